"""Greedy tokens of tokenmill against Hugging Face `generate` at one dtype, on the default model.

    python bench/hf_greedy_agreement.py --dtype bfloat16 [--prompts 32] [--tokens 32]

Prompts are stretches (16-200 tokens) of the agreement text (`tokenmill bench agreement`'s CPython
documentation); every request runs greedy for --tokens tokens (ignore_eos) on tokenmill (`LLM`) and
on transformers (`generate`, one prompt at a time, no padding). Prints how many sequences are
identical and the share of tokens before each sequence's first difference; with --control, the
same for HF at --dtype against HF in fp32 (how far that dtype alone moves greedy tokens) and for
tokenmill at --dtype against HF in fp32.
"""

from __future__ import annotations

import argparse
import random

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenmill import LLM, SamplingParams
from tokenmill.bench.agreement import reference_text
from tokenmill.models.model_loader.hub import default_model_dir


def agreement(a: list[list[int]], b: list[list[int]], tokens: int) -> str:
    firsts = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), tokens) for s, t in zip(a, b)]
    same = sum(f == tokens for f in firsts)
    return (
        f"identical sequences {same}/{len(a)}; tokens before the first difference {sum(firsts)}/"
        f"{tokens * len(a)} ({sum(firsts) / (tokens * len(a)):.1%})"
    )


def hf_greedy(model, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    return [
        model.generate(torch.tensor([p]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)[
            0, len(p) :
        ].tolist()
        for p in prompts
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--control", action="store_true", help="also HF at --dtype, and tokenmill at --dtype, against HF in fp32"
    )
    args = parser.parse_args()
    model_dir = str(default_model_dir())
    ids = AutoTokenizer.from_pretrained(model_dir)(reference_text())["input_ids"]
    rng = random.Random(args.seed)
    prompts = []
    for _ in range(args.prompts):
        start = rng.randrange(0, len(ids) - 300)
        prompts.append(ids[start : start + rng.randint(16, 200)])
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in LLM(model_dir, progress=False, dtype=args.dtype).generate(prompts, params)]
    dtype = getattr(torch, args.dtype)
    hf = hf_greedy(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype), prompts, args.tokens)
    print(f"tokenmill {args.dtype} vs HF {args.dtype}: {agreement(ours, hf, args.tokens)}")
    if args.control:
        fp32 = hf_greedy(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), prompts, args.tokens)
        print(f"HF {args.dtype} vs HF float32: {agreement(hf, fp32, args.tokens)}")
        print(f"tokenmill {args.dtype} vs HF float32: {agreement(ours, fp32, args.tokens)}")


if __name__ == "__main__":
    main()
