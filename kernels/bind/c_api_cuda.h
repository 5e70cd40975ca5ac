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

/* q4_cuda_<name>(parameters, void* stream) for each entry of c_api_ops.inc.
 * q4_cuda_int8_linear and q4_cuda_gemm_4bit_grad_input (m <= 8) allocate
 * temporary device memory on `stream` (cudaMallocAsync) and free it the same
 * way. */
#define Q4_OP(name, params, args) Q4_API int32_t q4_cuda_##name(Q4_STRIP params, void* stream);
#include "c_api_ops.inc"
#undef Q4_OP

#ifdef __cplusplus
}
#endif
