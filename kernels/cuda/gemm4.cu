// Fused 4-bit matmuls on CUDA: Y = X . W^T (+ bias) and dX = dY . W, with W
// [n, k] packed 4-bit; the CUDA twin of cpu/gemm4.cc. The dequantized W is
// never materialised.
//
// Element (r, c) of W is flat index f = r*k + c of the packed tensor: nibble
// f (high nibble of byte f/2 when f is even), block f / blocksize. Its value
// is decode(nibble) * scale(block) with scale = absmax[block] or, nested,
// fp32(code[q[block]] * absmax2[block / 256]) + offset (each step rounded, as
// the CPU decodes it). Products and sums are fp32 (fmaf) in an order that
// differs from the CPU's, so results agree within fp32 rounding, not bitwise.
//
// Paths (m = rows of X or dY):
//   gemv       m <= 8, k % 32 == 0, packed and X 16-byte aligned: a warp per
//              W row streams it once in 16-byte loads (32 nibbles, which lie
//              in one block: blocks are >= 32 elements and the load starts at
//              f % 32 == 0). Codes are decoded unscaled in registers, each
//              lane's 32-element partial sums are scaled once, and the lanes
//              reduce with shuffles.
//   grad gemv  m <= 8, k % 8 == 0, packed 4-byte aligned: a thread owns 8 dX
//              columns (one 4-byte word of each W row; a warp reads 128
//              contiguous bytes), coefficient dY[j, r] * scale per word. The 8
//              warps of a CTA split the W rows and reduce in shared memory;
//              for parallelism the rows are also split across CTAs into an
//              fp32 workspace that a second kernel sums.
//   tiled      otherwise: 64x64 output tiles, the reduction in steps of 32;
//              each step decodes its W tile into shared memory once (8
//              nibbles per 4-byte word when k % 8 == 0 and packed is 4-byte
//              aligned, else element by element) and all 64 rows of X / dY in
//              the tile reuse it; 4x4 accumulators per thread.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "common.cuh"
#include "q4/dynamic8.h"
#include "q4/kernels.h"
#include "q4/quant4.h"
#include "q4/w4a8.h"

