"""GGUF files as models: each file converted once into a cached Hugging Face directory.

A `.gguf` file (llama.cpp's format: weights, hyperparameters, tokenizer and chat template in one
file) is read with the `gguf` package and transformers' GGUF support, the way transformers loads
one: its config and tokenizer (chat template included) as `from_pretrained(..., gguf_file=...)`
builds them, its tensors under transformers' names, with transformers' own per-architecture fixes
(Llama's permuted q/k rows, Gemma's norm offsets). The result is written once under
`cache_root()/gguf/`, keyed by the file's path, size and modification time, so later starts load
a plain directory in seconds; a changed file gets a new copy (and the old one is removed).

What each tensor type becomes:
- F32, F16, BF16: the same values, in that dtype;
- the linear layers' Q8_0, Q4_0 and Q4_1 blocks: kept, unpacked (int8 or 4-bit values with their
  fp16 scales, and Q4_1's minimums), and run on tokenmill's int8 and 4-bit weight-only kernels with
  the file's own numbers, nothing quantized again (layers/quantization/gguf.py); a tied output
  matrix (the token embedding's blocks) becomes an lm_head of its own, so that the largest matrix
  a step reads runs on those kernels too;
- Q4_K, Q5_K, Q6_K (their sub-block scales are not fp16 values), and any quantized token embedding:
  dequantized (gguf's reference dequantization, fp32) and run in `--dtype`, one log line saying so.
Any other tensor type, and architectures tokenmill does not run from GGUF, are refused by name
before anything is converted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.errors import ModelLoadError
from tokenmill.paths import cache_root

if TYPE_CHECKING:  # (imported where used: resolving a model must not load torch before it has to)
    import numpy as np
    import torch

logger = logging.getLogger(__name__)

# general.architecture values served (transformers maps each to a family tokenmill runs natively;
# a Mistral file is a "llama" one that transformers tells apart by its name).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # (torch dtype names)
QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TYPES = (*FLOAT_TYPES, *QUANTIZED_TYPES)
BLOCK = 32  # weights per Q8_0 / Q4_0 / Q4_1 block
# Bytes before a block's values: its fp16 scale (and Q4_1's fp16 minimum).
_BLOCK_HEADER = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4}
METADATA_FILE = "tokenmill_gguf.json"  # what the copy was made from, and its tensor types
_DONE_MARKER = ".tokenmill-complete"
# Bump when the converted layout changes: copies made by an older layout are converted again.
_LAYOUT_VERSION = 2
_SHARD_BYTES = 2 << 30


def is_gguf_path(model: str | os.PathLike) -> bool:
    return str(model).lower().endswith(".gguf")


@dataclass(frozen=True)
class ConvertedGGUF:
    """What a converted directory's metadata says about the file it came from."""

    source: str
    tensor_types: dict[str, int]  # GGUF tensor type -> tensors of that type in the file
    kept: dict[str, int]  # GGUF type -> tensors of it the copy keeps in their blocks
    keep_quantized: bool  # made to keep blocks (False: every tensor dequantized)

    @property
    def dequantized(self) -> dict[str, int]:
        """Quantized GGUF type -> tensors of it the copy holds dequantized."""
        counts = {kind: n - self.kept.get(kind, 0) for kind, n in sorted(self.tensor_types.items())}
        return {kind: n for kind, n in counts.items() if kind not in FLOAT_TYPES and n > 0}

    @classmethod
    def read(cls, model_dir: Path) -> ConvertedGGUF | None:
        path = model_dir / METADATA_FILE
        if not path.exists():
            return None
        raw = json.loads(path.read_text())
        return cls(raw["source"], dict(raw["tensor_types"]), dict(raw["kept"]), bool(raw["keep_quantized"]))

    def write(self, model_dir: Path) -> None:
        metadata = {
            "source": self.source,
            "tensor_types": self.tensor_types,
            "kept": self.kept,
            "keep_quantized": self.keep_quantized,
        }
        (model_dir / METADATA_FILE).write_text(json.dumps(metadata, indent=1) + "\n")


def gguf_model_dir(path: str | os.PathLike, *, keep_quantized: bool = True, published_dtype: str | None = None) -> Path:
    """The converted copy of the GGUF file at `path`, converting it on first use. `keep_quantized`:
    the layers' Q8_0, Q4_0 and Q4_1 blocks kept as they are (False: every tensor dequantized);
    `published_dtype`: the dtype the model was published in, when the file does not say (recorded
    in config.json, where `--dtype auto` reads it)."""
    source = Path(path).expanduser().resolve()
    if not source.is_file():
        raise FileNotFoundError(f"GGUF file {path} not found")
    stat = source.stat()
    key = hashlib.sha256(
        f"{source}|{stat.st_size}|{stat.st_mtime_ns}|{keep_quantized}|{published_dtype}|{_LAYOUT_VERSION}".encode()
    ).hexdigest()[:16]
    target = cache_root() / "gguf" / f"{source.stem}-{key}"
    if (target / _DONE_MARKER).exists():
        return target
    _convert(source, target, keep_quantized=keep_quantized, published_dtype=published_dtype)
    _remove_stale_copies(source, keep_quantized, keep=target)
    return target


