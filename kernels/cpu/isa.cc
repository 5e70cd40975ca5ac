// CPU feature detection (cpuid + the OS's XSAVE state), the ISA levels and
// the kernel table of each (dispatch.h). The active level is the best one the
// processor supports, or the one Q4_ISA / set_cpu_isa names; naming a level
// the processor lacks is an error (Q4_ISA is checked by the Python loader,
// which refuses unknown names; here an unusable value falls back to the best
// level).
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#endif

#include "dispatch.h"
#include "q4/kernels.h"

namespace q4 {
namespace {

struct Features {
  bool avx2 = false;    // with FMA and F16C, and the OS saving ymm state
  bool avx512 = false;  // F, BW, VL, and the OS saving zmm and opmask state
  bool avx512_vbmi = false, avx512_bf16 = false, avx512_vnni = false, avx_vnni = false;
  bool amx_bf16 = false, amx_int8 = false;
  bool amx = false;  // AMX-TILE, -BF16 and -INT8, the OS saving tile state, and this process allowed to use it
};

#if defined(__x86_64__) || defined(__i386__)
uint64_t xgetbv0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

// Linux hands out the tile data state (8 KiB per thread) only to processes
// that ask: ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, once per process (its
// threads, present and future, inherit it). Elsewhere: no AMX.
bool request_tile_data() {
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

Features detect() {
  Features f;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!osxsave || !avx) return f;
  const uint64_t xcr0 = xgetbv0();
  const bool ymm_state = (xcr0 & 0x6) == 0x6;
  const bool zmm_state = ymm_state && (xcr0 & 0xe0) == 0xe0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  const uint32_t b7 = b, c7 = c, d7 = d;
  f.avx2 = ymm_state && fma && f16c && (b7 & (1u << 5));
  f.avx512 = f.avx2 && zmm_state && (b7 & (1u << 16)) && (b7 & (1u << 30)) && (b7 & (1u << 31));
  f.avx512_vbmi = f.avx512 && (c7 & (1u << 1));
  f.avx512_vnni = f.avx512 && (c7 & (1u << 11));
  f.amx_bf16 = d7 & (1u << 22);
  f.amx_int8 = d7 & (1u << 25);
  const bool tile_state = (xcr0 & 0x60000) == 0x60000;  // XTILECFG and XTILEDATA
  f.amx = f.avx512 && f.amx_bf16 && f.amx_int8 && (d7 & (1u << 24)) && tile_state && request_tile_data();
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) {
    f.avx512_bf16 = f.avx512 && (a & (1u << 5));
    f.avx_vnni = f.avx2 && (a & (1u << 4));
  }
  return f;
}
#else
Features detect() { return {}; }
#endif

const Features& features() {
  static const Features f = detect();
  return f;
}

constexpr const char* kLevelNames[] = {
#define Q4_ISA_NAME(name, Name) #name,
    Q4_ISA_LEVELS(Q4_ISA_NAME)
#undef Q4_ISA_NAME
};
constexpr int kLevels = kIsaLevels;

Isa best_isa() {
  const Features& f = features();
  const bool bf16 = f.avx512 && f.avx512_bf16 && f.avx512_vnni;
  if (bf16 && f.amx) return kIsaAmx;
  if (bf16) return kIsaAvx512Bf16;
  if (f.avx512) return kIsaAvx512;
  return f.avx2 ? kIsaAvx2 : kIsaScalar;
}

// The chains of one level: best kernel first, the scalar reference last.
cpu::KernelTable build_table(Isa isa) {
  cpu::KernelTable t;
#if defined(__x86_64__) || defined(__i386__)
  if (isa >= kIsaAmx) {
    t.gemm4.add("amx.gemm4_rows", cpu::amx::gemm4_rows);
    t.gemm4.add("amx.gemm4", cpu::amx::gemm4);
    t.gemm4.add("amx.gemv_f32", cpu::amx::gemv_f32);
    t.gemm4.add("amx.gemm4_split", cpu::amx::gemm4_split);
    t.grad4.add("amx.grad4", cpu::amx::grad4);
    t.grad4.add("amx.grad4_split", cpu::amx::grad4_split);
    t.int8_gemm.add("amx.int8_gemm", cpu::amx::int8_gemm, cpu::amx::kInt8GemmMinM);
    t.int8_grad_input.add("amx.int8_grad", cpu::amx::int8_grad);
    t.int8_grad_input.add("amx.int8_grad_split", cpu::amx::int8_grad_split);
  }
  if (isa >= kIsaAvx512Bf16) {
    t.gemm4.add("avx512_bf16.gemm4", cpu::avx512_bf16::gemm4);
    t.grad4.add("avx512_bf16.grad4", cpu::avx512_bf16::grad4);
    t.int8_dots.add("avx512_bf16.int8_dots", cpu::avx512_bf16::int8_dots);
    t.int8_gemm.add("avx512_bf16.int8_gemm", cpu::avx512_bf16::int8_gemm, cpu::avx512_bf16::kInt8GemmMinM);
    t.w4a8.add("avx512_bf16.w4a8", cpu::avx512_bf16::w4a8);
  }
  if (isa >= kIsaAvx512) {
    t.gemm4.add("avx512.gemm4", cpu::avx512::gemm4);
    t.grad4.add("avx512.grad4", cpu::avx512::grad4);
    t.int8_grad.add("avx512.int8_grad", cpu::avx512::int8_grad);
    t.optim8.add("avx512.optim8", cpu::avx512::optim8);
  }
  if (isa >= kIsaAvx2) {
    t.gemm4.add("avx2.gemm4", cpu::avx2::gemm4);
    t.grad4.add("avx2.grad4", cpu::avx2::grad4);
    t.int8_quantize.add("avx2.int8_quantize_rows", cpu::avx2::int8_quantize_rows);
    t.int8_linear.add("avx2.int8_dots", cpu::avx2::int8_linear);
    t.int8_grad_loops.add("avx2.int8_grad", cpu::avx2::int8_grad);
    t.quantize4.add("avx2.quantize4", cpu::avx2::quantize4);
    t.dequantize4.add("avx2.dequantize4", cpu::avx2::dequantize4);
    t.encode4.add("avx2.encode4", cpu::avx2::encode4);
    t.search4.add("avx2.search4", cpu::avx2::search4);
  }
#endif
  t.gemm4.add("scalar.gemm4", cpu::scalar::gemm4);
  t.grad4.add("scalar.grad4", cpu::scalar::grad4);
  t.w4a8.add("scalar.w4a8", cpu::scalar::w4a8);
  t.optim8.add("scalar.optim8", cpu::scalar::optim8);
  t.int8_quantize.add("scalar.int8_quantize_rows", cpu::scalar::int8_quantize_rows);
  t.int8_linear.add("scalar.int8_dots", cpu::scalar::int8_linear);  // named by their dot-product tiles
  t.int8_grad_loops.add("scalar.int8_grad", cpu::scalar::int8_grad);
  t.quantize4.add("scalar.quantize4", cpu::scalar::quantize4);
  t.dequantize4.add("scalar.dequantize4", cpu::scalar::dequantize4);
  t.encode4.add("scalar.encode4", cpu::scalar::encode4);
  t.search4.add("scalar.search4", cpu::scalar::search4);
  return t;
}

const cpu::KernelTable& table_of(Isa isa) {
  static const cpu::KernelTable tables[kLevels] = {
#define Q4_ISA_TABLE(name, Name) build_table(kIsa##Name),
      Q4_ISA_LEVELS(Q4_ISA_TABLE)
#undef Q4_ISA_TABLE
  };
  return tables[isa];
}

Isa initial_isa() {
  const char* v = std::getenv("Q4_ISA");
  const Isa best = best_isa();
  if (v == nullptr) return best;
  for (int i = 0; i < kLevels; ++i)
    if (std::strcmp(v, kLevelNames[i]) == 0 && i <= best) return static_cast<Isa>(i);
  return best;
}

std::atomic<int> g_isa{initial_isa()};
std::atomic<const char*> g_last[int(cpu::Op::kCount)];

void json_bool(std::string& s, const char* name, bool v) {
  s += std::string("\"") + name + "\": " + (v ? "true" : "false") + ", ";
}
void json_chain(std::string& s, const char* op, const char* const* names, int count) {
  s += std::string("\"") + op + "\": [";
  for (int i = 0; i < count; ++i) s += std::string(i ? ", " : "") + "\"" + names[i] + "\"";
  s += "]";
}

}  // namespace

