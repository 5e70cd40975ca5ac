// W4A8 with AVX512_VNNI (the contract is q4/w4a8.h; the scalar reference is
// cpu/w4a8.cc, and both produce the same bits).
//
// Lanes are 16 rows of X. X is quantized once per call into panels
// [group of 16 rows][k/4][16 rows][4 bytes] holding q (vpdpbusd's signed
// operand), the block scales sx [group][block][16] and xc [group][block][16]
// = -128 * the block's sum of q.
// Within each activation block the columns are stored in "strip order": the
// even columns, then the odd ones -- the order in which the weight's high and
// low nibbles come out of one table lookup each, so decoding a weight strip
// needs no interleave (the block sums are exact integers, so the order of
// their terms changes nothing).
//
// Weight rows are decoded in strips of kKc columns by up to 24 rows into
// unsigned table values w8 + 128 (L1), so that an accumulator started at xc
// ends the block at sum q * (w8 + 128) - 128 * sum q = isum exactly (the
// correction belongs to X, computed once per call, so the decode is two
// table lookups per 128 columns). A register tile of MR groups x NR strip
// rows (MR * NR = 24 int32 accumulators) takes, per 4 columns, MR panel
// loads, NR broadcast weight dwords and MR * NR vpdpbusd; after each block
// every accumulator is converted and added into its fp32 sum (in L1) in the
// contract's order.
//
// Per thread: for each pass of X groups that fits L2 (kPanelBytes), each
// chunk of weight rows is decoded strip by strip and swept by every tile of
// the pass.
#include "q4/w4a8.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "../../dispatch.h"
#include "../../parallel.h"
#include "../unit.h"

Q4_UNIT_BEGIN(avx512_bf16)

#include "../avx512/scale_decoder.h"
#include "../avx512/store16.h"

