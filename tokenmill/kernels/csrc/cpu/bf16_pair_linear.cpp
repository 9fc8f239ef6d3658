// bf16 linear layers on AVX512-BF16 dot products (vdpbf16ps) over pair-packed panels, for CPUs with
// native bf16 arithmetic but no AMX tiles (AMD Zen 4/5, Intel Xeons with AMX absent or not exposed):
// y = x W^T (+ bias) for bf16 x, any number of rows, each row's result independent of the other
// rows of its step.
//
// Why not oneDNN: its bf16 GEMMs on these CPUs block the inputs by the row count (a [rows, 1536] x
// [1536, 576] product changed some rows' bits from 17 rows up), so a request's tokens depended on
// who else was being served (docs/batch-invariance.md). Here every output is one chain of vdpbf16ps
// over the input pairs in order, whatever the row count, the row's place or the threads.
//
// The weight [N, K] is packed once into panels of kPanel (32) output columns by pairs of inputs,
// packed[p, j, 2c + t] = W[p * 32 + c, 2j + t] (the int8 panels' layout), columns past N and an odd
// K's last input zero. A pair row of a panel is two vectors of 16 columns x 2 inputs, each multiplied
// by a row's input pair broadcast into every lane: 32 products (exact in fp32) into 16 fp32 sums per
// instruction, twice an fp32 FMA's. Rows and panels are dealt to the threads as the panel GEMM deals
// them (panel_gemm.h): one row over six panels at once, more rows as register tiles of up to 12 rows
// x one panel over blocks of rows that stay in L2, the next panel requested while one computes.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "kernels.h"
#include "panel_gemm.h"
#include "vec_utils.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace tokenmill {
namespace {

#if defined(CPU_CAPABILITY_AVX512)
#define TOKENMILL_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr int64_t kPairRowElems = 2 * kPanel;  // bf16 values of one pair row of a panel (128 bytes)
static_assert(kPanel == 32, "pair panels are two 512-bit vectors of 16 columns x 2 inputs");

// The bits of one pair of bf16 inputs, as the broadcast reads them.
inline int32_t pair_at(const at::BFloat16* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return pair;
}

// acc[q][r] (r < R rows of x, ldx values a row; P panels from `panel`, `panel_elems` apart) over
// pairs [0, pairs). Prefetch: request `next`, the panel after these, a line per pair row.
template <int R, int P, bool Prefetch>
TOKENMILL_BF16_DOT inline void pair_sums(const at::BFloat16* x, int64_t ldx, const at::BFloat16* panel,
                                         int64_t panel_elems, int64_t pairs, const at::BFloat16* next,
                                         __m512 (&acc)[P][R][2]) {
  #pragma GCC unroll 16
  for (int q = 0; q < P; ++q)
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[q][r][0] = acc[q][r][1] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    if constexpr (Prefetch) {
      __builtin_prefetch(next + j * kPairRowElems, 0, 2);
      __builtin_prefetch(next + j * kPairRowElems + kPairRowElems / 2, 0, 2);
    }
    #pragma GCC unroll 16
    for (int q = 0; q < P; ++q) {
      const at::BFloat16* w = panel + q * panel_elems + j * kPairRowElems;
      const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w));
      const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + kPairRowElems / 2));
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair_at(x + r * ldx + 2 * j)));
        acc[q][r][0] = _mm512_dpbf16_ps(acc[q][r][0], w0, a);
        acc[q][r][1] = _mm512_dpbf16_ps(acc[q][r][1], w1, a);
      }
    }
  }
}

struct ColumnMasks {
  __mmask16 low, high;
  explicit ColumnMasks(int64_t cols)
      : low(cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1)),
        high(cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1)) {}
};

