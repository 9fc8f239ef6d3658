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
#include <vector>

namespace {

using namespace tokenmill;

// W rows computed side by side (dot_tile's columns): 4 W rows x up to 3 x rows of accumulators fit
// AVX2's registers, and the independent FMA chains hide the FMA latency.
constexpr int kWeightTile = 4;

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
    const float* w_rows[kWeightTile];
    int64_t j = begin;
    for (; j + kWeightTile <= end; j += kWeightTile) {
      for (int i = 0; i < kWeightTile; ++i) w_rows[i] = wp + (j + i) * k;
      for_tile_rows(rows, [&](auto count, int64_t m) {
        dot_tile<decltype(count)::value, kWeightTile>(x_rows.data() + m, w_rows, k, op + m * n + j, n);
      });
    }
    for (; j < end; ++j) {
      w_rows[0] = wp + j * k;
      for_tile_rows(rows, [&](auto count, int64_t m) {
        dot_tile<decltype(count)::value, 1>(x_rows.data() + m, w_rows, k, op + m * n + j, n);
      });
    }
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
