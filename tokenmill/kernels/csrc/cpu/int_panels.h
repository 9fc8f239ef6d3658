// Integer panels' shared parts (int8_linear.cpp, int4_linear.cpp): activations rounded to int16 per
// block of inputs, and the int16 pair products summed exactly in int32.
#pragma once

#include <ATen/ATen.h>

#include "vec_utils.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace tokenmill {

// int8 weights times 16-bit activations, summed exactly in int32 (pmaddwd multiplies two pairs of
// int16 and adds them: 16 products per AVX2 instruction, against 8 per FMA after widening each weight
// to fp32, scaling it and converting it, which left one row instruction-bound below the memory's
// read rate).
// x is quantized per row and block (a weight group of inputs, or an equal part of one over 512
// inputs, so that 512 products of 32767 x 127 fit an int32) to +-32767 of the block's largest
// magnitude: an error under 1/65534 of it per input, well below bf16's rounding of activations. Each
// block's int32 sums then enter the fp32 result as  acc = fma(float(sum) * x_scale, w_scale, acc).
// Every row takes the same blocks in the same order whatever its step holds: a row's result does
// not depend on the other rows (batch invariance).
constexpr int64_t kMaxBlockPairs = 256;

// How a row of K inputs is cut: `groups` weight groups of `group_pairs` pairs each (an odd K, one
// group, gets a zero input at its end), each cut into `blocks_per_group` blocks of up to
// `block_pairs` pairs with one activation scale each.
struct ActivationBlocks {
  int64_t groups, group_pairs, blocks_per_group, block_pairs;

  ActivationBlocks(int64_t k, int64_t group_count)
      : groups(group_count),
        group_pairs((k / group_count + 1) / 2),
        blocks_per_group((group_pairs + kMaxBlockPairs - 1) / kMaxBlockPairs),
        block_pairs((group_pairs + blocks_per_group - 1) / blocks_per_group) {}
  int64_t blocks() const { return groups * blocks_per_group; }
  int64_t pairs() const { return groups * group_pairs; }
  int64_t inputs() const { return 2 * pairs(); }  // K, or K + 1 for an odd K: a row of x as int16 pairs
  int64_t panel_bytes() const { return inputs() * kPanel; }  // one int8 panel
  int64_t panel_scales() const { return groups * kPanel; }  // one panel's scales
  int64_t block_index(int64_t group, int64_t block) const { return group * blocks_per_group + block; }
  int64_t first_pair(int64_t group, int64_t block) const { return group * group_pairs + block * block_pairs; }
  int64_t end_pair(int64_t group, int64_t block) const {
    return std::min(first_pair(group, block) + block_pairs, (group + 1) * group_pairs);
  }
};

