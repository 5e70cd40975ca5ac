// AVX2 + FMA + F16C kernels of the fused 4-bit matmuls (fp32 compute, the
// bit-exact fp32 contract of q4/kernels.h). Served shapes: k % 8 == 0 (rows
// start on whole bytes and 8-element groups never straddle a block).
//
// Paths:
//   gemv   (m <= 4):  one pass over W per call; for each W row the nibbles are
//                     looked up unscaled, multiplied into up to 4 x rows, and
//                     each block's partial sum is scaled once (the scale is
//                     factored out of the inner loop).
//   tiled  (m > 4):   X is packed into fp32 panels of 8 rows ([k][8]); tiles of
//                     6 W rows x 256 columns are decoded once and reused by
//                     every panel in a 6x(2x8) register-blocked FMA kernel.
//   grad input:       strips of 16 columns of W (x 256 rows) are decoded once
//                     and reused by every group of 6 dY rows (6x16 registers).
#include <algorithm>
#include <cstring>

#include "../../dispatch.h"
#include "../../gemm4_common.h"
#include "../../parallel.h"
#include "../../rows.h"
#include "../../simd_avx2.h"
#include "../prefetch.h"
#include "../unit.h"
#include "q4/kernels.h"
#include "q4/quant4.h"

Q4_UNIT_BEGIN(avx2)

