// 2:4 and unstructured rows on AVX-512 with VBMI2 and BF16, bfloat16 activations and weights
// (sparse_kernels.h): 32 bits of the bitmask are the mask of one vpexpandw, which places the kept
// values of 32 inputs in their lanes (16 in a 2:4 row; as many as the mask's popcount in an
// unstructured one, whose pointer then advances by that count); vdpbf16ps then adds the 32
// products into sixteen float32 lanes.
// The kept values are loaded plainly and expanded in registers (expand32 keeps the compiler from
// folding the load into vpexpandw): vpexpandw from memory was slower (JOURNAL.md). GCC's SLP
// vectorizer is off here: it packed the row pointers into vector registers and spilled the
// accumulators in the row loop.
#include <algorithm>
#include <cstring>
#include <vector>

#include "sparse_kernels.h"

#ifdef WS_EMULATE_INTRINSICS  // plain C++ intrinsics: the tests run this file on any CPU
#include WS_EMULATE_INTRINSICS
#define WS_TARGET
#else
#include <immintrin.h>
#define WS_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,avx512bf16,popcnt")))
#endif

#include "avx512_bf16_parts.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-tree-slp-vectorize")  // see the top of this file
#endif

namespace whisper_sparse {
namespace {

// Software prefetch, as in avx512.cpp: kPrefetchAhead bytes ahead in each row, and the
// same place in the rows of the next group (R rows on), so that a group starts on rows already
// on their way from memory.
constexpr int64_t kPrefetchAhead = 1024;

// Kept values per 64 inputs above which an unstructured group of rows asks for its lines every
// 32 inputs rather than every 64 (26 of 64, about 40 %; rows_block).
constexpr int64_t kAskEveryStepAbove = 26;

// y[m + t][n + r] for R rows from n and T tokens from m (x: token m's row): each row's kept
// values and bitmask are walked by a pointer of its own. Per 32 inputs, the R rows' kept values
// are expanded first and multiplied after: a vpexpandw next to the vdpbf16ps that reads it
// waits on it (JOURNAL.md).
// (U: an unstructured row, whose values start at row_offsets[n + r]; the next group's rows are
// prefetched at the same distance into them. Bounded: a row's next 32 values may run past the
// layer's last, so each load checks.)
template <int R, int T, bool U, bool Bounded = false>
WS_TARGET void rows_block(const RowsArgs& a, const uint16_t* x, int64_t m, int64_t n) {
  const int64_t half_k = a.K / 2, mask_bytes = (a.K + 7) / 8, ldx = a.ldx;
  const int64_t whole = a.K & ~int64_t(31);
  const uint16_t* base = static_cast<const uint16_t*>(a.compressed);
  const uint16_t* end = base + a.values_count;  // past the layer's last value
  const uint16_t* values[R];
  int64_t next_group[R];  // how far the next group's row starts past this row's start
  const uint8_t* masks[R];
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r) {
    const int64_t start = U ? a.row_offsets[n + r] : (n + r) * half_k;
    values[r] = base + start;
    next_group[r] = !U ? R * half_k : n + r + R < a.n_end ? a.row_offsets[n + r + R] - start : 0;
    masks[r] = a.bitmask + (n + r) * mask_bytes;
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  // The rows' lines are asked for once per cache line of kept values: a 2:4 row's pointer
  // moves 64 bytes every 64 inputs, so asking every 64 inputs meets each line once. An
  // unstructured row's moves by its popcounts; where its rows keep more than about 40 % of
  // their inputs it moves past 64 bytes between two such asks often enough to leave lines
  // unasked for, so there it asks every 32 inputs (at most 64 bytes on: no line skipped).
  // (Asks at a steady pace rather than from the pointer: tried, not kept; JOURNAL.md.)
  const bool every_step =
      U &&
      (R == 1 ||
       (a.row_offsets[n + R - 1] - a.row_offsets[n]) * 64 > kAskEveryStepAbove * a.K * (R - 1));
  for (int64_t k = 0; k < whole; k += 32) {
    if (every_step || (k & 63) == 0) {
      for (int r = 0; r < R; ++r) {
        __builtin_prefetch(values[r] + kPrefetchAhead / 2, 0, 3);
        __builtin_prefetch(values[r] + next_group[r], 0, 3);
        if ((k & 511) == 0) {
          __builtin_prefetch(masks[r] + k / 8 + 64, 0, 3);
          __builtin_prefetch(masks[r] + k / 8 + R * mask_bytes, 0, 3);
        }
      }
    }
    __m512i w[R];
    for (int r = 0; r < R; ++r) {
      uint32_t mask;
      std::memcpy(&mask, masks[r] + k / 8, sizeof(mask));
      const int64_t count = U ? __builtin_popcount(mask) : 16;
      w[r] = U ? expand32<false, Bounded>(mask, values[r], count, end)
               : expand32<true>(mask, values[r]);
      values[r] += count;
    }
    __m512i xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm512_loadu_si512(x + t * ldx + k);
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t)
        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)w[r], (__m512bh)xv[t]);
  }
  if (whole < a.K) {
    const int64_t rest = a.K - whole;  // 4 .. 28 inputs (2:4), 1 .. 31 (unstructured)
    const __mmask32 inputs = (uint32_t(1) << rest) - 1;
    __m512i xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm512_maskz_loadu_epi16(inputs, x + t * ldx + whole);
    for (int r = 0; r < R; ++r) {
      const uint32_t mask = mask_bits(masks[r], whole, rest);
      const __m512i w = expand32<false>(mask, values[r], U ? __builtin_popcount(mask) : rest / 2,
                                        U ? end : nullptr);
      for (int t = 0; t < T; ++t)
        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)w, (__m512bh)xv[t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      store_sum(a, (m + t) * a.ldy + n + r, n + r, _mm512_reduce_add_ps(acc[r][t]));
}

// rows_block, whose loads check the layer's end only where the block's last row is near it
// (loads_stay_in_layer).
template <int R, int T, bool U>
WS_TARGET void rows_block_in_layer(const RowsArgs& a, const uint16_t* x, int64_t m, int64_t n) {
  if (U && !loads_stay_in_layer(a.row_offsets[n + R - 1], a.K, a.values_count)) {
    rows_block<R, T, U, true>(a, x, m, n);
  } else {
    rows_block<R, T, U>(a, x, m, n);
  }
}

// Every token of rows [n, n + G): tiles of up to four tokens pass over the group while it is
// in cache, so the weights are read from memory once.
template <int G, bool U>
WS_TARGET void rows_all_tokens(const RowsArgs& a, const uint16_t* x, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4) rows_block_in_layer<G, 4, U>(a, x + m * a.ldx, m, n);
  switch (a.M - m) {
    case 3: rows_block_in_layer<G, 3, U>(a, x + m * a.ldx, m, n); break;
    case 2: rows_block_in_layer<G, 2, U>(a, x + m * a.ldx, m, n); break;
    case 1: rows_block_in_layer<G, 1, U>(a, x + m * a.ldx, m, n); break;
    default: break;
  }
}

