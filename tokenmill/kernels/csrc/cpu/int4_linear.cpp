// Linear layers on 4-bit panels: W in 4-bit values q (0-15) per group of inputs of each output,
// w = scale * (q - zero) (+ offset), weight-only, times x rounded to int16 per block of inputs
// (int_panels.h), in exact int32 sums per block and fp32 across blocks, as int8 panels compute
// (int8_linear.cpp). The 4-bit values are unpacked in registers as they stream: half a byte per
// weight read, one AND, one shift and one subtraction per 32 or 64 of them.
//
// Layout (kPanel output columns a panel, pairs of inputs as int8 panels): packed[p, j, i] holds, in
// its low nibble, value i of pair row j as int8 panels lay it out (value 2c + t: column c, input
// 2j + t) and in its high nibble value kPanel + i, so that one load gives both halves of the pair
// row (the columns of the panel's two vectors). Per panel and group of inputs: scales [p, g, c]
// (fp16: GPTQ's and AWQ's own, and any bf16 scale a checkpoint holds, exactly), zero points [p, g,
// 2c + t] (int8, each column's twice, as its pairs lie), or one zero point for every weight (8 for
// symmetric formats); and optionally offsets [p, g, c] (fp16: a float added to the group's
// weights, as llama.cpp's Q4_1 blocks hold), which enter as offset * (the group's sum of x).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "int_panels.h"
#include "kernels.h"
#include "panel_gemm.h"
#include "vec_utils.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace tokenmill {
namespace {

using Half = at::Half;

// A group's zero points for one panel, as the subtraction in registers takes them: int8 lanes, one
// per value of a pair row's half (column c's at 2c and 2c + 1).
#if defined(CPU_CAPABILITY_AVX512)
using ZeroLanes = __m256i;
inline ZeroLanes load_zeros(const int8_t* z) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(z)); }
inline ZeroLanes broadcast_zero(int8_t z) { return _mm256_set1_epi8(z); }
// A pair row's two halves (kPanel bytes of nibbles) as int16 pairs less their zero points.
inline void load_nibble_pairs(const uint8_t* w, const ZeroLanes& z0, const ZeroLanes& z1, Int16Pairs& w0,
                              Int16Pairs& w1) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i low = _mm256_and_si256(bytes, mask), high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
  w0 = _mm512_cvtepi8_epi16(_mm256_sub_epi8(low, z0));
  w1 = _mm512_cvtepi8_epi16(_mm256_sub_epi8(high, z1));
}
#elif defined(CPU_CAPABILITY_AVX2)
using ZeroLanes = __m128i;
inline ZeroLanes load_zeros(const int8_t* z) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(z)); }
inline ZeroLanes broadcast_zero(int8_t z) { return _mm_set1_epi8(z); }
inline void load_nibble_pairs(const uint8_t* w, const ZeroLanes& z0, const ZeroLanes& z1, Int16Pairs& w0,
                              Int16Pairs& w1) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  w0 = _mm256_cvtepi8_epi16(_mm_sub_epi8(low, z0));
  w1 = _mm256_cvtepi8_epi16(_mm_sub_epi8(high, z1));
}
#else
struct ZeroLanes {
  int8_t lane[kPanel];
};
inline ZeroLanes load_zeros(const int8_t* z) {
  ZeroLanes lanes;
  for (int64_t i = 0; i < kPanel; ++i) lanes.lane[i] = z[i];
  return lanes;
}
inline ZeroLanes broadcast_zero(int8_t z) {
  ZeroLanes lanes;
  for (int64_t i = 0; i < kPanel; ++i) lanes.lane[i] = z;
  return lanes;
}
inline void load_nibble_pairs(const uint8_t* w, const ZeroLanes& z0, const ZeroLanes& z1, Int16Pairs& w0,
                              Int16Pairs& w1) {
  for (int64_t i = 0; i < kPanel; ++i) {
    w0.lane[i] = (w[i] & 0x0F) - z0.lane[i];
    w1.lane[i] = (w[i] >> 4) - z1.lane[i];
  }
}
#endif

// One group's zero points of P panels (zeros: [panels, groups, 2 * kPanel] from `first`, or none:
// `zero` for every weight).
template <int P>
inline void group_zeros(const int8_t* zeros, int64_t panel_zeros, int64_t g, int8_t zero, ZeroLanes (&z)[P][2]) {
  #pragma GCC unroll 16
  for (int p = 0; p < P; ++p) {
    if (zeros == nullptr) {
      z[p][0] = z[p][1] = broadcast_zero(zero);
    } else {
      const int8_t* row = zeros + p * panel_zeros + g * 2 * kPanel;
      z[p][0] = load_zeros(row), z[p][1] = load_zeros(row + kPanel);
    }
  }
}

