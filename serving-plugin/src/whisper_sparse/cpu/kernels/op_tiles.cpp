// The op's prefill path (op.cpp's tiled_linear, from tiled_from tokens): W expanded tile by
// tile and multiplied by ATen's dense GEMM, each thread its own tiles; and the expansion of a
// layer's rows, which the tiles and op.cpp's decompress ops share.
#include "op_tiles.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>

#include "op_amx.h"
#include "op_brgemm.h"
#include "op_isa.h"
#include "sparse_kernels.h"

namespace whisper_sparse {

WeightType weight_type(const at::Tensor& compressed) {
  TORCH_CHECK(compressed.scalar_type() == at::kFloat || compressed.scalar_type() == at::kBFloat16,
              "compressed must be float32 or bfloat16, got ", compressed.scalar_type());
  return compressed.scalar_type() == at::kFloat ? WeightType::f32 : WeightType::bf16;
}

DecompressArgs OpLayer::decompress_args(void* out, int64_t begin, int64_t end,
                                        int64_t out_stride) const {
  DecompressArgs args{values.data_ptr(), weight_type(values), bitmask, out, in_features, begin,
                      end, offsets, values.numel(), out_stride};
  args.grouped = grouped;
  return args;
}

void decompress_rows(const OpLayer& layer, int64_t begin, int64_t end, at::Tensor& out) {
  const bool unstructured = layer.offsets != nullptr || layer.grouped.defined();
  const auto kernel = active_isa() >= kAvx512 ? decompress_avx512
                      : unstructured          ? decompress_bitmask_avx2
                                              : decompress_avx2;
  at::parallel_for(begin, end, 16, [&](int64_t first, int64_t last) {
    void* part = static_cast<char*>(out.data_ptr()) +
                 (first - begin) * layer.in_features * out.element_size();
    kernel(layer.decompress_args(part, first, last));
  });
}

namespace {

// Rows of W per tile of the prefill path: about 1 MiB of dense weight, a multiple of 16, and
// at least kMinTileRows. Each tile is one GEMM call, which packs all of x again, so a tile of
// few rows on a wide layer is dominated by that (JOURNAL.md).
constexpr int64_t kMinTileRows = 128;

int64_t tile_rows(int64_t in_features, int64_t element_size, int64_t rows) {
  const int64_t fit = ((int64_t(1) << 20) / (in_features * element_size)) / 16 * 16;
  return std::min(rows, std::max(kMinTileRows, fit));
}

// The dtype of the tiles' GEMM: bfloat16 weights are multiplied in bfloat16 only where the
// kernels are avx512_bf16 (a CPU with a bfloat16 dot product, where oneDNN's bfloat16 GEMM
// is fast); elsewhere oneDNN emulates it, far slower than float32, so the tiles are widened
// to float32, exactly.
at::ScalarType tile_dtype(at::ScalarType weight) {
  return weight == at::kBFloat16 && active_isa() == kAvx512Bf16 ? at::kBFloat16 : at::kFloat;
}

// Tiles [first, last) of `step` rows: each expanded into this thread's buffer (widened to the
// GEMM's dtype in a second one where it differs) and multiplied by ATen's linear, its bias
// added before the result is rounded, into its columns of y.
void tiles_of_thread(const at::Tensor& x_w, const OpLayer& layer,
                     const c10::optional<at::Tensor>& bias_w, int64_t step, int64_t first,
                     int64_t last, at::Tensor& y) {
  at::Tensor tile = at::empty({step, layer.in_features}, layer.values.options());
  at::Tensor widened = tile.scalar_type() == x_w.scalar_type()
                           ? at::Tensor()
                           : at::empty_like(tile, x_w.scalar_type());
  for (int64_t index = first; index < last; ++index) {
    const int64_t begin = index * step, count = std::min(step, layer.rows - begin);
    at::Tensor part = tile.narrow(0, 0, count);
    decompress_rows(layer, begin, begin + count, part);
    const c10::optional<at::Tensor> part_bias =
        bias_w.has_value() ? c10::optional<at::Tensor>(bias_w->narrow(0, begin, count))
                           : c10::nullopt;
    const at::Tensor weights =
        widened.defined() ? widened.narrow(0, 0, count).copy_(part) : part;
    y.narrow(1, begin, count).copy_(at::linear(x_w, weights, part_bias));
  }
}

}  // namespace

// x2 W^T + bias in tile_dtype, W expanded tile by tile. The threads take whole tiles, each
// expanding and multiplying its own (ATen's GEMM runs on one thread inside them), so no
// tile crosses between cores' caches and no tile costs a fork and join (JOURNAL.md). The
// threads run tensor ops, so each takes the caller's thread-local state (inference mode
// above all: y is an inference tensor under vLLM).
// With brgemm_tiles, in bfloat16, the AMX tiles where they run (op_amx.cpp), else oneDNN's
// micro-kernel where it runs (op_brgemm.cpp).
at::Tensor tiled_linear(const at::Tensor& x2, const OpLayer& layer,
                        const c10::optional<at::Tensor>& bias, bool brgemm_tiles) {
  const int64_t rows = layer.rows;
  const auto dtype = tile_dtype(layer.values.scalar_type());
  const at::Tensor x_w = x2.scalar_type() == dtype ? x2 : x2.to(dtype);
  if (brgemm_tiles && dtype == at::kBFloat16) {
    if (amx_runs(layer.in_features)) return amx_linear(x_w, layer, bias);
    if (brgemm_runs(layer.in_features)) return brgemm_linear(x_w, layer, bias);
  }
  const c10::optional<at::Tensor> bias_w =
      bias.has_value() && bias->defined() ? c10::optional<at::Tensor>(bias->to(dtype))
                                          : c10::nullopt;
  at::Tensor y = at::empty({x2.size(0), rows}, x_w.options());
  const int64_t per_thread = (rows + at::get_num_threads() - 1) / at::get_num_threads();
  const int64_t step = std::min(tile_rows(layer.in_features, layer.values.element_size(), rows),
                                std::max<int64_t>(16, (per_thread + 15) / 16 * 16));
  const at::ThreadLocalState caller;
  at::parallel_for(0, (rows + step - 1) / step, 1, [&](int64_t first, int64_t last) {
    const at::ThreadLocalStateGuard state(caller);
    tiles_of_thread(x_w, layer, bias_w, step, first, last, y);
  });
  return y;
}

std::string brgemm_tiles_kernel() { return amx_runs(2) ? "amx" : brgemm_kernel(); }

}  // namespace whisper_sparse
