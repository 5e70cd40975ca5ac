// AVX512_BF16 kernels of the fused 4-bit matmuls: bf16 compute for bf16
// inputs (x for the forward, dY for the input gradient).
//
// What every path computes (the bf16-compute contract): each W element is its
// fp32 value decode(nibble) * scale(block) (what dequantize_4bit returns in
// fp32) rounded once to bf16, round to nearest even; products of bf16 inputs
// and bf16 W are accumulated in fp32 by vdpbf16ps; the bias is added in fp32
// and the sum rounded once to the output dtype. vdpbf16ps and vcvtne2ps2bf16
// treat denormal inputs as zero and flush denormal results to zero (so input
// values and W values below 2^-126 in magnitude count as zero, and partial
// sums below it as zero). The error against the exact product with bf16 W is
// then at most (len+2) * 2^-24 * sum |x|.|W| (plus these flushes), where len is
// the reduction length, whatever the path; the paths differ only in the order
// of the fp32 additions. Results do not depend on the thread count: work is
// split over output columns / rows only, and each output is summed in a fixed
// order.
//
// Decode: a 64-element chunk of a W row (32 packed bytes) widens to 32 words
// (word j = byte j); the low 5 bits of word j (low nibble plus one stray bit)
// and of word j >> 4 (high nibble) index a 32-word bf16 table with vpermw.
// The table is the 16 codes times the block scale in fp32, rounded to bf16 by
// vcvtne2ps2bf16, stored twice (words 0-15 and 16-31) so the stray bit does
// not matter; with blocksize 32 a chunk spans two blocks, and the table holds
// the first block's values in words 0-15 and the second's in 16-31, selected
// by bit 4 of the masked index. So a chunk decodes to two vectors of bf16:
// hi = elements 0, 2, ..., 62 and lo = elements 1, 3, ..., 63 of the chunk.
// The inputs are rearranged once per call to match (a "deinterleaved" chunk:
// 32 even elements, then 32 odd ones); no W value is stored beyond an L1/L2
// tile, and nothing is kept across calls.
//
// Paths (each output's additions in a fixed order, whatever the threads):
//   gemv  (m <= kGemvMaxM = 24): x deinterleaved once. W rows are decoded
//         chunk by chunk into registers, 4 rows at a time, and dotted with up
//         to 4 x rows held in registers; each output keeps 16 fp32 lanes of
//         partial sums (two sets for m <= 2), summed at the end. 5-8 x rows
//         (kWideGroup): W rows decoded 2 at a time and dotted with every x
//         row, read from L1 (x stored chunk by chunk, [k/64][m][64]); with
//         a 48 KiB L1D in k segments of x that fit it (the partial sums kept
//         in memory between segments). More x rows: groups of <= 4, each
//         decoding the 4 W rows again (from L1, where the first group's pass
//         left them). The next row group's bytes are prefetched. One or two
//         x rows, k % 128 == 0 and blocksize >= 64: "quad" chunks of 128
//         elements (one 64-byte line of a W row indexes the table by shifts
//         alone; x rearranged to match, gemv_quad).
//   tiled (m > kGemvMaxM): x packed once into panels of 16 rows ([k/2 pairs]
//         [16 rows] dwords); tiles of 32 W rows x 256 k decoded into bf16
//         and reused by every panel in an 8-row x 3-panel register tile (W
//         pairs broadcast with vpbroadcastd); lanes are x rows (no horizontal
//         sums), accumulators carried across k tiles in memory; the output
//         is transposed 16x16 at the store. Up to 2 panels: tiles of 16 rows,
//         the next tile decoded inside the current tile's dot products.
//   grad  dX[m, k] = dY[m, n] . W[n, k], the reduction over n: threads own
//         strips of 64 dX columns; W rows (2i, 2i+1) are interleaved by
//         vpermt2w into zmm = 16 columns x 2 rows and dotted with broadcast
//         dY pairs. m <= 4: decoded into registers and used at once (two
//         accumulator sets for m <= 2); more: tiles of 256 rows x 64 columns
//         decoded into a 32 KiB buffer, reused by every group of 6 dY rows.
//         Every block scale is decoded once per call.
// Shapes served: k % 64 == 0 (every W row starts on a 32-byte boundary and a
// chunk never straddles more than two blocks); any m, n. Other k return false
// and the fp32 kernels run. Inputs of another dtype also return false.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../../dispatch.h"
#include "../../gemm4_common.h"
#include "../../parallel.h"
#include "../unit.h"
#include "q4/common.h"
#include "q4/dynamic8.h"
#include "q4/kernels.h"
#include "q4/quant4.h"

Q4_UNIT_BEGIN(avx512_bf16)

#include "../avx512/scale_decoder.h"
#include "../avx512/store16.h"
#include "../avx512/transpose16.h"
#include "bf16_decode.h"

namespace q4 {
namespace cpu {
namespace avx512_bf16 {
namespace {

using gemm4::kSlotAcc;
using gemm4::kSlotInput;
using gemm4::kSlotPanels;
using gemm4::kSlotRow;
using gemm4::log2_exact;

constexpr int64_t kGemvMaxM = 24;       // gemv path up to this many rows of x (measured crossover)
constexpr int kGemvGroup = 4;           // x rows per pass of the gemv path
constexpr int kGemvPrefetchGroups = 2;  // gemv: W prefetched this many row groups ahead (adjacent rows)
constexpr int kGemvStreamAhead = 1;     // gemv: W prefetched this many rows ahead in each row stream

// ------------------------------------------------------------- gemv (m small)

struct GemvArgs {
  const uint8_t* packed;
  int64_t size;  // n * k: W's elements
  int64_t k;
  int shift;
  __m512 codes;
  const uint16_t* xq;  // deinterleaved x rows: [m][k], or (5-8 rows) [k / 64][m][64]
};

// R W rows' chunks dotted with M x rows read from memory (x + j * 64: the
// deinterleaved chunk of x row j, chunk-major): each x vector is loaded once
// and used by the R rows at once.
template <int R, int M>
__attribute__((always_inline)) inline void dot_rows_mem(__m512 (&acc)[R][M][1], const Chunk (&w)[R],
                                                        const uint16_t* x) {
#pragma GCC unroll 8
  for (int j = 0; j < M; ++j) {
    const __m512i xe = _mm512_load_si512(x + j * kChunk), xo = _mm512_load_si512(x + j * kChunk + 32);
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) acc[i][j][0] = dot(acc[i][j][0], w[i].hi, xe);
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) acc[i][j][0] = dot(acc[i][j][0], w[i].lo, xo);
  }
}

// One W row's chunk dotted with M x rows: acc[j][h] for x row j.
template <int M, int H>
__attribute__((always_inline)) inline void dot_row(__m512 (&acc)[M][H], const Chunk& w, const __m512i* xe,
                                                   const __m512i* xo) {
#pragma GCC unroll 8
  for (int j = 0; j < M; ++j) {
    acc[j][0] = dot(acc[j][0], w.hi, xe[j]);
    acc[j][H - 1] = dot(acc[j][H - 1], w.lo, xo[j]);
  }
}

// The columns [c0, c1) of a gemv tile's pass (multiples of 64); resume: go
// on from the partial sums in acc_mem (the same additions in the same order
// as one pass over all k).
struct KRange {
  int64_t c0, c1;
  bool resume;
};

// A gemv tile's accumulators (output (i, j)'s h-th at mem[i * lda + j * H +
// h]): from mem when the tile resumes a pass, else zero; and back.
template <int R, int M, int H>
__attribute__((always_inline)) inline void load_acc(__m512 (&acc)[R][M][H], const __m512* mem, int64_t lda,
                                                    bool resume) {
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j)
      for (int h = 0; h < H; ++h) acc[i][j][h] = resume ? mem[i * lda + j * H + h] : _mm512_setzero_ps();
}
template <int R, int M, int H>
__attribute__((always_inline)) inline void store_acc(const __m512 (&acc)[R][M][H], __m512* mem, int64_t lda) {
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < M; ++j)
      for (int h = 0; h < H; ++h) mem[i * lda + j * H + h] = acc[i][j][h];
}

