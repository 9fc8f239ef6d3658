// y = x W^T + b for a few rows of bf16 x (decode-sized steps) on AMX, reading the weight oneDNN
// reordered for its own GEMMs (onednn_linear.cpp): one copy of the weight serves both.
//
// Why: oneDNN's bf16 GEMMs at decode sizes read the weights well below the memory's rate, and each
// call has a fixed cost of its own. These tiles stream the same bytes faster; from ~64 rows up
// oneDNN's blocking wins (it reuses each weight tile across more rows), so larger steps stay on it
// (`python bench/amx_linear_vs_onednn.py`: a model's layer GEMMs, each layer its own weights).
//
// oneDNN lays a bf16 weight [N, K] out for AMX as blocks of 32 outputs, each k-pair-major: byte
// offset ((n / 32) * Kp / 2 + k / 2) * 128 + (n % 32) * 4 + (k % 2) * 2, with K padded to Kp (a
// multiple of 32) and N to a multiple of 32 by zeros: an AMX B tile (16 k-pairs x 16 outputs) is 16
// rows of 64 bytes at a stride of 128. The layout is oneDNN's choice, not a promise: every (N, K) is
// checked once by reordering probe matrices through the same op (onednn_amx_layout), and a shape whose
// layout differs stays on oneDNN.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "kernels.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace at::native {
// (ATen's accessors of an opaque oneDNN tensor's buffer: exported, declared in a header the wheel
// does not ship, ATen/native/mkldnn/MKLDNNCommon.h)
TORCH_API void* data_ptr_from_mkldnn(const at::Tensor& mkldnn_tensor);
TORCH_API int64_t nbytes_from_mkldnn(const at::Tensor& mkldnn_tensor);
}  // namespace at::native

namespace tokenmill {
namespace {

constexpr int64_t kBlockOutputs = 32;  // outputs per oneDNN weight block (two B tiles side by side)
constexpr int64_t kTileK = 32;         // inputs per tile (16 pairs)

int64_t round_up(int64_t value, int64_t step) { return (value + step - 1) / step * step; }

// Probes (N, K) through oneDNN's reorder: true when its buffer is the layout above, zero-padded.
// Each probe weight is its output's index (n % 251 + 1) or its input's (k % 251 + 1), both exact in
// bf16, so every slot of the buffer names the (n, k) it holds, and padding (0) shows as 0. (Checked
// a few blocks at a time: a vocabulary-sized weight's expected values would not fit in fp32 at once.)
bool layout_matches(int64_t n, int64_t k) {
  static const c10::OperatorHandle reorder =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_reorder_linear_weight", "");
  const int64_t np = round_up(n, kBlockOutputs), kp = round_up(k, kTileK), blocks = np / kBlockOutputs;
  const auto options = at::TensorOptions().dtype(at::kFloat);
  const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 22) / (kp * kBlockOutputs));  // blocks per check
  for (const bool by_output : {true, false}) {
    const at::Tensor index = by_output ? at::arange(n, options).view({n, 1}).expand({n, k})
                                       : at::arange(k, options).view({1, k}).expand({n, k});
    torch::jit::Stack stack{(at::remainder(index, 251) + 1).to(at::kBFloat16).contiguous(),
                            c10::IValue(kOnednnBatchHint)};
    reorder.callBoxed(&stack);
    const at::Tensor packed = stack[0].toTensor();
    if (at::native::nbytes_from_mkldnn(packed) != np * kp * 2) return false;
    const at::Tensor raw = at::from_blob(at::native::data_ptr_from_mkldnn(packed),
                                         {blocks, kp / 2, kBlockOutputs, 2}, at::TensorOptions().dtype(at::kBFloat16));
    const at::Tensor inputs = ((at::arange(kp / 2, options) * 2).view({1, kp / 2, 1, 1}) +
                               at::arange(2, options).view({1, 1, 1, 2}));
    for (int64_t b0 = 0; b0 < blocks; b0 += chunk) {
      const int64_t count = std::min(chunk, blocks - b0);
      const at::Tensor outputs = at::arange(b0 * kBlockOutputs, (b0 + count) * kBlockOutputs, options)
                                     .view({count, 1, kBlockOutputs, 1});
      const at::Tensor inside = (outputs < n) & (inputs < k);
      const at::Tensor want = at::where(inside, at::remainder(by_output ? outputs : inputs, 251) + 1,
                                        at::zeros({}, options));
      if (!at::equal(raw.narrow(0, b0, count).to(at::kFloat), want.expand({count, kp / 2, kBlockOutputs, 2})))
        return false;
    }
  }
  return true;
}

