// The unstructured GEMM on AVX-512 with VBMI2 and BF16 (sparse_kernels.h, GemmArgs with
// row_offsets), for batched decode and prefill: y = x W^T for a W stored as each row's kept
// values, its bitmask and its offsets (bitmask_format); without row offsets, a 2:4 layer's
// rows, K / 2 values each (the op's lanes path).
//
// The kept values have no fixed place, so the products are a dense GEMM's: what this saves is
// the weight bytes read (a row's kept values and a bit per input) and the dense weight never
// held. The tokens take the lanes, so a row's weights need no transpose:
//   * x is packed once per pass of tokens as pairs of inputs, by all threads together
//     (pack_pairs_avx512_bf16, before the threads take their rows): token t's inputs
//     (2p, 2p + 1) as one 32-bit word, 16 tokens to a register, a tile of tokens' words for
//     pair after pair in a run of memory;
//   * a block of rows is expanded, a chunk of inputs at a time, into a row-major buffer: each
//     row's 32 bits of mask expand its next kept values into their places (vpexpandw), its
//     pointer advancing by their popcount;
//   * the micro-kernel broadcasts a row's pair of weights (32 bits of that buffer) and adds it,
//     by one vdpbf16ps, into a register of 16 tokens' float32 sums: R rows x TV registers of
//     tokens, 24 accumulators (24 x 1 for a tile of 16 tokens, 12 x 2 for 32).
//   * While the micro-kernel computes a block, the next block's bytes (each row's or group's
//     kept values, then their masks; in a pass of some inputs, their part) are asked for a line
//     at a time, spread over the block's work, so that its expansion finds them in the caches.
//
//   for each pass of tokens (up to 512), and each pass of its inputs (packed x of at most
//   kPackedBytes; op_gemm.cpp): pack x;
//     for each block of rows (a thread's share), a chunk of inputs at a time:
//       expand the block's rows; for every tile of tokens and group of R rows: the
//       micro-kernel, its sums kept per row and token across chunks (and across the passes
//       of inputs, in `partial`); after the last pass of inputs, each token's sums, plus the
//       bias, rounded once to bfloat16 into y.
//
// The tokens in the lanes beat the kernel this replaced (16 rows transposed into registers
// of rows, the tokens' inputs broadcast) at every token count; that, and the choices (the
// padded row stride, the sweep, the blockings, the cap on packed x), are measured in
// benchmarks/results/JOURNAL.md.
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

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-tree-slp-vectorize")  // else the rows' pointers share a vector register
#endif

#include "bitmask_gemm_reads.h"  // after the pragma, which its expansion needs

namespace whisper_sparse {
namespace {

// Rows expanded at a time (a multiple of 24) and inputs per chunk (a multiple of 32), by the
// number of tokens of a pass: up to kFewTokensUpTo, then beyond.
constexpr int64_t kFewTokensUpTo = 64;
constexpr int64_t kFewTokensRows = 24, kFewTokensChunk = 4096;
constexpr int64_t kManyTokensRows = 48, kManyTokensChunk = 1024;
constexpr int64_t kMostRows = std::max(kFewTokensRows, kManyTokensRows);
constexpr int64_t kMostRowStride =
    expanded_row_stride(std::max(kFewTokensChunk, kManyTokensChunk));
constexpr int64_t kTokensPerPass = 512;         // at most (a multiple of 32)
constexpr int64_t kPackedBytes = int64_t(8) << 20;  // packed x of a pass, at most (shared)
// A pass of inputs that is not all K: a multiple of this (of 32, a grouped layer's step, and of
// the chunk of the passes that are split: those of more than kFewTokensUpTo tokens, unless K
// is over 64 Ki).
constexpr int64_t kInputsPerPassStep = kManyTokensChunk;
static_assert(kMostRows <= kSweepUnits, "a sweep covers a block's rows");

// Per-thread buffers: a block's expanded chunk and its sums.
struct Scratch {
  uint16_t* expanded = static_cast<uint16_t*>(
      std::aligned_alloc(64, kMostRows * kMostRowStride * sizeof(uint16_t)));
  float* sums = static_cast<float*>(
      std::aligned_alloc(64, kMostRows * kTokensPerPass * sizeof(float)));
  const uint16_t* next[kMostRows];
  ~Scratch() {
    std::free(expanded);
    std::free(sums);
  }
};

Scratch& scratch() {
  static thread_local Scratch buffers;
  return buffers;
}

// sums[r * lanes + 16 v + t] (+)= the sum over `pairs` pairs p of row r's (w[2p], w[2p + 1])
// times token t's (x[2p], x[2p + 1]), for R rows of `expanded` (row stride Stride) and TV
// registers of tokens of `packed` (the tile's words at the chunk's first pair);
// `first` starts the sums at zero. Every `every` pairs the sweep asks for its next line.
template <int R, int TV, int64_t Stride>
WS_TARGET void micro(const uint16_t* expanded, const uint32_t* packed,
                     int64_t lanes, int64_t pairs, float* sums, bool first, Sweep& sweep,
                     int64_t every) {
  __m512 acc[R][TV];
  _Pragma("GCC unroll 32") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 4") for (int v = 0; v < TV; ++v)
      acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + r * lanes + 16 * v);
  int64_t wait = every;
  for (int64_t p = 0; p < pairs; ++p) {
    if (--wait == 0) {
      wait = every;
      sweep.step();
    }
    __m512i tokens[TV];
    _Pragma("GCC unroll 4") for (int v = 0; v < TV; ++v)
      tokens[v] = _mm512_loadu_si512(packed + p * (16 * TV) + 16 * v);
    _Pragma("GCC unroll 32") for (int r = 0; r < R; ++r) {  // unrolled: acc stays in registers
      int two;
      std::memcpy(&two, expanded + r * Stride + 2 * p, sizeof(two));
      const __m512i weights = _mm512_set1_epi32(two);
      _Pragma("GCC unroll 4") for (int v = 0; v < TV; ++v)
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)tokens[v], (__m512bh)weights);
    }
  }
  _Pragma("GCC unroll 32") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 4") for (int v = 0; v < TV; ++v)
      _mm512_storeu_ps(sums + r * lanes + 16 * v, acc[r][v]);
}