namespace q4 {
namespace cuda {
namespace {

constexpr int kWarps = 8;  // every kernel here runs 8 warps per CTA
constexpr int kThreads = kWarps * 32;
constexpr int64_t kGemvMaxRows = 8;            // largest m served by the gemv paths
constexpr int kTile = 64;                      // tiled: output tile edge
constexpr int kStep = 32;                      // tiled: reduction elements per shared-memory tile
constexpr int kGradCols = 8 * 32;              // grad gemv: dX columns per CTA (8 per lane)
constexpr int64_t kMinSplitRows = 8 * kWarps;  // grad gemv: fewest W rows per CTA
constexpr int kNestedShift = 8;
static_assert((int64_t(1) << kNestedShift) == kNestedBlocksize, "nested block = 256 absmax values");
static_assert(kMinBlocksize % 32 == 0, "a 32-element gemv chunk lies in one block");
static_assert(kTile * kStep / 8 == kThreads, "tiled forward: one 8-nibble word per thread per W tile");
static_assert(kStep * kTile / 8 == kThreads, "tiled backward: one 8-nibble word per thread per W tile");

// The block scales as a kernel receives them (device pointers). Plain:
// absmax. Nested: codes, absmax2, book (null = dynamic map) and the offset
// from offset_ptr (device memory) when set, else `offset`.
struct ScalesArg {
  const float* absmax;
  const uint8_t* codes;
  const float* absmax2;
  const float* book;
  const float* offset_ptr;
  float offset;
};

ScalesArg scales_arg(const Absmax4& a) {
  ScalesArg s{};
  if (a.nested()) {
    s.codes = a.nested_codes;
    s.absmax2 = a.nested_absmax;
    s.book = a.nested_code;
    s.offset_ptr = a.nested_offset_ptr;
    s.offset = a.nested_offset;
  } else {
    s.absmax = a.absmax;
  }
  return s;
}

// Scale of block b; the nested book lives in shared memory.
struct Scales {
  const float* absmax;
  const uint8_t* codes;
  const float* absmax2;
  const float* book;
  float offset;
  __device__ __forceinline__ float operator()(int64_t b) const {
    if (codes == nullptr) return __ldg(absmax + b);
    return __fadd_rn(__fmul_rn(book[__ldg(codes + b)], __ldg(absmax2 + (b >> kNestedShift))), offset);
  }
};

// Fills the CTA's code table (and nested book); a barrier for the CTA.
template <QuantType QT>
__device__ Scales setup_scales(const ScalesArg& a, float* table, float* book) {
  for (int i = threadIdx.x; i < 16; i += blockDim.x) table[i] = Code4<QT>::decode(i);
  if (a.codes != nullptr)
    for (int i = threadIdx.x; i < dynamic8::kCodes; i += blockDim.x) book[i] = a.book ? a.book[i] : kDynamic8.v[i];
  __syncthreads();
  Scales s{a.absmax, a.codes, a.absmax2, book, 0.0f};
  if (a.codes != nullptr) s.offset = a.offset_ptr ? *a.offset_ptr : a.offset;
  return s;
}

// Nibble of element e (0..7) of a 4-byte word read at byte f/2, f % 8 == 0:
// byte b (bits 8b..8b+7) holds element 2b in its high and 2b+1 in its low nibble.
__device__ __forceinline__ int nibble8(uint32_t word, int e) {
  return int(word >> (8 * (e >> 1) + ((e & 1) ? 0 : 4))) & 15;
}

__device__ __forceinline__ int nibble_at(const uint8_t* packed, int64_t f) {
  const uint8_t byte = __ldg(packed + (f >> 1));
  return (f & 1) ? unpack_odd(byte) : unpack_even(byte);
}

// 8 consecutive elements at a 16-byte aligned address, widened to fp32.
template <typename T>
struct Load8 {  // f16_t / bf16_t: one 16-byte load, element 2i in the low half of word i
  __device__ __forceinline__ static void run(const T* p, float* v) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const T lo{uint16_t(w[i] & 0xffffu)}, hi{uint16_t(w[i] >> 16)};
      v[2 * i] = Elem<T>::load(&lo, 0);
      v[2 * i + 1] = Elem<T>::load(&hi, 0);
    }
  }
};
template <>
struct Load8<float> {
  __device__ __forceinline__ static void run(const float* p, float* v) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  }
};

// ------------------------------------------------------------------ gemv

// Rows [0, rows) of X (rows <= MR) against every W row; warp per W row.
template <QuantType QT, typename T, int MR>
__global__ void __launch_bounds__(kThreads)
    gemv_kernel(const T* x, int rows, int64_t n, int64_t k, const uint8_t* packed, ScalesArg sa, int log2_bs,
                const void* bias, DType bias_dtype, void* out, DType out_dtype) {
  __shared__ float table[16];
  __shared__ float book[dynamic8::kCodes];
  const Scales scales = setup_scales<QT>(sa, table, book);
  const int lane = threadIdx.x & 31;
  const int64_t chunks = k >> 5;  // 32-element chunks per W row
  // r is warp-uniform, so every lane takes part in the shuffles
  for (int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; r < n; r += int64_t(gridDim.x) * kWarps) {
    const uint4* wr = reinterpret_cast<const uint4*>(packed + ((r * k) >> 1));
    float acc[MR];
#pragma unroll
    for (int j = 0; j < MR; ++j) acc[j] = 0.0f;
    for (int64_t ch = lane; ch < chunks; ch += 32) {
      const uint4 w = __ldg(wr + ch);
      const float s = scales((r * k + (ch << 5)) >> log2_bs);
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
      float part[MR];
#pragma unroll
      for (int j = 0; j < MR; ++j) part[j] = 0.0f;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float code[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) code[e] = table[nibble8(words[q], e)];
#pragma unroll
        for (int j = 0; j < MR; ++j) {
          if (j < rows) {
            float xv[8];
            Load8<T>::run(x + j * k + (ch << 5) + 8 * q, xv);
#pragma unroll
            for (int e = 0; e < 8; ++e) part[j] = fmaf(code[e], xv[e], part[j]);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < MR; ++j) acc[j] = fmaf(part[j], s, acc[j]);
    }
#pragma unroll
    for (int j = 0; j < MR; ++j)
      for (int off = 16; off > 0; off >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], off);
    if (lane == 0) {
      const float b = bias != nullptr ? load_any(bias, bias_dtype, r) : 0.0f;
#pragma unroll
      for (int j = 0; j < MR; ++j)
        if (j < rows) store_any(out, out_dtype, j * n + r, acc[j] + b);
    }
  }
}

