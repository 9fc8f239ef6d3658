// Linear layers on int8 panels: W in int8 (weight-only, a scale per group of input channels of each
// output, models/layers/quantization/int8.py) times x rounded to int16, int32 sums per block of
// inputs, fp32 across blocks (see int8_panel_tile). The weight is packed by pairs of k,
// packed[p, j, 2c + t] = W[p * kPanel + c, 2j + t]; its scales [N, groups] as bf16 ones, [p, g, c]
// (pack_linear_weight); the panels' order and how a step's rows and panels are cut: panel_gemm.h.

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

#include "int_panels.h"
#include "panel_gemm.h"

namespace tokenmill {
namespace {

// A weight group's scale (the kernels below are templated on its type, `Scale`): bf16 for tokenmill's
// own (--quantization int8: rounded up from its largest magnitude / 127 before the group is rounded to
// int8 by it, models/layers/quantization/int8.py, so the step it gives the group is at most 1/128
// coarser than an fp32 scale's, and no weight clips; 2 bytes per 32 weights instead of 4: a decode
// step streams 6% fewer bytes), or fp16 for a checkpoint's own (GPTQ's, GGUF Q8_0's), taken as they are.

// The int32 sums of pairs [j0, j1) of P int8 panels for R rows of x (int16 pairs, ldx per row).
// Not inlined: its registers then hold only the sums, a weight pair and an input pair (12 + 3 of
// AVX2's 16 at one row and six panels); inlined into int8_panel_tile, the compiler kept the fp32
// side (accumulators, scales) live across this loop and spilled sums to the stack in it (slower
// from cache: `tokenmill bench kernels`).
template <int R, int P, bool Prefetch>
__attribute__((noinline)) void block_sums(const int16_t* xq, int64_t ldx, const int8_t* panel, int64_t panel_bytes,
                                          int64_t j0, int64_t j1, const int8_t* next, Int32Sums (&out)[P][R][2]) {
  Int32Sums sums[P][R][2];
  #pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) sums[p][r][0] = sums[p][r][1] = zero_sums();
  for (int64_t j = j0; j < j1; ++j) {
    if constexpr (Prefetch) prefetch_step<2 * kPanel>(next, j);
    #pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      const int8_t* w = panel + p * panel_bytes + j * 2 * kPanel;
      const Int16Pairs w0 = load_pairs(w), w1 = load_pairs(w + 2 * kVec);
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

// out[r, 0:cols] = x[r, :] . W (+ bias) for R rows over P consecutive int8 panels ([pairs, 2 * kPanel]
// each: every column's two weights of a pair side by side) and their scales ([groups, kPanel]), from
// x as int16 pairs (ldx per row) and block scales (ldsx per row). One row runs over six panels at
// once (the int32 sums of one panel's two vectors alone were latency-bound, as in panel_tile); the
// fp32 sums wait in memory between blocks (AVX2's 16 registers hold the int32 ones).
// Prefetch: request the next panel and its scales (next, next_scales) while this one computes.
template <int R, int P, bool Prefetch = false, typename Scale>
inline void int8_panel_tile(const int16_t* xq, int64_t ldx, const float* sx, int64_t ldsx, const int8_t* panel,
                            const Scale* scales, const ActivationBlocks& cut, const float* bias, float* out,
                            int64_t ldo, int64_t cols, const int8_t* next = nullptr,
                            const Scale* next_scales = nullptr) {
  const int64_t panel_bytes = cut.panel_bytes(), panel_scales = cut.panel_scales();
  Vec acc[P][R][2];
  #pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[p][r][0] = acc[p][r][1] = Vec(0.f);
  for (int64_t g = 0; g < cut.groups; ++g) {
    if constexpr (Prefetch) prefetch_step<kPanel * sizeof(Scale)>(next_scales, g);
    for (int64_t b = 0; b < cut.blocks_per_group; ++b) {
      Int32Sums sums[P][R][2];
      block_sums<R, P, Prefetch>(xq, ldx, panel, panel_bytes, cut.first_pair(g, b), cut.end_pair(g, b), next, sums);
      const int64_t block = cut.block_index(g, b);
      #pragma GCC unroll 16
      for (int p = 0; p < P; ++p) {
        const Scale* s = scales + p * panel_scales + g * kPanel;
        const Vec s0 = load_as_float(s), s1 = load_as_float(s + kVec);
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const Vec x_scale(sx[r * ldsx + block]);
          acc[p][r][0] = at::vec::fmadd(to_float(sums[p][r][0]) * x_scale, s0, acc[p][r][0]);
          acc[p][r][1] = at::vec::fmadd(to_float(sums[p][r][1]) * x_scale, s1, acc[p][r][1]);
        }
      }
    }
  }
  #pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
    store_tile<R>(acc[p], bias != nullptr ? bias + p * kPanel : nullptr, out + p * kPanel, ldo,
                  p == P - 1 ? cols : kPanel);
}

// int8 panels on AMX-int8 tiles (CPUs with AMX: Sapphire Rapids and later) for fp32 x, from 16 rows.
// The same products as int8_panel_tile, summed by the tile unit: each int16 input is split into a
// signed high byte and an unsigned low byte (x = 256 hi + lo, exactly), tdpbssd sums hi x W and
// tdpbusd lo x W over a group of 32 inputs, and 256 * hi_sum + lo_sum is the panel path's exact int32
// block sum, which then enters the fp32 result as it does there: the bits equal the panel path's
// (tested), a row's result still does not depend on its step. Applies to weights with groups of 32
// (every K that is a multiple of 32): one group is one tile's depth. The panel's pairs are rearranged
// into the tile unit's quads (16 columns x 4 inputs a 64-byte row) as each panel is reached, once
// per block of rows.
#if defined(CPU_CAPABILITY_AVX512)
#define TOKENMILL_AMX_INT8 __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl")))

constexpr int64_t kAmxGroupPairs = 16;  // a weight group of 32 inputs: one A tile's 32 bytes of depth
constexpr int64_t kAmxTileRows = 16;
constexpr int64_t kQuadTileBytes = 8 * 64;  // B tile: 8 rows of 4 inputs x 16 columns

// Tiles 0, 1: x's high and low bytes (rows x 32 inputs); 2, 3: W's quads for the panel's two halves
// (8 x 64 bytes); 4-7: int32 sums (rows x 16 columns): hi and lo for half 0, then for half 1.
TOKENMILL_AMX_INT8 void configure_int8_tiles(int rows) {
  AmxTileConfig config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = static_cast<uint8_t>(rows);
  config.bytes_per_row[0] = config.bytes_per_row[1] = 2 * kAmxGroupPairs;
  config.rows[2] = config.rows[3] = 8;
  __asm__ __volatile__("" : : "r"(&config) : "memory");  // (keeps the stores above: see amx_linear.cpp)
  _tile_loadconfig(&config);
}

// Pair rows (64 bytes each) requested ahead of the one being rearranged or widened: a thread's
// panels are one stream (the next panel follows this one), which the core's own prefetchers left
// waiting on memory (most of the widening's time went to the first use of each load:
// `python bench/amx_int8_vs_panels.py`).
constexpr int64_t kDequantAhead = 64;

// One int8 panel's pairs ([pairs, 2 * kPanel] bytes) as quads, per group and half:
// quads[g][h][i][4c + t] = W[16h + c, 32g + 4i + t]: pair rows 2i and 2i + 1 of the group, their
// 16-bit units (one column's pair each) interleaved.
TOKENMILL_AMX_INT8 void panel_as_quads(const int8_t* panel, int64_t groups, int8_t* quads) {
  alignas(64) int16_t low_index[32], high_index[32];
  for (int c = 0; c < 16; ++c) {
    low_index[2 * c] = static_cast<int16_t>(c), low_index[2 * c + 1] = static_cast<int16_t>(32 + c);
    high_index[2 * c] = static_cast<int16_t>(16 + c), high_index[2 * c + 1] = static_cast<int16_t>(48 + c);
  }
  const __m512i low = _mm512_load_si512(low_index), high = _mm512_load_si512(high_index);
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* pairs = panel + g * kAmxGroupPairs * 2 * kPanel;
    int8_t* out = quads + g * 2 * kQuadTileBytes;
    for (int64_t i = 0; i < 8; ++i) {
      __builtin_prefetch(pairs + (2 * i + kDequantAhead) * 2 * kPanel, 0, 2);
      __builtin_prefetch(pairs + (2 * i + 1 + kDequantAhead) * 2 * kPanel, 0, 2);
      const __m512i a = _mm512_loadu_si512(pairs + 2 * i * 2 * kPanel);
      const __m512i b = _mm512_loadu_si512(pairs + (2 * i + 1) * 2 * kPanel);
      _mm512_store_si512(out + i * 64, _mm512_permutex2var_epi16(a, low, b));
      _mm512_store_si512(out + kQuadTileBytes + i * 64, _mm512_permutex2var_epi16(a, high, b));
    }
  }
}

// x's int16 inputs [rows, kp] as high (signed) and low (unsigned) bytes, [rows, kp] each.
TOKENMILL_AMX_INT8 void split_int16(const int16_t* xq, int64_t count, int8_t* high, uint8_t* low) {
  int64_t i = 0;
  for (; i + 32 <= count; i += 32) {
    const __m512i v = _mm512_loadu_si512(xq + i);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(high + i), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(low + i), _mm512_cvtepi16_epi8(v));
  }
  for (; i < count; ++i) high[i] = static_cast<int8_t>(xq[i] >> 8), low[i] = static_cast<uint8_t>(xq[i] & 0xFF);
}

// out[r, 0:cols] = x[r, :] . W (+ bias) for `rows` rows (up to 16; the tiles hold `tile_rows`) over one
// panel, from x's bytes (kp a row), its block scales (ldsx a row), the panel's quads and scales.
template <typename Scale>
TOKENMILL_AMX_INT8 void amx_int8_panel_tile(const int8_t* high, const uint8_t* low, int64_t kp, const float* sx,
                                            int64_t ldsx, int64_t rows, const int8_t* quads, const Scale* scales,
                                            int64_t groups, const float* bias, float* out, int64_t ldo,
                                            int64_t cols) {
  alignas(64) int32_t sums[4][kAmxTileRows][16];
  alignas(64) float acc[kAmxTileRows][kPanel] = {};
  for (int64_t g = 0; g < groups; ++g) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    _tile_loadd(0, high + g * 2 * kAmxGroupPairs, kp);
    _tile_loadd(1, low + g * 2 * kAmxGroupPairs, kp);
    _tile_loadd(2, quads + g * 2 * kQuadTileBytes, 64);
    _tile_loadd(3, quads + g * 2 * kQuadTileBytes + kQuadTileBytes, 64);
    _tile_dpbssd(4, 0, 2);
    _tile_dpbusd(5, 1, 2);
    _tile_dpbssd(6, 0, 3);
    _tile_dpbusd(7, 1, 3);
    _tile_stored(4, sums[0], 64);
    _tile_stored(5, sums[1], 64);
    _tile_stored(6, sums[2], 64);
    _tile_stored(7, sums[3], 64);
    const __m512 s0 = load_as_float(scales + g * kPanel), s1 = load_as_float(scales + g * kPanel + kVec);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 x_scale = _mm512_set1_ps(sx[r * ldsx + g]);
      const __m512i sum0 = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[0][r]), 8),
                                            _mm512_load_si512(sums[1][r]));
      const __m512i sum1 = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[2][r]), 8),
                                            _mm512_load_si512(sums[3][r]));
      _mm512_store_ps(acc[r], _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum0), x_scale), s0,
                                              _mm512_load_ps(acc[r])));
      _mm512_store_ps(acc[r] + kVec, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum1), x_scale), s1,
                                                     _mm512_load_ps(acc[r] + kVec)));
    }
  }
  const __mmask16 first = cols >= kVec ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 second =
      cols >= kPanel ? 0xFFFF : cols <= kVec ? 0 : static_cast<__mmask16>((1u << (cols - kVec)) - 1);
  const __m512 b0 = bias != nullptr ? _mm512_maskz_loadu_ps(first, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias != nullptr ? _mm512_maskz_loadu_ps(second, bias + kVec) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {  // (+ 0 without a bias, as store_tile adds it)
    _mm512_mask_storeu_ps(out + r * ldo, first, _mm512_add_ps(_mm512_load_ps(acc[r]), b0));
    _mm512_mask_storeu_ps(out + r * ldo + kVec, second, _mm512_add_ps(_mm512_load_ps(acc[r] + kVec), b1));
  }
}

