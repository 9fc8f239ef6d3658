// One Llama-shaped decoder layer (fp32 activations, CPU) in one call, for steps whose attention runs
// entirely on the paged kernel (decodes and chunks with cached context); each projection's weight is
// panel-packed fp32, or int8 with its packed scales (--quantization int8):
//   h = rms_norm(x); q, k, v = split(h W_qkv^T + b); rope(q, k); cache <- k, v; a = attention(q)
//   x = x + a W_o^T + b;  x = x + silu_mul(rms_norm(x) W_gate_up^T + b) W_down^T + b
// The same kernels, in the same order, as the Python layer (tokenmill/models/llama.py) on this
// path, so the result is bit-identical; what goes is the Python between them: ~25 op dispatches,
// module calls and views per layer (a batch-1 step of SmolLM2, 30 layers: ~23 -> ~18.5 ms).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

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

// One projection's panels: fp32/bf16 weight, or int8 with its scales; its bias if any.
struct Projection {
  at::Tensor weight;
  OptTensor scales, bias;
};

// A layer's weights and shape, as the op and the stack take them.
struct LayerWeights {
  at::Tensor input_norm, post_norm;
  double eps;
  Projection qkv, o, gate_up, down;
  int64_t heads, kv_heads, intermediate;
  double scale;
  int64_t window;
  double softcap;
};

// What every layer of a step shares: where this step's keys go and the paged attention's inputs.
struct StepInputs {
  const at::Tensor& slot_mapping;
  const at::Tensor& query_start;
  const at::Tensor& query_lens;
  const at::Tensor& block_tables;
  const at::Tensor& context_lens;
  int64_t block_size;
};

// One kv head's row of fp32 K/V as an int8 cache row: head_dim values and their fp32 scale (absmax /
// 127, symmetric), as tokenmill/models/kv_quant.py to_cache computes it, operation for operation
// (fp32 division, round half to even), so the fused and the Python layers write the same bytes.
void quantize_row(const float* row, int64_t head_dim, int8_t* dst) {
  float amax = 0.f;
  for (int64_t i = 0; i < head_dim; ++i) amax = std::max(amax, std::fabs(row[i]));
  const float scale = std::max(amax / 127.f, std::numeric_limits<float>::min());
  for (int64_t i = 0; i < head_dim; ++i)
    dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(row[i] / scale))));
  std::memcpy(dst + head_dim, &scale, sizeof(float));
}

// rows [tokens, kv_heads, head_dim] (fp32, each token's heads side by side) into their slots of a
// cache [slots, kv_heads, head_dim] (int8: head_dim + 4, see quantize_row): copied, rounded to bf16
// as Tensor.to rounds, or quantized. index_copy_ (and the .to) did the same through TensorIterator
// at ~4 us a call, twice per layer.
void write_cache(at::Tensor& cache, const at::Tensor& slots, const at::Tensor& rows) {
  const int64_t tokens = rows.size(0), heads = rows.size(1), head_dim = rows.size(2), width = heads * head_dim;
  const auto dtype = cache.scalar_type();
  const int64_t cache_row = dtype == at::kChar ? head_dim + static_cast<int64_t>(sizeof(float)) : head_dim;
  const bool direct = (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kChar) &&
                      rows.scalar_type() == at::kFloat && rows.stride(2) == 1 && rows.stride(1) == head_dim &&
                      slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == tokens &&
                      cache.is_contiguous() && cache.size(1) == heads && cache.size(2) == cache_row;
  if (!direct) {
    TORCH_CHECK(dtype != at::kChar, "llama_decoder_layer: fp32 K/V rows [tokens, kv_heads, head_dim] into an int8 cache "
                "[slots, kv_heads, head_dim + 4]");
    cache.index_copy_(0, slots, rows.to(dtype));  // (fp16 caches)
    return;
  }
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* src = rows.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < cache.size(0), "slot ", slot[t], " is outside the cache's ", cache.size(0));
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = src + t * rows.stride(0);
    if (dtype == at::kFloat) {
      std::memcpy(cache.data_ptr<float>() + slot[t] * width, row, width * sizeof(float));
    } else if (dtype == at::kBFloat16) {
      at::BFloat16* dst = cache.data_ptr<at::BFloat16>() + slot[t] * width;
      for (int64_t i = 0; i < width; ++i) dst[i] = at::BFloat16(row[i]);
    } else {
      int8_t* dst = cache.data_ptr<int8_t>() + slot[t] * heads * cache_row;
      for (int64_t h = 0; h < heads; ++h) quantize_row(row + h * head_dim, head_dim, dst + h * cache_row);
    }
  }
}

// dst += src, the residual adds: a plain loop over contiguous fp32 rows where TensorIterator's add
// took ~1-2 us a call at batch-1, twice a layer. Addition commutes (proj + x rounds as x + proj), so
// the bits are the Python layer's.
void add_residual(at::Tensor& dst, const at::Tensor& src) {
  if (dst.scalar_type() != at::kFloat || src.scalar_type() != at::kFloat || !dst.is_contiguous() ||
      !src.is_contiguous() || dst.sizes() != src.sizes()) {
    dst.add_(src);
    return;
  }
  float* d = dst.data_ptr<float>();
  const float* s = src.data_ptr<float>();
  at::parallel_for(0, dst.numel(), 1 << 15, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) d[i] += s[i];
  });
}

