// AVX-512 (F, BW, VL) kernels of the fused 4-bit matmuls, fp32 compute (the
// fp32 contract of q4/kernels.h): the batch-1 gemv here (k % 128 == 0 on
// 128-element chunks, else k % 64 == 0 on 64-element chunks), the tiled
// forward and the input gradient in gemm4_tiled.cc.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "../../dispatch.h"
#include "../../gemm4_common.h"
#include "../../parallel.h"
#include "../unit.h"
#include "q4/kernels.h"
#include "q4/quant4.h"

Q4_UNIT_BEGIN(avx512)
#include "scale_decoder.h"

namespace q4 {
namespace cpu {
namespace avx512 {
namespace {

using namespace gemm4;  // NOLINT: the shared pieces of every gemm4 unit

// AVX-512 batch-1 gemv (k % 64 == 0): 16 bytes widen to 16 int32 lanes
// (byte i of a half-chunk in lane i); `permutexvar` looks the 16-entry code
// table up with the low 4 bits of each lane, so the low nibble (odd element)
// needs no masking and the high nibble (even element) one shift. x is
// de-interleaved per 64-element chunk to match: xe[c*32 + i] = x[c*64 + 2i],
// xo[c*32 + i] = x[c*64 + 2i + 1]. Each 32-element half gets its own block
// scale (they differ when blocksize is 32). R rows share the x loads.
template <QuantType QT, int R>
void gemv1_rows_avx512(const Gemm4bitParams& p, const float* xe, const float* xo, const Scales& scales, int64_t r0) {
  alignas(64) float codes[16];
  for (int q = 0; q < 16; ++q) codes[q] = Code4<QT>::decode(q);
  const __m512 table = _mm512_load_ps(codes);
  const int64_t k = p.k, chunks = k / 64;
  const int shift = log2_exact(p.blocksize);
  __m512 total[R];
  for (int j = 0; j < R; ++j) total[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const __m512 xe0 = _mm512_loadu_ps(xe + c * 32), xe1 = _mm512_loadu_ps(xe + c * 32 + 16);
    const __m512 xo0 = _mm512_loadu_ps(xo + c * 32), xo1 = _mm512_loadu_ps(xo + c * 32 + 16);
    for (int j = 0; j < R; ++j) {
      const int64_t f = (r0 + j) * k + c * 64;
      const uint8_t* bytes = p.packed + f / 2;
      const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
      const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16)));
      __m512 h0 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), table), xe0);
      __m512 h1 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), table), xe1);
      h0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(v0, table), xo0, h0);
      h1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(v1, table), xo1, h1);
      total[j] = _mm512_fmadd_ps(h0, _mm512_set1_ps(scales(f >> shift)), total[j]);
      total[j] = _mm512_fmadd_ps(h1, _mm512_set1_ps(scales((f + 32) >> shift)), total[j]);
    }
  }
  for (int j = 0; j < R; ++j) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, total[j]);
    float sum = 0.0f;
    for (int l = 0; l < 8; ++l) sum += lanes[l] + lanes[l + 8];
    store_out(p.out, p.out_dtype, r0 + j, sum + load_bias(p.bias, p.bias_dtype, r0 + j));
  }
}

template <QuantType QT>
void gemv1_avx512(const Gemm4bitParams& p, const float* xe, const float* xo, const Scales& scales, int64_t n0,
                  int64_t n1) {
  int64_t r = n0;
  for (; r + 2 <= n1; r += 2) gemv1_rows_avx512<QT, 2>(p, xe, xo, scales, r);
  if (r < n1) gemv1_rows_avx512<QT, 1>(p, xe, xo, scales, r);
}

// Batch-1 gemv on 128-element chunks (k % 128 == 0), with no widening
// shuffles: one 64-byte load holds the chunk; dword j = elements 8j..8j+7,
// byte b of it elements 8j+2b (high nibble) and 8j+2b+1 (low nibble).
// `permutexvar` reads the low 4 bits of each dword, so step i (dword shifted
// right by kShift[i]) looks up element 8j + kElem[i] of every dword j: eight
// immediate shifts and eight table lookups per 128 weights. x is transposed
// per chunk to match (xt[c*128 + 16i + j] = x[c*128 + 8j + kElem[i]]). Dword
// j lies in block (c*128 + 8j) >> shift: one scale for the chunk when
// blocksize >= 128, two halves at 64, four quarters at 32, applied once per
// chunk to that chunk's unscaled sums. R rows share every x load.
constexpr int kShift[8] = {4, 0, 12, 8, 20, 16, 28, 24};
constexpr int kElem[8] = {0, 1, 2, 3, 4, 5, 6, 7};

