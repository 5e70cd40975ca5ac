// LLM.int8's integer part on the AMX tile unit (cpu/dispatch.h Int8Gemm; the
// whole contract is in cpu/int8.cc): TDPBSSD multiplies signed by signed bytes
// and adds each group of four products to an int32 lane. The sums are the
// exact int32 dot products (k <= int8::kMaxK), so int8_linear's output is
// bit-identical to every other path whatever kernel ran; x_sums are not needed
// (no unsigned operand to correct).
//
// Tiles: C[W row][x row] = W . xq^T. The A tiles are W's rows read in place
// (16 rows x 64 bytes at the row stride k); the B tiles are the x rows packed
// once per call into panels of 16 rows ([k/4 groups][16 rows] dwords: one
// 64-column k step of a panel is one 1 KiB B tile, zero past k and past m).
// A thread takes W blocks of kBlockRows rows (kept in its L2) and, per x panel
// pair, multiplies them 32 rows at a time with C = 2 W row groups x 2 panels in
// the tile registers over all of k; the pair's panels stay in L2 for the
// block's row groups. The last rows of W and a k tail (k % 64) are read from a
// zero-padded copy (a tile row is 64 bytes: in place it would read past W).
// The C tiles are transposed into acc[x row][W row] and the block's columns
// handed to `done`.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../../dispatch.h"
#include "../../parallel.h"
#include "../unit.h"

Q4_UNIT_BEGIN(amx)

#include "../avx512/transpose16.h"
#include "tiles.h"

