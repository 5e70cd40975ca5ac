// Blockwise 8-bit optimizer step with 512-bit vectors (contract in
// q4/optim8.h and Optim8bitParams): per block of 256 elements, 16 vectors of
// 16. The states are decoded with gathers from the 256-entry code books, each
// element updated with the contract's operations (vfmadd for its fused
// multiply-adds, vsqrtps / vdivps correctly rounded), the block's new states
// kept in 2 KiB of stack until their absmax is known, then re-quantized with
// one 4-byte gather per 16 bins from the map's bin table. Every operation is
// the scalar reference's, lane by lane, so the bytes are the same.
#include "q4/optim8.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "../../dispatch.h"
#include "../../optim8_common.h"
#include "../../parallel.h"
#include "../unit.h"
#include "q4/kernels.h"

Q4_UNIT_BEGIN(avx512)

namespace q4 {
namespace cpu {
namespace avx512 {
namespace {

using V = __m512;
constexpr int kVecs = optim8::kBlock / 16;

struct VConsts {
  V beta1, omb1, beta2, omb2, eps, neg_lr, wd, decay, c2, step_size, gscale;
  bool has_decay, first;
  explicit VConsts(const optim8::Consts& k)
      : beta1(_mm512_set1_ps(k.beta1)),
        omb1(_mm512_set1_ps(k.one_minus_beta1)),
        beta2(_mm512_set1_ps(k.beta2)),
        omb2(_mm512_set1_ps(k.one_minus_beta2)),
        eps(_mm512_set1_ps(k.eps)),
        neg_lr(_mm512_set1_ps(k.neg_lr)),
        wd(_mm512_set1_ps(k.weight_decay)),
        decay(_mm512_set1_ps(k.decay)),
        c2(_mm512_set1_ps(k.correction2)),
        step_size(_mm512_set1_ps(k.step_size)),
        gscale(_mm512_set1_ps(k.gnorm_scale)),
        has_decay(k.has_decay),
        first(k.first_step) {}
};

inline V load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline V load16(const bf16_t* p, __mmask16 m) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline void store16(float* p, __mmask16 m, V v) { _mm512_mask_storeu_ps(p, m, v); }
// fp32 -> bf16 rounded to nearest even, NaN kept quiet (f32_to_bf16)
inline void store16(bf16_t* p, __mmask16 m, V v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
}

// fp32 -> the parameter dtype and back (identity for fp32; bf16 rounded to nearest even)
inline V round_to(float*, V v) { return v; }
inline V round_to(bf16_t*, V v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
}

// optim8::nextafter_f lane by lane (up: towards +inf); NaN lanes are never passed
inline V next_toward(V u, __mmask16 up) {
  const V zero = _mm512_setzero_ps();
  const __m512i b = _mm512_castps_si512(u), one = _mm512_set1_epi32(1);
  const __mmask16 pos = _mm512_cmp_ps_mask(u, zero, _CMP_GT_OQ), is_zero = _mm512_cmp_ps_mask(u, zero, _CMP_EQ_OQ);
  const __mmask16 inc = __mmask16(~(pos ^ up));
  __m512i r = _mm512_mask_add_epi32(b, inc, b, one);
  r = _mm512_mask_sub_epi32(r, __mmask16(~inc), b, one);
  const __m512i tiny = _mm512_mask_blend_epi32(up, _mm512_set1_epi32(int32_t(0x80000001u)), one);
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(is_zero, r, tiny));
}

// optim8::update_to lane by lane
inline V update_to(V p, V next) {
  V u = _mm512_sub_ps(next, p);
  for (int i = 0; i < 2; ++i) {
    const V r = _mm512_add_ps(p, u);
    const __mmask16 done = _mm512_cmp_ps_mask(r, next, _CMP_EQ_OQ) | _mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q);
    if (done == 0xffff) break;
    const __mmask16 up = _mm512_cmp_ps_mask(r, next, _CMP_LT_OQ);
    u = _mm512_mask_blend_ps(__mmask16(~done), u, next_toward(u, up));
  }
  return u;
}

inline V sign16(V u) {
  const V zero = _mm512_setzero_ps();
  const __mmask16 pos = _mm512_cmp_ps_mask(u, zero, _CMP_GT_OQ), neg = _mm512_cmp_ps_mask(u, zero, _CMP_LT_OQ);
  V r = _mm512_mask_blend_ps(pos, zero, _mm512_set1_ps(1.0f));
  return _mm512_mask_blend_ps(neg, r, _mm512_set1_ps(-1.0f));
}

template <int32_t K>
inline void update16(const VConsts& k, V g, V& p, V& m, V& v) {
  g = _mm512_mul_ps(g, k.gscale);
  if (K == optim8::kAdam) {
    m = _mm512_fmadd_ps(g, k.omb1, _mm512_mul_ps(m, k.beta1));
    v = _mm512_fmadd_ps(_mm512_mul_ps(k.omb2, g), g, _mm512_mul_ps(v, k.beta2));
    const V d = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), k.c2), k.eps);
    if (k.has_decay) p = _mm512_mul_ps(p, k.decay);
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(k.step_size, m), d));
  } else if (K == optim8::kMomentum) {
    g = _mm512_fmadd_ps(p, k.wd, g);
    m = k.first ? g : _mm512_add_ps(_mm512_mul_ps(m, k.beta1), g);
    p = _mm512_fmadd_ps(m, k.neg_lr, p);
  } else if (K == optim8::kLion) {
    if (k.has_decay) p = _mm512_mul_ps(p, k.decay);
    const V u = sign16(_mm512_add_ps(_mm512_mul_ps(m, k.beta1), _mm512_mul_ps(g, k.omb1)));
    p = _mm512_fmadd_ps(u, k.neg_lr, p);
    m = _mm512_fmadd_ps(g, k.omb2, _mm512_mul_ps(m, k.beta2));
  } else {
    g = _mm512_fmadd_ps(p, k.wd, g);
    m = _mm512_fmadd_ps(_mm512_mul_ps(k.omb1, g), g, _mm512_mul_ps(m, k.beta1));
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(k.neg_lr, g), _mm512_add_ps(_mm512_sqrt_ps(m), k.eps)));
  }
}