// dX partial sums over W rows [split * rows_per_split, ...) for rows [0, rows)
// of dY (rows <= MR): into partial[split][rows][k] when partial is set, else
// straight into dX.
template <QuantType QT, typename T, int MR>
__global__ void __launch_bounds__(kThreads)
    grad_gemv_kernel(const T* dy, int rows, int64_t n, int64_t k, const uint8_t* packed, ScalesArg sa, int log2_bs,
                     int64_t rows_per_split, float* partial, void* dx, DType dx_dtype) {
  __shared__ float table[16];
  __shared__ float book[dynamic8::kCodes];
  __shared__ float red[kWarps][kGradCols];  // red[warp][8 * lane + e]
  const Scales scales = setup_scales<QT>(sa, table, book);
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int64_t c0 = int64_t(blockIdx.x) * kGradCols, c = c0 + 8 * lane;
  const int64_t r_begin = int64_t(blockIdx.y) * rows_per_split, r_end = min(n, r_begin + rows_per_split);
  float acc[MR][8];
#pragma unroll
  for (int j = 0; j < MR; ++j)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[j][e] = 0.0f;
  if (c < k) {
    for (int64_t r = r_begin + warp; r < r_end; r += kWarps) {
      const int64_t f = r * k + c;  // f % 8 == 0: 8 nibbles of one block in one word
      const uint32_t word = __ldg(reinterpret_cast<const uint32_t*>(packed + (f >> 1)));
      const float s = scales(f >> log2_bs);
      float code[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) code[e] = table[nibble8(word, e)];
#pragma unroll
      for (int j = 0; j < MR; ++j) {
        if (j < rows) {
          const float coef = Elem<T>::load(dy, j * n + r) * s;
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[j][e] = fmaf(coef, code[e], acc[j][e]);
        }
      }
    }
  }
  const int64_t col = c0 + threadIdx.x;
#pragma unroll
  for (int j = 0; j < MR; ++j) {
    if (j < rows) {  // uniform across the CTA
#pragma unroll
      for (int e = 0; e < 8; ++e) red[warp][8 * lane + e] = acc[j][e];
      __syncthreads();
      if (col < k) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum += red[w][threadIdx.x];
        if (partial != nullptr)
          partial[(int64_t(blockIdx.y) * rows + j) * k + col] = sum;
        else
          store_any(dx, dx_dtype, j * k + col, sum);
      }
      __syncthreads();
    }
  }
}

// dX[i] = sum over splits of partial[split][i], i < count.
__global__ void __launch_bounds__(kThreads)
    sum_splits_kernel(const float* partial, int64_t splits, int64_t count, void* dx, DType dx_dtype) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    float sum = 0.0f;
    for (int64_t s = 0; s < splits; ++s) sum += partial[s * count + i];
    store_any(dx, dx_dtype, i, sum);
  }
}

// ------------------------------------------------------------------ tiled
//
// Thread (tx, ty) = (t % 16, t / 16) owns outputs (ty + 16i, tx + 16j) of the
// tile, i, j < 4. Shared tiles are [kStep][kTile + 1]: the padding column
// keeps the transposing stores free of bank conflicts. Padding entries (past
// m, n or k) are 0 in both operands, so a padded product adds +0.

// The X (or dY) tile: a[kk][i] = src[(r0 + i) * ld + c0 + kk], zero outside
// rows < rows_total and columns < cols_total.
template <typename T>
__device__ __forceinline__ void load_input_tile(const T* src, int64_t ld, int64_t r0, int64_t rows_total, int64_t c0,
                                                int64_t cols_total, float (*a)[kTile + 1]) {
  const int kk = threadIdx.x % 32;
  const int64_t gc = c0 + kk;
  for (int i = threadIdx.x / 32; i < kTile; i += kWarps) {
    const int64_t gr = r0 + i;
    a[kk][i] = (gr < rows_total && gc < cols_total) ? Elem<T>::load(src, gr * ld + gc) : 0.0f;
  }
}

