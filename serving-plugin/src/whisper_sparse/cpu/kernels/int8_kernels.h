// W8A8 layers as stored (int8_op.cpp): int8 weights, the kept values of each row after the
// last row's (a 2:4 row holds K / 2, an unstructured row as many as its mask bits, from
// row_offsets[n] on), one bit per input (lowest bit first, ceil(K / 8) bytes a row), and a
// float32 scale per output row; activations quantized per token to int8 with a float32 scale.
// The integer sums are exact, then scaled as the vLLM dense W8A8 kernel the layer stands in for
// rounds them (Int8Output::token_scale_first), so every kernel's result is the reference's bit
// for bit. The reference the tests compare with is the dense int8 weight (format.decompress_24
// or decompress_bitmask) times x_q in int64.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "sparse_kernels.h"

namespace whisper_sparse {

struct Int8Layer {
  const int8_t* values = nullptr;
  const uint8_t* bitmask = nullptr;
  const int64_t* row_offsets = nullptr;  // null: a 2:4 layer
  int64_t values_count = 0;
  int64_t rows = 0;
  int64_t K = 0;
  const float* scale = nullptr;  // [rows]
  int64_t row_start(int64_t n) const { return row_offsets != nullptr ? row_offsets[n] : n * (K / 2); }
  // The values of the rows before row n, any n up to rows (where they are all of them).
  int64_t values_before(int64_t n) const { return n < rows ? row_start(n) : values_count; }
};

// Software prefetch of the row kernels, whose cursors walk blocks of R rows side by side: each
// row asks, into L1, for its values kRowValuesAhead bytes on and its mask kRowMaskAhead bytes on
// (once per line of the mask). Past its row's end a cursor asks in the row R rows on, which it
// walks next, not in the next row, which another cursor is reading: with rows of a few KiB
// (7B qkv), asking past the end fetched nothing new.
constexpr int64_t kRowValuesAhead = 2048;
constexpr int64_t kRowMaskAhead = 256;

template <int R>
struct RowsAhead {
  const int8_t* ends[R];  // where each row's values end
  int64_t jumps[R];       // from there to the values of the row R rows on
  int64_t mask_bytes;

