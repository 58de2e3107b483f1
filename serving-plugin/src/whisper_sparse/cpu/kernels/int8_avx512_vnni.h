// The pieces of the W8A8 kernels on AVX-512 VNNI that the rows (int8_avx512_vnni.cpp) and the
// tiles (int8_avx512_vnni_tiles.cpp) share: the target (or, for the tests, the emulated
// intrinsics), the masks of a step of 64 inputs, the expansion of a row's kept values (vpermb
// for a 2:4 row's whole steps, else vpexpandb), and each token's sum of x_q (the correction of
// vpdpbusd's unsigned operand).
#pragma once

#include <cstring>

#include "int8_kernels.h"

#ifdef WS_EMULATE_INTRINSICS  // plain C++ intrinsics: the tests run this file on any CPU
#include WS_EMULATE_INTRINSICS
#define WS_TARGET
#else
#include <immintrin.h>
#define WS_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vbmi2,avx512vnni,fma,popcnt")))
#endif

namespace whisper_sparse {
namespace {

constexpr int64_t kStep = 64;            // inputs per expansion: a register of bytes

inline __mmask64 low_bits(int64_t count) {
  return count >= 64 ? ~__mmask64(0) : (__mmask64(1) << count) - 1;
}

// The mask of `count` (at most 64) inputs of a bitmask row from input k on (k a multiple of 8).
inline __mmask64 step_mask(const uint8_t* row, int64_t k, int64_t count) {
  uint64_t mask = 0;
  std::memcpy(&mask, row + k / 8, (count + 7) / 8);
  return __mmask64(mask) & low_bits(count);
}

// The mask of a whole step (64 inputs) of a bitmask row from input k on, read as one word.
inline uint64_t whole_step_mask(const uint8_t* row, int64_t k) {
  uint64_t mask;
  std::memcpy(&mask, row + k / 8, sizeof(mask));
  return mask;
}

// The 64 dense weights of a whole step of a 2:4 row from its 32 kept values: vpermb places
// them, each group of 4 inputs taking its two values (2g and 2g + 1) in its two kept lanes. A
// kept lane takes the second where a kept lane lies before it in its group: always in lane 3,
// in lane 1 where lane 0 is kept, in lane 2 where lane 0 or 1 is. vpexpandb did the same in
// about 2.5 times the cycles on Zen 5.
WS_TARGET inline __m512i expand_two_four(const int8_t* values, __mmask64 mask) {
  alignas(64) static constexpr int8_t kFirstOfPair[64] = {
      0,  0,  0,  0,  2,  2,  2,  2,  4,  4,  4,  4,  6,  6,  6,  6,  8,  8,  8,  8,  10, 10,
      10, 10, 12, 12, 12, 12, 14, 14, 14, 14, 16, 16, 16, 16, 18, 18, 18, 18, 20, 20, 20, 20,
      22, 22, 22, 22, 24, 24, 24, 24, 26, 26, 26, 26, 28, 28, 28, 28, 30, 30, 30, 30};
  const uint64_t kept = mask;
  const uint64_t second = ((kept << 1) & 0x6666666666666666ull) |
                          ((kept << 2) & 0x4444444444444444ull) | 0x8888888888888888ull;
  const __m512i first = _mm512_load_si512(kFirstOfPair);
  const __m512i index = _mm512_mask_add_epi8(first, __mmask64(second), first, _mm512_set1_epi8(1));
  const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values));
  return _mm512_maskz_permutexvar_epi8(mask, index, _mm512_castsi256_si512(pairs));
}

// Sixty-four dense weights from a row's cursor over its kept values, which it advances: a 2:4
// row's whole step holds 32 values (U false: expand_two_four); else as many as the mask's bits,
// expand-loaded from memory (on Zen 5 about 1.25 times as fast as placing them by vpermb after
// counting each lane's kept lanes below it; on the AMX Xeon 25 % fewer cycles than a masked
// load then vpexpandb).
template <bool U = true>
WS_TARGET inline __m512i expand64(const int8_t*& values, __mmask64 mask) {
  if constexpr (!U) {
    const __m512i dense = expand_two_four(values, mask);
    values += kStep / 2;
    return dense;
  }
  const __m512i dense = _mm512_maskz_expandloadu_epi8(mask, values);
  values += __builtin_popcountll(mask);
  return dense;
}

// Each token's sum of x_q (vpdpbusd of ones by the tokens' bytes).
WS_TARGET void token_sums_of(const Int8Tokens& x, int64_t K, int32_t* sums) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t m = 0; m < x.M; ++m) {
    __m512i acc = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += kStep) {
      const int64_t count = K - k < kStep ? K - k : kStep;
      const __m512i token = _mm512_maskz_loadu_epi8(low_bits(count), x.x_q + m * x.ldx + k);
      acc = _mm512_dpbusd_epi32(acc, ones, token);
    }
    sums[m] = _mm512_reduce_add_epi32(acc);
  }
}

}  // namespace
}  // namespace whisper_sparse
