// One Llama-shaped decoder layer (CPU) in one call, for steps whose attention runs entirely on the
// paged kernel (decodes and chunks with cached context). fp32 activations with each projection's
// weight panel-packed fp32/bf16, int8 with its packed scales (--quantization int8), 4-bit, W8A8 (int8
// weights times activations rounded to int8 per token, w8a8_linear.cpp) or FP8 (fp8_linear.cpp); or
// bf16 activations with bf16 weights on oneDNN (CPUs with AMX / AVX512-BF16, `--dtype bfloat16`), on
// bf16 panels, on bf16 pair panels (AVX512-BF16 dot products, bf16_pair_linear.cpp), or on the
// integer or FP8 panels above (their ops widen x to fp32 and round the result to bf16):
//   h = rms_norm(x); q, k, v = split(h W_qkv^T + b); rope(q, k); cache <- k, v; a = attention(q)
//   x = x + a W_o^T + b;  x = x + silu_mul(rms_norm(x) W_gate_up^T + b) W_down^T + b
// The same kernels, in the same order, as the Python layer (tokenmill/models/families/llama.py) on
// this path, so the result is bit-identical; what goes is the Python between them: ~25 op
// dispatches, module calls and views per layer, a large share of a batch-1 step (`tokenmill bench
// profile`, its host time).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <omp.h>
#include <torch/custom_class.h>

#include "kernels.h"
#include "vec_utils.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

using OptTensor = c10::optional<at::Tensor>;

// One projection's weight: panels of fp32/bf16, bf16 pair panels, int8 panels with their scales, 4-bit panels (uint8)
// with their scales, zero points (or one for all: `zero`) and offsets, W8A8 quad panels (int8) with their
// column scales and offsets (`offsets`: 128 x each column's sum of weights), FP8 panels (uint8 e4m3 bytes)
// with their scales per `group_size` inputs, or a weight reordered for oneDNN (an opaque MkldnnCPU
// tensor); its bias if any.
struct Projection {
  at::Tensor weight;
  OptTensor scales, zeros, offsets, bias;
  int64_t zero = 0;
  int64_t group_size = 0;  // an FP8 weight's scale groups (0: any other kind)
  // A bf16 weight in oneDNN's AMX layout with whole tiles of inputs (K a multiple of 32), which
  // amx_linear's tiles take: probed once by DecoderStack's constructor (the layout probe takes a
  // lock), read by its one-region check every step.
  bool amx_tiles = false;

  bool fp8() const { return !onednn() && weight.scalar_type() == at::kByte && group_size > 0; }
  bool int4() const { return !onednn() && weight.scalar_type() == at::kByte && group_size == 0; }
  bool w8a8() const { return !onednn() && weight.scalar_type() == at::kChar && offsets.has_value(); }
  bool int8() const { return !onednn() && weight.scalar_type() == at::kChar && !offsets.has_value(); }
  bool onednn() const { return weight.is_mkldnn(); }
  // bf16 panels by pairs of inputs (pack_bf16_pairs: [panels, K / 2, 2 * kPanel], where bf16 panels
  // are [panels, K, kPanel]), multiplied by AVX512-BF16 dot products
  bool pairs() const {
    return !onednn() && weight.scalar_type() == at::kBFloat16 && weight.size(2) == 2 * tokenmill::kPanel;
  }
  const char* op_name() const {
    return onednn()  ? "tokenmill::amx_linear"
           : int8()  ? "tokenmill::packed_int8_linear"
           : int4()  ? "tokenmill::packed_int4_linear"
           : w8a8()  ? "tokenmill::w8a8_linear"
           : fp8()   ? "tokenmill::fp8_linear"
           : pairs() ? "tokenmill::bf16_pair_linear"
                     : "tokenmill::packed_linear";
  }
};

// x W^T + b on a projection's weight. (The profiler scopes, here and below, name the kernels as
// their torch ops: `tokenmill bench profile` sorts a step's time by them. They cost nothing
// measurable while no profiler runs. A oneDNN projection is its own op call: it shows as
// mkldnn::_linear_pointwise.)
at::Tensor linear(const at::Tensor& x, const Projection& p, int64_t n) {
  if (p.onednn()) return tokenmill::onednn_linear(x, p.weight, p.bias);
  RECORD_FUNCTION(p.op_name(), std::vector<c10::IValue>());
  if (p.int4()) return tokenmill::packed_int4_linear(x, p.weight, *p.scales, p.zeros, p.zero, p.offsets, p.bias, n);
  if (p.w8a8()) return tokenmill::w8a8_linear(x, p.weight, *p.offsets, *p.scales, p.bias, n);
  if (p.fp8()) return tokenmill::fp8_linear(x, p.weight, *p.scales, p.group_size, p.bias, n);
  if (p.pairs()) return tokenmill::bf16_pair_linear(x, p.weight, p.bias, n);
  return p.int8() ? tokenmill::packed_int8_linear(x, p.weight, *p.scales, p.bias, n)
                  : tokenmill::packed_linear(x, p.weight, p.bias, n);
}

at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  RECORD_FUNCTION("tokenmill::rms_norm", std::vector<c10::IValue>());
  return tokenmill::rms_norm(x, weight, eps);
}

