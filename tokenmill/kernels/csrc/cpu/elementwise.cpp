// Fused elementwise ops of a decoder layer on CPU (fp32 or bf16): RMSNorm, SiLU(gate) * up, and
// RoPE in place on q and k. In batch-1 decode each of them was 4-6 separate ATen ops per call (pow,
// mean, add, rsqrt, mul, mul; mul, neg, cat, mul, add per tensor), ~25 dispatches per layer whose
// Python and dispatcher cost was a large share of the step (`tokenmill bench profile`); here each is
// one call and one pass over memory.
// The arithmetic follows transformers' op order (RMSNorm: mean of squares in fp32, times
// rsqrt(mean + eps), times the weight), so fp32 results differ from the unfused ops only by the
// summation order of the mean. bf16 computes in fp32 and rounds to bf16 where each of those bf16
// ops rounds (RMSNorm: the normalised row, then its product with the weight; SiLU, then the
// product; RoPE: each product, then the sum): SiLU*up and RoPE give the unfused ops' bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "kernels.h"
#include "vec_utils.h"

#include <cmath>
#include <cstdint>
#include <initializer_list>

namespace tokenmill {
namespace {

// Rows of this many elements or more are worth a thread each.
constexpr int64_t kMinWorkPerThread = 1 << 15;

// RMSNorm and RoPE are a few operations per element: below this many elements (a decode batch of
// 64: 37K, 49K) one thread does them. A parallel region costs a wake-up of the other threads, and
// under a server (cores shared with the HTTP threads) the wake-ups were much of a step: these two
// and the residual adds (decoder_layer.cpp) on one thread raise a many-stream server's throughput
// and leave offline throughput unchanged (`tokenmill bench serve`, `tokenmill bench offline`).
constexpr int64_t kLightMinWork = 1 << 17;

inline int64_t grain(int64_t work_per_item, int64_t min_work = kMinWorkPerThread) {
  return std::max<int64_t>(1, min_work / std::max<int64_t>(1, work_per_item));
}

// fp32 or bf16 CPU tensors, all of the first one's dtype.
void check_same_float(const char* what, std::initializer_list<const at::Tensor*> tensors) {
  const at::ScalarType dtype = (*tensors.begin())->scalar_type();
  for (const at::Tensor* t : tensors)
    TORCH_CHECK(t->device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16) && t->scalar_type() == dtype,
                what, ": float32 or bfloat16 CPU tensors, all of one dtype");
}

// Calls fn(T{}) for fp32 or bf16.
template <typename Fn>
void dispatch_float(at::ScalarType dtype, Fn&& fn) {
  if (dtype == at::kBFloat16)
    fn(at::BFloat16{});
  else
    fn(float{});
}

}  // namespace

template <typename T>
void rms_norm_row(const T* x, const T* weight, int64_t dim, float eps, T* out) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + kVec <= dim; d += kVec) {
    const Vec v = load_as_float(x + d);
    acc = at::vec::fmadd(v, v, acc);
  }
  float squares = hsum(acc);
  for (; d < dim; ++d) squares += static_cast<float>(x[d]) * static_cast<float>(x[d]);
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
  const Vec vinv(inv);
  d = 0;
  for (; d + kVec <= dim; d += kVec)
    store_as(load_as_float(weight + d) * round_as(load_as_float(x + d) * vinv, T{}), out + d);
  for (; d < dim; ++d)
    out[d] = static_cast<T>(static_cast<float>(weight[d]) * round_as(static_cast<float>(x[d]) * inv, T{}));
}
template void rms_norm_row<float>(const float*, const float*, int64_t, float, float*);
template void rms_norm_row<at::BFloat16>(const at::BFloat16*, const at::BFloat16*, int64_t, float, at::BFloat16*);

// out = weight * (x * rsqrt(mean(x^2) + eps)) over the last dim of a contiguous x.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_same_float("rms_norm", {&x, &weight});
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 && x.size(-1) == weight.size(0),
              "rms_norm: contiguous x [..., dim] and weight [dim]");
  at::Tensor out = at::empty_like(x);
  const int64_t dim = x.size(-1), rows = dim == 0 ? 0 : x.numel() / dim;
  dispatch_float(x.scalar_type(), [&](auto type) {
    using T = decltype(type);
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, grain(dim, kLightMinWork), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * dim, wp, dim, static_cast<float>(eps), op + r * dim);
    });
  });
  return out;
}

