// 2:4 rows on AVX2 + FMA (sparse_kernels.h). AVX2 has no expand-load: each byte of the bitmask
// covers eight inputs (two groups of four, four kept values), and a 256-entry table gives, per
// byte, a vpshufb control that moves the kept values' bytes into the eight float32 lanes of
// those inputs (a bfloat16 value into the high half of its lane: the float32 it is), zeroing
// the pruned ones; the kept values are broadcast to both halves of the register first. Up to
// four tokens the rows step 32 inputs at a time: one load of a row's four bitmask bytes, and
// one of the kept values of each sixteen inputs (bfloat16: eight, the second four placed by a
// second table; float32: of each eight); more tokens, eight inputs a step, x shared by rows.
#include <immintrin.h>

#include <cstring>

#include "avx2_byte_tables.h"
#include "sparse_kernels.h"

#define WS_TARGET __attribute__((target("avx2,fma")))

namespace whisper_sparse {
namespace {

struct ExpandTable {
  // f32[b]: vpshufb controls placing the kept float32 values of byte b's eight inputs as eight
  // float32 lanes; 0x80 writes a zero byte (bfloat16: kByteShuffles.widen)
  alignas(64) uint8_t f32[256][32];
  // bf16_high[b]: kByteShuffles.widen[b] reading kept bytes 8..15, the second eight inputs of
  // sixteen
  alignas(64) uint8_t bf16_high[256][32];

  ExpandTable() {
    std::memset(this, 0x80, sizeof(*this));
    for (int b = 0; b < 256; ++b) {
      int next = 0;
      for (int i = 0; i < 8; ++i) {
        if (!((b >> i) & 1)) continue;
        if (next < 4) {
          const int lane = 4 * (i % 4) + (i / 4) * 16;  // byte offset in the 256-bit register
          for (int byte = 0; byte < 4; ++byte) f32[b][lane + byte] = uint8_t(4 * next + byte);
        }
        ++next;
      }
      const uint8_t* widen = kByteShuffles.widen[b];
      for (int byte = 0; byte < 32; ++byte)
        bf16_high[b][byte] = widen[byte] == 0x80 ? 0x80 : uint8_t(widen[byte] + 8);
    }
  }
};

const ExpandTable kTable;

// The kept values of eight inputs at ``values`` (four; two for a last group of four), their
// bytes broadcast to both 128-bit halves.
template <WeightType W>
WS_TARGET inline __m256i kept_bytes(const char* values, bool half) {
  if constexpr (W == WeightType::f32) {
    if (half) {
      int64_t two;
      std::memcpy(&two, values, sizeof(two));
      return _mm256_set1_epi64x(two);
    }
    return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values)));
  } else {
    if (half) {
      int32_t two;
      std::memcpy(&two, values, sizeof(two));
      return _mm256_set1_epi32(two);
    }
    int64_t four;
    std::memcpy(&four, values, sizeof(four));
    return _mm256_set1_epi64x(four);
  }
}

template <WeightType W>
constexpr int64_t kValueBytes = W == WeightType::f32 ? 4 : 2;

// Software prefetch: a row's kept values are one stream among 2 R (values and bitmask), more
// than the hardware prefetchers follow well; each row asks for the line kPrefetchAhead bytes
// ahead once per 64 bytes of its values (every 32 inputs for float32, 64 for bfloat16).
constexpr int64_t kPrefetchAhead = 1024;
template <WeightType W>
constexpr int64_t kPrefetchEvery = W == WeightType::f32 ? 31 : 63;

// Eight dense float32 weights from one bitmask byte and its kept values.
template <WeightType W>
WS_TARGET inline __m256 expand(__m256i kept, uint8_t byte) {
  const uint8_t* control = W == WeightType::f32 ? kTable.f32[byte] : kByteShuffles.widen[byte];
  return _mm256_castsi256_ps(
      _mm256_shuffle_epi8(kept, _mm256_load_si256(reinterpret_cast<const __m256i*>(control))));
}

