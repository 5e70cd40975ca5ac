// AMX fp32 forward and input gradients as bf16 part products (the fp32
// contract; entries gemm4_split, grad4_split and int8_grad_split of
// cpu/dispatch.h): the tile walks of gemm4.cc / grad4.cc over three exact bf16
// parts of each operand.
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../../dispatch.h"
#include "../../gemm4_common.h"
#include "../../parallel.h"
#include "../unit.h"
#include "q4/common.h"
#include "q4/int8.h"
#include "q4/kernels.h"
#include "q4/quant4.h"

Q4_UNIT_BEGIN(amx)

#include "../avx512/scale_decoder.h"
#include "../avx512_bf16/bf16_decode.h"
#include "tiles.h"
#include "walks.h"

namespace q4 {
namespace cpu {
namespace amx {
namespace {

// ------------------------------------------------------------ fp32 forward in bf16 parts

// fp32 and fp16 inputs (the fp32 contract) from kSplitMinM rows: each x and
// W element v is split exactly into three bf16 parts, v = hi + mid + lo (hi
// = v rounded to bf16, mid = v - hi rounded to bf16, lo = v - hi - mid: each
// remainder is exact and lo has at most 8 significant bits; split3 below),
// and x . W is the sum of the six part products hi.hi, hi.mid, hi.lo,
// mid.hi, mid.mid, lo.hi on TDPBF16PS (bf16 products are exact in fp32). The
// three dropped ones, mid.lo, lo.mid and lo.lo, are below (2^-22 + 2^-31) of
// the product: the error bound is that of an fp32 sum five terms longer (in
// practice the error is below the fp32 kernels': 2.1e-7 against 2.9e-7 at
// 4096^2). hi.hi is summed in its own tiles, the five smaller products in
// another pair, and the two sums added once at the end (in one accumulator,
// where the small products round against the whole, the error measured 1.8x
// the fp32 kernels'). The tile unit reads denormal inputs as zero and
// flushes denormal results, so each x row is first scaled by the power of
// two 2^-E that brings its largest magnitude into [1, 2) (exact), its
// elements below 2^-60 after scaling are dropped (an added error of at most
// 2^-60 max|x_row| sum|w| per output), and the row's sums are scaled back by
// 2^E at the end (one rounding, and only where the result is denormal). With
// every nonzero block scale in [2^-32, 2^32], each kept product is then at
// least 2^-100 and a part product that flushes is below 2^-26 of it; no sum
// can overflow. Rows of tiny values (GELU's and SiLU's far tails, the
// gradients through them) and of huge ones keep the split; a NaN or an
// infinity anywhere in x, or a block scale outside that range, makes the
// call return false, and the avx512 level's fp32 kernel computes it (over
// whatever this one wrote). The blocking is the bf16 forward's with three
// segment and panel sets, one x panel at a time: each thread takes one share
// of the W tiles and walks the x blocks inside it.
constexpr int64_t kSplitMinM = 8;       // x rows from which the split path runs (measured crossover)
constexpr int64_t kSplitGradMinM = 64;  // dY rows from which the split gradient runs (measured crossover)
constexpr int64_t kSplitSegK = 128;     // W columns per segment: three parts of 32 rows, 24 KiB, in L1

constexpr uint32_t kSplitMinX = 0x21800000u;      // 2^-60: scaled x / dY below it are dropped
constexpr uint32_t kSplitMinScale = 0x2f800000u;  // 2^-32
constexpr uint32_t kSplitMaxScale = 0x4f800000u;  // 2^32

// Lanes of v (fp32 bits) outside {0} u [lo, hi] in magnitude (NaN and
// infinities are above hi).
inline __mmask16 out_of_range(__m512i v, uint32_t lo, uint32_t hi) {
  const __m512i a = _mm512_and_si512(v, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nonzero = _mm512_test_epi32_mask(a, a);
  return _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(int(hi))) |
         _mm512_mask_cmplt_epu32_mask(nonzero, a, _mm512_set1_epi32(int(lo)));
}

inline bool scales_in_range(const float* sc, int64_t count) {
  __mmask16 bad = 0;
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) bad |= out_of_range(_mm512_loadu_si512(sc + i), kSplitMinScale, kSplitMaxScale);
  if (i < count)
    bad |= out_of_range(_mm512_maskz_loadu_epi32(__mmask16((1u << (count - i)) - 1), sc + i), kSplitMinScale,
                        kSplitMaxScale);
  return bad == 0;
}

// v rounded to bf16, as fp32: to nearest even (v finite), or toward zero.
template <bool NEAREST>
inline __m512 round_bf16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v), hi = _mm512_set1_epi32(int(0xffff0000u));
  if (!NEAREST) return _mm512_castsi512_ps(_mm512_and_si512(b, hi));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), odd);
  return _mm512_castsi512_ps(_mm512_and_si512(r, hi));
}