TOKENMILL_AMX_INT8 void release_int8_tiles() { _tile_release(); }

struct alignas(64) CacheLine {
  int8_t bytes[64];
};

// Rows [m0, m0 + rows) of x (split bytes [m + 16 rows, kp] each, the rows past m zero; block scales)
// times int8 panels [begin, end), on the calling thread.
template <typename Scale>
void amx_int8_panel_range(const int8_t* high, const uint8_t* low, const float* sxp, const ActivationBlocks& cut,
                          const int8_t* qp, const Scale* sp, const float* bias_ptr, float* op, int64_t m, int64_t n,
                          int64_t begin, int64_t end, int64_t m0, int64_t rows) {
  const int64_t kp = cut.inputs(), blocks = cut.blocks(), groups = cut.groups;
  thread_local std::vector<CacheLine> quads;
  quads.resize(static_cast<size_t>(groups * 2 * kQuadTileBytes / 64));
  int8_t* quad_bytes = quads.data()->bytes;
  configure_int8_tiles(static_cast<int>(std::min(m, kAmxTileRows)));
  for (int64_t p = begin; p < end; ++p) {
    const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
    panel_as_quads(qp + p * cut.panel_bytes(), groups, quad_bytes);
    for (int64_t r = m0; r < m0 + rows; r += kAmxTileRows)
      amx_int8_panel_tile(high + r * kp, low + r * kp, kp, sxp + r * blocks, blocks,
                          std::min(kAmxTileRows, m0 + rows - r), quad_bytes, sp + p * cut.panel_scales(), groups,
                          bias_ptr != nullptr ? bias_ptr + col : nullptr, op + r * n + col, n, cols);
  }
  release_int8_tiles();
}

