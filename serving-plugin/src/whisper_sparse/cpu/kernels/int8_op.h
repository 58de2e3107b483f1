// The W8A8 op (int8_op.cpp), registered by op.cpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <tuple>

namespace whisper_sparse {

// y = bfloat16 or float32 (out_dtype) of x_scale * w_scale * (x_q . w_q^T) (+ bias) for a W8A8
// layer as stored (int8_kernels.h): a 2:4 one (values [N, K / 2], row_offsets undefined) or an
// unstructured one (values 1-D, row_offsets [N]). From tiles_from tokens on, AMX-INT8 tiles where
// they run; below, the row kernels (AVX-512 VNNI, else AVX-VNNI or AVX2). The scales are applied in the order
// of the vLLM dense W8A8 kernel `rounding` names: "onednn" (its oneDNN layer) or "sgl" (its AMX
// kernel).
at::Tensor int8_linear(const at::Tensor& x_q, const at::Tensor& x_scale, const at::Tensor& values,
                       const at::Tensor& bitmask, const c10::optional<at::Tensor>& row_offsets,
                       const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
                       int64_t in_features, at::ScalarType out_dtype, int64_t tiles_from,
                       const std::string& rounding);

// (x_q int8 [M, K], scale float32 [M, 1]): x [..., K] (bfloat16 or float32) quantized per token,
// symmetrically, bit for bit as the vLLM dense W8A8 kernel `rounding` names quantizes it.
std::tuple<at::Tensor, at::Tensor> int8_quantize(const at::Tensor& x, const std::string& rounding);

// The dense int8 weight [N, in_features] of such a layer (tests).
at::Tensor int8_decompress(const at::Tensor& values, const at::Tensor& bitmask,
                           const c10::optional<at::Tensor>& row_offsets, int64_t in_features);

// The W8A8 kernels that run here: "amx_int8" (the tiles and the VNNI rows), "avx512_vnni",
// "avx_vnni" (256-bit VNNI rows), "avx2" (exact int16 rows) or "none" (below AVX2, or under a
// cap below it: such layers are served dense).
std::string int8_kernels();

}  // namespace whisper_sparse
