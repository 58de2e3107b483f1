// The AMX tile pieces op_amx.cpp multiplies with (AMX-BF16 for bfloat16 layers, AMX-INT8 for
// W8A8 ones: a tile row is 64 bytes of either): the tiles' configuration, the product of 32 rows
// by 32 tokens whose sums stay in four C tiles, the store of those sums into y, and the packing
// of tokens into the B tiles' layout. Included by op_amx.cpp after its WS_TARGET.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "avx512_bf16_parts.h"

namespace whisper_sparse {
namespace {

constexpr int64_t kTileRows = 16;     // rows of every tile
constexpr int64_t kTileBytes = 64;    // bytes of a tile row: 32 bfloat16 or 64 int8 inputs
constexpr int64_t kBlockTokens = 32;  // two B tiles of 16 tokens
constexpr int64_t kSubRows = 32;      // two A tiles of 16 rows

// The tile product: bfloat16 pairs summed in float32, or int8 quads summed in int32 (exact).
enum class TileDot { bf16, int8 };

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (float32 or int32, 16 rows x 16 tokens); 4-5: A (16 rows x 64 bytes); 6-7: B
// (16 words of inputs x 16 tokens x 4 bytes).
WS_TARGET void configure_tiles() {
  TileConfig config;
  for (int tile = 0; tile < 8; ++tile) {
    config.bytes_per_row[tile] = 64;
    config.rows[tile] = kTileRows;
  }
  _tile_loadconfig(&config);
}

// The 32 rows of a (row stride lda bytes) times the 16 or 32 tokens of b (each 16 its own tile
// column: [K words][16][4 bytes], the second at b + b_stride bytes), over k_steps steps of 64
// bytes, into c [32 rows][32 tokens] (added to c's sums where accumulate).
template <int kTokenTiles, TileDot kDot>
WS_TARGET void block_product(const void* a, int64_t lda, const void* b, int64_t b_stride,
                             int64_t k_steps, void* c_sums, bool accumulate) {
  constexpr int64_t c_bytes = kBlockTokens * 4;
  char* c = static_cast<char*>(c_sums);
  constexpr int64_t c_lower = kTileRows * c_bytes, c_right = kTileRows * 4;
  configure_tiles();
  if (accumulate) {
    _tile_loadd(0, c, c_bytes);
    _tile_loadd(1, c + c_right, c_bytes);
    _tile_loadd(2, c + c_lower, c_bytes);
    _tile_loadd(3, c + c_lower + c_right, c_bytes);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t step = 0; step < k_steps; ++step) {
    const char* a_step = static_cast<const char*>(a) + step * kTileBytes;
    const char* b_step = static_cast<const char*>(b) + step * kTileBytes * kTileRows;
    _tile_loadd(4, a_step, lda);
    _tile_loadd(5, a_step + kTileRows * lda, lda);
    _tile_loadd(6, b_step, kTileBytes);
    if constexpr (kDot == TileDot::int8) {
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(2, 5, 6);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
    }
    if (kTokenTiles == 2) {
      _tile_loadd(7, b_step + b_stride, kTileBytes);
      if constexpr (kDot == TileDot::int8) {
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(3, 5, 7);
      } else {
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  _tile_stored(0, c, c_bytes);
  _tile_stored(2, c + c_lower, c_bytes);
  if (kTokenTiles == 2) {
    _tile_stored(1, c + c_right, c_bytes);
    _tile_stored(3, c + c_lower + c_right, c_bytes);
  }
}

// y[t0 + t][n + r] = row_values(r, t0)[t] for the block's `tokens` tokens and `rows` rows, in
// bfloat16 (y_bf16) or float32 (y; row stride ldy): 16 x 16 transposes of the float32 values
// row_values gives for 16 tokens of one row (from c as block_product leaves it).
template <class RowValues>
WS_TARGET void store_rows(RowValues row_values, int64_t rows, int64_t tokens, uint16_t* y_bf16,
                          float* y, int64_t ldy) {
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    const int64_t count = std::min(kTileRows, rows - r0);
    const __mmask16 real = __mmask16((uint32_t(1) << count) - 1);
    for (int64_t t0 = 0; t0 < tokens; t0 += kTileRows) {
      __m512 v[16];
      for (int r = 0; r < 16; ++r) v[r] = row_values(r0 + r, t0);
      transpose16(v);
      for (int64_t t = 0; t < std::min(kTileRows, tokens - t0); ++t) {
        if (y_bf16 != nullptr) {
          _mm256_mask_storeu_epi16(y_bf16 + (t0 + t) * ldy + r0, real,
                                   (__m256i)_mm512_cvtneps_pbh(v[t]));
        } else {
          _mm512_mask_storeu_ps(y + (t0 + t) * ldy + r0, real, v[t]);
        }
      }
    }
  }
}

WS_TARGET void release_tiles() { _tile_release(); }

// Tokens [first, first + count) of x (token_words 32-bit words a token: bfloat16 pairs or int8
// quads of inputs) as 16-token tile columns [padded_words][16] words (a transpose of words),
// zero past count and past token_words.
WS_TARGET void pack_tokens(const int32_t* words, int64_t token_words, int64_t padded_words,
                           int64_t first, int64_t count, int32_t* packed) {
  words += first * token_words;
  const __m512i token_starts = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(int32_t(token_words)));
  const __mmask16 real = count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
  for (int64_t word = 0; word < padded_words; ++word) {
    const __m512i column = word < token_words
                               ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real,
                                                             token_starts, words + word, 4)
                               : _mm512_setzero_si512();
    _mm512_store_si512(packed + word * 16, column);
  }
}

}  // namespace
}  // namespace whisper_sparse
