// LLM.int8 kernels on the CPU: row-wise quantization, the int8 linear and its
// input gradient.
//
// Row quantization of x [rows, cols] (bit-exact with bitsandbytes 0.50.2's
// int8_vectorwise_quant, whose CPU path evaluates these torch expressions):
//   outlier element  threshold > 0 and |x| >= cut (NaN never is one), where
//                    cut = threshold rounded to x's dtype: torch compares
//                    `A.abs() >= threshold` in A's dtype (fp16 6.0009 -> 6.0);
//   outlier column   a column holding an outlier element;
//   row_stats[r]     max |x[r, c]| over the non-outlier elements of row r,
//                    NaN if one of them is NaN;
//   mult[r]          fp32(fp32(1 / row_stats[r]) * 127): torch evaluates
//                    `127.0 / t` as `t.reciprocal() * 127`, two roundings;
//   q[r, c]          round_half_even(clamp(fp32(x[r, c] * mult[r]), -127, 127)),
//                    0 where the product is NaN (0 * inf in a row whose
//                    row_stats is 0, NaN input) and 0 in every outlier column.
// The last rule covers both bitsandbytes cases: with rows > 1 it zeroes whole
// outlier columns; with one row the outlier columns are exactly the outlier
// elements, which it zeroes before quantizing.
//
// Linear, Y [m, n] from X [m, k] and CB [n, k], SCB [n]; every step an fp32
// operation in this order, no FMA contraction (the build uses
// -ffp-contract=off), identical in the scalar and AVX2 paths:
//   acc[m, n] = sum_k q[m, k] * CB[n, k]                              exact int32
//   y         = fp32(float(acc) * fp32(row_stats[m] * SCB[n])) * kInv127Sq
//   outliers (threshold > 0 and outlier columns c_0 < c_1 < ... exist):
//     wd[n, c] = fp32(float(CB[n, c]) * SCB[n]) * kInv127
//     o        = ((0 + x[m, c_0] * wd[n, c_0]) + x[m, c_1] * wd[n, c_1]) + ...
//     y        = y + o
//   bias:        y = y + bias[n]
//   out = y rounded to out_dtype (nearest even).
// float(acc) rounds to nearest for |acc| > 2^24. |acc| <= 128 * 127 * k must
// fit in int32, so k is limited to kMaxInt8K.
//
// Input gradient, dX [m, k] from dY [m, n]:
//   g[m, n]  = fp32(dY[m, n] * fp32(SCB[n] * kInv127))
//   dX[m, k] = (((0 + g[m, 0] * CB[0, k]) + g[m, 1] * CB[1, k]) + ...)  fp32,
//              one multiply and one add per term (no FMA) in both paths, so
//              the scalar and AVX2 results are identical.
// On the amx level two kernels of other contracts take the calls they serve
// first (x86/amx/gemm4.cc): bf16 dY under the bf16-compute contract, and
// fp32 dY as exact bf16 part products of g and CB summed in fp32 (within
// the fp32 bound of the exact sum; other bytes).
#include "q4/int8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "dispatch.h"
#include "parallel.h"
#include "q4/kernels.h"
#include "q4/quant4.h"
#include "rows.h"
#include "simd_avx2.h"

