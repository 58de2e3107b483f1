// 2:4 Linear layers on x86 CPUs, read from the compressed tensors as stored (format.py):
// per output row n, `compressed[n]` holds the two kept values of every group of four inputs
// (K / 2 values) and `bitmask[n]` one bit per input, lowest bit first (ceil(K / 8) bytes).
// In an exactly 2:4 row the kept values of inputs [k, k + 32) are compressed[n][k/2 .. k/2 + 16),
// so a kernel walks both tensors in step and expands the kept values in registers.
//
// One file per instruction set (each function carries its own target attribute, so no file is
// compiled for a CPU it may not run on; AVX-512 BF16 has three: its row kernels, its 2:4
// GEMM and its unstructured GEMM), this header, and op.cpp: the run-time dispatch from the
// CPU's flags and the torch op. The pure-torch reference the tests compare them with is
// format.decompress_24 (or decompress_bitmask) followed by F.linear.
#pragma once

#include <cstdint>
#include <cstring>

namespace whisper_sparse {

enum class WeightType : int { f32 = 0, bf16 = 1 };

// An unstructured layer in the grouped layout (cpu/grouped_layout.py), bfloat16: rows in groups
// of kGroupRows; per group, per step of 32 inputs, the group's rows' kept values one after
// another (row order), the group's values from offsets[g] on (groups + 1 entries); masks
// [groups][steps][kGroupRows] (rows past the layer's last: 0); 32 zeros after the last value.
// Rows of the layer: rows. A kernel's row range starts on a group.
constexpr int kGroupRows = 8;
inline int64_t group_steps(int64_t K) { return (K + 31) / 32; }
struct GroupedLayer {
  const int64_t* offsets = nullptr;
  const uint32_t* masks = nullptr;
  int64_t rows = 0;
  bool defined() const { return offsets != nullptr; }
  const uint32_t* group_masks(int64_t g, int64_t K) const {
    return masks + g * group_steps(K) * kGroupRows;
  }
};

// A row range of y = x W^T (+ bias) for all M tokens. x is [M, K] with row stride ldx (float32,
// or bfloat16 bits for the *_bf16 kernel), compressed [N, K / 2] of `type`, bitmask
// [N, ceil(K / 8)] uint8; rows [n_begin, n_end). Each float32 sum, plus bias[n] where bias is
// given ([N] float32), is stored once (store_sum): into y ([M, N] float32, row stride ldy), or
// rounded to bfloat16 into y_bf16 where that is given (the op's bfloat16 output, written as
// it is computed).
struct RowsArgs {
  const void* x;
  int64_t ldx;
  const void* compressed;
  WeightType type;
  const uint8_t* bitmask;
  float* y;
  int64_t ldy;
  int64_t M;
  int64_t K;
  int64_t n_begin;
  int64_t n_end;
  const float* bias = nullptr;
  uint16_t* y_bf16 = nullptr;
  // An unstructured layer (bitmask_format): compressed holds each row's kept values from
  // row_offsets[n] on, as many per group of inputs as its mask bits; values_count in all.
  const int64_t* row_offsets = nullptr;
  int64_t values_count = 0;
  GroupedLayer grouped;  // a grouped layer's (bitmask and row_offsets unused)
};

// float32 to bfloat16, to nearest even, a NaN to 0x7FC0: as torch rounds (c10::BFloat16).
inline uint16_t round_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// `bits` (at most 32) bits of a bitmask row from input k on (k a multiple of 8): whole bytes,
// never past the row; 32 bits are one load of a constant size.
inline uint32_t mask_bits(const uint8_t* row, int64_t k, int64_t bits) {
  uint32_t mask = 0;
  if (bits >= 32) {
    std::memcpy(&mask, row + k / 8, sizeof(mask));
    return mask;
  }
  std::memcpy(&mask, row + k / 8, (bits + 7) / 8);
  return mask & ((uint32_t(1) << bits) - 1);
}

// Whether 32 values loaded from anywhere in an unstructured layer's rows up to the one whose
// values start at `last_start` (their starts rising) stay among its values_count: a row's
// pointer never passes its start + K.
inline bool loads_stay_in_layer(int64_t last_start, int64_t K, int64_t values_count) {
  return last_start + K + 32 <= values_count;
}

// One output of a row kernel: y[index] (or y_bf16[index]) = sum + bias[row].
inline void store_sum(const RowsArgs& a, int64_t index, int64_t row, float sum) {
  if (a.bias != nullptr) sum += a.bias[row];
  if (a.y_bf16 != nullptr) {
    a.y_bf16[index] = round_to_bf16(sum);
  } else {
    a.y[index] = sum;
  }
}

// The stride, in bytes (expanded_row_bytes) or bfloat16 elements (expanded_row_stride), of a
// buffer of expanded rows that a micro-kernel reads side by side: an odd number of 64-byte lines
// (at least the row's), so that
// the rows fall in different L1 sets. At a multiple of 4 KiB they all meet in one set, which
// holds fewer lines than the rows read side by side (JOURNAL.md).
constexpr int64_t expanded_row_bytes(int64_t bytes) { return (((bytes + 63) / 64) | 1) * 64; }
constexpr int64_t expanded_row_stride(int64_t inputs) { return expanded_row_bytes(inputs * 2) / 2; }

// Dense rows [n_begin, n_end) of W, written to out ([rows, K] of `type`, row stride out_stride
// elements, 0: K); an unstructured layer's rows start at row_offsets[n] (as in RowsArgs),
// values_count values in all (0: unknown, and every load checked).
struct DecompressArgs {
  const void* compressed;
  WeightType type;
  const uint8_t* bitmask;
  void* out;
  int64_t K;
  int64_t n_begin;
  int64_t n_end;
  const int64_t* row_offsets = nullptr;
  int64_t values_count = 0;
  int64_t out_stride = 0;
  GroupedLayer grouped;  // a grouped layer's (bitmask and row_offsets unused)
  // Where row n starts in out, in elements.
  int64_t out_row(int64_t n) const { return (n - n_begin) * (out_stride > 0 ? out_stride : K); }
};

// avx2.cpp: AVX2 + FMA; x float32; a table indexed by each byte of the bitmask (two
// groups of four) places the four kept values of eight inputs.
void rows_avx2(const RowsArgs& args);
void decompress_avx2(const DecompressArgs& args);

// avx2_bitmask.cpp: unstructured rows (RowsArgs::row_offsets) on AVX2 + FMA; x float32; a
// table per bitmask byte places up to eight kept values; and their dense rows (a grouped
// layer's too: DecompressArgs::grouped).
void rows_bitmask_avx2(const RowsArgs& args);
void decompress_bitmask_avx2(const DecompressArgs& args);

// avx512.cpp: AVX-512 F/BW/VL/VBMI2; x float32; masked expand-loads place the kept values
// (2:4 and unstructured rows; the dense rows of both, and of a grouped layer).
void rows_avx512(const RowsArgs& args);
void decompress_avx512(const DecompressArgs& args);

// avx512_bf16.cpp: as rows_avx512 for bfloat16 x and weights, the products summed
// with AVX512_BF16's vdpbf16ps (32 inputs per instruction, float32 accumulators); unstructured
// rows for more than 8 tokens expand each chunk of inputs once, into an L1 buffer.
void rows_avx512_bf16(const RowsArgs& args);

// avx512_bf16_grouped.cpp: a grouped layer's rows (RowsArgs::grouped; n_begin on a group) for
// bfloat16 x: each group read as one stream, its kGroupRows rows side by side; tiles of four
// tokens over half the group's rows at a time, then two tokens or one over all of them.
void rows_grouped_avx512_bf16(const RowsArgs& args);

// The 2:4 GEMM, y = x W^T (+ bias), for bfloat16 x and weights, which multiplies the kept
// values only: per group of four inputs, each row's two kept values meet the two inputs they
// belong to, picked from the group's four by vpermw. Rows [n_begin, n_end) of W are laid out
// once per call, a block of rows at a time, as 16 rows per register (their kept pairs, and the
// positions that pick their inputs), and a register-blocked micro-kernel runs every token
// over them. x [M, K] bfloat16 with row stride ldx; y [M, N] bfloat16 with row stride ldy:
// each sum is rounded once, after the bias (float32, [N], or null) is added.
struct GemmArgs {
  const uint16_t* x;
  int64_t ldx;
  const uint16_t* compressed;
  const uint8_t* bitmask;
  const float* bias;
  uint16_t* y;
  int64_t ldy;
  int64_t M;
  int64_t K;
  int64_t n_begin;
  int64_t n_end;
  // For bitmask_gemm_avx512_bf16: an unstructured layer's, as in RowsArgs (without row
  // offsets it reads a 2:4 layer, each row's K / 2 values after the last row's), and x packed
  // by pack_pairs_avx512_bf16 for its M tokens (at most bitmask_gemm_tokens_per_pass()).
  const int64_t* row_offsets = nullptr;
  int64_t values_count = 0;
  const uint32_t* packed = nullptr;
  GroupedLayer grouped;  // a grouped layer's (bitmask and row_offsets unused)
  // A pass of inputs [k_begin, k_end) (bitmask_gemm_inputs_per_pass; 0, 0: all K), packed
  // holding only theirs. Where they are not all K: `resume`, each row's value pointer (a
  // grouped layer's: each group's, at index row / kGroupRows) at k_begin, read where k_begin
  // is not 0 and set to where it stands at k_end; `partial`, the rows' float32 sums so far,
  // [N][token_lanes(M)], read where k_begin is not 0 and written where k_end is not K, where
  // the rows' y is stored instead.
  int64_t k_begin = 0;
  int64_t k_end = 0;
  const uint16_t** resume = nullptr;
  float* partial = nullptr;
};

// avx512_bf16_gemm.cpp (AVX-512 F/BW/VL/VBMI2 with BF16)
void gemm_avx512_bf16(const GemmArgs& args);

// The unstructured GEMM (avx512_bf16_bitmask_gemm.cpp), for the same batches as the 2:4 GEMM,
// one pass of tokens at a time (and of its inputs, where they are many: passes of inputs keep
// their sums in GemmArgs::partial): x is packed once per pass as pairs of inputs (16 tokens per
// register; pack_pairs_avx512_bf16 packs pairs [pair_begin, pair_end), multiples of 16 or the
// end, into bitmask_gemm_packed_words(tokens, K) words, so that threads share the work and the
// result), then each thread's block of rows is expanded once per pass (vpexpandw by each row's
// mask, its pointer advancing by the mask's popcount) into a row-major buffer, and a
// register-blocked micro-kernel broadcasts each row's pair of weights into vdpbf16ps over every
// token. Any K (an odd K's last pair is padded with a zero).
inline int64_t input_pairs(int64_t K) { return (K + 1) / 2; }  // the packed pairs of inputs
inline int64_t token_lanes(int64_t tokens) { return (tokens + 15) / 16 * 16; }  // a pass's lanes
int64_t bitmask_gemm_tokens_per_pass();
// Inputs per pass for `tokens` tokens (a multiple of 1024, or all K) so that a pass's packed x
// stays within `packed_bytes` (the kernel's cap where 0): the passes of a wide layer's inputs,
// which expand its weights once, where passes of fewer tokens expanded them once a pass.
int64_t bitmask_gemm_inputs_per_pass(int64_t tokens, int64_t K, int64_t packed_bytes = 0);
int64_t bitmask_gemm_packed_words(int64_t tokens, int64_t K);
void pack_pairs_avx512_bf16(const uint16_t* x, int64_t ldx, int64_t tokens, int64_t K,
                            int64_t pair_begin, int64_t pair_end, uint32_t* packed);
void bitmask_gemm_avx512_bf16(const GemmArgs& args);

}  // namespace whisper_sparse