inline __mmask16 lanes(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u); }

inline V decode16(const uint8_t* codes, __mmask16 m, const float* book, float absmax) {
  const __m512i idx = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, codes));
  return _mm512_mul_ps(_mm512_i32gather_ps(idx, book, 4), _mm512_set1_ps(absmax));
}

// Codes of one block's new state x (inactive lanes of x are 0) with max |x| = amax.
inline void quantize_block(const V* x, int64_t len, float amax, const uint8_t* table, uint8_t* codes) {
  if (amax == 0.0f) {
    for (int j = 0; j * 16 < len; ++j) _mm_mask_storeu_epi8(codes + j * 16, lanes(len - j * 16), _mm_setzero_si128());
    return;
  }
  // bin = trunc(fp32(65535 * t + 0.5)) with t = fp32(clamp(s) + 1) * 0.5 (blockwise8::bin_of):
  // fp32(clamp(s) + 1) == clamp(fp32(s + 1), 0, 2) for every s, and 65535 * t == 32767.5 *
  // fp32(clamp(s) + 1) exactly, so one fused multiply-add gives the same bin. A NaN s: vmaxps
  // returns its second operand, 0, so the bin is 0, as bin_of gives.
  const V inv = _mm512_set1_ps(1.0f / amax), one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f);
  const V half = _mm512_set1_ps(0.5f), scale = _mm512_set1_ps(32767.5f), zero = _mm512_setzero_ps();
  for (int j = 0; j * 16 < len; ++j) {
    const V u = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(_mm512_mul_ps(x[j], inv), one), zero), two);
    const __m512i bin = _mm512_cvttps_epi32(_mm512_fmadd_ps(scale, u, half));
    // vpmovdb keeps each gathered dword's low byte: the table entry
    const __m512i code = _mm512_i32gather_epi32(bin, table, 1);
    _mm_mask_storeu_epi8(codes + j * 16, lanes(len - j * 16), _mm512_cvtepi32_epi8(code));
  }
}