// The three parts (hi, mid, lo) of the 16 fp32 values v, each remainder
// rounded to bf16 to nearest (the inputs: |mid| <= 2^-8 |v|, |lo| <= 2^-16
// |v|) or toward zero (the weight, in the decode's inner loop, where it is
// 4 integer operations less per part: |mid| < 2^-7 |v|, |lo| < 2^-15 |v|).
struct Parts {
  __m512 p[3];
};
template <bool NEAREST>
inline Parts split3(__m512 v) {
  const __m512 hi = round_bf16<NEAREST>(v), r = _mm512_sub_ps(v, hi), mid = round_bf16<NEAREST>(r);
  return {{hi, mid, _mm512_sub_ps(r, mid)}};
}

// Words 0-15 = bf16 of a, 16-31 = bf16 of b (exact: the parts are bf16 values).
inline __m512i to_bf16(__m512 a, __m512 b) { return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)); }

// Per row of v [m, cols] (fp32): e[r] = E, the exponent of the row's
// largest magnitude (in [2^E, 2^(E+1)); 0 for a row of zeros), as a float
// for vscalefps. False when some value is a NaN or an infinity.
bool row_exponents(const float* v, int64_t m, int64_t cols, float* e) {
  std::atomic<bool> bad{false};
  parallel_for(m, 16, [&](int64_t r0, int64_t r1) {
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = v + r * cols;
      __m512i mx = _mm512_setzero_si512();
      int64_t c = 0;
      for (; c + 16 <= cols; c += 16)
        mx = _mm512_max_epu32(mx, _mm512_and_si512(_mm512_loadu_si512(row + c), magnitude));
      if (c < cols)
        mx = _mm512_max_epu32(
            mx, _mm512_and_si512(_mm512_maskz_loadu_epi32(__mmask16((1u << (cols - c)) - 1), row + c), magnitude));
      const uint32_t b = _mm512_reduce_max_epu32(mx);
      if (b >= 0x7f800000u) bad.store(true, std::memory_order_relaxed);
      // normal: the biased exponent; denormal (b * 2^-149): its top bit's place
      e[r] = float(b >= 0x00800000u ? int(b >> 23) - 127 : b == 0 ? 0 : (31 - __builtin_clz(b)) - 149);
    }
  });
  return !bad.load();
}

// v * 2^-e (exact), with the lanes below 2^-60 after it set to zero: a row's
// values as the split multiplies them.
inline __m512 scaled_row(__m512 v, __m512 neg_e) {
  const __m512 s = _mm512_scalef_ps(v, neg_e);
  const __m512i a = _mm512_and_si512(_mm512_castps_si512(s), _mm512_set1_epi32(0x7fffffff));
  return _mm512_maskz_mov_ps(_mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(int(kSplitMinX))), s);
}

// x [m, k] fp32 -> the panels of its three parts (part j at xp + j * stride
// dwords, each laid out as pack_panels lays out a bf16 x), row r scaled by
// 2^-e[r] (scaled_row).
void pack_panels_split(const float* x, const float* e, int64_t m, int64_t k, uint32_t* xp, int64_t stride) {
  const int64_t panels = ceil_div(m, kPanel), chunks = k / kChunk;
  parallel_for(panels * chunks, 16, [&](int64_t u0, int64_t u1) {
    const __m512i ie = deinterleave_index(0), io = deinterleave_index(1);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t panel = u / chunks, c = (u % chunks) * kChunk;
      pack_panel_chunk<3>(m, k, panel, c, xp, stride, [&](int64_t r, int l, __m512i(*ev)[16], __m512i(*ov)[16]) {
        const __m512 neg_e = _mm512_set1_ps(-e[r]);
        Parts v[4];
        for (int i = 0; i < 4; ++i) v[i] = split3<true>(scaled_row(_mm512_loadu_ps(x + r * k + c + 16 * i), neg_e));
        for (int part = 0; part < 3; ++part)
          deinterleave64(to_bf16(v[0].p[part], v[1].p[part]), to_bf16(v[2].p[part], v[3].p[part]), ie, io, &ev[part][l],
                         &ov[part][l]);
      });
    }
  });
}

