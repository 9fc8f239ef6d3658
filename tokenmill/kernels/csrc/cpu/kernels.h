// The entry points of tokenmill's CPU kernels: the torch ops (torch.ops.tokenmill.*, all registered
// in bindings.cpp; tokenmill/kernels/ops.py is their one Python entry point) and the parts other
// kernels call directly (decoder_layer.cpp runs a whole layer through them without a trip through
// Python). See each one's source file for what it computes.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace tokenmill {

// elementwise.cpp (fp32 or bf16)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
// One row of each on the calling thread (the ops above run these over their rows): for callers that
// share a step's work among their own threads (decoder_layer.cpp's one-region stack). T: float or
// at::BFloat16.
template <typename T>
void rms_norm_row(const T* x, const T* weight, int64_t dim, float eps, T* out);
template <typename T>
void silu_mul_row(const T* gate_up, int64_t inter, T* out);
template <typename T>
void rope_head(T* x, const T* cos, const T* sin, int64_t rotary);

// panel_linear.cpp (fp32 x; fp32 or bf16 weights) and int8_linear.cpp (int8 weights)
// A linear layer's bias as an fp32 pointer (nullptr without one), kept alive by `holder`; `op` names
// the caller in the error for a bias that is not N floats.
const float* bias_data(const c10::optional<at::Tensor>& bias, int64_t n, at::Tensor& holder, const char* op);
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t n);
at::Tensor packed_logits(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t n);
at::Tensor pack_int8_weight(const at::Tensor& weight);
at::Tensor packed_int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& packed_scales,
                              const c10::optional<at::Tensor>& bias, int64_t n);
at::Tensor packed_int8_logits(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& packed_scales,
                              const c10::optional<at::Tensor>& bias, int64_t n);
at::Tensor packed_int8_rows(const at::Tensor& ids, const at::Tensor& packed, const at::Tensor& packed_scales,
                            int64_t k, at::ScalarType dtype);
// Rows x [m, K] (fp32, m up to the rows of one block of x: ~40 for K = 1,536) times panels
// [begin, end) of a packed weight, into those panels' columns of out [m, N] (bias: fp32 [N] or
// nullptr), on the calling thread, as the ops above compute them; shapes as they check them.
void packed_linear_rows(const float* x, int64_t m, const at::Tensor& packed, const float* bias, float* out, int64_t n,
                        int64_t begin, int64_t end);
struct Int8RowScratch {  // a thread's x as int16 pairs and block scales (and their bytes for AMX tiles)
  std::vector<int16_t> xq;
  std::vector<float> sx;
  std::vector<int8_t> high;
  std::vector<uint8_t> low;
  std::vector<float> group_sums;  // 4-bit layers with offsets: each row's sum of x per group
  std::vector<uint8_t> quads;     // W8A8 layers: x rounded to int8 per row, as bytes x + 128
};
void packed_int8_linear_rows(const float* x, int64_t m, int64_t k, const at::Tensor& packed,
                             const at::Tensor& packed_scales, const float* bias, float* out, int64_t n, int64_t begin,
                             int64_t end, Int8RowScratch& scratch);

// int4_linear.cpp: 4-bit weights (panels two values a byte, fp16 scales, int8 zero points or one for
// all, optional fp16 offsets), as the int8 ones compute them; the rows variant as above.
at::Tensor packed_int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& zeros, int64_t zero,
                              const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias,
                              int64_t n);
at::Tensor packed_int4_logits(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& zeros, int64_t zero,
                              const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias,
                              int64_t n);
void packed_int4_linear_rows(const float* x, int64_t m, int64_t k, const at::Tensor& packed, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& zeros, int64_t zero,
                             const c10::optional<at::Tensor>& offsets, const float* bias, float* out, int64_t n,
                             int64_t begin, int64_t end, Int8RowScratch& scratch);

// fp8_linear.cpp: e4m3 weight bytes in panels [panels, K, kPanel] times fp32 scales per column and group
// of `group_size` inputs ([panels, groups, kPanel], 2^8 folded in), widened as they stream; x's dtype.
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t group_size,
                      const c10::optional<at::Tensor>& bias, int64_t n);
// Rows x [m, K] (fp32) times panels [begin, end) on the calling thread, as fp8_linear computes them.
void fp8_linear_rows(const float* x, int64_t m, const at::Tensor& packed, const at::Tensor& scales, int64_t group_size,
                     const float* bias, float* out, int64_t n, int64_t begin, int64_t end);

// w8a8_linear.cpp: int8 weights (quad panels, per-column fp32 scales and 128 x column sums) times x
// rounded to int8 per row (dynamic per-token scales); x's dtype.
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets,
                       const at::Tensor& scales, const c10::optional<at::Tensor>& bias, int64_t n);