// Unstructured rows for more than kExpandOnceAbove tokens: the chunks of kChunk inputs of a group
// of rows are expanded once (the group's rows side by side, so their popcount-advanced pointers
// are independent chains), into a dense buffer that stays in L1, and every tile of up to six
// tokens is multiplied with it there (each tile's float32 sums kept in `partial` across chunks).
// Expanding per tile, as rows_all_tokens does, walks each row's pointer once per tile, which
// costs more from about a dozen tokens (JOURNAL.md).
constexpr int64_t kChunk = 2048;
constexpr int64_t kExpandOnceAbove = 12;
constexpr int kTileTokens = 6;  // 4 rows x 6 tokens: 24 accumulators

// partial[t * G + r] (16 float32 lanes each) += the dot products of tokens [m, m + T) with the
// chunk's dense rows (x: token m's row at the chunk's first input; `width` inputs in the chunk).
template <int G, int T>
WS_TARGET void multiply_chunk(const uint16_t (*dense)[kChunk], const uint16_t* x, int64_t ldx,
                              int64_t width, float* partial) {
  __m512 acc[G][T];
  for (int r = 0; r < G; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_loadu_ps(partial + (t * G + r) * 16);
  for (int64_t k = 0; k < width; k += 32) {
    const __mmask32 inputs = width - k >= 32 ? ~__mmask32(0) : (uint32_t(1) << (width - k)) - 1;
    __m512i xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm512_maskz_loadu_epi16(inputs, x + t * ldx + k);
    for (int r = 0; r < G; ++r) {
      const __m512i w = _mm512_loadu_si512(dense[r] + k);
      for (int t = 0; t < T; ++t)
        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)w, (__m512bh)xv[t]);
    }
  }
  for (int r = 0; r < G; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(partial + (t * G + r) * 16, acc[r][t]);
}

// multiply_chunk for the last `left` (< T + 1) tokens of a batch.
template <int G, int T>
WS_TARGET void multiply_chunk_tail(int64_t left, const uint16_t (*dense)[kChunk], const uint16_t* x,
                                   int64_t ldx, int64_t width, float* partial) {
  if constexpr (T > 0) {
    if (left == T) return multiply_chunk<G, T>(dense, x, ldx, width, partial);
    multiply_chunk_tail<G, T - 1>(left, dense, x, ldx, width, partial);
  }
}

