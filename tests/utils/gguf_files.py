"""GGUF files written by the `gguf` package's own writer from small Hugging Face models, in any of
the tensor types tokenmill reads, for the GGUF tests.

The models share a tiny byte-level BPE vocabulary (the 256 byte symbols, a few merges, ChatML's
special tokens: `TINY_VOCAB_SIZE` tokens) written as GGUF tokenizer fields, so that reading a file's
metadata takes no time; hyperparameters come from the model's config; tensors are named and laid
out as llama.cpp's converter writes them (Llama's q/k rows permuted for its RoPE). Float and the
Q8_0/Q4_0/Q4_1 types are quantized by gguf's reference code; gguf has no K-quant quantizer, so
Q4_K/Q5_K/Q6_K tensors are random blocks of the right layout, with small scales: the file's
dequantized values are the model then (what the tests compare against).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# The test models' architectures, by their GGUF name.
ARCHITECTURES = {
    "llama": "LLAMA",
    "qwen2": "QWEN2",
    "qwen3": "QWEN3",
    "phi3": "PHI3",
    "gemma2": "GEMMA2",
    "gemma3": "GEMMA3",
}
# transformers' model types of the GGUF architectures, where they differ
MODEL_TYPES = {"gemma3": "gemma3_text"}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 (as SmolLM2's)
MERGES = (("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("r", "e"))
TINY_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256 + len(MERGES)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_gguf(model_dir: Path, target: Path, tensor_type: str, *, seed: int = 0) -> Path:
    """The HF model in `model_dir` (an architecture of ARCHITECTURES, the tiny vocabulary) as a GGUF file
    whose matrices are of `tensor_type` (norms and other vectors stay F32, as llama.cpp keeps them)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    arch = {model_type: name for name, model_type in MODEL_TYPES.items()}.get(config.model_type, config.model_type)
    writer = gguf.GGUFWriter(target, arch)
    writer.add_name(f"tiny {arch}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    # (Gemma 3: one RoPE a layer type; the file holds the global layers', as llama.cpp writes it)
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    if arch in ("qwen3", "gemma2", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_sliding_window(config.sliding_window)
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(_file_type(tensor_type))
    _add_tiny_tokenizer(writer)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, ARCHITECTURES[arch]), config.num_hidden_layers)
    rng = np.random.default_rng(seed)
    state = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(path))
    for hf_name, tensor in state.items():
        if config.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = f"{names.get_name(base)}.{suffix}"
        values = tensor.float().numpy()
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in gguf_name else config.num_key_value_heads
            values = _permute_for_rope(values, heads)
        if arch in ("gemma2", "gemma3") and gguf_name.endswith("norm.weight"):
            values = values + 1  # (llama.cpp stores Gemma's (1 + w) norm weights)
        _add_tensor(writer, gguf_name, values, tensor_type if values.ndim == 2 else "F32", rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def _add_tensor(writer, name: str, values: np.ndarray, tensor_type: str, rng: np.random.Generator) -> None:
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, tensor_type)
    if tensor_type == "F32":
        writer.add_tensor(name, values.astype(np.float32))
    elif tensor_type == "F16":
        writer.add_tensor(name, values.astype(np.float16))
    elif tensor_type in K_QUANTS:
        writer.add_tensor(name, random_k_blocks(values.shape, tensor_type, rng), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)


def random_k_blocks(shape: tuple[int, ...], tensor_type: str, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a K-quant type for a matrix of `shape`, raw bytes [rows, row bytes]; for the
    ones tokenmill reads, super-block scales that keep the values near N(0, 0.1)-sized."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, tensor_type)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, columns = shape
    blocks = rng.integers(0, 256, size=(rows, columns // block_size, type_size), dtype=np.uint8)
    if tensor_type == "Q6_K":  # ..., d (fp16) last: value = d * scale (int8) * (q - 32)
        blocks[..., -2:] = _fp16_bytes(rng, blocks.shape[:2], 0.1 / (127 * 32))
    elif tensor_type in ("Q4_K", "Q5_K"):  # d, dmin (fp16) first: value = d * scale * q - dmin * min
        levels = 15 if tensor_type == "Q4_K" else 31
        blocks[..., 0:2] = _fp16_bytes(rng, blocks.shape[:2], 0.2 / (63 * levels))
        blocks[..., 2:4] = _fp16_bytes(rng, blocks.shape[:2], 0.1 / 63)
    return blocks.reshape(rows, -1)


def _fp16_bytes(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    values = (rng.uniform(0.5, 1.5, size=shape) * scale).astype(np.float16)
    return values[..., None].view(np.uint8).reshape(*shape, 2)


def _permute_for_rope(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Llama's q/k rows (transformers reverses it)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _file_type(tensor_type: str) -> int:
    import gguf

    name = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16"}.get(tensor_type, "MOSTLY_" + tensor_type)
    if tensor_type in K_QUANTS:
        name += "_M" if tensor_type != "Q6_K" else ""
    return int(getattr(gguf.LlamaFileType, name))


def _add_tiny_tokenizer(writer) -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*SPECIAL_TOKENS, *bytes_to_unicode().values(), *("".join(m) for m in MERGES)]
    assert len(tokens) == TINY_VOCAB_SIZE
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS)))
    writer.add_token_merges([" ".join(m) for m in MERGES])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def tiny_config(architecture: str = "llama", **overrides):
    """A small config of `architecture` over the tiny vocabulary: widths that every GGUF type's
    blocks divide (256 for the K-quants), sharp enough attention for greedy tests (see conftest)."""
    from transformers import AutoConfig

    values = dict(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    if architecture == "qwen3":
        values["head_dim"] = 128  # (transformers reads no head_dim from a Qwen3 GGUF: its default, 128)
    if architecture in ("gemma2", "gemma3"):
        values.update(head_dim=64, sliding_window=16, query_pre_attn_scalar=64)
    return AutoConfig.for_model(MODEL_TYPES.get(architecture, architecture), **{**values, **overrides})


def hf_model_from_gguf(path: Path) -> torch.nn.Module:
    """transformers' own reading of a GGUF file: the model with its dequantized weights, in fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
