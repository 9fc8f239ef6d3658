// The entry points of tokenmill's CPU kernels that other kernels call directly (decoder_layer.cpp
// runs a whole layer through them without a trip through Python). Each is also a torch op
// (torch.ops.tokenmill.*, registered in its own file); see that file for what it computes.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace tokenmill {

// elementwise.cpp (fp32)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);

// packed_linear.cpp (fp32 x; fp32, bf16 or int8 weights)
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t n);
at::Tensor packed_int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& packed_scales,
                              const c10::optional<at::Tensor>& bias, int64_t n);

// paged_attention.cpp
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out,
                     const at::Tensor& query_start, const at::Tensor& query_lens, const at::Tensor& block_tables,
                     const at::Tensor& context_lens, int64_t block_size, double scale, int64_t window,
                     double softcap);

}  // namespace tokenmill
