// Linear layers on a panel-packed weight: y = x W^T (+ bias) for any number of rows of x, with W
// in fp32, bf16 (widened to fp32 as it streams) or int8 (weight-only, a scale per group of input
// channels of each output, models/quant.py); fp32 arithmetic.
//
// The weight [N, K] is packed once into panels of kPanel output columns, each stored k-major:
// packed[p, k, c] = W[p * kPanel + c, k] (columns past N are zero); int8 scales [N, groups] the same
// way, [p, g, c]. One layout serves both ends of a step's row counts:
// - a few rows (batch-1 and small-batch decode): each thread streams a contiguous stretch of
//   panels exactly once, front to back (one row: six panels side by side), at memory speed; x's
//   rows sit in L1. int8 weights are widened and scaled in registers as they stream (1 byte per
//   weight read);
// - many rows (batched decode, prefill): a register tile of kTileM rows x one panel's columns
//   (2 vectors) accumulates over K with one broadcast of x and two panel loads per k: the panel
//   (K x 64-128 bytes) stays in L1/L2 while every row group of a block of x passes over it. An int8
//   panel is widened into fp32 once per block of rows first.
// Every output is one FMA chain over k in order of w = q * scale (int8) or w (fp32): a row's result
// does not depend on the other rows of its step, and int8 results equal the fp32 kernel's on the
// dequantized weight bit for bit.
// oneDNN's packed fp32 GEMMs ran decode-sized shapes here at ~2/3 of the memory bandwidth (1 row)
// and of the FMA peak (64 rows); see `tokenmill bench kernels` for this kernel against them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"
#include "vec_utils.h"

#include <algorithm>
#include <cstdint>
#include <vector>

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

// Rows of x up to this many multiply an int8 panel directly; more rows widen it once per block.
// (R rows hold 2R accumulators beside the 2 scale, 2 weight and 1 broadcast registers: AVX2 has 16.)
constexpr int kInt8DirectRows = 4;

// out[r, 0:cols] = acc[r] + bias for R rows (cols < kPanel: the last panel of an N that is not a
// multiple of kPanel).
template <int R>
inline void store_tile(Vec (&acc)[R][2], const float* bias, float* out, int64_t ldo, int64_t cols) {
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
  for (int r = 0; r < R; ++r) {
    alignas(64) float row[kPanel];
    acc[r][0].store(row);
    acc[r][1].store(row + kVec);
    for (int64_t c = 0; c < cols; ++c) out[r * ldo + c] = row[c] + (bias != nullptr ? bias[c] : 0.f);
  }
}

// out[r, 0:cols] = x[r, :] . panel (+ bias) for R rows. Each output is one FMA chain over k in order,
// whatever R is: a row's result does not depend on how many rows share its step (batch invariance),
// and two chains per row already run one row at the memory's speed (two chains per row over
// interleaved k steps measured 0.8x at one row: 23 vs 29 GB/s).
// bf16 panels (bf16 weights on a CPU without native bf16, or fp32 weights that are all bf16 values)
// are widened to fp32 in registers as they stream (load_as_float), exactly: half the bytes of fp32
// per weight, the same arithmetic as on their fp32 values.
template <int R, int P = 1, typename W>
inline void panel_tile(const float* x, int64_t ldx, const W* panel, int64_t k, const float* bias, float* out,
                       int64_t ldo, int64_t cols) {
  Vec acc[P][R][2];
  #pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[p][r][0] = acc[p][r][1] = Vec(0.f);
  for (int64_t d = 0; d < k; ++d) {
    #pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      const W* w = panel + p * k * kPanel + d * kPanel;
      const Vec w0 = load_as_float(w), w1 = load_as_float(w + kVec);
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const Vec a(x[r * ldx + d]);
        acc[p][r][0] = at::vec::fmadd(a, w0, acc[p][r][0]);
        acc[p][r][1] = at::vec::fmadd(a, w1, acc[p][r][1]);
      }
    }
  }
  #pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
    store_tile<R>(acc[p], bias != nullptr ? bias + p * kPanel : nullptr, out + p * kPanel, ldo,
                  p == P - 1 ? cols : kPanel);
}