namespace cpu {
const KernelTable& kernel_table() { return table_of(static_cast<Isa>(g_isa.load(std::memory_order_relaxed))); }
bool vbmi_scale_decode() { return features().avx512_vbmi && g_isa.load(std::memory_order_relaxed) >= kIsaAvx512Bf16; }
void record_kernel(Op op, const char* name) { g_last[int(op)].store(name, std::memory_order_relaxed); }
const char* last_kernel(Op op) {
  const char* n = g_last[int(op)].load(std::memory_order_relaxed);
  return n ? n : "";
}
}  // namespace cpu

bool cpu_has_avx2() { return features().avx2; }
bool cpu_has_avx512() { return features().avx512; }
bool cpu_has_avx512_bf16() { return best_isa() >= kIsaAvx512Bf16; }
bool cpu_has_amx() { return best_isa() >= kIsaAmx; }
Isa cpu_isa() { return static_cast<Isa>(g_isa.load(std::memory_order_relaxed)); }
const char* cpu_isa_name(int32_t isa) { return isa >= 0 && isa < kLevels ? kLevelNames[isa] : ""; }
bool cpu_has_isa(int32_t isa) { return isa >= 0 && isa <= best_isa(); }

Status set_cpu_isa(int32_t isa) {
  if (isa < kIsaScalar || isa >= kLevels) {
    std::string levels;  // "0 (scalar), 1 (avx2), ... or 4 (amx)"
    for (int i = 0; i < kLevels; ++i)
      levels += (i == 0 ? "" : i + 1 == kLevels ? " or " : ", ") + std::to_string(i) + " (" + kLevelNames[i] + ")";
    return Status::Invalid("isa must be " + levels + ", got " + std::to_string(isa));
  }
  if (isa > best_isa())
    return {kUnsupported, std::string("this processor does not support isa ") + kLevelNames[isa] +
                              "; the best it supports is " + kLevelNames[best_isa()]};
  g_isa.store(isa, std::memory_order_relaxed);
  return Status::Ok();
}

