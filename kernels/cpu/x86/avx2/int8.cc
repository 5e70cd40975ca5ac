// AVX2 loops of the LLM.int8 ops (contracts in cpu/int8.cc; the drivers in
// cpu/int8_loops.h): the same fp32 operations in the same order as the
// scalar loops, 8 lanes at a time, so both give identical bytes. Entries
// int8_quantize_rows / int8_linear / int8_grad of the avx2 level and above.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../../dispatch.h"
#include "../../int8_loops.h"
#include "../../rows.h"
#include "../../simd_avx2.h"
#include "../unit.h"

Q4_UNIT_BEGIN(avx2)

namespace q4 {
namespace cpu {
namespace avx2 {
namespace {

using namespace int8_loops;  // NOLINT: the drivers' constants and scalar tails

template <typename T>
float row_stat_avx2(const T* x, int64_t n, float cut) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 thr = _mm256_set1_ps(cut);
  const bool use_thr = cut == cut;
  __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 a = _mm256_and_ps(::q4::avx2::Vec<T>::load(x + i), abs_mask);
    if (use_thr) a = _mm256_and_ps(a, _mm256_cmp_ps(a, thr, _CMP_NGE_UQ));  // outliers count as 0
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, a);
  }
  const float tail = row_stat_scalar(x + i, n - i, cut);
  if (_mm256_movemask_ps(nan) || tail != tail) return __builtin_nanf("");
  const float v = ::q4::avx2::hmax(m);
  return tail > v ? tail : v;
}

// Columns [8*g0, min(8*g1, cols)) of the outlier flags.
template <typename T>
void outlier_cols_avx2(const T* x, int64_t rows, int64_t cols, float cut, int64_t g0, int64_t g1, uint8_t* flags) {
  const int64_t c0 = 8 * g0, c1 = std::min(8 * g1, cols);
  const int64_t v1 = c0 + (c1 - c0) / 8 * 8;  // columns [c0, v1) in full groups of 8
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 thr = _mm256_set1_ps(cut);
  std::vector<uint8_t> bits(size_t((v1 - c0) / 8), 0);  // bit j of bits[g] = column c0 + 8g + j
  for (int64_t c = c0; c < c1; ++c) flags[c] = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    for (int64_t c = c0; c < v1; c += 8) {
      const __m256 a = _mm256_and_ps(::q4::avx2::Vec<T>::load(xr + c), abs_mask);
      bits[size_t((c - c0) / 8)] |= uint8_t(_mm256_movemask_ps(_mm256_cmp_ps(a, thr, _CMP_GE_OQ)));
    }
    for (int64_t c = v1; c < c1; ++c) flags[c] |= uint8_t(is_outlier(std::fabs(Elem<T>::load(xr, c)), cut));
  }
  for (int64_t c = c0; c < v1; ++c) flags[c] = uint8_t((bits[size_t((c - c0) / 8)] >> ((c - c0) % 8)) & 1);
}

__m256i quantize8(__m256 x, __m256 mult) {
  __m256 s = _mm256_mul_ps(x, mult);
  s = _mm256_and_ps(s, _mm256_cmp_ps(s, s, _CMP_ORD_Q));  // NaN -> +0
  s = _mm256_min_ps(_mm256_max_ps(s, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
  return _mm256_cvtps_epi32(_mm256_round_ps(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// keep: [n] bytes, 0xff for a regular column, 0 for an outlier column; null
// when there is no outlier column.
template <typename T>
void quantize_row_avx2(const T* x, int64_t n, float mult, const uint8_t* flags, const uint8_t* keep, int8_t* q) {
  const __m256 mv = _mm256_set1_ps(mult);
  const __m256i fix_lanes = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i a = quantize8(::q4::avx2::Vec<T>::load(x + i), mv);
    const __m256i b = quantize8(::q4::avx2::Vec<T>::load(x + i + 8), mv);
    const __m256i c = quantize8(::q4::avx2::Vec<T>::load(x + i + 16), mv);
    const __m256i d = quantize8(::q4::avx2::Vec<T>::load(x + i + 24), mv);
    __m256i bytes =
        _mm256_permutevar8x32_epi32(_mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d)), fix_lanes);
    if (keep != nullptr)
      bytes = _mm256_and_si256(bytes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keep + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), bytes);
  }
  quantize_row_scalar(x + i, n - i, mult, flags == nullptr ? nullptr : flags + i, q + i);
}

void axpy_avx2(float* o, const float* w, float x, int64_t len) {
  const __m256 xv = _mm256_set1_ps(x);
  int64_t j = 0;
  for (; j + 8 <= len; j += 8)
    _mm256_storeu_ps(o + j, _mm256_add_ps(_mm256_loadu_ps(o + j), _mm256_mul_ps(xv, _mm256_loadu_ps(w + j))));
  axpy_scalar(o + j, w + j, x, len - j);
}

template <typename TO>
void linear_epilogue_avx2(const Int8LinearParams& p, const LinearShared& s, int64_t m0, int mr, int64_t n0, int nr,
                          const int32_t* acc, int64_t as, const float* o, int64_t os) {
  TO* out = static_cast<TO*>(p.out);
  const __m256 inv = _mm256_set1_ps(kInv127Sq);
  const int full = nr / 8 * 8;
  for (int i = 0; i < mr; ++i) {
    const int64_t m = m0 + i;
    const __m256 rs = _mm256_set1_ps(s.row_stats[m]);
    for (int j = 0; j < full; j += 8) {
      const int64_t n = n0 + j;
      const __m256 scale = _mm256_mul_ps(rs, _mm256_loadu_ps(p.weight_scale + n));
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + i * as + j));
      __m256 y = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a), scale), inv);
      if (o != nullptr) y = _mm256_add_ps(y, _mm256_loadu_ps(o + i * os + j));
      if (s.bias != nullptr) y = _mm256_add_ps(y, _mm256_loadu_ps(s.bias + n));
      ::q4::avx2::Vec<TO>::store(out + m * p.n + n, y);
    }
  }
  if (full < nr) linear_epilogue_scalar<TO>(p, s, m0, mr, n0, nr, full, acc, as, o, os);
}

