// W8A8 rows on AVX-512 VNNI (int8_kernels.h): sixty-four bits of the bitmask are the mask of
// one vpexpandb, which places the kept int8 values of sixty-four inputs in their lanes; vpdpbusd
// sums their products with the tokens' bytes in int32, exactly. vpdpbusd multiplies unsigned
// bytes by signed ones, so the weights go in shifted (w + 128) and each sum comes out 128 times
// its token's sum of x_q too, taken off at the end (exact in int32).
#include <vector>

#include "int8_avx512_vnni.h"

namespace whisper_sparse {
namespace {

// Row r's 64 weights at input k (`count` inputs: kStep, or the row's tail), asked ahead,
// expanded, then shifted to unsigned bytes (w + 128: vpdpbusd's unsigned operand); zero for a
// row past the block's R.
template <int r, int R, bool U, bool Tail>
WS_TARGET inline __m512i row_weights(const RowsAhead<R>& ahead, const int8_t* (&values)[R],
                                     const uint8_t* const (&masks)[R], int64_t k, int64_t count) {
  if constexpr (r >= R) {
    return _mm512_setzero_si512();
  } else {
    ask_row_ahead(ahead, r, values[r], masks[r], k);
    const uint64_t bits = Tail ? uint64_t(step_mask(masks[r], k, count))
                               : whole_step_mask(masks[r], k);
    return _mm512_xor_si512(expand64<U || Tail>(values[r], __mmask64(bits)),
                            _mm512_set1_epi8(char(0x80)));
  }
}

// Token m + t's bytes at input k (zero past the call's T tokens).
template <int t, int T, bool Tail>
WS_TARGET inline __m512i token_bytes(const Int8Tokens& x, int64_t m, int64_t k, int64_t count) {
  if constexpr (t >= T) {
    return _mm512_setzero_si512();
  } else {
    const int8_t* token = x.x_q + (m + t) * x.ldx + k;
    return Tail ? _mm512_maskz_loadu_epi8(low_bits(count), token) : _mm512_loadu_si512(token);
  }
}

// One step of R rows and T tokens (at most four of each) at input k: the rows' weights
// expanded first, then multiplied by the tokens' signed bytes (as the bfloat16 row kernels).
// The sums are the caller's named variables s<row><token>: GCC spilled an array of them to the
// stack and reloaded it on every step.
#define WS_ROWS_STEP(TAIL, K, COUNT)                                                       \
  {                                                                                        \
    const __m512i x0 = token_bytes<0, T, TAIL>(x, m, K, COUNT);                            \
    const __m512i x1 = token_bytes<1, T, TAIL>(x, m, K, COUNT);                            \
    const __m512i x2 = token_bytes<2, T, TAIL>(x, m, K, COUNT);                            \
    const __m512i x3 = token_bytes<3, T, TAIL>(x, m, K, COUNT);                            \
    const __m512i w0 = row_weights<0, R, U, TAIL>(ahead, values, masks, K, COUNT);         \
    const __m512i w1 = row_weights<1, R, U, TAIL>(ahead, values, masks, K, COUNT);         \
    const __m512i w2 = row_weights<2, R, U, TAIL>(ahead, values, masks, K, COUNT);         \
    const __m512i w3 = row_weights<3, R, U, TAIL>(ahead, values, masks, K, COUNT);         \
    WS_ROW_PRODUCTS(0) WS_ROW_PRODUCTS(1) WS_ROW_PRODUCTS(2) WS_ROW_PRODUCTS(3)            \
  }
#define WS_PRODUCT(r, t) \
  if constexpr (r < R && t < T) s##r##t = _mm512_dpbusd_epi32(s##r##t, w##r, x##t);
#define WS_ROW_PRODUCTS(r) WS_PRODUCT(r, 0) WS_PRODUCT(r, 1) WS_PRODUCT(r, 2) WS_PRODUCT(r, 3)

// y for R rows from n and T tokens from m: each row walked by a cursor of its own; the shift's
// 128 * (the token's sum of x_q) taken off each sum at the end.
template <int R, int T, bool U>
WS_TARGET void rows_block(const Int8Layer& layer, const Int8Tokens& x, const Int8Output& out,
                          const int32_t* token_sums, int64_t m, int64_t n) {
  static_assert(R <= 4 && T <= 4, "a block is at most four rows by four tokens");
  const int64_t mask_bytes = (layer.K + 7) / 8, whole = layer.K & ~(kStep - 1);
  const RowsAhead<R> ahead(layer, n);
  const int8_t* values[R];
  const uint8_t* masks[R];
  for (int r = 0; r < R; ++r) {
    values[r] = layer.values + layer.row_start(n + r);
    masks[r] = layer.bitmask + (n + r) * mask_bytes;
  }
  const __m512i zero = _mm512_setzero_si512();
  __m512i s00 = zero, s01 = zero, s02 = zero, s03 = zero, s10 = zero, s11 = zero, s12 = zero,
          s13 = zero, s20 = zero, s21 = zero, s22 = zero, s23 = zero, s30 = zero, s31 = zero,
          s32 = zero, s33 = zero;
  for (int64_t k = 0; k < whole; k += kStep) WS_ROWS_STEP(false, k, kStep)
  if (whole < layer.K) WS_ROWS_STEP(true, whole, layer.K - whole)
  const __m512i sums[4][4] = {
      {s00, s01, s02, s03}, {s10, s11, s12, s13}, {s20, s21, s22, s23}, {s30, s31, s32, s33}};
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {  // in uint32: the shifted sums may wrap, their difference not
      const uint32_t off = uint32_t(token_sums[m + t]) * 128u;
      const uint32_t sum = uint32_t(_mm512_reduce_add_epi32(sums[r][t])) - off;
      store_int8_sum(out, x, layer, m + t, n + r, int32_t(sum));
    }
}
#undef WS_ROW_PRODUCTS
#undef WS_PRODUCT
#undef WS_ROWS_STEP

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
