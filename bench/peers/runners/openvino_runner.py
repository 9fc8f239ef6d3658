"""OpenVINO GenAI's ContinuousBatchingPipeline on the workload (inside its own virtualenv).

The HF model is exported once with optimum-intel (`optimum-cli export openvino`, fp16 weights for
bf16 compute, fp32 for fp32; --weights int8: NNCF's int8 weight compression, optimum's
`--weight-format int8`, per output channel) into --export-dir; compute precision is the CPU plugin's
INFERENCE_PRECISION_HINT. The KV cache precision is set explicitly (KV_CACHE_PRECISION): the compute
precision, or u8 (the plugin's own default on recent releases) for --kv-cache int8. On a CPU
without native bf16 (no BF16 in the plugin's OPTIMIZATION_CAPABILITIES: AVX2-only CPUs) the plugin
computes in f32 whatever the hint, and its paged attention takes only an f32 cache ("expect kvcache
type f32"), so bf16 runs there keep fp16 weights with an f32 cache.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import Timer, load_workload, parser, write_result


def export(model: str, target: Path, precision: str, weights: str) -> None:
    if (target / "openvino_model.xml").exists():
        return
    cli = Path(sys.executable).parent / "optimum-cli"
    weight_format = "int8" if weights == "int8" else "fp16" if precision == "bf16" else "fp32"
    subprocess.run(
        [
            str(cli),
            "export",
            "openvino",
            "--model",
            model,
            "--task",
            "text-generation-with-past",
            "--weight-format",
            weight_format,
            str(target),
        ],
        check=True,
    )


def main() -> None:
    p = parser("OpenVINO GenAI")
    p.add_argument("--export-dir", required=True)
    p.add_argument("--kv-cache-gib", type=int, default=4)
    args = p.parse_args()
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    export(args.model, Path(args.export_dir), args.precision, args.weights)
    workload = load_workload(args.workload)
    scheduler = ov_genai.SchedulerConfig()
    scheduler.cache_size = args.kv_cache_gib
    scheduler.max_num_seqs = len(workload)
    scheduler.enable_prefix_caching = False
    compute = "bf16" if args.precision == "bf16" else "f32"
    native_bf16 = "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    kv_cache = "u8" if args.kv_cache == "int8" else compute if native_bf16 else "f32"
    properties = {
        "INFERENCE_PRECISION_HINT": compute,
        "KV_CACHE_PRECISION": kv_cache,
        "INFERENCE_NUM_THREADS": args.threads,
    }
    pipe = ov_genai.ContinuousBatchingPipeline(args.export_dir, scheduler, "CPU", properties)

    def config(max_new_tokens: int):
        c = ov_genai.GenerationConfig()
        c.max_new_tokens = max_new_tokens
        c.ignore_eos = True  # greedy is the default decoding
        return c

    inputs = [ov.Tensor(np.array([r["prompt_token_ids"]], dtype=np.int64)) for r in workload]
    pipe.generate(inputs[:2], [config(8)] * len(inputs[:2]))  # warmup
    with Timer() as t:
        results = pipe.generate(inputs, [config(r["output_len"]) for r in workload])
    tokens = sum(len(r.m_generation_ids[0]) for r in results)
    write_result(
        args.out,
        "openvino-genai",
        args.precision,
        tokens,
        t.seconds,
        sum(r["output_len"] for r in workload),
        kv_cache=kv_cache,
        weights="int8, per channel (NNCF)" if args.weights == "int8" else None,
    )


if __name__ == "__main__":
    main()
