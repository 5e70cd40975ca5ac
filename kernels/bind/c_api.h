/* The C ABI of the q4 kernel library (used through ctypes and by tests).
 * Every function returns 0 on success or a q4 StatusCode; on failure
 * q4_last_error() returns a message for the calling thread. Sizes are element
 * counts; a size that does not match the layout in q4/kernels.h is rejected
 * before any memory is touched. dtype codes: 0 f32, 1 f16, 2 bf16.
 * quant_type: a 4-bit format's id (q4_formats(): 0 nf4, 1 fp4). */
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
/* The 4-bit formats (q4/formats.h), one per line: "name id\n..." (id: quant_type). */
Q4_API const char* q4_formats(void);
Q4_API int32_t q4_code_table(int32_t which, float* out,
                             int64_t out_size); /* a format's id (16 values), 2 dynamic8, 3 unsigned dynamic8 */
Q4_API int32_t q4_fp4_rank_order(int32_t* out, int64_t out_size);
Q4_API int64_t q4_min_blocksize(void);
Q4_API int64_t q4_max_blocksize(void);
Q4_API int64_t q4_max_blocksize8(void); /* 8-bit blockwise */
Q4_API int64_t q4_nested_blocksize(void);
Q4_API int32_t q4_search_scales_4bit(const float* x, int64_t n_blocks, int64_t blocksize, int32_t quant_type,
                                     float* scales); /* the 'mse' scale per full fp32 block (q4/kernels.h) */
Q4_API int32_t q4_encode_4bit(const float* x, int64_t n_blocks, int64_t blocksize, int32_t quant_type,
                              const float* scales, uint8_t* packed); /* nibbles with given scales (q4/kernels.h) */
Q4_API int64_t q4_w4a8_act_block(int64_t blocksize);                 /* W4A8's activation block (q4/w4a8.h) */

Q4_API int32_t q4_cpu_isa(void);
/* The ISA levels, lowest first, one name per line (the index is the isa code). */
Q4_API const char* q4_cpu_isa_names(void);
Q4_API int32_t q4_cpu_has_isa(int32_t isa);
Q4_API int32_t q4_cpu_has_avx2(void);
Q4_API int32_t q4_cpu_has_avx512(void);
Q4_API int32_t q4_cpu_has_avx512_bf16(void);
Q4_API int32_t q4_cpu_has_amx(void);
/* isa levels: 0 scalar, 1 avx2, 2 avx512, 3 avx512_bf16, 4 amx (see q4/kernels.h).
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

/* The list of every op's name and parameters, one per line:
 * "name(parameters)\n..." (read by the Python packages for their ctypes
 * signatures and FFI registrations). */
Q4_API const char* q4_ops(void);

/* The ops: q4_<name>(parameters) for each entry of c_api_ops.inc (read it for
 * the parameters and contracts). */
#define Q4_STRIP(...) __VA_ARGS__
#define Q4_OP(name, params, args) Q4_API int32_t q4_##name params;
#include "c_api_ops.inc"
#undef Q4_OP

#ifdef __cplusplus
}
#endif