// A bf16 model's int8 steps of 12 rows and more on AMX-bf16 tiles: each panel's int8 weights times
// their group scales, rounded once to bf16, in amx_linear's block layout (the panel's pair rows,
// widened), then x's rows times that block (amx_bf16_blocks). x is bf16 already, so nothing of it
// is lost; the weights take a bf16 rounding (2^-9 of each) on top of int8's. The int8 sums above
// pay a scaling per group of 32 inputs for every output; these tiles sum all of K in fp32 inside the
// tile unit: SmolLM2's 120 layer GEMMs at 64 / 2,048 rows, `python bench/amx_int8_vs_panels.py`.
#define TOKENMILL_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// One int8 panel's (32 columns') weights times their group scales, bf16(q[c, 2j + t] * s[c, j / group_pairs]):
// as amx_linear's block (KMajor false: block[j][c][t]), or into columns [0, cols) of a [K, N] matrix
// (KMajor true: block[(2j + t) * ldo + c]).
template <bool KMajor = false, typename Scale>
TOKENMILL_AVX512_BF16 void panel_as_bf16(const int8_t* panel, const Scale* scales, const ActivationBlocks& cut,
                                         at::BFloat16* block, int64_t ldo = 0, int64_t cols = kPanel) {
  alignas(64) int16_t even_index[32], odd_index[32];  // a pair row's first / second inputs, by column
  for (int c = 0; c < 32; ++c)
    even_index[c] = static_cast<int16_t>(2 * c), odd_index[c] = static_cast<int16_t>(2 * c + 1);
  const __m512i evens = _mm512_load_si512(even_index), odds = _mm512_load_si512(odd_index);
  const __mmask32 columns = cols >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << cols) - 1);
  alignas(64) int32_t first_half[16], second_half[16];  // a pair row's 64 values: value e is column e / 2
  for (int e = 0; e < 16; ++e) first_half[e] = e / 2, second_half[e] = 8 + e / 2;
  const __m512i first = _mm512_load_si512(first_half), second = _mm512_load_si512(second_half);
  for (int64_t g = 0; g < cut.groups; ++g) {
    const __m512 s0 = load_as_float(scales + g * kPanel), s1 = load_as_float(scales + g * kPanel + kVec);
    const __m512 column_scales[4] = {_mm512_permutexvar_ps(first, s0), _mm512_permutexvar_ps(second, s0),
                                     _mm512_permutexvar_ps(first, s1), _mm512_permutexvar_ps(second, s1)};
    for (int64_t j = g * cut.group_pairs; j < (g + 1) * cut.group_pairs; ++j) {
      __builtin_prefetch(panel + (j + kDequantAhead) * 2 * kPanel, 0, 2);
      const __m512i w = _mm512_loadu_si512(panel + j * 2 * kPanel);
      __m512 values[4];
      values[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(w, 0)));
      values[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(w, 1)));
      values[2] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(w, 2)));
      values[3] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(w, 3)));
      for (int v = 0; v < 4; ++v) values[v] = _mm512_mul_ps(values[v], column_scales[v]);
      const __m512i low = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(values[1], values[0]));
      const __m512i high = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(values[3], values[2]));
      if constexpr (KMajor) {
        _mm512_mask_storeu_epi16(block + 2 * j * ldo, columns, _mm512_permutex2var_epi16(low, evens, high));
        _mm512_mask_storeu_epi16(block + (2 * j + 1) * ldo, columns, _mm512_permutex2var_epi16(low, odds, high));
      } else {
        _mm512_storeu_si512(block + j * 2 * kPanel, low);
        _mm512_storeu_si512(block + j * 2 * kPanel + 32, high);
      }
    }
  }
}
#endif  // CPU_CAPABILITY_AVX512


