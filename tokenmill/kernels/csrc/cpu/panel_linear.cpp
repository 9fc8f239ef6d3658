// Linear layers on a panel-packed weight: y = x W^T (+ bias) for any number of rows of x, with W
// in fp32 or bf16 (widened to fp32 as it streams), fp32 arithmetic (the layout and how a step's rows
// and panels are cut: panel_gemm.h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "kernels.h"
#include "vec_utils.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include "panel_gemm.h"

namespace tokenmill {

const float* bias_data(const c10::optional<at::Tensor>& bias, int64_t n, at::Tensor& holder, const char* op) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->numel() == n && bias->is_floating_point(), op, ": a float bias of N values");
  holder = bias->to(at::kFloat).contiguous();
  return holder.data_ptr<float>();
}

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(weight.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16) && weight.dim() == 2,
              "pack_linear_weight: an fp32 or bf16 CPU weight [N, K] (or int8 scales [N, groups]; int8 weights: "
              "pack_int8_weight)");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  // [panels, kPanel, K] -> [panels, K, kPanel]
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

namespace {

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

// Every row group of a panel requests the thread's next panel as it goes (a line per k), so that
// the next panel's pass from DRAM overlaps this one's arithmetic: the core did not overlap them on
// its own, a tile's time was its FMAs plus its panel's first read (`tokenmill bench kernels`, its
// table of the model's layer GEMMs, each layer its own weights; one row takes other paths).
template <typename W>
void panel_range(const float* xp, const W* wp, const float* bias_ptr, float* op, int64_t m, int64_t k, int64_t n,
                 int64_t begin, int64_t end, int64_t m0, int64_t rows) {
  int64_t p = begin;
  if (m == 1) one_row_panel_groups<kOneRowPanels>(xp, wp, bias_ptr, op, k, n, p, end);
  for (; p < end; ++p) {
    const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
    const W* panel = wp + p * k * kPanel;
    const float* b = bias_ptr != nullptr ? bias_ptr + col : nullptr;
    const W* next = p + 1 < end ? panel + k * kPanel : panel;  // (the thread's last: itself again, in cache)
    for_row_groups<kTileM>(rows, [&](auto count, int64_t r) {
      const int64_t row = m0 + r;
      panel_tile<decltype(count)::value, 1, true>(xp + row * k, k, panel, k, b, op + row * n + col, n, cols, next);
    });
  }
}

template <typename W>
void panel_gemm(const float* xp, const W* wp, const float* bias_ptr, float* op, int64_t m, int64_t k, int64_t n,
                int64_t panels) {
  for_panel_blocks(m, k, panels, [&](int64_t begin, int64_t end, int64_t m0, int64_t rows) {
    panel_range(xp, wp, bias_ptr, op, m, k, n, begin, end, m0, rows);
  });
}

// x W^T (+ bias) in x's dtype, or fp32 with `fp32_out`.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                        int64_t n, bool fp32_out) {
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
  return fp32_out ? out : out.to(x.scalar_type());
}

}  // namespace

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t n) {
  return panel_linear(x, packed, bias, n, false);
}

// Logits of a head on panels (fp32, or bf16 on CPUs without native bf16): fp32, whatever x's dtype.
at::Tensor packed_logits(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t n) {
  return panel_linear(x, packed, bias, n, true);
}

void packed_linear_rows(const float* x, int64_t m, const at::Tensor& packed, const float* bias, float* out, int64_t n,
                        int64_t begin, int64_t end) {
  const int64_t k = packed.size(1);
  if (packed.scalar_type() == at::kBFloat16)
    panel_range(x, packed.data_ptr<at::BFloat16>(), bias, out, m, k, n, begin, end, 0, m);
  else
    panel_range(x, packed.data_ptr<float>(), bias, out, m, k, n, begin, end, 0, m);
}

}  // namespace tokenmill
