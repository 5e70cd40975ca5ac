// extern "C" entry points of the CUDA kernels: build a params struct, call
// q4::cuda::<op> on the caller's stream, turn the Status into an error code
// plus a thread-local message (read with q4_cuda_last_error()).
#include <cuda_runtime.h>

#include <string>

#include "c_api_cuda.h"
#include "c_api_params.h"
#include "q4/kernels.h"

using q4::capi::finish;

extern "C" {

const char* q4_cuda_last_error(void) { return q4::capi::last_error().c_str(); }

int32_t q4_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver / no device: clear the error, report none
    return 0;
  }
  return n;
}

int32_t q4_cuda_quantize_4bit(const void* x, int32_t x_dtype, int64_t n, int64_t blocksize, int32_t quant_type,
                              uint8_t* packed, int64_t packed_size, float* absmax, int64_t absmax_size, void* stream) {
  return finish(q4::cuda::quantize_4bit(
      q4::capi::quantize_4bit(x, x_dtype, n, blocksize, quant_type, packed, packed_size, absmax, absmax_size), stream));
}

int32_t q4_cuda_dequantize_4bit(const uint8_t* packed, int64_t packed_size, const float* absmax, int64_t absmax_size,
                                int64_t n, int64_t blocksize, int32_t quant_type, void* out, int32_t out_dtype,
                                void* stream) {
  return finish(q4::cuda::dequantize_4bit(
      q4::capi::dequantize_4bit(packed, packed_size, absmax, absmax_size, n, blocksize, quant_type, out, out_dtype),
      stream));
}

int32_t q4_cuda_quantize_blockwise(const void* x, int32_t x_dtype, int64_t n, int64_t blocksize, const float* code,
                                   uint8_t* codes, int64_t codes_size, float* absmax, int64_t absmax_size,
                                   void* stream) {
  return finish(q4::cuda::quantize_blockwise(
      q4::capi::quantize_blockwise(x, x_dtype, n, blocksize, code, codes, codes_size, absmax, absmax_size), stream));
}

int32_t q4_cuda_dequantize_blockwise(const uint8_t* codes, int64_t n, const float* absmax, int64_t absmax_size,
                                     int64_t blocksize, const float* code, int32_t add_offset, float offset, void* out,
                                     int32_t out_dtype, void* stream) {
  return finish(q4::cuda::dequantize_blockwise(q4::capi::dequantize_blockwise(codes, n, absmax, absmax_size, blocksize,
                                                                              code, add_offset, offset, out, out_dtype),
                                               stream));
}

int32_t q4_cuda_quantize_nested(const float* absmax, int64_t n_blocks, uint8_t* codes, float* absmax2,
                                int64_t absmax2_size, float* offset, void* stream) {
  return finish(q4::cuda::quantize_nested(
      q4::capi::quantize_nested(absmax, n_blocks, codes, absmax2, absmax2_size, offset), stream));
}

int32_t q4_cuda_gemm_4bit(const void* x, int32_t x_dtype, int64_t m, int64_t n, int64_t k, const uint8_t* packed,
                          int64_t packed_size, const float* absmax, const uint8_t* nested_codes,
                          const float* nested_absmax, int64_t nested_absmax_size, const float* nested_code,
                          float nested_offset, int64_t n_blocks, int64_t blocksize, int32_t quant_type,
                          const void* bias, int32_t bias_dtype, void* out, int32_t out_dtype, void* stream) {
  const q4::Absmax4 scales =
      q4::capi::scales(absmax, nested_codes, nested_absmax, nested_absmax_size, nested_code, nested_offset, n_blocks);
  return finish(q4::cuda::gemm_4bit(q4::capi::gemm_4bit(x, x_dtype, m, n, k, packed, packed_size, scales, blocksize,
                                                        quant_type, bias, bias_dtype, out, out_dtype),
                                    stream));
}

int32_t q4_cuda_gemm_4bit_grad_input(const void* grad_out, int32_t grad_out_dtype, int64_t m, int64_t n, int64_t k,
                                     const uint8_t* packed, int64_t packed_size, const float* absmax,
                                     const uint8_t* nested_codes, const float* nested_absmax,
                                     int64_t nested_absmax_size, const float* nested_code, float nested_offset,
                                     int64_t n_blocks, int64_t blocksize, int32_t quant_type, void* grad_input,
                                     int32_t grad_input_dtype, void* stream) {
  const q4::Absmax4 scales =
      q4::capi::scales(absmax, nested_codes, nested_absmax, nested_absmax_size, nested_code, nested_offset, n_blocks);
  return finish(q4::cuda::gemm_4bit_grad_input(
      q4::capi::gemm_4bit_grad_input(grad_out, grad_out_dtype, m, n, k, packed, packed_size, scales, blocksize,
                                     quant_type, grad_input, grad_input_dtype),
      stream));
}

int32_t q4_cuda_int8_quantize_rows(const void* x, int32_t x_dtype, int64_t rows, int64_t cols, float threshold,
                                   int8_t* q, float* row_stats, uint8_t* outlier_cols, void* stream) {
  return finish(q4::cuda::int8_quantize_rows(
      q4::capi::int8_quantize_rows(x, x_dtype, rows, cols, threshold, q, row_stats, outlier_cols), stream));
}

int32_t q4_cuda_int8_linear(const void* x, int32_t x_dtype, int64_t m, int64_t n, int64_t k, const int8_t* weight,
                            const float* weight_scale, float threshold, const void* bias, int32_t bias_dtype, void* out,
                            int32_t out_dtype, void* stream) {
  return finish(q4::cuda::int8_linear(
      q4::capi::int8_linear(x, x_dtype, m, n, k, weight, weight_scale, threshold, bias, bias_dtype, out, out_dtype),
      stream));
}

int32_t q4_cuda_int8_grad_input(const void* grad_out, int32_t grad_out_dtype, int64_t m, int64_t n, int64_t k,
                                const int8_t* weight, const float* weight_scale, void* grad_input,
                                int32_t grad_input_dtype, void* stream) {
  return finish(q4::cuda::int8_grad_input(
      q4::capi::int8_grad_input(grad_out, grad_out_dtype, m, n, k, weight, weight_scale, grad_input, grad_input_dtype),
      stream));
}

}  // extern "C"
