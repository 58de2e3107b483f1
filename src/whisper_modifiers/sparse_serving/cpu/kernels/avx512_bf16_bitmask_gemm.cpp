// The unstructured GEMM on AVX-512 with VBMI2 and BF16 (sparse_kernels.h, GemmArgs with
// row_offsets), for batched decode and prefill: y = x W^T for a W stored as each row's kept
// values, its bitmask and its offsets (bitmask_format).
//
// The kept values have no fixed place, so the products are a dense GEMM's: what this saves is
// the weight bytes read (a row's kept values and a bit per input) and the dense weight never
// held. For 16 rows and 32 inputs at a time a block is laid out once per call: each row's 32
// bits of mask expand its next popcount values into their lanes (vpexpandw), its pointer
// advances by that count, and a 16 x 16 transpose of 32-bit words turns the 16 rows into 16
// registers pairs[p], one per pair of inputs (2p, 2p + 1), each holding that pair of every
// row: the operand of vdpbf16ps. The micro-kernel then broadcasts a token's pair of inputs
// (32 bits) and adds it, by one vdpbf16ps, into each of its row registers' float32 lanes.
//
//   for each block of kBlockRows rows (a thread's share), kBlockPairs pairs at a time:
//     lay the block out; for every panel of kPanel pairs (in L1) and tile of up to kTile
//     tokens: the micro-kernel (2 registers of rows x kTile tokens of float32 accumulators),
//     its sums kept per token and row across panels, while the next chunk's kept values and
//     mask bytes are prefetched into L2; then each token's sums, plus the bias, rounded once
//     to bfloat16 into y.
//
// Measured on a 2-core Zen 5 EPYC (12288 x 4096 at 50 %, against vLLM's dense GEMM, oneDNN
// on a packed weight): 2 x 12 accumulators 0.99x at 512 tokens, 2 x 8 0.96x, 4 x 6 0.88x.
// The layout costs 5.2-5.4 ms of one core for that layer where the row kernels walk the same
// values and multiply one token in 3.1 ms: the 16 rows' streams are latency-bound (prefetching
// farther ahead, walking one row at a time and fewer rows per block were all slower; the
// transpose is a tenth of it). Prefetching the next chunk during the micro-kernel took 64
// tokens from 0.81x to 0.86x; 256 tokens a pass rather than 512 took Llama-2-7B's down_proj
// (11008 inputs) at 512 tokens from 0.84x to 0.93x.
#include <algorithm>
#include <cstdlib>
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

