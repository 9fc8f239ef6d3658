// The panel GEMM's shared parts (panel_linear.cpp: fp32/bf16 weights; int8_linear.cpp: int8
// weights): register tiles, storing and prefetching them, and how a step's panels and rows are dealt
// to the threads.
//
// The weight [N, K] is packed once into panels of kPanel output columns, each stored k-major:
// packed[p, k, c] = W[p * kPanel + c, k] (columns past N are zero); int8 weights by pairs of k,
// packed[p, j, 2c + t] = W[p * kPanel + c, 2j + t]; int8 scales [N, groups] as bf16 ones, [p, g, c].
// One layout serves both ends of a step's row counts:
// - a few rows (batch-1 and small-batch decode): each thread streams a contiguous stretch of
//   panels exactly once, front to back (one row: six panels side by side), at memory speed; x's
//   rows sit in L1. int8 weights are widened in registers as they stream (1 byte per weight read);
// - many rows (batched decode, prefill): a register tile of kTileM rows x one panel's columns
//   (2 vectors) accumulates over K with one broadcast of x and two panel loads per k: the panel
//   (K x 64-128 bytes) stays in L1/L2 while every row group of a block of x passes over it, and
//   each row group requests the next panel meanwhile (see panel_gemm).
// Every fp32/bf16 output is one FMA chain over k in order, every int8 one the same blocks in the same
// order: a row's result does not depend on the other rows of its step.
// oneDNN's packed fp32 GEMMs run decode-sized shapes below the memory bandwidth (1 row) and the FMA
// peak (64 rows); `tokenmill bench kernels` measures this kernel against them.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "kernels.h"
#include "vec_utils.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace tokenmill {

// Rows of x per register tile: 2 accumulators each, plus the panel's 2 vectors and one broadcast,
// within AVX2's 16 (6 rows) or AVX-512's 32 (12 rows) vector registers.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kTileM = 12;
#else
constexpr int kTileM = 6;
#endif
// Rows of x per block: the block's rows stay in L2 while the thread's panels pass over them.
constexpr int64_t kBlockBytes = 256 * 1024;

// out[r, 0:cols] = acc[r] + bias for R rows (cols < kPanel: the last panel of an N that is not a
// multiple of kPanel).
template <int R>
inline void store_tile(Vec (&acc)[R][2], const float* bias, float* out, int64_t ldo, int64_t cols) {
  if (cols == kPanel) {
    const Vec b0 = bias != nullptr ? Vec::loadu(bias) : Vec(0.f);
    const Vec b1 = bias != nullptr ? Vec::loadu(bias + kVec) : Vec(0.f);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      (acc[r][0] + b0).store(out + r * ldo);
      (acc[r][1] + b1).store(out + r * ldo + kVec);
    }
    return;
  }
  // (unrolled like the loops above: a runtime index into acc would move it out of registers)
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    alignas(64) float row[kPanel];
    acc[r][0].store(row);
    acc[r][1].store(row + kVec);
    for (int64_t c = 0; c < cols; ++c) out[r * ldo + c] = row[c] + (bias != nullptr ? bias[c] : 0.f);
  }
}

// Requests step `step` of a panel that streams `Bytes` a step (a k of fp32/bf16 panels, a pair of
// inputs of int8 ones), a cache line at a time: see panel_gemm. Steps of under a line request their
// line more than once: skipping every other step (a modulo and a branch per k) made the bf16 tiles
// slower than no prefetch at all (`tokenmill bench kernels`, the model's layer GEMMs).
template <int64_t Bytes>
inline void prefetch_step(const void* panel, int64_t step) {
  const char* bytes = static_cast<const char*>(panel) + step * Bytes;
  for (int64_t offset = 0; offset < Bytes; offset += 64) __builtin_prefetch(bytes + offset, 0, 2);
}

