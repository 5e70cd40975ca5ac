// Fused 4-bit matmuls on the CPU: Y = X . W^T (+ bias) and dX = dY . W, with
// W [n, k] packed 4-bit. The dequantized W is never materialised: a few rows
// (forward) or a narrow column strip (backward) are decoded into an L1-sized
// buffer and consumed at once.
//
// This file holds the entry points, which validate and then run the first
// kernel of the active level's chain that serves the call (dispatch.h), and
// the scalar reference kernels, which serve every call: each W element is
// decode(nibble) * scale(block), the fp32 value dequantize_4bit returns, and
// all products and sums are accumulated in fp32. The ISA kernels live in
// kernels/cpu/x86/<level>/gemm4*.cc.
#include <algorithm>
#include <vector>

#include "dispatch.h"
#include "gemm4_common.h"
#include "parallel.h"
#include "q4/kernels.h"
#include "q4/quant4.h"

namespace q4 {
namespace cpu {
namespace {

using namespace gemm4;  // NOLINT: the shared pieces of every gemm4 unit

// ------------------------------------------------------------------ scalar

template <QuantType QT>
void gemm_scalar(const Gemm4bitParams& p, const float* x, const Scales& scales) {
  const int shift = log2_exact(p.blocksize);
  parallel_for(p.n, 16, [&](int64_t n0, int64_t n1) {
    float* row = scratch(kSlotRow, p.k);
    for (int64_t r = n0; r < n1; ++r) {
      decode_scalar<QT>(p.packed, scales, shift, r * p.k, p.k, row);
      const float bias = load_bias(p.bias, p.bias_dtype, r);
      for (int64_t m = 0; m < p.m; ++m) {
        const float* xr = x + m * p.k;
        float acc = 0.0f;
        for (int64_t c = 0; c < p.k; ++c) acc += xr[c] * row[c];
        store_out(p.out, p.out_dtype, m * p.n + r, acc + bias);
      }
    }
  });
}

template <QuantType QT>
void grad_input_scalar(const Gemm4bitGradInputParams& p, const float* dy, const Scales& scales) {
  // Threads own column ranges of dX; each decodes its slice of every W row.
  const int shift = log2_exact(p.blocksize);
  parallel_for(p.k, 64, [&](int64_t c0, int64_t c1) {
    const int64_t w = c1 - c0;
    float* seg = scratch(kSlotRow, w);
    float* acc = scratch(kSlotAcc, p.m * w);
    std::fill(acc, acc + p.m * w, 0.0f);
    for (int64_t r = 0; r < p.n; ++r) {
      decode_scalar<QT>(p.packed, scales, shift, r * p.k + c0, w, seg);
      for (int64_t m = 0; m < p.m; ++m) {
        const float g = dy[m * p.n + r];
        float* a = acc + m * w;
        for (int64_t c = 0; c < w; ++c) a[c] += g * seg[c];
      }
    }
    for (int64_t m = 0; m < p.m; ++m)
      for (int64_t c = 0; c < w; ++c) store_out(p.grad_input, p.grad_input_dtype, m * p.k + c0 + c, acc[m * w + c]);
  });
}

}  // namespace

namespace scalar {
bool gemm4(const Gemm4bitParams& p, const Scales& scales) {
  const float* x = as_f32(p.x, p.x_dtype, p.m * p.k);
  Q4_QUANT_SWITCH(p.quant_type, QT, [&] { gemm_scalar<QT>(p, x, scales); });
  return true;
}
bool grad4(const Gemm4bitGradInputParams& p, const Scales& scales) {
  const float* dy = as_f32(p.grad_out, p.grad_out_dtype, p.m * p.n);
  Q4_QUANT_SWITCH(p.quant_type, QT, [&] { grad_input_scalar<QT>(p, dy, scales); });
  return true;
}
}  // namespace scalar

Status gemm_4bit(const Gemm4bitParams& p) {
  const Status s = with_code_book(validate(p), p.scales);
  if (!s.ok()) return s;
  ScopedIeeeFloat ieee;
  const Scales scales(p.scales);
  run_chain(kernel_table().gemm4, Op::kGemm4, p, scales);
  return Status::Ok();
}

Status gemm_4bit_grad_input(const Gemm4bitGradInputParams& p) {
  const Status s = with_code_book(validate(p), p.scales);
  if (!s.ok()) return s;
  ScopedIeeeFloat ieee;
  const Scales scales(p.scales);
  run_chain(kernel_table().grad4, Op::kGrad4, p, scales);
  return Status::Ok();
}

}  // namespace cpu
}  // namespace q4
