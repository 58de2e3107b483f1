// The op's GEMM path (op.cpp's gemm_linear, where gemm_runs): the 2:4 GEMM, or for an
// unstructured layer (and a 2:4 one on the lanes path) the unstructured one in passes of
// tokens, over the threads.
#include "op_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>

#include "sparse_kernels.h"

namespace whisper_sparse {
namespace {

// The GEMM `kernel` over args' rows, the threads taking whole groups of 16 rows (one register
// of rows).
void rows_in_parallel(void (*kernel)(const GemmArgs&), const GemmArgs& args, int64_t rows) {
  at::parallel_for(0, (rows + 15) / 16, 4, [&](int64_t first, int64_t last) {
    GemmArgs part = args;
    part.n_begin = first * 16;
    part.n_end = std::min(rows, last * 16);
    kernel(part);
  });
}

// A buffer kept per calling thread and grown as needed (64-byte aligned): a pass's packed x,
// the sums of passes of inputs, their rows' pointers.
template <typename T>
struct Grown {
  T* items = nullptr;
  int64_t size = 0;
  T* at_least(int64_t count) {
    if (count > size) {
      std::free(items);
      const int64_t grown = (count + 15) / 16 * 16;
      items = static_cast<T*>(std::aligned_alloc(64, grown * sizeof(T)));
      size = items != nullptr ? grown : 0;
      TORCH_CHECK(items != nullptr, "the unstructured GEMM could not allocate ",
                  grown * sizeof(T), " bytes");
    }
    return items;
  }
  ~Grown() { std::free(items); }
};

// The unstructured GEMM in passes of tokens, and of inputs where a pass's packed x would pass
// the kernel's cap (a wide layer at many tokens: its weights then expand once, where passes of
// fewer tokens expanded them once a pass): each pass's x packed by all threads into one
// buffer, then their rows.
void bitmask_gemm_in_passes(const GemmArgs& args, int64_t rows) {
  static thread_local Grown<uint32_t> packed;
  static thread_local Grown<float> partial;
  static thread_local Grown<const uint16_t*> resume;
  const int64_t per_pass = bitmask_gemm_tokens_per_pass();
  for (int64_t t0 = 0; t0 < args.M; t0 += per_pass) {
    const int64_t tokens = std::min(per_pass, args.M - t0);
    const int64_t width = bitmask_gemm_inputs_per_pass(tokens, args.K);
    const bool split = width < args.K;
    for (int64_t k0 = 0; k0 < args.K; k0 += width) {
      const int64_t inputs = std::min(width, args.K - k0), pairs = input_pairs(inputs);
      uint32_t* to = packed.at_least(bitmask_gemm_packed_words(tokens, inputs));
      const uint16_t* x = args.x + t0 * args.ldx;
      at::parallel_for(0, (pairs + 15) / 16, 16, [&](int64_t first, int64_t last) {
        pack_pairs_avx512_bf16(x + k0, args.ldx, tokens, inputs, first * 16,
                               std::min(pairs, last * 16), to);
      });
      GemmArgs pass = args;
      pass.x = x;
      pass.y = args.y + t0 * args.ldy;
      pass.M = tokens;
      pass.packed = to;
      pass.k_begin = k0;
      pass.k_end = k0 + inputs;
      pass.resume = split ? resume.at_least(rows) : nullptr;
      pass.partial = split ? partial.at_least(rows * token_lanes(tokens)) : nullptr;
      rows_in_parallel(bitmask_gemm_avx512_bf16, pass, rows);
    }
  }
}

}  // namespace

// The 2:4 GEMM, or with row offsets (or `lanes`: a 2:4 layer, read by it as rows of
// in_features / 2 values) the unstructured one.
at::Tensor gemm_linear(const at::Tensor& x2, const OpLayer& layer,
                       const c10::optional<at::Tensor>& bias, bool lanes) {
  const int64_t tokens = x2.size(0), rows = layer.rows;
  const at::Tensor bias32 = bias.has_value() && bias->defined()
                                ? bias->to(at::kFloat).contiguous()
                                : at::Tensor();
  at::Tensor y = at::empty({tokens, rows}, x2.options());
  GemmArgs args{static_cast<const uint16_t*>(x2.data_ptr()), layer.in_features,
                static_cast<const uint16_t*>(layer.values.data_ptr()), layer.bitmask,
                bias32.defined() ? bias32.data_ptr<float>() : nullptr,
                static_cast<uint16_t*>(y.data_ptr()), rows, tokens, layer.in_features, 0, 0,
                layer.offsets, layer.values.numel()};
  args.grouped = layer.grouped;
  if (layer.offsets != nullptr || layer.grouped.defined() || lanes) {
    bitmask_gemm_in_passes(args, rows);
  } else {
    rows_in_parallel(gemm_avx512_bf16, args, rows);
  }
  return y;
}

}  // namespace whisper_sparse
