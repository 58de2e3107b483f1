// The torch ops over the kernels of sparse_kernels.h; their dispatch by CPU flags is op_isa.cpp.
//
//   whisper_sparse_cpu::linear(x, compressed, bitmask, bias, in_features, gemm_from,
//                                tiled_from, lanes_until=0, brgemm_until=0)
//       y = x W^T (+ bias) for a 2:4 W as stored, by one of five paths (cpu/op.py's PATHS)
//       chosen by the number of tokens M (the thresholds are a plan's, cpu/plans.py):
//       * M < gemm_from (decode): the row kernels expand the kept values in registers;
//       * gemm_from <= M < tiled_from, for bfloat16 x and W where the kernels are avx512_bf16:
//         below lanes_until the unstructured GEMM, which reads a 2:4 row as an unstructured
//         row of half the inputs' values (the tokens in the lanes), from it the 2:4 GEMM
//         (avx512_bf16_gemm.cpp), which multiplies the kept values only; both run over the
//         threads by op_gemm.cpp; elsewhere the row kernels;
//       * M >= tiled_from: cache-sized tiles of W are expanded into a buffer and multiplied by
//         ATen's dense GEMM (oneDNN; AMX where the CPU has it), each thread its own tiles, in
//         bfloat16 where the kernels are avx512_bf16, else in float32 (tile_dtype); below
//         brgemm_until tokens, bfloat16 blocks expanded once through a micro-kernel: AMX
//         tiles that keep each block's sums over all of K (op_amx.cpp) where AMX-BF16 runs,
//         else oneDNN's (op_brgemm.cpp) where it runs.
//       The dense weight is never held whole.
//   whisper_sparse_cpu::bitmask_linear(x, values, bitmask, row_offsets, bias, in_features,
//                                        gemm_from, tiled_from, brgemm_until=0)
//       the same for an unstructured W (bitmask_format's layout): the row kernels (their
//       pointers advancing by each mask's popcount) below gemm_from, the unstructured GEMM
//       (avx512_bf16_bitmask_gemm.cpp; bfloat16 on avx512_bf16 kernels) from it, the tiles
//       from tiled_from.
//   whisper_sparse_cpu::grouped_linear(x, values, group_masks, group_offsets, bias, in_features,
//                                      out_features, gemm_from, tiled_from, brgemm_until=0)
//       the same for an unstructured W in the grouped layout (cpu/grouped_layout.py, bfloat16):
//       its one-stream row kernel (avx512_bf16_grouped.cpp) below gemm_from, the unstructured
//       GEMM from it, the tiles from tiled_from; for float32 x, or below the avx512_bf16
//       kernels, the tiles at every token count.
//   whisper_sparse_cpu::decompress(compressed, bitmask, in_features),
//   grouped_decompress(values, group_masks, group_offsets, in_features, out_features), and
//   bitmask_decompress(values, bitmask, row_offsets, in_features): the dense W (tests).
//   whisper_sparse_cpu::isa() / set_isa(name): the kernels this CPU runs ("avx512_bf16",
//       "avx512", "avx2" or "none"), and a cap below them ("auto" undoes it).
//   whisper_sparse_cpu::int8_linear(x_q, x_scale, values, bitmask, row_offsets, w_scale, bias,
//                                   in_features, out_dtype, tiles_from, rounding)
//       a W8A8 layer as stored, 2:4 or unstructured (int8_op.h): the VNNI row kernels below
//       tiles_from tokens, AMX-INT8 tiles from it where they run; int8_quantize(x, rounding)
//       its activations; int8_decompress its dense weight (tests); int8_kernels() which of
//       them run here.
//   whisper_sparse_cpu::brgemm_kernel(): where the brgemm tiles run ("amx": AMX tiles,
//       "avx512": oneDNN's AVX512_BF16 micro-kernel, "none": ATen's tiles; op_tiles.cpp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "op_brgemm.h"
#include "int8_op.h"
#include "op_gemm.h"
#include "op_isa.h"
#include "op_layer.h"
#include "op_tiles.h"
#include "sparse_kernels.h"

