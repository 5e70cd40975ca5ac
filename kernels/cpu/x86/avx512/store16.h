// Output stores of the AVX-512 units: 16 fp32 values (the first `count`, or
// the lanes of a mask, written) as T, rounded as Elem<T>::store rounds. Include after
// the unit's `#pragma GCC target` (AVX-512 F/BW); everything here has
// internal linkage, so each unit keeps its own copy.
#pragma once

#include <immintrin.h>

#include "q4/common.h"

namespace q4 {
namespace cpu {
namespace {

// The lanes of v set in `mask` to the same lanes of dst.
template <typename T>
inline void store16_mask(T* dst, __m512 v, __mmask16 mask);
template <>
inline void store16_mask<float>(float* dst, __m512 v, __mmask16 mask) {
  _mm512_mask_storeu_ps(dst, mask, v);
}
template <>
inline void store16_mask<bf16_t>(bf16_t* dst, __m512 v, __mmask16 mask) {
  // round to nearest even; NaN -> quiet NaN (as f32_to_bf16)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_mask_storeu_epi16(dst, mask, _mm512_cvtepi32_epi16(r));
}
template <>
inline void store16_mask<f16_t>(f16_t* dst, __m512 v, __mmask16 mask) {
  alignas(64) float t[16];
  _mm512_store_ps(t, v);
  for (int i = 0; i < 16; ++i)
    if (mask >> i & 1) Elem<f16_t>::store(dst, i, t[i]);
}

template <typename T>
inline void store16(T* dst, __m512 v, int count) {
  store16_mask<T>(dst, v, __mmask16((1u << count) - 1));
}

}  // namespace
}  // namespace cpu
}  // namespace q4