// The int32 sums of pairs [j0, j1) of P 4-bit panels for R rows of x (int16 pairs, ldx per row); not
// inlined, as block_sums of int8 panels (int8_linear.cpp) says why.
template <int R, int P, bool Prefetch>
__attribute__((noinline)) void nibble_block_sums(const int16_t* xq, int64_t ldx, const uint8_t* panel,
                                                 int64_t panel_bytes, int64_t j0, int64_t j1,
                                                 const ZeroLanes (&z)[P][2], const uint8_t* next,
                                                 Int32Sums (&out)[P][R][2]) {
  Int32Sums sums[P][R][2];
  #pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) sums[p][r][0] = sums[p][r][1] = zero_sums();
  for (int64_t j = j0; j < j1; ++j) {
    if constexpr (Prefetch) prefetch_step<kPanel>(next, j);
    #pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      Int16Pairs w0, w1;
      load_nibble_pairs(panel + p * panel_bytes + j * kPanel, z[p][0], z[p][1], w0, w1);
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const Int16Pairs a = broadcast_pair(xq + r * ldx + 2 * j);
        sums[p][r][0] = madd(sums[p][r][0], w0, a);
        sums[p][r][1] = madd(sums[p][r][1], w1, a);
      }
    }
  }
  #pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) out[p][r][0] = sums[p][r][0], out[p][r][1] = sums[p][r][1];
}

// A layer's 4-bit panels and what goes with them (see the file's comment).
struct Int4Weights {
  const uint8_t* packed;
  const Half* scales;
  const int8_t* zeros;  // or nullptr: `zero` for every weight
  int8_t zero;
  const Half* offsets;  // or nullptr
  int64_t panel_bytes, panel_scales, panel_zeros;
};

// out[r, 0:cols] = x[r, :] . W (+ bias) for R rows over P consecutive 4-bit panels from panel `first`
// (x: int16 pairs, ldx per row; block scales, ldsx per row; each group's sum of x, ldxs per row), as
// int8_panel_tile computes int8 panels. Prefetch: request the next panel while this one computes.
template <int R, int P, bool Prefetch = false>
inline void int4_panel_tile(const int16_t* xq, int64_t ldx, const float* sx, int64_t ldsx, const float* xs,
                            int64_t ldxs, const Int4Weights& w, int64_t first, const ActivationBlocks& cut,
                            const float* bias, float* out, int64_t ldo, int64_t cols, const uint8_t* next = nullptr) {
  const uint8_t* panel = w.packed + first * w.panel_bytes;
  const Half* scales = w.scales + first * w.panel_scales;
  const int8_t* zeros = w.zeros != nullptr ? w.zeros + first * w.panel_zeros : nullptr;
  Vec acc[P][R][2];
  #pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[p][r][0] = acc[p][r][1] = Vec(0.f);
  for (int64_t g = 0; g < cut.groups; ++g) {
    ZeroLanes z[P][2];
    group_zeros<P>(zeros, w.panel_zeros, g, w.zero, z);
    for (int64_t b = 0; b < cut.blocks_per_group; ++b) {
      Int32Sums sums[P][R][2];
      nibble_block_sums<R, P, Prefetch>(xq, ldx, panel, w.panel_bytes, cut.first_pair(g, b), cut.end_pair(g, b), z,
                                        next, sums);
      const int64_t block = cut.block_index(g, b);
      #pragma GCC unroll 16
      for (int p = 0; p < P; ++p) {
        const Half* s = scales + p * w.panel_scales + g * kPanel;
        const Vec s0 = load_as_float(s), s1 = load_as_float(s + kVec);
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const Vec x_scale(sx[r * ldsx + block]);
          acc[p][r][0] = at::vec::fmadd(to_float(sums[p][r][0]) * x_scale, s0, acc[p][r][0]);
          acc[p][r][1] = at::vec::fmadd(to_float(sums[p][r][1]) * x_scale, s1, acc[p][r][1]);
        }
      }
    }
    if (w.offsets != nullptr) {
      #pragma GCC unroll 16
      for (int p = 0; p < P; ++p) {
        const Half* m = w.offsets + (first + p) * w.panel_scales + g * kPanel;
        const Vec m0 = load_as_float(m), m1 = load_as_float(m + kVec);
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const Vec x_sum(xs[r * ldxs + g]);
          acc[p][r][0] = at::vec::fmadd(x_sum, m0, acc[p][r][0]);
          acc[p][r][1] = at::vec::fmadd(x_sum, m1, acc[p][r][1]);
        }
      }
    }
  }
  #pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
    store_tile<R>(acc[p], bias != nullptr ? bias + p * kPanel : nullptr, out + p * kPanel, ldo,
                  p == P - 1 ? cols : kPanel);
}

