// Weight-only int8 linear layer on CPU: y = x W^T with W stored as int8 and, per group of
// `group_size` input channels of each output row, an affine map back to float:
// W[n, k] = q[n, k] * scales[n, g] + offsets[n, g], g = k / group_size (offsets empty = symmetric).
// Activations stay in float (no activation quantization: one outlier token cannot cost the others
// their precision, and a row's result does not depend on the rest of the batch).
//
// Up to kDirectRows rows of x (batch-1 decode and small batches), each weight row streams once
// through registers: 8 int8 lanes widened, multiplied into 8 fp32 lanes per row of x, scaled per
// group: 1 byte per weight read instead of 4 (fp32) or 2 (bf16), the bound of batch-1 decode. Up to
// kGemmRows rows, a tile of kTile weight rows is widened once into a per-thread buffer and multiplied
// by every row; from kGemmRows rows on (prefill, large batches) the widened weight goes to ATen's GEMM.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec_utils.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using namespace tokenmill;

constexpr int64_t kTile = 16;  // weight rows widened together
// Up to this many rows of x, int8 weights are widened in registers as they stream (decode).
constexpr int64_t kDirectRows = 4;
// From this many rows of x on, the product is compute-bound: widen the whole weight once and let
// ATen's GEMM (oneDNN/MKL, blocked for the cache) multiply.
constexpr int64_t kGemmRows = 16;

void widen_tile(const int8_t* q, const float* scales, const float* offsets, int64_t rows, int64_t in_features,
                int64_t group_size, float* dst) {
  const int64_t groups = in_features / group_size;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float s = scales[r * groups + g];
      const float b = offsets != nullptr ? offsets[r * groups + g] : 0.f;
      const int8_t* src = q + r * in_features + g * group_size;
      float* out = dst + r * in_features + g * group_size;
      for (int64_t k = 0; k < group_size; ++k) out[k] = static_cast<float>(src[k]) * s + b;  // vectorised by -O3
    }
  }
}

// 8 (AVX2) or 16 (AVX-512) int8 weights widened to one vector of fp32.
inline Vec load_int8(const int8_t* src) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)))));
#else
  float widened[kVec];
  for (int64_t i = 0; i < kVec; ++i) widened[i] = static_cast<float>(src[i]);
  return Vec::loadu(widened);
#endif
}

// R weight rows (independent accumulator chains) times M rows of x, streaming the int8 weights once:
// each vector of weights is widened and scaled by its group's scale, then multiplied into x.
template <int R, int M>
void dot_int8_rows(const float* xp, const int8_t* q, const float* scales, const float* offsets, const float* x_sums,
                   int64_t in_features, int64_t group_size, int64_t groups, float* out /* [M][R] */) {
  Vec total[R][M];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 16
    for (int m = 0; m < M; ++m) total[r][m] = Vec(0.f);
  for (int64_t g = 0; g < groups; ++g) {
    Vec scale[R];
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) scale[r] = Vec(scales[r * groups + g]);
    for (int64_t k = g * group_size; k < (g + 1) * group_size; k += kVec) {
      Vec x[M];
      #pragma GCC unroll 16
      for (int m = 0; m < M; ++m) x[m] = Vec::loadu(xp + m * in_features + k);
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const Vec w = load_int8(q + r * in_features + k) * scale[r];
        #pragma GCC unroll 16
        for (int m = 0; m < M; ++m) total[r][m] = at::vec::fmadd(w, x[m], total[r][m]);
      }
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    #pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      float shift = 0.f;
      if (offsets != nullptr)
        for (int64_t g = 0; g < groups; ++g) shift += offsets[r * groups + g] * x_sums[m * groups + g];
      out[m * R + r] = hsum(total[r][m]) + shift;
    }
  }
}

template <int M>
void gemv_direct(const float* xp, const int8_t* qp, const float* sp, const float* op, float* yp,
                 int64_t out_features, int64_t in_features, int64_t group_size) {
  constexpr int R = M == 1 ? 4 : M == 2 ? 2 : 1;  // accumulators fit the 16 vector registers
  const int64_t groups = in_features / group_size;
  // Offsets (affine groups) add offset * sum(x over the group).
  std::vector<float> x_sums(op != nullptr ? M * groups : 0);
  for (int64_t i = 0; i < static_cast<int64_t>(x_sums.size()); ++i) {
    const float* x = xp + (i / groups) * in_features + (i % groups) * group_size;
    float sum = 0.f;
    for (int64_t k = 0; k < group_size; ++k) sum += x[k];
    x_sums[i] = sum;
  }
  at::parallel_for(0, out_features, kTile, [&](int64_t first, int64_t last) {
    float dots[M * R];
    int64_t n = first;
    for (; n + R <= last; n += R) {
      dot_int8_rows<R, M>(xp, qp + n * in_features, sp + n * groups, op != nullptr ? op + n * groups : nullptr,
                          x_sums.data(), in_features, group_size, groups, dots);
      #pragma GCC unroll 16
      for (int m = 0; m < M; ++m)
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) yp[m * out_features + n + r] = dots[m * R + r];
    }
    for (; n < last; ++n) {
      dot_int8_rows<1, M>(xp, qp + n * in_features, sp + n * groups, op != nullptr ? op + n * groups : nullptr,
                          x_sums.data(), in_features, group_size, groups, dots);
      #pragma GCC unroll 16
      for (int m = 0; m < M; ++m) yp[m * out_features + n] = dots[m];
    }
  });
}