// The W rows of a gemv register tile: tile row i is W row r0 + i * stride,
// the scale of block b for it at base[i][b]; with blocksize 32 or 64 (SPC >
// 0, every row starts a block) tile row i's scales lie row_scales after tile
// row i - 1's. stride 1: adjacent rows; else rows of separate streams (see
// gemv_path).
struct TileSet {
  int64_t r0, stride;
  const float* const* base;
  int64_t row_scales;
  TileSet sub(int i) const { return {r0 + i * stride, stride, base + i, row_scales}; }  // from tile row i on
};

// The W rows of a tile (TileSet) from column c0 on: row i's bytes at wb + i *
// row_bytes and (SPC > 0) its scales at sb + i * row_scales, both pointers
// advanced per chunk by the tile (k is a multiple of 64: with blocksize 32 or
// 64 every row starts a block); with SPC = 0 a row's block is found per
// chunk (scales_at). Each row's bytes a few rows further down its stream are
// prefetched (adjacent rows: kGemvPrefetchGroups tiles ahead; separate
// streams: kGemvStreamAhead rows), while that stays inside W for the whole
// tile, else the tile does not prefetch (pf false).
template <int R, int SPC>
struct TileRows {
  const float* base[R];
  unsigned shift;
  uint64_t frow[R];  // W element index of each row's start
  int64_t row_bytes, row_scales, pf_bytes;
  const uint8_t* wb;
  const float* sb;
  bool pf;

  TileRows(const GemvArgs& g, const TileSet& set, int64_t c0) : shift(unsigned(g.shift)) {
    for (int i = 0; i < R; ++i) {
      frow[i] = uint64_t((set.r0 + i * set.stride) * g.k);
      base[i] = set.base[i];
    }
    row_bytes = set.stride * (g.k >> 1);
    row_scales = SPC > 0 ? set.row_scales : 0;
    wb = g.packed + ((frow[0] + uint64_t(c0)) >> 1);
    sb = scales_at(0, c0);
    const uint64_t pf_dist = uint64_t((set.stride == 1 ? kGemvPrefetchGroups * R : kGemvStreamAhead) * g.k);
    pf_bytes = int64_t(pf_dist >> 1);
    pf = frow[R - 1] + pf_dist + uint64_t(g.k) <= uint64_t(g.size);
  }
  // row i's scales from the block holding column c on
  const float* scales_at(int i, int64_t c) const { return base[i] + ((frow[i] + uint64_t(c)) >> shift); }
};

// R W rows (the tile `rows`) against M deinterleaved x rows (from j0), over
// the columns kr: the 16-lane partial sums of output (i, j) are written to
// acc[i * lda + j * H + h] (H = 2 accumulators per output when m <= 2, to
// hide the vdpbf16ps latency). SPC: the
// blocks' scales per 64-element chunk -- 2 (blocksize 32), 1 (64), or 0
// (larger: several chunks per block). M > 4 (XMEM): x is chunk-major and
// read from L1 by the dot products (dot_rows_mem).

