// The 2:4 GEMM on AVX-512 with VBMI2 and BF16 (sparse_kernels.h, GemmArgs), for batched decode and
// prefill: y = x W^T multiplying only the kept values, half the products of a dense GEMM.
//
// In a 2:4 row the kept values of a group of four inputs are one 32-bit word of `compressed`,
// (v0, v1), and the bitmask's nibble says which two of the four inputs they belong to
// (i0 < i1). For 16 rows at a time a block is laid out once per call:
//   pairs[g]: the 16 rows' words of group g (a 16 x 16 transpose of the stored words);
//   picks[g]: per row, (i0, i1) as two 16-bit lanes (the nibble looked up in kPicks).
// The micro-kernel then broadcasts the group's four inputs of a token (64 bits), vpermw picks
// each row's two (x[i0], x[i1]), and vdpbf16ps adds v0 x[i0] + v1 x[i1] into the row's float32
// lane: one permute and one dot product per 16 rows, group and token, where a dense GEMM
// spends two dot products on the group's four inputs, half of them on zeros.
//
//   for each block of kBlockRows rows (a thread's share), kBlockGroups groups at a time:
//     lay the block out (prefetching the rows' next bytes); for every pair of 16-row
//     registers and tile of kTile tokens: the micro-kernel (2 x kTile float32 accumulators)
//     over the block's groups, its sums kept per token and row across blocks of groups;
//   then each token's sums, plus the bias, rounded once to bfloat16 into y.
//
// The layout costs what the micro-kernel does not at few tokens: below about 32 the row
// kernels win (the plan measures it). A block is laid out once per 512 tokens, so that the
// layout stays a small share of a call (measured: benchmarks/results/JOURNAL.md).
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "sparse_kernels.h"

#ifdef WS_EMULATE_INTRINSICS  // plain C++ intrinsics: the tests run this file on any CPU
#include WS_EMULATE_INTRINSICS
#define WS_TARGET
#else
#include <immintrin.h>
#define WS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,avx512bf16")))
#endif

#include "avx512_bf16_parts.h"

namespace whisper_sparse {
namespace {

constexpr int64_t kBlockVectors = 4;      // registers of rows per block: 64 rows
constexpr int64_t kBlockRows = kBlockVectors * kLanes;
constexpr int64_t kBlockGroups = 512;     // groups of four inputs laid out at a time (2048)
constexpr int64_t kTokensPerPass = 512;   // tokens whose sums a block holds (128 KiB)
constexpr int64_t kPanel = 64;            // groups per micro-kernel call (its pairs in L1)
constexpr int kTile = 8;                  // tokens per micro-kernel call

// Per nibble of the bitmask: the positions of its two marks, i0 | i1 << 16 (0 where it does
// not mark exactly two; check_compressed refuses such a layer before it is loaded).
struct PickTable {
  alignas(64) uint32_t value[16] = {};
  PickTable() {
    for (int nibble = 0; nibble < 16; ++nibble) {
      int found[2], count = 0;
      for (int i = 0; i < 4; ++i)
        if (nibble >> i & 1) found[count < 2 ? count : 1] = i, ++count;
      if (count == 2) value[nibble] = uint32_t(found[0]) | uint32_t(found[1]) << 16;
    }
  }
};
const PickTable kPicks;

// Per-thread buffers, allocated once: a block's layout and its sums.
struct Scratch {
  __m512i* pairs = static_cast<__m512i*>(
      std::aligned_alloc(64, kBlockVectors * kBlockGroups * sizeof(__m512i)));
  __m512i* picks = static_cast<__m512i*>(
      std::aligned_alloc(64, kBlockVectors * kBlockGroups * sizeof(__m512i)));
  float* sums = static_cast<float*>(
      std::aligned_alloc(64, kTokensPerPass * kBlockRows * sizeof(float)));
  ~Scratch() {
    std::free(pairs);
    std::free(picks);
    std::free(sums);
  }
};

Scratch& scratch() {
  static thread_local Scratch buffers;
  return buffers;
}

// The picks of 16 groups of one row: its 8 bitmask bytes' nibbles, in order, looked up.
WS_TARGET inline __m512i row_picks(const uint8_t* mask, int64_t groups) {
  uint64_t bytes = 0;
  if (groups == 16) {
    std::memcpy(&bytes, mask, 8);
  } else {
    std::memcpy(&bytes, mask, (groups + 1) / 2);
  }
  const __m128i packed = _mm_cvtsi64_si128(static_cast<long long>(bytes));
  const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(0x0F));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F));
  const __m512i nibbles = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(low, high));
  return _mm512_permutexvar_epi32(nibbles, _mm512_load_si512(kPicks.value));
}

constexpr int64_t kPrefetchChunks = 8;  // lay_out asks for a row's words 8 x 64 bytes ahead

