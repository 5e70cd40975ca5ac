// Pieces of the fused 4-bit matmuls shared by the reference (scalar) kernels
// and every ISA translation unit (kernels/cpu/x86/*/gemm4.cc). Everything here
// is compiled for the baseline target: an ISA unit includes this header
// before its `#pragma GCC target`, so no inline function defined here can be
// emitted with wider instructions and picked by the linker for the scalar
// path.
//
// Element (r, c) of W [n, k] is flat index f = r*k + c of the packed tensor:
// nibble f (high nibble of byte f/2 when f is even), block f >> shift
// (shift = log2(blocksize)). Its value is decode(nibble) * scale(block),
// exactly the fp32 value dequantize_4bit returns.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "q4/dynamic8.h"
#include "q4/kernels.h"
#include "q4/quant4.h"

namespace q4 {
namespace cpu {
namespace gemm4 {

// Block scales, plain or nested (decoded on access exactly as dequantize does:
// fp32(code[q] * absmax2) + offset).
class Scales {
 public:
  explicit Scales(const Absmax4& a) : a_(a) {
    if (a.nested()) {
      for (int i = 0; i < 256; ++i) code_[i] = a.nested_code ? a.nested_code[i] : dynamic8::kValues.v[i];
      offset_ = a.nested_offset_ptr ? *a.nested_offset_ptr : a.nested_offset;
    }
  }
  float operator()(int64_t block) const {
    if (!a_.nested()) return a_.absmax[block];
    const float scaled = code_[a_.nested_codes[block]] * a_.nested_absmax[block / kNestedBlocksize];
    return scaled + offset_;
  }
  // scales of blocks [b0, b1) into out
  void decode(int64_t b0, int64_t b1, float* out) const {
    for (int64_t b = b0; b < b1; ++b) out[b - b0] = (*this)(b);
  }

 private:
  const Absmax4& a_;
  float code_[256] = {};
  float offset_ = 0.0f;
};

// s, then (if s is ok) the check of a caller-supplied nested code book.
inline Status with_code_book(Status s, const Absmax4& a) {
  if (s.ok() && a.nested() && a.nested_code) s = validate_code_book(a.nested_code);
  return s;
}

// Scratch slots (parallel.h scratch()) of the calling thread / of each worker.
constexpr int kSlotInput = 0;   // caller: fp32 copy of a 16-bit input
constexpr int kSlotPanels = 1;  // caller: X packed into panels
constexpr int kSlotAcc = 2;     // worker: accumulators
constexpr int kSlotRow = 3;     // worker: decoded rows / scales

inline int log2_exact(int64_t v) {
  int s = 0;
  while ((int64_t(1) << s) < v) ++s;
  return s;
}

template <typename T>
void to_f32(const T* src, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; ++i) dst[i] = Elem<T>::load(src, i);
}

// The input matrix as fp32: the data itself, or a converted copy in scratch.
inline const float* as_f32(const void* src, DType dtype, int64_t count) {
  if (dtype == kF32) return static_cast<const float*>(src);
  float* dst = scratch(kSlotInput, count);
  Q4_DTYPE_SWITCH(dtype, T, [&] {
    parallel_for(count, 1 << 16, [&](int64_t b, int64_t e) { to_f32(static_cast<const T*>(src) + b, e - b, dst + b); });
  });
  return dst;
}

inline void store_out(void* out, DType dtype, int64_t i, float v) {
  Q4_DTYPE_SWITCH(dtype, T, [&] { Elem<T>::store(static_cast<T*>(out), i, v); });
}

inline float load_bias(const void* bias, DType dtype, int64_t i) {
  if (bias == nullptr) return 0.0f;
  float v = 0.0f;
  Q4_DTYPE_SWITCH(dtype, T, [&] { v = Elem<T>::load(static_cast<const T*>(bias), i); });
  return v;
}

// Scalar decode of W elements [f, f + len) into out (fp32, scaled).
template <QuantType QT>
void decode_scalar(const uint8_t* packed, const Scales& scales, int shift, int64_t f, int64_t len, float* out) {
  for (int64_t i = 0; i < len; ++i, ++f) {
    const uint8_t byte = packed[f >> 1];
    const int nib = (f & 1) ? unpack_odd(byte) : unpack_even(byte);
    out[i] = Code4<QT>::decode(nib) * scales(f >> shift);
  }
}

}  // namespace gemm4
}  // namespace cpu
}  // namespace q4
