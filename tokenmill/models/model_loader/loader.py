"""Load a local Hugging Face model directory into tokenmill's own model code.

Strict by design: a model tokenmill cannot run exactly fails with one line naming the file and
the problem (`ModelLoadError`), never with silently wrong tokens. A config key the architecture
needs must be present (transformers would default it), every checkpoint tensor must be consumed
(except the derived buffers a model class lists in `ignored_checkpoint_tensors`), every weight
must be found, and shapes (and the dtypes of integer tensors) must agree with the config.

Each linear layer's method (linear.py) is chosen before the checkpoint is read, from its
quantization (quantization/) and the engine's backend: the method declares the tensors the layer
loads (a float weight, or a format's packed integers and scales).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.kernels.ops import cpu_kernels_available
from tokenmill.models.layers.linear import PartNames
from tokenmill.models.layers.parallel import NO_TP, TPInfo, check_shardable, local_spec, shard_state
from tokenmill.models.layers.quantization import QuantizationConfig, quantization_config
from tokenmill.models.model_loader.gguf import ConvertedGGUF
from tokenmill.models.model_loader.linear_setup import assign_linear_methods, linear_backend
from tokenmill.models.model_loader.registry import GENERIC, NATIVE, Architecture, HfToLocal, lookup
from tokenmill.models.spec import ModelSpec, as_list

logger = logging.getLogger(__name__)

# Fused group -> number of checkpoint tensors concatenated (dim 0) into one weight. A model adds its
# own groups in a `fused_parts` attribute (MoE: one part per expert, stacked into [E, ...]).
FUSED_PARTS = {"qkv": 3, "gate_up": 2}


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: invalid JSON ({_one_line(exc)})") from None


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


MODEL_IMPLS = ("auto", "native", "transformers")


def resolve_architecture(model_dir: Path, model_impl: str = "auto") -> tuple[Architecture, dict[str, Any]]:
    """The architecture serving the directory's config.json, checked for the keys it requires.
    `model_impl`: auto = the native path when the model type has one, else the generic
    (transformers) path; native or transformers force one path."""
    path = model_dir / "config.json"
    raw = read_config(model_dir)
    model_type = raw.get("model_type")
    if not model_type:
        raise ModelLoadError(f"{path}: missing required key 'model_type'")
    arch = _select(path, model_type, model_impl)
    missing = [key for key in arch.required_keys if raw.get(key) is None]
    if missing:
        keys = ", ".join(repr(k) for k in missing)
        raise ModelLoadError(
            f"{path}: missing required key{'s' if len(missing) > 1 else ''} {keys} for model_type {model_type!r}"
        )
    return arch, raw


def _select(path: Path, model_type: str, model_impl: str) -> Architecture:
    if model_impl not in MODEL_IMPLS:
        raise ModelLoadError(f"unknown model implementation {model_impl!r}; choose one of {', '.join(MODEL_IMPLS)}")
    if model_impl == "transformers":
        from tokenmill.models.model_loader.transformers_backend import generic_architecture

        arch = generic_architecture(model_type)
        if arch is None:
            raise ModelLoadError(f"{path}: transformers does not know model_type {model_type!r}")
        return arch
    try:
        arch = lookup(model_type)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    if model_impl == "native" and arch.path != NATIVE:
        raise ModelLoadError(
            f"{path}: model_type {model_type!r} has no native path (`tokenmill models`); "
            "use --model-impl auto or transformers"
        )
    return arch


def load_spec(model_dir: Path, model_impl: str = "auto") -> ModelSpec:
    return _architecture_and_spec(model_dir, model_impl)[1]


def _architecture_and_spec(model_dir: Path, model_impl: str = "auto") -> tuple[Architecture, ModelSpec]:
    from transformers import AutoConfig

    arch, _ = resolve_architecture(model_dir, model_impl)
    path = model_dir / "config.json"
    try:
        spec = arch.build_spec(AutoConfig.from_pretrained(model_dir))
    except (ValueError, TypeError, KeyError, AttributeError, OSError) as exc:
        raise ModelLoadError(f"{path}: {_one_line(exc)}") from None
    spec.eos_token_ids = [
        int(e) for e in (generation_eos(model_dir) or as_list(getattr(spec.hf_config, "eos_token_id", None)))
    ]
    return arch, spec


def generation_eos(model_dir: Path) -> list[int] | None:
    """eos ids of generation_config.json (they take precedence over config.json's), if any."""
    gen_path = model_dir / "generation_config.json"
    if not gen_path.exists():
        return None
    gen = read_json(gen_path)
    return as_list(gen.get("eos_token_id")) if isinstance(gen, dict) else None


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        content = read_json(index)
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: no 'weight_map' object")
        files = [model_dir / s for s in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise ModelLoadError(f"{f}: shard listed in {index.name} is missing")
        return files
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    bins = sorted(model_dir.glob("pytorch_model*.bin"))
    if bins:
        return bins
    raise ModelLoadError(f"{model_dir}: no weights (expected model.safetensors, a sharded index or pytorch_model.bin)")


def _unreadable(path: Path, exc: BaseException) -> ModelLoadError:
    return ModelLoadError(f"{path}: unreadable weights file ({_one_line(exc)})")


def _count_tensors(files: list[Path]) -> int | None:
    """Open every safetensors header up front, so that a truncated or corrupt file fails before any
    work (and before the progress bar); the tensor count, when no .bin file hides its own."""
    from safetensors import SafetensorError, safe_open

    total = 0
    for path in files:
        if path.suffix != ".safetensors":
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                total += len(f.keys())
        except (SafetensorError, OSError) as exc:
            raise _unreadable(path, exc) from None
    return total


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    import pickle

    from safetensors import SafetensorError, safe_open

    for path in files:
        try:
            if path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open has keys(), no __iter__
                        yield name, f.get_tensor(name)
            else:
                for name, tensor in torch.load(path, map_location="cpu", weights_only=True).items():
                    yield name, tensor
        except (SafetensorError, OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
            raise _unreadable(path, exc) from None


def _is_ignored(name: str, cls: type) -> bool:
    return name.endswith(tuple(getattr(cls, "ignored_checkpoint_tensors", ())))


def _join_parts(name: str, parts: list[torch.Tensor], expected: torch.Tensor) -> torch.Tensor:
    """A fused group's parts concatenated along the tensor's output dim (0 for a float weight; a
    quantized layer's tensors say theirs); per-expert parts [E * rows, cols] viewed as [E, rows, cols].
    A tensor without an output dim (GPTQ's g_idx) is one for every part: they must agree."""
    dim = getattr(expected, "output_dim", 0)
    if dim is None:
        if any(not torch.equal(part, parts[0]) for part in parts[1:]):
            raise ModelLoadError(f"{name}: the fused parts' tensors differ (they must be one for the whole layer)")
        return parts[0]
    shapes = [tuple(part.shape) for part in parts]
    if any(
        len(shape) != len(shapes[0]) or shape[:dim] + shape[dim + 1 :] != shapes[0][:dim] + shapes[0][dim + 1 :]
        for shape in shapes
    ):
        raise ModelLoadError(f"{name}: the checkpoint's parts have shapes {shapes}, which do not join into one tensor")
    joined = torch.cat(parts, dim=dim)
    if joined.dim() != expected.dim() and joined.numel() == expected.numel():
        return joined.view(expected.shape)
    return joined  # (a wrong size is reported by the shape check)


def _load_dtype(name: str, tensor: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype a checkpoint tensor is loaded in: the model's for float weights, the one a quantized
    layer declared for its float tensors (scales), and exactly the declared one for integer tensors."""
    declared = getattr(expected, "load_dtype", None)
    if declared is None:
        return dtype
    if tensor.is_floating_point() and declared.is_floating_point and declared.itemsize > 1:
        return declared
    if tensor.dtype != declared:
        raise ModelLoadError(f"tensor {name} has dtype {tensor.dtype}, the quantization implies {declared}")
    return declared


def _read_state(
    model_dir: Path,
    model: nn.Module,
    expected: dict[str, torch.Tensor],
    dtype: torch.dtype,
    progress: bool,
    fused_parts: dict[str, int],
    ignored: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor renamed (and fused) into the model's names; unknown tensors are an error."""
    from tqdm.auto import tqdm

    cls: type[Any] = type(model)
    hf_to_local: HfToLocal = cls.hf_to_local
    transposed = getattr(cls, "transposed_weights", ())
    # (not state_dict(): the parameters themselves, which carry the layout a quantized layer declared)
    tensors = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    state: dict[str, torch.Tensor] = {}
    fused: dict[str, list[torch.Tensor | None]] = {}
    unexpected: list[str] = []
    files = _weight_files(model_dir)
    total = _count_tensors(files)
    for hf_name, tensor in tqdm(
        _iter_tensors(files), desc=f"Loading {model_dir.name}", total=total, unit=" tensors", disable=not progress
    ):
        name, part, group = hf_to_local(hf_name)
        if name not in expected:
            if not _is_ignored(hf_name, cls) and not hf_name.endswith(ignored):
                unexpected.append(hf_name)
            continue
        if name.endswith(transposed) and tensor.dim() == 2:
            tensor = tensor.t()
        tensor = tensor.to(dtype=_load_dtype(hf_name, tensor, tensors.get(name, expected[name]), dtype)).contiguous()
        if group is None:
            state[name] = tensor
            continue
        assert part is not None  # (a fused group's tensors are its parts)
        slots = fused.setdefault(name, [None] * fused_parts[group])
        if part >= len(slots):  # e.g. an expert beyond the config's count
            unexpected.append(hf_name)
            continue
        slots[part] = tensor
        loaded = [t for t in slots if t is not None]
        if len(loaded) == len(slots):
            state[name] = _join_parts(name, loaded, tensors.get(name, expected[name]))
            del fused[name]
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise ModelLoadError(
            f"{model_dir}: checkpoint tensors the {cls.__name__} code does not use: "
            f"{', '.join(unexpected[:5])}{more} (config and weights disagree?)"
        )
    return state


def _checkpoint_parts(files: list[Path], cls: type[Any]) -> PartNames:
    """{a layer's local name: the checkpoint modules it is loaded from} (a fused layer has several),
    from the checkpoint's tensor names."""
    from safetensors import SafetensorError, safe_open

    parts: dict[str, list[str]] = {}
    for path in files:
        if path.suffix != ".safetensors":
            continue
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
        except (SafetensorError, OSError) as exc:
            raise _unreadable(path, exc) from None
        for hf_name in names:
            local = cls.hf_to_local(hf_name)[0].rpartition(".")[0]
            module = hf_name.rpartition(".")[0]
            if module not in parts.setdefault(local, []):
                parts[local].append(module)
    return {name: tuple(modules) for name, modules in parts.items()}


def _check_quantized_experts(model_dir: Path, model: nn.Module, quant: QuantizationConfig | None) -> None:
    """Refuse a pre-quantized mixture of experts (its per-expert packed tensors have no loader yet)."""
    from tokenmill.models.layers.moe import GroupedExperts

    if quant is not None and quant.prequantized and any(isinstance(m, GroupedExperts) for m in model.modules()):
        raise ModelLoadError(f"{model_dir}: {quant.name} checkpoints of mixture-of-experts models are not supported")


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool = True,
    tp: TPInfo = NO_TP,
    max_model_len: int | None = None,
    model_impl: str = "auto",
    packed_linear: bool = False,
    quantization: str | None = None,
    batch_invariant: bool = False,
) -> tuple[nn.Module, ModelSpec]:
    """The model (this rank's shard of it under tensor parallelism) and the spec of its shapes,
    built for contexts of up to `max_model_len` tokens (default: the model's maximum). Its linear
    layers get their methods here: the checkpoint's quantization (or `--quantization`), else float,
    packed for tokenmill's CPU kernels with `packed_linear` (on row-invariant kernels only with
    `batch_invariant`); their tensors are then as the checkpoint
    holds them, until linear_setup.process_weights_after_loading."""
    arch, full_spec = _architecture_and_spec(model_dir, model_impl)
    _log_dequantized_gguf(model_dir, dtype)
    if max_model_len:
        full_spec.context_len = min(max_model_len, full_spec.max_position)
    backend = linear_backend(device, dtype, packed_linear, batch_invariant)
    quant = quantization_config(
        read_config(model_dir), quantization, cpu_kernels_available(device), str(model_dir / "config.json")
    )
    if arch.path == GENERIC:
        from tokenmill.models.model_loader.transformers_backend import load_generic_model

        if tp.enabled:
            raise ModelLoadError(
                f"{model_dir}: --tensor-parallel-size > 1 needs the native path; "
                f"{full_spec.model_type!r} runs on the generic transformers path"
            )
        if quant is not None and quant.prequantized:
            raise ModelLoadError(
                f"{model_dir}: {quant.name} checkpoints load on the native path only (`tokenmill models`); "
                f"{full_spec.model_type!r} runs on the generic transformers path"
            )
        return load_generic_model(model_dir, full_spec, dtype, device, backend, quant)
    check_shardable(full_spec, tp.world_size)
    if tp.enabled and quant is not None and quant.prequantized:
        raise ModelLoadError(f"{model_dir}: --tensor-parallel-size > 1 does not take {quant.name} checkpoints yet")
    spec = local_spec(full_spec, tp)
    cls = arch.model_class
    with torch.device("meta"):
        model = cls(spec, tp) if tp.enabled else cls(spec)
    files = _weight_files(model_dir)
    assign_linear_methods(model, backend, quant, _checkpoint_parts(files, cls))
    _check_quantized_experts(model_dir, model, quant)
    expected = dict(model.state_dict())
    fused_parts = {**FUSED_PARTS, **getattr(model, "fused_parts", {})}
    ignored = quant.ignored_tensors() if quant is not None else ()
    state = _read_state(model_dir, model, expected, dtype, progress, fused_parts, ignored)
    tied = getattr(cls, "tied_weights", {}) if spec.tie_word_embeddings else {}
    for name in tied:  # the tied copy (if the checkpoint has one) is the embedding, as in HF
        expected.pop(name, None)
        state.pop(name, None)
    missing = sorted(set(expected) - set(state))
    if missing:
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise ModelLoadError(f"{model_dir}: weights missing from the checkpoint: {', '.join(missing[:8])}{more}")
    state = shard_state(state, full_spec, tp)
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ModelLoadError(
                f"{model_dir}: weight {name} has shape {tuple(tensor.shape)}, the config "
                f"implies {tuple(expected[name].shape)}"
            )
    model.load_state_dict(state, strict=False, assign=True)
    for name, source in tied.items():
        module_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(module_name), leaf, model.get_parameter(source))
    model.rebuild_buffers()
    model.to(device)
    model.eval()
    return model, spec


def _log_dequantized_gguf(model_dir: Path, dtype: torch.dtype) -> None:
    """One line at start for a converted GGUF file some of whose quantized tensors run dequantized."""
    converted = ConvertedGGUF.read(model_dir)
    if converted is not None and converted.dequantized:
        logger.info(
            "%s: tensors of the GGUF file that run dequantized to %s: %s",
            Path(converted.source).name,
            str(dtype).removeprefix("torch."),
            ", ".join(f"{n} {kind}" for kind, n in converted.dequantized.items()),
        )
