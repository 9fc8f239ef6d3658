// Paged attention on CPU, reading K/V blocks where they are in the cache (no gather copy).
//
// Every sequence s has query_lens[s] queries, rows query_start[s].. of q and out, which are the last
// query_lens[s] positions of its context_lens[s] keys; key position t lives at slot block_tables[s][t / block_size] *
// block_size + t % block_size of k_cache/v_cache [slots, kv_heads, head_dim]. A query at position
// p sees keys t <= p (causal) with p - t < window when window > 0. Decodes are q_len == 1. An int8
// cache's rows are [head_dim int8 values, their fp32 scale] (head_dim + 4 bytes, models/layers/kv_quant.py).
//
// Work items are (sequence, kv heads, tile of queries[, chunk of 128 keys]): all kv heads of a
// sequence when there are items enough for the threads (each K/V slot row is then read as
// one stretch), else one kv head each; a tile's keys are computed in 128-key chunks whose partial
// softmaxes are merged, the chunks split into items of their own only when tiles are few (see
// kKeyChunk). The query heads that share a kv head (GQA) are computed together, so every K/V
// row is loaded once per tile. Items differ in cost by orders of magnitude (a decode vs a prefill
// tile over a long context): the largest go first and threads pull them one at a time. Scores go to
// a per-thread buffer: q.k for tiles of 4 keys x 3 query rows (fp32 accumulators in registers), scale,
// optional softcap tanh, the causal/window mask as one range per row, max, exp, sum, then the
// weighted V rows accumulated in registers over tiles of 8 keys, divided by the sum at the end.
// Tiles of many query rows (prefill chunks, verification passes) compute the same products in the
// same order with the keys in the vector lanes (see keys_in_lanes_dots): same bits, fewer instructions.
// Vectorised with ATen's Vectorized<float> for the instruction set this file is compiled for
// (AVX2+FMA or AVX-512; see tokenmill/kernels/build.py). Faster than a per-key loop on cached K/V,
// over a bf16 cache and for prefill chunks; fp32 decode over a cache larger than L3 stays
// memory-bound (`tokenmill bench kernels`, its attention table, against the read rate).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "kernels.h"
#include "vec_utils.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace tokenmill {
namespace {

// Queries handled per work item: one decode, or up to this many rows of a prefill chunk; of a chunk
// of at least kLongChunk queries, up to kLongQueryTile (each tile reads its keys' K/V rows once: fewer,
// larger tiles read them fewer times). A query's bits do not depend on its tile.
constexpr int64_t kQueryTile = 8;
constexpr int64_t kLongChunk = 128;
constexpr int64_t kLongQueryTile = 32;
inline int64_t query_tile(int64_t queries) { return queries >= kLongChunk ? kLongQueryTile : kQueryTile; }

// K/V rows of one head are scattered (strided within a block, blocks anywhere in the cache): the
// hardware prefetcher does not follow, so a row's cache lines are requested this many keys ahead,
// a line for each line the tile reads (for_key_tiles). Requested in bursts, all of a tile's lines
// before it (48-96 lines), the requests stalled the loads behind them and a core read K/V no faster
// than with none; spread, they raise the read rate, 4 to 32 keys ahead alike (`python
// bench/paged_attention_decode.py`). An int8 row's scale, past its head_dim bytes, is not requested
// (it may sit in the next line).
constexpr int64_t kPrefetchAhead = 16;

struct Params {
  int64_t heads, kv_heads, dim, block_size, max_blocks, window;
  int64_t head_stride;  // cache elements per kv head of a slot: dim, or dim + 4 for int8 rows and their scale
  float scale, softcap;
};

// A sequence's keys are cut at multiples of kKeyChunk (absolute positions); a tile of queries whose
// keys span several chunks gets one partial softmax per chunk (max, sum, unnormalised weighted V),
// merged in chunk order afterwards, each chunk its own work item when tiles are few (a small-batch
// decode) and one after another in its tile's item otherwise. Fixed boundaries: a row's
// arithmetic never depends on the batch, the threads or the tiling. One decode over a long context
// is then many items, shared by the threads, each reading whole slot rows of every kv head
// (batch-1, 1,024 keys: 8 items of all three kv heads rather than 3 of one each), which speeds up
// long-context batch-1 decode; 64-key chunks were slower, 256-key ones no faster (`python
// bench/paged_attention_decode.py --sequences 1`).
constexpr int64_t kKeyChunk = 128;

struct WorkItem {
  int64_t seq, kv_head, num_kv_heads, first_query, num_queries;  // kv heads [kv_head, +num_kv_heads);
                                                                 // first_query: offset in the sequence's queries
  int64_t key_lo, key_hi;  // the keys this item reads: one chunk's, or the whole tile's (one or more chunks)
  int64_t partial;         // a chunk of a split tile: where its partial softmax goes (in floats); else -1
  int64_t cost;
};

// A partial result: rows x dim unnormalised accumulators, then each row's max and sum of exp(s - max).
inline int64_t partial_floats(int64_t rows, int64_t dim) { return rows * (dim + 2); }

// An item's rows: row r is kv head kv_head + r / head_rows, query (r % head_rows) / group, query
// head (that kv head) * group + r % group.
struct ItemRows {
  int64_t group, kv_head, head_rows, rows, heads, dim;

