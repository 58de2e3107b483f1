// The AVX-512 intrinsics the 2:4 CPU kernels use, in plain C++, lane by lane as Intel's
// manual defines them: the kernels' AVX-512 sources compiled with this header
// (-DWS_EMULATE_INTRINSICS='"avx512_emulation.h"') run on any x86 CPU, so the tests check
// their logic (lanes, masks, tails) where the CPU has no AVX-512 (check_kernels.cpp).
#pragma once

#include <cstdint>
#include <cstring>

struct __m512 { float f[16]; };
struct __m512i { union { uint8_t u8[64]; uint16_t u16[32]; uint32_t u32[16]; }; };
struct __m256i { union { uint8_t u8[32]; uint16_t u16[16]; }; };
typedef __m512i __m512bh;  // 32 bfloat16 lanes
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
