"""The generic path: any decoder-only transformers `*ForCausalLM`, run by its own HF modules.

Like vLLM's Transformers backend, the HF model is built from the checkpoint with
`attn_implementation="tokenmill"`: every attention layer calls `tokenmill_attention` (registered in
transformers' `AttentionInterface`), which writes the layer's K/V into tokenmill's paged cache and
attends with `paged_attention`. A step runs as one flattened batch (`input_ids[None]`,
`position_ids=positions[None]`, no HF cache); the step's cache and `AttentionMetadata` reach the
attention function through a context variable that `forward` sets. The rest of the HF code (norms,
MLPs, MoE routing, RoPE variants, embedding and logit scaling, softcapping) runs unchanged, so the
tokens equal HF's. Scheduling, KV paging, prefix caching, chunked prefill and sampling stay tokenmill's.

What the path cannot run fails at load with the reason (see `check_config` and `probe`): models
without custom-attention support, encoder-decoders, multimodal wrappers, recurrent / state-space /
convolution / linear-attention layers, anything that mixes tokens outside attention, attention
features paged attention does not implement.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.models.layers.attention import AttentionMetadata, PrefillSegment, paged_attention
from tokenmill.models.layers.linear import LinearBackend, replace_linear_modules
from tokenmill.models.layers.quantization import QuantizationConfig
from tokenmill.models.model_loader.linear_setup import assign_linear_methods
from tokenmill.models.model_loader.registry import GENERIC, Architecture, register, register_resolver
from tokenmill.models.spec import ModelSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "tokenmill"

# Architectures whose greedy tokens tests/models/test_models_generic.py checks against HF generate through
# this path (tiny random models, sharpened weights); the others it loads are untested.
TESTED_ARCHITECTURES = frozenset(
    {
        "apertus",
        "arcee",
        "cohere",
        "cohere2",
        "deepseek_v3",
        "ernie4_5",
        "exaone4",
        "falcon",
        "gemma",
        "gemma2",
        "gemma3_text",
        "glm",
        "glm4",
        "gpt2",
        "gpt_bigcode",
        "gpt_neox",
        "gptj",
        "granite",
        "helium",
        "llama",
        "ministral",
        "mistral",
        "mixtral",
        "nemotron",
        "olmo",
        "olmo2",
        "olmo3",
        "olmoe",
        "opt",
        "persimmon",
        "phi",
        "phi3",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "seed_oss",
        "smollm3",
        "stablelm",
        "starcoder2",
    }
)

# Layer types (transformers' `config.layer_types`) that are attention over the whole K/V history.
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}
# Keyword arguments HF attention layers pass that need nothing from us (None or irrelevant values).
_IGNORED_KWARGS = {
    "dropout",
    "position_ids",
    "output_attentions",
    "use_cache",
    "cache_position",
    "is_causal",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
}
# RoPE variants whose frequencies depend on the longest position of the whole forward batch: exact
# (per sequence, like HF generate) only while no sequence of a step passes the original length.
_BATCH_DEPENDENT_ROPE = {"dynamic", "longrope"}
# Attention arguments known to need what paged attention does not do, by what they are.
_KNOWN_UNSUPPORTED = {"s_aux": "attention sinks", "sinks": "attention sinks"}
_PROBE_TOKENS = 7
# Classes that call attention through transformers' AttentionInterface without declaring
# `_supports_attention_backend` (checked in their source; the load-time probe still checks every
# call, e.g. Falcon's ALiBi variant passes its bias as a mask and is refused there).
_ATTENTION_INTERFACE_WITHOUT_FLAG = {"falcon", "stablelm"}  # tokens of the load-time probe (`probe`)


class UnsupportedModelError(ModelLoadError):
    """A model the generic path cannot run correctly (the message names the reason)."""


# -- attention ------------------------------------------------------------------------------------


@dataclass
class AttentionCall:
    """What one HF attention layer passed to the attention function (recorded by `probe`)."""

    layer_idx: Any
    num_heads: int
    num_kv_heads: int
    q_len: int
    kv_len: int
    k_head_dim: int
    v_head_dim: int
    scaling: float | None
    kwargs: dict[str, Any]
    is_causal: bool
    has_mask: bool  # the model built its own mask or bias (e.g. ALiBi) instead of leaving it to us


@dataclass
class _Step:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None
    meta: AttentionMetadata | None
    head_dim: int  # the cache's head size: K and V are zero-padded up to it
    record: list[AttentionCall] | None = None  # probe mode: record the calls, return zeros


_STEP: contextvars.ContextVar[_Step | None] = contextvars.ContextVar("tokenmill_step", default=None)


@contextmanager
def _step_context(step: _Step) -> Iterator[None]:
    token = _STEP.set(step)
    try:
        yield
    finally:
        _STEP.reset(token)


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


@torch.compiler.disable
def tokenmill_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [1, H, T, Dk], key [1, Hkv, T, Dk],
    value [1, Hkv, T, Dv]; returns ([1, T, H, Dv], None). `sliding_window` (HF: a query sees the
    last `sliding_window` positions, itself included) and `softcap` (Gemma 2's attention logit
    softcapping) are the layer's own, as HF passes them; the other keyword arguments were checked
    at load (`probe`) to need nothing."""
    step = _STEP.get()
    if step is None:
        raise RuntimeError("tokenmill attention ran outside a tokenmill step (the model was called directly?)")
    _, heads, tokens, k_dim = query.shape
    v_dim = value.shape[-1]
    if step.record is not None:
        step.record.append(
            AttentionCall(
                getattr(module, "layer_idx", None),
                heads,
                key.shape[1],
                tokens,
                key.shape[2],
                k_dim,
                v_dim,
                scaling,
                {
                    k: v
                    for k, v in dict(kwargs, sliding_window=sliding_window, softcap=softcap).items()
                    if v is not None
                },
                bool(getattr(module, "is_causal", True)),
                attention_mask is not None,
            )
        )
        return query.new_zeros(1, tokens, heads, v_dim), None
    assert step.kv_caches is not None and step.meta is not None  # (a step outside probe mode)
    if scaling is None:
        scaling = k_dim**-0.5  # what SDPA (transformers' default path) does with scale=None
    d = step.head_dim
    q = _pad_last(query[0].transpose(0, 1), d)  # [T, H, D]
    k = _pad_last(key[0].transpose(0, 1), d)
    v = _pad_last(value[0].transpose(0, 1), d)
    # (torch types a Module's unknown attributes as its submodules' and tensors' union: HF's
    # attention modules hold their layer's index as an int)
    k_cache, v_cache = step.kv_caches[module.layer_idx]  # type: ignore[index]
    out = paged_attention(q, k, v, k_cache, v_cache, step.meta, scaling, window=sliding_window, softcap=softcap)
    return out.view(tokens, heads, d)[None, :, :, :v_dim], None


