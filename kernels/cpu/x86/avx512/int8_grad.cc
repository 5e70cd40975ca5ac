// LLM.int8 input gradient with 512-bit fp32 vectors (cpu/dispatch.h Int8Grad;
// the contract is in cpu/int8.cc): dX[m, c] = ((0 + g[m, 0] * CB[0, c]) +
// g[m, 1] * CB[1, c]) + ..., one multiply and one add per term, in n order --
// so the result is the scalar and AVX2 paths' bit for bit.
//
// A register tile of kInt8GradRows rows of g by 32 columns of dX (24
// accumulators) walks all n: per weight row, 32 int8 widened to fp32 in
// registers and 12 broadcast g values (adjacent in the caller's blocked
// layout) serve 24 multiplies and adds. Threads own column strips (32 wide),
// each copied once into a contiguous buffer (n x 32 bytes, L2): read in place
// at the weight's row stride (4 KiB for k = 4096) every line of the strip
// would fall into one L1 set.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "../../dispatch.h"
#include "../../gemm4_common.h"
#include "../../parallel.h"
#include "../unit.h"
#include "q4/kernels.h"

Q4_UNIT_BEGIN(avx512)

namespace q4 {
namespace cpu {
namespace avx512 {
namespace {

constexpr int kMR = kInt8GradRows;  // g rows per register tile
constexpr int64_t kStrip = 32;      // dX columns per tile (two zmm)
constexpr int64_t kMinRows = 48;    // fewer rows: the strip copy is not repaid (measured)

// acc + g * w, two roundings (a multiply, then an add: the contract's order).
// In asm with acc tied in and out: with the intrinsics GCC 12 keeps a copy of
// every accumulator of the tile on the stack and stores it on every step.
inline __m512 mul_add(__m512 acc, __m512 g, __m512 w) {
  __m512 t;
  asm("vmulps %[w], %[g], %[t]\n\tvaddps %[t], %[acc], %[acc]"
      : [acc] "+v"(acc), [t] "=&v"(t)
      : [g] "v"(g), [w] "v"(w));
  return acc;
}

inline __m512 widen16(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}

// acc rows [0, MR) x columns [c, c + 32) of dX for g rows g0.. (row stride n):
// the full sum over n, stored to dx (row stride k) in TO.
// g: the tile's block (g[j * MR + i]); strip: the strip (strip[j * 32 + v]).
template <int MR, typename TO>
void tile(const Int8Grad& a, const float* g, const int8_t* strip, int64_t c, TO* dx, int width) {
  __m512 acc[MR][2];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const int8_t* w = strip;
  for (int64_t j = 0; j < a.n; ++j, w += kStrip, g += MR) {
    const __m512 w0 = widen16(w), w1 = widen16(w + 16);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512 gv = _mm512_set1_ps(g[i]);
      acc[i][0] = mul_add(acc[i][0], gv, w0);
      acc[i][1] = mul_add(acc[i][1], gv, w1);
    }
  }
  for (int i = 0; i < MR; ++i) {
    TO* o = dx + i * a.k + c;
    if (sizeof(TO) == 4 && width == kStrip) {
      _mm512_storeu_ps(reinterpret_cast<float*>(o), acc[i][0]);
      _mm512_storeu_ps(reinterpret_cast<float*>(o) + 16, acc[i][1]);
      continue;
    }
    alignas(64) float t[kStrip];
    _mm512_store_ps(t, acc[i][0]);
    _mm512_store_ps(t + 16, acc[i][1]);
    for (int v = 0; v < width; ++v) Elem<TO>::store(o, v, t[v]);
  }
}

template <int MR, typename TO>
void tile_rows(int rows, const Int8Grad& a, const float* g, const int8_t* strip, int64_t c, TO* dx, int width) {
  if constexpr (MR > 1) {
    if (rows < MR) return tile_rows<MR - 1, TO>(rows, a, g, strip, c, dx, width);
  }
  tile<MR, TO>(a, g, strip, c, dx, width);
}

}  // namespace

bool int8_grad(const Int8Grad& a) {
  if (a.m < kMinRows) return false;  // int8.cc's loops widen W in registers: no strip copy for few rows
  const int64_t strips = ceil_div(a.k, kStrip);
  Q4_DTYPE_SWITCH(a.dx_dtype, TO, [&] {
    TO* dx = static_cast<TO*>(a.dx);
    parallel_for(strips, 1, [&](int64_t s0, int64_t s1) {
      int8_t* strip = reinterpret_cast<int8_t*>(scratch(gemm4::kSlotRow, a.n * kStrip / 4 + 1));
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t c = s * kStrip;
        const int width = int(std::min(kStrip, a.k - c));
        const __mmask32 mask = width == kStrip ? ~__mmask32(0) : (__mmask32(1) << width) - 1;
        for (int64_t j = 0; j < a.n; ++j)  // the strip, contiguous (zero past k)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(strip + j * kStrip),
                              _mm256_maskz_loadu_epi8(mask, a.weight + j * a.k + c));
        for (int64_t r = 0; r < a.m; r += kMR) {
          const int rows = int(std::min<int64_t>(kMR, a.m - r));
          tile_rows<kMR, TO>(rows, a, a.g + r * a.n, strip, c, dx + (a.row0 + r) * a.k, width);
        }
      }
    });
  });
  return true;
}

}  // namespace avx512
}  // namespace cpu
}  // namespace q4

Q4_UNIT_END
