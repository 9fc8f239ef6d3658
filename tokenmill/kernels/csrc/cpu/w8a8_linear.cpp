// Linear layers on int8 weights and int8 activations (W8A8: compressed-tensors int-quantized with
// dynamic per-token activation scales, models/layers/quantization/w8a8.py). Each row of x is rounded
// to int8 by its own scale, s_x = max|x| / 127, q = round(x / s_x) (as vLLM's dynamic per-token
// quantization); the products with the int8 weights are summed exactly in int32 over all of K and
// scaled once: y = float(sum) * s_x * s_w[column] (+ bias). A row's result does not depend on the
// other rows of its step.
//
// The last step, (sum * s_x) * s_w + bias, is one fused multiply-add on every path (the compiler may
// not contract a product and a sum on some paths and not others: the rows of one step would differ in
// the last bit from the same rows alone).
//
// Layout: panels of kPanel output columns by quads of inputs, packed[p, j, 4c + t] = W[p * kPanel + c,
// 4j + t] (K padded with zero weights to a multiple of kQuadDepth), the form vpdpbusd and AMX's
// tdpbssd read: one 32-bit lane per column, its four weights of a quad. Per column (padded to whole
// panels): its fp32 scale, and 128 times the sum of its weights (int32).
//
// vpdpbusd multiplies unsigned bytes by signed ones: x's int8 values enter as x + 128 (1 to 255), and
// 128 * (the column's sum of weights) is taken off the int32 sum after, exactly. AVX512-VNNI (512-bit
// vectors) or AVX-VNNI (256-bit), where the CPU has them (checked at run time; TOKENMILL_VNNI=0 turns
// them off), else the same sums from pmaddwd on the bytes widened to int16: the same bits on every
// CPU. Steps of 16 rows and more on AMX-int8 tiles where present (tdpbssd: signed bytes, no offset;
// the same int32 sums).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "int_panels.h"
#include "kernels.h"
#include "panel_gemm.h"
#include "vec_utils.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace tokenmill {
namespace {

// Bytes of one quad row of a panel: kPanel columns x 4 inputs.
constexpr int64_t kQuadBytes = 4 * kPanel;
// Inputs the packed weight's K is padded to a multiple of: one AMX tile's depth (64 bytes a row).
constexpr int64_t kQuadDepth = 64;

// One row of x, or fewer, takes the panels six at a time row by row (as int8 panels do).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kW8A8RowByRow = 1;
#else
constexpr int64_t kW8A8RowByRow = 4;
#endif

struct W8A8Weights {
  const int8_t* packed;
  const int32_t* offsets;  // 128 * each column's sum of weights
  const float* scales;
  int64_t quads, panel_bytes;
};

// Registers of quads of bytes: kVec 32-bit lanes, each four bytes of a column (weights) or the same
// four inputs (x, broadcast).
#if defined(CPU_CAPABILITY_AVX512)
using QuadBytes = __m512i;
inline QuadBytes load_quads(const int8_t* w) { return _mm512_loadu_si512(w); }
inline QuadBytes broadcast_quad(const uint8_t* x) {
  int32_t quad;
  std::memcpy(&quad, x, sizeof(quad));
  return _mm512_set1_epi32(quad);
}
inline Int32Sums load_sums(const int32_t* s) { return _mm512_loadu_si512(s); }
inline Int32Sums subtract(Int32Sums a, Int32Sums b) { return _mm512_sub_epi32(a, b); }
// Each lane's four products of unsigned x and signed w bytes, added to its sum: the bytes widened to
// int16 (x's even and odd ones zero-extended, w's sign-extended), two pmaddwd.
inline Int32Sums dpbusd_widened(Int32Sums sums, QuadBytes x, QuadBytes w) {
  const __m512i low_bytes = _mm512_set1_epi16(0x00FF);
  const __m512i x_even = _mm512_and_si512(x, low_bytes), x_odd = _mm512_srli_epi16(x, 8);
  const __m512i w_even = _mm512_srai_epi16(_mm512_slli_epi16(w, 8), 8), w_odd = _mm512_srai_epi16(w, 8);
  return _mm512_add_epi32(sums, _mm512_add_epi32(_mm512_madd_epi16(x_even, w_even), _mm512_madd_epi16(x_odd, w_odd)));
}
#define TOKENMILL_VNNI_TARGET "avx512vnni"
constexpr int kVector = 512;
#define TOKENMILL_DPBUSD _mm512_dpbusd_epi32
#elif defined(CPU_CAPABILITY_AVX2)
using QuadBytes = __m256i;
inline QuadBytes load_quads(const int8_t* w) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)); }
inline QuadBytes broadcast_quad(const uint8_t* x) {
  int32_t quad;
  std::memcpy(&quad, x, sizeof(quad));
  return _mm256_set1_epi32(quad);
}
inline Int32Sums load_sums(const int32_t* s) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)); }
inline Int32Sums subtract(Int32Sums a, Int32Sums b) { return _mm256_sub_epi32(a, b); }
inline Int32Sums dpbusd_widened(Int32Sums sums, QuadBytes x, QuadBytes w) {
  const __m256i low_bytes = _mm256_set1_epi16(0x00FF);
  const __m256i x_even = _mm256_and_si256(x, low_bytes), x_odd = _mm256_srli_epi16(x, 8);
  const __m256i w_even = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8), w_odd = _mm256_srai_epi16(w, 8);
  return _mm256_add_epi32(sums, _mm256_add_epi32(_mm256_madd_epi16(x_even, w_even), _mm256_madd_epi16(x_odd, w_odd)));
}
#define TOKENMILL_VNNI_TARGET "avxvnni"
constexpr int kVector = 256;
#define TOKENMILL_DPBUSD _mm256_dpbusd_avx_epi32
#else
struct QuadBytes {
  int8_t lane[4 * kVec];
};
inline QuadBytes load_quads(const int8_t* w) {
  QuadBytes q;
  std::memcpy(q.lane, w, sizeof(q.lane));
  return q;
}
inline QuadBytes broadcast_quad(const uint8_t* x) {
  QuadBytes q;
  for (int64_t i = 0; i < 4 * kVec; ++i) q.lane[i] = static_cast<int8_t>(x[i % 4]);
  return q;
}
inline Int32Sums load_sums(const int32_t* s) {
  Int32Sums sums;
  for (int64_t i = 0; i < kVec; ++i) sums.lane[i] = s[i];
  return sums;
}
inline Int32Sums subtract(Int32Sums a, const Int32Sums& b) {
  for (int64_t i = 0; i < kVec; ++i) a.lane[i] -= b.lane[i];
  return a;
}
inline Int32Sums dpbusd_widened(Int32Sums sums, const QuadBytes& x, const QuadBytes& w) {
  for (int64_t i = 0; i < kVec; ++i)
    for (int64_t t = 0; t < 4; ++t)
      sums.lane[i] += static_cast<uint8_t>(x.lane[4 * i + t]) * static_cast<int32_t>(w.lane[4 * i + t]);
  return sums;
}
#endif

