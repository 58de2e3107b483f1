// The AVX-512 kernels of the 2:4 CPU op, built with avx512_emulation.h, and the AVX2 ones (every
// x86 CPU the op serves has AVX2), against a scalar reference on integer values (every product
// and float32 sum exact, so equality is the test): every shape of tails and row groups, 1 to 9
// tokens, float32 and bfloat16 weights; and the 2:4 GEMM at token counts around its tiles,
// with a bias; and unstructured layers (row offsets, and the grouped layout), their values held
// in vectors of exactly their size, so that AddressSanitizer sees a load past the layer's last
// value (past the grouped layout's 32 zeros).
// Prints one line per failure and exits 1 on any; test_cpu_kernels.py builds and runs it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "sparse_kernels.h"

using namespace whisper_sparse;

namespace {

uint16_t to_bf16(float value) {  // exact for the small integers used here
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return uint16_t(bits >> 16);
}

uint16_t round_bf16(float value) {  // to nearest even (the sums here are finite)
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1)) >> 16);
}

struct Layer {
  int64_t rows, columns;
  std::vector<float> dense;       // [rows, columns]
  std::vector<float> kept;        // [rows, columns / 2]
  std::vector<uint16_t> kept_bf16;
  std::vector<uint8_t> bitmask;   // [rows, ceil(columns / 8)]
};

Layer random_layer(int64_t rows, int64_t columns, std::mt19937& draw) {
  Layer layer{rows, columns, std::vector<float>(rows * columns, 0.0f), {}, {}, {}};
  const int64_t bytes = (columns + 7) / 8;
  layer.bitmask.assign(rows * bytes, 0);
  std::uniform_int_distribution<int> value(-3, 3), position(0, 3);
  for (int64_t n = 0; n < rows; ++n) {
    for (int64_t g = 0; g < columns / 4; ++g) {
      int first = position(draw), second = position(draw);
      while (second == first) second = position(draw);
      for (int i = 0; i < 4; ++i) {
        const int64_t k = 4 * g + i;
        if (i != first && i != second) continue;
        layer.dense[n * columns + k] = float(value(draw));  // a kept zero is marked too
        layer.bitmask[n * bytes + k / 8] |= uint8_t(1u << (k % 8));
      }
    }
    for (int64_t k = 0; k < columns; ++k) {
      if (layer.bitmask[n * bytes + k / 8] >> (k % 8) & 1) {
        layer.kept.push_back(layer.dense[n * columns + k]);
        layer.kept_bf16.push_back(to_bf16(layer.dense[n * columns + k]));
      }
    }
  }
  return layer;
}

int failures = 0;

void expect(bool ok, const char* what, int64_t rows, int64_t columns, int64_t tokens) {
  if (!ok) {
    ++failures;
    std::printf("FAIL %s rows %ld columns %ld tokens %ld\n", what, long(rows), long(columns),
                long(tokens));
  }
}

// Element i of a decompressed weight of `type` written to `out`, as float32.
float dense_value(const uint8_t* out, WeightType type, int64_t i) {
  float value;
  if (type == WeightType::f32) {
    std::memcpy(&value, out + 4 * i, 4);
  } else {
    uint16_t bits;
    std::memcpy(&bits, out + 2 * i, 2);
    const uint32_t wide = uint32_t(bits) << 16;
    std::memcpy(&value, &wide, 4);
  }
  return value;
}