// Rows [0, rows) of x times 4-bit panels [p, end) in groups of P full panels, then of fewer, row by
// row (as int8 panels: int8_panel_groups); p ends at the first panel left.
template <int P>
inline void int4_panel_groups(const int16_t* xq, const float* sx, const float* xs, int64_t rows, const Int4Weights& w,
                              const ActivationBlocks& cut, const float* bias, float* out, int64_t n, int64_t& p,
                              int64_t end) {
  for (; p + P <= end && (p + P) * kPanel <= n; p += P)
    for (int64_t r = 0; r < rows; ++r)
      int4_panel_tile<1, P>(xq + r * cut.inputs(), 0, sx + r * cut.blocks(), 0, xs + r * cut.groups, 0, w, p, cut,
                            bias != nullptr ? bias + p * kPanel : nullptr, out + r * n + p * kPanel, n, kPanel);
  if constexpr (P > 1) int4_panel_groups<P - 1>(xq, sx, xs, rows, w, cut, bias, out, n, p, end);
}

// Rows of x up to this many take the panels six at a time row by row (int8_linear.cpp's
// kInt8RowByRow says why).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kInt4RowByRow = 1;
#else
constexpr int64_t kInt4RowByRow = 4;
#endif

// Rows [m0, m0 + rows) of x (m rows in all) times 4-bit panels [begin, end).
void int4_panel_range(const int16_t* xqp, const float* sxp, const float* xsp, const Int4Weights& w,
                      const ActivationBlocks& cut, const float* bias_ptr, float* op, int64_t m, int64_t n,
                      int64_t begin, int64_t end, int64_t m0, int64_t rows) {
  const int64_t kp = cut.inputs(), blocks = cut.blocks();
  int64_t p = begin;
  if (m <= kInt4RowByRow) int4_panel_groups<kOneRowPanels>(xqp, sxp, xsp, m, w, cut, bias_ptr, op, n, p, end);
  for (; p < end; ++p) {
    const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
    const float* b = bias_ptr != nullptr ? bias_ptr + col : nullptr;
    const uint8_t* next = w.packed + (p + 1 < end ? p + 1 : p) * w.panel_bytes;
    for_row_groups<kTileM>(rows, [&](auto count, int64_t r) {
      const int64_t row = m0 + r;
      int4_panel_tile<decltype(count)::value, 1, true>(xqp + row * kp, kp, sxp + row * blocks, blocks,
                                                       xsp + row * cut.groups, cut.groups, w, p, cut, b,
                                                       op + row * n + col, n, cols, next);
    });
  }
}

// Each row's sum of x over each weight group (for the offsets), [m, groups].
void group_sums(const float* x, int64_t k, int64_t groups, int64_t r0, int64_t r1, float* out) {
  const int64_t size = k / groups;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* v = x + r * k + g * size;
      Vec acc(0.f);
      int64_t i = 0;
      for (; i + kVec <= size; i += kVec) acc = acc + Vec::loadu(v + i);
      float total = hsum_pairwise(acc);
      for (; i < size; ++i) total += v[i];
      out[r * groups + g] = total;
    }
}

Int4Weights check_weights(const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                          int64_t zero, const c10::optional<at::Tensor>& offsets, int64_t k, int64_t n) {
  const int64_t panels = packed.dim() == 3 ? packed.size(0) : 0;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == kPanel &&
                  packed.is_contiguous() && packed.size(1) == k / 2 && k % 2 == 0 && panels * kPanel >= n &&
                  (panels - 1) * kPanel < n,
              "packed_int4_linear: 4-bit panels [panels, K / 2, ", kPanel, "] (uint8) for this even K, N and CPU");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 3 && scales.is_contiguous() &&
                  scales.size(0) == panels && scales.size(2) == kPanel && scales.size(1) > 0 &&
                  k % scales.size(1) == 0 && (scales.size(1) == 1 || k / scales.size(1) % 2 == 0),
              "packed_int4_linear: fp16 scales [panels, groups, ", kPanel, "] with groups dividing K into even groups");
  const int64_t groups = scales.size(1);
  const bool has_zeros = zeros.has_value() && zeros->defined();
  TORCH_CHECK(!has_zeros || (zeros->scalar_type() == at::kChar && zeros->is_contiguous() && zeros->dim() == 3 &&
                             zeros->size(0) == panels && zeros->size(1) == groups && zeros->size(2) == 2 * kPanel),
              "packed_int4_linear: int8 zero points [panels, groups, ", 2 * kPanel, "]");
  TORCH_CHECK(zero >= 0 && zero <= 15, "packed_int4_linear: a zero point from 0 to 15");
  const bool has_offsets = offsets.has_value() && offsets->defined();
  TORCH_CHECK(!has_offsets || (offsets->scalar_type() == at::kHalf && offsets->is_contiguous() &&
                               offsets->sizes() == scales.sizes()),
              "packed_int4_linear: fp16 offsets shaped as the scales");
  return {packed.data_ptr<uint8_t>(),
          scales.data_ptr<Half>(),
          has_zeros ? zeros->data_ptr<int8_t>() : nullptr,
          static_cast<int8_t>(zero),
          has_offsets ? offsets->data_ptr<Half>() : nullptr,
          packed.size(1) * kPanel,
          groups * kPanel,
          groups * 2 * kPanel};
}