// Rows x [m, K] (fp32) times panels [begin, end) on the calling thread, as w8a8_linear computes them
// (on the vector paths: the int32 sums its AMX tiles give too), x rounded to int8 in `scratch`.
void w8a8_linear_rows(const float* x, int64_t m, int64_t k, const at::Tensor& packed, const at::Tensor& offsets,
                      const at::Tensor& scales, const float* bias, float* out, int64_t n, int64_t begin, int64_t end,
                      Int8RowScratch& scratch);
// The instructions a W8A8 step of `rows` rows runs on here: "amx-int8", "avx512-vnni", "avx-vnni",
// "pmaddwd" (the same int32 sums from int16 products, where the CPU has no int8 dot products) or
// "scalar" (kernels built without vector extensions).
std::string w8a8_instructions(int64_t rows);

// bf16_pair_linear.cpp: bf16 x [M, K] times a weight packed by pairs of inputs (pack_bf16_pairs:
// [panels, ceil(K / 2), 2 * kPanel] bf16) on AVX512-BF16 dot products: each output one chain over the
// pairs in order, a row's result independent of its step.
bool bf16_pair_linear_supported();  // AVX512-BF16 here, and these kernels built for AVX-512
at::Tensor pack_bf16_pairs(const at::Tensor& weight);
at::Tensor bf16_pair_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t n);
// The same sums in fp32, unrounded (logits).
at::Tensor bf16_pair_logits(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t n);
// Rows x [m, K] (K even) times panels [begin, end) into their columns of out [m, N] bf16 (bias: fp32
// [N] or nullptr), on the calling thread, as bf16_pair_linear computes them.
void bf16_pair_linear_rows(const at::BFloat16* x, int64_t m, const at::Tensor& packed, const float* bias,
                           at::BFloat16* out, int64_t n, int64_t begin, int64_t end);

// onednn_linear.cpp: x W^T + b with W reordered for oneDNN (bf16 on AMX / AVX512-BF16 CPUs); x's dtype.
// Decode-sized bf16 steps on AMX CPUs run amx_linear on the same reordered weight.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
int64_t onednn_padded_rows(int64_t rows);
// The row count oneDNN's weight reorder is told to expect (mkldnn::_reorder_linear_weight's batch_size;
// tokenmill/models/layers/packed_linear.py passes the same: a test holds them equal).
constexpr int64_t kOnednnBatchHint = 64;

// amx_linear.cpp: bf16 x [1 to kAmxMaxRows rows, K] times a bf16 weight reordered by oneDNN, on AMX
constexpr int64_t kAmxMaxRows = 64;
// The rows an x buffer of m rows holds for amx_linear_rows: past 32, whole chunks of 32 (the tiles of
// a step's last chunk read 32 rows; what they compute past m is dropped).
inline int64_t amx_padded_rows(int64_t m) { return m <= 32 ? m : (m + 31) / 32 * 32; }
bool amx_linear_applies(const at::Tensor& x, const at::Tensor& packed);
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
// fp32 logits of a bf16 head on AMX tiles (nothing rounded after the tiles' fp32 sums)
bool amx_logits_applies(const at::Tensor& x, const at::Tensor& packed);
at::Tensor amx_logits(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
// Whether amx_linear takes `rows` bf16 rows of packed.size(1) inputs on this weight (amx_linear_applies, x unseen).
bool amx_linear_takes(int64_t rows, const at::Tensor& packed);
// amx_linear in parts, for callers with their own threads: its N outputs in blocks of 32
// (amx_linear_blocks), blocks [begin, end) of them on the calling thread (amx_linear_rows: x [m, Kp]
// bf16 in a buffer of amx_padded_rows(m) rows, K zero-padded to a multiple of 32; bias fp32 or
// nullptr; out [m, N] bf16).
int64_t amx_linear_blocks(const at::Tensor& packed);
void amx_linear_rows(const at::BFloat16* x, int64_t m, const at::Tensor& packed, const float* bias, at::BFloat16* out,
                     int64_t begin, int64_t end);
// x W^T + b for an (x, packed) that amx_linear_applies to (callers check; the op amx_linear checks too)
at::Tensor amx_linear_unchecked(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
// Whether oneDNN's reorder of a bf16 [n, k] weight is the blocked layout amx_linear reads (probed once per shape).
bool onednn_amx_layout(int64_t n, int64_t k);
// An AMX tile configuration (palette 1), as _tile_loadconfig reads it: bytes a row and rows per tile.
struct AmxTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};
// AMX-BF16 tiles on this CPU and granted by the OS.
bool amx_bf16_usable();
// x [m, kp] bf16 (rows past 32 padded to whole 32-row chunks; kp a multiple of 32) times blocks
// [begin, end) of 32 outputs of a weight held as amx_linear reads oneDNN's (block_of(b): block b's
// kp / 2 pair rows of 32 outputs x 2 inputs, bf16), into out [m, n] bf16 (+ bias, fp32 or nullptr),
// on the calling thread.
void amx_bf16_blocks(const at::BFloat16* x, int64_t m, int64_t kp, int64_t begin, int64_t end,
                     const std::function<const at::BFloat16*(int64_t)>& block_of, const float* bias,
                     at::BFloat16* out, int64_t n);
// The same into fp32 out (nothing rounded after the tiles' fp32 sums).
void amx_bf16_blocks(const at::BFloat16* x, int64_t m, int64_t kp, int64_t begin, int64_t end,
                     const std::function<const at::BFloat16*(int64_t)>& block_of, const float* bias, float* out,
                     int64_t n);
// AMX-int8 tiles on this CPU, granted by the OS, and not turned off (TOKENMILL_AMX_INT8=0): the int8
// panel GEMM (packed_linear.cpp) then sums fp32 steps of 16 rows and more on them.
bool amx_int8_usable();

// paged_attention.cpp
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out,
                     const at::Tensor& query_start, const at::Tensor& query_lens, const at::Tensor& block_tables,
                     const at::Tensor& context_lens, int64_t block_size, double scale, int64_t window,
                     double softcap);
