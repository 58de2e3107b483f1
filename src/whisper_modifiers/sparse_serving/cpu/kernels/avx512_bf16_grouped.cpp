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

// What a pass over a group asks for ahead of its pointer: the stream kStreamAhead bytes on,
// into L1 (the pass that comes first, which reads the group from memory), or the next group's
// lines a group's length on, into L2 (a later pass, which finds this group in cache: memory
// would otherwise stand idle while it runs).
enum class Ahead { kStream, kNextGroup };

// y[m + t][rows First .. First + R of group g] for T tokens from m (x: token m's row). The
// pointer walks the whole group (all kGroupRows rows' popcounts), expanding only rows First ..
// First + R.
template <int T, int First, int R, Ahead kAhead>
WS_TARGET void group_tokens(const RowsArgs& a, const uint16_t* x, int64_t m, int64_t g) {
  const GroupedLayer& layer = a.grouped;
  const int64_t steps = group_steps(a.K), whole = a.K / 32;
  const uint16_t* values = static_cast<const uint16_t*>(a.compressed) + layer.offsets[g];
  const uintptr_t ahead = kAhead == Ahead::kStream
                              ? kStreamAhead
                              : (layer.offsets[g + 1] - layer.offsets[g]) * sizeof(uint16_t);
  const uint32_t* masks = layer.group_masks(g, a.K);
  const uint32_t* masks_end = masks + steps * kGroupRows;
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    const uint32_t* step = masks + s * kGroupRows;
    if (kAhead == Ahead::kStream && (s & 1) == 0 && step + kMasksAhead * kGroupRows < masks_end)
      __builtin_prefetch(step + kMasksAhead * kGroupRows, 0, 3);  // a line: two steps' masks
    __m512i xv[T];
    if (s < whole) {
      for (int t = 0; t < T; ++t) xv[t] = _mm512_loadu_si512(x + t * a.ldx + s * 32);
    } else {  // the layer's last inputs: only their bytes
      const __mmask32 inputs = (uint32_t(1) << (a.K - s * 32)) - 1;
      for (int t = 0; t < T; ++t) xv[t] = _mm512_maskz_loadu_epi16(inputs, x + t * a.ldx + s * 32);
    }
    const uintptr_t before = reinterpret_cast<uintptr_t>(values) + ahead;
    for (int r = 0; r < First; ++r) values += __builtin_popcount(step[r]);
    __m512i w[R];
    for (int r = 0; r < R; ++r) {
      w[r] = expand32<false, false>(step[First + r], values);
      values += __builtin_popcount(step[First + r]);
    }
    for (int r = First + R; r < kGroupRows; ++r) values += __builtin_popcount(step[r]);
    // the lines this step moved past, `ahead` bytes on
    const uintptr_t after = reinterpret_cast<uintptr_t>(values) + ahead;
    for (uintptr_t line = (before + 63) & ~uintptr_t(63); line < after; line += 64)
      __builtin_prefetch(reinterpret_cast<const void*>(line), 0, kAhead == Ahead::kStream ? 3 : 2);
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t)
        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)w[r], (__m512bh)xv[t]);
  }
  for (int r = 0; r < R; ++r) {
    const int64_t n = g * kGroupRows + First + r;
    if (n >= layer.rows) break;
    for (int t = 0; t < T; ++t)
      store_sum(a, (m + t) * a.ldy + n, n, _mm512_reduce_add_ps(acc[r][t]));
  }
}

// A pass of T tokens from m over rows First .. First + R of group g: the group's first pass
// reads it as a stream; the passes after it ask for the next group.
template <int T, int First, int R>
WS_TARGET void group_pass(const RowsArgs& a, const uint16_t* x, int64_t m, int64_t g) {
  if (m == 0 && First == 0)
    group_tokens<T, First, R, Ahead::kStream>(a, x + m * a.ldx, m, g);
  else
    group_tokens<T, First, R, Ahead::kNextGroup>(a, x + m * a.ldx, m, g);
}

// Every token of group g. Tiles of four tokens take the group in two passes of half its rows
// (16 accumulators, 4 expanded rows, 4 tokens' inputs: all in registers; the whole group at
// once is 32 accumulators beside 8 expanded rows, which spilled, and ran 4 tokens 1.5x slower
// than the rows layout's 4-row groups in an 8-layer 7B pass on a Zen 5 EPYC); the last two
// tokens or one take the whole group in one pass.
WS_TARGET void group_all_tokens(const RowsArgs& a, const uint16_t* x, int64_t g) {
  constexpr int kHalf = kGroupRows / 2;
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4) {
    group_pass<4, 0, kHalf>(a, x, m, g);
    group_pass<4, kHalf, kHalf>(a, x, m, g);
  }
  if (m + 2 <= a.M) {
    group_pass<2, 0, kGroupRows>(a, x, m, g);
    m += 2;
  }
  if (m < a.M) group_pass<1, 0, kGroupRows>(a, x, m, g);
}

}  // namespace

void rows_grouped_avx512_bf16(const RowsArgs& args) {
  const uint16_t* x = static_cast<const uint16_t*>(args.x);
  for (int64_t n = args.n_begin; n < args.n_end; n += kGroupRows)
    group_all_tokens(args, x, n / kGroupRows);
}

}  // namespace whisper_sparse