void check_layer(const Layer& layer, std::mt19937& draw) {
  const int64_t rows = layer.rows, columns = layer.columns;
  for (WeightType type : {WeightType::f32, WeightType::bf16}) {
    const void* kept = type == WeightType::f32 ? static_cast<const void*>(layer.kept.data())
                                               : static_cast<const void*>(layer.kept_bf16.data());
    for (auto decompress : {decompress_avx512, decompress_avx2}) {
      std::vector<uint8_t> out(rows * columns * (type == WeightType::f32 ? 4 : 2) + 64, 0xAB);
      decompress({kept, type, layer.bitmask.data(), out.data(), columns, 0, rows});
      bool same = true;
      for (int64_t i = 0; i < rows * columns; ++i)
        same &= dense_value(out.data(), type, i) == layer.dense[i];
      const size_t used = rows * columns * (type == WeightType::f32 ? 4 : 2);
      for (size_t i = used; i < out.size(); ++i) same &= out[i] == 0xAB;  // nothing past the rows
      const char* what = type == WeightType::f32 ? "decompress f32" : "decompress bf16";
      expect(same, what, rows, columns, 0);
    }
  }
  std::uniform_int_distribution<int> value(-3, 3);
  for (int64_t tokens = 1; tokens <= 9; ++tokens) {
    std::vector<float> x(tokens * columns);
    std::vector<uint16_t> x_bf16(tokens * columns);
    for (size_t i = 0; i < x.size(); ++i) {
      x[i] = float(value(draw));
      x_bf16[i] = to_bf16(x[i]);
    }
    std::vector<float> expected(tokens * rows, 0.0f);
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t n = 0; n < rows; ++n)
        for (int64_t k = 0; k < columns; ++k)
          expected[t * rows + n] += x[t * columns + k] * layer.dense[n * columns + k];
    // every row range a thread may get: whole rows, and a range starting inside a group of four
    for (int64_t begin : {int64_t(0), rows / 3}) {
      std::vector<float> y32(tokens * rows, -1.0f), y16(tokens * rows, -1.0f);
      std::vector<float> avx2_32(tokens * rows, -1.0f), avx2_16(tokens * rows, -1.0f);
      rows_avx512({x.data(), columns, layer.kept.data(), WeightType::f32, layer.bitmask.data(),
                   y32.data(), rows, tokens, columns, begin, rows});
      rows_avx512({x.data(), columns, layer.kept_bf16.data(), WeightType::bf16,
                   layer.bitmask.data(), y16.data(), rows, tokens, columns, begin, rows});
      rows_avx2({x.data(), columns, layer.kept.data(), WeightType::f32, layer.bitmask.data(),
                 avx2_32.data(), rows, tokens, columns, begin, rows});
      rows_avx2({x.data(), columns, layer.kept_bf16.data(), WeightType::bf16,
                 layer.bitmask.data(), avx2_16.data(), rows, tokens, columns, begin, rows});
      std::vector<float> ydot(tokens * rows, -1.0f);
      rows_avx512_bf16({x_bf16.data(), columns, layer.kept_bf16.data(), WeightType::bf16,
                        layer.bitmask.data(), ydot.data(), rows, tokens, columns, begin, rows});
      // the op's bfloat16 output: the bias added, each sum rounded once as it is stored
      std::vector<float> bias(rows);
      for (auto& b : bias) b = float(value(draw));
      std::vector<uint16_t> yout(tokens * rows, 0xFFFF);
      RowsArgs rounded{x_bf16.data(), columns, layer.kept_bf16.data(), WeightType::bf16,
                       layer.bitmask.data(), nullptr, rows, tokens, columns, begin, rows};
      rounded.bias = bias.data();
      rounded.y_bf16 = yout.data();
      rows_avx512_bf16(rounded);
      bool f32 = true, bf16 = true, dot = true, out = true, avx2 = true;
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t n = 0; n < rows; ++n) {
          const float want = n < begin ? -1.0f : expected[t * rows + n];
          f32 &= y32[t * rows + n] == want;
          bf16 &= y16[t * rows + n] == want;
          avx2 &= avx2_32[t * rows + n] == want && avx2_16[t * rows + n] == want;
          dot &= ydot[t * rows + n] == want;
          out &= yout[t * rows + n] == (n < begin ? 0xFFFF : round_bf16(want + bias[n]));
        }
      expect(f32, "rows_avx512 f32", rows, columns, tokens);
      expect(bf16, "rows_avx512 bf16", rows, columns, tokens);
      expect(dot, "rows_avx512_bf16", rows, columns, tokens);
      expect(out, "rows_avx512_bf16 with bias, bfloat16 out", rows, columns, tokens);
      expect(avx2, "rows_avx2 f32 and bf16", rows, columns, tokens);
    }
  }
}

