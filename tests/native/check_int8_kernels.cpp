// The W8A8 kernels, int8_avx512_vnni.cpp's rows and int8_avx512_vnni_tiles.cpp's tiles built
// with avx512_emulation.h (or, with
// -DWS_INT8_AVX2, int8_avx2.cpp's rows and tiles as the CPU runs them; with -DWS_INT8_AVX_VNNI,
// int8_avx_vnni.cpp's, their vpdpbusd and vpdpwssd from avx_vnni_emulation.h or the CPU),
// against a scalar reference: 2:4 and unstructured layers (0 % to 95 % pruned, an all-zero and
// a full row), inputs off the kernels' 64, 32 and 16, 1 to 9 tokens holding -128 and 127,
// float32 and bfloat16 outputs, with and without a bias; the layers' values held in vectors of
// exactly their size, so that AddressSanitizer sees a load past the last. Prints one line per failure and exits 1 on any;
// test_cpu_int8_op.py builds and runs it.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "int8_kernels.h"

using namespace whisper_sparse;

#if defined(WS_INT8_AVX_VNNI)
#define WS_INT8_ROWS int8_rows_avx_vnni
#define WS_INT8_TILES int8_tiles_avx_vnni
#define WS_INT8_DECOMPRESS int8_decompress_avx2
#elif defined(WS_INT8_AVX2)
#define WS_INT8_ROWS int8_rows_avx2
#define WS_INT8_TILES int8_tiles_avx2
#define WS_INT8_DECOMPRESS int8_decompress_avx2
#else
#define WS_INT8_ROWS int8_rows_avx512_vnni
#define WS_INT8_BYTE_TILES int8_tiles_avx512_vnni
#define WS_INT8_DECOMPRESS int8_decompress_avx512
#endif

namespace {

struct Layer {
  int64_t rows, columns;
  std::vector<int8_t> dense, values;
  std::vector<uint8_t> bitmask;
  std::vector<int64_t> offsets;
  std::vector<float> scale;
};

Layer random_layer(int64_t rows, int64_t columns, double sparsity, bool two_four,
                   std::mt19937& draw) {
  Layer layer{rows, columns, std::vector<int8_t>(rows * columns, 0), {}, {}, {}, {}};
  const int64_t bytes = (columns + 7) / 8;
  layer.bitmask.assign(rows * bytes, 0);
  std::uniform_int_distribution<int> value(-128, 127), position(0, 3);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int64_t n = 0; n < rows; ++n) {
    layer.offsets.push_back(int64_t(layer.values.size()));
    for (int64_t k = 0; k < columns; ++k) {
      bool kept;
      if (two_four) {
        const int64_t group = k / 4;
        std::mt19937 pick(uint32_t(n * 7919 + group));
        const int first = int(pick() % 4), second = (first + 1 + int(pick() % 3)) % 4;
        kept = int(k % 4) == first || int(k % 4) == second;
      } else {
        kept = n != 0 && (n == 1 || unit(draw) >= sparsity);
      }
      if (!kept) continue;
      const int8_t v = n == 0 ? 0 : int8_t(value(draw));
      layer.dense[n * columns + k] = v;
      layer.values.push_back(v);
      layer.bitmask[n * bytes + k / 8] |= uint8_t(1u << (k % 8));
    }
    layer.scale.push_back(float(1e-3 * (1 + n % 7)));
  }
  return layer;
}

int failures = 0;

