// The W8A8 row kernels in 256-bit registers (int8_kernels.h), shared by int8_avx2.cpp and
// int8_avx_vnni.cpp, which differ in how a step's products are summed (their `Dot`). AVX2 has no
// expand: a 256-entry table gives, per bitmask byte, the pshufb control that moves the byte's
// kept values into its eight inputs' bytes (zero where pruned); two bytes make the control of
// sixteen inputs, the second's indices after the first byte's kept values (a 2:4 step's four
// bytes: four each, so its controls come from four tables with no count).
// The including file defines WS_TARGET and includes <immintrin.h> first.
#pragma once

#include <algorithm>
#include <cstring>
#include <vector>

#include "int8_kernels.h"

namespace whisper_sparse {
namespace {

constexpr int64_t kExpanded = 16;         // inputs per expansion: two bitmask bytes
constexpr int64_t kStep = 32;             // inputs per step: four bitmask bytes
constexpr uint64_t kEveryByte = 0x0101010101010101ull;

struct PlaceTable {
  // place[j][b], byte i: 4 j plus the index among byte b's kept values of input i's, or 0x80
  // (pruned: zero); j = 0 for any row, and in a 2:4 step byte j's kept values start at 4 j
  uint64_t place[4][256];

  PlaceTable() {
    for (int j = 0; j < 4; ++j)
      for (int b = 0; b < 256; ++b) {
        uint64_t control = 0;
        int next = 4 * j;
        for (int i = 0; i < 8; ++i) control |= uint64_t(b >> i & 1 ? next++ : 0x80) << (8 * i);
        place[j][b] = control;
      }
  }
};

const PlaceTable kPlace;

// A step's dense int8 weights: inputs [k, k + 16) and [k + 16, k + 32).
struct DenseStep {
  __m128i low, high;
};

// A 2:4 step: its four mask bytes place the sixteen kept values at `kept` (four a byte).
WS_TARGET inline DenseStep two_four_step(const int8_t* kept, uint32_t bits) {
  const __m128i values = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kept));
  const auto& t = kPlace.place;
  const __m128i low = _mm_set_epi64x(int64_t(t[1][bits >> 8 & 0xFF]), int64_t(t[0][bits & 0xFF]));
  const __m128i high =
      _mm_set_epi64x(int64_t(t[3][bits >> 24]), int64_t(t[2][bits >> 16 & 0xFF]));
  return {_mm_shuffle_epi8(values, low), _mm_shuffle_epi8(values, high)};
}

// Sixteen kept values from `at`, or where Checked and fewer than sixteen remain before `end`,
// those left and zeros (a load never passes the layer's last value).
template <bool Checked>
WS_TARGET inline __m128i kept16(const int8_t* at, const int8_t* end) {
  if (Checked && end - at < 16) {
    alignas(16) int8_t copy[16] = {};
    std::memcpy(copy, at, end - at);
    return _mm_load_si128(reinterpret_cast<const __m128i*>(copy));
  }
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
}

// The pshufb control of sixteen inputs from their mask bits (the first input in the lowest),
// whose kept values start at the control's index 0. The second byte's indices, raised by the
// first's count of kept values, stay at or above 0x80 where pruned.
WS_TARGET inline __m128i place16(uint32_t bits) {
  const uint32_t low = bits & 0xFF, high = bits >> 8 & 0xFF;
  return _mm_set_epi64x(int64_t(kPlace.place[0][high] + __builtin_popcount(low) * kEveryByte),
                        int64_t(kPlace.place[0][low]));
}

// A whole step of an unstructured row: its 32 mask bits and the cursor at its first kept value,
// which advances once, past the step's. Each half's values are loaded from where the first
// half's count says, so neither load waits on the other's advance.
template <bool Checked>
WS_TARGET inline DenseStep any_step(const int8_t*& values, const int8_t* end, uint32_t bits) {
  const int8_t* high = values + __builtin_popcount(bits & 0xFFFF);
  const DenseStep dense = {_mm_shuffle_epi8(kept16<Checked>(values, end), place16(bits)),
                           _mm_shuffle_epi8(kept16<Checked>(high, end), place16(bits >> 16))};
  values += __builtin_popcount(bits);
  return dense;
}

