"""`tokenmill bench agreement`: teacher-forced top-1 agreement of an engine setting with references.

The text (real English prose and code: the topic pages of CPython's own reference documentation,
`pydoc_data.topics`, shipped with every Python) is tokenized and cut into chunks; each chunk runs
as one prefill through each engine's model (its real layers, quantization, dtype and attention),
and at every position the argmax of the next-token logits is compared. The engine under test is
the one the flags describe (`--quantization int8`, `--dtype bfloat16`, a GGUF file's own Q8_0 or Q4 blocks,
...); references are plain engines in the given dtypes (default fp32), every weight dequantized.
Agreement is the fraction of positions with the same top-1 token: near-ties flip under any
rounding, so even bf16 vs fp32 is below 100%.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.bench.arg_types import positive_int
from tokenmill.bench.engine_args import add_bench_engine_args, make_llm, resolve_bench_model
from tokenmill.bench.report import format_grid, print_report

if TYPE_CHECKING:  # (imported where used: the CLI registers this module's flags without loading torch)
    import torch

TEXT_SOURCE = "pydoc_data.topics (CPython reference documentation), topics in sorted order"


@dataclass
class Agreement:
    reference: str
    tokens: int
    top1_agreement: float


def reference_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def text_chunks(tokenizer: Any, num_tokens: int, chunk: int) -> list[list[int]]:
    """`num_tokens` tokens of the reference text, in chunks of `chunk` (each one prefill)."""
    ids: list[int] = []
    text = reference_text()
    for start in range(0, len(text), 20_000):  # tokenize only as much as needed
        ids.extend(tokenizer(text[start : start + 20_000], add_special_tokens=False)["input_ids"])
        if len(ids) >= num_tokens:
            break
    if len(ids) < num_tokens:
        raise ValueError(f"the reference text has only {len(ids)} tokens; asked for {num_tokens}")
    return [ids[i : min(i + chunk, num_tokens)] for i in range(0, num_tokens, chunk)]


def next_token_argmax(llm: Any, ids: list[int], step: int | None = None) -> torch.Tensor:
    """Top-1 next token at every position of `ids`: one prefill through the engine's model, or
    with `step`, passes of `step` positions after the first whose keys (their own included) are read
    back from the KV cache, as decoding reads them (what a narrower --kv-cache-dtype changes). Runs
    under `predictions`' inference mode."""
    import torch

    from tokenmill.models.layers.attention import AttentionMetadata, PrefillSegment

    engine = llm.engine
    n = len(ids)
    if n + engine.block_size > engine.kv_cache.layers[0][0].shape[0]:
        raise ValueError(f"a {n}-token chunk does not fit the KV cache: lower --chunk or raise --kv-cache-memory")
    # Slots after the allocator's zero block; the engine holds no requests, so nothing else lives there.
    slots = torch.arange(engine.block_size, engine.block_size + n, device=engine.device)
    tokens, positions = torch.tensor(ids, device=engine.device), torch.arange(n, device=engine.device)
    out = []
    for start in range(0, n, step or n):
        end = min(n, start + (step or n))
        if step is None:
            segment = PrefillSegment(0, n, None, None)
        else:  # keys 0..end-1 from the cache; query i (position start + i) sees keys <= start + i
            mask = positions[:end][None, :] <= positions[start:end][:, None]
            segment = PrefillSegment(0, end - start, slots[:end], mask)
        meta = AttentionMetadata(
            slot_mapping=slots[start:end],
            block_size=engine.block_size,
            prefills=[segment],
            num_prefill_tokens=end - start,
        )
        hidden = engine.model(tokens[start:end], positions[start:end], engine.kv_cache.layers, meta)
        out.append(engine.model.compute_logits(hidden).argmax(-1).cpu())
    return torch.cat(out)


def predictions(llm: Any, chunks: list[list[int]], step: int | None = None) -> torch.Tensor:
    import torch

    with torch.inference_mode():
        return torch.cat([next_token_argmax(llm, chunk, step) for chunk in chunks])


def measure(args: argparse.Namespace) -> tuple[str, list[Agreement]]:
    from tokenmill.models.model_loader.gguf import dequantized_model_dir

    model_dir = resolve_bench_model(args.model)
    llm = make_llm(args, model_dir)
    setting = (
        f"dtype {llm.engine.precision.describe()}, quantization {args.quantization or 'as the checkpoint'}, "
        f"KV cache {str(llm.engine.kv_dtype).removeprefix('torch.')}"
    )
    chunks = text_chunks(llm.tokenizer, args.tokens, args.chunk)
    tested = predictions(llm, chunks, args.step)
    llm.engine.close()
    del llm
    results = []
    reference_dir = dequantized_model_dir(model_dir)  # (a GGUF file's kept blocks dequantized too)
    for dtype in args.references:
        reference = make_llm(args, reference_dir, dtype=dtype, quantization=None, kv_cache_dtype="auto")
        expected = predictions(reference, chunks, args.step)
        reference.engine.close()
        results.append(Agreement(dtype, len(expected), float((tested == expected).float().mean())))
    return setting, results


def main(args: argparse.Namespace) -> int:
    setting, results = measure(args)
    rows = [
        ["reference", "tokens", "top-1 agreement"],
        *([r.reference, str(r.tokens), f"{100 * r.top1_agreement:.2f}%"] for r in results),
    ]
    title = f"Teacher-forced top-1 agreement of {setting} (text: {TEXT_SOURCE})"
    return print_report(
        args,
        format_grid(rows, title),
        {
            "setting": setting,
            "text": TEXT_SOURCE,
            "chunk": args.chunk,
            "step": args.step,
            "results": [asdict(r) for r in results],
        },
    )


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--references",
        nargs="+",
        default=["float32"],
        choices=["float32", "bfloat16", "float16"],
        help="dtypes of the unquantized reference engines (default: float32)",
    )
    parser.add_argument(
        "--tokens",
        type=positive_int,
        default=2048,
        metavar="N",
        help="teacher-forced positions compared (default: 2048)",
    )
    parser.add_argument(
        "--chunk",
        type=positive_int,
        default=256,
        metavar="N",
        help="tokens per prefill: each chunk is read from its own start (default: 256)",
    )
    parser.add_argument(
        "--step",
        type=positive_int,
        default=None,
        metavar="N",
        help="positions per forward pass, reading earlier keys back from the KV cache as decoding "
        "does (1 = every position; use it with --kv-cache-dtype; default: one prefill per chunk)",
    )
    add_bench_engine_args(parser)