def register_attention() -> None:
    """Register `tokenmill_attention` as attn_implementation "tokenmill". No mask function is
    registered on purpose: transformers' mask builders return None at once for an implementation
    without one ("custom attention without equivalent mask creation"), so HF builds no dense
    [T, T] masks and does no packed-sequence detection (a device sync) per step; paged attention
    masks by its metadata. A model that builds its own mask anyway is refused by `probe`."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, tokenmill_attention)


# -- the model ------------------------------------------------------------------------------------


def _decoder_output_type() -> type:
    from transformers.modeling_outputs import BaseModelOutputWithPast

    class DecoderOutput(BaseModelOutputWithPast):
        """Any field a *ForCausalLM reads besides the hidden states (cross_attentions,
        router_logits, ...) is None."""

        def __getattr__(self, name: str) -> None:
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    return DecoderOutput


class _HiddenStates(nn.Module):
    """Stands in for the HF decoder inside the head: returns the hidden states it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.output_type = _decoder_output_type()

    def forward(self, *args: Any, inputs_embeds: torch.Tensor, **kwargs: Any) -> Any:
        return self.output_type(last_hidden_state=inputs_embeds)


class TransformersCausalLM(nn.Module):
    """A HF `*ForCausalLM` behind tokenmill's model interface:
    `forward(input_ids, positions, kv_caches, meta) -> hidden [T, hidden]` and
    `compute_logits(hidden) -> fp32 logits [rows, vocab]`."""

    # (plain attributes, set in __init__)
    _decoder_parent: nn.Module
    _hidden_states: _HiddenStates

    def __init__(self, hf_model: PreTrainedModel, head_dim: int) -> None:
        super().__init__()
        self.hf = hf_model
        self.head_dim = head_dim
        decoder = hf_model.get_decoder()
        path = next(name for name, module in hf_model.named_modules() if module is decoder)
        if not path:
            raise UnsupportedModelError(f"{type(hf_model).__name__} has no separate decoder module")
        parent, _, self._decoder_name = path.rpartition(".")
        # Plain attributes, not submodules: both already sit in the tree under `hf`.
        self.__dict__["_decoder_parent"] = hf_model.get_submodule(parent)
        self.__dict__["_hidden_states"] = _HiddenStates()

    # HF modeling code may sync with the host inside a step (data-dependent MoE dispatch, RoPE
    # updates), which CUDA-graph capture forbids; not verified on a GPU, so decode steps run eagerly.
    supports_cuda_graphs = False
    cuda_graphs_blocker = "the generic transformers path runs HF code that is not checked for capture"

    @property
    def decoder(self) -> nn.Module:
        module = self._decoder_parent._modules[self._decoder_name]
        assert module is not None  # (HF's decoder, found in __init__)
        return module

    @property
    def lm_head(self) -> nn.Module:
        return self.hf.get_output_embeddings()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        with _step_context(_Step(kv_caches, meta, self.head_dim)):
            return self.run_decoder(input_ids, positions)

    def run_decoder(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.decoder(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """HF's own *ForCausalLM.forward (lm_head, tied weights, logit scaling and softcapping exactly
        as HF applies them) with the decoder swapped, for this call, for one that returns `hidden`."""
        modules = self._decoder_parent._modules
        decoder = modules[self._decoder_name]
        modules[self._decoder_name] = self._hidden_states
        try:
            out = self.hf(inputs_embeds=hidden[None], use_cache=False, logits_to_keep=0)
        finally:
            modules[self._decoder_name] = decoder
        return out.logits[0].float()


# -- loading --------------------------------------------------------------------------------------


@dataclass
class GenericModelInfo:
    """The shapes the engine needs, found by `probe`."""

    num_layers: int  # attention layers (KV cache layers)
    num_kv_heads: int
    head_dim: int  # cache head size: max of the K and V head sizes (smaller ones are zero-padded)
    max_position: int
    notes: list[str] = field(default_factory=list)


def causal_lm_class(config: Any) -> type[PreTrainedModel]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        # (transformers types every lazy auto mapping's values as its tokenizer mapping's pairs)
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # type: ignore[return-value]
    except KeyError:
        raise UnsupportedModelError(
            f"{config.model_type!r} has no causal-LM class in transformers: the generic path runs "
            "decoder-only causal language models"
        ) from None


def check_config(config: Any) -> type[PreTrainedModel]:
    """The HF class to build, or UnsupportedModelError naming why the generic path cannot run it."""
    model_type = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{model_type!r} is an encoder-decoder model: the generic path runs decoder-only models"
        )
    if getattr(config, "add_cross_attention", False):
        raise UnsupportedModelError(
            f"{model_type!r} is configured with cross-attention (add_cross_attention): not supported"
        )
    if config.get_text_config() is not config:
        raise UnsupportedModelError(
            f"{model_type!r} is a multimodal model: the generic path runs text-only decoder models"
        )
    if getattr(config, "alibi", False):
        raise UnsupportedModelError(
            f"{model_type!r} with ALiBi position biases: tokenmill's paged attention applies no position bias"
        )
    cls = causal_lm_class(config)
    if not getattr(cls, "_supports_attention_backend", False) and model_type not in _ATTENTION_INTERFACE_WITHOUT_FLAG:
        raise UnsupportedModelError(
            f"{cls.__name__} does not support custom attention functions in transformers "
            f"(_supports_attention_backend is False), so tokenmill's paged attention cannot be plugged in"
        )
    layer_types = getattr(config, "layer_types", None) or []
    others = sorted(set(layer_types) - _ATTENTION_LAYER_TYPES)
    if others:
        raise UnsupportedModelError(
            f"{model_type!r} has layers of type {', '.join(others)}: the generic path runs full and sliding-window "
            "attention layers only (recurrent, state-space, convolution, linear, chunked or sparse attention "
            "need state or masks that tokenmill's paged KV cache does not hold)"
        )
    return cls


def _rope_types(config: Any) -> set[str]:
    params: dict[str, Any] = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    nested: list[dict[str, Any]] = [p for p in params.values() if isinstance(p, dict)] or [params]
    return {p.get("rope_type", p.get("type", "default")) for p in nested}


def _max_position(config: Any, notes: list[str]) -> int:
    names = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
    value = next((getattr(config, n) for n in names if getattr(config, n, None)), None)
    if value is None:
        raise UnsupportedModelError(
            f"{config.model_type!r}: the config names no context length (none of {', '.join(names)})"
        )
    batch_dependent = _rope_types(config) & _BATCH_DEPENDENT_ROPE
    if batch_dependent:
        original = getattr(config, "original_max_position_embeddings", None) or (
            (getattr(config, "rope_parameters", None) or {}).get("original_max_position_embeddings")
        )
        if not original:
            raise UnsupportedModelError(
                f"{config.model_type!r}: RoPE type {sorted(batch_dependent)} without original_max_position_embeddings"
            )
        if original < value:
            notes.append(
                f"context capped at {original} tokens: {sorted(batch_dependent)[0]} RoPE changes its "
                "frequencies with the longest sequence of a batch beyond that length"
            )
            value = original
    return int(value)


def load_hf_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """The HF model with its checkpoint weights; any tensor missing, unused or of the wrong shape is an error."""
    from transformers import AutoConfig

    register_attention()
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    cls = check_config(config)
    try:
        # (transformers types from_pretrained's result without output_loading_info's (model, info) pair)
        loaded: tuple[PreTrainedModel, dict[str, Any]] = cls.from_pretrained(  # type: ignore[assignment]
            model_dir,
            config=config,
            dtype=dtype,
            attn_implementation=ATTN_IMPLEMENTATION,
            local_files_only=True,
            output_loading_info=True,
            device_map={"": device},
            use_kernels=False,
        )  # transformers would otherwise fetch layer kernels from the Hub for CUDA devices
        model, info = loaded
    except (OSError, ValueError, RuntimeError, KeyError) as exc:  # unreadable or inconsistent files
        raise ModelLoadError(f"{model_dir}: {' '.join(str(exc).split())[:300]}") from None
    problems = [
        f"{what}: {', '.join(sorted(names)[:8])}"
        for what, names in (
            ("weights missing from the checkpoint", info.get("missing_keys")),
            ("checkpoint tensors the model does not use", info.get("unexpected_keys")),
            ("tensors of the wrong shape", [n for n, *_ in info.get("mismatched_keys") or []]),
        )
        if names
    ]
    if problems:
        raise ModelLoadError(f"{model_dir}: " + "; ".join(problems))
    return model.eval()


def probe(model: TransformersCausalLM, config: Any) -> GenericModelInfo:
    """Run the model on a few tokens, recording what every attention layer passes, and check that
    the paged cache can hold it; then check that a sequence's hidden states depend on nothing but
    its own tokens and cached K/V (see `_check_state_in_kv_only`). Raises UnsupportedModelError."""
    notes: list[str] = []
    max_position = _max_position(config, notes)
    device = next(model.hf.parameters()).device
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(config.get_text_config().vocab_size, (_PROBE_TOKENS + 3,), generator=generator).to(device)
    seq, other = ids[:_PROBE_TOKENS], ids[_PROBE_TOKENS:]
    calls: list[AttentionCall] = []
    try:
        with torch.inference_mode(), _step_context(_Step(None, None, 0, record=calls)):
            model.run_decoder(seq, torch.arange(_PROBE_TOKENS, device=device))
        info = _check_calls(calls, config, _PROBE_TOKENS, max_position, notes)
        model.head_dim = info.head_dim
        _check_state_in_kv_only(model, info, seq, other)
    except UnsupportedModelError:
        raise
    except Exception as exc:
        raise UnsupportedModelError(
            f"{config.model_type!r}: its HF forward fails with tokenmill's attention and no HF cache "
            f"({type(exc).__name__}: {' '.join(str(exc).split())[:160]})"
        ) from None
    return info


def _check_calls(
    calls: list[AttentionCall], config: Any, n: int, max_position: int, notes: list[str]
) -> GenericModelInfo:
    name = config.model_type
    if not calls:
        raise UnsupportedModelError(f"{name!r}: no layer called the attention function")
    layers = [c.layer_idx for c in calls]
    if any(not isinstance(i, int) for i in layers):
        raise UnsupportedModelError(f"{name!r}: an attention layer has no integer layer_idx")
    if sorted(layers) != list(range(len(calls))):
        raise UnsupportedModelError(
            f"{name!r}: attention layers {layers} do not each call attention once (shared K/V across "
            "layers, or layers without attention), which the paged cache does not hold"
        )
    expected = getattr(config.get_text_config(), "num_hidden_layers", len(calls))
    if len(calls) != expected:
        raise UnsupportedModelError(
            f"{name!r}: {len(calls)} of {expected} decoder layers call attention; the others (recurrent, "
            "state-space or convolution layers) keep state the paged KV cache does not hold"
        )
    for c in calls:
        where = f"{name!r} layer {c.layer_idx}"
        if not c.is_causal:
            raise UnsupportedModelError(f"{where}: bidirectional (non-causal) attention is not supported")
        if c.has_mask:
            raise UnsupportedModelError(
                f"{where}: the model passes its own attention mask or position bias "
                "(e.g. ALiBi), which paged attention does not apply"
            )
        if c.q_len != n or c.kv_len != n:
            raise UnsupportedModelError(
                f"{where}: attention over {c.kv_len} keys for {c.q_len} queries of "
                f"{n} tokens (cross-attention or compressed keys) is not supported"
            )
        if c.num_heads % c.num_kv_heads:
            raise UnsupportedModelError(f"{where}: {c.num_heads} query heads for {c.num_kv_heads} K/V heads")
        for key, value in c.kwargs.items():
            if key in _IGNORED_KWARGS:
                continue
            if key in ("sliding_window", "softcap") and isinstance(value, (int, float)) and value > 0:
                continue  # paged attention applies both, per layer
            what = _KNOWN_UNSUPPORTED.get(key, "attention argument")
            raise UnsupportedModelError(
                f"{where}: {what} {key}={_short(value)} is not supported by tokenmill's paged attention"
            )
    kv_heads = {c.num_kv_heads for c in calls}
    if len(kv_heads) > 1:
        raise UnsupportedModelError(
            f"{name!r}: layers differ in K/V heads ({sorted(kv_heads)}); the paged cache "
            "holds one shape for every layer"
        )
    head_dim = max(max(c.k_head_dim, c.v_head_dim) for c in calls)
    if any(c.k_head_dim != c.v_head_dim for c in calls):
        notes.append(
            f"K and V head sizes differ ({calls[0].k_head_dim} vs {calls[0].v_head_dim}): both are "
            f"cached padded to {head_dim}"
        )
    return GenericModelInfo(len(calls), kv_heads.pop(), head_dim, max_position, notes)


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)}>"
    text = repr(value)
    return text if len(text) < 40 else text[:37] + "..."


