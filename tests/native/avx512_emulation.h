// The AVX-512 intrinsics the 2:4 CPU kernels use, in plain C++, lane by lane as Intel's
// manual defines them: the kernels' AVX-512 sources compiled with this header
// (-DWS_EMULATE_INTRINSICS='"avx512_emulation.h"') run on any x86 CPU, so the tests check
// their logic (lanes, masks, tails) where the CPU has no AVX-512 (check_kernels.cpp).
#pragma once

#include <cstdint>
#include <cstring>

struct __m512 { float f[16]; };
struct __m512d { double d[8]; };
struct __m512i { union { uint8_t u8[64]; uint16_t u16[32]; uint32_t u32[16]; }; };
struct __m256 { float f[8]; };
struct __m256i { union { uint8_t u8[32]; uint16_t u16[16]; }; };
struct __m128i { union { uint8_t u8[16]; uint16_t u16[8]; }; };
typedef __m512i __m512bh;  // 32 bfloat16 lanes
typedef __m256i __m256bh;  // 16 bfloat16 lanes
typedef uint8_t __mmask8;
typedef uint16_t __mmask16;
typedef uint32_t __mmask32;

inline float bf16_to_float(uint16_t bits) {
  uint32_t wide = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

inline __m512 _mm512_setzero_ps() { return __m512{}; }

inline __m512 _mm512_loadu_ps(const void* p) {
  __m512 r;
  std::memcpy(r.f, p, sizeof(r.f));
  return r;
}

inline __m512 _mm512_maskz_loadu_ps(__mmask16 k, const void* p) {
  __m512 r{};
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) std::memcpy(&r.f[i], static_cast<const float*>(p) + i, 4);
  return r;
}

inline __m512 _mm512_fmadd_ps(__m512 a, __m512 b, __m512 c) {
  for (int i = 0; i < 16; ++i) c.f[i] = __builtin_fmaf(a.f[i], b.f[i], c.f[i]);
  return c;
}

inline float _mm512_reduce_add_ps(__m512 a) {  // pairwise, as the compiler's sequence adds
  for (int width = 8; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) a.f[i] = a.f[i] + a.f[i + width];
  return a.f[0];
}

inline __m512 _mm512_maskz_expandloadu_ps(__mmask16 k, const void* p) {
  __m512 r{};
  const float* source = static_cast<const float*>(p);
  for (int i = 0, j = 0; i < 16; ++i)
    if (k >> i & 1) r.f[i] = source[j++];
  return r;
}

inline __m256i _mm256_maskz_expandloadu_epi16(__mmask16 k, const void* p) {
  __m256i r{};
  const uint16_t* source = static_cast<const uint16_t*>(p);
  for (int i = 0, j = 0; i < 16; ++i)
    if (k >> i & 1) r.u16[i] = source[j++];
  return r;
}

inline __m512i _mm512_maskz_expandloadu_epi16(__mmask32 k, const void* p) {
  __m512i r{};
  const uint16_t* source = static_cast<const uint16_t*>(p);
  for (int i = 0, j = 0; i < 32; ++i)
    if (k >> i & 1) r.u16[i] = source[j++];
  return r;
}

inline __m512i _mm512_cvtepu16_epi32(__m256i a) {
  __m512i r;
  for (int i = 0; i < 16; ++i) r.u32[i] = a.u16[i];
  return r;
}

inline __m512i _mm512_slli_epi32(__m512i a, unsigned count) {
  for (int i = 0; i < 16; ++i) a.u32[i] = count > 31 ? 0 : a.u32[i] << count;
  return a;
}

inline __m512 _mm512_castsi512_ps(__m512i a) {
  __m512 r;
  std::memcpy(r.f, a.u8, 64);
  return r;
}

inline void _mm512_mask_storeu_ps(void* p, __mmask16 k, __m512 a) {
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) std::memcpy(static_cast<float*>(p) + i, &a.f[i], 4);
}

