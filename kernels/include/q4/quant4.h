// Dispatch over the 4-bit formats (q4/formats.h) with the quant type fixed
// at compile time (Q4_QUANT_SWITCH), and over the float dtypes
// (Q4_DTYPE_SWITCH). Host code only.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <type_traits>

#include "q4/formats.h"
#include "q4/packing.h"

namespace q4 {

// A QuantType no format has reached a kernel: every entry point validates
// quant_type first, so this is a programming error.
[[noreturn]] inline void unknown_quant_type(int64_t qt) {
  std::fprintf(stderr, "q4: unknown quant_type %lld reached a kernel (not validated)\n", static_cast<long long>(qt));
  std::abort();
}

// f(std::integral_constant<QuantType, qt>{}) for the format qt.
template <typename F>
auto quant_switch(int64_t qt, F&& f) {
  switch (qt) {
#define Q4_FORMAT_CASE(name, NAME, id, w4a8_scale) \
  case k##NAME:                                    \
    return f(std::integral_constant<QuantType, k##NAME>{});
    Q4_FORMATS(Q4_FORMAT_CASE)
#undef Q4_FORMAT_CASE
  }
  unknown_quant_type(qt);
}

}  // namespace q4

// Q4_QUANT_SWITCH(qt, QT, ...): run the body with `constexpr QuantType QT`.
#define Q4_QUANT_SWITCH(qt, QT, ...)                               \
  ::q4::quant_switch((qt), [&]([[maybe_unused]] auto q4_format_) { \
    constexpr ::q4::QuantType QT = decltype(q4_format_)::value;    \
    return __VA_ARGS__();                                          \
  })

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
