"""LoRA adapters by name: PEFT directories read, checked against the model, and kept in CPU memory.

An adapter is a PEFT LoRA directory (`adapter_config.json` + `adapter_model.safetensors`, or
`adapter_model.bin`), as `peft`'s `save_pretrained` writes it. Reading is strict, like the model
loader: every tensor must be the A or B matrix of a layer this model serves with LoRA (q, k, v,
o, gate, up, down projections of the native Llama-family decoders, placed into their fused
qkv / gate_up layers), with the shapes the model implies and a rank within `--max-lora-rank`;
anything else (DoRA, embedding or lm_head adapters, `modules_to_save`, trained biases, a layer the
model lacks) is refused with a message naming it, never ignored.

Every load gets a new id, never reused: it keys the adapter's prefix-cache blocks and its slot,
so an adapter unloaded and loaded again under the same name never meets the old one's KV blocks.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import pickle
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import regex
import torch

from tokenmill.errors import InvalidRequest
from tokenmill.lora.types import LoRAAdapter, LoRATarget, LoRAWeights

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<matrix>[AB])\.weight$")
# PEFT's alpha_pattern / rank_pattern keys are regexes written by whoever made the adapter. They
# are matched with `regex` (the GIL released) within one time budget per adapter: a catastrophic
# pattern is refused, naming it, instead of freezing the process (`re` holds the GIL while it
# backtracks). Their number and length are bounded too.
# Adapter names show in /v1/models, responses and metric labels.
ADAPTER_NAME = re.compile(r"[^\s\x00-\x1f\x7f]{1,128}")
MAX_PATTERNS = 256
MAX_PATTERN_CHARS = 512
PATTERN_MATCH_BUDGET_S = 1.0


class LoRAError(InvalidRequest):
    """An adapter that cannot be served (HTTP 400; a one-line error at startup)."""

    code = "invalid_lora_adapter"


class LoRAPathError(LoRAError):
    """`lora_path` holds no readable PEFT adapter: missing, not a directory, no or unreadable files.
    The run-time API answers these with one message (see `tokenmill.server.lora_api`), so it tells
    nobody whether a path exists on the server."""


class LoRANotFound(InvalidRequest):
    code = "lora_not_found"


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's offline handle on an adapter: `LLM.generate(..., lora_request=LoRARequest(name, id, path))`.
    tokenmill identifies adapters by name (loaded on first use); `lora_int_id` is kept for vLLM code."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """`NAME=PATH` or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules: {text!r} is not valid JSON ({exc})") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
            raise ValueError(f'--lora-modules: {text!r} needs string fields "name" and "path"')
        if not isinstance(spec.get("base_model_name", ""), (str, type(None))):
            raise ValueError(f'--lora-modules: {text!r}: "base_model_name" must be a string')
        unknown = set(spec) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"--lora-modules: {text!r} has unknown fields {sorted(unknown)}")
        return LoRAModulePath(spec["name"], spec["path"], spec.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: {text!r} must be NAME=PATH or a JSON object with name and path")
    return LoRAModulePath(name, path)


class LoRARegistry:
    """The adapters a server or LLM can serve, by name (thread-safe: the server loads adapters on
    worker threads while the engine thread reads them)."""

    def __init__(
        self,
        targets: Mapping[str, LoRATarget],
        hf_to_local: Callable[[str], tuple[str, int | None, Any]],
        max_rank: int,
        dtype: torch.dtype,
        base_model_name: str,
        max_adapters: int,
    ) -> None:
        self.targets = dict(targets)
        self.hf_to_local = hf_to_local
        self.max_rank = max_rank
        self.dtype = dtype
        self.base_model_name = base_model_name
        self.max_adapters = max_adapters
        self._adapters: dict[str, LoRAAdapter] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def get(self, name: str) -> LoRAAdapter | None:
        return self._adapters.get(name)

    def adapters(self) -> list[LoRAAdapter]:
        with self._lock:
            return list(self._adapters.values())

    def load(self, name: str, path: str | Path, base_model_name: str | None = None) -> LoRAAdapter:
        """Read, check and register an adapter under a new name (LoRAError on any problem)."""
        if not name or not str(path):
            raise LoRAError(
                "both lora_name and lora_path must be given", param="lora_name" if not name else "lora_path"
            )
        if not ADAPTER_NAME.fullmatch(name):
            raise LoRAError(
                "an adapter name is 1 to 128 characters, none of them whitespace or control characters",
                param="lora_name",
            )
        if name == self.base_model_name:
            raise LoRAError(f"{name!r} is the base model's name; give the adapter another", param="lora_name")
        self._check_room(name)
        weights, rank = self._read(name, Path(path))
        adapter = LoRAAdapter(name, str(path), next(self._ids), rank, weights, base_model_name)
        with self._lock:  # (another thread may have loaded one meanwhile)
            self._check_room(name)
            self._adapters[name] = adapter
        logger.info("LoRA adapter %r loaded from %s (rank %d, %d layers)", name, path, rank, len(weights))
        return adapter

    def _check_room(self, name: str) -> None:
        if name in self._adapters:
            raise LoRAError(f"the LoRA adapter {name!r} has already been loaded", param="lora_name")
        if len(self._adapters) >= self.max_adapters:
            raise LoRAError(
                f"{self.max_adapters} LoRA adapters are loaded, the most this server holds (--max-cpu-loras): "
                "unload one first",
                param="lora_name",
                code="lora_limit_reached",
            )

    def unload(self, name: str) -> LoRAAdapter:
        """Forget an adapter: new requests cannot select it; requests running with it finish with it."""
        with self._lock:
            adapter = self._adapters.pop(name, None)
        if adapter is None:
            raise LoRANotFound(f"the LoRA adapter {name!r} cannot be found", param="lora_name")
        logger.info("LoRA adapter %r unloaded", name)
        return adapter

    def get_or_load(self, request: LoRARequest) -> LoRAAdapter:
        """The offline API's adapter: the one loaded under this name, or loaded now."""
        adapter = self.get(request.lora_name)
        if adapter is None:
            return self.load(request.lora_name, request.lora_path)
        if Path(adapter.path) != Path(request.lora_path):
            raise LoRAError(
                f"the LoRA adapter {request.lora_name!r} is already loaded from {adapter.path}, not {request.lora_path}"
            )
        return adapter

    # -- reading a PEFT directory ------------------------------------------------------------

    def _read(self, name: str, path: Path) -> tuple[dict[str, tuple[LoRAWeights, ...]], int]:
        where = f"LoRA adapter {name!r} ({path})"
        config = _read_config(path, where)
        tensors = _read_tensors(path, where)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        unknown = []
        for key, tensor in tensors.items():
            match = _KEY.match(key)
            if match is None:
                unknown.append(key)
            else:
                pairs.setdefault(match["module"], {})[match["matrix"]] = tensor
        if unknown:
            raise LoRAError(
                f"{where}: tensors that are not LoRA A/B weights (DoRA, trained biases, "
                f"modules_to_save or embedding adapters are not supported): {_listed(unknown)}"
            )
        if not pairs:
            raise LoRAError(f"{where}: the weights file holds no LoRA matrices")
        weights: dict[str, list[LoRAWeights]] = {}
        rank = 0
        alphas = _AlphaPatterns(config, where)
        for module, matrices in sorted(pairs.items()):
            local, part, a, b = self._checked_pair(where, module, matrices)
            existing = weights.setdefault(local, [])
            if any(w.part is None or part is None or w.part == part for w in existing):
                raise LoRAError(f"{where}: {module} adapts a layer another of its modules already adapts")
            scaled_b = (b.float() * _scale(config, alphas.alpha(module), a.shape[0])).to(self.dtype)
            if not torch.isfinite(scaled_b).all():  # (a huge alpha overflows the model's dtype)
                raise LoRAError(f"{where}: {module}: lora_B times the scale alpha / r holds NaN or infinite weights")
            existing.append(LoRAWeights(part, a.to(self.dtype).contiguous(), scaled_b.contiguous()))
            rank = max(rank, a.shape[0])
        return {k: tuple(v) for k, v in weights.items()}, rank

    def _checked_pair(
        self, where: str, module: str, matrices: dict[str, torch.Tensor]
    ) -> tuple[str, int | None, torch.Tensor, torch.Tensor]:
        if set(matrices) != {"A", "B"}:
            missing = "lora_B" if "A" in matrices else "lora_A"
            raise LoRAError(f"{where}: {module} has no {missing} weight")
        local, part, _ = self.hf_to_local(f"{module}.weight")
        local = local.removesuffix(".weight")
        target = self.targets.get(local)
        if target is None or (part is not None and part >= len(target.part_sizes)):
            raise LoRAError(
                f"{where}: target module {module} is not a layer this model serves with LoRA "
                "(supported: the q/k/v/o and gate/up/down projections of every decoder layer)"
            )
        a, b = matrices["A"], matrices["B"]
        out = target.out_features if part is None else target.part_sizes[part]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise LoRAError(
                f"{where}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                "are not a [r, in] / [out, r] pair"
            )
        if a.shape[1] != target.in_features or b.shape[0] != out:
            raise LoRAError(
                f"{where}: {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the "
                f"model's layer ({target.in_features} in, {out} out): an adapter of another base model?"
            )
        if a.shape[0] == 0:
            raise LoRAError(f"{where}: {module} has rank 0 (empty lora_A / lora_B)")
        if a.shape[0] > self.max_rank:
            raise LoRAError(f"{where}: {module} has rank {a.shape[0]}, more than --max-lora-rank {self.max_rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAError(f"{where}: {module} holds NaN or infinite weights")
        return local, part, a, b


def _listed(names: list[str]) -> str:
    more = f" (and {len(names) - 5} more)" if len(names) > 5 else ""
    return ", ".join(sorted(names)[:5]) + more


def _read_config(path: Path, where: str) -> dict[str, Any]:
    if not path.is_dir():
        raise LoRAPathError(f"{where}: no such directory")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise LoRAPathError(f"{where}: {CONFIG_FILE} is missing (not a PEFT adapter directory?)") from None
    except (OSError, ValueError) as exc:
        raise LoRAPathError(f"{where}: {CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{where}: peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    refused = {
        "use_dora": "DoRA adapters",
        "modules_to_save": "modules_to_save (full copies of layers)",
        "layer_replication": "layer_replication",
        "target_parameters": "target_parameters (adapters of raw parameters, e.g. MoE experts)",
        "trainable_token_indices": "trainable_token_indices (embedding updates)",
        "lora_bias": "lora_bias",
    }
    for key, what in refused.items():
        if config.get(key):
            raise LoRAError(f"{where}: {what} are not supported ({key} is set in {CONFIG_FILE})")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{where}: bias={config['bias']!r} (trained biases) is not supported; only bias='none'")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not _positive_number(value):
            raise LoRAError(f"{where}: {CONFIG_FILE} needs a positive number {key!r}")
    _check_pattern(config, "alpha_pattern", where)
    _check_pattern(config, "rank_pattern", where)
    return config


def _positive_number(value: Any) -> bool:
    """A finite number > 0 (Python's json reads NaN and Infinity too)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _check_pattern(config: dict[str, Any], key: str, where: str) -> None:
    """PEFT's per-module alphas or ranks: {regex: positive number}, at most MAX_PATTERNS keys of at
    most MAX_PATTERN_CHARS characters."""
    pattern = config.get(key)
    if not pattern:
        return
    problem = None
    if not isinstance(pattern, dict):
        problem = "it is not an object"
    elif len(pattern) > MAX_PATTERNS:
        problem = f"it has {len(pattern)} keys, more than {MAX_PATTERNS}"
    else:
        for name, value in pattern.items():
            if not _positive_number(value):
                problem = f"{name!r} maps to {value!r}"
            elif len(name) > MAX_PATTERN_CHARS:
                problem = f"{name[:40]!r}... is longer than {MAX_PATTERN_CHARS} characters"
            else:
                try:
                    re.compile(name)  # PEFT's syntax (re's), whatever `regex` would also accept
                except re.error as exc:
                    problem = f"{name!r} is not a regular expression ({exc})"
            if problem:
                break
    if problem:
        raise LoRAError(
            f"{where}: {key} must be an object of module patterns to positive numbers in {CONFIG_FILE}: {problem}"
        )


class _AlphaPatterns:
    """`alpha_pattern` lookups of one adapter, all of them within PATTERN_MATCH_BUDGET_S of matching."""

    def __init__(self, config: dict[str, Any], where: str) -> None:
        self.default = config["lora_alpha"]
        given = config.get("alpha_pattern") or {}
        self.patterns = [(key, regex.compile(rf"(.*\.)?({key})$"), value) for key, value in given.items()]
        self.where = where
        self.budget_left = PATTERN_MATCH_BUDGET_S

    def alpha(self, module: str) -> float:
        """The first matching pattern's alpha, else lora_alpha (peft's get_pattern_key)."""
        for key, pattern, value in self.patterns:
            start = time.monotonic()
            try:
                if self.budget_left <= 0:
                    raise TimeoutError
                matched = pattern.match(module, timeout=self.budget_left, concurrent=True)
            except TimeoutError:
                raise LoRAError(
                    f"{self.where}: alpha_pattern key {key!r} takes too long to match module names (the budget "
                    f"for all of them is {PATTERN_MATCH_BUDGET_S:g} s): refused"
                ) from None
            self.budget_left -= time.monotonic() - start
            if matched:
                return value
        return self.default


def _read_tensors(path: Path, where: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    for file_name in WEIGHT_FILES:
        file = path / file_name
        if not file.exists():
            continue
        try:
            if file.suffix == ".safetensors":
                return load_file(str(file))
            tensors = torch.load(file, map_location="cpu", weights_only=True)
        except (SafetensorError, OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
            raise LoRAPathError(f"{where}: {file_name} is unreadable ({' '.join(str(exc).split())[:200]})") from None
        if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()
        ):
            raise LoRAError(f"{where}: {file_name} must hold a dict of named tensors")
        return tensors
    raise LoRAPathError(f"{where}: no {' or '.join(WEIGHT_FILES)}")


def _scale(config: dict[str, Any], alpha: float, rank: int) -> float:
    """PEFT's scaling of one module: alpha / r (alpha / sqrt(r) with rsLoRA); `rank_pattern` shows in
    the matrices' shapes, `alpha_pattern` gives `alpha` (see _AlphaPatterns)."""
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