inline void _mm512_mask_storeu_epi16(void* p, __mmask32 k, __m512i a) {
  for (int i = 0; i < 32; ++i)
    if (k >> i & 1) std::memcpy(static_cast<uint16_t*>(p) + i, &a.u16[i], 2);
}

inline __m512i _mm512_loadu_si512(const void* p) {
  __m512i r;
  std::memcpy(r.u8, p, 64);
  return r;
}

inline __m512i _mm512_maskz_loadu_epi16(__mmask32 k, const void* p) {
  __m512i r{};
  for (int i = 0; i < 32; ++i)
    if (k >> i & 1) std::memcpy(&r.u16[i], static_cast<const uint16_t*>(p) + i, 2);
  return r;
}

// vdpbf16ps: per float32 lane, the products of its two bfloat16 pairs added to it
inline __m512 _mm512_dpbf16_ps(__m512 acc, __m512bh a, __m512bh b) {
  for (int i = 0; i < 16; ++i) {
    acc.f[i] += bf16_to_float(a.u16[2 * i + 1]) * bf16_to_float(b.u16[2 * i + 1]);
    acc.f[i] += bf16_to_float(a.u16[2 * i]) * bf16_to_float(b.u16[2 * i]);
  }
  return acc;
}

// ---- plain loads and casts (the upper lanes of a widening cast are zero here; the kernels
// never read them)
inline __m256i _mm256_loadu_si256(const void* p) {
  __m256i r;
  std::memcpy(r.u8, p, 32);
  return r;
}

inline __m128i _mm_loadu_si128(const void* p) {
  __m128i r;
  std::memcpy(r.u8, p, 16);
  return r;
}

inline __m256 _mm256_loadu_ps(const void* p) {
  __m256 r;
  std::memcpy(r.f, p, 32);
  return r;
}

inline __m128i _mm_maskz_loadu_epi16(__mmask8 k, const void* p) {
  __m128i r{};
  for (int i = 0; i < 8; ++i)
    if (k >> i & 1) std::memcpy(&r.u16[i], static_cast<const uint16_t*>(p) + i, 2);
  return r;
}

inline __m512i _mm512_castsi256_si512(__m256i a) {
  __m512i r{};
  std::memcpy(r.u8, a.u8, 32);
  return r;
}

inline __m256i _mm256_castsi128_si256(__m128i a) {
  __m256i r{};
  std::memcpy(r.u8, a.u8, 16);
  return r;
}

inline __m512 _mm512_castps256_ps512(__m256 a) {
  __m512 r{};
  std::memcpy(r.f, a.f, 32);
  return r;
}

inline __m512d _mm512_castps_pd(__m512 a) {
  __m512d r;
  std::memcpy(r.d, a.f, 64);
  return r;
}

inline __m512 _mm512_castpd_ps(__m512d a) {
  __m512 r;
  std::memcpy(r.f, a.d, 64);
  return r;
}

inline __m512i _mm512_setzero_si512() { return __m512i{}; }

inline __m512i _mm512_set1_epi32(int value) {
  __m512i r;
  for (int i = 0; i < 16; ++i) r.u32[i] = uint32_t(value);
  return r;
}

inline void _mm512_storeu_si512(void* p, __m512i a) { std::memcpy(p, a.u8, 64); }

inline void _mm512_storeu_ps(void* p, __m512 a) { std::memcpy(p, a.f, 64); }

inline void _mm256_mask_storeu_epi16(void* p, __mmask16 k, __m256i a) {
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) std::memcpy(static_cast<uint16_t*>(p) + i, &a.u16[i], 2);
}

// ---- expands in registers: the low elements of `a`, in order, to the lanes `k` marks
inline __m512i _mm512_maskz_expand_epi16(__mmask32 k, __m512i a) {
  __m512i r{};
  for (int i = 0, j = 0; i < 32; ++i)
    if (k >> i & 1) r.u16[i] = a.u16[j++];
  return r;
}

