// Paged attention on CPU, reading K/V blocks where they are in the cache (no gather copy).
//
// Every sequence s has query_lens[s] queries, rows query_start[s].. of q and out, which are the last
// query_lens[s] positions of its context_lens[s] keys; key position t lives at slot block_tables[s][t / block_size] *
// block_size + t % block_size of k_cache/v_cache [slots, kv_heads, head_dim]. A query at position
// p sees keys t <= p (causal) with p - t < window when window > 0. Decodes are q_len == 1.
//
// Work items are (sequence, kv head, tile of queries); the query heads that share a kv head (GQA)
// are computed together, so every K/V row is loaded once per tile. Items differ in cost by orders
// of magnitude (a decode vs a prefill tile over a long context): the largest go first and threads
// pull them one at a time. Scores go to a per-thread buffer:
// q.k (fp32 accumulation), scale, optional softcap tanh, masked max, exp, sum, then the weighted
// sum of V rows, divided by the sum at the end. Vectorised with ATen's Vectorized<float> for the
// instruction set this file is compiled for (AVX2+FMA or AVX-512; see tokenmill/kernels/build.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec_utils.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace tokenmill;

// Queries handled per work item: one decode, or up to this many rows of a prefill chunk.
constexpr int64_t kQueryTile = 8;

// K/V rows of one head are scattered (strided within a block, blocks anywhere in the cache): the
// hardware prefetcher does not follow, so a row's cache lines are requested this many keys ahead.
constexpr int64_t kPrefetchAhead = 8;

template <typename T>
inline void prefetch_row(const T* row, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < n * static_cast<int64_t>(sizeof(T)); offset += 64) __builtin_prefetch(bytes + offset);
}

struct Params {
  int64_t heads, kv_heads, dim, block_size, max_blocks, window;
  float scale, softcap;
};

struct WorkItem {
  int64_t seq, kv_head, first_query, num_queries;  // first_query: offset in the sequence's queries
  int64_t cost;
};

// T: the dtype of q and out (the model's); C: the cache's (the same, or a narrower --kv-cache-dtype).
template <typename T, typename C>
void attend_item(const WorkItem& item, const T* q, const C* k_cache, const C* v_cache, T* out,
                 const int32_t* query_start, const int32_t* query_lens, const int32_t* block_tables,
                 const int32_t* context_lens, const Params& p, std::vector<float>& buffer) {
  const int64_t group = p.heads / p.kv_heads;
  const int64_t rows = group * item.num_queries;  // row r: query (r / group), head kv_head*group + r%group
  const int64_t ctx = context_lens[item.seq];
  const int64_t first_pos = ctx - query_lens[item.seq] + item.first_query;
  const int64_t first_row = query_start[item.seq] + item.first_query;
  const int64_t last_pos = first_pos + item.num_queries - 1;
  // Keys any query of the tile can see.
  const int64_t key_lo = p.window > 0 ? std::max<int64_t>(0, first_pos - p.window + 1) : 0;
  const int64_t key_hi = last_pos + 1;
  const int64_t keys = key_hi - key_lo;
  const int64_t dim = p.dim;
  const int64_t row_stride = p.kv_heads * dim;  // between slots of one head

  // Layout of the buffer: q rows (fp32), accumulators, one K/V row of scratch, then scores [rows, keys].
  buffer.resize(static_cast<size_t>(2 * rows * dim + dim + rows * keys));
  float* q_f = buffer.data();
  float* acc = q_f + rows * dim;
  float* scratch = acc + rows * dim;
  float* scores = scratch + dim;
  std::vector<const float*> q_rows(rows);
  std::vector<float*> acc_rows(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = first_row + r / group;
    const int64_t head = item.kv_head * group + r % group;
    const T* src = q + (token * p.heads + head) * dim;
    for (int64_t d = 0; d < dim; ++d) q_f[r * dim + d] = static_cast<float>(src[d]);
    q_rows[r] = q_f + r * dim;
    acc_rows[r] = acc + r * dim;
  }
  std::fill(acc, acc + rows * dim, 0.f);

  const int32_t* table = block_tables + item.seq * p.max_blocks;
  auto slot_of = [&](int64_t t) -> int64_t {
    return static_cast<int64_t>(table[t / p.block_size]) * p.block_size + t % p.block_size;
  };
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Scores, masked per query, and each row's max.
  std::vector<float> dots(rows);
  std::vector<float> row_max(rows, neg_inf);
  for (int64_t j = 0; j < keys; ++j) {
    const int64_t t = key_lo + j;
    if (j + kPrefetchAhead < keys) prefetch_row(k_cache + slot_of(t + kPrefetchAhead) * row_stride + item.kv_head * dim, dim);
    const C* k_src = k_cache + slot_of(t) * row_stride + item.kv_head * dim;
    const float* k_row = as_float<C>(k_src, scratch, dim);
    dot_rows_any(q_rows.data(), static_cast<int>(rows), k_row, dim, dots.data());
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + r / group;
      float s = dots[r] * p.scale;
      if (p.softcap > 0.f) s = std::tanh(s / p.softcap) * p.softcap;
      const bool visible = t <= pos && (p.window <= 0 || pos - t < p.window);
      s = visible ? s : neg_inf;
      scores[r * keys + j] = s;
      row_max[r] = std::max(row_max[r], s);
    }
  }
  // exp(s - max) and the sums, vectorised over keys.
  std::vector<float> row_sum(rows);
  for (int64_t r = 0; r < rows; ++r) {
    float* srow = scores + r * keys;
    const Vec m(row_max[r]);
    Vec sum_v(0.f);
    int64_t j = 0;
    for (; j + kVec <= keys; j += kVec) {
      Vec e = (Vec::loadu(srow + j) - m).exp_u20();
      e.store(srow + j);
      sum_v = sum_v + e;
    }
    float sum = hsum(sum_v);
    for (; j < keys; ++j) {
      srow[j] = std::exp(srow[j] - row_max[r]);
      sum += srow[j];
    }
    row_sum[r] = sum;
  }
  // Weighted V rows.
  std::vector<float> weights(rows);
  for (int64_t j = 0; j < keys; ++j) {
    const int64_t t = key_lo + j;
    if (j + kPrefetchAhead < keys) prefetch_row(v_cache + slot_of(t + kPrefetchAhead) * row_stride + item.kv_head * dim, dim);
    const C* v_src = v_cache + slot_of(t) * row_stride + item.kv_head * dim;
    const float* v_row = as_float<C>(v_src, scratch, dim);
    for (int64_t r = 0; r < rows; ++r) weights[r] = scores[r * keys + j];
    axpy_rows_any(weights.data(), static_cast<int>(rows), v_row, dim, acc_rows.data());
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = first_row + r / group;
    const int64_t head = item.kv_head * group + r % group;
    T* dst = out + (token * p.heads + head) * dim;
    const float inv = 1.f / row_sum[r];
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc_rows[r][d] * inv);
  }
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
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() ||
                  (q.scalar_type() == at::kFloat &&
                   (k_cache.scalar_type() == at::kBFloat16 || k_cache.scalar_type() == at::kHalf)),
              "caches in q's dtype, or bf16/fp16 caches for fp32 queries");
  TORCH_CHECK(q.size(2) == k_cache.size(2), "head_dim of q and cache differ");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must be shaped like q");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables: int32 [seqs, max_blocks]");
  const int64_t seqs = block_tables.size(0);
  for (const at::Tensor* t : {&query_start, &query_lens, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->numel() == seqs,
                "query_start, query_lens, context_lens: int32 [seqs]");
}

