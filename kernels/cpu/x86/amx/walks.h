// What the AMX units of the 4-bit matmuls share (x86/amx/gemm4.cc: the bf16
// forwards; grad4.cc: the bf16 input gradients, the 4-bit weights' and
// LLM.int8's; split.cc: the fp32 forward and gradients in bf16 parts): the
// tile sizes, the segment and strip walks, the A tile packing and the int8
// weight decode. Included after a unit's Q4_UNIT_BEGIN(amx) (x86/unit.h),
// with tiles.h, bf16_decode.h and scale_decoder.h before it.
//
// AMX kernels of the fused 4-bit matmuls (and of LLM.int8's input gradient,
// which shares the 4-bit gradients' tile walks): bf16 compute for bf16 inputs
// on the tile unit (TDPBF16PS), at the amx level (AVX512_BF16 + AMX-TILE,
// AMX-BF16, AMX-INT8, and the OS's permission for the tile data; isa.cc).
//
// Contract: the bf16-compute contract of x86/avx512_bf16/gemm4.cc. Each W
// element is decode(nibble) * scale(block) in fp32 rounded once to bf16 (the
// same decode, bf16_decode.h); TDPBF16PS, like vdpbf16ps, multiplies bf16
// pairs exactly, accumulates in fp32 rounding to nearest even, treats denormal
// inputs as zero and flushes denormal results. Only the order of the fp32
// additions differs from the avx512_bf16 paths (the error bound there holds
// as it is). Work is split over W row tiles (forward) and dX column strips
// (gradient), each output summed in a fixed order: results do not depend on
// the thread count.
#pragma once

#include <cstdint>
#include <cstring>

