// Linear layers on FP8 (e4m3) weights held in 8 bits: y = x (W * S)^T (+ bias), with W's bytes in the
// panels of the panel GEMM (panel_gemm.h: packed[p, k, c] = W[p * kPanel + c, k], one byte each) and
// S one fp32 scale per column and group of consecutive inputs ([panels, groups, kPanel]: a per-channel
// scale is one group; a 128 x 128 block scale, DeepSeek's and Qwen3's, is groups of 128 inputs with
// each column's block row's scale).
//
// Each weight is widened to fp32 as it streams and multiplied by its scale, w = fp8 * s rounded once
// to fp32: the very weight a float model carrying the dequantized checkpoint holds. The products with
// x then run as the fp32 panels do (one FMA chain over k in order per output: a row's result does not
// depend on the other rows of its step). A step streams one byte per weight, a quarter of fp32's.
//
// e4m3 to fp32 exactly, with no table: the byte's 4 exponent and 3 mantissa bits moved into an fp16's
// bits 13-7 (the low exponent bits and the top of the mantissa), its sign into bit 15, give the same
// value times 2^-8 (fp16's exponent bias is 15, e4m3's 7; e4m3's subnormals become fp16 subnormals
// the same way), which F16C widens exactly; the 2^8 is folded into the scales when they are packed
// (a power of two: exact). e4m3fn's NaN (0x7F, 0xFF) has no place here:
// the loader refuses checkpoints holding it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "kernels.h"
#include "panel_gemm.h"
#include "vec_utils.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace tokenmill {
namespace {

// All of an fp16's bits but bit 14 (see load_fp8).
constexpr int16_t kFp16Bits = static_cast<int16_t>(0xBFFF);

// kVec e4m3 bytes as fp32, times 2^-8 (see the top): each byte sign-extended to 16 bits and shifted
// left by 7 puts its sign in bit 15 and its exponent and mantissa in fp16's bits 13-7; bit 14 (a copy
// of the sign) is cleared.
inline Vec load_fp8(const uint8_t* src) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return Vec(_mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(wide, 7), _mm256_set1_epi16(kFp16Bits))));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i wide = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  return Vec(_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(wide, 7), _mm_set1_epi16(kFp16Bits))));
#else
  float widened[kVec];
  for (int64_t i = 0; i < kVec; ++i) {
    const auto bits = static_cast<uint16_t>(((src[i] & 0x80) << 8) | ((src[i] & 0x7F) << 7));
    widened[i] = static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
  }
  return Vec::loadu(widened);
#endif
}

// How K is cut into scale groups: `groups` of `size` inputs (the last one shorter when size does not
// divide K).
struct ScaleGroups {
  int64_t k, groups, size;
  int64_t end(int64_t g) const { return std::min(k, (g + 1) * size); }
  int64_t panel_scales() const { return groups * kPanel; }
};

