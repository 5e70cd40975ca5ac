// Block scales of a 4-bit weight for the AVX-512 units (x86/avx512 and
// x86/avx512_bf16): the absmax itself, or the nested absmax decoded exactly
// as gemm4::Scales does (fp32(code[q] * absmax2) + offset, two roundings), 32
// blocks per step. Include after the unit's `#pragma GCC target` (AVX-512F);
// everything here has internal linkage, so each unit keeps its own copy.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "../../dispatch.h"
#include "../prefetch.h"
#include "q4/dynamic8.h"
#include "q4/kernels.h"

namespace q4 {
namespace cpu {
namespace {

// The blocks [first, end) (blocksize 2^shift) that hold W rows [r, r + count)
// of k elements each; a block may straddle two rows.
struct BlockSpan {
  int64_t first, end;
};
inline BlockSpan row_blocks(int64_t r, int64_t count, int64_t k, int shift) {
  return {(r * k) >> shift, (((r + count) * k - 1) >> shift) + 1};
}

class ScaleDecoder {
 public:
  explicit ScaleDecoder(const Absmax4& a) : a_(a), vbmi_(a.nested() && vbmi_scale_decode()) {
    if (a.nested()) {
      if (a.nested_code)
        memcpy(code_, a.nested_code, sizeof(code_));
      else
        memcpy(code_, dynamic8::kValues.v, sizeof(code_));
      offset_ = a.nested_offset_ptr ? *a.nested_offset_ptr : a.nested_offset;
      for (int j = 0; j < 256; ++j) {
        uint32_t u;
        memcpy(&u, code_ + j, 4);
        lo16_[j] = uint16_t(u);
        hi16_[j] = uint16_t(u >> 16);
        if (vbmi_)
          for (int q = 0; q < 4; ++q) plane_[q][j] = uint8_t(u >> (8 * q));
      }
    }
  }
  // The plain fp32 absmax itself (indexed by global block), or null when
  // nested: kernels that read scales in place need no decode of plain ones.
  const float* plain() const { return a_.nested() ? nullptr : a_.absmax; }
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
  // The scales of W rows [r, r + count) (rows k elements long, blocks of
  // 2^shift) into out, returned as a pointer indexed by global block (the
  // returned p[b] = scale of block b); the next `next` rows' stored scales
  // are asked for (prefetch), for the caller's following call.
  const float* decode_rows(int64_t r, int64_t count, int64_t next, int64_t k, int shift, float* out) const {
    const BlockSpan s = row_blocks(r, count, k, shift);
    decode(s.first, s.end, out);
    if (next > 0) prefetch(s.end, row_blocks(r + count, next, k, shift).end);
    return out - s.first;
  }
  // scales of blocks [b0, b1) into out[0, b1 - b0); with MUL, each times
  // mult (a second fp32 rounding, as if multiplied after the decode)
  template <bool MUL = false>
  void decode(int64_t b0, int64_t b1, float* out, float mult = 1.0f) const {
    if (!a_.nested()) {
      if (!MUL) {
        memcpy(out, a_.absmax + b0, size_t(b1 - b0) * sizeof(float));
        return;
      }
      int64_t b = b0;
      for (; b + 16 <= b1; b += 16)
        _mm512_storeu_ps(out + (b - b0), _mm512_mul_ps(_mm512_loadu_ps(a_.absmax + b), _mm512_set1_ps(mult)));
      for (; b < b1; ++b) out[b - b0] = a_.absmax[b] * mult;
      return;
    }
    int64_t b = b0;
    for (; b < b1 && (b & 15) != 0; ++b) out[b - b0] = MUL ? one(b) * mult : one(b);
    // byte lookups for long ranges (their 16 table vectors are loaded once per
    // call: a run of 64 scales measured faster with the words)
    if (vbmi_ && b1 - b >= kBytesMinRange) {
      b = decode_words<MUL>(b0, b, b1, true, out, mult);  // up to a multiple of 64
      b = decode_bytes<MUL>(b0, b, b1, out, mult);
    }
    b = decode_words<MUL>(b0, b, b1, false, out, mult);
    for (; b < b1; ++b) out[b - b0] = MUL ? one(b) * mult : one(b);
  }

