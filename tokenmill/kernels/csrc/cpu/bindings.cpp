// Every op of tokenmill's CPU kernels, registered in one place: the schemas (torch.ops.tokenmill.*)
// and the kernels that compute them. tokenmill/kernels/ops.py is their one Python entry point, and
// holds their fake (meta) implementations, so that torch.compile traces through them.

#include <torch/library.h>

#include "kernels.h"
#include "vec_utils.h"

TORCH_LIBRARY(tokenmill, m) {
  // paged_attention.cpp
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor(a!) out, Tensor query_start, "
        "Tensor query_lens, Tensor block_tables, Tensor context_lens, int block_size, float scale, int window, "
        "float softcap) -> ()");
  // elementwise.cpp
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  // panel_linear.cpp
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("linear_panel_width() -> int", []() -> int64_t { return tokenmill::kPanel; });  // no tensor: every backend
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("packed_logits(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  // bf16_pair_linear.cpp
  m.def("bf16_pair_linear_supported() -> bool", &tokenmill::bf16_pair_linear_supported);
  m.def("pack_bf16_pairs(Tensor weight) -> Tensor");
  m.def("bf16_pair_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("bf16_pair_logits(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  // int8_linear.cpp
  m.def("pack_int8_weight(Tensor weight) -> Tensor");
  m.def("packed_int8_linear(Tensor x, Tensor packed, Tensor packed_scales, Tensor? bias, int n) -> Tensor");
  m.def("packed_int8_logits(Tensor x, Tensor packed, Tensor packed_scales, Tensor? bias, int n) -> Tensor");
  m.def("packed_int8_rows(Tensor ids, Tensor packed, Tensor packed_scales, int k, ScalarType dtype) -> Tensor");
  // int4_linear.cpp
  m.def("packed_int4_linear(Tensor x, Tensor packed, Tensor scales, Tensor? zeros, int zero, Tensor? offsets, "
        "Tensor? bias, int n) -> Tensor");
  m.def("packed_int4_logits(Tensor x, Tensor packed, Tensor scales, Tensor? zeros, int zero, Tensor? offsets, "
        "Tensor? bias, int n) -> Tensor");
  // fp8_linear.cpp
  m.def("fp8_linear(Tensor x, Tensor packed, Tensor scales, int group_size, Tensor? bias, int n) -> Tensor");
  // w8a8_linear.cpp
  m.def("w8a8_linear(Tensor x, Tensor packed, Tensor offsets, Tensor scales, Tensor? bias, int n) -> Tensor");
  m.def("w8a8_instructions(int rows) -> str", &tokenmill::w8a8_instructions);
  // quantize.cpp
  m.def("int8_group_scales(Tensor groups, int candidates) -> Tensor");
  m.def("int4_affine_groups(Tensor groups) -> (Tensor, Tensor, Tensor)");
  // onednn_linear.cpp
  m.def("onednn_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("onednn_padded_rows(int rows) -> int", &tokenmill::onednn_padded_rows);
  m.def("onednn_batch_hint() -> int", []() -> int64_t { return tokenmill::kOnednnBatchHint; });
  // amx_linear.cpp
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("amx_logits(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("amx_logits_applies(Tensor x, Tensor packed) -> bool", &tokenmill::amx_logits_applies);
  m.def("amx_linear_applies(Tensor x, Tensor packed) -> bool", &tokenmill::amx_linear_applies);
  m.def("onednn_amx_layout(int n, int k) -> bool", &tokenmill::onednn_amx_layout);
  m.def("amx_int8_usable() -> bool", &tokenmill::amx_int8_usable);
  m.def("amx_bf16_usable() -> bool", &tokenmill::amx_bf16_usable);
  // lora.cpp
  m.def("lora_delta(Tensor x, Tensor(a!) out, Tensor lora_a, Tensor lora_b, Tensor rows, Tensor segments, "
        "Tensor blocks) -> ()");
  // sampling.cpp
  m.def("sample_tokens(Tensor logits, bool[] greedy, float[] temperature, int[] top_k, float[] top_p, float[] min_p, "
        "float[] uniform) -> Tensor");
  // decoder_layer.cpp
  m.def(
      "llama_decoder_layer(Tensor x, Tensor input_norm, Tensor post_norm, float eps, Tensor?[] projections, "
      "int[] zero_points, int[] group_sizes, int heads, int kv_heads, int intermediate, Tensor cos, Tensor sin, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, Tensor query_start, Tensor query_lens, "
      "Tensor block_tables, Tensor context_lens, int block_size, float scale, int window, float softcap) -> Tensor");
  tokenmill::register_decoder_stack(m);
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("paged_attention", &tokenmill::paged_attention);
  m.impl("rms_norm", &tokenmill::rms_norm);
  m.impl("silu_mul", &tokenmill::silu_mul);
  m.impl("rope_", &tokenmill::rope_);
  m.impl("pack_linear_weight", &tokenmill::pack_linear_weight);
  m.impl("packed_linear", &tokenmill::packed_linear);
  m.impl("packed_logits", &tokenmill::packed_logits);
  m.impl("pack_bf16_pairs", &tokenmill::pack_bf16_pairs);
  m.impl("bf16_pair_linear", &tokenmill::bf16_pair_linear);
  m.impl("bf16_pair_logits", &tokenmill::bf16_pair_logits);
  m.impl("pack_int8_weight", &tokenmill::pack_int8_weight);
  m.impl("packed_int8_linear", &tokenmill::packed_int8_linear);
  m.impl("packed_int8_logits", &tokenmill::packed_int8_logits);
  m.impl("packed_int8_rows", &tokenmill::packed_int8_rows);
  m.impl("packed_int4_linear", &tokenmill::packed_int4_linear);
  m.impl("packed_int4_logits", &tokenmill::packed_int4_logits);
  m.impl("w8a8_linear", &tokenmill::w8a8_linear);
  m.impl("fp8_linear", &tokenmill::fp8_linear);
  m.impl("int8_group_scales", &tokenmill::int8_group_scales);
  m.impl("int4_affine_groups", &tokenmill::int4_affine_groups);
  m.impl("onednn_linear", &tokenmill::onednn_linear);
  m.impl("lora_delta", &tokenmill::lora_delta);
  m.impl("sample_tokens", &tokenmill::sample_tokens);
  m.impl("llama_decoder_layer", &tokenmill::llama_decoder_layer);
}

// (a oneDNN-reordered weight is an opaque tensor: a call with one dispatches on its MkldnnCPU key)
TORCH_LIBRARY_IMPL(tokenmill, MkldnnCPU, m) {
  m.impl("onednn_linear", &tokenmill::onednn_linear);
  m.impl("amx_linear", &tokenmill::amx_linear);
  m.impl("amx_logits", &tokenmill::amx_logits);
}