// Between the two: each thread widens its tiles of weight rows and multiplies them by every row.
void gemv_tiles(const float* xp, const int8_t* qp, const float* sp, const float* op, float* yp, int64_t rows,
                int64_t out_features, int64_t in_features, int64_t group_size) {
  const int64_t groups = in_features / group_size;
  const int64_t tiles = (out_features + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t last) {
    std::vector<float> widened(static_cast<size_t>(kTile * in_features));
    const float* w_rows[kTile];
    float dots[kTile];
    for (int64_t tile = first; tile < last; ++tile) {
      const int64_t n0 = tile * kTile;
      const int64_t n = std::min(kTile, out_features - n0);
      widen_tile(qp + n0 * in_features, sp + n0 * groups, op != nullptr ? op + n0 * groups : nullptr, n,
                 in_features, group_size, widened.data());
      for (int64_t r = 0; r < n; ++r) w_rows[r] = widened.data() + r * in_features;
      for (int64_t m = 0; m < rows; ++m) {
        dot_rows_any(w_rows, static_cast<int>(n), xp + m * in_features, in_features, dots);
        std::copy(dots, dots + n, yp + m * out_features + n0);
      }
    }
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& offsets, int64_t group_size) {
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu(), "int8_linear: CPU tensors only");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 2 && qweight.is_contiguous(),
              "int8_linear: qweight must be contiguous int8 [out_features, in_features]");
  const int64_t out_features = qweight.size(0), in_features = qweight.size(1);
  TORCH_CHECK(x.size(-1) == in_features, "int8_linear: x has ", x.size(-1), " features, the weight ", in_features);
  TORCH_CHECK(group_size > 0 && in_features % group_size == 0, "int8_linear: group_size must divide in_features");
  const int64_t groups = in_features / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({out_features, groups}),
              "int8_linear: scales must be contiguous fp32 [out_features, in_features / group_size]");
  const bool affine = offsets.numel() > 0;
  TORCH_CHECK(!affine || (offsets.scalar_type() == at::kFloat && offsets.is_contiguous() &&
                          offsets.sizes() == scales.sizes()),
              "int8_linear: offsets must be empty or shaped like scales");

  const at::Tensor x2 = x.reshape({-1, in_features}).to(at::kFloat).contiguous();
  const int64_t rows = x2.size(0);
  at::Tensor out = at::empty({rows, out_features}, x2.options());
  const float* xp = x2.data_ptr<float>();
  const int8_t* qp = qweight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = affine ? offsets.data_ptr<float>() : nullptr;
  if (rows >= kGemmRows) {
    at::Tensor widened = at::empty({out_features, in_features}, x2.options());
    float* wp = widened.data_ptr<float>();
    at::parallel_for(0, out_features, kTile, [&](int64_t first, int64_t last) {
      widen_tile(qp + first * in_features, sp + first * groups, op != nullptr ? op + first * groups : nullptr,
                 last - first, in_features, group_size, wp + first * in_features);
    });
    at::mm_out(out, x2, widened.t());
  } else if (rows <= kDirectRows && group_size % kVec == 0) {
    float* yp = out.data_ptr<float>();
    switch (rows) {
      case 1: gemv_direct<1>(xp, qp, sp, op, yp, out_features, in_features, group_size); break;
      case 2: gemv_direct<2>(xp, qp, sp, op, yp, out_features, in_features, group_size); break;
      case 3: gemv_direct<3>(xp, qp, sp, op, yp, out_features, in_features, group_size); break;
      default: gemv_direct<4>(xp, qp, sp, op, yp, out_features, in_features, group_size); break;
    }
  } else {
    gemv_tiles(xp, qp, sp, op, out.data_ptr<float>(), rows, out_features, in_features, group_size);
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return out.view(shape).to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor offsets, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("int8_linear", &int8_linear);
}