// A layer's weights and shape, as the op and the stack take them.
struct LayerWeights {
  at::Tensor input_norm, post_norm;
  double eps;
  Projection qkv, o, gate_up, down;
  int64_t heads, kv_heads, intermediate;
  double scale;
  int64_t window;
  double softcap;
};

// What every layer of a step shares: where this step's keys go and the paged attention's inputs.
struct StepInputs {
  const at::Tensor& slot_mapping;
  const at::Tensor& query_start;
  const at::Tensor& query_lens;
  const at::Tensor& block_tables;
  const at::Tensor& context_lens;
  int64_t block_size;
};

// One kv head's row of fp32 K/V as an int8 cache row: head_dim values and their fp32 scale (absmax /
// 127, symmetric), as tokenmill/models/layers/kv_quant.py to_cache computes it, operation for operation
// (fp32 division, round half to even), so the fused and the Python layers write the same bytes.
void quantize_row(const float* row, int64_t head_dim, int8_t* dst) {
  float amax = 0.f;
  for (int64_t i = 0; i < head_dim; ++i) amax = std::max(amax, std::fabs(row[i]));
  const float scale = std::max(amax / 127.f, std::numeric_limits<float>::min());
  for (int64_t i = 0; i < head_dim; ++i)
    dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(row[i] / scale))));
  std::memcpy(dst + head_dim, &scale, sizeof(float));
}

// head_dim of a cache [slots, kv_heads, row]: the row, less an int8 row's fp32 scale.
int64_t cache_head_dim(const at::Tensor& cache) {
  return cache.size(2) - (cache.scalar_type() == at::kChar ? static_cast<int64_t>(sizeof(float)) : 0);
}

// One kv head's fp32 or bf16 row into its slot of a contiguous cache [slots, heads, head_dim] of fp32,
// bf16 (rounded as Tensor.to rounds) or int8 rows (head_dim + 4 bytes, see quantize_row; a bf16 row
// widened first, as kv_quant.to_cache does).
template <typename R>
void write_head(at::Tensor& cache, int64_t slot, int64_t head, const R* row) {
  const int64_t heads = cache.size(1);
  const auto dtype = cache.scalar_type();
  if (dtype == at::kChar) {
    const int64_t head_dim = cache_head_dim(cache);
    int8_t* dst = cache.data_ptr<int8_t>() + (slot * heads + head) * cache.size(2);
    if constexpr (std::is_same_v<R, float>) {
      quantize_row(row, head_dim, dst);
    } else {
      thread_local std::vector<float> widened;
      widened.assign(row, row + head_dim);
      quantize_row(widened.data(), head_dim, dst);
    }
    return;
  }
  const int64_t head_dim = cache.size(2), offset = (slot * heads + head) * head_dim;
  if (dtype == at::kFloat) {
    float* dst = cache.data_ptr<float>() + offset;
    for (int64_t i = 0; i < head_dim; ++i) dst[i] = static_cast<float>(row[i]);
  } else {
    at::BFloat16* dst = cache.data_ptr<at::BFloat16>() + offset;
    for (int64_t i = 0; i < head_dim; ++i) dst[i] = at::BFloat16(row[i]);
  }
}

// Whether write_head takes rows of this many kv heads and head_dim into `cache` (fp16 caches, or
// any other layout, go through index_copy_).
bool writes_heads(const at::Tensor& cache, int64_t heads, int64_t head_dim) {
  const auto dtype = cache.scalar_type();
  const int64_t cache_row = dtype == at::kChar ? head_dim + static_cast<int64_t>(sizeof(float)) : head_dim;
  return (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kChar) && cache.dim() == 3 &&
         cache.is_contiguous() && cache.size(1) == heads && cache.size(2) == cache_row;
}

void check_slots(const at::Tensor& cache, const int64_t* slot, int64_t tokens) {
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < cache.size(0), "slot ", slot[t], " is outside the cache's ", cache.size(0));
}

// rows [tokens, kv_heads, head_dim] (fp32 or bf16, each token's heads side by side) into their slots
// of a cache (write_head). index_copy_ (and the .to) did the same through TensorIterator, whose
// per-call cost outweighs the copy at decode sizes, twice per layer.
void write_cache(at::Tensor& cache, const at::Tensor& slots, const at::Tensor& rows) {
  const int64_t tokens = rows.size(0), heads = rows.size(1), head_dim = rows.size(2);
  const bool fp32_rows = rows.scalar_type() == at::kFloat;
  const bool direct = writes_heads(cache, heads, head_dim) && (fp32_rows || rows.scalar_type() == at::kBFloat16) &&
                      rows.stride(2) == 1 && rows.stride(1) == head_dim && slots.scalar_type() == at::kLong &&
                      slots.is_contiguous() && slots.numel() == tokens;
  if (!direct) {
    TORCH_CHECK(cache.scalar_type() != at::kChar, "llama_decoder_layer: fp32 or bf16 K/V rows [tokens, kv_heads, "
                "head_dim] into an int8 cache [slots, kv_heads, head_dim + 4]");
    cache.index_copy_(0, slots, rows.to(cache.scalar_type()));  // (fp16 caches)
    return;
  }
  const int64_t* slot = slots.data_ptr<int64_t>();
  check_slots(cache, slot, tokens);
  auto write = [&](const auto* src) {
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h) write_head(cache, slot[t], h, src + t * rows.stride(0) + h * head_dim);
  };
  if (fp32_rows)
    write(rows.data_ptr<float>());
  else
    write(rows.data_ptr<at::BFloat16>());
}