namespace q4 {
namespace cpu {
namespace avx512_bf16 {
namespace {

using gemm4::kSlotInput;
using gemm4::kSlotPanels;
using gemm4::kSlotRow;
using gemm4::log2_exact;
using gemm4::Scales;

constexpr int64_t kPanelBytes = int64_t(512) << 10;  // X panel bytes per pass (half of a 1 MiB L2)
constexpr int64_t kMaxPassGroups = 16;               // X groups of 16 rows per pass, at most
constexpr int64_t kKc = 1024;                        // columns per decoded weight strip (L1)
constexpr int kTileAcc = 24;                         // int32 accumulators per register tile

template <typename T>
T* aligned_scratch(int slot, int64_t bytes) {
  float* p = scratch(slot, (bytes + 3) / 4 + 16);
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

// acc + the 4-byte dot products of unsigned a and signed b per lane (asm: see
// int8.cc). b is a register: with the broadcast dword as a memory operand
// vpdpbusd runs at a third of the rate here (measured, Zen 5).
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %[b], %[a], %[acc]" : [acc] "+v"(acc) : [a] "v"(a), [b] "v"(b));
  return acc;
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const f16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const bf16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

struct Panels {
  int8_t* xp;   // [groups][steps][16][4]
  float* sx;    // [groups][nb][16]
  int32_t* xc;  // [groups][nb][16]: -128 * sum of the block's q
  int64_t groups, steps, nb;
};

// One activation block of `ba` (32 or 64) values at src: its q in strip
// order (even columns, then odd ones) as nv = ba / 16 vectors of 16 int8,
// and its sx.
template <typename T>
float quantize_block(const T* src, int nv, __m128i* q) {
  __m512 v[4];
  __m512 mx = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int i = 0; i < nv; ++i) {
    v[i] = load16(src + 16 * i);
    mx = _mm512_max_ps(mx, _mm512_abs_ps(v[i]));
    nan |= _mm512_cmp_ps_mask(v[i], v[i], _CMP_UNORD_Q);
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  if (nv == 4) {
    const __m512 e0 = _mm512_permutex2var_ps(v[0], even, v[1]), e1 = _mm512_permutex2var_ps(v[2], even, v[3]);
    const __m512 o0 = _mm512_permutex2var_ps(v[0], odd, v[1]), o1 = _mm512_permutex2var_ps(v[2], odd, v[3]);
    v[0] = e0, v[1] = e1, v[2] = o0, v[3] = o1;
  } else {
    const __m512 e = _mm512_permutex2var_ps(v[0], even, v[1]), o = _mm512_permutex2var_ps(v[0], odd, v[1]);
    v[0] = e, v[1] = o;
  }
  const float amax = nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(mx);
  const w4a8::ActScale s = w4a8::act_scale(amax);
  const __m512 inv = _mm512_set1_ps(s.inv);
  for (int i = 0; i < nv; ++i)
    q[i] = s.inv == 0.0f ? _mm_setzero_si128() : _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv)));
  return s.sx;
}

// 128 * the sum of a block's q (nv vectors of 16): what an accumulator that
// reads the weight as w8 + 128 holds beyond the block's isum (|sum| <= 64 *
// 127: no overflow).
inline int32_t sum128(const __m128i* q, int nv) {
  __m512i sum = _mm512_setzero_si512();
  for (int i = 0; i < nv; ++i) sum = _mm512_add_epi32(sum, _mm512_cvtepi8_epi32(q[i]));
  return 128 * _mm512_reduce_add_epi32(sum);
}

// Rows [r0, r1) of x into the panels.
template <typename T>
void quantize_rows(const T* x, int64_t r0, int64_t r1, int64_t k, int64_t ba, const Panels& pn) {
  const int nv = int(ba / 16);
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t g = r / 16, l = r % 16;
    int8_t* dst = pn.xp + g * pn.steps * 64 + l * 4;
    const T* row = x + r * k;
    for (int64_t b = 0; b < pn.nb; ++b) {
      __m128i qv[4];
      pn.sx[(g * pn.nb + b) * 16 + l] = quantize_block(row + b * ba, nv, qv);
      pn.xc[(g * pn.nb + b) * 16 + l] = -sum128(qv, nv);
      for (int i = 0; i < nv; ++i) {
        const __m128i q = qv[i];
        int8_t* d = dst + (b * ba / 4 + 4 * i) * 64;
        const uint32_t d0 = uint32_t(_mm_cvtsi128_si32(q)), d1 = uint32_t(_mm_extract_epi32(q, 1)),
                       d2 = uint32_t(_mm_extract_epi32(q, 2)), d3 = uint32_t(_mm_extract_epi32(q, 3));
        std::memcpy(d, &d0, 4);
        std::memcpy(d + 64, &d1, 4);
        std::memcpy(d + 128, &d2, 4);
        std::memcpy(d + 192, &d3, 4);
      }
    }
  }
}

// Rows of the last group past m: q = 0, sx = 0, xc = 0.
void pad_rows(int64_t m, const Panels& pn) {
  for (int64_t r = m; r < pn.groups * 16; ++r) {
    const int64_t g = r / 16, l = r % 16;
    for (int64_t t = 0; t < pn.steps; ++t) std::memset(pn.xp + (g * pn.steps + t) * 64 + l * 4, 0, 4);
    for (int64_t b = 0; b < pn.nb; ++b) {
      pn.sx[(g * pn.nb + b) * 16 + l] = 0.0f;
      pn.xc[(g * pn.nb + b) * 16 + l] = 0;
    }
  }
}

// r[i] = the sum of the 16 lanes of v[i] (int32, modulo 2^32).
inline __m512i pair_sums(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
inline __m512i quad_sums(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}
inline __m512i lane_pairs(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xdd));
}
// After three levels: [v0..v3 lanes 0-7, v0..v3 lanes 8-15, v4..v7 lanes 0-7, v4..v7 lanes 8-15].
inline __m512i half_sums8(const __m512i* v) {
  const __m512i a = quad_sums(pair_sums(v[0], v[1]), pair_sums(v[2], v[3]));
  const __m512i b = quad_sums(pair_sums(v[4], v[5]), pair_sums(v[6], v[7]));
  return lane_pairs(a, b);
}

// sw [rows][k / ba] of weight rows [n0, n0 + rows): the scale of each
// activation block (its weight block's scale) * fp32(1 / S), decoded for the
// whole row chunk at once (one call per strip and row took ~10% of a batch-32
// call: the decoder's tables load per call); block_scales: room for
// rows * k / blocksize + 2 floats.
template <QuantType QT>
void decode_chunk_scales(const Gemm4bitParams& p, const ScaleDecoder& scales, int64_t n0, int rows, int64_t ba,
                         float* sw, float* block_scales) {
  const int64_t k = p.k, nbk = k / ba;
  const int shift = log2_exact(p.blocksize);
  const BlockSpan blocks = row_blocks(n0, rows, k, shift);
  const int64_t first = blocks.first, end = blocks.end;
  if (p.blocksize == ba) {  // one weight block per activation block, in the same order
    scales.decode<true>(first, end, sw, w4a8::inv_table_scale<QT>());
    return;
  }
  scales.decode<true>(first, end, block_scales, w4a8::inv_table_scale<QT>());
  for (int j = 0; j < rows; ++j)
    for (int64_t b = 0; b < nbk; ++b) sw[j * nbk + b] = block_scales[(((n0 + j) * k + b * ba) >> shift) - first];
}