// The dwords of v shifted right by S (permutexvar reads their low 4 bits).
// Plain dword shifts run beside the permutes and FMAs; a vpmulhuw form of the
// in-word shifts (by 2^(16-s)) takes FMA-pipe slots (measured: kernels/NOTES.md).
template <int S>
inline __m512i nibbles(__m512i v) {
  return S == 0 ? v : _mm512_srli_epi32(v, S);
}

// Scales of the 16 dwords of chunk c of a row. SHIFT = log2(blocksize) for
// blocksize 32 and 64: rs points at the row's first block, and the chunk's two
// (64) or four (32) scales are loaded at once and spread over their dwords by
// one permute (for blocksize 64 the earlier two broadcasts and a 256-bit
// insert measured 4-5% slower on the Zen 4 VM, one thread, 4096^2: 0.642 ->
// 0.613 ms). SHIFT = 0 for blocksize >= 128: one scale per chunk, rs indexed
// by global block (a block may start inside a row), c the global chunk index.
template <int SHIFT>
inline __m512 chunk_scales(const float* rs, int64_t c, int shift) {
  if (SHIFT == 0) return _mm512_set1_ps(rs[(c * 128) >> shift]);
  if (SHIFT == 6) {
    const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m128i two = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rs + 2 * c));
    return _mm512_permutexvar_ps(half, _mm512_castps128_ps512(_mm_castsi128_ps(two)));
  }
  const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  return _mm512_permutexvar_ps(quarter, _mm512_castps128_ps512(_mm_loadu_ps(rs + 4 * c)));
}

constexpr int64_t kPrefetchRows = 1;  // each row stream prefetched this many rows ahead

// R rows, row j = rows[j], far apart in W (see gemv128); sc[j][b] = scale of
// block b for row j. Each row's chunk kPrefetchRows rows further down its
// stream is prefetched (pf: those rows exist). Four rows: eight independent
// FMA chains, enough to cover the FMA latency (two rows' four chains left the
// loop latency-bound). A row's sums do not depend on the other rows of its
// tile, so the spacing changes no output bit.
template <QuantType QT, int R, int SHIFT>
void gemv128_rows(const Gemm4bitParams& p, const float* xt, const float* const* sc, const int64_t* rows, bool pf) {
  alignas(64) float codes[16];
  for (int q = 0; q < 16; ++q) codes[q] = Code4<QT>::decode(q);
  const __m512 table = _mm512_load_ps(codes);
  const int64_t k = p.k, chunks = k / 128;
  const int shift = log2_exact(p.blocksize);
  const int64_t row_bytes = k / 2, ahead = kPrefetchRows * row_bytes;
  const uint8_t* row[R];
  const float* rs[R];  // SHIFT 0: the global block's scales, chunk c + chunk0[j]
  int64_t chunk0[R];   //          else: row j's first block's, chunk c
  __m512 total[R];
  for (int j = 0; j < R; ++j) {
    row[j] = p.packed + rows[j] * row_bytes;
    chunk0[j] = SHIFT == 0 ? (rows[j] * k) >> 7 : 0;
    rs[j] = SHIFT == 0 ? sc[j] : sc[j] + ((rows[j] * k) >> SHIFT);
    total[j] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i v[R];
    __m512 a0[R], a1[R];
    for (int j = 0; j < R; ++j) {
      const uint8_t* src = row[j] + c * 64;
      if (pf) prefetch_stream(src + ahead);
      v[j] = _mm512_loadu_si512(src);
      a0[j] = a1[j] = _mm512_setzero_ps();
    }
    const float* xc = xt + c * 128;
#define Q4_STEP(i, acc)                                                                             \
  {                                                                                                 \
    const __m512 xv = _mm512_loadu_ps(xc + 16 * (i));                                               \
    for (int j = 0; j < R; ++j)                                                                     \
      acc[j] = _mm512_fmadd_ps(_mm512_permutexvar_ps(nibbles<kShift[i]>(v[j]), table), xv, acc[j]); \
  }
    Q4_STEP(0, a0)
    Q4_STEP(1, a1)
    Q4_STEP(2, a0)
    Q4_STEP(3, a1)
    Q4_STEP(4, a0)
    Q4_STEP(5, a1)
    Q4_STEP(6, a0)
    Q4_STEP(7, a1)
#undef Q4_STEP
    for (int j = 0; j < R; ++j)
      total[j] =
          _mm512_fmadd_ps(_mm512_add_ps(a0[j], a1[j]), chunk_scales<SHIFT>(rs[j], chunk0[j] + c, shift), total[j]);
  }
  for (int j = 0; j < R; ++j)
    store_out(p.out, p.out_dtype, rows[j], _mm512_reduce_add_ps(total[j]) + load_bias(p.bias, p.bias_dtype, rows[j]));
}

constexpr int64_t kGemvRows = 4;         // rows per register tile
constexpr int64_t kStreamScaleRows = 8;  // rows of each stream whose block scales are decoded at a time

