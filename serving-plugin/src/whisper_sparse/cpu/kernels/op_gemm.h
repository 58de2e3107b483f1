// The op's GEMM path (op_gemm.cpp), which op.cpp's torch ops take from gemm_from tokens on
// where gemm_runs (bfloat16 on avx512_bf16 kernels).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "op_layer.h"

namespace whisper_sparse {

// y = x2 W^T (+ bias) in bfloat16 for x2 [M, in_features] bfloat16 and a bfloat16 W: an
// unstructured layer's (row offsets, or grouped) by the unstructured GEMM; a 2:4 layer's by the
// 2:4 GEMM, or where `lanes` the unstructured one over the 2:4 rows (in_features / 2 values
// each).
at::Tensor gemm_linear(const at::Tensor& x2, const OpLayer& layer,
                       const c10::optional<at::Tensor>& bias, bool lanes = false);

}  // namespace whisper_sparse