// The mask bits of inputs [k, min(k + 16, K)) of a bitmask row (k a multiple of 8; 0 from K).
inline uint32_t step_bits(const uint8_t* row, int64_t k, int64_t K) {
  if (k >= K) return 0;
  const int64_t count = std::min<int64_t>(kExpanded, K - k);
  uint16_t bits = 0;
  std::memcpy(&bits, row + k / 8, (count + 7) / 8);
  return count >= 16 ? bits : bits & ((1u << count) - 1);
}

// Sixteen weights of a row in its tail from input k (zero from K), from a cursor it advances
// past their kept values, which it reads no further than (through a copy where fewer than 16).
WS_TARGET inline __m128i tail16(const int8_t*& values, const uint8_t* mask, int64_t k,
                                int64_t K) {
  const uint32_t bits = step_bits(mask, k, K);
  const int8_t* after = values + __builtin_popcount(bits);
  const __m128i kept = kept16<true>(values, after);
  values = after;
  return _mm_shuffle_epi8(kept, place16(bits));
}

WS_TARGET inline int32_t horizontal_sum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// The tokens as the Dot reads them: [M, stride] of Dot::Token (stride a multiple of kStep, zero
// from K), and each token's sum of x_q.
template <class Dot>
struct StepTokens {
  std::vector<typename Dot::Token> values;
  std::vector<int32_t> sums;
  int64_t stride = 0;

  StepTokens(const Int8Tokens& x, int64_t K)
      : values(x.M * ((K + kStep - 1) / kStep * kStep)), sums(x.M) {
    stride = int64_t(values.size()) / std::max<int64_t>(x.M, 1);
    for (int64_t m = 0; m < x.M; ++m) {
      int32_t sum = 0;
      for (int64_t k = 0; k < K; ++k) {
        values[m * stride + k] = x.x_q[m * x.ldx + k];
        sum += x.x_q[m * x.ldx + k];
      }
      sums[m] = sum;
    }
  }
};

// How a block of rows is stored: 2:4, or unstructured, whose loads either stay in the layer or,
// in its last rows, are checked against its end (kept16).
enum class Layout { kTwoFour, kBitmask, kBitmaskAtEnd };

// One step (kStep inputs at k; in the tail, zero from K) of R rows and T tokens: each row's
// weights expanded once (Dot::weights) and multiplied by every token's, read from L1.
template <class Dot, int R, int T, Layout L, bool Tail>
WS_TARGET inline void rows_step(const Int8Layer& layer, const typename Dot::Token* tokens,
                                int64_t stride, int64_t k, const RowsAhead<R>& ahead,
                                const int8_t* (&values)[R], const uint8_t* const (&masks)[R],
                                __m256i (&acc)[R][T]) {
  const int8_t* end = layer.values + layer.values_count;
  for (int r = 0; r < R; ++r) {
    DenseStep dense;
    if constexpr (Tail) {
      dense.low = tail16(values[r], masks[r], k, layer.K);
      dense.high = tail16(values[r], masks[r], k + kExpanded, layer.K);
    } else if constexpr (L == Layout::kTwoFour) {  // the cursor stays at the row's start
      uint32_t bits;
      std::memcpy(&bits, masks[r] + k / 8, sizeof(bits));
      dense = two_four_step(values[r] + k / 2, bits);
      if ((k & 127) == 0) ask_row_ahead(ahead, r, values[r] + k / 2, masks[r], k);
    } else {
      if ((k & 63) == 0) ask_row_ahead(ahead, r, values[r], masks[r], k);
      uint32_t bits;
      std::memcpy(&bits, masks[r] + k / 8, sizeof(bits));
      dense = any_step<L == Layout::kBitmaskAtEnd>(values[r], end, bits);
    }
    const typename Dot::Weights w = Dot::weights(dense);
    for (int t = 0; t < T; ++t) acc[r][t] = Dot::dot(acc[r][t], w, tokens + t * stride + k);
  }
}