#if defined(CPU_CAPABILITY_AVX512)

#define TOKENMILL_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

// cpuid leaf 7's EDX: AMX-TILE (bit 24), AMX-BF16 (22), AMX-INT8 (25).
unsigned leaf7_edx() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) ? edx : 0;
}

// The tile state granted to this process (Linux asks each process to request it).
bool tiles_granted() {
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  static const bool granted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return granted;
}

// AMX-BF16 on this CPU and granted.
bool amx_usable() {
  static const bool usable = [] {
    const unsigned edx = leaf7_edx();
    const bool tile = edx & (1u << 24), bf16 = edx & (1u << 22), avx512_bf16 = [] {
      unsigned a = 0, b = 0, c = 0, d = 0;
      return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
    }();
    return tile && bf16 && avx512_bf16 && tiles_granted();
  }();
  return usable;
}

// Tiles 0, 1: sums of x's first rows (up to 16) x 16 outputs each, fp32; 2, 3: of the next rows
// (up to 16); 4, 5: those rows of x (32 inputs); 6, 7: W (16 pairs x 16 outputs x 2). A tile of fewer
// than 16 rows reads and writes only those: x needs no padding rows.
TOKENMILL_AMX void configure_tiles(int first_rows, int second_rows) {
  AmxTileConfig config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = 16;
  config.rows[0] = config.rows[1] = config.rows[4] = static_cast<uint8_t>(first_rows);
  if (second_rows > 0) config.rows[2] = config.rows[3] = config.rows[5] = static_cast<uint8_t>(second_rows);
  __asm__ __volatile__("" : : "r"(&config) : "memory");  // (GCC dropped the stores above without it)
  _tile_loadconfig(&config);
}

TOKENMILL_AMX void release_tiles() { _tile_release(); }

