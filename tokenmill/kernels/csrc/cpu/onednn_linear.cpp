// y = x W^T + b on oneDNN, W reordered once into its blocked layout (torch's
// mkldnn::_reorder_linear_weight): bf16 on CPUs with native bf16 (AMX or AVX512-BF16), where
// oneDNN's AMX kernels run it, or fp32 where tokenmill's panel GEMM cannot be built. The
// counterpart of tokenmill/models/layers/packed_linear.py's OneDnnLinearMethod, as a C++ call, so that a decoder
// layer running in C++ (decoder_layer.cpp) can call it without going through Python.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include "kernels.h"

#include <string>

namespace tokenmill {

// Row counts rounded up to buckets: oneDNN builds (JIT-compiles) a primitive per input shape, and a
// step's token count takes hundreds of values; building one per step per layer cost more than the
// padding (<= 1/8 extra rows at worst). The same buckets as packed_linear.py's padded_rows (see there).
int64_t onednn_padded_rows(int64_t rows) {
  if (rows <= 8) return rows;
  const int64_t step = rows <= 64 ? 8 : rows <= 512 ? 32 : 64;
  return (rows + step - 1) / step * step;
}

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "onednn_linear: x [rows, in_features]");
  if (amx_linear_applies(x, packed)) {
    RECORD_FUNCTION("tokenmill::amx_linear", std::vector<c10::IValue>());
    return amx_linear_unchecked(x, packed, bias);
  }
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const int64_t rows = x.size(0), padded = onednn_padded_rows(rows);
  at::Tensor input = padded == rows ? x : at::constant_pad_nd(x, {0, 0, 0, padded - rows});
  // (boxed: the op's typed signature spells its string and list arguments in types that change
  // between torch releases. Called from Python, this op and mkldnn's own take the same time on a
  // small weight, most of it oneDNN's: the boxing is not measurable.)
  torch::jit::Stack stack{input, packed, bias.has_value() ? c10::IValue(*bias) : c10::IValue(), std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), c10::IValue()};
  op.callBoxed(&stack);
  at::Tensor out = stack[0].toTensor();
  return padded == rows ? out : out.narrow(0, 0, rows);
}

}  // namespace tokenmill
