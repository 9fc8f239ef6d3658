"""tokenmill on the workload (tokenmill's own interpreter)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import Timer, load_workload, parser, write_result


def weight_format(llm, weights: str) -> str | None:
    """The weight format the engine's model really holds: int8's groups, or a GGUF file's layers by
    the linear method each runs on (None: every layer in the compute precision)."""
    from tokenmill.models.layers.linear import linear_layers
    from tokenmill.models.layers.quantization.int8 import GROUP_SIZE

    methods = sorted({layer.quant_method.name for _, layer in linear_layers(llm.engine.model)})
    if weights == "gguf":
        return "GGUF as is: " + ", ".join(methods)
    return f"int8, groups of {GROUP_SIZE}" if "int8" in methods else None


def main() -> None:
    args = parser("tokenmill").parse_args()
    import torch

    from tokenmill import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    workload = load_workload(args.workload)
    kv_cache_dtype = "int8" if args.kv_cache == "int8" else "auto"  # auto: the compute dtype
    llm = LLM(
        args.model,
        progress=False,
        dtype={"bf16": "bfloat16", "fp32": "float32"}[args.precision],
        kv_cache_dtype=kv_cache_dtype,
        quantization="int8" if args.weights == "int8" else None,
    )
    prompts = [r["prompt_token_ids"] for r in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=r["output_len"], ignore_eos=True) for r in workload]
    # Warm-up on prompts that are not the measured ones (reversed): the prefix cache would answer
    # those, and the peers run without one.
    llm.generate([p[::-1] for p in prompts[:2]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    with Timer() as t:
        outputs = llm.generate(prompts, params)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    write_result(
        args.out,
        "tokenmill",
        args.precision,
        tokens,
        t.seconds,
        sum(r["output_len"] for r in workload),
        kv_cache=str(llm.engine.kv_cache.data.dtype).removeprefix("torch."),
        weights=weight_format(llm, args.weights),
        cached_prompt_tokens=sum(o.num_cached_tokens for o in outputs),
    )  # (0: no prompt seen before)


if __name__ == "__main__":
    main()