// panel_tile over P consecutive int8 panels and their scales [groups, kPanel] each: each weight
// widened and scaled (w = q * scale, as the dequantized weight) in registers, then the same FMA
// chain over k in order. P > 1 (one row of x over several panels at once) gives the chains of the
// other panels to overlap: at one byte per weight, one row's two chains per panel were latency-
// bound, not memory-bound. The scales are read (from L1) at every k rather than held in registers:
// six panels' accumulators leave none for them on AVX2 (one row over SmolLM2's layers: six panels
// reading scales 5.75 ms, two panels holding them 6.33). `cols`: of the last panel. (The same loop
// as panel_tile's, kept apart: one tile over a weights policy for both measured int8 one row 1.2x
// and fp32 64 rows 1.02x slower as GCC compiled it.)
template <int R, int P>
inline void int8_panel_tile(const float* x, int64_t ldx, const int8_t* panel, const float* scales, int64_t k,
                            int64_t group, const float* bias, float* out, int64_t ldo, int64_t cols) {
  const int64_t panel_scales = k / group * kPanel;
  Vec acc[P][R][2];
  #pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[p][r][0] = acc[p][r][1] = Vec(0.f);
  for (int64_t g0 = 0; g0 < k; g0 += group) {
    const float* group_scales = scales + g0 / group * kPanel;  // (panel p's: + p * panel_scales)
    for (int64_t d = g0; d < g0 + group; ++d) {
      #pragma GCC unroll 16
      for (int p = 0; p < P; ++p) {
        const int8_t* w = panel + p * k * kPanel + d * kPanel;
        const float* s = group_scales + p * panel_scales;
        const Vec w0 = load_int8(w) * Vec::loadu(s), w1 = load_int8(w + kVec) * Vec::loadu(s + kVec);
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const Vec a(x[r * ldx + d]);
          acc[p][r][0] = at::vec::fmadd(a, w0, acc[p][r][0]);
          acc[p][r][1] = at::vec::fmadd(a, w1, acc[p][r][1]);
        }
      }
    }
  }
  #pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
    store_tile<R>(acc[p], bias != nullptr ? bias + p * kPanel : nullptr, out + p * kPanel, ldo,
                  p == P - 1 ? cols : kPanel);
}

// This thread's buffer for a widened int8 panel (kept across calls: no allocation per panel).
inline std::vector<float>& widened_panel() {
  thread_local std::vector<float> buffer;
  return buffer;
}

// An int8 panel as fp32 (w = q * scale), for panel_tile.
inline void widen_panel(const int8_t* panel, const float* scales, int64_t k, int64_t group, float* dst) {
  for (int64_t g0 = 0; g0 < k; g0 += group) {
    const float* s = scales + g0 / group * kPanel;
    const Vec s0 = Vec::loadu(s), s1 = Vec::loadu(s + kVec);
    for (int64_t d = g0; d < g0 + group; ++d) {
      (load_int8(panel + d * kPanel) * s0).store(dst + d * kPanel);
      (load_int8(panel + d * kPanel + kVec) * s1).store(dst + d * kPanel + kVec);
    }
  }
}

// Calls tile(begin, end, m0, rows) for each thread's contiguous stretch of panels [begin, end) (at
// decode sizes each thread streams its part of W once) and each block of rows [m0, m0 + rows) of an
// [m, k] x: blocks of about equal rows stay in L2 (a last block of a few rows would stream every
// panel again).
template <typename Tile>
void for_panel_blocks(int64_t m, int64_t k, int64_t panels, Tile&& tile) {
  const int64_t max_rows = std::max<int64_t>(kTileM, kBlockBytes / (k * 4) / kTileM * kTileM);
  const int64_t blocks = (m + max_rows - 1) / max_rows;
  const int64_t block_rows = ((m + blocks - 1) / blocks + kTileM - 1) / kTileM * kTileM;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m; m0 += block_rows) tile(begin, end, m0, std::min(block_rows, m - m0));
  });
}

// The bias as an fp32 pointer (nullptr without one), kept alive by `holder`.
const float* bias_data(const c10::optional<at::Tensor>& bias, int64_t n, at::Tensor& holder, const char* op) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->numel() == n && bias->is_floating_point(), op, ": a float bias of N values");
  holder = bias->to(at::kFloat).contiguous();
  return holder.data_ptr<float>();
}

}  // namespace

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(weight.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kChar) &&
                  weight.dim() == 2,
              "pack_linear_weight: an fp32, bf16 or int8 CPU weight [N, K] (or int8 scales [N, groups])");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  // [panels, kPanel, K] -> [panels, K, kPanel]
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