// The unsigned table values w8 + 128 of the format's 16 codes, in each
// 128-bit lane (a vpshufb table).
template <QuantType QT>
__m512i w8_table() {
  alignas(16) uint8_t t8[16];
  for (int i = 0; i < 16; ++i) t8[i] = uint8_t(w4a8::table8<QT>(i) + 128);
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(t8)));
}

// Decodes columns [c0, c0 + len) of weight rows [n0, n0 + rows) (c0 and len
// multiples of ba, len <= kKc) into w8 [rows][kKc] (unsigned table values
// w8 + 128; table: w8_table).
inline void decode_rows(const Gemm4bitParams& p, __m512i table, int64_t n0, int rows, int64_t c0, int64_t len,
                        int64_t ba, uint8_t* w8) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const int64_t k = p.k;
  for (int j = 0; j < rows; ++j) {
    const int64_t f0 = (n0 + j) * k + c0;  // even: k and c0 are
    const uint8_t* src = p.packed + f0 / 2;
    // this row's bytes of the strip decoded next (the next k strip, or after
    // the last one the next row chunk's first) into L2: each strip row is a
    // short run of its own, which the hardware prefetchers do not catch in
    // time (measured: the decode waited on these loads for 40% of the time
    // at m = 32); the prefetch stays inside that strip
    const bool last_strip = c0 + len >= k;
    const int64_t next_row = last_strip ? n0 + rows + j : n0 + j, next_c0 = last_strip ? 0 : c0 + len;
    const int64_t next_bytes = next_row < p.n ? std::min(kKc, k - next_c0) / 2 : 0;
    const char* next = reinterpret_cast<const char*>(p.packed + (next_bytes ? (next_row * k + next_c0) / 2 : 0));
    uint8_t* dst = w8 + j * kKc;
    // 128 columns (64 bytes) at a time: the high nibbles (even columns) and
    // the low ones (odd columns) looked up at once, then each activation
    // block's even half followed by its odd half
    const __m512i ba32_lo = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i ba32_hi = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int64_t c = 0; 128 * c < len; ++c) {
      const int64_t bytes = std::min<int64_t>(64, (len - 128 * c) / 2);
      const __m512i v = bytes == 64 ? _mm512_loadu_si512(src + 64 * c)
                                    : _mm512_maskz_loadu_epi8(~__mmask64(0) >> (64 - bytes), src + 64 * c);
      if (64 * c < next_bytes) prefetch_stream(next + 64 * c);
      const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
      const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low4));
      const __m512i w0 = ba == 64 ? _mm512_shuffle_i64x2(hi, lo, 0x44) : _mm512_permutex2var_epi64(hi, ba32_lo, lo);
      const __m512i w1 = ba == 64 ? _mm512_shuffle_i64x2(hi, lo, 0xee) : _mm512_permutex2var_epi64(hi, ba32_hi, lo);
      _mm512_store_si512(dst + 128 * c, w0);
      _mm512_store_si512(dst + 128 * c + 64, w1);
    }
  }
}

struct Strip {  // a decoded strip of weight rows (decode_rows)
  const uint8_t* w8;
  const float* sw;  // sw[j * sw_row + b]: strip row j, block b (decode_chunk_scales)
  int64_t sw_row;
  int64_t t0;      // first step (4 columns) of the strip in X's panels
  int64_t b0;      // first activation block of the strip
  int64_t nb;      // activation blocks in the strip
  int64_t bsteps;  // steps per activation block
};