// Rows [n, n + 16 * vectors) (those before n_end), groups [g0, g0 + groups) of the layer, as
// pairs[v][g] and picks[v][g] (v < vectors, g < groups; rows past n_end are zeros).
WS_TARGET void lay_out(const GemmArgs& a, int64_t n, int64_t vectors, int64_t g0, int64_t groups,
                       __m512i* pairs, __m512i* picks) {
  const int64_t words_per_row = a.K / 4, mask_bytes = (a.K + 7) / 8;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(a.compressed);
  for (int64_t v = 0; v < vectors; ++v) {
    for (int64_t g = g0; g < g0 + groups; g += 16) {
      const int64_t count = std::min<int64_t>(16, g0 + groups - g);
      const __mmask16 in_row = __mmask16((uint32_t(1) << count) - 1);
      __m512 kept[16], where[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t row = n + kLanes * v + i;
        if (row < a.n_end) {
          __builtin_prefetch(words + row * words_per_row + g + 16 * kPrefetchChunks, 0, 3);
          if ((g & 127) == 0) __builtin_prefetch(a.bitmask + row * mask_bytes + g / 2 + 64, 0, 3);
          kept[i] = _mm512_castsi512_ps(
              _mm512_maskz_loadu_epi32(in_row, words + row * words_per_row + g));
          where[i] = _mm512_castsi512_ps(row_picks(a.bitmask + row * mask_bytes + g / 2, count));
        } else {
          kept[i] = where[i] = _mm512_setzero_ps();
        }
      }
      transpose16(kept);  // now group g + j's 16 rows
      transpose16(where);
      const int64_t at = v * kBlockGroups + (g - g0);
      for (int64_t j = 0; j < count; ++j) {
        pairs[at + j] = _mm512_castps_si512(kept[j]);
        picks[at + j] = _mm512_castps_si512(where[j]);
      }
    }
  }
}

// sums[t][16 v + r] (+)= sum over `groups` groups g of row r's v0 x[t][i0] + v1 x[t][i1], for
// V registers of rows (pairs / picks kBlockGroups apart) and T tokens from x (row stride ldx,
// at the first group); `first` starts the sums at zero.
template <int V, int T>
WS_TARGET void micro(const __m512i* pairs, const __m512i* picks, const uint16_t* x, int64_t ldx,
                     int64_t groups, float* sums, bool first) {
  __m512 acc[V][T];
  for (int v = 0; v < V; ++v)
    for (int t = 0; t < T; ++t)
      acc[v][t] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + t * kBlockRows + 16 * v);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i w[V], p[V];
    for (int v = 0; v < V; ++v) {
      w[v] = _mm512_load_si512(pairs + v * kBlockGroups + g);
      p[v] = _mm512_load_si512(picks + v * kBlockGroups + g);
    }
    for (int t = 0; t < T; ++t) {
      long long four;
      std::memcpy(&four, x + t * ldx + 4 * g, sizeof(four));
      const __m512i inputs = _mm512_set1_epi64(four);
      for (int v = 0; v < V; ++v)
        acc[v][t] = _mm512_dpbf16_ps(acc[v][t], (__m512bh)w[v],
                                     (__m512bh)_mm512_permutexvar_epi16(p[v], inputs));
    }
  }
  for (int v = 0; v < V; ++v)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(sums + t * kBlockRows + 16 * v, acc[v][t]);
}

// micro<V, .> over `tokens` tokens: tiles of kTile, then the rest.
template <int V>
WS_TARGET void tokens_tiled(const __m512i* pairs, const __m512i* picks, const uint16_t* x,
                            int64_t ldx, int64_t groups, float* sums, int64_t tokens,
                            bool first) {
  int64_t t = 0;
  for (; t + kTile <= tokens; t += kTile)
    micro<V, kTile>(pairs, picks, x + t * ldx, ldx, groups, sums + t * kBlockRows, first);
  x += t * ldx, sums += t * kBlockRows;
  switch (tokens - t) {
    case 7: micro<V, 7>(pairs, picks, x, ldx, groups, sums, first); break;
    case 6: micro<V, 6>(pairs, picks, x, ldx, groups, sums, first); break;
    case 5: micro<V, 5>(pairs, picks, x, ldx, groups, sums, first); break;
    case 4: micro<V, 4>(pairs, picks, x, ldx, groups, sums, first); break;
    case 3: micro<V, 3>(pairs, picks, x, ldx, groups, sums, first); break;
    case 2: micro<V, 2>(pairs, picks, x, ldx, groups, sums, first); break;
    case 1: micro<V, 1>(pairs, picks, x, ldx, groups, sums, first); break;
    default: break;
  }
}

}  // namespace

WS_TARGET void gemm_avx512_bf16(const GemmArgs& a) {
  Scratch& buffers = scratch();
  const int64_t all_groups = a.K / 4;
  for (int64_t t0 = 0; t0 < a.M; t0 += kTokensPerPass) {
    const int64_t tokens = std::min(kTokensPerPass, a.M - t0);
    for (int64_t n = a.n_begin; n < a.n_end; n += kBlockRows) {
      const int64_t vectors = std::min(kBlockVectors, (a.n_end - n + kLanes - 1) / kLanes);
      for (int64_t g0 = 0; g0 < all_groups; g0 += kBlockGroups) {
        const int64_t groups = std::min(kBlockGroups, all_groups - g0);
        lay_out(a, n, vectors, g0, groups, buffers.pairs, buffers.picks);
        for (int64_t p = 0; p < groups; p += kPanel) {  // a panel's pairs stay in L1
          const int64_t panel = std::min(kPanel, groups - p);
          const uint16_t* x = a.x + t0 * a.ldx + 4 * (g0 + p);
          const bool first = g0 == 0 && p == 0;
          int64_t v = 0;
          for (; v + 2 <= vectors; v += 2)
            tokens_tiled<2>(buffers.pairs + v * kBlockGroups + p,
                            buffers.picks + v * kBlockGroups + p, x, a.ldx, panel,
                            buffers.sums + 16 * v, tokens, first);
          if (v < vectors)
            tokens_tiled<1>(buffers.pairs + v * kBlockGroups + p,
                            buffers.picks + v * kBlockGroups + p, x, a.ldx, panel,
                            buffers.sums + 16 * v, tokens, first);
        }
      }
      store_block<kBlockRows>(a, buffers.sums, n, t0, tokens);
    }
  }
}

}  // namespace whisper_sparse
