// AVX-512 (F, BW, VL) kernels of the fused 4-bit matmuls, fp32 compute (the
// bit-exact fp32 contract of q4/kernels.h): the batch-1 gemv here (k % 64 ==
// 0), the tiled forward and the input gradient in gemm4_tiled.cc.
#include <algorithm>
#include <cstring>

#include "../../dispatch.h"
#include "../../gemm4_common.h"
#include "../../parallel.h"
#include "q4/kernels.h"
#include "q4/quant4.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")

namespace q4 {
namespace cpu {
namespace avx512 {
namespace {

using namespace gemm4;  // NOLINT: the shared pieces of every gemm4 unit

// GCC 12's own AVX-512 intrinsic headers trip -Wmaybe-uninitialized (they
// pass _mm512_undefined_*() as the merge source; GCC bug 105593, fixed in
// GCC 13): silenced for the AVX-512 functions below only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// AVX-512 batch-1 gemv (k % 64 == 0): 16 bytes widen to 16 int32 lanes
// (byte i of a half-chunk in lane i); `permutexvar` looks the 16-entry code
// table up with the low 4 bits of each lane, so the low nibble (odd element)
// needs no masking and the high nibble (even element) one shift. x is
// de-interleaved per 64-element chunk to match: xe[c*32 + i] = x[c*64 + 2i],
// xo[c*32 + i] = x[c*64 + 2i + 1]. Each 32-element half gets its own block
// scale (they differ when blocksize is 32). R rows share the x loads.
template <QuantType QT, int R>
void gemv1_rows_avx512(const Gemm4bitParams& p, const float* xe, const float* xo, const Scales& scales, int64_t r0) {
  alignas(64) float codes[16];
  for (int q = 0; q < 16; ++q) codes[q] = Code4<QT>::decode(q);
  const __m512 table = _mm512_load_ps(codes);
  const int64_t k = p.k, chunks = k / 64;
  const int shift = log2_exact(p.blocksize);
  __m512 total[R];
  for (int j = 0; j < R; ++j) total[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const __m512 xe0 = _mm512_loadu_ps(xe + c * 32), xe1 = _mm512_loadu_ps(xe + c * 32 + 16);
    const __m512 xo0 = _mm512_loadu_ps(xo + c * 32), xo1 = _mm512_loadu_ps(xo + c * 32 + 16);
    for (int j = 0; j < R; ++j) {
      const int64_t f = (r0 + j) * k + c * 64;
      const uint8_t* bytes = p.packed + f / 2;
      const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
      const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16)));
      __m512 h0 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), table), xe0);
      __m512 h1 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), table), xe1);
      h0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(v0, table), xo0, h0);
      h1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(v1, table), xo1, h1);
      total[j] = _mm512_fmadd_ps(h0, _mm512_set1_ps(scales(f >> shift)), total[j]);
      total[j] = _mm512_fmadd_ps(h1, _mm512_set1_ps(scales((f + 32) >> shift)), total[j]);
    }
  }
  for (int j = 0; j < R; ++j) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, total[j]);
    float sum = 0.0f;
    for (int l = 0; l < 8; ++l) sum += lanes[l] + lanes[l + 8];
    store_out(p.out, p.out_dtype, r0 + j, sum + load_bias(p.bias, p.bias_dtype, r0 + j));
  }
}

template <QuantType QT>
void gemv1_avx512(const Gemm4bitParams& p, const float* xe, const float* xo, const Scales& scales, int64_t n0,
                  int64_t n1) {
  int64_t r = n0;
  for (; r + 2 <= n1; r += 2) gemv1_rows_avx512<QT, 2>(p, xe, xo, scales, r);
  if (r < n1) gemv1_rows_avx512<QT, 1>(p, xe, xo, scales, r);
}

#pragma GCC diagnostic pop

template <QuantType QT>
void gemv1(const Gemm4bitParams& p, const float* x, const Scales& scales) {
  float* xe = scratch(kSlotPanels, p.k);
  float* xo = xe + p.k / 2;
  for (int64_t i = 0; i < p.k / 2; ++i) {
    xe[i] = x[2 * i];
    xo[i] = x[2 * i + 1];
  }
  parallel_for(ceil_div(p.n, 2), 4,
               [&](int64_t a, int64_t b) { gemv1_avx512<QT>(p, xe, xo, scales, 2 * a, std::min(p.n, 2 * b)); });
}

}  // namespace

bool gemm4(const Gemm4bitParams& p, const Scales& scales) {
  if (p.m > 1) return gemm4_tiled(p, scales);
  if (p.k % 64 != 0) return false;
  const float* x = as_f32(p.x, p.x_dtype, p.k);
  Q4_QUANT_SWITCH(p.quant_type, QT, [&] { gemv1<QT>(p, x, scales); });
  return true;
}

}  // namespace avx512
}  // namespace cpu
}  // namespace q4

#else  // not x86

namespace q4 {
namespace cpu {
namespace avx512 {
bool gemm4(const Gemm4bitParams&, const gemm4::Scales&) { return false; }
}  // namespace avx512
}  // namespace cpu
}  // namespace q4

#endif
