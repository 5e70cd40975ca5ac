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

}  // extern "C"
