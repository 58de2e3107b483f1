// AVX-VNNI's 256-bit vpdpbusd and vpdpwssd in AVX2 instructions, lane by lane as Intel's manual
// defines them (vpdpbusd: each int32 lane plus the four products of its unsigned bytes of b and
// signed bytes of c, no saturation), so int8_avx_vnni.cpp runs on CPUs without AVX-VNNI;
// test_cpu_int8_op.py builds it with -DWS_EMULATE_AVX_VNNI="avx_vnni_emulation.h".
#pragma once

#include <immintrin.h>

__attribute__((target("avx2"))) inline __m256i emulated_dpbusd_avx(__m256i a, __m256i b,
                                                                    __m256i c) {
  const __m256i low_bytes = _mm256_set1_epi16(0x00FF);
  // bytes 0 and 2 of each lane as int16 (b unsigned, c signed), then bytes 1 and 3
  const __m256i b_even = _mm256_and_si256(b, low_bytes), b_odd = _mm256_srli_epi16(b, 8);
  const __m256i c_even = _mm256_srai_epi16(_mm256_slli_epi16(c, 8), 8);
  const __m256i c_odd = _mm256_srai_epi16(c, 8);
  // each pair at most 2 * 255 * 128 in magnitude: vpmaddwd's int32 sums are exact
  const __m256i even = _mm256_madd_epi16(b_even, c_even), odd = _mm256_madd_epi16(b_odd, c_odd);
  return _mm256_add_epi32(a, _mm256_add_epi32(even, odd));
}

// vpdpwssd: each int32 lane plus its two products of signed int16 words of b and c, wrapping;
// vpmaddwd's one overflow (two products of -32768 * -32768) gives the same bits.
__attribute__((target("avx2"))) inline __m256i emulated_dpwssd_avx(__m256i a, __m256i b,
                                                                    __m256i c) {
  return _mm256_add_epi32(a, _mm256_madd_epi16(b, c));
}