// The register tiles fully unroll their loops over MR / NR / NV with
// `#pragma GCC unroll`, early enough that GCC keeps the accumulator arrays
// in registers; without it they are stored to the stack on every step.
int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// acc[i][j] += 32 products x_i[0..32) . w_j[0..32). maddubs(|w|, sign(x, w))
// forms w*x pairwise in int16: |pair sum| <= 2 * 128 * 127 < 2^15 because
// |x| <= 127 (|w| = 128 is fine too), so nothing saturates; madd with ones
// widens to int32.
template <int MR, int NR>
void dot_step_avx2(const int8_t* x, int64_t xs, const int8_t* const* w, __m256i (&acc)[MR][NR]) {
  const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[j]));
    const __m256i wa = _mm256_abs_epi8(wv);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * xs));
      const __m256i pairs = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv, wv));
      acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(pairs, ones));
    }
  }
}

// Dot products of MR rows of xq (stride xs, readable and zero-padded up to
// ceil(k/32)*32) with NR rows w[j] (readable up to k). The last partial
// 32-column block of W comes from wtail [NR][32] (zero-padded copies).
template <int MR, int NR>
void dot_tile_avx2(const int8_t* xq, int64_t xs, const int8_t* const* w, int64_t k, const int8_t (*wtail)[32],
                   int32_t* acc) {
  __m256i a[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) a[i][j] = _mm256_setzero_si256();
  const int64_t kfull = k / 32 * 32;
  const int8_t* wp[NR];
  for (int64_t kk = 0; kk < kfull; kk += 32) {
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) wp[j] = w[j] + kk;
    dot_step_avx2<MR, NR>(xq + kk, xs, wp, a);
  }
  if (kfull < k) {
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) wp[j] = wtail[j];
    dot_step_avx2<MR, NR>(xq + kfull, xs, wp, a);
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i * kLinNR + j] = hsum_epi32(a[i][j]);
}

// 32 bytes at a time: x + 128 as unsigned bytes, summed by vpsadbw.
int32_t row_sum_avx2(const int8_t* x, int64_t len) {
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  __m256i acc = _mm256_setzero_si256();
  int64_t c = 0;
  for (; c + 32 <= len; c += 32) {
    const __m256i v = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + c)), flip);
    acc = _mm256_add_epi64(acc, _mm256_sad_epu8(v, _mm256_setzero_si256()));
  }
  __m128i t = _mm_add_epi64(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  t = _mm_add_epi64(t, _mm_unpackhi_epi64(t, t));
  return int32_t(_mm_cvtsi128_si64(t) - 128 * c) + row_sum_scalar(x + c, len - c);
}

void widen_w_avx2(const int8_t* w, int64_t ws, int64_t nlen, int64_t width, float* wf) {
  if (width < 8) return widen_w_scalar(w, ws, nlen, width, wf);
  for (int64_t nn = 0; nn < nlen; ++nn)
    for (int64_t v = 0; v + 8 <= width; v += 8)
      _mm256_storeu_ps(
          wf + nn * kGradKT + v,
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + nn * ws + v)))));
}