namespace whisper_sparse {
namespace {

constexpr int64_t kBlockVectors = 4;    // registers of rows per block: 64 rows
constexpr int64_t kBlockRows = kBlockVectors * kLanes;
constexpr int64_t kBlockPairs = 256;    // pairs of inputs laid out at a time (512 inputs)
constexpr int64_t kTokensPerPass = 256; // tokens whose sums a block holds (64 KiB)
constexpr int64_t kPanel = 64;          // pairs per micro-kernel call (16 KiB of weights)
constexpr int kTile = 12;               // tokens per micro-kernel call
constexpr int64_t kPrefetchAhead = 128; // values ahead in each row's kept values (256 bytes)

// Per-thread buffers, allocated once: a block's layout and its sums, and where each of its
// rows' next kept value is.
struct Scratch {
  __m512i* pairs = static_cast<__m512i*>(
      std::aligned_alloc(64, kBlockVectors * kBlockPairs * sizeof(__m512i)));
  float* sums = static_cast<float*>(
      std::aligned_alloc(64, kTokensPerPass * kBlockRows * sizeof(float)));
  const uint16_t* next[kBlockRows];
  int64_t span[kBlockRows];  // about how many kept values a row has in a chunk of inputs
  ~Scratch() {
    std::free(pairs);
    std::free(sums);
  }
};

Scratch& scratch() {
  static thread_local Scratch buffers;
  return buffers;
}

// The 32 inputs of a row from input k (`inputs` of them before the layer's last) whose mask
// bits mark its next kept values at `values`, advanced past them (expand32).
WS_TARGET inline __m512i expand_next(const uint8_t* mask_row, int64_t k, int64_t inputs,
                                     const uint16_t*& values, const uint16_t* end) {
  const uint32_t mask = mask_bits(mask_row, k, inputs);
  const int count = __builtin_popcount(mask);
  const __m512i expanded = expand32<false>(mask, values, count, end);
  values += count;
  return expanded;
}

// 32 inputs from k of 16 whole rows (masks: the first's bitmask row, mask_bytes apart), none of
// whose next 32 values lies past the layer's: expand_next without its checks.
WS_TARGET inline void expand_16_rows(const uint8_t* masks, int64_t mask_bytes, int64_t k,
                                     const uint16_t** next, __m512 rows[16]) {
  if ((k & 511) == 0)
    for (int i = 0; i < 16; ++i) __builtin_prefetch(masks + i * mask_bytes + k / 8 + 64, 0, 3);
  for (int i = 0; i < 16; ++i) {
    const uint16_t* values = next[i];
    __builtin_prefetch(values + kPrefetchAhead, 0, 3);
    uint32_t mask;
    std::memcpy(&mask, masks + i * mask_bytes + k / 8, sizeof(mask));
    rows[i] = _mm512_castsi512_ps(expand32<false, false>(mask, values));
    next[i] = values + __builtin_popcount(mask);
  }
}

// Rows [n, n + 16 * vectors) (those before n_end), pairs [p0, p0 + count) of the layer, as
// pairs[v * kBlockPairs + p - p0] (rows past n_end are zeros), each row's values from next[r].
// `whole`: every row of the block is before n_end, and none reads past the layer's values.
WS_TARGET void lay_out(const GemmArgs& a, const uint16_t** next, int64_t n, int64_t vectors,
                       int64_t p0, int64_t count, bool whole, __m512i* pairs) {
  const int64_t mask_bytes = (a.K + 7) / 8;
  const uint16_t* end = a.compressed + a.values_count;
  for (int64_t p = p0; p < p0 + count; p += 16) {
    const int64_t k = 2 * p, inputs = std::min<int64_t>(32, a.K - k);
    for (int64_t v = 0; v < vectors; ++v) {
      __m512 rows[16];
      if (whole && inputs == 32) {
        expand_16_rows(a.bitmask + (n + kLanes * v) * mask_bytes, mask_bytes, k,
                       next + kLanes * v, rows);
      } else {
        for (int i = 0; i < 16; ++i) {
          const int64_t r = kLanes * v + i;
          rows[i] = n + r < a.n_end ? _mm512_castsi512_ps(expand_next(
                                          a.bitmask + (n + r) * mask_bytes, k, inputs, next[r], end))
                                    : _mm512_setzero_ps();
        }
      }
      transpose16(rows);  // now pair p + j of the 16 rows
      const int64_t at = v * kBlockPairs + (p - p0), here = std::min<int64_t>(16, p0 + count - p);
      for (int64_t j = 0; j < here; ++j) pairs[at + j] = _mm512_castps_si512(rows[j]);
    }
  }
}

// sums[t][16 v + r] (+)= sum over `count` pairs p of row r's w[2p] x[t][2p] + w[2p+1]
// x[t][2p+1], for V registers of rows (kBlockPairs apart) and T tokens from x (row stride ldx,
// at the panel's first pair); `first` starts the sums at zero.
template <int V, int T>
WS_TARGET void micro(const __m512i* pairs, const uint16_t* x, int64_t ldx, int64_t count,
                     float* sums, bool first) {
  __m512 acc[V][T];
  for (int v = 0; v < V; ++v)
    for (int t = 0; t < T; ++t)
      acc[v][t] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + t * kBlockRows + 16 * v);
  for (int64_t p = 0; p < count; ++p) {
    __m512i w[V];
    for (int v = 0; v < V; ++v) w[v] = _mm512_load_si512(pairs + v * kBlockPairs + p);
    for (int t = 0; t < T; ++t) {
      int two;
      std::memcpy(&two, x + t * ldx + 2 * p, sizeof(two));
      const __m512i inputs = _mm512_set1_epi32(two);
      for (int v = 0; v < V; ++v)
        acc[v][t] = _mm512_dpbf16_ps(acc[v][t], (__m512bh)w[v], (__m512bh)inputs);
    }
  }
  for (int v = 0; v < V; ++v)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(sums + t * kBlockRows + 16 * v, acc[v][t]);
}

// micro<V, .> over `tokens` tokens: tiles of kTile, then the rest.
template <int V>
WS_TARGET void tokens_tiled(const __m512i* pairs, const uint16_t* x, int64_t ldx, int64_t count,
                            float* sums, int64_t tokens, bool first) {
  int64_t t = 0;
  for (; t + kTile <= tokens; t += kTile)
    micro<V, kTile>(pairs, x + t * ldx, ldx, count, sums + t * kBlockRows, first);
  x += t * ldx, sums += t * kBlockRows;
  switch (tokens - t) {
    case 11: micro<V, 11>(pairs, x, ldx, count, sums, first); break;
    case 10: micro<V, 10>(pairs, x, ldx, count, sums, first); break;
    case 9: micro<V, 9>(pairs, x, ldx, count, sums, first); break;
    case 8: micro<V, 8>(pairs, x, ldx, count, sums, first); break;
    case 7: micro<V, 7>(pairs, x, ldx, count, sums, first); break;
    case 6: micro<V, 6>(pairs, x, ldx, count, sums, first); break;
    case 5: micro<V, 5>(pairs, x, ldx, count, sums, first); break;
    case 4: micro<V, 4>(pairs, x, ldx, count, sums, first); break;
    case 3: micro<V, 3>(pairs, x, ldx, count, sums, first); break;
    case 2: micro<V, 2>(pairs, x, ldx, count, sums, first); break;
    case 1: micro<V, 1>(pairs, x, ldx, count, sums, first); break;
    default: break;
  }
}

// The block's `vectors` registers of rows over one panel, for `tokens` tokens.
WS_TARGET void panel(const __m512i* pairs, int64_t vectors, const uint16_t* x, int64_t ldx,
                     int64_t count, float* sums, int64_t tokens, bool first) {
  int64_t v = 0;
  for (; v + 2 <= vectors; v += 2)
    tokens_tiled<2>(pairs + v * kBlockPairs, x, ldx, count, sums + 16 * v, tokens, first);
  if (v < vectors)
    tokens_tiled<1>(pairs + v * kBlockPairs, x, ldx, count, sums + 16 * v, tokens, first);
}

// Rows [first, first + rows) of the next chunk (its values from start[r] on, about span[r] of
// them, and its bitmask from input k): asked for into L2 while the micro-kernel computes, so
// that the next lay_out finds them there.
WS_TARGET inline void prefetch_rows(const GemmArgs& a, const uint16_t* const* start,
                                    const int64_t* span, int64_t n, int64_t first, int64_t rows,
                                    int64_t k) {
  const int64_t mask_bytes = (a.K + 7) / 8;
  for (int64_t r = first; r < first + rows && n + r < a.n_end; ++r) {
    const char* from = reinterpret_cast<const char*>(start[r]);
    for (int64_t byte = 0; byte < span[r] * 2; byte += 64) __builtin_prefetch(from + byte, 0, 2);
    __builtin_prefetch(a.bitmask + (n + r) * mask_bytes + k / 8, 0, 2);
  }
}

}  // namespace

