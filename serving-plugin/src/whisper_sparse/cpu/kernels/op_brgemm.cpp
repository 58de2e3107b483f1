// The tiles' micro-kernel path: y^T = W x^T block by block, with oneDNN's brgemm micro-kernel
// (ATen's at::native::cpublas::brgemm, as PyTorch's CPU flash attention and Inductor's CPU GEMM
// template use it). oneDNN picks AMX tiles where the CPU has them and AVX512_BF16 elsewhere,
// and asks the OS for the tile state itself. W's rows are expanded a block at a time into a
// row-major buffer (the A operand: never transposed, never packed; its rows padded apart); x^T
// is packed into oneDNN's pair-interleaved layout once per call (the B operand, 64 tokens a
// block); each product's float32 block gets the bias and is rounded once into y.
#include "op_brgemm.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>

#include "op_buffers.h"
#include "sparse_kernels.h"

namespace whisper_sparse {
namespace {

constexpr int64_t kTokensPerBlock = 64;  // B's width; oneDNN packs 16, 32, 48 or 64 columns
// Inputs per micro-kernel call, the float32 sums carried over the calls (each call loads and
// stores them: on AMX, C's tiles). 1024, with A's rows padded apart, was the fastest measured
// on the AVX512_BF16 micro-kernel (JOURNAL.md); not yet measured on AMX.
constexpr int64_t kInputsPerProduct = 1024;

// Rows of W per block: 32, or 16 where 32 expanded rows (at their padded stride) would pass
// 512 KiB (L2).
int64_t rows_per_block(int64_t in_features) {
  return expanded_row_stride(in_features) * 2 * 32 <= (int64_t(512) << 10) ? 32 : 16;
}

}  // namespace

#ifdef CPUBLAS_BRGEMM_BF16BF16F32
namespace {

// x's tokens [first, first + count) as oneDNN's pair-interleaved B: [K / 2][width][2], the
// columns past count zero (the layout cpublas::pack writes for bfloat16 where AMX exists).
void pack_pairs(const c10::BFloat16* x, int64_t K, int64_t first, int64_t count, int64_t width,
                c10::BFloat16* out) {
  for (int64_t pair = 0; pair < K / 2; ++pair) {
    c10::BFloat16* row = out + pair * width * 2;
    for (int64_t t = 0; t < width; ++t) {
      const bool real = t < count;
      row[2 * t] = real ? x[(first + t) * K + 2 * pair] : c10::BFloat16(0.0f);
      row[2 * t + 1] = real ? x[(first + t) * K + 2 * pair + 1] : c10::BFloat16(0.0f);
    }
  }
}

// One 16 x 16 x 2 product through cpublas::brgemm's pair-interleaved path: whether torch's
// oneDNN micro-kernel runs bfloat16 here (it needs oneDNN's ukernel API and an AVX-512 ISA,
// neither capped nor disabled; elsewhere ATen raises, and the tiles call ATen's GEMM).
bool brgemm_answers() {
  try {
    c10::BFloat16 a[16 * 2], b[2 * 16];
    float c[16 * 16];
    for (int i = 0; i < 32; ++i) a[i] = b[i] = c10::BFloat16(1.0f);
    at::native::cpublas::brgemm(16, 16, 2, 2, 16, 16, false, a, b, c, true);
    at::native::cpublas::brgemm_release();
    return c[0] == 2.0f && c[255] == 2.0f;
  } catch (const c10::Error&) {
    return false;
  }
}

}  // namespace
#endif

bool brgemm_runs(int64_t in_features) {
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
  static const bool answers = brgemm_answers();
  return answers && in_features % 2 == 0;
#else
  (void)in_features;
  return false;
#endif
}

std::string brgemm_kernel() {
  if (!brgemm_runs(2)) return "none";
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
  return at::native::cpublas::could_pack(at::kBFloat16) ? "amx" : "avx512";
#else
  return "none";
#endif
}

#ifdef CPUBLAS_BRGEMM_BF16BF16F32
at::Tensor brgemm_linear(const at::Tensor& x2, const OpLayer& layer,
                         const c10::optional<at::Tensor>& bias) {
  namespace cpublas = at::native::cpublas;
  const int64_t tokens = x2.size(0), rows = layer.rows, K = layer.in_features;
  const int64_t blocks = (tokens + kTokensPerBlock - 1) / kTokensPerBlock;
  // x^T packed block by block: block b holds tokens [64 b, 64 b + width_b), zero-padded to a
  // multiple of 16, as oneDNN's B
  const at::Tensor x = x2.contiguous();
  at::Tensor packed = at::empty({blocks, K * kTokensPerBlock}, x2.options());
  auto* packed_x = static_cast<c10::BFloat16*>(packed.data_ptr());
  std::vector<int64_t> width(blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t count = std::min(kTokensPerBlock, tokens - b * kTokensPerBlock);
    width[b] = (count + 15) / 16 * 16;
  }
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      pack_pairs(static_cast<const c10::BFloat16*>(x.data_ptr()), K, b * kTokensPerBlock,
                 std::min(kTokensPerBlock, tokens - b * kTokensPerBlock), width[b],
                 packed_x + b * K * kTokensPerBlock);
    }
  });
  const at::Tensor bias32 = bias.has_value() && bias->defined()
                                ? bias->to(at::kFloat).contiguous()
                                : at::Tensor();
  const float* bias_values = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({tokens, rows}, x2.options());
  auto* out = static_cast<c10::BFloat16*>(y.data_ptr());
  const int64_t block_rows = rows_per_block(K), lda = expanded_row_stride(K);
  at::parallel_for(0, (rows + block_rows - 1) / block_rows, 1, [&](int64_t first, int64_t last) {
    auto a_operand = aligned_buffer<c10::BFloat16>(block_rows * lda);
    auto sums = aligned_buffer<float>(block_rows * kTokensPerBlock);
    for (int64_t block = first; block < last; ++block) {
      const int64_t r0 = block * block_rows, count = std::min(block_rows, rows - r0);
      decompress_avx512(layer.decompress_args(a_operand.get(), r0, r0 + count, lda));
      for (int64_t b = 0; b < blocks; ++b) {
        for (int64_t k0 = 0; k0 < K; k0 += kInputsPerProduct) {
          cpublas::brgemm(count, width[b], std::min(kInputsPerProduct, K - k0), lda, width[b],
                          kTokensPerBlock, k0 > 0, a_operand.get() + k0,
                          packed_x + b * K * kTokensPerBlock + k0 * width[b], sums.get(), true);
        }
        const int64_t first_token = b * kTokensPerBlock;
        const int64_t in_block = std::min(kTokensPerBlock, tokens - first_token);
        for (int64_t t = 0; t < in_block; ++t) {
          c10::BFloat16* y_row = out + (first_token + t) * rows + r0;
          for (int64_t r = 0; r < count; ++r) {
            const float bias_r = bias_values != nullptr ? bias_values[r0 + r] : 0.0f;
            y_row[r] = c10::BFloat16(sums[r * kTokensPerBlock + t] + bias_r);
          }
        }
      }
    }
    cpublas::brgemm_release();
  });
  return y;
}
#else
at::Tensor brgemm_linear(const at::Tensor&, const OpLayer&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "this torch has no cpublas::brgemm");
}
#endif

}  // namespace whisper_sparse
