// 8-bit blockwise quantization and the nested quantization of 4-bit absmax on
// CUDA: the bit-exact twin of cpu/blockwise.cc, i.e. of the compatible
// format's CPU arithmetic (blockwise8.h), not of bitsandbytes' own CUDA
// kernels (which choose codes differently: q4 gives the same bytes on either
// device).
//   absmax[b] = max |x| over the block's non-NaN elements (0 if none)
//   code      = table[bin(x * (1 / absmax[b]))], 0 for a block with absmax 0;
//               the table is held in its threshold form (blockwise8.h): 256
//               bin thresholds in shared memory, searched per element
//   dequantize: out = code[q] * absmax[b] (+ offset), each step rounded to fp32
//   nested:     offset = PyTorch's CPU float32 mean of the absmax (one thread),
//               then the 8-bit quantize of fp32(absmax - offset) with block
//               256 and the dynamic map
// The code book lives in shared memory (256 fp32); code == nullptr selects the
// dynamic map, whose device copy is generated from dynamic8::value at compile
// time.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "bin_thresholds.cuh"
#include "common.cuh"
#include "q4/blockwise8.h"
#include "q4/dynamic8.h"
#include "q4/kernels.h"
#include "q4/quant4.h"

namespace q4 {
namespace cuda {

namespace {

constexpr int kWarpsPerCta = 8;  // quantize: one warp per quantization block
constexpr int kThreads = 256;    // dequantize: one thread per element
constexpr int kMeanWarps = 32;   // nested mean: a single CTA
constexpr unsigned kFullMask = 0xffffffffu;
static_assert(kWarpsPerCta * 32 == blockwise8::kCodes, "one thread per bin threshold");

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
  __shared__ int thresholds[blockwise8::kCodes];
  load_code_book(book, code);
  bin_thresholds(thresholds, book);
  const bool centre = offset != nullptr;
  const float off = centre ? *offset : 0.0f;
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerCta;
  for (int64_t b = int64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32; b < blocks; b += warps) {
    const int64_t start = b * bs, len = min(bs, n - start);
    auto input = [&](int64_t i) {
      const float v = Elem<T>::load(x, start + i);
      return centre ? __fsub_rn(v, off) : v;
    };
    float m = -INFINITY;  // the largest non-NaN |x|: `a > m` is false for NaN a
    for (int64_t i = lane; i < len; i += 32) {
      const float a = fabsf(input(i));
      m = a > m ? a : m;
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float v = __shfl_xor_sync(kFullMask, m, o);
      m = v > m ? v : m;
    }
    m = 0.0f > m ? 0.0f : m;
    if (m == 0.0f) {
      for (int64_t i = lane; i < len; i += 32) codes[start + i] = 0;
    } else {
      const float inv = __fdiv_rn(1.0f, m);
      for (int64_t i = lane; i < len; i += 32)
        codes[start + i] = uint8_t(code_of_bin(thresholds, blockwise8::bin_of(__fmul_rn(input(i), inv))));
    }
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

// *offset = PyTorch's float32 mean of a[0..n) in the order of blockwise8.h.
// Lane c of every warp owns column c of the 32-column rows. Per round, warp w
// sums group (round * kMeanWarps + w) of 2^p rows in order; warp 0 then
// carries the round's group sums through the cascade in group order. Warp 0
// finishes the columns and lane 0 the final sum.
__global__ void __launch_bounds__(kMeanWarps * 32) mean_kernel(const float* a, int64_t n, float* offset) {
  if (n < 8) {
    if (threadIdx.x == 0) *offset = blockwise8::div_rn(blockwise8::sum_short(a, n), static_cast<float>(n));
    return;
  }
  __shared__ float group[kMeanWarps][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t vecs = n / 8, rows = vecs / 4;
  const int p = blockwise8::cascade_power(rows);
  const int64_t step = int64_t(1) << p, groups = rows / step;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // warp 0: the cascade levels of column `lane`
  for (int64_t g0 = 0; g0 < groups; g0 += kMeanWarps) {
    const int64_t g = g0 + warp;
    if (g < groups) {
      const float* col = a + g * step * 32 + lane;
      float s = 0.0f;
      for (int64_t r = 0; r < step; ++r) s = __fadd_rn(s, col[r * 32]);
      group[warp][lane] = s;
    }
    __syncthreads();
    if (warp == 0) {
      const int64_t count = groups - g0 < kMeanWarps ? groups - g0 : kMeanWarps;
      for (int64_t k = 0; k < count; ++k)
        blockwise8::cascade_add(acc, group[k][lane], blockwise8::cascade_carries((g0 + k + 1) * step, p));
    }
    __syncthreads();
  }
  if (warp != 0) return;
  float col = 0.0f;
  for (int64_t r = groups * step; r < rows; ++r) col = __fadd_rn(col, a[r * 32 + lane]);
  col = blockwise8::cascade_finish(acc, col);
  // columns 0..7: the whole 8-value vectors after the rows, then columns
  // 8..15, 16..23 and 24..31 (lanes >= 8 keep their values for the shuffles)
  for (int64_t v = rows * 4; v < vecs; ++v)
    if (lane < 8) col = __fadd_rn(col, a[v * 8 + lane]);
  const float c1 = __shfl_down_sync(kFullMask, col, 8);
  const float c2 = __shfl_down_sync(kFullMask, col, 16);
  const float c3 = __shfl_down_sync(kFullMask, col, 24);
  if (lane < 8) col = __fadd_rn(__fadd_rn(__fadd_rn(col, c1), c2), c3);
  float lanes[8];
  for (int l = 0; l < 8; ++l) lanes[l] = __shfl_sync(kFullMask, col, l);
  if (lane != 0) return;
  float s = 0.0f;
  for (int64_t k = vecs * 8; k < n; ++k) s = __fadd_rn(s, a[k]);
  for (int l = 0; l < 8; ++l) s = __fadd_rn(s, lanes[l]);
  *offset = blockwise8::div_rn(__fadd_rn(0.0f, s), static_cast<float>(n));
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
  mean_kernel<<<1, kMeanWarps * 32, 0, st>>>(p.absmax, p.n_blocks, p.offset);
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
