// 2:4 rows on AVX-512 F/BW/VL/VBMI2 with float32 activations (sparse_kernels.h): sixteen bits of
// the bitmask are the mask of one expand-load, which places the eight kept values of sixteen
// inputs in their lanes (vexpandps for float32 weights, vpexpandw then a shift for bfloat16).
#include <cstring>

#include "sparse_kernels.h"

#ifdef WS_EMULATE_INTRINSICS  // plain C++ intrinsics: the tests run this file on any CPU
#include WS_EMULATE_INTRINSICS
#define WS_TARGET
#else
#include <immintrin.h>
#define WS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,popcnt")))
#endif

namespace whisper_sparse {
namespace {

// Sixteen dense weights, as float32, from the `count` kept values at ``values`` (element
// ``offset`` on) and the sixteen bits of the bitmask that cover them (count <= 16, an
// unstructured row's popcount; 8 for a whole group of sixteen inputs of a 2:4 row, loaded
// without a mask). The values are loaded plainly and expanded
// in registers: the expand-load from memory was slower on a Zen 5 EPYC (avx512_bf16.cpp).
template <WeightType W, bool Whole = true>
WS_TARGET inline __m512 expand16(const void* values, int64_t offset, __mmask16 mask,
                                 int64_t count = 8) {
  const __mmask16 loaded = __mmask16((1u << count) - 1);
  if constexpr (W == WeightType::f32) {
    const float* source = static_cast<const float*>(values) + offset;
    const __m512 kept = Whole ? _mm512_castps256_ps512(_mm256_loadu_ps(source))
                              : _mm512_maskz_loadu_ps(loaded, source);
    return _mm512_maskz_expand_ps(mask, kept);
  } else {
    const uint16_t* source = static_cast<const uint16_t*>(values) + offset;
    const __m256i kept =
        Whole ? _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(source)))
              : _mm256_maskz_loadu_epi16(loaded, source);
    const __m256i bits = _mm256_maskz_expand_epi16(mask, kept);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}

template <WeightType W>
constexpr int64_t kValueBytes = W == WeightType::f32 ? 4 : 2;

// Software prefetch (as in avx2.cpp: 2 R streams are more than the hardware
// prefetchers follow well): the line kPrefetchAhead bytes ahead, once per 64 bytes of a
// row's kept values (every 32 inputs for float32, 64 for bfloat16).
constexpr int64_t kPrefetchAhead = 1024;
template <WeightType W>
constexpr int64_t kPrefetchEvery = W == WeightType::f32 ? 31 : 63;

// y[m + t][n + r] for R rows from n and T tokens from m (x: token m's row): each row's kept
// values and bitmask are walked
// by a pointer of its own.
// (U: an unstructured row, whose values start at row_offsets[n + r], as many per sixteen
// inputs as their mask bits.)
template <int R, int T, WeightType W, bool U>
WS_TARGET void rows_block(const RowsArgs& a, const float* x, int64_t m, int64_t n) {
  const int64_t half_k = a.K / 2, mask_bytes = (a.K + 7) / 8, ldx = a.ldx;
  const int64_t whole = a.K & ~int64_t(15);
  const char* values[R];
  int64_t next_group[R];  // bytes from this row's values to the next group's row's
  const uint8_t* masks[R];
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r) {
    const int64_t start = U ? a.row_offsets[n + r] : (n + r) * half_k;
    values[r] = static_cast<const char*>(a.compressed) + start * kValueBytes<W>;
    const int64_t next = !U ? start + R * half_k
                            : n + r + R < a.n_end ? a.row_offsets[n + r + R] : start;
    next_group[r] = (next - start) * kValueBytes<W>;
    masks[r] = a.bitmask + (n + r) * mask_bytes;
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < whole; k += 16) {
    __m512 xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm512_loadu_ps(x + t * ldx + k);
    if ((k & kPrefetchEvery<W>) == 0) {  // once per cache line of kept values, per row
      for (int r = 0; r < R; ++r) {
        __builtin_prefetch(values[r] + kPrefetchAhead, 0, 3);
        __builtin_prefetch(values[r] + next_group[r], 0, 3);  // the next group
        if ((k & 511) == 0) {
          __builtin_prefetch(masks[r] + 64, 0, 3);
          __builtin_prefetch(masks[r] + R * mask_bytes, 0, 3);
        }
      }
    }
    __m512 w[R];  // expanded first, multiplied after (avx512_bf16.cpp's rows_block says why)
    for (int r = 0; r < R; ++r) {
      uint16_t mask;
      std::memcpy(&mask, masks[r], sizeof(mask));
      const int64_t count = U ? __builtin_popcount(mask) : 8;
      w[r] = U ? expand16<W, false>(values[r], 0, mask, count) : expand16<W>(values[r], 0, mask);
      values[r] += count * kValueBytes<W>;
      masks[r] += 2;
    }
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_fmadd_ps(w[r], xv[t], acc[r][t]);
  }
  if (whole < a.K) {
    const int64_t rest = a.K - whole;
    const __mmask16 inputs = __mmask16((1u << rest) - 1);
    __m512 xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm512_maskz_loadu_ps(inputs, x + t * ldx + whole);
    for (int r = 0; r < R; ++r) {
      const __mmask16 mask = __mmask16(mask_bits(masks[r], 0, rest));
      const int64_t count = U ? __builtin_popcount(mask) : rest / 2;
      const __m512 w = expand16<W, false>(values[r], 0, mask, count);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_fmadd_ps(w, xv[t], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      store_sum(a, (m + t) * a.ldy + n + r, n + r, _mm512_reduce_add_ps(acc[r][t]));
}

// Every token of rows [n, n + G): tiles of up to four tokens pass over the group while it is
// in cache, so the weights are read from memory once.
template <int G, WeightType W, bool U>
WS_TARGET void rows_all_tokens(const RowsArgs& a, const float* x, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4) rows_block<G, 4, W, U>(a, x + m * a.ldx, m, n);
  switch (a.M - m) {
    case 3: rows_block<G, 3, W, U>(a, x + m * a.ldx, m, n); break;
    case 2: rows_block<G, 2, W, U>(a, x + m * a.ldx, m, n); break;
    case 1: rows_block<G, 1, W, U>(a, x + m * a.ldx, m, n); break;
    default: break;
  }
}

template <WeightType W, bool U>
WS_TARGET void rows_typed(const RowsArgs& a) {
  const float* x = static_cast<const float*>(a.x);
  int64_t n = a.n_begin;
  for (; n + 4 <= a.n_end; n += 4) rows_all_tokens<4, W, U>(a, x, n);
  for (; n < a.n_end; ++n) rows_all_tokens<1, W, U>(a, x, n);
}

// The expansion's software prefetch: one row at a time, so further ahead than the row kernels'
// kPrefetchAhead (an unstructured row's loads advance by each mask's popcount, a stride the
// CPU's own prefetcher misses). The distance is the shortest of the fastest measured
// (JOURNAL.md).
constexpr int64_t kExpandPrefetchAhead = 2048;

WS_TARGET inline void prefetch_values(const void* values) {
  __builtin_prefetch(static_cast<const char*>(values) + kExpandPrefetchAhead, 0, 3);
}

// A 2:4 row's whole groups of 32 (bfloat16) or 16 (float32) inputs: each holds exactly half
// its inputs' values, so each group is one plain load of half a register, expanded, and one
// plain store, faster than the general loop below (JOURNAL.md); the inputs done.
template <WeightType W>
WS_TARGET int64_t decompress_two_four(const void* compressed, const uint8_t* mask, int64_t K,
                                      void* out_row) {
  if constexpr (W == WeightType::f32) {
    const float* values = static_cast<const float*>(compressed);
    float* out = static_cast<float*>(out_row);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      prefetch_values(values + k / 2);
      const __m512 half = _mm512_castps256_ps512(_mm256_loadu_ps(values + k / 2));
      _mm512_storeu_ps(out + k, _mm512_maskz_expand_ps(__mmask16(mask_bits(mask, k, 16)), half));
    }
    return k;
  } else {
    const uint16_t* values = static_cast<const uint16_t*>(compressed);
    uint16_t* out = static_cast<uint16_t*>(out_row);
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      prefetch_values(values + k / 2);
      const __m512i half = _mm512_castsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + k / 2)));
      _mm512_storeu_si512(out + k, _mm512_maskz_expand_epi16(mask_bits(mask, k, 32), half));
    }
    return k;
  }
}

