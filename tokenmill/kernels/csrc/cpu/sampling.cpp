// A step's token selection on CPU, one row at a time in a few vectorised passes over its logits:
// greedy rows take the argmax; sampled rows divide by the temperature, keep the top-k, take the
// softmax, keep the top-p nucleus and the min-p tokens (transformers' order), and draw by inverse
// CDF with one uniform per row (drawn by the caller from the row's RNG, engine/sample/sampler.py).
// The torch ops it replaces spend, per row of a large vocabulary, most of their time on the
// exponentials of an exponential race and top-p's full sort, and run argmax as a scalar loop
// (`tokenmill bench offline --temperature 0.8 --top-p 0.95` against greedy). Top-p sorts nothing:
// the nucleus's least weight comes from a radix selection by mass over the tokens that can be in it
// (with mass S and n tokens, those below (1 - top_p) S / n hold less than (1 - top_p) S together).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "kernels.h"
#include "vec_utils.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

namespace tokenmill {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int64_t kBlock = 256;  // probabilities summed per block: the draw finds its block first

struct RowParams {
  bool greedy;
  float temperature;
  int64_t top_k;  // <= 0 or >= vocab: off
  double top_p;   // 1: off
  double min_p;   // 0: off
  double uniform;  // U[0, 1) for the draw
};

// A thread's buffers, reused across rows and steps (a row's 200 KB would be a fresh mmap each time).
struct Scratch {
  std::vector<float> probs;
  std::vector<double> block_sums;
  std::vector<float> heap;
  std::vector<int64_t> candidates, selection;
  std::vector<double> hist;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

Vec max_nan(const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }  // NaN wins, as in torch.max

float max_of(const float* x, int64_t n) {
  Vec acc(-kInf);
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) acc = max_nan(acc, Vec::loadu(x + i));
  float m = at::vec::vec_reduce_all<float>(max_nan, acc);
  for (; i < n; ++i) m = std::isnan(x[i]) || x[i] > m ? x[i] : m;
  return m;
}

// The first index in [begin, n) whose value passes `hit`, tested a vector at a time (mask lanes).
template <typename VecTest, typename Test>
int64_t find_first(const float* x, int64_t begin, int64_t n, VecTest vec_hit, Test hit) {
  int64_t i = begin;
  for (; i < n && i % kVec != 0; ++i)
    if (hit(x[i])) return i;
  for (; i + kVec <= n; i += kVec)
    if (vec_hit(Vec::loadu(x + i)).zero_mask() != (1 << kVec) - 1) break;  // a lane hits in this vector
  for (; i < n; ++i)
    if (hit(x[i])) return i;
  return -1;
}

// torch.argmax of a row: the first largest value, or the first NaN.
int64_t argmax(const float* x, int64_t n) {
  const float m = max_of(x, n);
  const int64_t i = std::isnan(m) ? find_first(x, 0, n, [](const Vec& v) { return v.isnan(); },
                                               [](float v) { return std::isnan(v); })
                                  : find_first(x, 0, n, [&](const Vec& v) { return v == Vec(m); },
                                               [&](float v) { return v == m; });
  return std::max<int64_t>(i, 0);
}

// The k-th largest of y (no NaN), through a min-heap of the k largest so far; a vector compare
// against the heap's least skips the (almost all) values that cannot enter it.
float kth_largest(const float* y, int64_t n, int64_t k, std::vector<float>& heap) {
  heap.assign(y, y + k);
  std::make_heap(heap.begin(), heap.end(), std::greater<float>());
  int64_t i = k;
  auto offer = [&](float value) {
    if (value > heap.front()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
      heap.back() = value;
      std::push_heap(heap.begin(), heap.end(), std::greater<float>());
    }
  };
  for (; i < n && i % kVec != 0; ++i) offer(y[i]);
  for (; i + kVec <= n; i += kVec) {
    const Vec above = Vec::loadu(y + i) > Vec(heap.front());
    if (above.zero_mask() == (1 << kVec) - 1) continue;  // no lane above the least kept
    for (int64_t j = i; j < i + kVec; ++j) offer(y[j]);
  }
  for (; i < n; ++i) offer(y[i]);
  return heap.front();
}

// probs[i] = exp(y[i] - m) where y[i] >= floor and that value >= min_prob, else 0, in place over
// the divided logits y (padded with -inf to whole vectors). Returns the sum of each block of
// kBlock weights (double) and their total.
double exponentiate(float* probs, int64_t padded, float m, float floor, float min_prob, std::vector<double>& block_sums) {
  block_sums.assign((padded + kBlock - 1) / kBlock, 0.0);
  const Vec vm(m), vfloor(floor), vmin(min_prob);
  double total = 0.0;
  for (int64_t b = 0; b * kBlock < padded; ++b) {
    Vec acc(0.f);
    for (int64_t i = b * kBlock; i < std::min(padded, (b + 1) * kBlock); i += kVec) {
      const Vec y = Vec::loadu(probs + i);
      const Vec e = (y - vm).exp();
      const Vec kept = e & ((y >= vfloor) & (e >= vmin));  // (a true compare is all ones)
      kept.store(probs + i);
      acc = acc + kept;
    }
    block_sums[b] = hsum(acc);
    total += block_sums[b];
  }
  return total;
}

// The first index (in order) where the running sum of the weights passes target: a token drawn
// with probability weight / total when target = U[0, 1) * total. The block sums find the block;
// if rounding leaves the running sum short of target there (or past the last block), the last
// token with weight is drawn.
int64_t draw_dense(const float* probs, int64_t padded, const std::vector<double>& block_sums, double target) {
  double running = 0.0;
  for (size_t b = 0; b < block_sums.size(); ++b) {
    if (running + block_sums[b] <= target) {
      running += block_sums[b];
      continue;
    }
    int64_t last = -1;
    for (int64_t i = static_cast<int64_t>(b) * kBlock; i < std::min(padded, static_cast<int64_t>(b + 1) * kBlock); ++i) {
      if (probs[i] <= 0.f) continue;
      running += probs[i];
      last = i;
      if (running > target) return i;
    }
    return last;  // (a block whose sum passed target has a token with weight)
  }
  for (int64_t i = padded - 1; i > 0; --i)
    if (probs[i] > 0.f) return i;
  return 0;
}

// A positive float's bits, which order as its value does.
inline uint32_t bits_of(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

// The nucleus's least weight: the t with mass(weight > t) < mass <= mass(weight >= t) among
// `tokens`, by radix selection on the weights' bits (12, 12 and 8 bits a pass, each a histogram of
// mass, then only the tokens of the chosen bucket go on). `above` gets mass(weight > t). No sort: a
// flat distribution's nucleus holds a large part of the vocabulary (temperature 1).
float nucleus_floor(const float* probs, std::vector<int64_t>& tokens, double mass, std::vector<double>& hist,
                    double& above) {
  uint32_t prefix = 0;
  above = 0.0;
  for (const auto [shift, width] : {std::pair{20, 12}, std::pair{8, 12}, std::pair{0, 8}}) {
    const uint32_t buckets = 1u << width;
    hist.assign(buckets, 0.0);
    for (const int64_t t : tokens) hist[(bits_of(probs[t]) >> shift) & (buckets - 1)] += probs[t];
    uint32_t bucket = buckets - 1;  // the highest bucket whose mass, with all above it, reaches `mass`
    while (bucket > 0 && (above + hist[bucket] < mass || hist[bucket] == 0.0)) {
      above += hist[bucket];
      --bucket;
    }
    prefix |= bucket << shift;
    const uint32_t fixed = ~0u << shift;  // the bits chosen so far
    tokens.erase(std::remove_if(tokens.begin(), tokens.end(),
                                [&](int64_t t) { return (bits_of(probs[t]) & fixed) != prefix; }),
                 tokens.end());
  }
  float floor;
  std::memcpy(&floor, &prefix, sizeof floor);
  return floor;
}

// The smallest set of most likely tokens whose mass reaches top_p * total (ties by index), min-p
// applied after, then drawn from in token order. Only tokens at or above (1 - top_p) * total / n
// can be in it.
int64_t draw_nucleus(const float* probs, int64_t n, double total, float top, const RowParams& p, Scratch& s) {
  // (0.999: a margin for the float rounding of the bound and of the sums)
  const float bound = static_cast<float>(0.999 * (1.0 - p.top_p) * total / static_cast<double>(n));
  std::vector<int64_t>& candidates = s.candidates;
  candidates.clear();
  const auto vec_hit = [&](const Vec& v) { return v >= Vec(bound); };
  const auto hit = [&](float v) { return v >= bound; };
  for (int64_t i = find_first(probs, 0, n, vec_hit, hit); i >= 0; i = find_first(probs, i + 1, n, vec_hit, hit))
    candidates.push_back(i);
  const double mass = p.top_p * total;
  s.selection.assign(candidates.begin(), candidates.end());
  double before;  // mass of the tokens kept so far, in the nucleus's order
  const float floor = nucleus_floor(probs, s.selection, mass, s.hist, before);
  // Every token above the floor, and of those at it the first (by index) while the mass before them
  // is short of `mass`; min-p (relative to the most likely token, weight `top`) after.
  const float min_prob = static_cast<float>(p.min_p) * top;
  std::vector<int64_t>& kept = s.selection;
  kept.clear();
  double sum = 0.0;
  for (const int64_t t : candidates) {
    const float w = probs[t];
    if (w < floor || (w == floor && !(before < mass))) continue;
    if (w == floor) before += w;
    if (w < min_prob) continue;
    kept.push_back(t);
    sum += w;
  }
  const double target = p.uniform * sum;
  double running = 0.0;
  for (const int64_t t : kept) {
    running += probs[t];
    if (running > target) return t;
  }
  return kept.back();
}

int64_t sample_row(const float* logits, int64_t n, const RowParams& p) {
  if (p.greedy) return argmax(logits, n);
  Scratch& s = scratch();
  const int64_t padded = (n + kVec - 1) / kVec * kVec;
  s.probs.resize(padded);
  float* y = s.probs.data();
  const Vec vt(p.temperature);
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) (Vec::loadu(logits + i) / vt).store(y + i);
  for (; i < n; ++i) y[i] = logits[i] / p.temperature;
  std::fill(y + n, y + padded, -kInf);
  const float m = max_of(y, padded);  // (a second pass over y in L2: as fast as fused with the division)
  if (!std::isfinite(m)) return argmax(y, n);  // NaN, all -inf or an +inf: no distribution to draw from
  const float floor = p.top_k > 0 && p.top_k < n ? kth_largest(y, n, p.top_k, s.heap) : -kInf;
  const bool nucleus = p.top_p < 1.0;
  // min-p keeps weights >= min_p times the most likely token's, exp(m - m) as the vector exp computes
  // it. It comes after top-p; without top-p it is one more threshold in the same pass.
  float top[kVec];
  (Vec(m) - Vec(m)).exp().store(top);
  const float min_prob = nucleus ? 0.f : static_cast<float>(p.min_p) * top[0];
  const double total = exponentiate(y, padded, m, floor, min_prob, s.block_sums);
  if (nucleus) return draw_nucleus(y, n, total, top[0], p, s);
  return draw_dense(y, padded, s.block_sums, p.uniform * total);
}

}  // namespace