namespace q4 {
namespace cpu {
namespace amx {
namespace {

constexpr int64_t kBlockRows = 128;  // W rows a thread keeps in L2 while the x panels pass (512 KiB at k = 4096)
constexpr int64_t kStepBytes = 64;   // k columns per tile step
// The calling thread's scratch slots (parallel.h): int8.cc holds the quantized
// x and the int32 sums in slots 0 and 1.
constexpr int kSlotWPad = 2;
constexpr int kSlotXPanels = 3;

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

template <typename T>
T* aligned_scratch(int slot, int64_t bytes) {
  float* p = scratch(slot, (bytes + 3) / 4 + 16);
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

// x rows [m] (stride xs bytes, zero past k up to a multiple of 4) -> panels
// xp[panel][step][16 groups][16 rows] dwords, zero past k and past m.
void pack_x(const Int8Gemm& g, int64_t kp64, uint32_t* xp) {
  const int64_t panels = ceil_div(g.m, int64_t(16)), steps = kp64 / kStepBytes;
  parallel_for(panels * steps, 16, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t panel = u / steps, c0 = (u % steps) * kStepBytes;
      const int64_t bytes = min64(kStepBytes, g.xs - c0);  // the row's bytes (zero past k) in this step
      const __mmask64 mk = bytes >= 64 ? ~__mmask64(0) : ((__mmask64(1) << bytes) - 1);
      __m512i r[16];
      for (int l = 0; l < 16; ++l) {
        const int64_t row = panel * 16 + l;
        r[l] = row < g.m ? _mm512_maskz_loadu_epi8(mk, g.xq + row * g.xs + c0) : _mm512_setzero_si512();
      }
      transpose16(r);
      uint32_t* dst = xp + u * 256;
      for (int t = 0; t < 16; ++t) _mm512_store_si512(dst + t * 16, r[t]);
    }
  });
}

// C tiles 0-3 = W rows 0-15 / 16-31 (A tiles at w, row stride ws bytes) x
// panels 0 / 1 (Q panels at xp, panel stride ps dwords) over `steps` k steps,
// stored to c[(panel * 32 + row) * 16 + lane].
template <int Q>
void product(const int8_t* w, int64_t ws, const uint32_t* xp, int64_t ps, int64_t steps, int32_t* c) {
  _tile_zero(0);
  _tile_zero(1);
  if (Q == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, w + s * kStepBytes, ws);
    _tile_loadd(5, w + 16 * ws + s * kStepBytes, ws);
    _tile_loadd(6, xp + s * 256, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 5, 6);
    if (Q == 2) {
      _tile_loadd(7, xp + ps + s * 256, 64);
      _tile_dpbssd(2, 4, 7);
      _tile_dpbssd(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  if (Q == 2) {
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
  }
}

// c (as product() stores it) -> acc[(i0 + lane) * lda + j0 + row] for the
// `rows` W rows and `lanes` x rows of panel pn.
void store_sums(const int32_t* c, int64_t pn, int rows, int lanes, const Int8Gemm& g, int64_t i0, int64_t j0) {
  for (int rs = 0; rs < rows; rs += 16) {
    const int cols = std::min(16, rows - rs);
    __m512i v[16];
    for (int i = 0; i < 16; ++i)
      v[i] = i < cols ? _mm512_load_si512(c + (pn * 32 + rs + i) * 16) : _mm512_setzero_si512();
    transpose16(v);
    const __mmask16 mk = __mmask16((1u << cols) - 1);
    for (int l = 0; l < lanes; ++l) _mm512_mask_storeu_epi32(g.acc + (i0 + l) * g.lda + j0 + rs, mk, v[l]);
  }
}

}  // namespace

bool int8_gemm(const Int8Gemm& g) {
  if (g.m < 1 || g.n < 1 || g.k < 1) return false;
  const int64_t kp64 = ceil_div(g.k, kStepBytes) * kStepBytes, steps = kp64 / kStepBytes;
  const int64_t panels = ceil_div(g.m, int64_t(16)), ps = steps * 256;
  uint32_t* xp = aligned_scratch<uint32_t>(kSlotXPanels, panels * ps * 4);
  pack_x(g, kp64, xp);
  // W rows read in place up to the last whole group of 32 rows when k is a
  // multiple of 64; the rest from a zero-padded copy
  const int64_t in_place = g.k % kStepBytes == 0 ? g.n / 32 * 32 : 0;
  const int64_t tail_rows = g.n - in_place;
  int8_t* wpad = nullptr;
  if (tail_rows > 0) {
    wpad = aligned_scratch<int8_t>(kSlotWPad, ceil_div(tail_rows, int64_t(32)) * 32 * kp64);
    const int64_t pad_rows = ceil_div(tail_rows, int64_t(32)) * 32;
    parallel_for(pad_rows, 32, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        int8_t* dst = wpad + r * kp64;
        if (r < tail_rows) {
          memcpy(dst, g.w + (in_place + r) * g.k, size_t(g.k));
          memset(dst + g.k, 0, size_t(kp64 - g.k));
        } else {
          memset(dst, 0, size_t(kp64));
        }
      }
    });
  }
  parallel_for(ceil_div(g.n, kBlockRows), 1, [&](int64_t b0, int64_t b1) {
    configure_tiles();
    alignas(64) int32_t c[1024];  // the C tiles of one product
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t j0 = b * kBlockRows, j1 = min64(g.n, j0 + kBlockRows);
      for (int64_t q = 0; q < panels; q += 2) {
        const int lanes0 = int(min64(16, g.m - q * 16)), lanes1 = int(min64(16, g.m - q * 16 - 16));
        for (int64_t r = j0; r < j1; r += 32) {
          const int rows = int(min64(32, j1 - r));
          const bool pad = r + 32 > in_place;
          const int8_t* w = pad ? wpad + (r - in_place) * kp64 : g.w + r * g.k;
          const int64_t ws = pad ? kp64 : g.k;
          if (panels - q >= 2) {
            product<2>(w, ws, xp + q * ps, ps, steps, c);
            store_sums(c, 0, rows, lanes0, g, q * 16, r);
            store_sums(c, 1, rows, lanes1, g, q * 16 + 16, r);
          } else {
            product<1>(w, ws, xp + q * ps, ps, steps, c);
            store_sums(c, 0, rows, lanes0, g, q * 16, r);
          }
        }
      }
      if (g.done != nullptr) g.done(g.ctx, j0, j1 - j0);
    }
    _tile_release();
  });
  return true;
}

}  // namespace amx
}  // namespace cpu
}  // namespace q4

Q4_UNIT_END
