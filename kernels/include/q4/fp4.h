// FP4 (E2M1 with bias 2, no inf/nan): bit 3 is the sign, bits 0..2 index the
// magnitudes {0, 0.0625, 8, 12, 4, 6, 2, 3}, all divided by 12 so the largest
// is 1. Nibble 8 (the "negative zero" pattern) decodes to +0.0, as in the
// reference format. Encoding picks the nearest value through the midpoints of
// the values sorted ascending with a stable sort (so of the two zeros, nibble 0
// ranks first: s in (-0.0026, 0] -> 0, s in (0, 0.0026] -> 8). NaN ranks last and
// so encodes as nibble 3 (+1.0).
#pragma once

#include "q4/common.h"

namespace q4 {
namespace fp4 {

constexpr int kCodes = 16;

Q4_HDC float value(int nibble) {
  constexpr float t[kCodes] = {
      0.0f / 12.0f,  0.0625f / 12.0f, 8.0f / 12.0f,  12.0f / 12.0f,    4.0f / 12.0f,  6.0f / 12.0f,
      2.0f / 12.0f,  3.0f / 12.0f,    0.0f / 12.0f,  -0.0625f / 12.0f, -8.0f / 12.0f, -12.0f / 12.0f,
      -4.0f / 12.0f, -6.0f / 12.0f,   -2.0f / 12.0f, -3.0f / 12.0f,
  };
  return t[nibble & 15];
}

// Stable ascending order of value(): rank -> nibble.
Q4_HDC int nibble_of_rank(int r) {
  constexpr int order[kCodes] = {11, 10, 13, 12, 15, 14, 9, 0, 8, 1, 6, 7, 4, 5, 2, 3};
  return order[r & 15];
}

Q4_HDC float sorted_value(int r) { return value(nibble_of_rank(r)); }

Q4_HDC float midpoint(int r) { return (sorted_value(r) + sorted_value(r + 1)) / 2.0f; }

Q4_HDC int encode(float s) {
  int r = 0;
  for (int i = 0; i < kCodes - 1; ++i) r += !(s <= midpoint(i));
  return nibble_of_rank(r);
}

Q4_HDC float decode(int nibble) { return value(nibble); }

#if !defined(__CUDACC__)
namespace detail {
constexpr bool order_is_stable_sort() {
  for (int r = 0; r + 1 < kCodes; ++r) {
    const float a = sorted_value(r), b = sorted_value(r + 1);
    if (a > b) return false;
    if (a == b && nibble_of_rank(r) > nibble_of_rank(r + 1)) return false;
  }
  bool seen[kCodes] = {};
  for (int r = 0; r < kCodes; ++r) seen[nibble_of_rank(r)] = true;
  for (bool s : seen)
    if (!s) return false;
  return true;
}
}  // namespace detail
static_assert(detail::order_is_stable_sort(), "fp4 rank order must be a stable ascending sort");
#endif

}  // namespace fp4
}  // namespace q4
