// The 4-bit formats, one row each: the only list of them in the tree.
// Everything that depends on the set of formats is generated from
// Q4_FORMATS: the QuantType enum and Code4<> (here), the format switch
// Q4_QUANT_SWITCH (q4/quant4.h: an unknown type is an error, never a
// default format), the quant_type checks and their message (validate.cc),
// every decode table built through the switch (the bf16 decode,
// x86/avx512_bf16/bf16_decode.h), W4A8's table scale (q4/w4a8.h), and the
// C exports q4_formats() / q4_code_table (bind/c_api.cc), from which Python
// takes the names and codes (q4/_src/formats.py).
//
// Row: X(name, NAME, id, w4a8_scale)
//   name        the namespace of its header q4/<name>.h (value, encode, decode,
//               midpoint, nibble_of_rank: the Q4_HD element functions), and its
//               name in Python and in checkpoints (bitsandbytes__<name>)
//   NAME        its QuantType value k<NAME>
//   id          the value of k<NAME> (C ABI: quant_type, q4_code_table's index)
//   w4a8_scale  S of W4A8's int8 weight table round(S * value) (q4/w4a8.h)
#pragma once

#include <cstdint>

#include "q4/common.h"
#include "q4/fp4.h"
#include "q4/nf4.h"

#define Q4_FORMATS(X)    \
  X(nf4, NF4, 0, 112.0f) \
  X(fp4, FP4, 1, 120.0f)

namespace q4 {

// Values are part of the C ABI.
enum QuantType : int32_t {
#define Q4_FORMAT_ENUM(name, NAME, id, w4a8_scale) k##NAME = id,
  Q4_FORMATS(Q4_FORMAT_ENUM)
#undef Q4_FORMAT_ENUM
};

#define Q4_FORMAT_COUNT(name, NAME, id, w4a8_scale) +1
constexpr int kFormats = 0 Q4_FORMATS(Q4_FORMAT_COUNT);
#undef Q4_FORMAT_COUNT

// Whether q is the QuantType value of a format.
Q4_HDC bool is_quant_type(int64_t q) {
#define Q4_FORMAT_IS(name, NAME, id, w4a8_scale) || q == id
  return false Q4_FORMATS(Q4_FORMAT_IS);
#undef Q4_FORMAT_IS
}

// A format's code book with QT fixed at compile time.
template <QuantType QT>
struct Code4;
#define Q4_FORMAT_CODE4(name, NAME, id, w4a8_scale)                            \
  template <>                                                                  \
  struct Code4<k##NAME> {                                                      \
    static constexpr const char* kName = #name;                                \
    Q4_HD static int encode(float s) { return name::encode(s); }               \
    Q4_HD static float decode(int q) { return name::decode(q); }               \
    Q4_HD static float midpoint(int r) { return name::midpoint(r); }           \
    Q4_HD static int nibble_of_rank(int r) { return name::nibble_of_rank(r); } \
    Q4_HDC static float value(int q) { return name::value(q); }                \
    Q4_HDC static float table_scale() { return w4a8_scale; }                   \
  };
Q4_FORMATS(Q4_FORMAT_CODE4)
#undef Q4_FORMAT_CODE4

}  // namespace q4
