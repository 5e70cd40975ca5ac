// What the blockwise 8-bit optimizer kernels share (cpu/optim8.cc, the ISA
// units): one prepared call, and the block loop that runs a kernel's block
// body over the threads and counts skipped blocks.
#pragma once

#include <cstdint>
#include <functional>

#include "q4/blockwise8.h"
#include "q4/kernels.h"
#include "q4/optim8.h"

namespace q4 {
namespace cpu {

// bin -> code index of a code book (blockwise8.h's threshold form), padded
// with kTablePad bytes so that a 4-byte gather at any bin stays inside.
constexpr int kTablePad = 4;

struct Optim8Call {
  const Optim8bitParams* p = nullptr;
  optim8::Consts k{};
  const float* book1 = nullptr;     // [256], the state-1 code book
  const float* book2 = nullptr;     // [256], adam's state-2 code book (else null)
  const uint8_t* table1 = nullptr;  // [blockwise8::kBins + kTablePad]
  const uint8_t* table2 = nullptr;
};

// Runs body(b0, b1) over the blocks on the kernels' threads; body returns how
// many of its blocks it skipped (non-finite gradient). Returns the total.
int64_t optim8_blocks(const Optim8Call& c, const std::function<int64_t(int64_t, int64_t)>& body);

}  // namespace cpu
}  // namespace q4