  ItemRows(const WorkItem& item, const Params& p)
      : group(p.heads / p.kv_heads), kv_head(item.kv_head), head_rows(group * item.num_queries),
        rows(item.num_kv_heads * head_rows), heads(p.heads), dim(p.dim) {}
  int64_t query_of(int64_t r) const { return (r % head_rows) / group; }
  int64_t head_of(int64_t r) const { return (kv_head + r / head_rows) * group + r % group; }
  // Where row r starts in q and out [tokens, heads, dim], the item's first query being token first_row.
  int64_t offset(int64_t r, int64_t first_row) const { return ((first_row + query_of(r)) * heads + head_of(r)) * dim; }
};

// Calls fn(lo, hi) for the kKeyChunk-aligned stretches of keys [key_lo, key_hi), in order.
template <typename Fn>
inline void for_key_chunks(int64_t key_lo, int64_t key_hi, Fn&& fn) {
  for (int64_t lo = key_lo; lo < key_hi;) {
    const int64_t hi = std::min(key_hi, (lo / kKeyChunk + 1) * kKeyChunk);
    fn(lo, hi);
    lo = hi;
  }
}

// Keys per tile: their dot products accumulate side by side (one load of each q chunk for 4 keys).
constexpr int kKeyTile = 4;
// Keys whose weighted V rows accumulate in registers before the output rows are loaded and stored.
constexpr int kValueTile = 8;

// out_rows[r] += sum_j w[r * ld + j] * v_rows[j] for N rows and KT keys (V rows in fp32, or bf16
// read as fp32): the KT products accumulate in registers, so each output chunk is loaded and stored
// once per tile. `ahead`: as dot_tile's.
template <int N, int KT, typename V>
inline void weighted_sum_tile(const float* w, int64_t ld, const V* const* v_rows, int64_t dim,
                              float* const* out_rows, const char* const* ahead = nullptr, int64_t ahead_size = 4) {
  int64_t d = 0;
  for (; d + 2 * kVec <= dim; d += 2 * kVec) {
    if (ahead != nullptr) prefetch_rows_span<KT>(ahead, d * ahead_size, (d + 2 * kVec) * ahead_size);
    Vec acc[N][2];
    #pragma GCC unroll 16
    for (int r = 0; r < N; ++r) {
      acc[r][0] = Vec::loadu(out_rows[r] + d);
      acc[r][1] = Vec::loadu(out_rows[r] + d + kVec);
    }
    #pragma GCC unroll 16
    for (int j = 0; j < KT; ++j) {
      const Vec v0 = load_as_float(v_rows[j] + d), v1 = load_as_float(v_rows[j] + d + kVec);
      #pragma GCC unroll 16
      for (int r = 0; r < N; ++r) {
        const Vec wr(w[r * ld + j]);
        acc[r][0] = at::vec::fmadd(wr, v0, acc[r][0]);
        acc[r][1] = at::vec::fmadd(wr, v1, acc[r][1]);
      }
    }
    #pragma GCC unroll 16
    for (int r = 0; r < N; ++r) {
      acc[r][0].store(out_rows[r] + d);
      acc[r][1].store(out_rows[r] + d + kVec);
    }
  }
  for (; d + kVec <= dim; d += kVec) {
    Vec acc[N];
    #pragma GCC unroll 16
    for (int r = 0; r < N; ++r) acc[r] = Vec::loadu(out_rows[r] + d);
    #pragma GCC unroll 16
    for (int j = 0; j < KT; ++j) {
      const Vec v = load_as_float(v_rows[j] + d);
      #pragma GCC unroll 16
      for (int r = 0; r < N; ++r) acc[r] = at::vec::fmadd(Vec(w[r * ld + j]), v, acc[r]);
    }
    #pragma GCC unroll 16
    for (int r = 0; r < N; ++r) acc[r].store(out_rows[r] + d);
  }
  for (; d < dim; ++d)
    for (int r = 0; r < N; ++r)
      for (int j = 0; j < KT; ++j) out_rows[r][d] += w[r * ld + j] * static_cast<float>(v_rows[j][d]);
}

// The K/V rows a pass reads after its last keys, for it to request as it ends: the same keys' V rows
// after the K pass, the next chunk's first K rows after the V pass (an item's chunks in turn).
struct Upcoming {
  const void* cache = nullptr;
  const int64_t* offsets = nullptr;  // element offsets of its first keys' rows (first kv head)
  int64_t keys = 0;                  // how many (up to kPrefetchAhead)
  int64_t kv_heads = 0;
};

// Head h's row of key a of a pass over keys [0, keys) of `cache`, past its last key `next`'s rows;
// nullptr past those too.
template <typename C>
inline const C* row_ahead(const C* cache, const int64_t* offsets, int64_t keys, const Upcoming& next, int64_t a,
                          int64_t h, int64_t head_stride) {
  if (a < keys) return cache + offsets[a] + h * head_stride;
  if (a - keys < next.keys && h < next.kv_heads)
    return static_cast<const C*>(next.cache) + next.offsets[a - keys] + h * head_stride;
  return nullptr;
}

// Each key's element offset in a cache for keys [lo, hi) of sequence seq (its first kv head
// kv_head), walking the block table once (no division per key).
inline void key_offsets(const Params& p, const int32_t* block_tables, int64_t seq, int64_t kv_head, int64_t lo,
                        int64_t hi, int64_t* offsets) {
  const int64_t row_stride = p.kv_heads * p.head_stride;  // between slots of one head
  const int32_t* table = block_tables + seq * p.max_blocks;
  for (int64_t t = lo; t < hi;) {
    const int64_t in_block = std::min(hi - t, p.block_size - t % p.block_size);
    const int64_t base =
        (static_cast<int64_t>(table[t / p.block_size]) * p.block_size + t % p.block_size) * row_stride +
        kv_head * p.head_stride;
    for (int64_t i = 0; i < in_block; ++i) offsets[t - lo + i] = base + i * row_stride;
    t += in_block;
  }
}

// The lane sums of N rows' dot products with one K row (dim a multiple of kVec; row r of q at
// q + r * dim): reduced by the caller, a dot product's bits the same as dot_tile's.
template <int N, typename K, int64_t kDim = 0>
inline void dot_lanes(const float* q, const K* k, int64_t runtime_dim, Vec* out) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim;
  Vec acc[N];
  #pragma GCC unroll 16
  for (int r = 0; r < N; ++r) acc[r] = Vec(0.f);
  for (int64_t d = 0; d < dim; d += kVec) {
    const Vec kv = load_as_float(k + d);
    #pragma GCC unroll 16
    for (int r = 0; r < N; ++r) acc[r] = at::vec::fmadd(Vec::loadu(q + r * dim + d), kv, acc[r]);
  }
  #pragma GCC unroll 16
  for (int r = 0; r < N; ++r) out[r] = acc[r];
}

// Makes v hold at least n elements. Never shrinks: the sizes change chunk by chunk, and a resize that
// grows fills every element it adds (a chunk's staged V rows: tens of KB a chunk, refilled each time).
template <typename V>
inline void grow(std::vector<V>& v, int64_t n) {
  if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n));
}

// Per-thread scratch, kept across work items.
struct Scratch {
  std::vector<float> floats;
  std::vector<int64_t> offsets;  // each visible key's element offset in the caches
  std::vector<const float*> q_rows;
  std::vector<float*> acc_rows;
  std::vector<float> row_sum, row_max;
  std::vector<float> partials;  // a tile's chunks done in one item (attend_item)
  std::vector<Vec> lanes;  // a key's unreduced dot products, one per row (dots_in_memory_order)
  std::vector<float> stage;  // its V rows, staged (as floats or bf16 pairs: raw bytes)
  std::vector<int64_t> stage_offsets;
  std::vector<float> keys_t;  // a chunk's K rows of one head transposed (keys_in_lanes_dots)
  std::vector<float> widened;  // rows widened to fp32 on the way
};

// A row of `bytes` copied, 32 at a time (a call per row is what a decode's few hundred bytes cost).
inline void copy_row(const void* src, void* dst, int64_t bytes) {
  const char* from = static_cast<const char*>(src);
  char* to = static_cast<char*>(dst);
  int64_t b = 0;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  for (; b + 32 <= bytes; b += 32)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + b), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + b)));
#endif
  if (b < bytes) std::memcpy(to + b, from + b, static_cast<size_t>(bytes - b));
}

// dst[d] = T(src[d] * scale) for d < dim, vectorised for fp32 and bf16 rows (the scalar
// conversion's roundings: an fp32 product, then to nearest even).
template <typename T>
inline void store_scaled_row(const float* src, float scale, T* dst, int64_t dim) {
  int64_t d = 0;
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    const Vec factor(scale);
    for (; d + kVec <= dim; d += kVec) store_as(Vec::loadu(src + d) * factor, dst + d);
  }
  for (; d < dim; ++d) dst[d] = static_cast<T>(src[d] * scale);
}