def _check_state_in_kv_only(
    model: TransformersCausalLM, info: GenericModelInfo, seq: torch.Tensor, other: torch.Tensor
) -> None:
    """`seq` alone, `seq` after another sequence in one flattened batch, and the tail of `seq` as a
    chunk over its cached K/V must give the same hidden states. Layers that carry state along the
    token axis outside attention (convolutions, recurrences, token shifts) would not."""
    n, m = seq.numel(), other.numel()
    device, dtype = seq.device, next(model.hf.parameters()).dtype
    caches = [
        (
            torch.zeros(n + m, info.num_kv_heads, info.head_dim, dtype=dtype, device=device),
            torch.zeros(n + m, info.num_kv_heads, info.head_dim, dtype=dtype, device=device),
        )
        for _ in range(info.num_layers)
    ]
    slots, positions = torch.arange(n + m, device=device), torch.arange(n, device=device)

    def run(
        ids: torch.Tensor, pos: torch.Tensor, slot_mapping: torch.Tensor, prefills: list[PrefillSegment]
    ) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, block_size=n + m, prefills=prefills, num_prefill_tokens=ids.numel()
        )
        with torch.inference_mode():
            return model(ids, pos, caches, meta).float()

    alone = run(seq, positions, slots[:n], [PrefillSegment(0, n, None, None)])
    k = n // 2  # the tail [k, n) as a chunk attending to all n cached positions
    causal = positions[None, :] <= positions[k:, None]
    chunk = run(seq[k:], positions[k:], slots[k:n], [PrefillSegment(0, n - k, slots[:n], causal)])
    batched = run(
        torch.cat([other, seq]),
        torch.cat([torch.arange(m, device=device), positions]),
        torch.cat([slots[n:], slots[:n]]),
        [PrefillSegment(0, m, None, None), PrefillSegment(m, m + n, None, None)],
    )
    tolerance = (1e-3 if dtype == torch.float32 else 5e-2) * alone.abs().max().clamp(min=1e-6)
    for what, got, want in (
        ("a sequence batched after another", batched[m:], alone),
        ("a prompt prefilled in two chunks", chunk, alone[k:]),
    ):
        if not torch.isfinite(got).all() or (got - want).abs().max() > tolerance:
            raise UnsupportedModelError(
                f"{model.hf.config.model_type!r}: {what} gives other hidden states than the sequence alone: the "
                "model carries state along the tokens outside attention (convolution, recurrence or token "
                "shift), which the generic path cannot batch or cache"
            )