// Registers of int16 pairs and int32 sums, and what they do: `load_pairs` widens kVec columns' pairs
// of int8 weights to int16, `broadcast_pair` repeats a pair of inputs in every lane, `madd` adds the
// lanes' two products to their int32 sums. (One set per instruction set: the same few lines over
// 512- or 256-bit intrinsics, or plain arrays.)
inline int32_t pair_bits(const int16_t* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return pair;
}
#if defined(CPU_CAPABILITY_AVX512)
using Int16Pairs = __m512i;
using Int32Sums = __m512i;
inline Int32Sums zero_sums() { return _mm512_setzero_si512(); }
inline Int16Pairs load_pairs(const int8_t* w) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
}
inline Int16Pairs broadcast_pair(const int16_t* x) { return _mm512_set1_epi32(pair_bits(x)); }
inline Int32Sums madd(Int32Sums sums, Int16Pairs w, Int16Pairs x) {
  return _mm512_add_epi32(sums, _mm512_madd_epi16(w, x));
}
inline Vec to_float(Int32Sums sums) { return Vec(_mm512_cvtepi32_ps(sums)); }
#elif defined(CPU_CAPABILITY_AVX2)
using Int16Pairs = __m256i;
using Int32Sums = __m256i;
inline Int32Sums zero_sums() { return _mm256_setzero_si256(); }
inline Int16Pairs load_pairs(const int8_t* w) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}
inline Int16Pairs broadcast_pair(const int16_t* x) { return _mm256_set1_epi32(pair_bits(x)); }
inline Int32Sums madd(Int32Sums sums, Int16Pairs w, Int16Pairs x) {
  return _mm256_add_epi32(sums, _mm256_madd_epi16(w, x));
}
inline Vec to_float(Int32Sums sums) { return Vec(_mm256_cvtepi32_ps(sums)); }
#else
struct Int16Pairs {
  int32_t lane[2 * kVec];
};
struct Int32Sums {
  int32_t lane[kVec];
};
inline Int32Sums zero_sums() { return Int32Sums{}; }
inline Int16Pairs load_pairs(const int8_t* w) {
  Int16Pairs pairs;
  for (int64_t i = 0; i < 2 * kVec; ++i) pairs.lane[i] = w[i];
  return pairs;
}
inline Int16Pairs broadcast_pair(const int16_t* x) {
  Int16Pairs pairs;
  for (int64_t i = 0; i < 2 * kVec; ++i) pairs.lane[i] = x[i % 2];
  return pairs;
}
inline Int32Sums madd(Int32Sums sums, const Int16Pairs& w, const Int16Pairs& x) {
  for (int64_t i = 0; i < kVec; ++i) sums.lane[i] += w.lane[2 * i] * x.lane[2 * i] + w.lane[2 * i + 1] * x.lane[2 * i + 1];
  return sums;
}
inline Vec to_float(const Int32Sums& sums) {
  float lanes[kVec];
  for (int64_t i = 0; i < kVec; ++i) lanes[i] = static_cast<float>(sums.lane[i]);
  return Vec::loadu(lanes);
}
#endif

// n inputs as int16 (round to nearest even of x * inv, as torch.round does).
inline void round_to_int16(const float* x, float inv, int64_t n, int16_t* out) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; i + 16 <= n; i += 16) {
    const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(inv)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtsepi32_epi16(rounded));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  for (; i + 8 <= n; i += 8) {
    const __m256i rounded = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm_packs_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1)));
  }
#endif
  for (; i < n; ++i) out[i] = static_cast<int16_t>(std::nearbyint(x[i] * inv));
}

// Rows [r0, r1) of x [m, k] as int16 pairs xq [m, 2 * pairs] and their blocks' scales sx [m, blocks].
// A block's scale is its largest magnitude / 32767 (a NaN or an infinity stays in it, and so in the
// result); an all-zero block has scale 0 and zero inputs.
inline void quantize_activations(const float* x, int64_t k, const ActivationBlocks& cut, int64_t r0, int64_t r1, int16_t* xq,
                          float* sx) {
  const int64_t kp = cut.inputs(), blocks = cut.blocks();
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = x + r * k;
    for (int64_t g = 0; g < cut.groups; ++g) {
      for (int64_t b = 0; b < cut.blocks_per_group; ++b) {
        const int64_t begin = 2 * cut.first_pair(g, b), padded_end = 2 * cut.end_pair(g, b);
        const int64_t end = std::min(padded_end, k);
        Vec largest(0.f);
        for (int64_t i = begin; i < end; i += kVec)
          largest = at::vec::maximum(largest, Vec::loadu(row + i, std::min<int64_t>(kVec, end - i)).abs());
        const float amax = at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return at::vec::maximum(a, c); }, largest);
        const float inv = amax > 0.f && std::isfinite(amax) ? 32767.f / amax : 0.f;
        round_to_int16(row + begin, inv, end - begin, xq + r * kp + begin);
        for (int64_t i = end; i < padded_end; ++i) xq[r * kp + i] = 0;
        sx[r * blocks + cut.block_index(g, b)] = amax / 32767.f;
      }
    }
  }
}

}  // namespace tokenmill