// dst[d] = float(src[d]) for d < dim (vectorised for fp32 and bf16 rows).
template <typename T>
inline void widen_row(const T* src, float* dst, int64_t dim) {
  int64_t d = 0;
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    for (; d + kVec <= dim; d += kVec) load_as_float(src + d).store(dst + d);
  }
  for (; d < dim; ++d) dst[d] = static_cast<float>(src[d]);
}

// The in-order pass below requests each K and V slot row kPrefetchAhead keys ahead: its first line
// (AVX2: the hardware prefetchers fetch the rest, and requesting every line was slower), or its
// first 6 lines (AVX-512 builds: faster over bf16 caches' 384-byte slot rows, and no slower than
// all 12 lines over fp32 caches' 768-byte rows). `python bench/paged_attention_decode.py` measures
// both.
#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kRequestSlotRowLines = true;
#else
constexpr bool kRequestSlotRowLines = false;
#endif

inline void request_slot_row(const void* row, int64_t bytes) {
  const char* first = static_cast<const char*>(row);
  bytes = kRequestSlotRowLines ? std::min<int64_t>(bytes, 6 * 64) : 1;
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(first + b);
}

// A decode item of several kv heads reads its K and V rows here, in memory order: one key's slot
// row (all the item's heads), then the next key's. Tiles of 4 keys of one head at a time read three
// heads' rows back and forth, which the hardware prefetchers did not follow: read in order, batched
// decodes over K/V not in cache read it at a higher rate (`python bench/paged_attention_decode.py`).
// This pass computes the raw dot products (each key's lane sums reduced four rows at a time: hsum4
// gives the bits of one at a time, as dot_tile) and copies the V rows into `stage`
// [kv head][key][dim], from where the weighted sums run in tiles of keys, in cache. The slot rows
// kPrefetchAhead keys later are requested (request_slot_row: their first line, or first 6 on
// AVX-512), past the last key `next`'s.
template <typename C, int64_t kDim = 0>
void dots_in_memory_order(const C* k_cache, const C* v_cache, const int64_t* offsets, int64_t keys, int64_t kv_heads,
                          int64_t head_rows, int64_t head_stride, int64_t runtime_dim, const float* q, float* scores,
                          C* stage, const Upcoming& next, std::vector<Vec>& lanes) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim;
  const int64_t rows = kv_heads * head_rows;
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(C));
  const int64_t slot_bytes = kv_heads * head_stride * static_cast<int64_t>(sizeof(C));
  grow(lanes, rows);
  Vec* lane = lanes.data();
  for (int64_t j = 0; j < keys; ++j) {
    const int64_t a = j + kPrefetchAhead;
    if (a < keys) request_slot_row(v_cache + offsets[a], slot_bytes);
    if (const C* row = row_ahead(k_cache, offsets, keys, next, a, 0, head_stride)) request_slot_row(row, slot_bytes);
    const C* key = k_cache + offsets[j];
    const C* value = v_cache + offsets[j];
    for (int64_t h = 0; h < kv_heads; ++h) copy_row(value + h * head_stride, stage + (h * keys + j) * dim, row_bytes);
    for (int64_t h = 0; h < kv_heads; ++h)
      for_tile_rows(head_rows, [&](auto count, int64_t r) {
        r += h * head_rows;
        dot_lanes<decltype(count)::value, C, kDim>(q + r * dim, key + h * head_stride, dim, lane + r);
      });
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
      float sums[4];
      hsum4(lane[r], lane[r + 1], lane[r + 2], lane[r + 3], sums);
      for (int i = 0; i < 4; ++i) scores[(r + i) * keys + j] = sums[i];
    }
    for (; r < rows; ++r) scores[r * keys + j] = hsum_pairwise(lane[r]);
  }
}

// The rows the tiles read from a cache of C: fp32 and bf16 rows in place (bf16 widened as it is
// loaded, no pass through scratch, which is faster for batched decodes over a bf16 cache: `python
// bench/paged_attention_decode.py`), others as fp32 rows converted into scratch.
template <typename C>
using RowOf = std::conditional_t<std::is_same_v<C, float> || std::is_same_v<C, at::BFloat16>, C, float>;

// Rows [first, first + count) of a cache as row pointers of RowOf<C>: in place, or converted into
// `converted` (count * dim floats).
template <typename C>
inline void cache_rows(const C* cache, const int64_t* offsets, int64_t count, int64_t dim, float* converted,
                       const RowOf<C>** rows) {
  for (int64_t j = 0; j < count; ++j) {
    if constexpr (std::is_same_v<RowOf<C>, C>) {
      rows[j] = cache + offsets[j];
    } else {
      rows[j] = as_float<C>(cache + offsets[j], converted + j * dim, dim);
    }
  }
}

// Calls fn(rows, j, n, h, ahead) for tiles [j, j + n) of Tile keys and each kv head h of the item,
// `rows` the n keys' rows of head h (see cache_rows), `ahead` the rows of head h kPrefetchAhead keys
// later, past the last key those of `next`, for fn to request as it reads `rows` (nullptr: none left,
// or `request` false: rows in cache already).
template <int Tile, typename C, typename Fn>
inline void for_key_tiles(const C* cache, const int64_t* offsets, int64_t keys, int64_t heads, int64_t dim,
                          int64_t head_stride, float* converted, const Upcoming& next, Fn&& fn, bool request = true) {
  const RowOf<C>* rows[Tile];
  const char* ahead[Tile];
  for (int64_t j = 0; j < keys; j += Tile) {
    const int64_t n = std::min<int64_t>(Tile, keys - j);
    const bool prefetch = request && j + kPrefetchAhead < keys + next.keys;
    for (int64_t h = 0; h < heads; ++h) {
      if (prefetch)
        for (int64_t i = 0; i < Tile; ++i) {
          const C* row = row_ahead(cache, offsets, keys, next, j + kPrefetchAhead + i, h, head_stride);
          // (none: a row read now, requested again)
          ahead[i] = reinterpret_cast<const char*>(row != nullptr ? row : cache + offsets[j] + h * head_stride);
        }
      cache_rows<C>(cache + h * head_stride, offsets + j, n, dim, converted, rows);
      fn(static_cast<const RowOf<C>* const*>(rows), j, n, h, prefetch ? static_cast<const char* const*>(ahead) : nullptr);
    }
  }
}

// Calls fn(N, width, r, i) for the query row groups of kv head h (rows r = h * head_rows + ..., N at
// a time, as std::integral_constant) over a tile of n keys: once with width = Tile when the tile is
// full, else once per key i with width 1. N and width are compile-time, so the callee's register
// tiles are sized at compile time.
template <int Tile, typename Fn>
inline void for_row_groups_of_tile(int64_t head_rows, int64_t h, int64_t n, Fn&& fn) {
  for_tile_rows(head_rows, [&](auto count, int64_t r) {
    r += h * head_rows;
    if (n == Tile) {
      fn(count, std::integral_constant<int, Tile>{}, r, int64_t{0});
    } else {
      for (int64_t i = 0; i < n; ++i) fn(count, std::integral_constant<int, 1>{}, r, i);
    }
  });
}

