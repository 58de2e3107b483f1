// The W8A8 tiles in 256-bit registers (int8_kernels.h), shared by int8_avx2.cpp and
// int8_avx_vnni.cpp, which differ in how a pair of int16 products is added to an int32 sum
// (their `Madd`). A block of rows is expanded once per pass over the inputs into an int16
// buffer that stays in L2 (the row kernels' table expansion, int8_rows_256.h), and every token,
// widened to int16 once per call, is multiplied through it three rows by three tokens at a
// time: nine sums, three weight and one token register, and a product in flight fill AVX2's 16.
// The including file defines WS_TARGET and includes <immintrin.h> first.
#pragma once

#include <algorithm>
#include <cstring>
#include <vector>

#include "int8_rows_256.h"

namespace whisper_sparse {
namespace {

constexpr int64_t kBlockRows = 48;     // rows expanded at a time, a multiple of kMicroRows
constexpr int64_t kPassInputs = 2048;  // inputs a pass: 48 rows of them in int16 are 192 KiB
constexpr int64_t kBufferPad = 16;     // int16 after each buffer row, off a power-of-two stride
constexpr int kMicroRows = 3, kMicroTokens = 3;

// Inputs [k0, k0 + count) of rows [n, n + rows) as int16 into buffer (row stride ld), zero
// from K; an unstructured row reads from its cursor in `cursors`, which it advances.
template <bool TwoFour>
WS_TARGET void expand_pass(const Int8Layer& layer, int64_t n, int64_t rows, int64_t k0,
                           int64_t count, const int8_t** cursors, int16_t* buffer, int64_t ld) {
  const int64_t mask_bytes = (layer.K + 7) / 8;
  const int8_t* end = layer.values + layer.values_count;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* mask = layer.bitmask + (n + r) * mask_bytes;
    const int8_t* two_four_row = layer.values + layer.row_start(n + r);
    int16_t* row = buffer + r * ld - k0;
    for (int64_t k = k0; k < k0 + count; k += kStep) {
      DenseStep dense;
      if (k + kStep > layer.K) {  // the tail: zero from K, read through a copy
        const int8_t* tail = TwoFour ? two_four_row + k / 2 : cursors[r];
        dense.low = tail16(tail, mask, k, layer.K);
        dense.high = tail16(tail, mask, k + kExpanded, layer.K);
      } else {
        uint32_t bits;
        std::memcpy(&bits, mask + k / 8, sizeof(bits));
        if constexpr (TwoFour) {
          dense = two_four_step(two_four_row + k / 2, bits);
        } else {
          dense = any_step<true>(cursors[r], end, bits);
        }
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + k), _mm256_cvtepi8_epi16(dense.low));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + k + kExpanded),
                          _mm256_cvtepi8_epi16(dense.high));
    }
  }
}

// sums[t * ld_sums + r] += the products over `count` inputs (a multiple of 16) of R buffer rows
// (stride ld_w) and T wide tokens (stride ld_x).
template <class Madd, int R, int T>
WS_TARGET void tile_products(const int16_t* w, int64_t ld_w, const int16_t* x, int64_t ld_x,
                             int64_t count, int32_t* sums, int64_t ld_sums) {
  __m256i acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_si256();
  for (int64_t k = 0; k < count; k += kExpanded) {
    __m256i weights[R];
    for (int r = 0; r < R; ++r)
      weights[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * ld_w + k));
    for (int t = 0; t < T; ++t) {
      const __m256i token = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + t * ld_x + k));
      for (int r = 0; r < R; ++r) acc[r][t] = Madd::madd(acc[r][t], weights[r], token);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) sums[t * ld_sums + r] += horizontal_sum(acc[r][t]);
}

template <class Madd>
using TileProducts = void (*)(const int16_t*, int64_t, const int16_t*, int64_t, int64_t,
                              int32_t*, int64_t);

// tile_products for 1 to 3 rows by 1 to 3 tokens: [rows - 1][tokens - 1].
template <class Madd>
constexpr TileProducts<Madd> kTileProducts[kMicroRows][kMicroTokens] = {
    {tile_products<Madd, 1, 1>, tile_products<Madd, 1, 2>, tile_products<Madd, 1, 3>},
    {tile_products<Madd, 2, 1>, tile_products<Madd, 2, 2>, tile_products<Madd, 2, 3>},
    {tile_products<Madd, 3, 1>, tile_products<Madd, 3, 2>, tile_products<Madd, 3, 3>},
};

// Rows [n_begin, n_end) of y for every token of `wide` (x_q as int16, [M, ld_x], zero from K).
template <class Madd, bool TwoFour>
WS_TARGET void tiles_of(const Int8Layer& layer, const Int8Tokens& x, const int16_t* wide,
                        int64_t ld_x, const Int8Output& out, int64_t n_begin, int64_t n_end) {
  const int64_t padded = (layer.K + kStep - 1) / kStep * kStep, ld = kPassInputs + kBufferPad;
  std::vector<int16_t> buffer(kBlockRows * ld);
  std::vector<int32_t> sums(x.M * kBlockRows);
  const int8_t* cursors[kBlockRows];
  for (int64_t n = n_begin; n < n_end; n += kBlockRows) {
    const int64_t rows = std::min(kBlockRows, n_end - n);
    std::fill(sums.begin(), sums.end(), 0);
    for (int64_t r = 0; r < rows; ++r) cursors[r] = layer.values + layer.row_start(n + r);
    for (int64_t k0 = 0; k0 < padded; k0 += kPassInputs) {
      const int64_t count = std::min(kPassInputs, padded - k0);
      expand_pass<TwoFour>(layer, n, rows, k0, count, cursors, buffer.data(), ld);
      for (int64_t m = 0; m < x.M; m += kMicroTokens) {
        const int64_t tokens = std::min<int64_t>(kMicroTokens, x.M - m);
        for (int64_t r = 0; r < rows; r += kMicroRows) {
          const int64_t micro_rows = std::min<int64_t>(kMicroRows, rows - r);
          kTileProducts<Madd>[micro_rows - 1][tokens - 1](buffer.data() + r * ld, ld,
                                                          wide + m * ld_x + k0, ld_x, count,
                                                          sums.data() + m * kBlockRows + r,
                                                          kBlockRows);
        }
      }
    }
    for (int64_t m = 0; m < x.M; ++m)
      for (int64_t r = 0; r < rows; ++r)
        store_int8_sum(out, x, layer, m, n + r, sums[m * kBlockRows + r]);
  }
}

template <class Madd>
WS_TARGET void tiles_256(const Int8Layer& layer, const Int8Tokens& x, const int16_t* wide,
                         int64_t ld_x, const Int8Output& out, int64_t n_begin, int64_t n_end) {
  if (layer.row_offsets == nullptr) {
    tiles_of<Madd, true>(layer, x, wide, ld_x, out, n_begin, n_end);
  } else {
    tiles_of<Madd, false>(layer, x, wide, ld_x, out, n_begin, n_end);
  }
}

}  // namespace
}  // namespace whisper_sparse
