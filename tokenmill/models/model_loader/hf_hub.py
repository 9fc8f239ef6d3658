"""Models named by repository id (`ORG/NAME`): found in the local Hugging Face cache, or downloaded.

Resolution goes through `huggingface_hub`, so the cache, endpoint and token settings HF users
already have apply (HF_HOME, HF_HUB_CACHE, HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE):

1. the cache first (`--download-dir`, else HF_HUB_CACHE): a complete copy of the revision there
   (its config, tokenizer and every weight file the index names) is used without any network
   request, so a machine holding the model starts offline;
2. else, unless HF_HUB_OFFLINE is set, the files the engine reads are downloaded (with the hub's
   progress bars; a transfer cut mid-file resumes where it stopped): config.json,
   generation_config.json, the tokenizer files and chat template, and one weight format, by
   preference the safetensors its index names, else model.safetensors, else pytorch_model*.bin.
   Nothing else (other weight formats, `original/`, ONNX exports, GGUF files) is fetched.

Failures are one line naming the repository and what to do: 401/403 (gated or private: a token),
404 (no such repository or revision), no network (HF_HUB_OFFLINE, or a copy from a connected
machine). With TOKENMILL_USE_MODELSCOPE=1 (or vLLM's VLLM_USE_MODELSCOPE) the same ids resolve
through ModelScope's client instead (`pip install modelscope`).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MODELSCOPE_ENV = ("TOKENMILL_USE_MODELSCOPE", "VLLM_USE_MODELSCOPE")
# What each kind of repository is fetched for (top-level files; weights are chosen separately).
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)
TEMPLATE_DIRECTORY = "additional_chat_templates/"  # named chat templates (transformers 5)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
MODEL, TOKENIZER, ADAPTER = "model", "tokenizer", "LoRA adapter"
_REPO_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


class ModelSourceError(ValueError):
    """A model that cannot be found or fetched: the message names it and the way out."""


@dataclass(frozen=True)
class HubOptions:
    """Where and how repository ids are fetched (`--revision`, `--download-dir`, `--hf-token`)."""

    revision: str | None = None
    download_dir: str | None = None  # the HF cache to read and fill (default: HF_HUB_CACHE)
    token: str | bool | None = None  # default: HF_TOKEN or the token `hf auth login` stored (True: that one)


def looks_like_repo_id(text: str) -> bool:
    """`NAME` or `ORG/NAME` in the hub's spelling (and no path of this machine: checked first)."""
    if text.startswith((".", "/", "~")) or text.endswith("/"):
        return False
    parts = text.split("/")
    return len(parts) <= 2 and all(_REPO_PART.fullmatch(p) and not p.endswith((".", "-")) for p in parts)


def use_modelscope() -> bool:
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes") for name in MODELSCOPE_ENV)


def fetch_repo(repo_id: str, options: HubOptions = HubOptions(), kind: str = MODEL) -> Path:
    """The local directory of `repo_id` (a model, a tokenizer or a LoRA adapter) at the revision
    asked for: the cached copy, or a fresh download of the files that kind needs."""
    if use_modelscope():
        return _fetch_from_modelscope(repo_id, options, kind)
    cached = cached_repo(repo_id, options, kind)
    if cached is not None:
        logger.info("%s %s: from the local cache at %s", kind, repo_id, cached)
        return cached
    from huggingface_hub import constants

    if constants.is_offline_mode():
        raise ModelSourceError(
            f"{kind} {repo_id!r}{_at(options)} is not in the local Hugging Face cache ({_cache_dir(options)}) and "
            "HF_HUB_OFFLINE=1 forbids downloading it: unset HF_HUB_OFFLINE, or copy the model into that cache "
            "from a machine that has it (`hf download " + repo_id + "`), or pass a local directory"
        )
    return _download(repo_id, options, kind)


def cached_repo(repo_id: str, options: HubOptions, kind: str) -> Path | None:
    """The cached snapshot of the revision, if it holds every file `kind` needs (no network)."""
    from huggingface_hub import try_to_load_from_cache

    anchors = {MODEL: ("config.json",), TOKENIZER: TOKENIZER_FILES, ADAPTER: (ADAPTER_CONFIG,)}[kind]
    for anchor in anchors:
        found = try_to_load_from_cache(repo_id, anchor, cache_dir=options.download_dir, revision=options.revision)
        if isinstance(found, str):
            snapshot = Path(found).parent
            return snapshot if _complete(snapshot, kind) else None
    return None