// acc[i][j] += a[kk][ty + 16i] * b[kk][tx + 16j] over the kStep entries.
__device__ __forceinline__ void tile_fma(float (*a)[kTile + 1], float (*b)[kTile + 1], float (*acc)[4]) {
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll 8
  for (int kk = 0; kk < kStep; ++kk) {
    float av[4], bv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) av[i] = a[kk][ty + 16 * i];
#pragma unroll
    for (int j = 0; j < 4; ++j) bv[j] = b[kk][tx + 16 * j];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
  }
}

template <QuantType QT, typename T, bool kWord>
__global__ void __launch_bounds__(kThreads, 2)
    gemm_tiled_kernel(const T* x, int64_t m, int64_t n, int64_t k, const uint8_t* packed, ScalesArg sa, int log2_bs,
                      const void* bias, DType bias_dtype, void* out, DType out_dtype) {
  __shared__ float table[16];
  __shared__ float book[dynamic8::kCodes];
  __shared__ float xs[kStep][kTile + 1];  // xs[kk][i] = X[m0 + i, k0 + kk]
  __shared__ float ws[kStep][kTile + 1];  // ws[kk][j] = W[n0 + j, k0 + kk]
  const Scales scales = setup_scales<QT>(sa, table, book);
  const int t = threadIdx.x, tx = t % 16, ty = t / 16;
  for (int64_t m0 = int64_t(blockIdx.y) * kTile; m0 < m; m0 += int64_t(gridDim.y) * kTile) {
    for (int64_t n0 = int64_t(blockIdx.x) * kTile; n0 < n; n0 += int64_t(gridDim.x) * kTile) {
      float acc[4][4] = {};
      for (int64_t k0 = 0; k0 < k; k0 += kStep) {
        load_input_tile(x, k, m0, m, k0, k, xs);
        if (kWord) {
          // 64 W rows x 4 words (8 elements each) of the step
          const int g = t % 4, j = t / 4;
          const int64_t gn = n0 + j, gk = k0 + 8 * g;
          float v[8] = {};
          if (gn < n && gk < k) {  // k % 8 == 0: the whole word is in row gn
            const int64_t f = gn * k + gk;
            const uint32_t word = __ldg(reinterpret_cast<const uint32_t*>(packed + (f >> 1)));
            const float s = scales(f >> log2_bs);
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = __fmul_rn(table[nibble8(word, e)], s);
          }
#pragma unroll
          for (int e = 0; e < 8; ++e) ws[8 * g + e][j] = v[e];
        } else {
          for (int e = t; e < kTile * kStep; e += kThreads) {
            const int kk = e % kStep, j = e / kStep;
            const int64_t gn = n0 + j, gk = k0 + kk;
            float v = 0.0f;
            if (gn < n && gk < k) {
              const int64_t f = gn * k + gk;
              v = __fmul_rn(table[nibble_at(packed, f)], scales(f >> log2_bs));
            }
            ws[kk][j] = v;
          }
        }
        __syncthreads();
        tile_fma(xs, ws, acc);
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
          const float b = bias != nullptr ? load_any(bias, bias_dtype, gn) : 0.0f;
          store_any(out, out_dtype, gm * n + gn, acc[i][j] + b);
        }
      }
    }
  }
}