// The three bf16 parts of W rows [r0, r0 + rows) x columns [c0, c0 + len)
// into ws (part j at ws + j * kWRows * kSplitSegK / 2 dwords, each laid out
// as decode_segment lays out its segment, with rows kSplitSegK / 2 dwords
// apart), asking for each row's bytes of the next segment.
template <bool TWO>
void decode_segment_split(const uint8_t* packed, int64_t k, int shift, __m512 codes, const float* sc, int64_t b0,
                          int64_t r0, int64_t rows, int64_t c0, int64_t len, uint32_t* ws) {
  constexpr int64_t part_stride = kWRows * kSplitSegK / 2;
  const __m512i half = upper_half_bit();
  for_each_segment_chunk<kSplitSegK>(packed, k, shift, b0, r0, rows, 1, c0, len, ws,
                                     [&](const uint8_t* bytes, int64_t b, uint32_t* d) {
                                       const __m512 a = _mm512_mul_ps(codes, _mm512_set1_ps(sc[b]));
                                       const __m512 a2 = TWO ? _mm512_mul_ps(codes, _mm512_set1_ps(sc[b + 1])) : a;
                                       const __m512i v = widen_chunk(bytes);
                                       const Parts pa = split3<false>(a), pa2 = TWO ? split3<false>(a2) : pa;
                                       for (int part = 0; part < 3; ++part) {
                                         const Chunk w = lookup_chunk<TWO>(v, to_bf16(pa.p[part], pa2.p[part]), half);
                                         _mm512_store_si512(d + part * part_stride, w.hi);
                                         _mm512_store_si512(d + part * part_stride + 16, w.lo);
                                       }
                                     });
}

