// Threads for the CPU kernels. parallel_for splits [0, n) into contiguous
// chunks of at least `grain` items (up to 4 per thread, handed out
// dynamically) and runs fn(begin, end) on each; the caller's thread works too.
// fn may be called several times per thread. The workers are, in order of
// precedence: the current thread's TaskScheduler (XLA's intra-op pool during a
// custom call), the process's fork-join entry point (the host framework's
// OpenMP team; not in a forked child), else a persistent pool of q4's own
// (see q4/kernels.h).
// Thread count: set_cpu_num_threads(), else Q4_NUM_THREADS, else
// OMP_NUM_THREADS, else the hardware concurrency.
#pragma once

#include <cstdint>
#include <functional>

namespace q4 {
namespace cpu {

// Runs fn over [0, n) in chunks (see above). Every chunk runs with IEEE
// denormal handling (ScopedIeeeFloat), whatever the calling thread's mode.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

// Clears flush-to-zero / denormals-are-zero for its lifetime and restores the
// caller's mode after. XLA runs custom calls with FTZ/DAZ set, and torch can
// set them (torch.set_flush_denormal); the formats are defined on IEEE
// arithmetic, so a denormal input must not read as zero.
class ScopedIeeeFloat {
 public:
  ScopedIeeeFloat();
  ~ScopedIeeeFloat();
  ScopedIeeeFloat(const ScopedIeeeFloat&) = delete;
  ScopedIeeeFloat& operator=(const ScopedIeeeFloat&) = delete;

 private:
  unsigned saved_ = 0;
};

// A per-thread, grow-only scratch buffer of at least `count` floats (one per
// slot and thread). Kernels reuse it across calls instead of allocating: a
// fresh multi-megabyte buffer costs page faults on every call. Contents are
// unspecified on return.
float* scratch(int slot, int64_t count);
constexpr int kScratchSlots = 4;

// Hint that a large output buffer about to be written for the first time may
// be backed by huge pages (madvise MADV_HUGEPAGE on its 2 MiB-aligned
// interior). A fresh 64 MiB buffer otherwise costs ~16k page faults, more
// than the kernel itself. Advisory only: never fails, never changes data.
void hint_fresh_output(void* ptr, int64_t bytes);

}  // namespace cpu
}  // namespace q4
