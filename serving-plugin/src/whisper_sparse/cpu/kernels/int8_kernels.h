// W8A8 layers as stored (int8_op.cpp): int8 weights, the kept values of each row after the
// last row's (a 2:4 row holds K / 2, an unstructured row as many as its mask bits, from
// row_offsets[n] on), one bit per input (lowest bit first, ceil(K / 8) bytes a row), and a
// float32 scale per output row; activations quantized per token to int8 with a float32 scale.
// y = bfloat16(fma(float32(x_q . w_q) * w_scale, x_scale, bias)), as vLLM's oneDNN W8A8 layer
// rounds it: the integer sums are exact, so every kernel's result is the reference's bit for bit. The reference the tests compare with is
// the dense int8 weight (format.decompress_24 or decompress_bitmask) times x_q in int64.
#pragma once

#include <cmath>
#include <cstdint>

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
};

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
};

// The output of row n for token m from its exact integer sum, scaled as vLLM's oneDNN W8A8 layer
// scales it: the row's scale first, then the token's fused with the bias (one rounding).
inline void store_int8_sum(const Int8Output& out, const Int8Tokens& x, const Int8Layer& layer,
                           int64_t m, int64_t n, int32_t sum) {
  const float row_scaled = float(sum) * layer.scale[n];
  const float value = out.bias != nullptr ? std::fma(row_scaled, x.scale[m], out.bias[n])
                                          : row_scaled * x.scale[m];
  if (out.y_bf16 != nullptr) {
    out.y_bf16[m * out.ldy + n] = round_to_bf16(value);
  } else {
    out.y[m * out.ldy + n] = value;
  }
}

// int8_avx512_vnni.cpp (AVX-512 F/BW/VL/VBMI2 with VNNI): rows [n_begin, n_end) of y for all
// tokens, exact in int32 (vpdpbusd's unsigned operand is the weights shifted by 128, and the
// shift's share, 128 times each token's sum of x_q, comes off).
void int8_rows_avx512_vnni(const Int8Layer& layer, const Int8Tokens& x, const Int8Output& out,
                           int64_t n_begin, int64_t n_end);

// Dense int8 rows [n_begin, n_end) of the layer into out (row stride out_stride bytes), zero
// from K to out_stride (AVX-512 VBMI2's vpexpandb).
void int8_decompress_avx512(const Int8Layer& layer, int8_t* out, int64_t out_stride,
                            int64_t n_begin, int64_t n_end);

}  // namespace whisper_sparse