// Tiles of many query rows (prefill chunks, verification passes) take the two passes below instead of
// dot_tile and weighted_sum_tile: the same fused multiply-adds in the same order, so every score and
// output keeps its bits (a query's result does not depend on the tile it is computed in), with fewer
// instructions around them. Scores run with the keys in the vector lanes, over the chunk's K rows
// transposed once per tile: no horizontal sum per dot product. The weighted V rows keep a group of
// rows' accumulators in registers across all the chunk's keys instead of loading and storing them
// every 8 keys. `tokenmill bench offline --long-prompts` measures the prefill they speed up.
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
constexpr bool kTileKernels = true;
#else
constexpr bool kTileKernels = false;
#endif
// Rows per kv head from which a tile takes them: below, transposing the chunk's keys costs more than
// it saves.
constexpr int64_t kTileKernelRows = 8;
// Query rows sharing each transposed key vector (5 live vectors per row: the lane sums as they fold).
constexpr int kLaneRows = 4;
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kValueRows = 4;  // x 4 vectors of output: 16 accumulators of the 32 registers
#else
constexpr int kValueRows = 2;  // x 4 vectors: 8 of the 16 registers
#endif
constexpr int kValueVecs = 4;

// Row j of a cache widened into dst (fp32): as load_as_float reads fp32 and bf16, as as_float the rest.
template <typename C>
inline void widen_cache_row(const C* row, float* dst, int64_t dim) {
  if constexpr (std::is_same_v<C, float> || std::is_same_v<C, at::BFloat16>) {
    widen_row(row, dst, dim);
  } else {
    as_float<C>(row, dst, dim);
  }
}