// out[r, 0:cols] = x[r, :] . panel (+ bias) for R rows. Each output is one FMA chain over k in order,
// whatever R is: a row's result does not depend on how many rows share its step (batch invariance),
// and two chains per row already run one row at the memory's speed (two chains per row over
// interleaved k steps were slower at one row: `tokenmill bench kernels`).
// bf16 panels (bf16 weights on a CPU without native bf16, or fp32 weights that are all bf16 values)
// are widened to fp32 in registers as they stream (load_as_float), exactly: half the bytes of fp32
// per weight, the same arithmetic as on their fp32 values. Prefetch: request `next`, the panel after
// this one, a line per k, while this one computes.
template <int R, int P = 1, bool Prefetch = false, typename W>
inline void panel_tile(const float* x, int64_t ldx, const W* panel, int64_t k, const float* bias, float* out,
                       int64_t ldo, int64_t cols, const W* next = nullptr) {
  Vec acc[P][R][2];
  #pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[p][r][0] = acc[p][r][1] = Vec(0.f);
  for (int64_t d = 0; d < k; ++d) {
    if constexpr (Prefetch) prefetch_step<kPanel * sizeof(W)>(next, d);
    #pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      const W* w = panel + p * k * kPanel + d * kPanel;
      const Vec w0 = load_as_float(w), w1 = load_as_float(w + kVec);
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const Vec a(x[r * ldx + d]);
        acc[p][r][0] = at::vec::fmadd(a, w0, acc[p][r][0]);
        acc[p][r][1] = at::vec::fmadd(a, w1, acc[p][r][1]);
      }
    }
  }
  #pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
    store_tile<R>(acc[p], bias != nullptr ? bias + p * kPanel : nullptr, out + p * kPanel, ldo,
                  p == P - 1 ? cols : kPanel);
}


// Panels one row of x multiplies at once. One panel's two FMA chains were latency-bound, and more
// streams read at once also draw more of the memory's bandwidth into one core (one row's read rate
// over a model's layers and its head rises from one panel to three to six: `tokenmill bench
// kernels`, its table of the model's layer GEMMs). Six panels' 12 accumulators, a broadcast and a
// weight vector fit AVX2's 16 registers.
constexpr int kOneRowPanels = 6;

// A matrix of at least this many panels (a vocabulary projection) is shared among the threads in
// pieces of kPanelsPerPiece, taken as each thread finishes its last, when x is one block of rows.
// Fixed halves of the head left one thread idle while the other finished (the cores do not draw
// equal shares of the memory's bandwidth); a piece is 4 groups of six panels, a small fraction of a
// head's time.
constexpr int64_t kPiecewisePanels = 512;
constexpr int64_t kPanelsPerPiece = 24;

// Calls tile(begin, end, m0, rows) for each thread's contiguous stretch of panels [begin, end) (at
// decode sizes each thread streams its part of W once; a vocabulary-sized W piece by piece, above)
// and each block of rows [m0, m0 + rows) of an [m, k] x: blocks of about equal rows stay in L2 (a
// last block of a few rows would stream every panel again).
template <typename Tile>
void for_panel_blocks(int64_t m, int64_t k, int64_t panels, Tile&& tile) {
  const int64_t max_rows = std::max<int64_t>(kTileM, kBlockBytes / (k * 4) / kTileM * kTileM);
  const int64_t blocks = (m + max_rows - 1) / max_rows;
  const int64_t block_rows = ((m + blocks - 1) / blocks + kTileM - 1) / kTileM * kTileM;
  if (blocks == 1 && panels >= kPiecewisePanels) {
    const int64_t pieces = (panels + kPanelsPerPiece - 1) / kPanelsPerPiece;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      for (int64_t i = next++; i < pieces; i = next++)
        tile(i * kPanelsPerPiece, std::min(panels, (i + 1) * kPanelsPerPiece), int64_t{0}, m);
    });
    return;
  }
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m; m0 += block_rows) tile(begin, end, m0, std::min(block_rows, m - m0));
  });
}


}  // namespace tokenmill
