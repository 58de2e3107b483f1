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

// How far ahead of the pointer the stream's lines are asked for, and the masks' (in steps):
// the probe this comes from was fastest at 4 KiB (JOURNAL.md).
constexpr int64_t kStreamAhead = 4096;
constexpr int64_t kMasksAhead = 32;

// What a pass over a group asks for ahead of its pointer. A group's only pass (one or two
// tokens) reads it from memory as a stream, asked for kStreamAhead bytes on, into L1. Where a
// group takes n passes (three tokens or more), each asks, into L2, for its n-th of the group
// kGroupsAhead groups on, evenly over its steps, so that memory streams at one pace through
// every pass (the first pass then finds its group in L2). Asking instead for the whole next
// group in the second pass only (memory idle through much of the first, which streamed its
// own group kStreamAhead bytes on) was slower, and two groups on the fastest (JOURNAL.md).
enum class Ahead { kStream, kShare };
constexpr int64_t kGroupsAhead = 2;

// Asks for the lines that start in [from, to), into the cache level of `hint` (3: L1, 2: L2).
template <int Hint>
WS_TARGET inline void ask_lines(uintptr_t from, uintptr_t to) {
  for (uintptr_t line = (from + 63) & ~uintptr_t(63); line < to; line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, Hint);
}

// The lines of a pass's share (pass `pass` of `passes`) of the group kGroupsAhead groups after
// `group`, asked for step by step: step s asks for the share's s-th steps-th.
struct ShareAhead {
  uintptr_t start = 0;
  int64_t step_bytes = 0;  // the share's bytes per step, in 1/65536 bytes

  ShareAhead() = default;
  ShareAhead(const void* group, int64_t group_bytes, int64_t steps, int pass, int passes)
      : start(reinterpret_cast<uintptr_t>(group) + kGroupsAhead * group_bytes),
        step_bytes((group_bytes << 16) / (int64_t(passes) * steps)) {
    start += uintptr_t((int64_t(pass) * steps * step_bytes) >> 16);
  }
  WS_TARGET void ask(int64_t s) const {
    ask_lines<2>(start + uintptr_t((s * step_bytes) >> 16),
                 start + uintptr_t(((s + 1) * step_bytes) >> 16));
  }
};

// y[m + t][rows First .. First + R of group g] for T tokens from m (x: token m's row), in pass
// `pass` of the group's `passes`. The pointer walks the whole group (all kGroupRows rows'
// popcounts), expanding only rows First .. First + R.
template <int T, int First, int R, Ahead kAhead>
WS_TARGET void group_tokens(const RowsArgs& a, const uint16_t* x, int64_t m, int64_t g, int pass,
                            int passes) {
  const GroupedLayer& layer = a.grouped;
  const int64_t steps = group_steps(a.K), whole = a.K / 32;
  const uint16_t* values = static_cast<const uint16_t*>(a.compressed) + layer.offsets[g];
  const int64_t group_bytes = (layer.offsets[g + 1] - layer.offsets[g]) * sizeof(uint16_t);
  const ShareAhead share = kAhead == Ahead::kShare
                               ? ShareAhead(values, group_bytes, steps, pass, passes)
                               : ShareAhead();
  const uint32_t* masks = layer.group_masks(g, a.K);
  const uint32_t* masks_end = masks + steps * kGroupRows;
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    const uint32_t* step = masks + s * kGroupRows;
    // the group's first pass (its only one, where it streams) asks for its masks
    if (pass == 0 && (s & 1) == 0 && step + kMasksAhead * kGroupRows < masks_end)
      __builtin_prefetch(step + kMasksAhead * kGroupRows, 0, 3);  // a line: two steps' masks
    __m512i xv[T];
    if (s < whole) {
      for (int t = 0; t < T; ++t) xv[t] = _mm512_loadu_si512(x + t * a.ldx + s * 32);
    } else {  // the layer's last inputs: only their bytes
      const __mmask32 inputs = (uint32_t(1) << (a.K - s * 32)) - 1;
      for (int t = 0; t < T; ++t) xv[t] = _mm512_maskz_loadu_epi16(inputs, x + t * a.ldx + s * 32);
    }
    const uintptr_t before = reinterpret_cast<uintptr_t>(values) + kStreamAhead;
    for (int r = 0; r < First; ++r) values += __builtin_popcount(step[r]);
    __m512i w[R];
    for (int r = 0; r < R; ++r) {
      w[r] = expand32<false, false>(step[First + r], values);
      values += __builtin_popcount(step[First + r]);
    }
    for (int r = First + R; r < kGroupRows; ++r) values += __builtin_popcount(step[r]);
    if (kAhead == Ahead::kStream)  // the lines this step moved past, kStreamAhead bytes on
      ask_lines<3>(before, reinterpret_cast<uintptr_t>(values) + kStreamAhead);
    else
      share.ask(s);
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

// Pass `pass` of `passes` over group g: T tokens from m, rows First .. First + R.
template <int T, int First, int R>
WS_TARGET void group_pass(const RowsArgs& a, const uint16_t* x, int64_t m, int64_t g, int pass,
                          int passes) {
  if (passes == 1)
    group_tokens<T, First, R, Ahead::kStream>(a, x + m * a.ldx, m, g, pass, passes);
  else
    group_tokens<T, First, R, Ahead::kShare>(a, x + m * a.ldx, m, g, pass, passes);
}

// Every token of group g. Tiles of four tokens take the group in two passes of half its rows
// (16 accumulators, 4 expanded rows, 4 tokens' inputs: all in registers; the whole group at
// once is 32 accumulators beside 8 expanded rows, which spill); the last two tokens or one
// take the whole group in one pass.
WS_TARGET void group_all_tokens(const RowsArgs& a, const uint16_t* x, int64_t g) {
  constexpr int kHalf = kGroupRows / 2;
  const int passes = int(2 * (a.M / 4) + (a.M % 4) / 2 + a.M % 2);
  int pass = 0;
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4) {
    group_pass<4, 0, kHalf>(a, x, m, g, pass++, passes);
    group_pass<4, kHalf, kHalf>(a, x, m, g, pass++, passes);
  }
  if (m + 2 <= a.M) {
    group_pass<2, 0, kGroupRows>(a, x, m, g, pass++, passes);
    m += 2;
  }
  if (m < a.M) group_pass<1, 0, kGroupRows>(a, x, m, g, pass, passes);
}

}  // namespace

void rows_grouped_avx512_bf16(const RowsArgs& args) {
  const uint16_t* x = static_cast<const uint16_t*>(args.x);
  for (int64_t n = args.n_begin; n < args.n_end; n += kGroupRows)
    group_all_tokens(args, x, n / kGroupRows);
}

}  // namespace whisper_sparse