namespace q4 {
namespace cpu {
namespace amx {
namespace {  // internal linkage in each unit, as when these lived in one .cc

using gemm4::kSlotAcc;
using gemm4::kSlotInput;
using gemm4::kSlotPanels;
using gemm4::kSlotRow;
using gemm4::log2_exact;

constexpr int64_t kMinM = 3;                          // x rows from which the tile path runs (measured crossover)
constexpr int64_t kWRows = 32;                        // W rows per decoded W tile (two A tiles)
constexpr int64_t kMaxRowStride = 4;                  // forward: a W tile's rows at most this many rows apart
constexpr int64_t kStreamedBytes = int64_t(4) << 20;  // forward: from this many bytes of W its tiles take spaced rows
static_assert(kMaxRowStride <= kMaxStoreStride, "store_tiles stores rows at most kMaxStoreStride apart");
constexpr int64_t kSegK = 256;  // W columns decoded per segment (32 rows: 16 KiB of bf16, stays in L1)
constexpr int64_t kXBlockBytes = int64_t(3) << 19;  // x panels kept in L2 while the W tiles pass (1.5 MiB)
constexpr int64_t kAmxStrip = 256;  // gradient: dX columns per strip (two whole 64-byte lines of each W row)
constexpr int64_t kSegN = 256;      // gradient: W rows decoded per segment (a strip's columns: 128 KiB, in L2)
constexpr int64_t kStripStep = kAmxStrip / 16 * 256;  // gradient: dwords per k step of a strip's W tiles
constexpr int64_t kL2Budget = int64_t(3) << 19;       // gradient: bytes of L2 for a dY block's strip sums
constexpr int64_t kGradInPlaceN = 1536;  // gradient: dY read in place up to this width (packed beyond: measured)

// The walk of a segment decode over W rows r0 + r * stride (r < rows) x
// columns [c0, c0 + len): asks for each row's bytes of the next segment (SEG
// columns wide), then calls chunk(bytes, b, d) for each 64-element chunk with
// its 32 packed bytes, its block b - b0 and its destination d = ws + r * SEG /
// 2 + c / 2.
template <int64_t SEG, typename F>
inline void for_each_segment_chunk(const uint8_t* packed, int64_t k, int shift, int64_t b0, int64_t r0, int64_t rows,
                                   int64_t stride, int64_t c0, int64_t len, uint32_t* ws, F&& chunk) {
  for (int64_t r = 0; r < rows; ++r) {
    uint64_t g = uint64_t((r0 + r * stride) * k + c0);
    if (c0 + len < k)
      for (int64_t l = 0; l < min64(SEG, k - c0 - len); l += 128)
        _mm_prefetch(reinterpret_cast<const char*>(packed + ((g + len + l) >> 1)), _MM_HINT_T0);
    uint32_t* d = ws + r * (SEG / 2);
    for (int64_t c = 0; c < len; c += kChunk, g += kChunk, d += 32)
      chunk(packed + (g >> 1), int64_t(g >> shift) - b0, d);
  }
}

// A [m, cols] bf16 -> ap[group of 16 rows][step of 32 columns][16 rows][32
// words], zero past m and cols: the A tiles of a group, 1 KiB each, contiguous
// (dY in the input gradient beyond kGradInPlaceN columns, and in both the
// forward and the gradient the rows after the last whole 32-row pair read in
// place, padded with zero rows).
inline void pack_a_tiles(const uint16_t* a, int64_t m, int64_t cols, int64_t steps, uint16_t* ap) {
  parallel_for(ceil_div(m, 16) * steps, 64, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t g = u / steps, c0 = (u % steps) * 32;
      const int64_t len = min64(32, cols - c0);
      const __mmask32 mk = len >= 32 ? ~__mmask32(0) : ((__mmask32(1) << len) - 1);
      uint16_t* dst = ap + u * 512;
      for (int l = 0; l < 16; ++l) {
        const int64_t row = g * 16 + l;
        const __m512i v = row < m ? _mm512_maskz_loadu_epi16(mk, a + row * cols + c0) : _mm512_setzero_si512();
        _mm512_store_si512(dst + l * 32, v);
      }
    }
  });
}

// A strip's W segment -- rows [n0, n0 + rows), the strip's `halves` 64-column
// parts -- as B tiles in wt ([rows / 32 k steps][kAmxStrip / 16 column
// groups][16 row pairs][16 dwords]), PARTS sets of them part_stride dwords
// apart; row pairs past n are zero. decode(t, h, z) fills z[part][0..3] with
// row pair t's part h (decode_pair's four vectors).
template <int PARTS, typename Decode>
inline void decode_strip_segment(int64_t rows, int64_t halves, uint32_t* wt, int64_t part_stride, Decode&& decode) {
  const int64_t pairs = (rows + 1) / 2, steps = ceil_div(rows, 32);
  if (pairs % 16 != 0)  // pairs past n: zero
    for (int j = 0; j < PARTS; ++j)
      memset(wt + j * part_stride + (pairs / 16) * kStripStep, 0, size_t((steps - pairs / 16) * kStripStep) * 4);
  for (int64_t t = 0; t < pairs; ++t) {
    uint32_t* dst = wt + (t / 16) * kStripStep + (t % 16) * 16;
    for (int64_t h = 0; h < halves; ++h) {
      __m512i z[PARTS][4];
      decode(t, h, z);
      for (int j = 0; j < PARTS; ++j)
        for (int q = 0; q < 4; ++q) _mm512_store_si512(dst + j * part_stride + (4 * h + q) * 256, z[j][q]);
    }
  }
}

// The input gradients' work: (dY row block, strip) units, row-block major.
// A block has at most `most` rows (its sums for a strip stay in the L2),
// and fewer where the strips alone would not give each thread two units: at
// k = 384 (a strip of 256 columns and one of 128) two threads split by
// strips alone were one busy while the other did half as much. Rows are
// independent, so the blocking changes no bit.
struct GradUnits {
  int64_t m, strips, block, count;
  GradUnits(int64_t m_, int64_t k, int64_t most, int64_t align) : m(m_) {
    strips = ceil_div(k, kAmxStrip);
    const int64_t blocks = ceil_div(2 * int64_t(std::max(1, cpu_num_threads())), strips);
    block = max64(align, min64(most, ceil_div(ceil_div(m, blocks), align) * align));
    count = ceil_div(m, block) * strips;
  }
  struct Unit {
    int64_t r0, re, strip;  // dY rows [r0, re), the strip's index
  };
  Unit operator[](int64_t u) const {
    const int64_t r0 = (u / strips) * block;
    return {r0, min64(m, r0 + block), u % strips};
  }
};

// Asks for the bytes at `at` of W rows (row, row + 1) (rows `stride` bytes
// apart) kAheadPairs row pairs on, where they exist. A gradient strip reads a
// few lines of each W row, rows k / 2 (4-bit) or k (int8) bytes apart, each
// in its own 4 KiB page at k = 4096, which the hardware prefetchers do not
// follow. Measured (bf16 dY, 4096^2, in-process A/B): 4-bit 1.42 -> 1.14 ms
// at 4 rows, 2.06 -> 1.88 at 64, 9.0 -> 8.4 at 512; int8 2.02 -> 1.31 at 4
// rows, 3.46 -> 2.03 at 64; 2 and 8 pairs ahead alike, 16 worse; MiniLM's
// shapes (W in L2) unchanged. In asm: GCC 12 emitted no instruction for
// _mm_prefetch / __builtin_prefetch here (none in the gradients' loops).
constexpr int64_t kAheadPairs = 4;

inline void prefetch_ahead(const void* at, int64_t row, int64_t n, int64_t stride) {
  if (row + 2 * kAheadPairs + 1 < n) {
    const char* a = static_cast<const char*>(at) + 2 * kAheadPairs * stride;
    asm volatile("prefetcht0 %0" ::"m"(*a));
    asm volatile("prefetcht0 %0" ::"m"(*(a + stride)));
  }
}

// The 16 int16 of v widened to fp32 and times s.
inline __m512 scaled_words(__m256i v, __m512 s) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(v)), s);
}

