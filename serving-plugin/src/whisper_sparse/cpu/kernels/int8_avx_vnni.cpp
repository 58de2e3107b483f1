// W8A8 rows and tiles on AVX-VNNI (int8_kernels.h, int8_rows_256.h, int8_tiles_256.h): the AVX2
// kernels' expansion and 256-bit VNNI sums in int32, exactly. The rows' vpdpbusd multiplies
// unsigned bytes by signed ones, so the weights go in shifted (w + 128) and each sum comes out
// 128 times its token's sum of x_q too, taken off at the end; the tiles' vpdpwssd adds pairs of
// int16 products.
#include <immintrin.h>

#ifdef WS_EMULATE_AVX_VNNI  // tests: vpdpbusd in AVX2 instructions, on CPUs without AVX-VNNI
#include WS_EMULATE_AVX_VNNI
#define WS_TARGET __attribute__((target("avx2,popcnt")))
#define WS_DPBUSD emulated_dpbusd_avx
#define WS_DPWSSD emulated_dpwssd_avx
#else
#define WS_TARGET __attribute__((target("avx2,avxvnni,popcnt")))
#define WS_DPBUSD _mm256_dpbusd_avx_epi32
#define WS_DPWSSD _mm256_dpwssd_avx_epi32
#endif

#include "int8_rows_256.h"
#include "int8_tiles_256.h"

namespace whisper_sparse {
namespace {

// The weights of a step shifted to unsigned bytes (one register), quads of products summed by
// vpdpbusd with the tokens' signed bytes.
struct VnniDot {
  using Token = int8_t;
  using Weights = __m256i;

  WS_TARGET static Weights weights(const DenseStep& dense) {
    return _mm256_xor_si256(_mm256_set_m128i(dense.high, dense.low), _mm256_set1_epi8(char(0x80)));
  }
  WS_TARGET static __m256i dot(__m256i acc, Weights w, const int8_t* x) {
    return WS_DPBUSD(acc, w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  }
  // in uint32: the shifted sums may wrap, their difference not
  static int32_t sum_of(int32_t sum, int32_t token_sum) {
    return int32_t(uint32_t(sum) - uint32_t(token_sum) * 128u);
  }
};

// The tiles' pairs of int16 products, added to the sums by vpdpwssd.
struct VnniPairMadd {
  WS_TARGET static __m256i madd(__m256i acc, __m256i w, __m256i x) { return WS_DPWSSD(acc, w, x); }
};

}  // namespace

WS_TARGET void int8_rows_avx_vnni(const Int8Layer& layer, const Int8Tokens& x,
                                  const Int8Output& out, int64_t n_begin, int64_t n_end) {
  rows_256<VnniDot>(layer, x, out, n_begin, n_end);
}

WS_TARGET void int8_tiles_avx_vnni(const Int8Layer& layer, const Int8Tokens& x,
                                   const int16_t* wide, int64_t ld_x, const Int8Output& out,
                                   int64_t n_begin, int64_t n_end) {
  tiles_256<VnniPairMadd>(layer, x, wide, ld_x, out, n_begin, n_end);
}

}  // namespace whisper_sparse