// res[g * NR + j] += the strip's fp32 sums of X group g0 + g by strip row j
// (16 lanes: the group's rows), in block order. The sums live in res (L1),
// so that all registers but the MR panel vectors and one broadcast hold int32
// accumulators: MR * NR = 24 chains cover vpdpbusd's latency.
template <int MR, int NR>
void tile(const Panels& pn, int64_t g0, const Strip& w, float (*res)[16]) {
  const int8_t* xg = pn.xp + (g0 * pn.steps + w.t0) * 64;
  const int64_t gstride = pn.steps * 64;
  for (int64_t b = 0; b < w.nb; ++b) {
    __m512i acc[MR][NR];
#pragma GCC unroll 2
    for (int g = 0; g < MR; ++g) {
      const __m512i c = _mm512_loadu_si512(pn.xc + ((g0 + g) * pn.nb + w.b0 + b) * 16);
#pragma GCC unroll 24
      for (int j = 0; j < NR; ++j) acc[g][j] = c;
    }
    const uint8_t* wb = w.w8 + b * w.bsteps * 4;
    const int8_t* xb = xg + b * w.bsteps * 64;
    for (int64_t t = 0; t < w.bsteps; ++t) {
      __m512i xv[MR];
#pragma GCC unroll 2
      for (int g = 0; g < MR; ++g) xv[g] = _mm512_load_si512(xb + g * gstride + t * 64);
#pragma GCC unroll 24
      for (int j = 0; j < NR; ++j) {
        int32_t wd;
        std::memcpy(&wd, wb + j * kKc + 4 * t, 4);
        const __m512i wv = _mm512_set1_epi32(wd);
#pragma GCC unroll 2
        for (int g = 0; g < MR; ++g) acc[g][j] = dpbusd(acc[g][j], wv, xv[g]);
      }
    }
#pragma GCC unroll 2
    for (int g = 0; g < MR; ++g) {
      const __m512 sxv = _mm512_loadu_ps(pn.sx + ((g0 + g) * pn.nb + w.b0 + b) * 16);
#pragma GCC unroll 24
      for (int j = 0; j < NR; ++j) {
        const __m512 s = _mm512_mul_ps(sxv, _mm512_set1_ps(w.sw[j * w.sw_row + b]));
        float* r = res[g * NR + j];
        _mm512_store_ps(r, _mm512_add_ps(_mm512_load_ps(r), _mm512_mul_ps(_mm512_cvtepi32_ps(acc[g][j]), s)));
      }
    }
  }
}

// tile with NR = nr (1..NR) chosen at run time
template <int MR, int NR>
void tile_any(int nr, const Panels& pn, int64_t g0, const Strip& w, float (*res)[16]) {
  if constexpr (NR > 1) {
    if (nr < NR) return tile_any<MR, NR - 1>(nr, pn, g0, w, res);
  }
  tile<MR, NR>(pn, g0, w, res);
}