// Rows of x up to this many take int8 panels six at a time, one row after another over each group of
// panels (the group, 55-150 KB, stays in L2 for the next row): as for one row, six streams draw more
// of the memory's bandwidth than one panel of a register tile of rows on AVX2. With AVX-512 (a
// register tile of 12 rows) only one row does: 2-4 rows run faster as register tiles there
// (`python bench/amx_int8_vs_panels.py`; on AVX2, `tokenmill bench kernels`, its int8 panels).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kInt8RowByRow = 1;
#else
constexpr int64_t kInt8RowByRow = 4;
#endif

// Rows [0, rows) of x (int16 pairs and block scales) times int8 panels [p, end) in groups of P full
// panels, then of fewer; p ends at the first panel left (none, or a last partial one).
template <int P, typename Scale>
inline void int8_panel_groups(const int16_t* xq, const float* sx, int64_t rows, const int8_t* qp, const Scale* sp,
                              const ActivationBlocks& cut, const float* bias, float* out, int64_t n, int64_t& p,
                              int64_t end) {
  for (; p + P <= end && (p + P) * kPanel <= n; p += P)
    for (int64_t r = 0; r < rows; ++r)
      int8_panel_tile<1, P>(xq + r * cut.inputs(), 0, sx + r * cut.blocks(), 0, qp + p * cut.panel_bytes(),
                            sp + p * cut.panel_scales(), cut, bias != nullptr ? bias + p * kPanel : nullptr,
                            out + r * n + p * kPanel, n, kPanel);
  if constexpr (P > 1) int8_panel_groups<P - 1>(xq, sx, rows, qp, sp, cut, bias, out, n, p, end);
}