// gemm_avx512_bf16 for rows [begin, rows): y = bfloat16(x W^T + bias), rows before `begin`
// untouched; x with a row stride wider than K (a view's).
void check_gemm(const Layer& layer, std::mt19937& draw) {
  const int64_t rows = layer.rows, columns = layer.columns, ldx = columns + 4;
  std::uniform_int_distribution<int> value(-3, 3);
  for (int64_t tokens : {1, 3, 8, 17, 70}) {
    std::vector<float> x(tokens * columns), bias(rows);
    std::vector<uint16_t> x_bf16(tokens * ldx, 0x7FC0);  // NaN between the rows
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t k = 0; k < columns; ++k) {
        x[t * columns + k] = float(value(draw));
        x_bf16[t * ldx + k] = to_bf16(x[t * columns + k]);
      }
    for (auto& b : bias) b = float(value(draw));
    for (int64_t begin : {int64_t(0), rows > 16 ? int64_t(16) : int64_t(0)}) {
      std::vector<uint16_t> y(tokens * rows, 0xFFFF);
      gemm_avx512_bf16({x_bf16.data(), ldx, layer.kept_bf16.data(), layer.bitmask.data(),
                        bias.data(), y.data(), rows, tokens, columns, begin, rows});
      bool same = true;
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t n = 0; n < rows; ++n) {
          float sum = bias[n];
          for (int64_t k = 0; k < columns; ++k)
            sum += x[t * columns + k] * layer.dense[n * columns + k];
          same &= y[t * rows + n] == (n < begin ? 0xFFFF : round_bf16(sum));
        }
      expect(same, "gemm_avx512_bf16", rows, columns, tokens);
    }
  }
}

// The unstructured GEMM as op_gemm.cpp runs it: pass by pass of tokens and of inputs (of at
// most `packed_bytes` of packed x; 0: the kernel's cap), x packed (in two calls, as two
// threads would share it) before the rows.
void run_bitmask_gemm(const GemmArgs& args, int64_t packed_bytes) {
  const int64_t per_pass = bitmask_gemm_tokens_per_pass();
  for (int64_t t0 = 0; t0 < args.M; t0 += per_pass) {
    const int64_t tokens = std::min(per_pass, args.M - t0);
    const int64_t width = bitmask_gemm_inputs_per_pass(tokens, args.K, packed_bytes);
    std::vector<const uint16_t*> resume(args.n_end, nullptr);
    std::vector<float> partial(args.n_end * token_lanes(tokens), std::nanf(""));
    for (int64_t k0 = 0; k0 < args.K; k0 += width) {
      const int64_t inputs = std::min(width, args.K - k0), pairs = input_pairs(inputs);
      const int64_t half = (pairs + 31) / 32 * 16;
      std::vector<uint32_t> packed(bitmask_gemm_packed_words(tokens, inputs));
      const uint16_t* x = args.x + t0 * args.ldx;
      pack_pairs_avx512_bf16(x + k0, args.ldx, tokens, inputs, 0, std::min(half, pairs),
                             packed.data());
      pack_pairs_avx512_bf16(x + k0, args.ldx, tokens, inputs, std::min(half, pairs), pairs,
                             packed.data());
      GemmArgs pass = args;
      pass.x = x;
      pass.y = args.y + t0 * args.ldy;
      pass.M = tokens;
      pass.packed = packed.data();
      pass.k_begin = k0;
      pass.k_end = k0 + inputs;
      if (width < args.K) {
        pass.resume = resume.data();
        pass.partial = partial.data();
      }
      bitmask_gemm_avx512_bf16(pass);
    }
  }
}