// d[i] += s[i] over [begin, end), the residual adds: fp32, or bf16 (the fp32 sum rounded once, as
// torch adds bf16). Addition commutes (proj + x rounds as x + proj), so the bits are the Python layer's.
template <typename T>
void add_into(T* d, const T* s, int64_t begin, int64_t end) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t i = begin; i < end; ++i) d[i] += s[i];
  } else {
    int64_t i = begin;
    for (; i + tokenmill::kVec <= end; i += tokenmill::kVec)
      tokenmill::store_as(tokenmill::load_bf16(d + i) + tokenmill::load_bf16(s + i), d + i);
    for (; i < end; ++i) d[i] = at::BFloat16(static_cast<float>(d[i]) + static_cast<float>(s[i]));
  }
}

// dst += src over contiguous fp32 or bf16 rows (add_into) where TensorIterator's add costs more in
// per-call overhead than in work at batch-1, twice a layer. One thread below 128K elements (a
// decode batch: elementwise.cpp's kLightMinWork says why).
void add_residual(at::Tensor& dst, const at::Tensor& src) {
  const auto dtype = dst.scalar_type();
  if ((dtype != at::kFloat && dtype != at::kBFloat16) || src.scalar_type() != dtype || !dst.is_contiguous() ||
      !src.is_contiguous() || dst.sizes() != src.sizes()) {
    dst.add_(src);
    return;
  }
  auto add = [&](auto type) {
    using T = decltype(type);
    T* d = dst.data_ptr<T>();
    const T* s = src.data_ptr<T>();
    at::parallel_for(0, dst.numel(), int64_t{1} << 17, [&](int64_t begin, int64_t end) { add_into(d, s, begin, end); });
  };
  if (dtype == at::kFloat)
    add(float{});
  else
    add(at::BFloat16{});
}

at::Tensor decoder_layer(const at::Tensor& x, const LayerWeights& w, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor& k_cache, at::Tensor& v_cache, const StepInputs& step) {
  TORCH_CHECK(x.dim() == 2 && k_cache.dim() == 3, "llama_decoder_layer: x [tokens, hidden], caches [slots, kv_heads, dim]");
  const int64_t tokens = x.size(0), hidden = x.size(1), head_dim = cache_head_dim(k_cache);
  const int64_t q_size = w.heads * head_dim, kv_size = w.kv_heads * head_dim;

  const at::Tensor qkv = linear(norm(x.contiguous(), w.input_norm, w.eps), w.qkv, q_size + 2 * kv_size);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, w.heads, head_dim});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, w.kv_heads, head_dim});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, w.kv_heads, head_dim});
  {
    RECORD_FUNCTION("tokenmill::rope_", std::vector<c10::IValue>());
    tokenmill::rope_(q, k, cos.view({tokens, -1}), sin.view({tokens, -1}));
  }
  at::Tensor attended = at::empty({tokens, w.heads, head_dim}, x.options());
  {
    RECORD_FUNCTION("tokenmill::attention", std::vector<c10::IValue>());  // (the cache writes too, as in Python)
    write_cache(k_cache, step.slot_mapping, k);
    write_cache(v_cache, step.slot_mapping, v);
    const at::Tensor queries = q.contiguous();
    {
      RECORD_FUNCTION("tokenmill::paged_attention", std::vector<c10::IValue>());
      tokenmill::paged_attention(queries, k_cache, v_cache, attended, step.query_start, step.query_lens,
                                 step.block_tables, step.context_lens, step.block_size, w.scale, w.window, w.softcap);
    }
  }

  at::Tensor out = linear(attended.view({tokens, q_size}), w.o, hidden);
  add_residual(out, x);
  const at::Tensor gate_up = linear(norm(out, w.post_norm, w.eps), w.gate_up, 2 * w.intermediate);
  at::Tensor activated;
  {
    RECORD_FUNCTION("tokenmill::silu_mul", std::vector<c10::IValue>());
    activated = tokenmill::silu_mul(gate_up);
  }
  add_residual(out, linear(activated, w.down, hidden));
  return out;
}

// A sense-reversing spin barrier for the region's team. An omp barrier sleeps in the kernel under
// OMP_WAIT_POLICY=PASSIVE and, spinning, takes longer than this one; a waiting thread here yields
// only after a few thousand spins (threads past the free cores).
class SpinBarrier {
 public:
  void wait(int64_t team) {
    const int64_t gen = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == team - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_acq_rel);
      return;
    }
    for (int64_t spins = 0; generation_.load(std::memory_order_acquire) == gen; ++spins) {
      if (spins < 4096)
        pause();
      else
        std::this_thread::yield();
    }
  }

 private:
  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  alignas(64) std::atomic<int64_t> arrived_{0};
  alignas(64) std::atomic<int64_t> generation_{0};
};

