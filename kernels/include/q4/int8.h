// LLM.int8's arithmetic (the contract is stated with Int8QuantizeRowsParams
// and Int8LinearParams in q4/kernels.h), shared by the CPU and CUDA kernels.
// Every step is one IEEE fp32 operation rounded to nearest (the builds never
// contract a*b+c and divide exactly), so both produce the same bits.
#pragma once

#include <cstdint>

#include "q4/common.h"

namespace q4 {
namespace int8 {

constexpr float kInv127 = 1.0f / 127.0f;      // fp32(1/127)
constexpr float kInv127Sq = 1.0f / 16129.0f;  // fp32(1/127^2)
// The largest reduction length whose int32 accumulator of int8 x int8
// products cannot overflow (|product| <= 128 * 127).
constexpr int64_t kMaxK = (int64_t(1) << 31) / (128 * 127) - 1;

// fp32(fp32(1 / row_stat) * 127): two roundings, as PyTorch evaluates
// `127.0 / t` (t.reciprocal() * 127).
Q4_HD float row_multiplier(float row_stat) {
  const float inv = 1.0f / row_stat;
  return inv * 127.0f;
}

// One element of a row: round_half_even(clamp(fp32(x * mult), -127, 127)),
// 0 where the product is NaN.
Q4_HD int8_t quantize(float x, float mult) {
  float s = x * mult;
  if (!(s == s)) return 0;
  s = s < -127.0f ? -127.0f : (s > 127.0f ? 127.0f : s);
  return int8_t(round_half_even_small(s));
}

}  // namespace int8
}  // namespace q4