// Dense rows, each walked by a cursor over its kept values that advances by the mask's
// popcount: 2:4 rows (half of every group marked) and unstructured ones (row_offsets) alike;
// a 2:4 row's whole groups first by decompress_two_four; the values asked for ahead.
template <WeightType W>
WS_TARGET void decompress_typed(const DecompressArgs& a) {
  const int64_t half_k = a.K / 2, mask_bytes = (a.K + 7) / 8;
  constexpr int64_t kElement = W == WeightType::f32 ? 4 : 2;
  for (int64_t n = a.n_begin; n < a.n_end; ++n) {
    const uint8_t* mask = a.bitmask + n * mask_bytes;
    const int64_t row = a.out_row(n);
    const int64_t start = a.row_offsets != nullptr ? a.row_offsets[n] : n * half_k;
    const int64_t done = a.row_offsets != nullptr ? 0 : decompress_two_four<W>(
        static_cast<const char*>(a.compressed) + start * kElement, mask, a.K,
        static_cast<char*>(a.out) + row * kElement);  // fmt: skip
    if constexpr (W == WeightType::f32) {
      const float* values = static_cast<const float*>(a.compressed) + start + done / 2;
      float* out = static_cast<float*>(a.out) + row;
      for (int64_t k = done; k < a.K; k += 16) {
        const int64_t count = a.K - k < 16 ? a.K - k : 16;
        const __mmask16 inputs = __mmask16(count == 16 ? 0xFFFF : (1u << count) - 1);
        const __mmask16 kept = __mmask16(mask_bits(mask, k, count));
        const int marked = __builtin_popcount(kept);
        prefetch_values(values);
        const __m512 values_in = _mm512_maskz_loadu_ps(__mmask16((1u << marked) - 1), values);
        _mm512_mask_storeu_ps(out + k, inputs, _mm512_maskz_expand_ps(kept, values_in));
        values += marked;
      }
    } else {
      const uint16_t* values = static_cast<const uint16_t*>(a.compressed) + start + done / 2;
      uint16_t* out = static_cast<uint16_t*>(a.out) + row;
      for (int64_t k = done; k < a.K; k += 32) {
        const int64_t count = a.K - k < 32 ? a.K - k : 32;
        const __mmask32 inputs = count == 32 ? 0xFFFFFFFFu : (1u << count) - 1;
        const __mmask32 kept = mask_bits(mask, k, count);
        const int marked = __builtin_popcount(kept);
        prefetch_values(values);
        const __m512i values_in = _mm512_maskz_loadu_epi16(
            marked == 32 ? 0xFFFFFFFFu : (uint32_t(1) << marked) - 1, values);
        _mm512_mask_storeu_epi16(out + k, inputs, _mm512_maskz_expand_epi16(kept, values_in));
        values += marked;
      }
    }
  }
}

}  // namespace

