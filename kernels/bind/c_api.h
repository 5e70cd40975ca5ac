/* The C ABI of the q4 kernel library (used through ctypes and by tests).
 * Every function returns 0 on success or a q4 StatusCode; on failure
 * q4_last_error() returns a message for the calling thread. Sizes are element
 * counts; a size that does not match the layout in q4/kernels.h is rejected
 * before any memory is touched. dtype codes: 0 f32, 1 f16, 2 bf16.
 * quant_type: 0 nf4, 1 fp4. */
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define Q4_API __attribute__((visibility("default")))

Q4_API const char* q4_last_error(void);
Q4_API int32_t q4_abi_version(void);
Q4_API int32_t q4_has_cuda(void);

/* Format constants, read by the Python packages (single source of truth). */
Q4_API int32_t q4_code_table(int32_t which, float* out, int64_t out_size); /* 0 nf4, 1 fp4, 2 dynamic8 */
Q4_API int32_t q4_fp4_rank_order(int32_t* out, int64_t out_size);
Q4_API int64_t q4_min_blocksize(void);
Q4_API int64_t q4_max_blocksize(void);
Q4_API int64_t q4_nested_blocksize(void);

Q4_API int32_t q4_cpu_isa(void);
Q4_API int32_t q4_cpu_has_avx2(void);
Q4_API int32_t q4_cpu_has_avx512(void);
Q4_API int32_t q4_cpu_has_avx512_bf16(void);
/* isa levels: 0 scalar, 1 avx2, 2 avx512, 3 avx512_bf16 (see q4/kernels.h).
 * Features, active level and each op's kernel chain as JSON; the string is
 * valid until this thread's next call. */
Q4_API const char* q4_cpu_features_json(void);
Q4_API int32_t q4_set_cpu_isa(int32_t isa);
Q4_API int32_t q4_cpu_num_threads(void);
Q4_API void q4_set_cpu_num_threads(int32_t n);
// Run the CPU kernels' threads through an OpenMP-style fork-join entry point
// (GOMP_parallel's signature, e.g. the OpenMP runtime the host framework
// already runs); NULL: q4's own thread pool. See q4/kernels.h.
Q4_API void q4_set_cpu_fork_join(void* gomp_parallel);
Q4_API void* q4_cpu_fork_join(void);

Q4_API int32_t q4_quantize_4bit(const void* x, int32_t x_dtype, int64_t n, int64_t blocksize, int32_t quant_type,
                                uint8_t* packed, int64_t packed_size, float* absmax, int64_t absmax_size);
Q4_API int32_t q4_dequantize_4bit(const uint8_t* packed, int64_t packed_size, const float* absmax, int64_t absmax_size,
                                  int64_t n, int64_t blocksize, int32_t quant_type, void* out, int32_t out_dtype);
/* code: 256 sorted floats, or NULL for the dynamic map. */
Q4_API int32_t q4_quantize_blockwise(const void* x, int32_t x_dtype, int64_t n, int64_t blocksize, const float* code,
                                     uint8_t* codes, int64_t codes_size, float* absmax, int64_t absmax_size);
/* add_offset != 0: out = fp32(code[q] * absmax) + offset (nested absmax). */
Q4_API int32_t q4_dequantize_blockwise(const uint8_t* codes, int64_t n, const float* absmax, int64_t absmax_size,
                                       int64_t blocksize, const float* code, int32_t add_offset, float offset,
                                       void* out, int32_t out_dtype);
Q4_API int32_t q4_quantize_nested(const float* absmax, int64_t n_blocks, uint8_t* codes, float* absmax2,
                                  int64_t absmax2_size, float* offset);

/* Fused matmuls. A 4-bit weight W [n, k] is `packed` (ceil(n*k/2) bytes) with
 * per-block scales given either plain (absmax != NULL, nested_codes == NULL)
 * or nested (nested_codes, nested_absmax[nested_absmax_size], nested_code[256]
 * or NULL for the dynamic map, nested_offset); n_blocks = ceil(n*k/blocksize).
 * bias may be NULL. */
Q4_API int32_t q4_gemm_4bit(const void* x, int32_t x_dtype, int64_t m, int64_t n, int64_t k, const uint8_t* packed,
                            int64_t packed_size, const float* absmax, const uint8_t* nested_codes,
                            const float* nested_absmax, int64_t nested_absmax_size, const float* nested_code,
                            float nested_offset, int64_t n_blocks, int64_t blocksize, int32_t quant_type,
                            const void* bias, int32_t bias_dtype, void* out, int32_t out_dtype);
Q4_API int32_t q4_gemm_4bit_grad_input(const void* grad_out, int32_t grad_out_dtype, int64_t m, int64_t n, int64_t k,
                                       const uint8_t* packed, int64_t packed_size, const float* absmax,
                                       const uint8_t* nested_codes, const float* nested_absmax,
                                       int64_t nested_absmax_size, const float* nested_code, float nested_offset,
                                       int64_t n_blocks, int64_t blocksize, int32_t quant_type, void* grad_input,
                                       int32_t grad_input_dtype);
/* LLM.int8 (see Int8*Params in q4/kernels.h). outlier_cols may be NULL. */
Q4_API int32_t q4_int8_quantize_rows(const void* x, int32_t x_dtype, int64_t rows, int64_t cols, float threshold,
                                     int8_t* q, float* row_stats, uint8_t* outlier_cols);
Q4_API int32_t q4_int8_linear(const void* x, int32_t x_dtype, int64_t m, int64_t n, int64_t k, const int8_t* weight,
                              const float* weight_scale, float threshold, const void* bias, int32_t bias_dtype,
                              void* out, int32_t out_dtype);
Q4_API int32_t q4_int8_grad_input(const void* grad_out, int32_t grad_out_dtype, int64_t m, int64_t n, int64_t k,
                                  const int8_t* weight, const float* weight_scale, void* grad_input,
                                  int32_t grad_input_dtype);

#ifdef __cplusplus
}
#endif