// Runs fn, on thread 0 under a profiler scope named as the op it stands for (the other threads'
// share of a phase is in thread 0's wall time: each phase ends at a barrier inside its scope).
template <typename Fn>
inline void phase(int64_t tid, const char* name, Fn&& fn) {
  if (tid != 0) {
    fn();
    return;
  }
  RECORD_FUNCTION(name, std::vector<c10::IValue>());
  fn();
}

// [begin, end) of `count` items that thread `tid` of `team` takes: contiguous shares, as
// at::parallel_for deals them (empty past the last).
std::pair<int64_t, int64_t> share_of(int64_t count, int64_t tid, int64_t team) {
  const int64_t chunk = (count + team - 1) / team, begin = std::min(count, tid * chunk);
  return {begin, std::min(count, begin + chunk)};
}

// One projection of m fp32 rows on the calling thread: its share of the panels of out [m, N]; an
// int8, 4-bit or W8A8 one quantizes x in the thread's scratch.
void project_rows(const Projection& p, const float* bias, const float* x, int64_t m, int64_t k, float* out, int64_t n,
                  int64_t tid, int64_t team, tokenmill::Int8RowScratch& scratch) {
  const auto [begin, end] = share_of(p.weight.size(0), tid, team);
  if (begin >= end) return;
  if (p.int8())
    tokenmill::packed_int8_linear_rows(x, m, k, p.weight, *p.scales, bias, out, n, begin, end, scratch);
  else if (p.int4())
    tokenmill::packed_int4_linear_rows(x, m, k, p.weight, *p.scales, p.zeros, p.zero, p.offsets, bias, out, n, begin,
                                       end, scratch);
  else if (p.w8a8())
    tokenmill::w8a8_linear_rows(x, m, k, p.weight, *p.offsets, *p.scales, bias, out, n, begin, end, scratch);
  else if (p.fp8())
    tokenmill::fp8_linear_rows(x, m, p.weight, *p.scales, p.group_size, bias, out, n, begin, end);
  else
    tokenmill::packed_linear_rows(x, m, p.weight, bias, out, n, begin, end);
}

// A thread's own buffers in the one-region stack, kept across steps.
struct RegionScratch {
  tokenmill::Int8RowScratch int8;
  std::vector<float> wide;  // bf16 rows widened to fp32 for a panel projection
};

// One projection of m rows of T on the calling thread, its share of out [m, N] of T, as the layer
// path's op computes it: fp32 x on the panels (project_rows); bf16 x on a oneDNN weight's 32-output
// blocks as amx_linear runs them, or on a share of pair panels as bf16_pair_linear runs them; bf16 x
// on other panels (integer, FP8 or bf16 weights) widened to fp32 as their ops widen it, summed into
// `wide_out` [m, N] (fp32, shared) and this thread's columns rounded to bf16 once, bias included, as
// the op's .to(bf16) rounds them.
template <typename T>
void project_share(const Projection& p, const float* bias, const T* x, int64_t m, int64_t k, T* out, int64_t n,
                   float* wide_out, int64_t tid, int64_t team, RegionScratch& scratch) {
  if constexpr (std::is_same_v<T, float>) {
    (void)wide_out;
    project_rows(p, bias, x, m, k, out, n, tid, team, scratch.int8);
  } else {
    if (p.onednn()) {
      const auto [begin, end] = share_of(tokenmill::amx_linear_blocks(p.weight), tid, team);
      if (begin < end) tokenmill::amx_linear_rows(x, m, p.weight, bias, out, begin, end);
      return;
    }
    if (p.pairs()) {
      const auto [begin, end] = share_of(p.weight.size(0), tid, team);
      if (begin < end) tokenmill::bf16_pair_linear_rows(x, m, p.weight, bias, out, n, begin, end);
      return;
    }
    scratch.wide.assign(x, x + m * k);
    project_rows(p, bias, scratch.wide.data(), m, k, wide_out, n, tid, team, scratch.int8);
    const auto [begin, end] = share_of(p.weight.size(0), tid, team);
    const int64_t first = std::min(n, begin * tokenmill::kPanel), last = std::min(n, end * tokenmill::kPanel);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = first; c < last; ++c) out[r * n + c] = at::BFloat16(wide_out[r * n + c]);
  }
}