template <QuantType QT, typename T, bool kWord>
__global__ void __launch_bounds__(kThreads)
    grad_tiled_kernel(const T* dy, int64_t m, int64_t n, int64_t k, const uint8_t* packed, ScalesArg sa, int log2_bs,
                      void* dx, DType dx_dtype) {
  __shared__ float table[16];
  __shared__ float book[dynamic8::kCodes];
  __shared__ float ys[kStep][kTile + 1];  // ys[rr][i] = dY[m0 + i, r0 + rr]
  __shared__ float ws[kStep][kTile + 1];  // ws[rr][j] = W[r0 + rr, c0 + j]
  const Scales scales = setup_scales<QT>(sa, table, book);
  const int t = threadIdx.x, tx = t % 16, ty = t / 16;
  for (int64_t m0 = int64_t(blockIdx.y) * kTile; m0 < m; m0 += int64_t(gridDim.y) * kTile) {
    for (int64_t c0 = int64_t(blockIdx.x) * kTile; c0 < k; c0 += int64_t(gridDim.x) * kTile) {
      float acc[4][4] = {};
      for (int64_t r0 = 0; r0 < n; r0 += kStep) {
        load_input_tile(dy, n, m0, m, r0, n, ys);
        if (kWord) {
          // 32 W rows x 8 words (8 columns each) of the tile
          const int g = t % 8, rr = t / 8;
          const int64_t gr = r0 + rr, gc = c0 + 8 * g;
          float v[8] = {};
          if (gr < n && gc < k) {  // k % 8 == 0: the whole word is in row gr
            const int64_t f = gr * k + gc;
            const uint32_t word = __ldg(reinterpret_cast<const uint32_t*>(packed + (f >> 1)));
            const float s = scales(f >> log2_bs);
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = __fmul_rn(table[nibble8(word, e)], s);
          }
#pragma unroll
          for (int e = 0; e < 8; ++e) ws[rr][8 * g + e] = v[e];
        } else {
          for (int e = t; e < kStep * kTile; e += kThreads) {
            const int j = e % kTile, rr = e / kTile;
            const int64_t gr = r0 + rr, gc = c0 + j;
            float v = 0.0f;
            if (gr < n && gc < k) {
              const int64_t f = gr * k + gc;
              v = __fmul_rn(table[nibble_at(packed, f)], scales(f >> log2_bs));
            }
            ws[rr][j] = v;
          }
        }
        __syncthreads();
        tile_fma(ys, ws, acc);
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

// ------------------------------------------------------------------ host

int log2_of(int64_t pow2) { return __builtin_ctzll(static_cast<unsigned long long>(pow2)); }

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

int sm_count() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    (void)cudaGetLastError();  // the launch that follows reports a missing device
    return 1;
  }
  return sms;
}

// f(std::integral_constant<int, MR>) with the smallest MR in {1, 2, 4, 8} >= rows.
template <class F>
void rows_switch(int64_t rows, F f) {
  if (rows <= 1)
    f(std::integral_constant<int, 1>{});
  else if (rows <= 2)
    f(std::integral_constant<int, 2>{});
  else if (rows <= 4)
    f(std::integral_constant<int, 4>{});
  else
    f(std::integral_constant<int, 8>{});
}
static_assert(kGemvMaxRows == 8, "rows_switch covers m <= 8");

dim3 tiled_grid(int64_t cols, int64_t rows) {
  return dim3(unsigned(std::min(ceil_div(cols, kTile), kMaxGridX)),
              unsigned(std::min(ceil_div(rows, kTile), kMaxGridY)));
}

}  // namespace

Status gemm_4bit(const Gemm4bitParams& p, void* stream) {
  // A nested code book is device memory: its order is not checked here.
  Status s = validate(p);
  if (!s.ok()) return s;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const ScalesArg sa = scales_arg(p.scales);
  const int log2_bs = log2_of(p.blocksize);
  const bool gemv = p.m <= kGemvMaxRows && p.k % 32 == 0 && aligned(p.packed, 16) && aligned(p.x, 16);
  const bool word = p.k % 8 == 0 && aligned(p.packed, 4);
  Q4_QUANT_SWITCH(p.quant_type, QT, [&] {
    Q4_DTYPE_SWITCH(p.x_dtype, T, [&] {
      const T* x = static_cast<const T*>(p.x);
      if (gemv) {
        const int grid = int(std::min(ceil_div(p.n, kWarps), kMaxGridX));
        rows_switch(p.m, [&](auto mr) {
          gemv_kernel<QT, T, decltype(mr)::value><<<grid, kThreads, 0, st>>>(
              x, int(p.m), p.n, p.k, p.packed, sa, log2_bs, p.bias, p.bias_dtype, p.out, p.out_dtype);
        });
      } else if (word) {
        gemm_tiled_kernel<QT, T, true><<<tiled_grid(p.n, p.m), kThreads, 0, st>>>(
            x, p.m, p.n, p.k, p.packed, sa, log2_bs, p.bias, p.bias_dtype, p.out, p.out_dtype);
      } else {
        gemm_tiled_kernel<QT, T, false><<<tiled_grid(p.n, p.m), kThreads, 0, st>>>(
            x, p.m, p.n, p.k, p.packed, sa, log2_bs, p.bias, p.bias_dtype, p.out, p.out_dtype);
      }
    });
  });
  return launch_status("gemm_4bit");
}

Status gemm_4bit_grad_input(const Gemm4bitGradInputParams& p, void* stream) {
  Status s = validate(p);
  if (!s.ok()) return s;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const ScalesArg sa = scales_arg(p.scales);
  const int log2_bs = log2_of(p.blocksize);
  const bool word = p.k % 8 == 0 && aligned(p.packed, 4);
  if (p.m > kGemvMaxRows || !word) {
    Q4_QUANT_SWITCH(p.quant_type, QT, [&] {
      Q4_DTYPE_SWITCH(p.grad_out_dtype, T, [&] {
        const T* dy = static_cast<const T*>(p.grad_out);
        if (word)
          grad_tiled_kernel<QT, T, true><<<tiled_grid(p.k, p.m), kThreads, 0, st>>>(
              dy, p.m, p.n, p.k, p.packed, sa, log2_bs, p.grad_input, p.grad_input_dtype);
        else
          grad_tiled_kernel<QT, T, false><<<tiled_grid(p.k, p.m), kThreads, 0, st>>>(
              dy, p.m, p.n, p.k, p.packed, sa, log2_bs, p.grad_input, p.grad_input_dtype);
      });
    });
    return launch_status("gemm_4bit_grad_input");
  }

  // gemv: split the W rows across CTAs until the grid has a few CTAs per SM
  const int64_t col_ctas = ceil_div(p.k, kGradCols);
  const int64_t want = ceil_div(4 * int64_t(sm_count()), col_ctas);
  const int64_t splits_max = std::max<int64_t>(1, std::min({want, ceil_div(p.n, kMinSplitRows), kMaxGridY}));
  const int64_t rows_per_split = ceil_div(p.n, splits_max);
  const int64_t splits = ceil_div(p.n, rows_per_split);
  float* partial = nullptr;
  if (splits > 1) {
    const size_t bytes = size_t(splits * p.m * p.k) * sizeof(float);
    const cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&partial), bytes, st);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return {kInternal, "gemm_4bit_grad_input: cudaMallocAsync of " + std::to_string(bytes) +
                             " bytes failed: " + cudaGetErrorString(e)};
    }
  }
  Q4_QUANT_SWITCH(p.quant_type, QT, [&] {
    Q4_DTYPE_SWITCH(p.grad_out_dtype, T, [&] {
      rows_switch(p.m, [&](auto mr) {
        grad_gemv_kernel<QT, T, decltype(mr)::value><<<dim3(unsigned(col_ctas), unsigned(splits)), kThreads, 0, st>>>(
            static_cast<const T*>(p.grad_out), int(p.m), p.n, p.k, p.packed, sa, log2_bs, rows_per_split, partial,
            p.grad_input, p.grad_input_dtype);
      });
    });
  });
  if (partial != nullptr) {
    const int64_t count = p.m * p.k;
    const int grid = int(std::min(ceil_div(count, kThreads), kMaxGridX));
    sum_splits_kernel<<<grid, kThreads, 0, st>>>(partial, splits, count, p.grad_input, p.grad_input_dtype);
  }
  s = launch_status("gemm_4bit_grad_input");
  if (partial != nullptr) {
    const cudaError_t e = cudaFreeAsync(partial, st);
    if (e != cudaSuccess && s.ok())
      s = {kInternal, std::string("gemm_4bit_grad_input: cudaFreeAsync failed: ") + cudaGetErrorString(e)};
  }
  return s;
}

