// AMX bf16 input gradients (contract: walks.h): the 4-bit weights' (grad4)
// and LLM.int8's for bf16 dY (int8_grad), which share one tile walk
// (grad_tiles): only their W decodes differ.
//
// Input gradient, dX[m, c] = sum_n dY[m, n] W[n, c]: dY is the A operand, read
// in place (rows 2n bytes apart) up to kGradInPlaceN columns, packed once into
// A tiles beyond ([16-row group][32-column step][16 rows][32 words], zero past
// m and n: at n = 4096 its rows would all fall in one L1 set); the rows after
// the last whole 32-row pair are always packed.
// Threads own strips of kAmxStrip dX columns; per dY block (rows whose strip
// sums fit kL2Budget: one block up to 1536 rows, so W is decoded once) and
// strip, W is decoded kSegN rows at a time as interleaved row pairs
// (bf16_decode.h decode_pair: B tiles of 16 pairs x 16 columns, 1 KiB each)
// into an L2 buffer, and C = 2 dY row groups x 2 column groups is carried in
// memory between segments (64-row segments in L1 measured slower: a C round
// trip every 2 k steps). A strip reads 32
// bytes of every W row per 64 columns, rows k/2 bytes apart: latency-bound
// (53 cycles per row pair from L3 against 17 from L2 in a microbenchmark), so
// strips are 256 columns wide (two whole lines of each row).
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