template <int MR, int NV>
void grad_tile_avx2(const float* panel, const float* wf, int64_t nlen, float* acc, int64_t as) {
  __m256 a[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) a[i][v] = _mm256_loadu_ps(acc + i * as + 8 * v);
  for (int64_t nn = 0; nn < nlen; ++nn) {
    __m256 wv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) wv[v] = _mm256_loadu_ps(wf + nn * kGradKT + 8 * v);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 g = _mm256_broadcast_ss(panel + nn * MR + i);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) a[i][v] = _mm256_add_ps(a[i][v], _mm256_mul_ps(g, wv[v]));
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(acc + i * as + 8 * v, a[i][v]);
}
// As grad_tile_avx2, widening W in registers: for a single row block,
// where a widened chunk would be used only once.
template <int MR, int NV>
void grad_tile_direct_avx2(const float* panel, const int8_t* w, int64_t ws, int64_t nlen, float* acc, int64_t as) {
  __m256 a[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) a[i][v] = _mm256_loadu_ps(acc + i * as + 8 * v);
  for (int64_t nn = 0; nn < nlen; ++nn) {
    __m256 wv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v)
      wv[v] = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + nn * ws + 8 * v))));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 g = _mm256_broadcast_ss(panel + nn * MR + i);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) a[i][v] = _mm256_add_ps(a[i][v], _mm256_mul_ps(g, wv[v]));
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(acc + i * as + 8 * v, a[i][v]);
}

template <int MR>
void grad_direct_dispatch_mr(const float* panel, const int8_t* w, int64_t ws, int64_t nlen, int64_t width, float* acc,
                             int64_t as) {
  if (width == 16) return grad_tile_direct_avx2<MR, 2>(panel, w, ws, nlen, acc, as);
  grad_tile_direct_avx2<MR, 1>(panel, w, ws, nlen, acc, as);
}

// width 16 or 8.
void grad_tile_direct(int mr, const float* panel, const int8_t* w, int64_t ws, int64_t nlen, int64_t width, float* acc,
                      int64_t as) {
#define Q4_GRAD(R) grad_direct_dispatch_mr<R>(panel, w, ws, nlen, width, acc, as)
  Q4_ROWS_SWITCH_6(mr, Q4_GRAD)
#undef Q4_GRAD
}

// The loops int8_loops.h's drivers run on this level.
struct Avx2Loops {
  template <typename T>
  static float row_stat(const T* x, int64_t n, float cut) {
    return row_stat_avx2(x, n, cut);
  }
  template <typename T>
  static void outlier_cols(const T* x, int64_t rows, int64_t cols, float cut, int64_t g0, int64_t g1, uint8_t* flags) {
    outlier_cols_avx2(x, rows, cols, cut, g0, g1, flags);
  }
  template <typename T>
  static void quantize_row(const T* x, int64_t n, float mult, const uint8_t* flags, const uint8_t* keep, int8_t* q) {
    quantize_row_avx2(x, n, mult, flags, keep, q);
  }
  static void axpy(float* o, const float* w, float x, int64_t len) { axpy_avx2(o, w, x, len); }
  template <typename TO>
  static void epilogue(const Int8LinearParams& p, const LinearShared& s, int64_t m0, int mr, int64_t n0, int nr,
                       const int32_t* acc, int64_t as, const float* o, int64_t os) {
    linear_epilogue_avx2<TO>(p, s, m0, mr, n0, nr, acc, as, o, os);
  }
  template <int MR, int NR>
  static void dot_tile(const int8_t* xq, int64_t xs, const int8_t* const* w, int64_t k, const int8_t (*wtail)[32],
                       int32_t* acc) {
    dot_tile_avx2<MR, NR>(xq, xs, w, k, wtail, acc);
  }
  static int32_t row_sum(const int8_t* x, int64_t len) { return row_sum_avx2(x, len); }
  static void widen_w(const int8_t* w, int64_t ws, int64_t nlen, int64_t width, float* wf) {
    widen_w_avx2(w, ws, nlen, width, wf);
  }
  template <int MR>
  static void grad_tile(const float* panel, const float* wf, int64_t nlen, int64_t width, float* acc, int64_t as) {
    if (width == 16) return grad_tile_avx2<MR, 2>(panel, wf, nlen, acc, as);
    if (width == 8) return grad_tile_avx2<MR, 1>(panel, wf, nlen, acc, as);
    grad_tile_scalar<MR>(panel, wf, nlen, width, acc, as);
  }
  static bool grad_tile_direct(int mr, const float* panel, const int8_t* w, int64_t ws, int64_t nlen, int64_t width,
                               float* acc, int64_t as) {
    avx2::grad_tile_direct(mr, panel, w, ws, nlen, width, acc, as);
    return true;
  }
};

}  // namespace

bool int8_quantize_rows(const Int8QuantizeRowsParams& p) {
  quantize_rows_op<Avx2Loops>(p);
  return true;
}
bool int8_linear(const Int8LinearParams& p, Int8LinearRun* run) {
  linear_op<Avx2Loops>(p, run);
  return true;
}
bool int8_grad(const Int8GradInputParams& p, const float* col_scale) {
  grad_op<Avx2Loops>(p, col_scale);
  return true;
}

}  // namespace avx2
}  // namespace cpu
}  // namespace q4

Q4_UNIT_END
