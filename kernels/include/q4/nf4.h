// NF4 (NormalFloat4): 16 quantiles of N(0,1) normalised to [-1, 1].
// A nibble is an index into the table; the table is sorted ascending, so the
// nibble of a scaled value s is the number of midpoints m with !(s <= m):
// ties go to the lower index and NaN encodes as 15.
#pragma once

#include "q4/common.h"

namespace q4 {
namespace nf4 {

constexpr int kCodes = 16;

Q4_HDC float value(int i) {
  constexpr float t[kCodes] = {
      -1.0f,
      -0.6961928009986877f,
      -0.5250730514526367f,
      -0.39491748809814453f,
      -0.28444138169288635f,
      -0.18477343022823334f,
      -0.09105003625154495f,
      0.0f,
      0.07958029955625534f,
      0.16093020141124725f,
      0.24611230194568634f,
      0.33791524171829224f,
      0.44070982933044434f,
      0.5626170039176941f,
      0.7229568362236023f,
      1.0f,
  };
  return t[i & 15];
}

// Midpoint between sorted neighbours i and i+1, computed in fp32 as (a+b)/2.
Q4_HDC float midpoint(int i) { return (value(i) + value(i + 1)) / 2.0f; }

// Sorted position -> nibble: NF4 is already sorted.
Q4_HDC int nibble_of_rank(int r) { return r; }

// s = x / absmax, normally in [-1, 1].
Q4_HDC int encode(float s) {
  int r = 0;
  for (int i = 0; i < kCodes - 1; ++i) r += !(s <= midpoint(i));
  return r;
}

Q4_HDC float decode(int nibble) { return value(nibble); }

}  // namespace nf4
}  // namespace q4