def _complete(snapshot: Path, kind: str) -> bool:
    present = {str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()}
    if kind == TOKENIZER:
        return bool(present & set(TOKENIZER_FILES))
    if kind == ADAPTER:
        return any(name in present for name in ADAPTER_WEIGHTS)
    try:
        weights = select_weights(present, lambda name: json.loads((snapshot / name).read_text()))
    except (ModelSourceError, OSError, ValueError):
        return False
    return all(name in present for name in weights)


def select_weights(files: Iterable[str], read_index: Callable[[str], Any]) -> list[str]:
    """The weight files to fetch from a repository's file list: the safetensors an index names (with
    the index), or model.safetensors, or every top-level *.safetensors, else the same for
    pytorch_model*.bin. `read_index(name)` reads an index file's JSON."""
    files = set(files)
    top = sorted(f for f in files if "/" not in f)
    for index, single, suffix in (
        ("model.safetensors.index.json", "model.safetensors", ".safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin", ".bin"),
    ):
        if index in files:
            weight_map = read_index(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelSourceError(f"{index} has no weight_map")
            return [index, *sorted(set(weight_map.values()))]
        if single in files:
            return [single]
        found = [f for f in top if f.endswith(suffix) and (suffix == ".safetensors" or f.startswith("pytorch_model"))]
        if found:
            return found
    raise ModelSourceError("no weights tokenmill reads (safetensors, or pytorch_model*.bin)")


def _wanted_files(repo_id: str, files: set[str], kind: str, read: Callable[[str], Any]) -> list[str]:
    if kind == TOKENIZER:
        return sorted(f for f in files if f in TOKENIZER_FILES or f in CONFIG_FILES or _is_template(f))
    if kind == ADAPTER:
        if ADAPTER_CONFIG not in files:
            raise ModelSourceError(f"{repo_id!r} is no PEFT LoRA adapter: it has no {ADAPTER_CONFIG}")
        adapter_weights = next((w for w in ADAPTER_WEIGHTS if w in files), None)
        if adapter_weights is None:
            raise ModelSourceError(f"LoRA adapter {repo_id!r} has none of {', '.join(ADAPTER_WEIGHTS)}")
        return [ADAPTER_CONFIG, adapter_weights]
    if "config.json" not in files:
        raise ModelSourceError(f"{repo_id!r} has no config.json: not a Hugging Face (transformers) model repository")
    try:
        weights = select_weights(files, read)
    except ModelSourceError as exc:
        ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
        hint = f"; for its GGUF files ({', '.join(ggufs[:4])}) download one and pass --model FILE.gguf" if ggufs else ""
        raise ModelSourceError(f"{repo_id!r} has {exc}{hint}") from None
    wanted = [f for f in files if f in CONFIG_FILES or f in TOKENIZER_FILES or _is_template(f)]
    return sorted({*wanted, *weights})


def _is_template(name: str) -> bool:
    return name.startswith(TEMPLATE_DIRECTORY) and name.endswith(".jinja")


def _download(repo_id: str, options: HubOptions, kind: str) -> Path:
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    with _hub_errors(repo_id, options, kind):
        info = HfApi(token=options.token).model_info(repo_id, revision=options.revision)
        files = {s.rfilename for s in info.siblings or []}

        def read(name: str) -> Any:
            path = hf_hub_download(
                repo_id, name, revision=info.sha, cache_dir=options.download_dir, token=options.token
            )
            return json.loads(Path(path).read_text())

        wanted = _wanted_files(repo_id, files, kind, read)
        logger.info("downloading %s %s%s: %s", kind, repo_id, _at(options), ", ".join(wanted))
        # (by the revision asked for, not the commit: the cache then maps that branch or tag to it,
        # which is how a later start finds it offline)
        path = snapshot_download(
            repo_id,
            revision=options.revision,
            cache_dir=options.download_dir,
            token=options.token,
            allow_patterns=wanted,
        )
    return Path(path)


@contextmanager
def _hub_errors(repo_id: str, options: HubOptions, kind: str) -> Iterator[None]:
    """The hub's exceptions as one-line ModelSourceErrors naming the repository and the way out."""
    try:
        yield
    except ModelSourceError:
        raise
    except Exception as exc:
        message = hub_error_message(exc, repo_id, options, kind)
        if message is None:
            raise
        raise ModelSourceError(message) from exc


def hub_error_message(exc: Exception, repo_id: str, options: HubOptions, kind: str) -> str | None:
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"{kind} {repo_id!r}"
    token_hint = "pass --hf-token TOKEN or set HF_TOKEN (a token with access to it)"
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, GatedRepoError):
        return (
            f"{what} is gated: accept its conditions on {constants.ENDPOINT}/{repo_id} while logged in, then "
            f"{token_hint} (HTTP {status})"
        )
    if isinstance(exc, RevisionNotFoundError):
        return f"{what} has no revision {options.revision!r} (a branch, tag or commit of the repository; HTTP 404)"
    if isinstance(exc, RepositoryNotFoundError):
        if status == 401 and options.token is None and not os.environ.get("HF_TOKEN"):
            return (
                f"{what} was not found on {constants.ENDPOINT}, or it is private or gated (HTTP 401): check the "
                f"name, or {token_hint}"
            )
        if status == 401:
            return f"{what}: the hub refused the token (HTTP 401): check --hf-token / HF_TOKEN, or the name"
        return f"{what} was not found on {constants.ENDPOINT} (HTTP {status or 404}): check the name"
    if isinstance(exc, HfHubHTTPError) and status in (401, 403):
        return f"{what}: access denied (HTTP {status}): {token_hint}"
    if isinstance(exc, HfHubHTTPError):
        return f"{what}: the hub answered HTTP {status} ({_first_line(exc)})"
    if isinstance(exc, (LocalEntryNotFoundError, *_network_errors())):
        return (
            f"cannot reach {constants.ENDPOINT} to download {what}{_at(options)} ({_first_line(exc)}), and it is "
            f"not in the local cache ({_cache_dir(options)}): check the network (or HF_ENDPOINT, a proxy), or "
            f"copy the model into that cache from a connected machine (`hf download {repo_id}`), or pass a local "
            "directory"
        )
    return None