// C tiles 0-3 = dY rows 0-15 / 16-31 (A tiles: the groups at dy and dy + gs
// words, k step s at + s * ystep words, rows ldy bytes apart: packed groups
// by default, dY's rows in place with ystep 32, ldy 2n) x column groups g, g
// + 1 of the strip (B tiles at wt + q * 256 dwords, k step s at + s *
// kAmxStrip * 16) += their products over `steps` steps of 16 W row pairs; C
// starts at zero (fresh) or from acc[r * kAmxStrip + q * 16 + lane], and is
// stored there. G2: both dY row groups.
template <bool G2>
void grad_product(const uint16_t* dy, int64_t gs, const uint32_t* wt, int64_t steps, float* acc, bool fresh,
                  int64_t ystep = 512, int64_t ldy = 64) {
  constexpr int64_t lda = kAmxStrip * 4;  // bytes per row of acc
  if (fresh) {
    _tile_zero(0);
    _tile_zero(2);
    if (G2) {
      _tile_zero(1);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, acc, lda);
    _tile_loadd(2, acc + 16, lda);
    if (G2) {
      _tile_loadd(1, acc + 16 * kAmxStrip, lda);
      _tile_loadd(3, acc + 16 * kAmxStrip + 16, lda);
    }
  }
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(6, wt + s * kStripStep, 64);
    _tile_loadd(7, wt + s * kStripStep + 256, 64);
    _tile_loadd(4, dy + s * ystep, ldy);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    if (G2) {
      _tile_loadd(5, dy + gs + s * ystep, ldy);
      _tile_dpbf16ps(1, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, lda);
  _tile_stored(2, acc + 16, lda);
  if (G2) {
    _tile_stored(1, acc + 16 * kAmxStrip, lda);
    _tile_stored(3, acc + 16 * kAmxStrip + 16, lda);
  }
}

// dX [m, k] (OutT) = dY [m, n] (bf16) . W [n, k] on the tile unit, W given by
// decode(row, col, has_b, z): rows (row, row + 1) x the 64 columns from col
// as decode_pair's four vectors (row + 1 zero when has_b is false). The
// 4-bit weights' gradient (grad below) and LLM.int8's (int8_grad) share it:
// only their W decodes differ.
template <typename OutT, typename Decode>
void grad_tiles(const uint16_t* dy, int64_t m, int64_t n, int64_t k, OutT* out, Decode&& decode) {
  const int64_t steps = ceil_div(n, 32), gs = steps * 512;  // k steps of 32 dY columns; words per dY group
  // up to kGradInPlaceN columns, whole 32-row pairs of dY are read in place
  // (the rest packed): the same values in the same order, so no bit changes
  const int64_t full = n <= kGradInPlaceN && n % 32 == 0 ? m / 32 * 32 : 0;
  uint16_t* dyp = scratch_as<uint16_t>(kSlotInput, ceil_div(m - full, 16) * gs * 2);
  if (full < m) pack_a_tiles(dy + full * n, m - full, n, steps, dyp);
  // dY rows per block: their sums for a strip (acc) stay in the L2 while the
  // strip's W segments pass; the packed dY rows stream from wherever they are
  // (a strip reads them once per W segment: ~4 bytes per cycle at 512 rows)
  const GradUnits units(m, k, max64(32, kL2Budget / (kAmxStrip * 4) / 32 * 32), 32);
  const int64_t block = units.block;
  parallel_for(units.count, 1, [&](int64_t u0, int64_t u1) {
    configure_tiles();
    // a segment of the strip's W: [kSegN / 32 steps][kAmxStrip / 16 column groups][16 pairs][16 dwords]
    uint32_t* wt = scratch_as<uint32_t>(kSlotRow, kSegN * kAmxStrip * 2);
    float* acc = scratch_as<float>(kSlotAcc, block * kAmxStrip * 4);
    for (int64_t u = u0; u < u1; ++u) {
      const auto [r0, re, st] = units[u];
      // the strip's 64-column parts (fewer in the last strip when k % kAmxStrip != 0)
      const int64_t c0 = st * kAmxStrip, halves = min64(kAmxStrip / kStrip, (k - c0) / kStrip);
      for (int64_t n0 = 0; n0 < n; n0 += kSegN) {
        const int64_t rows = min64(kSegN, n - n0), seg_steps = ceil_div(rows, 32);
        decode_strip_segment<1>(rows, halves, wt, 0, [&](int64_t t, int64_t h, __m512i z[1][4]) {
          decode(n0 + 2 * t, c0 + h * kStrip, n0 + 2 * t + 1 < n, z[0]);
        });
        for (int64_t r = r0; r < re; r += 32) {
          float* ac = acc + (r - r0) * kAmxStrip;
          if (r + 32 <= full) {
            const uint16_t* a = dy + r * n + n0;
            for (int g = 0; g < 4 * halves; g += 2)
              grad_product<true>(a, 16 * n, wt + g * 256, seg_steps, ac + g * 16, n0 == 0, 32, 2 * n);
            continue;
          }
          const uint16_t* a = dyp + ((r - full) / 16) * gs + (n0 / 32) * 512;
          for (int g = 0; g < 4 * halves; g += 2) {
            if (re - r > 16)
              grad_product<true>(a, gs, wt + g * 256, seg_steps, ac + g * 16, n0 == 0);
            else
              grad_product<false>(a, gs, wt + g * 256, seg_steps, ac + g * 16, n0 == 0);
          }
        }
      }
      for (int64_t r = r0; r < re; r += 32)
        for (int64_t h = 0; h < halves; ++h)
          store_strip<OutT>(acc + (r - r0) * kAmxStrip + h * kStrip, min64(32, re - r), k, c0 + h * kStrip, out + r * k,
                            kAmxStrip);
    }
    _tile_release();
  });
}

template <typename OutT, bool TWO>
void grad(const Gemm4bitGradInputParams& p, const ScaleDecoder& scales) {
  const int shift = log2_exact(p.blocksize);
  // every block scale, decoded once (the strips read them with stride k)
  const float* sc_all = decode_all_scales(scales, ceil_div(p.n * p.k, p.blocksize), gemm4::kSlotPanels);
  const __m512 codes = code_table(p.quant_type);
  const __m512i half = upper_half_bit(), i_lo = pair_index(0), i_hi = pair_index(16);
  const int64_t n = p.n, k = p.k;
  grad_tiles(static_cast<const uint16_t*>(p.grad_out), p.m, n, k, static_cast<OutT*>(p.grad_input),
             [&](int64_t row, int64_t col, bool has_b, __m512i z[4]) {
               prefetch_ahead(p.packed + (row * k + col) / 2, row, n, k / 2);
               decode_pair<TWO>(p.packed, sc_all, codes, shift, uint64_t(row * k + col), k, has_b, half, i_lo, i_hi, z);
             });
}
// ------------------------------------------------------------ LLM.int8 input gradient, bf16 dY

// bf16 dY (the bf16-compute contract, as the 4-bit weights'): each weight
// element is its fp32 value, fp32(float(CB[n, c]) * s[n]) with s[n] =
// fp32(SCB[n] * kInv127) (the exact contract's column scale, cpu/int8.cc),
// rounded once to bf16; products summed in fp32 on TDPBF16PS, the result
// rounded once to the output dtype. The error is that of a dense bf16 matmul
// with the dequantized weight, where the exact contract's one multiply and
// one add per term (fp32 dY . the int8 weight) runs on the FMA units at half
// their peak. W rows (2t, 2t + 1) x 64 columns become decode_pair's four
// vectors (columns 0, 2, .., 30 | 32, .., 62 | 1, .., 31 | 33, .., 63): each
// 16 widened to fp32 and scaled, the two rows' bf16 values interleaved word
// by word.
constexpr int64_t kInt8GradMinM = 4;  // dY rows from which the tile kernel runs (measured crossover: 3-4)

template <typename OutT>
void int8_grad_tiles(const Int8GradInputParams& p) {
  const int64_t n = p.n, k = p.k;
  float* s = scratch_as<float>(gemm4::kSlotPanels, (n + 1) * 4);
  int8_column_scales(p, s);
  s[n] = 0.0f;  // (read for the missing row of a last pair)
  const __m512i i_lo = pair_index(0), i_hi = pair_index(16);
  grad_tiles(static_cast<const uint16_t*>(p.grad_out), p.m, n, k, static_cast<OutT*>(p.grad_input),
             [&](int64_t row, int64_t col, bool has_b, __m512i z[4]) {
               prefetch_ahead(p.weight + row * k + col, row, n, k);
               int8_pair(p.weight + row * k + col, k, s[row], s[row + 1], has_b, i_lo, i_hi, z);
             });
}

}  // namespace

bool grad4(const Gemm4bitGradInputParams& p, const gemm4::Scales&) {
  return bf16_grad(p, kMinM, [&](auto* o, const ScaleDecoder& scales) {
    using OutT = std::remove_pointer_t<decltype(o)>;
    if (p.blocksize == 32) return grad<OutT, true>(p, scales);
    grad<OutT, false>(p, scales);
  });
}

bool int8_grad(const Int8GradInputParams& p) {
  if (p.grad_out_dtype != kBF16 || p.k % kStrip != 0 || p.m < kInt8GradMinM) return false;
  if (reinterpret_cast<uintptr_t>(p.grad_out) % 2 != 0) return false;
  hint_fresh_output(p.grad_input, p.m * p.k * (p.grad_input_dtype == kF32 ? 4 : 2));
  with_out_type(p.grad_input_dtype, [&](auto* o) { int8_grad_tiles<std::remove_pointer_t<decltype(o)>>(p); });
  return true;
}

}  // namespace amx
}  // namespace cpu
}  // namespace q4

Q4_UNIT_END
