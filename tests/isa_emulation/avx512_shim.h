// Test-only (never compiled into tokenmill): lets the CPU kernels' AVX-512 variant run on a CPU
// with AVX2 but no AVX-512, so its 16-lane logic (32-column panels, 12-row tiles, tails, the
// 512-bit intrinsics in tokenmill/kernels/csrc) is tested on every machine this project gets.
// Force-included (-include) before the kernel sources, with -mavx2 and CPU_CAPABILITY_AVX512:
// SIMDe (libsimde-dev) supplies _mm512_* and the __m512 types as portable code, ATen's 512-bit
// Vectorized<> is compiled against them, and the few things SIMDe 0.7.4 lacks or gets wrong are
// defined below lane by lane. Sleef's 512-bit functions (libtorch has them only for real AVX-512)
// become std:: calls per lane: results may differ from Sleef in the last bit, not in logic.
// Loaded by tests/isa_emulation/avx512.py (`make test-avx512-emulated`).
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

namespace tm_emulation {

template <typename Out, typename In>
inline Out bits(const In& in) {
  static_assert(sizeof(Out) == sizeof(In));
  Out out;
  std::memcpy(&out, &in, sizeof(out));
  return out;
}

template <typename T, int N>
struct Lanes {
  T v[N];
};
using F16 = Lanes<float, 16>;
using D8 = Lanes<double, 8>;
using I16 = Lanes<int32_t, 16>;

template <typename L, typename V, typename F>
inline V map1(V x, F f) {
  L a = bits<L>(x);
  for (auto& lane : a.v) lane = f(lane);
  return bits<V>(a);
}
template <typename L, typename V, typename F>
inline V map2(V x, V y, F f) {
  L a = bits<L>(x);
  const L b = bits<L>(y);
  for (int i = 0; i < static_cast<int>(sizeof(a.v) / sizeof(a.v[0])); ++i) a.v[i] = f(a.v[i], b.v[i]);
  return bits<V>(a);
}

inline float round_as(float x, int mode) {  // _MM_FROUND_TO_{NEAREST_INT,NEG_INF,POS_INF,ZERO}
  switch (mode & 3) {
    case 1: return std::floor(x);
    case 2: return std::ceil(x);
    case 3: return std::trunc(x);
    default: return std::nearbyint(x);
  }
}

inline simde__m512i cvt_round_ps_epi32(simde__m512 v, int mode) {
  const F16 a = bits<F16>(v);
  I16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<int32_t>(round_as(a.v[i], mode));
  return bits<simde__m512i>(r);
}

inline simde__m512 cvtepi32_ps(simde__m512i v) {
  const I16 a = bits<I16>(v);
  F16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(a.v[i]);
  return bits<simde__m512>(r);
}

inline simde__m512i cvtepu16_epi32(__m256i v) {
  const Lanes<uint16_t, 16> a = bits<Lanes<uint16_t, 16>>(v);
  I16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i];
  return bits<simde__m512i>(r);
}

inline simde__m512i madd_epi16(simde__m512i a, simde__m512i b) {
  const Lanes<int16_t, 32> x = bits<Lanes<int16_t, 32>>(a), y = bits<Lanes<int16_t, 32>>(b);
  I16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = int32_t{x.v[2 * i]} * y.v[2 * i] + int32_t{x.v[2 * i + 1]} * y.v[2 * i + 1];
  return bits<simde__m512i>(r);
}

inline simde__m512 maskz_loadu_ps(simde__mmask16 k, const void* p) {
  F16 r{};
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) r.v[i] = static_cast<const float*>(p)[i];
  return bits<simde__m512>(r);
}

inline void mask_storeu_ps(void* p, simde__mmask16 k, simde__m512 v) {
  const F16 a = bits<F16>(v);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) static_cast<float*>(p)[i] = a.v[i];
}

inline simde__m256 extractf32x8_ps(simde__m512 v, int half) {
  return bits<Lanes<simde__m256, 2>>(v).v[half & 1];
}

inline float cvtss_f32(simde__m512 v) { return bits<F16>(v).v[0]; }

inline simde__m512 shuffle_f32x4(simde__m512 a, simde__m512 b, int imm) {
  const F16 x = bits<F16>(a), y = bits<F16>(b);
  F16 r;
  for (int quarter = 0; quarter < 4; ++quarter) {
    const float* src = (quarter < 2 ? x.v : y.v) + 4 * ((imm >> (2 * quarter)) & 3);
    std::memcpy(r.v + 4 * quarter, src, 4 * sizeof(float));
  }
  return bits<simde__m512>(r);
}

inline __m256i cvtps_ph(simde__m512 v, int) {  // F16C is native: convert each half
  const Lanes<__m256, 2> halves = bits<Lanes<__m256, 2>>(v);
  return _mm256_set_m128i(_mm256_cvtps_ph(halves.v[1], 0), _mm256_cvtps_ph(halves.v[0], 0));
}

inline simde__m512 cvtph_ps(__m256i h) {
  const Lanes<__m256, 2> halves{{_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))}};
  return bits<simde__m512>(halves);
}

}  // namespace tm_emulation