// Sums of x's rows (ldx elements a row, Kp inputs; the tiles' rows: up to 16 for one tile, up to 32
// for two) times one block of 32 outputs (`block`: its Kp / 2 pair rows of 128 bytes), into scratch
// [32 rows][32 outputs] fp32.
template <int RowTiles>
TOKENMILL_AMX void block_sums(const at::BFloat16* x, int64_t ldx, const at::BFloat16* block, int64_t tiles,
                              float* scratch) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (RowTiles == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t x_stride = ldx * 2;
  for (int64_t t = 0; t < tiles; ++t) {
    const at::BFloat16* w = block + t * 16 * 2 * kBlockOutputs;  // 16 pair rows of 32 outputs x 2
    _tile_loadd(6, w, 128);
    _tile_loadd(7, w + 32, 128);
    _tile_loadd(4, x + t * kTileK, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (RowTiles == 2) {
      _tile_loadd(5, x + 16 * ldx + t * kTileK, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, scratch, 128);
  _tile_stored(1, scratch + 16, 128);
  if constexpr (RowTiles == 2) {
    _tile_stored(2, scratch + 16 * 32, 128);
    _tile_stored(3, scratch + 16 * 32 + 16, 128);
  }
}

// out[r, 0:cols] = sums[r] + bias for rows r < rows (bias: fp32 or nullptr), rounded to bf16 or
// kept fp32 (logits: `amx_logits`).
template <typename Out>
TOKENMILL_AMX void store_rows(const float* scratch, const float* bias, Out* out, int64_t ldo, int64_t rows,
                              int64_t cols) {
  const __mmask16 low = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 high = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  const __m512 b0 = bias != nullptr ? _mm512_maskz_loadu_ps(low, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias != nullptr ? _mm512_maskz_loadu_ps(high, bias + 16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(scratch + r * 32), b0);
    const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(scratch + r * 32 + 16), b1);
    if constexpr (std::is_same_v<Out, float>) {
      _mm512_mask_storeu_ps(out + r * ldo, low, lo);
      _mm512_mask_storeu_ps(out + r * ldo + 16, high, hi);
    } else {
      const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
      _mm512_mask_storeu_epi16(out + r * ldo, (static_cast<__mmask32>(high) << 16) | low, both);
    }
  }
}

// amx_bf16_blocks for either output dtype.
template <typename Out>
TOKENMILL_AMX void bf16_blocks(const at::BFloat16* x, int64_t m, int64_t kp, int64_t begin, int64_t end,
                               const std::function<const at::BFloat16*(int64_t)>& block_of, const float* bias,
                               Out* out, int64_t n) {
  const int first_rows = static_cast<int>(std::min<int64_t>(m, 16));
  const int second_rows = static_cast<int>(std::min<int64_t>(m - first_rows, 16));
  configure_tiles(first_rows, second_rows);
  alignas(64) float scratch[32 * 32];
  for (int64_t b = begin; b < end; ++b) {
    const at::BFloat16* block = block_of(b);
    const int64_t col = b * kBlockOutputs, cols = std::min(kBlockOutputs, n - col);
    for (int64_t r = 0; r < m; r += 32) {
      if (second_rows > 0)
        block_sums<2>(x + r * kp, kp, block, kp / kTileK, scratch);
      else
        block_sums<1>(x + r * kp, kp, block, kp / kTileK, scratch);
      store_rows(scratch, bias != nullptr ? bias + col : nullptr, out + r * n + col, n, std::min<int64_t>(32, m - r),
                 cols);
    }
  }
  release_tiles();
}

#endif  // CPU_CAPABILITY_AVX512

}  // namespace

bool amx_bf16_usable() {
#if defined(CPU_CAPABILITY_AVX512)
  return amx_usable();
#else
  return false;
#endif
}

bool amx_int8_usable() {
#if defined(CPU_CAPABILITY_AVX512)
  static const bool usable = [] {
    const char* setting = std::getenv("TOKENMILL_AMX_INT8");
    if (setting != nullptr && std::strcmp(setting, "0") == 0) return false;
    const unsigned edx = leaf7_edx();
    return (edx & (1u << 24)) && (edx & (1u << 25)) && tiles_granted();
  }();
  return usable;
#else
  return false;
#endif
}

bool onednn_amx_layout(int64_t n, int64_t k) {
  static std::mutex mutex;
  static std::map<std::pair<int64_t, int64_t>, bool> known;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = known.find({n, k});
  if (found == known.end()) found = known.emplace(std::make_pair(n, k), layout_matches(n, k)).first;
  return found->second;
}

bool amx_linear_takes(int64_t rows, const at::Tensor& packed) {
#if defined(CPU_CAPABILITY_AVX512)
  return rows >= 1 && rows <= kAmxMaxRows && packed.is_mkldnn() && packed.scalar_type() == at::kBFloat16 &&
         packed.dim() == 2 && amx_usable() && onednn_amx_layout(packed.size(0), packed.size(1));
#else
  (void)rows, (void)packed;
  return false;
#endif
}

bool amx_linear_applies(const at::Tensor& x, const at::Tensor& packed) {
  return x.scalar_type() == at::kBFloat16 && x.dim() == 2 && amx_linear_takes(x.size(0), packed) &&
         packed.size(1) == x.size(1);
}

int64_t amx_linear_blocks(const at::Tensor& packed) { return round_up(packed.size(0), kBlockOutputs) / kBlockOutputs; }

void amx_linear_rows(const at::BFloat16* x, int64_t m, const at::Tensor& packed, const float* bias, at::BFloat16* out,
                     int64_t begin, int64_t end) {
#if defined(CPU_CAPABILITY_AVX512)
  const int64_t n = packed.size(0), kp = round_up(packed.size(1), kTileK), block_elems = kp * kBlockOutputs;
  const auto* weight = static_cast<const at::BFloat16*>(at::native::data_ptr_from_mkldnn(packed));
  amx_bf16_blocks(x, m, kp, begin, end, [&](int64_t b) { return weight + b * block_elems; }, bias, out, n);
#else
  (void)x, (void)m, (void)packed, (void)bias, (void)out, (void)begin, (void)end;
  TORCH_CHECK(false, "amx_linear_rows: tokenmill's kernels are built without AVX-512 here");
#endif
}

namespace {

// x W^T (+ bias) on the tiles into a new [m, N] tensor of Out (bf16: rounded; fp32: the tiles' sums),
// any row count: each weight block is read once, for every 32-row chunk of x in turn.
template <typename Out>
at::Tensor amx_product(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       const char* op) {
#if defined(CPU_CAPABILITY_AVX512)
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0), kp = round_up(k, kTileK);
  at::Tensor bias_holder;
  const float* bias_ptr = bias_data(bias, n, bias_holder, op);
  // x as whole tiles of inputs: a K that is not a multiple of 32 reads a zero-padded copy (the
  // weight's padding is zero too), as does a step past 32 rows that is not whole chunks of 32
  // (amx_padded_rows).
  at::Tensor xp = x.contiguous();
  if (kp != k || amx_padded_rows(m) != m) xp = at::constant_pad_nd(xp, {0, kp - k, 0, amx_padded_rows(m) - m});
  at::Tensor out = at::empty({m, n}, xp.options().dtype(c10::CppTypeToScalarType<Out>::value));
  const at::BFloat16* xd = xp.data_ptr<at::BFloat16>();
  const auto* weight = static_cast<const at::BFloat16*>(at::native::data_ptr_from_mkldnn(packed));
  const int64_t block_elems = kp * kBlockOutputs;
  Out* od = out.data_ptr<Out>();
  at::parallel_for(0, amx_linear_blocks(packed), 1, [&](int64_t begin, int64_t end) {
    amx_bf16_blocks(xd, m, kp, begin, end, [&](int64_t b) { return weight + b * block_elems; }, bias_ptr, od, n);
  });
  return out;
#else
  (void)x, (void)packed, (void)bias;
  TORCH_CHECK(false, op, ": tokenmill's kernels are built without AVX-512 here");
  return at::Tensor();
#endif
}

}  // namespace