void rows_avx512(const RowsArgs& args) {
  const bool unstructured = args.row_offsets != nullptr;
  if (args.type == WeightType::f32) {
    unstructured ? rows_typed<WeightType::f32, true>(args)
                 : rows_typed<WeightType::f32, false>(args);
  } else {
    unstructured ? rows_typed<WeightType::bf16, true>(args)
                 : rows_typed<WeightType::bf16, false>(args);
  }
}

namespace {

// A grouped layer's dense rows [n_begin, n_end) (bfloat16; GroupedLayer): each group's stream
// walked once, each row's 32 inputs of a step expanded by its mask (vpexpandw); rows of the
// group outside the range are walked past.
WS_TARGET void decompress_grouped(const DecompressArgs& a) {
  const GroupedLayer& layer = a.grouped;
  const int64_t steps = group_steps(a.K), whole = a.K / 32;
  for (int64_t g = a.n_begin / kGroupRows; g * kGroupRows < a.n_end; ++g) {
    const uint16_t* values = static_cast<const uint16_t*>(a.compressed) + layer.offsets[g];
    const uint32_t* masks = layer.group_masks(g, a.K);
    for (int64_t s = 0; s < steps; ++s)
      for (int r = 0; r < kGroupRows; ++r) {
        const uint32_t mask = masks[s * kGroupRows + r];
        const int64_t n = g * kGroupRows + r;
        if (n >= a.n_begin && n < a.n_end) {
          const __m512i w = _mm512_maskz_expand_epi16(mask, _mm512_loadu_si512(values));
          uint16_t* out = static_cast<uint16_t*>(a.out) + a.out_row(n) + s * 32;
          if (s < whole) {
            _mm512_storeu_si512(out, w);
          } else {
            _mm512_mask_storeu_epi16(out, (uint32_t(1) << (a.K - s * 32)) - 1, w);
          }
        }
        values += __builtin_popcount(mask);
      }
  }
}

}  // namespace

void decompress_avx512(const DecompressArgs& args) {
  if (args.grouped.defined()) {
    decompress_grouped(args);
  } else if (args.type == WeightType::f32) {
    decompress_typed<WeightType::f32>(args);
  } else {
    decompress_typed<WeightType::bf16>(args);
  }
}

}  // namespace whisper_sparse