WS_TARGET void bitmask_gemm_avx512_bf16(const GemmArgs& a) {
  Scratch& buffers = scratch();
  const int64_t all_pairs = a.K / 2;
  for (int64_t t0 = 0; t0 < a.M; t0 += kTokensPerPass) {
    const int64_t tokens = std::min(kTokensPerPass, a.M - t0);
    for (int64_t n = a.n_begin; n < a.n_end; n += kBlockRows) {
      const int64_t vectors = std::min(kBlockVectors, (a.n_end - n + kLanes - 1) / kLanes);
      const int64_t last = std::min(n + kBlockRows, a.n_end) - 1;
      const bool whole = last == n + kBlockRows - 1 &&
                         loads_stay_in_layer(a.row_offsets, last, a.K, a.values_count);
      for (int64_t r = 0; r < kBlockRows && n + r < a.n_end; ++r) {
        buffers.next[r] = a.compressed + a.row_offsets[n + r];
        const int64_t row_end = n + r + 1 < a.n_end ? a.row_offsets[n + r + 1] : a.values_count;
        buffers.span[r] = (row_end - a.row_offsets[n + r]) * 2 * kBlockPairs / a.K + 32;
      }
      for (int64_t p0 = 0; p0 < all_pairs; p0 += kBlockPairs) {
        const int64_t count = std::min(kBlockPairs, all_pairs - p0);
        lay_out(a, buffers.next, n, vectors, p0, count, whole, buffers.pairs);
        const bool more = p0 + kBlockPairs < all_pairs;
        const int64_t panels = (count + kPanel - 1) / kPanel;
        const int64_t share = (kBlockRows + panels - 1) / panels;
        for (int64_t p = 0, i = 0; p < count; p += kPanel, ++i) {  // a panel's pairs stay in L1
          if (more)
            prefetch_rows(a, buffers.next, buffers.span, n, i * share, share, 2 * (p0 + count));
          panel(buffers.pairs + p, vectors, a.x + t0 * a.ldx + 2 * (p0 + p), a.ldx,
                std::min(kPanel, count - p), buffers.sums, tokens, p0 == 0 && p == 0);
        }
      }
      store_block<kBlockRows>(a, buffers.sums, n, t0, tokens);
    }
  }
}

}  // namespace whisper_sparse
