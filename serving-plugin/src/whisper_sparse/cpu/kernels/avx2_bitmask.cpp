// Unstructured rows on AVX2 + FMA (sparse_kernels.h, RowsArgs with row_offsets): each byte of the
// bitmask covers eight inputs, of which any number may be kept, and the row's pointer advances
// by the byte's popcount. bfloat16 weights: the next eight values of the row (sixteen bytes,
// broadcast to both halves of a register) meet a vpshufb control from a 256-entry table, which
// moves the i-th kept value into the high half of the float32 lane of the input the byte's i-th
// mark names (the float32 it is) and zeroes the others: one load and one shuffle place eight
// weights, as for 2:4 (avx2.cpp). float32 weights: vpermps puts the i-th of the next eight
// values in that lane (a table of ranks) and the lanes not marked are zeroed. Only the rows
// whose loads could pass the layer's last value check for it; they read a zero-padded copy.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "avx2_byte_tables.h"
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

const RankTable kRanks;  // float32 weights (bfloat16: kByteShuffles)

template <WeightType W>
constexpr int64_t kValueBytes = W == WeightType::f32 ? 4 : 2;

// Software prefetch, as the 2:4 rows ask (avx2.cpp): each row's values kPrefetchAhead bytes ahead.
constexpr int64_t kPrefetchAhead = 1024;

// The eight values from `values` on (`end`: past the layer's last value; checked only where
// kChecked, else the caller has made sure eight values remain).
template <WeightType W, bool kChecked>
WS_TARGET inline const char* eight_values(const char* values, const char* end, char* copy) {
  if (kChecked && values + 8 * kValueBytes<W> > end) {  // never read past the layer
    std::memset(copy, 0, 32);
    std::memcpy(copy, values, end - values);
    return copy;
  }
  return values;
}

// Eight dense float32 weights from one bitmask byte and the row's next values at `source`;
// `offset`: the byte times 32, its entry's offset in the widen table.
template <WeightType W>
WS_TARGET inline __m256 expand_byte(const char* source, uint32_t byte, uint32_t offset) {
  if constexpr (W == WeightType::f32) {
    const __m256 loaded = _mm256_loadu_ps(reinterpret_cast<const float*>(source));
    const __m256i rank = _mm256_load_si256(reinterpret_cast<const __m256i*>(kRanks.rank[byte]));
    const __m256i keep = _mm256_load_si256(reinterpret_cast<const __m256i*>(kRanks.keep[byte]));
    return _mm256_and_ps(_mm256_permutevar8x32_ps(loaded, rank), _mm256_castsi256_ps(keep));
  } else {
    const __m256i kept =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(source)));
    const uint8_t* control = &kByteShuffles.widen[0][0] + offset;
    return _mm256_castsi256_ps(
        _mm256_shuffle_epi8(kept, _mm256_load_si256(reinterpret_cast<const __m256i*>(control))));
  }
}

WS_TARGET inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[m + t][n] for row n and T tokens from m (x: token m's row), 32 inputs a step: the row's
// four bitmask bytes are read at once, and the popcounts of those before each byte say where
// its values start. One row at a time, in memory order, for every token count: faster than
// rows side by side at one and two tokens (JOURNAL.md).
template <int T, WeightType W, bool kChecked>
WS_TARGET void row_block(const RowsArgs& a, const float* x, int64_t m, int64_t n) {
  const int64_t steps = a.K & ~int64_t(31), ldx = a.ldx;
  const char* base = static_cast<const char*>(a.compressed);
  const char* end = base + a.values_count * kValueBytes<W>;
  const char* values = base + a.row_offsets[n] * kValueBytes<W>;
  const uint8_t* mask = a.bitmask + n * ((a.K + 7) / 8);
  alignas(32) char copy[32];
  // S sums per token in flight (a chain of FMAs each), so that the FMAs of one or two tokens
  // do not wait on each other
  constexpr int S = T == 1 ? 4 : 2;
  __m256 acc[T][S];
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < S; ++i) acc[t][i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < steps; k += 32) {
    if ((k & 63) == 0) _mm_prefetch(values + kPrefetchAhead, _MM_HINT_T0);
    uint32_t bits;
    std::memcpy(&bits, mask + k / 8, sizeof(bits));
    const int before[4] = {0, __builtin_popcount(bits & 0xFFu), __builtin_popcount(bits & 0xFFFFu),
                           __builtin_popcount(bits & 0xFFFFFFu)};
    for (int i = 0; i < 4; ++i) {
      const uint32_t byte = bits >> 8 * i & 0xFF;
      const uint32_t offset = (i == 0 ? bits << 5 : bits >> (8 * i - 5)) & 0x1FE0;
      const __m256 w = expand_byte<W>(
          eight_values<W, kChecked>(values + before[i] * kValueBytes<W>, end, copy), byte, offset);
      for (int t = 0; t < T; ++t)
        acc[t][i % S] =
            _mm256_fmadd_ps(w, _mm256_loadu_ps(x + t * ldx + k + 8 * i), acc[t][i % S]);
    }
    values += __builtin_popcount(bits) * kValueBytes<W>;
  }
  for (int64_t k = steps; k < a.K; k += 8) {  // the last 1 .. 31 inputs, eight at a time
    const int64_t rest = std::min<int64_t>(a.K - k, 8);
    const uint32_t byte = mask[k / 8] & uint32_t((1u << rest) - 1);
    const __m256 w = expand_byte<W>(eight_values<W, true>(values, end, copy), byte, byte << 5);
    values += __builtin_popcount(byte) * kValueBytes<W>;
    for (int t = 0; t < T; ++t) {
      alignas(32) float tail[8] = {};
      std::memcpy(tail, x + t * ldx + k, rest * sizeof(float));
      acc[t][0] = _mm256_fmadd_ps(w, _mm256_load_ps(tail), acc[t][0]);
    }
  }
  for (int t = 0; t < T; ++t) {
    for (int i = 1; i < S; ++i) acc[t][0] = _mm256_add_ps(acc[t][0], acc[t][i]);
    store_sum(a, (m + t) * a.ldy + n, n, horizontal_sum(acc[t][0]));
  }
}