// One row's sums (two vectors of 16 columns) + bias into out[0, cols): fp32, or rounded to bf16
// (to nearest even, once).
TOKENMILL_BF16_DOT inline void store_sums(const __m512 (&sums)[2], const float* bias, float* out, int64_t cols) {
  const ColumnMasks mask(cols);
  const __m512 b0 = bias != nullptr ? _mm512_maskz_loadu_ps(mask.low, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias != nullptr ? _mm512_maskz_loadu_ps(mask.high, bias + 16) : _mm512_setzero_ps();
  _mm512_mask_storeu_ps(out, mask.low, _mm512_add_ps(sums[0], b0));
  _mm512_mask_storeu_ps(out + 16, mask.high, _mm512_add_ps(sums[1], b1));
}
TOKENMILL_BF16_DOT inline void store_sums(const __m512 (&sums)[2], const float* bias, at::BFloat16* out,
                                          int64_t cols) {
  const ColumnMasks mask(cols);
  const __m512 b0 = bias != nullptr ? _mm512_maskz_loadu_ps(mask.low, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias != nullptr ? _mm512_maskz_loadu_ps(mask.high, bias + 16) : _mm512_setzero_ps();
  const __m512i both =
      reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_add_ps(sums[1], b1), _mm512_add_ps(sums[0], b0)));
  _mm512_mask_storeu_epi16(out, (static_cast<__mmask32>(mask.high) << 16) | mask.low, both);
}

// out[r, the panels' columns] = x[r] . W + bias for R rows over P consecutive panels from panel `p`
// (cols: the last panel's columns).
template <int R, int P, bool Prefetch = false, typename Out>
TOKENMILL_BF16_DOT inline void pair_tile(const at::BFloat16* x, int64_t ldx, const at::BFloat16* wp, int64_t pairs,
                                         int64_t p, const float* bias, Out* out, int64_t ldo, int64_t cols,
                                         const at::BFloat16* next = nullptr) {
  const int64_t panel_elems = pairs * kPairRowElems;
  __m512 acc[P][R][2];
  pair_sums<R, P, Prefetch>(x, ldx, wp + p * panel_elems, panel_elems, pairs, next, acc);
  #pragma GCC unroll 16
  for (int q = 0; q < P; ++q) {
    const int64_t col = (p + q) * kPanel;
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
      store_sums(acc[q][r], bias != nullptr ? bias + col : nullptr, out + r * ldo + col, q == P - 1 ? cols : kPanel);
  }
}

// One row of x times panels [p, end) in groups of P full panels, then of fewer; p ends at the first
// panel left (none, or a last partial one).
template <int P, typename Out>
TOKENMILL_BF16_DOT inline void one_row_groups(const at::BFloat16* x, const at::BFloat16* wp, int64_t pairs,
                                              const float* bias, Out* out, int64_t n, int64_t& p, int64_t end) {
  for (; p + P <= end && (p + P) * kPanel <= n; p += P) pair_tile<1, P>(x, 0, wp, pairs, p, bias, out, n, kPanel);
  if constexpr (P > 1) one_row_groups<P - 1>(x, wp, pairs, bias, out, n, p, end);
}

// Rows [m0, m0 + rows) of x [m, 2 * pairs] times panels [begin, end), on the calling thread.
template <typename Out>
TOKENMILL_BF16_DOT void pair_panel_range(const at::BFloat16* x, const at::BFloat16* wp, int64_t pairs,
                                         const float* bias, Out* out, int64_t m, int64_t n, int64_t begin,
                                         int64_t end, int64_t m0, int64_t rows) {
  const int64_t ldx = 2 * pairs;
  int64_t p = begin;
  if (m == 1) one_row_groups<kOneRowPanels>(x, wp, pairs, bias, out, n, p, end);
  for (; p < end; ++p) {
    const int64_t cols = std::min(kPanel, n - p * kPanel);
    // (the thread's last panel requests itself again: in cache already)
    const at::BFloat16* next = wp + (p + 1 < end ? p + 1 : p) * pairs * kPairRowElems;
    for_row_groups<kTileM>(rows, [&](auto count, int64_t r) {
      const int64_t row = m0 + r;
      pair_tile<decltype(count)::value, 1, true>(x + row * ldx, ldx, wp, pairs, p, bias, out + row * n, n, cols, next);
    });
  }
}
#endif  // CPU_CAPABILITY_AVX512