// bitmask_gemm_avx512_bf16 for rows [begin, rows): y = bfloat16(x W^T + bias), rows before
// `begin` untouched; x with a row stride wider than K and NaN between its rows.
void check_bitmask_gemm(const std::vector<float>& x, const std::vector<float>& expected,
                        const std::vector<uint16_t>& kept_bf16, const std::vector<uint8_t>& bitmask,
                        const int64_t* offsets, int64_t rows, int64_t columns,
                        int64_t tokens, std::mt19937& draw, GroupedLayer grouped = {}) {
  const int64_t ldx = columns + 4;
  std::uniform_int_distribution<int> value(-3, 3);
  std::vector<uint16_t> x_bf16(tokens * ldx, 0x7FC0);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t k = 0; k < columns; ++k) x_bf16[t * ldx + k] = to_bf16(x[t * columns + k]);
  std::vector<float> bias(rows);
  for (auto& b : bias) b = float(value(draw));
  // the kernel's cap, and passes of 1024 inputs (where K is wider)
  const bool split = bitmask_gemm_inputs_per_pass(tokens, columns, 1) < columns;
  for (int64_t packed_bytes : {int64_t(0), int64_t(1)}) {
    if (packed_bytes == 1 && !split) continue;
    for (int64_t begin : {int64_t(0), rows > 16 ? int64_t(16) : int64_t(0)}) {
      std::vector<uint16_t> y(tokens * rows, 0xFFFF);
      GemmArgs args{x_bf16.data(), ldx, kept_bf16.data(), bitmask.data(), bias.data(), y.data(),
                    rows, tokens, columns, begin, rows, offsets, int64_t(kept_bf16.size())};
      args.grouped = grouped;
      run_bitmask_gemm(args, packed_bytes);
      bool same = true;
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t n = 0; n < rows; ++n)
          same &= y[t * rows + n] ==
                  (n < begin ? 0xFFFF : round_bf16(expected[t * rows + n] + bias[n]));
      expect(same,
             grouped.defined() ? (packed_bytes ? "bitmask_gemm_avx512_bf16 grouped, inputs split"
                                               : "bitmask_gemm_avx512_bf16 grouped")
                               : (packed_bytes ? "bitmask_gemm_avx512_bf16, inputs split"
                                               : "bitmask_gemm_avx512_bf16"),
             rows, columns, tokens);
    }
  }
}

// x W^T in float32 ([tokens, rows]) for a dense W [rows, columns] and x [tokens, columns].
std::vector<float> products(const std::vector<float>& x, const std::vector<float>& dense,
                            int64_t rows, int64_t columns, int64_t tokens) {
  std::vector<float> y(tokens * rows, 0.0f);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t k = 0; k < columns; ++k)
        y[t * rows + n] += x[t * columns + k] * dense[n * columns + k];
  return y;
}

std::vector<float> random_x(int64_t tokens, int64_t columns, std::mt19937& draw) {
  std::uniform_int_distribution<int> value(-3, 3);
  std::vector<float> x(tokens * columns);
  for (auto& v : x) v = float(value(draw));
  return x;
}

// A 2:4 layer in the unstructured GEMM: without row offsets, as the op's "lanes" path runs
// it (each row columns / 2 values, after the rows before it), and with those offsets written
// out, as an unstructured layer.
void check_two_four_in_bitmask_gemm(const Layer& layer, std::mt19937& draw) {
  std::vector<int64_t> offsets(layer.rows);
  for (int64_t n = 0; n < layer.rows; ++n) offsets[n] = n * (layer.columns / 2);
  for (int64_t tokens : {1, 17, 70}) {
    const std::vector<float> x = random_x(tokens, layer.columns, draw);
    const std::vector<float> expected =
        products(x, layer.dense, layer.rows, layer.columns, tokens);
    const int64_t* const ways[] = {nullptr, offsets.data()};
    for (const int64_t* starts : ways)
      check_bitmask_gemm(x, expected, layer.kept_bf16, layer.bitmask, starts, layer.rows,
                         layer.columns, tokens, draw);
  }
}