at::Tensor decoder_layer(const at::Tensor& x, const LayerWeights& w, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor& k_cache, at::Tensor& v_cache, const StepInputs& step) {
  TORCH_CHECK(x.dim() == 2 && k_cache.dim() == 3, "llama_decoder_layer: x [tokens, hidden], caches [slots, kv_heads, dim]");
  const int64_t scale_bytes = k_cache.scalar_type() == at::kChar ? static_cast<int64_t>(sizeof(float)) : 0;
  const int64_t tokens = x.size(0), hidden = x.size(1), head_dim = k_cache.size(2) - scale_bytes;
  const int64_t q_size = w.heads * head_dim, kv_size = w.kv_heads * head_dim;
  auto project = [](const at::Tensor& in, const Projection& p, int64_t n) {
    return linear(in, p.weight, p.scales, p.bias, n);
  };

  const at::Tensor qkv = project(norm(x.contiguous(), w.input_norm, w.eps), w.qkv, q_size + 2 * kv_size);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, w.heads, head_dim});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, w.kv_heads, head_dim});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, w.kv_heads, head_dim});
  {
    RECORD_FUNCTION("tokenmill::rope_", std::vector<c10::IValue>());
    tokenmill::rope_(q, k, cos.view({tokens, -1}), sin.view({tokens, -1}));
  }
  at::Tensor attended = at::empty({tokens, w.heads, head_dim}, x.options());
  {
    RECORD_FUNCTION("tokenmill::attention", std::vector<c10::IValue>());  // (the cache writes too, as in Python)
    write_cache(k_cache, step.slot_mapping, k);
    write_cache(v_cache, step.slot_mapping, v);
    const at::Tensor queries = q.contiguous();
    {
      RECORD_FUNCTION("tokenmill::paged_attention", std::vector<c10::IValue>());
      tokenmill::paged_attention(queries, k_cache, v_cache, attended, step.query_start, step.query_lens,
                                 step.block_tables, step.context_lens, step.block_size, w.scale, w.window, w.softcap);
    }
  }

  at::Tensor out = project(attended.view({tokens, q_size}), w.o, hidden);
  add_residual(out, x);
  const at::Tensor gate_up = project(norm(out, w.post_norm, w.eps), w.gate_up, 2 * w.intermediate);
  at::Tensor activated;
  {
    RECORD_FUNCTION("tokenmill::silu_mul", std::vector<c10::IValue>());
    activated = tokenmill::silu_mul(gate_up);
  }
  add_residual(out, project(activated, w.down, hidden));
  return out;
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
  const LayerWeights w{input_norm, post_norm, eps,
                       {qkv_weight, qkv_scales, qkv_bias}, {o_weight, o_scales, o_bias},
                       {gate_up_weight, gate_up_scales, gate_up_bias}, {down_weight, down_scales, down_bias},
                       heads, kv_heads, intermediate, scale, window, softcap};
  return decoder_layer(x, w, cos, sin, k_cache, v_cache,
                       {slot_mapping, query_start, query_lens, block_tables, context_lens, block_size});
}

// Every decoder layer of a model, held once (tokenmill.models.fused_layer.FusedStack): a step's
// layers run as one C++ loop. Per layer, Python's loop, the op call's 32 boxed arguments and the
// returned tensor cost ~25 us between layers (batch-1 SmolLM2: ~0.7 ms of a 9 ms int8 step).
struct DecoderStack : torch::CustomClassHolder {
  static constexpr int64_t kTensors = 14, kInts = 4, kFloats = 3;  // per layer (see the constructor)
  std::vector<LayerWeights> layers;

  // Per layer: tensors input_norm, post_norm, then weight, scales?, bias? of qkv, o, gate_up and
  // down; ints heads, kv_heads, intermediate, window; floats eps, scale, softcap.
  DecoderStack(const c10::List<std::optional<at::Tensor>>& tensors, const std::vector<int64_t>& ints,
               const std::vector<double>& floats) {
    const int64_t count = static_cast<int64_t>(ints.size()) / kInts;
    TORCH_CHECK(static_cast<int64_t>(tensors.size()) == count * kTensors && static_cast<int64_t>(ints.size()) == count * kInts &&
                    static_cast<int64_t>(floats.size()) == count * kFloats,
                "DecoderStack: ", kTensors, " tensors, ", kInts, " ints and ", kFloats, " floats per layer");
    auto tensor = [&](int64_t i) -> OptTensor { return tensors.get(i); };
    for (int64_t l = 0; l < count; ++l) {
      const int64_t t = l * kTensors;
      auto projection = [&](int64_t first) { return Projection{*tensor(t + first), tensor(t + first + 1), tensor(t + first + 2)}; };
      layers.push_back({*tensor(t), *tensor(t + 1), floats[l * kFloats], projection(2), projection(5), projection(8),
                        projection(11), ints[l * kInts], ints[l * kInts + 1], ints[l * kInts + 2],
                        floats[l * kFloats + 1], ints[l * kInts + 3], floats[l * kFloats + 2]});
    }
  }

  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, const at::Tensor& slot_mapping,
                     const at::Tensor& query_start, const at::Tensor& query_lens, const at::Tensor& block_tables,
                     const at::Tensor& context_lens, int64_t block_size) {
    TORCH_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size(),
                "DecoderStack: one K and one V cache per layer");
    const StepInputs step{slot_mapping, query_start, query_lens, block_tables, context_lens, block_size};
    at::Tensor hidden = x;
    for (size_t l = 0; l < layers.size(); ++l) {
      RECORD_FUNCTION("tokenmill::llama_decoder_layer", std::vector<c10::IValue>());
      hidden = decoder_layer(hidden, layers[l], cos, sin, k_caches[l], v_caches[l], step);
    }
    return hidden;
  }
};

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

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<const c10::List<std::optional<at::Tensor>>&, const std::vector<int64_t>&,
                       const std::vector<double>&>())
      .def("forward", &DecoderStack::forward);
}
