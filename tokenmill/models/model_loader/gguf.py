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
- Q8_0 (blocks of 32 int8 values with one fp16 scale): the int8 values and fp16 scales as they are
  (`<name>.weight` int8, `<name>.weight_scale` fp16), run on tokenmill's int8 weight-only kernels,
  which take groups of 32 with fp16 scales: the file's own numbers, nothing quantized again;
- Q4_0, Q4_1, Q4_K, Q5_K, Q6_K: dequantized (gguf's reference dequantization, fp32) and run in
  `--dtype` (`dequantize_tensor` is where a 4-bit kernel path would take them instead).
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
INT8_TYPES = ("Q8_0",)
DEQUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TYPES = (*FLOAT_TYPES, *INT8_TYPES, *DEQUANTIZED_TYPES)
Q8_0_BLOCK = 32  # values per Q8_0 block (one fp16 scale, then 32 int8 values)
SCALE_SUFFIX = "_scale"  # `<name>.weight_scale`: the fp16 scales of an int8 `<name>.weight`
# config.json's quantization_config of a copy with int8 weights (read by the loader).
INT8_QUANT_METHOD = "tokenmill_int8"
METADATA_FILE = "tokenmill_gguf.json"  # what the copy was made from, and its tensor types
_DONE_MARKER = ".tokenmill-complete"
# Bump when the converted layout changes: copies made by an older layout are converted again.
_LAYOUT_VERSION = 1
_SHARD_BYTES = 2 << 30


def is_gguf_path(model: str | os.PathLike) -> bool:
    return str(model).lower().endswith(".gguf")


@dataclass(frozen=True)
class ConvertedGGUF:
    """What a converted directory's metadata says about the file it came from."""

    source: str
    tensor_types: dict[str, int]  # GGUF tensor type -> tensors of that type
    q8_0_as_int8: bool

    @property
    def dequantized_types(self) -> list[str]:
        """The quantized types whose tensors the copy holds dequantized."""
        int8 = INT8_TYPES if self.q8_0_as_int8 else ()
        return sorted(t for t in self.tensor_types if t not in FLOAT_TYPES and t not in int8)

    @classmethod
    def read(cls, model_dir: Path) -> ConvertedGGUF | None:
        path = model_dir / METADATA_FILE
        if not path.exists():
            return None
        raw = json.loads(path.read_text())
        return cls(raw["source"], dict(raw["tensor_types"]), bool(raw["q8_0_as_int8"]))

    def write(self, model_dir: Path) -> None:
        metadata = {"source": self.source, "tensor_types": self.tensor_types, "q8_0_as_int8": self.q8_0_as_int8}
        (model_dir / METADATA_FILE).write_text(json.dumps(metadata, indent=1) + "\n")


def gguf_model_dir(path: str | os.PathLike, *, q8_0_as_int8: bool = True, published_dtype: str | None = None) -> Path:
    """The converted copy of the GGUF file at `path`, converting it on first use. `q8_0_as_int8`:
    Q8_0 tensors kept as int8 with their scales (False: dequantized like the 4-bit types);
    `published_dtype`: the dtype the model was published in, when the file does not say (recorded
    in config.json, where `--dtype auto` reads it)."""
    source = Path(path).expanduser().resolve()
    if not source.is_file():
        raise FileNotFoundError(f"GGUF file {path} not found")
    stat = source.stat()
    key = hashlib.sha256(
        f"{source}|{stat.st_size}|{stat.st_mtime_ns}|{q8_0_as_int8}|{published_dtype}|{_LAYOUT_VERSION}".encode()
    ).hexdigest()[:16]
    target = cache_root() / "gguf" / f"{source.stem}-{key}"
    if (target / _DONE_MARKER).exists():
        return target
    _convert(source, target, q8_0_as_int8=q8_0_as_int8, published_dtype=published_dtype)
    _remove_stale_copies(source, q8_0_as_int8, keep=target)
    return target


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


def _convert(source: Path, target: Path, *, q8_0_as_int8: bool, published_dtype: str | None) -> None:
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
        summary = ConvertedGGUF(str(source), dict(Counter(t.tensor_type.name for t in reader.tensors)), q8_0_as_int8)
        int8_types = INT8_TYPES if q8_0_as_int8 else ()
        unmapped: list[str] = []
        writer = _ShardWriter(tmp)
        progress = tqdm(reader.tensors, desc=f"Converting {source.name} (first use only)", unit=" tensors")
        for tensor in progress:
            converted = _convert_tensor(tensor, names, processor, int8_types)
            if converted is None:
                unmapped.append(tensor.name)
                continue
            for name, value in converted:
                writer.add(name, value)
        writer.close()
        if unmapped:  # (as transformers does: derived tables such as Llama 3's rope_freqs)
            logger.warning("%s: tensors without a place in the model, not used: %s", source.name, ", ".join(unmapped))
        if summary.dequantized_types:
            logger.info(
                "%s: %s tensors dequantized (fp32 in the copy)", source.name, ", ".join(summary.dequantized_types)
            )
        config.dtype = published_dtype or _published_dtype(reader)
        if any(t in int8_types for t in summary.tensor_types):
            config.quantization_config = {
                "quant_method": INT8_QUANT_METHOD,
                "group_size": Q8_0_BLOCK,
                "scale_dtype": "float16",
                "source": "GGUF Q8_0",
            }
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


def _convert_tensor(
    tensor: Any, names: dict[str, str], processor: Any, int8_types: tuple[str, ...]
) -> list[tuple[str, torch.Tensor]] | None:
    """The checkpoint tensors one GGUF tensor becomes (None: transformers gives it no place)."""
    import numpy as np
    import torch

    kind = tensor.tensor_type.name
    if kind in int8_types:
        values, scales = q8_0_values(tensor)
        processed = processor.process(values, tensor.name)
        name = _hf_name(processed, names)
        if name is None:
            return None
        q, scales = processed.weights, processor.process(scales, tensor.name).weights
        # transformers' fixes move whole rows (Llama's q/k permutation): the blocks must come out as
        # the dequantized tensor does, or they are not this layout's any more.
        expected = processor.process(dequantize_tensor(tensor), tensor.name).weights
        dequantized = q.astype(np.float32) * np.repeat(scales.astype(np.float32), Q8_0_BLOCK, axis=-1)
        if not np.array_equal(dequantized, expected):
            raise ModelLoadError(f"{tensor.name}: transformers' processing of it does not keep its Q8_0 blocks whole")
        return [(name, torch.from_numpy(np.array(q))), (name + SCALE_SUFFIX, torch.from_numpy(np.array(scales)))]
    result = processor.process(dequantize_tensor(tensor), tensor.name)
    name = _hf_name(result, names)
    if name is None:
        return None
    values = torch.from_numpy(np.array(result.weights, dtype=np.float32))  # (a copy: the file is memory-mapped)
    dtype = getattr(torch, FLOAT_TYPES[kind]) if kind in FLOAT_TYPES else None
    if dtype is not None and torch.equal(values.to(dtype).float(), values):
        values = values.to(dtype)  # (a processed value F16/BF16 cannot hold stays fp32)
    return [(name, values)]


def _hf_name(result: Any, names: dict[str, str]) -> str | None:
    return names.get(result.name) if result.name is not None else None


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """A GGUF tensor's values as fp32 [rows, columns] (gguf's reference dequantization, which
    transformers loads GGUF files with). The 4/5/6-bit types come here."""
    import numpy as np
    from gguf import dequantize

    return dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)