// Every token of row n, in tiles of up to four tokens.
template <WeightType W, bool kChecked>
WS_TARGET void row_tokens(const RowsArgs& a, const float* x, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4) row_block<4, W, kChecked>(a, x + m * a.ldx, m, n);
  switch (a.M - m) {
    case 3: row_block<3, W, kChecked>(a, x + m * a.ldx, m, n); break;
    case 2: row_block<2, W, kChecked>(a, x + m * a.ldx, m, n); break;
    case 1: row_block<1, W, kChecked>(a, x + m * a.ldx, m, n); break;
    default: break;
  }
}

// The rows whose loads could pass the layer's last value (its last rows) check them.
template <WeightType W>
WS_TARGET void rows_typed(const RowsArgs& a) {
  const float* x = static_cast<const float*>(a.x);
  for (int64_t n = a.n_begin; n < a.n_end; ++n) {
    if (loads_stay_in_layer(a.row_offsets[n], a.K, a.values_count)) {
      row_tokens<W, false>(a, x, n);
    } else {
      row_tokens<W, true>(a, x, n);
    }
  }
}

// Dense row n: each input's value where its bit is set, the row's cursor advancing; eight
// inputs a byte (one shuffle for bfloat16, vpermps for float32) where the loads stay in the
// layer, else one input at a time.
template <typename Value, WeightType W>
WS_TARGET void decompress_row(const DecompressArgs& a, int64_t n) {
  const int64_t mask_bytes = (a.K + 7) / 8, whole = a.K & ~int64_t(7);
  const Value* values = static_cast<const Value*>(a.compressed) + a.row_offsets[n];
  const uint8_t* mask = a.bitmask + n * mask_bytes;
  Value* out = static_cast<Value*>(a.out) + a.out_row(n);
  int64_t k = 0;
  if (loads_stay_in_layer(a.row_offsets[n], a.K, a.values_count)) {
    for (; k < whole; k += 8) {
      const uint8_t byte = mask[k / 8];
      if constexpr (W == WeightType::f32) {
        _mm256_storeu_ps(reinterpret_cast<float*>(out + k),
                         expand_byte<W>(reinterpret_cast<const char*>(values), byte, byte << 5));
      } else {
        const __m128i kept = _mm_loadu_si128(reinterpret_cast<const __m128i*>(values));
        const __m128i control =
            _mm_load_si128(reinterpret_cast<const __m128i*>(kByteShuffles.place[byte]));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm_shuffle_epi8(kept, control));
      }
      values += __builtin_popcount(byte);
    }
  }
  for (; k < a.K; ++k) out[k] = (mask[k / 8] >> (k % 8) & 1) ? *values++ : Value(0);
}

// A grouped layer's dense rows [n_begin, n_end) (bfloat16; GroupedLayer), value by value:
// each group's stream walked once, its rows outside the range walked past. The grouped layout
// is held only where the avx512_bf16 kernels run (cpu/grouped_layout.py); this serves a layer
// whose kernels were capped below them since.
WS_TARGET void decompress_grouped(const DecompressArgs& a) {
  const int64_t steps = group_steps(a.K);
  for (int64_t g = a.n_begin / kGroupRows; g * kGroupRows < a.n_end; ++g) {
    const uint16_t* values = static_cast<const uint16_t*>(a.compressed) + a.grouped.offsets[g];
    const uint32_t* masks = a.grouped.group_masks(g, a.K);
    for (int64_t s = 0; s < steps; ++s)
      for (int r = 0; r < kGroupRows; ++r) {
        const uint32_t mask = masks[s * kGroupRows + r];
        const int64_t n = g * kGroupRows + r;
        if (n >= a.n_begin && n < a.n_end) {
          uint16_t* out = static_cast<uint16_t*>(a.out) + a.out_row(n) + s * 32;
          const uint16_t* next = values;
          for (int64_t i = 0; i < 32 && s * 32 + i < a.K; ++i)
            out[i] = (mask >> i) & 1u ? *next++ : 0;
        }
        values += __builtin_popcount(mask);
      }
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
  if (args.grouped.defined()) return decompress_grouped(args);
  for (int64_t n = args.n_begin; n < args.n_end; ++n) {
    if (args.type == WeightType::f32) {
      decompress_row<float, WeightType::f32>(args, n);
    } else {
      decompress_row<uint16_t, WeightType::bf16>(args, n);
    }
  }
}

}  // namespace whisper_sparse
