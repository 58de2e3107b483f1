// A grouped unstructured layer's rows on AVX-512 with VBMI2 and BF16 (sparse_kernels.h,
// GroupedLayer; cpu/grouped_layout.py), bfloat16 activations and weights: per step of 32
// inputs, the group's kGroupRows rows' kept values lie one after another, so one pointer walks
// the group front to back, advancing by each row's popcount; each row's 32 values are
// expanded by its mask (vpexpandw) and multiplied by vdpbf16ps, as in avx512_bf16.cpp's row
// kernels. One stream per thread, asked for kStreamAhead bytes ahead, instead of the rows
// kernels' two streams per row (this group's and the next's) and their bitmask rows.
#include <cstring>

#include "sparse_kernels.h"

#ifdef WS_EMULATE_INTRINSICS  // plain C++ intrinsics: the tests run this file on any CPU
#include WS_EMULATE_INTRINSICS
#define WS_TARGET
#else
#include <immintrin.h>
#define WS_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,avx512bf16,popcnt")))
#endif

#include "avx512_bf16_parts.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-tree-slp-vectorize")  // as avx512_bf16.cpp
#endif

namespace whisper_sparse {
namespace {

// How far ahead of the pointer the stream's lines are asked for, and the masks' (in steps).
// The throwaway probe this comes from (docs/serving.md) read 65-67 GB/s with 4 KiB, in a
// phase where dense read 74; other distances were no faster.
constexpr int64_t kStreamAhead = 4096;
constexpr int64_t kMasksAhead = 32;

// y[m + t][rows of group g] for T tokens from m (x: token m's row).
template <int T>
WS_TARGET void group_tokens(const RowsArgs& a, const uint16_t* x, int64_t m, int64_t g) {
  const GroupedLayer& layer = a.grouped;
  const int64_t steps = group_steps(a.K), whole = a.K / 32;
  const uint16_t* values = static_cast<const uint16_t*>(a.compressed) + layer.offsets[g];
  const uint32_t* masks = layer.group_masks(g, a.K);
  const uint32_t* masks_end = masks + steps * kGroupRows;
  __m512 acc[kGroupRows][T];
  for (int r = 0; r < kGroupRows; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    const uint32_t* step = masks + s * kGroupRows;
    if ((s & 1) == 0 && step + kMasksAhead * kGroupRows < masks_end)
      __builtin_prefetch(step + kMasksAhead * kGroupRows, 0, 3);  // a line: two steps' masks
    __m512i xv[T];
    if (s < whole) {
      for (int t = 0; t < T; ++t) xv[t] = _mm512_loadu_si512(x + t * a.ldx + s * 32);
    } else {  // the layer's last inputs: only their bytes
      const __mmask32 inputs = (uint32_t(1) << (a.K - s * 32)) - 1;
      for (int t = 0; t < T; ++t) xv[t] = _mm512_maskz_loadu_epi16(inputs, x + t * a.ldx + s * 32);
    }
    const uintptr_t before = reinterpret_cast<uintptr_t>(values) + kStreamAhead;
    __m512i w[kGroupRows];
    for (int r = 0; r < kGroupRows; ++r) {
      w[r] = expand32<false, false>(step[r], values);
      values += __builtin_popcount(step[r]);
    }
    // the lines this step moved past, kStreamAhead bytes on
    const uintptr_t after = reinterpret_cast<uintptr_t>(values) + kStreamAhead;
    for (uintptr_t line = (before + 63) & ~uintptr_t(63); line < after; line += 64)
      __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 3);
    for (int r = 0; r < kGroupRows; ++r)
      for (int t = 0; t < T; ++t)
        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)w[r], (__m512bh)xv[t]);
  }
  for (int r = 0; r < kGroupRows; ++r) {
    const int64_t n = g * kGroupRows + r;
    if (n >= layer.rows) break;
    for (int t = 0; t < T; ++t)
      store_sum(a, (m + t) * a.ldy + n, n, _mm512_reduce_add_ps(acc[r][t]));
  }
}

// Every token of group g: tiles of two tokens pass over the group while it is in cache. (8
// rows x 4 tokens is 32 accumulators, beside 8 expanded rows: they spilled, and 4 tokens ran
// 1.5x slower than the rows layout's 4-row groups in an 8-layer 7B pass on a Zen 5 EPYC.)
WS_TARGET void group_all_tokens(const RowsArgs& a, const uint16_t* x, int64_t g) {
  int64_t m = 0;
  for (; m + 2 <= a.M; m += 2) group_tokens<2>(a, x + m * a.ldx, m, g);
  if (m < a.M) group_tokens<1>(a, x + m * a.ldx, m, g);
}

}  // namespace

void rows_grouped_avx512_bf16(const RowsArgs& args) {
  const uint16_t* x = static_cast<const uint16_t*>(args.x);
  for (int64_t n = args.n_begin; n < args.n_end; n += kGroupRows)
    group_all_tokens(args, x, n / kGroupRows);
}

}  // namespace whisper_sparse
