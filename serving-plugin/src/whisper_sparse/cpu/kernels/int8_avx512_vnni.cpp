// W8A8 rows on AVX-512 VNNI (int8_kernels.h): sixty-four bits of the bitmask are the mask of
// one vpexpandb, which places the kept int8 values of sixty-four inputs in their lanes; vpdpbusd
// sums their products with the tokens' bytes in int32, exactly. vpdpbusd multiplies unsigned
// bytes by signed ones, so the weights go in shifted (w + 128) and each sum comes out 128 times
// its token's sum of x_q too, taken off at the end (exact in int32).
#include <vector>

#include "int8_avx512_vnni.h"

namespace whisper_sparse {
namespace {

// One step of R rows and T tokens at input k: `count` inputs (kStep, or the row's tail). The
// rows' weights are expanded, then shifted to unsigned bytes (w + 128: vpdpbusd's unsigned
// operand), then multiplied by the tokens' signed bytes (as the bfloat16 row kernels: expanded
// first, multiplied after).
template <int R, int T, bool U, bool Tail>
WS_TARGET inline void rows_step(const Int8Tokens& x, int64_t m, int64_t k, int64_t count,
                                const RowsAhead<R>& ahead, const int8_t* (&values)[R],
                                const uint8_t* const (&masks)[R], __m512i (&acc)[R][T]) {
  const __m512i shift = _mm512_set1_epi8(char(0x80));
  __m512i xv[T];
  for (int t = 0; t < T; ++t) {
    const int8_t* token = x.x_q + (m + t) * x.ldx + k;
    xv[t] = Tail ? _mm512_maskz_loadu_epi8(low_bits(count), token) : _mm512_loadu_si512(token);
  }
  __m512i w[R];
  for (int r = 0; r < R; ++r) {
    ask_row_ahead(ahead, r, values[r], masks[r], k);
    uint64_t bits;
    if (Tail) {
      bits = step_mask(masks[r], k, count);
    } else {
      std::memcpy(&bits, masks[r] + k / 8, sizeof(bits));
    }
    w[r] = _mm512_xor_si512(expand64<U || Tail>(values[r], __mmask64(bits)), shift);
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], w[r], xv[t]);
}

// y for R rows from n and T tokens from m: each row walked by a cursor of its own; the shift's
// 128 * (the token's sum of x_q) taken off each sum at the end.
template <int R, int T, bool U>
WS_TARGET void rows_block(const Int8Layer& layer, const Int8Tokens& x, const Int8Output& out,
                          const int32_t* token_sums, int64_t m, int64_t n) {
  const int64_t mask_bytes = (layer.K + 7) / 8, whole = layer.K & ~(kStep - 1);
  const RowsAhead<R> ahead(layer, n);
  const int8_t* values[R];
  const uint8_t* masks[R];
  __m512i acc[R][T];
  for (int r = 0; r < R; ++r) {
    values[r] = layer.values + layer.row_start(n + r);
    masks[r] = layer.bitmask + (n + r) * mask_bytes;
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_si512();
  }
  for (int64_t k = 0; k < whole; k += kStep)
    rows_step<R, T, U, false>(x, m, k, kStep, ahead, values, masks, acc);
  if (whole < layer.K)
    rows_step<R, T, U, true>(x, m, whole, layer.K - whole, ahead, values, masks, acc);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {  // in uint32: the shifted sums may wrap, their difference not
      const uint32_t off = uint32_t(token_sums[m + t]) * 128u;
      const uint32_t sum = uint32_t(_mm512_reduce_add_epi32(acc[r][t])) - off;
      store_int8_sum(out, x, layer, m + t, n + r, int32_t(sum));
    }
}

// Every token of rows [n, n + R): tiles of up to four tokens pass over the rows while they are
// in cache, so the weights are read from memory once.
template <int R, bool U>
WS_TARGET void rows_all_tokens(const Int8Layer& layer, const Int8Tokens& x, const Int8Output& out,
                               const int32_t* sums, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= x.M; m += 4) rows_block<R, 4, U>(layer, x, out, sums, m, n);
  switch (x.M - m) {
    case 3: rows_block<R, 3, U>(layer, x, out, sums, m, n); break;
    case 2: rows_block<R, 2, U>(layer, x, out, sums, m, n); break;
    case 1: rows_block<R, 1, U>(layer, x, out, sums, m, n); break;
    default: break;
  }
}

}  // namespace

WS_TARGET void int8_rows_avx512_vnni(const Int8Layer& layer, const Int8Tokens& x, const Int8Output& out,
                           int64_t n_begin, int64_t n_end) {
  std::vector<int32_t> sums(x.M);
  token_sums_of(x, layer.K, sums.data());
  int64_t n = n_begin;
  if (layer.row_offsets != nullptr) {
    for (; n + 4 <= n_end; n += 4) rows_all_tokens<4, true>(layer, x, out, sums.data(), n);
    for (; n < n_end; ++n) rows_all_tokens<1, true>(layer, x, out, sums.data(), n);
  } else {
    for (; n + 4 <= n_end; n += 4) rows_all_tokens<4, false>(layer, x, out, sums.data(), n);
    for (; n < n_end; ++n) rows_all_tokens<1, false>(layer, x, out, sums.data(), n);
  }
}

WS_TARGET void int8_quantize_avx512(const Int8Quantize& q, int64_t m_begin, int64_t m_end) {
  quantize_int8_tokens(q, m_begin, m_end);
}

WS_TARGET void int8_decompress_avx512(const Int8Layer& layer, int8_t* out, int64_t out_stride,
                                      int64_t n_begin, int64_t n_end) {
  const int64_t mask_bytes = (layer.K + 7) / 8;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* values = layer.values + layer.row_start(n);
    const uint8_t* mask = layer.bitmask + n * mask_bytes;
    int8_t* row = out + (n - n_begin) * out_stride;
    int64_t k = 0;
    for (; k < layer.K; k += kStep) {
      const int64_t count = layer.K - k < kStep ? layer.K - k : kStep;
      __builtin_prefetch(values + kRowValuesAhead, 0, 3);  // past the end: the next row, read next
      const __m512i dense = expand64(values, step_mask(mask, k, count));
      _mm512_mask_storeu_epi8(row + k, low_bits(out_stride - k), dense);
    }
    if (k < out_stride) std::memset(row + k, 0, out_stride - k);
  }
}

}  // namespace whisper_sparse