template <QuantType QT>
void run(const Gemm4bitParams& p, const Panels& pn, int64_t ba, const float* bias) {
  const int mr = pn.groups >= 2 ? 2 : 1;
  const int nr_max = kTileAcc / mr;
  const int64_t chunks = ceil_div(p.n, int64_t(nr_max));
  const int64_t per_pass =
      std::max<int64_t>(mr, std::min<int64_t>(kMaxPassGroups, kPanelBytes / (pn.steps * 64)) / mr * mr);
  const __m512i table = w8_table<QT>();
  parallel_for(chunks, 1, [&](int64_t c0, int64_t c1) {
    const ScaleDecoder scales(p.scales);
    // per thread: the pass's fp32 sums, the strip (w8), the chunk's scales
    // (sw) and its weight blocks' scales
    const int64_t nbk = p.k / ba, chunk_blocks = kTileAcc * p.k / p.blocksize + 2;
    char* buf = aligned_scratch<char>(
        kSlotRow, 4 * kMaxPassGroups * kTileAcc * 16 + kTileAcc * kKc + 4 * (kTileAcc * nbk + chunk_blocks) + 128);
    auto* res = reinterpret_cast<float (*)[16]>(buf);
    uint8_t* w8 = reinterpret_cast<uint8_t*>(buf + 4 * kMaxPassGroups * kTileAcc * 16);
    float* sw = reinterpret_cast<float*>(w8 + kTileAcc * kKc);
    float* block_scales = sw + kTileAcc * nbk;
    Strip w;
    w.w8 = w8;
    w.sw_row = nbk;
    w.bsteps = ba / 4;
    for (int64_t gb = 0; gb < pn.groups; gb += per_pass) {
      const int64_t ge = std::min(pn.groups, gb + per_pass);
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t n0 = c * nr_max;
        const int nr = int(std::min<int64_t>(nr_max, p.n - n0));
        std::memset(res, 0, size_t((ge - gb) * kTileAcc * 16) * sizeof(float));
        decode_chunk_scales<QT>(p, scales, n0, nr, ba, sw, block_scales);
        for (int64_t k0 = 0; k0 < p.k; k0 += kKc) {
          const int64_t len = std::min(kKc, p.k - k0);
          decode_rows(p, table, n0, nr, k0, len, ba, w8);
          w.sw = sw + k0 / ba;
          w.t0 = k0 / 4;
          w.b0 = k0 / ba;
          w.nb = len / ba;
          for (int64_t g = gb; g < ge; g += mr) {
            float (*rg)[16] = res + (g - gb) * kTileAcc;
            if (ge - g >= 2)
              tile_any<2, kTileAcc / 2>(nr, pn, g, w, rg);
            else if (mr == 2)
              tile_any<1, kTileAcc / 2>(nr, pn, g, w, rg);
            else
              tile_any<1, kTileAcc>(nr, pn, g, w, rg);
          }
        }
        Q4_DTYPE_SWITCH(p.out_dtype, T, [&] {
          T* out = static_cast<T*>(p.out);
          for (int64_t g = gb; g < ge; ++g) {
            // group g's sums: res[(g - gb) * kTileAcc + (g - g_pair) * nr + j], g_pair its tile's first group
            const int64_t gp = gb + (g - gb) / mr * mr;
            const float (*rt)[16] = res + (gp - gb) * kTileAcc + (g - gp) * nr;
            // row l's nr outputs are lane l of rt[0..nr): gathered, then
            // stored at once (a scalar store per output with its bf16
            // rounding took ~5% of the call at batch 32)
            // lane j reads rt[j0 + j][l], 16 floats after rt[j0 + j - 1][l]
            const __m512i idx =
                _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
            for (int j0 = 0; j0 < nr; j0 += 16) {  // nr <= kTileAcc = 24
              const int cnt = std::min(16, nr - j0);
              const __mmask16 cols = __mmask16((1u << cnt) - 1);
              const __m512 bv = _mm512_maskz_loadu_ps(cols, bias + n0 + j0);
              for (int l = 0; l < 16 && g * 16 + l < p.m; ++l) {
                const __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), cols, idx, &rt[j0][l], 4);
                store16<T>(out + (g * 16 + l) * p.n + n0 + j0, _mm512_add_ps(v, bv), cnt);
              }
            }
          }
        });
      }
    }
  });
}

// ------------------------------------------------------------ few X rows
//
// For m <= kFewRows and 64-column activation blocks the tiles above would
// leave most of their 16 lanes idle. Here lanes are the 64 columns of a
// block: X stays row-major (q in strip order, signed) with xcorr[m][b] = 128 *
// the block's sum of q, and the codes decode to unsigned table values w8 +
// 128, so a block's vpdpbusd total is isum + xcorr. 16 weight rows at a time:
// per block their 16 lane vectors reduce to one vector of 16 isums (one per
// weight row), added into 16 fp32 sums in the contract's order -- the same
// bits as the tiles'.
constexpr int64_t kFewRows = 6;    // measured crossover with the tiles: 6-8 rows
constexpr int64_t kFewAhead = 16;  // blocks of prefetch distance

struct FewX {
  int8_t* q;      // [m][k], strip order within each block
  int32_t* corr;  // [m][k / 64]
  float* sx;      // [m][k / 64]
};

template <typename T>
void quantize_few(const T* x, int64_t r0, int64_t r1, int64_t k, const FewX& fx) {
  const int64_t nb = k / 64;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      __m128i qv[4];
      fx.sx[r * nb + b] = quantize_block(x + r * k + b * 64, 4, qv);
      for (int i = 0; i < 4; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(fx.q + r * k + b * 64 + 16 * i), qv[i]);
      fx.corr[r * nb + b] = sum128(qv, 4);
    }
}