inline __m512i _mm512_mask_expand_epi16(__m512i src, __mmask32 k, __m512i a) {
  __m512i r = src;
  for (int i = 0, j = 0; i < 32; ++i)
    if (k >> i & 1) r.u16[i] = a.u16[j++];
  return r;
}

inline __m256i _mm256_maskz_expand_epi16(__mmask16 k, __m256i a) {
  __m256i r{};
  for (int i = 0, j = 0; i < 16; ++i)
    if (k >> i & 1) r.u16[i] = a.u16[j++];
  return r;
}

inline __m512 _mm512_maskz_expand_ps(__mmask16 k, __m512 a) {
  __m512 r{};
  for (int i = 0, j = 0; i < 16; ++i)
    if (k >> i & 1) r.f[i] = a.f[j++];
  return r;
}

// ---- arithmetic and shuffles of the blocked GEMM's stores
inline __m512 _mm512_add_ps(__m512 a, __m512 b) {
  for (int i = 0; i < 16; ++i) a.f[i] += b.f[i];
  return a;
}

inline __m512 _mm512_unpacklo_ps(__m512 a, __m512 b) {  // per 128-bit lane: a0 b0 a1 b1
  __m512 r;
  for (int lane = 0; lane < 4; ++lane)
    for (int i = 0; i < 2; ++i) {
      r.f[4 * lane + 2 * i] = a.f[4 * lane + i];
      r.f[4 * lane + 2 * i + 1] = b.f[4 * lane + i];
    }
  return r;
}

inline __m512 _mm512_unpackhi_ps(__m512 a, __m512 b) {  // per 128-bit lane: a2 b2 a3 b3
  __m512 r;
  for (int lane = 0; lane < 4; ++lane)
    for (int i = 0; i < 2; ++i) {
      r.f[4 * lane + 2 * i] = a.f[4 * lane + 2 + i];
      r.f[4 * lane + 2 * i + 1] = b.f[4 * lane + 2 + i];
    }
  return r;
}

inline __m512d _mm512_unpacklo_pd(__m512d a, __m512d b) {  // per 128-bit lane: a0 b0
  __m512d r;
  for (int lane = 0; lane < 4; ++lane) {
    r.d[2 * lane] = a.d[2 * lane];
    r.d[2 * lane + 1] = b.d[2 * lane];
  }
  return r;
}

inline __m512d _mm512_unpackhi_pd(__m512d a, __m512d b) {  // per 128-bit lane: a1 b1
  __m512d r;
  for (int lane = 0; lane < 4; ++lane) {
    r.d[2 * lane] = a.d[2 * lane + 1];
    r.d[2 * lane + 1] = b.d[2 * lane + 1];
  }
  return r;
}

// 128-bit lanes: two of a (chosen by imm bits 0-3), then two of b (bits 4-7)
inline __m512 _mm512_shuffle_f32x4(__m512 a, __m512 b, int imm) {
  __m512 r;
  for (int lane = 0; lane < 4; ++lane) {
    const __m512& from = lane < 2 ? a : b;
    const int pick = (imm >> (2 * lane)) & 3;
    std::memcpy(&r.f[4 * lane], &from.f[4 * pick], 16);
  }
  return r;
}

// vcvtneps2bf16: round to nearest even (a NaN stays a quiet NaN)
inline __m256bh _mm512_cvtneps_pbh(__m512 a) {
  __m256bh r;
  for (int i = 0; i < 16; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &a.f[i], 4);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
      r.u16[i] = uint16_t((bits >> 16) | 0x40);
    } else {
      r.u16[i] = uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1)) >> 16);
    }
  }
  return r;
}

// ---- the 2:4 GEMM's layout and permutes

inline __m128i _mm_cvtsi64_si128(long long a) {
  __m128i r{};
  std::memcpy(r.u8, &a, 8);
  return r;
}