template <int R, int M, int H, int SPC>
void gemv_tile(const GemvArgs& g, const TileSet& rows, int64_t j0, __m512* acc_mem, int64_t lda, KRange kr) {
  constexpr bool TWO = SPC == 2;
  const int64_t k = g.k;
  const __m512i half = upper_half_bit();
  __m512 acc[R][M][H];
  load_acc(acc, acc_mem, lda, kr.resume);
  const uint16_t* x = g.xq + j0 * k;
  const TileRows<R, SPC> t(g, rows, kr.c0);
  const uint8_t* wb = t.wb;  // row r0 at chunk c
  const float* sb = t.sb;    // (SPC > 0) its scales
  // Blocksize 64: each row's table is made one chunk ahead, and with one x
  // row its bytes are also loaded and widened one chunk ahead, so that the
  // multiply, the conversion and the load are off the path to the chunk's
  // dot products (one thread, 4096^2: batch 1 0.509 -> 0.495 ms, batch 4
  // 1.015 -> 0.962 ms). With more x rows the registers are taken.
  constexpr bool TAB_AHEAD = SPC == 1, LOAD_AHEAD = TAB_AHEAD && M == 1;
  // Each row's dot products right after its decode (ROWWISE), or all R
  // rows decoded first (more independent work between a decode and its
  // use): whichever keeps the accumulators, x and W in the 32 registers. With
  // all 4 rows decoded first, GCC kept 6 of the 16 accumulators of M = 4 on
  // the stack (a store-to-load trip on each one's chain every chunk): on the
  // Zen 5 VM, one thread, 4096^2, batch 4 0.456 -> 0.385 ms, batch 8 0.88 ->
  // 0.78, batch 2 0.342 -> 0.314; batch 1 and 3, and blocksizes above 64
  // (no table ahead), measured faster decoded first.
  constexpr bool XMEM = M > 4;  // x read from L1 by each dot product
  constexpr bool ROWWISE = !XMEM && (SPC > 0 && (M == 4 || (M == 2 && H == 2)));
  __m512i tab_next[R], v_next[R];
  for (int i = 0; i < R; ++i) {
    if (TAB_AHEAD) tab_next[i] = chunk_table<false>(g.codes, sb[i * t.row_scales], 0.0f);
    if (LOAD_AHEAD) v_next[i] = widen_chunk(wb + i * t.row_bytes);
  }
  for (int64_t c = kr.c0; c < kr.c1; c += kChunk, wb += kChunk / 2, sb += SPC) {
    // the x chunk stays in registers for all R rows (512-bit loads and the
    // decode compete with the dot products; the x loads are shared)
    __m512i xe[XMEM ? 1 : M], xo[XMEM ? 1 : M];
    if constexpr (!XMEM) {
#pragma GCC unroll 8
      for (int j = 0; j < M; ++j) {
        xe[j] = _mm512_load_si512(x + j * k + c);
        xo[j] = _mm512_load_si512(x + j * k + c + 32);
      }
    }
    Chunk w[R];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const float* s = SPC > 0 ? sb + i * t.row_scales : t.scales_at(i, c);
      const bool more = c + kChunk < kr.c1;
      __m512i tab;
      if (TAB_AHEAD) {
        tab = tab_next[i];
        if (more) tab_next[i] = chunk_table<false>(g.codes, s[1], 0.0f);
      } else {
        tab = chunk_table<TWO>(g.codes, s[0], TWO ? s[1] : 0.0f);
      }
      const uint8_t* bytes = wb + i * t.row_bytes;
      // W is streamed once (from L3 or DRAM): ask for the same chunk of the
      // row group kGemvPrefetchGroups ahead (the hardware prefetchers miss
      // the R interleaved row streams). Every chunk, so each 64-byte line is
      // asked for twice: from DRAM the first request is often lost (the
      // profile's samples sat on the W loads, whatever the distance or the
      // hint), most when x is read from L1/L2 beside it. Two threads, Zen 4,
      // 4096^2 from DRAM (16 layers) against one request per line: batch 3
      // 0.432 -> 0.412 ms, 4 0.484 -> 0.464, 5 0.608 -> 0.569, 8 0.977 ->
      // 0.851, 16 1.73 -> 1.67; from L3 within 0.5%. (Four requests per line
      // measured no better than two; the quad chunks' one line per row and
      // chunk gained nothing from a second request.)
      if (t.pf) prefetch_stream(bytes + t.pf_bytes);
      if (LOAD_AHEAD) {
        w[i] = lookup_chunk<false>(v_next[i], tab, half);
        if (more) v_next[i] = widen_chunk(bytes + kChunk / 2);
      } else {
        w[i] = decode_chunk<TWO>(bytes, tab, half);
      }
      if constexpr (ROWWISE) dot_row<M, H>(acc[i], w[i], xe, xo);
    }
    if constexpr (XMEM) {
      if constexpr (H == 1) dot_rows_mem<R, M>(acc, w, g.xq + c * M);
    } else if constexpr (!ROWWISE) {
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) dot_row<M, H>(acc[i], w[i], xe, xo);
    }
  }
  store_acc(acc, acc_mem, lda);
}

// ------------------------------------ gemv, quad chunks (one or two x rows)
//
// With one or two x rows the decode, not the dot products, bounds the gemv. A
// 128-element chunk of a W row is one 64-byte line of packed bytes; loaded as
// 32 words, word i holds elements 4i..4i+3 (bits 0-3: 4i+1, 4-7: 4i, 8-11:
// 4i+3, 12-15: 4i+2), so shifts of the line index the table directly: no
// widening shuffle (vpmovzxbw) per 64 elements, and with blocksize 64 one
// table conversion per two blocks (words 0-15 are the first block, 16-31 the
// second; the table holds the two blocks' values in words 0-15 and 16-31,
// selected by bit 4 of the index). x is rearranged once per call to match:
// vector j of a chunk holds the chunk's elements 4i + kQuadPos[j]. Zen 4 (its
// 512-bit shuffles and shifts share two of the four vector pipes), one
// thread, 4096^2 bf16, blocksize 64: 0.445 -> 0.40 ms; blocksize 256: 0.46
// -> 0.34 ms; two x rows (blocksize 64) 0.607 -> 0.533-0.557 ms. k % 128 !=
// 0 and blocksize 32 keep the 64-element chunks; with 3-4 x rows the x
// vectors of a chunk (4 per row) no longer fit the registers beside the
// accumulators.
constexpr int64_t kQuad = 128;
constexpr int kQuadPos[4] = {1, 0, 3, 2};

// x rearranged for quad chunks: the 4 vectors of chunk c at dst + c, + 32,
// + 64, + 96.
inline void quad_x(const uint16_t* src, int64_t len, uint16_t* dst) {
  __m512i idx[4];
  for (int j = 0; j < 4; ++j) {
    alignas(64) uint16_t t[32];
    for (int i = 0; i < 32; ++i) t[i] = uint16_t((4 * i + kQuadPos[j]) & 63);
    idx[j] = _mm512_load_si512(t);
  }
  for (int64_t c = 0; c < len; c += kQuad) {
    const __m512i a0 = _mm512_loadu_si512(src + c), a1 = _mm512_loadu_si512(src + c + 32);
    const __m512i a2 = _mm512_loadu_si512(src + c + 64), a3 = _mm512_loadu_si512(src + c + 96);
    for (int j = 0; j < 4; ++j) {
      const __m512i lo = _mm512_permutex2var_epi16(a0, idx[j], a1), hi = _mm512_permutex2var_epi16(a2, idx[j], a3);
      _mm512_storeu_si512(dst + c + 32 * j, _mm512_mask_mov_epi16(lo, 0xFFFF0000u, hi));
    }
  }
}

// Bit 4 of every byte of words 16-31 (the second block's half of the table).
inline __m512i upper_half_bytes() { return _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(0x1010), 1); }

// The 4 table indices of a quad chunk's line w. SPC = 1: every nibble is
// masked alone into its byte, bit 4 of the byte set in words 16-31 (two
// ternary ops and three shifts; masking each of the four shifted lines
// measured 0.445 against 0.40 ms: the shifts and logic ops are what fill the
// pipes here). SPC = 0: the table is stored twice, the stray bits do not
// matter.
template <int SPC>
__attribute__((always_inline)) inline void quad_index(__m512i w, __m512i upper, __m512i (&ix)[4]) {
  if constexpr (SPC == 1) {
    const __m512i m = _mm512_set1_epi16(0x0F0F);
    const __m512i lo = _mm512_ternarylogic_epi32(w, m, upper, 0xea);  // (w & m) | upper
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 4), m, upper, 0xea);
    ix[0] = lo;
    ix[1] = hi;
    ix[2] = _mm512_srli_epi16(lo, 8);
    ix[3] = _mm512_srli_epi16(hi, 8);
  } else {
    ix[0] = w;
    ix[1] = _mm512_srli_epi16(w, 4);
    ix[2] = _mm512_srli_epi16(w, 8);
    ix[3] = _mm512_srli_epi16(w, 12);
  }
}

