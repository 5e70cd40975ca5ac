// LLM.int8 kernels on CUDA: row-wise quantization, the int8 linear and its
// input gradient; the bit-exact twin of cpu/int8.cc, whose header states the
// arithmetic. Every fp32 step below is an explicitly rounded intrinsic
// (__fmul_rn / __fadd_rn / __fdiv_rn, never contracted), in the CPU's order:
//   quantize  outlier |x| >= threshold (threshold > 0); row_stats = max |x|
//             over the non-outlier elements (NaN if one is NaN); mult =
//             fp32(fp32(1 / row_stats) * 127); q = round_half_even(clamp(
//             fp32(x * mult), -127, 127)), 0 for a NaN product and in every
//             outlier column.
//   linear    acc = sum q * CB (int32, __dp4a: exact, so any order);
//             y = fp32(float(acc) * fp32(row_stats * SCB)) * 1/127^2;
//             outlier columns c_0 < c_1 < ...: o = ((0 + x*wd_0) + x*wd_1) + ...
//             with wd = fp32(float(CB) * SCB) * 1/127, then y = y + o; y + bias.
//   grad      g = fp32(dY * fp32(SCB * 1/127)); dX = ((0 + g_0*CB_0) + g_1*CB_1)
//             + ... over n in order, one rounded multiply and add per term.
// int8_linear quantizes X into temporary device memory (cudaMallocAsync on
// the caller's stream, freed the same way).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common.cuh"
#include "q4/int8.h"
#include "q4/kernels.h"
#include "q4/quant4.h"

namespace q4 {
namespace cuda {
namespace {

using int8::kInv127;
using int8::kInv127Sq;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kCompactThreads = 1024;  // outlier column list: one CTA
constexpr int kTile = 64;              // tiled kernels: output tile edge
constexpr int kStepBytes = 64;         // linear: k bytes per shared-memory step
constexpr int kStepWords = kStepBytes / 4;
constexpr int kStep = 32;  // grad: W rows per shared-memory step
constexpr int64_t kOutlierRowsPerCta = 256;

__device__ __forceinline__ bool is_outlier(float a, float threshold) { return threshold > 0.0f && a >= threshold; }

// (q4/int8.h)
__device__ __forceinline__ int8_t quantize_elem(float x, float mult) { return int8::quantize(x, mult); }

// ------------------------------------------------------------ quantization

// flags[c] = 1 for a column with an outlier among rows [y * rows_per_cta, ...)
// (flags zeroed beforehand; concurrent writers all store 1).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    outlier_cols_kernel(const T* x, int64_t rows, int64_t cols, float threshold, int64_t rows_per_cta, uint8_t* flags) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_cta, r1 = min(rows, r0 + rows_per_cta);
  bool any = false;
  for (int64_t r = r0; r < r1 && !any; ++r) any = is_outlier(fabsf(Elem<T>::load(x, r * cols + c)), threshold);
  if (any) flags[c] = 1;
}

// A CTA per row: row_stats[r], then q[r * q_stride + c] (columns [cols,
// q_stride) zero-filled). flags: outlier columns (zeroed in q), or null.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_rows_kernel(const T* x, int64_t rows, int64_t cols, float threshold, const uint8_t* flags, int8_t* q,
                         int64_t q_stride, float* row_stats) {
  __shared__ float warp_max[kWarps];
  __shared__ int warp_nan[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * cols;
    float m = 0.0f;  // never NaN itself: `a > m` is false for NaN a
    bool nan = false;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const float a = fabsf(Elem<T>::load(xr, c));
      if (is_outlier(a, threshold)) continue;
      nan |= (a != a);
      m = a > m ? a : m;
    }
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    nan = __any_sync(0xffffffffu, nan);
    if (lane == 0) {
      warp_max[warp] = m;
      warp_nan[warp] = nan;
    }
    __syncthreads();
    m = warp_max[0];
    nan = warp_nan[0] != 0;
    for (int w = 1; w < kWarps; ++w) {
      m = fmaxf(m, warp_max[w]);
      nan |= warp_nan[w] != 0;
    }
    __syncthreads();  // warp_max is rewritten for the next row
    const float stat = nan ? __builtin_nanf("") : m;
    if (threadIdx.x == 0) row_stats[r] = stat;
    const float mult = int8::row_multiplier(stat);
    int8_t* qr = q + r * q_stride;
    for (int64_t c = threadIdx.x; c < q_stride; c += blockDim.x) {
      int8_t v = 0;
      if (c < cols && !(flags != nullptr && flags[c])) v = quantize_elem(Elem<T>::load(xr, c), mult);
      qr[c] = v;
    }
  }
}

