// The params structs of q4/kernels.h built from the C ABI argument lists,
// shared by the CPU (c_api.cc) and CUDA (c_api_cuda.cu) entry points.
#pragma once

#include <cstdint>
#include <string>

#include "q4/kernels.h"

namespace q4 {
namespace capi {

// The calling thread's last error message, shared by the CPU and CUDA entry
// points (q4_last_error and q4_cuda_last_error read the same slot).
inline std::string& last_error() {
  thread_local std::string message;
  return message;
}

// Records the status message for this thread and returns the status code.
inline int32_t finish(const Status& s) {
  last_error() = s.message;
  return s.code;
}

inline Quantize4bitParams quantize_4bit(const void* x, int32_t x_dtype, int64_t n, int64_t blocksize,
                                        int32_t quant_type, uint8_t* packed, int64_t packed_size, float* absmax,
                                        int64_t absmax_size) {
  Quantize4bitParams p;
  p.x = x;
  p.x_dtype = static_cast<DType>(x_dtype);
  p.n = n;
  p.blocksize = blocksize;
  p.quant_type = static_cast<QuantType>(quant_type);
  p.packed = packed;
  p.packed_size = packed_size;
  p.absmax = absmax;
  p.absmax_size = absmax_size;
  return p;
}

inline Dequantize4bitParams dequantize_4bit(const uint8_t* packed, int64_t packed_size, const float* absmax,
                                            int64_t absmax_size, int64_t n, int64_t blocksize, int32_t quant_type,
                                            void* out, int32_t out_dtype) {
  Dequantize4bitParams p;
  p.packed = packed;
  p.packed_size = packed_size;
  p.absmax = absmax;
  p.absmax_size = absmax_size;
  p.n = n;
  p.blocksize = blocksize;
  p.quant_type = static_cast<QuantType>(quant_type);
  p.out = out;
  p.out_dtype = static_cast<DType>(out_dtype);
  return p;
}

inline QuantizeBlockwiseParams quantize_blockwise(const void* x, int32_t x_dtype, int64_t n, int64_t blocksize,
                                                  const float* code, uint8_t* codes, int64_t codes_size, float* absmax,
                                                  int64_t absmax_size) {
  QuantizeBlockwiseParams p;
  p.x = x;
  p.x_dtype = static_cast<DType>(x_dtype);
  p.n = n;
  p.blocksize = blocksize;
  p.code = code;
  p.codes = codes;
  p.codes_size = codes_size;
  p.absmax = absmax;
  p.absmax_size = absmax_size;
  return p;
}

inline DequantizeBlockwiseParams dequantize_blockwise(const uint8_t* codes, int64_t n, const float* absmax,
                                                      int64_t absmax_size, int64_t blocksize, const float* code,
                                                      int32_t add_offset, float offset, void* out, int32_t out_dtype) {
  DequantizeBlockwiseParams p;
  p.codes = codes;
  p.n = n;
  p.absmax = absmax;
  p.absmax_size = absmax_size;
  p.blocksize = blocksize;
  p.code = code;
  p.add_offset = add_offset != 0;
  p.offset = offset;
  p.out = out;
  p.out_dtype = static_cast<DType>(out_dtype);
  return p;
}

inline QuantizeNestedParams quantize_nested(const float* absmax, int64_t n_blocks, uint8_t* codes, float* absmax2,
                                            int64_t absmax2_size, float* offset) {
  QuantizeNestedParams p;
  p.absmax = absmax;
  p.n_blocks = n_blocks;
  p.codes = codes;
  p.absmax2 = absmax2;
  p.absmax2_size = absmax2_size;
  p.offset = offset;
  return p;
}

inline Absmax4 scales(const float* absmax, const uint8_t* nested_codes, const float* nested_absmax,
                      int64_t nested_absmax_size, const float* nested_code, float nested_offset, int64_t n_blocks) {
  Absmax4 a;
  a.absmax = nested_codes ? nullptr : absmax;
  a.nested_codes = nested_codes;
  a.nested_absmax = nested_absmax;
  a.nested_absmax_size = nested_absmax_size;
  a.nested_code = nested_code;
  a.nested_offset = nested_offset;
  a.n_blocks = n_blocks;
  return a;
}

inline Gemm4bitParams gemm_4bit(const void* x, int32_t x_dtype, int64_t m, int64_t n, int64_t k, const uint8_t* packed,
                                int64_t packed_size, const float* absmax, const uint8_t* nested_codes,
                                const float* nested_absmax, int64_t nested_absmax_size, const float* nested_code,
                                float nested_offset, int64_t n_blocks, int64_t blocksize, int32_t quant_type,
                                const void* bias, int32_t bias_dtype, void* out, int32_t out_dtype) {
  Gemm4bitParams p;
  p.x = x;
  p.x_dtype = static_cast<DType>(x_dtype);
  p.m = m;
  p.n = n;
  p.k = k;
  p.packed = packed;
  p.packed_size = packed_size;
  p.scales = scales(absmax, nested_codes, nested_absmax, nested_absmax_size, nested_code, nested_offset, n_blocks);
  p.blocksize = blocksize;
  p.quant_type = static_cast<QuantType>(quant_type);
  p.bias = bias;
  p.bias_dtype = static_cast<DType>(bias_dtype);
  p.out = out;
  p.out_dtype = static_cast<DType>(out_dtype);
  return p;
}

// gemm_4bit_w4a8 takes gemm_4bit's arguments.
template <typename... A>
Gemm4bitParams gemm_4bit_w4a8(A... args) {
  return gemm_4bit(args...);
}

inline Gemm4bitGradInputParams gemm_4bit_grad_input(const void* grad_out, int32_t grad_out_dtype, int64_t m, int64_t n,
                                                    int64_t k, const uint8_t* packed, int64_t packed_size,
                                                    const float* absmax, const uint8_t* nested_codes,
                                                    const float* nested_absmax, int64_t nested_absmax_size,
                                                    const float* nested_code, float nested_offset, int64_t n_blocks,
                                                    int64_t blocksize, int32_t quant_type, void* grad_input,
                                                    int32_t grad_input_dtype) {
  Gemm4bitGradInputParams p;
  p.grad_out = grad_out;
  p.grad_out_dtype = static_cast<DType>(grad_out_dtype);
  p.m = m;
  p.n = n;
  p.k = k;
  p.packed = packed;
  p.packed_size = packed_size;
  p.scales = scales(absmax, nested_codes, nested_absmax, nested_absmax_size, nested_code, nested_offset, n_blocks);
  p.blocksize = blocksize;
  p.quant_type = static_cast<QuantType>(quant_type);
  p.grad_input = grad_input;
  p.grad_input_dtype = static_cast<DType>(grad_input_dtype);
  return p;
}

inline Int8QuantizeRowsParams int8_quantize_rows(const void* x, int32_t x_dtype, int64_t rows, int64_t cols,
                                                 float threshold, int8_t* q, float* row_stats, uint8_t* outlier_cols) {
  Int8QuantizeRowsParams p;
  p.x = x;
  p.x_dtype = static_cast<DType>(x_dtype);
  p.rows = rows;
  p.cols = cols;
  p.threshold = threshold;
  p.q = q;
  p.row_stats = row_stats;
  p.outlier_cols = outlier_cols;
  return p;
}

inline Int8LinearParams int8_linear(const void* x, int32_t x_dtype, int64_t m, int64_t n, int64_t k,
                                    const int8_t* weight, const float* weight_scale, float threshold, const void* bias,
                                    int32_t bias_dtype, void* out, int32_t out_dtype) {
  Int8LinearParams p;
  p.x = x;
  p.x_dtype = static_cast<DType>(x_dtype);
  p.m = m;
  p.n = n;
  p.k = k;
  p.weight = weight;
  p.weight_scale = weight_scale;
  p.threshold = threshold;
  p.bias = bias;
  p.bias_dtype = static_cast<DType>(bias_dtype);
  p.out = out;
  p.out_dtype = static_cast<DType>(out_dtype);
  return p;
}

inline Int8GradInputParams int8_grad_input(const void* grad_out, int32_t grad_out_dtype, int64_t m, int64_t n,
                                           int64_t k, const int8_t* weight, const float* weight_scale, void* grad_input,
                                           int32_t grad_input_dtype) {
  Int8GradInputParams p;
  p.grad_out = grad_out;
  p.grad_out_dtype = static_cast<DType>(grad_out_dtype);
  p.m = m;
  p.n = n;
  p.k = k;
  p.weight = weight;
  p.weight_scale = weight_scale;
  p.grad_input = grad_input;
  p.grad_input_dtype = static_cast<DType>(grad_input_dtype);
  return p;
}

inline Optim8bitParams optimizer_update_8bit(int32_t optimizer, void* param, int32_t param_dtype, const void* grad,
                                             int32_t grad_dtype, int64_t n, uint8_t* state1, float* absmax1,
                                             const float* qmap1, uint8_t* state2, float* absmax2, const float* qmap2,
                                             int64_t absmax_size, int64_t step, double lr, double beta1, double beta2,
                                             double eps, double weight_decay, double gnorm_scale,
                                             int32_t* skipped_blocks, float* update) {
  Optim8bitParams p;
  p.optimizer = optimizer;
  p.param = param;
  p.param_dtype = static_cast<DType>(param_dtype);
  p.grad = grad;
  p.grad_dtype = static_cast<DType>(grad_dtype);
  p.n = n;
  p.state1 = state1;
  p.absmax1 = absmax1;
  p.qmap1 = qmap1;
  p.state2 = state2;
  p.absmax2 = absmax2;
  p.qmap2 = qmap2;
  p.absmax_size = absmax_size;
  p.step = step;
  p.lr = lr;
  p.beta1 = beta1;
  p.beta2 = beta2;
  p.eps = eps;
  p.weight_decay = weight_decay;
  p.gnorm_scale = gnorm_scale;
  p.skipped_blocks = skipped_blocks;
  p.update = update;
  return p;
}

}  // namespace capi
}  // namespace q4