#define TOKENMILL_W8A8_TARGET
// The bias of columns [from, from + kVec) of a tile, those of them below `count` (the rest, and
// every one without a bias, zero).
inline Vec column_bias(const float* bias, int64_t from, int64_t count) {
  if (bias == nullptr || count <= 0) return Vec(0.f);
  return count >= kVec ? Vec::loadu(bias + from) : Vec::loadu(bias + from, count);
}

// a * b + c rounded once (ATen's generic fmadd rounds twice).
inline Vec fused_multiply_add(const Vec& a, const Vec& b, const Vec& c) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return at::vec::fmadd(a, b, c);
#else
  float lanes[kVec];
  for (int64_t i = 0; i < kVec; ++i) lanes[i] = std::fma(a[i], b[i], c[i]);
  return Vec::loadu(lanes);
#endif
}

namespace widened {
inline Int32Sums dpbusd(Int32Sums sums, QuadBytes x, QuadBytes w) { return dpbusd_widened(sums, x, w); }
#include "w8a8_tiles.h"
}  // namespace widened
#undef TOKENMILL_W8A8_TARGET

#if defined(TOKENMILL_VNNI_TARGET)
#define TOKENMILL_W8A8_TARGET __attribute__((target(TOKENMILL_VNNI_TARGET)))
namespace vnni {
TOKENMILL_W8A8_TARGET inline Int32Sums dpbusd(Int32Sums sums, QuadBytes x, QuadBytes w) {
  return TOKENMILL_DPBUSD(sums, x, w);
}
#include "w8a8_tiles.h"
}  // namespace vnni
#undef TOKENMILL_W8A8_TARGET

