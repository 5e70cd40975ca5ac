// Blockwise 8-bit optimizer step on CUDA: the bit-exact twin of cpu/optim8.cc
// (contract in q4/optim8.h and Optim8bitParams). One CTA of 256 threads per
// block of 256 elements (grid-stride over blocks), one element per thread:
// decode the states, update (optim8::update, IEEE-rounded intrinsics, no
// contraction), write the parameter, reduce the new absmax across the CTA and
// re-quantize through the bin thresholds of each code book (blockwise8.h's
// threshold form, built per CTA in shared memory). The step and the lr scale
// may come from device memory (XLA buffers); the constants are then derived
// on the device in fp64, as on the host.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <string>

#include "bin_thresholds.cuh"
#include "common.cuh"
#include "q4/blockwise8.h"
#include "q4/kernels.h"
#include "q4/optim8.h"
#include "q4/quant4.h"

namespace q4 {
namespace cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;
static_assert(kThreads == optim8::kBlock && kThreads == blockwise8::kCodes, "one thread per element and threshold");

// The largest non-NaN |x| over the CTA (x = 0 for threads past the block's end); a barrier.
__device__ float block_absmax(float x, float* scratch) {
  float m = fabsf(x);
  m = m == m ? m : 0.0f;
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(kFullMask, m, o);
    m = v > m ? v : m;
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = m;
  __syncthreads();
  float r = 0.0f;
  for (int w = 0; w < kWarps; ++w) r = scratch[w] > r ? scratch[w] : r;
  return r;
}

__device__ __forceinline__ uint8_t quantize(float x, float amax, const int* thresholds) {
  if (amax == 0.0f) return 0;
  const float inv = __fdiv_rn(1.0f, amax);
  return uint8_t(code_of_bin(thresholds, blockwise8::bin_of(__fmul_rn(x, inv))));
}

template <int32_t K, typename P, typename G>
__global__ void __launch_bounds__(kThreads) optim8_kernel(Optim8bitParams p) {
  constexpr bool kTwo = K == optim8::kAdam;
  __shared__ float book1[256], book2[256];
  __shared__ int thr1[256], thr2[256];
  __shared__ float scratch[kWarps];
  __shared__ optim8::Consts k;
  __shared__ int any_nonfinite;
  const int t = threadIdx.x;
  book1[t] = p.qmap1[t];
  if (kTwo) book2[t] = p.qmap2[t];
  if (t == 0) {
    const int64_t step = p.step_ptr ? int64_t(*p.step_ptr) : p.step;
    const double lr = p.lr_scale_ptr ? p.lr * double(*p.lr_scale_ptr) : p.lr;
    k = optim8::make_consts(K, step, lr, p.beta1, p.beta2, p.eps, p.weight_decay, p.gnorm_scale);
  }
  __syncthreads();
  bin_thresholds(thr1, book1);
  if (kTwo) bin_thresholds(thr2, book2);
  P* param = static_cast<P*>(p.param);
  const G* grad = static_cast<const G*>(p.grad);
  for (int64_t b = blockIdx.x; b < p.absmax_size; b += gridDim.x) {
    const int64_t start = b * optim8::kBlock, i = start + t;
    const bool active = i < p.n;
    const float g = active ? Elem<G>::load(grad, i) : 0.0f;
    if (t == 0) any_nonfinite = 0;
    __syncthreads();
    if (!optim8::finite_bits(g)) any_nonfinite = 1;
    __syncthreads();
    if (any_nonfinite) {
      if (t == 0 && p.skipped_blocks) atomicAdd(p.skipped_blocks, 1);
      if (active && p.update) p.update[i] = 0.0f;
      __syncthreads();  // any_nonfinite is reset by the next block
      continue;
    }
    float w = active ? Elem<P>::load(param, i) : 0.0f;
    float m = active ? __fmul_rn(book1[p.state1[i]], p.absmax1[b]) : 0.0f;
    float v = (kTwo && active) ? __fmul_rn(book2[p.state2[i]], p.absmax2[b]) : 0.0f;
    const float before = w;
    optim8::update<K>(k, g, w, m, v);
    if (!active) m = v = 0.0f;
    if (active && p.update) {
      P stored[1];
      Elem<P>::store(stored, 0, w);
      p.update[i] = optim8::update_to(before, Elem<P>::load(stored, 0));
    } else if (active) {
      Elem<P>::store(param, i, w);
    }
    const float amax1 = block_absmax(m, scratch);
    if (active) p.state1[i] = quantize(m, amax1, thr1);
    if (t == 0) p.absmax1[b] = amax1;
    if (kTwo) {
      const float amax2 = block_absmax(v, scratch);
      if (active) p.state2[i] = quantize(v, amax2, thr2);
      if (t == 0) p.absmax2[b] = amax2;
    }
    __syncthreads();
  }
}

template <int32_t K>
void launch(const Optim8bitParams& p, int grid, cudaStream_t st) {
  Q4_DTYPE_SWITCH(p.param_dtype, P, [&] {
    Q4_DTYPE_SWITCH(p.grad_dtype, G, [&] { optim8_kernel<K, P, G><<<grid, kThreads, 0, st>>>(p); });
  });
}

}  // namespace

Status optimizer_update_8bit(const Optim8bitParams& p, void* stream) {
  // The maps are device memory, so their order is not checked here; the
  // front ends pass sorted maps.
  Status s = validate(p);
  if (!s.ok()) return s;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (p.skipped_blocks && cudaMemsetAsync(p.skipped_blocks, 0, sizeof(int32_t), st) != cudaSuccess)
    return {kInternal, "optimizer_update_8bit: clearing the skipped-block count failed"};
  const int grid = int(std::min(p.absmax_size, kMaxGridX));
  switch (p.optimizer) {
    case optim8::kAdam:
      launch<optim8::kAdam>(p, grid, st);
      break;
    case optim8::kMomentum:
      launch<optim8::kMomentum>(p, grid, st);
      break;
    case optim8::kLion:
      launch<optim8::kLion>(p, grid, st);
      break;
    default:
      launch<optim8::kRmsprop>(p, grid, st);
  }
  return launch_status("optimizer_update_8bit");
}

}  // namespace cuda
}  // namespace q4