namespace q4 {
namespace cpu {
namespace avx2 {
namespace {

using namespace gemm4;  // NOLINT: the shared pieces of every gemm4 unit

// The 8 nibbles of W elements [f, f+8) (f % 8 == 0) as int32 lanes: lane i
// holds nibble f+i in bits 0..3 (for the permute) and, in `sel`, bit 3 of that
// nibble moved to bit 31 (for the blend).
struct Nibbles8 {
  __m256i idx, sel;
};

Nibbles8 load_nibbles8(const uint8_t* packed, int64_t f) {
  int32_t word;
  memcpy(&word, packed + (f >> 1), 4);
  const __m256i v = _mm256_set1_epi32(word);
  // byte j holds elements 2j (high nibble, bits 8j+4..) and 2j+1 (low nibble, bits 8j..)
  const __m256i right = _mm256_setr_epi32(4, 0, 12, 8, 20, 16, 28, 24);
  const __m256i left = _mm256_setr_epi32(24, 28, 16, 20, 8, 12, 0, 4);
  return {_mm256_srlv_epi32(v, right), _mm256_sllv_epi32(v, left)};
}

struct Table16 {
  __m256 lo, hi;
};

template <QuantType QT>
Table16 code_table() {
  alignas(32) float t[16];
  for (int q = 0; q < 16; ++q) t[q] = Code4<QT>::decode(q);
  return {_mm256_load_ps(t), _mm256_load_ps(t + 8)};
}

__m256 lookup(const Table16& t, const Nibbles8& nb) {
  const __m256 lo = _mm256_permutevar8x32_ps(t.lo, nb.idx);
  const __m256 hi = _mm256_permutevar8x32_ps(t.hi, nb.idx);
  return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(nb.sel));
}

// Decode W elements [f, f + len) (f % 8 == 0, len % 8 == 0) into out, scaled.
void decode_avx2(const Table16& t, const uint8_t* packed, const Scales& scales, int shift, int64_t f, int64_t len,
                 float* out) {
  int64_t i = 0;
  while (i < len) {
    const int64_t block = (f + i) >> shift;
    const int64_t end = std::min(len, ((block + 1) << shift) - f);
    const __m256 s = _mm256_set1_ps(scales(block));
    for (; i < end; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(lookup(t, load_nibbles8(packed, f + i)), s));
  }
}

// gemv: MR (1..4) rows of X against every W row. Per block segment the
// unscaled codes are multiplied into two accumulators per x row, then scaled.
template <QuantType QT, int MR>
void gemv_rows_avx2(const Gemm4bitParams& p, const float* x, const Scales& scales, int64_t m0, int64_t n0, int64_t n1) {
  const Table16 t = code_table<QT>();
  const int64_t k = p.k;
  const int shift = log2_exact(p.blocksize);
  float* row_scales = scratch(kSlotRow, (k >> shift) + 2);
  {
    for (int64_t r = n0; r < n1; ++r) {
      __m256 total[MR];
      for (int j = 0; j < MR; ++j) total[j] = _mm256_setzero_ps();
      const int64_t f0 = r * k;
      // the row's block scales first: independent loads, off the FMA chain
      const int64_t first_block = f0 >> shift, last_block = (f0 + k - 1) >> shift;
      for (int64_t b = first_block; b <= last_block; ++b) row_scales[b - first_block] = scales(b);
      int64_t c = 0;
      while (c < k) {
        const int64_t block = (f0 + c) >> shift;
        const int64_t end = std::min(k, ((block + 1) << shift) - f0);
        __m256 acc0[MR], acc1[MR];
        for (int j = 0; j < MR; ++j) acc0[j] = acc1[j] = _mm256_setzero_ps();
        for (; c + 16 <= end; c += 16) {
          const __m256 w0 = lookup(t, load_nibbles8(p.packed, f0 + c));
          const __m256 w1 = lookup(t, load_nibbles8(p.packed, f0 + c + 8));
          for (int j = 0; j < MR; ++j) {
            const float* xr = x + (m0 + j) * k + c;
            acc0[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc0[j]);
            acc1[j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc1[j]);
          }
        }
        for (; c < end; c += 8) {
          const __m256 w0 = lookup(t, load_nibbles8(p.packed, f0 + c));
          for (int j = 0; j < MR; ++j) acc0[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + (m0 + j) * k + c), acc0[j]);
        }
        const __m256 s = _mm256_set1_ps(row_scales[block - first_block]);
        for (int j = 0; j < MR; ++j) total[j] = _mm256_fmadd_ps(_mm256_add_ps(acc0[j], acc1[j]), s, total[j]);
      }
      const float bias = load_bias(p.bias, p.bias_dtype, r);
      for (int j = 0; j < MR; ++j) {
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, total[j]);
        const float sum =
            ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
        store_out(p.out, p.out_dtype, (m0 + j) * p.n + r, sum + bias);
      }
    }
  }
}

// The batch-1 gemv asks for each row's bytes this many rows ahead, into L2
// (the hardware prefetchers lose the two interleaved row streams): on the
// Zen 4 VM with Q4_ISA=avx2, two threads, 16 layers of 4096^2 cycled from
// DRAM, 1.07-1.09 -> 0.75-0.77 ms (4, 8 and 16 rows ahead alike); from L3
// 2-3% faster.
constexpr int64_t kGemv1PrefetchRows = 8;

// Batch-1 gemv for k % 64 == 0, on 64-element chunks: one 32-byte load holds
// the chunk's nibbles, dword j = elements 8j..8j+7 with element 8j+i at bit
// offset kNibbleShift[i]. Step i extracts nibble i of every dword with
// immediate shifts (no shuffle), giving elements {8j+i}; x is pre-transposed
// per chunk to match (xt[c*64 + 8i + j] = x[c*64 + 8j + i]). Lane j's block
// scale is applied once per chunk (lanes 0-3 and 4-7 differ when blocksize
// is 32). R rows share every x load.
template <QuantType QT, int R>
void gemv1_chunk_rows_avx2(const Gemm4bitParams& p, const float* xt, const Scales& scales, int64_t r0) {
  const Table16 t = code_table<QT>();
  const int64_t k = p.k, chunks = k / 64;
  const int shift = log2_exact(p.blocksize);
  __m256 total[R];
  for (int j = 0; j < R; ++j) total[j] = _mm256_setzero_ps();
  const int64_t ahead = kGemv1PrefetchRows * (k / 2);
  const bool pf = r0 + R + kGemv1PrefetchRows <= p.n;
  for (int64_t c = 0; c < chunks; ++c) {
    __m256i v[R];
    __m256 scale[R], acc0[R], acc1[R];
    for (int j = 0; j < R; ++j) {
      const int64_t f = (r0 + j) * k + c * 64;
      if (pf) prefetch_stream(p.packed + f / 2 + ahead);
      v[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.packed + f / 2));
      const float s_lo = scales(f >> shift), s_hi = scales((f + 32) >> shift);
      scale[j] = _mm256_setr_ps(s_lo, s_lo, s_lo, s_lo, s_hi, s_hi, s_hi, s_hi);
      acc0[j] = acc1[j] = _mm256_setzero_ps();
    }
    const float* xc = xt + c * 64;
#define Q4_STEP(i, right, acc)                                                                             \
  {                                                                                                        \
    const __m256 xv = _mm256_loadu_ps(xc + 8 * (i));                                                       \
    for (int j = 0; j < R; ++j) {                                                                          \
      const __m256i idx = _mm256_srli_epi32(v[j], right);                                                  \
      const __m256 sel = _mm256_castsi256_ps(_mm256_slli_epi32(v[j], 28 - (right)));                       \
      const __m256 w =                                                                                     \
          _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.lo, idx), _mm256_permutevar8x32_ps(t.hi, idx), sel); \
      acc[j] = _mm256_fmadd_ps(w, xv, acc[j]);                                                             \
    }                                                                                                      \
  }
    Q4_STEP(0, 4, acc0)
    Q4_STEP(1, 0, acc1)
    Q4_STEP(2, 12, acc0)
    Q4_STEP(3, 8, acc1)
    Q4_STEP(4, 20, acc0)
    Q4_STEP(5, 16, acc1)
    Q4_STEP(6, 28, acc0)
    Q4_STEP(7, 24, acc1)
