"""Engine subcommands: `tokenmill generate` and `tokenmill make-tiny-model`.

The engine (torch, transformers) is imported when a command runs, not when the parser is built,
so `tokenmill --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.models.model_loader.hub import TINY_ARCHITECTURES, make_tiny_model


def register(subparsers: argparse._SubParsersAction) -> None:
    gen = subparsers.add_parser(
        "generate",
        help="generate text for one prompt (offline, no server)",
        description="Generate text for a prompt with the engine, in this process.",
    )
    gen.add_argument(
        "--prompt", required=True, action="append", help="prompt text (repeat for several prompts, batched together)"
    )
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template as a user message"
    )
    gen.add_argument("--max-tokens", type=int, default=64, help="most new tokens per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens (-1 = off)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request seed for reproducible sampling")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument(
        "--json",
        action="store_true",
        help="print a JSON object per prompt (text, token_ids, finish_reason, prompt_token_ids) instead of plain text",
    )
    EngineConfig.add_cli_args(gen)
    gen.set_defaults(func=_generate)

    tiny = subparsers.add_parser(
        "make-tiny-model",
        help="write a small deterministic random-init model for tests",
        description="Write a deterministic random-init model in standard Hugging Face format "
        "(SmolLM2 tokenizer): a Llama (~28M params) or a mixture-of-experts model "
        "of the same width and active size.",
    )
    tiny.add_argument("dir", help="output directory")
    tiny.add_argument("--seed", type=int, default=0, help="weight init seed")
    tiny.add_argument(
        "--tokenizer",
        metavar="DIR",
        default=None,
        help="directory with the tokenizer files to use (default: the bundled SmolLM2's)",
    )
    tiny.add_argument(
        "--architecture",
        choices=TINY_ARCHITECTURES,
        default="llama",
        help="model_type to build; the MoE ones have 8 experts, top-2 (default: llama)",
    )
    tiny.set_defaults(func=_make_tiny)


def _generate(args: argparse.Namespace) -> int:
    from tokenmill.engine.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        stop=args.stop,
    )
    config = EngineConfig.from_cli_args(args)
    llm = LLM(**vars(config))
    prompts: list[str] | list[list[int]] = args.prompt
    if args.chat:  # the same chat rendering as the server's (token ids: no second BOS)
        prompts = [llm.engine.input_processor.render_chat([{"role": "user", "content": p}]) for p in prompts]
    for out in llm.generate(prompts, params):
        choice = out.outputs[0]
        if args.json:
            print(
                json.dumps(
                    {
                        "text": choice.text,
                        "token_ids": choice.token_ids,
                        "finish_reason": choice.finish_reason,
                        "prompt_token_ids": out.prompt_token_ids,
                    }
                )
            )
        else:
            print(choice.text)
    sys.stdout.flush()
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    print(make_tiny_model(args.dir, seed=args.seed, tokenizer_dir=args.tokenizer, architecture=args.architecture))
    return 0
