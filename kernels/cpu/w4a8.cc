// W4A8 on the CPU: the entry point of gemm_4bit_w4a8 (validate, then the first
// kernel of the active level's chain that serves the call) and the scalar
// reference kernel, which follows the contract of q4/w4a8.h step by step.
// The vector kernel is kernels/cpu/x86/avx512_bf16/w4a8.cc; both produce the
// same bits.
#include "q4/w4a8.h"

#include <limits>

#include "dispatch.h"
#include "gemm4_common.h"
#include "parallel.h"
#include "q4/kernels.h"
#include "q4/quant4.h"

namespace q4 {
namespace cpu {
namespace {

using namespace gemm4;  // NOLINT: the shared pieces of every gemm4 unit

// Activation blocks of rows [r0, r1) of x [m, k]: q [m, k], sx [m, k / ba].
template <typename T>
void quantize_rows(const T* x, int64_t r0, int64_t r1, int64_t k, int64_t ba, int8_t* q, float* sx) {
  const int64_t nb = k / ba;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t c0 = r * k + b * ba;
      float amax = 0.0f;
      bool nan = false;
      for (int64_t j = 0; j < ba; ++j) {
        const float v = Elem<T>::load(x, c0 + j);
        const float a = v < 0.0f ? -v : v;
        nan |= !(v == v);
        if (a > amax) amax = a;
      }
      const w4a8::ActScale s = w4a8::act_scale(nan ? std::numeric_limits<float>::quiet_NaN() : amax);
      sx[r * nb + b] = s.sx;
      for (int64_t j = 0; j < ba; ++j)
        q[c0 + j] = s.inv == 0.0f ? int8_t(0) : w4a8::act_quantize(Elem<T>::load(x, c0 + j), s.inv);
    }
  }
}

template <QuantType QT>
void w4a8_scalar(const Gemm4bitParams& p, const int8_t* q, const float* sx, const Scales& scales) {
  const int64_t ba = w4a8::act_block(p.blocksize), nb = p.k / ba;
  const int shift = log2_exact(p.blocksize);
  int8_t table[16];
  for (int i = 0; i < 16; ++i) table[i] = w4a8::table8<QT>(i);
  parallel_for(p.n, 16, [&](int64_t n0, int64_t n1) {
    float* sw = scratch(kSlotRow, nb + p.k / 4 + 1);
    int8_t* w8 = reinterpret_cast<int8_t*>(sw + nb);
    for (int64_t r = n0; r < n1; ++r) {
      for (int64_t c = 0; c < p.k; ++c) {
        const int64_t f = r * p.k + c;
        const uint8_t byte = p.packed[f >> 1];
        w8[c] = table[(f & 1) ? unpack_odd(byte) : unpack_even(byte)];
      }
      for (int64_t b = 0; b < nb; ++b) sw[b] = scales((r * p.k + b * ba) >> shift) * w4a8::inv_table_scale<QT>();
      const float bias = load_bias(p.bias, p.bias_dtype, r);
      for (int64_t m = 0; m < p.m; ++m) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
          int32_t isum = 0;
          const int8_t* qb = q + m * p.k + b * ba;
          for (int64_t j = 0; j < ba; ++j) isum += int32_t(qb[j]) * int32_t(w8[b * ba + j]);
          acc = acc + float(isum) * (sx[m * nb + b] * sw[b]);
        }
        store_out(p.out, p.out_dtype, m * p.n + r, acc + bias);
      }
    }
  });
}

}  // namespace

namespace scalar {
bool w4a8(const Gemm4bitParams& p, const Scales& scales) {
  const int64_t ba = w4a8::act_block(p.blocksize), nb = p.k / ba;
  float* sx = scratch(kSlotInput, p.m * nb);
  int8_t* q = reinterpret_cast<int8_t*>(scratch(kSlotPanels, p.m * p.k / 4 + 1));
  Q4_DTYPE_SWITCH(p.x_dtype, T, [&] {
    parallel_for(p.m, 4,
                 [&](int64_t r0, int64_t r1) { quantize_rows(static_cast<const T*>(p.x), r0, r1, p.k, ba, q, sx); });
  });
  Q4_QUANT_SWITCH(p.quant_type, QT, [&] { w4a8_scalar<QT>(p, q, sx, scales); });
  return true;
}
}  // namespace scalar

Status gemm_4bit_w4a8(const Gemm4bitParams& p) {
  const Status s = with_code_book(validate_w4a8(p), p.scales);
  if (!s.ok()) return s;
  ScopedIeeeFloat ieee;
  const Scales scales(p.scales);
  run_chain(kernel_table().w4a8, Op::kW4A8, p, scales);
  return Status::Ok();
}

}  // namespace cpu
}  // namespace q4
