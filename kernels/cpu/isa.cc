// Instruction-set selection for the CPU kernels: the best level the processor
// supports (AVX-512 F/BW/VL, else AVX2 with FMA and F16C, else scalar).
// Q4_ISA=scalar|avx2|avx512 or set_cpu_isa() forces one; forcing a level the
// processor lacks is an error (the environment variable then falls back to
// the best supported level).
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

bool detect_avx512() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return detect_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

Isa best_isa() { return detect_avx512() ? kIsaAvx512 : detect_avx2() ? kIsaAvx2 : kIsaScalar; }

Isa initial_isa() {
  const char* v = std::getenv("Q4_ISA");
  const Isa best = best_isa();
  if (v == nullptr) return best;
  if (std::strcmp(v, "scalar") == 0) return kIsaScalar;
  if (std::strcmp(v, "avx2") == 0 && best >= kIsaAvx2) return kIsaAvx2;
  return best;
}

Isa g_isa = initial_isa();

}  // namespace

bool cpu_has_avx2() { return detect_avx2(); }
bool cpu_has_avx512() { return detect_avx512(); }
Isa cpu_isa() { return g_isa; }

Status set_cpu_isa(int32_t isa) {
  if (isa < kIsaScalar || isa > kIsaAvx512)
    return Status::Invalid("isa must be 0 (scalar), 1 (avx2) or 2 (avx512), got " + std::to_string(isa));
  if (isa > best_isa())
    return {kUnsupported, "this processor does not support isa " + std::to_string(isa) + "; the best it supports is " +
                              std::to_string(best_isa())};
  g_isa = static_cast<Isa>(isa);
  return Status::Ok();
}

}  // namespace q4