// y for R rows from n and T tokens from m. A 2:4 row's cursor stays at its start (its step's
// values are at k / 2) until the tail; any other row's advances over its kept values.
template <class Dot, int R, int T, Layout L>
WS_TARGET void rows_block(const Int8Layer& layer, const Int8Tokens& x,
                          const StepTokens<Dot>& tokens, const Int8Output& out, int64_t m,
                          int64_t n) {
  const int64_t mask_bytes = (layer.K + 7) / 8, whole = layer.K / kStep * kStep;
  const RowsAhead<R> ahead(layer, n);
  const int8_t* values[R];
  const uint8_t* masks[R];
  __m256i acc[R][T];
  for (int r = 0; r < R; ++r) {
    values[r] = layer.values + layer.row_start(n + r);
    masks[r] = layer.bitmask + (n + r) * mask_bytes;
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_si256();
  }
  const typename Dot::Token* rows = tokens.values.data() + m * tokens.stride;
  for (int64_t k = 0; k < whole; k += kStep)
    rows_step<Dot, R, T, L, false>(layer, rows, tokens.stride, k, ahead, values, masks, acc);
  if (whole < layer.K) {
    if constexpr (L == Layout::kTwoFour)
      for (int r = 0; r < R; ++r) values[r] += whole / 2;
    rows_step<Dot, R, T, L, true>(layer, rows, tokens.stride, whole, ahead, values, masks, acc);
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      const int32_t sum = Dot::sum_of(horizontal_sum(acc[r][t]), tokens.sums[m + t]);
      store_int8_sum(out, x, layer, m + t, n + r, sum);
    }
}

// Every token of rows [n, n + R): tiles of up to four tokens pass over the rows while they are
// in cache, so the weights are read from memory once.
template <class Dot, int R, Layout L>
WS_TARGET void rows_all_tokens(const Int8Layer& layer, const Int8Tokens& x,
                               const StepTokens<Dot>& tokens, const Int8Output& out, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= x.M; m += 4) rows_block<Dot, R, 4, L>(layer, x, tokens, out, m, n);
  switch (x.M - m) {
    case 3: rows_block<Dot, R, 3, L>(layer, x, tokens, out, m, n); break;
    case 2: rows_block<Dot, R, 2, L>(layer, x, tokens, out, m, n); break;
    case 1: rows_block<Dot, R, 1, L>(layer, x, tokens, out, m, n); break;
    default: break;
  }
}

// Rows [n, n + R) of any layout: an unstructured block is checked where a load of sixteen
// values from its last row's could pass the layer's end.
template <class Dot, int R, bool TwoFour>
WS_TARGET void rows_block_of(const Int8Layer& layer, const Int8Tokens& x,
                             const StepTokens<Dot>& tokens, const Int8Output& out, int64_t n) {
  if constexpr (TwoFour) {
    rows_all_tokens<Dot, R, Layout::kTwoFour>(layer, x, tokens, out, n);
  } else if (layer.values_before(n + R) + kExpanded <= layer.values_count) {
    rows_all_tokens<Dot, R, Layout::kBitmask>(layer, x, tokens, out, n);
  } else {
    rows_all_tokens<Dot, R, Layout::kBitmaskAtEnd>(layer, x, tokens, out, n);
  }
}

// Rows [n_begin, n_end) in blocks of R, then one by one.
template <class Dot, int R, bool TwoFour>
WS_TARGET void rows_of(const Int8Layer& layer, const Int8Tokens& x, const StepTokens<Dot>& tokens,
                       const Int8Output& out, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + R <= n_end; n += R) rows_block_of<Dot, R, TwoFour>(layer, x, tokens, out, n);
  for (; n < n_end; ++n) rows_block_of<Dot, 1, TwoFour>(layer, x, tokens, out, n);
}

// Rows [n_begin, n_end) of y for every token: one row at a time in memory order up to two
// tokens (its cursor and sums stay in registers), two above (at most 2 x 4 sums and a step's
// weights in registers).
template <class Dot>
WS_TARGET void rows_256(const Int8Layer& layer, const Int8Tokens& x, const Int8Output& out,
                        int64_t n_begin, int64_t n_end) {
  const StepTokens<Dot> tokens(x, layer.K);
  const bool two_four = layer.row_offsets == nullptr;
  if (x.M <= 2) {
    two_four ? rows_of<Dot, 1, true>(layer, x, tokens, out, n_begin, n_end)
             : rows_of<Dot, 1, false>(layer, x, tokens, out, n_begin, n_end);
  } else {
    two_four ? rows_of<Dot, 2, true>(layer, x, tokens, out, n_begin, n_end)
             : rows_of<Dot, 2, false>(layer, x, tokens, out, n_begin, n_end);
  }
}

}  // namespace
}  // namespace whisper_sparse
