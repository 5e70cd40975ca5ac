/* The C ABI of the q4 CUDA kernels (built when the library has CUDA; see
 * q4_has_cuda()). Argument lists are those of the q4_* functions in c_api.h
 * plus a trailing cudaStream_t `stream` (NULL: the legacy default stream);
 * every pointer is device memory. Work is enqueued and not synchronised, so a
 * return of 0 means the arguments were valid and the launches were accepted;
 * a kernel fault surfaces at the caller's next synchronisation. On failure
 * q4_cuda_last_error() returns a message for the calling thread (separate from
 * q4_last_error(), which reports the CPU entry points). */
#pragma once
#include <stdint.h>

#include "c_api.h"

#ifdef __cplusplus
extern "C" {
#endif

Q4_API const char* q4_cuda_last_error(void);
/* Number of visible CUDA devices; 0 when there is no driver or no GPU. */
Q4_API int32_t q4_cuda_device_count(void);

Q4_API int32_t q4_cuda_quantize_4bit(const void* x, int32_t x_dtype, int64_t n, int64_t blocksize, int32_t quant_type,
                                     uint8_t* packed, int64_t packed_size, float* absmax, int64_t absmax_size,
                                     void* stream);
Q4_API int32_t q4_cuda_dequantize_4bit(const uint8_t* packed, int64_t packed_size, const float* absmax,
                                       int64_t absmax_size, int64_t n, int64_t blocksize, int32_t quant_type, void* out,
                                       int32_t out_dtype, void* stream);
/* code: 256 sorted floats in device memory, or NULL for the dynamic map. Its
 * order is not checked (it cannot be read on the host). */
Q4_API int32_t q4_cuda_quantize_blockwise(const void* x, int32_t x_dtype, int64_t n, int64_t blocksize,
                                          const float* code, uint8_t* codes, int64_t codes_size, float* absmax,
                                          int64_t absmax_size, void* stream);
Q4_API int32_t q4_cuda_dequantize_blockwise(const uint8_t* codes, int64_t n, const float* absmax, int64_t absmax_size,
                                            int64_t blocksize, const float* code, int32_t add_offset, float offset,
                                            void* out, int32_t out_dtype, void* stream);
/* offset: one float in device memory, written by the kernel. */
Q4_API int32_t q4_cuda_quantize_nested(const float* absmax, int64_t n_blocks, uint8_t* codes, float* absmax2,
                                       int64_t absmax2_size, float* offset, void* stream);

/* Fused matmuls and LLM.int8, as q4_gemm_4bit ... q4_int8_grad_input in
 * c_api.h. The nested code book (nested_code) is device memory and its order
 * is not checked; nested_offset is a host float. q4_cuda_int8_linear and
 * q4_cuda_gemm_4bit_grad_input (m <= 8) allocate temporary device memory on
 * `stream` (cudaMallocAsync) and free it the same way. */
Q4_API int32_t q4_cuda_gemm_4bit(const void* x, int32_t x_dtype, int64_t m, int64_t n, int64_t k, const uint8_t* packed,
                                 int64_t packed_size, const float* absmax, const uint8_t* nested_codes,
                                 const float* nested_absmax, int64_t nested_absmax_size, const float* nested_code,
                                 float nested_offset, int64_t n_blocks, int64_t blocksize, int32_t quant_type,
                                 const void* bias, int32_t bias_dtype, void* out, int32_t out_dtype, void* stream);
Q4_API int32_t q4_cuda_gemm_4bit_grad_input(const void* grad_out, int32_t grad_out_dtype, int64_t m, int64_t n,
                                            int64_t k, const uint8_t* packed, int64_t packed_size, const float* absmax,
                                            const uint8_t* nested_codes, const float* nested_absmax,
                                            int64_t nested_absmax_size, const float* nested_code, float nested_offset,
                                            int64_t n_blocks, int64_t blocksize, int32_t quant_type, void* grad_input,
                                            int32_t grad_input_dtype, void* stream);
Q4_API int32_t q4_cuda_int8_quantize_rows(const void* x, int32_t x_dtype, int64_t rows, int64_t cols, float threshold,
                                          int8_t* q, float* row_stats, uint8_t* outlier_cols, void* stream);
Q4_API int32_t q4_cuda_int8_linear(const void* x, int32_t x_dtype, int64_t m, int64_t n, int64_t k,
                                   const int8_t* weight, const float* weight_scale, float threshold, const void* bias,
                                   int32_t bias_dtype, void* out, int32_t out_dtype, void* stream);
Q4_API int32_t q4_cuda_int8_grad_input(const void* grad_out, int32_t grad_out_dtype, int64_t m, int64_t n, int64_t k,
                                       const int8_t* weight, const float* weight_scale, void* grad_input,
                                       int32_t grad_input_dtype, void* stream);

#ifdef __cplusplus
}
#endif
