// AVX512_VNNI dot products of LLM.int8's integer part (cpu/dispatch.h
// Int8Dots; the whole contract is in cpu/int8.cc). The results are the exact
// int32 dot products, so int8_linear's output is bit-identical to the AVX2 and
// scalar paths whatever kernel ran.
//
// vpdpbusd multiplies unsigned by signed bytes. The weight byte is made
// unsigned by flipping its sign bit (u = w + 128, exact for every int8 w,
// -128 included), so each lane sums (w + 128) * x = w * x + 128 * x; the
// caller's x_sums[i] = sum x removes the second term: dot = total - 128 *
// x_sums[i]. vpdpbusd adds without saturation and every step is an int32 add
// modulo 2^32, so the result is exact whenever the true dot product fits in
// int32, which k <= int8::kMaxK guarantees. A k tail (k % 64) is read with
// masked loads (masked x bytes are 0, so their products vanish).
//
// int8_dots (few x rows): a register tile of mr <= 4 x rows by nr <= 4 weight
// rows, one zmm accumulator each (16 lanes of partial sums, summed at the
// end); per 64 columns nr weight loads (+ sign flips) and mr x loads serve
// mr * nr vpdpbusd.
//
// int8_gemm (many x rows): lanes are output columns. Per block of 64 weight
// rows and kGemmKc columns the sign-flipped weight bytes are packed once into
// an L1 panel [kc/4][64 rows][4 bytes] (one zmm = 16 rows x 4 columns), used
// by every x row: a register tile of 6 x rows x 64 columns (24 accumulators)
// takes per 4 columns 4 panel loads and 6 broadcast x dwords. The
// accumulators start at -128 * x_sums[row] and are carried in acc between
// column blocks (int32 adds modulo 2^32 in any order: the same exact sums).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../../dispatch.h"
#include "../../parallel.h"
#include "../prefetch.h"
#include "../unit.h"

Q4_UNIT_BEGIN(avx512_bf16)

#include "../avx512/transpose16.h"

