"""Assembles an engine from its config (`build_engine`): the device and precision, the model with
its LoRA slots, draft model and tensor-parallel workers, the KV cache and its block allocator, the
scheduler, the runner and its sampler, the input and output processors, structured outputs, and
the model thread of overlap scheduling. `LLMEngine` runs what this builds.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.engine import faults
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core.block_manager import BlockAllocator
from tokenmill.engine.core.request import Request
from tokenmill.engine.core.scheduler import Scheduler
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.precision import Precision, resolve_kv_cache_dtype, resolve_precision
from tokenmill.engine.result_cache import ResultCache
from tokenmill.engine.sample.sampler import Sampler
from tokenmill.engine.setup import (
    batch_invariance,
    check_tensor_parallel,
    generation_defaults,
    load_prepared_model,
    load_tokenizer,
    resolve_device,
)
from tokenmill.engine.spec_decode import check_speculative_config
from tokenmill.engine.spec_decode.draft import DraftProposer, check_draft_model, load_draft_model
from tokenmill.engine.spec_decode.ngram import NgramProposer
from tokenmill.engine.structured_output.manager import StructuredOutputManager
from tokenmill.engine.worker.cuda_graphs import DecodeGraphs
from tokenmill.engine.worker.kv_cache import KVCache, num_kv_blocks
from tokenmill.engine.worker.model_runner import ModelRunner
from tokenmill.engine.worker.tensor_parallel import TensorParallelGroup, rank_device
from tokenmill.lora.batch import LoRASlots
from tokenmill.lora.layers import LoRAModel
from tokenmill.lora.registry import LoRARegistry, parse_lora_module
from tokenmill.models.model_loader.hf_hub import HubOptions
from tokenmill.models.model_loader.hub import default_served_name, resolve_adapter, resolve_model, resolve_tokenizer
from tokenmill.models.spec import ModelSpec

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """What an engine runs; `close` stops what runs on other threads and processes."""

    config: EngineConfig
    device: torch.device
    model_dir: Path
    served_model_names: list[str]  # the names requests may use; responses report the first
    generation_defaults: dict[str, Any]  # sampling settings of requests that leave them unset (by SamplingParams name)
    precision: Precision
    kv_dtype: torch.dtype
    tokenizer: Any  # None: the model has none (token ids in and out)
    model: torch.nn.Module
    spec: ModelSpec
    max_model_len: int  # the context, within the model's, the draft model's and the KV cache's
    tp_group: TensorParallelGroup | None  # the other tensor-parallel ranks
    batch_invariant: bool  # each request's output independent of what shares its steps (docs/batch-invariance.md)
    lora_model: LoRAModel | None  # the model's LoRA target layers (None: LoRA is off)
    loras: LoRARegistry | None  # the adapters requests may name
    allocator: BlockAllocator
    kv_cache: KVCache
    scheduler: Scheduler
    runner: ModelRunner
    drafter: DraftProposer | None  # --speculative-method draft
    structured_outputs: StructuredOutputManager[Request]
    input_processor: InputProcessor
    output_processor: OutputProcessor
    model_thread: ThreadPoolExecutor | None  # overlap scheduling: the model runs here, a step ahead

    @property
    def model_name(self) -> str:
        """The name responses report."""
        return self.served_model_names[0]

    def close(self) -> None:
        """Stop the model thread, the grammar compilers and the tensor-parallel workers."""
        if self.model_thread is not None:
            self.model_thread.shutdown(wait=True)
        self.structured_outputs.close()
        if self.tp_group is not None:
            self.tp_group.close()


@dataclass(frozen=True)
class _LoadedModel:
    """The model and what comes with it, before the KV cache is sized."""

    device: torch.device
    model_dir: Path
    precision: Precision
    tokenizer: Any
    model: torch.nn.Module
    spec: ModelSpec
    max_model_len: int
    tp_group: TensorParallelGroup | None
    lora_model: LoRAModel | None
    draft: tuple[torch.nn.Module, ModelSpec] | None  # --speculative-method draft


def build_engine(config: EngineConfig, progress: bool = True) -> EngineParts:
    """Every part of an engine for `config`, ready to step; what was started is stopped again when a
    later part fails."""
    device = resolve_device(config.device)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    config.check_sources()
    model_dir = resolve_model(config.model, config.hub_options())
    precision = resolve_precision(config.dtype, device, model_dir)
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, precision.weights)
    tokenizer_dir = (
        resolve_tokenizer(config.tokenizer, config.tokenizer_hub_options()) if config.tokenizer else model_dir
    )
    tokenizer = load_tokenizer(tokenizer_dir, config.chat_template)
    names = config.served_model_names or [default_served_name(config.model, model_dir)]
    defaults = generation_defaults(config.generation_config, model_dir)
    check_speculative_config(config)
    config.check_lora()
    config.check_batch_invariance()
    lora_modules = [parse_lora_module(text) for text in config.lora_modules or ()]
    check_tensor_parallel(config, model_dir, device)
    loaded = _load_model(config, progress, device, model_dir, precision, tokenizer)
    try:
        parts = _assemble(config, loaded, kv_dtype, names, defaults)
    except BaseException:
        if loaded.tp_group is not None:
            loaded.tp_group.close()
        raise
    faults.install(parts)  # test-only hook, off unless TOKENMILL_FAULT_INJECTION=1
    try:
        for module in lora_modules:
            assert parts.loras is not None  # (adapters to load turn LoRA on)
            path = resolve_adapter(module.path, side_hub_options(config))
            parts.loras.load(module.name, str(path), module.base_model_name)
    except BaseException:
        parts.close()
        raise
    return parts


def side_hub_options(config: EngineConfig) -> HubOptions:
    """How repository ids other than --model's (the draft model, LoRA adapters) are fetched: the same
    cache and token, their default revision."""
    return HubOptions(None, config.download_dir, config.hf_token)


def _load_model(
    config: EngineConfig, progress: bool, device: torch.device, model_dir: Path, precision: Precision, tokenizer: Any
) -> _LoadedModel:
    """The model on every tensor-parallel rank, wrapped for LoRA, and the draft model."""
    tp_group = None
    if config.tensor_parallel_size > 1:
        device = rank_device(device, 0)
        tp_group = TensorParallelGroup(config, device)  # workers load their shards meanwhile
    try:
        model, spec = load_prepared_model(config, model_dir, precision, device, progress=progress)
        # LoRA: the model's target layers wrapped, with --max-loras slots each (before the KV budget is taken).
        lora_model = (
            LoRAModel(model, config.max_loras, config.max_lora_rank, precision.compute, device)
            if config.lora_enabled
            else None
        )
        max_model_len = min(config.max_model_len or spec.max_position, spec.max_position)
        draft = None
        if config.speculative_method == "draft":
            draft = _load_draft(config, spec, tokenizer, precision, device)
            if draft[1].max_position < max_model_len:
                logger.warning(
                    "the draft model's context is %d tokens: max_model_len lowered from %d",
                    draft[1].max_position,
                    max_model_len,
                )
                max_model_len = draft[1].max_position
    except BaseException:
        if tp_group is not None:
            tp_group.close()
        raise
    return _LoadedModel(
        device, model_dir, precision, tokenizer, model, spec, max_model_len, tp_group, lora_model, draft
    )


def _load_draft(
    config: EngineConfig, target: ModelSpec, tokenizer: Any, precision: Precision, device: torch.device
) -> tuple[torch.nn.Module, ModelSpec]:
    draft_dir = resolve_model(config.speculative_model, side_hub_options(config))
    draft_spec = check_draft_model(draft_dir, target, tokenizer)
    return load_draft_model(config, draft_dir, precision, device), draft_spec


def _assemble(
    config: EngineConfig,
    loaded: _LoadedModel,
    kv_dtype: torch.dtype,
    served_model_names: list[str],
    generation_defaults: dict[str, Any],
) -> EngineParts:
    """The KV cache (sized to the memory budget, which may lower the context) and everything that
    runs steps over it."""
    spec, device, bs = loaded.spec, loaded.device, config.block_size
    dtype = loaded.precision.compute
    invariant = batch_invariance(config, device, dtype)
    draft_bytes = DraftProposer.bytes_per_block(loaded.draft[1], bs, dtype) if loaded.draft else 0
    max_model_len = loaded.max_model_len
    num_blocks, per_block = num_kv_blocks(config, spec, kv_dtype, device, max_model_len, draft_bytes)
    usable_tokens = (num_blocks - 1) * bs  # block 0 is the allocator's zero block
    if usable_tokens < max_model_len:
        logger.warning("KV cache holds %d tokens: max_model_len lowered from %d", usable_tokens, max_model_len)
        max_model_len = usable_tokens
    if loaded.tp_group is not None:
        loaded.tp_group.broadcast(num_blocks)  # every rank's cache has the same block ids
    allocator = BlockAllocator(num_blocks, bs, config.enable_prefix_caching)
    kv_cache = KVCache(spec.num_layers, num_blocks, bs, spec.num_kv_heads, spec.head_dim, kv_dtype, device)
    # Structured outputs: grammars compile on their own threads; requests wait there meanwhile.
    structured_outputs: StructuredOutputManager[Request] = StructuredOutputManager(
        loaded.tokenizer, spec.vocab_size, spec.eos_token_ids
    )
    ngram = config.speculative_method == "ngram"
    lora = loaded.lora_model
    scheduler = Scheduler(
        allocator,
        config.max_num_seqs,
        max(config.max_num_batched_tokens, 1),
        max_model_len,
        spec.eos_token_ids,
        config.num_speculative_tokens if config.speculative_method else 0,
        NgramProposer(config.ngram_prompt_lookup_min, config.ngram_prompt_lookup_max) if ngram else None,
        lora.max_loras if lora else None,
        structured_outputs,
        config.scheduling_policy,
    )
    drafter = DraftProposer(*loaded.draft, num_blocks, bs, dtype, device) if loaded.draft is not None else None
    runner = ModelRunner(
        loaded.model,
        kv_cache,
        bs,
        Sampler(spec.vocab_size, config.seed, device),
        device,
        loaded.tp_group,
        _decode_graphs(config, loaded, kv_cache, max_model_len, invariant),
        lora,
        LoRASlots(lora.max_loras) if lora else None,
        invariant,
    )
    logger.info(
        "KV cache: %d blocks x %d tokens, %s (%.1f MiB%s)",
        num_blocks,
        bs,
        str(kv_dtype).removeprefix("torch."),
        num_blocks * per_block / 2**20,
        ", the draft model's included" if loaded.draft else "",
    )
    _log_speculation(config)
    logger.info("batch-invariant steps: %s (docs/batch-invariance.md)", "on" if invariant else "off")
    result_cache = ResultCache(config.result_cache_size)
    return EngineParts(
        config=config,
        device=device,
        model_dir=loaded.model_dir,
        served_model_names=served_model_names,
        generation_defaults=generation_defaults,
        precision=loaded.precision,
        kv_dtype=kv_dtype,
        tokenizer=loaded.tokenizer,
        model=loaded.model,
        spec=spec,
        max_model_len=max_model_len,
        tp_group=loaded.tp_group,
        batch_invariant=invariant,
        lora_model=lora,
        loras=(
            None
            if lora is None
            else LoRARegistry(
                lora.targets, lora.hf_to_local, config.max_lora_rank, dtype, served_model_names[0], config.max_cpu_loras
            )
        ),
        allocator=allocator,
        kv_cache=kv_cache,
        scheduler=scheduler,
        runner=runner,
        drafter=drafter,
        structured_outputs=structured_outputs,
        input_processor=InputProcessor(loaded.tokenizer, spec.vocab_size, max_model_len, config.max_logprobs),
        output_processor=OutputProcessor(loaded.tokenizer, result_cache, scheduler.finish, spec.eos_token_ids),
        model_thread=_model_thread(config, device),
    )


def _decode_graphs(
    config: EngineConfig, loaded: _LoadedModel, kv_cache: KVCache, max_model_len: int, batch_invariant: bool
) -> DecodeGraphs | None:
    if not config.cuda_graphs:
        return None
    if loaded.device.type != "cuda":
        logger.warning("--cuda-graphs needs a CUDA device: decode steps run eagerly on %s", loaded.device)
        return None
    if loaded.tp_group is not None:
        logger.warning("--cuda-graphs is not used with tensor parallelism: decode steps run eagerly")
        return None
    if batch_invariant:  # (graphs replay padded batch shapes, not the fixed ones)
        logger.warning("--cuda-graphs is not used with --batch-invariant: decode steps run eagerly")
        return None
    if not getattr(loaded.model, "supports_cuda_graphs", True):
        reason = getattr(loaded.model, "cuda_graphs_blocker", None) or (
            "this model's MoE experts run as a per-expert loop here (int8, or no grouped_mm for "
            f"{loaded.precision.compute} on this GPU), which capture forbids"
        )
        logger.warning("--cuda-graphs: %s: decode steps run eagerly", reason)
        return None
    return DecodeGraphs(
        loaded.model,
        kv_cache,
        config.block_size,
        config.max_num_seqs,
        -(-max_model_len // config.block_size),
        loaded.device,
    )


def _log_speculation(config: EngineConfig) -> None:
    if not config.speculative_method:
        return
    source = (
        f"n-grams of {config.ngram_prompt_lookup_min}-{config.ngram_prompt_lookup_max} tokens looked "
        "up in the prompt and output"
        if config.speculative_method == "ngram"
        else f"draft model {config.speculative_model}"
    )
    logger.info(
        "speculative decoding: up to %d draft tokens per sequence and step from %s",
        config.num_speculative_tokens,
        source,
    )


def _model_thread(config: EngineConfig, device: torch.device) -> ThreadPoolExecutor | None:
    """With overlap scheduling, the thread the model runs on, one step ahead of the completions."""
    overlap = config.overlap_scheduling
    if config.speculative_method is not None:
        if overlap:
            logger.warning(
                "--overlap-scheduling is off with speculative decoding: drafts are proposed from "
                "each step's tokens, so a step cannot be planned before the previous one lands"
            )
        return None
    if overlap is None:  # auto: a GPU runs the model while the CPU prepares; a CPU has no core to spare
        overlap = device.type == "cuda"
    if not overlap:
        return None
    return ThreadPoolExecutor(
        1,
        "tokenmill-model",
        initializer=_init_model_thread,
        initargs=(torch.get_num_threads(), _indexed(device)),
    )


def _init_model_thread(num_threads: int, device: torch.device) -> None:
    torch.set_num_threads(num_threads)  # intra-op threads are set per calling thread
    if device.type == "cuda":
        # So is the current CUDA device. An index-less "cuda" means the creating thread's current device
        # (resolved by the caller): set_device rejects a device without an index.
        torch.cuda.set_device(device.index)


def _indexed(device: torch.device) -> torch.device:
    """A CUDA device with its index: an index-less "cuda" is this thread's current device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
