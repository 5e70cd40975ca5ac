// The arithmetic of 8-bit blockwise quantization and of the nested offset,
// exactly as the compatible format (bitsandbytes 0.50.2 on the CPU, with
// PyTorch's CPU float32 mean for the offset) computes it. Shared by the CPU
// and CUDA kernels; every step is one IEEE fp32 operation rounded to nearest
// (the builds never contract a*b+c), so both produce the same bits.
//
// 8-bit codes, per block of x:
//   absmax = max |x| over the block's non-NaN elements, 0 if there are none
//            (so NaN never reaches absmax; +-inf does).
//   absmax == 0: every element of the block gets code 0.
//   otherwise s = fp32(x * fp32(1 / absmax)) picks one of 65536 bins over
//   [-1, 1] and the code is table[bin]:
//     c   = -1 if s < -1, 1 if s > 1, else s (NaN stays NaN)
//     t   = fp32(fp32(c + 1) * 0.5)
//     bin = trunc(fp32(65535 * t + 0.5)), one rounding (a fused multiply-add);
//           NaN gives bin 0
//   The table of a 256-entry code book: bin k sits at
//     pos(k) = fp32(fp32(2k) / 65535) - 1
//   and, with midpoints mid[j] = fp32(fp32(code[j] + code[j+1]) * 0.5),
//   table[k] = the first j < 255 with !(mid[j] < pos(k)), else 255.
//   So a value takes the code nearest to its bin's position, not to itself:
//   codes closer together than a bin (2 / 65535 of absmax) can be skipped,
//   and |s| below about 1.5e-5 lands on the code nearest to +-1.5e-5.
// Threshold form of the table (what the kernels build): pos is
// non-decreasing in k, so mid[j] < pos(k) holds exactly for k >=
// first_bin_above(mid[j]) (never for a NaN midpoint), and
//   table[k] = #{ j < 255 : T[j] <= k },  T[j] = max_{i <= j} first_bin_above(mid[i])
// for any code book, sorted or not.
//
// Nested offset = mean(absmax) as PyTorch's CPU float32 kernels compute it for
// a contiguous 1-D tensor (checked bit for bit against PyTorch 2.13 on x86-64;
// identical for the DEFAULT, AVX2 and AVX512 CPU capabilities, whose sum
// kernel works on 8-lane vectors in all three): fp32(sum / fp32(n)), where the
// sum runs with one intra-op thread as follows (every + is an fp32 add, every
// accumulator starts at +0):
//   n < 8: p[c] = x[c] for c < 4 if n >= 4 (else 0); p[0] += x[4..n) in
//          order; s = ((p[0] + p[1]) + p[2]) + p[3].
//   n >= 8: the first 32 * floor(n / 32) values form rows of 32 columns,
//          summed per column with the cascade below; whole 8-value vectors
//          left over add, in order, into columns 0..7; then columns 0..7 +=
//          columns 8..15, += 16..23, += 24..31 (in that order). s = the values
//          after the last whole 8-value vector, summed in order, then + column
//          0, + column 1, ..., + column 7.
//   Cascade over `rows` rows, per column: p = max(4, ceil_log2(rows) / 4),
//   groups of 2^p consecutive rows are summed in order into a group sum g;
//   after each group (ending at row index i, a multiple of 2^p):
//     acc1 += g; unless i is a multiple of 2^(2p) stop;
//     acc2 += acc1, acc1 = 0; unless i is a multiple of 2^(3p) stop;
//     acc3 += acc2, acc2 = 0.
//   The rows after the last whole group are summed in order into `tail`, and
//   the column sum is ((tail + acc1) + acc2) + acc3.
//   The result is 0 + s (PyTorch accumulates into a zeroed output).
// With T > 1 intra-op threads and n >= 32768 PyTorch sums min(T, ceil(n /
// 32768)) chunks of ceil(n / chunks) values separately (each as above) and then
// sums the T chunk sums (unused ones 0) as above, so its offset then depends on
// torch.get_num_threads(); q4 always gives the one-thread value.
#pragma once

#include <cstdint>

#include "q4/common.h"

namespace q4 {
namespace blockwise8 {

constexpr int kBins = 65536;
constexpr int kCodes = 256;

Q4_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// Position of bin k in [-1, 1].
Q4_HD float bin_position(int k) { return div_rn(2.0f * static_cast<float>(k), 65535.0f) - 1.0f; }

// Bin of a value s already multiplied by 1 / absmax.
Q4_HD int bin_of(float s) {
  const float c = (-1.0f > s) ? -1.0f : ((s > 1.0f) ? 1.0f : s);
  const float t = (c + 1.0f) * 0.5f;
#if defined(__CUDA_ARCH__)
  const float y = __fmaf_rn(65535.0f, t, 0.5f);
#else
  // t is a multiple of 2^-25 in [0, 1], so 65535 * t + 0.5 is exact in fp64:
  // its single rounding to fp32 is the fused multiply-add's.
  const float y = static_cast<float>(65535.0 * static_cast<double>(t) + 0.5);
#endif
  return (y == y) ? static_cast<int>(y) : 0;
}

Q4_HD float midpoint(const float* code, int j) { return (code[j] + code[j + 1]) * 0.5f; }

// The first bin k with m < pos(k); kBins if none (always for NaN m).
Q4_HD int first_bin_above(float m) {
  int lo = 0, hi = kBins;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (m < bin_position(mid))
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

// ---- the PyTorch float32 sum (see the top of this file)

// PyTorch's CeilLog2: 1 for x <= 2, else the bit width of x - 1.
Q4_HD int ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  int bits = 0;
  for (uint64_t v = static_cast<uint64_t>(x - 1); v != 0; v >>= 1) ++bits;
  return bits;
}

// Rows per cascade group: 2^cascade_power(rows).
Q4_HD int cascade_power(int64_t rows) {
  const int p = ceil_log2(rows) / 4;
  return p > 4 ? p : 4;
}

// After a whole group ending at row index i: how many cascade levels take the
// carry (1: acc1 only, 2: up to acc2, 3: up to acc3).
Q4_HD int cascade_carries(int64_t i, int p) {
  const int64_t mask = (int64_t(1) << p) - 1;
  if (i & (mask << p)) return 1;
  if (i & (mask << (2 * p))) return 2;
  return 3;
}

// acc[1..3] of one column take the group sum g (acc[0] is unused).
Q4_HD void cascade_add(float* acc, float g, int carries) {
  acc[1] += g;
  if (carries >= 2) {
    acc[2] += acc[1];
    acc[1] = 0.0f;
  }
  if (carries >= 3) {
    acc[3] += acc[2];
    acc[2] = 0.0f;
  }
}

Q4_HD float cascade_finish(const float* acc, float tail) {
  float s = tail;
  s += acc[1];
  s += acc[2];
  s += acc[3];
  return s;
}

// The sum of x[0..n) for n < 8 (PyTorch's scalar path).
Q4_HD float sum_short(const float* x, int64_t n) {
  const float none[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float p[4];
  for (int c = 0; c < 4; ++c) p[c] = cascade_finish(none, n >= 4 ? 0.0f + x[c] : 0.0f);
  for (int64_t k = n >= 4 ? 4 : 0; k < n; ++k) p[0] += x[k];
  float s = p[0];
  s += p[1];
  s += p[2];
  s += p[3];
  return 0.0f + s;
}

}  // namespace blockwise8
}  // namespace q4