namespace whisper_sparse {
namespace {

void check_layer(const at::Tensor& compressed, const at::Tensor& bitmask, int64_t in_features) {
  TORCH_CHECK(active_isa() != kNone, "no 2:4 CPU kernel runs on this CPU");
  TORCH_CHECK(in_features > 0 && in_features % 4 == 0, "in_features must be a positive multiple"
              " of 4, got ", in_features);
  TORCH_CHECK(compressed.device().is_cpu() && bitmask.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(compressed.dim() == 2 && compressed.size(1) == in_features / 2 &&
                  compressed.is_contiguous(),
              "compressed must be a contiguous [out, in / 2] tensor");
  TORCH_CHECK(bitmask.scalar_type() == at::kByte && bitmask.dim() == 2 &&
                  bitmask.size(0) == compressed.size(0) &&
                  bitmask.size(1) == (in_features + 7) / 8 && bitmask.is_contiguous(),
              "bitmask must be a contiguous [out, ceil(in / 8)] uint8 tensor");
  weight_type(compressed);
}

void check_bitmask_layer(const at::Tensor& values, const at::Tensor& bitmask,
                         const at::Tensor& row_offsets, int64_t in_features) {
  TORCH_CHECK(active_isa() != kNone, "no sparse CPU kernel runs on this CPU");
  TORCH_CHECK(in_features > 0, "in_features must be positive, got ", in_features);
  TORCH_CHECK(values.device().is_cpu() && bitmask.device().is_cpu() &&
                  row_offsets.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(values.dim() == 1 && values.is_contiguous(), "values must be a contiguous 1-D "
              "tensor");
  TORCH_CHECK(bitmask.scalar_type() == at::kByte && bitmask.dim() == 2 &&
                  bitmask.size(1) == (in_features + 7) / 8 && bitmask.is_contiguous(),
              "bitmask must be a contiguous [out, ceil(in / 8)] uint8 tensor");
  TORCH_CHECK(row_offsets.scalar_type() == at::kLong && row_offsets.dim() == 1 &&
                  row_offsets.size(0) == bitmask.size(0) && row_offsets.is_contiguous(),
              "row_offsets must be a contiguous [out] int64 tensor");
  weight_type(values);
}

void check_grouped_layer(const at::Tensor& values, const at::Tensor& group_masks,
                         const at::Tensor& group_offsets, int64_t in_features,
                         int64_t out_features) {
  TORCH_CHECK(active_isa() != kNone, "no sparse CPU kernel runs on this CPU");
  TORCH_CHECK(in_features > 0 && out_features > 0, "in_features and out_features must be "
              "positive, got ", in_features, " and ", out_features);
  TORCH_CHECK(values.device().is_cpu() && group_masks.device().is_cpu() &&
                  group_offsets.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(values.scalar_type() == at::kBFloat16 && values.dim() == 1 &&
                  values.is_contiguous(), "values must be a contiguous 1-D bfloat16 tensor");
  const int64_t groups = (out_features + kGroupRows - 1) / kGroupRows;
  TORCH_CHECK(group_masks.scalar_type() == at::kInt && group_masks.dim() == 3 &&
                  group_masks.size(0) == groups && group_masks.size(1) == group_steps(in_features) &&
                  group_masks.size(2) == kGroupRows && group_masks.is_contiguous(),
              "group_masks must be a contiguous [", groups, ", ", group_steps(in_features), ", ",
              kGroupRows, "] int32 tensor");
  TORCH_CHECK(group_offsets.scalar_type() == at::kLong && group_offsets.dim() == 1 &&
                  group_offsets.size(0) == groups + 1 && group_offsets.is_contiguous(),
              "group_offsets must be a contiguous [", groups + 1, "] int64 tensor");
  TORCH_CHECK(values.numel() >= group_offsets.data_ptr<int64_t>()[groups] + 32,
              "values must hold 32 values past the last group's");
}

OpLayer two_four_layer(const at::Tensor& compressed, const at::Tensor& bitmask,
                       int64_t in_features) {
  check_layer(compressed, bitmask, in_features);
  return OpLayer{compressed, bitmask.data_ptr<uint8_t>(), nullptr, {}, bitmask.size(0),
                 in_features};
}

OpLayer unstructured_layer(const at::Tensor& values, const at::Tensor& bitmask,
                           const at::Tensor& row_offsets, int64_t in_features) {
  check_bitmask_layer(values, bitmask, row_offsets, in_features);
  return OpLayer{values, bitmask.data_ptr<uint8_t>(), row_offsets.data_ptr<int64_t>(), {},
                 bitmask.size(0), in_features};
}

OpLayer grouped_layer(const at::Tensor& values, const at::Tensor& group_masks,
                      const at::Tensor& group_offsets, int64_t in_features,
                      int64_t out_features) {
  check_grouped_layer(values, group_masks, group_offsets, in_features, out_features);
  GroupedLayer grouped{group_offsets.data_ptr<int64_t>(),
                       reinterpret_cast<const uint32_t*>(group_masks.data_ptr<int32_t>()),
                       out_features};
  return OpLayer{values, nullptr, nullptr, grouped, out_features, in_features};
}

at::Tensor dense_rows(const OpLayer& layer) {
  at::Tensor out = at::empty({layer.rows, layer.in_features}, layer.values.options());
  decompress_rows(layer, 0, layer.rows, out);
  return out;
}

at::Tensor decompress(const at::Tensor& compressed, const at::Tensor& bitmask,
                      int64_t in_features) {
  return dense_rows(two_four_layer(compressed, bitmask, in_features));
}

at::Tensor bitmask_decompress(const at::Tensor& values, const at::Tensor& bitmask,
                              const at::Tensor& row_offsets, int64_t in_features) {
  return dense_rows(unstructured_layer(values, bitmask, row_offsets, in_features));
}

at::Tensor grouped_decompress(const at::Tensor& values, const at::Tensor& group_masks,
                              const at::Tensor& group_offsets, int64_t in_features,
                              int64_t out_features) {
  return dense_rows(grouped_layer(values, group_masks, group_offsets, in_features, out_features));
}

// The row kernels over x2 [M, K]: float32 sums plus the bias (float32), stored once in x's
// dtype (bfloat16 rounded by the kernels as they store, so no float32 copy of y is made). A
// grouped layer's run on the avx512_bf16 kernels, for bfloat16 x (row_kernels_run), the
// threads taking whole groups.
at::Tensor row_kernel_linear(const at::Tensor& x2, const OpLayer& layer,
                             const c10::optional<at::Tensor>& bias) {
  const int64_t rows = layer.rows;
  const int level = active_isa();
  const WeightType type = weight_type(layer.values);
  const bool bf16_x = x2.scalar_type() == at::kBFloat16;
  const bool bf16_dot = level == kAvx512Bf16 && type == WeightType::bf16 && bf16_x;
  const at::Tensor x = bf16_dot ? x2 : x2.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), rows}, x2.options());
  const at::Tensor bias32 = bias.has_value() && bias->defined()
                                ? bias->to(at::kFloat).contiguous()
                                : at::Tensor();
  RowsArgs args{x.data_ptr(), layer.in_features, layer.values.data_ptr(), type, layer.bitmask,
                bf16_x ? nullptr : y.data_ptr<float>(), rows, x.size(0), layer.in_features, 0,
                0, bias32.defined() ? bias32.data_ptr<float>() : nullptr,
                bf16_x ? static_cast<uint16_t*>(y.data_ptr()) : nullptr, layer.offsets,
                layer.values.numel()};
  args.grouped = layer.grouped;
  const auto kernel = layer.grouped.defined()  ? rows_grouped_avx512_bf16
                      : bf16_dot               ? rows_avx512_bf16
                      : level >= kAvx512       ? rows_avx512
                      : layer.offsets != nullptr ? rows_bitmask_avx2
                                                 : rows_avx2;
  const int64_t unit = layer.grouped.defined() ? kGroupRows : 1;  // rows a thread takes whole
  at::parallel_for(0, (rows + unit - 1) / unit, 16 / unit, [&](int64_t first, int64_t last) {
    RowsArgs part = args;
    part.n_begin = first * unit;
    part.n_end = std::min(rows, last * unit);
    kernel(part);
  });
  return y;
}

// Whether the GEMMs (2:4 and unstructured) run x of this dtype with these weights here.
bool gemm_runs(const at::Tensor& x2, const at::Tensor& compressed) {
  return active_isa() == kAvx512Bf16 && x2.scalar_type() == at::kBFloat16 &&
         compressed.scalar_type() == at::kBFloat16;
}

// Whether the row kernels run x2 with this layer here: a grouped layer's only on the
// avx512_bf16 kernels, for bfloat16 x (elsewhere it takes the tiles, at every token count).
bool row_kernels_run(const at::Tensor& x2, const OpLayer& layer) {
  return !layer.grouped.defined() || gemm_runs(x2, layer.values);
}

// x as [M, in_features], after checking it.
at::Tensor rows_of(const at::Tensor& x, int64_t in_features) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == in_features,
              "x must be a CPU tensor [..., ", in_features, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16, got ", x.scalar_type());
  return x.reshape({-1, in_features}).contiguous();
}

// y [M, rows] in x's dtype, shaped as x with its last size rows.
at::Tensor shaped_as(const at::Tensor& y, const at::Tensor& x, int64_t rows) {
  auto shape = x.sizes().vec();
  shape.back() = rows;
  return y.to(x.scalar_type()).reshape(shape);
}

// y = x W^T (+ bias) on the path of x's number of tokens: the tiles from tiled_from (oneDNN's
// micro-kernel's below brgemm_until), the GEMM from gemm_from (where it runs; a 2:4 layer's in
// the unstructured GEMM below lanes_until), the row kernels below (where they run).
at::Tensor path_linear(const at::Tensor& x, const OpLayer& layer,
                       const c10::optional<at::Tensor>& bias, int64_t gemm_from,
                       int64_t tiled_from, int64_t lanes_until, int64_t brgemm_until) {
  const at::Tensor x2 = rows_of(x, layer.in_features);
  const int64_t tokens = x2.size(0);
  at::Tensor y;
  if (tokens >= tiled_from || !row_kernels_run(x2, layer)) {
    y = tiled_linear(x2, layer, bias, tokens < brgemm_until);
  } else if (tokens >= gemm_from && gemm_runs(x2, layer.values)) {
    y = gemm_linear(x2, layer, bias, tokens < lanes_until);
  } else {
    y = row_kernel_linear(x2, layer, bias);
  }
  return shaped_as(y, x, layer.rows);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& compressed, const at::Tensor& bitmask,
                  const c10::optional<at::Tensor>& bias, int64_t in_features, int64_t gemm_from,
                  int64_t tiled_from, int64_t lanes_until, int64_t brgemm_until) {
  return path_linear(x, two_four_layer(compressed, bitmask, in_features), bias, gemm_from,
                     tiled_from, lanes_until, brgemm_until);
}

// An unstructured layer (bitmask_format): the row kernels below gemm_from tokens, the
// unstructured GEMM from it (where it runs), the tiles from tiled_from.
at::Tensor bitmask_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& bitmask,
                          const at::Tensor& row_offsets, const c10::optional<at::Tensor>& bias,
                          int64_t in_features, int64_t gemm_from, int64_t tiled_from,
                          int64_t brgemm_until) {
  return path_linear(x, unstructured_layer(values, bitmask, row_offsets, in_features), bias,
                     gemm_from, tiled_from, 0, brgemm_until);
}