// gemv_tile for M = 1 or 2 x rows (H = 2 accumulators per output for one x
// row, else 1) by quad chunks: x = g.xq in the quad layout, row j at j * k;
// SPC 1 (blocksize 64) or 0 (blocksize >= 128: one block per chunk).
template <int R, int M, int SPC>
void gemv_quad(const GemvArgs& g, const TileSet& rows, __m512* acc_mem, int64_t lda, KRange kr) {
  static_assert(SPC == 0 || SPC == 1, "quad chunks: blocksize >= 64");
  static_assert(M == 1 || M == 2, "quad chunks: x in registers");
  constexpr int H = M == 1 ? 2 : 1;
  const int64_t k = g.k;
  const __m512i upper = upper_half_bytes();
  __m512 acc[R][M][H];
  load_acc(acc, acc_mem, lda, kr.resume);
  const TileRows<R, SPC> t(g, rows, kr.c0);
  const uint8_t* wb = t.wb;  // row r0 at chunk c
  const float* sb = t.sb;    // (SPC > 0) its scales
  // row i's table at chunk c (s: its scales there when SPC = 1), made one
  // chunk ahead as in gemv_tile
  auto table = [&](int i, int64_t c, const float* s) -> __m512i {
    if constexpr (SPC == 1) {
      const __m512 a = _mm512_mul_ps(g.codes, _mm512_set1_ps(s[0]));
      const __m512 b = _mm512_mul_ps(g.codes, _mm512_set1_ps(s[1]));
      return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
    } else {
      return chunk_table<false>(g.codes, *t.scales_at(i, c), 0.0f);
    }
  };
  __m512i tab_next[R];
  for (int i = 0; i < R; ++i) tab_next[i] = table(i, kr.c0, sb + i * t.row_scales);
  for (int64_t c = kr.c0; c < kr.c1; c += kQuad, wb += kQuad / 2, sb += 2 * SPC) {
    __m512i xv[M][4];
    for (int j = 0; j < M; ++j)
      for (int q = 0; q < 4; ++q) xv[j][q] = _mm512_load_si512(g.xq + j * k + c + 32 * q);
    const bool more = c + kQuad < kr.c1;
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512i tab = tab_next[i];
      if (more) tab_next[i] = table(i, c + kQuad, sb + i * t.row_scales + 2 * SPC);
      const uint8_t* bytes = wb + i * t.row_bytes;
      if (t.pf) prefetch_stream(bytes + t.pf_bytes);  // one line per row and chunk
      __m512i ix[4];
      quad_index<SPC>(_mm512_loadu_si512(bytes), upper, ix);
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        const __m512i wq = _mm512_permutexvar_epi16(ix[q], tab);
        for (int j = 0; j < M; ++j) acc[i][j][q % H] = dot(acc[i][j][q % H], wq, xv[j][q]);
      }
    }
  }
  store_acc(acc, acc_mem, lda);
}

// 5-8 x rows ("wide"): one group, each W row pair decoded once for all of
// them, x read from L1 by the dot products (one thread, 4096^2, against
// groups of <= 4 decoding W again per group: batch 5 0.59-0.61 -> 0.52-0.55
// ms, 6 0.65-0.66 -> 0.62-0.63, 8 0.79 -> 0.74-0.77 on the Zen 5 VM).
// With a 48 KiB L1D (Zen 5) k is split into segments of kWideXBytes of x,
// which stay in L1 beside the W rows and accumulators while every W row pair
// of a row block sweeps them (Zen 5, batch 8: unsegmented, 8 rows of x (64
// KiB) 1.0 ms; segments of 12 / 24 / 32 / 48 KiB 0.90 / 0.81 / 0.74-0.77 /
// 0.93). A 32 KiB L1D (Zen 4) does not hold a 32 KiB segment beside the rest
// either, and segments only added the cost of stopping and resuming each
// tile (its accumulators stored and reloaded, its first chunk's decode
// exposed): Zen 4, one thread, 4096^2, unsegmented against 32 / 16 KiB
// segments, batch 8 1.46-1.50 against 1.55-1.58 / 1.68 ms, batch 5 1.02-1.05
// against 1.08-1.10; k = 11008: batch 5 2.77 against 2.99, batch 8 4.32-4.49
// against 4.36-4.48 (and 4.99-5.11 with 64 KiB segments).
constexpr int kWideGroup = 8;                           // up to this many x rows: one group
constexpr int kWideR = 2;                               // W rows per register tile then
constexpr int64_t kWideXBytes = int64_t(32) << 10;      // x bytes per k segment, on a large enough L1D
constexpr int64_t kWideSegmentL1d = int64_t(48) << 10;  // the L1D size from which k is segmented

// gemv_tile with one accumulator per output and M = 1..MMAX x rows chosen
// at run time
template <int R, int MMAX, int SPC>
void gemv_tile_any(int M, const GemvArgs& g, const TileSet& rows, int64_t j0, __m512* acc, int64_t lda, KRange kr) {
  if constexpr (MMAX > 1) {
    if (M < MMAX) return gemv_tile_any<R, MMAX - 1, SPC>(M, g, rows, j0, acc, lda, kr);
  }
  gemv_tile<R, MMAX, 1, SPC>(g, rows, j0, acc, lda, kr);
}

// M x rows (1..kWideGroup); H = 2 accumulators per output (only when m <= 2,
// so then M <= 2).
template <int R, int SPC>
void gemv_rows(int M, int H, const GemvArgs& g, const TileSet& rows, int64_t j0, __m512* acc, int64_t lda, KRange kr) {
  if (H == 2) {
    if (M == 2) return gemv_tile<R, 2, 2, SPC>(g, rows, j0, acc, lda, kr);
    return gemv_tile<R, 1, 2, SPC>(g, rows, j0, acc, lda, kr);
  }
  gemv_tile_any<R, kWideGroup, SPC>(M, g, rows, j0, acc, lda, kr);
}

constexpr int kGemvR = 4;                                     // W rows per gemv register tile
constexpr int64_t kGemvStreamRows = 8;                        // rows of each stream whose scales are decoded at once
constexpr int64_t kGemvBlockRows = kGemvR * kGemvStreamRows;  // W rows summed at once