// keys_t[d * ldk + j] = element d of key j's row (head h) for j < keys, 0 up to ldk (a multiple of kVec).
// slot_stride: elements from one slot's row to the next's.
template <typename C>
void transpose_keys(const C* k_cache, const int64_t* offsets, int64_t keys, int64_t h, int64_t head_stride,
                    int64_t slot_stride, int64_t dim, int64_t ldk, float* keys_t, float* block) {
  for (int64_t j0 = 0; j0 < ldk; j0 += kVec) {
    if constexpr (std::is_same_v<C, float>) {
      // kVec keys in neighbouring slots (of one block): transposed where they are, no copy.
      bool neighbours = j0 + kVec <= keys;
      for (int64_t i = 1; neighbours && i < kVec; ++i) neighbours = offsets[j0 + i] == offsets[j0] + i * slot_stride;
      if (neighbours) {
        const float* first = k_cache + offsets[j0] + h * head_stride;
        for (int64_t d = 0; d < dim; d += kVec)
          at::vec::transpose_mxn<float, kVec, kVec>(first + d, slot_stride, keys_t + d * ldk + j0, ldk);
        continue;
      }
    }
    for (int64_t i = 0; i < kVec; ++i) {
      if (j0 + i < keys) {
        widen_cache_row(k_cache + offsets[j0 + i] + h * head_stride, block + i * dim, dim);
      } else {
        std::fill(block + i * dim, block + (i + 1) * dim, 0.f);
      }
    }
    for (int64_t d = 0; d < dim; d += kVec)
      at::vec::transpose_mxn<float, kVec, kVec>(block + d, dim, keys_t + d * ldk + j0, ldk);
  }
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// Lane l of dot_tile's accumulators for N rows, as vectors over kVec keys: the products of elements
// l, l + kVec, ... fused in order. (Always inlined: the vectors stay in registers.)
template <int N, int64_t kBlocks>
__attribute__((always_inline)) inline void lane_products(const float* const* q_rows, const float* keys_t, int64_t ldk,
                                                         int64_t runtime_blocks, int64_t l, Vec* x) {
  const int64_t blocks = kBlocks > 0 ? kBlocks : runtime_blocks;
  #pragma GCC unroll 8
  for (int r = 0; r < N; ++r) x[r] = Vec(0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t d = b * kVec + l;
    const Vec k = Vec::loadu(keys_t + d * ldk);
    #pragma GCC unroll 8
    for (int r = 0; r < N; ++r) x[r] = at::vec::fmadd(Vec(q_rows[r][d]), k, x[r]);
  }
}

// y_l of hsum4's tree: lane l, plus lane l + 8 on AVX-512 (eight_lanes).
template <int N, int64_t kBlocks>
__attribute__((always_inline)) inline void folded_lane(const float* const* q_rows, const float* keys_t, int64_t ldk,
                                                       int64_t blocks, int64_t l, Vec* y) {
  lane_products<N, kBlocks>(q_rows, keys_t, ldk, blocks, l, y);
#if defined(CPU_CAPABILITY_AVX512)
  Vec high[N];
  lane_products<N, kBlocks>(q_rows, keys_t, ldk, blocks, l + 8, high);
  #pragma GCC unroll 8
  for (int r = 0; r < N; ++r) y[r] = y[r] + high[r];
#endif
}

// (y_l + y_l+1) + (y_l+2 + y_l+3) for N rows: a quarter of hsum4's tree.
template <int N, int64_t kBlocks>
__attribute__((always_inline)) inline void four_lanes(const float* const* q_rows, const float* keys_t, int64_t ldk,
                                                      int64_t blocks, int64_t l, Vec* sum) {
  Vec a[N], b[N];
  folded_lane<N, kBlocks>(q_rows, keys_t, ldk, blocks, l, a);
  folded_lane<N, kBlocks>(q_rows, keys_t, ldk, blocks, l + 1, b);
  #pragma GCC unroll 8
  for (int r = 0; r < N; ++r) sum[r] = a[r] + b[r];
  folded_lane<N, kBlocks>(q_rows, keys_t, ldk, blocks, l + 2, a);
  folded_lane<N, kBlocks>(q_rows, keys_t, ldk, blocks, l + 3, b);
  #pragma GCC unroll 8
  for (int r = 0; r < N; ++r) sum[r] = sum[r] + (a[r] + b[r]);
}

// out[r * ld + j] = q_rows[r] . key j for N rows and the kVec keys at keys_t (transposed, leading
// dimension ldk), `count` of them stored: dot_tile's bits, its lanes summed in hsum4's order,
// ((y0 + y1) + (y2 + y3)) + ((y4 + y5) + (y6 + y7)). kBlocks: dim / kVec at compile time, or 0.
template <int N, int64_t kBlocks = 0>
inline void keys_in_lanes_dots(const float* const* q_rows, const float* keys_t, int64_t ldk, int64_t dim, float* out,
                               int64_t ld, int64_t count) {
  const int64_t blocks = dim / kVec;
  Vec left[N], right[N];
  four_lanes<N, kBlocks>(q_rows, keys_t, ldk, blocks, 0, left);
  four_lanes<N, kBlocks>(q_rows, keys_t, ldk, blocks, 4, right);
  #pragma GCC unroll 8
  for (int r = 0; r < N; ++r) (left[r] + right[r]).store(out + r * ld, static_cast<int>(count));
}
#endif

// acc_rows[r][d0 + ...] += w[r * ld + j] * (row j)[d0 + ...] for N rows, V vectors of output and
// every key j < keys in order, row j at values + offsets[j]: weighted_sum_tile's fused multiply-adds
// in its order, the accumulators in registers throughout.
template <int N, int V, typename R>
inline void keys_in_registers_values(const float* w, int64_t ld, const R* values, const int64_t* offsets,
                                     int64_t keys, int64_t d0, float* const* acc_rows) {
  Vec acc[N][V];
  #pragma GCC unroll 8
  for (int r = 0; r < N; ++r)
    #pragma GCC unroll 8
    for (int i = 0; i < V; ++i) acc[r][i] = Vec::loadu(acc_rows[r] + d0 + i * kVec);
  for (int64_t j = 0; j < keys; ++j) {
    Vec v[V];
    #pragma GCC unroll 8
    for (int i = 0; i < V; ++i) v[i] = load_as_float(values + offsets[j] + d0 + i * kVec);
    #pragma GCC unroll 8
    for (int r = 0; r < N; ++r) {
      const Vec wr(w[r * ld + j]);
      #pragma GCC unroll 8
      for (int i = 0; i < V; ++i) acc[r][i] = at::vec::fmadd(wr, v[i], acc[r][i]);
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < N; ++r)
    #pragma GCC unroll 8
    for (int i = 0; i < V; ++i) acc[r][i].store(acc_rows[r] + d0 + i * kVec);
}

// Calls fn(std::integral_constant<int, V>) with V = n (1..kValueVecs).
template <typename Fn>
inline void with_value_vecs(int64_t n, Fn&& fn) {
  switch (n) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    default: fn(std::integral_constant<int, kValueVecs>{}); break;
  }
}

// T: the dtype of q and out (the model's); C: the cache's (the same, or a narrower --kv-cache-dtype).
// Keys [item.key_lo, item.key_hi), within one chunk, for the item's rows: normalised into out, or,
// with `partial`, that chunk's partial softmax (see partial_floats).
template <typename T, typename C>
void attend_chunk(const WorkItem& item, const T* q, const C* k_cache, const C* v_cache, T* out, float* partial,
                  const int32_t* query_start, const int32_t* query_lens, const int32_t* block_tables,
                  const int32_t* context_lens, const Params& p, Scratch& scratch, const Upcoming& next) {
  // (An item of all kv heads reads each slot row of K/V as one stretch.)
  const ItemRows map(item, p);
  const int64_t head_rows = map.head_rows, rows = map.rows;
  const int64_t ctx = context_lens[item.seq];
  const int64_t first_pos = ctx - query_lens[item.seq] + item.first_query;
  const int64_t first_row = query_start[item.seq] + item.first_query;
  const int64_t key_lo = item.key_lo, key_hi = item.key_hi, keys = key_hi - key_lo;
  const int64_t dim = p.dim;

  grow(scratch.offsets, keys);
  int64_t* offsets = scratch.offsets.data();
  key_offsets(p, block_tables, item.seq, item.kv_head, key_lo, key_hi, offsets);

  // Floats: q rows, accumulators, converted K/V rows of one tile, then scores [rows, keys].
  constexpr int64_t tile = kKeyTile > kValueTile ? kKeyTile : kValueTile;  // (keys converted at once)
  grow(scratch.floats, 2 * rows * dim + tile * dim + rows * keys);
  float* q_f = scratch.floats.data();
  float* acc = q_f + rows * dim;
  float* converted = acc + rows * dim;
  float* scores = converted + tile * dim;
  std::vector<const float*>& q_rows = scratch.q_rows;
  std::vector<float*>& acc_rows = scratch.acc_rows;
  grow(q_rows, rows);
  grow(acc_rows, rows);
  for (int64_t r = 0; r < rows; ++r) {
    widen_row(q + map.offset(r, first_row), q_f + r * dim, dim);
    q_rows[r] = q_f + r * dim;
    acc_rows[r] = acc + r * dim;
  }
  std::fill(acc, acc + rows * dim, 0.f);

  // Raw dot products: a decode item of several kv heads in memory order, its V rows staged on the
  // way (dots_in_memory_order); else a tile of keys at a time, every query row group of a kv head
  // sharing the tile's K rows of that head.
  C* staged = nullptr;
  if constexpr (std::is_same_v<RowOf<C>, C>) {
    if (item.num_queries == 1 && item.num_kv_heads > 1 && dim % kVec == 0) {
      grow(scratch.stage, (keys * item.num_kv_heads * dim * sizeof(C) + 3) / 4);
      staged = reinterpret_cast<C*>(scratch.stage.data());
      // (head_dim 64 and 128 at compile time: the loops over a row unrolled, a little faster)
      auto in_order = [&](auto head_dim) {
        dots_in_memory_order<C, decltype(head_dim)::value>(k_cache, v_cache, offsets, keys, item.num_kv_heads,
                                                           head_rows, p.head_stride, dim, q_f, scores, staged, next,
                                                           scratch.lanes);
      };
      if (dim == 64)
        in_order(std::integral_constant<int64_t, 64>{});
      else if (dim == 128)
        in_order(std::integral_constant<int64_t, 128>{});
      else
        in_order(std::integral_constant<int64_t, 0>{});
    }
  }
  // (dim a whole number of vectors: dot_tile's scalar tail has no counterpart here)
  const bool tile_kernels = kTileKernels && staged == nullptr && head_rows >= kTileKernelRows && dim % kVec == 0;
  if (tile_kernels) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
    const int64_t ldk = (keys + kVec - 1) / kVec * kVec;
    grow(scratch.keys_t, dim * ldk);
    grow(scratch.widened, kVec * dim);
    for (int64_t h = 0; h < item.num_kv_heads; ++h) {
      transpose_keys(k_cache, offsets, keys, h, p.head_stride, p.kv_heads * p.head_stride, dim, ldk,
                     scratch.keys_t.data(), scratch.widened.data());
      for_row_groups<kLaneRows>(head_rows, [&](auto count, int64_t r) {
        r += h * head_rows;
        auto dots = [&](auto blocks) {
          for (int64_t j = 0; j < keys; j += kVec)
            keys_in_lanes_dots<decltype(count)::value, decltype(blocks)::value>(
                q_rows.data() + r, scratch.keys_t.data() + j, ldk, dim, scores + r * keys + j, keys,
                std::min(kVec, keys - j));
        };
        if (dim == 4 * kVec)
          dots(std::integral_constant<int64_t, 4>{});
        else if (dim == 8 * kVec)
          dots(std::integral_constant<int64_t, 8>{});
        else
          dots(std::integral_constant<int64_t, 0>{});
      });
    }
#endif
  } else if (staged == nullptr) {
    const Upcoming values{v_cache, offsets, std::min(keys, kPrefetchAhead), item.num_kv_heads};
    for_key_tiles<kKeyTile>(k_cache, offsets, keys, item.num_kv_heads, dim, p.head_stride, converted, values,
                            [&](auto k_rows, int64_t j, int64_t n, int64_t h, const char* const* ahead) {
      for_row_groups_of_tile<kKeyTile>(head_rows, h, n, [&](auto count, auto width, int64_t r, int64_t i) {
        dot_tile<decltype(count)::value, decltype(width)::value>(q_rows.data() + r, k_rows + i, dim,
                                                                 scores + r * keys + j + i, keys,
                                                                 r == h * head_rows ? ahead : nullptr, sizeof(C));
      });
    });
  }
  // Per row: scale, optional softcap tanh, mask (the row's visible keys are one range), max,
  // then exp(s - max) and the sum, vectorised over keys.
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float>& row_sum = scratch.row_sum;
  std::vector<float>& row_max = scratch.row_max;
  grow(row_sum, rows);
  grow(row_max, rows);
  for (int64_t r = 0; r < rows; ++r) {
    float* srow = scores + r * keys;
    const int64_t pos = first_pos + map.query_of(r);
    const int64_t visible_lo = (p.window > 0 ? std::max<int64_t>(key_lo, pos - p.window + 1) : key_lo) - key_lo;
    const int64_t visible_hi = std::min(pos + 1, key_hi) - key_lo;
    if (visible_hi <= visible_lo) {  // (a chunk this row sees none of: weights 0, max -inf)
      std::fill(srow, srow + keys, 0.f);
      row_max[r] = neg_inf;
      row_sum[r] = 0.f;
      continue;
    }
    std::fill(srow, srow + visible_lo, neg_inf);
    std::fill(srow + visible_hi, srow + keys, neg_inf);
    float max = neg_inf;
    int64_t j = visible_lo;
    if (p.softcap <= 0.f) {
      const Vec scale(p.scale);
      Vec max_v(neg_inf);
      for (; j + kVec <= visible_hi; j += kVec) {
        const Vec s = Vec::loadu(srow + j) * scale;
        s.store(srow + j);
        max_v = at::vec::maximum(max_v, s);
      }
      max = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, max_v);
    }
    for (; j < visible_hi; ++j) {
      float s = srow[j] * p.scale;
      if (p.softcap > 0.f) s = std::tanh(s / p.softcap) * p.softcap;
      srow[j] = s;
      max = std::max(max, s);
    }
    // Every key's weight from the vectorised exp, and summed in lane j % kVec of its place j in the
    // chunk (a last part-vector as a whole one, its lanes past `keys` -inf: weight 0): a query's bits
    // do not depend on how many keys its tile reads past its own (later queries of a prefill tile or
    // a verification pass, against the same query decoded alone). (A scalar tail here took another
    // exp for the last keys: a decode and a chunk disagreed in fp32.)
    const Vec m(max);
    Vec sum_v(0.f);
    for (j = 0; j < keys; j += kVec) {
      const int64_t count = std::min<int64_t>(kVec, keys - j);
      const Vec s = count == kVec ? Vec::loadu(srow + j) : Vec::set(Vec(neg_inf), Vec::loadu(srow + j, count), count);
      const Vec e = (s - m).exp_u20();
      e.store(srow + j, static_cast<int>(count));
      sum_v = sum_v + e;
    }
    row_sum[r] = hsum(sum_v);
    row_max[r] = max;
  }
  // Weighted V rows, a tile of keys at a time: from the cache, requesting the rows ahead, or from
  // the staged rows (in cache already; head h's row of key j at staged + (h * keys + j) * dim).
  const C* v_rows = v_cache;
  const int64_t* v_offsets = offsets;
  int64_t v_head_stride = p.head_stride;
  if (staged != nullptr) {
    grow(scratch.stage_offsets, keys);
    for (int64_t j = 0; j < keys; ++j) scratch.stage_offsets[j] = j * dim;
    v_rows = staged;
    v_offsets = scratch.stage_offsets.data();
    v_head_stride = keys * dim;
  }
  if (tile_kernels) {
    for (int64_t h = 0; h < item.num_kv_heads; ++h) {
      auto weigh = [&](const auto* values, const int64_t* row_offsets) {
        for_row_groups<kValueRows>(head_rows, [&](auto count, int64_t r) {
          r += h * head_rows;
          for (int64_t d = 0; d < dim; d += kValueVecs * kVec)
            with_value_vecs((dim - d) / kVec, [&](auto vecs) {
              keys_in_registers_values<decltype(count)::value, decltype(vecs)::value>(
                  scores + r * keys, keys, values, row_offsets, keys, d, acc_rows.data() + r);
            });
        });
      };
      if constexpr (std::is_same_v<RowOf<C>, C>) {
        weigh(v_cache + h * p.head_stride, offsets);  // (in place)
      } else {
        grow(scratch.widened, keys * dim);
        grow(scratch.stage_offsets, keys);
        for (int64_t j = 0; j < keys; ++j) {
          widen_cache_row(v_cache + offsets[j] + h * p.head_stride, scratch.widened.data() + j * dim, dim);
          scratch.stage_offsets[j] = j * dim;
        }
        weigh(static_cast<const float*>(scratch.widened.data()), scratch.stage_offsets.data());
      }
    }
  } else {
  for_key_tiles<kValueTile>(v_rows, v_offsets, keys, item.num_kv_heads, dim, v_head_stride, converted, next,
                            [&](auto rows_of_tile, int64_t j, int64_t n, int64_t h, const char* const* ahead) {
    for_row_groups_of_tile<kValueTile>(head_rows, h, n, [&](auto count, auto width, int64_t r, int64_t i) {
      weighted_sum_tile<decltype(count)::value, decltype(width)::value>(scores + r * keys + j + i, keys,
                                                                        rows_of_tile + i, dim, acc_rows.data() + r,
                                                                        r == h * head_rows ? ahead : nullptr, sizeof(C));
    });
  }, staged == nullptr);
  }
  if (partial != nullptr) {  // one chunk of several: merged by merge_chunks
    std::copy(acc, acc + rows * dim, partial);
    std::copy(row_max.begin(), row_max.begin() + rows, partial + rows * dim);
    std::copy(row_sum.begin(), row_sum.begin() + rows, partial + rows * dim + rows);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    store_scaled_row(acc_rows[r], 1.f / row_sum[r], out + map.offset(r, first_row), dim);
  }
}

