// Vectorised building blocks shared by tokenmill's CPU kernels: ATen's Vectorized<float> for the
// instruction set the including file is compiled for (see tokenmill/kernels/build.py).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace tokenmill {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
// Output columns per panel of a packed weight (packed_linear.cpp): two vectors, so a row of the
// register tile is two accumulators.
constexpr int64_t kPanel = 2 * kVec;
// Rows (query heads x queries, or weight rows) whose dot products share one load of the other operand.
constexpr int kRowGroup = 4;

inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// kVec bf16 values as fp32 (bf16 is the top half of an fp32: widen and shift, exact).
inline Vec load_bf16(const at::BFloat16* src) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
#else
  float widened[kVec];
  for (int64_t i = 0; i < kVec; ++i) widened[i] = static_cast<float>(src[i]);
  return Vec::loadu(widened);
#endif
}

// kVec values from memory as fp32: fp32 as they are, bf16 widened exactly (for kernels templated on
// the dtype of a row they stream: weight panels, K/V rows).
inline Vec load_as_float(const float* src) { return Vec::loadu(src); }
inline Vec load_as_float(const at::BFloat16* src) { return load_bf16(src); }
// fp16 (4-bit layers' scales) widened exactly (F16C).
inline Vec load_as_float(const at::Half* src) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
#else
  float widened[kVec];
  for (int64_t i = 0; i < kVec; ++i) widened[i] = static_cast<float>(src[i]);
  return Vec::loadu(widened);
#endif
}

// kVec fp32 values stored as T: fp32 as they are, bf16 rounded to nearest even (as Tensor.to rounds,
// NaN kept NaN).
inline void store_as(const Vec& v, float* dst) { v.store(dst); }
inline void store_as(const Vec& v, at::BFloat16* dst) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), at::vec::cvtfp32_bf16(__m512(v)));
#elif defined(CPU_CAPABILITY_AVX2)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), at::vec::cvtfp32_bf16(__m256(v)));
#else
  float values[kVec];
  v.store(values);
  for (int64_t i = 0; i < kVec; ++i) dst[i] = at::BFloat16(values[i]);
#endif
}

// v as a T would hold it, back in fp32: a bf16 op's rounding of its fp32 result (torch computes a
// bf16 op in fp32 and rounds once per op), nothing for fp32.
inline Vec round_as(const Vec& v, float) { return v; }
inline Vec round_as(const Vec& v, at::BFloat16) {
  at::BFloat16 rounded[kVec];
  store_as(v, rounded);
  return load_bf16(rounded);
}
// The scalar tails' counterpart.
inline float round_as(float v, float) { return v; }
inline float round_as(float v, at::BFloat16) { return static_cast<float>(at::BFloat16(v)); }

// Rows of K/V the kernels cannot read in place (fp16, int8; fp32 and bf16 rows are read where they
// are, see load_as_float) as fp32 in `scratch`. An int8 row is followed by its fp32 scale
// (tokenmill/models/layers/kv_quant.py).
template <typename T>
inline const float* as_float(const T* src, float* scratch, int64_t n) {
  for (int64_t i = 0; i < n; ++i) scratch[i] = static_cast<float>(src[i]);
  return scratch;
}
template <>
inline const float* as_float<int8_t>(const int8_t* src, float* scratch, int64_t n) {
  float scale;
  std::memcpy(&scale, src + n, sizeof(float));
  for (int64_t i = 0; i < n; ++i) scratch[i] = static_cast<float>(src[i]) * scale;
  return scratch;
}

// Lane sums in one fixed order, ((v0+v1)+(v2+v3)) + ((v4+v5)+(v6+v7)) (AVX-512: v_i + v_i+8 first),
// for one vector (hsum_pairwise) or four at once (hsum4: one transposing reduction instead of four).
// Both give the same bits for the same vector, so a dot product does not depend on whether it was
// reduced alone or in a tile of four (a key's score is the same in every tiling of the keys).
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
inline __m256 eight_lanes(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 x = v;
  return _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
#else
  return v;
#endif
}
#endif

inline float hsum_pairwise(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  const __m256 x = eight_lanes(v);
  const __m256 pairs = _mm256_hadd_ps(x, x);
  const __m256 quads = _mm256_hadd_ps(pairs, pairs);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
#else
  return hsum(v);
#endif
}