namespace {

// ------------------------------------------------------------------ W4A8
//
// The contract of q4/w4a8.h, one thread per activation block (quantization)
// and one per output (the matmul): every operation is the contract's, in its
// order, rounded explicitly (__fmul_rn / __fadd_rn), so the
// result is the CPU's bit for bit. Simple, not tuned.

template <typename T>
__global__ void w4a8_quantize_kernel(const T* x, int64_t m, int64_t k, int64_t ba, int8_t* q, float* sx) {
  const int64_t nb = k / ba;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < m * nb; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c0 = (i / nb) * k + (i % nb) * ba;
    float amax = 0.0f;
    bool nan = false;
    for (int64_t j = 0; j < ba; ++j) {
      const float v = Elem<T>::load(x, c0 + j);
      nan |= !(v == v);
      amax = fmaxf(amax, fabsf(v));
    }
    const w4a8::ActScale s = w4a8::act_scale(nan ? __int_as_float(0x7fc00000) : amax);
    sx[i] = s.sx;
    for (int64_t j = 0; j < ba; ++j)
      q[c0 + j] = s.inv == 0.0f ? int8_t(0) : w4a8::act_quantize(Elem<T>::load(x, c0 + j), s.inv);
  }
}

template <QuantType QT>
__global__ void w4a8_gemm_kernel(const int8_t* q, const float* sx, int64_t m, int64_t n, int64_t k, int64_t ba,
                                 const uint8_t* packed, ScalesArg sa, int log2_bs, const void* bias, DType bias_dtype,
                                 void* out, DType out_dtype) {
  __shared__ float table[16];
  __shared__ float book[dynamic8::kCodes];
  __shared__ int table8[16];
  for (int i = threadIdx.x; i < 16; i += blockDim.x) table8[i] = w4a8::table8<QT>(i);
  const Scales scales = setup_scales<QT>(sa, table, book);
  const int64_t nb = k / ba;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < m * n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / n, r = i % n;
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t f0 = r * k + b * ba;
      const int8_t* qb = q + row * k + b * ba;
      int32_t isum = 0;
      for (int64_t j = 0; j < ba; ++j) isum += int32_t(qb[j]) * table8[nibble_at(packed, f0 + j)];
      const float sw = __fmul_rn(scales(f0 >> log2_bs), w4a8::inv_table_scale<QT>());
      acc = __fadd_rn(acc, __fmul_rn(float(isum), __fmul_rn(sx[row * nb + b], sw)));
    }
    const float bv = bias == nullptr ? 0.0f : load_any(bias, bias_dtype, r);
    store_any(out, out_dtype, i, __fadd_rn(acc, bv));
  }
}

}  // namespace