def dequantized_model_dir(model_dir: Path) -> Path:
    """The same model with every weight dequantized: for a GGUF file's copy that keeps quantized
    layers, its fully dequantized copy; any other directory as it is (the references of
    `tokenmill bench agreement`)."""
    converted = ConvertedGGUF.read(model_dir)
    if converted is None or not converted.kept:
        return model_dir
    return gguf_model_dir(converted.source, keep_quantized=False)


def read_architecture(reader: Any, path: Path) -> str:
    """The file's architecture, refused unless tokenmill runs it, and every tensor's type checked."""
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ModelLoadError(f"{path}: no general.architecture in the GGUF metadata")
    architecture = str(field.contents())
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {architecture!r} is not supported; tokenmill runs GGUF files of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (or pass a Hugging Face model directory or repo id)"
        )
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} is of GGUF type {kind}, which tokenmill does not read; "
                f"supported types: {', '.join(SUPPORTED_TYPES)}"
            )
    return architecture


def _convert(source: Path, target: Path, *, keep_quantized: bool, published_dtype: str | None) -> None:
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ModelLoadError(f"{source}: reading GGUF needs the gguf package: pip install 'tokenmill[gguf]'") from None
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    from tokenmill.models.layers.quantization.gguf import KEPT_TYPES, QUANT_METHOD

    try:
        reader = GGUFReader(source)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"{source}: not a readable GGUF file ({exc})") from None
    architecture = read_architecture(reader, source)
    logger.info("converting %s to a cached Hugging Face directory at %s (once)", source, target)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        # (the config as AutoConfig.from_pretrained(..., gguf_file=...) builds it, from one parse of the file)
        raw_config = load_gguf_checkpoint(str(source), return_tensors=False)["config"]
        config = AutoConfig.for_model(**raw_config)
        processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=raw_config)
        with torch.device("meta"):
            hf_model = AutoModelForCausalLM.from_config(config)
        names = get_gguf_hf_weights_map(hf_model, processor)
        config.architectures = [type(hf_model).__name__]
        modules = {id(module): name for name, module in hf_model.named_modules()}
        linear = {name for name, module in hf_model.named_modules() if isinstance(module, torch.nn.Linear)}
        embedding = modules[id(hf_model.get_input_embeddings())] + ".weight"
        # A head tied to the embedding (no output matrix in the file) gets the embedding's blocks.
        tied_head = None
        if config.tie_word_embeddings and not any(t.name == "output.weight" for t in reader.tensors):
            tied_head = modules[id(hf_model.get_output_embeddings())]
        kept_types = KEPT_TYPES if keep_quantized else ()
        layers: dict[str, str] = {}  # kept layers: {checkpoint module: GGUF type}
        kept: Counter[str] = Counter()  # tensors kept, by GGUF type
        unmapped: list[str] = []
        writer = _ShardWriter(tmp)
        progress = tqdm(reader.tensors, desc=f"Converting {source.name} (first use only)", unit=" tensors")
        for tensor in progress:
            kind = tensor.tensor_type.name
            processed = processor.process(dequantize_tensor(tensor), tensor.name)
            name = names.get(processed.name) if processed.name is not None else None
            if name is None:
                unmapped.append(tensor.name)
                continue
            module = name.removesuffix(".weight")
            blocks = _kept_blocks(tensor, processor, processed.weights) if kind in kept_types else None
            if blocks is not None and module in linear:
                writer.add_blocks(module, blocks)
                layers[module] = kind
                kept[kind] += 1
            else:
                writer.add(name, _float_tensor(processed.weights, kind))
            if blocks is not None and name == embedding and tied_head is not None:
                writer.add_blocks(tied_head, blocks)
                layers[tied_head] = kind
        writer.close()
        if unmapped:  # (as transformers does: derived tables such as Llama 3's rope_freqs)
            logger.warning("%s: tensors without a place in the model, not used: %s", source.name, ", ".join(unmapped))
        tensor_types = dict(Counter(t.tensor_type.name for t in reader.tensors))
        summary = ConvertedGGUF(str(source), tensor_types, dict(kept), keep_quantized)
        config.dtype = published_dtype or _published_dtype(reader)
        if layers:
            config.quantization_config = {"quant_method": QUANT_METHOD, "source": source.name, "layers": layers}
            if tied_head in layers:
                config.tie_word_embeddings = False  # (the head holds its blocks, the embedding its values)
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name).save_pretrained(tmp)
        summary.write(tmp)
        (tmp / _DONE_MARKER).write_text("ok\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():  # a concurrent conversion won; keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(target)


def _published_dtype(reader: Any) -> str | None:
    """The dtype of a file whose matrices are all in one float type (else None: quantized)."""
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2}
    if len(kinds) == 1 and next(iter(kinds)) in FLOAT_TYPES:
        return FLOAT_TYPES[next(iter(kinds))]
    return None