// The partials of a tile's chunks (`base`, one after another in chunk order) merged into out: each
// chunk's accumulators and sum rescaled by exp(its max - the rows' max). `first`: the tile's item.
template <typename T>
void merge_chunks(const WorkItem& first, int64_t chunks, const float* base, T* out, const int32_t* query_start,
                  const Params& p) {
  const ItemRows map(first, p);
  const int64_t dim = p.dim, rows = map.rows;
  const int64_t stride = partial_floats(rows, dim);
  std::vector<float> row(static_cast<size_t>(dim));
  for (int64_t r = 0; r < rows; ++r) {
    float max = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < chunks; ++c) max = std::max(max, base[c * stride + rows * dim + r]);
    float sum = 0.f;
    std::fill(row.begin(), row.end(), 0.f);
    for (int64_t c = 0; c < chunks; ++c) {
      const float* part = base + c * stride;
      const float chunk_max = part[rows * dim + r];
      const float w = chunk_max == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(chunk_max - max);
      sum += w * part[rows * dim + rows + r];
      for (int64_t d = 0; d < dim; ++d) row[d] += w * part[r * dim + d];
    }
    store_scaled_row(row.data(), 1.f / sum, out + map.offset(r, query_start[first.seq] + first.first_query), dim);
  }
}