// Every tile of tokens (of `lanes`, a multiple of 16: 32 at a time, then 16) and group of
// 24 / TV rows (of `rows`, a multiple of 24) over a block's expanded chunk; the sweep asks for
// `lines` lines, spread over the work.
template <int64_t Stride>
WS_TARGET void multiply_chunk(const uint16_t* expanded, const uint32_t* packed, int64_t all_pairs,
                              int64_t p0, int64_t lanes, int64_t pairs, float* sums, int64_t rows,
                              bool first, Sweep& sweep, int64_t lines) {
  const int64_t steps = (lanes / 32 * 2 + lanes % 32 / 16) * (rows / 24) * pairs;
  const int64_t every = lines > 0 ? std::max<int64_t>(1, steps / lines) : steps + 1;
  int64_t t = 0;
  for (; t + 32 <= lanes; t += 32)
    for (int64_t r = 0; r < rows; r += 12)
      micro<12, 2, Stride>(expanded + r * Stride, packed + t * all_pairs + p0 * 32, lanes, pairs,
                           sums + r * lanes + t, first, sweep, every);
  if (t < lanes)
    for (int64_t r = 0; r < rows; r += 24)
      micro<24, 1, Stride>(expanded + r * Stride, packed + t * all_pairs + p0 * 16, lanes, pairs,
                           sums + r * lanes + t, first, sweep, every);
}

// y[t][n + r] = bfloat16(sums[r * lanes + t] + bias[n + r]) for a block's `rows` rows and
// `tokens` tokens.
WS_TARGET void store_sums(const GemmArgs& a, const float* sums, int64_t lanes, int64_t n,
                          int64_t rows, int64_t tokens) {
  for (int64_t r = 0; r < rows; r += 16) {
    const int64_t count = std::min<int64_t>(16, rows - r);
    const __mmask16 kept = __mmask16((uint32_t(1) << count) - 1);
    const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(kept, a.bias + n + r) : _mm512_setzero_ps();
    for (int64_t t = 0; t < tokens; t += 16) {
      __m512 block[16];
      for (int i = 0; i < 16; ++i)
        block[i] = i < count ? _mm512_loadu_ps(sums + (r + i) * lanes + t) : _mm512_setzero_ps();
      transpose16(block);  // now token t + j's 16 rows
      const int64_t here = std::min<int64_t>(16, tokens - t);
      for (int64_t j = 0; j < here; ++j)
        _mm256_mask_storeu_epi16(a.y + (t + j) * a.ldy + n + r, kept,
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(block[j], bias)));
    }
  }
}

