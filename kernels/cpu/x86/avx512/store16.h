// Output stores of the AVX-512 units: 16 fp32 values (of which the first
// `count` are written) as T, rounded as Elem<T>::store rounds. Include after
// the unit's `#pragma GCC target` (AVX-512 F/BW); everything here has
// internal linkage, so each unit keeps its own copy.
#pragma once

#include <immintrin.h>

#include "q4/common.h"

namespace q4 {
namespace cpu {
namespace {

template <typename T>
inline void store16(T* dst, __m512 v, int count);
template <>
inline void store16<float>(float* dst, __m512 v, int count) {
  _mm512_mask_storeu_ps(dst, __mmask16((1u << count) - 1), v);
}
template <>
inline void store16<bf16_t>(bf16_t* dst, __m512 v, int count) {
  // round to nearest even; NaN -> quiet NaN (as f32_to_bf16)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_mask_storeu_epi16(dst, __mmask16((1u << count) - 1), _mm512_cvtepi32_epi16(r));
}
// fp32 bits u rounded to bf16 in their high words (the low words are left
// over): to nearest even, NaN -> quiet NaN, as f32_to_bf16.
inline __m512i bf16_high_words(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x400000));
}

// 32 fp32 values (a, then b; the first `count` written) as bf16, rounded as
// store16<bf16_t>: one 64-byte store.
inline void store32_bf16(bf16_t* dst, __m512 a, __m512 b, int count) {
  alignas(64) static const uint16_t odd[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                               33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  const __m512i w = _mm512_permutex2var_epi16(bf16_high_words(a), _mm512_load_si512(odd), bf16_high_words(b));
  _mm512_mask_storeu_epi16(dst, count >= 32 ? ~__mmask32(0) : ((__mmask32(1) << count) - 1), w);
}

template <>
inline void store16<f16_t>(f16_t* dst, __m512 v, int count) {
  alignas(64) float t[16];
  _mm512_store_ps(t, v);
  for (int i = 0; i < count; ++i) Elem<f16_t>::store(dst, i, t[i]);
}

}  // namespace
}  // namespace cpu
}  // namespace q4