def _network_errors() -> tuple[type[BaseException], ...]:
    """Connection failures of the HTTP client the installed huggingface_hub uses."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for client in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(client).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."


def _at(options: HubOptions) -> str:
    return f" at revision {options.revision!r}" if options.revision else ""


def _cache_dir(options: HubOptions) -> str:
    from huggingface_hub import constants

    return options.download_dir or constants.HF_HUB_CACHE


def _fetch_from_modelscope(repo_id: str, options: HubOptions, kind: str) -> Path:
    """The same repository id through ModelScope's client (its own cache, endpoint and token)."""
    try:
        from modelscope import snapshot_download
    except ImportError:
        raise ModelSourceError(
            f"{MODELSCOPE_ENV[0]}/{MODELSCOPE_ENV[1]} is set but the modelscope package is not installed: "
            "pip install modelscope (or unset it to use the Hugging Face hub)"
        ) from None
    patterns = {
        TOKENIZER: [*TOKENIZER_FILES, *CONFIG_FILES],
        ADAPTER: [ADAPTER_CONFIG, *ADAPTER_WEIGHTS],
        MODEL: [*CONFIG_FILES, *TOKENIZER_FILES, "*.safetensors", "model.safetensors.index.json"],
    }[kind]

    def fetch(allow_patterns: list[str]) -> Path:
        return Path(
            snapshot_download(
                repo_id, revision=options.revision, cache_dir=options.download_dir, allow_patterns=allow_patterns
            )
        )

    try:
        path = fetch(patterns)
        if kind == MODEL and not any(path.glob("*.safetensors")):  # an older repository: .bin weights
            path = fetch([*CONFIG_FILES, *TOKENIZER_FILES, "pytorch_model*.bin", "pytorch_model.bin.index.json"])
    except Exception as exc:  # (ModelScope's errors share no base class worth naming)
        message = f"ModelScope could not provide {kind} {repo_id!r}{_at(options)}: {_first_line(exc)}"
        raise ModelSourceError(message) from exc
    logger.info("%s %s: from ModelScope, at %s", kind, repo_id, path)
    return path
