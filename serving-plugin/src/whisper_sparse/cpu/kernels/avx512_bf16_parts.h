// Parts the AVX-512 BF16 kernel files share (avx512_bf16.cpp's rows, avx512_bf16_gemm.cpp's
// 2:4 GEMM, avx512_bf16_bitmask_gemm.cpp's unstructured one): the expansion of 32 inputs'
// kept values by their mask, the 16 x 16 transpose of 32-bit words (transpose16.h), and the
// store of a GEMM block's float32 sums into y. Included by those files after their WS_TARGET
// preamble.
#pragma once

#include <algorithm>
#include <cstdint>

#include "sparse_kernels.h"
#include "transpose16.h"

namespace whisper_sparse {
namespace {

constexpr int64_t kLanes = 16;  // rows per register

// The 32 inputs whose `mask` bits mark the `count` kept values at `values` (count <= 32; 16
// for a whole group of 32 inputs of a 2:4 row, loaded without a mask). An unstructured row's
// values are loaded 32 at a time without a mask where 32 values from `values` lie inside the
// layer's (before `end`; Bounded = false: the caller knows they do): vpexpandw takes only the
// first `count`, and a plain load spares the mask's making, which is slow where each row is
// walked once per tile. Near the end, a masked load reads exactly `count` (never a value past
// the layer's). The expansion merges into a register of zeros rather than zeroing its
// destination: a zeroing vpexpandw waits for its destination register's last writer, and GCC
// gives every expansion of a loop the same destination, which chained them (JOURNAL.md).
template <bool Whole, bool Bounded = true>
WS_TARGET inline __m512i expand32(uint32_t mask, const uint16_t* values, int64_t count = 16,
                                  const uint16_t* end = nullptr) {
  __m512i kept;
  if (Whole) {
    kept = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values)));
  } else if (!Bounded || (end != nullptr && values + 32 <= end)) {
    kept = _mm512_loadu_si512(values);
  } else {
    kept = _mm512_maskz_loadu_epi16(count >= 32 ? ~uint32_t(0) : (uint32_t(1) << count) - 1,
                                    values);
  }
  __m512i zeros = _mm512_setzero_si512();
#ifndef WS_EMULATE_INTRINSICS
  asm("" : "+v"(kept));  // keeps the load apart: the compiler folds it into vpexpandw otherwise
  asm("" : "+v"(zeros));  // keeps the merge: the compiler makes it a zeroing vpexpandw otherwise
#endif
  return _mm512_mask_expand_epi16(zeros, mask, kept);
}

// y[t][n + r] = bfloat16(sums[t][r] + bias[n + r]) for the block's rows before n_end.
template <int64_t BlockRows>
WS_TARGET void store_block(const GemmArgs& a, const float* sums, int64_t n, int64_t t0,
                           int64_t tokens) {
  for (int64_t r = 0; r < BlockRows && n + r < a.n_end; r += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, a.n_end - n - r);
    const __mmask16 rows = __mmask16((uint32_t(1) << count) - 1);
    const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(rows, a.bias + n + r) : _mm512_setzero_ps();
    for (int64_t t = 0; t < tokens; ++t) {
      const __m512 sum = _mm512_add_ps(_mm512_loadu_ps(sums + t * BlockRows + r), bias);
      _mm256_mask_storeu_epi16(a.y + (t0 + t) * a.ldy + n + r, rows,
                               (__m256i)_mm512_cvtneps_pbh(sum));
    }
  }
}

}  // namespace
}  // namespace whisper_sparse