// One k step of the six part products into C tiles 0 / 1 (hi.hi) and 2 / 3
// (the five smaller ones): tiles P0 / P1 hold the part of the operand that
// differs between C 0 and 1 (pair(j) loads part j there), S0 / S1 parts of
// the shared one (shared0(j), shared1(j)); PAIR_A: the pair is the A operand
// (the forward's W row groups), else B (the gradient's W column groups).
// Loads: parts hi, mid, lo of the shared operand, then mid again; hi, mid,
// lo of the pair.
template <bool PAIR_A, int P0, int P1, int S0, int S1>
struct SixProducts {
  // C += A . B for tile numbers given as template arguments (the
  // _tile_dpbf16ps macro pastes its arguments' text into the instruction)
  template <int C, int A, int B>
  static void tdp() {
    __asm__ volatile("tdpbf16ps %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C));
  }
  template <int C, int P, int S>
  static void dot() {
    if (PAIR_A)
      tdp<C, P, S>();
    else
      tdp<C, S, P>();
  }
  // PAIR_PARTS = 1: the pair operand is exact in bf16 (LLM.int8's weight),
  // its mid and lo parts zero: the first three products only.
  template <int PAIR_PARTS = 3, typename Pair, typename Shared0, typename Shared1>
  static void step(Pair&& pair, Shared0&& shared0, Shared1&& shared1) {
    pair(0);  // hi . hi -> C 0 / 1
    shared0(0);
    dot<0, P0, S0>();
    dot<1, P1, S0>();
    shared1(1);  // hi . mid
    dot<2, P0, S1>();
    dot<3, P1, S1>();
    shared1(2);  // hi . lo
    dot<2, P0, S1>();
    dot<3, P1, S1>();
    if constexpr (PAIR_PARTS == 1) return;
    pair(1);  // mid . hi
    dot<2, P0, S0>();
    dot<3, P1, S0>();
    shared1(1);  // mid . mid
    dot<2, P0, S1>();
    dot<3, P1, S1>();
    pair(2);  // lo . hi
    dot<2, P0, S0>();
    dot<3, P1, S0>();
  }
};

// C tiles 0 / 1 (W row groups 0 / 1, one panel) += hi.hi, and tiles 2 / 3
// += the five smaller part products, of the segment ws (part stride wst
// dwords) and the panel at xp (part stride xst dwords); acc: hi.hi at acc,
// the rest at acc + 512. Per k step 6 A and 4 B tile loads for 12 products.
void segment_product_split(const uint32_t* ws, int64_t wst, const uint32_t* xp, int64_t xst, int64_t steps, float* acc,
                           bool fresh, bool load, bool store) {
  if (fresh) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else if (load) {
    _tile_loadd(0, acc, 64);
    _tile_loadd(1, acc + 256, 64);
    _tile_loadd(2, acc + 512, 64);
    _tile_loadd(3, acc + 768, 64);
  }
  constexpr int64_t ldw = kSplitSegK * 2;  // bytes per W row of the segment
  for (int64_t s = 0; s < steps; ++s) {
    const uint32_t* w = ws + s * 16;
    const uint32_t* x = xp + s * 256;
    SixProducts<true, 4, 5, 6, 7>::step(
        [&](int j) {  // W part j, row groups 0 / 1
          _tile_loadd(4, w + j * wst, ldw);
          _tile_loadd(5, w + j * wst + 16 * (kSplitSegK / 2), ldw);
        },
        [&](int j) { _tile_loadd(6, x + j * xst, 64); }, [&](int j) { _tile_loadd(7, x + j * xst, 64); });
  }
  if (store) {
    _tile_stored(0, acc, 64);
    _tile_stored(1, acc + 256, 64);
    _tile_stored(2, acc + 512, 64);
    _tile_stored(3, acc + 768, 64);
  }
}

template <typename OutT, typename BiasT, bool TWO>
bool forward_split(const Gemm4bitParams& p, const float* xf, const ScaleDecoder& scales) {
  const int64_t m = p.m, n = p.n, k = p.k;
  const int shift = log2_exact(p.blocksize);
  const int64_t panels = ceil_div(m, kPanel), ps = (k / 2) * kPanel, xst = panels * ps;
  uint32_t* xp = scratch_as<uint32_t>(kSlotPanels, 3 * xst * 4 + panels * kPanel * 4);
  float* xe = reinterpret_cast<float*>(xp + 3 * xst);  // row exponents, zero past m
  std::fill(xe + m, xe + panels * kPanel, 0.0f);
  if (!row_exponents(xf, m, k, xe)) return false;
  pack_panels_split(xf, xe, m, k, xp, xst);
  const __m512 codes = code_table(p.quant_type);
  const int64_t block = max64(2, kXBlockBytes / (3 * ps * 4)) & ~int64_t(1);  // panels per x block
  constexpr int64_t wst = kWRows * kSplitSegK / 2;
  OutT* out = static_cast<OutT*>(p.out);
  std::atomic<bool> bad{false};
  // One share of the W tiles per thread, and in it the x blocks outside the
  // tiles: each thread reads each x block from the L3 once and from its L2
  // once per tile (with the blocks inside, every chunk of W tiles streamed
  // all of x again: at 384 W rows, k = 1536 and 1024 x rows, 8 x 9 MiB), and
  // no thread waits for the other between x blocks.
  const int64_t tiles = ceil_div(n, kWRows);
  parallel_for(tiles, ceil_div(tiles, max64(1, cpu_num_threads())), [&](int64_t t0, int64_t t1) {
    configure_tiles();
    const int64_t sc_count = ((kWRows * k) >> shift) + 4;
    uint32_t* ws = scratch_as<uint32_t>(kSlotRow, 3 * wst * 4 + sc_count * 4);
    float* sc = reinterpret_cast<float*>(ws + 3 * wst);
    float* acc = scratch_as<float>(kSlotAcc, block * kWRows * 32 * 4);
    for (int64_t q0 = 0; q0 < panels && !bad.load(std::memory_order_relaxed); q0 += block) {
      const int64_t qe = min64(panels, q0 + block);
      const bool one = qe - q0 == 1;  // one panel: C stays in the tile registers over all of k
      for (int64_t tile = t0; tile < t1; ++tile) {
        const int64_t r0 = tile * kWRows, rows = min64(kWRows, n - r0);
        const BlockSpan blocks = row_blocks(r0, rows, k, shift);
        const int64_t b0 = blocks.first, b1 = blocks.end;
        scales.decode(b0, b1, sc);
        if (!scales_in_range(sc, b1 - b0)) {
          bad.store(true, std::memory_order_relaxed);
          break;
        }
        if (rows < kWRows)
          for (int j = 0; j < 3; ++j)
            memset(ws + j * wst + rows * (kSplitSegK / 2), 0, size_t((kWRows - rows) * kSplitSegK * 2));
        for (int64_t c0 = 0; c0 < k; c0 += kSplitSegK) {
          const int64_t len = min64(kSplitSegK, k - c0);
          const bool last = c0 + len >= k;
          decode_segment_split<TWO>(p.packed, k, shift, codes, sc, b0, r0, rows, c0, len, ws);
          for (int64_t q = q0; q < qe; ++q)
            segment_product_split(ws, wst, xp + q * ps + (c0 / 2) * kPanel, xst, len / 32, acc + (q - q0) * kWRows * 32,
                                  c0 == 0, !one, !one || last);
        }
        for (int64_t q = q0; q < qe; ++q) {  // the two accumulators' sum scaled back, then bias and store
          float* a = acc + (q - q0) * kWRows * 32;
          const __m512 e = _mm512_loadu_ps(xe + q * kPanel);  // lanes = the panel's x rows
          for (int64_t i = 0; i < kWRows * 16; i += 16)
            _mm512_store_ps(
                a + i, _mm512_scalef_ps(_mm512_add_ps(_mm512_load_ps(a + i), _mm512_load_ps(a + kWRows * 16 + i)), e));
        }
        for (int64_t q = q0; q < qe; q += 2)
          store_tiles<OutT, BiasT>(acc + (q - q0) * kWRows * 32, 2 * kWRows, rows, min64(2 * kPanel, m - q * kPanel), n,
                                   r0, p.bias, out + q * kPanel * n);
      }
    }
    _tile_release();
  });
  return !bad.load();
}

// ------------------------------------------------------------ fp32 input gradient in bf16 parts

// fp32 dY from kSplitGradMinM rows, the forward's split (above) on the bf16
// gradient's blocking: dY's three parts packed as A tiles, W's decoded as B
// tiles; per dY group of 16 rows and pair of column groups, hi.hi into C
// tiles 0 / 1 and the five smaller products into 2 / 3 (acc and acc2), 10
// tile loads per 12 products. Each dY row scaled as the forward's x rows
// are. Declines (false) when a dY is not finite or a block scale is out of
// the split range, before writing anything.

// dY [m, n] fp32 -> the packed A tiles of its three parts (part j at dyp + j *
// stride words, each laid out as pack_a_tiles lays out a bf16 dY), row r scaled
// by 2^-e[r] (scaled_row).
void pack_dy_split(const float* dy, const float* e, int64_t m, int64_t n, int64_t steps, uint16_t* dyp,
                   int64_t stride) {
  const int64_t groups = ceil_div(m, 16);
  parallel_for(groups * steps, 64, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t g = u / steps, c0 = (u % steps) * 32;
      const int64_t len = min64(32, n - c0);
      const __mmask16 m0 = len >= 16 ? __mmask16(0xffff) : __mmask16((1u << len) - 1);
      const __mmask16 m1 = len >= 32 ? __mmask16(0xffff) : len <= 16 ? __mmask16(0) : __mmask16((1u << (len - 16)) - 1);
      for (int l = 0; l < 16; ++l) {
        const int64_t row = g * 16 + l;
        __m512 v0 = _mm512_setzero_ps(), v1 = _mm512_setzero_ps();
        if (row < m) {
          const __m512 neg_e = _mm512_set1_ps(-e[row]);
          v0 = scaled_row(_mm512_maskz_loadu_ps(m0, dy + row * n + c0), neg_e);
          v1 = scaled_row(_mm512_maskz_loadu_ps(m1, dy + row * n + c0 + 16), neg_e);
        }
        const Parts p0 = split3<true>(v0), p1 = split3<true>(v1);
        for (int part = 0; part < 3; ++part)
          _mm512_store_si512(dyp + part * stride + u * 512 + l * 32, to_bf16(p0.p[part], p1.p[part]));
      }
    }
  });
}

