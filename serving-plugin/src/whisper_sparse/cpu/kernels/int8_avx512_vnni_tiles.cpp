// W8A8 tiles on AVX-512 VNNI (int8_kernels.h): from a plan's tiles_from tokens, a block of 64
// rows is expanded once per pass over the inputs into the layout vpdpbusd multiplies without
// horizontal sums, [16 rows][4 inputs] a register (the rows' bytes by expand64, then a 16 x 16
// transpose of their 4-input words), and every token is multiplied through it: four registers
// of 16 rows by six tokens, each token's 4 inputs broadcast from memory. The weights are
// vpdpbusd's unsigned operand (w + 128, as in the rows), so each sum comes out 128 times its
// token's sum of x_q too, taken off before the scaling.
#include <algorithm>
#include <vector>

#include "int8_avx512_vnni.h"
#include "transpose16.h"

namespace whisper_sparse {
namespace {

constexpr int64_t kColumns = 4;                  // registers of 16 rows in a block
constexpr int64_t kBlockRows = 16 * kColumns;    // rows expanded at a time
constexpr int64_t kPassInputs = 2048;            // inputs a pass: the block's 128 KiB stay in L2
constexpr int64_t kPassWords = kPassInputs / 4;  // 4-input words a pass

// Sixteen expanded rows' words of one step turned into `out`'s 16 words of all 16 rows.
WS_TARGET inline void store_step(__m512 words[16], __m512i* out) {
  transpose16(words);  // now 16 words of inputs, each of all 16 rows
  for (int j = 0; j < 16; ++j) _mm512_storeu_si512(out + j, _mm512_castps_si512(words[j]));
}

// The whole steps of 16 rows, all in the layer: each row's mask and values addressed once, the
// mask read as one word (the step's addressing and a variable-length copy of its mask were
// most of the expansion's instructions).
template <bool TwoFour>
WS_TARGET void expand_whole_steps(const Int8Layer& layer, int64_t first_row, int64_t k0,
                                  int64_t steps, const int8_t** cursors, __m512i* out) {
  const __m512i shift = _mm512_set1_epi8(char(0x80));
  const int64_t mask_bytes = (layer.K + 7) / 8;
  const uint8_t* masks[16];
  const int8_t* values[16];  // a cursor per row, advanced as the rows' kernels advance theirs
  for (int r = 0; r < 16; ++r) {
    masks[r] = layer.bitmask + (first_row + r) * mask_bytes;
    values[r] = TwoFour ? layer.values + layer.row_start(first_row + r) + k0 / 2 : cursors[r];
  }
  for (int64_t step = 0; step < steps; ++step) {
    __m512 words[16];
    for (int r = 0; r < 16; ++r) {
      const uint64_t mask = whole_step_mask(masks[r], k0 + step * kStep);
      const __m512i dense = expand64<!TwoFour>(values[r], __mmask64(mask));
      words[r] = _mm512_castsi512_ps(_mm512_xor_si512(dense, shift));
    }
    store_step(words, out + step * (kStep / 4));
  }
  if (!TwoFour)
    for (int r = 0; r < 16; ++r) cursors[r] = values[r];
}

// Inputs [k0, k0 + count) of rows [n, n_end) (at most a block's) into `packed`
// ([kColumns][kPassWords][16 rows][4 inputs], shifted to unsigned bytes; rows past n_end are
// zero); an unstructured row reads from its cursor in `cursors`, which it advances.
template <bool TwoFour>
WS_TARGET void expand_pass(const Int8Layer& layer, int64_t n, int64_t n_end, int64_t k0,
                           int64_t count, const int8_t** cursors, __m512i* packed) {
  const __m512i shift = _mm512_set1_epi8(char(0x80));
  const int64_t mask_bytes = (layer.K + 7) / 8;
  for (int64_t c = 0; c < kColumns; ++c) {
    int64_t k = k0;
    if (n + 16 * c + 16 <= n_end) {
      const int64_t steps = count / kStep;
      expand_whole_steps<TwoFour>(layer, n + 16 * c, k0, steps, cursors + 16 * c,
                                  packed + c * kPassWords);
      k += steps * kStep;
    }
    for (; k < k0 + count; k += kStep) {
      const int64_t inputs = std::min(kStep, layer.K - k);
      __m512 words[16];
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t row = n + 16 * c + r;
        __m512i dense = _mm512_setzero_si512();
        if (row < n_end) {
          const int8_t* two_four = layer.values + layer.row_start(row) + k / 2;
          const int8_t*& values = TwoFour ? two_four : cursors[16 * c + r];
          const __mmask64 mask = step_mask(layer.bitmask + row * mask_bytes, k, inputs);
          dense = inputs < kStep || !TwoFour ? expand64<true>(values, mask)
                                             : expand64<false>(values, mask);
          dense = _mm512_xor_si512(dense, shift);
        }
        words[r] = _mm512_castsi512_ps(dense);
      }
      store_step(words, packed + c * kPassWords + (k - k0) / 4);
    }
  }
}

// The stored bytes of the next block of rows (its kept values, then its masks), fetched into L2
// a line at a time while the tile products keep the vector units busy and the memory idle.
struct NextBlock {
  const char* at[2] = {nullptr, nullptr};
  const char* end[2] = {nullptr, nullptr};