inline __m128i _mm_set1_epi8(char value) {
  __m128i r;
  std::memset(r.u8, static_cast<unsigned char>(value), 16);
  return r;
}

inline __m128i _mm_and_si128(__m128i a, __m128i b) {
  for (int i = 0; i < 16; ++i) a.u8[i] &= b.u8[i];
  return a;
}

inline __m128i _mm_srli_epi16(__m128i a, int count) {
  for (int i = 0; i < 8; ++i) a.u16[i] = count > 15 ? 0 : uint16_t(a.u16[i] >> count);
  return a;
}

inline __m128i _mm_unpacklo_epi8(__m128i a, __m128i b) {  // a0 b0 a1 b1 ... a7 b7
  __m128i r;
  for (int i = 0; i < 8; ++i) {
    r.u8[2 * i] = a.u8[i];
    r.u8[2 * i + 1] = b.u8[i];
  }
  return r;
}

inline __m512i _mm512_cvtepu8_epi32(__m128i a) {
  __m512i r;
  for (int i = 0; i < 16; ++i) r.u32[i] = a.u8[i];
  return r;
}

inline __m512i _mm512_load_si512(const void* p) { return _mm512_loadu_si512(p); }

inline __m512i _mm512_permutexvar_epi32(__m512i index, __m512i a) {
  __m512i r;
  for (int i = 0; i < 16; ++i) r.u32[i] = a.u32[index.u32[i] & 15];
  return r;
}

inline __m512i _mm512_permutexvar_epi16(__m512i index, __m512i a) {
  __m512i r;
  for (int i = 0; i < 32; ++i) r.u16[i] = a.u16[index.u16[i] & 31];
  return r;
}

inline __m512i _mm512_maskz_loadu_epi32(__mmask16 k, const void* p) {
  __m512i r{};
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) std::memcpy(&r.u32[i], static_cast<const uint32_t*>(p) + i, 4);
  return r;
}

inline __m512i _mm512_set1_epi64(long long value) {
  __m512i r;
  for (int i = 0; i < 8; ++i) std::memcpy(&r.u8[8 * i], &value, 8);
  return r;
}

inline __m512i _mm512_castps_si512(__m512 a) {
  __m512i r;
  std::memcpy(r.u8, a.f, 64);
  return r;
}

inline __m256i _mm256_maskz_loadu_epi16(__mmask16 k, const void* p) {
  __m256i r{};
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) std::memcpy(&r.u16[i], static_cast<const uint16_t*>(p) + i, 2);
  return r;
}

// The byte intrinsics of the W8A8 kernels (int8_avx512_vnni.cpp), VNNI's vpdpbusd among them.
typedef uint64_t __mmask64;

inline __m512i _mm512_set1_epi8(char value) {
  __m512i r;
  std::memset(r.u8, static_cast<uint8_t>(value), 64);
  return r;
}

inline __m512i _mm512_xor_si512(__m512i a, __m512i b) {
  for (int i = 0; i < 64; ++i) a.u8[i] ^= b.u8[i];
  return a;
}

inline __m512i _mm512_maskz_loadu_epi8(__mmask64 k, const void* p) {
  __m512i r{};
  for (int i = 0; i < 64; ++i)
    if (k >> i & 1) r.u8[i] = static_cast<const uint8_t*>(p)[i];
  return r;
}

inline __m512i _mm512_maskz_expand_epi8(__mmask64 k, __m512i a) {
  __m512i r{};
  for (int i = 0, j = 0; i < 64; ++i)
    if (k >> i & 1) r.u8[i] = a.u8[j++];
  return r;
}

inline void _mm512_mask_storeu_epi8(void* p, __mmask64 k, __m512i a) {
  for (int i = 0; i < 64; ++i)
    if (k >> i & 1) static_cast<uint8_t*>(p)[i] = a.u8[i];
}

