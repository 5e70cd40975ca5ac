// Pieces shared by the CUDA kernels: grid limits, dtype-dispatched element
// access, the dynamic map in constant memory, and launch-error reporting.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "q4/common.h"
#include "q4/dynamic8.h"
#include "q4/kernels.h"

namespace q4 {
namespace cuda {
namespace {

constexpr int64_t kMaxGridX = int64_t(1) << 20;  // kernels loop grid-stride beyond this
constexpr int64_t kMaxGridY = 65535;

// Element i of a float buffer of kernel dtype d, widened to fp32 / stored
// rounded to nearest even (the Elem<T> conversions shared with the CPU).
__device__ __forceinline__ float load_any(const void* p, DType d, int64_t i) {
  switch (d) {
    case kF32:
      return static_cast<const float*>(p)[i];
    case kF16:
      return Elem<f16_t>::load(static_cast<const f16_t*>(p), i);
    default:
      return Elem<bf16_t>::load(static_cast<const bf16_t*>(p), i);
  }
}

__device__ __forceinline__ void store_any(void* p, DType d, int64_t i, float v) {
  switch (d) {
    case kF32:
      return Elem<float>::store(static_cast<float*>(p), i, v);
    case kF16:
      return Elem<f16_t>::store(static_cast<f16_t*>(p), i, v);
    default:
      return Elem<bf16_t>::store(static_cast<bf16_t*>(p), i, v);
  }
}

// The dynamic map (dynamic8.h) in constant memory, built at compile time.
struct CodeTable {
  float v[dynamic8::kCodes];
};
constexpr CodeTable dynamic8_table() {
  CodeTable t{};
  for (int i = 0; i < dynamic8::kCodes; ++i) t.v[i] = dynamic8::value(i);
  return t;
}
__constant__ CodeTable kDynamic8 = dynamic8_table();

// The status of the last launch on this thread.
inline Status launch_status(const char* op) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return Status::Ok();
  return {kInternal, std::string(op) + ": CUDA launch failed: " + cudaGetErrorString(e)};
}

}  // namespace
}  // namespace cuda
}  // namespace q4
