// The op's prefill tiles (op_tiles.cpp), which op.cpp's torch ops take from tiled_from tokens,
// and the expansion of a layer's rows, which the tiles and op.cpp's decompress ops share.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include "op_layer.h"

namespace whisper_sparse {

// Rows [begin, end) of W expanded into out [end - begin, in_features] (W's dtype), over the
// threads.
void decompress_rows(const OpLayer& layer, int64_t begin, int64_t end, at::Tensor& out);

// y = x2 W^T (+ bias) for x2 [M, in_features]: tiles of W's rows expanded and multiplied by
// ATen's dense GEMM, in bfloat16 where the kernels are avx512_bf16 and W is bfloat16, else in
// float32; with brgemm_tiles, in bfloat16, a micro-kernel over blocks of W expanded once: the
// AMX tiles where they run (op_amx.cpp), else oneDNN's where it runs (op_brgemm.cpp).
at::Tensor tiled_linear(const at::Tensor& x2, const OpLayer& layer,
                        const c10::optional<at::Tensor>& bias, bool brgemm_tiles);

// Where brgemm_tiles run: "amx" (AMX tiles: op_amx.cpp's, or oneDNN's where those do not
// run), "avx512" (oneDNN's AVX512_BF16 micro-kernel) or "none" (ATen's GEMM tiles).
std::string brgemm_tiles_kernel();

}  // namespace whisper_sparse
