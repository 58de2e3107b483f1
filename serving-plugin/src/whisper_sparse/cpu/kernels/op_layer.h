// A layer as the op's paths take it (op.cpp, op_gemm.cpp, op_tiles.cpp, op_brgemm.cpp), and the
// weight type of its stored values.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "sparse_kernels.h"

namespace whisper_sparse {

// The kernels' WeightType of a layer's stored values (float32 or bfloat16; else an error).
WeightType weight_type(const at::Tensor& compressed);

// A layer as the op's paths take it (op.cpp makes it from the torch op's tensors): a 2:4
// layer's values and bitmask; an unstructured one's values, bitmask and row offsets; or a
// grouped one's values and GroupedLayer (bfloat16).
struct OpLayer {
  at::Tensor values;
  const uint8_t* bitmask = nullptr;
  const int64_t* offsets = nullptr;
  GroupedLayer grouped;
  int64_t rows = 0;
  int64_t in_features = 0;
  // The kernels' arguments for rows [begin, end) expanded into out (row stride out_stride
  // elements, 0: in_features).
  DecompressArgs decompress_args(void* out, int64_t begin, int64_t end,
                                 int64_t out_stride = 0) const;
};

}  // namespace whisper_sparse