// m <= 4: each W row group is decoded into registers and dotted with every x
// row at once; 4 < m <= kWideGroup: the same by W row pairs, x from L1 in k
// segments (wide). kWideGroup < m <= kGemvMaxM: x rows in groups of <= 4,
// each group's pass decoding the W row group again from L1. (Decoding it once into an L1 buffer
// for the other groups, and splitting k into segments whose x rows stay in
// L1, measured slower: one thread, 4096^2, batch 8 2.28 vs 1.80 ms, batch 16
// 4.89 vs 3.58.) SPC: scales per chunk (gemv_tile).
template <typename OutT, typename BiasT, int SPC>
void gemv_path(const Gemm4bitParams& p, const ScaleDecoder& scales) {
  const int64_t m = p.m, n = p.n, k = p.k;
  const bool wide = m > kGemvGroup && m <= kWideGroup;
  const bool quad = SPC < 2 && m <= 2 && k % kQuad == 0;  // quad chunks
  // deinterleaved x, one pass (caller's scratch)
  uint16_t* xq = scratch_as<uint16_t>(kSlotPanels, m * k * 2);
  if (quad) {
    for (int64_t j = 0; j < m; ++j) quad_x(static_cast<const uint16_t*>(p.x) + j * k, k, xq + j * k);
  } else {
    const uint16_t* x = static_cast<const uint16_t*>(p.x);
    const __m512i ie = deinterleave_index(0), io = deinterleave_index(1);
    for (int64_t i = 0; i < m * k; i += kChunk) {
      __m512i e, o;
      deinterleave64(x + i, ie, io, &e, &o);
      // wide: chunk c of row j at (c * m + j) * 64
      const int64_t at = wide ? ((i % k) / kChunk * m + i / k) * kChunk : i;
      _mm512_storeu_si512(xq + at, e);
      _mm512_storeu_si512(xq + at + 32, o);
    }
  }
  const GemvArgs g{p.packed, n * k, k, log2_exact(p.blocksize), code_table(p.quant_type), xq};
  // x groups of at most 4 rows, as even as possible, or one (wide)
  const int groups = wide ? 1 : int(ceil_div(m, kGemvGroup));
  const int64_t gsize = ceil_div(m, groups);
  const int H = m == 1 || (m == 2 && !quad) ? 2 : 1;  // accumulators per output
  const int64_t lda = m * H;                          // vectors per W row in acc
  // wide: k in segments whose x rows stay in L1, where they can (kWideSegmentL1d)
  const bool segment = wide && cpu_l1d_bytes() >= kWideSegmentL1d;
  const int64_t kseg = segment ? max64(kChunk, kWideXBytes / (2 * m) / kChunk * kChunk) : k;
  // A chunk of rows [n0, n1) is cut into kGemvR equal runs (the rows left
  // over after them go one at a time), and register tile i takes the i-th row
  // of every run: four row streams, each in pages of its own and prefetched
  // one row ahead, where four adjacent rows shared pages (as the avx512
  // level's gemv128). On the Xeon VM (Q4_ISA=avx512_bf16, bf16 x, 4096^2
  // nested, 32 layers cycled through the C ABI, alternating rounds in one
  // process): from DRAM batch 1 0.54 -> 0.47 ms, 2 0.66 -> 0.63, 4 1.11 ->
  // 1.09; from L3 within 1-2.5% (two rows ahead: 6% slower from L3). A row's
  // sums do not depend on the other rows of its tile: no output bit changes.
  parallel_for(ceil_div(n, kGemvR), 16, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * kGemvR, n1 = min64(n, t1 * kGemvR);
    const int64_t run = (n1 - n0) / kGemvR;  // rows per stream
    // scale entries per stream and step block (kGemvStreamRows rows)
    const int64_t part = (((kGemvStreamRows * k) >> g.shift) + 4 + 15) / 16 * 16;
    float* sc = scratch_as<float>(kSlotRow, part * kGemvR * 4);
    __m512* acc = scratch_as<__m512>(kSlotAcc, kGemvBlockRows * lda * 64);
    float res[kGemvBlockRows * kGemvMaxM];
    const float* bases[kGemvR];
    // `tiles` register tiles of kGemvR rows (full) or of one row, tile t's
    // rows set(t), its partial sums at acc + t * (rows per tile) * lda
    const auto compute = [&](int64_t tiles, bool full, const auto& set) {
      for (int64_t c0 = 0; c0 < k; c0 += kseg) {
        const KRange kr{c0, min64(k, c0 + kseg), c0 > 0};
        for (int64_t t = 0; t < tiles; ++t) {
          const TileSet rows = set(t);
          __m512* a = acc + t * (full ? kGemvR : 1) * lda;
          for (int64_t j0 = 0; j0 < m; j0 += gsize) {
            const int M = int(min64(gsize, m - j0));
            if constexpr (SPC < 2) {
              if (quad) {
                if (full) {
                  if (m == 1) gemv_quad<kGemvR, 1, SPC>(g, rows, a, lda, kr);
                  if (m == 2) gemv_quad<kGemvR, 2, SPC>(g, rows, a, lda, kr);
                } else {
                  if (m == 1) gemv_quad<1, 1, SPC>(g, rows, a, lda, kr);
                  if (m == 2) gemv_quad<1, 2, SPC>(g, rows, a, lda, kr);
                }
                continue;
              }
            }
            if (full && M > kGemvGroup) {
              for (int i = 0; i < kGemvR; i += kWideR)
                gemv_rows<kWideR, SPC>(M, H, g, rows.sub(i), j0, a + i * lda + j0 * H, lda, kr);
            } else if (full) {
              gemv_rows<kGemvR, SPC>(M, H, g, rows, j0, a + j0 * H, lda, kr);
            } else {
              gemv_rows<1, SPC>(M, H, g, rows, j0, a + j0 * H, lda, kr);
            }
          }
        }
      }
    };
    // the partial sums of `slots` W rows (acc slot s: W row row_of(s)) summed and stored
    const auto finish = [&](int64_t slots, const auto& row_of) {
      for (int64_t i = 0; i < slots * m; ++i) {
        __m512 v = acc[i * H];
        if (H == 2) v = _mm512_add_ps(v, acc[i * H + 1]);
        res[i] = _mm512_reduce_add_ps(v);
      }
      OutT* out = static_cast<OutT*>(p.out);
      for (int64_t s = 0; s < slots; ++s) {
        const int64_t r = row_of(s);
        for (int64_t j = 0; j < m; ++j)
          Elem<OutT>::store(out, j * n + r, res[s * m + j] + load_bias_as<BiasT>(p.bias, r));
      }
    };
    for (int64_t i0 = 0; i0 < run; i0 += kGemvStreamRows) {
      const int64_t steps = min64(kGemvStreamRows, run - i0), next = min64(kGemvStreamRows, run - i0 - steps);
      for (int j = 0; j < kGemvR; ++j)  // stream j's rows [n0 + j run + i0, + steps)
        bases[j] = scales.decode_rows(n0 + j * run + i0, steps, next, k, g.shift, sc + j * part);
      compute(steps, true, [&](int64_t t) { return TileSet{n0 + i0 + t, run, bases, part}; });
      finish(steps * kGemvR, [&](int64_t s) { return n0 + (s % kGemvR) * run + i0 + s / kGemvR; });
    }
    const int64_t left = n0 + kGemvR * run;  // the rows left over, adjacent
    if (left < n1) {
      const float* base = scales.decode_rows(left, n1 - left, 0, k, g.shift, sc);
      for (int j = 0; j < kGemvR; ++j) bases[j] = base;
      compute(n1 - left, false, [&](int64_t t) { return TileSet{left + t, 1, bases, k >> g.shift}; });
      finish(n1 - left, [&](int64_t s) { return left + s; });
    }
  });
}