// decode_pair for the three parts: z[j] = part j.
template <bool TWO>
inline void decode_pair_split(const uint8_t* __restrict packed, const float* __restrict sc, __m512 codes, int shift,
                              uint64_t fa, int64_t k, bool has_b, __m512i half, __m512i i_lo, __m512i i_hi,
                              __m512i z[3][4]) {
  const uint64_t fb = fa + uint64_t(k);
  const int64_t ba = int64_t(fa >> shift), bb = int64_t(fb >> shift);
  const __m512 a0 = _mm512_mul_ps(codes, _mm512_set1_ps(sc[ba]));
  const __m512 a1 = TWO ? _mm512_mul_ps(codes, _mm512_set1_ps(sc[ba + 1])) : a0;
  const __m512i va = widen_chunk(packed + (fa >> 1));
  __m512 b0 = a0, b1 = a1;
  __m512i vb = _mm512_setzero_si512();
  if (has_b) {
    b0 = _mm512_mul_ps(codes, _mm512_set1_ps(sc[bb]));
    b1 = TWO ? _mm512_mul_ps(codes, _mm512_set1_ps(sc[bb + 1])) : b0;
    vb = widen_chunk(packed + (fb >> 1));
  }
  const Parts pa0 = split3<false>(a0), pa1 = TWO ? split3<false>(a1) : pa0;
  const Parts pb0 = split3<false>(b0), pb1 = TWO ? split3<false>(b1) : pb0;
  for (int part = 0; part < 3; ++part) {
    const Chunk a = lookup_chunk<TWO>(va, to_bf16(pa0.p[part], pa1.p[part]), half);
    Chunk b{_mm512_setzero_si512(), _mm512_setzero_si512()};
    if (has_b) b = lookup_chunk<TWO>(vb, to_bf16(pb0.p[part], pb1.p[part]), half);
    interleave_pair(a, b, i_lo, i_hi, z[part]);
  }
}