inline void hsum4(const Vec& a, const Vec& b, const Vec& c, const Vec& d, float* out) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  // hadd pairs within each 128-bit lane, twice: each lane then holds a partial sum of a, b, c and d
  // in order; the two lanes added.
  const __m256 ab = _mm256_hadd_ps(eight_lanes(a), eight_lanes(b)), cd = _mm256_hadd_ps(eight_lanes(c), eight_lanes(d));
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
#else
  out[0] = hsum(a);
  out[1] = hsum(b);
  out[2] = hsum(c);
  out[3] = hsum(d);
#endif
}

// Rows per group of a dot tile (below): 3 rows x 4 columns of fp32 accumulators, plus the 3 rows'
// chunks and one column chunk, are the 16 vector registers of AVX2.
constexpr int kTileRows = 3;

// Calls group(std::integral_constant<int, N>{}, first) for rows [from, n) cut into groups of N rows:
// G at a time, then one group of what is left, so each group's row count is a compile-time N.
template <int G, typename Group>
inline void for_row_groups(int64_t n, Group&& group, int64_t from = 0) {
  int64_t r = from;
  for (; r + G <= n; r += G) group(std::integral_constant<int, G>{}, r);
  if constexpr (G > 1) {
    if (r < n) for_row_groups<G - 1>(n, group, r);
  }
}

// Rows [0, n) in groups of kTileRows, for dot tiles.
template <typename Group>
inline void for_tile_rows(int64_t n, Group&& group) {
  for_row_groups<kTileRows>(n, group);
}

// Requests the lines of KT rows that start in bytes [from, to) of each row: a loop that reads one
// set of rows chunk by chunk can request the next set's lines as it goes, a line per line it reads.
template <int KT>
inline void prefetch_rows_span(const char* const* rows, int64_t from, int64_t to) {
  for (int64_t b = (from + 63) / 64 * 64; b < to; b += 64)
    #pragma GCC unroll 16
    for (int j = 0; j < KT; ++j) __builtin_prefetch(rows[j] + b);
}

// out[r * ld + j] = q_rows[r] . k_rows[j] for N rows and KT columns (keys, weight rows; fp32, or
// bf16 read as fp32), fp32 accumulation: each chunk of a row is loaded once for the KT columns.
// `ahead`: KT rows of ahead_size-byte elements to request as these are read (see prefetch_rows_span).
template <int N, int KT, typename K = float>
inline void dot_tile(const float* const* q_rows, const K* const* k_rows, int64_t dim, float* out, int64_t ld,
                     const char* const* ahead = nullptr, int64_t ahead_size = 4) {
  Vec acc[N][KT];
  #pragma GCC unroll 16
  for (int r = 0; r < N; ++r)
    #pragma GCC unroll 16
    for (int j = 0; j < KT; ++j) acc[r][j] = Vec(0.f);
  int64_t d = 0;
  for (; d + kVec <= dim; d += kVec) {
    if (ahead != nullptr) prefetch_rows_span<KT>(ahead, d * ahead_size, (d + kVec) * ahead_size);
    Vec qv[N];
    #pragma GCC unroll 16
    for (int r = 0; r < N; ++r) qv[r] = Vec::loadu(q_rows[r] + d);
    #pragma GCC unroll 16
    for (int j = 0; j < KT; ++j) {
      const Vec kv = load_as_float(k_rows[j] + d);
      #pragma GCC unroll 16
      for (int r = 0; r < N; ++r) acc[r][j] = at::vec::fmadd(qv[r], kv, acc[r][j]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < N; ++r) {
    float sums[KT];
    if constexpr (KT == 4) {
      hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], sums);
    } else {
      #pragma GCC unroll 16
      for (int j = 0; j < KT; ++j) sums[j] = hsum_pairwise(acc[r][j]);
    }
    #pragma GCC unroll 16
    for (int j = 0; j < KT; ++j) {
      for (int64_t t = d; t < dim; ++t) sums[j] += q_rows[r][t] * static_cast<float>(k_rows[j][t]);
      out[r * ld + j] = sums[j];
    }
  }
}

// dots[r] = q_rows[r] . k for n rows, kRowGroup rows sharing each load of k.
inline void dot_rows_any(const float* const* q_rows, int n, const float* k, int64_t dim, float* dots) {
  for_row_groups<kRowGroup>(n, [&](auto rows, int64_t r) {
    dot_tile<decltype(rows)::value, 1>(q_rows + r, &k, dim, dots + r, 1);
  });
}

}  // namespace tokenmill
