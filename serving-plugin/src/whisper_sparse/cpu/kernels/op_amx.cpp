// The AMX tiles' path: y^T = W x^T with AMX tile products (amx_tiles.h), AMX-BF16 for bfloat16
// layers and AMX-INT8 for W8A8 ones (their blocks' kinds, Bf16Blocks and Int8Blocks, expand and
// store; the rest is shared, in bytes). A block of W's rows is expanded once into a row-major
// buffer, whose rows the A tiles load as they lie; x^T is packed once per call into the B tiles'
// layout (words of two bfloat16 or four int8 inputs); each 32 x 32 block of y^T keeps its sums in
// four C tiles over K (over passes of K for many tokens), and is rounded once into y. Expanding
// the next block between the tile products, into a second buffer, measured no faster
// (benchmarks/results/JOURNAL.md).
#include "op_amx.h"

#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "int8_kernels.h"
#include "op_buffers.h"
#include "op_isa.h"
#include "sparse_kernels.h"

#define WS_TARGET                                                                     \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,avx512bf16,avx512vnni,fma," \
                        "amx-tile,amx-bf16,amx-int8")))

#include "amx_tiles.h"

namespace whisper_sparse {
namespace {

// Blocking, measured on a Sapphire-Rapids-class Xeon: up to kFewTokens tokens (whose packed
// activations stay in L2 beside the block) blocks of kSubRows rows, multiplied over all of K;
// above, blocks of kManyTokensRows rows (fewer passes over the activations, which L3 holds)
// in passes of kPassSteps steps (4096 inputs) over K, so that a pass's part of the block
// stays in L2.
constexpr int64_t kFewTokens = 128;
constexpr int64_t kManyTokensRows = 128;
constexpr int64_t kPassSteps = 128;

// CPUID's AMX-TILE and the tile product's own bit (AMX-BF16 or AMX-INT8), the tile state
// enabled by the OS (XCR0 bits 17 and 18), and this process permitted to use it (Linux asks each
// process to request it).
constexpr int kAmxBf16 = 22, kAmxInt8 = 25;  // CPUID.(7, 0):EDX bits
bool amx_present(int product_bit) {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!((edx >> product_bit) & 1) || !((edx >> 24) & 1)) return false;
  unsigned xcr0_low, xcr0_high;
  __asm__("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  if ((xcr0_low & 0x60000) != 0x60000) return false;
  constexpr long kRequestPermission = 0x1023, kTileData = 18;
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

// One call's sizes and the blocking chosen for them, in bytes: a step is a tile row's 64.
struct AmxBlocking {
  int64_t tokens, rows;
  int64_t lda;           // the expanded rows' stride (expanded_row_bytes)
  int64_t k_steps;       // steps of 64 bytes of inputs
  int64_t group_bytes;   // a 16-token tile column of the packed activations
  int64_t token_blocks;  // of kBlockTokens
  int64_t per_block;     // rows expanded at a time, a multiple of kSubRows
  int64_t pass_steps;    // steps per pass over K (a block's sums kept between passes)

  bool passes() const { return pass_steps < k_steps; }
};

AmxBlocking amx_blocking(int64_t rows, int64_t input_bytes, int64_t tokens) {
  AmxBlocking p;
  p.tokens = tokens;
  p.rows = rows;
  p.lda = expanded_row_bytes(input_bytes);
  p.k_steps = (input_bytes + kTileBytes - 1) / kTileBytes;
  p.group_bytes = p.k_steps * kTileBytes * kTileRows;
  p.token_blocks = (tokens + kBlockTokens - 1) / kBlockTokens;
  const int64_t per_block = tokens <= kFewTokens ? kSubRows : kManyTokensRows;
  p.per_block = std::min(per_block, (rows + kSubRows - 1) / kSubRows * kSubRows);
  p.pass_steps = tokens <= kFewTokens ? p.k_steps : std::min(p.k_steps, kPassSteps);
  return p;
}

// A bfloat16 layer's blocks: expanded by the AVX-512 decompression, their float32 sums plus the
// bias rounded into y.
struct Bf16Blocks {
  static constexpr TileDot kDot = TileDot::bf16;
  const OpLayer& layer;
  const float* bias;
  uint16_t* y;

  struct RowValues {
    const float* c;
    const float* bias;
    int64_t rows;
    WS_TARGET __m512 operator()(int64_t r, int64_t t) const {
      const __m512 bias_r = _mm512_set1_ps(bias != nullptr && r < rows ? bias[r] : 0.0f);
      return _mm512_add_ps(_mm512_loadu_ps(c + r * kBlockTokens + t), bias_r);
    }
  };

  void expand(void* out, int64_t lda, int64_t r0, int64_t r1) const {
    decompress_avx512(layer.decompress_args(out, r0, r1, lda / 2));
  }
  void store(const void* sums, int64_t n, int64_t rows, int64_t t0, int64_t tokens) const {
    const RowValues values{static_cast<const float*>(sums), bias != nullptr ? bias + n : nullptr,
                           rows};
    store_rows(values, rows, tokens, y + t0 * layer.rows + n, nullptr, layer.rows);
  }
};

// A W8A8 layer's blocks: expanded by vpexpandb, their int32 sums scaled as store_int8_sum does.
struct Int8Blocks {
  static constexpr TileDot kDot = TileDot::int8;
  const Int8Layer& layer;
  const Int8Tokens& x;
  const Int8Output& out;

  struct RowValues {
    const int32_t* c;
    const float* token_scales;  // the block's tokens'
    const float* row_scales;    // the block's rows'
    const float* bias;
    int64_t rows, tokens;
    bool token_scale_first;
    WS_TARGET __m512 operator()(int64_t r, int64_t t) const {
      if (r >= rows) return _mm512_setzero_ps();
      const __mmask16 live = tokens - t >= 16 ? __mmask16(0xFFFF)
                                              : __mmask16((1u << (tokens - t)) - 1);
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_loadu_si512(c + r * kBlockTokens + t));
      const __m512 row_scale = _mm512_set1_ps(row_scales[r]);
      const __m512 tokens_scales = _mm512_maskz_loadu_ps(live, token_scales + t);
      const __m512 first = token_scale_first ? tokens_scales : row_scale;
      const __m512 second = token_scale_first ? row_scale : tokens_scales;
      const __m512 scaled = _mm512_mul_ps(sums, first);
      return bias != nullptr ? _mm512_fmadd_ps(scaled, second, _mm512_set1_ps(bias[r]))
                             : _mm512_mul_ps(scaled, second);
    }
  };

  void expand(void* buffer, int64_t lda, int64_t r0, int64_t r1) const {
    int8_decompress_avx512(layer, static_cast<int8_t*>(buffer), lda, r0, r1);
  }
  void store(const void* sums, int64_t n, int64_t rows, int64_t t0, int64_t tokens) const {
    const RowValues values{static_cast<const int32_t*>(sums), x.scale + t0, layer.scale + n,
                           out.bias != nullptr ? out.bias + n : nullptr, rows, tokens,
                           out.token_scale_first};
    const int64_t at = t0 * out.ldy + n;
    store_rows(values, rows, tokens, out.y_bf16 != nullptr ? out.y_bf16 + at : nullptr,
               out.y != nullptr ? out.y + at : nullptr, out.ldy);
  }
};

// The products of one expanded block (count rows from r0, at a) with every token, its sums
// stored into y by the blocks' kind.
template <class Blocks>
void block_products(const AmxBlocking& p, const Blocks& blocks, const char* a, int64_t r0,
                    int64_t count, const char* packed, char* sums) {
  constexpr int64_t c_bytes = kSubRows * kBlockTokens * 4;
  for (int64_t k0 = 0; k0 < p.k_steps; k0 += p.pass_steps) {
    const int64_t steps = std::min(p.pass_steps, p.k_steps - k0);
    const bool last_pass = k0 + steps == p.k_steps;
    for (int64_t t0 = 0; t0 < p.tokens; t0 += kBlockTokens) {
      const int64_t in_block = std::min(kBlockTokens, p.tokens - t0);
      const char* b = packed + (t0 / kTileRows) * p.group_bytes + k0 * kTileBytes * kTileRows;
      for (int64_t s = 0; s < count; s += kSubRows) {
        char* c = p.passes() ? sums + ((s / kSubRows) * p.token_blocks + t0 / kBlockTokens) * c_bytes
                             : sums;
        const char* a_sub = a + s * p.lda + k0 * kTileBytes;
        if (in_block > kTileRows) {
          block_product<2, Blocks::kDot>(a_sub, p.lda, b, p.group_bytes, steps, c, k0 > 0);
        } else {
          block_product<1, Blocks::kDot>(a_sub, p.lda, b, p.group_bytes, steps, c, k0 > 0);
        }
        if (last_pass) blocks.store(c, r0 + s, std::min(kSubRows, count - s), t0, in_block);
      }
    }
  }
}

// One thread's blocks [first, last), each expanded into the thread's buffer and multiplied.
template <class Blocks>
void blocks_of_thread(const AmxBlocking& p, const Blocks& blocks, const char* packed,
                      int64_t first, int64_t last) {
  auto expanded = aligned_buffer<char>(p.per_block * p.lda);
  std::memset(expanded.get(), 0, p.per_block * p.lda);
  auto sums = aligned_buffer<char>((p.passes() ? p.per_block / kSubRows * p.token_blocks : 1) *
                                   kSubRows * kBlockTokens * 4);
  for (int64_t block = first; block < last; ++block) {
    const int64_t r0 = block * p.per_block, count = std::min(p.per_block, p.rows - r0);
    blocks.expand(expanded.get(), p.lda, r0, r0 + count);
    if (count < p.per_block) {  // the rows past the layer's end multiply as zeros
      std::memset(expanded.get() + count * p.lda, 0, (p.per_block - count) * p.lda);
    }
    block_products(p, blocks, expanded.get(), r0, count, packed, sums.get());
  }
  release_tiles();
}

// Packs the tokens (token_words words each) once, then runs every block of rows over them.
template <class Blocks>
void amx_blocks(const Blocks& blocks, const int32_t* words, int64_t token_words, int64_t rows,
                int64_t tokens) {
  const AmxBlocking p = amx_blocking(rows, token_words * 4, tokens);
  const int64_t groups = (tokens + kTileRows - 1) / kTileRows;  // 16-token tile columns
  auto packed = aligned_buffer<char>(groups * p.group_bytes);
  at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
    for (int64_t g = first; g < last; ++g) {
      pack_tokens(words, token_words, p.k_steps * kTileBytes / 4, g * kTileRows,
                  std::min(kTileRows, tokens - g * kTileRows),
                  reinterpret_cast<int32_t*>(packed.get() + g * p.group_bytes));
    }
  });
  at::parallel_for(0, (rows + p.per_block - 1) / p.per_block, 1, [&](int64_t first, int64_t last) {
    blocks_of_thread(p, blocks, packed.get(), first, last);
  });
}

}  // namespace

