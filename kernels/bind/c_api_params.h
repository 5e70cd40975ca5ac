// The params structs of q4/kernels.h built from the C ABI argument lists,
// shared by the CPU (c_api.cc) and CUDA (c_api_cuda.cu) entry points. There
// is one builder for every op: Q4_CAPI_PARAMS(name, (arguments)) sets each
// field of q4::cpu::name's params struct from the argument of the same name
// (c_api_ops.inc), converted to the field's type (dtype and quant_type codes
// to their enums, add_offset to bool); the 4-bit matmuls' block-scale
// arguments fill p.scales (Absmax4), whose plain absmax is dropped when the
// scales are nested. An argument without a field of its name does not
// compile.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "q4/kernels.h"

namespace q4 {
namespace capi {

// The calling thread's last error message, shared by the CPU and CUDA entry
// points (q4_last_error and q4_cuda_last_error read the same slot).
inline std::string& last_error() {
  thread_local std::string message;
  return message;
}

// Records the status message for this thread and returns the status code.
inline int32_t finish(const Status& s) {
  last_error() = s.message;
  return s.code;
}

// The params struct P of an op's entry point Status (*)(const P&).
template <typename Fn>
struct ParamsOfFn;
template <typename P>
struct ParamsOfFn<Status (*)(const P&)> {
  using type = P;
};
template <typename Fn>
using ParamsOf = typename ParamsOfFn<Fn>::type;

// field = the argument, as the field's type.
template <typename F, typename A>
void set(F& field, A arg) {
  field = static_cast<F>(arg);
}

// Nested block scales replace the plain ones (a caller may pass both).
template <typename P>
void finish_params(P& p) {
  auto has_scales = [](auto& r) -> decltype((void)r.scales, true) { return true; };
  if constexpr (std::is_invocable_v<decltype(has_scales), P&>) {
    if (p.scales.nested()) p.scales.absmax = nullptr;
  }
}

}  // namespace capi
}  // namespace q4

// Q4_CAPI_FOR_EACH(F, a, b, ...): F(a) F(b) ... for up to 24 arguments.
#define Q4_CAPI_EXPAND(x) x
#define Q4_CAPI_FE1(F, a) F(a)
#define Q4_CAPI_FE2(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE1(F, __VA_ARGS__))
#define Q4_CAPI_FE3(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE2(F, __VA_ARGS__))
#define Q4_CAPI_FE4(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE3(F, __VA_ARGS__))
#define Q4_CAPI_FE5(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE4(F, __VA_ARGS__))
#define Q4_CAPI_FE6(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE5(F, __VA_ARGS__))
#define Q4_CAPI_FE7(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE6(F, __VA_ARGS__))
#define Q4_CAPI_FE8(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE7(F, __VA_ARGS__))
#define Q4_CAPI_FE9(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE8(F, __VA_ARGS__))
#define Q4_CAPI_FE10(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE9(F, __VA_ARGS__))
#define Q4_CAPI_FE11(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE10(F, __VA_ARGS__))
#define Q4_CAPI_FE12(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE11(F, __VA_ARGS__))
#define Q4_CAPI_FE13(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE12(F, __VA_ARGS__))
#define Q4_CAPI_FE14(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE13(F, __VA_ARGS__))
#define Q4_CAPI_FE15(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE14(F, __VA_ARGS__))
#define Q4_CAPI_FE16(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE15(F, __VA_ARGS__))
#define Q4_CAPI_FE17(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE16(F, __VA_ARGS__))
#define Q4_CAPI_FE18(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE17(F, __VA_ARGS__))
#define Q4_CAPI_FE19(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE18(F, __VA_ARGS__))
#define Q4_CAPI_FE20(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE19(F, __VA_ARGS__))
#define Q4_CAPI_FE21(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE20(F, __VA_ARGS__))
#define Q4_CAPI_FE22(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE21(F, __VA_ARGS__))
#define Q4_CAPI_FE23(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE22(F, __VA_ARGS__))
#define Q4_CAPI_FE24(F, a, ...) F(a) Q4_CAPI_EXPAND(Q4_CAPI_FE23(F, __VA_ARGS__))
#define Q4_CAPI_PICK(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13, _14, _15, _16, _17, _18, _19, _20, _21, \
                     _22, _23, _24, N, ...)                                                                          \
  N
#define Q4_CAPI_FOR_EACH(F, ...)                                                                                  \
  Q4_CAPI_EXPAND(Q4_CAPI_PICK(__VA_ARGS__, Q4_CAPI_FE24, Q4_CAPI_FE23, Q4_CAPI_FE22, Q4_CAPI_FE21, Q4_CAPI_FE20,  \
                              Q4_CAPI_FE19, Q4_CAPI_FE18, Q4_CAPI_FE17, Q4_CAPI_FE16, Q4_CAPI_FE15, Q4_CAPI_FE14, \
                              Q4_CAPI_FE13, Q4_CAPI_FE12, Q4_CAPI_FE11, Q4_CAPI_FE10, Q4_CAPI_FE9, Q4_CAPI_FE8,   \
                              Q4_CAPI_FE7, Q4_CAPI_FE6, Q4_CAPI_FE5, Q4_CAPI_FE4, Q4_CAPI_FE3, Q4_CAPI_FE2,       \
                              Q4_CAPI_FE1)(F, __VA_ARGS__))

// p.a = a where the params struct has a field a, else p.scales.a (the 4-bit
// matmuls' block scales). The detection needs a generic lambda (C++17).
#define Q4_CAPI_SET(a)                                                                  \
  [&](auto& q4_params_) {                                                               \
    auto has_field = [](auto& q4_r_) -> decltype((void)q4_r_.a, true) { return true; }; \
    if constexpr (std::is_invocable_v<decltype(has_field), decltype(q4_params_)>)       \
      ::q4::capi::set(q4_params_.a, a);                                                 \
    else                                                                                \
      ::q4::capi::set(q4_params_.scales.a, a);                                          \
  }(q4_params_);

#define Q4_CAPI_STRIP(...) __VA_ARGS__
// The params struct of op `name` from its argument names (a c_api_ops.inc entry's third element).
#define Q4_CAPI_PARAMS(name, args)                                    \
  [&] {                                                               \
    ::q4::capi::ParamsOf<decltype(&::q4::cpu::name)> q4_params_;      \
    Q4_CAPI_EXPAND(Q4_CAPI_FOR_EACH(Q4_CAPI_SET, Q4_CAPI_STRIP args)) \
    ::q4::capi::finish_params(q4_params_);                            \
    return q4_params_;                                                \
  }()