// A grouped unstructured layer (cpu/grouped_layout.py): as bitmask_linear, on the avx512_bf16
// kernels for bfloat16 x; elsewhere the tiles.
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& values,
                          const at::Tensor& group_masks, const at::Tensor& group_offsets,
                          const c10::optional<at::Tensor>& bias, int64_t in_features,
                          int64_t out_features, int64_t gemm_from, int64_t tiled_from,
                          int64_t brgemm_until) {
  return path_linear(
      x, grouped_layer(values, group_masks, group_offsets, in_features, out_features), bias,
      gemm_from, tiled_from, 0, brgemm_until);
}

}  // namespace
}  // namespace whisper_sparse

TORCH_LIBRARY(whisper_sparse_cpu, m) {
  m.def("linear(Tensor x, Tensor compressed, Tensor bitmask, Tensor? bias, int in_features, "
        "int gemm_from, int tiled_from, int lanes_until=0, int brgemm_until=0) -> Tensor");
  m.def("decompress(Tensor compressed, Tensor bitmask, int in_features) -> Tensor");
  m.def("bitmask_linear(Tensor x, Tensor values, Tensor bitmask, Tensor row_offsets, Tensor? bias, "
        "int in_features, int gemm_from, int tiled_from, int brgemm_until=0) -> Tensor");
  m.def("bitmask_decompress(Tensor values, Tensor bitmask, Tensor row_offsets, int in_features) "
        "-> Tensor");
  m.def("grouped_linear(Tensor x, Tensor values, Tensor group_masks, Tensor group_offsets, "
        "Tensor? bias, int in_features, int out_features, int gemm_from, int tiled_from, "
        "int brgemm_until=0) -> Tensor");
  m.def("grouped_decompress(Tensor values, Tensor group_masks, Tensor group_offsets, "
        "int in_features, int out_features) -> Tensor");
  m.def("isa", &whisper_sparse::isa);
  m.def("set_isa", &whisper_sparse::set_isa);
  m.def("brgemm_kernel", &whisper_sparse::brgemm_tiles_kernel);
  m.def("int8_linear(Tensor x_q, Tensor x_scale, Tensor values, Tensor bitmask, "
        "Tensor? row_offsets, Tensor w_scale, Tensor? bias, int in_features, "
        "ScalarType out_dtype, int tiles_from, str rounding) -> Tensor");
  m.def("int8_quantize(Tensor x, str rounding) -> (Tensor, Tensor)");
  m.def("int8_decompress(Tensor values, Tensor bitmask, Tensor? row_offsets, int in_features) "
        "-> Tensor");
  m.def("int8_kernels", &whisper_sparse::int8_kernels);
}

TORCH_LIBRARY_IMPL(whisper_sparse_cpu, CPU, m) {
  m.impl("linear", &whisper_sparse::linear);
  m.impl("decompress", &whisper_sparse::decompress);
  m.impl("bitmask_linear", &whisper_sparse::bitmask_linear);
  m.impl("bitmask_decompress", &whisper_sparse::bitmask_decompress);
  m.impl("grouped_linear", &whisper_sparse::grouped_linear);
  m.impl("grouped_decompress", &whisper_sparse::grouped_decompress);
  m.impl("int8_linear", &whisper_sparse::int8_linear);
  m.impl("int8_decompress", &whisper_sparse::int8_decompress);
  m.impl("int8_quantize", &whisper_sparse::int8_quantize);
}