#undef Q4_STEP
    for (int j = 0; j < R; ++j) total[j] = _mm256_fmadd_ps(_mm256_add_ps(acc0[j], acc1[j]), scale[j], total[j]);
  }
  for (int j = 0; j < R; ++j) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, total[j]);
    const float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    store_out(p.out, p.out_dtype, r0 + j, sum + load_bias(p.bias, p.bias_dtype, r0 + j));
  }
}

template <QuantType QT>
void gemv1_chunked_avx2(const Gemm4bitParams& p, const float* xt, const Scales& scales, int64_t n0, int64_t n1) {
  int64_t r = n0;
  for (; r + 2 <= n1; r += 2) gemv1_chunk_rows_avx2<QT, 2>(p, xt, scales, r);
  if (r < n1) gemv1_chunk_rows_avx2<QT, 1>(p, xt, scales, r);
}

template <QuantType QT, int MR>
void gemv_avx2(const Gemm4bitParams& p, const float* x, const Scales& scales, int64_t m0) {
  if (MR == 1 && p.m == 1 && p.k % 64 == 0) {
    float* xt = scratch(kSlotPanels, p.k);
    for (int64_t c = 0; c < p.k; c += 64)
      for (int i = 0; i < 8; ++i)
        for (int j = 0; j < 8; ++j) xt[c + 8 * i + j] = x[c + 8 * j + i];
    // even row ranges so that most rows are processed in pairs
    parallel_for(ceil_div(p.n, 2), 4,
                 [&](int64_t a, int64_t b) { gemv1_chunked_avx2<QT>(p, xt, scales, 2 * a, std::min(p.n, 2 * b)); });
    return;
  }
  parallel_for(p.n, 8, [&](int64_t n0, int64_t n1) { gemv_rows_avx2<QT, MR>(p, x, scales, m0, n0, n1); });
}

constexpr int kRowTile = 6;      // W rows per forward tile / dY rows per backward group
constexpr int64_t kChunk = 256;  // columns (forward) or rows (backward) decoded per tile