// C tiles 0 / 1 (hi.hi) and 2 / 3 (the smaller products) = the 16 dY rows of
// the packed A tiles at dy (part stride dps words, k step s at + s * 512) x
// column groups g, g + 1 of the strip (B tiles at wt, part stride wst dwords,
// k step s at + s * kAmxStrip * 16), over `steps` steps of 16 W row pairs;
// from zero (fresh) or from acc / acc2 [r * kAmxStrip + q * 16 + lane], and
// stored there.
template <int WPARTS>
void grad_product_split(const uint16_t* dy, int64_t dps, const uint32_t* wt, int64_t wst, int64_t steps, float* acc,
                        float* acc2, bool fresh) {
  constexpr int64_t lda = kAmxStrip * 4;  // bytes per row of acc
  if (fresh) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, acc, lda);
    _tile_loadd(1, acc + 16, lda);
    _tile_loadd(2, acc2, lda);
    _tile_loadd(3, acc2 + 16, lda);
  }
  for (int64_t s = 0; s < steps; ++s) {
    const uint32_t* w = wt + s * kStripStep;
    const uint16_t* a = dy + s * 512;
    SixProducts<false, 6, 7, 4, 5>::step<WPARTS>(
        [&](int j) {  // W part j, column groups 0 / 1
          _tile_loadd(6, w + j * wst, 64);
          _tile_loadd(7, w + j * wst + 256, 64);
        },
        [&](int j) { _tile_loadd(4, a + j * dps, 64); }, [&](int j) { _tile_loadd(5, a + j * dps, 64); });
  }
  _tile_stored(0, acc, lda);
  _tile_stored(1, acc + 16, lda);
  _tile_stored(2, acc2, lda);
  _tile_stored(3, acc2 + 16, lda);
}

