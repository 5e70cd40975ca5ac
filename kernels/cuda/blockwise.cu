// 8-bit blockwise quantization and the nested quantization of 4-bit absmax on
// CUDA: the bit-exact twin of cpu/blockwise.cc.
//   absmax[b] = max |x| over the block (NaN if any element is NaN)
//   code index = encode8_nearest (dynamic8.h) with scale floor(absmax[b])
//   dequantize: out = code[q] * absmax[b] (+ offset), each step rounded to fp32
//   nested:     offset = fp32(sum_fp64(absmax) / n), then the 8-bit quantize of
//               fp32(absmax - offset) with block 256 and the dynamic map
// The code book lives in shared memory (256 fp32); code == nullptr selects the
// dynamic map, whose device copy is generated from dynamic8::value at compile
// time.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "common.cuh"
#include "q4/dynamic8.h"
#include "q4/kernels.h"
#include "q4/quant4.h"

namespace q4 {
namespace cuda {

namespace {

constexpr int kWarpsPerCta = 8;     // quantize: one warp per quantization block
constexpr int kThreads = 256;       // dequantize: one thread per element
constexpr int kMeanThreads = 1024;  // nested mean: a single CTA

int log2_of(int64_t pow2) { return __builtin_ctzll(static_cast<unsigned long long>(pow2)); }

// Copies the code book (or the dynamic map) into shared memory; a barrier for the CTA.
__device__ void load_code_book(float* book, const float* code) {
  for (int i = threadIdx.x; i < dynamic8::kCodes; i += blockDim.x) book[i] = code ? code[i] : kDynamic8.v[i];
  __syncthreads();
}

// One warp per quantization block (warp-uniform loop, so every lane joins the
// shuffles). offset != nullptr: quantize fp32(x - *offset) (nested absmax).
template <typename T>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
    quantize_8bit_kernel(const T* x, const float* offset, int64_t n, int64_t bs, int64_t blocks, const float* code,
                         uint8_t* codes, float* absmax) {
  __shared__ float book[dynamic8::kCodes];
  load_code_book(book, code);
  const bool centre = offset != nullptr;
  const float off = centre ? *offset : 0.0f;
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerCta;
  for (int64_t b = int64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32; b < blocks; b += warps) {
    const int64_t start = b * bs, len = min(bs, n - start);
    auto input = [&](int64_t i) {
      const float v = Elem<T>::load(x, start + i);
      return centre ? v - off : v;
    };
    float m = 0.0f;  // never NaN itself: `a > m` is false for NaN a
    bool nan = false;
    for (int64_t i = lane; i < len; i += 32) {
      const float a = fabsf(input(i));
      nan |= (a != a);
      m = a > m ? a : m;
    }
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (__any_sync(0xffffffffu, nan)) m = __builtin_nanf("");
    const float scale = absmax_floor(m);
    const float inv = 1.0f / scale;
    for (int64_t i = lane; i < len; i += 32) codes[start + i] = uint8_t(encode8_nearest(book, input(i), scale, inv));
    if (lane == 0) absmax[b] = m;
  }
}

// out[i] = code[q[i]] * absmax[i >> log2_bs], then + offset when add_offset
// (offset read from device memory when offset_dev != nullptr).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    dequantize_8bit_kernel(const uint8_t* q, const float* absmax, int64_t n, int log2_bs, const float* code,
                           bool add_offset, float offset, const float* offset_dev, T* out) {
  __shared__ float book[dynamic8::kCodes];
  load_code_book(book, code);
  const float off = offset_dev ? *offset_dev : offset;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float scaled = book[q[i]] * absmax[i >> log2_bs];
    Elem<T>::store(out, i, add_offset ? scaled + off : scaled);
  }
}

template <typename V, typename F>
__device__ V block_reduce(V v, F op, V* scratch) {
  for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  __syncthreads();  // scratch may still be read by a previous reduction
  if ((threadIdx.x & 31) == 0) scratch[warp] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < warps; ++w) v = op(v, scratch[w]);
  return v;
}

