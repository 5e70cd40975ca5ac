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

}  // namespace capi
}  // namespace q4
