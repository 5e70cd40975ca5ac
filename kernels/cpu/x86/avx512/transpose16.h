// In-register 16 x 16 transpose of 32-bit elements (r[j] lane i <- r[i] lane
// j), for the AVX-512 units: include after the unit's `#pragma GCC target`
// (AVX-512 F); internal linkage, so each unit keeps its own copy.
#pragma once

#include <immintrin.h>

namespace q4 {
namespace cpu {
namespace {

__attribute__((always_inline)) inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // r[4i + j] now holds, in 128-bit lane L, rows 4i..4i+3 of column 4L + j;
  // two rounds of lane shuffles put column c in r[c].
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      const __m512i a = r[8 * i + j], b = r[8 * i + 4 + j];
      t[8 * i + j] = _mm512_shuffle_i32x4(a, b, 0x88);      // lanes a0 a2 b0 b2
      t[8 * i + 4 + j] = _mm512_shuffle_i32x4(a, b, 0xdd);  // lanes a1 a3 b1 b3
    }
  for (int j = 0; j < 8; ++j) {
    const __m512i a = t[j], b = t[8 + j];
    r[j] = _mm512_shuffle_i32x4(a, b, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(a, b, 0xdd);
  }
}

// The same for 16 x 16 floats.
inline void transpose16(__m512 v[16]) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(v[i]);
  transpose16(r);
  for (int i = 0; i < 16; ++i) v[i] = _mm512_castsi512_ps(r[i]);
}

}  // namespace
}  // namespace cpu
}  // namespace q4