// out[r, 0:cols] = x[r, :] . (W * S) (+ bias) for R rows over P consecutive panels (`panel`, their
// scales `scales`). Prefetch: request `next`, the panel after these, as this one streams.
template <int R, int P = 1, bool Prefetch = false>
inline void fp8_panel_tile(const float* x, int64_t ldx, const uint8_t* panel, const float* scales,
                           const ScaleGroups& cut, const float* bias, float* out, int64_t ldo, int64_t cols,
                           const uint8_t* next = nullptr) {
  const int64_t k = cut.k;
  Vec acc[P][R][2];
  #pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[p][r][0] = acc[p][r][1] = Vec(0.f);
  for (int64_t g = 0; g < cut.groups; ++g) {
    Vec s[P][2];
    #pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      const float* group_scales = scales + p * cut.panel_scales() + g * kPanel;
      s[p][0] = Vec::loadu(group_scales);
      s[p][1] = Vec::loadu(group_scales + kVec);
    }
    for (int64_t d = g * cut.size; d < cut.end(g); ++d) {
      if constexpr (Prefetch) prefetch_step<kPanel>(next, d);
      #pragma GCC unroll 16
      for (int p = 0; p < P; ++p) {
        const uint8_t* w = panel + (p * k + d) * kPanel;
        const Vec w0 = load_fp8(w) * s[p][0], w1 = load_fp8(w + kVec) * s[p][1];
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

// One row of x times panels [p, end) in groups of P full panels, then of fewer; p ends at the first
// panel left (none, or a last partial one).
template <int P>
void fp8_one_row_groups(const float* x, const uint8_t* wp, const float* sp, const ScaleGroups& cut, const float* bias,
                        float* out, int64_t n, int64_t& p, int64_t end) {
  for (; p + P <= end && (p + P) * kPanel <= n; p += P)
    fp8_panel_tile<1, P>(x, cut.k, wp + p * cut.k * kPanel, sp + p * cut.panel_scales(), cut,
                         bias != nullptr ? bias + p * kPanel : nullptr, out + p * kPanel, n, kPanel);
  if constexpr (P > 1) fp8_one_row_groups<P - 1>(x, wp, sp, cut, bias, out, n, p, end);
}

// Rows [m0, m0 + rows) of x (m rows in all) times panels [begin, end).
void fp8_panel_range(const float* xp, const uint8_t* wp, const float* sp, const ScaleGroups& cut, const float* bias,
                     float* op, int64_t m, int64_t n, int64_t begin, int64_t end, int64_t m0, int64_t rows) {
  const int64_t k = cut.k;
  int64_t p = begin;
  if (m == 1) fp8_one_row_groups<kOneRowPanels>(xp, wp, sp, cut, bias, op, n, p, end);
  for (; p < end; ++p) {
    const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
    const uint8_t* panel = wp + p * k * kPanel;
    const uint8_t* next = p + 1 < end ? panel + k * kPanel : panel;
    const float* b = bias != nullptr ? bias + col : nullptr;
    for_row_groups<kTileM>(rows, [&](auto count, int64_t r) {
      const int64_t row = m0 + r;
      fp8_panel_tile<decltype(count)::value, 1, true>(xp + row * k, k, panel, sp + p * cut.panel_scales(), cut, b,
                                                      op + row * n + col, n, cols, next);
    });
  }
}

}  // namespace

void fp8_linear_rows(const float* x, int64_t m, const at::Tensor& packed, const at::Tensor& scales, int64_t group_size,
                     const float* bias, float* out, int64_t n, int64_t begin, int64_t end) {
  const int64_t k = packed.size(1);
  const ScaleGroups cut{k, (k + group_size - 1) / group_size, group_size};
  fp8_panel_range(x, packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), cut, bias, out, m, n, begin, end, 0, m);
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t group_size,
                      const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && x.is_floating_point() && x.dim() >= 1, "fp8_linear: a float CPU x [..., K]");
  const int64_t k = x.size(-1), panels = packed.dim() == 3 ? packed.size(0) : 0;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(1) == k && packed.size(2) == kPanel && panels * kPanel >= n && (panels - 1) * kPanel < n,
              "fp8_linear: e4m3 bytes in panels [panels, K, ", kPanel, "] for this K, N and CPU");
  TORCH_CHECK(group_size > 0, "fp8_linear: a positive group size");
  const ScaleGroups cut{k, (k + group_size - 1) / group_size, group_size};
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 3 && scales.is_contiguous() &&
                  scales.size(0) == panels && scales.size(1) == cut.groups && scales.size(2) == kPanel,
              "fp8_linear: fp32 scales [panels, K / group_size (rounded up), ", kPanel, "]");
  at::Tensor bias_holder;
  const float* bias_ptr = bias_data(bias, n, bias_holder, "fp8_linear");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  const at::Tensor xc = x.reshape({-1, k}).to(at::kFloat).contiguous();
  const int64_t m = xc.size(0);
  at::Tensor out = at::empty({m, n}, xc.options());
  if (m > 0 && n > 0) {
    const float* xp = xc.data_ptr<float>();
    const uint8_t* wp = packed.data_ptr<uint8_t>();
    const float* sp = scales.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for_panel_blocks(m, k, panels, [&](int64_t begin, int64_t end, int64_t m0, int64_t rows) {
      fp8_panel_range(xp, wp, sp, cut, bias_ptr, op, m, n, begin, end, m0, rows);
    });
  }
  return out.view(shape).to(x.scalar_type());
}

}  // namespace tokenmill