// An unstructured layer in the grouped layout (sparse_kernels.h, GroupedLayer), built as
// cpu/grouped_layout.py builds it: 32 zeros after the last value, and no room past them.
struct Grouped {
  std::vector<uint16_t> values;
  std::vector<uint32_t> masks;
  std::vector<int64_t> offsets;
  GroupedLayer layer(int64_t rows) const { return {offsets.data(), masks.data(), rows}; }
};

Grouped grouped_layout(const std::vector<float>& dense, const std::vector<uint8_t>& bitmask,
                       int64_t rows, int64_t columns) {
  const int64_t steps = group_steps(columns), groups = (rows + kGroupRows - 1) / kGroupRows;
  const int64_t bytes = (columns + 7) / 8;
  Grouped grouped;
  grouped.masks.assign(groups * steps * kGroupRows, 0);
  for (int64_t g = 0; g < groups; ++g) {
    grouped.offsets.push_back(int64_t(grouped.values.size()));
    for (int64_t s = 0; s < steps; ++s)
      for (int64_t r = 0; r < kGroupRows && g * kGroupRows + r < rows; ++r) {
        const int64_t n = g * kGroupRows + r;
        for (int64_t k = s * 32; k < std::min(columns, s * 32 + 32); ++k) {
          if (!(bitmask[n * bytes + k / 8] >> (k % 8) & 1)) continue;
          grouped.masks[(g * steps + s) * kGroupRows + r] |= uint32_t(1) << (k - s * 32);
          grouped.values.push_back(to_bf16(dense[n * columns + k]));
        }
      }
  }
  grouped.offsets.push_back(int64_t(grouped.values.size()));
  grouped.values.resize(grouped.values.size() + 32, 0);
  grouped.values.shrink_to_fit();
  return grouped;
}

// The grouped layout: its dense rows (from a row that does not start a group too), its
// one-stream row kernel at the row kernels' token counts (from the second group too), and the
// unstructured GEMM over it.
void check_grouped(const std::vector<float>& dense, const std::vector<uint8_t>& bitmask,
                   int64_t rows, int64_t columns, std::mt19937& draw,
                   const std::vector<int64_t>& gemm_tokens) {
  const Grouped grouped = grouped_layout(dense, bitmask, rows, columns);
  const GroupedLayer layer = grouped.layer(rows);
  for (int64_t begin : {int64_t(0), std::min<int64_t>(3, rows - 1)}) {
    for (auto decompress : {decompress_avx512, decompress_bitmask_avx2}) {
      std::vector<uint16_t> out((rows - begin) * columns, 0xABCD);
      DecompressArgs args{grouped.values.data(), WeightType::bf16, nullptr, out.data(), columns,
                          begin, rows};
      args.grouped = layer;
      decompress(args);
      bool same = true;
      for (int64_t i = 0; i < (rows - begin) * columns; ++i)
        same &= out[i] == to_bf16(dense[begin * columns + i]);
      expect(same, "decompress grouped", rows, columns, begin);
    }
  }
  for (int64_t tokens : {int64_t(1), int64_t(2), int64_t(7), int64_t(9)}) {
    const std::vector<float> x = random_x(tokens, columns, draw);
    const std::vector<float> expected = products(x, dense, rows, columns, tokens);
    std::vector<uint16_t> x_bf16(tokens * columns);
    for (size_t i = 0; i < x.size(); ++i) x_bf16[i] = to_bf16(x[i]);
    for (int64_t begin : {int64_t(0), rows > kGroupRows ? int64_t(kGroupRows) : int64_t(0)}) {
      std::vector<float> y(tokens * rows, -1.0f);
      RowsArgs args{x_bf16.data(), columns, grouped.values.data(), WeightType::bf16, nullptr,
                    y.data(), rows, tokens, columns, begin, rows};
      args.grouped = layer;
      rows_grouped_avx512_bf16(args);
      bool same = true;
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t n = 0; n < rows; ++n)
          same &= y[t * rows + n] == (n < begin ? -1.0f : expected[t * rows + n]);
      expect(same, "rows_grouped_avx512_bf16", rows, columns, tokens);
    }
  }
  for (int64_t tokens : gemm_tokens) {
    const std::vector<float> x = random_x(tokens, columns, draw);
    check_bitmask_gemm(x, products(x, dense, rows, columns, tokens), grouped.values, bitmask,
                       nullptr, rows, columns, tokens, draw, layer);
  }
}