namespace {

// Panels one row of x multiplies at once. One panel's two FMA chains were latency-bound, and more
// streams read at once also draw more of the memory's bandwidth into one core: one row over
// SmolLM2's 30 layers / its 49,152 x 576 head, bf16 panels 27.7 / 35.9 GB/s with one panel at a time,
// 38.3 / 51.2 with 3, 39.0 / 66.1 with 6 (fp32: 38.2 / 47.4 -> 45.9 / 64.1; AMD Zen3, 2 threads).
// Six panels' 12 accumulators, a broadcast and a weight vector fit AVX2's 16 registers.
constexpr int kOneRowPanels = 6;

// One row of x times panels [p, end) in groups of P full panels, then of fewer; p ends at the
// first panel left (none, or a last partial one).
template <int P, typename W>
inline void one_row_panel_groups(const float* x, const W* wp, const float* bias, float* out, int64_t k, int64_t n,
                                 int64_t& p, int64_t end) {
  for (; p + P <= end && (p + P) * kPanel <= n; p += P)
    panel_tile<1, P>(x, k, wp + p * k * kPanel, k, bias != nullptr ? bias + p * kPanel : nullptr, out + p * kPanel, n,
                     kPanel);
  if constexpr (P > 1) one_row_panel_groups<P - 1>(x, wp, bias, out, k, n, p, end);
}

// The same over int8 panels and their scales ([panels, groups, kPanel]).
template <int P>
inline void one_row_int8_groups(const float* x, const int8_t* qp, const float* sp, int64_t groups, const float* bias,
                                float* out, int64_t k, int64_t n, int64_t& p, int64_t end) {
  for (; p + P <= end && (p + P) * kPanel <= n; p += P)
    int8_panel_tile<1, P>(x, k, qp + p * k * kPanel, sp + p * groups * kPanel, k, k / groups,
                          bias != nullptr ? bias + p * kPanel : nullptr, out + p * kPanel, n, kPanel);
  if constexpr (P > 1) one_row_int8_groups<P - 1>(x, qp, sp, groups, bias, out, k, n, p, end);
}

template <typename W>
void panel_gemm(const float* xp, const W* wp, const float* bias_ptr, float* op, int64_t m, int64_t k, int64_t n,
                int64_t panels) {
  for_panel_blocks(m, k, panels, [&](int64_t begin, int64_t end, int64_t m0, int64_t rows) {
    int64_t p = begin;
    if (m == 1) one_row_panel_groups<kOneRowPanels>(xp, wp, bias_ptr, op, k, n, p, end);
    for (; p < end; ++p) {
      const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
      const W* panel = wp + p * k * kPanel;
      const float* b = bias_ptr != nullptr ? bias_ptr + col : nullptr;
      for_row_groups<kTileM>(rows, [&](auto count, int64_t r) {
        const int64_t row = m0 + r;
        panel_tile<decltype(count)::value>(xp + row * k, k, panel, k, b, op + row * n + col, n, cols);
      });
    }
  });
}

}  // namespace

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t n) {
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (x.scalar_type() == at::kFloat || (bf16 && x.is_floating_point())),
              "packed_linear: a CPU x [M, K], fp32 (or any float over bf16 weights)");
  TORCH_CHECK((packed.scalar_type() == at::kFloat || bf16) && packed.dim() == 3 && packed.size(2) == kPanel &&
                  packed.is_contiguous() && packed.size(1) == x.size(1) && packed.size(0) * kPanel >= n &&
                  (packed.size(0) - 1) * kPanel < n,
              "packed_linear: an fp32 or bf16 weight from pack_linear_weight for this K, N and CPU (panels of ", kPanel,
              ")");
  at::Tensor bias_holder;
  const float* bias_ptr = bias_data(bias, n, bias_holder, "packed_linear");
  TORCH_CHECK(bias_ptr == nullptr || bias->scalar_type() == x.scalar_type(), "packed_linear: a bias of x's dtype");
  const at::Tensor xc = x.to(at::kFloat).contiguous();  // (bf16 activations: computed in fp32, like oneDNN's)
  const int64_t m = xc.size(0), k = xc.size(1);
  at::Tensor out = at::empty({m, n}, xc.options());
  if (m > 0 && n > 0) {
    if (bf16)
      panel_gemm(xc.data_ptr<float>(), packed.data_ptr<at::BFloat16>(), bias_ptr, out.data_ptr<float>(), m, k, n,
                 packed.size(0));
    else
      panel_gemm(xc.data_ptr<float>(), packed.data_ptr<float>(), bias_ptr, out.data_ptr<float>(), m, k, n,
                 packed.size(0));
  }
  return out.to(x.scalar_type());
}