inline int64_t chunks_in(int64_t key_lo, int64_t key_hi) {
  return key_hi / kKeyChunk - key_lo / kKeyChunk + (key_hi % kKeyChunk != 0);
}

// One work item: a chunk of a split tile (its partial to `partials`), a tile of one chunk, or a
// tile over several chunks done here one chunk after another, each exactly as a split tile's chunk
// item computes it and merged the same way (so splitting or not never changes a bit). A chunk's last
// keys request the next chunk's first K rows.
template <typename T, typename C>
void attend_item(const WorkItem& item, const T* q, const C* k_cache, const C* v_cache, T* out, float* partials,
                 const int32_t* query_start, const int32_t* query_lens, const int32_t* block_tables,
                 const int32_t* context_lens, const Params& p, Scratch& scratch) {
  auto chunk = [&](const WorkItem& part, float* partial, const Upcoming& after) {
    attend_chunk<T, C>(part, q, k_cache, v_cache, out, partial, query_start, query_lens, block_tables, context_lens,
                       p, scratch, after);
  };
  const int64_t chunks = chunks_in(item.key_lo, item.key_hi);
  if (item.partial >= 0 || chunks == 1) {
    chunk(item, item.partial >= 0 ? partials + item.partial : nullptr, Upcoming{});
    return;
  }
  const int64_t stride = partial_floats(ItemRows(item, p).rows, p.dim);
  grow(scratch.partials, chunks * stride);
  WorkItem part = item;
  int64_t c = 0;
  int64_t chunk_next[kPrefetchAhead];
  for_key_chunks(item.key_lo, item.key_hi, [&](int64_t lo, int64_t hi) {
    part.key_lo = lo;
    part.key_hi = hi;
    Upcoming after;
    if (hi < item.key_hi) {  // the next chunk's first K rows
      after = {k_cache, chunk_next, std::min(kPrefetchAhead, item.key_hi - hi), item.num_kv_heads};
      key_offsets(p, block_tables, item.seq, item.kv_head, hi, hi + after.keys, chunk_next);
    }
    chunk(part, scratch.partials.data() + c++ * stride, after);
  });
  merge_chunks<T>(item, chunks, scratch.partials.data(), out, query_start, p);
}

void check_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& out,
                  const at::Tensor& query_start, const at::Tensor& query_lens, const at::Tensor& block_tables,
                  const at::Tensor& context_lens) {
  TORCH_CHECK(q.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q [T, H, D], caches [slots, Hkv, D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(),
              "paged_attention: contiguous q, caches and out");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k and v caches differ in shape");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and out share one dtype, the k and v caches another");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() || k_cache.scalar_type() == at::kChar ||
                  (q.scalar_type() == at::kFloat &&
                   (k_cache.scalar_type() == at::kBFloat16 || k_cache.scalar_type() == at::kHalf)),
              "caches in q's dtype, int8 caches, or bf16/fp16 caches for fp32 queries");
  const int64_t scale_bytes = k_cache.scalar_type() == at::kChar ? 4 : 0;  // an int8 row's fp32 scale
  TORCH_CHECK(k_cache.size(2) == q.size(2) + scale_bytes, "cache rows must be head_dim wide",
              scale_bytes ? " + 4 (int8 values and their fp32 scale)" : "");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must be shaped like q");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables: int32 [seqs, max_blocks]");
  const int64_t seqs = block_tables.size(0);
  for (const at::Tensor* t : {&query_start, &query_lens, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->numel() == seqs,
                "query_start, query_lens, context_lens: int32 [seqs]");
}

}  // namespace

// A call's work items and merges (kernels.h): everything but the layer's q, caches, out, scale and
// softcap, so one plan serves every layer of a step that shares its window.
struct AttentionWork {
  Params p;  // (scale and softcap: each call's own)
  at::ScalarType q_type, cache_type;
  std::vector<int32_t> starts, lens, ctx, tables;  // copies: the plan outlives no tensor it came from
  std::vector<WorkItem> items;
  std::vector<int64_t> order;  // the items by cost, largest first; `items` keeps chunk order
  std::vector<std::pair<int64_t, int64_t>> merges;  // (first chunk's item index, chunks) per split tile
  int64_t partial_size = 0;
};

