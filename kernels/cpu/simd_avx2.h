// AVX2 helpers for the x86 ISA units. Every function carries the target
// attribute, so the units may include this header before their
// Q4_UNIT_BEGIN (x86/unit.h) and no AVX2 code can leak into the scalar path
// through shared inline functions.
#pragma once

#include <immintrin.h>

#include "q4/common.h"

#define Q4_AVX2 __attribute__((target("avx2,fma,f16c"))) inline

namespace q4 {
namespace avx2 {

template <typename T>
struct Vec;  // 8 elements of T <-> __m256 (fp32)

template <>
struct Vec<float> {
  Q4_AVX2 static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  Q4_AVX2 static void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
};
template <>
struct Vec<bf16_t> {
  Q4_AVX2 static __m256 load(const bf16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  // Round to nearest even; NaN -> quiet NaN (same as f32_to_bf16).
  Q4_AVX2 static void store(bf16_t* p, __m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
};
template <>
struct Vec<f16_t> {
  Q4_AVX2 static __m256 load(const f16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  Q4_AVX2 static void store(f16_t* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
};

Q4_AVX2 float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// max |x| over len (multiple of 8) elements; NaN anywhere -> NaN.
template <typename T>
Q4_AVX2 float absmax(const T* x, int64_t len) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m256 a = _mm256_and_ps(Vec<T>::load(x + i), abs_mask);
    const __m256 b = _mm256_and_ps(Vec<T>::load(x + i + 8), abs_mask);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
  }
  for (; i < len; i += 8) {
    const __m256 a = _mm256_and_ps(Vec<T>::load(x + i), abs_mask);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    m0 = _mm256_max_ps(m0, a);
  }
  if (_mm256_movemask_ps(nan)) return __builtin_nanf("");
  return hmax(_mm256_max_ps(m0, m1));
}

// 16-entry fp32 table lookup: t_lo = entries 0..7, t_hi = entries 8..15.
Q4_AVX2 __m256 lookup16(__m256 t_lo, __m256 t_hi, __m256i idx) {
  const __m256 lo = _mm256_permutevar8x32_ps(t_lo, idx);
  const __m256 hi = _mm256_permutevar8x32_ps(t_hi, idx);
  return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

}  // namespace avx2
}  // namespace q4