// Each group of 16 weight rows is decoded in registers, each row's block
// used at once by every X row: its 32 bytes loaded into both halves of a
// vector, one variable shift (the high nibbles of the lower copy: even
// columns), a mask and one lookup give the block in strip order. One X row
// takes the 16 rows in one pass (16 accumulators), two or three in two
// passes of 8, four to six in four passes of 4 (at most 24), and the passes'
// lane sums are joined. (Through a 16-row buffer -- two 256-bit lookups, an
// insert, a store and a reload per row -- batch 1 took 0.46 ms on one
// thread at 4096^2, now 0.32.) rowp[i]: weight row n0 + i at its first
// block (a group's missing rows repeat a present one: their lanes are not
// stored); table: the w8 + 128 values in each 128-bit lane.
template <int M>
void few_rows_in_registers(const uint8_t* const* rowp, int64_t nb, const FewX& fx, const float* swc, __m512i table,
                           float* accs) {
  constexpr int kPass = M == 1 ? 16 : M <= 3 ? 8 : 4;  // weight rows per pass (M * kPass accumulators)
  const int64_t k = nb * 64;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i even_shift = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_setzero_si256(), 1);
  __m512 acc[M];
  for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    // 16 interleaved row streams: fetched 16 blocks (8 lines) ahead of use
    if ((b & 1) == 0 && b + kFewAhead < nb)
      for (int i = 0; i < 16; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(rowp[i] + (b + kFewAhead) * 32), _MM_HINT_T0);
    __m512i xv[M];
    for (int r = 0; r < M; ++r) xv[r] = _mm512_loadu_si512(fx.q + r * k + b * 64);
    __m512i part[4][M];  // (M > 1) each pass's lane sums
    __m512i total[M];
    for (int pass = 0; pass < 16 / kPass; ++pass) {
      __m512i v[M][kPass];
#pragma GCC unroll 16
      for (int i = 0; i < kPass; ++i) {
        const __m512i a = _mm512_broadcast_i64x4(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rowp[pass * kPass + i] + b * 32)));
        const __m512i w = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srlv_epi16(a, even_shift), low4));
        for (int r = 0; r < M; ++r) v[r][i] = dpbusd(_mm512_setzero_si512(), w, xv[r]);
      }
      // lane i of total: weight row n0 + i (half_sums8 of 8 vectors is
      // lane_pairs of the quad sums of each 4)
      for (int r = 0; r < M; ++r) {
        if constexpr (kPass == 16)
          total[r] = lane_pairs(half_sums8(v[r]), half_sums8(v[r] + 8));
        else if constexpr (kPass == 8)
          part[pass][r] = half_sums8(v[r]);
        else
          part[pass][r] = quad_sums(pair_sums(v[r][0], v[r][1]), pair_sums(v[r][2], v[r][3]));
      }
    }
    for (int r = 0; r < M; ++r) {
      if constexpr (kPass == 8) total[r] = lane_pairs(part[0][r], part[1][r]);
      if constexpr (kPass == 4)
        total[r] = lane_pairs(lane_pairs(part[0][r], part[1][r]), lane_pairs(part[2][r], part[3][r]));
      const __m512i isum = _mm512_sub_epi32(total[r], _mm512_set1_epi32(fx.corr[r * nb + b]));
      const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(fx.sx[r * nb + b]), _mm512_loadu_ps(swc + b * 16));
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), sc));
    }
  }
  for (int r = 0; r < M; ++r) _mm512_store_ps(accs + 16 * r, acc[r]);
}

// few_rows_in_registers with M = 1..MMAX X rows chosen at run time
template <int MMAX>
void few_rows_any(int m, const uint8_t* const* rowp, int64_t nb, const FewX& fx, const float* swc, __m512i t,
                  float* accs) {
  if constexpr (MMAX > 1) {
    if (m < MMAX) return few_rows_any<MMAX - 1>(m, rowp, nb, fx, swc, t, accs);
  }
  few_rows_in_registers<MMAX>(rowp, nb, fx, swc, t, accs);
}