// The CPU's int8 dot products (AVX512-VNNI or AVX-VNNI, for this build's vectors), unless
// TOKENMILL_VNNI=0.
bool vnni_usable() {
  static const bool usable = [] {
    const char* setting = std::getenv("TOKENMILL_VNNI");
    if (setting != nullptr && std::strcmp(setting, "0") == 0) return false;
    return __builtin_cpu_supports(TOKENMILL_VNNI_TARGET) != 0;
  }();
  return usable;
}
#else
bool vnni_usable() { return false; }
#endif

// Rows [r0, r1) of x [m, k] (fp32) as bytes q + 128 [m, kp] (inputs past k: 128, a zero), and
// their scales s_x = max|x| / 127 (at least 1e-12: an all-zero row has zero inputs). A row with a
// NaN or an infinity keeps that scale, and so NaN results.
void quantize_rows(const float* x, int64_t k, int64_t kp, int64_t r0, int64_t r1, uint8_t* xu, float* sx) {
  thread_local std::vector<float> levels;
  levels.resize(static_cast<size_t>(k));
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = x + r * k;
    Vec largest(0.f);
    int64_t i = 0;
    for (; i + kVec <= k; i += kVec) largest = at::vec::maximum(largest, Vec::loadu(row + i).abs());
    float amax = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, largest);
    for (; i < k; ++i) amax = std::isnan(row[i]) ? row[i] : std::max(amax, std::fabs(row[i]));
    const float scale = std::isnan(amax) ? amax : std::max(amax / 127.f, 1e-12f);
    sx[r] = scale;
    uint8_t* out = xu + r * kp;
    std::fill(out + k, out + kp, uint8_t{128});
    if (!std::isfinite(scale)) {
      std::fill(out, out + k, uint8_t{128});
      continue;
    }
    // (a quotient, not a product with 1 / scale: the levels torch's round(x / scale) gives)
    const Vec s(scale), lo(-127.f), hi(127.f);
    i = 0;
    for (; i + kVec <= k; i += kVec) at::vec::clamp((Vec::loadu(row + i) / s).round(), lo, hi).store(levels.data() + i);
    for (; i < k; ++i) levels[i] = std::clamp(std::nearbyint(row[i] / scale), -127.f, 127.f);
    for (i = 0; i < k; ++i) out[i] = static_cast<uint8_t>(static_cast<int32_t>(levels[i]) + 128);
  }
}

// Rows of x from which a step takes the AMX-int8 tiles (where present).
constexpr int64_t kAmxW8A8MinRows = 16;

#if defined(CPU_CAPABILITY_AVX512)
#define TOKENMILL_AMX_W8A8 __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl")))
constexpr int64_t kAmxRows = 16;
static_assert(kQuadBytes == 128, "a panel's quad row is two B tile rows of 16 columns");

// Tile 0: x's signed bytes (rows x 64 inputs); 1, 2: the panel's quads for its two halves of 16
// columns (16 quad rows x 64 bytes); 3, 4: the int32 sums of the two halves (rows x 16).
TOKENMILL_AMX_W8A8 void configure_w8a8_tiles(int rows) {
  AmxTileConfig config;
  for (int t = 0; t < 5; ++t) config.bytes_per_row[t] = 64, config.rows[t] = static_cast<uint8_t>(rows);
  config.rows[1] = config.rows[2] = 16;
  __asm__ __volatile__("" : : "r"(&config) : "memory");  // (keeps the stores above: see amx_linear.cpp)
  _tile_loadconfig(&config);
}

