// y = x W^T for a few rows of x (decode batches) and a row-major fp32 W [N, K], read once at
// memory speed: the weight streams row after row while the x rows stay in L1.
//
// BLAS and oneDNN block for many rows; for 1-8 rows their GEMV paths read a large row-major W
// (the vocabulary projection: 49k x 576 floats for SmolLM2) at about half the machine's
// bandwidth here. Threads take contiguous stretches of W rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec_utils.h"

#include <algorithm>

namespace {

using namespace tokenmill;

// W rows computed side by side: WT rows x M x-rows accumulators (<= 12) + x chunks + one W chunk fit
// AVX2's 16 vector registers, and WT independent FMA chains hide the FMA latency.
constexpr int kWeightTile = 4;

// out[m * ldo + j] = x_rows[m] . w_rows[j] for M x-rows and WT W rows.
template <int M, int WT>
inline void tile_dots(const float* const* x_rows, const float* w, int64_t k, float* out, int64_t ldo) {
  Vec acc[M][WT];
  #pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
    #pragma GCC unroll 16
    for (int j = 0; j < WT; ++j) acc[m][j] = Vec(0.f);
  int64_t d = 0;
  for (; d + kVec <= k; d += kVec) {
    Vec xv[M];
    #pragma GCC unroll 16
    for (int m = 0; m < M; ++m) xv[m] = Vec::loadu(x_rows[m] + d);
    #pragma GCC unroll 16
    for (int j = 0; j < WT; ++j) {
      const Vec wv = Vec::loadu(w + j * k + d);
      #pragma GCC unroll 16
      for (int m = 0; m < M; ++m) acc[m][j] = at::vec::fmadd(xv[m], wv, acc[m][j]);
    }
  }
  #pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
    #pragma GCC unroll 16
    for (int j = 0; j < WT; ++j) {
      float sum = hsum(acc[m][j]);
      for (int64_t t = d; t < k; ++t) sum += x_rows[m][t] * w[j * k + t];
      out[m * ldo + j] = sum;
    }
}

// Calls group(std::integral_constant<int, M>{}, first) for x rows [0, n) in groups of up to 3.
template <typename Group>
inline void for_x_groups(int64_t n, Group&& group) {
  int64_t m = 0;
  for (; m + 3 <= n; m += 3) group(std::integral_constant<int, 3>{}, m);
  if (n - m == 2) group(std::integral_constant<int, 2>{}, m);
  if (n - m == 1) group(std::integral_constant<int, 1>{}, m);
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "skinny_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "skinny_linear: fp32 x and weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "skinny_linear: x [M, K] and weight [N, K]");
  TORCH_CHECK(weight.is_contiguous(), "skinny_linear: a row-major weight");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), n = weight.size(0), k = weight.size(1);
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  std::vector<const float*> x_rows(rows);
  for (int64_t m = 0; m < rows; ++m) x_rows[m] = xp + m * k;
  // Stretches of whole tiles; a grain of 64 W rows keeps a thread's reads long and sequential.
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    int64_t j = begin;
    for (; j + kWeightTile <= end; j += kWeightTile)
      for_x_groups(rows, [&](auto count, int64_t m) {
        tile_dots<decltype(count)::value, kWeightTile>(x_rows.data() + m, wp + j * k, k, op + m * n + j, n);
      });
    for (; j < end; ++j)
      for_x_groups(rows, [&](auto count, int64_t m) {
        tile_dots<decltype(count)::value, 1>(x_rows.data() + m, wp + j * k, k, op + m * n + j, n);
      });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("skinny_linear(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
}