// The 64 int8 at w times s, rounded to bf16, as decode_chunk returns a 4-bit
// chunk (hi: columns 0, 2, .., 62; lo: 1, 3, .., 63): each word holds columns
// (2i, 2i + 1); its low byte sign-extended gives the even column, its high
// byte the odd one.
inline Chunk int8_chunk(const int8_t* w, float s) {
  const __m512i b = _mm512_loadu_si512(w);
  const __m512i even = _mm512_srai_epi16(_mm512_slli_epi16(b, 8), 8), odd = _mm512_srai_epi16(b, 8);
  const __m512 sv = _mm512_set1_ps(s);
  return {reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(scaled_words(_mm512_extracti64x4_epi64(even, 1), sv),
                                                        scaled_words(_mm512_castsi512_si256(even), sv))),
          reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(scaled_words(_mm512_extracti64x4_epi64(odd, 1), sv),
                                                        scaled_words(_mm512_castsi512_si256(odd), sv)))};
}

// W rows (row, row + 1) x 64 columns from col of the int8 weight (row stride
// k) scaled by sa, sb, as decode_pair's four vectors (the second row zero
// when has_b is false): decode_pair's interleave of two chunks.
inline void int8_pair(const int8_t* w, int64_t k, float sa, float sb, bool has_b, __m512i i_lo, __m512i i_hi,
                      __m512i z[4]) {
  const Chunk b = has_b ? int8_chunk(w + k, sb) : Chunk{_mm512_setzero_si512(), _mm512_setzero_si512()};
  interleave_pair(int8_chunk(w, sa), b, i_lo, i_hi, z);
}

// s[j] = fp32(SCB[j] * kInv127), the exact contract's column scales (cpu/int8.cc).
inline void int8_column_scales(const Int8GradInputParams& p, float* s) {
  for (int64_t j = 0; j < p.n; ++j) s[j] = p.weight_scale[j] * int8::kInv127;
}

}  // namespace
}  // namespace amx
}  // namespace cpu
}  // namespace q4
