"""Engine setup: the device, the model (loaded and prepared alike on every tensor-parallel rank)
and the tokenizer."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.precision import Precision
from tokenmill.kernels.cpu_caps import detect
from tokenmill.kernels.ops import cpu_kernels_available
from tokenmill.models.families.llama import RMSNorm
from tokenmill.models.layers.fixed_shapes import fix_row_shapes
from tokenmill.models.layers.fused_layer import fuse_decoder_layers
from tokenmill.models.layers.linear import UNQUANTIZED, Linear
from tokenmill.models.layers.moe import GroupedExperts
from tokenmill.models.layers.packed_linear import has_row_invariant_method
from tokenmill.models.layers.parallel import TPInfo, check_shardable
from tokenmill.models.model_loader.linear_setup import process_weights_after_loading
from tokenmill.models.model_loader.loader import load_model, load_spec, resolve_architecture
from tokenmill.models.model_loader.registry import NATIVE
from tokenmill.models.spec import ModelSpec

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    return torch.device(name)


def check_tensor_parallel(config: EngineConfig, model_dir: Path, device: torch.device) -> None:
    """Refuse a tensor-parallel setup that cannot work, before any worker process starts."""
    world = config.tensor_parallel_size
    if world < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {world}")
    if device.type == "cuda" and world > torch.cuda.device_count():
        raise ValueError(f"--tensor-parallel-size {world} needs as many GPUs; {torch.cuda.device_count()} visible")
    if world == 1:
        return
    if resolve_architecture(model_dir, config.model_impl)[0].path != NATIVE:
        raise ValueError(
            "--tensor-parallel-size > 1 needs the native path (`tokenmill models`), not the generic transformers path"
        )
    check_shardable(load_spec(model_dir), world)


def batch_invariance(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether steps run batch-invariant (docs/batch-invariance.md): --batch-invariant, refused where it
    cannot hold, or by default on wherever tokenmill's CPU kernels compute the model and nothing blocks
    it: on every CPU kind its row-invariant methods cost under 5% of throughput (docs/batch-invariance.md,
    per CPU kind; `python bench/batch_invariance.py cost` and `serve` measure it). Off by default on CUDA
    and without the kernels, where library kernels on fixed shapes pay for padding."""
    config.check_batch_invariance()
    kernels = cpu_kernels_available(device)
    cpu_blockers = {
        "--no-packed-linear": kernels and not packs_linear_weights(config, device),
        f"--dtype {str(dtype).removeprefix('torch.')} on this CPU": kernels and not has_row_invariant_method(dtype),
        # (the int8 kernel multiplies bf16 steps of 12 rows and more on AMX-bf16 tiles, by the weights
        # rounded to bf16: other numbers than the int8 sums of smaller steps)
        "--quantization int8 under bf16 activations on an AMX CPU": (
            kernels and config.quantization == "int8" and dtype == torch.bfloat16 and detect().amx_bf16
        ),
    }
    blockers = [name for name, blocks in cpu_blockers.items() if blocks]
    if config.batch_invariant is None:
        return kernels and not blockers and not config.batch_invariance_blockers()
    if config.batch_invariant and blockers:
        raise ValueError(f"--batch-invariant cannot hold with {' or '.join(blockers)}; leave it off there")
    return config.batch_invariant


def load_prepared_model(
    config: EngineConfig,
    model_dir: Path,
    precision: Precision,
    device: torch.device,
    rank: int = 0,
    progress: bool = False,
) -> tuple[torch.nn.Module, ModelSpec]:
    """This rank's share of the model in `precision`, quantized, packed or compiled as the config asks."""
    model, spec = load_model(
        model_dir,
        precision.compute,
        device,
        progress=progress,
        tp=TPInfo(rank, config.tensor_parallel_size),
        max_model_len=config.max_model_len,
        model_impl=config.model_impl,
        packed_linear=packs_linear_weights(config, device),
        quantization=config.quantization,
        batch_invariant=batch_invariance(config, device, precision.compute),
    )
    if precision.weights != precision.compute:
        round_weights(model, precision.weights)
    prepare_model(model, config, device, precision.compute)
    return model, spec


@torch.no_grad()
def round_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating-point parameter rounded to `dtype`'s values. In place (the storage keeps the
    compute dtype: packing then holds the linear weights in `dtype`, see packed_linear.panel_dtype),
    except in modules that compute in their weights' dtype (MoE expert stacks): held in `dtype`. The
    tensors a quantized layer's method declared (a checkpoint's scales) stay as they are."""
    for module in model.modules():
        narrow = getattr(module, "computes_in_weight_dtype", False)
        kept = _quantized_tensor_names(module)
        for name, parameter in module.named_parameters(recurse=False):
            if not parameter.is_floating_point() or name in kept:
                continue
            if narrow:
                parameter.data = parameter.data.to(dtype)
            else:
                parameter.copy_(parameter.to(dtype))


def _quantized_tensor_names(module: torch.nn.Module) -> tuple[str, ...]:
    """The tensors a linear layer's quantized method declared (none for a float weight)."""
    if isinstance(module, Linear) and module.quant_method.tensor_names != UNQUANTIZED.tensor_names:
        return module.quant_method.tensor_names
    return ()