bool amx_runs(int64_t in_features) {
  static const bool present = amx_present(kAmxBf16);
  return present && active_isa() == kAvx512Bf16 && in_features % 2 == 0;
}

bool amx_int8_runs(int64_t in_features) {
  static const bool present = amx_present(kAmxInt8);
  return present && int8_vnni_runs() && in_features % 4 == 0;
}

at::Tensor amx_linear(const at::Tensor& x2, const OpLayer& layer,
                      const c10::optional<at::Tensor>& bias) {
  const at::Tensor x = x2.contiguous();
  const at::Tensor bias32 = bias.has_value() && bias->defined()
                                ? bias->to(at::kFloat).contiguous()
                                : at::Tensor();
  at::Tensor y = at::empty({x.size(0), layer.rows}, x2.options());
  const Bf16Blocks blocks{layer, bias32.defined() ? bias32.data_ptr<float>() : nullptr,
                          static_cast<uint16_t*>(y.data_ptr())};
  amx_blocks(blocks, static_cast<const int32_t*>(x.data_ptr()), layer.in_features / 2, layer.rows,
             x.size(0));
  return y;
}

void amx_int8_linear(const Int8Layer& layer, const Int8Tokens& x, const Int8Output& out) {
  TORCH_CHECK(x.ldx == layer.K, "amx_int8_linear: the tokens' rows must be contiguous");
  amx_blocks(Int8Blocks{layer, x, out}, reinterpret_cast<const int32_t*>(x.x_q), layer.K / 4,
             layer.rows, x.M);
}

}  // namespace whisper_sparse