std::shared_ptr<const AttentionWork> plan_paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                          const at::Tensor& v_cache, const at::Tensor& out,
                                                          const at::Tensor& query_start, const at::Tensor& query_lens,
                                                          const at::Tensor& block_tables,
                                                          const at::Tensor& context_lens, int64_t block_size,
                                                          int64_t window, int64_t threads) {
  check_inputs(q, k_cache, v_cache, out, query_start, query_lens, block_tables, context_lens);
  auto work = std::make_shared<AttentionWork>();
  work->p = Params{q.size(1), k_cache.size(1), q.size(2), block_size, block_tables.size(1), window, k_cache.size(2),
                   0.f, 0.f};
  const Params& p = work->p;
  work->q_type = q.scalar_type();
  work->cache_type = k_cache.scalar_type();
  const int64_t seqs = block_tables.size(0);
  const int64_t tokens = q.size(0);
  auto copy = [](const at::Tensor& t) {
    const int32_t* data = t.data_ptr<int32_t>();
    return std::vector<int32_t>(data, data + t.numel());
  };
  work->starts = copy(query_start);
  work->lens = copy(query_lens);
  work->ctx = copy(context_lens);
  work->tables = copy(block_tables);
  const int32_t* starts = work->starts.data();
  const int32_t* lens = work->lens.data();
  const int32_t* ctx = work->ctx.data();
  const int32_t* tables = work->tables.data();
  TORCH_CHECK(block_size > 0 && k_cache.size(0) % block_size == 0, "cache slots are whole blocks");
  const int64_t num_blocks = k_cache.size(0) / block_size;
  auto tile_keys = [&](int64_t s, int64_t first, int64_t n) {  // [lo, hi): the keys a tile's queries can see
    const int64_t first_pos = ctx[s] - lens[s] + first, hi = first_pos + n;
    // (a window's first key rounded down to a whole vector: each key keeps its lane of the softmax sum
    // whichever query of a tile starts it, see attend_chunk; the keys before the window are masked)
    const int64_t lo = p.window > 0 ? std::max<int64_t>(0, first_pos - p.window + 1) / kVec * kVec : 0;
    return std::pair<int64_t, int64_t>{lo, hi};
  };
  // Tiles are split into an item per chunk only when there are too few tiles to share among the
  // threads (a batch-1 decode); else each item does its tile's chunks in turn (no partials kept
  // between items: a long prefill's would be tens of MB a layer). Same bits either way.
  int64_t tiles = 0, units = 0;
  for (int64_t s = 0; s < seqs; ++s)
    for (int64_t first = 0; first < lens[s]; first += query_tile(lens[s]), ++tiles) {
      const auto keys = tile_keys(s, first, std::min<int64_t>(query_tile(lens[s]), lens[s] - first));
      units += chunks_in(keys.first, keys.second);
    }
  const bool split = tiles < 4 * threads;
  // Items of all kv heads (each K/V slot row read as one stretch: a block's rows are one run of
  // memory) when there are items enough for every thread: split chunks, one per thread already, or
  // 4 tiles per thread; else one kv head per item. Rows of one head alone (a third of each slot row
  // on SmolLM2) come from DRAM at a fraction of the rate whole rows do, so small-batch decodes over
  // long contexts run faster this way (`python bench/paged_attention_decode.py --sequences 1`); a
  // context of one chunk keeps one head per item.
  const bool whole_rows = split ? units >= threads : tiles >= 4 * threads;
  const int64_t heads_per_item = whole_rows ? p.kv_heads : 1;
  std::vector<WorkItem>& items = work->items;
  for (int64_t s = 0; s < seqs; ++s) {
    TORCH_CHECK(lens[s] >= 0 && lens[s] <= ctx[s], "each sequence's queries are the last of its context");
    TORCH_CHECK(starts[s] >= 0 && starts[s] + lens[s] <= tokens, "query rows out of range");
    const int64_t used_blocks = (ctx[s] + block_size - 1) / block_size;
    TORCH_CHECK(used_blocks <= p.max_blocks, "context longer than its block table");
    for (int64_t b = 0; b < used_blocks; ++b) {
      const int32_t block = tables[s * p.max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block table entry ", block, " is outside the cache's ",
                  num_blocks, " blocks");
    }
    for (int64_t first = 0; first < lens[s]; first += query_tile(lens[s])) {
      const int64_t n = std::min<int64_t>(query_tile(lens[s]), lens[s] - first);
      const auto keys = tile_keys(s, first, n);
      const int64_t chunks = chunks_in(keys.first, keys.second);
      for (int64_t h = 0; h < p.kv_heads; h += heads_per_item) {
        const WorkItem tile{s, h, heads_per_item, first, n, keys.first, keys.second, -1,
                            heads_per_item * n * (keys.second - keys.first)};
        if (chunks == 1 || !split) {
          items.push_back(tile);
          continue;
        }
        work->merges.emplace_back(static_cast<int64_t>(items.size()), chunks);
        const int64_t stride = partial_floats(ItemRows(tile, p).rows, p.dim);
        for_key_chunks(keys.first, keys.second, [&](int64_t lo, int64_t hi) {
          items.push_back({s, h, heads_per_item, first, n, lo, hi, work->partial_size, heads_per_item * n * (hi - lo)});
          work->partial_size += stride;
        });
      }
    }
  }
  work->order.resize(items.size());
  for (size_t i = 0; i < items.size(); ++i) work->order[i] = static_cast<int64_t>(i);
  std::stable_sort(work->order.begin(), work->order.end(),
                   [&](int64_t a, int64_t b) { return items[a].cost > items[b].cost; });
  return work;
}

int64_t attention_items(const AttentionWork& work) { return static_cast<int64_t>(work.items.size()); }
int64_t attention_merges(const AttentionWork& work) { return static_cast<int64_t>(work.merges.size()); }
int64_t attention_partial_floats(const AttentionWork& work) { return work.partial_size; }

namespace {

// Calls run(T{}, C{}) for the plan's q and cache element types.
template <typename Run>
void dispatch_types(const AttentionWork& work, Run&& run) {
  if (work.cache_type == at::kBFloat16 && work.q_type == at::kFloat) {
    run(float{}, at::BFloat16{});  // fp32 compute over a bf16 --kv-cache-dtype: half the bytes read
  } else if (work.cache_type == at::kHalf && work.q_type == at::kFloat) {
    run(float{}, at::Half{});
  } else if (work.cache_type == at::kChar) {  // --kv-cache-dtype int8, under any model dtype
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, work.q_type, "tokenmill_paged_attention_int8",
                                    [&] { run(scalar_t{}, int8_t{}); });
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, work.q_type, "tokenmill_paged_attention",
                                    [&] { run(scalar_t{}, scalar_t{}); });
  }
}

}  // namespace

void attend_items(const AttentionWork& work, const void* q, const void* k_cache, const void* v_cache, void* out,
                  double scale, double softcap, float* partials, std::atomic<int64_t>& next) {
  Params p = work.p;
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  const int64_t num_items = attention_items(work);
  dispatch_types(work, [&](auto q_type, auto cache_type) {
    using T = decltype(q_type);
    using C = decltype(cache_type);
    thread_local Scratch scratch;  // (kept across calls: no allocation per layer)
    for (int64_t i = next++; i < num_items; i = next++)
      attend_item<T, C>(work.items[work.order[i]], static_cast<const T*>(q), static_cast<const C*>(k_cache),
                        static_cast<const C*>(v_cache), static_cast<T*>(out), partials, work.starts.data(),
                        work.lens.data(), work.tables.data(), work.ctx.data(), p, scratch);
  });
}

void merge_partials(const AttentionWork& work, void* out, const float* partials, int64_t begin, int64_t end) {
  dispatch_types(work, [&](auto q_type, auto) {
    using T = decltype(q_type);
    for (int64_t m = begin; m < end; ++m) {
      const WorkItem& first = work.items[work.merges[m].first];
      merge_chunks<T>(first, work.merges[m].second, partials + first.partial, static_cast<T*>(out),
                      work.starts.data(), work.p);
    }
  });
}

void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out,
                     const at::Tensor& query_start, const at::Tensor& query_lens, const at::Tensor& block_tables,
                     const at::Tensor& context_lens, int64_t block_size, double scale, int64_t window,
                     double softcap) {
  const int64_t threads = at::get_num_threads();
  const auto work = plan_paged_attention(q, k_cache, v_cache, out, query_start, query_lens, block_tables, context_lens,
                                         block_size, window, threads);
  std::vector<float> partials(static_cast<size_t>(work->partial_size));
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(threads, attention_items(*work));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    attend_items(*work, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), scale, softcap,
                 partials.data(), next);
  });
  // (a few split tiles, batch-1: merged here; many: by the threads)
  at::parallel_for(0, attention_merges(*work), 8, [&](int64_t begin, int64_t end) {
    merge_partials(*work, out.data_ptr(), partials.data(), begin, end);
  });
}

}  // namespace tokenmill