// list[0, *count) = the flagged columns in ascending order (one CTA).
__global__ void __launch_bounds__(kCompactThreads)
    compact_cols_kernel(const uint8_t* flags, int64_t cols, int32_t* list, int32_t* count) {
  __shared__ int warp_count[kCompactThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  int base = 0;
  for (int64_t c0 = 0; c0 < cols; c0 += kCompactThreads) {
    const int64_t c = c0 + threadIdx.x;
    const bool flagged = c < cols && flags[c] != 0;
    const unsigned ballot = __ballot_sync(0xffffffffu, flagged);
    if (lane == 0) warp_count[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < kCompactThreads / 32; ++w) {
      before += w < warp ? warp_count[w] : 0;
      total += warp_count[w];
    }
    if (flagged) list[base + before + __popc(ballot & ((1u << lane) - 1u))] = int32_t(c);
    base += total;
    __syncthreads();  // warp_count is rewritten by the next chunk
  }
  if (threadIdx.x == 0) *count = base;
}

// ------------------------------------------------------------ linear
//
// Thread (tx, ty) = (t % 16, t / 16) owns outputs (ty + 16i, tx + 16j) of the
// 64x64 tile. Shared tiles hold 4 k-bytes per int32 word (byte b = element
// 4w + b, as __dp4a pairs them), rows padded to 17 words against bank
// conflicts.

template <typename T>
__global__ void __launch_bounds__(kThreads, 2)
    int8_linear_kernel(const int8_t* xq, int64_t kp, const float* row_stats, const T* x, const int8_t* w,
                       const float* scb, int64_t m, int64_t n, int64_t k, bool w_words, const int32_t* outlier_cols,
                       const int32_t* outlier_count, const void* bias, DType bias_dtype, void* out, DType out_dtype) {
  __shared__ int32_t xs[kTile][kStepWords + 1];  // xs[i][v] = xq[m0 + i, k0 + 4v .. +4]
  __shared__ int32_t ws[kTile][kStepWords + 1];  // ws[j][v] = CB[n0 + j, k0 + 4v .. +4] (0 past k)
  const int t = threadIdx.x, tx = t % 16, ty = t / 16;
  const int nc = outlier_count != nullptr ? *outlier_count : 0;
  for (int64_t m0 = int64_t(blockIdx.y) * kTile; m0 < m; m0 += int64_t(gridDim.y) * kTile) {
    for (int64_t n0 = int64_t(blockIdx.x) * kTile; n0 < n; n0 += int64_t(gridDim.x) * kTile) {
      int32_t acc[4][4] = {};
      for (int64_t k0 = 0; k0 < k; k0 += kStepBytes) {
        const int v = t % kStepWords;
        const int64_t kk = k0 + 4 * v;
        for (int i = t / kStepWords; i < kTile; i += kThreads / kStepWords) {
          const int64_t gm = m0 + i, gn = n0 + i;
          // xq rows are zero-padded to kp (a multiple of kStepBytes) and 4-byte aligned
          xs[i][v] = gm < m ? *reinterpret_cast<const int32_t*>(xq + gm * kp + kk) : 0;
          int32_t wv = 0;
          if (gn < n && kk < k) {
            const int8_t* src = w + gn * k + kk;
            if (w_words) {  // k % 4 == 0 and CB 4-byte aligned
              wv = __ldg(reinterpret_cast<const int32_t*>(src));
            } else {
              for (int b = 0; b < 4; ++b)
                if (kk + b < k) wv |= int32_t(uint8_t(src[b])) << (8 * b);
            }
          }
          ws[i][v] = wv;
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < kStepWords; ++u) {
          int32_t a[4], b[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) a[i] = xs[ty + 16 * i][u];
#pragma unroll
          for (int j = 0; j < 4; ++j) b[j] = ws[tx + 16 * j][u];
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] = __dp4a(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t gm = m0 + ty + 16 * i;
        if (gm >= m) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t gn = n0 + tx + 16 * j;
          if (gn >= n) continue;
          const float sc = scb[gn];
          float y = __fmul_rn(__int2float_rn(acc[i][j]), __fmul_rn(row_stats[gm], sc));
          y = __fmul_rn(y, kInv127Sq);
          if (nc > 0) {
            float o = 0.0f;
            for (int c = 0; c < nc; ++c) {
              const int64_t col = outlier_cols[c];
              const float wd = __fmul_rn(__fmul_rn(float(w[gn * k + col]), sc), kInv127);
              o = __fadd_rn(o, __fmul_rn(Elem<T>::load(x, gm * k + col), wd));
            }
            y = __fadd_rn(y, o);
          }
          if (bias != nullptr) y = __fadd_rn(y, load_any(bias, bias_dtype, gn));
          store_any(out, out_dtype, gm * n + gn, y);
        }
      }
    }
  }
}

// ------------------------------------------------------------ grad input

template <typename T>
__global__ void __launch_bounds__(kThreads) int8_grad_kernel(const T* dy, const int8_t* w, const float* scb, int64_t m,
                                                             int64_t n, int64_t k, void* dx, DType dx_dtype) {
  __shared__ float gs[kStep][kTile + 1];  // gs[rr][i] = g[m0 + i, r0 + rr]
  __shared__ float ws[kStep][kTile + 1];  // ws[rr][j] = float(CB[r0 + rr, c0 + j])
  const int t = threadIdx.x, tx = t % 16, ty = t / 16;
  for (int64_t m0 = int64_t(blockIdx.y) * kTile; m0 < m; m0 += int64_t(gridDim.y) * kTile) {
    for (int64_t c0 = int64_t(blockIdx.x) * kTile; c0 < k; c0 += int64_t(gridDim.x) * kTile) {
      float acc[4][4] = {};
      for (int64_t r0 = 0; r0 < n; r0 += kStep) {
        {
          const int rr = t % kStep;
          const int64_t gr = r0 + rr;
          const float col_scale = gr < n ? __fmul_rn(scb[gr], kInv127) : 0.0f;
          for (int i = t / kStep; i < kTile; i += kThreads / kStep) {
            const int64_t gm = m0 + i;
            gs[rr][i] = (gm < m && gr < n) ? __fmul_rn(Elem<T>::load(dy, gm * n + gr), col_scale) : 0.0f;
          }
        }
        for (int e = t; e < kStep * kTile; e += kThreads) {
          const int j = e % kTile, rr = e / kTile;
          const int64_t gr = r0 + rr, gc = c0 + j;
          ws[rr][j] = (gr < n && gc < k) ? float(w[gr * k + gc]) : 0.0f;
        }
        __syncthreads();
        // Rows past n add fp32(0 * 0) = +0, which leaves every sum unchanged
        // (a sum that starts at +0 is never -0 in round-to-nearest).
#pragma unroll 8
        for (int rr = 0; rr < kStep; ++rr) {
          float a[4], b[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) a[i] = gs[rr][ty + 16 * i];
#pragma unroll
          for (int j = 0; j < 4; ++j) b[j] = ws[rr][tx + 16 * j];
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] = __fadd_rn(acc[i][j], __fmul_rn(a[i], b[j]));
        }
        __syncthreads();
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t gm = m0 + ty + 16 * i;
        if (gm >= m) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t gc = c0 + tx + 16 * j;
          if (gc < k) store_any(dx, dx_dtype, gm * k + gc, acc[i][j]);
        }
      }
    }
  }
}