// Missing from SIMDe 0.7.4, or wrong there (its _mm512_madd_epi16 alias takes four arguments).
#undef _mm512_cvt_roundps_epi32
#define _mm512_cvt_roundps_epi32(v, mode) tm_emulation::cvt_round_ps_epi32(v, mode)
#undef _mm512_cvtps_epi32
#define _mm512_cvtps_epi32(v) tm_emulation::cvt_round_ps_epi32(v, 0)
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps(v) tm_emulation::cvtepi32_ps(v)
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32(v) tm_emulation::cvtepu16_epi32(v)
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) tm_emulation::madd_epi16(a, b)
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps(k, p) tm_emulation::maskz_loadu_ps(k, p)
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps(p, k, v) tm_emulation::mask_storeu_ps(p, k, v)
#undef _mm512_extractf32x8_ps
#define _mm512_extractf32x8_ps(v, half) tm_emulation::extractf32x8_ps(v, half)
#undef _mm512_cvtss_f32
#define _mm512_cvtss_f32(v) tm_emulation::cvtss_f32(v)
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_f32x4(a, b, imm) tm_emulation::shuffle_f32x4(a, b, imm)
#undef _mm512_cvtps_ph
#define _mm512_cvtps_ph(v, rounding) tm_emulation::cvtps_ph(v, rounding)
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps(h) tm_emulation::cvtph_ps(h)

// Sleef's 512-bit math (ATen's vec512 calls them), lane by lane.
#define TM_SLEEF_UNARY(f16, d8, fn)                                                                         \
  inline simde__m512 f16(simde__m512 x) {                                                                   \
    return tm_emulation::map1<tm_emulation::F16>(x, [](float v) { return fn(v); });                        \
  }                                                                                                         \
  inline simde__m512d d8(simde__m512d x) {                                                                  \
    return tm_emulation::map1<tm_emulation::D8>(x, [](double v) { return fn(v); });                        \
  }
#define TM_SLEEF_BINARY(f16, d8, fn)                                                                        \
  inline simde__m512 f16(simde__m512 x, simde__m512 y) {                                                    \
    return tm_emulation::map2<tm_emulation::F16>(x, y, [](float a, float b) { return fn(a, b); });         \
  }                                                                                                         \
  inline simde__m512d d8(simde__m512d x, simde__m512d y) {                                                  \
    return tm_emulation::map2<tm_emulation::D8>(x, y, [](double a, double b) { return fn(a, b); });        \
  }
TM_SLEEF_UNARY(Sleef_acosf16_u10, Sleef_acosd8_u10, std::acos)
TM_SLEEF_UNARY(Sleef_acoshf16_u10, Sleef_acoshd8_u10, std::acosh)
TM_SLEEF_UNARY(Sleef_asinf16_u10, Sleef_asind8_u10, std::asin)
TM_SLEEF_UNARY(Sleef_asinhf16_u10, Sleef_asinhd8_u10, std::asinh)
TM_SLEEF_UNARY(Sleef_atanf16_u10, Sleef_atand8_u10, std::atan)
TM_SLEEF_UNARY(Sleef_atanhf16_u10, Sleef_atanhd8_u10, std::atanh)
TM_SLEEF_UNARY(Sleef_erfcf16_u15, Sleef_erfcd8_u15, std::erfc)
TM_SLEEF_UNARY(Sleef_erff16_u10, Sleef_erfd8_u10, std::erf)
TM_SLEEF_UNARY(Sleef_expf16_u10, Sleef_expd8_u10, std::exp)
TM_SLEEF_UNARY(Sleef_exp2f16_u10, Sleef_exp2d8_u10, std::exp2)
TM_SLEEF_UNARY(Sleef_expm1f16_u10, Sleef_expm1d8_u10, std::expm1)
TM_SLEEF_UNARY(Sleef_logf16_u10, Sleef_logd8_u10, std::log)
TM_SLEEF_UNARY(Sleef_log2f16_u10, Sleef_log2d8_u10, std::log2)
TM_SLEEF_UNARY(Sleef_log10f16_u10, Sleef_log10d8_u10, std::log10)
TM_SLEEF_UNARY(Sleef_log1pf16_u10, Sleef_log1pd8_u10, std::log1p)
TM_SLEEF_UNARY(Sleef_sinf16_u10, Sleef_sind8_u10, std::sin)
TM_SLEEF_UNARY(Sleef_sinf16_u35, Sleef_sind8_u35, std::sin)
TM_SLEEF_UNARY(Sleef_sinhf16_u10, Sleef_sinhd8_u10, std::sinh)
TM_SLEEF_UNARY(Sleef_cosf16_u10, Sleef_cosd8_u10, std::cos)
TM_SLEEF_UNARY(Sleef_cosf16_u35, Sleef_cosd8_u35, std::cos)
TM_SLEEF_UNARY(Sleef_coshf16_u10, Sleef_coshd8_u10, std::cosh)
TM_SLEEF_UNARY(Sleef_tanf16_u10, Sleef_tand8_u10, std::tan)
TM_SLEEF_UNARY(Sleef_tanhf16_u10, Sleef_tanhd8_u10, std::tanh)
TM_SLEEF_UNARY(Sleef_lgammaf16_u10, Sleef_lgammad8_u10, std::lgamma)
TM_SLEEF_BINARY(Sleef_atan2f16_u10, Sleef_atan2d8_u10, std::atan2)
TM_SLEEF_BINARY(Sleef_copysignf16, Sleef_copysignd8, std::copysign)
TM_SLEEF_BINARY(Sleef_fmodf16, Sleef_fmodd8, std::fmod)
TM_SLEEF_BINARY(Sleef_hypotf16_u05, Sleef_hypotd8_u05, std::hypot)
TM_SLEEF_BINARY(Sleef_nextafterf16, Sleef_nextafterd8, std::nextafter)
TM_SLEEF_BINARY(Sleef_powf16_u10, Sleef_powd8_u10, std::pow)