// Per 32-bit lane: src plus the four products of a's unsigned bytes by b's signed ones, in
// int32 without saturation (wrapping).
inline __m512i _mm512_dpbusd_epi32(__m512i src, __m512i a, __m512i b) {
  for (int i = 0; i < 16; ++i) {
    uint32_t sum = src.u32[i];
    for (int j = 0; j < 4; ++j)
      sum += uint32_t(int32_t(a.u8[4 * i + j]) * int32_t(int8_t(b.u8[4 * i + j])));
    src.u32[i] = sum;
  }
  return src;
}

inline int32_t _mm512_reduce_add_epi32(__m512i a) {
  uint32_t sum = 0;
  for (int i = 0; i < 16; ++i) sum += a.u32[i];
  return int32_t(sum);
}

inline __m512i _mm512_maskz_expandloadu_epi8(__mmask64 k, const void* p) {
  __m512i r{};
  const uint8_t* source = static_cast<const uint8_t*>(p);
  for (int i = 0, j = 0; i < 64; ++i)
    if (k >> i & 1) r.u8[i] = source[j++];
  return r;
}

// The W8A8 VNNI tiles' sums and their scaling (int8_avx512_vnni_tiles.cpp).
inline __m512i _mm512_add_epi32(__m512i a, __m512i b) {  // wrapping
  for (int i = 0; i < 16; ++i) a.u32[i] += b.u32[i];
  return a;
}

inline __m512i _mm512_sub_epi32(__m512i a, __m512i b) {  // wrapping
  for (int i = 0; i < 16; ++i) a.u32[i] -= b.u32[i];
  return a;
}

inline __m512i _mm512_srli_epi32(__m512i a, unsigned count) {
  for (int i = 0; i < 16; ++i) a.u32[i] = count > 31 ? 0 : a.u32[i] >> count;
  return a;
}

inline __m512i _mm512_and_si512(__m512i a, __m512i b) {
  for (int i = 0; i < 64; ++i) a.u8[i] &= b.u8[i];
  return a;
}

inline __mmask16 _mm512_cmpgt_epu32_mask(__m512i a, __m512i b) {
  __mmask16 k = 0;
  for (int i = 0; i < 16; ++i)
    if (a.u32[i] > b.u32[i]) k |= __mmask16(1u << i);
  return k;
}

inline __m512i _mm512_mask_blend_epi32(__mmask16 k, __m512i a, __m512i b) {  // b where k
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) a.u32[i] = b.u32[i];
  return a;
}

inline __m256i _mm512_cvtepi32_epi16(__m512i a) {  // truncating
  __m256i r;
  for (int i = 0; i < 16; ++i) r.u16[i] = uint16_t(a.u32[i]);
  return r;
}

inline __m512 _mm512_cvtepi32_ps(__m512i a) {  // rounded to nearest even, as float(int32)
  __m512 r;
  for (int i = 0; i < 16; ++i) r.f[i] = float(int32_t(a.u32[i]));
  return r;
}

inline __m512 _mm512_mul_ps(__m512 a, __m512 b) {
  for (int i = 0; i < 16; ++i) a.f[i] = a.f[i] * b.f[i];
  return a;
}

inline __m512 _mm512_set1_ps(float value) {
  __m512 r;
  for (float& f : r.f) f = value;
  return r;
}

// The 2:4 expansion of the W8A8 kernels (int8_avx512_vnni.h): vpermb and a masked byte add.
inline __m512i _mm512_mask_add_epi8(__m512i src, __mmask64 k, __m512i a, __m512i b) {
  for (int i = 0; i < 64; ++i)
    if (k >> i & 1) src.u8[i] = uint8_t(a.u8[i] + b.u8[i]);
  return src;
}

inline __m512i _mm512_maskz_permutexvar_epi8(__mmask64 k, __m512i index, __m512i a) {
  __m512i r{};
  for (int i = 0; i < 64; ++i)
    if (k >> i & 1) r.u8[i] = a.u8[index.u8[i] & 63];
  return r;
}