// The vpshufb control at byte offset `offset` (a bitmask byte times 32) of a table.
WS_TARGET inline __m256i control_at(const uint8_t (*table)[32], uint32_t offset) {
  return _mm256_load_si256(
      reinterpret_cast<const __m256i*>(reinterpret_cast<const uint8_t*>(table) + offset));
}

// Eight dense float32 weights: inputs [8 i, 8 i + 8) of 32 whose kept values start at `values`
// and whose bitmask bytes are `bits` (the first in the low byte); the i-th byte, times 32, is
// its control's offset. bfloat16: one 16-byte load holds the kept values of sixteen inputs, the
// second eight's placed by bf16_high.
template <WeightType W>
WS_TARGET inline __m256 expand_eight(const char* values, uint32_t bits, int i) {
  const uint32_t offset = (i == 0 ? bits << 5 : bits >> (8 * i - 5)) & 0x1FE0;
  if constexpr (W == WeightType::f32) {
    return _mm256_castsi256_ps(_mm256_shuffle_epi8(kept_bytes<W>(values + 16 * i, false),
                                                   control_at(kTable.f32, offset)));
  } else {
    const __m256i kept = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(values + 16 * (i / 2))));
    const auto& table = i % 2 ? kTable.bf16_high : kByteShuffles.widen;
    return _mm256_castsi256_ps(_mm256_shuffle_epi8(kept, control_at(table, offset)));
  }
}