template <int32_t K, typename P, typename G>
int64_t blocks(const Optim8Call& c, int64_t b0, int64_t b1) {
  const Optim8bitParams& p = *c.p;
  P* param = static_cast<P*>(p.param);
  const G* grad = static_cast<const G*>(p.grad);
  constexpr bool kTwo = K == optim8::kAdam;
  const VConsts k(c.k);
  const __m512i exp_mask = _mm512_set1_epi32(0x7f800000);
  int64_t skipped = 0;
  V g[kVecs], m[kVecs], v[kVecs];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * optim8::kBlock, len = std::min(optim8::kBlock, p.n - start);
    const int nv = int((len + 15) / 16);
    __mmask16 nonfinite = 0;
    for (int j = 0; j < nv; ++j) {
      g[j] = load16(grad + start + j * 16, lanes(len - j * 16));
      const __m512i e = _mm512_and_si512(_mm512_castps_si512(g[j]), exp_mask);
      nonfinite |= _mm512_cmpeq_epi32_mask(e, exp_mask);
    }
    if (nonfinite) {
      ++skipped;
      if (p.update)
        for (int j = 0; j < nv; ++j)
          _mm512_mask_storeu_ps(p.update + start + j * 16, lanes(len - j * 16), _mm512_setzero_ps());
      continue;
    }
    const float a1 = p.absmax1[b], a2 = kTwo ? p.absmax2[b] : 0.0f;
    V amax1 = _mm512_setzero_ps(), amax2 = _mm512_setzero_ps();
    for (int j = 0; j < nv; ++j) {
      const int64_t i = start + j * 16;
      const __mmask16 mk = lanes(len - j * 16);
      V w = load16(param + i, mk);
      V mm = decode16(p.state1 + i, mk, c.book1, a1);
      V vv = kTwo ? decode16(p.state2 + i, mk, c.book2, a2) : _mm512_setzero_ps();
      const V before = w;
      update16<K>(k, g[j], w, mm, vv);
      if (p.update)
        _mm512_mask_storeu_ps(p.update + i, mk, update_to(before, round_to(param, w)));
      else
        store16(param + i, mk, w);
      m[j] = _mm512_maskz_mov_ps(mk, mm);
      amax1 = _mm512_max_ps(_mm512_abs_ps(m[j]), amax1);  // NaN lanes keep amax1
      if (kTwo) {
        v[j] = _mm512_maskz_mov_ps(mk, vv);
        amax2 = _mm512_max_ps(_mm512_abs_ps(v[j]), amax2);
      }
    }
    const float m1 = _mm512_reduce_max_ps(amax1);
    p.absmax1[b] = m1;
    quantize_block(m, len, m1, c.table1, p.state1 + start);
    if (kTwo) {
      const float m2 = _mm512_reduce_max_ps(amax2);
      p.absmax2[b] = m2;
      quantize_block(v, len, m2, c.table2, p.state2 + start);
    }
  }
  return skipped;
}

template <int32_t K, typename P>
int64_t run_grad(const Optim8Call& c) {
  if (c.p->grad_dtype == kF32)
    return optim8_blocks(c, [&](int64_t b0, int64_t b1) { return blocks<K, P, float>(c, b0, b1); });
  return optim8_blocks(c, [&](int64_t b0, int64_t b1) { return blocks<K, P, bf16_t>(c, b0, b1); });
}

template <int32_t K>
int64_t run_kind(const Optim8Call& c) {
  return c.p->param_dtype == kF32 ? run_grad<K, float>(c) : run_grad<K, bf16_t>(c);
}

}  // namespace

bool optim8(const Optim8Call& c) {
  const Optim8bitParams& p = *c.p;
  if (p.param_dtype == kF16 || p.grad_dtype == kF16) return false;
  int64_t skipped = 0;
  switch (p.optimizer) {
    case optim8::kAdam:
      skipped = run_kind<optim8::kAdam>(c);
      break;
    case optim8::kMomentum:
      skipped = run_kind<optim8::kMomentum>(c);
      break;
    case optim8::kLion:
      skipped = run_kind<optim8::kLion>(c);
      break;
    default:
      skipped = run_kind<optim8::kRmsprop>(c);
  }
  if (p.skipped_blocks) *p.skipped_blocks = int32_t(std::min<int64_t>(skipped, INT32_MAX));
  return true;
}

}  // namespace avx512
}  // namespace cpu
}  // namespace q4

Q4_UNIT_END
