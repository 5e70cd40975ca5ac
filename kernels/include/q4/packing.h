// 4-bit packing: two codes per byte, element 2i in the high nibble and
// element 2i+1 in the low nibble of byte i. An odd element count pads the
// last low nibble with the code of 0.0 for the format.
#pragma once

#include "q4/common.h"

namespace q4 {

Q4_HD uint8_t pack2(int even, int odd) { return uint8_t(((even & 15) << 4) | (odd & 15)); }
Q4_HD int unpack_even(uint8_t b) { return b >> 4; }
Q4_HD int unpack_odd(uint8_t b) { return b & 15; }
Q4_HD int64_t packed_bytes(int64_t n) { return n <= 0 ? 0 : n / 2 + (n & 1); }  // ceil(n/2), no n + 1

static_assert(sizeof(uint8_t) == 1, "packed storage is bytes");
static_assert(kMinBlocksize % 2 == 0, "a block must start on a byte boundary");

}  // namespace q4