def load_generic_model(
    model_dir: Path,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    backend: LinearBackend,
    quantization: QuantizationConfig | None,
) -> tuple[TransformersCausalLM, ModelSpec]:
    """The HF model behind tokenmill's interface, and `spec` with the cache shapes the probe found.
    Its nn.Linear modules become tokenmill's linear layers (the same weights), each given its
    method as on the native path (`--quantization`, packing)."""
    try:
        hf_model = load_hf_model(model_dir, dtype, device)
        replace_linear_modules(hf_model)
        model = TransformersCausalLM(hf_model, head_dim=0)
        info = probe(model, hf_model.config)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{model_dir}: {exc}") from None
    assign_linear_methods(hf_model, backend, quantization, {})  # (after the probe: the float weights ran it)
    for note in info.notes:
        logger.warning("%s: %s", model_dir.name, note)
    logger.info("%s: %s on the generic transformers path", model_dir.name, type(hf_model).__name__)
    return model, dataclasses.replace(
        spec,
        num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        max_position=info.max_position,
    )


# -- registry -------------------------------------------------------------------------------------

# config.json keys (by their standard names) a model must state: transformers' config classes
# default them silently, and weights of a defaulted shape can still load (e.g. the head count).
_REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def config_spec(config: Any) -> ModelSpec:
    """A spec from the config alone. The engine's cache shapes (layers, K/V heads, head size,
    context) are replaced at load by what `probe` finds; the rest describe native model code.
    A model the generic path cannot run fails here, with the reason (`check_config`)."""
    check_config(config)
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", 0) or 0
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0)
    return ModelSpec(
        model_type=config.model_type,
        hidden_size=text.hidden_size,
        num_layers=text.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        intermediate_size=getattr(text, "intermediate_size", None) or 0,
        vocab_size=text.vocab_size,
        max_position=_max_position(text, []),
        norm_eps=0.0,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        activation="",
        rope=None,
        eos_token_ids=[],
        bos_token_id=getattr(config, "bos_token_id", None),
        hf_config=config,
    )


