// Fused elementwise ops of a decoder layer on CPU (fp32): RMSNorm, SiLU(gate) * up, and RoPE in
// place on q and k. In batch-1 decode each of them was 4-6 separate ATen ops per call (pow, mean,
// add, rsqrt, mul, mul; mul, neg, cat, mul, add per tensor), ~25 dispatches per layer whose Python
// and dispatcher cost was a quarter of the step; here each is one call and one pass over memory.
// The arithmetic follows transformers' op order (RMSNorm: mean of squares in fp32, times
// rsqrt(mean + eps), times the weight), so fp32 results differ from the unfused ops only by the
// summation order of the mean.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"
#include "vec_utils.h"

#include <cmath>
#include <cstdint>

namespace tokenmill {
namespace {

// Rows of this many elements or more are worth a thread each.
constexpr int64_t kMinWorkPerThread = 1 << 15;

inline int64_t grain(int64_t work_per_item) { return std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(1, work_per_item)); }

void check_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, what, ": float32 CPU tensors only");
}

}  // namespace

void rms_norm_row(const float* x, const float* weight, int64_t dim, float eps, float* out) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + kVec <= dim; d += kVec) {
    const Vec v = Vec::loadu(x + d);
    acc = at::vec::fmadd(v, v, acc);
  }
  float squares = hsum(acc);
  for (; d < dim; ++d) squares += x[d] * x[d];
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
  const Vec vinv(inv);
  d = 0;
  for (; d + kVec <= dim; d += kVec) (Vec::loadu(weight + d) * (Vec::loadu(x + d) * vinv)).store(out + d);
  for (; d < dim; ++d) out[d] = weight[d] * (x[d] * inv);
}

// out = weight * (x * rsqrt(mean(x^2) + eps)) over the last dim of a contiguous x.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float(x, "rms_norm");
  check_float(weight, "rms_norm");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 && x.size(-1) == weight.size(0),
              "rms_norm: contiguous x [..., dim] and weight [dim]");
  at::Tensor out = at::empty_like(x);
  const int64_t dim = x.size(-1), rows = dim == 0 ? 0 : x.numel() / dim;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * dim, wp, dim, static_cast<float>(eps), op + r * dim);
  });
  return out;
}

void silu_mul_row(const float* gate_up, int64_t inter, float* out) {
  const float* g = gate_up;
  const float* u = g + inter;
  const Vec one(1.f);
  int64_t d = 0;
  for (; d + kVec <= inter; d += kVec) {
    const Vec gv = Vec::loadu(g + d);
    (gv / (one + gv.neg().exp()) * Vec::loadu(u + d)).store(out + d);
  }
  for (; d < inter; ++d) out[d] = g[d] / (1.f + std::exp(-g[d])) * u[d];
}

// silu(gate) * up of a [T, 2 * I] tensor whose first I columns are the gate: [T, I].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_float(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul: [tokens, 2 * intermediate] with contiguous rows");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(gp + r * stride, inter, op + r * inter);
  });
  return out;
}

// One head's row x rotated in place by its token's cos/sin [rotary] (rotary <= head_dim: the dims
// past it pass through): the "rotate half" layout.
void rope_head(float* x, const float* c, const float* s, int64_t rotary) {
  const int64_t half = rotary / 2;
  float* a = x;
  float* b = a + half;
  int64_t d = 0;
  for (; d + kVec <= half; d += kVec) {
    const Vec av = Vec::loadu(a + d), bv = Vec::loadu(b + d);
    // out[d] = a*cos[d] + (-b)*sin[d]; out[d + half] = b*cos[d + half] + a*sin[d + half]
    const Vec ra = av * Vec::loadu(c + d) + bv.neg() * Vec::loadu(s + d);
    const Vec rb = bv * Vec::loadu(c + half + d) + av * Vec::loadu(s + half + d);
    ra.store(a + d);
    rb.store(b + d);
  }
  for (; d < half; ++d) {
    const float av = a[d], bv = b[d];
    a[d] = av * c[d] + (-bv) * s[d];
    b[d] = bv * c[half + d] + av * s[half + d];
  }
}

namespace {

// x [T, heads, head_dim] (any strides, last dim contiguous) rotated in place by cos/sin [T, rotary].
void rope_one(at::Tensor& x, const float* cp, const float* sp, int64_t rotary) {
  const int64_t tokens = x.size(0), heads = x.size(1);
  const int64_t ts = x.stride(0), hs = x.stride(1);
  float* xp = x.data_ptr<float>();
  at::parallel_for(0, tokens * heads, grain(rotary), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / heads, h = i % heads;
      rope_head(xp + t * ts + h * hs, cp + t * rotary, sp + t * rotary, rotary);
    }
  });
}

}  // namespace

void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  for (const at::Tensor* t : {&q, &k}) {
    check_float(*t, "rope_");
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->size(0) == cos.size(0), "rope_: q, k [tokens, heads, head_dim]");
  }
  check_float(cos, "rope_");
  check_float(sin, "rope_");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
              cos.size(1) % 2 == 0 && cos.size(1) <= q.size(2) && cos.size(1) <= k.size(2),
              "rope_: cos, sin [tokens, rotary] with an even rotary <= head_dim");
  const int64_t rotary = cos.size(1);
  rope_one(q, cos.data_ptr<float>(), sin.data_ptr<float>(), rotary);
  rope_one(k, cos.data_ptr<float>(), sin.data_ptr<float>(), rotary);
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("rms_norm", &tokenmill::rms_norm);
  m.impl("silu_mul", &tokenmill::silu_mul);
  m.impl("rope_", &tokenmill::rope_);
}