void check_pair_weight(const at::Tensor& packed, int64_t k, int64_t n, const char* op) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 &&
                  packed.size(2) == 2 * kPanel && packed.is_contiguous() && packed.size(1) == (k + 1) / 2 &&
                  packed.size(0) * kPanel >= n && (packed.size(0) - 1) * kPanel < n,
              op, ": a bf16 weight from pack_bf16_pairs for this K, N and CPU (panels of ", kPanel, ")");
}

// x W^T (+ bias) as bf16, or fp32 with `fp32_out` (the sums unrounded: logits).
at::Tensor pair_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t n, bool fp32_out, const char* op) {
  TORCH_CHECK(bf16_pair_linear_supported(), op, ": needs AVX512-BF16 and tokenmill's kernels built for AVX-512");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": a bf16 CPU x [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  check_pair_weight(packed, k, n, op);
  at::Tensor bias_holder;
  const float* bias_ptr = bias_data(bias, n, bias_holder, op);
  // (an odd K's last input is paired with a zero, as the weight's is)
  const at::Tensor xc = k % 2 == 0 ? x.contiguous() : at::constant_pad_nd(x, {0, 1});
  at::Tensor out = at::empty({m, n}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
#if defined(CPU_CAPABILITY_AVX512)
  if (m > 0 && n > 0) {
    const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
    const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
    const int64_t pairs = packed.size(1);
    for_panel_blocks(m, 2 * pairs, packed.size(0), [&](int64_t begin, int64_t end, int64_t m0, int64_t rows) {
      if (fp32_out)
        pair_panel_range(xp, wp, pairs, bias_ptr, out.data_ptr<float>(), m, n, begin, end, m0, rows);
      else
        pair_panel_range(xp, wp, pairs, bias_ptr, out.data_ptr<at::BFloat16>(), m, n, begin, end, m0, rows);
    });
  }
#else
  (void)bias_ptr;
#endif
  return out;
}

}  // namespace

bool bf16_pair_linear_supported() {
#if defined(CPU_CAPABILITY_AVX512)
  static const bool supported = __builtin_cpu_supports("avx512bf16");
  return supported;
#else
  return false;
#endif
}

at::Tensor pack_bf16_pairs(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.is_floating_point() && weight.dim() == 2,
              "pack_bf16_pairs: a float CPU weight [N, K] (rounded to bf16)");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel, pairs = (k + 1) / 2;
  at::Tensor padded = at::zeros({panels * kPanel, 2 * pairs}, weight.options().dtype(at::kBFloat16));
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  // [panels, kPanel, pairs, 2] -> [panels, pairs, kPanel, 2]: a pair row's 2 * kPanel values side by side
  return padded.view({panels, kPanel, pairs, 2}).permute({0, 2, 1, 3}).contiguous().view({panels, pairs, 2 * kPanel});
}

at::Tensor bf16_pair_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t n) {
  return pair_linear(x, packed, bias, n, false, "bf16_pair_linear");
}

at::Tensor bf16_pair_logits(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t n) {
  return pair_linear(x, packed, bias, n, true, "bf16_pair_logits");
}

void bf16_pair_linear_rows(const at::BFloat16* x, int64_t m, const at::Tensor& packed, const float* bias,
                           at::BFloat16* out, int64_t n, int64_t begin, int64_t end) {
#if defined(CPU_CAPABILITY_AVX512)
  pair_panel_range(x, packed.data_ptr<at::BFloat16>(), packed.size(1), bias, out, m, n, begin, end, 0, m);
#else
  (void)x, (void)m, (void)packed, (void)bias, (void)out, (void)n, (void)begin, (void)end;
  TORCH_CHECK(false, "bf16_pair_linear_rows: tokenmill's kernels are built without AVX-512 here");
#endif
}

}  // namespace tokenmill