  NextBlock() = default;
  NextBlock(const Int8Layer& layer, int64_t first, int64_t last) {
    if (first >= last) return;
    const int64_t mask_bytes = (layer.K + 7) / 8;
    at[0] = reinterpret_cast<const char*>(layer.values + layer.row_start(first));
    end[0] = reinterpret_cast<const char*>(layer.values + layer.values_before(last));
    at[1] = reinterpret_cast<const char*>(layer.bitmask + first * mask_bytes);
    end[1] = reinterpret_cast<const char*>(layer.bitmask + last * mask_bytes);
  }
  WS_TARGET inline void fetch_line() {
    const int i = at[0] < end[0] ? 0 : 1;
    if (at[i] < end[i]) {
      __builtin_prefetch(at[i], 0, 2);  // prefetcht1: into L2
      at[i] += 64;
    }
  }
};

// sums[t * kBlockRows + row] += the products of `words` words of the packed block with the T
// (at most six) tokens from `token` (row stride ldx bytes, 4-byte words from the pass's first
// input), a line of the next block fetched each word. Each token's 4 inputs are broadcast to
// every row. The 24 sums are named variables, not an array: GCC keeps those in registers, and
// spilled an array (or a struct of four) on every word.
template <int T>
WS_TARGET void tile_products(const __m512i* packed, const int8_t* token, int64_t ldx,
                             int64_t words, int32_t* sums, NextBlock& next) {
  const __m512i zero = _mm512_setzero_si512();
  __m512i s00 = zero, s01 = zero, s02 = zero, s03 = zero, s10 = zero, s11 = zero, s12 = zero,
          s13 = zero, s20 = zero, s21 = zero, s22 = zero, s23 = zero, s30 = zero, s31 = zero,
          s32 = zero, s33 = zero, s40 = zero, s41 = zero, s42 = zero, s43 = zero, s50 = zero,
          s51 = zero, s52 = zero, s53 = zero;
  for (int64_t w = 0; w < words; ++w) {
    const __m512i w0 = _mm512_loadu_si512(packed + w);
    const __m512i w1 = _mm512_loadu_si512(packed + kPassWords + w);
    const __m512i w2 = _mm512_loadu_si512(packed + 2 * kPassWords + w);
    const __m512i w3 = _mm512_loadu_si512(packed + 3 * kPassWords + w);
    const int8_t* at = token + 4 * w;
    next.fetch_line();
#define WS_TOKEN(t)                                          \
  if constexpr (t < T) {                                     \
    int32_t word;                                            \
    std::memcpy(&word, at + t * ldx, sizeof(word));          \
    const __m512i inputs = _mm512_set1_epi32(word);          \
    s##t##0 = _mm512_dpbusd_epi32(s##t##0, w0, inputs);      \
    s##t##1 = _mm512_dpbusd_epi32(s##t##1, w1, inputs);      \
    s##t##2 = _mm512_dpbusd_epi32(s##t##2, w2, inputs);      \
    s##t##3 = _mm512_dpbusd_epi32(s##t##3, w3, inputs);      \
  }
    WS_TOKEN(0) WS_TOKEN(1) WS_TOKEN(2) WS_TOKEN(3) WS_TOKEN(4) WS_TOKEN(5)
#undef WS_TOKEN
  }
  const __m512i all[kVnniTileTokens * kColumns] = {s00, s01, s02, s03, s10, s11, s12, s13,
                                                   s20, s21, s22, s23, s30, s31, s32, s33,
                                                   s40, s41, s42, s43, s50, s51, s52, s53};
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < kColumns; ++c) {
      int32_t* at = sums + t * kBlockRows + 16 * c;
      _mm512_storeu_si512(at, _mm512_add_epi32(_mm512_loadu_si512(at), all[t * kColumns + c]));
    }
}

// bfloat16 bits of 16 float32, rounded to nearest even as round_to_bf16 (a NaN to 0x7FC0).
WS_TARGET inline __m256i bf16_bits(__m512 values) {
  const __m512i bits = _mm512_castps_si512(values);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i biased = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd);
  const __m512i rounded = _mm512_srli_epi32(biased, 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC0)));
}

