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

#define Q4_OP(name, params, args)                                      \
  int32_t q4_cuda_##name(Q4_STRIP params, void* stream) {              \
    return finish(q4::cuda::name(Q4_CAPI_PARAMS(name, args), stream)); \
  }
#include "c_api_ops.inc"
#undef Q4_OP

}  // extern "C"
