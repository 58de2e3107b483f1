// The blocked 2:4 GEMM on AVX-512 with VBMI2 and BF16 (sparse24.h, GemmArgs), for batched
// decode and prefill: y = x W^T with every weight expanded once per call, never the whole W.
//
//   for each block of kBlockRows rows of W (a thread's share of the rows):
//     for each block of kBlockInputs inputs: expand the block's kept values (vpexpandw, by the
//       bitmask) into a dense row-major buffer (the micro-kernel's broadcast operand);
//       for each chunk of up to 64 tokens, for each panel of kPairsPerPanel input pairs (x's
//         panel stays in L1 while every row group of the block runs over it):
//           micro-kernel: R rows x V registers of 16 tokens, R * V float32 accumulators; per
//           input pair, V loads of x's pairs, R broadcasts of a weight pair, R * V vdpbf16ps;
//     the block's float32 sums (kTokensPerPass tokens at a time) are transposed 16 x 16 in
//     registers, the bias added, rounded once to bfloat16 and stored as y's rows.
//
// The choices, measured on a 2-core Zen 5 EPYC against dense F.linear (oneDNN), 7B / 8B shapes:
// 6 x 4 registers over 64-token chunks, about 0.85 of the core's vdpbf16ps peak; the sums
// stored through a register transpose (scalar stores of them had cost a fifth of the time);
// x packed chunk by chunk, each panel contiguous (5-8 % faster than one [pairs][M] matrix);
// 2048-input blocks (the 14336-input 8B down was 3-5 % slower with 4096); the next block's
// bytes prefetched during the current one. The GEMM performs the dense number of products, so
// from 64 tokens it is at parity with oneDNN, not ahead of it: 0.93-1.21x in our runs, the
// spread being mostly the dense side's from run to run.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "sparse24.h"

#ifdef WS_EMULATE_INTRINSICS  // plain C++ intrinsics: the tests run this file on any CPU
#include WS_EMULATE_INTRINSICS
#define WS_TARGET
#else
#include <immintrin.h>
#define WS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,avx512bf16")))
#endif

namespace whisper_sparse24 {
namespace {

constexpr int64_t kBlockRows = 48;        // rows of W expanded at a time (a multiple of 16)
constexpr int64_t kBlockInputs = 2048;    // inputs of W expanded at a time (a multiple of 32)
constexpr int64_t kPairsPerPanel = 128;   // input pairs of x per micro-kernel call (32 KiB)
constexpr int64_t kTokensPerPass = 512;   // tokens whose float32 sums a row block holds (96 KiB)
constexpr int64_t kTokensPerChunk = kGemmChunk;  // tokens per micro-kernel call (4 registers)

// Per-thread buffers, allocated once: the expanded block and its sums.
struct Scratch {
  uint16_t* weights = static_cast<uint16_t*>(
      std::aligned_alloc(64, kBlockRows * kBlockInputs * sizeof(uint16_t)));
  float* sums = static_cast<float*>(
      std::aligned_alloc(64, kBlockRows * kTokensPerPass * sizeof(float)));
  ~Scratch() {
    std::free(weights);
    std::free(sums);
  }
};

Scratch& scratch() {
  static thread_local Scratch buffers;
  return buffers;
}

// The stored bytes of the block expand_block takes next (its kept values and bitmask bytes,
// one range per row and tensor), brought into the cache a few lines per step while the
// micro-kernel runs over the current block, so that the expansion does not wait on memory.
class NextBlock {
 public:
  NextBlock(const GemmArgs& g, int64_t n, int64_t rows, int64_t k0, int64_t inputs,
            int64_t steps) {
    const int64_t end = std::min(k0 + inputs, g.K), half_k = g.K / 2;
    const int64_t mask_row = (g.K + 7) / 8;
    rows_ = k0 < g.K ? rows : 0;
    values_ = reinterpret_cast<const char*>(g.compressed + n * half_k + k0 / 2);
    value_stride_ = half_k * 2;
    value_lines_ = ((end - k0) + 63) / 64;  // (end - k0) / 2 values of 2 bytes
    masks_ = reinterpret_cast<const char*>(g.bitmask + n * mask_row + k0 / 8);
    mask_stride_ = mask_row;
    mask_lines_ = ((end - k0) / 8 + 64) / 64;
    per_step_ = (rows_ * (value_lines_ + mask_lines_) + steps - 1) / std::max<int64_t>(steps, 1);
  }

