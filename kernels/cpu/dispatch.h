// The CPU kernel table. Each op variant that has ISA-specific kernels is a
// chain of entries, best first; an entry returns false when it does not serve
// the call (input dtype, shape) and the next one runs. The chain for each ISA
// level is built once; the active level is the best the processor and the OS
// support (isa.cc: cpuid + XGETBV), or what Q4_ISA / set_cpu_isa name.
//
// Levels (each implies the ones below it):
//   scalar       the reference kernels (always present, exact contracts)
//   avx2         AVX2 + FMA + F16C
//   avx512       + AVX-512 F/BW/VL (512-bit fp32 FMAs)
//   avx512_bf16  + AVX512_BF16 and AVX512_VNNI (vdpbf16ps / vpdpbusd)
//   amx          + AMX-TILE, AMX-BF16, AMX-INT8 and the OS's permission for
//                the tile data (tile matrix multiplies)
//
// One translation unit per level (kernels/cpu/x86/<level>/*.cc) defines its
// entries after a `#pragma GCC target(...)` for that level, so its code never
// runs on a processor that lacks it. See kernels/README.md to add one.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "gemm4_common.h"
#include "q4/kernels.h"

namespace q4 {
namespace cpu {

// Fused 4-bit matmul forward / input gradient (contracts in q4/kernels.h).
// fp32-compute entries convert a 16-bit input to fp32 first (gemm4::as_f32)
// and keep the bit-exact fp32 contract; bf16-compute entries serve bf16
// inputs only (see README: bf16 compute).
using Gemm4Fn = bool (*)(const Gemm4bitParams& p, const gemm4::Scales& scales);
using Grad4Fn = bool (*)(const Gemm4bitGradInputParams& p, const gemm4::Scales& scales);

template <typename Fn>
struct Entry {
  const char* name;  // "<level>.<kernel>", reported by q4.cpu_features()
  Fn fn;
  int64_t min_m;  // int8_gemm: the caller takes this entry from this many x rows on
};

constexpr int kMaxChain = 12;
template <typename Fn>
struct Chain {
  Entry<Fn> entries[kMaxChain];
  int size = 0;
  void add(const char* name, Fn fn, int64_t min_m = 0) {
    if (size == kMaxChain) {  // a programming error, met when the table is built at load on every CPU
      std::fprintf(stderr, "q4: kernel chain full (kMaxChain = %d) adding %s\n", kMaxChain, name);
      std::abort();
    }
    entries[size++] = {name, fn, min_m};
  }
};

// LLM.int8 dot products (the integer part of int8_linear, contract in
// cpu/int8.cc): acc[i * acc_stride + j] = sum_{kk < k} xq[i * xs + kk] *
// w[j][kk], exact in int32 (k <= int8::kMaxK), for i < mr <= 4 quantized x
// rows and j < nr <= 4 weight rows. x_sums[i] = sum_kk xq[i * xs + kk].
// An entry returns false for calls it does not serve; the dot-product tiles
// of the int8_linear entry's own loops (cpu/int8_loops.h) run then.
struct Int8Dots {
  const int8_t* xq;
  int64_t xs;
  const int32_t* x_sums;
  const int8_t* const* w;
  int mr, nr;
  int64_t k;
  int32_t* acc;
  int64_t acc_stride;
  // Weight rows that come next, to prefetch while these stream by (weight
  // rows at stride k from `ahead`; ahead_rows <= nr of them, 0: none). The
  // caller passes rows only on its first x block of w, and only rows of W.
  const int8_t* ahead = nullptr;
  int ahead_rows = 0;
};
using Int8DotsFn = bool (*)(const Int8Dots& d);
// The same integer sums for a whole block: acc[i * lda + j] for i < m, j < n
// (rows of xq at stride xs, zero beyond k up to a multiple of 4; w [n, k]).
// For many x rows: int8.cc takes the first entry whose min_m the row count
// reaches (measured crossovers against int8_dots), else the int8_dots chain;
// runs its own parallel_for. x_sums are for kernels with an unsigned operand.
struct Int8Gemm {
  const int8_t* xq;
  int64_t xs;
  const int32_t* x_sums;
  const int8_t* w;
  int64_t m, n, k;
  int32_t* acc;
  int64_t lda;
  // Called, when not null, by the thread that finished columns [j0, j0 +
  // cols): acc holds their final sums for all m rows, still in that core's
  // L2, for the caller's epilogue (which must not start a parallel_for).
  void (*done)(void* ctx, int64_t j0, int64_t cols) = nullptr;
  void* ctx = nullptr;
};
using Int8GemmFn = bool (*)(const Int8Gemm& g);

// LLM.int8 input gradient of rows [row0, row0 + m) (contract in cpu/int8.cc):
// dx[(row0 + i) * k + c] = the sum in n order of g(i, j) * weight[j * k + c],
// one fp32 multiply and one add per term (g = dY * fp32(SCB * kInv127), from
// the caller), g in blocks of kInt8GradRows rows: the r rows of block b (r =
// kInt8GradRows but for the last) at g[b * kInt8GradRows * n + j * r + i], so
// a block's values for one j are adjacent. Runs its own parallel_for.
constexpr int kInt8GradRows = 12;
struct Int8Grad {
  const float* g;
  const int8_t* weight;
  int64_t m, n, k, row0;
  void* dx;
  DType dx_dtype;
};
using Int8GradFn = bool (*)(const Int8Grad& a);
// An LLM.int8 input gradient kernel given the call as it is (dY in its own
// dtype), of another contract than the exact one: the bf16-compute contract
// for bf16 dY, fp32 sums of exact part products for fp32 dY
// (x86/amx/grad4.cc, split.cc). Runs before the int8_grad chain; false: not served.
using Int8GradInputFn = bool (*)(const Int8GradInputParams& p);

// The LLM.int8 ops with one level's loops (cpu/int8_loops.h: the drivers;
// x86/avx2/int8.cc, cpu/int8.cc: the loops), the call validated. Each level's
// chain ends in the scalar entry, which serves every call. int8_linear's
// entry also consults the int8_gemm and int8_dots chains and names the entry
// it took in run->kernel (null: its own dot-product tiles, reported by the
// entry's name); its status is the op's. int8_grad's entry runs after the
// int8_grad_input and int8_grad chains, col_scale[j] = fp32(SCB[j] / 127).
struct Int8LinearRun {
  Status status;
  const char* kernel = nullptr;
};
using Int8QuantizeFn = bool (*)(const Int8QuantizeRowsParams& p);
using Int8LinearFn = bool (*)(const Int8LinearParams& p, Int8LinearRun* run);
using Int8GradLoopsFn = bool (*)(const Int8GradInputParams& p, const float* col_scale);

// 4-bit quantize / dequantize with one level's block functions
// (cpu/quant4_loops.h: the drivers), the call validated; each level's chain
// ends in the scalar entry. Blocks4: encode_4bit (x, scales_in -> packed) and
// search_scales_4bit (x -> scales_out) over n_blocks full blocks.
struct Blocks4 {
  const float* x;
  int64_t n_blocks, blocksize;
  int32_t quant_type;
  const float* scales_in;
  uint8_t* packed;
  float* scales_out;
};
using Quantize4Fn = bool (*)(const Quantize4bitParams& p);
using Dequantize4Fn = bool (*)(const Dequantize4bitParams& p);
using Blocks4Fn = bool (*)(const Blocks4& a);

// Blockwise 8-bit optimizer step (contract in q4/kernels.h, Optim8bitParams):
// the whole call, its own parallel_for; false: not served (dtype).
struct Optim8Call;  // cpu/optim8_common.h
using Optim8Fn = bool (*)(const Optim8Call& c);

struct KernelTable {
  Chain<Gemm4Fn> gemm4;
  Chain<Grad4Fn> grad4;
  Chain<Gemm4Fn> w4a8;  // gemm_4bit_w4a8 (contract in q4/w4a8.h)
  Chain<Int8GradFn> int8_grad;
  Chain<Int8GradInputFn> int8_grad_input;
  Chain<Int8DotsFn> int8_dots;
  Chain<Int8GemmFn> int8_gemm;
  Chain<Int8QuantizeFn> int8_quantize;
  Chain<Int8LinearFn> int8_linear;
  Chain<Int8GradLoopsFn> int8_grad_loops;
  Chain<Optim8Fn> optim8;
  Chain<Quantize4Fn> quantize4;
  Chain<Dequantize4Fn> dequantize4;
  Chain<Blocks4Fn> encode4;
  Chain<Blocks4Fn> search4;
};

// The table of the active level.
const KernelTable& kernel_table();

// Whether the AVX-512 units decode nested block scales with AVX512_VBMI byte
// permutes (x86/avx512/scale_decoder.h): on the avx512_bf16 level when the
// processor has VBMI. The avx512 level keeps to F, BW and VL. Both decodes
// give the same bits.
bool vbmi_scale_decode();

// Ops whose last-run kernel is recorded (for tests and benchmarks).
enum class Op : int { kGemm4 = 0, kGrad4 = 1, kInt8Linear = 2, kW4A8 = 3, kInt8Grad = 4, kOptim8 = 5, kCount = 6 };
void record_kernel(Op op, const char* name);
const char* last_kernel(Op op);

// Runs the first entry of `chain` that serves the call and records its name.
template <typename Fn, typename P>
void run_chain(const Chain<Fn>& chain, Op op, const P& p, const gemm4::Scales& scales) {
  for (int i = 0; i < chain.size; ++i)
    if (chain.entries[i].fn(p, scales)) return record_kernel(op, chain.entries[i].name);
}

// Entry points of each level's translation unit. The x86 units are compiled
// only on x86 (isa.cc adds their entries there only).
namespace scalar {
bool gemm4(const Gemm4bitParams& p, const gemm4::Scales& scales);
bool grad4(const Gemm4bitGradInputParams& p, const gemm4::Scales& scales);
bool w4a8(const Gemm4bitParams& p, const gemm4::Scales& scales);  // cpu/w4a8.cc
bool optim8(const Optim8Call& c);                                 // cpu/optim8.cc
bool int8_quantize_rows(const Int8QuantizeRowsParams& p);         // cpu/int8.cc
bool int8_linear(const Int8LinearParams& p, Int8LinearRun* run);
bool int8_grad(const Int8GradInputParams& p, const float* col_scale);
bool quantize4(const Quantize4bitParams& p);  // cpu/quant4.cc
bool dequantize4(const Dequantize4bitParams& p);
bool encode4(const Blocks4& a);
bool search4(const Blocks4& a);
}  // namespace scalar
namespace avx2 {
bool gemm4(const Gemm4bitParams& p, const gemm4::Scales& scales);
bool grad4(const Gemm4bitGradInputParams& p, const gemm4::Scales& scales);
// the LLM.int8 ops' AVX2 loops (x86/avx2/int8.cc)
bool int8_quantize_rows(const Int8QuantizeRowsParams& p);
bool int8_linear(const Int8LinearParams& p, Int8LinearRun* run);
bool int8_grad(const Int8GradInputParams& p, const float* col_scale);
// 4-bit quantize / dequantize blocks (x86/avx2/quant4.cc)
bool quantize4(const Quantize4bitParams& p);
bool dequantize4(const Dequantize4bitParams& p);
bool encode4(const Blocks4& a);
bool search4(const Blocks4& a);
}  // namespace avx2
namespace avx512 {
// fp32 compute with 512-bit FMAs (batch-1 gemv, tiled forward, input gradient)
bool gemm4(const Gemm4bitParams& p, const gemm4::Scales& scales);        // m == 1 here, else gemm4_tiled
bool gemm4_tiled(const Gemm4bitParams& p, const gemm4::Scales& scales);  // x86/avx512/gemm4_tiled.cc
bool grad4(const Gemm4bitGradInputParams& p, const gemm4::Scales& scales);
bool int8_grad(const Int8Grad& a);  // x86/avx512/int8_grad.cc
// fp32 / bf16 parameters and gradients (x86/avx512/optim8.cc); false otherwise
bool optim8(const Optim8Call& c);
}  // namespace avx512
namespace avx512_bf16 {
// bf16 inputs: W decoded to bf16 (fp32 value rounded once), vdpbf16ps with
// fp32 accumulation; returns false for other input dtypes
bool gemm4(const Gemm4bitParams& p, const gemm4::Scales& scales);
bool grad4(const Gemm4bitGradInputParams& p, const gemm4::Scales& scales);
// LLM.int8 dot products with vpdpbusd (AVX512_VNNI)
bool int8_dots(const Int8Dots& d);
bool int8_gemm(const Int8Gemm& g);
constexpr int64_t kInt8GemmMinM = 64;  // measured: below it the int8_dots tiles are faster
// W4A8 with vpdpbusd (x86/avx512_bf16/w4a8.cc)
bool w4a8(const Gemm4bitParams& p, const gemm4::Scales& scales);
}  // namespace avx512_bf16
namespace amx {
// bf16 inputs on the tile unit (TDPBF16PS), x86/amx/gemm4.cc (the gradients
// in grad4.cc, the fp32 split kernels in split.cc); returns false
// for other input dtypes and for few x rows (the avx512_bf16 gemv runs)
bool gemm4(const Gemm4bitParams& p, const gemm4::Scales& scales);
// the same from kRowsMinM x rows with x read in place (C in the output's
// orientation); false below it
bool gemm4_rows(const Gemm4bitParams& p, const gemm4::Scales& scales);
// batch-1 bf16 inputs through the fp32 gemv (avx512::gemm4): faster on AMX cores
bool gemv_f32(const Gemm4bitParams& p, const gemm4::Scales& scales);
// fp32 / fp16 inputs from 8 rows as six bf16 part products (the fp32
// contract), when every x and block scale is in its range; false otherwise
bool gemm4_split(const Gemm4bitParams& p, const gemm4::Scales& scales);
bool grad4(const Gemm4bitGradInputParams& p, const gemm4::Scales& scales);
// the same split for fp32 dY from 64 rows
bool grad4_split(const Gemm4bitGradInputParams& p, const gemm4::Scales& scales);
// LLM.int8 input gradient for bf16 dY (the bf16-compute contract, on
// TDPBF16PS) from 3 dY rows with k % 64 == 0; false otherwise
bool int8_grad(const Int8GradInputParams& p);
// the same for fp32 dY from 48 rows: g = dY * SCB / 127 split into three
// bf16 parts against the exact bf16 int8 weight (an fp32-class sum, other
// bytes than the exact contract); false for a NaN / inf g
bool int8_grad_split(const Int8GradInputParams& p);
// LLM.int8 integer sums with TDPBSSD, x86/amx/int8.cc
bool int8_gemm(const Int8Gemm& g);
constexpr int64_t kInt8GemmMinM = 16;  // measured: below it the int8_dots tiles are faster
}  // namespace amx

}  // namespace cpu
}  // namespace q4
