// extern "C" entry points of the CUDA kernels: build a params struct, call
// q4::cuda::<op> on the caller's stream, turn the Status into an error code
// plus a thread-local message (read with q4_cuda_last_error()).
#include "c_api_cuda.h"

#include <cuda_runtime.h>

#include <string>

#include "q4/kernels.h"

namespace {

thread_local std::string t_error;

int32_t finish(const q4::Status& s) {
  t_error = s.message;
  return s.code;
}

}  // namespace

extern "C" {

const char* q4_cuda_last_error(void) { return t_error.c_str(); }

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
  q4::Quantize4bitParams p;
  p.x = x;
  p.x_dtype = static_cast<q4::DType>(x_dtype);
  p.n = n;
  p.blocksize = blocksize;
  p.quant_type = static_cast<q4::QuantType>(quant_type);
  p.packed = packed;
  p.packed_size = packed_size;
  p.absmax = absmax;
  p.absmax_size = absmax_size;
  return finish(q4::cuda::quantize_4bit(p, stream));
}

int32_t q4_cuda_dequantize_4bit(const uint8_t* packed, int64_t packed_size, const float* absmax, int64_t absmax_size,
                                int64_t n, int64_t blocksize, int32_t quant_type, void* out, int32_t out_dtype,
                                void* stream) {
  q4::Dequantize4bitParams p;
  p.packed = packed;
  p.packed_size = packed_size;
  p.absmax = absmax;
  p.absmax_size = absmax_size;
  p.n = n;
  p.blocksize = blocksize;
  p.quant_type = static_cast<q4::QuantType>(quant_type);
  p.out = out;
  p.out_dtype = static_cast<q4::DType>(out_dtype);
  return finish(q4::cuda::dequantize_4bit(p, stream));
}

int32_t q4_cuda_quantize_blockwise(const void* x, int32_t x_dtype, int64_t n, int64_t blocksize, const float* code,
                                   uint8_t* codes, int64_t codes_size, float* absmax, int64_t absmax_size,
                                   void* stream) {
  q4::QuantizeBlockwiseParams p;
  p.x = x;
  p.x_dtype = static_cast<q4::DType>(x_dtype);
  p.n = n;
  p.blocksize = blocksize;
  p.code = code;
  p.codes = codes;
  p.codes_size = codes_size;
  p.absmax = absmax;
  p.absmax_size = absmax_size;
  return finish(q4::cuda::quantize_blockwise(p, stream));
}

int32_t q4_cuda_dequantize_blockwise(const uint8_t* codes, int64_t n, const float* absmax, int64_t absmax_size,
                                     int64_t blocksize, const float* code, int32_t add_offset, float offset, void* out,
                                     int32_t out_dtype, void* stream) {
  q4::DequantizeBlockwiseParams p;
  p.codes = codes;
  p.n = n;
  p.absmax = absmax;
  p.absmax_size = absmax_size;
  p.blocksize = blocksize;
  p.code = code;
  p.add_offset = add_offset != 0;
  p.offset = offset;
  p.out = out;
  p.out_dtype = static_cast<q4::DType>(out_dtype);
  return finish(q4::cuda::dequantize_blockwise(p, stream));
}

int32_t q4_cuda_quantize_nested(const float* absmax, int64_t n_blocks, uint8_t* codes, float* absmax2,
                                int64_t absmax2_size, float* offset, void* stream) {
  q4::QuantizeNestedParams p;
  p.absmax = absmax;
  p.n_blocks = n_blocks;
  p.codes = codes;
  p.absmax2 = absmax2;
  p.absmax2_size = absmax2_size;
  p.offset = offset;
  return finish(q4::cuda::quantize_nested(p, stream));
}

}  // extern "C"
