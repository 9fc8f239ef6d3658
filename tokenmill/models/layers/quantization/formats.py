"""Pre-quantized checkpoints: GPTQ (4 and 8 bit, act-order g_idx, gptq v1 and gptqmodel's v2 zero
points), AWQ (GEMM packing) and compressed-tensors (pack-quantized W4A16/W8A16, int-quantized W8A8,
float-quantized FP8 per tensor, channel or 128x128 block).

Each format's method declares the tensors the checkpoint holds for a layer (with the dim its fused
parts join along) and, once they are loaded, checks them (a bad one is refused, naming it). On
tokenmill's CPU kernels the layers then keep the checkpoint's own integers: 4-bit ones in the 4-bit
panels of int4.py (values, zero points, fp16 scales, act order's input permutation), symmetric 8-bit
ones (GPTQ, W8A16) in the int8 panels of int8.py with their scales, W8A8 ones in the int8 x int8
panels of w8a8.py, FP8 ones as e4m3 bytes in the panels of fp8.py. Other layers (asymmetric 8-bit
GPTQ, and every format where the kernels do not run) are turned into the weight they encode,
`(q - zero) * scale` per group of inputs (FP8: `w * scale`), computed exactly in fp32, and run on the
float method the engine gives float layers (panels, oneDNN, or torch's GEMM) on that weight in the
model's dtype; W8A8 layers there quantize each token's activations to int8 (dynamic per-token
scales) as the checkpoint's scheme does.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.models.layers.linear import FusedProjection, Linear, LinearBackend, LinearMethod, linear_parameter
from tokenmill.models.layers.quantization import QuantizationConfig
from tokenmill.models.layers.quantization.fp8 import FP8LinearKernelMethod, FP8Weight
from tokenmill.models.layers.quantization.gguf import QUANT_METHOD as GGUF_METHOD
from tokenmill.models.layers.quantization.gguf import GGUFConfig
from tokenmill.models.layers.quantization.int4 import Int4LinearMethod, Int4Weight
from tokenmill.models.layers.quantization.int8 import Int8LinearMethod, Int8Weight
from tokenmill.models.layers.quantization.w8a8 import W8A8LinearMethod

# AWQ's GEMM packing: the 8 nibbles of an int32 hold output columns in this order.
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words of 32 / bits values each (the lowest bits first) unpacked along `dim`, as int32."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = packed.unsqueeze(dim + 1) >> shifts.view([-1 if d == dim + 1 else 1 for d in range(packed.dim() + 1)])
    values = values & ((1 << bits) - 1)
    shape = list(packed.shape)
    shape[dim] *= per_word
    return values.reshape(shape)


class QuantizedLinearMethod(LinearMethod):
    """A layer whose checkpoint tensors encode its weight (a format's subclass says how); computed on
    `float_method` over the decoded weight."""

    name = "quantized"

    def __init__(self, float_method: LinearMethod, dtype: torch.dtype) -> None:
        self.float_method, self.dtype = float_method, dtype

    def decode(self, layer: Linear) -> torch.Tensor:
        """The fp32 weight [out, in] the loaded tensors encode (checked: a bad tensor names itself)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: Linear, storage: list[torch.Tensor]) -> None:
        weight = self.decode(layer)
        for name in self.tensor_names:
            delattr(layer, name)
        layer.weight = nn.Parameter(weight.to(self.dtype), requires_grad=False)
        self.float_method.process_weights_after_loading(layer, [])

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.float_method.apply(layer, x)

    def logits(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.float_method.logits(layer, x)

    def dequantized(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        return self.float_method.dequantized(layer, dtype)

    def fused_projection(self, layer: Linear, activations: torch.dtype) -> FusedProjection | None:
        return self.float_method.fused_projection(layer, activations)

    def streamed_tensors(self, layer: Linear) -> list[torch.Tensor]:
        return self.float_method.streamed_tensors(layer)

    def describe(self, layer: Linear) -> str:
        return f"{self.name} on {self.float_method.describe(layer)}"


def _check(layer_name: str, tensor_name: str, ok: bool, problem: str) -> None:
    if not ok:
        raise ModelLoadError(f"tensor {layer_name}.{tensor_name}: {problem}")


def _contiguous_groups(
    name: str, g_idx_name: str, values: torch.Tensor, group: torch.Tensor, groups: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Values [out, in] whose input i is in group `group[i]`, with their inputs in group order, and
    the permutation that put them there (act order), or none when the groups are in input order
    already; every group must hold in / groups inputs."""
    k = values.shape[1]
    if torch.equal(group, torch.arange(k, device=group.device) * groups // k):
        return values, None
    counts = torch.bincount(group, minlength=groups)
    _check(name, g_idx_name, bool((counts == k // groups).all()), "groups of unequal sizes")
    perm = torch.argsort(group, stable=True)
    return values[:, perm], perm


def _grouped(
    name: str,
    g_idx_name: str,
    values: torch.Tensor,
    group: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    zero: int,
) -> Int4Weight:
    """4-bit values [out, in] whose input i is in group `group[i]` (scales, zeros: [out, groups]) as an
    Int4Weight of contiguous groups (see _contiguous_groups)."""
    values, perm = _contiguous_groups(name, g_idx_name, values, group, scales.shape[1])
    return Int4Weight(
        values.to(torch.uint8).contiguous(),
        scales.contiguous(),
        None if zeros is None else zeros.to(torch.uint8).contiguous(),
        zero,
        None,
        perm,
    )


def _grouped_int8(
    name: str, g_idx_name: str, values: torch.Tensor, group: torch.Tensor, scales: torch.Tensor
) -> Int8Weight:
    """Signed 8-bit values [out, in] (-128 to 127) in groups `group` as an Int8Weight of contiguous groups."""
    values, perm = _contiguous_groups(name, g_idx_name, values, group, scales.shape[1])
    return Int8Weight(values.to(torch.int8).contiguous(), scales.contiguous(), perm)


def _four_bit(
    method: GPTQLinearMethod | AWQLinearMethod | PackedIntLinearMethod, backend: LinearBackend
) -> LinearMethod:
    """A 4-bit format's layers: on the 4-bit kernels where they run, else decoded to float."""
    return Int4LinearMethod(kernels=True, source=method) if backend.kernels else method


def _eight_bit(
    method: GPTQLinearMethod | PackedIntLinearMethod | Int8ChannelLinearMethod, backend: LinearBackend
) -> LinearMethod:
    """A symmetric 8-bit format's layers (weight-only): on the int8 kernels where they run, with the
    checkpoint's values and scales, else decoded to float."""
    return Int8LinearMethod(kernels=True, source=method) if backend.kernels else method


def _fp8(method: FP8LinearMethod, backend: LinearBackend) -> LinearMethod:
    """An FP8 format's layers: their bytes on the FP8 kernels where they run, else decoded to float."""
    return FP8LinearKernelMethod(method) if backend.kernels else method


def _groups(in_features: int, group_size: int) -> int:
    return 1 if group_size <= 0 else in_features // group_size


class GPTQLinearMethod(QuantizedLinearMethod):
    """GPTQ: qweight [in / (32 / bits), out] int32 (packed along the inputs), qzeros [groups, out /
    (32 / bits)] int32 and scales [groups, out]; g_idx [in], each input's group (act order). v1
    checkpoints (AutoGPTQ, `checkpoint_format` gptq) store each zero point less one."""

    name = "gptq"
    tensor_names = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(
        self, float_method: LinearMethod, dtype: torch.dtype, bits: int, group_size: int, v1_zeros: bool
    ) -> None:
        super().__init__(float_method, dtype)
        self.bits, self.group_size, self.v1_zeros = bits, group_size, v1_zeros

    def create_weights(self, layer: Linear) -> None:
        per_word, k, n = 32 // self.bits, layer.in_features, layer.out_features
        groups = _groups(k, self.group_size)
        linear_parameter(layer, "qweight", (k // per_word, n), torch.int32, output_dim=1)
        linear_parameter(layer, "qzeros", (groups, n // per_word), torch.int32, output_dim=1)
        linear_parameter(layer, "scales", (groups, n), torch.float32, output_dim=1)
        linear_parameter(layer, "g_idx", (k,), torch.int32, output_dim=None)

    def decode(self, layer: Linear) -> torch.Tensor:
        q = unpack_int32(layer.qweight.data, self.bits, dim=0)  # [in, out]
        zeros = unpack_int32(layer.qzeros.data, self.bits, dim=1)  # [groups, out]
        if self.v1_zeros:
            zeros = (zeros + 1) & ((1 << self.bits) - 1)
        g_idx = self._groups(layer)
        return ((q - zeros[g_idx]).float() * layer.scales.data[g_idx]).t().contiguous()

    def _groups(self, layer: Linear) -> torch.Tensor:
        name, g_idx, groups = getattr(layer, "name", "?"), layer.g_idx.data.long(), layer.scales.shape[0]
        _check(name, "g_idx", bool(((g_idx >= 0) & (g_idx < groups)).all()), f"group indices outside [0, {groups})")
        _check(name, "scales", bool(layer.scales.isfinite().all()), "not finite")
        return g_idx

    def decode_int4(self, layer: Linear) -> Int4Weight:
        zeros = unpack_int32(layer.qzeros.data, self.bits, dim=1)
        if self.v1_zeros:
            zeros = (zeros + 1) & 15
        values = unpack_int32(layer.qweight.data, self.bits, dim=0).t()
        return _grouped(
            getattr(layer, "name", "?"), "g_idx", values, self._groups(layer), layer.scales.data.t(), zeros.t(), 0
        )

    def decode_int8(self, layer: Linear) -> Int8Weight:
        """A symmetric 8-bit checkpoint's values less their zero point, 128 (v1: stored as 127)."""
        name = getattr(layer, "name", "?")
        zeros = unpack_int32(layer.qzeros.data, 8, dim=1)
        if self.v1_zeros:
            zeros = (zeros + 1) & 255
        _check(name, "qzeros", bool((zeros == 128).all()), "zero points other than 128 in a symmetric 8-bit checkpoint")
        values = unpack_int32(layer.qweight.data, 8, dim=0).t() - 128
        return _grouped_int8(name, "g_idx", values, self._groups(layer), layer.scales.data.t())


class AWQLinearMethod(QuantizedLinearMethod):
    """AWQ (GEMM): qweight [in, out / 8] int32 (8 columns a word, in AWQ's order), qzeros [groups,
    out / 8] int32 the same way, scales [groups, out]."""

    name = "awq"
    tensor_names = ("qweight", "qzeros", "scales")

    def __init__(self, float_method: LinearMethod, dtype: torch.dtype, group_size: int) -> None:
        super().__init__(float_method, dtype)
        self.group_size = group_size

    def create_weights(self, layer: Linear) -> None:
        k, n = layer.in_features, layer.out_features
        groups = _groups(k, self.group_size)
        linear_parameter(layer, "qweight", (k, n // 8), torch.int32, output_dim=1)
        linear_parameter(layer, "qzeros", (groups, n // 8), torch.int32, output_dim=1)
        linear_parameter(layer, "scales", (groups, n), torch.float32, output_dim=1)

    @staticmethod
    def _columns(packed: torch.Tensor) -> torch.Tensor:
        values = unpack_int32(packed, 4, dim=1)
        rows, columns = values.shape
        inverse = torch.argsort(torch.tensor(_AWQ_ORDER, device=packed.device))
        return values.view(rows, columns // 8, 8)[:, :, inverse].reshape(rows, columns)

    def decode(self, layer: Linear) -> torch.Tensor:
        _check(getattr(layer, "name", "?"), "scales", bool(layer.scales.isfinite().all()), "not finite")
        q, zeros = self._columns(layer.qweight.data), self._columns(layer.qzeros.data)
        group = torch.arange(layer.in_features, device=q.device) * layer.scales.shape[0] // layer.in_features
        return ((q - zeros[group]).float() * layer.scales.data[group]).t().contiguous()

    def decode_int4(self, layer: Linear) -> Int4Weight:
        _check(getattr(layer, "name", "?"), "scales", bool(layer.scales.isfinite().all()), "not finite")
        values = self._columns(layer.qweight.data).t()
        zeros = self._columns(layer.qzeros.data).t()
        return Int4Weight(
            values.to(torch.uint8).contiguous(),
            layer.scales.data.t().contiguous(),
            zeros.to(torch.uint8).contiguous(),
            0,
            None,
            None,
        )


class PackedIntLinearMethod(QuantizedLinearMethod):
    """compressed-tensors pack-quantized (W4A16, W8A16), symmetric: weight_packed [out, in / (32 /
    bits)] int32 (packed along the inputs, each value offset by 2^(bits - 1)), weight_scale [out,
    groups]; weight_g_idx [in] with act order."""

    name = "compressed-tensors pack-quantized"

    def __init__(
        self, float_method: LinearMethod, dtype: torch.dtype, bits: int, group_size: int, actorder: bool
    ) -> None:
        super().__init__(float_method, dtype)
        self.bits, self.group_size, self.actorder = bits, group_size, actorder
        self.tensor_names = ("weight_packed", "weight_scale") + (("weight_g_idx",) if actorder else ())

    def create_weights(self, layer: Linear) -> None:
        k, n = layer.in_features, layer.out_features
        linear_parameter(layer, "weight_packed", (n, k // (32 // self.bits)), torch.int32, output_dim=0)
        linear_parameter(layer, "weight_scale", (n, _groups(k, self.group_size)), torch.float32, output_dim=0)
        if self.actorder:
            linear_parameter(layer, "weight_g_idx", (k,), torch.int32, output_dim=None)

    def decode(self, layer: Linear) -> torch.Tensor:
        name = getattr(layer, "name", "?")
        scales = layer.weight_scale.data
        _check(name, "weight_scale", bool(scales.isfinite().all()), "not finite")
        q = unpack_int32(layer.weight_packed.data, self.bits, dim=1) - (1 << (self.bits - 1))  # [out, in]
        return q.float() * scales[:, self._groups(layer)]

    def _groups(self, layer: Linear) -> torch.Tensor:
        groups = layer.weight_scale.shape[1]
        if not self.actorder:
            return torch.arange(layer.in_features, device=layer.weight_scale.device) * groups // layer.in_features
        group = layer.weight_g_idx.data.long()
        name = getattr(layer, "name", "?")
        _check(name, "weight_g_idx", bool(((group >= 0) & (group < groups)).all()), "groups out of range")
        return group

    def decode_int4(self, layer: Linear) -> Int4Weight:
        scales = layer.weight_scale.data
        _check(getattr(layer, "name", "?"), "weight_scale", bool(scales.isfinite().all()), "not finite")
        values = unpack_int32(layer.weight_packed.data, 4, dim=1)  # (offset by 8: zero point 8)
        return _grouped(getattr(layer, "name", "?"), "weight_g_idx", values, self._groups(layer), scales, None, 8)

    def decode_int8(self, layer: Linear) -> Int8Weight:
        scales = layer.weight_scale.data
        _check(getattr(layer, "name", "?"), "weight_scale", bool(scales.isfinite().all()), "not finite")
        values = unpack_int32(layer.weight_packed.data, 8, dim=1) - 128
        return _grouped_int8(getattr(layer, "name", "?"), "weight_g_idx", values, self._groups(layer), scales)


class Int8ChannelLinearMethod(QuantizedLinearMethod):
    """compressed-tensors int-quantized W8A8: weight [out, in] int8, weight_scale [out, 1] (per
    channel, symmetric); with `dynamic_tokens`, each token's activations are rounded to int8 by
    their own scale (max |x| / 127) before the product, as the scheme computes."""

    name = "compressed-tensors w8a8"
    tensor_names = ("weight", "weight_scale")

    def __init__(self, float_method: LinearMethod, dtype: torch.dtype, dynamic_tokens: bool) -> None:
        super().__init__(float_method, dtype)
        self.dynamic_tokens = dynamic_tokens

    def create_weights(self, layer: Linear) -> None:
        linear_parameter(layer, "weight", (layer.out_features, layer.in_features), torch.int8, output_dim=0)
        linear_parameter(layer, "weight_scale", (layer.out_features, 1), torch.float32, output_dim=0)

    def decode(self, layer: Linear) -> torch.Tensor:
        _check(getattr(layer, "name", "?"), "weight_scale", bool(layer.weight_scale.isfinite().all()), "not finite")
        return layer.weight.data.float() * layer.weight_scale.data

    def decode_int8(self, layer: Linear) -> Int8Weight:
        _check(getattr(layer, "name", "?"), "weight_scale", bool(layer.weight_scale.isfinite().all()), "not finite")
        return Int8Weight(layer.weight.data, layer.weight_scale.data)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.float_method.apply(layer, quantize_tokens(x) if self.dynamic_tokens else x)

    def logits(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.float_method.logits(layer, quantize_tokens(x) if self.dynamic_tokens else x)

    def fused_projection(self, layer: Linear, activations: torch.dtype) -> FusedProjection | None:
        return None if self.dynamic_tokens else self.float_method.fused_projection(layer, activations)


def quantize_tokens(x: torch.Tensor) -> torch.Tensor:
    """Each row of x rounded to int8 levels of its own scale (max |row| / 127), back in x's dtype."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-12)
    return (torch.round(x.float() / scale).clamp(-127, 127) * scale).to(x.dtype)


class FP8LinearMethod(QuantizedLinearMethod):
    """FP8 (e4m3) weights [out, in] times their scale: one per channel [out, 1], or one per block of
    128 x 128 [out / 128, in / 128] (`block`; DeepSeek's and Qwen3's FP8 checkpoints). Activations stay
    in the model's dtype (the weights are widened)."""

    name = "fp8"

    def __init__(
        self, float_method: LinearMethod, dtype: torch.dtype, block: tuple[int, int] | None, scale_name: str
    ) -> None:
        super().__init__(float_method, dtype)
        self.block, self.scale_name = block, scale_name
        self.tensor_names = ("weight", scale_name)

    def create_weights(self, layer: Linear) -> None:
        n, k = layer.out_features, layer.in_features
        linear_parameter(layer, "weight", (n, k), torch.float8_e4m3fn, output_dim=0)
        shape = (n, 1) if self.block is None else (-(-n // self.block[0]), -(-k // self.block[1]))
        linear_parameter(layer, self.scale_name, shape, torch.float32, output_dim=0)

    def decode(self, layer: Linear) -> torch.Tensor:
        scale = getattr(layer, self.scale_name).data
        _check(getattr(layer, "name", "?"), self.scale_name, bool(scale.isfinite().all()), "not finite")
        weight = layer.weight.data.float()
        if self.block is not None:
            rows, cols = self.block
            scale = scale.repeat_interleave(rows, 0)[: weight.shape[0]].repeat_interleave(cols, 1)[:, : weight.shape[1]]
        return weight * scale

    def scale_groups(self, layer: Linear) -> int:
        """Groups of inputs with a scale each: one (per channel), or the blocks across the inputs."""
        return 1 if self.block is None else -(-layer.in_features // self.block[1])

    def decode_fp8(self, layer: Linear) -> FP8Weight:
        """The checkpoint's e4m3 bytes and its scales per column and group of inputs (checked: finite
        scales, no e4m3 NaN, which the kernel would read as a number)."""
        name, scale = getattr(layer, "name", "?"), getattr(layer, self.scale_name).data
        _check(name, self.scale_name, bool(scale.isfinite().all()), "not finite")
        values = layer.weight.data.view(torch.uint8)
        _check(name, "weight", not bool(((values & 0x7F) == 0x7F).any()), "holds NaN (e4m3 0x7F / 0xFF)")
        if self.block is None:
            return FP8Weight(values, scale.reshape(-1, 1), layer.in_features)
        rows, cols = self.block
        return FP8Weight(values, scale.repeat_interleave(rows, 0)[: layer.out_features], cols)


# -- the formats' configs -------------------------------------------------------------------------


def _matches(rule: str, module: str) -> bool:
    """compressed-tensors' (and AWQ's) module rules: `re:<regex>` matched at the start of the name,
    else the name itself or its last component(s)."""
    if rule.startswith("re:"):
        return re.match(rule[3:], module) is not None
    return module == rule or module.endswith("." + rule)


def _one_for_all(name: str, parts: tuple[str, ...], verdicts: list[Any], what: str) -> Any:
    """The one verdict of a fused layer's parts (they must agree: a fused layer has one method)."""
    if any(v != verdicts[0] for v in verdicts[1:]):
        raise ModelLoadError(f"layer {name}: its parts {', '.join(parts)} are {what} differently")
    return verdicts[0]


def _require(where: str, ok: bool, problem: str) -> None:
    if not ok:
        raise ModelLoadError(f"{where}: {problem}")


class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, declared: dict[str, Any], where: str) -> None:
        self.bits = int(declared.get("bits", 0))
        self.group_size = int(declared.get("group_size", -1))
        _require(where, self.bits in (4, 8), f"GPTQ with {self.bits} bits is not supported (4 or 8)")
        _require(where, self.group_size == -1 or self.group_size > 0, f"GPTQ group_size {self.group_size}")
        fmt = str(declared.get("checkpoint_format", "gptq")).lower()
        _require(where, fmt in ("gptq", "gptq_v2"), f"GPTQ checkpoint_format {fmt!r} (gptq or gptq_v2)")
        self.v1_zeros = fmt == "gptq"
        self.symmetric = bool(declared.get("sym", True))
        self.lm_head = bool(declared.get("lm_head", False))
        self.skipped = list(declared.get("modules_to_not_convert") or [])

    def linear_method(
        self, name: str, parts: tuple[str, ...], layer: Linear, backend: LinearBackend
    ) -> LinearMethod | None:
        quantized = [
            not (p.endswith("lm_head") and not self.lm_head) and not any(_matches(r, p) for r in self.skipped)
            for p in parts
        ]
        if not _one_for_all(name, parts, quantized, "quantized"):
            return None
        per_word = 32 // self.bits
        _require(
            f"layer {name}",
            layer.in_features % per_word == 0
            and layer.out_features % per_word == 0
            and (self.group_size == -1 or layer.in_features % self.group_size == 0),
            f"{layer.in_features} x {layer.out_features} does not divide into GPTQ's words and groups "
            f"of {self.group_size}",
        )
        method = GPTQLinearMethod(backend.float_method(), backend.dtype, self.bits, self.group_size, self.v1_zeros)
        if self.bits == 4:
            return _four_bit(method, backend)
        # (asymmetric 8-bit: values less a zero point per group span -255..255, beyond int8: decoded)
        return _eight_bit(method, backend) if self.symmetric else method


class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, declared: dict[str, Any], where: str) -> None:
        bits = int(declared.get("bits", declared.get("w_bit", 0)))
        self.group_size = int(declared.get("group_size", declared.get("q_group_size", -1)))
        version = str(declared.get("version", "gemm")).lower()
        _require(where, bits == 4, f"AWQ with {bits} bits is not supported (4)")
        _require(where, version == "gemm", f"AWQ version {version!r} is not supported (gemm)")
        _require(where, bool(declared.get("zero_point", True)), "AWQ without zero points is not supported")
        self.skipped = list(declared.get("modules_to_not_convert") or [])

    def linear_method(
        self, name: str, parts: tuple[str, ...], layer: Linear, backend: LinearBackend
    ) -> LinearMethod | None:
        quantized = [not p.endswith("lm_head") and not any(_matches(r, p) for r in self.skipped) for p in parts]
        if not _one_for_all(name, parts, quantized, "quantized"):
            return None
        _require(
            f"layer {name}",
            layer.out_features % 8 == 0 and (self.group_size == -1 or layer.in_features % self.group_size == 0),
            f"{layer.in_features} x {layer.out_features} does not divide into AWQ's words and groups",
        )
        return _four_bit(AWQLinearMethod(backend.float_method(), backend.dtype, self.group_size), backend)


class CompressedTensorsConfig(QuantizationConfig):
    """llm-compressor's exports: config_groups of {targets, weights, input_activations}, an ignore
    list, one format (pack-quantized, int-quantized, float-quantized) overall or per group."""

    name = "compressed-tensors"

    def __init__(self, declared: dict[str, Any], where: str) -> None:
        self.where = where
        self.format = str(declared.get("format", "")).lower()
        self.ignore = list(declared.get("ignore") or [])
        groups = declared.get("config_groups") or {}
        _require(where, isinstance(groups, dict) and bool(groups), "compressed-tensors without config_groups")
        self.groups = list(groups.values())
        self.schemes = [self._scheme(g) for g in self.groups]  # (checked up front: refused at startup)

    def _scheme(self, group: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
        fmt = str(group.get("format") or self.format).lower()
        weights = group.get("weights") or {}
        activations = group.get("input_activations")
        kind, bits, strategy = weights.get("type", "int"), int(weights.get("num_bits", 0)), weights.get("strategy")
        where = self.where
        if fmt == "pack-quantized":
            _require(where, kind == "int" and bits in (4, 8), f"pack-quantized {kind} with {bits} bits (int 4 or 8)")
            _require(where, strategy in ("group", "channel"), f"pack-quantized strategy {strategy!r} (group, channel)")
            _require(where, bool(weights.get("symmetric", True)), "asymmetric pack-quantized weights are not supported")
            _require(where, activations is None, "pack-quantized with quantized activations is not supported")
        elif fmt == "int-quantized":
            _require(
                where, kind == "int" and bits == 8 and strategy == "channel", "int-quantized: int8 per channel only"
            )
            _require(where, bool(weights.get("symmetric", True)), "asymmetric int-quantized weights are not supported")
            _require(
                where,
                activations is None or (activations.get("dynamic") and activations.get("strategy") == "token"),
                "int-quantized activations: dynamic per token only (static scales are not supported)",
            )
        elif fmt == "float-quantized":
            _require(where, kind == "float" and bits == 8, "float-quantized: FP8 only")
            _require(where, strategy in ("channel", "block"), f"float-quantized strategy {strategy!r} (channel, block)")
            _require(
                where,
                activations is None or bool(activations.get("dynamic")),
                "float-quantized activations with static scales are not supported",
            )
        else:
            raise ModelLoadError(
                f"{where}: compressed-tensors format {fmt!r} is not supported "
                "(pack-quantized, int-quantized, float-quantized)"
            )
        return fmt, weights, activations

    def _scheme_of(self, module: str) -> int | None:
        if any(_matches(rule, module) for rule in self.ignore):
            return None
        for index, group in enumerate(self.groups):
            for target in group.get("targets") or []:
                if target == "Linear" or _matches(target, module):
                    return index
        return None

    def linear_method(
        self, name: str, parts: tuple[str, ...], layer: Linear, backend: LinearBackend
    ) -> LinearMethod | None:
        index = _one_for_all(name, parts, [self._scheme_of(p) for p in parts], "quantized")
        if index is None:
            return None
        fmt, weights, activations = self.schemes[index]
        float_method, dtype = backend.float_method(), backend.dtype
        if fmt == "pack-quantized":
            bits = int(weights["num_bits"])
            group_size = int(weights.get("group_size") or -1) if weights.get("strategy") == "group" else -1
            _require(
                f"layer {name}",
                layer.in_features % (32 // bits) == 0 and (group_size == -1 or layer.in_features % group_size == 0),
                f"{layer.in_features} inputs do not divide into words and groups of {group_size}",
            )
            actorder = weights.get("actorder") not in (None, False, "weight")
            packed = PackedIntLinearMethod(float_method, dtype, bits, group_size, actorder)
            return _four_bit(packed, backend) if bits == 4 else _eight_bit(packed, backend)
        if fmt == "int-quantized":
            channel = Int8ChannelLinearMethod(float_method, dtype, activations is not None)
            if activations is None:
                return _eight_bit(channel, backend)
            return W8A8LinearMethod(channel) if backend.kernels else channel
        block = weights.get("block_structure") if weights.get("strategy") == "block" else None
        return _fp8(FP8LinearMethod(float_method, dtype, tuple(block) if block else None, "weight_scale"), backend)

    def ignored_tensors(self) -> tuple[str, ...]:
        return (".weight_shape",)


class FP8Config(QuantizationConfig):
    """transformers' `fp8` (DeepSeek-V3, Qwen3-FP8): e4m3 weights with a scale per 128 x 128 block
    (`weight_scale_inv`, multiplied in), dynamic activation scales (the weights are widened here)."""

    name = "fp8"

    def __init__(self, declared: dict[str, Any], where: str) -> None:
        block = declared.get("weight_block_size")
        _require(where, block is not None and len(block) == 2, "fp8 without weight_block_size is not supported")
        assert block is not None
        _require(where, declared.get("activation_scheme", "dynamic") == "dynamic", "fp8 with static activations")
        self.block = (int(block[0]), int(block[1]))
        self.skipped = list(declared.get("modules_to_not_convert") or [])

    def linear_method(
        self, name: str, parts: tuple[str, ...], layer: Linear, backend: LinearBackend
    ) -> LinearMethod | None:
        quantized = [not p.endswith("lm_head") and not any(_matches(r, p) for r in self.skipped) for p in parts]
        if not _one_for_all(name, parts, quantized, "quantized"):
            return None
        return _fp8(FP8LinearMethod(backend.float_method(), backend.dtype, self.block, "weight_scale_inv"), backend)


# {quant_method: its config from (quantization_config, where: the config's path, for errors)}
FORMATS: dict[str, Callable[[dict[str, Any], str], QuantizationConfig]] = {
    "gptq": GPTQConfig,
    "awq": AWQConfig,
    "compressed-tensors": CompressedTensorsConfig,
    "fp8": FP8Config,
    GGUF_METHOD: GGUFConfig,  # (a converted GGUF file's kept layers: model_loader/gguf.py)
}