 private:
  // decode() from b (a multiple of 16) in steps of 32 or 16 blocks while
  // whole steps fit before b1 (and, with to64, b is not a multiple of 64);
  // returns where it stopped.
  template <bool MUL>
  int64_t decode_words(int64_t b0, int64_t b, int64_t b1, bool to64, float* out, float mult) const {
    if (b + 16 > b1 || (to64 && (b & 63) == 0)) return b;  // no step: the tables are not loaded
    // The 256-entry code book as 16-bit halves of its fp32 bit patterns
    // (made once, in the constructor), 8 vectors of 32 words each: a 32-lane
    // lookup of one half is 4 two-table word permutes (index bits 0-5) and 3
    // blends (bits 6-7), and the halves interleave back into 32 fp32 values
    // exactly (a 16-lane fp32 lookup took 8 permutes and 7 blends per 16
    // scales, a fifth of a batch-1 bf16 forward at blocksize 64)
    __m512i lo[8], hi[8];
    for (int i = 0; i < 8; ++i) {
      lo[i] = _mm512_load_si512(lo16_ + 32 * i);
      hi[i] = _mm512_load_si512(hi16_ + 32 * i);
    }
    // codes reordered so that unpacking the halves word by word within each
    // 128-bit lane gives scales 0-15, then 16-31: lane l of the lookup holds
    // codes 4l..4l+3 in words 0-3 and 16+4l..16+4l+3 in words 4-7
    const __m512i reorder = _mm512_set_epi16(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8, 23, 22, 21,
                                             20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512 offset = _mm512_set1_ps(offset_), mv = _mm512_set1_ps(mult);
    const auto finish = [&](__m512 v) { return MUL ? _mm512_mul_ps(v, mv) : v; };
    while (b + 16 <= b1 && !(to64 && (b & 63) == 0)) {
      // 32 blocks when they are there and share one absmax2 (block 256),
      // else 16 (b is a multiple of 16: 16 blocks always share one)
      const bool two =
          b + 32 <= b1 && (b & (kNestedBlocksize - 1)) + 32 <= kNestedBlocksize && !(to64 && ((b + 16) & 63) == 0);
      const __m256i bytes = _mm256_maskz_loadu_epi8(two ? ~__mmask32(0) : __mmask32(0xffff), a_.nested_codes + b);
      const __m512i q = _mm512_permutexvar_epi16(reorder, _mm512_cvtepu8_epi16(bytes));
      const __mmask32 b6 = _mm512_test_epi16_mask(q, _mm512_set1_epi16(64));
      const __mmask32 b7 = _mm512_test_epi16_mask(q, _mm512_set1_epi16(128));
      const auto look = [&](const __m512i(&t)[8]) {
        const __m512i r0 = _mm512_permutex2var_epi16(t[0], q, t[1]), r1 = _mm512_permutex2var_epi16(t[2], q, t[3]);
        const __m512i r2 = _mm512_permutex2var_epi16(t[4], q, t[5]), r3 = _mm512_permutex2var_epi16(t[6], q, t[7]);
        return _mm512_mask_blend_epi16(b7, _mm512_mask_blend_epi16(b6, r0, r1), _mm512_mask_blend_epi16(b6, r2, r3));
      };
      const __m512i l = look(lo), h = look(hi);
      const __m512 absmax2 = _mm512_set1_ps(a_.nested_absmax[b / kNestedBlocksize]);
      const __m512 code0 = _mm512_castsi512_ps(_mm512_unpacklo_epi16(l, h));
      _mm512_storeu_ps(out + (b - b0), finish(_mm512_add_ps(_mm512_mul_ps(code0, absmax2), offset)));
      if (two) {
        const __m512 code1 = _mm512_castsi512_ps(_mm512_unpackhi_epi16(l, h));
        _mm512_storeu_ps(out + (b - b0) + 16, finish(_mm512_add_ps(_mm512_mul_ps(code1, absmax2), offset)));
      }
      b += two ? 32 : 16;
    }
    return b;
  }

  // decode() from b (a multiple of 64) in steps of 64 blocks (which share one
  // absmax2) while they fit before b1; returns where it stopped. Each byte of
  // the code book's fp32 bit patterns is looked up on its own: per plane two
  // two-table byte permutes (index bits 0-6) and a blend (bit 7), then the
  // four planes interleave back into 64 fp32 values exactly. Against the
  // word lookup: 0.17 against 0.31 cycles per scale in a microbenchmark on
  // the Zen 5 VM.
  template <bool MUL>
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi"), noinline)) int64_t decode_bytes(int64_t b0, int64_t b,
                                                                                                 int64_t b1, float* out,
                                                                                                 float mult) const {
    __m512i t[4][4];
    for (int q = 0; q < 4; ++q)
      for (int i = 0; i < 4; ++i) t[q][i] = _mm512_load_si512(plane_[q] + 64 * i);
    // codes reordered so that the interleave below gives scales 0-15, 16-31,
    // 32-47, 48-63: byte 16l + 4j + u of the lookup is code 16j + 4l + u
    const __m512i reorder = _mm512_set_epi32(0x3f3e3d3c, 0x2f2e2d2c, 0x1f1e1d1c, 0x0f0e0d0c, 0x3b3a3938, 0x2b2a2928,
                                             0x1b1a1918, 0x0b0a0908, 0x37363534, 0x27262524, 0x17161514, 0x07060504,
                                             0x33323130, 0x23222120, 0x13121110, 0x03020100);
    const __m512 offset = _mm512_set1_ps(offset_), mv = _mm512_set1_ps(mult);
    for (; b + 64 <= b1; b += 64) {
      const __m512i q = _mm512_permutexvar_epi8(reorder, _mm512_loadu_si512(a_.nested_codes + b));
      const __mmask64 b7 = _mm512_movepi8_mask(q);
      __m512i v[4];
      for (int p = 0; p < 4; ++p)
        v[p] = _mm512_mask_blend_epi8(b7, _mm512_permutex2var_epi8(t[p][0], q, t[p][1]),
                                      _mm512_permutex2var_epi8(t[p][2], q, t[p][3]));
      const __m512i lo01 = _mm512_unpacklo_epi8(v[0], v[1]), hi01 = _mm512_unpackhi_epi8(v[0], v[1]);
      const __m512i lo23 = _mm512_unpacklo_epi8(v[2], v[3]), hi23 = _mm512_unpackhi_epi8(v[2], v[3]);
      const __m512i d[4] = {_mm512_unpacklo_epi16(lo01, lo23), _mm512_unpackhi_epi16(lo01, lo23),
                            _mm512_unpacklo_epi16(hi01, hi23), _mm512_unpackhi_epi16(hi01, hi23)};
      const __m512 absmax2 = _mm512_set1_ps(a_.nested_absmax[b / kNestedBlocksize]);
      for (int j = 0; j < 4; ++j) {
        __m512 s = _mm512_add_ps(_mm512_mul_ps(_mm512_castsi512_ps(d[j]), absmax2), offset);
        if (MUL) s = _mm512_mul_ps(s, mv);
        _mm512_storeu_ps(out + (b - b0) + 16 * j, s);
      }
    }
    return b;
  }

  static constexpr int64_t kBytesMinRange = 256;
  const Absmax4& a_;
  const bool vbmi_;  // decode_bytes (vbmi_scale_decode())
  alignas(64) float code_[256] = {};
  alignas(64) uint16_t lo16_[256] = {}, hi16_[256] = {};  // code_'s bit patterns, low and high halves
  alignas(64) uint8_t plane_[4][256] = {};                // (vbmi_) byte q of each bit pattern
  float offset_ = 0.0f;
};

}  // namespace
}  // namespace cpu
}  // namespace q4