def _kept_blocks(tensor: Any, processor: Any, expected: np.ndarray) -> dict[str, np.ndarray] | None:
    """A Q8_0 / Q4_0 / Q4_1 tensor's blocks unpacked (`gguf_blocks`) under transformers' fixes, or
    None where those fixes do not keep the blocks whole (they move whole rows: Llama's q/k
    permutation): the blocks must give the dequantized tensor's values exactly."""
    import numpy as np

    parts = {part: processor.process(values, tensor.name).weights for part, values in gguf_blocks(tensor).items()}
    if not np.array_equal(blocks_dequantized(parts), expected):
        return None
    return {part: np.ascontiguousarray(values) for part, values in parts.items()}


def _float_tensor(values: np.ndarray, kind: str) -> torch.Tensor:
    """A dequantized tensor for the copy: a float type's values in its dtype, others fp32."""
    import numpy as np
    import torch

    tensor = torch.from_numpy(np.array(values, dtype=np.float32))  # (a copy: the file is memory-mapped)
    dtype = getattr(torch, FLOAT_TYPES[kind]) if kind in FLOAT_TYPES else None
    if dtype is not None and torch.equal(tensor.to(dtype).float(), tensor):
        tensor = tensor.to(dtype)  # (a processed value F16/BF16 cannot hold stays fp32)
    return tensor


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """A GGUF tensor's values as fp32 [rows, columns] (gguf's reference dequantization, which
    transformers loads GGUF files with)."""
    import numpy as np
    from gguf import dequantize

    return dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)


def gguf_blocks(tensor: Any) -> dict[str, np.ndarray]:
    """A Q8_0, Q4_0 or Q4_1 tensor's blocks as stored, unpacked: `qweight` [rows, columns] (Q8_0's
    int8 values; the 4-bit types' values 0-15 as uint8), `scales` [rows, columns / 32] fp16, and
    Q4_1's minimums `offsets` likewise (see layers/quantization/gguf.py for what they compute)."""
    import numpy as np

    kind = tensor.tensor_type.name
    header = _BLOCK_HEADER[kind]
    rows = tensor.data.shape[0]
    blocks = np.ascontiguousarray(tensor.data).reshape(rows, -1, header + (BLOCK if kind == "Q8_0" else BLOCK // 2))
    parts: dict[str, np.ndarray] = {"scales": blocks[..., :2].copy().view(np.float16).reshape(rows, -1)}
    if kind == "Q8_0":
        parts["qweight"] = blocks[..., header:].copy().view(np.int8).reshape(rows, -1)
        return parts
    packed = blocks[..., header:]  # (byte j: value j in its low nibble, value j + 16 in its high one)
    parts["qweight"] = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    if kind == "Q4_1":
        parts["offsets"] = blocks[..., 2:4].copy().view(np.float16).reshape(rows, -1)
    return parts


def blocks_dequantized(parts: dict[str, np.ndarray]) -> np.ndarray:
    """The fp32 weights unpacked blocks encode, computed as llama.cpp's (and gguf's) dequantization."""
    import numpy as np

    def per_weight(values: np.ndarray) -> np.ndarray:
        return np.repeat(values.astype(np.float32), BLOCK, axis=-1)

    q, scales = parts["qweight"], per_weight(parts["scales"])
    if q.dtype == np.int8:  # Q8_0
        return q.astype(np.float32) * scales
    if "offsets" not in parts:  # Q4_0
        return (q.astype(np.float32) - 8) * scales
    return q.astype(np.float32) * scales + per_weight(parts["offsets"])


class _ShardWriter:
    """model.safetensors, or shards of up to _SHARD_BYTES with their index: written as they fill,
    so a converted model never sits in memory whole."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []  # the tensor names of each shard written

    def add_blocks(self, module: str, blocks: dict[str, np.ndarray]) -> None:
        import torch

        for part, values in blocks.items():
            self.add(f"{module}.{part}", torch.from_numpy(values))

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > _SHARD_BYTES:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file  # (imports torch)

        index = len(self.shards) + 1
        save_file(self.pending, self.directory / f"shard-{index}.safetensors", metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        self._flush()
        if len(self.shards) == 1:
            (self.directory / "shard-1.safetensors").rename(self.directory / "model.safetensors")
            return
        total = len(self.shards)
        weight_map: dict[str, str] = {}
        for index, names in enumerate(self.shards, start=1):
            final = f"model-{index:05d}-of-{total:05d}.safetensors"
            (self.directory / f"shard-{index}.safetensors").rename(self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        index_file = {"metadata": {}, "weight_map": weight_map}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=1) + "\n")


def _remove_stale_copies(source: Path, keep_quantized: bool, keep: Path) -> None:
    """Copies made the same way from an earlier version of the same file (another size or time)."""
    for metadata in (cache_root() / "gguf").glob(f"*/{METADATA_FILE}"):
        copy = metadata.parent
        if copy == keep:
            continue
        try:
            made = ConvertedGGUF.read(copy)
        except (OSError, ValueError, KeyError):
            continue
        if made is not None and made.source == str(source) and made.keep_quantized == keep_quantized:
            logger.info("removing %s, converted from an earlier version of %s", copy, source)
            shutil.rmtree(copy, ignore_errors=True)