// A chunk of rows [n0, n1) is cut into kGemvRows equal runs (the leftover
// rows after them go one at a time), and a register tile takes the i-th row
// of every run: each tile reads kGemvRows rows that lie (n1 - n0) / 4 rows
// apart, four streams in pages of their own, each prefetched one row ahead.
// Adjacent rows (2 KiB apart at k = 4096, two to a 4 KiB page, prefetched two
// tiles ahead) left the weight's stream from DRAM well below the read floor
// on the Xeon VM: two threads, 32 layers of 4096^2 with nested scales cycled
// through the C ABI, alternating rounds of both builds in one process, 0.56-
// 0.59 -> 0.45-0.47 ms a layer, from L3 0.40 -> 0.37-0.39 (a loop of four
// separate streams alone ran at the floor; prefetching two rows ahead: 0.47
// / 0.40). Plain fp32 scales are read in place (no copy per row block): from
// L3 0.36 -> 0.32 ms, from DRAM 0.45 -> 0.41.
template <QuantType QT, int SHIFT>
void gemv128(const Gemm4bitParams& p, const float* x, const ScaleDecoder& scales) {
  float* xt = scratch(kSlotPanels, p.k);
  for (int64_t c = 0; c < p.k; c += 128)
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 16; ++j) xt[c + 16 * i + j] = x[c + 8 * j + kElem[i]];
  const int shift = log2_exact(p.blocksize);
  const int64_t k = p.k;
  parallel_for(ceil_div(p.n, kGemvRows), 8, [&](int64_t a, int64_t b) {
    const int64_t n0 = kGemvRows * a, n1 = std::min(p.n, kGemvRows * b);
    const int64_t run = (n1 - n0) / kGemvRows;  // rows per stream
    const int64_t per_stream = ((kStreamScaleRows * k) >> shift) + 2 + 16;
    float* rs = scratch(kSlotRow, kGemvRows * per_stream);
    const float* sc[kGemvRows];
    for (int64_t i0 = 0; i0 < run; i0 += kStreamScaleRows) {
      const int64_t count = std::min(kStreamScaleRows, run - i0);
      const int64_t next = std::min(kStreamScaleRows, run - i0 - count);
      for (int64_t j = 0; j < kGemvRows; ++j) {
        const float* plain = scales.plain();  // read in place
        sc[j] = plain ? plain : scales.decode_rows(n0 + j * run + i0, count, next, k, shift, rs + j * per_stream);
      }
      for (int64_t i = i0; i < i0 + count; ++i) {
        int64_t rows[kGemvRows];
        for (int64_t j = 0; j < kGemvRows; ++j) rows[j] = n0 + j * run + i;
        gemv128_rows<QT, kGemvRows, SHIFT>(p, xt, sc, rows, i + kPrefetchRows < run);
      }
    }
    for (int64_t r = n0 + kGemvRows * run; r < n1; ++r) {  // the leftover rows
      const float* plain = scales.plain();
      const float* one_sc = plain ? plain : scales.decode_rows(r, 1, 0, k, shift, rs);
      gemv128_rows<QT, 1, SHIFT>(p, xt, &one_sc, &r, false);
    }
  });
}

template <QuantType QT>
void gemv1(const Gemm4bitParams& p, const float* x, const Scales& scales) {
  float* xe = scratch(kSlotPanels, p.k);
  float* xo = xe + p.k / 2;
  for (int64_t i = 0; i < p.k / 2; ++i) {
    xe[i] = x[2 * i];
    xo[i] = x[2 * i + 1];
  }
  parallel_for(ceil_div(p.n, 2), 4,
               [&](int64_t a, int64_t b) { gemv1_avx512<QT>(p, xe, xo, scales, 2 * a, std::min(p.n, 2 * b)); });
}

}  // namespace

bool gemm4(const Gemm4bitParams& p, const Scales& scales) {
  if (p.m > 1) return gemm4_tiled(p, scales);
  if (p.k % 64 != 0) return false;
  const float* x = as_f32(p.x, p.x_dtype, p.k);
  if (p.k % 128 == 0) {
    const ScaleDecoder decoder(p.scales);
    Q4_QUANT_SWITCH(p.quant_type, QT, [&] {
      if (p.blocksize == 32) return gemv128<QT, 5>(p, x, decoder);
      if (p.blocksize == 64) return gemv128<QT, 6>(p, x, decoder);
      gemv128<QT, 0>(p, x, decoder);
    });
    return true;
  }
  Q4_QUANT_SWITCH(p.quant_type, QT, [&] { gemv1<QT>(p, x, scales); });
  return true;
}

}  // namespace avx512
}  // namespace cpu
}  // namespace q4

Q4_UNIT_END