template <QuantType QT>
void run_few(const Gemm4bitParams& p, const FewX& fx, const float* bias) {
  const int64_t k = p.k, nb = k / 64;
  const __m512i table = w8_table<QT>();
  parallel_for(ceil_div(p.n, int64_t(16)), 1, [&](int64_t c0, int64_t c1) {
    const ScaleDecoder scales(p.scales);
    // per thread: the 16 rows' scales [block][row], the same [row][block]
    // and their weight blocks' scales (decode_chunk_scales), the sums
    const int64_t group_blocks = 16 * k / p.blocksize + 2;
    char* buf = aligned_scratch<char>(kSlotRow, 4 * (2 * 16 * nb + group_blocks) + 64 * kFewRows + 128);
    float* swc = reinterpret_cast<float*>(buf);
    float* sw = swc + 16 * nb;
    float* block_scales = sw + 16 * nb;
    float* accs =
        reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(block_scales + group_blocks) + 63) & ~uintptr_t(63));
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * 16;
      const int rows = int(std::min<int64_t>(16, p.n - n0));
      decode_chunk_scales<QT>(p, scales, n0, rows, 64, sw, block_scales);
      for (int64_t b = 0; b < nb; ++b)
        for (int i = 0; i < 16; ++i) swc[b * 16 + i] = i < rows ? sw[i * nb + b] : 0.0f;
      const uint8_t* rowp[16];
      for (int i = 0; i < 16; ++i) rowp[i] = p.packed + (n0 + (i < rows ? i : 0)) * k / 2;
      // the next group's scales and the first kFewAhead blocks of its rows
      // (the decode prefetches each row from there on) into L2: from DRAM,
      // each group otherwise started with a quarter of its rows (k = 4096)
      // and its scales not yet asked for (two threads, 4096^2 bf16, 16
      // layers cycled from DRAM: batch 1 0.628 -> 0.545 ms, batch 4 0.680 ->
      // 0.665; from L3 within noise. A second, L2 prefetch 48 blocks ahead
      // in the decode cost batch 4 10%.)
      const int64_t n1 = std::min<int64_t>(p.n, n0 + 32);
      if (n0 + 16 < n1) {
        scales.prefetch((n0 + 16) * k / p.blocksize, (n1 * k - 1) / p.blocksize + 1);
        for (int64_t r = n0 + 16; r < n1; ++r)
          for (int64_t o = 0; o < kFewAhead * 32; o += 64) prefetch_stream(p.packed + r * k / 2 + o);
      }
      few_rows_any<kFewRows>(int(p.m), rowp, nb, fx, swc, table, accs);
      Q4_DTYPE_SWITCH(p.out_dtype, T, [&] {
        T* out = static_cast<T*>(p.out);
        for (int r = 0; r < p.m; ++r)
          for (int i = 0; i < rows; ++i) Elem<T>::store(out + r * p.n + n0, i, accs[16 * r + i] + bias[n0 + i]);
      });
    }
  });
}

}  // namespace

bool w4a8(const Gemm4bitParams& p, const Scales&) {
  const int64_t ba = w4a8::act_block(p.blocksize);
  if ((ba != 32 && ba != 64) || p.k % ba != 0) return false;
  float* bias = scratch(gemm4::kSlotAcc, p.n);  // fp32 (0 without a bias)
  for (int64_t j = 0; j < p.n; ++j) bias[j] = gemm4::load_bias(p.bias, p.bias_dtype, j);
  if (ba == 64 && p.m <= kFewRows) {
    const int64_t nb = p.k / 64;
    FewX fx;
    fx.q = aligned_scratch<int8_t>(kSlotPanels, p.m * p.k);
    fx.corr = aligned_scratch<int32_t>(kSlotInput, 8 * p.m * nb + 64);
    fx.sx = reinterpret_cast<float*>(fx.corr + p.m * nb);
    Q4_DTYPE_SWITCH(p.x_dtype, T, [&] { quantize_few(static_cast<const T*>(p.x), 0, p.m, p.k, fx); });
    Q4_QUANT_SWITCH(p.quant_type, QT, [&] { run_few<QT>(p, fx, bias); });
    return true;
  }
  Panels pn;
  pn.groups = ceil_div(p.m, int64_t(16));
  pn.steps = p.k / 4;
  pn.nb = p.k / ba;
  pn.xp = aligned_scratch<int8_t>(kSlotPanels, pn.groups * pn.steps * 64);
  pn.sx = aligned_scratch<float>(kSlotInput, pn.groups * pn.nb * 16 * 8);
  pn.xc = reinterpret_cast<int32_t*>(pn.sx + pn.groups * pn.nb * 16);
  Q4_DTYPE_SWITCH(p.x_dtype, T, [&] {
    parallel_for(p.m, 4,
                 [&](int64_t r0, int64_t r1) { quantize_rows(static_cast<const T*>(p.x), r0, r1, p.k, ba, pn); });
  });
  pad_rows(p.m, pn);
  Q4_QUANT_SWITCH(p.quant_type, QT, [&] { run<QT>(p, pn, ba, bias); });
  return true;
}

}  // namespace avx512_bf16
}  // namespace cpu
}  // namespace q4

Q4_UNIT_END