// dX [m, k] (OutT) = dY [m, n] (fp32) . W [n, k] in bf16 parts on the tile
// unit: dY's three parts packed as A tiles (each row scaled by its power of
// two), W's WPARTS parts given by decode(row, col, has_b, z) (decode_pair's
// four vectors of rows (row, row + 1) x 64 columns from col, per part). The
// 4-bit weights' split gradient (three W parts) and LLM.int8's (one: the
// int8 weight is exact in bf16) share it. False, before anything is
// written, when a dY is not finite.
template <int WPARTS, typename OutT, typename Decode>
bool grad_tiles_split(const float* dy, int64_t m, int64_t n, int64_t k, OutT* out, Decode&& decode) {
  const int64_t steps = ceil_div(n, 32), gs = steps * 512;  // k steps of 32 dY columns; words per dY group
  const int64_t dps = ceil_div(m, 16) * gs;                 // words per dY part
  uint16_t* dyp = scratch_as<uint16_t>(kSlotInput, 3 * dps * 2 + m * 4);
  float* ye = reinterpret_cast<float*>(dyp + 3 * dps);  // dY row exponents
  if (!row_exponents(dy, m, n, ye)) return false;
  pack_dy_split(dy, ye, m, n, steps, dyp, dps);
  const GradUnits units(m, k, max64(16, kL2Budget / (2 * kAmxStrip * 4) / 16 * 16), 16);  // two sums per row
  const int64_t block = units.block;
  constexpr int64_t wst = kSegN * kAmxStrip / 2;  // dwords per W part of a segment
  parallel_for(units.count, 1, [&](int64_t u0, int64_t u1) {
    configure_tiles();
    uint32_t* wt = scratch_as<uint32_t>(kSlotRow, WPARTS * wst * 4);
    float* acc = scratch_as<float>(kSlotAcc, 2 * block * kAmxStrip * 4);
    float* acc2 = acc + block * kAmxStrip;
    for (int64_t u = u0; u < u1; ++u) {
      const auto [r0, re, st] = units[u];
      const int64_t c0 = st * kAmxStrip, halves = min64(kAmxStrip / kStrip, (k - c0) / kStrip);
      for (int64_t n0 = 0; n0 < n; n0 += kSegN) {
        const int64_t rows = min64(kSegN, n - n0), seg_steps = ceil_div(rows, 32);
        decode_strip_segment<WPARTS>(rows, halves, wt, wst, [&](int64_t t, int64_t h, __m512i z[WPARTS][4]) {
          decode(n0 + 2 * t, c0 + h * kStrip, n0 + 2 * t + 1 < n, z);
        });
        for (int64_t r = r0; r < re; r += 16) {
          const uint16_t* a = dyp + (r / 16) * gs + (n0 / 32) * 512;
          for (int g = 0; g < 4 * halves; g += 2)
            grad_product_split<WPARTS>(a, dps, wt + g * 256, wst, seg_steps, acc + (r - r0) * kAmxStrip + g * 16,
                                       acc2 + (r - r0) * kAmxStrip + g * 16, n0 == 0);
        }
      }
      for (int64_t r = r0; r < re; ++r) {  // the two sums' total, scaled back
        const __m512 e = _mm512_set1_ps(ye[r]);
        for (int64_t c = 0; c < halves * kStrip; c += 16) {
          float* a = acc + (r - r0) * kAmxStrip + c;
          _mm512_store_ps(a,
                          _mm512_scalef_ps(_mm512_add_ps(_mm512_load_ps(a), _mm512_load_ps(a + block * kAmxStrip)), e));
        }
      }
      for (int64_t r = r0; r < re; r += 32)
        for (int64_t h = 0; h < halves; ++h)
          store_strip<OutT>(acc + (r - r0) * kAmxStrip + h * kStrip, min64(32, re - r), k, c0 + h * kStrip, out + r * k,
                            kAmxStrip);
    }
    _tile_release();
  });
  return true;
}

template <typename OutT, bool TWO>
bool grad_split(const Gemm4bitGradInputParams& p, const ScaleDecoder& scales) {
  const int64_t k = p.k;
  const int shift = log2_exact(p.blocksize);
  const int64_t n_blocks = ceil_div(p.n * k, p.blocksize);
  const float* sc_all = decode_all_scales(scales, n_blocks, gemm4::kSlotPanels);
  if (!scales_in_range(sc_all, n_blocks)) return false;
  const __m512 codes = code_table(p.quant_type);
  const __m512i half = upper_half_bit(), i_lo = pair_index(0), i_hi = pair_index(16);
  return grad_tiles_split<3>(static_cast<const float*>(p.grad_out), p.m, p.n, k, static_cast<OutT*>(p.grad_input),
                             [&](int64_t row, int64_t col, bool has_b, __m512i z[3][4]) {
                               prefetch_ahead(p.packed + (row * k + col) / 2, row, p.n, k / 2);
                               decode_pair_split<TWO>(p.packed, sc_all, codes, shift, uint64_t(row * k + col), k, has_b,
                                                      half, i_lo, i_hi, z);
                             });
}

// ------------------------------------------------------------ LLM.int8 input gradient, fp32 dY

