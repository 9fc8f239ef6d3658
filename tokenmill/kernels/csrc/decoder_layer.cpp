// One Llama-shaped decoder layer (fp32 activations, CPU) in one call, for steps whose attention runs
// entirely on the paged kernel (decodes and chunks with cached context); each projection's weight is
// panel-packed fp32, or int8 with its packed scales (--quantization int8):
//   h = rms_norm(x); q, k, v = split(h W_qkv^T + b); rope(q, k); cache <- k, v; a = attention(q)
//   x = x + a W_o^T + b;  x = x + silu_mul(rms_norm(x) W_gate_up^T + b) W_down^T + b
// The same kernels, in the same order, as the Python layer (tokenmill/models/llama.py) on this
// path, so the result is bit-identical; what goes is the Python between them: ~25 op dispatches,
// module calls and views per layer (a batch-1 step of SmolLM2, 30 layers: ~23 -> ~18.5 ms).

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include "kernels.h"

#include <cstdint>

namespace {

using OptTensor = c10::optional<at::Tensor>;

// x W^T + b on a panel-packed weight: fp32, or int8 when it comes with scales. (The profiler
// scopes, here and below, name the kernels as their torch ops: `tokenmill bench profile` sorts a
// step's time by them. They cost nothing measurable while no profiler runs.)
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const OptTensor& scales, const OptTensor& bias,
                  int64_t n) {
  if (scales.has_value() && scales->defined()) {
    RECORD_FUNCTION("tokenmill::packed_int8_linear", std::vector<c10::IValue>());
    return tokenmill::packed_int8_linear(x, weight, *scales, bias, n);
  }
  RECORD_FUNCTION("tokenmill::packed_linear", std::vector<c10::IValue>());
  return tokenmill::packed_linear(x, weight, bias, n);
}

at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  RECORD_FUNCTION("tokenmill::rms_norm", std::vector<c10::IValue>());
  return tokenmill::rms_norm(x, weight, eps);
}

at::Tensor llama_decoder_layer(const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& post_norm,
                               double eps, const at::Tensor& qkv_weight, const OptTensor& qkv_scales,
                               const OptTensor& qkv_bias, const at::Tensor& o_weight, const OptTensor& o_scales,
                               const OptTensor& o_bias, const at::Tensor& gate_up_weight,
                               const OptTensor& gate_up_scales, const OptTensor& gate_up_bias,
                               const at::Tensor& down_weight, const OptTensor& down_scales,
                               const OptTensor& down_bias, int64_t heads, int64_t kv_heads, int64_t intermediate,
                               const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                               at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& query_start,
                               const at::Tensor& query_lens, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, int64_t block_size, double scale, int64_t window,
                               double softcap) {
  TORCH_CHECK(x.dim() == 2 && k_cache.dim() == 3, "llama_decoder_layer: x [tokens, hidden], caches [slots, kv_heads, dim]");
  TORCH_CHECK(k_cache.scalar_type() != at::kChar, "llama_decoder_layer: int8 caches take the Python path");
  const int64_t tokens = x.size(0), hidden = x.size(1), head_dim = k_cache.size(2);
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;

  const at::Tensor qkv = linear(norm(x.contiguous(), input_norm, eps), qkv_weight, qkv_scales, qkv_bias,
                                q_size + 2 * kv_size);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, heads, head_dim});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads, head_dim});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, head_dim});
  {
    RECORD_FUNCTION("tokenmill::rope_", std::vector<c10::IValue>());
    tokenmill::rope_(q, k, cos.view({tokens, -1}), sin.view({tokens, -1}));
  }
  at::Tensor attended = at::empty({tokens, heads, head_dim}, x.options());
  {
    RECORD_FUNCTION("tokenmill::attention", std::vector<c10::IValue>());  // (the cache writes too, as in Python)
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.scalar_type()));
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.scalar_type()));
    const at::Tensor queries = q.contiguous();
    {
      RECORD_FUNCTION("tokenmill::paged_attention", std::vector<c10::IValue>());
      tokenmill::paged_attention(queries, k_cache, v_cache, attended, query_start, query_lens, block_tables,
                                 context_lens, block_size, scale, window, softcap);
    }
  }

  at::Tensor out = x + linear(attended.view({tokens, q_size}), o_weight, o_scales, o_bias, hidden);
  const at::Tensor gate_up =
      linear(norm(out, post_norm, eps), gate_up_weight, gate_up_scales, gate_up_bias, 2 * intermediate);
  at::Tensor activated;
  {
    RECORD_FUNCTION("tokenmill::silu_mul", std::vector<c10::IValue>());
    activated = tokenmill::silu_mul(gate_up);
  }
  out.add_(linear(activated, down_weight, down_scales, down_bias, hidden));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def(
      "llama_decoder_layer(Tensor x, Tensor input_norm, Tensor post_norm, float eps, Tensor qkv_weight, "
      "Tensor? qkv_scales, Tensor? qkv_bias, Tensor o_weight, Tensor? o_scales, Tensor? o_bias, "
      "Tensor gate_up_weight, Tensor? gate_up_scales, Tensor? gate_up_bias, Tensor down_weight, Tensor? down_scales, "
      "Tensor? down_bias, int heads, int kv_heads, int intermediate, Tensor cos, Tensor sin, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, Tensor query_start, Tensor query_lens, "
      "Tensor block_tables, Tensor context_lens, int block_size, float scale, int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("llama_decoder_layer", &llama_decoder_layer);
}
