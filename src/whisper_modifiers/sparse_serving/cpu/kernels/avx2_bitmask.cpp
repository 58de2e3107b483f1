// Unstructured rows on AVX2 + FMA (sparse_kernels.h, RowsArgs with row_offsets): each byte of the
// bitmask covers eight inputs, of which any number may be kept. The next eight values of the
// row are loaded (float32, or bfloat16 widened to float32), vpermps puts the i-th of them in
// the lane of the input the byte's i-th mark names (a 256-entry table of ranks), the lanes it
// does not mark are zeroed, and the row's pointer advances by the byte's popcount. A load
// that would pass the layer's last value reads a zero-padded copy instead.
#include <immintrin.h>

#include <cstring>

#include "sparse_kernels.h"

#define WS_TARGET __attribute__((target("avx2,fma,popcnt")))

namespace whisper_sparse {
namespace {

struct RankTable {
  alignas(32) int32_t rank[256][8];  // lane i: how many marks come before input i
  alignas(32) int32_t keep[256][8];  // lane i: all ones where input i is marked
  RankTable() {
    for (int byte = 0; byte < 256; ++byte) {
      int before = 0;
      for (int i = 0; i < 8; ++i) {
        const bool marked = byte >> i & 1;
        rank[byte][i] = marked ? before : 0;
        keep[byte][i] = marked ? -1 : 0;
        before += marked;
      }
    }
  }
};

const RankTable kRanks;

template <WeightType W>
constexpr int64_t kValueBytes = W == WeightType::f32 ? 4 : 2;

// Eight dense float32 weights from one bitmask byte and the row's values from `values`
// (`end`: past the layer's last value).
template <WeightType W>
WS_TARGET inline __m256 expand_byte(const char* values, uint8_t byte, const char* end) {
  alignas(32) char copy[32] = {};
  const char* source = values;
  if (values + 8 * kValueBytes<W> > end) {  // the layer's last values: never read past them
    std::memcpy(copy, values, __builtin_popcount(byte) * kValueBytes<W>);
    source = copy;
  }
  __m256 loaded;
  if constexpr (W == WeightType::f32) {
    loaded = _mm256_loadu_ps(reinterpret_cast<const float*>(source));
  } else {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source));
    loaded = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  const __m256i rank = _mm256_load_si256(reinterpret_cast<const __m256i*>(kRanks.rank[byte]));
  const __m256i keep = _mm256_load_si256(reinterpret_cast<const __m256i*>(kRanks.keep[byte]));
  return _mm256_and_ps(_mm256_permutevar8x32_ps(loaded, rank), _mm256_castsi256_ps(keep));
}

WS_TARGET inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[m + t][n + r] for R rows from n and T tokens from m (x: token m's row).
template <int R, int T, WeightType W>
WS_TARGET void rows_block(const RowsArgs& a, const float* x, int64_t m, int64_t n) {
  const int64_t mask_bytes = (a.K + 7) / 8, ldx = a.ldx, whole = a.K & ~int64_t(7);
  const char* base = static_cast<const char*>(a.compressed);
  const char* end = base + a.values_count * kValueBytes<W>;
  const char* values[R];
  const uint8_t* masks[R];
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r) {
    values[r] = base + a.row_offsets[n + r] * kValueBytes<W>;
    masks[r] = a.bitmask + (n + r) * mask_bytes;
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < whole; k += 8) {
    __m256 xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm256_loadu_ps(x + t * ldx + k);
    if ((k & 63) == 0)
      for (int r = 0; r < R; ++r) _mm_prefetch(values[r] + 1024, _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      const uint8_t byte = *masks[r]++;
      const __m256 w = expand_byte<W>(values[r], byte, end);
      values[r] += __builtin_popcount(byte) * kValueBytes<W>;
      for (int t = 0; t < T; ++t) acc[r][t] = _mm256_fmadd_ps(w, xv[t], acc[r][t]);
    }
  }
  if (whole < a.K) {  // the last 1 .. 7 inputs
    const int64_t rest = a.K - whole;
    __m256 xv[T];
    for (int t = 0; t < T; ++t) {
      alignas(32) float tail[8] = {};
      std::memcpy(tail, x + t * ldx + whole, rest * sizeof(float));
      xv[t] = _mm256_load_ps(tail);
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t byte = *masks[r] & uint8_t((1u << rest) - 1);
      const __m256 w = expand_byte<W>(values[r], byte, end);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm256_fmadd_ps(w, xv[t], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      store_sum(a, (m + t) * a.ldy + n + r, n + r, horizontal_sum(acc[r][t]));
}

// Every token of rows [n, n + G), in tiles of up to four tokens.
template <int G, WeightType W>
WS_TARGET void rows_all_tokens(const RowsArgs& a, const float* x, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4) rows_block<G, 4, W>(a, x + m * a.ldx, m, n);
  switch (a.M - m) {
    case 3: rows_block<G, 3, W>(a, x + m * a.ldx, m, n); break;
    case 2: rows_block<G, 2, W>(a, x + m * a.ldx, m, n); break;
    case 1: rows_block<G, 1, W>(a, x + m * a.ldx, m, n); break;
    default: break;
  }
}

template <WeightType W>
WS_TARGET void rows_typed(const RowsArgs& a) {
  const float* x = static_cast<const float*>(a.x);
  int64_t n = a.n_begin;
  if (a.M == 1) {  // more rows side by side for one token, as the 2:4 kernels do
    for (; n + 6 <= a.n_end; n += 6) rows_all_tokens<6, W>(a, x, n);
  }
  for (; n + 2 <= a.n_end; n += 2) rows_all_tokens<2, W>(a, x, n);
  for (; n < a.n_end; ++n) rows_all_tokens<1, W>(a, x, n);
}

// Dense rows: each input's value where its bit is set, the row's cursor advancing.
template <typename Value>
void decompress_rows(const DecompressArgs& a) {
  const int64_t mask_bytes = (a.K + 7) / 8;
  for (int64_t n = a.n_begin; n < a.n_end; ++n) {
    const Value* values = static_cast<const Value*>(a.compressed) + a.row_offsets[n];
    const uint8_t* mask = a.bitmask + n * mask_bytes;
    Value* out = static_cast<Value*>(a.out) + (n - a.n_begin) * a.K;
    for (int64_t k = 0; k < a.K; ++k) out[k] = (mask[k / 8] >> (k % 8) & 1) ? *values++ : Value(0);
  }
}

}  // namespace

void rows_bitmask_avx2(const RowsArgs& args) {
  if (args.type == WeightType::f32) {
    rows_typed<WeightType::f32>(args);
  } else {
    rows_typed<WeightType::bf16>(args);
  }
}

void decompress_bitmask_avx2(const DecompressArgs& args) {
  if (args.type == WeightType::f32) {
    decompress_rows<float>(args);
  } else {
    decompress_rows<uint16_t>(args);
  }
}

}  // namespace whisper_sparse