// The FMA micro-kernel of both directions: for t < len,
//   acc[i][h] += a[i*lda + t] * b_h[t*ldb .. t*ldb + 8)   (i < R rows, h < Q vectors)
// with acc[i][h] at acc_mem + (i*2 + h)*8. Forward: a = decoded W rows, b_h =
// X panels; backward: a = dY rows, b_h = the two halves of a W column strip.
template <int R, int Q>
void micro(const float* a, int64_t lda, const float* b0, const float* b1, int64_t ldb, int64_t len, float* acc_mem) {
  const float* b[2] = {b0, b1};
  __m256 acc[R][Q];
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < Q; ++h) acc[i][h] = _mm256_loadu_ps(acc_mem + (i * 2 + h) * 8);
  for (int64_t t = 0; t < len; ++t) {
    __m256 bv[Q];
    for (int h = 0; h < Q; ++h) bv[h] = _mm256_loadu_ps(b[h] + t * ldb);
    for (int i = 0; i < R; ++i) {
      const __m256 w = _mm256_broadcast_ss(a + i * lda + t);
      for (int h = 0; h < Q; ++h) acc[i][h] = _mm256_fmadd_ps(w, bv[h], acc[i][h]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < Q; ++h) _mm256_storeu_ps(acc_mem + (i * 2 + h) * 8, acc[i][h]);
}

// The full 6x2 tile with named accumulators: written out so the compiler keeps
// all 12 in registers (the array form above spills them on every iteration).
void micro_6x2(const float* a, int64_t lda, const float* b0, const float* b1, int64_t ldb, int64_t len,
               float* acc_mem) {
#define Q4_LOAD_ROW(i) \
  __m256 a##i##0 = _mm256_loadu_ps(acc_mem + (i * 2) * 8), a##i##1 = _mm256_loadu_ps(acc_mem + (i * 2 + 1) * 8)
  Q4_LOAD_ROW(0);
  Q4_LOAD_ROW(1);
  Q4_LOAD_ROW(2);
  Q4_LOAD_ROW(3);
  Q4_LOAD_ROW(4);
  Q4_LOAD_ROW(5);
#undef Q4_LOAD_ROW
  for (int64_t t = 0; t < len; ++t) {
    const __m256 v0 = _mm256_loadu_ps(b0 + t * ldb), v1 = _mm256_loadu_ps(b1 + t * ldb);
#define Q4_FMA_ROW(i)                                      \
  {                                                        \
    const __m256 w = _mm256_broadcast_ss(a + i * lda + t); \
    a##i##0 = _mm256_fmadd_ps(w, v0, a##i##0);             \
    a##i##1 = _mm256_fmadd_ps(w, v1, a##i##1);             \
  }
    Q4_FMA_ROW(0)
    Q4_FMA_ROW(1)
    Q4_FMA_ROW(2)
    Q4_FMA_ROW(3)
    Q4_FMA_ROW(4)
    Q4_FMA_ROW(5)
#undef Q4_FMA_ROW
  }
#define Q4_STORE_ROW(i)                             \
  _mm256_storeu_ps(acc_mem + (i * 2) * 8, a##i##0); \
  _mm256_storeu_ps(acc_mem + (i * 2 + 1) * 8, a##i##1)
  Q4_STORE_ROW(0);
  Q4_STORE_ROW(1);
  Q4_STORE_ROW(2);
  Q4_STORE_ROW(3);
  Q4_STORE_ROW(4);
  Q4_STORE_ROW(5);
#undef Q4_STORE_ROW
}

template <int R>
void micro_q(int q_count, const float* a, int64_t lda, const float* b0, const float* b1, int64_t ldb, int64_t len,
             float* acc_mem) {
  if (q_count == 2)
    micro<R, 2>(a, lda, b0, b1, ldb, len, acc_mem);
  else
    micro<R, 1>(a, lda, b0, b1, ldb, len, acc_mem);
}

// R (1..6) rows x q_count (1..2) vectors.
void micro_any(int rows, int q_count, const float* a, int64_t lda, const float* b0, const float* b1, int64_t ldb,
               int64_t len, float* acc_mem) {
  if (rows == 6 && q_count == 2) return micro_6x2(a, lda, b0, b1, ldb, len, acc_mem);
#define Q4_MICRO(R) micro_q<R>(q_count, a, lda, b0, b1, ldb, len, acc_mem)
  Q4_ROWS_SWITCH_6(rows, Q4_MICRO)
#undef Q4_MICRO
}

template <QuantType QT>
void gemm_tiles_avx2(const Gemm4bitParams& p, const float* xp_all, const Scales& scales, int64_t t0, int64_t t1);

template <QuantType QT>
void gemm_tiled_avx2(const Gemm4bitParams& p, const float* x, const Scales& scales) {
  const int64_t k = p.k, panels = ceil_div(p.m, 8);
  // X packed into panels of 8 rows: xp[panel][c][lane], zero-padded rows.
  float* xp = scratch(kSlotPanels, panels * k * 8);
  parallel_for(panels, 1, [&](int64_t a, int64_t b) {
    for (int64_t pn = a; pn < b; ++pn)
      for (int64_t lane = 0; lane < 8; ++lane) {
        float* dst = xp + pn * k * 8 + lane;
        if (pn * 8 + lane >= p.m) {
          for (int64_t c = 0; c < k; ++c) dst[c * 8] = 0.0f;
          continue;
        }
        const float* src = x + (pn * 8 + lane) * k;
        for (int64_t c = 0; c < k; ++c) dst[c * 8] = src[c];
      }
  });
  parallel_for(ceil_div(p.n, kRowTile), 1, [&](int64_t t0, int64_t t1) { gemm_tiles_avx2<QT>(p, xp, scales, t0, t1); });
}

// Output columns [r0, r0 + rows) of every row from a tile's accumulators
// (per 8-row panel: [row][lane]). Row by row, so each output row's `rows`
// values are written together (column-wise writes with stride n thrash the
// cache and the TLB on large outputs).
template <typename T>
void store_tile_as(const Gemm4bitParams& p, const float* acc, int64_t r0, int rows) {
  float bias[kRowTile];
  for (int r = 0; r < rows; ++r) bias[r] = load_bias(p.bias, p.bias_dtype, r0 + r);
  T* out = static_cast<T*>(p.out);
  for (int64_t m = 0; m < p.m; ++m) {
    const float* a = acc + (m / 8) * kRowTile * 8 + m % 8;
    for (int r = 0; r < rows; ++r) Elem<T>::store(out, m * p.n + r0 + r, a[r * 8] + bias[r]);
  }
}

void store_tile(const Gemm4bitParams& p, const float* acc, int64_t r0, int rows) {
  Q4_DTYPE_SWITCH(p.out_dtype, T, [&] { store_tile_as<T>(p, acc, r0, rows); });
}

template <QuantType QT>
void gemm_tiles_avx2(const Gemm4bitParams& p, const float* xp_all, const Scales& scales, int64_t t0, int64_t t1) {
  const int64_t k = p.k, panels = ceil_div(p.m, 8);
  const int shift = log2_exact(p.blocksize);
  const Table16 table = code_table<QT>();
  {
    alignas(32) float wd[kRowTile * kChunk];
    float* acc = scratch(kSlotAcc, panels * kRowTile * 8);  // per panel: [row][lane]
    for (int64_t tile = t0; tile < t1; ++tile) {
      const int64_t r0 = tile * kRowTile;
      const int rows = int(std::min<int64_t>(kRowTile, p.n - r0));
      std::fill(acc, acc + panels * kRowTile * 8, 0.0f);
      for (int64_t c0 = 0; c0 < k; c0 += kChunk) {
        const int64_t len = std::min(kChunk, k - c0);
        for (int r = 0; r < rows; ++r)
          decode_avx2(table, p.packed, scales, shift, (r0 + r) * k + c0, len, wd + r * kChunk);
        for (int64_t pn = 0; pn < panels; pn += 2) {
          const int q_count = pn + 1 < panels ? 2 : 1;
          const float* xps[2] = {xp_all + pn * k * 8 + c0 * 8, xp_all + std::min(pn + 1, panels - 1) * k * 8 + c0 * 8};
          // acc layout for a panel pair: [row][q][lane] within acc_pair
          alignas(32) float pair[kRowTile * 2 * 8];
          for (int r = 0; r < rows; ++r)
            for (int q = 0; q < q_count; ++q) memcpy(pair + (r * 2 + q) * 8, acc + ((pn + q) * kRowTile + r) * 8, 32);
          micro_any(rows, q_count, wd, kChunk, xps[0], xps[1], 8, len, pair);
          for (int r = 0; r < rows; ++r)
            for (int q = 0; q < q_count; ++q) memcpy(acc + ((pn + q) * kRowTile + r) * 8, pair + (r * 2 + q) * 8, 32);
        }
      }
      store_tile(p, acc, r0, rows);
    }
  }
}

// dX column strips of width 16 (8 for a final strip of k % 16 == 8).
template <QuantType QT>
void grad_strips_avx2(const Gemm4bitGradInputParams& p, const float* dy, const Scales& scales, int64_t s0, int64_t s1) {
  const int64_t k = p.k, groups = ceil_div(p.m, kRowTile);
  const int shift = log2_exact(p.blocksize);
  const Table16 table = code_table<QT>();
  {
    alignas(32) float ws[kChunk * 16];
    float* acc = scratch(kSlotAcc, groups * kRowTile * 16);
    for (int64_t strip = s0; strip < s1; ++strip) {
      const int64_t c0 = strip * 16, width = std::min<int64_t>(16, k - c0);
      std::fill(acc, acc + groups * kRowTile * 16, 0.0f);
      for (int64_t r0 = 0; r0 < p.n; r0 += kChunk) {
        const int64_t len = std::min(kChunk, p.n - r0);
        for (int64_t r = 0; r < len; ++r) {
          decode_avx2(table, p.packed, scales, shift, (r0 + r) * k + c0, width, ws + r * 16);
          if (width == 8) memset(ws + r * 16 + 8, 0, 32);
        }
        for (int64_t g = 0; g < groups; ++g) {
          const int rows = int(std::min<int64_t>(kRowTile, p.m - g * kRowTile));
          micro_any(rows, 2, dy + g * kRowTile * p.n + r0, p.n, ws, ws + 8, 16, len, acc + g * kRowTile * 16);
        }
      }
      for (int64_t m = 0; m < p.m; ++m)
        for (int64_t c = 0; c < width; ++c)
          store_out(p.grad_input, p.grad_input_dtype, m * k + c0 + c, acc[m * 16 + c]);
    }
  }
}

// Small m: every W row is streamed once; for each block piece of the thread's
// column range the unscaled codes are accumulated into dX with the
// coefficient dY[m, r] * scale (the scale folded into the broadcast).
template <QuantType QT, int MR>
void grad_rows_avx2(const Gemm4bitGradInputParams& p, const float* dy, const Scales& scales, int64_t g0, int64_t g1) {
  const Table16 t = code_table<QT>();
  const int64_t k = p.k, c0 = g0 * 8, width = (g1 - g0) * 8;
  const int shift = log2_exact(p.blocksize);
  float* acc = scratch(kSlotAcc, MR * width);
  std::fill(acc, acc + MR * width, 0.0f);
  for (int64_t r = 0; r < p.n; ++r) {
    const int64_t f0 = r * k + c0;
    int64_t c = 0;
    while (c < width) {
      const int64_t block = (f0 + c) >> shift;
      const int64_t end = std::min(width, ((block + 1) << shift) - f0);
      const float s = scales(block);
      __m256 coef[MR];
      for (int j = 0; j < MR; ++j) coef[j] = _mm256_set1_ps(dy[j * p.n + r] * s);
      for (; c < end; c += 8) {
        const __m256 w = lookup(t, load_nibbles8(p.packed, f0 + c));
        for (int j = 0; j < MR; ++j) {
          float* a = acc + j * width + c;
          _mm256_storeu_ps(a, _mm256_fmadd_ps(coef[j], w, _mm256_loadu_ps(a)));
        }
      }
    }
  }
  for (int j = 0; j < MR; ++j)
    for (int64_t c = 0; c < width; ++c) store_out(p.grad_input, p.grad_input_dtype, j * k + c0 + c, acc[j * width + c]);
}

template <QuantType QT>
void grad_input_avx2(const Gemm4bitGradInputParams& p, const float* dy, const Scales& scales) {
  if (p.m <= 4) {
    const int64_t groups = p.k / 8;
    parallel_for(groups, 32, [&](int64_t g0, int64_t g1) {
#define Q4_GRAD_ROWS(R) grad_rows_avx2<QT, R>(p, dy, scales, g0, g1)
      Q4_ROWS_SWITCH_4(p.m, Q4_GRAD_ROWS)
#undef Q4_GRAD_ROWS
    });
    return;
  }
  parallel_for(ceil_div(p.k, 16), 1, [&](int64_t s0, int64_t s1) { grad_strips_avx2<QT>(p, dy, scales, s0, s1); });
}

template <QuantType QT>
void gemm_avx2(const Gemm4bitParams& p, const float* x, const Scales& scales) {
  if (p.m > 4) return gemm_tiled_avx2<QT>(p, x, scales);
  for (int64_t m0 = 0; m0 < p.m; m0 += 4) {
#define Q4_GEMV(R) gemv_avx2<QT, R>(p, x, scales, m0)
    Q4_ROWS_SWITCH_4(std::min<int64_t>(4, p.m - m0), Q4_GEMV)
#undef Q4_GEMV
  }
}

}  // namespace

bool gemm4(const Gemm4bitParams& p, const Scales& scales) {
  if (p.k % 8 != 0) return false;
  const float* x = as_f32(p.x, p.x_dtype, p.m * p.k);
  Q4_QUANT_SWITCH(p.quant_type, QT, [&] { gemm_avx2<QT>(p, x, scales); });
  return true;
}

bool grad4(const Gemm4bitGradInputParams& p, const Scales& scales) {
  if (p.k % 8 != 0) return false;
  const float* dy = as_f32(p.grad_out, p.grad_out_dtype, p.m * p.n);
  Q4_QUANT_SWITCH(p.quant_type, QT, [&] { grad_input_avx2<QT>(p, dy, scales); });
  return true;
}

}  // namespace avx2
}  // namespace cpu
}  // namespace q4

Q4_UNIT_END