// Unstructured layers (RowsArgs::row_offsets): the AVX-512 row kernels and the dense rows,
// any number kept per group, inputs not a multiple of 16 or 32; the unstructured GEMM at the
// row kernels' token counts and at `gemm_tokens` (its tiles of 16 and 32 tokens, its blocking
// beyond 64, its passes).
void check_unstructured(int64_t rows, int64_t columns, double sparsity, std::mt19937& draw,
                        std::vector<int64_t> gemm_tokens = {16, 33, 65}) {
  const int64_t bytes = (columns + 7) / 8;
  std::vector<float> dense(rows * columns, 0.0f), kept;
  std::vector<uint16_t> kept_bf16;
  std::vector<uint8_t> bitmask(rows * bytes, 0);
  std::vector<int64_t> offsets(rows);
  std::uniform_int_distribution<int> value(-3, 3);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (int64_t n = 0; n < rows; ++n) {
    offsets[n] = int64_t(kept.size());
    for (int64_t k = 0; k < columns; ++k) {
      if (uniform(draw) < sparsity) continue;
      dense[n * columns + k] = float(value(draw));  // a kept zero is marked too
      bitmask[n * bytes + k / 8] |= uint8_t(1u << (k % 8));
      kept.push_back(dense[n * columns + k]);
      kept_bf16.push_back(to_bf16(dense[n * columns + k]));
    }
  }
  kept.shrink_to_fit();  // no room past the last value: ASan sees a load there
  kept_bf16.shrink_to_fit();
  const int64_t count = int64_t(kept.size());
  for (WeightType type : {WeightType::f32, WeightType::bf16}) {
    for (auto decompress : {decompress_avx512, decompress_bitmask_avx2}) {
      const void* values = type == WeightType::f32 ? static_cast<const void*>(kept.data())
                                                   : static_cast<const void*>(kept_bf16.data());
      std::vector<uint8_t> out(rows * columns * 4 + 64, 0xAB);
      DecompressArgs dense_args{values, type, bitmask.data(), out.data(), columns, 0, rows};
      dense_args.row_offsets = offsets.data();
      dense_args.values_count = count;
      decompress(dense_args);
      bool same = true;
      for (int64_t i = 0; i < rows * columns; ++i)
        same &= dense_value(out.data(), type, i) == dense[i];
      expect(same, "decompress unstructured", rows, columns, 0);
    }
  }
  for (int64_t tokens : gemm_tokens) {
    const std::vector<float> x = random_x(tokens, columns, draw);
    check_bitmask_gemm(x, products(x, dense, rows, columns, tokens), kept_bf16, bitmask,
                       offsets.data(), rows, columns, tokens, draw);
  }
  if (columns <= 8192) check_grouped(dense, bitmask, rows, columns, draw, gemm_tokens);
  if (columns > 8192) return;  // the row kernels' checks below are for the smaller layers
  for (int64_t tokens :
       {int64_t(1), int64_t(2), int64_t(5), int64_t(9), int64_t(14), int64_t(29)}) {
    const std::vector<float> x = random_x(tokens, columns, draw);
    const std::vector<float> expected = products(x, dense, rows, columns, tokens);
    std::vector<uint16_t> x_bf16(tokens * columns);
    for (size_t i = 0; i < x.size(); ++i) x_bf16[i] = to_bf16(x[i]);
    std::vector<float> y32(tokens * rows), y16(tokens * rows), ydot(tokens * rows);
    RowsArgs f32{x.data(), columns, kept.data(), WeightType::f32, bitmask.data(), y32.data(),
                 rows, tokens, columns, 0, rows};
    RowsArgs bf16 = f32, dot = f32;
    bf16.compressed = kept_bf16.data();
    bf16.type = WeightType::bf16;
    bf16.y = y16.data();
    dot.x = x_bf16.data();
    dot.compressed = kept_bf16.data();
    dot.type = WeightType::bf16;
    dot.y = ydot.data();
    for (RowsArgs* args : {&f32, &bf16, &dot}) {
      args->row_offsets = offsets.data();
      args->values_count = count;
    }
    rows_avx512(f32);
    rows_avx512(bf16);
    rows_avx512_bf16(dot);
    std::vector<float> avx2_32(tokens * rows), avx2_16(tokens * rows);
    RowsArgs avx2_f32 = f32, avx2_bf16 = bf16;
    avx2_f32.y = avx2_32.data();
    avx2_bf16.y = avx2_16.data();
    rows_bitmask_avx2(avx2_f32);
    rows_bitmask_avx2(avx2_bf16);
    expect(avx2_32 == expected, "rows_bitmask_avx2 f32", rows, columns, tokens);
    expect(avx2_16 == expected, "rows_bitmask_avx2 bf16", rows, columns, tokens);
    expect(y32 == expected, "rows_avx512 f32 unstructured", rows, columns, tokens);
    expect(y16 == expected, "rows_avx512 bf16 unstructured", rows, columns, tokens);
    expect(ydot == expected, "rows_avx512_bf16 unstructured", rows, columns, tokens);
    check_bitmask_gemm(x, expected, kept_bf16, bitmask, offsets.data(), rows, columns, tokens,
                       draw);
  }
}

}  // namespace