def packs_linear_weights(config: EngineConfig, device: torch.device) -> bool:
    """Whether float linear layers are packed for tokenmill's CPU kernels or oneDNN (not under
    --compile: inductor cannot lower ops on weights it did not pack itself)."""
    return config.packed_linear and device.type == "cpu" and not config.compile


def prepare_model(model: torch.nn.Module, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
    """The loaded weights in their linear methods' layouts, decoder layers fused, the step
    compiled, as the config asks (every TP rank alike)."""
    process_weights_after_loading(model)
    if config.fused_layers and packs_linear_weights(config, device):
        fuse_decoder_layers(model)  # (where every projection's method takes the fused layer)
    if batch_invariance(config, device, dtype):
        _hold_batch_invariance(model, device)
    if config.compile:
        # The dense parts of the step (attention stays eager); the token count is dynamic.
        logger.info("compiling the model step with torch.compile (first steps are slow)")
        model.forward = torch.compile(model.forward, dynamic=True)


def _hold_batch_invariance(model: torch.nn.Module, device: torch.device) -> None:
    """Where tokenmill's row-invariant kernels do not run (CUDA, or a CPU without them), norms on fixed
    shapes (linear layers got methods on fixed shapes at load); a warning for what stays outside the
    contract (MoE experts)."""
    if not cpu_kernels_available(device):
        count = fix_row_shapes(model, (RMSNorm, torch.nn.LayerNorm))
        logger.info("--batch-invariant: linear layers and %d norms run on fixed-size chunks of rows", count)
    if any(isinstance(module, GroupedExperts) for module in model.modules()):
        logger.warning(
            "--batch-invariant: this model's MoE experts multiply the rows routed to each expert in one "
            "GEMM whose size changes step by step: its attention and dense layers are batch-invariant, "
            "its experts' sums are not (--quantization int8 runs them as invariant linear layers)"
        )


def load_tokenizer(model_dir: Path, chat_template: str | None = None) -> Any:
    """The model's tokenizer, or None (then only token-id prompts work); `chat_template`
    (--chat-template: a file or the template itself) replaces the tokenizer's."""
    template = load_chat_template(chat_template) if chat_template is not None else None
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError) as exc:
        if template is not None:
            raise ValueError(f"--chat-template needs a tokenizer, and {model_dir} has no usable one ({exc})") from None
        logger.warning("no usable tokenizer in %s (%s): only token-id prompts will work", model_dir, exc)
        return None
    if getattr(tokenizer, "backend_tokenizer", None) is None:  # incremental detokenization needs `tokenizers`
        raise ValueError(
            f"the tokenizer in {model_dir} ({type(tokenizer).__name__}) has no fast (tokenizers) "
            "backend; tokenmill needs one (a tokenizer.json)"
        )
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


_JINJA_MARKS = ("{", "}", "\n")


def load_chat_template(value: str) -> str:
    """--chat-template, as vLLM reads it: the file it names, or else (when it looks like a template,
    not a path) the template itself, with backslash escapes such as \\n decoded. Checked to parse."""
    import codecs

    import jinja2

    path = Path(value).expanduser()
    if path.is_file():
        template = path.read_text()
    elif any(mark in value for mark in _JINJA_MARKS):
        template = codecs.decode(value, "unicode_escape")
    else:
        raise ValueError(f"--chat-template {value!r}: no such file (and not a Jinja template either)")
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: not a valid Jinja template (line {exc.lineno}: {exc.message})") from None
    return template


# generation_config.json keys that become request defaults (as vLLM applies them), by their
# SamplingParams name.
GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(choice: str, model_dir: Path) -> dict[str, Any]:
    """--generation-config: the sampling settings requests get where they set none (by SamplingParams
    name): from the model's generation_config.json (auto), none (vllm), or another directory's.
    Only the values it sets apart from transformers' defaults count (its top_k of 50 does not)."""
    if choice == "vllm":
        return {}
    directory = model_dir if choice == "auto" else Path(choice).expanduser()
    if not (directory / "generation_config.json").is_file():
        if choice == "auto":
            return {}
        raise ValueError(
            f"--generation-config {choice}: no generation_config.json there (expected auto, vllm or a directory)"
        )
    from transformers import GenerationConfig

    try:
        diff = GenerationConfig.from_pretrained(directory).to_diff_dict()
    except (OSError, ValueError) as exc:
        raise ValueError(f"--generation-config: {directory / 'generation_config.json'}: {exc}") from None
    defaults = {ours: diff[theirs] for theirs, ours in GENERATION_DEFAULTS.items() if diff.get(theirs) is not None}
    if defaults:
        logger.info(
            "requests that do not set them get the model's sampling defaults %s (from %s; --generation-config vllm: "
            "none)",
            defaults,
            directory / "generation_config.json",
        )
    return defaults