namespace q4 {
namespace cpu {
namespace avx512_bf16 {
namespace {

// The sum of the 16 lanes modulo 2^32 (the header's _mm512_reduce_add_epi32
// adds as signed int, undefined on overflow, which these sums may reach).
inline uint32_t lane_sum(__m512i v) {
  const __m256i a = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
  __m128i b = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  b = _mm_add_epi32(b, _mm_shuffle_epi32(b, 0x4e));
  b = _mm_add_epi32(b, _mm_shuffle_epi32(b, 0xb1));
  return uint32_t(_mm_cvtsi128_si32(b));
}

// acc + the 4-byte dot products of unsigned a and signed b per lane. Written
// in asm with acc tied in and out: GCC 12 keeps a copy of every accumulator of
// the intrinsic's tiles on the stack and moves it through registers.
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %[b], %[a], %[acc]" : [acc] "+v"(acc) : [a] "v"(a), [b] "v"(b));
  return acc;
}

template <int MR, int NR>
void dots(const Int8Dots& d) {
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  __m512i acc[MR][NR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_si512();
  const int64_t k = d.k, kfull = k / 64 * 64;
  for (int64_t c = 0; c < kfull; c += 64) {
    __m512i wv[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      if (j < d.ahead_rows) prefetch_stream(d.ahead + j * k + c);
      wv[j] = _mm512_xor_si512(_mm512_loadu_si512(d.w[j] + c), flip);
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m512i xv = _mm512_loadu_si512(d.xq + i * d.xs + c);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[i][j] = dpbusd(acc[i][j], wv[j], xv);
    }
  }
  if (kfull < k) {
    const __mmask64 mask = ~__mmask64(0) >> (64 - (k - kfull));
    __m512i wv[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, d.w[j] + kfull), flip);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m512i xv = _mm512_maskz_loadu_epi8(mask, d.xq + i * d.xs + kfull);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[i][j] = dpbusd(acc[i][j], wv[j], xv);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    const uint32_t bias = uint32_t(d.x_sums[i]) << 7;  // 128 * sum x, modulo 2^32
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) d.acc[i * d.acc_stride + j] = int32_t(lane_sum(acc[i][j]) - bias);
  }
}

// dots with MR = mr (1..4) and NR = nr (1..4) chosen at run time
template <int MR, int NR>
void dots_any(const Int8Dots& d) {
  if constexpr (NR > 1) {
    if (d.nr < NR) return dots_any<MR, NR - 1>(d);
  }
  if constexpr (MR > 1) {
    if (d.mr < MR) return dots_any<MR - 1, NR>(d);
  }
  dots<MR, NR>(d);
}

constexpr int kGemmMR = 6;        // x rows per register tile
constexpr int kGemmNV = 4;        // zmm of 16 weight rows per register tile
constexpr int64_t kGemmNB = 64;   // weight rows per panel (kGemmNV * 16)
constexpr int64_t kGemmKc = 512;  // columns per panel (32 KiB: L1; 256 measured 3-9% slower at batch 512)

// Packs weight rows [j0, j0 + rows) x columns [c0, c0 + len) (len a multiple
// of 4 past k: zero bytes there) into panel[(t * 64 + r) * 4 + b] = byte b of
// column c0 + 4t + b of row j0 + r, sign bit flipped; rows past `rows` are 0.
// Whole blocks of 16 rows x 64 columns go through one 16 x 16 dword
// transpose (a dword at a time, the packing had taken a sixth of a batch-512
// forward); the rest a dword at a time.
void pack_panel(const int8_t* w, int64_t k, int64_t j0, int64_t rows, int64_t c0, int64_t len, uint8_t* panel) {
  const int64_t steps = len / 4;
  const int64_t whole = std::min<int64_t>(steps, (k - c0) / 4);  // dwords wholly inside k
  const int64_t vec_rows = rows / 16 * 16, vec_steps = whole / 16 * 16;
  const __m512i flip = _mm512_set1_epi32(int32_t(0x80808080u));
  for (int64_t r0 = 0; r0 < vec_rows; r0 += 16)
    for (int64_t t0 = 0; t0 < vec_steps; t0 += 16) {
      __m512i v[16];
      for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_si512(w + (j0 + r0 + i) * k + c0 + 4 * t0);
      transpose16(v);
      for (int t = 0; t < 16; ++t)
        _mm512_store_si512(panel + ((t0 + t) * kGemmNB + r0) * 4, _mm512_xor_si512(v[t], flip));
    }
  for (int64_t r = 0; r < kGemmNB; ++r) {
    uint32_t* dst = reinterpret_cast<uint32_t*>(panel) + r;
    if (r >= rows) {
      for (int64_t t = 0; t < steps; ++t) dst[t * kGemmNB] = 0x80808080u;
      continue;
    }
    const int8_t* src = w + (j0 + r) * k + c0;
    for (int64_t t = r < vec_rows ? vec_steps : 0; t < whole; ++t) {
      uint32_t v;
      std::memcpy(&v, src + 4 * t, 4);
      dst[t * kGemmNB] = v ^ 0x80808080u;
    }
    for (int64_t t = whole; t < steps; ++t) {
      uint8_t b[4];
      for (int q = 0; q < 4; ++q) {
        const int64_t c = c0 + 4 * t + q;
        b[q] = uint8_t((c < k ? uint8_t(src[4 * t + q]) : uint8_t(0)) ^ 0x80u);
      }
      std::memcpy(&dst[t * kGemmNB], b, 4);
    }
  }
}

// acc rows [i0, i0 + MR) x the panel's columns (cols of them valid) +=
// the panel's sums over `steps` groups of 4 columns; `first`: start from
// -128 * x_sums instead of acc.
template <int MR>
void gemm_tile(const Int8Gemm& g, int64_t i0, int64_t c0, const uint8_t* panel, int64_t steps, int64_t j0,
               const __mmask16 (&mk)[kGemmNV], bool first) {
  __m512i a[MR][kGemmNV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < kGemmNV; ++v) a[i][v] = _mm512_setzero_si512();
  const int32_t* x = reinterpret_cast<const int32_t*>(g.xq + i0 * g.xs + c0);
  const int64_t xs = g.xs / 4;
  for (int64_t t = 0; t < steps; ++t) {
    __m512i wv[kGemmNV];
#pragma GCC unroll 4
    for (int v = 0; v < kGemmNV; ++v) wv[v] = _mm512_load_si512(panel + (t * kGemmNB + 16 * v) * 4);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512i xv = _mm512_set1_epi32(x[i * xs + t]);
#pragma GCC unroll 4
      for (int v = 0; v < kGemmNV; ++v) a[i][v] = dpbusd(a[i][v], wv[v], xv);
    }
  }
  // acc (+)= the tile's sums; the first column block starts from -128 * x_sums
  int32_t* out = g.acc + i0 * g.lda + j0;
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const __m512i base =
        first ? _mm512_set1_epi32(int32_t(uint32_t(g.x_sums[i0 + i]) * 0xffffff80u)) : _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int v = 0; v < kGemmNV; ++v) {
      int32_t* o = out + i * g.lda + 16 * v;
      const __m512i prev = first ? base : _mm512_maskz_loadu_epi32(mk[v], o);
      _mm512_mask_storeu_epi32(o, mk[v], _mm512_add_epi32(prev, a[i][v]));
    }
  }
}

