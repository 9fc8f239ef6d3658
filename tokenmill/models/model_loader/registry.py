"""Which code serves which architecture: HF `model_type` -> spec builder, model class, path.

A family module calls `register(Architecture(...))` at import; `FAMILY_MODULES` lists the modules
to import, so the loader and the engine never name a family. Model classes share one interface:

    model = cls(spec)                      # or cls(spec, tp) when supports_tensor_parallel
    hidden = model(input_ids, positions, kv_caches, meta)   # [T] ids/positions -> [T, hidden]
    logits = model.compute_logits(hidden)
    cls.hf_to_local(hf_name) -> (local name, fused part index | None, fused group | None)
    model.rebuild_buffers(device)          # recompute non-persistent buffers (RoPE tables, ...)

and class attributes read by the loader: `ignored_checkpoint_tensors` (suffixes of checkpoint
tensors that are derived, not weights), `tied_weights` ({local name: name it is tied to when the
config ties embeddings}), `transposed_weights`, `supports_tensor_parallel`.

Architectures that no native module claims may be served by a fallback resolver (the generic
transformers path registers one): `lookup` asks the resolvers in order.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.models.spec import ModelSpec

# Modules that register architectures when imported.
FAMILY_MODULES = [
    "tokenmill.models.families.llama",
    "tokenmill.models.families.qwen3",
    "tokenmill.models.families.gemma",
    "tokenmill.models.families.gemma2",
    "tokenmill.models.families.gemma3",
    "tokenmill.models.families.phi3",
    "tokenmill.models.families.gpt2",
    "tokenmill.models.families.moe_decoder",
    "tokenmill.models.model_loader.transformers_backend",  # generic: after the native families, which take precedence
]

# A model class's `hf_to_local` (see above).
HfToLocal = Callable[[str], tuple[str, int | None, str | None]]

NATIVE = "native"
GENERIC = "generic"


@dataclass(frozen=True)
class Architecture:
    model_type: str  # config.json "model_type"
    hf_architectures: tuple[str, ...]  # HF class names served, e.g. ("LlamaForCausalLM",)
    model_class: type
    build_spec: Callable[[Any], ModelSpec]  # transformers config -> spec (eos filled in by the loader)
    # config.json keys that must be present: transformers would silently default them otherwise.
    required_keys: tuple[str, ...] = ()
    path: str = NATIVE  # which implementation serves it: NATIVE or GENERIC
    features: str = ""  # one line for `tokenmill models` and the README table


_ARCHITECTURES: dict[str, Architecture] = {}
_GENERIC: dict[str, Architecture] = {}  # generic-path entries, shadowed by a native one of the same type
_RESOLVERS: list[Callable[[str], Architecture | None]] = []
_loaded = False


def register(arch: Architecture) -> None:
    table = _ARCHITECTURES if arch.path == NATIVE else _GENERIC
    if arch.model_type in table and table[arch.model_type] != arch:
        raise ValueError(f"architecture {arch.model_type!r} registered twice")
    table[arch.model_type] = arch


def register_resolver(resolver: Callable[[str], Architecture | None]) -> None:
    """A fallback for model types without a registered architecture (asked in registration order)."""
    if resolver not in _RESOLVERS:
        _RESOLVERS.append(resolver)


def _ensure_loaded() -> None:
    global _loaded
    if not _loaded:
        for name in FAMILY_MODULES:
            importlib.import_module(name)
        _loaded = True


def architectures() -> list[Architecture]:
    """Every registered architecture (a native one where both paths registered it), sorted by model type."""
    _ensure_loaded()
    return sorted(({**_GENERIC, **_ARCHITECTURES}).values(), key=lambda a: a.model_type)


def lookup(model_type: str | None) -> Architecture:
    """The architecture serving `model_type`; ValueError naming the supported ones if none does."""
    _ensure_loaded()
    for table in (_ARCHITECTURES, _GENERIC):
        if model_type in table:
            return table[model_type]
    for resolver in _RESOLVERS:
        arch = resolver(model_type) if model_type else None
        if arch is not None:
            return arch
    supported = ", ".join(a.model_type for a in architectures())
    raise ValueError(
        f"unsupported architecture {model_type!r}; tokenmill supports: {supported} (`tokenmill models` lists them)"
    )
