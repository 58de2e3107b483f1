// The AMX-BF16 tile pieces op_amx.cpp multiplies with: the tiles' configuration, the product of
// 32 rows by 32 tokens whose sums stay in four C tiles, the store of those sums into y, and the
// packing of tokens into the B tiles' layout. Included by op_amx.cpp after its WS_TARGET.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "avx512_bf16_parts.h"

namespace whisper_sparse {
namespace {

constexpr int64_t kTileRows = 16;     // rows of every tile
constexpr int64_t kTileInputs = 32;   // bfloat16 inputs per A tile row (64 bytes)
constexpr int64_t kBlockTokens = 32;  // two B tiles of 16 tokens
constexpr int64_t kSubRows = 32;      // two A tiles of 16 rows

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (float32, 16 rows x 16 tokens); 4-5: A (16 rows x 32 inputs); 6-7: B (16 input
// pairs x 16 tokens x 2).
WS_TARGET void configure_tiles() {
  TileConfig config;
  for (int tile = 0; tile < 8; ++tile) {
    config.bytes_per_row[tile] = 64;
    config.rows[tile] = kTileRows;
  }
  _tile_loadconfig(&config);
}

// The 32 rows of a (row stride lda) times the 16 or 32 tokens of b (each 16 its own tile
// column: [K / 2][16][2], the second at b + b_stride), over k_steps steps of 32 inputs, into
// c [32 rows][32 tokens] float32 (added to c's sums where accumulate).
template <int kTokenTiles>
WS_TARGET void block_product(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b,
                             int64_t b_stride, int64_t k_steps, float* c, bool accumulate) {
  constexpr int64_t c_bytes = kBlockTokens * 4;
  configure_tiles();
  if (accumulate) {
    _tile_loadd(0, c, c_bytes);
    _tile_loadd(1, c + kTileRows, c_bytes);
    _tile_loadd(2, c + kTileRows * kBlockTokens, c_bytes);
    _tile_loadd(3, c + kTileRows * kBlockTokens + kTileRows, c_bytes);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t a_bytes = lda * 2;
  for (int64_t step = 0; step < k_steps; ++step) {
    const c10::BFloat16* a_step = a + step * kTileInputs;
    const c10::BFloat16* b_step = b + step * kTileInputs * kTileRows;
    _tile_loadd(4, a_step, a_bytes);
    _tile_loadd(5, a_step + kTileRows * lda, a_bytes);
    _tile_loadd(6, b_step, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (kTokenTiles == 2) {
      _tile_loadd(7, b_step + b_stride, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, c_bytes);
  _tile_stored(2, c + kTileRows * kBlockTokens, c_bytes);
  if (kTokenTiles == 2) {
    _tile_stored(1, c + kTileRows, c_bytes);
    _tile_stored(3, c + kTileRows * kBlockTokens + kTileRows, c_bytes);
  }
}

// y[t0 + t][n + r] = bfloat16(c[r][t] + bias[n + r]) for the block's `tokens` tokens and
// `rows` rows (c as block_product leaves it; y's row stride ldy): 16 x 16 transposes.
WS_TARGET void store_sums(const float* c, const float* bias, int64_t rows, int64_t tokens,
                          c10::BFloat16* y, int64_t ldy) {
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    const int64_t count = std::min(kTileRows, rows - r0);
    const __mmask16 real = __mmask16((uint32_t(1) << count) - 1);
    for (int64_t t0 = 0; t0 < tokens; t0 += kTileRows) {
      __m512 v[16];
      for (int r = 0; r < 16; ++r) {
        const float bias_r = bias != nullptr && r < count ? bias[r0 + r] : 0.0f;
        v[r] = _mm512_add_ps(_mm512_loadu_ps(c + (r0 + r) * kBlockTokens + t0),
                             _mm512_set1_ps(bias_r));
      }
      transpose16(v);
      for (int64_t t = 0; t < std::min(kTileRows, tokens - t0); ++t) {
        _mm256_mask_storeu_epi16(y + (t0 + t) * ldy + r0, real, (__m256i)_mm512_cvtneps_pbh(v[t]));
      }
    }
  }
}

WS_TARGET void release_tiles() { _tile_release(); }

// Tokens [first, first + count) of x [M, K] as 16-token tile columns [K_padded / 2][16][2]
// (pairs of inputs as 32-bit words: a transpose of words), zero past count and past K.
WS_TARGET void pack_tokens(const c10::BFloat16* x, int64_t K, int64_t k_padded, int64_t first,
                           int64_t count, c10::BFloat16* out) {
  const auto* words = reinterpret_cast<const int32_t*>(x + first * K);
  auto* packed = reinterpret_cast<int32_t*>(out);
  const __m512i token_words = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                                  6, 5, 4, 3, 2, 1, 0),
                                                 _mm512_set1_epi32(int32_t(K / 2)));
  const __mmask16 real = count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
  for (int64_t pair = 0; pair < k_padded / 2; ++pair) {
    const __m512i row = pair < K / 2 ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real,
                                                                   token_words, words + pair, 4)
                                     : _mm512_setzero_si512();
    _mm512_store_si512(packed + pair * 16, row);
  }
}

}  // namespace
}  // namespace whisper_sparse