// Every decoder layer of a model, held once (tokenmill.models.layers.fused_layer.FusedStack): a
// step's layers run as one C++ loop. Per layer, Python's loop, the op call's 32 boxed arguments and
// the returned tensor cost host time between layers, a share of a batch-1 step worth removing
// (`tokenmill bench profile`).
//
// A step of a few tokens (batch-1 and small-batch decode) runs every layer in one parallel region
// (forward_in_one_region): each thread keeps its own copy of the hidden rows and does the row-sized
// work itself (norms, SiLU*up, the residual adds, quantizing a GEMM's input), the threads share each
// GEMM's panels, the RoPE and cache writes by token and head and the attention's items, and meet at
// a barrier after each shared phase. The layer-by-layer path opens ~8 parallel regions a layer
// (each a fork and a join) and allocates ~8 tensors, and its GEMMs' checks and views cost more
// still. The same kernels' arithmetic on the same inputs: the bits are the layer-by-layer path's
// (tests/models/test_fused_layers.py). fp32 or bf16 rows (a bf16 model: its oneDNN weights on
// amx_linear's tiles, or int8 panels); the one region shortens batch-1 steps of either
// (`tokenmill bench profile --dtype bfloat16`, with and without `--quantization int8`).
struct DecoderStack : torch::CustomClassHolder {
  static constexpr int64_t kProjectionTensors = 5;  // weight, scales, zeros, offsets, bias
  static constexpr int64_t kTensors = 2 + 4 * kProjectionTensors, kInts = 12, kFloats = 3;  // per layer
  std::vector<LayerWeights> layers;
  std::vector<std::array<at::Tensor, 4>> biases;  // per layer: qkv, o, gate_up, down biases in fp32 (or undefined)
  // Steps of up to this many tokens run in one region where a projection is on panels: at most one
  // block of rows of the panel GEMM (kTileM: 6 on AVX2), whose row tiles do not depend on K; and
  // below the 12 (bf16) and 16 (fp32) rows from which packed_int8_linear sums on AMX tiles, so the
  // region's int8 panels are the op's. A bf16 stack on amx_linear's tiles alone takes up to
  // kAmxMaxRows (64): decode batches of dozens of streams too.
  static constexpr int64_t kRegionRows = 6;
  int64_t region_steps = 0;  // steps that took forward_in_one_region (what a test can ask: region_steps())

  at::Tensor final_norm;  // the model's norm after the last layer (fp32 weight), applied by forward
  double final_eps;

  // Per layer: tensors input_norm, post_norm, then weight, scales?, zeros?, offsets?, bias? of qkv, o,
  // gate_up and down; ints heads, kv_heads, intermediate, window, then the four projections' zero
  // points, then their FP8 scale group sizes (0: not FP8); floats eps, scale, softcap. Then the final
  // norm's weight and eps.
  DecoderStack(const c10::List<std::optional<at::Tensor>>& tensors, const std::vector<int64_t>& ints,
               const std::vector<double>& floats, const at::Tensor& final_norm_weight, double final_norm_eps)
      : final_norm(final_norm_weight), final_eps(final_norm_eps) {
    const int64_t count = static_cast<int64_t>(ints.size()) / kInts;
    TORCH_CHECK(static_cast<int64_t>(tensors.size()) == count * kTensors && static_cast<int64_t>(ints.size()) == count * kInts &&
                    static_cast<int64_t>(floats.size()) == count * kFloats,
                "DecoderStack: ", kTensors, " tensors, ", kInts, " ints and ", kFloats, " floats per layer");
    auto tensor = [&](int64_t i) -> OptTensor { return tensors.get(i); };
    for (int64_t l = 0; l < count; ++l) {
      const int64_t t = l * kTensors;
      auto projection = [&](int64_t index) {
        const int64_t first = t + 2 + index * kProjectionTensors;
        Projection p{*tensor(first), tensor(first + 1), tensor(first + 2), tensor(first + 3), tensor(first + 4),
                     ints[l * kInts + 4 + index], ints[l * kInts + 8 + index]};
        p.amx_tiles = p.onednn() && p.weight.size(1) % 32 == 0 && tokenmill::amx_linear_takes(1, p.weight);
        return p;
      };
      layers.push_back({*tensor(t), *tensor(t + 1), floats[l * kFloats], projection(0), projection(1), projection(2),
                        projection(3), ints[l * kInts], ints[l * kInts + 1], ints[l * kInts + 2],
                        floats[l * kFloats + 1], ints[l * kInts + 3], floats[l * kFloats + 2]});
      auto fp32 = [](const Projection& p) {
        return p.bias.has_value() && p.bias->defined() ? p.bias->to(at::kFloat).contiguous() : at::Tensor();
      };
      const LayerWeights& w = layers.back();
      biases.push_back({fp32(w.qkv), fp32(w.o), fp32(w.gate_up), fp32(w.down)});
    }
  }

