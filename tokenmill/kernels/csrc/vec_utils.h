// Vectorised building blocks shared by tokenmill's CPU kernels: ATen's Vectorized<float> for the
// instruction set the including file is compiled for (see tokenmill/kernels/build.py).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>

namespace tokenmill {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
// Rows (query heads x queries, or weight rows) whose dot products share one load of the other operand.
constexpr int kRowGroup = 4;

inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// Rows of K/V as fp32: fp32 caches are read in place, others converted into `scratch`.
template <typename T>
inline const float* as_float(const T* src, float* scratch, int64_t n) {
  for (int64_t i = 0; i < n; ++i) scratch[i] = static_cast<float>(src[i]);
  return scratch;
}
template <>
inline const float* as_float<float>(const float* src, float*, int64_t) {
  return src;
}
template <>
inline const float* as_float<at::BFloat16>(const at::BFloat16* src, float* scratch, int64_t n) {
  // bf16 is the top half of an fp32: a shift, which compilers vectorise.
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(scratch);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
  return scratch;
}

// dots[r] = q_rows[r] . k for N rows (N <= kRowGroup), one load of each chunk of k.
template <int N>
inline void dot_rows(const float* const* q_rows, const float* k, int64_t dim, float* dots) {
  Vec acc[N];
  #pragma GCC unroll 16
  for (int r = 0; r < N; ++r) acc[r] = Vec(0.f);
  int64_t d = 0;
  for (; d + kVec <= dim; d += kVec) {
    Vec kv = Vec::loadu(k + d);
    #pragma GCC unroll 16
    for (int r = 0; r < N; ++r) acc[r] = at::vec::fmadd(Vec::loadu(q_rows[r] + d), kv, acc[r]);
  }
  #pragma GCC unroll 16
  for (int r = 0; r < N; ++r) {
    float s = hsum(acc[r]);
    for (int64_t t = d; t < dim; ++t) s += q_rows[r][t] * k[t];
    dots[r] = s;
  }
}

inline void dot_rows_any(const float* const* q_rows, int n, const float* k, int64_t dim, float* dots) {
  int r = 0;
  for (; r + kRowGroup <= n; r += kRowGroup) dot_rows<kRowGroup>(q_rows + r, k, dim, dots + r);
  switch (n - r) {
    case 3: dot_rows<3>(q_rows + r, k, dim, dots + r); break;
    case 2: dot_rows<2>(q_rows + r, k, dim, dots + r); break;
    case 1: dot_rows<1>(q_rows + r, k, dim, dots + r); break;
    default: break;
  }
}

// out[r] += p[r] * v for N rows, one load of each V chunk.
template <int N>
inline void axpy_rows(const float* p, const float* v, int64_t dim, float* const* out) {
  Vec w[N];
  #pragma GCC unroll 16
  for (int r = 0; r < N; ++r) w[r] = Vec(p[r]);
  int64_t d = 0;
  for (; d + kVec <= dim; d += kVec) {
    Vec vv = Vec::loadu(v + d);
    #pragma GCC unroll 16
    for (int r = 0; r < N; ++r) at::vec::fmadd(w[r], vv, Vec::loadu(out[r] + d)).store(out[r] + d);
  }
  for (; d < dim; ++d)
    #pragma GCC unroll 16
    for (int r = 0; r < N; ++r) out[r][d] += p[r] * v[d];
}

inline void axpy_rows_any(const float* p, int n, const float* v, int64_t dim, float* const* out) {
  int r = 0;
  for (; r + kRowGroup <= n; r += kRowGroup) axpy_rows<kRowGroup>(p + r, v, dim, out + r);
  switch (n - r) {
    case 3: axpy_rows<3>(p + r, v, dim, out + r); break;
    case 2: axpy_rows<2>(p + r, v, dim, out + r); break;
    case 1: axpy_rows<1>(p + r, v, dim, out + r); break;
    default: break;
  }
}

}  // namespace tokenmill