// Steps of at least this many rows take the AMX tiles where they apply (fp32 x: amx_int8_panel_tile;
// bf16 x: panel_as_bf16); fewer stay on the panels, which stream the weights at fewer instructions
// per byte: the row counts from which the tiles win (`python bench/amx_int8_vs_panels.py`, a model's
// layer GEMMs on either).
constexpr int64_t kAmxInt8MinRows = 16;
constexpr int64_t kAmxBf16MinRows = 12;

#if defined(CPU_CAPABILITY_AVX512)
// Whether the weight's groups are the tiles' depth: groups of 32 inputs, one activation block each.
bool groups_are_tile_deep(const ActivationBlocks& cut) {
  return cut.group_pairs == kAmxGroupPairs && cut.blocks_per_group == 1;
}
#endif

// x [m, K] a bf16 model's activations, on the AMX-bf16 tiles (see panel_as_bf16)?
bool amx_bf16_applies(const at::Tensor& x, const ActivationBlocks& cut) {
#if defined(CPU_CAPABILITY_AVX512)
  static_assert(kPanel == 32, "an int8 panel is one of amx_linear's 32-output blocks");
  return x.scalar_type() == at::kBFloat16 && x.size(0) >= kAmxBf16MinRows && groups_are_tile_deep(cut) &&
         amx_bf16_usable();
#else
  (void)x, (void)cut;
  return false;
#endif
}

// From this many rows a bf16 step's int8 weights (of a layer without a bias) are widened to one bf16
// [K, N] matrix and multiplied by oneDNN's bf16 GEMM (prefill chunks): its blocking reuses a weight
// tile across more rows than the tiles above, which pays for the widening on prefill-sized steps
// (`python bench/amx_int8_vs_panels.py`).
constexpr int64_t kDenseMinRows = 1024;

// out = x W^T (+ bias) for bf16 x [m, K] where amx_bf16_applies (see panel_as_bf16), bf16 or fp32
// (`fp32_out`: logits, the tiles' fp32 sums as they are).
template <typename Scale>
at::Tensor bf16_tiles_int8_linear(const at::Tensor& x, const at::Tensor& packed, const Scale* sp,
                                  const ActivationBlocks& cut, const float* bias_ptr, int64_t n, bool fp32_out) {
  const int64_t m = x.size(0), k = x.size(1), chunks = (m + 31) / 32;
#if defined(CPU_CAPABILITY_AVX512)
  // (with a bias, or fp32 out: the tiles, which add it before rounding, or do not round)
  if (m >= kDenseMinRows && bias_ptr == nullptr && !fp32_out) {
    at::Tensor weight = at::empty({k, n}, x.options());
    at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
    const int8_t* qp = packed.data_ptr<int8_t>();
    at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p)
        panel_as_bf16<true>(qp + p * cut.panel_bytes(), sp + p * cut.panel_scales(), cut, wp + p * kPanel, n,
                            std::min(kPanel, n - p * kPanel));
    });
    return at::matmul(x, weight);
  }
