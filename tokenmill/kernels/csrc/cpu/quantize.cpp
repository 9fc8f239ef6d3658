// Group scales of weight-only int8 (tokenmill/models/layers/quantization/int8.py's quantize_weight): for each group, the
// bf16 scale s with the least squared error of round(w / s) * s (round half to even, clamped to
// +-127), among `candidates` consecutive bf16 values from the least one not below max|w| / 127 up.
// The first candidate is round-to-nearest by the group's largest magnitude; larger ones matter for
// weights that sit on a coarser grid than int8's (a checkpoint dequantised from a 4-bit GGUF: 16
// levels a block, whose step and offset a larger int8 step can match exactly or nearly).
// quant.py holds the same search in torch ops for devices without these kernels (the same picks up
// to ties within rounding of the error sums).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

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

}  // namespace tokenmill
