// A 16 x 16 transpose of 32-bit words in sixteen AVX-512 registers, which turns 16 rows' words
// into 16 registers of one word of every row: shared by the bfloat16 kernels
// (avx512_bf16_parts.h) and the W8A8 VNNI tiles (int8_avx512_vnni_tiles.cpp). Included after
// the including file's WS_TARGET preamble.
#pragma once

namespace whisper_sparse {
namespace {

// v[i] (16 lanes of 32 bits) becomes column i of the 16 x 16 matrix whose rows v held.
WS_TARGET inline void transpose16(__m512 v[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 2; ++j) {
      const __m512d a = _mm512_castps_pd(t[4 * i + j]), b = _mm512_castps_pd(t[4 * i + j + 2]);
      v[4 * i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      v[4 * i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(v[8 * i + j], v[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_f32x4(v[8 * i + j], v[8 * i + j + 4], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    v[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    v[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
  }
}

}  // namespace
}  // namespace whisper_sparse
