// The AMX tiles' path (op_amx.cpp): bfloat16 tile products on AMX-BF16 and int8 ones on
// AMX-INT8, written here.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "int8_kernels.h"
#include "op_layer.h"

namespace whisper_sparse {

// Whether amx_linear runs here: the CPU has AMX-TILE and AMX-BF16, the OS saves their state and
// lets this process use it, the kernels are not capped below avx512_bf16, and in_features is
// even (the packed activations hold pairs of inputs).
bool amx_runs(int64_t in_features);

// y = x2 W^T (+ bias) in bfloat16, for x2 [M, in_features] and W bfloat16 (2:4, unstructured or
// grouped): each block of W's rows is expanded once into a row-major buffer, the A tiles, and
// multiplied by x2^T, packed once per call into the B tiles' layout.
at::Tensor amx_linear(const at::Tensor& x2, const OpLayer& layer,
                      const c10::optional<at::Tensor>& bias);

// Whether amx_int8_linear runs here: AMX-TILE and AMX-INT8 as above, the int8 kernels running
// (int8_vnni_runs), and in_features a multiple of 4 (the packed tokens hold quads of inputs).
bool amx_int8_runs(int64_t in_features);

// out = a W8A8 layer's y for the tokens x (contiguous rows) with AMX-INT8 tile products, blocked
// as amx_linear: each block of int8 rows expanded once, every token multiplied through it.
void amx_int8_linear(const Int8Layer& layer, const Int8Tokens& x, const Int8Output& out);

}  // namespace whisper_sparse
