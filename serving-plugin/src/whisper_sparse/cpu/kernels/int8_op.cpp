// The W8A8 op over int8 layers as stored (int8_op.h): its checks, and the path by token count.
#include "int8_op.h"

#include <ATen/Parallel.h>

#include <algorithm>

#include "int8_kernels.h"
#include "op_amx.h"
#include "op_isa.h"

namespace whisper_sparse {
namespace {

// The layer's pointers, after checking its tensors.
Int8Layer int8_layer(const at::Tensor& values, const at::Tensor& bitmask,
                     const c10::optional<at::Tensor>& row_offsets, int64_t in_features) {
  TORCH_CHECK(in_features > 0, "in_features must be positive, got ", in_features);
  TORCH_CHECK(values.device().is_cpu() && bitmask.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(values.scalar_type() == at::kChar && values.is_contiguous(),
              "values must be a contiguous int8 tensor, got ", values.scalar_type());
  TORCH_CHECK(bitmask.scalar_type() == at::kByte && bitmask.dim() == 2 &&
                  bitmask.size(1) == (in_features + 7) / 8 && bitmask.is_contiguous(),
              "bitmask must be a contiguous [out, ceil(in / 8)] uint8 tensor");
  Int8Layer layer;
  layer.values = values.data_ptr<int8_t>();
  layer.bitmask = bitmask.data_ptr<uint8_t>();
  layer.values_count = values.numel();
  layer.rows = bitmask.size(0);
  layer.K = in_features;
  const bool unstructured = row_offsets.has_value() && row_offsets->defined();
  if (unstructured) {
    TORCH_CHECK(values.dim() == 1, "an unstructured layer's values must be 1-D");
    TORCH_CHECK(row_offsets->scalar_type() == at::kLong && row_offsets->dim() == 1 &&
                    row_offsets->size(0) == layer.rows && row_offsets->is_contiguous(),
                "row_offsets must be a contiguous [out] int64 tensor");
    layer.row_offsets = row_offsets->data_ptr<int64_t>();
  } else {
    TORCH_CHECK(in_features % 4 == 0, "a 2:4 layer's in_features must be a multiple of 4, got ",
                in_features);
    TORCH_CHECK(values.dim() == 2 && values.size(0) == layer.rows &&
                    values.size(1) == in_features / 2,
                "a 2:4 layer's values must be [out, in / 2]");
  }
  return layer;
}

// Whether `rounding` names vLLM's AMX W8A8 kernel ("sgl") rather than its oneDNN layer ("onednn").
bool sgl_rounding(const std::string& rounding) {
  TORCH_CHECK(rounding == "onednn" || rounding == "sgl",
              "rounding must be 'onednn' or 'sgl' (the vLLM dense W8A8 kernel to equal), got '",
              rounding, "'");
  return rounding == "sgl";
}

// The W8A8 row kernels that run here: AVX-512 VNNI's, else AVX-VNNI's or AVX2's, else none.
enum class Int8Rows { kNone, kAvx2, kAvxVnni, kVnni };

Int8Rows int8_rows_here() {
  if (int8_vnni_runs()) return Int8Rows::kVnni;
  if (active_isa() < kAvx2) return Int8Rows::kNone;
  static const bool avx_vnni = (__builtin_cpu_init(), __builtin_cpu_supports("avxvnni"));
  return avx_vnni ? Int8Rows::kAvxVnni : Int8Rows::kAvx2;
}

// The 256-bit tiles over every row, the tokens widened to int16 once for all of them.
void run_tiles_256(const Int8Layer& layer, const Int8Tokens& x, const at::Tensor& x2,
                   const Int8Output& out) {
  const int64_t ld_x = wide_token_stride(layer.K);
  at::Tensor wide = at::zeros({x.M, ld_x}, x2.options().dtype(at::kShort));
  wide.narrow(1, 0, layer.K).copy_(x2);
  const int16_t* tokens = wide.data_ptr<int16_t>();
  const bool vnni = int8_rows_here() == Int8Rows::kAvxVnni;
  at::parallel_for(0, layer.rows, 48, [&](int64_t first, int64_t last) {  // the tiles' blocks
    vnni ? int8_tiles_avx_vnni(layer, x, tokens, ld_x, out, first, last)
         : int8_tiles_avx2(layer, x, tokens, ld_x, out, first, last);
  });
}

// The VNNI tiles over every row, the tokens copied once into the zero-padded rows they read.
void run_tiles_vnni(const Int8Layer& layer, const Int8Tokens& x, const at::Tensor& x2,
                    const Int8Output& out) {
  at::Tensor padded = at::zeros({vnni_tile_rows(x.M), vnni_token_stride(layer.K)}, x2.options());
  padded.narrow(0, 0, x.M).narrow(1, 0, layer.K).copy_(x2);
  Int8Tokens tokens = x;
  tokens.x_q = padded.data_ptr<int8_t>();
  tokens.ldx = padded.size(1);
  at::parallel_for(0, layer.rows, 64, [&](int64_t first, int64_t last) {  // the tiles' blocks
    int8_tiles_avx512_vnni(layer, tokens, out, first, last);
  });
}

void check_int8_rows_run() {
  TORCH_CHECK(int8_rows_here() != Int8Rows::kNone,
              "no W8A8 CPU kernel runs on this CPU (it needs AVX2), or the kernels are capped "
              "below avx2");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> int8_quantize(const at::Tensor& x, const std::string& rounding) {
  const bool sgl = sgl_rounding(rounding);
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be a bfloat16 or float32 CPU tensor [..., K], got ", x.scalar_type());
  const int64_t K = x.size(-1);
  const at::Tensor rows = x.reshape({-1, K}).contiguous();
  const int64_t tokens = rows.size(0);
  at::Tensor x_q = at::empty({tokens, K}, rows.options().dtype(at::kChar));
  at::Tensor scale = at::empty({tokens, 1}, rows.options().dtype(at::kFloat));
  Int8Quantize q;
  if (rows.scalar_type() == at::kBFloat16) {
    q.x_bf16 = static_cast<const uint16_t*>(rows.data_ptr());
  } else {
    q.x = rows.data_ptr<float>();
  }
  q.ldx = K;
  q.K = K;
  q.sgl = sgl;
  q.x_q = x_q.data_ptr<int8_t>();
  q.scale = scale.data_ptr<float>();
  const Int8Rows kernels = int8_rows_here();
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(K, 1));
  at::parallel_for(0, tokens, grain, [&](int64_t first, int64_t last) {  // one thread below 64 Ki
    if (kernels == Int8Rows::kVnni) {
      int8_quantize_avx512(q, first, last);
    } else if (kernels != Int8Rows::kNone) {
      int8_quantize_avx2(q, first, last);
    } else {
      quantize_int8_tokens(q, first, last);
    }
  });
  return {x_q, scale};
}

std::string int8_kernels() {
  switch (int8_rows_here()) {
    case Int8Rows::kVnni: return amx_int8_runs(4) ? "amx_int8" : "avx512_vnni";
    case Int8Rows::kAvxVnni: return "avx_vnni";
    case Int8Rows::kAvx2: return "avx2";
    default: return "none";
  }
}

at::Tensor int8_linear(const at::Tensor& x_q, const at::Tensor& x_scale, const at::Tensor& values,
                       const at::Tensor& bitmask, const c10::optional<at::Tensor>& row_offsets,
                       const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
                       int64_t in_features, at::ScalarType out_dtype, int64_t tiles_from,
                       const std::string& rounding) {
  const bool sgl = sgl_rounding(rounding);
  check_int8_rows_run();
  Int8Layer layer = int8_layer(values, bitmask, row_offsets, in_features);
  TORCH_CHECK(x_q.device().is_cpu() && x_q.scalar_type() == at::kChar && x_q.dim() >= 1 &&
                  x_q.size(-1) == in_features,
              "x_q must be an int8 CPU tensor [..., ", in_features, "]");
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kFloat,
              "out_dtype must be bfloat16 or float32, got ", out_dtype);
  const at::Tensor x2 = x_q.reshape({-1, in_features}).contiguous();
  const int64_t tokens = x2.size(0);
  const at::Tensor token_scales = x_scale.to(at::kFloat).contiguous();
  const at::Tensor row_scales = w_scale.to(at::kFloat).contiguous();
  TORCH_CHECK(token_scales.numel() == tokens, "x_scale must hold one scale per token (", tokens,
              "), got ", token_scales.numel());
  TORCH_CHECK(row_scales.numel() == layer.rows, "w_scale must hold one scale per output row (",
              layer.rows, "), got ", row_scales.numel());
  const at::Tensor bias32 = bias.has_value() && bias->defined()
                                ? bias->to(at::kFloat).contiguous()
                                : at::Tensor();
  TORCH_CHECK(!bias32.defined() || bias32.numel() == layer.rows, "bias must be [out]");
  layer.scale = row_scales.data_ptr<float>();
  const Int8Tokens x{x2.data_ptr<int8_t>(), in_features, token_scales.data_ptr<float>(), tokens};
  at::Tensor y = at::empty({tokens, layer.rows}, x_q.options().dtype(out_dtype));
  Int8Output out;
  out.ldy = layer.rows;
  out.bias = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  out.token_scale_first = sgl;
  if (out_dtype == at::kBFloat16) {
    out.y_bf16 = static_cast<uint16_t*>(y.data_ptr());
  } else {
    out.y = y.data_ptr<float>();
  }
  const Int8Rows kernels = int8_rows_here();
  if (tokens >= tiles_from && amx_int8_runs(in_features)) {
    amx_int8_linear(layer, x, out);
  } else if (tokens >= tiles_from) {
    kernels == Int8Rows::kVnni ? run_tiles_vnni(layer, x, x2, out)
                               : run_tiles_256(layer, x, x2, out);
  } else {
    at::parallel_for(0, layer.rows, 16, [&](int64_t first, int64_t last) {
      if (kernels == Int8Rows::kVnni) {
        int8_rows_avx512_vnni(layer, x, out, first, last);
      } else if (kernels == Int8Rows::kAvxVnni) {
        int8_rows_avx_vnni(layer, x, out, first, last);
      } else {
        int8_rows_avx2(layer, x, out, first, last);
      }
    });
  }
  auto shape = x_q.sizes().vec();
  shape.back() = layer.rows;
  return y.reshape(shape);
}

at::Tensor int8_decompress(const at::Tensor& values, const at::Tensor& bitmask,
                           const c10::optional<at::Tensor>& row_offsets, int64_t in_features) {
  check_int8_rows_run();
  const Int8Layer layer = int8_layer(values, bitmask, row_offsets, in_features);
  at::Tensor out = at::empty({layer.rows, in_features}, values.options());
  if (int8_rows_here() == Int8Rows::kVnni) {
    int8_decompress_avx512(layer, out.data_ptr<int8_t>(), in_features, 0, layer.rows);
  } else {
    int8_decompress_avx2(layer, out.data_ptr<int8_t>(), in_features, 0, layer.rows);
  }
  return out;
}

}  // namespace whisper_sparse