  void step() {
    for (int64_t i = 0; i < per_step_ && row_ < rows_; ++i) {
      const bool value = line_ < value_lines_;
      const char* line = value ? values_ + row_ * value_stride_ + line_ * 64
                               : masks_ + row_ * mask_stride_ + (line_ - value_lines_) * 64;
      __builtin_prefetch(line, 0, 2);
      if (++line_ == value_lines_ + mask_lines_) {
        line_ = 0;
        ++row_;
      }
    }
  }

 private:
  const char* values_;
  const char* masks_;
  int64_t value_stride_, value_lines_, mask_stride_, mask_lines_, rows_, per_step_;
  int64_t row_ = 0, line_ = 0;
};

// Rows [n, n + rows) of W, inputs [k0, k0 + inputs), dense into `out` ([rows][inputs]); inputs
// past K are zeros. A whole group of 32 inputs holds exactly 16 kept values (2:4).
WS_TARGET void expand_block(const GemmArgs& g, int64_t n, int64_t rows, int64_t k0,
                            int64_t inputs, uint16_t* out) {
  const int64_t half_k = g.K / 2, mask_bytes = (g.K + 7) / 8;
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* values = g.compressed + (n + r) * half_k;
    const uint8_t* mask_row = g.bitmask + (n + r) * mask_bytes;
    uint16_t* row = out + r * inputs;
    for (int64_t k = k0; k < k0 + inputs; k += 32) {
      __m512i dense;
      if (k + 32 <= g.K) {
        uint32_t mask;
        std::memcpy(&mask, mask_row + k / 8, sizeof(mask));
        const __m256i kept = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + k / 2));
        dense = _mm512_maskz_expand_epi16(mask, _mm512_castsi256_si512(kept));
      } else if (k < g.K) {  // the last 4 .. 28 inputs
        const int64_t rest = g.K - k;
        uint32_t mask = 0;
        std::memcpy(&mask, mask_row + k / 8, (rest + 7) / 8);
        mask &= (uint32_t(1) << rest) - 1;
        const __m512i kept =
            _mm512_maskz_loadu_epi16((uint32_t(1) << (rest / 2)) - 1, values + k / 2);
        dense = _mm512_maskz_expand_epi16(mask, kept);
      } else {
        dense = _mm512_setzero_si512();
      }
      _mm512_storeu_si512(row + (k - k0), dense);
    }
  }
}

// sums[r][16 v + t] (+)= sum over `pairs` input pairs p of weights[r][p] . x_pairs[p][16 v + t]
// (x_pairs' rows kTokensPerChunk apart), for R rows and V registers of 16 tokens; `first`
// starts the sums at zero.
template <int R, int V>
WS_TARGET void micro(const uint32_t* weights, int64_t ld_weights, const uint32_t* x_pairs,
                     int64_t pairs, float* sums, int64_t ld_sums, bool first) {
  constexpr int64_t ld_pairs = kTokensPerChunk;
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + r * ld_sums + 16 * v);
#pragma GCC unroll 4
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i x[V];
    for (int v = 0; v < V; ++v) x[v] = _mm512_loadu_si512(x_pairs + p * ld_pairs + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512i w = _mm512_set1_epi32(static_cast<int>(weights[r * ld_weights + p]));
      for (int v = 0; v < V; ++v)
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)w, (__m512bh)x[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(sums + r * ld_sums + 16 * v, acc[r][v]);
}

