// Batched LoRA deltas on CPU for the small row groups of decode steps: out[row] += B_s (A_s x[row])
// for every row of a step that has an adapter, s being the slot of that row's adapter.
//
// The rows come grouped by slot (`rows`, with `segments` [G, 3] = slot, start, end into `rows`).
// Each slot holds, per fused part of the layer, a block (`blocks` [slots, parts, 4] = first column
// of the rank space, rank, first and end output feature; rank 0 = no block): A rows [col, col+r)
// of `lora_a` [slots, S*R, in] shrink x, and B rows [col, col+r) of `lora_b` [slots, S*R, out]
// (B transposed: one rank column per row, so the expand streams contiguous output features)
// expand into the block's output features. Only the adapter's true rank and its own part are read:
// a rank-8 adapter in a rank-16 slot, or the zeros off a fused layer's block diagonal, cost nothing.
// That is what makes this faster than padded batched GEMMs for decode: those read every slot's
// whole padded matrices and spend a call per matrix; here a step's deltas are one call per layer.
//
// Shrink: threads split the rows (each a few dot products over `in`). Expand: threads split the
// output features; a tile of up to 4 rows x 2 vectors of features accumulates in registers over
// the rank, one load of B per tile. Steps with little work stay on one thread.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "kernels.h"
#include "vec_utils.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using namespace tokenmill;

// A thread's share of work is at least this many multiply-adds: small steps (a few decode rows) run
// on the calling thread, without waking (or waiting for) the others for microseconds of work.
constexpr int64_t kMinWorkPerThread = 1 << 18;

inline int64_t grain(int64_t work_per_item) { return std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(1, work_per_item)); }

struct Block {
  int64_t col, rank, first, end;  // rank columns [col, col + rank) adapt output features [first, end)
};

inline Block block_at(const int64_t* blocks, int64_t parts, int64_t slot, int64_t part) {
  const int64_t* b = blocks + (slot * parts + part) * 4;
  return {b[0], b[1], b[2], b[3]};
}

// out rows += t rows (N rows, their `rank` values at stride `t_stride`) times B rows, over the
// output features [first, end): tiles of N rows x 2 vectors accumulate in registers over the rank.
template <int N>
void expand_rows(const float* t, int64_t t_stride, const float* b, int64_t b_stride, int64_t rank, float* const* out,
                 int64_t first, int64_t end) {
  int64_t o = first;
  for (; o + 2 * kVec <= end; o += 2 * kVec) {
    Vec acc[N][2];
    #pragma GCC unroll 4
    for (int n = 0; n < N; ++n) {
      acc[n][0] = Vec::loadu(out[n] + o);
      acc[n][1] = Vec::loadu(out[n] + o + kVec);
    }
    for (int64_t k = 0; k < rank; ++k) {
      const Vec b0 = Vec::loadu(b + k * b_stride + o), b1 = Vec::loadu(b + k * b_stride + o + kVec);
      #pragma GCC unroll 4
      for (int n = 0; n < N; ++n) {
        const Vec w(t[n * t_stride + k]);
        acc[n][0] = at::vec::fmadd(w, b0, acc[n][0]);
        acc[n][1] = at::vec::fmadd(w, b1, acc[n][1]);
      }
    }
    #pragma GCC unroll 4
    for (int n = 0; n < N; ++n) {
      acc[n][0].store(out[n] + o);
      acc[n][1].store(out[n] + o + kVec);
    }
  }
  for (; o < end; ++o)  // (feature counts that are not a multiple of 2 vectors)
    for (int n = 0; n < N; ++n) {
      float s = 0.f;
      for (int64_t k = 0; k < rank; ++k) s += t[n * t_stride + k] * b[k * b_stride + o];
      out[n][o] += s;
    }
}

}  // namespace