// ------------------------------------------------------------ host

Status cuda_status(cudaError_t e, const char* op, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  (void)cudaGetLastError();  // not sticky: leave no stale error for the next call
  return {kInternal, std::string(op) + ": " + what + " failed: " + cudaGetErrorString(e)};
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

dim3 tiled_grid(int64_t cols, int64_t rows) {
  return dim3(unsigned(std::min(ceil_div(cols, kTile), kMaxGridX)),
              unsigned(std::min(ceil_div(rows, kTile), kMaxGridY)));
}

// Temporary device memory: one cudaMallocAsync carved into 256-byte aligned parts.
class Scratch {
 public:
  explicit Scratch(cudaStream_t st) : st_(st) {}
  int64_t add(int64_t bytes) {
    const int64_t at = size_;
    size_ += ceil_div(std::max<int64_t>(bytes, 1), 256) * 256;
    return at;
  }
  Status alloc(const char* op) {
    return cuda_status(cudaMallocAsync(reinterpret_cast<void**>(&base_), size_t(size_), st_), op,
                       ("cudaMallocAsync of " + std::to_string(size_) + " bytes").c_str());
  }
  template <typename P>
  P* at(int64_t offset) const {
    return reinterpret_cast<P*>(base_ + offset);
  }
  // Frees the memory (stream-ordered); the first error wins.
  Status release(Status s, const char* op) {
    if (base_ == nullptr) return s;
    const Status f = cuda_status(cudaFreeAsync(base_, st_), op, "cudaFreeAsync");
    base_ = nullptr;
    return s.ok() ? f : s;
  }

 private:
  cudaStream_t st_;
  char* base_ = nullptr;
  int64_t size_ = 0;
};

// Enqueues the row quantization of x [rows, cols] into q (row stride
// q_stride), row_stats and flags ([cols], required when threshold > 0; when
// given it is always written, zeros for threshold 0).
Status quantize_rows_launch(const void* x, DType dtype, int64_t rows, int64_t cols, float threshold, uint8_t* flags,
                            int8_t* q, int64_t q_stride, float* row_stats, cudaStream_t st, const char* op) {
  if (flags != nullptr) {
    Status s = cuda_status(cudaMemsetAsync(flags, 0, size_t(cols), st), op, "cudaMemsetAsync");
    if (!s.ok()) return s;
  }
  const bool outliers = threshold > 0.0f;
  Q4_DTYPE_SWITCH(dtype, T, [&] {
    const T* xt = static_cast<const T*>(x);
    if (outliers) {
      const int64_t rows_per_cta = std::max(kOutlierRowsPerCta, ceil_div(rows, kMaxGridY));
      const dim3 grid(unsigned(ceil_div(cols, kThreads)), unsigned(ceil_div(rows, rows_per_cta)));
      outlier_cols_kernel<T><<<grid, kThreads, 0, st>>>(xt, rows, cols, threshold, rows_per_cta, flags);
    }
    const int grid = int(std::min(rows, kMaxGridX));
    quantize_rows_kernel<T>
        <<<grid, kThreads, 0, st>>>(xt, rows, cols, threshold, outliers ? flags : nullptr, q, q_stride, row_stats);
  });
  return launch_status(op);
}

}  // namespace

