// Weights quantized at load, one C++ pass each (the torch versions in models/layers/quantization/
// serve devices without these kernels, with the same picks up to ties within rounding of the error
// sums):
// - int8_group_scales (int8.py's quantize_weight): for each group, the bf16 scale s with the least
//   squared error of round(w / s) * s (round half to even, clamped to +-127), among `candidates`
//   consecutive bf16 values from the least one not below max|w| / 127 up. The first candidate is
//   round-to-nearest by the group's largest magnitude; larger ones matter for weights that sit on a
//   coarser grid than int8's (a checkpoint dequantised from a 4-bit GGUF: 16 levels a block, whose
//   step and offset a larger int8 step can match exactly or nearly).
// - int4_affine_groups (int4.py's affine_groups): for each group, 16 levels q = round((w - m) / s)
//   in 0-15, the fp16 (s, m) of least squared error among min-max, a range shrunk about its middle,
//   and each one's least-squares refit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels.h"
#include "vec_utils.h"

namespace tokenmill {
namespace {

float bf16_bits_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// The least bf16 value not below a positive finite `value` (quant.py's round_up_to_bf16), as bits.
uint16_t round_up_to_bf16_bits(float value) {
  const uint16_t bits = at::BFloat16(value).x;  // round to nearest even
  return bf16_bits_to_float(bits) < value ? static_cast<uint16_t>(bits + 1) : bits;
}

// Squared error of the group w[0..size) quantized with scale s.
float squared_error(const float* w, int64_t size, float s) {
  const Vec scale(s), lo(-127.0f), hi(127.0f);
  Vec acc(0.0f);
  int64_t i = 0;
  for (; i + kVec <= size; i += kVec) {
    const Vec x = Vec::loadu(w + i);
    // (division, not a product with 1 / s: the quotients, and so the picks, match torch's)
    const Vec q = at::vec::clamp((x / scale).round(), lo, hi);
    const Vec diff = q * scale - x;
    acc = at::vec::fmadd(diff, diff, acc);
  }
  float total = hsum(acc);
  for (; i < size; ++i) {
    const float q = std::clamp(std::nearbyint(w[i] / s), -127.0f, 127.0f);
    const float diff = q * s - w[i];
    total += diff * diff;
  }
  return total;
}

uint16_t best_scale_bits(const float* w, int64_t size, int64_t candidates) {
  float amax = 0.0f;
  for (int64_t i = 0; i < size; ++i) amax = std::max(amax, std::fabs(w[i]));
  const uint16_t first = round_up_to_bf16_bits(std::max(amax, 1e-8f) / 127.0f);
  uint16_t best = first;
  float best_error = std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < candidates; ++j) {
    const uint16_t bits = static_cast<uint16_t>(first + j);
    const float s = bf16_bits_to_float(bits);
    if (!std::isfinite(s)) break;
    const float error = squared_error(w, size, s);
    if (error < best_error) {  // ties keep the smaller scale
      best_error = error;
      best = bits;
    }
  }
  return best;
}

// -- int4: affine groups ---------------------------------------------------------------------------

// The range shrinks tried about each group's middle (int4.py's _SHRINKS; 1: min-max).
constexpr float kShrinks[] = {1.0f, 0.9f};
constexpr float kHalfTiny = 6.103515625e-05f;  // torch.finfo(torch.float16).tiny: no scale below it

float as_half(float v) { return static_cast<float>(at::Half(v)); }

// q[i] = round((w[i] - m) / s) in [0, 15] (s at least kHalfTiny), as floats.
void affine_levels(const float* w, int64_t size, float s, float m, float* q) {
  const float step = std::max(s, kHalfTiny);
  const Vec vs(step), vm(m), lo(0.0f), hi(15.0f);
  int64_t i = 0;
  for (; i + kVec <= size; i += kVec) at::vec::clamp(((Vec::loadu(w + i) - vm) / vs).round(), lo, hi).store(q + i);
  for (; i < size; ++i) q[i] = std::clamp(std::nearbyint((w[i] - m) / step), 0.0f, 15.0f);
}

// Squared error of the group reproduced as q * s + m.
float affine_error(const float* w, const float* q, int64_t size, float s, float m) {
  const Vec vs(s), vm(m);
  Vec acc(0.0f);
  int64_t i = 0;
  for (; i + kVec <= size; i += kVec) {
    const Vec diff = (Vec::loadu(q + i) * vs + vm) - Vec::loadu(w + i);
    acc = at::vec::fmadd(diff, diff, acc);
  }
  float total = hsum(acc);
  for (; i < size; ++i) {
    const float diff = (q[i] * s + m) - w[i];
    total += diff * diff;
  }
  return total;
}

float sum_of(const float* v, int64_t size) {
  Vec acc(0.0f);
  int64_t i = 0;
  for (; i + kVec <= size; i += kVec) acc = acc + Vec::loadu(v + i);
  float total = hsum(acc);
  for (; i < size; ++i) total += v[i];
  return total;
}

// The least-squares (slope, intercept) of w over the levels (s, m) give it (int4.py's _refit).
std::pair<float, float> refit(const float* w, int64_t size, float s, float m, float* q) {
  affine_levels(w, size, s, m, q);
  const float q_mean = sum_of(q, size) / size, w_mean = sum_of(w, size) / size;
  float spread = 0.0f, covariance = 0.0f;
  for (int64_t i = 0; i < size; ++i) {
    spread += (q[i] - q_mean) * (q[i] - q_mean);
    covariance += (q[i] - q_mean) * (w[i] - w_mean);
  }
  float slope = spread > 0.0f ? covariance / std::max(spread, 1e-12f) : s;
  slope = std::isnan(slope) ? slope : std::max(slope, 1e-8f);
  return {slope, w_mean - slope * q_mean};
}

// One group's levels (into `values`) and fp16 scale and offset (q: scratch of `size` floats, twice).
void best_affine(const float* w, int64_t size, float* q, uint8_t* values, at::Half& scale, at::Half& offset) {
  float lo = w[0], hi = w[0];
  for (int64_t i = 1; i < size; ++i) lo = std::min(lo, w[i]), hi = std::max(hi, w[i]);
  float* best_q = q + size;
  std::fill(best_q, best_q + size, 0.0f);
  float best_error = std::numeric_limits<float>::infinity(), best_s = 0.0f, best_m = as_half(lo);
  const float middle = (lo + hi) / 2;
  for (const float shrink : kShrinks) {
    const float low = middle - (middle - lo) * shrink;
    const float s = std::max((hi - lo) * shrink / 15, 1e-8f);
    const std::pair<float, float> fitted = refit(w, size, s, low, q);
    for (const auto& [cs, cm] : {std::pair<float, float>{s, low}, fitted}) {
      const float s16 = as_half(cs), m16 = as_half(cm);
      affine_levels(w, size, s16, m16, q);
      float error = affine_error(w, q, size, s16, m16);
      if (!std::isfinite(error)) error = std::numeric_limits<float>::infinity();
      if (error < best_error) {  // (ties keep the earlier candidate)
        best_error = error, best_s = s16, best_m = m16;
        std::copy(q, q + size, best_q);
      }
    }
  }
  for (int64_t i = 0; i < size; ++i) values[i] = static_cast<uint8_t>(best_q[i]);
  scale = at::Half(best_s), offset = at::Half(best_m);
}

}  // namespace

