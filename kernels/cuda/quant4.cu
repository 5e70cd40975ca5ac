// 4-bit blockwise quantize / dequantize on CUDA: the bit-exact twin of
// cpu/quant4.cc. Per block b of elements [b*bs, min(n, (b+1)*bs)):
//   amax = max |x| (NaN if any element is NaN)
//   full block:    s = x * (1.0f / floor(amax)), stored absmax = amax
//   partial block: s = x / floor(amax),          stored absmax = floor(amax)
// nibble = Code4<QT>::encode(s); byte i = (nibble[2i] << 4) | nibble[2i+1],
// an odd n pads the last low nibble with encode(0.0f). Dequantize:
// out = fp32(decode(nibble) * absmax[b]) rounded to the output dtype.
// Built with --fmad=false and IEEE division/reciprocal (no fast math), so every
// fp32 operation rounds exactly as on the CPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "common.cuh"
#include "q4/kernels.h"
#include "q4/quant4.h"

namespace q4 {
namespace cuda {
namespace {

constexpr int kWarpsPerCta = 8;  // quantize: one warp per quantization block
constexpr int kThreads = 256;    // dequantize: one thread per packed byte

// max |x[i]| over i < len, reduced across the warp; NaN if any element is NaN
// (the running max itself never becomes NaN: `a > m` is false for NaN a).
template <typename T>
__device__ float warp_absmax(const T* x, int64_t len, int lane) {
  float m = 0.0f;
  bool nan = false;
  for (int64_t i = lane; i < len; i += 32) {
    const float a = fabsf(Elem<T>::load(x, i));
    nan |= (a != a);
    m = a > m ? a : m;
  }
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  return __any_sync(0xffffffffu, nan) ? __builtin_nanf("") : m;
}

// Warp w of the grid handles quantization blocks w, w + warps, ... The block
// index is warp-uniform, so all 32 lanes take part in every shuffle.
template <QuantType QT, typename T>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
    quantize_4bit_kernel(const T* x, int64_t n, int64_t bs, int64_t blocks, uint8_t* packed, float* absmax) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerCta;
  for (int64_t b = int64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32; b < blocks; b += warps) {
    const int64_t start = b * bs, len = min(bs, n - start);
    const bool partial = len < bs;
    const T* xb = x + start;
    const float amax = warp_absmax(xb, len, lane);
    const float floor_amax = absmax_floor(amax);
    const float inv = 1.0f / floor_amax;
    const int pad = Code4<QT>::encode(0.0f);
    // lane handles element pairs (2j, 2j+1) = byte j of the block (bs is even)
    for (int64_t j = lane; 2 * j < len; j += 32) {
      const float e = Elem<T>::load(xb, 2 * j);
      const int qe = Code4<QT>::encode(partial ? e / floor_amax : e * inv);
      int qo = pad;
      if (2 * j + 1 < len) {
        const float o = Elem<T>::load(xb, 2 * j + 1);
        qo = Code4<QT>::encode(partial ? o / floor_amax : o * inv);
      }
      packed[start / 2 + j] = pack2(qe, qo);
    }
    if (lane == 0) absmax[b] = partial ? floor_amax : amax;
  }
}

// Thread per packed byte j: elements 2j (high nibble) and 2j+1 (low nibble),
// both in block (2j) >> log2_bs since blocks start on even elements.
template <QuantType QT, typename T>
__global__ void __launch_bounds__(kThreads)
    dequantize_4bit_kernel(const uint8_t* packed, const float* absmax, int64_t n, int log2_bs, T* out) {
  __shared__ float table[16];
  if (threadIdx.x < 16) table[threadIdx.x] = Code4<QT>::decode(int(threadIdx.x));
  __syncthreads();
  const int64_t bytes = packed_bytes(n);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < bytes; j += stride) {
    const uint8_t q = packed[j];
    const float scale = absmax[(2 * j) >> log2_bs];
    Elem<T>::store(out, 2 * j, table[unpack_even(q)] * scale);
    if (2 * j + 1 < n) Elem<T>::store(out, 2 * j + 1, table[unpack_odd(q)] * scale);
  }
}

int log2_of(int64_t pow2) { return __builtin_ctzll(static_cast<unsigned long long>(pow2)); }

}  // namespace

Status quantize_4bit(const Quantize4bitParams& p, void* stream) {
  Status s = validate(p);
  if (!s.ok()) return s;
  const int grid = int(std::min(ceil_div(p.absmax_size, kWarpsPerCta), kMaxGridX));
  Q4_QUANT_SWITCH(p.quant_type, QT, [&] {
    Q4_DTYPE_SWITCH(p.x_dtype, T, [&] {
      quantize_4bit_kernel<QT, T><<<grid, kWarpsPerCta * 32, 0, static_cast<cudaStream_t>(stream)>>>(
          static_cast<const T*>(p.x), p.n, p.blocksize, p.absmax_size, p.packed, p.absmax);
    });
  });
  return launch_status("quantize_4bit");
}

Status dequantize_4bit(const Dequantize4bitParams& p, void* stream) {
  Status s = validate(p);
  if (!s.ok()) return s;
  const int grid = int(std::min(ceil_div(p.packed_size, kThreads), kMaxGridX));
  Q4_QUANT_SWITCH(p.quant_type, QT, [&] {
    Q4_DTYPE_SWITCH(p.out_dtype, T, [&] {
      dequantize_4bit_kernel<QT, T><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          p.packed, p.absmax, p.n, log2_of(p.blocksize), static_cast<T*>(p.out));
    });
  });
  return launch_status("dequantize_4bit");
}

}  // namespace cuda
}  // namespace q4
