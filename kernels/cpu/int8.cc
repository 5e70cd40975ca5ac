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
// fit in int32, so k is limited to int8::kMaxK (checked in validate.cc).
//
// Input gradient, dX [m, k] from dY [m, n]:
//   g[m, n]  = fp32(dY[m, n] * fp32(SCB[n] * kInv127))
//   dX[m, k] = (((0 + g[m, 0] * CB[0, k]) + g[m, 1] * CB[1, k]) + ...)  fp32,
//              one multiply and one add per term (no FMA) in both paths, so
//              the scalar and AVX2 results are identical.
// On the amx level two kernels of other contracts take the calls they serve
// first (x86/amx/grad4.cc, split.cc): bf16 dY under the bf16-compute contract, and
// fp32 dY as exact bf16 part products of g and CB summed in fp32 (within
// the fp32 bound of the exact sum; other bytes).
// The loops of every path are in int8_loops.h; the scalar ones are the
// int8 chains' last entries (below), the AVX2 ones x86/avx2/int8.cc's.
#include "q4/int8.h"

#include <string>
#include <vector>

#include "dispatch.h"
#include "int8_loops.h"
#include "parallel.h"
#include "q4/kernels.h"

namespace q4 {
namespace cpu {

namespace scalar {
bool int8_quantize_rows(const Int8QuantizeRowsParams& p) {
  int8_loops::quantize_rows_op<int8_loops::ScalarLoops>(p);
  return true;
}
bool int8_linear(const Int8LinearParams& p, Int8LinearRun* run) {
  int8_loops::linear_op<int8_loops::ScalarLoops>(p, run);
  return true;
}
bool int8_grad(const Int8GradInputParams& p, const float* col_scale) {
  int8_loops::grad_op<int8_loops::ScalarLoops>(p, col_scale);
  return true;
}
}  // namespace scalar

using int8::kInv127;
using int8_loops::kGradPassFloats;
using int8_loops::kSlotGradPanel;

Status int8_quantize_rows(const Int8QuantizeRowsParams& p) {
  Status s = validate(p);
  if (!s.ok()) return s;
  const ScopedIeeeFloat ieee;  // for the work done outside parallel_for
  const Chain<Int8QuantizeFn>& chain = kernel_table().int8_quantize;
  for (int i = 0; i < chain.size; ++i)
    if (chain.entries[i].fn(p)) return Status::Ok();
  return Status::Invalid("int8_quantize_rows: no kernel serves the call");
}

Status int8_linear(const Int8LinearParams& p) {
  Status s = validate(p);
  if (!s.ok()) return s;
  const ScopedIeeeFloat ieee;  // for the work done outside parallel_for
  const Chain<Int8LinearFn>& chain = kernel_table().int8_linear;
  for (int i = 0; i < chain.size; ++i) {
    Int8LinearRun run;
    if (chain.entries[i].fn(p, &run)) {
      record_kernel(Op::kInt8Linear, run.kernel != nullptr ? run.kernel : chain.entries[i].name);
      return run.status;
    }
  }
  return Status::Invalid("int8_linear: no kernel serves the call");
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
  // the loops (cpu/int8_loops.h) of the level, the scalar reference last
  const Chain<Int8GradLoopsFn>& loops = kernel_table().int8_grad_loops;
  for (int i = 0; i < loops.size; ++i)
    if (loops.entries[i].fn(p, col_scale.data())) {
      record_kernel(Op::kInt8Grad, loops.entries[i].name);
      return Status::Ok();
    }
  return Status::Invalid("int8_grad_input: no kernel serves the call");
}

}  // namespace cpu
}  // namespace q4