// fp32 dY from kInt8SplitMinM rows: g = fp32(dY * s[n]) as the exact
// contract computes it (cpu/int8.cc), then sum_n g . CB on the tile unit with
// g split exactly into three bf16 parts and CB exact in bf16 (|CB| <= 128): three
// part products per tile step, each exact in fp32, hi . CB summed in its own
// tiles and the two smaller ones in another pair, added once at the end.
// Each g row is scaled by a power of two (the split forward's rule: the
// largest magnitude into [1, 2), elements below 2^-60 of it dropped, the
// sums scaled back), so the tile unit's denormal flushing cannot matter. The
// error is within the fp32 bound of a sum a few terms longer (the exact
// contract's own bound); the bytes are not the exact contract's (other
// order, exact products). A NaN or infinity in g declines the call (false):
// the exact kernels run.
constexpr int64_t kInt8SplitMinM = 8;  // dY rows from which it runs (measured crossover: 4-8)

template <typename OutT>
bool int8_grad_split_tiles(const Int8GradInputParams& p) {
  const int64_t m = p.m, n = p.n, k = p.k;
  float* g = scratch_as<float>(gemm4::kSlotPanels, (m * n + n) * 4);
  float* s = g + m * n;
  int8_column_scales(p, s);
  const float* dy = static_cast<const float*>(p.grad_out);
  parallel_for(m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int64_t j = 0;
      for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(g + r * n + j, _mm512_mul_ps(_mm512_loadu_ps(dy + r * n + j), _mm512_loadu_ps(s + j)));
      for (; j < n; ++j) g[r * n + j] = dy[r * n + j] * s[j];
    }
  });
  const __m512i i_lo = pair_index(0), i_hi = pair_index(16);
  return grad_tiles_split<1>(g, m, n, k, static_cast<OutT*>(p.grad_input),
                             [&](int64_t row, int64_t col, bool has_b, __m512i z[1][4]) {
                               prefetch_ahead(p.weight + row * k + col, row, n, k);
                               int8_pair(p.weight + row * k + col, k, 1.0f, 1.0f, has_b, i_lo, i_hi, z[0]);
                             });
}

}  // namespace

bool gemm4_split(const Gemm4bitParams& p, const gemm4::Scales&) {
  // no test on n: which kernel computes an output must not depend on how many
  // outputs the call has (a column-parallel shard gives one device's bytes)
  if ((p.x_dtype != kF32 && p.x_dtype != kF16) || p.k % kChunk != 0 || p.m < kSplitMinM) return false;
  const float* x = gemm4::as_f32(p.x, p.x_dtype, p.m * p.k);
  return typed_forward(p, [&](auto* o, auto* b, const ScaleDecoder& scales) {
    using OutT = std::remove_pointer_t<decltype(o)>;
    using BiasT = std::remove_pointer_t<decltype(b)>;
    return p.blocksize == 32 ? forward_split<OutT, BiasT, true>(p, x, scales)
                             : forward_split<OutT, BiasT, false>(p, x, scales);
  });
}

bool grad4_split(const Gemm4bitGradInputParams& p, const gemm4::Scales&) {
  if (p.grad_out_dtype != kF32 || p.k % kChunk != 0 || p.m < kSplitGradMinM) return false;  // none on k (above)
  return typed_grad(p, [&](auto* o, const ScaleDecoder& scales) {
    using OutT = std::remove_pointer_t<decltype(o)>;
    return p.blocksize == 32 ? grad_split<OutT, true>(p, scales) : grad_split<OutT, false>(p, scales);
  });
}

bool int8_grad_split(const Int8GradInputParams& p) {
  if (p.grad_out_dtype != kF32 || p.k % kStrip != 0 || p.m < kInt8SplitMinM) return false;
  if (reinterpret_cast<uintptr_t>(p.grad_out) % 4 != 0) return false;
  hint_fresh_output(p.grad_input, p.m * p.k * (p.grad_input_dtype == kF32 ? 4 : 2));
  bool ok = false;
  with_out_type(p.grad_input_dtype,
                [&](auto* o) { ok = int8_grad_split_tiles<std::remove_pointer_t<decltype(o)>>(p); });
  return ok;
}

}  // namespace amx
}  // namespace cpu
}  // namespace q4

Q4_UNIT_END