#endif
  at::Tensor xp = x.contiguous();
  if (m > 32 && m % 32 != 0) xp = at::constant_pad_nd(xp, {0, 0, 0, chunks * 32 - m});  // whole 32-row chunks
  at::Tensor out = at::empty({m, n}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
#if defined(CPU_CAPABILITY_AVX512)
  const int8_t* qp = packed.data_ptr<int8_t>();
  const at::BFloat16* xd = xp.data_ptr<at::BFloat16>();
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<CacheLine> lines;
    lines.resize(static_cast<size_t>(k * kPanel * 2 / 64));
    auto* block = reinterpret_cast<at::BFloat16*>(lines.data());
    const auto block_of = [&](int64_t p) {
      panel_as_bf16(qp + p * cut.panel_bytes(), sp + p * cut.panel_scales(), cut, block);
      return static_cast<const at::BFloat16*>(block);
    };
    if (fp32_out)
      amx_bf16_blocks(xd, m, k, begin, end, block_of, bias_ptr, out.data_ptr<float>(), n);
    else
      amx_bf16_blocks(xd, m, k, begin, end, block_of, bias_ptr, out.data_ptr<at::BFloat16>(), n);
  });
#endif
  return out;
}

// x's int16 inputs as the AMX tiles read them (high and low bytes), or none: the panel path.
struct SplitInputs {
  const int8_t* high = nullptr;
  const uint8_t* low = nullptr;
};

bool amx_int8_applies(const ActivationBlocks& cut, int64_t m) {
#if defined(CPU_CAPABILITY_AVX512)
  return m >= kAmxInt8MinRows && groups_are_tile_deep(cut) && amx_int8_usable();
#else
  (void)cut, (void)m;
  return false;
#endif
}

// x's m rows of int16 inputs (kp a row) split into `high` and `low` for the AMX tiles, with 16 zero
// rows after them (a tile of 16 rows starting at any row reads inside the buffers); none where the
// tiles do not apply. `parallel`: split on torch's threads (else on the calling one).
SplitInputs split_for_amx(const int16_t* xq, const ActivationBlocks& cut, int64_t m, std::vector<int8_t>& high,
                          std::vector<uint8_t>& low, bool parallel) {
  if (!amx_int8_applies(cut, m)) return {};
#if defined(CPU_CAPABILITY_AVX512)
  const int64_t kp = cut.inputs();
  high.resize(static_cast<size_t>((m + kAmxTileRows) * kp));
  low.resize(high.size());
  std::fill(high.begin() + m * kp, high.end(), 0);
  std::fill(low.begin() + m * kp, low.end(), 0);
  auto split = [&](int64_t r0, int64_t r1) {
    split_int16(xq + r0 * kp, (r1 - r0) * kp, high.data() + r0 * kp, low.data() + r0 * kp);
  };
  if (parallel)
    at::parallel_for(0, m, 64, split);
  else
    split(0, m);
#endif
  return {high.data(), low.data()};
}

// Rows [m0, m0 + rows) of x (int16 pairs and block scales, m rows in all; `split` where the AMX tiles
// apply) times int8 panels [begin, end).
template <typename Scale>
void int8_panel_range(const int16_t* xqp, const float* sxp, SplitInputs split, const ActivationBlocks& cut,
                      const int8_t* qp, const Scale* sp, const float* bias_ptr, float* op, int64_t m, int64_t n,
                      int64_t begin, int64_t end, int64_t m0, int64_t rows) {
#if defined(CPU_CAPABILITY_AVX512)
  if (split.high != nullptr) {
    amx_int8_panel_range(split.high, split.low, sxp, cut, qp, sp, bias_ptr, op, m, n, begin, end, m0, rows);
    return;
  }
#endif
  const int64_t kp = cut.inputs(), blocks = cut.blocks();
  int64_t p = begin;
  if (m <= kInt8RowByRow) int8_panel_groups<kOneRowPanels>(xqp, sxp, m, qp, sp, cut, bias_ptr, op, n, p, end);
  for (; p < end; ++p) {
    const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
    const int8_t* panel = qp + p * cut.panel_bytes();
    const Scale* scales = sp + p * cut.panel_scales();
    const float* b = bias_ptr != nullptr ? bias_ptr + col : nullptr;
    const bool last = p + 1 == end;  // (the thread's last panel requests itself again, as in panel_gemm)
    const int8_t* next = last ? panel : panel + cut.panel_bytes();
    const Scale* next_scales = last ? scales : scales + cut.panel_scales();
    for_row_groups<kTileM>(rows, [&](auto count, int64_t r) {
      const int64_t row = m0 + r;
      int8_panel_tile<decltype(count)::value, 1, true>(xqp + row * kp, kp, sxp + row * blocks, blocks, panel, scales,
                                                       cut, b, op + row * n + col, n, cols, next, next_scales);
    });
  }
}


}  // namespace

