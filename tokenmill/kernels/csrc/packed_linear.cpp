// fp32 linear layers on a panel-packed weight: y = x W^T (+ bias) for any number of rows of x.
//
// The weight [N, K] is packed once into panels of kPanel output columns, each stored k-major:
// packed[p, k, c] = W[p * kPanel + c, k] (columns past N are zero). One layout serves both ends of
// a step's row counts:
// - a few rows (batch-1 and small-batch decode): each thread streams a contiguous stretch of
//   panels exactly once, front to back, at memory speed; x's rows sit in L1;
// - many rows (batched decode, prefill): a register tile of kTileM rows x one panel's columns
//   (2 vectors) accumulates over K with one broadcast of x and two panel loads per k: the panel
//   (K x 64-128 bytes) stays in L1/L2 while every row group of a block of x passes over it.
// oneDNN's packed fp32 GEMMs ran decode-sized shapes here at ~2/3 of the memory bandwidth (1 row)
// and of the FMA peak (64 rows); see `tokenmill bench kernels` for this kernel against them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"
#include "vec_utils.h"

#include <algorithm>
#include <cstdint>

namespace tokenmill {
namespace {


// Output columns per panel: two vectors, so a row of the register tile is two accumulators.
constexpr int64_t kPanel = 2 * kVec;
// Rows of x per register tile: 2 accumulators each, plus the panel's 2 vectors and one broadcast,
// within AVX2's 16 (6 rows) or AVX-512's 32 (12 rows) vector registers.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kTileM = 12;
#else
constexpr int kTileM = 6;
#endif
// Rows of x per block: the block's rows stay in L2 while the thread's panels pass over them.
constexpr int64_t kBlockBytes = 256 * 1024;

// out[r, 0:cols] = x[r, :] . panel (+ bias) for R rows. Each output is one FMA chain over k in order,
// whatever R is: a row's result does not depend on how many rows share its step (batch invariance),
// and two chains per row already run one row at the memory's speed (two chains per row over
// interleaved k steps measured 0.8x at one row: 23 vs 29 GB/s).
template <int R>
inline void panel_tile(const float* x, int64_t ldx, const float* panel, int64_t k, const float* bias, float* out,
                       int64_t ldo, int64_t cols) {
  Vec acc[R][2];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = Vec(0.f);
  for (int64_t d = 0; d < k; ++d) {
    const float* w = panel + d * kPanel;
    const Vec w0 = Vec::loadu(w), w1 = Vec::loadu(w + kVec);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const Vec a(x[r * ldx + d]);
      acc[r][0] = at::vec::fmadd(a, w0, acc[r][0]);
      acc[r][1] = at::vec::fmadd(a, w1, acc[r][1]);
    }
  }
  if (cols == kPanel) {
    const Vec b0 = bias != nullptr ? Vec::loadu(bias) : Vec(0.f);
    const Vec b1 = bias != nullptr ? Vec::loadu(bias + kVec) : Vec(0.f);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      (acc[r][0] + b0).store(out + r * ldo);
      (acc[r][1] + b1).store(out + r * ldo + kVec);
    }
    return;
  }
  // (unrolled like the loops above: a runtime index into acc would move it out of registers)
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {  // the last panel of an N that is not a multiple of kPanel
    alignas(64) float row[kPanel];
    acc[r][0].store(row);
    acc[r][1].store(row + kVec);
    for (int64_t c = 0; c < cols; ++c) out[r * ldo + c] = row[c] + (bias != nullptr ? bias[c] : 0.f);
  }
}

}  // namespace

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "pack_linear_weight: an fp32 CPU weight [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  // [panels, kPanel, K] -> [panels, K, kPanel]
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2, "packed_linear: fp32 CPU x [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(2) == kPanel &&
                  packed.is_contiguous() && packed.size(1) == x.size(1) && packed.size(0) * kPanel >= n &&
                  (packed.size(0) - 1) * kPanel < n,
              "packed_linear: a weight from pack_linear_weight for this K, N and CPU (panels of ", kPanel, ")");
  const float* bias_ptr = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n, "packed_linear: an fp32 bias of N values");
    bias_c = bias->contiguous();
    bias_ptr = bias_c.data_ptr<float>();
  }
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), panels = packed.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Blocks of about equal rows: a last block of a few rows would stream every panel again for them.
  const int64_t max_rows = std::max<int64_t>(kTileM, kBlockBytes / (k * 4) / kTileM * kTileM);
  const int64_t blocks = (m + max_rows - 1) / max_rows;
  const int64_t block_rows = ((m + blocks - 1) / blocks + kTileM - 1) / kTileM * kTileM;
  // Threads take contiguous stretches of panels: at decode sizes each streams its part of W once.
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m; m0 += block_rows) {
      const int64_t rows = std::min(block_rows, m - m0);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
        const float* panel = wp + p * k * kPanel;
        const float* b = bias_ptr != nullptr ? bias_ptr + col : nullptr;
        for_row_groups<kTileM>(rows, [&](auto count, int64_t r) {
          const int64_t row = m0 + r;
          panel_tile<decltype(count)::value>(xp + row * k, k, panel, k, b, op + row * n + col, n, cols);
        });
      }
    }
  });
  return out;
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("linear_panel_width() -> int", []() -> int64_t { return tokenmill::kPanel; });  // no tensor: every backend
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("pack_linear_weight", &tokenmill::pack_linear_weight);
  m.impl("packed_linear", &tokenmill::packed_linear);
}