Status int8_quantize_rows(const Int8QuantizeRowsParams& p, void* stream) {
  Status s = validate(p);
  if (!s.ok()) return s;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const char* op = "int8_quantize_rows";
  Scratch scratch(st);
  uint8_t* flags = p.outlier_cols;
  if (flags == nullptr && p.threshold > 0.0f) {
    const int64_t at = scratch.add(p.cols);
    s = scratch.alloc(op);
    if (!s.ok()) return s;
    flags = scratch.at<uint8_t>(at);
  }
  s = quantize_rows_launch(p.x, p.x_dtype, p.rows, p.cols, p.threshold, flags, p.q, p.cols, p.row_stats, st, op);
  return scratch.release(s, op);
}

Status int8_linear(const Int8LinearParams& p, void* stream) {
  Status s = validate(p);
  if (!s.ok()) return s;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const char* op = "int8_linear";
  const bool outliers = p.threshold > 0.0f;
  const int64_t kp = ceil_div(p.k, kStepBytes) * kStepBytes;
  Scratch scratch(st);
  const int64_t at_xq = scratch.add(p.m * kp);
  const int64_t at_stats = scratch.add(p.m * int64_t(sizeof(float)));
  const int64_t at_flags = outliers ? scratch.add(p.k) : 0;
  const int64_t at_list = outliers ? scratch.add(p.k * int64_t(sizeof(int32_t))) : 0;
  const int64_t at_count = outliers ? scratch.add(int64_t(sizeof(int32_t))) : 0;
  s = scratch.alloc(op);
  if (!s.ok()) return s;
  int8_t* xq = scratch.at<int8_t>(at_xq);
  float* row_stats = scratch.at<float>(at_stats);
  uint8_t* flags = outliers ? scratch.at<uint8_t>(at_flags) : nullptr;
  int32_t* list = outliers ? scratch.at<int32_t>(at_list) : nullptr;
  int32_t* count = outliers ? scratch.at<int32_t>(at_count) : nullptr;

  s = quantize_rows_launch(p.x, p.x_dtype, p.m, p.k, p.threshold, flags, xq, kp, row_stats, st, op);
  if (s.ok()) {
    if (outliers) compact_cols_kernel<<<1, kCompactThreads, 0, st>>>(flags, p.k, list, count);
    const bool w_words = p.k % 4 == 0 && aligned(p.weight, 4);
    Q4_DTYPE_SWITCH(p.x_dtype, T, [&] {
      int8_linear_kernel<T><<<tiled_grid(p.n, p.m), kThreads, 0, st>>>(
          xq, kp, row_stats, static_cast<const T*>(p.x), p.weight, p.weight_scale, p.m, p.n, p.k, w_words, list, count,
          p.bias, p.bias_dtype, p.out, p.out_dtype);
    });
    s = launch_status(op);
  }
  return scratch.release(s, op);
}

Status int8_grad_input(const Int8GradInputParams& p, void* stream) {
  Status s = validate(p);
  if (!s.ok()) return s;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  Q4_DTYPE_SWITCH(p.grad_out_dtype, T, [&] {
    int8_grad_kernel<T><<<tiled_grid(p.k, p.m), kThreads, 0, st>>>(
        static_cast<const T*>(p.grad_out), p.weight, p.weight_scale, p.m, p.n, p.k, p.grad_input, p.grad_input_dtype);
  });
  return launch_status("int8_grad_input");
}

}  // namespace cuda
}  // namespace q4