at::Tensor pack_int8_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kChar && weight.dim() == 2,
              "pack_int8_weight: an int8 CPU weight [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel, pairs = (k + 1) / 2;
  at::Tensor padded = at::zeros({panels * kPanel, 2 * pairs}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  // [panels, kPanel, pairs, 2] -> [panels, pairs, kPanel, 2]: a pair's 2 * kPanel bytes side by side
  return padded.view({panels, kPanel, pairs, 2}).permute({0, 2, 1, 3}).contiguous().view({panels, pairs, 2 * kPanel});
}

namespace {

// Calls f with the data of an int8 layer's packed scales as its type: bf16 (tokenmill's) or fp16 (a
// checkpoint's).
template <typename F>
auto with_scales(const at::Tensor& scales, F&& f) {
  if (scales.scalar_type() == at::kHalf) return f(static_cast<const at::Half*>(scales.data_ptr<at::Half>()));
  return f(static_cast<const at::BFloat16*>(scales.data_ptr<at::BFloat16>()));
}

bool int8_scale_type(const at::Tensor& scales) {
  return scales.scalar_type() == at::kBFloat16 || scales.scalar_type() == at::kHalf;
}

// x W^T (+ bias) in x's dtype, or fp32 with `fp32_out` (nothing rounded after the sums).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& packed_scales,
                       const c10::optional<at::Tensor>& bias, int64_t n, bool fp32_out) {
  TORCH_CHECK(x.device().is_cpu() && x.is_floating_point() && x.dim() >= 1, "packed_int8_linear: a float CPU x [..., K]");
  const int64_t k = x.size(-1), panels = packed.dim() == 3 ? packed.size(0) : 0;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.size(2) == 2 * kPanel &&
                  packed.is_contiguous() && packed.size(1) == (k + 1) / 2 && panels * kPanel >= n &&
                  (panels - 1) * kPanel < n,
              "packed_int8_linear: an int8 weight from pack_int8_weight for this K, N and CPU (panels of ", kPanel, ")");
  TORCH_CHECK(int8_scale_type(packed_scales) && packed_scales.dim() == 3 && packed_scales.is_contiguous() &&
                  packed_scales.size(0) == panels && packed_scales.size(2) == kPanel && packed_scales.size(1) > 0 &&
                  k % packed_scales.size(1) == 0 && (packed_scales.size(1) == 1 || k / packed_scales.size(1) % 2 == 0),
              "packed_int8_linear: bf16 or fp16 scales from pack_linear_weight([N, groups]) with groups dividing K "
              "(into even groups, or one)");
  const ActivationBlocks cut(k, packed_scales.size(1));
  at::Tensor bias_holder;
  const float* bias_ptr = bias_data(bias, n, bias_holder, "packed_int8_linear");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  const at::Tensor x2d = x.reshape({-1, k});
  if (n > 0 && amx_bf16_applies(x2d, cut))
    return with_scales(packed_scales, [&](auto sp) {
      return bf16_tiles_int8_linear(x2d, packed, sp, cut, bias_ptr, n, fp32_out).view(shape);
    });
  const at::Tensor xc = x2d.to(at::kFloat).contiguous();  // (a bf16 model's activations too)
  const int64_t m = xc.size(0), kp = cut.inputs();
  at::Tensor out = at::empty({m, n}, xc.options());
  if (m > 0 && n > 0) {
    // x as int16 and its block scales: per-thread buffers kept across calls (not two tensors
    // allocated per call).
    thread_local std::vector<int16_t> xq;
    thread_local std::vector<float> sx;
    xq.resize(static_cast<size_t>(m * kp));
    sx.resize(static_cast<size_t>(m * cut.blocks()));
    const float* xp = xc.data_ptr<float>();
    int16_t* xqp = xq.data();
    float* sxp = sx.data();
    at::parallel_for(0, m, 64, [&](int64_t r0, int64_t r1) { quantize_activations(xp, k, cut, r0, r1, xqp, sxp); });
    thread_local std::vector<int8_t> high;
    thread_local std::vector<uint8_t> low;
    const SplitInputs split = split_for_amx(xqp, cut, m, high, low, true);
    const int8_t* qp = packed.data_ptr<int8_t>();
    float* op = out.data_ptr<float>();
    with_scales(packed_scales, [&](auto sp) {
      for_panel_blocks(m, k, panels, [&](int64_t begin, int64_t end, int64_t m0, int64_t rows) {
        int8_panel_range(xqp, sxp, split, cut, qp, sp, bias_ptr, op, m, n, begin, end, m0, rows);
      });
    });
  }
  return fp32_out ? out.view(shape) : out.view(shape).to(x.scalar_type());
}

}  // namespace

