// The torch ops over the kernels of sparse_kernels.h; their dispatch by CPU flags is op_isa.cpp.
//
//   whisper_sparse_cpu::linear(x, compressed, bitmask, bias, in_features, gemm_from,
//                                tiled_from, lanes_until=0, brgemm_until=0)
//       y = x W^T (+ bias) for a 2:4 W as stored, by one of three paths chosen by the number of
//       tokens M (the thresholds come from cpu_plans' measurements):
//       * M < gemm_from (decode): the row kernels expand the kept values in registers;
//       * gemm_from <= M < tiled_from, for bfloat16 x and W where the kernels are avx512_bf16:
//         below lanes_until the unstructured GEMM, which reads a 2:4 row as an unstructured
//         row of half the inputs' values (the tokens in the lanes), from it the 2:4 GEMM
//         (avx512_bf16_gemm.cpp), which multiplies the kept values only; both run over the
//         threads by op_gemm.cpp; elsewhere the row kernels;
//       * M >= tiled_from: cache-sized tiles of W are expanded into a buffer and multiplied by
//         ATen's dense GEMM (oneDNN; AMX where the CPU has it), each thread its own tiles, in
//         bfloat16 where the kernels are avx512_bf16, else in float32 (tile_dtype); below
//         brgemm_until tokens, bfloat16 blocks through oneDNN's micro-kernel (op_brgemm.cpp)
//         where it runs.
//       The dense weight is never held whole.
//   whisper_sparse_cpu::bitmask_linear(x, values, bitmask, row_offsets, bias, in_features,
//                                        gemm_from, tiled_from, brgemm_until=0)
//       the same for an unstructured W (bitmask_format's layout): the row kernels (their
//       pointers advancing by each mask's popcount) below gemm_from, the unstructured GEMM
//       (avx512_bf16_bitmask_gemm.cpp; bfloat16 on avx512_bf16 kernels) from it, the tiles
//       from tiled_from.
//   whisper_sparse_cpu::decompress(compressed, bitmask, in_features), and
//   bitmask_decompress(values, bitmask, row_offsets, in_features): the dense W (tests).
//   whisper_sparse_cpu::isa() / set_isa(name): the kernels this CPU runs ("avx512_bf16",
//       "avx512", "avx2" or "none"), and a cap below them ("auto" undoes it).
//   whisper_sparse_cpu::brgemm_kernel(): where the brgemm tiles run oneDNN's micro-kernel
//       ("amx", "avx512" or "none"; op_brgemm.cpp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "op_brgemm.h"
#include "op_gemm.h"
#include "op_isa.h"
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

at::Tensor decompress(const at::Tensor& compressed, const at::Tensor& bitmask,
                      int64_t in_features) {
  check_layer(compressed, bitmask, in_features);
  at::Tensor out = at::empty({compressed.size(0), in_features}, compressed.options());
  decompress_rows(compressed, bitmask, nullptr, in_features, 0, compressed.size(0), out);
  return out;
}

at::Tensor bitmask_decompress(const at::Tensor& values, const at::Tensor& bitmask,
                              const at::Tensor& row_offsets, int64_t in_features) {
  check_bitmask_layer(values, bitmask, row_offsets, in_features);
  at::Tensor out = at::empty({bitmask.size(0), in_features}, values.options());
  decompress_rows(values, bitmask, row_offsets.data_ptr<int64_t>(), in_features, 0,
                  bitmask.size(0), out);
  return out;
}