  // The final norm of the last layer's output, for tokens x [T, hidden] at `positions` [T] (rows
  // of the RoPE tables cos_table/sin_table [positions, rotary], read as the Python model's
  // cos[positions] gathers them).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_table,
                     const at::Tensor& sin_table, std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                     const at::Tensor& slot_mapping, const at::Tensor& query_start, const at::Tensor& query_lens,
                     const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size) {
    TORCH_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size(),
                "DecoderStack: one K and one V cache per layer");
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == x.size(0) && cos_table.dim() == 2 &&
                    cos_table.sizes() == sin_table.sizes(),
                "DecoderStack: positions [tokens], RoPE tables [positions, rotary]");
    const StepInputs step{slot_mapping, query_start, query_lens, block_tables, context_lens, block_size};
    at::Tensor hidden;
    if (fits_one_region(x, positions, cos_table, sin_table, k_caches, v_caches, slot_mapping)) {
      ++region_steps;
      hidden = x.scalar_type() == at::kFloat
                   ? forward_in_one_region<float>(x, positions, cos_table, sin_table, k_caches, v_caches, step)
                   : forward_in_one_region<at::BFloat16>(x, positions, cos_table, sin_table, k_caches, v_caches, step);
    } else {
      // (in x's dtype, as the Python model's _rope_at rounds them for a bf16 model)
      const at::Tensor cos = cos_table.index_select(0, positions).to(x.scalar_type());
      const at::Tensor sin = sin_table.index_select(0, positions).to(x.scalar_type());
      hidden = x;
      for (size_t l = 0; l < layers.size(); ++l) {
        RECORD_FUNCTION("tokenmill::llama_decoder_layer", std::vector<c10::IValue>());
        hidden = decoder_layer(hidden, layers[l], cos, sin, k_caches[l], v_caches[l], step);
      }
    }
    return norm(hidden, final_norm, final_eps);
  }

 private:
  // Whether the step is fp32 or bf16 tokens (kRegionRows says how many) over caches write_head
  // writes, every layer of one shape, its norms in x's dtype and each projection one the region
  // computes as the layer path does (project_share): panels under fp32 x (oneDNN runs its own
  // threads); under bf16 x, integer, FP8, bf16 or pair panels, or a oneDNN weight amx_linear takes
  // whole tiles of (K a multiple of 32).
  bool fits_one_region(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                       const at::Tensor& sin, const std::vector<at::Tensor>& k_caches,
                       const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping) const {
    const auto dtype = x.scalar_type();
    if (layers.empty() || x.dim() != 2 || x.size(0) < 1 || x.size(0) > tokenmill::kAmxMaxRows ||
        (dtype != at::kFloat && dtype != at::kBFloat16) || !x.is_contiguous() ||
        slot_mapping.scalar_type() != at::kLong || slot_mapping.numel() != x.size(0) ||
        !slot_mapping.is_contiguous() || positions.scalar_type() != at::kLong || !positions.is_contiguous())
      return false;
    const at::Tensor& k0 = k_caches[0];
    if (k0.dim() != 3) return false;
    // (cos, sin: the RoPE tables [positions, rotary], whose rows at `positions` the region reads)
    const int64_t head_dim = cache_head_dim(k0), rotary = cos.size(1);
    if (cos.scalar_type() != at::kFloat || sin.scalar_type() != at::kFloat || !cos.is_contiguous() ||
        !sin.is_contiguous() || rotary % 2 != 0 || rotary > head_dim)
      return false;
    const int64_t m = x.size(0);
    auto computes = [&](const Projection& p) {
      if (p.onednn()) return dtype == at::kBFloat16 && p.amx_tiles && m <= tokenmill::kAmxMaxRows;
      if (p.pairs()) return dtype == at::kBFloat16 && m <= kRegionRows;
      return m <= kRegionRows &&
             (dtype == at::kFloat || p.int8() || p.int4() || p.w8a8() || p.fp8() ||
              p.weight.scalar_type() == at::kBFloat16);
    };
    const LayerWeights& first = layers[0];
    for (size_t l = 0; l < layers.size(); ++l) {
      const LayerWeights& w = layers[l];
      if (w.heads != first.heads || w.kv_heads != first.kv_heads || w.intermediate != first.intermediate ||
          w.input_norm.scalar_type() != dtype || w.post_norm.scalar_type() != dtype || !w.input_norm.is_contiguous() ||
          !w.post_norm.is_contiguous() || !computes(w.qkv) || !computes(w.o) || !computes(w.gate_up) ||
          !computes(w.down) || !writes_heads(k_caches[l], w.kv_heads, head_dim) ||
          !writes_heads(v_caches[l], w.kv_heads, head_dim) || k_caches[l].scalar_type() != k0.scalar_type() ||
          v_caches[l].scalar_type() != k0.scalar_type() || k_caches[l].sizes() != k0.sizes() ||
          v_caches[l].sizes() != k0.sizes())
        return false;
    }
    return true;
  }

  // The layers in one parallel region for T = x's dtype (fp32 or bf16: the buffers between the ops
  // hold T, as the layer path's tensors do). (cos, sin: the RoPE tables, read at each token's
  // position: gathering them first took two index_select calls, slow in a cold batch-1 step; a bf16
  // step rounds its tokens' rows to bf16 first, as the Python model's _rope_at does.)
  template <typename T>
  at::Tensor forward_in_one_region(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                                   const at::Tensor& sin, std::vector<at::Tensor>& k_caches,
                                   std::vector<at::Tensor>& v_caches, const StepInputs& step) {
    constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;
    const LayerWeights& first = layers[0];
    const int64_t m = x.size(0), hidden = x.size(1), head_dim = cache_head_dim(k_caches[0]);
    const int64_t heads = first.heads, kv_heads = first.kv_heads, inter = first.intermediate;
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
    const int64_t rotary = cos.size(1);
    const int64_t* slots = step.slot_mapping.data_ptr<int64_t>();
    check_slots(k_caches[0], slots, m);  // (every cache has k_caches[0]'s shape: fits_one_region)
    const int64_t* position = positions.data_ptr<int64_t>();
    for (int64_t t = 0; t < m; ++t)
      TORCH_CHECK(position[t] >= 0 && position[t] < cos.size(0), "DecoderStack: position ", position[t],
                  " is outside the RoPE tables' ", cos.size(0), " rows");
    const auto options = x.options();
    at::Tensor qkv = at::empty({m, qkv_size}, options);
    at::Tensor queries = at::empty({m, heads, head_dim}, options);  // q after RoPE, as the attention reads it
    // (the o projection's input: amx_linear_rows reads whole 32-row chunks past 32 rows)
    at::Tensor attended = at::empty({tokenmill::amx_padded_rows(m), heads, head_dim}, options);
    at::Tensor gate_up = at::empty({m, 2 * inter}, options);
    at::Tensor projected = at::empty({m, hidden}, options);  // the o and down GEMMs' output, in turn
    at::Tensor result = at::empty({m, hidden}, options);
    // bf16 panel projections' fp32 sums (project_share)
    std::vector<float> wide_out(kBf16 ? static_cast<size_t>(m * std::max({qkv_size, 2 * inter, hidden})) : 0);
    // each token's RoPE rows as the rotation reads them: the tables' rows, or (bf16) those rounded
    std::vector<T> rounded_cos, rounded_sin;
    std::vector<const T*> cos_of(static_cast<size_t>(m)), sin_of(static_cast<size_t>(m));
    const float* cos_table = cos.data_ptr<float>();
    const float* sin_table = sin.data_ptr<float>();
    if constexpr (kBf16) {
      rounded_cos.assign(static_cast<size_t>(m * rotary), T(0.f));
      rounded_sin.assign(static_cast<size_t>(m * rotary), T(0.f));
      for (int64_t t = 0; t < m; ++t) {
        for (int64_t i = 0; i < rotary; ++i) {
          rounded_cos[t * rotary + i] = T(cos_table[position[t] * rotary + i]);
          rounded_sin[t * rotary + i] = T(sin_table[position[t] * rotary + i]);
        }
        cos_of[t] = rounded_cos.data() + t * rotary, sin_of[t] = rounded_sin.data() + t * rotary;
      }
    } else {
      for (int64_t t = 0; t < m; ++t)
        cos_of[t] = cos_table + position[t] * rotary, sin_of[t] = sin_table + position[t] * rotary;
    }
    // The attention's work: one plan per window (the same for every layer that shares it).
    const int64_t threads = at::get_num_threads();
    std::vector<std::pair<int64_t, std::shared_ptr<const tokenmill::AttentionWork>>> plans;
    std::vector<const tokenmill::AttentionWork*> plan_of(layers.size());
    int64_t partial_floats = 0;
    for (size_t l = 0; l < layers.size(); ++l) {
      auto found = std::find_if(plans.begin(), plans.end(), [&](const auto& e) { return e.first == layers[l].window; });
      if (found == plans.end()) {
        plans.emplace_back(layers[l].window,
                           tokenmill::plan_paged_attention(queries, k_caches[l], v_caches[l], attended.narrow(0, 0, m),
                                                           step.query_start, step.query_lens, step.block_tables,
                                                           step.context_lens, step.block_size, layers[l].window,
                                                           threads));
        found = plans.end() - 1;
        partial_floats = std::max(partial_floats, tokenmill::attention_partial_floats(*found->second));
      }
      plan_of[l] = found->second.get();
    }
    std::vector<float> partials(static_cast<size_t>(partial_floats));
    std::unique_ptr<std::atomic<int64_t>[]> next_item(new std::atomic<int64_t>[layers.size()]);
    for (size_t l = 0; l < layers.size(); ++l) next_item[l].store(0);
    const int64_t row_values = std::max({hidden, inter, q_size});
    T* qkv_ptr = qkv.data_ptr<T>();
    T* queries_ptr = queries.data_ptr<T>();
    T* attended_ptr = attended.data_ptr<T>();
    T* gate_up_ptr = gate_up.data_ptr<T>();
    T* projected_ptr = projected.data_ptr<T>();
    float* wide_ptr = wide_out.data();
    auto bias = [](const at::Tensor& b) { return b.defined() ? b.data_ptr<float>() : nullptr; };
    SpinBarrier barrier;  // (after each shared phase)
    auto norm_rows = [&](const T* h, const at::Tensor& weight, double eps, T* out) {
      for (int64_t t = 0; t < m; ++t)
        tokenmill::rms_norm_row(h + t * hidden, weight.data_ptr<T>(), hidden, static_cast<float>(eps),
                                out + t * hidden);
    };

#pragma omp parallel num_threads(threads)
    {
      const int64_t tid = omp_get_thread_num(), team = omp_get_num_threads();
      thread_local std::vector<T> own_hidden, own_rows;  // this thread's hidden rows and norm/SiLU output
      thread_local RegionScratch scratch;
      own_hidden.assign(x.data_ptr<T>(), x.data_ptr<T>() + m * hidden);
      own_rows.resize(static_cast<size_t>(tokenmill::amx_padded_rows(m) * row_values));  // (as `attended`)
      T* h = own_hidden.data();
      T* rows = own_rows.data();
      for (size_t l = 0; l < layers.size(); ++l) {
        const LayerWeights& w = layers[l];
        const auto& b = biases[l];
        phase(tid, "tokenmill::rms_norm", [&] { norm_rows(h, w.input_norm, w.eps, rows); });
        phase(tid, w.qkv.op_name(), [&] {
          project_share(w.qkv, bias(b[0]), rows, m, hidden, qkv_ptr, qkv_size, wide_ptr, tid, team, scratch);
          barrier.wait(team);
        });
        phase(tid, "tokenmill::rope_", [&] {
          // each token's q heads (into `queries`, rotated there), then its kv heads (K rotated, then
          // K and V into the caches), dealt round the threads
          for (int64_t i = tid; i < m * (heads + kv_heads); i += team) {
            const int64_t t = i / (heads + kv_heads), head = i % (heads + kv_heads);
            const T* c = cos_of[t];
            const T* s = sin_of[t];
            T* token = qkv_ptr + t * qkv_size;
            if (head < heads) {
              T* q = queries_ptr + (t * heads + head) * head_dim;
              std::memcpy(q, token + head * head_dim, head_dim * sizeof(T));
              tokenmill::rope_head(q, c, s, rotary);
              continue;
            }
            T* k = token + q_size + (head - heads) * head_dim;
            tokenmill::rope_head(k, c, s, rotary);
            write_head(k_caches[l], slots[t], head - heads, k);
            write_head(v_caches[l], slots[t], head - heads, k + kv_size);
          }
          barrier.wait(team);
        });
        // (the op inside the scope `tokenmill bench profile` counts as attention, as on the layer path)
        phase(tid, "tokenmill::attention", [&] { phase(tid, "tokenmill::paged_attention", [&] {
          const tokenmill::AttentionWork& work = *plan_of[l];
          tokenmill::attend_items(work, queries_ptr, k_caches[l].data_ptr(), v_caches[l].data_ptr(), attended_ptr,
                                  w.scale, w.softcap, partials.data(), next_item[l]);
          const int64_t merges = tokenmill::attention_merges(work);
          if (merges > 0) {
            barrier.wait(team);
            const auto [begin, end] = share_of(merges, tid, team);
            tokenmill::merge_partials(work, attended_ptr, partials.data(), begin, end);
          }
          barrier.wait(team);
        }); });
        phase(tid, w.o.op_name(), [&] {
          project_share(w.o, bias(b[1]), attended_ptr, m, q_size, projected_ptr, hidden, wide_ptr, tid, team, scratch);
          barrier.wait(team);
        });
        add_into(h, projected_ptr, 0, m * hidden);
        phase(tid, "tokenmill::rms_norm", [&] { norm_rows(h, w.post_norm, w.eps, rows); });
        phase(tid, w.gate_up.op_name(), [&] {
          project_share(w.gate_up, bias(b[2]), rows, m, hidden, gate_up_ptr, 2 * inter, wide_ptr, tid, team, scratch);
          barrier.wait(team);
        });
        phase(tid, "tokenmill::silu_mul", [&] {
          for (int64_t t = 0; t < m; ++t) tokenmill::silu_mul_row(gate_up_ptr + t * 2 * inter, inter, rows + t * inter);
        });
        phase(tid, w.down.op_name(), [&] {
          project_share(w.down, bias(b[3]), rows, m, inter, projected_ptr, hidden, wide_ptr, tid, team, scratch);
          barrier.wait(team);
        });
        add_into(h, projected_ptr, 0, m * hidden);
      }
      if (tid == 0) std::memcpy(result.data_ptr<T>(), h, m * hidden * sizeof(T));
    }
    return result;
  }
};

}  // namespace