def q8_0_values(tensor: Any) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor's int8 values [rows, columns] and fp16 scales [rows, columns / 32], as stored."""
    import numpy as np

    rows = tensor.data.shape[0]
    blocks = np.ascontiguousarray(tensor.data).reshape(rows, -1, 2 + Q8_0_BLOCK)
    scales = blocks[..., :2].copy().view(np.float16).reshape(rows, -1)
    values = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
    return values, scales


class _ShardWriter:
    """model.safetensors, or shards of up to _SHARD_BYTES with their index: written as they fill,
    so a converted model never sits in memory whole."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []  # the tensor names of each shard written

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


def _remove_stale_copies(source: Path, q8_0_as_int8: bool, keep: Path) -> None:
    """Copies made the same way from an earlier version of the same file (another size or time)."""
    for metadata in (cache_root() / "gguf").glob(f"*/{METADATA_FILE}"):
        copy = metadata.parent
        if copy == keep:
            continue
        try:
            made = ConvertedGGUF.read(copy)
        except (OSError, ValueError, KeyError):
            continue
        if made is not None and made.source == str(source) and made.q8_0_as_int8 == q8_0_as_int8:
            logger.info("removing %s, converted from an earlier version of %s", copy, source)
            shutil.rmtree(copy, ignore_errors=True)