TOKENMILL_AMX_W8A8 void release_w8a8_tiles() { _tile_release(); }

// Rows [m0, m0 + rows) of x (signed bytes [m + 16 rows, kp], rows past m zero) times panels [begin, end).
TOKENMILL_AMX_W8A8 void amx_w8a8_range(const int8_t* xs, const float* sx, const W8A8Weights& w, const float* bias,
                                       float* out, int64_t m, int64_t n, int64_t begin, int64_t end, int64_t m0,
                                       int64_t rows) {
  const int64_t kp = 4 * w.quads;
  alignas(64) int32_t sums[2][kAmxRows][16];
  configure_w8a8_tiles(static_cast<int>(std::min(m, kAmxRows)));
  for (int64_t p = begin; p < end; ++p) {
    const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
    const int8_t* panel = w.packed + p * w.panel_bytes;
    for (int64_t r0 = m0; r0 < m0 + rows; r0 += kAmxRows) {
      _tile_zero(3);
      _tile_zero(4);
      for (int64_t t = 0; t < w.quads / 16; ++t) {
        _tile_loadd(0, xs + r0 * kp + t * kQuadDepth, kp);
        _tile_loadd(1, panel + t * 16 * kQuadBytes, kQuadBytes);
        _tile_loadd(2, panel + t * 16 * kQuadBytes + 64, kQuadBytes);
        _tile_dpbssd(3, 0, 1);
        _tile_dpbssd(4, 0, 2);
      }
      _tile_stored(3, sums[0], 64);
      _tile_stored(4, sums[1], 64);
      const int64_t count = std::min(kAmxRows, m0 + rows - r0);
      for (int64_t r = 0; r < count; ++r) {
        alignas(64) float row[kPanel];
        for (int h = 0; h < 2; ++h) {
          const __m512 product = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[h][r])), _mm512_set1_ps(sx[r0 + r]));
          const Vec b = column_bias(bias, col + 16 * h, cols - 16 * h);
          _mm512_store_ps(row + 16 * h, _mm512_fmadd_ps(product, _mm512_loadu_ps(w.scales + col + 16 * h), b));
        }
        std::copy(row, row + cols, out + (r0 + r) * n + col);
      }
    }
  }
  release_w8a8_tiles();
}
#endif

bool amx_w8a8_applies(int64_t m) {
#if defined(CPU_CAPABILITY_AVX512)
  return m >= kAmxW8A8MinRows && amx_int8_usable();
#else
  (void)m;
  return false;
#endif
}

// Rows [0, m) of bytes xu times panels [begin, end) on the calling thread, on the CPU's int8 dot
// products where it has them (every path the same int32 sums).
void w8a8_panels(const uint8_t* xu, const float* sx, const W8A8Weights& w, const float* bias, float* out, int64_t m,
                 int64_t n, int64_t begin, int64_t end, int64_t m0, int64_t rows) {
#if defined(TOKENMILL_VNNI_TARGET)
  if (vnni_usable()) {
    vnni::w8a8_panel_range(xu, sx, w, bias, out, m, n, begin, end, m0, rows);
    return;
  }
#endif
  widened::w8a8_panel_range(xu, sx, w, bias, out, m, n, begin, end, m0, rows);
}

// The panels' weights, their quads and the bytes of one panel, as the kernels read them.
W8A8Weights w8a8_weights(const at::Tensor& packed, const at::Tensor& offsets, const at::Tensor& scales) {
  const int64_t quads = packed.size(1);
  return {packed.data_ptr<int8_t>(), offsets.data_ptr<int32_t>(), scales.data_ptr<float>(), quads, quads * kQuadBytes};
}