at::Tensor int8_group_scales(const at::Tensor& groups, int64_t candidates) {
  TORCH_CHECK(groups.dim() == 2 && groups.scalar_type() == at::kFloat,
              "int8_group_scales: fp32 groups [count, size]");
  TORCH_CHECK(candidates >= 1, "int8_group_scales: at least one candidate scale");
  const at::Tensor w = groups.contiguous();
  const int64_t count = w.size(0), size = w.size(1);
  at::Tensor scales = at::empty({count}, w.options().dtype(at::kBFloat16));
  const float* src = w.data_ptr<float>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(scales.data_ptr<at::BFloat16>());
  at::parallel_for(0, count, std::max<int64_t>(1, 4096 / std::max<int64_t>(size, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) dst[g] = best_scale_bits(src + g * size, size, candidates);
  });
  return scales;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> int4_affine_groups(const at::Tensor& groups) {
  TORCH_CHECK(groups.dim() == 2 && groups.scalar_type() == at::kFloat && groups.size(1) > 0,
              "int4_affine_groups: fp32 groups [count, size]");
  const at::Tensor w = groups.contiguous();
  const int64_t count = w.size(0), size = w.size(1);
  at::Tensor values = at::empty({count, size}, w.options().dtype(at::kByte));
  at::Tensor scales = at::empty({count}, w.options().dtype(at::kHalf));
  at::Tensor offsets = at::empty({count}, w.options().dtype(at::kHalf));
  const float* src = w.data_ptr<float>();
  uint8_t* vp = values.data_ptr<uint8_t>();
  at::Half* sp = scales.data_ptr<at::Half>();
  at::Half* mp = offsets.data_ptr<at::Half>();
  at::parallel_for(0, count, std::max<int64_t>(1, 4096 / size), [&](int64_t begin, int64_t end) {
    std::vector<float> q(static_cast<size_t>(2 * size));
    for (int64_t g = begin; g < end; ++g) best_affine(src + g * size, size, q.data(), vp + g * size, sp[g], mp[g]);
  });
  return {values, scales, offsets};
}

}  // namespace tokenmill