int main() {
  std::mt19937 draw(0);
  const int64_t shapes[][2] = {{1, 4},   {5, 12},   {16, 32}, {33, 100}, {64, 132}, {7, 36},
                               {9, 64},  {3, 28},   {4, 44},  {6, 60},   {130, 260}, {5, 4100}};
  for (const auto& shape : shapes) {
    const Layer layer = random_layer(shape[0], shape[1], draw);
    check_layer(layer, draw);
    check_gemm(layer, draw);
    check_two_four_in_bitmask_gemm(layer, draw);
  }
  check_gemm(random_layer(100, 8200, draw), draw);  // a second block of rows and of groups
  for (double sparsity : {0.0, 0.5, 0.65, 1.0}) {
    check_unstructured(1, 1, sparsity, draw);
    check_unstructured(9, 37, sparsity, draw);
    check_unstructured(13, 100, sparsity, draw);
    check_unstructured(5, 1031, sparsity, draw);
    check_unstructured(70, 1058, sparsity, draw);  // a second block of rows; chunks and a tail
    check_unstructured(130, 66, sparsity, draw);
    check_unstructured(9, 4258, sparsity, draw);  // chunks of the expand-once rows, and a tail
    check_unstructured(50, 4097, sparsity, draw);  // the GEMM: an odd K past a whole chunk
  }
  // the GEMM's packed x capped per pass: 70 tokens take two passes of inputs here; an odd K
  for (double sparsity : {0.5, 0.95}) {
    check_unstructured(3, 66001, sparsity, draw, {70});
  }
  // past 512 tokens, passes of tokens, each split into passes of inputs (the small cap)
  check_unstructured(20, 2100, 0.5, draw, {530});
  std::printf(failures ? "FAILED %d\n" : "OK\n", failures);
  return failures ? 1 : 0;
}