WS_TARGET inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[m + t][n + r] for R rows from n and T tokens from m (x: token m's row), the rows' one pass
// (at most four tokens: they are read from memory). Each step of 32 inputs reads, for every
// row, the kept values and bitmask bytes of its inputs at one offset from the row's start
// (rows of a 2:4 layer all hold K / 2 values).
template <int R, int T, WeightType W>
WS_TARGET void rows_block(const RowsArgs& a, const float* x, int64_t m, int64_t n) {
  const int64_t row_bytes = a.K / 2 * kValueBytes<W>, mask_bytes = (a.K + 7) / 8, ldx = a.ldx;
  const int64_t steps = a.K & ~int64_t(31), sixteens = a.K & ~int64_t(15);
  const int64_t whole = a.K & ~int64_t(7);
  // S sums per row and token in flight (a chain of FMAs each), where few rows and tokens would
  // leave the FMAs waiting on each other
  constexpr int S = R * T == 1 ? 4 : R * T == 2 ? 2 : 1;
  const char* values[R];
  const uint8_t* masks[R];
  __m256 acc[R][T][S];
  for (int r = 0; r < R; ++r) {
    values[r] = static_cast<const char*>(a.compressed) + (n + r) * row_bytes;
    masks[r] = a.bitmask + (n + r) * mask_bytes;
    for (int t = 0; t < T; ++t)
      for (int i = 0; i < S; ++i) acc[r][t][i] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < steps; k += 32) {
    const int64_t at = k / 2 * kValueBytes<W>;  // the step's kept values in each row
    if ((k & kPrefetchEvery<W>) == 0) {  // once per cache line of kept values, per row
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(values[r] + at + kPrefetchAhead, _MM_HINT_T0);
        if ((k & 511) == 0)
          _mm_prefetch(reinterpret_cast<const char*>(masks[r] + k / 8) + 64, _MM_HINT_T0);
      }
    }
    uint32_t bits[R];
    for (int r = 0; r < R; ++r) std::memcpy(&bits[r], masks[r] + k / 8, sizeof(bits[r]));
    for (int r = 0; r < R; ++r)  // each row's 32 weights go into its sums at once
      for (int i = 0; i < 4; ++i) {
        const __m256 w = expand_eight<W>(values[r] + at, bits[r], i);
        for (int t = 0; t < T; ++t)
          acc[r][t][i % S] =
              _mm256_fmadd_ps(w, _mm256_loadu_ps(x + t * ldx + k + 8 * i), acc[r][t][i % S]);
      }
  }
  if (steps < sixteens) {  // sixteen inputs more
    const int64_t at = steps / 2 * kValueBytes<W>;
    for (int r = 0; r < R; ++r) {
      uint16_t bits;
      std::memcpy(&bits, masks[r] + steps / 8, sizeof(bits));
      for (int i = 0; i < 2; ++i) {
        const __m256 w = expand_eight<W>(values[r] + at, bits, i);
        for (int t = 0; t < T; ++t)
          acc[r][t][0] =
              _mm256_fmadd_ps(w, _mm256_loadu_ps(x + t * ldx + steps + 8 * i), acc[r][t][0]);
      }
    }
  }
  if (sixteens < whole) {  // eight inputs more
    const int64_t at = sixteens / 2 * kValueBytes<W>;
    __m256 xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm256_loadu_ps(x + t * ldx + sixteens);
    for (int r = 0; r < R; ++r) {
      const __m256 w = expand<W>(kept_bytes<W>(values[r] + at, false), masks[r][sixteens / 8]);
      for (int t = 0; t < T; ++t) acc[r][t][0] = _mm256_fmadd_ps(w, xv[t], acc[r][t][0]);
    }
  }
  if (whole < a.K) {  // a last group of four inputs
    const int64_t at = whole / 2 * kValueBytes<W>;
    __m256 xv[T];
    for (int t = 0; t < T; ++t)
      xv[t] = _mm256_set_m128(_mm_setzero_ps(), _mm_loadu_ps(x + t * ldx + whole));
    for (int r = 0; r < R; ++r) {
      const __m256 w = expand<W>(kept_bytes<W>(values[r] + at, true), masks[r][whole / 8] & 0x0F);
      for (int t = 0; t < T; ++t) acc[r][t][0] = _mm256_fmadd_ps(w, xv[t], acc[r][t][0]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      for (int i = 1; i < S; ++i) acc[r][t][0] = _mm256_add_ps(acc[r][t][0], acc[r][t][i]);
      store_sum(a, (m + t) * a.ldy + n + r, n + r, horizontal_sum(acc[r][t][0]));
    }
}

// The same for a tile of T tokens of more than four, over rows held in cache since the first
// tile: eight inputs a step, each eight of x loaded once for every row (fewer loads than the
// 32-input step, which gains only where the rows come from memory; measured: JOURNAL.md).
template <int R, int T, WeightType W>
WS_TARGET void rows_block_cached(const RowsArgs& a, const float* x, int64_t m, int64_t n) {
  const int64_t half_k = a.K / 2, mask_bytes = (a.K + 7) / 8, ldx = a.ldx;
  const int64_t whole = a.K & ~int64_t(7);
  const char* values[R];
  const uint8_t* masks[R];
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r) {
    values[r] = static_cast<const char*>(a.compressed) + (n + r) * half_k * kValueBytes<W>;
    masks[r] = a.bitmask + (n + r) * mask_bytes;
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < whole; k += 8) {
    __m256 xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm256_loadu_ps(x + t * ldx + k);
    if ((k & kPrefetchEvery<W>) == 0) {  // once per cache line of kept values, per row
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(values[r] + kPrefetchAhead, _MM_HINT_T0);
        if ((k & 511) == 0) _mm_prefetch(reinterpret_cast<const char*>(masks[r]) + 64, _MM_HINT_T0);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 w = expand<W>(kept_bytes<W>(values[r], false), *masks[r]);
      values[r] += 4 * kValueBytes<W>;
      masks[r] += 1;
      for (int t = 0; t < T; ++t) acc[r][t] = _mm256_fmadd_ps(w, xv[t], acc[r][t]);
    }
  }
  if (whole < a.K) {  // a last group of four inputs
    __m256 xv[T];
    for (int t = 0; t < T; ++t)
      xv[t] = _mm256_set_m128(_mm_setzero_ps(), _mm_loadu_ps(x + t * ldx + whole));
    for (int r = 0; r < R; ++r) {
      const __m256 w = expand<W>(kept_bytes<W>(values[r], true), *masks[r] & 0x0F);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm256_fmadd_ps(w, xv[t], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      store_sum(a, (m + t) * a.ldy + n + r, n + r, horizontal_sum(acc[r][t]));
}

// Every token of rows [n, n + G): one pass for up to four tokens; else tiles of up to four
// tokens pass over the group while it is in cache, so the weights are read from memory once.
template <int G, WeightType W>
WS_TARGET void rows_all_tokens(const RowsArgs& a, const float* x, int64_t n) {
  switch (a.M) {
    case 1: rows_block<G, 1, W>(a, x, 0, n); return;
    case 2: rows_block<G, 2, W>(a, x, 0, n); return;
    case 3: rows_block<G, 3, W>(a, x, 0, n); return;
    case 4: rows_block<G, 4, W>(a, x, 0, n); return;
    default: break;
  }
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4) rows_block_cached<G, 4, W>(a, x + m * a.ldx, m, n);
  switch (a.M - m) {
    case 3: rows_block_cached<G, 3, W>(a, x + m * a.ldx, m, n); break;
    case 2: rows_block_cached<G, 2, W>(a, x + m * a.ldx, m, n); break;
    case 1: rows_block_cached<G, 1, W>(a, x + m * a.ldx, m, n); break;
    default: break;
  }
}

template <int R, WeightType W>
WS_TARGET void rows_typed(const RowsArgs& a) {
  const float* x = static_cast<const float*>(a.x);
  int64_t n = a.n_begin;
  for (; n + R <= a.n_end; n += R) rows_all_tokens<R, W>(a, x, n);
  for (; n < a.n_end; ++n) rows_all_tokens<1, W>(a, x, n);
}

template <WeightType W>
WS_TARGET void decompress_typed(const DecompressArgs& a) {
  const int64_t half_k = a.K / 2, mask_bytes = (a.K + 7) / 8, K = a.K;
  const int64_t whole = K & ~int64_t(7);
  for (int64_t n = a.n_begin; n < a.n_end; ++n) {
    const uint8_t* mask = a.bitmask + n * mask_bytes;
    const char* values = static_cast<const char*>(a.compressed) + n * half_k * kValueBytes<W>;
    char* out = static_cast<char*>(a.out) + a.out_row(n) * kValueBytes<W>;
    if constexpr (W == WeightType::f32) {
      for (int64_t k = 0; k < whole; k += 8)
        _mm256_storeu_ps(reinterpret_cast<float*>(out) + k,
                         expand<W>(kept_bytes<W>(values + 2 * k, false), mask[k / 8]));
      if (whole < K)
        _mm_storeu_ps(reinterpret_cast<float*>(out) + whole,
                      _mm256_castps256_ps128(expand<W>(kept_bytes<W>(values + 2 * whole, true),
                                                       mask[whole / 8] & 0x0F)));
    } else {
      for (int64_t k = 0; k < whole; k += 8) {
        const __m128i kept = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(values + k));
        const __m128i control =
            _mm_load_si128(reinterpret_cast<const __m128i*>(kByteShuffles.place[mask[k / 8]]));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * k), _mm_shuffle_epi8(kept, control));
      }
      if (whole < K) {
        int32_t two;
        std::memcpy(&two, values + whole, sizeof(two));
        const __m128i control = _mm_load_si128(
            reinterpret_cast<const __m128i*>(kByteShuffles.place[mask[whole / 8] & 0x0F]));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(out + 2 * whole),
                         _mm_shuffle_epi8(_mm_cvtsi32_si128(two), control));
      }
    }
  }
}

template <WeightType W>
void rows_for_tokens(const RowsArgs& args) {
  // rows side by side, each the fastest measured for its token count (JOURNAL.md): one token,
  // one row at a time in memory order (four sums in flight); two tokens, four rows; more
  // tokens, two rows.
  if (args.M == 1) {
    rows_typed<1, W>(args);
  } else if (args.M == 2) {
    rows_typed<4, W>(args);
  } else {
    rows_typed<2, W>(args);
  }
}

}  // namespace

void rows_avx2(const RowsArgs& args) {
  if (args.type == WeightType::f32) {
    rows_for_tokens<WeightType::f32>(args);
  } else {
    rows_for_tokens<WeightType::bf16>(args);
  }
}

void decompress_avx2(const DecompressArgs& args) {
  if (args.type == WeightType::f32) {
    decompress_typed<WeightType::f32>(args);
  } else {
    decompress_typed<WeightType::bf16>(args);
  }
}

}  // namespace whisper_sparse