  RowsAhead(const Int8Layer& layer, int64_t n) : mask_bytes((layer.K + 7) / 8) {
    for (int r = 0; r < R; ++r) {
      ends[r] = layer.values + layer.values_before(n + r + 1);
      jumps[r] = layer.values_before(n + r + R) - layer.values_before(n + r + 1);
    }
  }
};

// Row r's asks at input k, its cursor at `at` in its values and its mask row at `mask`
// (a prefetch never faults, past the layer too).
template <int R>
__attribute__((always_inline)) inline void ask_row_ahead(const RowsAhead<R>& ahead, int r,
                                                         const int8_t* at, const uint8_t* mask,
                                                         int64_t k) {
  const int8_t* values = at + kRowValuesAhead;
  __builtin_prefetch(values + (values >= ahead.ends[r] ? ahead.jumps[r] : 0), 0, 3);
  if ((k & 511) == 0) {
    const int64_t byte = k / 8 + kRowMaskAhead, bytes = ahead.mask_bytes;
    __builtin_prefetch(mask + byte + (byte >= bytes ? (R - 1) * bytes : 0), 0, 3);
  }
}

// Per-token int8 activations: x_q [M, K] (row stride ldx) and scale [M].
struct Int8Tokens {
  const int8_t* x_q = nullptr;
  int64_t ldx = 0;
  const float* scale = nullptr;
  int64_t M = 0;
};

// Where a kernel writes y: [M, rows] with row stride ldy, bfloat16 bits (y_bf16) or float32.
struct Int8Output {
  uint16_t* y_bf16 = nullptr;
  float* y = nullptr;
  int64_t ldy = 0;
  const float* bias = nullptr;  // [rows] or null
  // false: vLLM's oneDNN layer's order, fma(sum * w_scale, x_scale, bias); true: its AMX
  // kernel's, fma(sum * x_scale, w_scale, bias) (without a bias, the product rounded twice).
  bool token_scale_first = false;
};

// A scaled sum as Int8Output::token_scale_first orders it.
inline float scale_int8_sum(float sum, float token_scale, float row_scale, const float* bias,
                            bool token_scale_first) {
  const float first = token_scale_first ? token_scale : row_scale;
  const float second = token_scale_first ? row_scale : token_scale;
  return bias != nullptr ? std::fma(sum * first, second, *bias) : sum * first * second;
}

// The output of row n for token m from its exact integer sum.
inline void store_int8_sum(const Int8Output& out, const Int8Tokens& x, const Int8Layer& layer,
                           int64_t m, int64_t n, int32_t sum) {
  const float value = scale_int8_sum(float(sum), x.scale[m], layer.scale[n],
                                     out.bias != nullptr ? out.bias + n : nullptr,
                                     out.token_scale_first);
  if (out.y_bf16 != nullptr) {
    out.y_bf16[m * out.ldy + n] = round_to_bf16(value);
  } else {
    out.y[m * out.ldy + n] = value;
  }
}

// Tokens to quantize: rows [M, K] (row stride ldx) of bfloat16 bits or float32, and where the
// int8 values [M, K] and the float32 scales [M] go.
struct Int8Quantize {
  const uint16_t* x_bf16 = nullptr;
  const float* x = nullptr;
  int64_t ldx = 0, K = 0;
  bool sgl = false;  // the rounding of vLLM's AMX kernel, else its oneDNN layer's (int8_op.h)
  int8_t* x_q = nullptr;
  float* scale = nullptr;
};

inline float float_of_bits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}
inline float value_of(uint16_t bf16) { return float_of_bits(uint32_t(bf16) << 16); }
inline float value_of(float value) { return value; }
// |x| as its bits, and back: bfloat16 in 16 bits, float32 in 32.
inline uint16_t magnitude_of(uint16_t bf16) { return bf16 & 0x7FFFu; }
inline uint32_t magnitude_of(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits & 0x7FFFFFFFu;
}
inline float magnitude_value(uint16_t bits) { return value_of(bits); }
inline float magnitude_value(uint32_t bits) { return float_of_bits(bits); }

// One token quantized as the rounding's vLLM kernel does: oneDNN's `scale = amax / 127`,
// `x * float(1.0 / scale)` (a token of zeros: scale 0, zeros); the AMX kernel's amax at least
// 1e-7, `x * (127 / amax)`. Both clamp to int8 and round to nearest even (adding and taking
// off 1.5 * 2^23 rounds so below 2^22). The largest magnitude is an integer max of the bits
// (their order is the numbers'), so both loops are plain C++ the compiler vectorizes (inlined
// into int8_quantize_avx512, for AVX-512).
template <typename T>
__attribute__((always_inline)) inline void quantize_int8_token(const T* x, int64_t K, bool sgl,
                                                              int8_t* x_q, float* scale) {
  decltype(magnitude_of(T())) largest = 0;
  for (int64_t k = 0; k < K; ++k) largest = std::max(largest, magnitude_of(x[k]));
  float amax = magnitude_value(largest);
  float inverse;
  if (sgl) {
    amax = std::max(amax, 1e-7f);
    *scale = amax / 127.0f;
    inverse = 127.0f / amax;
  } else {
    *scale = amax / 127.0f;
    inverse = *scale > 0.0f ? float(1.0 / double(*scale)) : 0.0f;
  }
  constexpr float kRound = 12582912.0f;
  for (int64_t k = 0; k < K; ++k) {
    const float v = std::min(std::max(value_of(x[k]) * inverse, -128.0f), 127.0f);
    x_q[k] = int8_t(int32_t((v + kRound) - kRound));
  }
}

__attribute__((always_inline)) inline void quantize_int8_tokens(const Int8Quantize& q,
                                                               int64_t m_begin, int64_t m_end) {
  for (int64_t m = m_begin; m < m_end; ++m) {
    if (q.x_bf16 != nullptr) {
      quantize_int8_token(q.x_bf16 + m * q.ldx, q.K, q.sgl, q.x_q + m * q.K, q.scale + m);
    } else {
      quantize_int8_token(q.x + m * q.ldx, q.K, q.sgl, q.x_q + m * q.K, q.scale + m);
    }
  }
}