// paged_attention in parts, for callers with their own threads: the work of a call planned once
// (checked as paged_attention checks its inputs; every layer of a step with the same window has the
// same plan), then each thread pulls items (attend_items, `next` shared, from 0), and once all are
// done the split tiles' partials are merged (merge_partials over [0, attention_merges) in parts).
// paged_attention is these three steps on torch's threads. The data pointers are the call's q, caches
// and out, of the planned dtypes and shapes.
struct AttentionWork;
std::shared_ptr<const AttentionWork> plan_paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                          const at::Tensor& v_cache, const at::Tensor& out,
                                                          const at::Tensor& query_start, const at::Tensor& query_lens,
                                                          const at::Tensor& block_tables,
                                                          const at::Tensor& context_lens, int64_t block_size,
                                                          int64_t window, int64_t threads);
int64_t attention_items(const AttentionWork& work);
int64_t attention_merges(const AttentionWork& work);
int64_t attention_partial_floats(const AttentionWork& work);
void attend_items(const AttentionWork& work, const void* q, const void* k_cache, const void* v_cache, void* out,
                  double scale, double softcap, float* partials, std::atomic<int64_t>& next);
void merge_partials(const AttentionWork& work, void* out, const float* partials, int64_t begin, int64_t end);

// quantize.cpp: weight-only int8's least-error group scales; --quantization int4's groups (levels,
// fp16 scales, fp16 offsets)
at::Tensor int8_group_scales(const at::Tensor& groups, int64_t candidates);
std::tuple<at::Tensor, at::Tensor, at::Tensor> int4_affine_groups(const at::Tensor& groups);

// sampling.cpp
at::Tensor sample_tokens(const at::Tensor& logits, const c10::List<bool>& greedy, c10::ArrayRef<double> temperature,
                         c10::ArrayRef<int64_t> top_k, c10::ArrayRef<double> top_p, c10::ArrayRef<double> min_p,
                         c10::ArrayRef<double> uniform);

// lora.cpp
void lora_delta(const at::Tensor& x, at::Tensor& out, const at::Tensor& lora_a, const at::Tensor& lora_b,
                const at::Tensor& rows, const at::Tensor& segments, const at::Tensor& blocks);

// decoder_layer.cpp: one Llama-shaped layer, and DecoderStack (every layer of a model) as a torch class
// (projections: weight, scales, zeros, offsets and bias of qkv, o, gate_up and down; zero_points:
// the four projections' one zero point, for 4-bit ones without per-group zero points)
at::Tensor llama_decoder_layer(const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& post_norm,
                               double eps, const c10::List<std::optional<at::Tensor>>& projections,
                               c10::ArrayRef<int64_t> zero_points, c10::ArrayRef<int64_t> group_sizes,
                               int64_t heads, int64_t kv_heads,
                               int64_t intermediate, const at::Tensor& cos, const at::Tensor& sin,
                               at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                               const at::Tensor& query_start, const at::Tensor& query_lens,
                               const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                               double scale, int64_t window, double softcap);
void register_decoder_stack(torch::Library& m);

}  // namespace tokenmill