// gemm_tile with MR = rows (1..RMAX) chosen at run time
template <int RMAX>
void gemm_rows(int rows, const Int8Gemm& g, int64_t i0, int64_t c0, const uint8_t* panel, int64_t steps, int64_t j0,
               const __mmask16 (&mk)[kGemmNV], bool first) {
  if constexpr (RMAX > 1) {
    if (rows == RMAX) return gemm_tile<RMAX>(g, i0, c0, panel, steps, j0, mk, first);
    return gemm_rows<RMAX - 1>(rows, g, i0, c0, panel, steps, j0, mk, first);
  } else {
    return gemm_tile<1>(g, i0, c0, panel, steps, j0, mk, first);
  }
}

}  // namespace

bool int8_gemm(const Int8Gemm& g) {
  if (g.x_sums == nullptr || g.m < 1 || g.n < 1 || g.k < 1) return false;
  const int64_t blocks = ceil_div(g.n, kGemmNB);
  const int64_t kpad = ceil_div(g.k, int64_t(4)) * 4;
  parallel_for(blocks, 1, [&](int64_t b0, int64_t b1) {
    uint8_t* panel = reinterpret_cast<uint8_t*>(scratch(gemm4::kSlotRow, kGemmNB * kGemmKc / 4 + 16));
    panel += (64 - (reinterpret_cast<uintptr_t>(panel) & 63)) & 63;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t j0 = b * kGemmNB;
      const int cols = int(std::min(kGemmNB, g.n - j0));
      __mmask16 mk[kGemmNV];
      for (int v = 0; v < kGemmNV; ++v) mk[v] = __mmask16((1u << std::min(16, std::max(0, cols - 16 * v))) - 1);
      for (int64_t c0 = 0; c0 < kpad; c0 += kGemmKc) {
        const int64_t len = std::min(kGemmKc, kpad - c0);
        pack_panel(g.w, g.k, j0, cols, c0, len, panel);
        // the next panel's rows (each a run of 4 lines, 4 KiB from the next:
        // too short for the hardware prefetchers) into L2 while this one is used
        const bool same_rows = c0 + kGemmKc < kpad;
        if (same_rows || b + 1 < b1) {
          const int64_t nj0 = same_rows ? j0 : j0 + kGemmNB, nc0 = same_rows ? c0 + kGemmKc : 0;
          const int64_t nrows = std::min(kGemmNB, g.n - nj0), nbytes = std::min(kGemmKc, g.k - nc0);
          for (int64_t r = 0; r < nrows; ++r)
            for (int64_t o = 0; o < nbytes; o += 64) prefetch_stream(g.w + (nj0 + r) * g.k + nc0 + o);
        }
        for (int64_t i0 = 0; i0 < g.m; i0 += kGemmMR) {
          const int mr = int(std::min<int64_t>(kGemmMR, g.m - i0));
          gemm_rows<kGemmMR>(mr, g, i0, c0, panel, len / 4, j0, mk, c0 == 0);
        }
      }
      if (g.done != nullptr) g.done(g.ctx, j0, cols);
    }
  });
  return true;
}

bool int8_dots(const Int8Dots& d) {
  if (d.mr < 1 || d.mr > 4 || d.nr < 1 || d.nr > 4 || d.x_sums == nullptr) return false;
  dots_any<4, 4>(d);
  return true;
}

}  // namespace avx512_bf16
}  // namespace cpu
}  // namespace q4

Q4_UNIT_END