Status gemm_4bit_w4a8(const Gemm4bitParams& p, void* stream) {
  Status s = validate_w4a8(p);
  if (!s.ok()) return s;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int64_t ba = w4a8::act_block(p.blocksize), nb = p.k / ba;
  const size_t q_bytes = size_t(p.m * p.k), bytes = q_bytes + size_t(p.m * nb) * sizeof(float) + 16;
  char* work = nullptr;
  const cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&work), bytes, st);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return {kInternal,
            "gemm_4bit_w4a8: cudaMallocAsync of " + std::to_string(bytes) + " bytes failed: " + cudaGetErrorString(e)};
  }
  int8_t* q = reinterpret_cast<int8_t*>(work);
  float* sx = reinterpret_cast<float*>(work + (q_bytes + 15) / 16 * 16);
  Q4_DTYPE_SWITCH(p.x_dtype, T, [&] {
    const int grid = int(std::min(ceil_div(p.m * nb, kThreads), kMaxGridX));
    w4a8_quantize_kernel<T><<<grid, kThreads, 0, st>>>(static_cast<const T*>(p.x), p.m, p.k, ba, q, sx);
  });
  Q4_QUANT_SWITCH(p.quant_type, QT, [&] {
    const int grid = int(std::min(ceil_div(p.m * p.n, kThreads), kMaxGridX));
    w4a8_gemm_kernel<QT><<<grid, kThreads, 0, st>>>(q, sx, p.m, p.n, p.k, ba, p.packed, scales_arg(p.scales),
                                                    log2_of(p.blocksize), p.bias, p.bias_dtype, p.out, p.out_dtype);
  });
  s = launch_status("gemm_4bit_w4a8");
  const cudaError_t f = cudaFreeAsync(work, st);
  if (f != cudaSuccess && s.ok())
    s = {kInternal, std::string("gemm_4bit_w4a8: cudaFreeAsync failed: ") + cudaGetErrorString(f)};
  return s;
}

}  // namespace cuda
}  // namespace q4