void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out,
                     const at::Tensor& query_start, const at::Tensor& query_lens, const at::Tensor& block_tables,
                     const at::Tensor& context_lens, int64_t block_size, double scale, int64_t window,
                     double softcap) {
  check_inputs(q, k_cache, v_cache, out, query_start, query_lens, block_tables, context_lens);
  const Params p{q.size(1), k_cache.size(1), q.size(2), block_size, block_tables.size(1), window,
                 static_cast<float>(scale), static_cast<float>(softcap)};
  const int64_t seqs = block_tables.size(0);
  const int64_t tokens = q.size(0);
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const int32_t* lens = query_lens.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  TORCH_CHECK(block_size > 0 && k_cache.size(0) % block_size == 0, "cache slots are whole blocks");
  const int64_t num_blocks = k_cache.size(0) / block_size;
  std::vector<WorkItem> items;
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
    for (int64_t first = 0; first < lens[s]; first += kQueryTile) {
      const int64_t n = std::min<int64_t>(kQueryTile, lens[s] - first);
      const int64_t last_pos = ctx[s] - lens[s] + first + n;
      const int64_t keys = p.window > 0 ? std::min<int64_t>(last_pos, p.window + n) : last_pos;
      for (int64_t h = 0; h < p.kv_heads; ++h) items.push_back({s, h, first, n, n * keys});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  std::atomic<int64_t> next{0};
  auto run = [&](auto q_type, auto cache_type) {
    using T = decltype(q_type);
    using C = decltype(cache_type);
    const T* q_ptr = q.data_ptr<T>();
    const C* k_ptr = k_cache.data_ptr<C>();
    const C* v_ptr = v_cache.data_ptr<C>();
    T* out_ptr = out.data_ptr<T>();
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      std::vector<float> buffer;
      for (int64_t i = next++; i < num_items; i = next++)
        attend_item<T, C>(items[i], q_ptr, k_ptr, v_ptr, out_ptr, starts, lens, tables, ctx, p, buffer);
    });
  };
  if (k_cache.scalar_type() == at::kBFloat16 && q.scalar_type() == at::kFloat) {
    run(float{}, at::BFloat16{});  // fp32 compute over a bf16 --kv-cache-dtype: half the bytes read
  } else if (k_cache.scalar_type() == at::kHalf && q.scalar_type() == at::kFloat) {
    run(float{}, at::Half{});
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "tokenmill_paged_attention",
                                    [&] { run(scalar_t{}, scalar_t{}); });
  }
}

}  // namespace

TORCH_LIBRARY(tokenmill, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor(a!) out, Tensor query_start, "
        "Tensor query_lens, Tensor block_tables, Tensor context_lens, int block_size, float scale, int window, float softcap) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
