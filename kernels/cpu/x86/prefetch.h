// Prefetch of a weight that is streamed once (from L3 or DRAM), a few row
// groups or tiles ahead of its use: into L2 (T1), not L1 (T0). A T0 prefetch
// holds one of the core's few L1 miss buffers until the line arrives, which
// caps one core's DRAM rate at ~10 GB/s (Zen 4, measured: batch-1 gemv 8
// layers from DRAM 1.25x faster with T1 two row groups ahead than T0 one
// ahead); the L2 has more, and the L1 refill from L2 is short. Internal
// linkage: each x86 unit keeps its own copy.
#pragma once

#include <xmmintrin.h>

namespace q4 {
namespace cpu {
namespace {

inline void prefetch_stream(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

}  // namespace
}  // namespace cpu
}  // namespace q4
