// The threshold form of an 8-bit code book on CUDA (blockwise8.h), shared by the
// blockwise quantizer (blockwise.cu) and the 8-bit optimizer step (optim8.cu).
#pragma once

#include <cuda_runtime.h>

#include "q4/blockwise8.h"

namespace q4 {
namespace cuda {

// thresholds[j] = T[j] of the threshold form (blockwise8.h), thresholds[255] =
// kBins; one thread per entry (blockDim.x == 256), the running maximum as a
// warp scan plus the preceding warps' maxima. A barrier for the CTA.
__device__ inline void bin_thresholds(int* thresholds, const float* book) {
  constexpr unsigned kMask = 0xffffffffu;
  __shared__ int warp_max[blockwise8::kCodes / 32];
  const int j = threadIdx.x, lane = j & 31, warp = j >> 5;
  int t = j < blockwise8::kCodes - 1 ? blockwise8::first_bin_above(blockwise8::midpoint(book, j)) : blockwise8::kBins;
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(kMask, t, o);
    if (lane >= o) t = max(t, v);
  }
  if (lane == 31) warp_max[warp] = t;
  __syncthreads();
  for (int w = 0; w < warp; ++w) t = max(t, warp_max[w]);
  thresholds[j] = t;
  __syncthreads();
}

// Code of bin k: the number of thresholds <= k (thresholds[255] = kBins > k).
__device__ __forceinline__ int code_of_bin(const int* thresholds, int k) {
  int lo = 0;
  for (int step = 128; step >= 1; step >>= 1) lo += (thresholds[lo + step - 1] <= k) ? step : 0;
  return lo;
}

}  // namespace cuda
}  // namespace q4
