// Block scales of a 4-bit weight for the AVX-512 units (x86/avx512 and
// x86/avx512_bf16): the absmax itself, or the nested absmax decoded exactly
// as gemm4::Scales does (fp32(code[q] * absmax2) + offset, two roundings), 16
// blocks per step. Include after the unit's `#pragma GCC target` (AVX-512F);
// everything here has internal linkage, so each unit keeps its own copy.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "../prefetch.h"
#include "q4/dynamic8.h"
#include "q4/kernels.h"

namespace q4 {
namespace cpu {
namespace {

class ScaleDecoder {
 public:
  explicit ScaleDecoder(const Absmax4& a) : a_(a) {
    if (a.nested()) {
      if (a.nested_code)
        memcpy(code_, a.nested_code, sizeof(code_));
      else
        memcpy(code_, dynamic8::kValues.v, sizeof(code_));
      offset_ = a.nested_offset_ptr ? *a.nested_offset_ptr : a.nested_offset;
    }
  }
  float one(int64_t b) const {
    if (!a_.nested()) return a_.absmax[b];
    const float scaled = code_[a_.nested_codes[b]] * a_.nested_absmax[b / kNestedBlocksize];
    return scaled + offset_;
  }
  // Brings the stored scales of blocks [b0, b1) (the nested codes, or the
  // fp32 absmax) into L2: decode() of the next row block then does not wait
  // for them (2 KB per 32 rows of 4096, not in the hardware prefetchers' view
  // while W streams).
  void prefetch(int64_t b0, int64_t b1) const {
    const int64_t size = a_.nested() ? 1 : int64_t(sizeof(float));
    const char* base =
        a_.nested() ? reinterpret_cast<const char*>(a_.nested_codes) : reinterpret_cast<const char*>(a_.absmax);
    for (int64_t o = b0 * size; o < b1 * size; o += 64) prefetch_stream(base + o);
  }
  // scales of blocks [b0, b1) into out[0, b1 - b0)
  void decode(int64_t b0, int64_t b1, float* out) const {
    if (!a_.nested()) {
      memcpy(out, a_.absmax + b0, size_t(b1 - b0) * sizeof(float));
      return;
    }
    int64_t b = b0;
    for (; b < b1 && (b & 15) != 0; ++b) out[b - b0] = one(b);
    // the 256-entry code book as 16 vectors: a 16-lane lookup is 8 two-table
    // permutes (index bits 0-4) and 7 blends (bits 5-7); a gather is slower
    __m512 t[16];
    for (int i = 0; i < 16; ++i) t[i] = _mm512_load_ps(code_ + 16 * i);
    const __m512 offset = _mm512_set1_ps(offset_);
    for (; b + 16 <= b1; b += 16) {
      // 16 consecutive blocks from a multiple of 16 share one absmax2 (block 256)
      const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a_.nested_codes + b)));
      __m512 r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm512_permutex2var_ps(t[2 * i], q, t[2 * i + 1]);
      const __mmask16 b5 = _mm512_test_epi32_mask(q, _mm512_set1_epi32(32));
      const __mmask16 b6 = _mm512_test_epi32_mask(q, _mm512_set1_epi32(64));
      const __mmask16 b7 = _mm512_test_epi32_mask(q, _mm512_set1_epi32(128));
      for (int i = 0; i < 4; ++i) r[i] = _mm512_mask_blend_ps(b5, r[2 * i], r[2 * i + 1]);
      for (int i = 0; i < 2; ++i) r[i] = _mm512_mask_blend_ps(b6, r[2 * i], r[2 * i + 1]);
      const __m512 code = _mm512_mask_blend_ps(b7, r[0], r[1]);
      const __m512 scaled = _mm512_mul_ps(code, _mm512_set1_ps(a_.nested_absmax[b / kNestedBlocksize]));
      _mm512_storeu_ps(out + (b - b0), _mm512_add_ps(scaled, offset));
    }
    for (; b < b1; ++b) out[b - b0] = one(b);
  }

 private:
  const Absmax4& a_;
  alignas(64) float code_[256] = {};
  float offset_ = 0.0f;
};

}  // namespace
}  // namespace cpu
}  // namespace q4