// quantize_int8_tokens compiled for AVX-512 (int8_avx512_vnni.cpp) and AVX2 (int8_avx2.cpp).
void int8_quantize_avx512(const Int8Quantize& q, int64_t m_begin, int64_t m_end);
void int8_quantize_avx2(const Int8Quantize& q, int64_t m_begin, int64_t m_end);

// int8_avx512_vnni.cpp (AVX-512 F/BW/VL/VBMI2 with VNNI): rows [n_begin, n_end) of y for all
// tokens, exact in int32 (vpdpbusd's unsigned operand is the weights shifted by 128, and the
// shift's share, 128 times each token's sum of x_q, comes off).
void int8_rows_avx512_vnni(const Int8Layer& layer, const Int8Tokens& x, const Int8Output& out,
                           int64_t n_begin, int64_t n_end);

// From a plan's tiles_from tokens, int8_avx512_vnni_tiles.cpp: rows [n_begin, n_end) of y for
// every token, each block of rows expanded once into vpdpbusd's layout and every token multiplied
// through it, kVnniTileTokens at a time. It reads x_q [vnni_tile_rows(M), ld] with ld at least
// K rounded up to 4: zero from K and past M (vnni_token_stride(K) keeps the rows off 4 KiB).
constexpr int64_t kVnniTileTokens = 6;
inline int64_t vnni_tile_rows(int64_t M) {
  return (M + kVnniTileTokens - 1) / kVnniTileTokens * kVnniTileTokens;
}
inline int64_t vnni_token_stride(int64_t K) { return (K + 63) / 64 * 64 + 64; }
void int8_tiles_avx512_vnni(const Int8Layer& layer, const Int8Tokens& x, const Int8Output& out,
                            int64_t n_begin, int64_t n_end);

// Dense int8 rows [n_begin, n_end) of the layer into out (row stride out_stride bytes), zero
// from K to out_stride (AVX-512 VBMI2's vpexpandb).
void int8_decompress_avx512(const Int8Layer& layer, int8_t* out, int64_t out_stride,
                            int64_t n_begin, int64_t n_end);

// Where AVX-512 VNNI does not run, the same rows in 256-bit registers (int8_rows_256.h), exact
// in int32: int8_avx2.cpp (AVX2: both operands widened to int16, vpmaddwd), its expansion, and
// int8_avx_vnni.cpp (AVX-VNNI: 256-bit vpdpbusd on the shifted weights).
void int8_rows_avx2(const Int8Layer& layer, const Int8Tokens& x, const Int8Output& out,
                    int64_t n_begin, int64_t n_end);
void int8_rows_avx_vnni(const Int8Layer& layer, const Int8Tokens& x, const Int8Output& out,
                        int64_t n_begin, int64_t n_end);
void int8_decompress_avx2(const Int8Layer& layer, int8_t* out, int64_t out_stride,
                          int64_t n_begin, int64_t n_end);

// From a plan's tiles_from tokens, the same CPUs' tiles (int8_tiles_256.h): rows [n_begin, n_end)
// of y for the tokens `wide` (x_q widened to int16, [M, ld_x] with ld_x = wide_token_stride(K),
// zero from K), each block of rows expanded once and every token multiplied through it.
void int8_tiles_avx2(const Int8Layer& layer, const Int8Tokens& x, const int16_t* wide,
                     int64_t ld_x, const Int8Output& out, int64_t n_begin, int64_t n_end);
void int8_tiles_avx_vnni(const Int8Layer& layer, const Int8Tokens& x, const int16_t* wide,
                         int64_t ld_x, const Int8Output& out, int64_t n_begin, int64_t n_end);
// The row stride of the tiles' wide tokens: K up to 32 inputs, then 16 more (off a power of two).
inline int64_t wide_token_stride(int64_t K) { return (K + 31) / 32 * 32 + 16; }

}  // namespace whisper_sparse
