// How the unstructured GEMM (avx512_bf16_bitmask_gemm.cpp) reads a block of rows: where each
// row's kept values start, the sweep that asks for the next block's bytes while the
// micro-kernel computes this one, and the expansion of a chunk of the block's rows (rows, or a
// grouped layer's groups) into a row-major buffer. Included by that file after its WS_TARGET
// preamble and its pragma against GCC's SLP vectorizer (else the rows' pointers share a
// vector register).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "avx512_bf16_parts.h"
#include "sparse_kernels.h"

namespace whisper_sparse {
namespace {

constexpr int kSweepUnits = 48;  // rows (or groups) of a block a sweep covers, at most

// Rows expanded side by side, their popcount-advanced pointers independent chains: 4, the
// fastest measured (8 spill their pointers; JOURNAL.md).
constexpr int64_t kExpandSide = 4;

// The next block's bytes as runs of lines (each row's or group's kept values, then their
// masks; in a pass of some of the inputs, their part), asked for one line at a time.
struct Sweep {
  struct Run {
    const char* at;
    const char* end;
  };
  Run runs[2 * kSweepUnits];
  int count = 0, i = 0;
  void add(const void* begin, const void* end) {
    const uintptr_t line = reinterpret_cast<uintptr_t>(begin) & ~uintptr_t(63);
    if (reinterpret_cast<const char*>(line) < static_cast<const char*>(end))
      runs[count++] = {reinterpret_cast<const char*>(line), static_cast<const char*>(end)};
  }
  int64_t lines_left() const {
    int64_t lines = 0;
    for (int j = i; j < count; ++j) lines += (runs[j].end - runs[j].at + 63) / 64;
    return lines;
  }
  inline void step() {
    while (i < count && runs[i].at >= runs[i].end) ++i;
    if (i < count) {
      __builtin_prefetch(runs[i].at, 0, 3);
      runs[i].at += 64;
    }
  }
};

// Where row n's kept values start: at its row offset, or in a 2:4 layer (no row offsets: the
// op's lanes path) after the K / 2 of each row before it.
inline int64_t row_start(const GemmArgs& a, int64_t n) {
  return a.row_offsets != nullptr ? a.row_offsets[n] : n * (a.K / 2);
}

// Rows [n, n_end) of the layer as a sweep, for inputs [kb, ke); empty where there are none:
// each row's or group's part of its kept values (in proportion, about; all of them over all
// K), then of its masks.
Sweep sweep_of(const GemmArgs& a, int64_t n, int64_t n_end, int64_t kb, int64_t ke) {
  Sweep sweep;
  if (n >= n_end) return sweep;
  const auto part = [&](const uint16_t* begin, const uint16_t* end) {
    const int64_t length = end - begin;
    sweep.add(begin + length * kb / a.K, begin + (length * ke + a.K - 1) / a.K);
  };
  if (a.grouped.defined()) {
    const int64_t g = n / kGroupRows, g_end = (n_end + kGroupRows - 1) / kGroupRows;
    const int64_t* offsets = a.grouped.offsets;
    for (int64_t i = g; i < g_end; ++i)
      part(a.compressed + offsets[i], a.compressed + offsets[i + 1]);
    for (int64_t i = g; i < g_end; ++i)
      sweep.add(a.grouped.group_masks(i, a.K) + kb / 32 * kGroupRows,
                a.grouped.group_masks(i, a.K) + (ke + 31) / 32 * kGroupRows);
    return sweep;
  }
  const int64_t mask_bytes = (a.K + 7) / 8;
  const int64_t first = row_start(a, n), last_row = row_start(a, n_end - 1);
  // the last row's end, about: it may be the layer's, which row_offsets does not hold
  const int64_t last = std::min(
      last_row + (n_end - 1 > n ? (last_row - first) / (n_end - 1 - n) : a.K), a.values_count);
  for (int64_t row = n; row < n_end; ++row)
    part(a.compressed + row_start(a, row),
         a.compressed + (row + 1 < n_end ? row_start(a, row + 1) : last));
  for (int64_t row = n; row < n_end; ++row)
    sweep.add(a.bitmask + row * mask_bytes + kb / 8, a.bitmask + row * mask_bytes + (ke + 7) / 8);
  return sweep;
}

// Rows [n, n + rows) of the layer, inputs [k0, k0 + width), expanded into `expanded` (row r at
// r * stride, 0 past the layer's K), each row's values from next[r] on (advanced);
// `unchecked`: no 32 values loaded from any of these rows pass the layer's.
WS_TARGET void expand_chunk(const GemmArgs& a, const uint16_t** next, int64_t n, int64_t rows,
                            int64_t k0, int64_t width, bool unchecked, uint16_t* expanded,
                            int64_t stride) {
  const int64_t mask_bytes = (a.K + 7) / 8;
  const uint16_t* end = a.compressed + a.values_count;
  const int64_t whole = width & ~int64_t(31);
  for (int64_t r0 = 0; r0 < rows; r0 += kExpandSide) {
    const int64_t side = std::min(kExpandSide, rows - r0);
    const uint8_t* masks = a.bitmask + (n + r0) * mask_bytes + k0 / 8;
    uint16_t* out = expanded + r0 * stride;
    if (unchecked && side == kExpandSide) {  // kExpandSide pointer chains side by side
      const uint16_t* values[kExpandSide];
      for (int i = 0; i < kExpandSide; ++i) values[i] = next[r0 + i];
      for (int64_t k = 0; k < whole; k += 32)
        for (int i = 0; i < kExpandSide; ++i) {
          uint32_t mask;
          std::memcpy(&mask, masks + i * mask_bytes + k / 8, sizeof(mask));
          _mm512_storeu_si512(out + i * stride + k, expand32<false, false>(mask, values[i]));
          values[i] += __builtin_popcount(mask);
        }
      for (int i = 0; i < kExpandSide; ++i) next[r0 + i] = values[i];
    } else {
      for (int i = 0; i < side; ++i)
        for (int64_t k = 0; k < whole; k += 32) {
          const uint32_t mask = mask_bits(masks + i * mask_bytes, k, 32);
          const int count = __builtin_popcount(mask);
          _mm512_storeu_si512(out + i * stride + k,
                              expand32<false>(mask, next[r0 + i], count, end));
          next[r0 + i] += count;
        }
    }
    if (whole < width)  // the layer's last inputs: only their bytes
      for (int i = 0; i < side; ++i) {
        const uint32_t mask = mask_bits(masks + i * mask_bytes, whole, width - whole);
        const int count = __builtin_popcount(mask);
        _mm512_storeu_si512(out + i * stride + whole,
                            expand32<false>(mask, next[r0 + i], count, end));
        next[r0 + i] += count;
      }
  }
}

// Side groups of a block, steps [0, steps) of a chunk (group i's values from next[i] on,
// advanced; masks[i]: its masks at the chunk's first step), expanded into `expanded` (the
// groups' row r at r * stride), each group's rows in turn. Side is a constant and the
// pointers are locals, so that they stay in registers: walked through next[] (which the
// stores may alias), each advance was an add to memory that the next load waited on.
template <int Side>
WS_TARGET inline void expand_groups(const uint32_t* const* masks, const uint16_t** next,
                                    int64_t steps, uint16_t* expanded, int64_t stride) {
  const uint16_t* values[Side];
  _Pragma("GCC unroll 4") for (int i = 0; i < Side; ++i) values[i] = next[i];
  for (int64_t s = 0; s < steps; ++s)
    _Pragma("GCC unroll 8") for (int r = 0; r < kGroupRows; ++r)
      _Pragma("GCC unroll 4") for (int i = 0; i < Side; ++i) {
        const uint32_t mask = masks[i][s * kGroupRows + r];
        _mm512_storeu_si512(expanded + (i * kGroupRows + r) * stride + s * 32,
                            expand32<false, false>(mask, values[i]));
        values[i] += __builtin_popcount(mask);
      }
  _Pragma("GCC unroll 4") for (int i = 0; i < Side; ++i) next[i] = values[i];
}

// A grouped layer's rows [n, n + rows) (n on a group), inputs [k0, k0 + width) (k0 a multiple
// of 32), expanded into `expanded` as expand_chunk's; next[i]: where the block's group i goes
// on (advanced). The groups are walked kExpandSide at a time (expand_groups), their pointers
// independent chains; the rows past the layer's last in its last group expand to zeros (their
// masks are).
WS_TARGET void expand_grouped_chunk(const GemmArgs& a, const uint16_t** next, int64_t n,
                                    int64_t rows, int64_t k0, int64_t width, uint16_t* expanded,
                                    int64_t stride) {
  const int64_t groups = (rows + kGroupRows - 1) / kGroupRows, steps = (width + 31) / 32;
  for (int64_t g0 = 0; g0 < groups; g0 += kExpandSide) {
    const int64_t side = std::min(kExpandSide, groups - g0);
    const uint32_t* masks[kExpandSide];
    for (int64_t i = 0; i < side; ++i)
      masks[i] = a.grouped.group_masks(n / kGroupRows + g0 + i, a.K) + k0 / 32 * kGroupRows;
    uint16_t* out = expanded + g0 * kGroupRows * stride;
    static_assert(kExpandSide == 4, "a case per side below kExpandSide");
    switch (side) {
      case 1: expand_groups<1>(masks, next + g0, steps, out, stride); break;
      case 2: expand_groups<2>(masks, next + g0, steps, out, stride); break;
      case 3: expand_groups<3>(masks, next + g0, steps, out, stride); break;
      default: expand_groups<kExpandSide>(masks, next + g0, steps, out, stride);
    }
  }
}

}  // namespace
}  // namespace whisper_sparse
