// W4A8: the opt-in int8-activation form of the fused 4-bit matmul
// (gemm_4bit_w4a8), shared by the CPU and CUDA kernels. The weight's bytes are
// the ordinary 4-bit format; what changes is the arithmetic:
//
//   Ba = act_block(blocksize) = min(64, blocksize); k must be a multiple of Ba,
//   so each activation block lies inside one weight block.
//   Activation block (m, b) = X[m, b*Ba : (b+1)*Ba] as fp32 (act_scale):
//     amax = max |x| (NaN if one x is NaN)
//     amax NaN or inf       -> q = 0, sx = NaN (the output row becomes NaN)
//     127 / amax not finite -> q = 0, sx = 0   (amax == 0, or below ~3.7e-37)
//     otherwise             inv = fp32(127 / amax), sx = fp32(amax / 127),
//                           q = round_half_even(fp32(x * inv)), |q| <= 127
//   Weight element (n, c): w8 = table8(code) = round(S * table[code]) (half
//   away from zero), and sw[n, b] = fp32(absmax(block of element (n, b*Ba)) * fp32(1 / S)),
//   S = table_scale: 112 for NF4, 120 for FP4 -- the integer scales up to 127
//   whose rounding of the 16 values is smallest (rms 0.0017 of absmax for NF4,
//   against 0.0022 at 127; FP4's values are multiples of 1/120 but +-1/192).
//   isum[m, n, b] = sum_j q[m, b*Ba + j] * w8[n, b*Ba + j]          exact int32
//   acc = 0; for b = 0, 1, ...: acc = acc + fp32(fp32(isum) * fp32(sx * sw))
//   Y[m, n] = out_dtype(acc + bias[n])
// Every step is one IEEE fp32 operation rounded to nearest (the builds never
// contract a*b+c), so every kernel, CPU or CUDA, scalar or vector, produces
// the same bits, whatever the thread count.
#pragma once

#include <cstdint>
#include <limits>

#include "q4/common.h"
#include "q4/quant4.h"

namespace q4 {
namespace w4a8 {

constexpr int64_t kMaxActBlock = 64;
Q4_HD int64_t act_block(int64_t blocksize) { return blocksize < kMaxActBlock ? blocksize : kMaxActBlock; }

template <QuantType QT>
Q4_HDC float table_scale() {
  return Code4<QT>::table_scale();  // q4/formats.h
}
// fp32(1 / S): sw = absmax * inv_table_scale (a product: a division per block
// costs the vector decode a tenth of its time)
template <QuantType QT>
Q4_HDC float inv_table_scale() {
  return 1.0f / table_scale<QT>();
}

// round(scale * v), half away from zero (|v| <= 1)
Q4_HDC int table8_round(float scale, float v) {
  const float s = scale * v;
  return s >= 0.0f ? int(s + 0.5f) : -int(-s + 0.5f);
}

template <QuantType QT>
Q4_HDC int8_t table8(int nibble) {
  return int8_t(table8_round(table_scale<QT>(), Code4<QT>::decode(nibble)));
}

// The scales of one activation block from its amax: (inv, sx); inv == 0 means
// every q of the block is 0.
struct ActScale {
  float inv;
  float sx;
};
Q4_HD ActScale act_scale(float amax) {
  constexpr float kMax = std::numeric_limits<float>::max();
  if (!(amax <= kMax)) return {0.0f, std::numeric_limits<float>::quiet_NaN()};
  if (amax == 0.0f) return {0.0f, 0.0f};
  const float inv = 127.0f / amax;
  if (inv > kMax) return {0.0f, 0.0f};
  return {inv, amax / 127.0f};
}

// q of one element given its block's inv (|x| <= amax, so |x * inv| <= 127).
Q4_HD int8_t act_quantize(float x, float inv) { return int8_t(round_half_even_small(x * inv)); }

}  // namespace w4a8
}  // namespace q4