template <int G>
WS_TARGET void unstructured_rows_all_tokens(const RowsArgs& a, const uint16_t* x, int64_t n,
                                            float* partial) {
  const int64_t mask_bytes = (a.K + 7) / 8;
  const uint16_t* base = static_cast<const uint16_t*>(a.compressed);
  const uint16_t* end = base + a.values_count;
  alignas(64) uint16_t dense[G][kChunk];
  const uint16_t* values[G];
  int64_t next_group[G];  // how far the next group's row starts past this row's start
  for (int r = 0; r < G; ++r) {
    values[r] = base + a.row_offsets[n + r];
    next_group[r] = n + r + G < a.n_end ? a.row_offsets[n + r + G] - a.row_offsets[n + r] : 0;
  }
  const bool bounded = !loads_stay_in_layer(a.row_offsets[n + G - 1], a.K, a.values_count);
  std::fill(partial, partial + a.M * G * 16, 0.0f);
  for (int64_t k0 = 0; k0 < a.K; k0 += kChunk) {
    const int64_t width = std::min(kChunk, a.K - k0);
    const uint8_t* masks[G];
    for (int r = 0; r < G; ++r) masks[r] = a.bitmask + (n + r) * mask_bytes + k0 / 8;
    const int64_t whole = width & ~int64_t(31);
    for (int64_t k = 0; k < whole; k += 32) {  // the G rows side by side: G pointer chains
      if ((k & 63) == 0)
        for (int r = 0; r < G; ++r) {  // as rows_block: ahead in the row, and the next group's
          __builtin_prefetch(values[r] + kPrefetchAhead / 2, 0, 3);
          __builtin_prefetch(values[r] + next_group[r], 0, 3);
        }
      for (int r = 0; r < G; ++r) {
        uint32_t mask;
        std::memcpy(&mask, masks[r] + k / 8, sizeof(mask));
        const int64_t count = __builtin_popcount(mask);
        const __m512i w = bounded ? expand32<false>(mask, values[r], count, end)
                                  : expand32<false, false>(mask, values[r]);
        _mm512_storeu_si512(dense[r] + k, w);
        values[r] += count;
      }
    }
    if (whole < width)
      for (int r = 0; r < G; ++r) {  // the layer's last inputs: only their bytes
        const uint32_t mask = mask_bits(masks[r], whole, width - whole);
        const int64_t count = __builtin_popcount(mask);
        _mm512_storeu_si512(dense[r] + whole, expand32<false>(mask, values[r], count, end));
        values[r] += count;
      }
    int64_t m = 0;
    for (; m + kTileTokens <= a.M; m += kTileTokens)
      multiply_chunk<G, kTileTokens>(dense, x + m * a.ldx + k0, a.ldx, width, partial + m * G * 16);
    multiply_chunk_tail<G, kTileTokens - 1>(a.M - m, dense, x + m * a.ldx + k0, a.ldx, width,
                                            partial + m * G * 16);
  }
  for (int64_t t = 0; t < a.M; ++t)
    for (int r = 0; r < G; ++r)
      store_sum(a, t * a.ldy + n + r, n + r,
                _mm512_reduce_add_ps(_mm512_loadu_ps(partial + (t * G + r) * 16)));
}

// Rows [n_begin, n_end) for a batch of exactly T tokens, R rows side by side (then one by one).
template <int R, int T, bool U>
WS_TARGET void rows_side_by_side(const RowsArgs& a, const uint16_t* x) {
  int64_t n = a.n_begin;
  for (; n + R <= a.n_end; n += R) rows_block_in_layer<R, T, U>(a, x, 0, n);
  for (; n < a.n_end; ++n) rows_block_in_layer<1, T, U>(a, x, 0, n);
}

template <bool U>
WS_TARGET void rows_for_tokens(const RowsArgs& a) {
  const uint16_t* x = static_cast<const uint16_t*>(a.x);
  if (a.M == 1) return rows_side_by_side<8, 1, U>(a, x);
  if (a.M == 2) return rows_side_by_side<6, 2, U>(a, x);
  int64_t n = a.n_begin;
  if (U && a.M > kExpandOnceAbove) {  // the kept values expanded once per chunk, for all tokens
    std::vector<float> partial(a.M * 4 * 16);  // [M][4 rows][16 lanes] float32 sums
    for (; n + 4 <= a.n_end; n += 4) unstructured_rows_all_tokens<4>(a, x, n, partial.data());
    for (; n < a.n_end; ++n) unstructured_rows_all_tokens<1>(a, x, n, partial.data());
    return;
  }
  for (; n + 4 <= a.n_end; n += 4) rows_all_tokens<4, U>(a, x, n);
  for (; n < a.n_end; ++n) rows_all_tokens<1, U>(a, x, n);
}

}  // namespace

// Rows side by side by the number of tokens: 8 rows for one token, 6 for two, else groups of 4
// with tiles of up to four tokens: more rows in flight hide more of memory's latency
// (JOURNAL.md).
void rows_avx512_bf16(const RowsArgs& args) {
  if (args.row_offsets != nullptr) {
    rows_for_tokens<true>(args);
  } else {
    rows_for_tokens<false>(args);
  }
}

}  // namespace whisper_sparse