def generic_architecture(model_type: str) -> Architecture | None:
    """The generic path's entry for any model type transformers knows, else None. Whether it
    really runs is decided by `config_spec` and at load (`check_config`, `probe`), with the reason."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        return None
    return _architecture(model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type))


@functools.cache
def _architecture(model_type: str, class_name: str | None) -> Architecture:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    attribute_map = getattr(config_class, "attribute_map", {})
    keys = set(inspect.signature(config_class.__init__).parameters)
    required = tuple(key for key in (attribute_map.get(k, k) for k in _REQUIRED_KEYS) if key in keys)
    tested = model_type in TESTED_ARCHITECTURES
    return Architecture(
        model_type,
        (class_name,) if class_name else (),
        TransformersCausalLM,
        config_spec,
        required,
        path=GENERIC,
        features="HF modeling code + paged attention; tested (greedy == HF)"
        if tested
        else "HF modeling code + paged attention; untested",
    )


def untested_architectures() -> list[tuple[Architecture, str | None]]:
    """Every other causal-LM type of the installed transformers, with the reason the generic path
    refuses it (judged from its default config; None when it would try to run it, untested)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rows = []
    for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        if model_type in TESTED_ARCHITECTURES:
            continue
        reason = None
        try:
            check_config(CONFIG_MAPPING[model_type]())
        except UnsupportedModelError as exc:
            reason = str(exc)
        except Exception:
            pass
        rows.append((_architecture(model_type, class_name), reason))
    return rows


def _register() -> None:
    for model_type in sorted(TESTED_ARCHITECTURES):
        arch = generic_architecture(model_type)
        if arch is not None:
            register(arch)
    register_resolver(generic_architecture)


_register()