void check(const Layer& l, bool two_four, int64_t tokens, bool bf16, bool with_bias,
           std::mt19937& draw) {
  std::uniform_int_distribution<int> value(-128, 127);
  std::vector<int8_t> x(tokens * l.columns);
  for (auto& v : x) v = int8_t(value(draw));
  x[0] = -128;
  x.back() = 127;
  std::vector<float> x_scale, bias;
  for (int64_t m = 0; m < tokens; ++m) x_scale.push_back(float(0.01 * (m + 1)));
  for (int64_t n = 0; n < l.rows; ++n) bias.push_back(float(n % 5) - 2.0f);
  Int8Layer layer{l.values.data(), l.bitmask.data(), two_four ? nullptr : l.offsets.data(),
                  int64_t(l.values.size()), l.rows, l.columns, l.scale.data()};
  Int8Tokens t{x.data(), l.columns, x_scale.data(), tokens};
  std::vector<float> y(tokens * l.rows), want(tokens * l.rows);
  std::vector<uint16_t> y_bf16(tokens * l.rows), want_bf16(tokens * l.rows);
  Int8Output out{bf16 ? y_bf16.data() : nullptr, bf16 ? nullptr : y.data(), l.rows,
                 with_bias ? bias.data() : nullptr};
  Int8Output ref{bf16 ? want_bf16.data() : nullptr, bf16 ? nullptr : want.data(), l.rows,
                 with_bias ? bias.data() : nullptr};
  for (int64_t m = 0; m < tokens; ++m)
    for (int64_t n = 0; n < l.rows; ++n) {
      int64_t sum = 0;
      for (int64_t k = 0; k < l.columns; ++k)
        sum += int64_t(x[m * l.columns + k]) * l.dense[n * l.columns + k];
      store_int8_sum(ref, t, layer, m, n, int32_t(sum));
    }
  const auto compare = [&](const char* path) {
    if (bf16 ? y_bf16 != want_bf16 : y != want) {
      std::printf("%s: %lld x %lld %s, %lld tokens, bf16 %d, bias %d\n", path, (long long)l.rows,
                  (long long)l.columns, two_four ? "2:4" : "unstructured", (long long)tokens,
                  int(bf16), int(with_bias));
      ++failures;
    }
  };
  WS_INT8_ROWS(layer, t, out, 0, l.rows);
  compare("rows");
#ifdef WS_INT8_TILES
  const int64_t ld_x = wide_token_stride(l.columns);
  std::vector<int16_t> wide(tokens * ld_x, 0);
  for (int64_t m = 0; m < tokens; ++m)
    for (int64_t k = 0; k < l.columns; ++k) wide[m * ld_x + k] = x[m * l.columns + k];
  std::fill(y.begin(), y.end(), 0.0f);
  std::fill(y_bf16.begin(), y_bf16.end(), uint16_t(0));
  WS_INT8_TILES(layer, t, wide.data(), ld_x, out, 0, l.rows);
  compare("tiles");
#endif
#ifdef WS_INT8_BYTE_TILES
  const int64_t words = (l.columns + 3) / 4 * 4;  // zero to whole 4-input words and 6 tokens
  std::vector<int8_t> padded(vnni_tile_rows(tokens) * words, 0);
  for (int64_t m = 0; m < tokens; ++m)
    std::copy(x.begin() + m * l.columns, x.begin() + (m + 1) * l.columns,
              padded.begin() + m * words);
  const Int8Tokens padded_tokens{padded.data(), words, x_scale.data(), tokens};
  std::fill(y.begin(), y.end(), 0.0f);
  std::fill(y_bf16.begin(), y_bf16.end(), uint16_t(0));
  WS_INT8_BYTE_TILES(layer, padded_tokens, out, 0, l.rows);
  compare("tiles");
#endif
  const int64_t stride = expanded_row_bytes(l.columns);
  std::vector<int8_t> dense(l.rows * stride, 1);  // ones: the padding must come out zero
  WS_INT8_DECOMPRESS(layer, dense.data(), stride, 0, l.rows);
  for (int64_t n = 0; n < l.rows; ++n)
    for (int64_t k = 0; k < stride; ++k) {
      const int8_t expected = k < l.columns ? l.dense[n * l.columns + k] : 0;
      if (dense[n * stride + k] != expected) {
        std::printf("decompress: %lld x %lld row %lld input %lld\n", (long long)l.rows,
                    (long long)l.columns, (long long)n, (long long)k);
        ++failures;
        return;
      }
    }
}

}  // namespace

int main() {
  std::mt19937 draw(11);
  std::vector<std::array<int64_t, 2>> shapes = {{1, 4},   {5, 12},  {7, 30},  {6, 64},
                                                {9, 100}, {4, 132}, {3, 1000}};
#if defined(WS_INT8_TILES) || defined(WS_INT8_BYTE_TILES)
  shapes.push_back({70, 2100});  // more rows than a block of the tiles, more inputs than a pass
  shapes.push_back({40, 300});  // whole steps of full columns of 16 rows, then a tail, in a pass
#endif
  for (const auto& shape : shapes) {
    for (double sparsity : {0.0, 0.3, 0.5, 0.8, 0.95}) {
      for (bool two_four : {false, true}) {
        if (two_four && (shape[1] % 4 != 0 || sparsity != 0.5)) continue;
        const Layer layer = random_layer(shape[0], shape[1], sparsity, two_four, draw);
        for (int64_t tokens = 1; tokens <= 9; ++tokens)
          for (bool bf16 : {false, true})
            for (bool with_bias : {false, true}) check(layer, two_four, tokens, bf16, with_bias, draw);
      }
    }
  }
  if (failures == 0) std::printf("OK\n");
  return failures == 0 ? 0 : 1;
}
