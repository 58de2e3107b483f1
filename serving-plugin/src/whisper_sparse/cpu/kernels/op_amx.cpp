// The AMX tiles' path: y^T = W x^T with AMX-BF16 tile products (amx_tiles.h). A block of W's
// rows is expanded once into a row-major buffer, whose rows the A tiles load as they lie; x^T
// is packed once per call into the B tiles' pair-interleaved layout; each 32 x 32 block of y^T
// keeps its float32 sums in four C tiles over K (over passes of K for many tokens), and is
// rounded once into y. Expanding the next block between the tile products, into a second
// buffer, measured no faster (benchmarks/results/JOURNAL.md).
#include "op_amx.h"

#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "op_buffers.h"
#include "op_isa.h"
#include "sparse_kernels.h"

#define WS_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,avx512bf16,amx-tile,amx-bf16")))

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

// CPUID's AMX-TILE and AMX-BF16, the tile state enabled by the OS (XCR0 bits 17 and 18), and
// this process permitted to use it (Linux asks each process to request it).
bool amx_bf16_present() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!((edx >> 22) & 1) || !((edx >> 24) & 1)) return false;
  unsigned xcr0_low, xcr0_high;
  __asm__("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  if ((xcr0_low & 0x60000) != 0x60000) return false;
  constexpr long kRequestPermission = 0x1023, kTileData = 18;
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

// One call's sizes and the blocking chosen for them.
struct AmxBlocking {
  int64_t tokens, rows, K;
  int64_t lda;             // the expanded rows' stride: K rounded up to 32, an odd number of lines
  int64_t k_steps;         // steps of 32 inputs
  int64_t group_elements;  // a 16-token tile column of the packed activations
  int64_t token_blocks;    // of kBlockTokens
  int64_t per_block;       // rows expanded at a time, a multiple of kSubRows
  int64_t pass_steps;      // steps per pass over K (a block's sums kept between passes)

  bool passes() const { return pass_steps < k_steps; }
};

AmxBlocking amx_blocking(const OpLayer& layer, int64_t tokens) {
  AmxBlocking p;
  p.tokens = tokens;
  p.rows = layer.rows;
  p.K = layer.in_features;
  p.lda = expanded_row_stride(p.K);
  p.k_steps = (p.K + kTileInputs - 1) / kTileInputs;
  p.group_elements = p.k_steps * kTileInputs * kTileRows;
  p.token_blocks = (tokens + kBlockTokens - 1) / kBlockTokens;
  const int64_t per_block = tokens <= kFewTokens ? kSubRows : kManyTokensRows;
  p.per_block = std::min(per_block, (p.rows + kSubRows - 1) / kSubRows * kSubRows);
  p.pass_steps = tokens <= kFewTokens ? p.k_steps : std::min(p.k_steps, kPassSteps);
  return p;
}

// The products of one expanded block (count rows from r0, at a) with every token, its sums
// rounded into y.
void block_products(const AmxBlocking& p, const c10::BFloat16* a, int64_t r0, int64_t count,
                    const c10::BFloat16* packed, const float* bias, float* sums,
                    c10::BFloat16* y) {
  for (int64_t k0 = 0; k0 < p.k_steps; k0 += p.pass_steps) {
    const int64_t steps = std::min(p.pass_steps, p.k_steps - k0);
    const bool last_pass = k0 + steps == p.k_steps;
    for (int64_t t0 = 0; t0 < p.tokens; t0 += kBlockTokens) {
      const int64_t in_block = std::min(kBlockTokens, p.tokens - t0);
      const c10::BFloat16* b =
          packed + (t0 / kTileRows) * p.group_elements + k0 * kTileInputs * kTileRows;
      for (int64_t s = 0; s < count; s += kSubRows) {
        float* c = p.passes() ? sums + ((s / kSubRows) * p.token_blocks + t0 / kBlockTokens) *
                                       kSubRows * kBlockTokens
                          : sums;
        const c10::BFloat16* a_sub = a + s * p.lda + k0 * kTileInputs;
        if (in_block > kTileRows) {
          block_product<2>(a_sub, p.lda, b, p.group_elements, steps, c, k0 > 0);
        } else {
          block_product<1>(a_sub, p.lda, b, p.group_elements, steps, c, k0 > 0);
        }
        if (last_pass) {
          store_sums(c, bias != nullptr ? bias + r0 + s : nullptr, std::min(kSubRows, count - s),
                     in_block, y + t0 * p.rows + r0 + s, p.rows);
        }
      }
    }
  }
}

// One thread's blocks [first, last), each expanded into the thread's buffer and multiplied.
void blocks_of_thread(const AmxBlocking& p, const OpLayer& layer, const c10::BFloat16* packed,
                      const float* bias, c10::BFloat16* y, int64_t first, int64_t last) {
  auto expanded = aligned_buffer<c10::BFloat16>(p.per_block * p.lda);
  std::memset(expanded.get(), 0, p.per_block * p.lda * sizeof(c10::BFloat16));
  auto sums = aligned_buffer<float>((p.passes() ? p.per_block / kSubRows * p.token_blocks : 1) *
                                    kSubRows * kBlockTokens);
  for (int64_t block = first; block < last; ++block) {
    const int64_t r0 = block * p.per_block, count = std::min(p.per_block, p.rows - r0);
    decompress_avx512(layer.decompress_args(expanded.get(), r0, r0 + count, p.lda));
    if (count < p.per_block) {  // the rows past the layer's end multiply as zeros
      std::memset(expanded.get() + count * p.lda, 0,
                  (p.per_block - count) * p.lda * sizeof(c10::BFloat16));
    }
    block_products(p, expanded.get(), r0, count, packed, bias, sums.get(), y);
  }
  release_tiles();
}

}  // namespace

bool amx_runs(int64_t in_features) {
  static const bool present = amx_bf16_present();
  return present && active_isa() == kAvx512Bf16 && in_features % 2 == 0;
}

at::Tensor amx_linear(const at::Tensor& x2, const OpLayer& layer,
                      const c10::optional<at::Tensor>& bias) {
  const AmxBlocking p = amx_blocking(layer, x2.size(0));
  const int64_t groups = (p.tokens + kTileRows - 1) / kTileRows;  // 16-token tile columns
  const at::Tensor x = x2.contiguous();
  auto packed = aligned_buffer<c10::BFloat16>(groups * p.group_elements);
  const auto* x_values = static_cast<const c10::BFloat16*>(x.data_ptr());
  at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
    for (int64_t g = first; g < last; ++g) {
      pack_tokens(x_values, p.K, p.k_steps * kTileInputs, g * kTileRows,
                  std::min(kTileRows, p.tokens - g * kTileRows),
                  packed.get() + g * p.group_elements);
    }
  });
  const at::Tensor bias32 = bias.has_value() && bias->defined()
                                ? bias->to(at::kFloat).contiguous()
                                : at::Tensor();
  at::Tensor y = at::empty({p.tokens, p.rows}, x2.options());
  at::parallel_for(0, (p.rows + p.per_block - 1) / p.per_block, 1, [&](int64_t first, int64_t last) {
    blocks_of_thread(p, layer, packed.get(), bias32.defined() ? bias32.data_ptr<float>() : nullptr,
                     static_cast<c10::BFloat16*>(y.data_ptr()), first, last);
  });
  return y;
}

}  // namespace whisper_sparse
