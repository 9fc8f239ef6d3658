// W8A8 register tiles (w8a8_linear.cpp), written once for two instruction sets: w8a8_linear.cpp
// includes this file twice, into namespaces whose `dpbusd` differs (AVX512-VNNI / AVX-VNNI's one
// instruction, or pmaddwd on bytes widened to int16; the same int32 sums), with TOKENMILL_W8A8_TARGET
// the functions' target attribute (empty for the widened ones). An attribute on each function, not a
// target pragma around the include: GCC does not carry a pragma's target into template
// instantiations. No include guard, on purpose; it includes nothing (the includer has).

// The int32 sums of quads [0, quads) of P panels for R rows of x (bytes x + 128, ldx per row): each
// output column's four weights of a quad side by side (kQuadBytes a quad row), `next` the panel to
// request meanwhile.
template <int R, int P, bool Prefetch>
__attribute__((noinline)) TOKENMILL_W8A8_TARGET void quad_sums(const uint8_t* xu, int64_t ldx, const int8_t* panel, int64_t panel_bytes,
                                         int64_t quads, const int8_t* next, Int32Sums (&out)[P][R][2]) {
  Int32Sums sums[P][R][2];
  #pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) sums[p][r][0] = sums[p][r][1] = zero_sums();
  for (int64_t j = 0; j < quads; ++j) {
    if constexpr (Prefetch) prefetch_step<kQuadBytes>(next, j);
    #pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      const int8_t* w = panel + p * panel_bytes + j * kQuadBytes;
      const QuadBytes w0 = load_quads(w), w1 = load_quads(w + kQuadBytes / 2);
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const QuadBytes a = broadcast_quad(xu + r * ldx + 4 * j);
        sums[p][r][0] = dpbusd(sums[p][r][0], a, w0);
        sums[p][r][1] = dpbusd(sums[p][r][1], a, w1);
      }
    }
  }
  #pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) out[p][r][0] = sums[p][r][0], out[p][r][1] = sums[p][r][1];
}

// out[r, 0:cols] = x[r, :] . W (+ bias) for R rows over P consecutive panels from panel `first`.
template <int R, int P, bool Prefetch = false>
TOKENMILL_W8A8_TARGET void w8a8_tile(const uint8_t* xu, int64_t ldx, const float* sx, const W8A8Weights& w, int64_t first,
               const float* bias, float* out, int64_t ldo, int64_t cols, const int8_t* next = nullptr) {
  Int32Sums sums[P][R][2];
  quad_sums<R, P, Prefetch>(xu, ldx, w.packed + first * w.panel_bytes, w.panel_bytes, w.quads, next, sums);
  #pragma GCC unroll 16
  for (int p = 0; p < P; ++p) {
    const int64_t column = (first + p) * kPanel, width = p == P - 1 ? cols : kPanel;
    Vec acc[R][2];
    #pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const Int32Sums offset = load_sums(w.offsets + column + h * kVec);
      const Vec scale = Vec::loadu(w.scales + column + h * kVec);
      const Vec b = column_bias(bias, p * kPanel + h * kVec, width - h * kVec);
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        acc[r][h] = fused_multiply_add(to_float(subtract(sums[p][r][h], offset)) * Vec(sx[r]), scale, b);
    }
    store_tile<R>(acc, nullptr, out + p * kPanel, ldo, width);
  }
}

// Rows [0, rows) of x times panels [p, end) in groups of P full panels, one row at a time, then of
// fewer; p ends at the first panel left.
template <int P>
TOKENMILL_W8A8_TARGET void w8a8_panel_groups(const uint8_t* xu, int64_t ldx, const float* sx, int64_t rows, const W8A8Weights& w,
                       const float* bias, float* out, int64_t n, int64_t& p, int64_t end) {
  for (; p + P <= end && (p + P) * kPanel <= n; p += P)
    for (int64_t r = 0; r < rows; ++r)
      w8a8_tile<1, P>(xu + r * ldx, 0, sx + r, w, p, bias != nullptr ? bias + p * kPanel : nullptr,
                      out + r * n + p * kPanel, n, kPanel);
  if constexpr (P > 1) w8a8_panel_groups<P - 1>(xu, ldx, sx, rows, w, bias, out, n, p, end);
}

// Rows [m0, m0 + rows) of x (m rows in all) times panels [begin, end).
TOKENMILL_W8A8_TARGET void w8a8_panel_range(const uint8_t* xu, const float* sx, const W8A8Weights& w, const float* bias, float* out,
                      int64_t m, int64_t n, int64_t begin, int64_t end, int64_t m0, int64_t rows) {
  const int64_t ldx = 4 * w.quads;
  int64_t p = begin;
  if (m <= kW8A8RowByRow) w8a8_panel_groups<kOneRowPanels>(xu, ldx, sx, m, w, bias, out, n, p, end);
  for (; p < end; ++p) {
    const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
    const float* b = bias != nullptr ? bias + col : nullptr;
    const int8_t* next = w.packed + (p + 1 < end ? p + 1 : p) * w.panel_bytes;
    for_row_groups<kTileM>(rows, [&](auto count, int64_t r) {
      const int64_t row = m0 + r;
      w8a8_tile<decltype(count)::value, 1, true>(xu + row * ldx, ldx, sx + row, w, p, b, out + row * n + col, n, cols,
                                                 next);
    });
  }
}