at::Tensor packed_int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& packed_scales,
                              const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && x.is_floating_point() && x.dim() >= 1, "packed_int8_linear: a float CPU x [..., K]");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.size(2) == kPanel &&
                  packed.is_contiguous() && packed.size(1) == x.size(-1) && packed.size(0) * kPanel >= n &&
                  (packed.size(0) - 1) * kPanel < n,
              "packed_int8_linear: an int8 weight from pack_linear_weight for this K, N and CPU (panels of ", kPanel, ")");
  const int64_t k = packed.size(1), panels = packed.size(0);
  TORCH_CHECK(packed_scales.scalar_type() == at::kFloat && packed_scales.dim() == 3 && packed_scales.is_contiguous() &&
                  packed_scales.size(0) == panels && packed_scales.size(2) == kPanel && packed_scales.size(1) > 0 &&
                  k % packed_scales.size(1) == 0,
              "packed_int8_linear: scales from pack_linear_weight([N, groups]) with groups dividing K");
  const int64_t group = k / packed_scales.size(1);
  at::Tensor bias_holder;
  const float* bias_ptr = bias_data(bias, n, bias_holder, "packed_int8_linear");
  const at::Tensor xc = x.reshape({-1, k}).to(at::kFloat).contiguous();  // (a bf16 model's activations too)
  const int64_t m = xc.size(0);
  at::Tensor out = at::empty({m, n}, xc.options());
  if (m > 0 && n > 0) {
    const float* xp = xc.data_ptr<float>();
    const int8_t* qp = packed.data_ptr<int8_t>();
    const float* sp = packed_scales.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t groups = packed_scales.size(1);
    for_panel_blocks(m, k, panels, [&](int64_t begin, int64_t end, int64_t m0, int64_t rows) {
      auto bias_at = [&](int64_t col) { return bias_ptr != nullptr ? bias_ptr + col : nullptr; };
      int64_t p = begin;
      if (m == 1) one_row_int8_groups<kOneRowPanels>(xp, qp, sp, groups, bias_ptr, op, k, n, p, end);
      std::vector<float>& widened = widened_panel();
      for (; p < end; ++p) {
        const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
        const int8_t* panel = qp + p * k * kPanel;
        const float* scales = sp + p * groups * kPanel;
        if (m <= kInt8DirectRows) {
          for_row_groups<kInt8DirectRows>(rows, [&](auto count, int64_t r) {
            const int64_t row = m0 + r;
            int8_panel_tile<decltype(count)::value, 1>(xp + row * k, k, panel, scales, k, group, bias_at(col),
                                                       op + row * n + col, n, cols);
          });
          continue;
        }
        widened.resize(static_cast<size_t>(k * kPanel));
        widen_panel(panel, scales, k, group, widened.data());
        for_row_groups<kTileM>(rows, [&](auto count, int64_t r) {
          const int64_t row = m0 + r;
          panel_tile<decltype(count)::value>(xp + row * k, k, widened.data(), k, bias_at(col), op + row * n + col, n,
                                             cols);
        });
      }
    });
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return out.view(shape).to(x.scalar_type());
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("linear_panel_width() -> int", []() -> int64_t { return tokenmill::kPanel; });  // no tensor: every backend
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("packed_int8_linear(Tensor x, Tensor packed, Tensor packed_scales, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("pack_linear_weight", &tokenmill::pack_linear_weight);
  m.impl("packed_linear", &tokenmill::packed_linear);
  m.impl("packed_int8_linear", &tokenmill::packed_int8_linear);
}