at::Tensor amx_linear_unchecked(const at::Tensor& x, const at::Tensor& packed,
                                const c10::optional<at::Tensor>& bias) {
  return amx_product<at::BFloat16>(x, packed, bias, "amx_linear");
}

namespace {

template <typename Out>
void bf16_blocks_here(const at::BFloat16* x, int64_t m, int64_t kp, int64_t begin, int64_t end,
                      const std::function<const at::BFloat16*(int64_t)>& block_of, const float* bias, Out* out,
                      int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  bf16_blocks(x, m, kp, begin, end, block_of, bias, out, n);
#else
  (void)x, (void)m, (void)kp, (void)begin, (void)end, (void)block_of, (void)bias, (void)out, (void)n;
  TORCH_CHECK(false, "amx_bf16_blocks: tokenmill's kernels are built without AVX-512 here");
#endif
}

}  // namespace

void amx_bf16_blocks(const at::BFloat16* x, int64_t m, int64_t kp, int64_t begin, int64_t end,
                     const std::function<const at::BFloat16*(int64_t)>& block_of, const float* bias,
                     at::BFloat16* out, int64_t n) {
  bf16_blocks_here(x, m, kp, begin, end, block_of, bias, out, n);
}

void amx_bf16_blocks(const at::BFloat16* x, int64_t m, int64_t kp, int64_t begin, int64_t end,
                     const std::function<const at::BFloat16*(int64_t)>& block_of, const float* bias, float* out,
                     int64_t n) {
  bf16_blocks_here(x, m, kp, begin, end, block_of, bias, out, n);
}

bool amx_logits_applies(const at::Tensor& x, const at::Tensor& packed) {
  return x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) >= 1 && amx_linear_takes(1, packed) &&
         packed.size(1) == x.size(1);
}

at::Tensor amx_logits(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_logits_applies(x, packed), "amx_logits: bf16 x [rows, K] and a bf16 weight reordered by oneDNN "
              "in the blocked layout amx_linear reads, on a CPU with AMX");
  return amx_product<float>(x, packed, bias, "amx_logits");
}

// The op: amx_linear_unchecked where it applies, else an error naming what it takes.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_linear_applies(x, packed), "amx_linear: bf16 x [1-", kAmxMaxRows,
              " rows, K] and a bf16 weight reordered by oneDNN in the blocked layout amx_linear reads, on a CPU "
              "with AMX");
  return amx_linear_unchecked(x, packed, bias);
}

}  // namespace tokenmill