int64_t cpu_l1d_bytes() {
  static const int64_t bytes = [] {
    if (const char* v = std::getenv("Q4_L1D_BYTES")) {
      char* end = nullptr;
      const long long n = std::strtoll(v, &end, 10);
      if (end != v && *end == '\0' && n > 0) return int64_t(n);
    }
#if defined(_SC_LEVEL1_DCACHE_SIZE)
    const long n = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    if (n > 0) return int64_t(n);
#endif
    return int64_t(32) << 10;
  }();
  return bytes;
}

std::string cpu_features_json() {
  const Features& f = features();
  std::string s = "{\"features\": {";
  json_bool(s, "avx2", f.avx2);
  json_bool(s, "avx512", f.avx512);
  json_bool(s, "avx512_vbmi", f.avx512_vbmi);
  json_bool(s, "avx512_bf16", f.avx512_bf16);
  json_bool(s, "avx512_vnni", f.avx512_vnni);
  json_bool(s, "avx_vnni", f.avx_vnni);
  json_bool(s, "amx_bf16", f.amx_bf16);
  json_bool(s, "amx_int8", f.amx_int8);
  s += std::string("\"amx\": ") + (f.amx ? "true" : "false") + "}, ";
  s += std::string("\"best_isa\": \"") + kLevelNames[best_isa()] + "\", ";
  s += std::string("\"isa\": \"") + kLevelNames[cpu_isa()] + "\", ";
  s += "\"l1d_bytes\": " + std::to_string(cpu_l1d_bytes()) + ", \"kernels\": {";
  const cpu::KernelTable& t = cpu::kernel_table();
  const char* names[cpu::kMaxChain];
  for (int i = 0; i < t.gemm4.size; ++i) names[i] = t.gemm4.entries[i].name;
  json_chain(s, "gemm_4bit", names, t.gemm4.size);
  s += ", ";
  for (int i = 0; i < t.grad4.size; ++i) names[i] = t.grad4.entries[i].name;
  json_chain(s, "gemm_4bit_grad_input", names, t.grad4.size);
  s += ", ";
  int count = 0;  // int8_linear: the int8_gemm and int8_dots chains, then the loops' entries
  for (int i = 0; i < t.int8_gemm.size; ++i) names[count++] = t.int8_gemm.entries[i].name;
  for (int i = 0; i < t.int8_dots.size; ++i) names[count++] = t.int8_dots.entries[i].name;
  for (int i = 0; i < t.int8_linear.size; ++i) names[count++] = t.int8_linear.entries[i].name;
  json_chain(s, "int8_linear", names, count);
  s += ", ";
  for (int i = 0; i < t.w4a8.size; ++i) names[i] = t.w4a8.entries[i].name;
  json_chain(s, "gemm_4bit_w4a8", names, t.w4a8.size);
  s += ", ";
  count = 0;  // int8_grad_input: the call-as-it-is kernels, the int8_grad chain, then the loops' entries
  for (int i = 0; i < t.int8_grad_input.size; ++i) names[count++] = t.int8_grad_input.entries[i].name;
  for (int i = 0; i < t.int8_grad.size; ++i) names[count++] = t.int8_grad.entries[i].name;
  for (int i = 0; i < t.int8_grad_loops.size; ++i) names[count++] = t.int8_grad_loops.entries[i].name;
  json_chain(s, "int8_grad_input", names, count);
  s += ", ";
  for (int i = 0; i < t.optim8.size; ++i) names[i] = t.optim8.entries[i].name;
  json_chain(s, "optimizer_update_8bit", names, t.optim8.size);
  s += "}, \"last_kernel\": {\"gemm_4bit\": \"" + std::string(cpu::last_kernel(cpu::Op::kGemm4)) +
       "\", \"gemm_4bit_grad_input\": \"" + std::string(cpu::last_kernel(cpu::Op::kGrad4)) + "\", \"int8_linear\": \"" +
       std::string(cpu::last_kernel(cpu::Op::kInt8Linear)) + "\", \"gemm_4bit_w4a8\": \"" +
       std::string(cpu::last_kernel(cpu::Op::kW4A8)) + "\", \"int8_grad_input\": \"" +
       std::string(cpu::last_kernel(cpu::Op::kInt8Grad)) + "\", \"optimizer_update_8bit\": \"" +
       std::string(cpu::last_kernel(cpu::Op::kOptim8)) + "\"}}";
  return s;
}

}  // namespace q4