// One token per row of logits [rows, vocab] (fp32, rows may be strided), with each row's settings.
at::Tensor sample_tokens(const at::Tensor& logits, const c10::List<bool>& greedy, c10::ArrayRef<double> temperature,
                         c10::ArrayRef<int64_t> top_k, c10::ArrayRef<double> top_p, c10::ArrayRef<double> min_p,
                         c10::ArrayRef<double> uniform) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.stride(1) == 1 && logits.size(1) > 0,
              "sample_tokens: logits [rows, vocab], float32 on CPU, each row contiguous");
  const int64_t rows = logits.size(0), n = logits.size(1);
  for (const size_t size : {greedy.size(), temperature.size(), top_k.size(), top_p.size(), min_p.size(), uniform.size()})
    TORCH_CHECK(static_cast<int64_t>(size) == rows, "sample_tokens: one setting of each kind per row");
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(greedy.get(r) || (temperature[r] > 0.0 && top_p[r] > 0.0 && top_p[r] <= 1.0 && min_p[r] >= 0.0 &&
                              min_p[r] <= 1.0 && uniform[r] >= 0.0 && uniform[r] < 1.0),
                "sample_tokens: row ", r, " has settings outside temperature > 0, top_p in (0, 1], min_p in [0, 1], "
                "uniform in [0, 1)");
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  const float* base = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const RowParams p{greedy.get(r), static_cast<float>(temperature[r]), top_k[r], top_p[r], min_p[r], uniform[r]};
      out[r] = sample_row(base + r * stride, n, p);
    }
  });
  return tokens;
}

}  // namespace tokenmill