// Rows per micro-kernel call: R * V accumulators, V x registers and a broadcast fit in 32.
template <int V>
constexpr int kRowsPerCall = V == 4 ? 6 : V == 3 ? 8 : 12;

// micro<., V> over `rows` rows: groups of kRowsPerCall<V>, then 4, 2 and 1.
template <int V>
WS_TARGET void micro_rows(int64_t rows, const uint32_t* weights, int64_t ld_weights,
                          const uint32_t* x_pairs, int64_t pairs, float* sums, int64_t ld_sums,
                          bool first) {
  constexpr int R = kRowsPerCall<V>;
  int64_t r = 0;
  for (; r + R <= rows; r += R)
    micro<R, V>(weights + r * ld_weights, ld_weights, x_pairs, pairs,
                sums + r * ld_sums, ld_sums, first);
  for (; r + 4 <= rows; r += 4)
    micro<4, V>(weights + r * ld_weights, ld_weights, x_pairs, pairs,
                sums + r * ld_sums, ld_sums, first);
  for (; r + 2 <= rows; r += 2)
    micro<2, V>(weights + r * ld_weights, ld_weights, x_pairs, pairs,
                sums + r * ld_sums, ld_sums, first);
  if (r < rows)
    micro<1, V>(weights + r * ld_weights, ld_weights, x_pairs, pairs,
                sums + r * ld_sums, ld_sums, first);
}