// *offset = fp32(sum / n) with sum = the CPU's sequential fp64 sum of a[0..n).
// Summed here in parallel: with u = the smallest ulp among the nonzero a[i]
// (2^(e-150) for biased exponent e, subnormals e=1), every partial sum of any
// subset is a multiple of u bounded by sum|a|, hence exact in fp64 whenever
// sum|a| < 2^53 u; then every summation order gives the same double. Otherwise
// (a non-finite value, or magnitudes spread wider than about 2^28 / n) thread 0
// redoes the sum sequentially in the CPU's order.
__global__ void __launch_bounds__(kMeanThreads) mean_kernel(const float* a, int64_t n, float* offset) {
  __shared__ double dscratch[kMeanThreads / 32];
  __shared__ int iscratch[kMeanThreads / 32];
  double sum = 0.0, sum_abs = 0.0;
  int emin = 255;  // smallest biased exponent of a nonzero finite value (255: none)
  int nonfinite = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = a[i];
    const int e = int((f32_bits(v) >> 23) & 0xffu);
    nonfinite |= (e == 255);
    if (v != 0.0f && e != 255) emin = min(emin, max(e, 1));
    sum += v;
    sum_abs += fabs(double(v));
  }
  sum = block_reduce(sum, [](double x, double y) { return x + y; }, dscratch);
  sum_abs = block_reduce(sum_abs, [](double x, double y) { return x + y; }, dscratch);
  emin = block_reduce(emin, [](int x, int y) { return min(x, y); }, iscratch);
  nonfinite = block_reduce(nonfinite, [](int x, int y) { return x | y; }, iscratch);
  if (threadIdx.x != 0) return;
  // half the bound leaves room for the rounding of sum_abs itself
  const bool exact = !nonfinite && sum_abs <= ldexp(1.0, 52 + emin - 150);
  if (!exact) {
    sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += a[i];
  }
  *offset = static_cast<float>(sum / static_cast<double>(n));
}

}  // namespace

Status quantize_blockwise(const QuantizeBlockwiseParams& p, void* stream) {
  // p.code is device memory, so its order is not checked here (an unsorted
  // book still yields in-range indices); the front ends pass sorted books.
  Status s = validate(p);
  if (!s.ok()) return s;
  const int grid = int(std::min(ceil_div(p.absmax_size, kWarpsPerCta), kMaxGridX));
  Q4_DTYPE_SWITCH(p.x_dtype, T, [&] {
    quantize_8bit_kernel<T><<<grid, kWarpsPerCta * 32, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(p.x), nullptr, p.n, p.blocksize, p.absmax_size, p.code, p.codes, p.absmax);
  });
  return launch_status("quantize_blockwise");
}

Status dequantize_blockwise_device_offset(const DequantizeBlockwiseParams& p, const float* offset, void* stream) {
  Status s = validate(p);
  if (!s.ok()) return s;
  const int grid = int(std::min(ceil_div(p.n, kThreads), kMaxGridX));
  Q4_DTYPE_SWITCH(p.out_dtype, T, [&] {
    dequantize_8bit_kernel<T><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        p.codes, p.absmax, p.n, log2_of(p.blocksize), p.code, p.add_offset, p.offset, offset, static_cast<T*>(p.out));
  });
  return launch_status("dequantize_blockwise");
}

Status dequantize_blockwise(const DequantizeBlockwiseParams& p, void* stream) {
  return dequantize_blockwise_device_offset(p, nullptr, stream);
}

Status quantize_nested(const QuantizeNestedParams& p, void* stream) {
  Status s = validate(p);
  if (!s.ok()) return s;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  mean_kernel<<<1, kMeanThreads, 0, st>>>(p.absmax, p.n_blocks, p.offset);
  s = launch_status("quantize_nested (mean)");
  if (!s.ok()) return s;
  // stream order: the quantize reads the offset the mean kernel wrote
  const int grid = int(std::min(ceil_div(p.absmax2_size, kWarpsPerCta), kMaxGridX));
  quantize_8bit_kernel<float><<<grid, kWarpsPerCta * 32, 0, st>>>(p.absmax, p.offset, p.n_blocks, kNestedBlocksize,
                                                                  p.absmax2_size, nullptr, p.codes, p.absmax2);
  return launch_status("quantize_nested");
}

}  // namespace cuda
}  // namespace q4
