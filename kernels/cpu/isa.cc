// Instruction-set selection for the CPU kernels: AVX2 when the processor has
// it (with FMA and F16C), else the scalar path. Q4_ISA=scalar|avx2 or
// set_cpu_isa() forces one; forcing avx2 on a processor without it is an error.
#include <cstdlib>
#include <cstring>
#include <string>

#include "q4/kernels.h"

namespace q4 {
namespace {

bool detect_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

Isa initial_isa() {
  const char* v = std::getenv("Q4_ISA");
  if (v != nullptr && std::strcmp(v, "scalar") == 0) return kIsaScalar;
  return detect_avx2() ? kIsaAvx2 : kIsaScalar;
}

Isa g_isa = initial_isa();

}  // namespace

bool cpu_has_avx2() { return detect_avx2(); }
Isa cpu_isa() { return g_isa; }

Status set_cpu_isa(int32_t isa) {
  if (isa == kIsaScalar) {
    g_isa = kIsaScalar;
  } else if (isa == kIsaAvx2) {
    if (!detect_avx2())
      return {kUnsupported, "this processor lacks AVX2/FMA/F16C; only the scalar path (0) is available"};
    g_isa = kIsaAvx2;
  } else {
    return Status::Invalid("isa must be 0 (scalar) or 1 (avx2), got " + std::to_string(isa));
  }
  return Status::Ok();
}

}  // namespace q4
