// Per-core throughput of the vector instructions the x86 kernels are built
// from, alone and in the mixes the kernels issue: how many cycles one
// instruction (or one pair) occupies on this core. It is the arithmetic
// behind the "measured limits" in kernels/NOTES.md and the README's speed
// section (which targets a CPU can reach at all).
//
//   make pipes    (g++ -O2 -march=native -o build/pipes benchmarks/pipes.cc && build/pipes)
//
// Needs AVX512_BF16 and AVX512_VNNI (checked at run time). The clock is
// calibrated with a chain of dependent integer adds (one cycle each); every
// instruction under test is an `asm` statement on register operands, so the
// compiler can neither fold nor reorder it, and 12 independent accumulators
// cover every latency measured here (<= 6.4 cycles).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace {

double seconds() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

constexpr long kIters = 50'000'000;

// ns per iteration of body (kIters iterations), best of 3
template <typename F>
double ns_per_iter(F&& body) {
  double best = 1e30;
  for (int r = 0; r < 3; ++r) {
    const double t0 = seconds();
    body();
    best = std::min(best, (seconds() - t0) / kIters * 1e9);
  }
  return best;
}

#define Q4_R12(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)
#define Q4_DECL(i) __m512i a##i = _mm512_set1_epi32(i + 1);

// 12 independent instructions per iteration (INSN dst-in-out, src1, src2).
#define Q4_TWELVE(INSN)                    \
  [&] {                                    \
    Q4_R12(Q4_DECL)                        \
    for (long it = 0; it < kIters; ++it) { \
      Q4_R12(Q4_ONE_##INSN)                \
    }                                      \
    Q4_R12(Q4_SINK)                        \
  }
#define Q4_SINK(i) asm volatile("" : : "v"(a##i));
#define Q4_ONE_dpbf16(i) asm("vdpbf16ps %2, %1, %0" : "+v"(a##i) : "v"(x), "v"(y));
#define Q4_ONE_dpbusd(i) asm("vpdpbusd %2, %1, %0" : "+v"(a##i) : "v"(x), "v"(y));
#define Q4_ONE_fma(i) asm("vfmadd231ps %2, %1, %0" : "+v"(a##i) : "v"(x), "v"(y));
#define Q4_ONE_vpermw(i) asm("vpermw %2, %1, %0" : "+v"(a##i) : "v"(x), "v"(y));
#define Q4_ONE_vpshufb(i) asm("vpshufb %2, %1, %0" : "+v"(a##i) : "v"(x), "v"(y));
#define Q4_ONE_cvt2bf16(i) asm("vcvtne2ps2bf16 %2, %1, %0" : "+v"(a##i) : "v"(x), "v"(y));
#define Q4_ONE_zext(i) asm("vpmovzxbw %1, %0" : "+v"(a##i) : "v"(xh));
#define Q4_ONE_srlw(i) asm("vpsrlw $4, %1, %0" : "+v"(a##i) : "v"(x));
// one dot product beside one decode instruction (12 pairs per iteration)
#define Q4_DECL_B(i) __m512i b##i = _mm512_set1_epi32(i + 1);
#define Q4_SINK_B(i) asm volatile("" : : "v"(b##i));
#define Q4_PAIR_WITH(DOT, INSN)            \
  [&] {                                    \
    Q4_R12(Q4_DECL)                        \
    Q4_R12(Q4_DECL_B)                      \
    for (long it = 0; it < kIters; ++it) { \
      Q4_R12(Q4_ONE_##DOT)                 \
      Q4_R12(Q4_TWO_##INSN)                \
    }                                      \
    Q4_R12(Q4_SINK)                        \
    Q4_R12(Q4_SINK_B)                      \
  }
#define Q4_PAIR(INSN) Q4_PAIR_WITH(dpbf16, INSN)
// 12 vdpbf16ps and one INSN per iteration: what one decode instruction costs
// inside a tile of dot products (the pairs above run both at full rate)
#define Q4_ONE_IN_12(INSN)                 \
  [&] {                                    \
    Q4_R12(Q4_DECL)                        \
    Q4_R12(Q4_DECL_B)                      \
    for (long it = 0; it < kIters; ++it) { \
      Q4_R12(Q4_ONE_dpbf16)                \
      Q4_TWO_##INSN(0)                     \
    }                                      \
    Q4_R12(Q4_SINK)                        \
    Q4_R12(Q4_SINK_B)                      \
  }
#define Q4_TWO_vpshufb(i) asm("vpshufb %2, %1, %0" : "+v"(b##i) : "v"(x), "v"(y));
#define Q4_TWO_vpermw(i) asm("vpermw %2, %1, %0" : "+v"(b##i) : "v"(x), "v"(y));
#define Q4_TWO_zext(i) asm("vpmovzxbw %1, %0" : "+v"(b##i) : "v"(xh));
#define Q4_TWO_cvt2bf16(i) asm("vcvtne2ps2bf16 %2, %1, %0" : "+v"(b##i) : "v"(x), "v"(y));
#define Q4_TWO_srlw(i) asm("vpsrlw $4, %1, %0" : "+v"(b##i) : "v"(x));
#define Q4_TWO_mulps(i) asm("vmulps %2, %1, %0" : "+v"(b##i) : "v"(x), "v"(y));
// the W4A8 epilogue's instructions (int32 block sums to fp32, scaled, added)
#define Q4_TWO_cvtdq2ps(i) asm("vcvtdq2ps %1, %0" : "+v"(b##i) : "v"(x));
#define Q4_TWO_subps(i) asm("vsubps %2, %1, %0" : "+v"(b##i) : "v"(x), "v"(y));
#define Q4_TWO_addps(i) asm("vaddps %2, %1, %0" : "+v"(b##i) : "v"(x), "v"(y));
#define Q4_TWO_paddd(i) asm("vpaddd %2, %1, %0" : "+v"(b##i) : "v"(x), "v"(y));
#define Q4_TWO_vpermps(i) asm("vpermps %2, %1, %0" : "+v"(b##i) : "v"(x), "v"(y));
#define Q4_TWO_srld(i) asm("vpsrld $4, %1, %0" : "+v"(b##i) : "v"(x));
#define Q4_TWO_ternlog(i) asm("vpternlogd $0xea, %2, %1, %0" : "+v"(b##i) : "v"(x), "v"(y));
#define Q4_TWO_pord(i) asm("vpord %2, %1, %0" : "+v"(b##i) : "v"(x), "v"(y));
#define Q4_TWO_mshift(i) asm("vpmultishiftqb %2, %1, %0" : "+v"(b##i) : "v"(x), "v"(y));
#define Q4_TWO_srldq(i) asm("vpsrldq $1, %1, %0" : "+v"(b##i) : "v"(x));
// 12 vdpbf16ps and four INSN per iteration: is a decode instruction free
// beside the dot products when it is a third of their number?
#define Q4_FOUR_IN_12(INSN)                                               \
  [&] {                                                                   \
    Q4_R12(Q4_DECL)                                                       \
    Q4_R12(Q4_DECL_B)                                                     \
    for (long it = 0; it < kIters; ++it) {                                \
      Q4_R12(Q4_ONE_dpbf16)                                               \
      Q4_TWO_##INSN(0) Q4_TWO_##INSN(1) Q4_TWO_##INSN(2) Q4_TWO_##INSN(3) \
    }                                                                     \
    Q4_R12(Q4_SINK)                                                       \
    Q4_R12(Q4_SINK_B)                                                     \
  }
// the fp32 gemv's step per 16 weights (shift the packed dwords, look the
// nibbles up, multiply-add), as three independent instructions: 8 of each
// per iteration on 24 registers
#define Q4_R8(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7)
#define Q4_STEP_F32(i)                                         \
  asm("vfmadd231ps %2, %1, %0" : "+v"(a##i) : "v"(x), "v"(y)); \
  asm("vpermps %2, %1, %0" : "+v"(b##i) : "v"(x), "v"(y));     \
  asm("vpsrld $4, %1, %0" : "+v"(c##i) : "v"(x));
#define Q4_DECL_C(i) __m512i c##i = _mm512_set1_epi32(i + 1);
// 8 each of the named instructions per iteration (F: vfmadd231ps, P: vpermps,
// S: vpsrld), each on its own 8 registers (a, b, c): which pipes each pair
// shares
#define Q4_MIX_S(i) asm("vpsrld $4, %1, %0" : "+v"(c##i) : "v"(x));
#define Q4_MIX(F, P, S)                    \
  [&] {                                    \
    Q4_R8(Q4_DECL)                         \
    Q4_R8(Q4_DECL_B)                       \
    Q4_R8(Q4_DECL_C)                       \
    for (long it = 0; it < kIters; ++it) { \
      if (F) {                             \
        Q4_R8(Q4_ONE_fma)                  \
      }                                    \
      if (P) {                             \
        Q4_R8(Q4_TWO_vpermps)              \
      }                                    \
      if (S) {                             \
        Q4_R8(Q4_MIX_S)                    \
      }                                    \
    }                                      \
    Q4_R8(Q4_SINK)                         \
    Q4_R8(Q4_SINK_B)                       \
    Q4_R8(Q4_SINK_C)                       \
  }
#define Q4_SINK_C(i) asm volatile("" : : "v"(c##i));
#define Q4_F32_STEPS                       \
  [&] {                                    \
    Q4_R8(Q4_DECL)                         \
    Q4_R8(Q4_DECL_B)                       \
    Q4_R8(Q4_DECL_C)                       \
    for (long it = 0; it < kIters; ++it) { \
      Q4_R8(Q4_STEP_F32)                   \
    }                                      \
    Q4_R8(Q4_SINK)                         \
    Q4_R8(Q4_SINK_B)                       \
    Q4_R8(Q4_SINK_C)                       \
  }

}  // namespace

int main() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512vnni")) {
    std::printf("this CPU lacks AVX512_BF16 or AVX512_VNNI: nothing to measure\n");
    return 0;
  }
  __m512i x = _mm512_set1_epi16(0x3f80), y = _mm512_set1_epi16(0x0102);
  __m256i xh = _mm256_set1_epi16(0x0102);
  asm volatile("" : "+v"(x), "+v"(y), "+v"(xh));
  // the clock: 4 dependent adds per iteration, one cycle each
  const double ns_cycle = ns_per_iter([] {
                            long s = 0;
                            for (long it = 0; it < kIters; ++it)
                              asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(s));
                          }) /
                          4;
  std::printf("clock ~%.2f GHz (dependent integer adds)\n", 1 / ns_cycle);
  std::printf("cycles per instruction, one core, 12 independent zmm chains:\n");
  struct Row {
    const char* name;
    double ns;
  };
  const Row alone[] = {
      {"vdpbf16ps", ns_per_iter(Q4_TWELVE(dpbf16))}, {"vpdpbusd", ns_per_iter(Q4_TWELVE(dpbusd))},
      {"vfmadd231ps", ns_per_iter(Q4_TWELVE(fma))},  {"vpermw", ns_per_iter(Q4_TWELVE(vpermw))},
      {"vpshufb", ns_per_iter(Q4_TWELVE(vpshufb))},  {"vcvtne2ps2bf16", ns_per_iter(Q4_TWELVE(cvt2bf16))},
      {"vpmovzxbw", ns_per_iter(Q4_TWELVE(zext))},   {"vpsrlw", ns_per_iter(Q4_TWELVE(srlw))},
  };
  for (const Row& r : alone) std::printf("  %-16s %.2f\n", r.name, r.ns / 12 / ns_cycle);
  std::printf(
      "cycles per pair, vdpbf16ps beside one decode instruction (fully overlapped = the slower of the two alone, same "
      "pipes = the two alone added):\n");
  const Row pairs[] = {
      {"+ vpermw", ns_per_iter(Q4_PAIR(vpermw))},
      {"+ vpmovzxbw", ns_per_iter(Q4_PAIR(zext))},
      {"+ vcvtne2ps2bf16", ns_per_iter(Q4_PAIR(cvt2bf16))},
      {"+ vpsrlw", ns_per_iter(Q4_PAIR(srlw))},
      {"+ vpternlogd", ns_per_iter(Q4_PAIR(ternlog))},
      {"+ vpord", ns_per_iter(Q4_PAIR(pord))},
      {"+ vmulps", ns_per_iter(Q4_PAIR(mulps))},
  };
  for (const Row& r : pairs) std::printf("  %-18s %.2f\n", r.name, r.ns / 12 / ns_cycle);
  std::printf("cycles per 12 vdpbf16ps beside one decode instruction (12 x the vdpbf16ps figure = free):\n");
  const Row ones[] = {
      {"+ vcvtne2ps2bf16", ns_per_iter(Q4_ONE_IN_12(cvt2bf16))},
      {"+ vpermw", ns_per_iter(Q4_ONE_IN_12(vpermw))},
      {"+ vmulps", ns_per_iter(Q4_ONE_IN_12(mulps))},
      {"+ vpmovzxbw", ns_per_iter(Q4_ONE_IN_12(zext))},
  };
  for (const Row& r : ones) std::printf("  %-18s %.2f\n", r.name, r.ns / ns_cycle);
  std::printf("cycles per 12 vdpbf16ps beside four of one instruction (12 = all four free):\n");
  const Row fours[] = {
      {"+ 4 vpsrlw", ns_per_iter(Q4_FOUR_IN_12(srlw))},           {"+ 4 vpord", ns_per_iter(Q4_FOUR_IN_12(pord))},
      {"+ 4 vpermw", ns_per_iter(Q4_FOUR_IN_12(vpermw))},         {"+ 4 vpsrldq", ns_per_iter(Q4_FOUR_IN_12(srldq))},
      {"+ 4 vpmovzxbw", ns_per_iter(Q4_FOUR_IN_12(zext))},        {"+ 4 vmulps", ns_per_iter(Q4_FOUR_IN_12(mulps))},
      {"+ 4 vpmultishiftqb", ns_per_iter(Q4_FOUR_IN_12(mshift))},
  };
  for (const Row& r : fours) std::printf("  %-20s %.2f\n", r.name, r.ns / ns_cycle);
  std::printf(
      "cycles per pair, vpdpbusd beside one epilogue instruction (fully overlapped = the slower of the two alone, same "
      "pipes = the two alone added):\n");
  const Row int_pairs[] = {
      {"+ vcvtdq2ps", ns_per_iter(Q4_PAIR_WITH(dpbusd, cvtdq2ps))},
      {"+ vmulps", ns_per_iter(Q4_PAIR_WITH(dpbusd, mulps))},
      {"+ vsubps", ns_per_iter(Q4_PAIR_WITH(dpbusd, subps))},
      {"+ vaddps", ns_per_iter(Q4_PAIR_WITH(dpbusd, addps))},
      {"+ vpaddd", ns_per_iter(Q4_PAIR_WITH(dpbusd, paddd))},
  };
  for (const Row& r : int_pairs) std::printf("  %-18s %.2f\n", r.name, r.ns / 12 / ns_cycle);
  std::printf(
      "cycles per pair, vfmadd231ps beside one fp32-gemv decode instruction (fully overlapped = the slower of the two "
      "alone, same pipes = the two alone added):\n");
  const Row fma_pairs[] = {
      {"+ vpermps", ns_per_iter(Q4_PAIR_WITH(fma, vpermps))},
      {"+ vpsrld", ns_per_iter(Q4_PAIR_WITH(fma, srld))},
      {"+ vpermw", ns_per_iter(Q4_PAIR_WITH(fma, vpermw))},
      {"+ vpshufb", ns_per_iter(Q4_PAIR_WITH(fma, vpshufb))},
  };
  for (const Row& r : fma_pairs) std::printf("  %-18s %.2f\n", r.name, r.ns / 12 / ns_cycle);
  // Zen 4 (2026-12-05): F+P 10.7, F+S 8.0, P+S 10.7, F+P+S 12.0 cycles; the
  // same as if each zmm instruction took two slots of four 256-bit pipes, F
  // on pipes 0-1, P on 1-2, S on 2-3
  std::printf("cycles per 8 of each named (F vfmadd231ps, P vpermps, S vpsrld; 8.0 = each alone):\n");
  const Row mixes[] = {
      {"F+P", ns_per_iter(Q4_MIX(1, 1, 0))},
      {"F+S", ns_per_iter(Q4_MIX(1, 0, 1))},
      {"P+S", ns_per_iter(Q4_MIX(0, 1, 1))},
      {"F+P+S", ns_per_iter(Q4_MIX(1, 1, 1))},
  };
  for (const Row& r : mixes) std::printf("  %-18s %.2f\n", r.name, r.ns / ns_cycle);
  const double step = ns_per_iter(Q4_F32_STEPS) / 8 / ns_cycle;
  std::printf("cycles per fp32-gemv step (vpsrld + vpermps + vfmadd231ps, 16 weights): %.2f\n", step);
  const double dot = alone[0].ns / 12 / ns_cycle, dpbusd = alone[1].ns / 12 / ns_cycle;
  std::printf("per core: %.0f bf16 GFLOP/s (vdpbf16ps), %.0f int8 GOP/s (vpdpbusd) at this clock\n",
              64 / (dot * ns_cycle), 128 / (dpbusd * ns_cycle));
  // What these allow a 4096 x 4096 layer on one core, counting only the
  // instructions named (no loads, scales, epilogue or call): the floors
  // behind the README's targets. Divide by the cores used.
  const double w = 4096.0 * 4096.0, ms = ns_cycle * 1e-6;
  std::printf(
      "floors per 4096^2 layer, one core: fp32 batch 1 %.2f ms (one step per 16 weights), bf16 batch 8 %.2f ms "
      "(vdpbf16ps alone), int8 batch 512 %.1f ms (vpdpbusd alone)\n",
      w / 16 * step * ms, w * 8 / 32 * dot * ms, w * 512 / 64 * dpbusd * ms);
  return 0;
}