// One block of rows [n, n + rows) for a pass of tokens (a.packed, `lanes` of them: a.M rounded
// up to 16) and of inputs [kb, ke) into sums, asking for the next block's bytes (rows
// [n + rows, ahead_end)) along the way.
template <int64_t Chunk>
WS_TARGET void block(const GemmArgs& a, Scratch& buffers, int64_t n, int64_t rows,
                     int64_t ahead_end, int64_t lanes, int64_t kb, int64_t ke) {
  constexpr int64_t stride = expanded_row_stride(Chunk);
  const int64_t padded = (rows + 23) / 24 * 24;  // rows past `rows` stay zeros
  const bool grouped = a.grouped.defined();
  const bool unchecked =
      grouped || loads_stay_in_layer(row_start(a, n + rows - 1), a.K, a.values_count);
  const int64_t units = grouped ? (rows + kGroupRows - 1) / kGroupRows : rows;
  const int64_t unit0 = grouped ? n / kGroupRows : n;  // the block's first row or group
  for (int64_t i = 0; i < units; ++i)
    buffers.next[i] = kb > 0    ? a.resume[unit0 + i]
                      : grouped ? a.compressed + a.grouped.offsets[unit0 + i]
                                : a.compressed + row_start(a, n + i);
  if (kb > 0) std::memcpy(buffers.sums, a.partial + n * lanes, rows * lanes * sizeof(float));
  std::memset(buffers.expanded + rows * stride, 0, (padded - rows) * stride * sizeof(uint16_t));
  Sweep sweep = sweep_of(a, n + rows, ahead_end, kb, ke);
  const int64_t chunks = (ke - kb + Chunk - 1) / Chunk;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t k0 = kb + c * Chunk, width = std::min(Chunk, ke - k0);
    if (grouped) {
      expand_grouped_chunk(a, buffers.next, n, rows, k0, width, buffers.expanded, stride);
    } else {
      expand_chunk(a, buffers.next, n, rows, k0, width, unchecked, buffers.expanded, stride);
    }
    const int64_t lines = (sweep.lines_left() + chunks - c - 1) / (chunks - c);
    multiply_chunk<stride>(buffers.expanded, a.packed, input_pairs(ke - kb), (k0 - kb) / 2,
                           lanes, input_pairs(width), buffers.sums, padded, c == 0 && kb == 0,
                           sweep, lines);
  }
  if (ke < a.K) {  // the inputs go on in a later pass
    std::memcpy(a.partial + n * lanes, buffers.sums, rows * lanes * sizeof(float));
    for (int64_t i = 0; i < units; ++i) a.resume[unit0 + i] = buffers.next[i];
  }
}

}  // namespace

int64_t bitmask_gemm_tokens_per_pass() { return kTokensPerPass; }

int64_t bitmask_gemm_inputs_per_pass(int64_t tokens, int64_t K, int64_t packed_bytes) {
  const int64_t cap = packed_bytes > 0 ? packed_bytes : kPackedBytes;
  const int64_t fit = cap / (4 * token_lanes(tokens)) * 2;  // inputs, in pairs of 4 bytes a token
  const int64_t most = std::max(kInputsPerPassStep, fit / kInputsPerPassStep * kInputsPerPassStep);
  if (K <= most) return K;
  const int64_t passes = (K + most - 1) / most;  // as few as fit, of about equal width
  return ((K + passes - 1) / passes + kInputsPerPassStep - 1) / kInputsPerPassStep *
         kInputsPerPassStep;
}

int64_t bitmask_gemm_packed_words(int64_t tokens, int64_t K) {
  return token_lanes(tokens) * input_pairs(K);
}

// Token t's inputs (2p, 2p + 1) (0 past K and past `tokens`) go to its tile's run: tiles of 32
// tokens (the last of 16 where the lanes, tokens rounded up to 16, end there), each tile's
// words pair after pair; pairs [pair_begin, pair_end) here (multiples of 16, or the end).
WS_TARGET void pack_pairs_avx512_bf16(const uint16_t* x, int64_t ldx, int64_t tokens, int64_t K,
                                      int64_t pair_begin, int64_t pair_end, uint32_t* packed) {
  const int64_t pairs = input_pairs(K), lanes = token_lanes(tokens);
  for (int64_t t = 0; t < lanes; t += 16)
    for (int64_t p = pair_begin; p < pair_end; p += 16) {
      const int64_t k = 2 * p, inputs = std::min<int64_t>(32, K - k);
      const __mmask32 load = inputs >= 32 ? ~__mmask32(0) : (__mmask32(1) << inputs) - 1;
      __m512 words[16];
      for (int i = 0; i < 16; ++i)
        words[i] = t + i < tokens
                       ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(load, x + (t + i) * ldx + k))
                       : _mm512_setzero_ps();
      transpose16(words);  // now pair p + j of the 16 tokens
      const int64_t tile = t & ~int64_t(31), width = tile + 32 <= lanes ? 32 : 16;
      uint32_t* to = packed + tile * pairs + (t - tile);
      for (int64_t j = 0; j < std::min<int64_t>(16, pair_end - p); ++j)
        _mm512_storeu_ps(reinterpret_cast<float*>(to + (p + j) * width), words[j]);
    }
}

WS_TARGET void bitmask_gemm_avx512_bf16(const GemmArgs& a) {
  Scratch& buffers = scratch();
  const int64_t lanes = token_lanes(a.M);
  const bool few = lanes <= kFewTokensUpTo;
  const int64_t block_rows = few ? kFewTokensRows : kManyTokensRows;
  const int64_t kb = a.k_begin, ke = a.k_end > 0 ? a.k_end : a.K;
  for (int64_t n = a.n_begin; n < a.n_end; n += block_rows) {
    const int64_t rows = std::min(block_rows, a.n_end - n);
    const int64_t ahead_end = std::min(n + 2 * block_rows, a.n_end);
    if (few) {
      block<kFewTokensChunk>(a, buffers, n, rows, ahead_end, lanes, kb, ke);
    } else {
      block<kManyTokensChunk>(a, buffers, n, rows, ahead_end, lanes, kb, ke);
    }
    if (ke == a.K) store_sums(a, buffers.sums, lanes, n, rows, a.M);
  }
}

}  // namespace whisper_sparse