template <typename T>
void silu_mul_row(const T* gate_up, int64_t inter, T* out) {
  const T* g = gate_up;
  const T* u = g + inter;
  const Vec one(1.f);
  int64_t d = 0;
  for (; d + kVec <= inter; d += kVec) {
    const Vec gv = load_as_float(g + d);
    // (bf16: ATen's faster exp, whose few ulps of fp32 never reach the bf16 rounding of its result,
    // checked for every bf16 gate in tests/kernels/test_cpu_kernels.py; fp32 keeps the exp torch's silu uses)
    const Vec e = std::is_same_v<T, float> ? gv.neg().exp() : gv.neg().exp_u20();
    store_as(round_as(gv / (one + e), T{}) * load_as_float(u + d), out + d);
  }
  for (; d < inter; ++d) {
    const float gv = static_cast<float>(g[d]);
    out[d] = static_cast<T>(round_as(gv / (1.f + std::exp(-gv)), T{}) * static_cast<float>(u[d]));
  }
}
template void silu_mul_row<float>(const float*, int64_t, float*);
template void silu_mul_row<at::BFloat16>(const at::BFloat16*, int64_t, at::BFloat16*);

// silu(gate) * up of a [T, 2 * I] tensor whose first I columns are the gate: [T, I].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_same_float("silu_mul", {&gate_up});
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul: [tokens, 2 * intermediate] with contiguous rows");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  dispatch_float(gate_up.scalar_type(), [&](auto type) {
    using T = decltype(type);
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, grain(inter), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_mul_row(gp + r * stride, inter, op + r * inter);
    });
  });
  return out;
}

// One head's row x rotated in place by its token's cos/sin [rotary] (rotary <= head_dim: the dims
// past it pass through): the "rotate half" layout.
template <typename T>
void rope_head(T* x, const T* c, const T* s, int64_t rotary) {
  const int64_t half = rotary / 2;
  T* a = x;
  T* b = a + half;
  auto r = [](const Vec& v) { return round_as(v, T{}); };
  int64_t d = 0;
  for (; d + kVec <= half; d += kVec) {
    const Vec av = load_as_float(a + d), bv = load_as_float(b + d);
    // out[d] = a*cos[d] + (-b)*sin[d]; out[d + half] = b*cos[d + half] + a*sin[d + half]
    const Vec ra = r(av * load_as_float(c + d)) + r(bv.neg() * load_as_float(s + d));
    const Vec rb = r(bv * load_as_float(c + half + d)) + r(av * load_as_float(s + half + d));
    store_as(ra, a + d);
    store_as(rb, b + d);
  }
  for (; d < half; ++d) {
    const float av = static_cast<float>(a[d]), bv = static_cast<float>(b[d]);
    auto f = [](T v) { return static_cast<float>(v); };
    a[d] = static_cast<T>(round_as(av * f(c[d]), T{}) + round_as((-bv) * f(s[d]), T{}));
    b[d] = static_cast<T>(round_as(bv * f(c[half + d]), T{}) + round_as(av * f(s[half + d]), T{}));
  }
}
template void rope_head<float>(float*, const float*, const float*, int64_t);
template void rope_head<at::BFloat16>(at::BFloat16*, const at::BFloat16*, const at::BFloat16*, int64_t);

namespace {

// x [T, heads, head_dim] (any strides, last dim contiguous) rotated in place by cos/sin [T, rotary].
template <typename T>
void rope_one(at::Tensor& x, const T* cp, const T* sp, int64_t rotary) {
  const int64_t tokens = x.size(0), heads = x.size(1);
  const int64_t ts = x.stride(0), hs = x.stride(1);
  T* xp = x.data_ptr<T>();
  at::parallel_for(0, tokens * heads, grain(rotary, kLightMinWork), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / heads, h = i % heads;
      rope_head(xp + t * ts + h * hs, cp + t * rotary, sp + t * rotary, rotary);
    }
  });
}

}  // namespace

void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  check_same_float("rope_", {&q, &k, &cos, &sin});
  for (const at::Tensor* t : {&q, &k})
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->size(0) == cos.size(0), "rope_: q, k [tokens, heads, head_dim]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
              cos.size(1) % 2 == 0 && cos.size(1) <= q.size(2) && cos.size(1) <= k.size(2),
              "rope_: cos, sin [tokens, rotary] with an even rotary <= head_dim");
  const int64_t rotary = cos.size(1);
  dispatch_float(q.scalar_type(), [&](auto type) {
    using T = decltype(type);
    rope_one(q, cos.data_ptr<T>(), sin.data_ptr<T>(), rotary);
    rope_one(k, cos.data_ptr<T>(), sin.data_ptr<T>(), rotary);
  });
}

}  // namespace tokenmill