// y for rows [n, n + rows) and every token from the block's sums, less the shift's share, scaled
// as store_int8_sum scales one output.
WS_TARGET void store_block(const Int8Layer& layer, const Int8Tokens& x, const Int8Output& out,
                           const int32_t* token_sums, const int32_t* sums, int64_t n,
                           int64_t rows) {
  for (int64_t c = 0; c < (rows + 15) / 16; ++c) {
    const int64_t live = std::min<int64_t>(16, rows - 16 * c), first_row = n + 16 * c;
    const __mmask16 real = __mmask16((uint32_t(1) << live) - 1);
    const __m512 row_scale = _mm512_maskz_loadu_ps(real, layer.scale + first_row);
    const __m512 bias = out.bias != nullptr ? _mm512_maskz_loadu_ps(real, out.bias + first_row)
                                            : _mm512_setzero_ps();
    for (int64_t m = 0; m < x.M; ++m) {
      const int32_t off = int32_t(uint32_t(token_sums[m]) * 128u);  // wraps as the sums may
      const __m512i sum = _mm512_sub_epi32(
          _mm512_loadu_si512(sums + m * kBlockRows + 16 * c), _mm512_set1_epi32(off));
      const __m512 token_scale = _mm512_set1_ps(x.scale[m]);
      const __m512 first = out.token_scale_first ? token_scale : row_scale;
      const __m512 second = out.token_scale_first ? row_scale : token_scale;
      const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), first);
      const __m512 y = out.bias != nullptr ? _mm512_fmadd_ps(scaled, second, bias)
                                           : _mm512_mul_ps(scaled, second);
      const int64_t at = m * out.ldy + first_row;
      if (out.y_bf16 != nullptr) {
        _mm256_mask_storeu_epi16(out.y_bf16 + at, real, bf16_bits(y));
      } else {
        _mm512_mask_storeu_ps(out.y + at, real, y);
      }
    }
  }
}

template <bool TwoFour>
WS_TARGET void tiles_of(const Int8Layer& layer, const Int8Tokens& x, const Int8Output& out,
                        int64_t n_begin, int64_t n_end) {
  std::vector<int32_t> token_sums(x.M);
  std::vector<int32_t> sums(vnni_tile_rows(x.M) * kBlockRows);
  token_sums_of(x, layer.K, token_sums.data());
  std::vector<int32_t> packed_words(kColumns * kPassWords * 16);
  __m512i* packed = reinterpret_cast<__m512i*>(packed_words.data());
  const int8_t* cursors[kBlockRows];
  for (int64_t n = n_begin; n < n_end; n += kBlockRows) {
    const int64_t rows = std::min(kBlockRows, n_end - n);
    std::fill(sums.begin(), sums.end(), 0);
    for (int64_t r = 0; r < rows; ++r) cursors[r] = layer.values + layer.row_start(n + r);
    NextBlock next(layer, n + rows, std::min(n + 2 * rows, n_end));
    for (int64_t k0 = 0; k0 < layer.K; k0 += kPassInputs) {
      const int64_t count = std::min(kPassInputs, layer.K - k0);
      expand_pass<TwoFour>(layer, n, n + rows, k0, count, cursors, packed);
      const int64_t words = (count + 3) / 4;
      for (int64_t m = 0; m < x.M; m += kVnniTileTokens) {
        const int8_t* tokens = x.x_q + m * x.ldx + k0;
        int32_t* token_sums_at = sums.data() + m * kBlockRows;
        switch (std::min(kVnniTileTokens, x.M - m)) {  // the last tokens: no padded products
          case 1: tile_products<1>(packed, tokens, x.ldx, words, token_sums_at, next); break;
          case 2: tile_products<2>(packed, tokens, x.ldx, words, token_sums_at, next); break;
          case 3: tile_products<3>(packed, tokens, x.ldx, words, token_sums_at, next); break;
          case 4: tile_products<4>(packed, tokens, x.ldx, words, token_sums_at, next); break;
          case 5: tile_products<5>(packed, tokens, x.ldx, words, token_sums_at, next); break;
          default: tile_products<6>(packed, tokens, x.ldx, words, token_sums_at, next); break;
        }
      }
    }
    store_block(layer, x, out, token_sums.data(), sums.data(), n, rows);
  }
}

}  // namespace

WS_TARGET void int8_tiles_avx512_vnni(const Int8Layer& layer, const Int8Tokens& x,
                                      const Int8Output& out, int64_t n_begin, int64_t n_end) {
  if (layer.row_offsets == nullptr) {
    tiles_of<true>(layer, x, out, n_begin, n_end);
  } else {
    tiles_of<false>(layer, x, out, n_begin, n_end);
  }
}

}  // namespace whisper_sparse
