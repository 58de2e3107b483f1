// The tiles' micro-kernel path (op_brgemm.cpp): oneDNN's brgemm through ATen's cpublas, which
// op.cpp's tiles take in bfloat16 wherever it runs.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include "op_layer.h"

namespace whisper_sparse {

// Whether brgemm_linear runs here: torch has cpublas::brgemm with oneDNN's micro-kernel for
// bfloat16 (AMX tiles where the CPU has them, AVX512_BF16's dot product elsewhere) and
// in_features is even (the packed activations hold pairs of inputs).
bool brgemm_runs(int64_t in_features);

// Where brgemm_linear runs and how: "amx" (oneDNN packs bfloat16 for AMX tiles here), "avx512"
// (its AVX512_BF16 micro-kernel) or "none".
std::string brgemm_kernel();

// y = x2 W^T (+ bias) in bfloat16, for x2 [M, in_features] and W bfloat16 (2:4, or unstructured
// with row offsets): each block of W's rows is expanded once into a row-major buffer, oneDNN's
// A operand, and multiplied by x2^T, packed once per call as its B operand, 64 tokens at a time.
at::Tensor brgemm_linear(const at::Tensor& x2, const OpLayer& layer,
                         const c10::optional<at::Tensor>& bias);

}  // namespace whisper_sparse