// x W^T (+ bias), fp32, for x [m, k] fp32.
void w8a8_gemm(const float* xp, int64_t m, int64_t k, const W8A8Weights& w, int64_t panels, const float* bias,
               float* op, int64_t n) {
  const int64_t kp = 4 * w.quads;
  const bool amx = amx_w8a8_applies(m);
  thread_local std::vector<uint8_t> xu;
  thread_local std::vector<float> sx;
  xu.resize(static_cast<size_t>((m + (amx ? 16 : 0)) * kp));
  sx.resize(static_cast<size_t>(m));
  uint8_t* xup = xu.data();
  float* sxp = sx.data();
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) { quantize_rows(xp, k, kp, r0, r1, xup, sxp); });
#if defined(CPU_CAPABILITY_AVX512)
  if (amx) {
    // (signed bytes for tdpbssd: x + 128 less 128; 16 zero rows after the last for its last tile)
    for (size_t i = 0; i < static_cast<size_t>(m * kp); ++i) xup[i] ^= 0x80;
    std::fill(xup + m * kp, xup + (m + 16) * kp, uint8_t{0});
    const int8_t* xs = reinterpret_cast<const int8_t*>(xup);
    for_panel_blocks(m, k, panels, [&](int64_t begin, int64_t end, int64_t m0, int64_t rows) {
      amx_w8a8_range(xs, sxp, w, bias, op, m, n, begin, end, m0, rows);
    });
    return;
  }
#endif
  for_panel_blocks(m, k, panels, [&](int64_t begin, int64_t end, int64_t m0, int64_t rows) {
    w8a8_panels(xup, sxp, w, bias, op, m, n, begin, end, m0, rows);
  });
}

}  // namespace

std::string w8a8_instructions(int64_t rows) {
  if (amx_w8a8_applies(rows)) return "amx-int8";
#if defined(TOKENMILL_VNNI_TARGET)
  if (vnni_usable()) return kVector == 512 ? "avx512-vnni" : "avx-vnni";
  return "pmaddwd";
#else
  return "scalar";
#endif
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets,
                       const at::Tensor& scales, const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && x.is_floating_point() && x.dim() >= 1, "w8a8_linear: a float CPU x [..., K]");
  const int64_t k = x.size(-1), panels = packed.dim() == 3 ? packed.size(0) : 0;
  const int64_t kp = (k + kQuadDepth - 1) / kQuadDepth * kQuadDepth;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(1) == kp / 4 && packed.size(2) == kQuadBytes && panels * kPanel >= n &&
                  (panels - 1) * kPanel < n,
              "w8a8_linear: int8 quad panels [panels, K padded to ", kQuadDepth, " / 4, ", kQuadBytes,
              "] for this K, N and CPU");
  TORCH_CHECK(k <= 65536, "w8a8_linear: K up to 65,536 (the int32 sums)");
  TORCH_CHECK(offsets.scalar_type() == at::kInt && offsets.is_contiguous() && offsets.numel() == panels * kPanel,
              "w8a8_linear: int32 column offsets, one per column of the panels");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == panels * kPanel,
              "w8a8_linear: fp32 column scales, one per column of the panels");
  at::Tensor bias_holder;
  const float* bias_ptr = bias_data(bias, n, bias_holder, "w8a8_linear");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  const at::Tensor xc = x.reshape({-1, k}).to(at::kFloat).contiguous();
  const int64_t m = xc.size(0);
  at::Tensor out = at::empty({m, n}, xc.options());
  if (m > 0 && n > 0)
    w8a8_gemm(xc.data_ptr<float>(), m, k, w8a8_weights(packed, offsets, scales), panels, bias_ptr,
              out.data_ptr<float>(), n);
  return out.view(shape).to(x.scalar_type());
}

void w8a8_linear_rows(const float* x, int64_t m, int64_t k, const at::Tensor& packed, const at::Tensor& offsets,
                      const at::Tensor& scales, const float* bias, float* out, int64_t n, int64_t begin, int64_t end,
                      Int8RowScratch& scratch) {
  const W8A8Weights w = w8a8_weights(packed, offsets, scales);
  const int64_t kp = 4 * w.quads;
  scratch.quads.resize(static_cast<size_t>(m * kp));
  scratch.sx.resize(static_cast<size_t>(m));
  quantize_rows(x, k, kp, 0, m, scratch.quads.data(), scratch.sx.data());
  w8a8_panels(scratch.quads.data(), scratch.sx.data(), w, bias, out, m, n, begin, end, 0, m);
}

}  // namespace tokenmill