namespace q4 {
namespace cpu {
namespace {

using int8::kInv127;
using int8::kInv127Sq;
constexpr int64_t kMaxInt8K = int8::kMaxK;

// ------------------------------------------------------------ quantization

// One element of a row scaled by mult, and a row's multiplier (q4/int8.h).
using int8::row_multiplier;
inline int8_t quantize_elem(float x, float mult) { return int8::quantize(x, mult); }

// cut: the comparison value above, NaN when outliers are off (threshold 0),
// so that no element compares >= it.
inline bool is_outlier(float a, float cut) { return a >= cut; }

template <typename T>
float outlier_cut(float threshold) {
  if (!(threshold > 0.0f)) return __builtin_nanf("");
  T t;
  Elem<T>::store(&t, 0, threshold);
  return Elem<T>::load(&t, 0);
}

template <typename T>
float row_stat_scalar(const T* x, int64_t n, float cut) {
  float m = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(Elem<T>::load(x, i));
    if (is_outlier(a, cut)) continue;
    nan |= (a != a);
    m = a > m ? a : m;
  }
  return nan ? __builtin_nanf("") : m;
}

// Outlier columns of rows [0, rows) restricted to columns [c0, c1).
template <typename T>
void outlier_cols_scalar(const T* x, int64_t rows, int64_t cols, float cut, int64_t c0, int64_t c1, uint8_t* flags) {
  for (int64_t c = c0; c < c1; ++c) flags[c] = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    for (int64_t c = c0; c < c1; ++c) flags[c] |= uint8_t(is_outlier(std::fabs(Elem<T>::load(xr, c)), cut));
  }
}

// q[0, n) of one row; outlier columns (flags[c] != 0, flags may be null) are 0.
template <typename T>
void quantize_row_scalar(const T* x, int64_t n, float mult, const uint8_t* flags, int8_t* q) {
  for (int64_t i = 0; i < n; ++i)
    q[i] = (flags != nullptr && flags[i]) ? int8_t(0) : quantize_elem(Elem<T>::load(x, i), mult);
}

#if Q4_HAVE_AVX2_CODE
template <typename T>
Q4_AVX2 float row_stat_avx2(const T* x, int64_t n, float cut) {
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
Q4_AVX2 void outlier_cols_avx2(const T* x, int64_t rows, int64_t cols, float cut, int64_t g0, int64_t g1,
                               uint8_t* flags) {
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

Q4_AVX2 __m256i quantize8(__m256 x, __m256 mult) {
  __m256 s = _mm256_mul_ps(x, mult);
  s = _mm256_and_ps(s, _mm256_cmp_ps(s, s, _CMP_ORD_Q));  // NaN -> +0
  s = _mm256_min_ps(_mm256_max_ps(s, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
  return _mm256_cvtps_epi32(_mm256_round_ps(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// keep: [n] bytes, 0xff for a regular column, 0 for an outlier column; null
// when there is no outlier column.
template <typename T>
Q4_AVX2 void quantize_row_avx2(const T* x, int64_t n, float mult, const uint8_t* flags, const uint8_t* keep,
                               int8_t* q) {
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
#endif

// Quantizes x [rows, cols] into q (row stride q_stride >= cols; columns
// [cols, q_stride) are zero-filled), row_stats and the outlier column flags
// (flags [cols], always written). Returns whether any outlier column exists.
template <typename T>
bool quantize_rows_impl(const T* x, int64_t rows, int64_t cols, float threshold, bool simd, int8_t* q, int64_t q_stride,
                        float* row_stats, uint8_t* flags) {
  bool any = false;
  const float cut = outlier_cut<T>(threshold);
  if (cut == cut) {
    const int64_t groups = ceil_div(cols, 8);
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (8 * rows));
    parallel_for(groups, grain, [&](int64_t g0, int64_t g1) {
#if Q4_HAVE_AVX2_CODE
      if (simd) return outlier_cols_avx2(x, rows, cols, cut, g0, g1, flags);
#endif
      outlier_cols_scalar(x, rows, cols, cut, 8 * g0, std::min(8 * g1, cols), flags);
    });
    for (int64_t c = 0; c < cols && !any; ++c) any = flags[c] != 0;
  } else {
    std::memset(flags, 0, size_t(cols));
  }
  std::vector<uint8_t> keep;
  if (any) {
    keep.resize(size_t(cols));
    for (int64_t c = 0; c < cols; ++c) keep[size_t(c)] = flags[c] ? 0 : 0xff;
  }
  const uint8_t* zero_cols = any ? flags : nullptr;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / cols);
  parallel_for(rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * cols;
      int8_t* qr = q + r * q_stride;
#if Q4_HAVE_AVX2_CODE
      if (simd) {
        row_stats[r] = row_stat_avx2(xr, cols, cut);
        quantize_row_avx2(xr, cols, row_multiplier(row_stats[r]), zero_cols, any ? keep.data() : nullptr, qr);
      } else
#endif
      {
        row_stats[r] = row_stat_scalar(xr, cols, cut);
        quantize_row_scalar(xr, cols, row_multiplier(row_stats[r]), zero_cols, qr);
      }
      std::memset(qr + cols, 0, size_t(q_stride - cols));
    }
  });
  return any;
}

// ------------------------------------------------------------ linear

// Register tile: kLinMR rows of X by kLinNR rows of W, each accumulator a
// full dot product over k. X rows are processed in passes of at most
// kXPanelBytes of quantized X (the pass stays in L2 while W streams by);
// output columns in sub-blocks of kLinSubCols (the outlier part of a
// sub-block is computed first, into a buffer the epilogue reads).
constexpr int kLinMR = 4, kLinNR = 4;  // the AVX2 and scalar loops take the W rows in pairs
constexpr int64_t kXPanelBytes = 256 << 10;
constexpr int64_t kLinSubCols = 256;
constexpr int64_t kLinAhead = 4;  // W row blocks of prefetch distance (int8_dots)
// The int8_gemm chain (x rows as a block, cpu/dispatch.h; each entry from its
// own min_m rows on), in blocks of kInt8GemmRows rows (their int32 sums kept in
// a scratch buffer; each block of columns is finished by the thread that
// summed it).
constexpr int64_t kInt8GemmRows = 512;  // (each block packs W again: 256 rows took 8% of batch 512 in packing)
constexpr int kSlotQuantX = 0;          // caller's scratch slots (parallel.h): the quantized x,
constexpr int kSlotGemmSums = 1;        // and a row block's int32 sums
static_assert(kLinSubCols % kLinNR == 0, "sub-blocks hold whole register tiles");

struct LinearShared {
  const int8_t* xq;  // [m, kp], zero-padded to kp = ceil(k/32)*32
  int64_t kp;
  const int32_t* x_sums;   // [m] sum of each xq row (for the dot-product chain), or null
  const Int8DotsFn dots;   // the chain's kernel (cpu/dispatch.h), or null
  const float* row_stats;  // [m]
  const int64_t* cols;     // [nc] outlier columns, ascending
  int64_t nc;
  const float* x_outliers;  // [m, nc]: x[:, cols] widened to fp32
  const float* bias;        // [n] widened to fp32, or null
};

// o[j] = o[j] + x * w[j]: one rounded multiply and one rounded add per
// element in both paths.
void axpy_scalar(float* o, const float* w, float x, int64_t len) {
  for (int64_t j = 0; j < len; ++j) o[j] = o[j] + x * w[j];
}

#if Q4_HAVE_AVX2_CODE
Q4_AVX2 void axpy_avx2(float* o, const float* w, float x, int64_t len) {
  const __m256 xv = _mm256_set1_ps(x);
  int64_t j = 0;
  for (; j + 8 <= len; j += 8)
    _mm256_storeu_ps(o + j, _mm256_add_ps(_mm256_loadu_ps(o + j), _mm256_mul_ps(xv, _mm256_loadu_ps(w + j))));
  axpy_scalar(o + j, w + j, x, len - j);
}
#endif

// Outlier part of rows [m0, m1) x columns [ns, ne):
// o[(r - m0) * (ne - ns) + (j - ns)] = sum over outlier columns in ascending order.
void outlier_part(const Int8LinearParams& p, const LinearShared& s, bool simd, int64_t m0, int64_t m1, int64_t ns,
                  int64_t ne, std::vector<float>* wd_t, std::vector<float>* o) {
  const int64_t width = ne - ns;
  wd_t->resize(static_cast<size_t>(s.nc * width));  // wd_t[c * width + j] = wd[ns + j, cols[c]]
  for (int64_t j = 0; j < width; ++j) {
    const int8_t* wr = p.weight + (ns + j) * p.k;
    const float scale = p.weight_scale[ns + j];
    for (int64_t c = 0; c < s.nc; ++c) (*wd_t)[size_t(c * width + j)] = (float(wr[s.cols[c]]) * scale) * kInv127;
  }
  o->assign(static_cast<size_t>((m1 - m0) * width), 0.0f);
  for (int64_t c = 0; c < s.nc; ++c) {
    const float* wc = wd_t->data() + c * width;
    for (int64_t r = m0; r < m1; ++r) {
      float* orow = o->data() + (r - m0) * width;
      const float x = s.x_outliers[r * s.nc + c];
#if Q4_HAVE_AVX2_CODE
      if (simd) {
        axpy_avx2(orow, wc, x, width);
        continue;
      }
#endif
      axpy_scalar(orow, wc, x, width);
    }
  }
}

// Output of one tile: acc [mr][nr] (row stride as) for rows m0.. and columns
// n0..; o: the outlier part at (m0, n0) with row stride os, or null. The
// AVX2 loop does the same fp32 operations in the same order, 8 columns at a
// time (the scalar loop had taken ~9% of a batch-512 forward on one thread).
template <typename TO>
void linear_epilogue_scalar(const Int8LinearParams& p, const LinearShared& s, int64_t m0, int mr, int64_t n0, int nr,
                            int j0, const int32_t* acc, int64_t as, const float* o, int64_t os) {
  TO* out = static_cast<TO*>(p.out);
  for (int i = 0; i < mr; ++i) {
    const int64_t m = m0 + i;
    for (int j = j0; j < nr; ++j) {
      const int64_t n = n0 + j;
      const float scale = s.row_stats[m] * p.weight_scale[n];
      float y = float(acc[i * as + j]) * scale;
      y = y * kInv127Sq;
      if (o != nullptr) y = y + o[i * os + j];
      if (s.bias != nullptr) y = y + s.bias[n];
      Elem<TO>::store(out, m * p.n + n, y);
    }
  }
}

#if Q4_HAVE_AVX2_CODE
template <typename TO>
Q4_AVX2 void linear_epilogue_avx2(const Int8LinearParams& p, const LinearShared& s, int64_t m0, int mr, int64_t n0,
                                  int nr, const int32_t* acc, int64_t as, const float* o, int64_t os) {
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
#endif

template <typename TO>
void linear_epilogue(const Int8LinearParams& p, const LinearShared& s, bool simd, int64_t m0, int mr, int64_t n0,
                     int nr, const int32_t* acc, int64_t as, const float* o, int64_t os) {
#if Q4_HAVE_AVX2_CODE
  if (simd) return linear_epilogue_avx2<TO>(p, s, m0, mr, n0, nr, acc, as, o, os);
#endif
  linear_epilogue_scalar<TO>(p, s, m0, mr, n0, nr, 0, acc, as, o, os);
}

template <int MR, int NR>
void dot_tile_scalar(const int8_t* xq, int64_t xs, const int8_t* const* w, int64_t k, int32_t* acc) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const int8_t* xr = xq + i * xs;
      int32_t a = 0;
      for (int64_t kk = 0; kk < k; ++kk) a += int32_t(xr[kk]) * int32_t(w[j][kk]);
      acc[i * kLinNR + j] = a;
    }
}

#if Q4_HAVE_AVX2_CODE
// The register tiles fully unroll their loops over MR / NR / NV with
// `#pragma GCC unroll`, early enough that GCC keeps the accumulator arrays
// in registers; without it they are stored to the stack on every step.
Q4_AVX2 int32_t hsum_epi32(__m256i v) {
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
Q4_AVX2 void dot_step_avx2(const int8_t* x, int64_t xs, const int8_t* const* w, __m256i (&acc)[MR][NR]) {
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
Q4_AVX2 void dot_tile_avx2(const int8_t* xq, int64_t xs, const int8_t* const* w, int64_t k, const int8_t (*wtail)[32],
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
#endif

template <int NR>
void dot_tile(bool simd, int mr, const int8_t* xq, int64_t xs, const int8_t* const* w, int64_t k,
              const int8_t (*wtail)[32], int32_t* acc) {
#if Q4_HAVE_AVX2_CODE
  if (simd) {
#define Q4_DOT(R) dot_tile_avx2<R, NR>(xq, xs, w, k, wtail, acc)
    Q4_ROWS_SWITCH_4(mr, Q4_DOT)
#undef Q4_DOT
    return;
  }
#endif
  (void)wtail;
#define Q4_DOT(R) dot_tile_scalar<R, NR>(xq, xs, w, k, acc)
  Q4_ROWS_SWITCH_4(mr, Q4_DOT)
#undef Q4_DOT
}

// acc[i * kLinNR + j] for i < mr x rows at xq (stride xs) and j < nr W rows
// w[j]: the chain's kernel if there is one, else the AVX2 / scalar tiles on
// the W rows in pairs.
void dot_block(const LinearShared& s, bool simd, int mr, const int8_t* xq, const int32_t* x_sums,
               const int8_t* const* w, int nr, int64_t k, const int8_t (*wtail)[32], int32_t* acc, const int8_t* ahead,
               int ahead_rows) {
  if (s.dots != nullptr && s.dots(Int8Dots{xq, s.kp, x_sums, w, mr, nr, k, acc, kLinNR, ahead, ahead_rows})) return;
  for (int j = 0; j < nr; j += 2) {
    if (nr - j >= 2)
      dot_tile<2>(simd, mr, xq, s.kp, w + j, k, wtail + j, acc + j);
    else
      dot_tile<1>(simd, mr, xq, s.kp, w + j, k, wtail + j, acc + j);
  }
}

// Output columns of W row blocks [b0, b1) (block = kLinNR rows) for X rows [m0, m1).
template <typename TO>
void linear_range(const Int8LinearParams& p, const LinearShared& s, bool simd, int64_t m0, int64_t m1, int64_t b0,
                  int64_t b1) {
  const int64_t k = p.k;
  std::vector<float> wd_t, o;
  alignas(32) int8_t wtail[kLinNR][32];
  for (int64_t ns = b0 * kLinNR; ns < std::min(b1 * kLinNR, p.n); ns += kLinSubCols) {
    const int64_t ne = std::min({ns + kLinSubCols, b1 * kLinNR, p.n});
    if (s.nc > 0) outlier_part(p, s, simd, m0, m1, ns, ne, &wd_t, &o);
    for (int64_t n0 = ns; n0 < ne; n0 += kLinNR) {
      const int nr = int(std::min<int64_t>(kLinNR, ne - n0));
      const int8_t* w[kLinNR];
      for (int j = 0; j < kLinNR; ++j) w[j] = p.weight + (n0 + std::min(j, nr - 1)) * k;
      std::memset(wtail, 0, sizeof wtail);
      for (int j = 0; j < nr; ++j) std::memcpy(wtail[j], w[j] + k / 32 * 32, size_t(k % 32));
      // the W rows kLinAhead blocks on, prefetched by the first x block (W
      // streams once from L3 or DRAM; the hardware prefetchers pick up each
      // new row late)
      const int64_t na = n0 + kLinAhead * kLinNR;
      const int ahead_rows = int(std::clamp<int64_t>(std::min(b1 * kLinNR, p.n) - na, 0, kLinNR));
      const int8_t* ahead = ahead_rows > 0 ? p.weight + na * k : nullptr;
      for (int64_t m = m0; m < m1; m += kLinMR) {
        const int mr = int(std::min<int64_t>(kLinMR, m1 - m));
        int32_t acc[kLinMR * kLinNR];
        dot_block(s, simd, mr, s.xq + m * s.kp, s.x_sums != nullptr ? s.x_sums + m : nullptr, w, nr, k, wtail, acc,
                  ahead, m == m0 ? ahead_rows : 0);
        const float* ot = s.nc > 0 ? o.data() + (m - m0) * (ne - ns) + (n0 - ns) : nullptr;
        linear_epilogue<TO>(p, s, simd, m, mr, n0, nr, acc, kLinNR, ot, ne - ns);
      }
    }
  }
}

// The output of rows [m0, m1) x columns [c0, c1) from their integer sums acc
// [m1 - m0][n] (the int8_gemm path): the outlier part and the epilogue per
// sub-block of columns.
template <typename TO>
void linear_cols(const Int8LinearParams& p, const LinearShared& s, bool simd, int64_t m0, int64_t m1,
                 const int32_t* acc, int64_t c0, int64_t c1) {
  std::vector<float> wd_t, o;
  for (int64_t ns = c0; ns < c1; ns += kLinSubCols) {
    const int64_t ne = std::min(c1, ns + kLinSubCols);
    if (s.nc > 0) outlier_part(p, s, simd, m0, m1, ns, ne, &wd_t, &o);
    linear_epilogue<TO>(p, s, simd, m0, int(m1 - m0), ns, int(ne - ns), acc + ns, p.n, s.nc > 0 ? o.data() : nullptr,
                        ne - ns);
  }
}

// The sum of x[0..len) (|sum| <= 128 * kMaxInt8K: no overflow).
int32_t row_sum_scalar(const int8_t* x, int64_t len) {
  int32_t t = 0;
  for (int64_t c = 0; c < len; ++c) t += x[c];
  return t;
}

#if Q4_HAVE_AVX2_CODE
// 32 bytes at a time: x + 128 as unsigned bytes, summed by vpsadbw.
Q4_AVX2 int32_t row_sum_avx2(const int8_t* x, int64_t len) {
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
#endif

int32_t row_sum(const int8_t* x, int64_t len, bool simd) {
#if Q4_HAVE_AVX2_CODE
  if (simd) return row_sum_avx2(x, len);
#endif
  (void)simd;
  return row_sum_scalar(x, len);
}

// What int8_gemm's `done` needs to finish a block of columns.
struct LinearCols {
  const Int8LinearParams* p;
  const LinearShared* s;
  bool simd;
  int64_t m0, m1;
  const int32_t* acc;
};

template <typename TO>
void linear_cols_done(void* ctx, int64_t j0, int64_t cols) {
  const LinearCols& c = *static_cast<const LinearCols*>(ctx);
  linear_cols<TO>(*c.p, *c.s, c.simd, c.m0, c.m1, c.acc, j0, j0 + cols);
}

// ------------------------------------------------------------ grad input
//
// g is laid out in panels: the rows of a pass (at most kGradPanelFloats / n
// of them) are split into blocks of at most kGradMR rows; block b, rows
// r0 .. r0 + mr of the pass, sits at offset r0 * n as [n][mr], so a tile
// broadcasts consecutive floats. A thread owns a range of dX columns and an
// fp32 accumulator [rows of the pass][its columns]; it walks W in chunks of
// kGradNC rows so the W lines of a tile (kGradNC lines) stay in L1 across
// the row blocks, widening each chunk of a tile to fp32 once for all of
// them (with a single row block the AVX2 path widens in registers instead).
// Each accumulator element still sums over n in order.

constexpr int kGradMR = 6;                     // g rows per register tile
constexpr int64_t kGradKT = 16;                // dX columns per tile (two __m256)
constexpr int64_t kGradNC = 256;               // W rows per chunk
constexpr int64_t kGradPanelFloats = 1 << 17;  // a pass's g panel <= 512 KiB
constexpr int64_t kGradPassFloats = 1 << 21;   // the chain kernels' g pass <= 8 MiB
constexpr int kSlotGradPanel = 1;              // caller's scratch slot (parallel.h) of that pass

// W rows [0, nlen) x columns [0, width) (width <= kGradKT) widened to fp32:
// wf[nn * kGradKT + v] = float(w[nn * ws + v]).
void widen_w_scalar(const int8_t* w, int64_t ws, int64_t nlen, int64_t width, float* wf) {
  for (int64_t nn = 0; nn < nlen; ++nn)
    for (int64_t v = 0; v < width; ++v) wf[nn * kGradKT + v] = float(w[nn * ws + v]);
}

// acc[i * as + v] (i < MR, v < width) += sum over nn < nlen of
// panel[nn * MR + i] * wf[nn * kGradKT + v], in nn order.
template <int MR>
void grad_tile_scalar(const float* panel, const float* wf, int64_t nlen, int64_t width, float* acc, int64_t as) {
  for (int64_t nn = 0; nn < nlen; ++nn) {
    const float* wr = wf + nn * kGradKT;
    for (int i = 0; i < MR; ++i) {
      const float g = panel[nn * MR + i];
      float* a = acc + i * as;
      for (int64_t v = 0; v < width; ++v) a[v] = a[v] + g * wr[v];
    }
  }
}

#if Q4_HAVE_AVX2_CODE
Q4_AVX2 void widen_w_avx2(const int8_t* w, int64_t ws, int64_t nlen, int64_t width, float* wf) {
  if (width < 8) return widen_w_scalar(w, ws, nlen, width, wf);
  for (int64_t nn = 0; nn < nlen; ++nn)
    for (int64_t v = 0; v + 8 <= width; v += 8)
      _mm256_storeu_ps(
          wf + nn * kGradKT + v,
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + nn * ws + v)))));
}

template <int MR, int NV>
Q4_AVX2 void grad_tile_avx2(const float* panel, const float* wf, int64_t nlen, float* acc, int64_t as) {
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
Q4_AVX2 void grad_tile_direct_avx2(const float* panel, const int8_t* w, int64_t ws, int64_t nlen, float* acc,
                                   int64_t as) {
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
Q4_AVX2 void grad_direct_dispatch_mr(const float* panel, const int8_t* w, int64_t ws, int64_t nlen, int64_t width,
                                     float* acc, int64_t as) {
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
#endif

template <int MR>
void grad_tile(bool simd, const float* panel, const float* wf, int64_t nlen, int64_t width, float* acc, int64_t as) {
#if Q4_HAVE_AVX2_CODE
  if (simd && width == 16) return grad_tile_avx2<MR, 2>(panel, wf, nlen, acc, as);
  if (simd && width == 8) return grad_tile_avx2<MR, 1>(panel, wf, nlen, acc, as);
#endif
  (void)simd;
  grad_tile_scalar<MR>(panel, wf, nlen, width, acc, as);
}

void grad_tile_dispatch(int mr, bool simd, const float* panel, const float* wf, int64_t nlen, int64_t width, float* acc,
                        int64_t as) {
#define Q4_GRAD(R) grad_tile<R>(simd, panel, wf, nlen, width, acc, as)
  Q4_ROWS_SWITCH_6(mr, Q4_GRAD)
#undef Q4_GRAD
}

// Row blocks of one pass: sizes differ by at most one, none above kGradMR.
struct RowBlocks {
  int64_t count;
  int64_t rows;
  int64_t size(int64_t b) const { return rows / count + (b < rows % count ? 1 : 0); }
  int64_t start(int64_t b) const { return b * (rows / count) + std::min(b, rows % count); }
};

// dX rows [m0, m0 + blocks.rows) x the columns of tiles [t0, t1).
template <typename TO>
void grad_range(const Int8GradInputParams& p, const float* panel, int64_t m0, const RowBlocks& blocks, bool simd,
                int64_t t0, int64_t t1) {
  const int64_t c0 = t0 * kGradKT, c1 = std::min(t1 * kGradKT, p.k), as = c1 - c0;
  std::vector<float> acc(static_cast<size_t>(blocks.rows * as), 0.0f);  // [rows][c1 - c0]
  std::vector<float> wf(static_cast<size_t>(kGradNC * kGradKT));        // one W chunk of a tile, widened
  for (int64_t nb = 0; nb < p.n; nb += kGradNC) {
    const int64_t nlen = std::min(kGradNC, p.n - nb);
    for (int64_t c = c0; c < c1;) {
      const int64_t left = std::min(kGradKT, c1 - c);
      const int64_t width = left >= 16 ? 16 : (left >= 8 ? 8 : left);  // AVX2 pieces of 16 or 8, then scalar
      const int8_t* w = p.weight + nb * p.k + c;
#if Q4_HAVE_AVX2_CODE
      if (simd && blocks.count == 1 && width >= 8) {
        grad_tile_direct(int(blocks.rows), panel + nb * blocks.rows, w, p.k, nlen, width, acc.data() + (c - c0), as);
        c += width;
        continue;
      }
      if (simd)
        widen_w_avx2(w, p.k, nlen, width, wf.data());
      else
#endif
        widen_w_scalar(w, p.k, nlen, width, wf.data());
      for (int64_t b = 0; b < blocks.count; ++b) {
        const int64_t r0 = blocks.start(b);
        grad_tile_dispatch(int(blocks.size(b)), simd, panel + r0 * p.n + nb * blocks.size(b), wf.data(), nlen, width,
                           acc.data() + r0 * as + (c - c0), as);
      }
      c += width;
    }
  }
  TO* dx = static_cast<TO*>(p.grad_input);
  for (int64_t r = 0; r < blocks.rows; ++r)
    for (int64_t c = c0; c < c1; ++c) Elem<TO>::store(dx, (m0 + r) * p.k + c, acc[size_t(r * as + c - c0)]);
}

}  // namespace

Status int8_quantize_rows(const Int8QuantizeRowsParams& p) {
  Status s = validate(p);
  if (!s.ok()) return s;
  const ScopedIeeeFloat ieee;  // for the work done outside parallel_for
  const bool simd = cpu_isa() >= kIsaAvx2;
  std::vector<uint8_t> local;
  uint8_t* flags = p.outlier_cols;
  if (flags == nullptr) {
    local.resize(size_t(p.cols));
    flags = local.data();
  }
  Q4_DTYPE_SWITCH(p.x_dtype, T, [&] {
    quantize_rows_impl(static_cast<const T*>(p.x), p.rows, p.cols, p.threshold, simd, p.q, p.cols, p.row_stats, flags);
  });
  return Status::Ok();
}

Status int8_linear(const Int8LinearParams& p) {
  Status s = validate(p);
  if (!s.ok()) return s;
  const ScopedIeeeFloat ieee;  // for the work done outside parallel_for
  if (p.k > kMaxInt8K)
    return Status::Invalid("int8 linear: k = " + std::to_string(p.k) + " overflows the int32 accumulator (max " +
                           std::to_string(kMaxInt8K) + ")");
  const bool simd = cpu_isa() >= kIsaAvx2;
  const int64_t m = p.m, n = p.n, k = p.k, kp = ceil_div(k, 32) * 32;

  // quantized x, zero-padded to kp columns by quantize_rows_impl (a vector
  // would be fresh, zeroed pages on every call)
  int8_t* const xq = reinterpret_cast<int8_t*>(scratch(kSlotQuantX, (m * kp + 3) / 4));
  std::vector<float> row_stats(static_cast<size_t>(m));
  std::vector<uint8_t> flags(static_cast<size_t>(k));
  std::vector<int64_t> cols;
  std::vector<float> x_outliers, bias;
  Q4_DTYPE_SWITCH(p.x_dtype, T, [&] {
    const T* x = static_cast<const T*>(p.x);
    if (quantize_rows_impl(x, m, k, p.threshold, simd, xq, kp, row_stats.data(), flags.data())) {
      for (int64_t c = 0; c < k; ++c)
        if (flags[size_t(c)]) cols.push_back(c);
      const int64_t nc = int64_t(cols.size());
      x_outliers.resize(size_t(m * nc));
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < nc; ++c) x_outliers[size_t(r * nc + c)] = Elem<T>::load(x, r * k + cols[size_t(c)]);
    }
  });
  if (p.bias != nullptr) {
    bias.resize(size_t(n));
    Q4_DTYPE_SWITCH(p.bias_dtype, T, [&] {
      for (int64_t j = 0; j < n; ++j) bias[size_t(j)] = Elem<T>::load(static_cast<const T*>(p.bias), j);
    });
  }
  // the dot-product chains (cpu/dispatch.h) and the x row sums their kernels need
  const Chain<Int8DotsFn>& chain = kernel_table().int8_dots;
  const Int8DotsFn dots = chain.size > 0 ? chain.entries[0].fn : nullptr;
  const Chain<Int8GemmFn>& gemm_chain = kernel_table().int8_gemm;
  int gemm_entry = 0;  // the first int8_gemm entry that takes m rows
  while (gemm_entry < gemm_chain.size && m < gemm_chain.entries[gemm_entry].min_m) ++gemm_entry;
  const Int8GemmFn gemm = gemm_entry < gemm_chain.size ? gemm_chain.entries[gemm_entry].fn : nullptr;
  std::vector<int32_t> x_sums;
  if (dots != nullptr || gemm != nullptr) {
    x_sums.resize(size_t(m));
    parallel_for(m, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) x_sums[size_t(r)] = row_sum(xq + r * kp, k, simd);
    });
  }
  record_kernel(Op::kInt8Linear, gemm != nullptr   ? gemm_chain.entries[gemm_entry].name
                                 : dots != nullptr ? chain.entries[0].name
                                 : simd            ? "avx2.int8_dots"
                                                   : "scalar.int8_dots");
  const LinearShared shared{xq,
                            kp,
                            x_sums.empty() ? nullptr : x_sums.data(),
                            dots,
                            row_stats.data(),
                            cols.data(),
                            int64_t(cols.size()),
                            x_outliers.data(),
                            p.bias != nullptr ? bias.data() : nullptr};
  hint_fresh_output(p.out, m * n * (p.out_dtype == kF32 ? 4 : 2));
  const int64_t m_chunk = std::max<int64_t>(kLinMR, kXPanelBytes / kp / kLinMR * kLinMR);
  const int64_t n_blocks = ceil_div(n, kLinNR);
  if (gemm != nullptr) {
    // the int32 sums of a block of rows (written whole by the kernel; a
    // vector would be fresh, zeroed pages on every call)
    int32_t* acc = reinterpret_cast<int32_t*>(scratch(kSlotGemmSums, std::min(m, kInt8GemmRows) * n));
    for (int64_t m0 = 0; m0 < m; m0 += kInt8GemmRows) {
      const int64_t m1 = std::min(m, m0 + kInt8GemmRows);
      // each block of columns is finished by the thread that summed it, while
      // its sums are in that core's L2 (a pass over all of acc after the
      // kernel had taken 7% of a batch-512 forward)
      LinearCols ctx{&p, &shared, simd, m0, m1, acc};
      Int8Gemm g{xq + m0 * kp, kp, x_sums.data() + m0, p.weight, m1 - m0, n, k, acc, n};
      g.ctx = &ctx;
      Q4_DTYPE_SWITCH(p.out_dtype, TO, [&] { g.done = &linear_cols_done<TO>; });
      if (!gemm(g)) return Status::Invalid("int8_gemm refused a call it was chosen for");
    }
    return Status::Ok();
  }
  Q4_DTYPE_SWITCH(p.out_dtype, TO, [&] {
    for (int64_t m0 = 0; m0 < m; m0 += m_chunk) {
      const int64_t m1 = std::min(m, m0 + m_chunk);
      const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / ((m1 - m0) * kp * kLinNR));
      parallel_for(n_blocks, grain, [&](int64_t b0, int64_t b1) { linear_range<TO>(p, shared, simd, m0, m1, b0, b1); });
    }
  });
  return Status::Ok();
}

Status int8_grad_input(const Int8GradInputParams& p) {
  Status s = validate(p);
  if (!s.ok()) return s;
  const ScopedIeeeFloat ieee;  // for the work done outside parallel_for
  // the kernels of the other contracts (bf16 dY: bf16 compute; fp32 dY on
  // the tile unit: exact part products), where one serves the call
  const auto& direct = kernel_table().int8_grad_input;
  for (int i = 0; i < direct.size; ++i)
    if (direct.entries[i].fn(p)) {
      record_kernel(Op::kInt8Grad, direct.entries[i].name);
      return Status::Ok();
    }
  const bool simd = cpu_isa() >= kIsaAvx2;
  const int64_t m = p.m, n = p.n, k = p.k;
  std::vector<float> col_scale(static_cast<size_t>(n));  // fp32(SCB[n] * kInv127)
  for (int64_t j = 0; j < n; ++j) col_scale[size_t(j)] = p.weight_scale[j] * kInv127;
  hint_fresh_output(p.grad_input, m * k * (p.grad_input_dtype == kF32 ? 4 : 2));
  const Chain<Int8GradFn>& chain = kernel_table().int8_grad;
  if (chain.size > 0) {
    // the chain's kernels take g row-major, a pass of rows at a time
    const int64_t pass = std::max<int64_t>(1, std::min(m, kGradPassFloats / n));
    float* g = scratch(kSlotGradPanel, pass * n);  // (a vector would be fresh pages on every call)
    for (int64_t m0 = 0; m0 < m; m0 += pass) {
      const int64_t mc = std::min(pass, m - m0);
      Q4_DTYPE_SWITCH(p.grad_out_dtype, T, [&] {
        const T* dy = static_cast<const T*>(p.grad_out);
        parallel_for(mc, 1, [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) {
            const int64_t b = r / kInt8GradRows, i = r % kInt8GradRows;
            const int64_t rows = std::min<int64_t>(kInt8GradRows, mc - b * kInt8GradRows);
            float* gb = g + b * kInt8GradRows * n + i;
            for (int64_t j = 0; j < n; ++j) gb[j * rows] = Elem<T>::load(dy, (m0 + r) * n + j) * col_scale[size_t(j)];
          }
        });
      });
      const Int8Grad a{g, p.weight, mc, n, k, m0, p.grad_input, p.grad_input_dtype};
      int i = 0;
      while (i < chain.size && !chain.entries[i].fn(a)) ++i;
      if (i == chain.size) break;  // (no entry serves: the loops below do it all)
      record_kernel(Op::kInt8Grad, chain.entries[i].name);
      if (m0 + mc == m) return Status::Ok();
    }
  }
  record_kernel(Op::kInt8Grad, simd ? "avx2.int8_grad" : "scalar.int8_grad");
  const int64_t m_chunk = std::max<int64_t>(1, std::min(m, kGradPanelFloats / n));
  std::vector<float> panel(static_cast<size_t>(m_chunk * n));
  const int64_t tiles = ceil_div(k, kGradKT);
  for (int64_t m0 = 0; m0 < m; m0 += m_chunk) {
    const int64_t mc = std::min(m_chunk, m - m0);
    const RowBlocks blocks{ceil_div(mc, kGradMR), mc};
    Q4_DTYPE_SWITCH(p.grad_out_dtype, T, [&] {
      const T* dy = static_cast<const T*>(p.grad_out);
      parallel_for(blocks.count, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t r0 = blocks.start(b), mr = blocks.size(b);
          float* pb = panel.data() + r0 * n;
          for (int64_t i = 0; i < mr; ++i)
            for (int64_t j = 0; j < n; ++j)
              pb[j * mr + i] = Elem<T>::load(dy, (m0 + r0 + i) * n + j) * col_scale[size_t(j)];
        }
      });
    });
    Q4_DTYPE_SWITCH(p.grad_input_dtype, TO, [&] {
      const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / (mc * n * kGradKT));
      parallel_for(tiles, grain,
                   [&](int64_t t0, int64_t t1) { grad_range<TO>(p, panel.data(), m0, blocks, simd, t0, t1); });
    });
  }
  return Status::Ok();
}

}  // namespace cpu
}  // namespace q4