namespace tokenmill {

void lora_delta(const at::Tensor& x, at::Tensor& out, const at::Tensor& lora_a, const at::Tensor& lora_b,
                const at::Tensor& rows, const at::Tensor& segments, const at::Tensor& blocks) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0), "lora_delta: x and out must be [tokens, features]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && lora_a.scalar_type() == at::kFloat &&
              lora_b.scalar_type() == at::kFloat, "lora_delta: float32 only");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && lora_a.is_contiguous() && lora_b.is_contiguous(),
              "lora_delta: contiguous tensors only");
  TORCH_CHECK(rows.scalar_type() == at::kLong && segments.scalar_type() == at::kLong && blocks.scalar_type() == at::kLong,
              "lora_delta: int64 rows, segments and blocks");
  const int64_t in = x.size(1), features = out.size(1), width = lora_a.size(1), parts = blocks.size(1);
  TORCH_CHECK(lora_a.size(2) == in && lora_b.size(1) == width && lora_b.size(2) == features &&
              blocks.size(0) == lora_a.size(0), "lora_delta: shapes of lora_a, lora_b and blocks do not match");
  const int64_t n = rows.size(0), groups = segments.size(0), slots = lora_a.size(0), tokens = x.size(0);
  TORCH_CHECK(segments.dim() == 2 && segments.size(1) == 3 && segments.is_contiguous() && rows.is_contiguous() &&
              blocks.is_contiguous(), "lora_delta: segments must be [groups, 3] (slot, start, end)");
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* ap = lora_a.data_ptr<float>();
  const float* bp = lora_b.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = segments.data_ptr<int64_t>();
  const int64_t* kp = blocks.data_ptr<int64_t>();
  const int64_t slot_a = width * in, slot_b = width * features;
  // Indices are checked once here: the loops below trust them.
  for (int64_t g = 0; g < groups; ++g)
    TORCH_CHECK(sp[g * 3] >= 0 && sp[g * 3] < slots && 0 <= sp[g * 3 + 1] && sp[g * 3 + 1] <= sp[g * 3 + 2] &&
                sp[g * 3 + 2] <= n, "lora_delta: segment ", g, " is out of range");
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < tokens, "lora_delta: row ", rp[i], " out of range");
  for (int64_t i = 0; i < slots * parts; ++i) {
    const Block b = block_at(kp, parts, i / parts, i % parts);
    TORCH_CHECK(b.rank == 0 || (b.col >= 0 && b.rank > 0 && b.col + b.rank <= width && b.first >= 0 &&
                                b.first <= b.end && b.end <= features), "lora_delta: block ", i, " is out of range");
  }
  if (n == 0) return;

  // Shrink: t[i] = A_s x[rows[i]] on each block's rank columns (the others stay unused).
  std::vector<float> t(n * width, 0.f);
  std::vector<int64_t> slot_of(n);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t i = sp[g * 3 + 1]; i < sp[g * 3 + 2]; ++i) slot_of[i] = sp[g * 3];
  int64_t max_rank = 0;  // (for the work estimate of the expand)
  for (int64_t i = 0; i < slots * parts; ++i) max_rank = std::max(max_rank, kp[i * 4 + 1]);
  at::parallel_for(0, n, grain(width * in), [&](int64_t begin, int64_t last) {
    for (int64_t i = begin; i < last; ++i) {
      const int64_t slot = slot_of[i];
      const float* xr = xp + rp[i] * in;
      for (int64_t part = 0; part < parts; ++part) {
        const Block b = block_at(kp, parts, slot, part);
        for (int64_t k = 0; k < b.rank; k += kRowGroup) {  // kRowGroup A rows share each load of x
          const float* a_rows[kRowGroup];
          const int count = static_cast<int>(std::min<int64_t>(kRowGroup, b.rank - k));
          for (int m = 0; m < count; ++m) a_rows[m] = ap + slot * slot_a + (b.col + k + m) * in;
          dot_rows_any(a_rows, count, xr, in, &t[i * width + b.col + k]);
        }
      }
    }
  });

  // Expand: threads split the output features (in whole vectors); each walks every group's blocks.
  const int64_t vectors = (features + kVec - 1) / kVec;
  at::parallel_for(0, vectors, grain(n * max_rank * kVec), [&](int64_t v_begin, int64_t v_end) {
    const int64_t lo = v_begin * kVec, hi = std::min(features, v_end * kVec);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t slot = sp[g * 3], start = sp[g * 3 + 1], stop = sp[g * 3 + 2];
      for (int64_t part = 0; part < parts; ++part) {
        const Block b = block_at(kp, parts, slot, part);
        const int64_t first = std::max(lo, b.first), end = std::min(hi, b.end);
        if (b.rank == 0 || first >= end) continue;
        const float* b_rows = bp + slot * slot_b + b.col * features;
        for_row_groups<kRowGroup>(stop - start, [&](auto count, int64_t r) {
          constexpr int N = decltype(count)::value;
          float* out_rows[N];
          for (int m = 0; m < N; ++m) out_rows[m] = op + rp[start + r + m] * features;
          expand_rows<N>(&t[(start + r) * width + b.col], width, b_rows, features, b.rank, out_rows, first, end);
        });
      }
    }
  });
}

}  // namespace tokenmill