namespace tokenmill {

at::Tensor llama_decoder_layer(const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& post_norm,
                               double eps, const c10::List<std::optional<at::Tensor>>& projections,
                               c10::ArrayRef<int64_t> zero_points, c10::ArrayRef<int64_t> group_sizes,
                               int64_t heads, int64_t kv_heads,
                               int64_t intermediate, const at::Tensor& cos, const at::Tensor& sin,
                               at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                               const at::Tensor& query_start, const at::Tensor& query_lens,
                               const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                               double scale, int64_t window, double softcap) {
  constexpr int64_t kPer = DecoderStack::kProjectionTensors;
  TORCH_CHECK(projections.size() == 4 * kPer && zero_points.size() == 4 && group_sizes.size() == 4,
              "llama_decoder_layer: weight, scales, zeros, offsets and bias of qkv, o, gate_up and down, their "
              "zero points and their FP8 scale group sizes");
  auto projection = [&](int64_t index) {
    const int64_t first = index * kPer;
    return Projection{*projections.get(first), projections.get(first + 1), projections.get(first + 2),
                      projections.get(first + 3), projections.get(first + 4), zero_points[index],
                      group_sizes[index]};
  };
  const LayerWeights w{input_norm, post_norm, eps, projection(0), projection(1), projection(2), projection(3),
                       heads, kv_heads, intermediate, scale, window, softcap};
  return decoder_layer(x, w, cos, sin, k_cache, v_cache,
                       {slot_mapping, query_start, query_lens, block_tables, context_lens, block_size});
}

void register_decoder_stack(torch::Library& m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<const c10::List<std::optional<at::Tensor>>&, const std::vector<int64_t>&,
                       const std::vector<double>&, const at::Tensor&, double>())
      .def("forward", &DecoderStack::forward)
      .def("region_steps", [](const c10::intrusive_ptr<DecoderStack>& self) { return self->region_steps; });
}

}  // namespace tokenmill