// ---------------------------------------------------------- tiled (m larger)

constexpr int64_t kTileN = 32;            // W rows per tile (half that when interleaved)
constexpr int64_t kInterleavePanels = 2;  // interleave the decode with the dot products up to this many panels
constexpr int64_t kTileK = 256;           // W columns per tile (128 pairs)
constexpr int kMicroR = 8;                // W rows per register tile
constexpr int kMicroQ = 3;                // panels per register tile

// acc[r][q] (at acc + (q * lda + r) * 16) += sum over t < steps of the pair
// products of W row r (dwords w[r * ldw + t], broadcast) and panel q (x[q * ldx
// + t * 16 .. + 16]). Every `every` steps (a power of two) one chunk of the
// next tile is decoded by dec.
template <int R, int Q, bool TWO, bool DEC>
void micro_fwd(const uint32_t* w, int64_t ldw, const uint32_t* x, int64_t ldx, int64_t steps, float* acc, int64_t lda,
               TileDecoder<TWO>* dec, int64_t every) {
  __m512 a[R][Q];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < Q; ++q) a[r][q] = _mm512_load_ps(acc + (q * lda + r) * 16);
  const int64_t mask = every - 1;
  for (int64_t t = 0; t < steps; ++t) {
    if (DEC && (t & mask) == 0 && !dec->done()) dec->step();
    __m512i xv[Q];
#pragma GCC unroll 4
    for (int q = 0; q < Q; ++q) xv[q] = _mm512_load_si512(x + q * ldx + t * 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_set1_epi32(int(w[r * ldw + t]));
#pragma GCC unroll 4
      for (int q = 0; q < Q; ++q) a[r][q] = dot(a[r][q], xv[q], wv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < Q; ++q) _mm512_store_ps(acc + (q * lda + r) * 16, a[r][q]);
}

// micro_fwd with R = rows (1..RMAX) chosen at run time
template <int RMAX, int Q, bool TWO, bool DEC>
void micro_fwd_r(int rows, const uint32_t* w, int64_t ldw, const uint32_t* x, int64_t ldx, int64_t steps, float* acc,
                 int64_t lda, TileDecoder<TWO>* dec, int64_t every) {
  if constexpr (RMAX > 1) {
    if (rows == RMAX) return micro_fwd<RMAX, Q, TWO, DEC>(w, ldw, x, ldx, steps, acc, lda, dec, every);
    return micro_fwd_r<RMAX - 1, Q, TWO, DEC>(rows, w, ldw, x, ldx, steps, acc, lda, dec, every);
  } else {
    return micro_fwd<1, Q, TWO, DEC>(w, ldw, x, ldx, steps, acc, lda, dec, every);
  }
}

template <bool TWO, bool DEC>
void micro_fwd_any(int R, int Q, const uint32_t* w, int64_t ldw, const uint32_t* x, int64_t ldx, int64_t steps,
                   float* acc, int64_t lda, TileDecoder<TWO>* dec, int64_t every) {
  if (Q == 3) return micro_fwd_r<kMicroR, 3, TWO, DEC>(R, w, ldw, x, ldx, steps, acc, lda, dec, every);
  if (Q == 2) return micro_fwd_r<kMicroR, 2, TWO, DEC>(R, w, ldw, x, ldx, steps, acc, lda, dec, every);
  micro_fwd_r<kMicroR, 1, TWO, DEC>(R, w, ldw, x, ldx, steps, acc, lda, dec, every);
}

template <typename OutT, typename BiasT, bool TWO>
void tiled_path(const Gemm4bitParams& p, const ScaleDecoder& scales) {
  const int64_t m = p.m, n = p.n, k = p.k;
  const int shift = log2_exact(p.blocksize);
  const int64_t panels = ceil_div(m, kPanel);
  uint32_t* xp = scratch_as<uint32_t>(kSlotPanels, panels * k * 2 * kPanel);
  pack_panels(static_cast<const uint16_t*>(p.x), m, k, xp);
  const __m512 codes = code_table(p.quant_type);
  // few panels: small W tiles, each decoded inside the previous one's dot
  // products (two tiles and the x panels stay in L1); many panels: the decode
  // is a small part, larger tiles decoded in place
  const bool interleave = panels <= kInterleavePanels;
  const int64_t tile_n = interleave ? kTileN / 2 : kTileN;
  parallel_for(ceil_div(n, tile_n), 1, [&](int64_t t0, int64_t t1) {
    float* acc = scratch_as<float>(kSlotAcc, panels * kTileN * 16 * 4);
    // worker scratch: two decoded W tiles (the current one and the next; the
    // second offset by 1 KiB + 64 B so that its stores do not alias the loads
    // from the first modulo 4 KiB), then the tile rows' block scales
    const int64_t tile_dwords = kTileN * kTileK / 2 + 272;
    const int64_t sc_count = ((kTileN * k) >> shift) + 4;
    uint32_t* wt0 = scratch_as<uint32_t>(kSlotRow, 2 * tile_dwords * 4 + sc_count * 4);
    float* sc = reinterpret_cast<float*>(wt0 + 2 * tile_dwords);
    const int64_t row_groups = ceil_div(tile_n, kMicroR), panel_groups = ceil_div(panels, kMicroQ);
    for (int64_t tile = t0; tile < t1; ++tile) {
      const int64_t r0 = tile * tile_n, rows = min64(tile_n, n - r0);
      const BlockSpan blocks = row_blocks(r0, rows, k, shift);
      const int64_t b0 = blocks.first, b1 = blocks.end;
      scales.decode(b0, b1, sc);
      memset(acc, 0, size_t(panels * kTileN * 16) * sizeof(float));
      auto decoder = [&](int64_t c0, uint32_t* wt) {
        return TileDecoder<TWO>{p.packed, k,          shift, codes, sc, b0, r0, rows, c0, min64(kTileK, k - c0),
                                wt,       kTileK / 2, n,     kTileK};
      };
      if (interleave) {
        TileDecoder<TWO> first = decoder(0, wt0);
        first.finish();
      }
      for (int64_t c0 = 0, i = 0; c0 < k; c0 += kTileK, ++i) {
        const int64_t len = min64(kTileK, k - c0);
        uint32_t* wt = wt0 + (interleave ? (i & 1) * tile_dwords : 0);
        // interleaved: the next W tile is decoded inside this one's dot products
        TileDecoder<TWO> next = decoder(c0 + kTileK, wt0 + ((i + 1) & 1) * tile_dwords);
        if (!interleave) {
          TileDecoder<TWO> now = decoder(c0, wt);
          now.finish();
        }
        if (!interleave || c0 + kTileK >= k) next.rows = 0;
        const int64_t steps = panel_groups * row_groups * (len / 2);
        const int64_t chunks = max64(1, next.rows * (next.len / kChunk));
        int64_t every = 1;
        while (every * 2 <= steps / chunks) every *= 2;
        for (int64_t q0 = 0; q0 < panels; q0 += kMicroQ) {
          const int Q = int(min64(kMicroQ, panels - q0));
          const uint32_t* xq = xp + (q0 * (k / 2) + c0 / 2) * kPanel;
          for (int64_t rg = 0; rg < rows; rg += kMicroR) {
            const int R = int(min64(kMicroR, rows - rg));
            if (interleave)
              micro_fwd_any<TWO, true>(R, Q, wt + rg * (kTileK / 2), kTileK / 2, xq, (k / 2) * kPanel, len / 2,
                                       acc + (q0 * kTileN + rg) * 16, kTileN, &next, every);
            else
              micro_fwd_any<TWO, false>(R, Q, wt + rg * (kTileK / 2), kTileK / 2, xq, (k / 2) * kPanel, len / 2,
                                        acc + (q0 * kTileN + rg) * 16, kTileN, &next, every);
          }
        }
        next.finish();
      }
      store_tiles<OutT, BiasT>(acc, kTileN, rows, m, n, r0, p.bias, static_cast<OutT*>(p.out));
    }
  });
}

// ------------------------------------------------------------ input gradient

constexpr int64_t kStrip = 64;      // dX columns per strip (4 zmm of 16)
constexpr int64_t kGradN = 256;     // W rows per decoded tile (128 pairs)
constexpr int kGradR = 6;           // dY rows per register tile
constexpr int64_t kGradFusedM = 4;  // up to this many dY rows: W pairs decoded into registers, no tile

// acc[r][q] (at acc + r * lda + q * 16) += sum over pairs t < steps of
// W pair tile w[t * 64 + q * 16 ..] times the broadcast dY pair of row r (dword
// t of dy + r * ldy). H = 2: even and odd t in separate accumulators, summed
// at the end (few dY rows: hides the vdpbf16ps latency).
template <int R, int H>
void micro_grad(const uint32_t* w, const uint32_t* dy, int64_t ldy, int64_t steps, float* acc, int64_t lda) {
  __m512 a[H][R][4];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) {
      a[0][r][q] = _mm512_load_ps(acc + r * lda + q * 16);
      if (H == 2) a[H - 1][r][q] = _mm512_setzero_ps();
    }
  int64_t t = 0;
  for (; t + H <= steps; t += H) {
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) {
      const uint32_t* wt = w + (t + h) * 64;
      const __m512i w0 = _mm512_load_si512(wt), w1 = _mm512_load_si512(wt + 16);
      const __m512i w2 = _mm512_load_si512(wt + 32), w3 = _mm512_load_si512(wt + 48);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i d = _mm512_set1_epi32(int(dy[r * ldy + t + h]));
        a[h][r][0] = dot(a[h][r][0], w0, d);
        a[h][r][1] = dot(a[h][r][1], w1, d);
        a[h][r][2] = dot(a[h][r][2], w2, d);
        a[h][r][3] = dot(a[h][r][3], w3, d);
      }
    }
  }
  for (; t < steps; ++t) {
    const uint32_t* wt = w + t * 64;
    for (int r = 0; r < R; ++r) {
      const __m512i d = _mm512_set1_epi32(int(dy[r * ldy + t]));
      for (int q = 0; q < 4; ++q) a[0][r][q] = dot(a[0][r][q], _mm512_load_si512(wt + q * 16), d);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) {
      __m512 v = a[0][r][q];
      if (H == 2) v = _mm512_add_ps(v, a[H - 1][r][q]);
      _mm512_store_ps(acc + r * lda + q * 16, v);
    }
}