// v[i] (16 floats) becomes column i of the 16 x 16 matrix whose rows v held.
WS_TARGET inline void transpose16(__m512 v[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 2; ++j) {
      const __m512d a = _mm512_castps_pd(t[4 * i + j]), b = _mm512_castps_pd(t[4 * i + j + 2]);
      v[4 * i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      v[4 * i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(v[8 * i + j], v[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_f32x4(v[8 * i + j], v[8 * i + j + 4], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    v[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    v[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
  }
}

// y[t][r] = bfloat16(sums[r][t] + bias[r]) for `rows` rows and `tokens` tokens, 16 x 16 at a
// time through registers (sums rows past `rows` are read but never stored).
WS_TARGET void store_rows(const float* sums, int64_t ld_sums, int64_t rows, int64_t tokens,
                          const float* bias, uint16_t* y, int64_t ldy) {
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int64_t count = std::min<int64_t>(16, rows - r0);
    const __mmask16 kept = __mmask16((uint32_t(1) << count) - 1);
    const __m512 add = bias ? _mm512_maskz_loadu_ps(kept, bias + r0) : _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < tokens; t0 += 16) {
      __m512 v[16];
      for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_ps(sums + (r0 + i) * ld_sums + t0);
      transpose16(v);
      const int64_t last = std::min<int64_t>(16, tokens - t0);
      for (int64_t t = 0; t < last; ++t) {
        const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(v[t], add));
        _mm256_mask_storeu_epi16(y + (t0 + t) * ldy + r0, kept, rounded);
      }
    }
  }
}

// One chunk of tokens over the expanded block, panel by panel.
template <int V>
WS_TARGET void chunk(int64_t rows, const uint16_t* weights, int64_t inputs,
                     const uint32_t* x_pairs, float* sums, bool first_block, NextBlock& next) {
  const uint32_t* weight_pairs = reinterpret_cast<const uint32_t*>(weights);
  for (int64_t p = 0; p < inputs / 2; p += kPairsPerPanel) {
    const int64_t pairs = std::min(kPairsPerPanel, inputs / 2 - p);
    next.step();
    micro_rows<V>(rows, weight_pairs + p, inputs / 2, x_pairs + p * kTokensPerChunk, pairs, sums,
                  kTokensPerPass, first_block && p == 0);
  }
}

}  // namespace

WS_TARGET void gemm_avx512_bf16(const GemmArgs& g) {
  Scratch& buffers = scratch();
  const int64_t padded_k = (g.K + 31) & ~int64_t(31);
  for (int64_t t0 = 0; t0 < g.M; t0 += kTokensPerPass) {
    const int64_t tokens = std::min(kTokensPerPass, g.M - t0);
    const int64_t chunks = (tokens + kTokensPerChunk - 1) / kTokensPerChunk;
    for (int64_t n = g.n_begin; n < g.n_end; n += kBlockRows) {
      const int64_t rows = std::min(kBlockRows, g.n_end - n);
      for (int64_t k0 = 0; k0 < padded_k; k0 += kBlockInputs) {
        const int64_t inputs = std::min(kBlockInputs, padded_k - k0);
        expand_block(g, n, rows, k0, inputs, buffers.weights);
        // what expand_block takes next: these rows' next inputs, else the next rows' first
        const bool more_inputs = k0 + inputs < padded_k;
        const int64_t next_n = more_inputs ? n : n + kBlockRows;
        const int64_t next_rows = std::min(kBlockRows, g.n_end - next_n);
        const int64_t next_k0 = more_inputs ? k0 + inputs : 0;
        const int64_t panels = (inputs / 2 + kPairsPerPanel - 1) / kPairsPerPanel;
        NextBlock next(g, next_n, next_n < g.n_end ? next_rows : 0, next_k0,
                       std::min(kBlockInputs, padded_k - next_k0), chunks * panels);
        for (int64_t t = 0; t < tokens; t += kTokensPerChunk) {
          const uint32_t* x_pairs =
              g.x_pairs + ((t0 + t) / kTokensPerChunk * (padded_k / 2) + k0 / 2) * kTokensPerChunk;
          float* sums = buffers.sums + t;
          const bool first = k0 == 0;
          const uint16_t* w = buffers.weights;
          switch ((std::min(kTokensPerChunk, tokens - t) + 15) / 16) {
            case 4: chunk<4>(rows, w, inputs, x_pairs, sums, first, next); break;
            case 3: chunk<3>(rows, w, inputs, x_pairs, sums, first, next); break;
            case 2: chunk<2>(rows, w, inputs, x_pairs, sums, first, next); break;
            default: chunk<1>(rows, w, inputs, x_pairs, sums, first, next);
          }
        }
      }
      store_rows(buffers.sums, kTokensPerPass, rows, tokens, g.bias ? g.bias + n : nullptr,
                 g.y + t0 * g.ldy + n, g.ldy);
    }
  }
}

WS_TARGET void pack_pairs_avx512_bf16(const PackArgs& a) {
  const int64_t half_padded_k = ((a.K + 31) & ~int64_t(31)) / 2;
  const int64_t padded_m = (a.M + kGemmChunk - 1) / kGemmChunk * kGemmChunk;
  for (int64_t p0 = a.p_begin; p0 < a.p_end; p0 += 16) {
    // the bfloat16 lanes of x's rows that hold pairs [p0, p0 + 16) before K
    const int64_t lanes = std::max<int64_t>(0, std::min<int64_t>(32, a.K - 2 * p0));
    const __mmask32 in_x = lanes == 32 ? 0xFFFFFFFFu : (uint32_t(1) << lanes) - 1;
    const int64_t count = std::min<int64_t>(16, a.p_end - p0);
    for (int64_t t0 = 0; t0 < padded_m; t0 += 16) {
      __m512 v[16];  // token t0 + i's 16 pairs
      for (int i = 0; i < 16; ++i)
        v[i] = t0 + i < a.M ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(
                                  in_x, a.x + (t0 + i) * a.ldx + 2 * p0))
                            : _mm512_setzero_ps();
      transpose16(v);  // now pair p0 + j's 16 tokens
      float* chunk = a.pairs + (t0 / kGemmChunk) * half_padded_k * kGemmChunk + t0 % kGemmChunk;
      for (int64_t j = 0; j < count; ++j) _mm512_storeu_ps(chunk + (p0 + j) * kGemmChunk, v[j]);
    }
  }
}

}  // namespace whisper_sparse24
