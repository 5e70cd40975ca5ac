// Dispatch over the two 4-bit code books with the quant type fixed at compile
// time (see Q4_QUANT_SWITCH).
#pragma once

#include "q4/fp4.h"
#include "q4/nf4.h"
#include "q4/packing.h"

namespace q4 {

template <QuantType QT>
struct Code4;
template <>
struct Code4<kNF4> {
  Q4_HD static int encode(float s) { return nf4::encode(s); }
  Q4_HD static float decode(int q) { return nf4::decode(q); }
  Q4_HD static float midpoint(int r) { return nf4::midpoint(r); }
  Q4_HD static int nibble_of_rank(int r) { return nf4::nibble_of_rank(r); }
};
template <>
struct Code4<kFP4> {
  Q4_HD static int encode(float s) { return fp4::encode(s); }
  Q4_HD static float decode(int q) { return fp4::decode(q); }
  Q4_HD static float midpoint(int r) { return fp4::midpoint(r); }
  Q4_HD static int nibble_of_rank(int r) { return fp4::nibble_of_rank(r); }
};

}  // namespace q4

// Q4_QUANT_SWITCH(qt, QT, ...): run the body with `constexpr QuantType QT`.
#define Q4_QUANT_SWITCH(qt, QT, ...)             \
  [&] {                                          \
    if ((qt) == ::q4::kNF4) {                    \
      constexpr ::q4::QuantType QT = ::q4::kNF4; \
      return __VA_ARGS__();                      \
    } else {                                     \
      constexpr ::q4::QuantType QT = ::q4::kFP4; \
      return __VA_ARGS__();                      \
    }                                            \
  }()

// Q4_DTYPE_SWITCH(dt, T, ...): run the body with T = float / f16_t / bf16_t.
#define Q4_DTYPE_SWITCH(dt, T, ...)  \
  [&] {                              \
    if ((dt) == ::q4::kF32) {        \
      using T = float;               \
      return __VA_ARGS__();          \
    } else if ((dt) == ::q4::kF16) { \
      using T = ::q4::f16_t;         \
      return __VA_ARGS__();          \
    } else {                         \
      using T = ::q4::bf16_t;        \
      return __VA_ARGS__();          \
    }                                \
  }()