// x W^T (+ bias) in x's dtype, or fp32 with `fp32_out` (nothing rounded after the sums).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& zeros, int64_t zero, const c10::optional<at::Tensor>& offsets,
                       const c10::optional<at::Tensor>& bias, int64_t n, bool fp32_out) {
  TORCH_CHECK(x.device().is_cpu() && x.is_floating_point() && x.dim() >= 1, "packed_int4_linear: a float CPU x [..., K]");
  const int64_t k = x.size(-1);
  const Int4Weights w = check_weights(packed, scales, zeros, zero, offsets, k, n);
  const ActivationBlocks cut(k, scales.size(1));
  at::Tensor bias_holder;
  const float* bias_ptr = bias_data(bias, n, bias_holder, "packed_int4_linear");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  const at::Tensor xc = x.reshape({-1, k}).to(at::kFloat).contiguous();
  const int64_t m = xc.size(0), kp = cut.inputs();
  at::Tensor out = at::empty({m, n}, xc.options());
  if (m > 0 && n > 0) {
    thread_local std::vector<int16_t> xq;
    thread_local std::vector<float> sx, xs;
    xq.resize(static_cast<size_t>(m * kp));
    sx.resize(static_cast<size_t>(m * cut.blocks()));
    xs.resize(w.offsets != nullptr ? static_cast<size_t>(m * cut.groups) : 0);
    const float* xp = xc.data_ptr<float>();
    int16_t* xqp = xq.data();
    float* sxp = sx.data();
    float* xsp = xs.data();
    at::parallel_for(0, m, 64, [&](int64_t r0, int64_t r1) {
      quantize_activations(xp, k, cut, r0, r1, xqp, sxp);
      if (w.offsets != nullptr) group_sums(xp, k, cut.groups, r0, r1, xsp);
    });
    float* op = out.data_ptr<float>();
    for_panel_blocks(m, k, packed.size(0), [&](int64_t begin, int64_t end, int64_t m0, int64_t rows) {
      int4_panel_range(xqp, sxp, xsp, w, cut, bias_ptr, op, m, n, begin, end, m0, rows);
    });
  }
  return fp32_out ? out.view(shape) : out.view(shape).to(x.scalar_type());
}

}  // namespace

at::Tensor packed_int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& zeros, int64_t zero,
                              const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias,
                              int64_t n) {
  return int4_linear(x, packed, scales, zeros, zero, offsets, bias, n, false);
}

at::Tensor packed_int4_logits(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& zeros, int64_t zero,
                              const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias,
                              int64_t n) {
  return int4_linear(x, packed, scales, zeros, zero, offsets, bias, n, true);
}

void packed_int4_linear_rows(const float* x, int64_t m, int64_t k, const at::Tensor& packed, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& zeros, int64_t zero,
                             const c10::optional<at::Tensor>& offsets, const float* bias, float* out, int64_t n,
                             int64_t begin, int64_t end, Int8RowScratch& scratch) {
  const Int4Weights w = check_weights(packed, scales, zeros, zero, offsets, k, n);
  const ActivationBlocks cut(k, scales.size(1));
  scratch.xq.resize(static_cast<size_t>(m * cut.inputs()));
  scratch.sx.resize(static_cast<size_t>(m * cut.blocks()));
  scratch.group_sums.resize(w.offsets != nullptr ? static_cast<size_t>(m * cut.groups) : 0);
  quantize_activations(x, k, cut, 0, m, scratch.xq.data(), scratch.sx.data());
  if (w.offsets != nullptr) group_sums(x, k, cut.groups, 0, m, scratch.group_sums.data());
  int4_panel_range(scratch.xq.data(), scratch.sx.data(), scratch.group_sums.data(), w, cut, bias, out, m, n, begin,
                   end, 0, m);
}

}  // namespace tokenmill