// The row kernels over x2 [M, K]: float32 sums plus the bias (float32), stored once in x's
// dtype (bfloat16 rounded by the kernels as they store, so no float32 copy of y is made).
at::Tensor row_kernel_linear(const at::Tensor& x2, const at::Tensor& compressed,
                             const at::Tensor& bitmask, const int64_t* offsets,
                             const c10::optional<at::Tensor>& bias, int64_t in_features) {
  const int64_t rows = bitmask.size(0);
  const int level = active_isa();
  const WeightType type = weight_type(compressed);
  const bool bf16_x = x2.scalar_type() == at::kBFloat16;
  const bool bf16_dot = level == kAvx512Bf16 && type == WeightType::bf16 && bf16_x;
  const at::Tensor x = bf16_dot ? x2 : x2.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), rows}, x2.options());
  const at::Tensor bias32 = bias.has_value() && bias->defined()
                                ? bias->to(at::kFloat).contiguous()
                                : at::Tensor();
  RowsArgs args{x.data_ptr(), in_features, compressed.data_ptr(), type,
                bitmask.data_ptr<uint8_t>(), bf16_x ? nullptr : y.data_ptr<float>(),
                rows, x.size(0), in_features, 0, 0,
                bias32.defined() ? bias32.data_ptr<float>() : nullptr,
                bf16_x ? static_cast<uint16_t*>(y.data_ptr()) : nullptr, offsets,
                compressed.numel()};
  const auto kernel = bf16_dot             ? rows_avx512_bf16
                      : level >= kAvx512   ? rows_avx512
                      : offsets != nullptr ? rows_bitmask_avx2
                                           : rows_avx2;
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    RowsArgs part = args;
    part.n_begin = first;
    part.n_end = last;
    kernel(part);
  });
  return y;
}

// Whether the GEMMs (2:4 and unstructured) run x of this dtype with these weights here.
bool gemm_runs(const at::Tensor& x2, const at::Tensor& compressed) {
  return active_isa() == kAvx512Bf16 && x2.scalar_type() == at::kBFloat16 &&
         compressed.scalar_type() == at::kBFloat16;
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
// the unstructured GEMM below lanes_until), the row kernels below; offsets: an unstructured
// layer's.
at::Tensor path_linear(const at::Tensor& x, const at::Tensor& compressed, const at::Tensor& bitmask,
                       const int64_t* offsets, const c10::optional<at::Tensor>& bias,
                       int64_t in_features, int64_t gemm_from, int64_t tiled_from,
                       int64_t lanes_until, int64_t brgemm_until) {
  const at::Tensor x2 = rows_of(x, in_features);
  at::Tensor y;
  if (x2.size(0) >= tiled_from) {
    y = tiled_linear(x2, compressed, bitmask, offsets, bias, in_features,
                     x2.size(0) < brgemm_until);
  } else if (x2.size(0) >= gemm_from && gemm_runs(x2, compressed)) {
    y = gemm_linear(x2, compressed, bitmask, offsets, bias, in_features,
                    x2.size(0) < lanes_until);
  } else {
    y = row_kernel_linear(x2, compressed, bitmask, offsets, bias, in_features);
  }
  return shaped_as(y, x, bitmask.size(0));
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& compressed, const at::Tensor& bitmask,
                  const c10::optional<at::Tensor>& bias, int64_t in_features, int64_t gemm_from,
                  int64_t tiled_from, int64_t lanes_until, int64_t brgemm_until) {
  check_layer(compressed, bitmask, in_features);
  return path_linear(x, compressed, bitmask, nullptr, bias, in_features, gemm_from, tiled_from,
                     lanes_until, brgemm_until);
}

// An unstructured layer (bitmask_format): the row kernels below gemm_from tokens, the
// unstructured GEMM from it (where it runs), the tiles from tiled_from.
at::Tensor bitmask_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& bitmask,
                          const at::Tensor& row_offsets, const c10::optional<at::Tensor>& bias,
                          int64_t in_features, int64_t gemm_from, int64_t tiled_from,
                          int64_t brgemm_until) {
  check_bitmask_layer(values, bitmask, row_offsets, in_features);
  return path_linear(x, values, bitmask, row_offsets.data_ptr<int64_t>(), bias, in_features,
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
  m.def("isa", &whisper_sparse::isa);
  m.def("set_isa", &whisper_sparse::set_isa);
  m.def("brgemm_kernel", &whisper_sparse::brgemm_kernel);
}

TORCH_LIBRARY_IMPL(whisper_sparse_cpu, CPU, m) {
  m.impl("linear", &whisper_sparse::linear);
  m.impl("decompress", &whisper_sparse::decompress);
  m.impl("bitmask_linear", &whisper_sparse::bitmask_linear);
  m.impl("bitmask_decompress", &whisper_sparse::bitmask_decompress);
}
