// W8A8 rows and tiles on AVX2 (int8_kernels.h, int8_rows_256.h, int8_tiles_256.h), exact: no
// vpmaddubsw, whose pairs of u8 * s8 products saturate in int16 (cpu/int8.py). Both operands are
// widened to int16 instead and vpmaddwd sums each pair in int32 (at most 2 * 128 * 128, exact).
#include <immintrin.h>

#define WS_TARGET __attribute__((target("avx2,popcnt")))

#include "int8_rows_256.h"
#include "int8_tiles_256.h"

namespace whisper_sparse {
namespace {

// The weights of a step widened to int16 (two registers), pairs of products summed by
// vpmaddwd with the tokens' int16.
struct MaddDot {
  using Token = int16_t;
  struct Weights {
    __m256i low, high;
  };

  WS_TARGET static Weights weights(const DenseStep& dense) {
    return {_mm256_cvtepi8_epi16(dense.low), _mm256_cvtepi8_epi16(dense.high)};
  }
  WS_TARGET static __m256i dot(__m256i acc, const Weights& w, const int16_t* x) {
    const __m256i low = _mm256_madd_epi16(w.low, _mm256_loadu_si256((const __m256i*)x));
    const __m256i high = _mm256_madd_epi16(w.high, _mm256_loadu_si256((const __m256i*)(x + 16)));
    return _mm256_add_epi32(acc, _mm256_add_epi32(low, high));
  }
  static int32_t sum_of(int32_t sum, int32_t) { return sum; }
};

// The tiles' pairs of int16 products: vpmaddwd, then added to the sums.
struct PairMadd {
  WS_TARGET static __m256i madd(__m256i acc, __m256i w, __m256i x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
  }
};

}  // namespace

WS_TARGET void int8_rows_avx2(const Int8Layer& layer, const Int8Tokens& x, const Int8Output& out,
                              int64_t n_begin, int64_t n_end) {
  rows_256<MaddDot>(layer, x, out, n_begin, n_end);
}

WS_TARGET void int8_tiles_avx2(const Int8Layer& layer, const Int8Tokens& x, const int16_t* wide,
                               int64_t ld_x, const Int8Output& out, int64_t n_begin,
                               int64_t n_end) {
  tiles_256<PairMadd>(layer, x, wide, ld_x, out, n_begin, n_end);
}

WS_TARGET void int8_quantize_avx2(const Int8Quantize& q, int64_t m_begin, int64_t m_end) {
  quantize_int8_tokens(q, m_begin, m_end);
}

WS_TARGET void int8_decompress_avx2(const Int8Layer& layer, int8_t* out, int64_t out_stride,
                                    int64_t n_begin, int64_t n_end) {
  const int64_t mask_bytes = (layer.K + 7) / 8;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* values = layer.values + layer.row_start(n);
    const uint8_t* mask = layer.bitmask + n * mask_bytes;
    int8_t* row = out + (n - n_begin) * out_stride;
    for (int64_t k = 0; k < layer.K; k += kExpanded) {
      alignas(16) int8_t dense[kExpanded];
      _mm_store_si128(reinterpret_cast<__m128i*>(dense), tail16(values, mask, k, layer.K));
      std::memcpy(row + k, dense, std::min(kExpanded, layer.K - k));
    }
    if (layer.K < out_stride) std::memset(row + layer.K, 0, out_stride - layer.K);
  }
}

}  // namespace whisper_sparse
