// The LLM.int8 drivers (contracts in cpu/int8.cc), shared by the scalar
// reference (cpu/int8.cc) and the AVX2 unit (x86/avx2/int8.cc). Every loop a
// driver runs is a static member of a Loops class L: ScalarLoops below,
// Avx2Loops in the AVX2 unit (whose loops end in ScalarLoops' for the tails).
// This header is included before a unit's Q4_UNIT_BEGIN, so the drivers are
// compiled for the baseline target in both units. The op drivers at the end
// (quantize_rows_op, linear_op, grad_op) are the bodies of the int8 chains'
// entries (cpu/dispatch.h): which loops run is decided by the kernel table
// alone.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "dispatch.h"
#include "parallel.h"
#include "q4/int8.h"
#include "q4/kernels.h"
#include "rows.h"

namespace q4 {
namespace cpu {
namespace int8_loops {
// Internal linkage in each including unit, as when these lived in one .cc:
// GCC then specialises and inlines the scalar loops as it did (a named
// namespace cost the scalar int8 gradient ~25%).
namespace {

using int8::kInv127;
using int8::kInv127Sq;

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

// Quantizes x [rows, cols] into q (row stride q_stride >= cols; columns
// [cols, q_stride) are zero-filled), row_stats and the outlier column flags
// (flags [cols], always written). Returns whether any outlier column exists.
template <class L, typename T>
bool quantize_rows_impl(const T* x, int64_t rows, int64_t cols, float threshold, int8_t* q, int64_t q_stride,
                        float* row_stats, uint8_t* flags) {
  bool any = false;
  const float cut = outlier_cut<T>(threshold);
  if (cut == cut) {
    const int64_t groups = ceil_div(cols, 8);
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (8 * rows));
    parallel_for(groups, grain, [&](int64_t g0, int64_t g1) { L::outlier_cols(x, rows, cols, cut, g0, g1, flags); });
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
      row_stats[r] = L::row_stat(xr, cols, cut);
      L::quantize_row(xr, cols, row_multiplier(row_stats[r]), zero_cols, any ? keep.data() : nullptr, qr);
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
inline void axpy_scalar(float* o, const float* w, float x, int64_t len) {
  for (int64_t j = 0; j < len; ++j) o[j] = o[j] + x * w[j];
}

// Outlier part of rows [m0, m1) x columns [ns, ne):
// o[(r - m0) * (ne - ns) + (j - ns)] = sum over outlier columns in ascending order.
template <class L>
void outlier_part(const Int8LinearParams& p, const LinearShared& s, int64_t m0, int64_t m1, int64_t ns, int64_t ne,
                  std::vector<float>* wd_t, std::vector<float>* o) {
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
      L::axpy(orow, wc, x, width);
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

template <class L, int NR>
void dot_tile(int mr, const int8_t* xq, int64_t xs, const int8_t* const* w, int64_t k, const int8_t (*wtail)[32],
              int32_t* acc) {
#define Q4_DOT(R) L::template dot_tile<R, NR>(xq, xs, w, k, wtail, acc)
  Q4_ROWS_SWITCH_4(mr, Q4_DOT)
#undef Q4_DOT
}

// acc[i * kLinNR + j] for i < mr x rows at xq (stride xs) and j < nr W rows
// w[j]: the chain's kernel if there is one, else the AVX2 / scalar tiles on
// the W rows in pairs.
template <class L>
void dot_block(const LinearShared& s, int mr, const int8_t* xq, const int32_t* x_sums, const int8_t* const* w, int nr,
               int64_t k, const int8_t (*wtail)[32], int32_t* acc, const int8_t* ahead, int ahead_rows) {
  if (s.dots != nullptr && s.dots(Int8Dots{xq, s.kp, x_sums, w, mr, nr, k, acc, kLinNR, ahead, ahead_rows})) return;
  for (int j = 0; j < nr; j += 2) {
    if (nr - j >= 2)
      dot_tile<L, 2>(mr, xq, s.kp, w + j, k, wtail + j, acc + j);
    else
      dot_tile<L, 1>(mr, xq, s.kp, w + j, k, wtail + j, acc + j);
  }
}

// Output columns of W row blocks [b0, b1) (block = kLinNR rows) for X rows [m0, m1).
template <class L, typename TO>
void linear_range(const Int8LinearParams& p, const LinearShared& s, int64_t m0, int64_t m1, int64_t b0, int64_t b1) {
  const int64_t k = p.k;
  std::vector<float> wd_t, o;
  alignas(32) int8_t wtail[kLinNR][32];
  for (int64_t ns = b0 * kLinNR; ns < std::min(b1 * kLinNR, p.n); ns += kLinSubCols) {
    const int64_t ne = std::min({ns + kLinSubCols, b1 * kLinNR, p.n});
    if (s.nc > 0) outlier_part<L>(p, s, m0, m1, ns, ne, &wd_t, &o);
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
        dot_block<L>(s, mr, s.xq + m * s.kp, s.x_sums != nullptr ? s.x_sums + m : nullptr, w, nr, k, wtail, acc, ahead,
                     m == m0 ? ahead_rows : 0);
        const float* ot = s.nc > 0 ? o.data() + (m - m0) * (ne - ns) + (n0 - ns) : nullptr;
        L::template epilogue<TO>(p, s, m, mr, n0, nr, acc, kLinNR, ot, ne - ns);
      }
    }
  }
}

// The output of rows [m0, m1) x columns [c0, c1) from their integer sums acc
// [m1 - m0][n] (the int8_gemm path): the outlier part and the epilogue per
// sub-block of columns.
template <class L, typename TO>
void linear_cols(const Int8LinearParams& p, const LinearShared& s, int64_t m0, int64_t m1, const int32_t* acc,
                 int64_t c0, int64_t c1) {
  std::vector<float> wd_t, o;
  for (int64_t ns = c0; ns < c1; ns += kLinSubCols) {
    const int64_t ne = std::min(c1, ns + kLinSubCols);
    if (s.nc > 0) outlier_part<L>(p, s, m0, m1, ns, ne, &wd_t, &o);
    L::template epilogue<TO>(p, s, m0, int(m1 - m0), ns, int(ne - ns), acc + ns, p.n, s.nc > 0 ? o.data() : nullptr,
                             ne - ns);
  }
}

// The sum of x[0..len) (|sum| <= 128 * int8::kMaxK: no overflow).
inline int32_t row_sum_scalar(const int8_t* x, int64_t len) {
  int32_t t = 0;
  for (int64_t c = 0; c < len; ++c) t += x[c];
  return t;
}

// What int8_gemm's `done` needs to finish a block of columns.
struct LinearCols {
  const Int8LinearParams* p;
  const LinearShared* s;
  int64_t m0, m1;
  const int32_t* acc;
};

template <class L, typename TO>
void linear_cols_done(void* ctx, int64_t j0, int64_t cols) {
  const LinearCols& c = *static_cast<const LinearCols*>(ctx);
  linear_cols<L, TO>(*c.p, *c.s, c.m0, c.m1, c.acc, j0, j0 + cols);
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
inline void widen_w_scalar(const int8_t* w, int64_t ws, int64_t nlen, int64_t width, float* wf) {
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

template <class L>
void grad_tile_dispatch(int mr, const float* panel, const float* wf, int64_t nlen, int64_t width, float* acc,
                        int64_t as) {
#define Q4_GRAD(R) L::template grad_tile<R>(panel, wf, nlen, width, acc, as)
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
template <class L, typename TO>
void grad_range(const Int8GradInputParams& p, const float* panel, int64_t m0, const RowBlocks& blocks, int64_t t0,
                int64_t t1) {
  const int64_t c0 = t0 * kGradKT, c1 = std::min(t1 * kGradKT, p.k), as = c1 - c0;
  std::vector<float> acc(static_cast<size_t>(blocks.rows * as), 0.0f);  // [rows][c1 - c0]
  std::vector<float> wf(static_cast<size_t>(kGradNC * kGradKT));        // one W chunk of a tile, widened
  for (int64_t nb = 0; nb < p.n; nb += kGradNC) {
    const int64_t nlen = std::min(kGradNC, p.n - nb);
    for (int64_t c = c0; c < c1;) {
      const int64_t left = std::min(kGradKT, c1 - c);
      const int64_t width = left >= 16 ? 16 : (left >= 8 ? 8 : left);  // AVX2 pieces of 16 or 8, then scalar
      const int8_t* w = p.weight + nb * p.k + c;
      if (blocks.count == 1 && width >= 8 &&
          L::grad_tile_direct(int(blocks.rows), panel + nb * blocks.rows, w, p.k, nlen, width, acc.data() + (c - c0),
                              as)) {
        c += width;
        continue;
      }
      L::widen_w(w, p.k, nlen, width, wf.data());
      for (int64_t b = 0; b < blocks.count; ++b) {
        const int64_t r0 = blocks.start(b);
        grad_tile_dispatch<L>(int(blocks.size(b)), panel + r0 * p.n + nb * blocks.size(b), wf.data(), nlen, width,
                              acc.data() + r0 * as + (c - c0), as);
      }
      c += width;
    }
  }
  TO* dx = static_cast<TO*>(p.grad_input);
  for (int64_t r = 0; r < blocks.rows; ++r)
    for (int64_t c = c0; c < c1; ++c) Elem<TO>::store(dx, (m0 + r) * p.k + c, acc[size_t(r * as + c - c0)]);
}

// The reference loops: every contract exactly, one element at a time.
struct ScalarLoops {
  template <typename T>
  static float row_stat(const T* x, int64_t n, float cut) {
    return row_stat_scalar(x, n, cut);
  }
  // Outlier flags of columns [8*g0, min(8*g1, cols)).
  template <typename T>
  static void outlier_cols(const T* x, int64_t rows, int64_t cols, float cut, int64_t g0, int64_t g1, uint8_t* flags) {
    outlier_cols_scalar(x, rows, cols, cut, 8 * g0, std::min(8 * g1, cols), flags);
  }
  // keep: [n] bytes, 0xff for a regular column, 0 for an outlier column
  // (null when there is none), the same columns as flags.
  template <typename T>
  static void quantize_row(const T* x, int64_t n, float mult, const uint8_t* flags, const uint8_t*, int8_t* q) {
    quantize_row_scalar(x, n, mult, flags, q);
  }
  static void axpy(float* o, const float* w, float x, int64_t len) { axpy_scalar(o, w, x, len); }
  template <typename TO>
  static void epilogue(const Int8LinearParams& p, const LinearShared& s, int64_t m0, int mr, int64_t n0, int nr,
                       const int32_t* acc, int64_t as, const float* o, int64_t os) {
    linear_epilogue_scalar<TO>(p, s, m0, mr, n0, nr, 0, acc, as, o, os);
  }
  template <int MR, int NR>
  static void dot_tile(const int8_t* xq, int64_t xs, const int8_t* const* w, int64_t k, const int8_t (*)[32],
                       int32_t* acc) {
    dot_tile_scalar<MR, NR>(xq, xs, w, k, acc);
  }
  static int32_t row_sum(const int8_t* x, int64_t len) { return row_sum_scalar(x, len); }
  static void widen_w(const int8_t* w, int64_t ws, int64_t nlen, int64_t width, float* wf) {
    widen_w_scalar(w, ws, nlen, width, wf);
  }
  template <int MR>
  static void grad_tile(const float* panel, const float* wf, int64_t nlen, int64_t width, float* acc, int64_t as) {
    grad_tile_scalar<MR>(panel, wf, nlen, width, acc, as);
  }
  // A tile that widens W in registers (for a single row block, width 16 or
  // 8); false: not served (the widened path runs).
  static bool grad_tile_direct(int, const float*, const int8_t*, int64_t, int64_t, int64_t, float*, int64_t) {
    return false;
  }
};

// ------------------------------------------------------------ the op drivers

// int8_quantize_rows with L's loops (the call validated).
template <class L>
void quantize_rows_op(const Int8QuantizeRowsParams& p) {
  std::vector<uint8_t> local;
  uint8_t* flags = p.outlier_cols;
  if (flags == nullptr) {
    local.resize(size_t(p.cols));
    flags = local.data();
  }
  Q4_DTYPE_SWITCH(p.x_dtype, T, [&] {
    quantize_rows_impl<L>(static_cast<const T*>(p.x), p.rows, p.cols, p.threshold, p.q, p.cols, p.row_stats, flags);
  });
}

// int8_linear with L's loops (the call validated). Sets run->kernel to the
// int8_gemm or int8_dots chain entry it took, or leaves it null when L's own
// dot-product tiles run.
template <class L>
void linear_op(const Int8LinearParams& p, Int8LinearRun* run) {
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
    if (quantize_rows_impl<L>(x, m, k, p.threshold, xq, kp, row_stats.data(), flags.data())) {
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
      for (int64_t r = r0; r < r1; ++r) x_sums[size_t(r)] = L::row_sum(xq + r * kp, k);
    });
  }
  run->kernel = gemm != nullptr   ? gemm_chain.entries[gemm_entry].name
                : dots != nullptr ? chain.entries[0].name
                                  : nullptr;
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
      LinearCols ctx{&p, &shared, m0, m1, acc};
      Int8Gemm g{xq + m0 * kp, kp, x_sums.data() + m0, p.weight, m1 - m0, n, k, acc, n};
      g.ctx = &ctx;
      Q4_DTYPE_SWITCH(p.out_dtype, TO, [&] { g.done = &linear_cols_done<L, TO>; });
      if (!gemm(g)) {
        run->status = Status::Invalid("int8_gemm refused a call it was chosen for");
        return;
      }
    }
    return;
  }
  Q4_DTYPE_SWITCH(p.out_dtype, TO, [&] {
    for (int64_t m0 = 0; m0 < m; m0 += m_chunk) {
      const int64_t m1 = std::min(m, m0 + m_chunk);
      const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / ((m1 - m0) * kp * kLinNR));
      parallel_for(n_blocks, grain, [&](int64_t b0, int64_t b1) { linear_range<L, TO>(p, shared, m0, m1, b0, b1); });
    }
  });
}

// int8_grad_input with L's loops (the call validated); col_scale[j] =
// fp32(SCB[j] * kInv127).
template <class L>
void grad_op(const Int8GradInputParams& p, const float* col_scale) {
  const int64_t m = p.m, n = p.n, k = p.k;
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
            for (int64_t j = 0; j < n; ++j) pb[j * mr + i] = Elem<T>::load(dy, (m0 + r0 + i) * n + j) * col_scale[j];
        }
      });
    });
    Q4_DTYPE_SWITCH(p.grad_input_dtype, TO, [&] {
      const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / (mc * n * kGradKT));
      parallel_for(tiles, grain,
                   [&](int64_t t0, int64_t t1) { grad_range<L, TO>(p, panel.data(), m0, blocks, t0, t1); });
    });
  }
}

}  // namespace
}  // namespace int8_loops
}  // namespace cpu
}  // namespace q4