void micro_grad_any(int R, const uint32_t* w, const uint32_t* dy, int64_t ldy, int64_t steps, float* acc, int64_t lda) {
  switch (R) {
    case 6:
      return micro_grad<6, 1>(w, dy, ldy, steps, acc, lda);
    case 5:
      return micro_grad<5, 1>(w, dy, ldy, steps, acc, lda);
    case 4:
      return micro_grad<4, 1>(w, dy, ldy, steps, acc, lda);
    case 3:
      return micro_grad<3, 1>(w, dy, ldy, steps, acc, lda);
    case 2:
      return micro_grad<2, 2>(w, dy, ldy, steps, acc, lda);
    default:
      return micro_grad<1, 2>(w, dy, ldy, steps, acc, lda);
  }
}

// Few dY rows (R <= 4, all of them): each pair of W rows is decoded into
// registers and used at once (no tile buffer); acc as in micro_grad, H = 2:
// even and odd pairs in separate accumulators.
template <int R, int H, bool TWO>
void grad_fused(const uint8_t* packed, const float* sc, __m512 codes, int shift, int64_t n, int64_t k, int64_t n0,
                int64_t pairs, int64_t c0, const uint32_t* dy, int64_t ldy, float* acc) {
  const __m512i half = upper_half_bit();
  const __m512i i_lo = pair_index(0), i_hi = pair_index(16);
  __m512 a[H][R][4];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) {
      a[0][r][q] = _mm512_load_ps(acc + r * kStrip + q * 16);
      if (H == 2) a[H - 1][r][q] = _mm512_setzero_ps();
    }
  for (int64_t t0 = 0; t0 < pairs; t0 += H) {
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) {
      const int64_t t = t0 + h;
      if (H == 2 && t >= pairs) break;
      __m512i z[4];
      decode_pair<TWO>(packed, sc, codes, shift, uint64_t((n0 + 2 * t) * k + c0), k, n0 + 2 * t + 1 < n, half, i_lo,
                       i_hi, z);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512i d = _mm512_set1_epi32(int(dy[r * ldy + n0 / 2 + t]));
        for (int q = 0; q < 4; ++q) a[h][r][q] = dot(a[h][r][q], z[q], d);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) {
      __m512 v = a[0][r][q];
      if (H == 2) v = _mm512_add_ps(v, a[H - 1][r][q]);
      _mm512_store_ps(acc + r * kStrip + q * 16, v);
    }
}