at::Tensor packed_int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& packed_scales,
                              const c10::optional<at::Tensor>& bias, int64_t n) {
  return int8_linear(x, packed, packed_scales, bias, n, false);
}

// Logits of a bf16 (or fp32) model's int8 head: fp32, whatever x's dtype.
at::Tensor packed_int8_logits(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& packed_scales,
                              const c10::optional<at::Tensor>& bias, int64_t n) {
  return int8_linear(x, packed, packed_scales, bias, n, true);
}


void packed_int8_linear_rows(const float* x, int64_t m, int64_t k, const at::Tensor& packed,
                             const at::Tensor& packed_scales, const float* bias, float* out, int64_t n, int64_t begin,
                             int64_t end, Int8RowScratch& scratch) {
  const ActivationBlocks cut(k, packed_scales.size(1));
  scratch.xq.resize(static_cast<size_t>(m * cut.inputs()));
  scratch.sx.resize(static_cast<size_t>(m * cut.blocks()));
  quantize_activations(x, k, cut, 0, m, scratch.xq.data(), scratch.sx.data());
  const SplitInputs split = split_for_amx(scratch.xq.data(), cut, m, scratch.high, scratch.low, false);
  with_scales(packed_scales, [&](auto sp) {
    int8_panel_range(scratch.xq.data(), scratch.sx.data(), split, cut, packed.data_ptr<int8_t>(), sp, bias, out, m,
                     n, begin, end, 0, m);
  });
}

// Rows `ids` of the int8 matrix [N, k] packed by pack_int8_weight (row v: column v % kPanel of
// panel v / kPanel, by pairs of inputs), times their group scales, as `dtype` rows [..., k]: the
// token embedding tied to an int8 lm_head (models/layers/quantization/int8.py Int8Embedding). The
// product is rounded once to dtype from fp32, as torch's int8.to(dtype) * scale.to(dtype) rounds it.
at::Tensor packed_int8_rows(const at::Tensor& ids, const at::Tensor& packed, const at::Tensor& packed_scales,
                            int64_t k, at::ScalarType dtype) {
  TORCH_CHECK(ids.scalar_type() == at::kLong, "packed_int8_rows: int64 ids");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.size(2) == 2 * kPanel &&
                  packed.is_contiguous() && packed.size(1) == (k + 1) / 2,
              "packed_int8_rows: an int8 weight from pack_int8_weight for this K and CPU");
  TORCH_CHECK(int8_scale_type(packed_scales) && packed_scales.dim() == 3 && packed_scales.is_contiguous() &&
                  packed_scales.size(0) == packed.size(0) && packed_scales.size(2) == kPanel &&
                  packed_scales.size(1) > 0 && k % packed_scales.size(1) == 0,
              "packed_int8_rows: bf16 or fp16 scales from pack_linear_weight([N, groups]) with groups dividing K");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "packed_int8_rows: fp32 or bf16 rows");
  const at::Tensor flat = ids.reshape({-1}).contiguous();
  const int64_t count = flat.numel(), rows = packed.size(0) * kPanel, groups = packed_scales.size(1);
  const int64_t group_size = k / groups, pairs = packed.size(1);
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t t = 0; t < count; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < rows, "packed_int8_rows: id ", id[t], " is outside the ", rows, " rows");
  at::Tensor out = at::empty({count, k}, flat.options().dtype(dtype));
  const int8_t* qp = packed.data_ptr<int8_t>();
  auto fill = [&](auto* dst, auto round) {
    with_scales(packed_scales, [&](auto sp) {
      at::parallel_for(0, count, 256, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t panel = id[t] / kPanel, column = id[t] % kPanel;
          const int8_t* values = qp + panel * pairs * 2 * kPanel + 2 * column;  // pair j at values[j * 2 * kPanel]
          const auto* scales = sp + panel * groups * kPanel + column;  // group g at scales[g * kPanel]
          for (int64_t i = 0; i < k; ++i)
            dst[t * k + i] = round(static_cast<float>(values[(i / 2) * 2 * kPanel + i % 2]) *
                                   static_cast<float>(scales[(i / group_size) * kPanel]));
        }
      });
    });
  };
  if (dtype == at::kFloat) {
    fill(out.data_ptr<float>(), [](float v) { return v; });
  } else {
    fill(out.data_ptr<at::BFloat16>(), [](float v) { return static_cast<float>(at::BFloat16(v)); });
  }
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  return out.view(shape);
}


}  // namespace tokenmill