template <bool TWO>
void grad_fused_any(int R, const uint8_t* packed, const float* sc, __m512 codes, int shift, int64_t n, int64_t k,
                    int64_t n0, int64_t pairs, int64_t c0, const uint32_t* dy, int64_t ldy, float* acc) {
  switch (R) {
    case 4:
      return grad_fused<4, 1, TWO>(packed, sc, codes, shift, n, k, n0, pairs, c0, dy, ldy, acc);
    case 3:
      return grad_fused<3, 1, TWO>(packed, sc, codes, shift, n, k, n0, pairs, c0, dy, ldy, acc);
    case 2:
      return grad_fused<2, 2, TWO>(packed, sc, codes, shift, n, k, n0, pairs, c0, dy, ldy, acc);
    default:
      return grad_fused<1, 2, TWO>(packed, sc, codes, shift, n, k, n0, pairs, c0, dy, ldy, acc);
  }
}

template <typename OutT, bool TWO>
void grad_path(const Gemm4bitGradInputParams& p, const ScaleDecoder& scales) {
  const int64_t m = p.m, n = p.n, k = p.k;
  const int shift = log2_exact(p.blocksize);
  // dY with an even row length (pairs of n), zero-padded when n is odd
  const int64_t ldy = (n + 1) / 2;  // in dwords
  const uint32_t* dy = static_cast<const uint32_t*>(p.grad_out);
  if (n & 1) {
    uint16_t* pad = scratch_as<uint16_t>(kSlotInput, m * ldy * 4);
    const uint16_t* src = static_cast<const uint16_t*>(p.grad_out);
    for (int64_t r = 0; r < m; ++r) {
      memcpy(pad + r * 2 * ldy, src + r * n, size_t(n) * 2);
      pad[r * 2 * ldy + n] = 0;
    }
    dy = reinterpret_cast<const uint32_t*>(pad);
  } else if (reinterpret_cast<uintptr_t>(dy) % 4 != 0) {
    uint16_t* copy = scratch_as<uint16_t>(kSlotInput, m * n * 2);
    memcpy(copy, p.grad_out, size_t(m * n) * 2);
    dy = reinterpret_cast<const uint32_t*>(copy);
  }
  // every block scale, decoded once (the strips read them with stride k)
  const float* sc_all = decode_all_scales(scales, ceil_div(n * k, p.blocksize), gemm4::kSlotPanels);
  const __m512 codes = code_table(p.quant_type);
  parallel_for(k / kStrip, 1, [&](int64_t s0, int64_t s1) {
    const __m512i half = upper_half_bit();
    const __m512i i_lo = pair_index(0), i_hi = pair_index(16);
    float* acc = scratch_as<float>(kSlotAcc, m * kStrip * 4);
    uint32_t* wt = scratch_as<uint32_t>(kSlotRow, kGradN * kStrip * 2);
    const uint8_t* __restrict packed = p.packed;
    const float* __restrict sc = sc_all;
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t c0 = s * kStrip;
      memset(acc, 0, size_t(m * kStrip) * sizeof(float));
      if (m <= kGradFusedM)
        grad_fused_any<TWO>(int(m), packed, sc, codes, shift, n, k, 0, (n + 1) / 2, c0, dy, ldy, acc);
      for (int64_t n0 = 0; n0 < n && m > kGradFusedM; n0 += kGradN) {
        const int64_t rows = min64(kGradN, n - n0), pairs = (rows + 1) / 2;
        // the strip's chunk of row r starts at flat index r*k + c0
        for (int64_t t = 0; t < pairs; ++t) {
          __m512i z[4];
          decode_pair<TWO>(packed, sc, codes, shift, uint64_t((n0 + 2 * t) * k + c0), k, n0 + 2 * t + 1 < n, half, i_lo,
                           i_hi, z);
          for (int q = 0; q < 4; ++q) _mm512_store_si512(wt + t * 64 + q * 16, z[q]);
        }
        for (int64_t r = 0; r < m; r += kGradR) {
          const int R = int(min64(kGradR, m - r));
          micro_grad_any(R, wt, dy + r * ldy + n0 / 2, ldy, pairs, acc + r * kStrip, kStrip);
        }
      }
      store_strip<OutT>(acc, m, k, c0, static_cast<OutT*>(p.grad_input));
    }
  });
}

template <typename OutT, typename BiasT>
void gemm_typed(const Gemm4bitParams& p, const ScaleDecoder& scales) {
  const bool two = p.blocksize == 32;
  if (p.m <= kGemvMaxM) {
    if (two) return gemv_path<OutT, BiasT, 2>(p, scales);
    if (p.blocksize == kChunk) return gemv_path<OutT, BiasT, 1>(p, scales);
    return gemv_path<OutT, BiasT, 0>(p, scales);
  }
  if (two) return tiled_path<OutT, BiasT, true>(p, scales);
  tiled_path<OutT, BiasT, false>(p, scales);
}

}  // namespace

bool gemm4(const Gemm4bitParams& p, const gemm4::Scales&) {
  return bf16_forward(p, 0, [&](auto* o, auto* b, const ScaleDecoder& scales) {
    gemm_typed<std::remove_pointer_t<decltype(o)>, std::remove_pointer_t<decltype(b)>>(p, scales);
  });
}

bool grad4(const Gemm4bitGradInputParams& p, const gemm4::Scales&) {
  return bf16_grad(p, 0, [&](auto* o, const ScaleDecoder& scales) {
    using OutT = std::remove_pointer_t<decltype(o)>;
    if (p.blocksize == 32) return grad_path<OutT, true>(p, scales);
    grad_path<OutT, false>(p, scales);
  });
}

}  // namespace avx512_bf16
}  // namespace cpu
}  // namespace q4

Q4_UNIT_END
