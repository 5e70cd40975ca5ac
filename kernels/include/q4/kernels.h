// The framework-free kernel API. Every op takes a small params struct of raw
// pointers and explicit element counts; no framework type appears here. The
// C ABI (bind/c_api.cc) and the XLA FFI handlers (bind/xla_ffi*.cc) are thin
// wrappers over these functions. Each op validates its params and returns a
// Status; it never aborts and never touches memory outside the given sizes.
//
// Layouts (n = element count of the flattened, row-major tensor):
//   4-bit:   packed[ceil(n/2)] bytes (even element in the high nibble),
//            absmax[ceil(n/blocksize)] fp32, one per block of `blocksize`
//            consecutive elements; the last block may be partial.
//   8-bit:   codes[n] bytes indexing a sorted 256-entry code book,
//            absmax[ceil(n/blocksize)] fp32.
//   nested:  the 4-bit absmax stored as 8-bit codes of (absmax - offset) with
//            block 256, their own absmax2[ceil(n_blocks/256)], and the fp32
//            offset = mean(absmax). Decoded absmax = code[q]*absmax2 + offset,
//            each operation rounded to fp32 in that order.
#pragma once

#include <cstdint>
#include <string>

#include "q4/common.h"
#include "q4/formats.h"

namespace q4 {

// a * b for element counts: -1 when either is negative, the product
// overflows int64, or it exceeds kMaxElements (host code only).
inline int64_t checked_count(int64_t a, int64_t b) {
  int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r) || r > kMaxElements) return -1;
  return r;
}

struct Status {
  StatusCode code = kOk;
  std::string message;
  bool ok() const { return code == kOk; }
  static Status Ok() { return {}; }
  static Status Invalid(std::string m) { return {kInvalidArgument, std::move(m)}; }
};

struct Quantize4bitParams {
  const void* x = nullptr;  // [n] of x_dtype (fp32 / fp16 / bf16)
  DType x_dtype = kF32;
  int64_t n = 0;
  int64_t blocksize = 64;  // power of two in [32, 4096]
  QuantType quant_type = kNF4;
  uint8_t* packed = nullptr;  // [packed_size] == ceil(n/2)
  int64_t packed_size = 0;
  float* absmax = nullptr;  // [absmax_size] == ceil(n/blocksize)
  int64_t absmax_size = 0;
};

struct Dequantize4bitParams {
  const uint8_t* packed = nullptr;  // [packed_size] == ceil(n/2)
  int64_t packed_size = 0;
  const float* absmax = nullptr;  // [absmax_size] == ceil(n/blocksize)
  int64_t absmax_size = 0;
  int64_t n = 0;
  int64_t blocksize = 64;
  QuantType quant_type = kNF4;
  void* out = nullptr;  // [n] of out_dtype
  DType out_dtype = kF32;
};

struct QuantizeBlockwiseParams {
  const void* x = nullptr;  // [n] fp32 / fp16 / bf16
  DType x_dtype = kF32;
  int64_t n = 0;
  int64_t blocksize = 256;
  const float* code = nullptr;  // [256] sorted ascending; null = dynamic map
  uint8_t* codes = nullptr;     // [codes_size] == n
  int64_t codes_size = 0;
  float* absmax = nullptr;  // [absmax_size] == ceil(n/blocksize)
  int64_t absmax_size = 0;
};

struct DequantizeBlockwiseParams {
  const uint8_t* codes = nullptr;  // [n]
  int64_t n = 0;
  const float* absmax = nullptr;  // [absmax_size] == ceil(n/blocksize)
  int64_t absmax_size = 0;
  int64_t blocksize = 256;
  const float* code = nullptr;  // [256]; null = dynamic map
  bool add_offset = false;      // nested absmax: out = fp32(code[q]*absmax) + offset
  float offset = 0.0f;
  void* out = nullptr;  // [n] of out_dtype
  DType out_dtype = kF32;
};

// Nested quantization of a 4-bit absmax vector: offset = mean(absmax)
// (accumulated in fp64, rounded once), then 8-bit blockwise quantization of
// fp32(absmax - offset) with block 256 and the dynamic map.
struct QuantizeNestedParams {
  const float* absmax = nullptr;  // [n_blocks]
  int64_t n_blocks = 0;
  uint8_t* codes = nullptr;  // [n_blocks]
  float* absmax2 = nullptr;  // [absmax2_size] == ceil(n_blocks/256)
  int64_t absmax2_size = 0;
  float* offset = nullptr;  // [1]
};

// ------------------------------------------------------------ fused matmuls
//
// A 4-bit weight W [n, k] (row-major, flattened for blocking) is packed as in
// quantize_4bit; its per-block scales are plain fp32 or nested.
struct Absmax4 {
  const float* absmax = nullptr;             // plain: [n_blocks]; null when nested
  const uint8_t* nested_codes = nullptr;     // nested: [n_blocks] 8-bit codes
  const float* nested_absmax = nullptr;      // nested: [ceil(n_blocks/256)]
  const float* nested_code = nullptr;        // nested: [256] code book; null = dynamic map
  float nested_offset = 0.0f;                // nested: used when nested_offset_ptr is null
  const float* nested_offset_ptr = nullptr;  // nested: offset in the kernel's memory (XLA buffers)
  int64_t n_blocks = 0;                      // number of entries in absmax / nested_codes
  int64_t nested_absmax_size = 0;
  bool nested() const { return nested_codes != nullptr; }
};

// Y[m, n] = sum_k X[m, k] * W[n, k] (+ bias[n]), accumulated in fp32; the
// dequantized weight is never materialised (tiles are decoded into
// registers / a small buffer and used at once). Each W element is
// decode(nibble) * absmax, the value dequantize_4bit returns in fp32.
struct Gemm4bitParams {
  const void* x = nullptr;  // [m, k] row-major, x_dtype
  DType x_dtype = kF32;
  int64_t m = 0, n = 0, k = 0;
  const uint8_t* packed = nullptr;  // [packed_size] == ceil(n*k/2)
  int64_t packed_size = 0;
  Absmax4 scales;  // n_blocks == ceil(n*k/blocksize)
  int64_t blocksize = 64;
  QuantType quant_type = kNF4;
  const void* bias = nullptr;  // [n] of bias_dtype, or null
  DType bias_dtype = kF32;
  void* out = nullptr;  // [m, n] of out_dtype
  DType out_dtype = kF32;
};

// dX[m, k] = sum_n dY[m, n] * W[n, k]: the input gradient of the layer above.
struct Gemm4bitGradInputParams {
  const void* grad_out = nullptr;  // dY [m, n] row-major
  DType grad_out_dtype = kF32;
  int64_t m = 0, n = 0, k = 0;
  const uint8_t* packed = nullptr;
  int64_t packed_size = 0;
  Absmax4 scales;
  int64_t blocksize = 64;
  QuantType quant_type = kNF4;
  void* grad_input = nullptr;  // dX [m, k] of grad_input_dtype
  DType grad_input_dtype = kF32;
};

// LLM.int8 row-wise ("vector-wise") quantization of x [rows, cols], bit-exact
// with the reference implementation:
//   outlier elements: |x| >= threshold (threshold > 0), compared after
//   rounding threshold to x's dtype; outlier columns: any outlier element in
//   the column (written to outlier_cols as 0/1 if given).
//   row_stats[r] = max |x[r, c]| over the non-outlier elements of row r;
//   q[r, c] = round_half_even(x[r, c] * fp32(fp32(1 / row_stats[r]) * 127)),
//   clamped to [-127, 127], 0 where the product is NaN, for outlier elements,
//   for every element of an outlier column when rows > 1, and for a row whose
//   row_stats is 0.
struct Int8QuantizeRowsParams {
  const void* x = nullptr;  // [rows, cols]
  DType x_dtype = kF32;
  int64_t rows = 0, cols = 0;
  float threshold = 0.0f;
  int8_t* q = nullptr;              // [rows, cols]
  float* row_stats = nullptr;       // [rows]
  uint8_t* outlier_cols = nullptr;  // [cols] or null
};

// LLM.int8 linear with an int8 weight CB [n, k] and per-row scales SCB [n]
// (W ~= CB * SCB / 127):
//   X is quantized row-wise (Int8QuantizeRows with `threshold`);
//   Y = (Xq . CB^T) * row_stats[m] * SCB[n] / 127^2           (int32 accumulation)
//     + X[:, outlier cols] . (CB[:, outlier cols] * SCB / 127)^T (fp32, X unquantized)
//     (+ bias).  threshold 0: no outlier part.
struct Int8LinearParams {
  const void* x = nullptr;  // [m, k]
  DType x_dtype = kF32;
  int64_t m = 0, n = 0, k = 0;
  const int8_t* weight = nullptr;       // CB [n, k]
  const float* weight_scale = nullptr;  // SCB [n]
  float threshold = 0.0f;
  const void* bias = nullptr;  // [n] or null
  DType bias_dtype = kF32;
  void* out = nullptr;  // [m, n]
  DType out_dtype = kF32;
};

// dX[m, k] = sum_n dY[m, n] * CB[n, k] * SCB[n] / 127 (fp32 accumulation).
struct Int8GradInputParams {
  const void* grad_out = nullptr;  // [m, n]
  DType grad_out_dtype = kF32;
  int64_t m = 0, n = 0, k = 0;
  const int8_t* weight = nullptr;
  const float* weight_scale = nullptr;
  void* grad_input = nullptr;  // [m, k]
  DType grad_input_dtype = kF32;
};

// One step of a blockwise 8-bit optimizer (q4/optim8.h: the state layout, the
// per-element arithmetic and its rounding), fused: per block of 256 elements
// the states are decoded, the parameter and states updated in fp32, the
// parameter written back in its dtype (rounded to nearest even) and the states
// re-quantized (new absmax, 8-bit codes through the map's bin table), in one
// pass. State bytes and parameter bits are those of the reference's CPU step
// (bitsandbytes 0.50.2) wherever its square root is correctly rounded, and do
// not depend on the ISA level or thread count.
// A block whose gradient holds a NaN or infinity is left unchanged (parameter,
// codes and absmax) and counted in *skipped_blocks: a non-finite gradient never
// reaches the state.
struct Optim8bitParams {
  int32_t optimizer = 0;  // optim8::Kind: 0 adam, 1 momentum, 2 lion, 3 rmsprop
  void* param = nullptr;  // [n] fp32 / fp16 / bf16, updated in place
  DType param_dtype = kF32;
  const void* grad = nullptr;  // [n] fp32 / fp16 / bf16
  DType grad_dtype = kF32;
  int64_t n = 0;
  uint8_t* state1 = nullptr;     // [n] codes in qmap1
  float* absmax1 = nullptr;      // [absmax_size]
  const float* qmap1 = nullptr;  // [256] sorted ascending (host memory for the CPU)
  uint8_t* state2 = nullptr;     // [n], adam only (else null)
  float* absmax2 = nullptr;      // [absmax_size], adam only
  const float* qmap2 = nullptr;  // [256], adam only
  int64_t absmax_size = 0;       // == ceil(n / 256)
  int64_t step = 1;              // 1 for the first step
  double lr = 0.0, beta1 = 0.0, beta2 = 0.0, eps = 0.0, weight_decay = 0.0, gnorm_scale = 1.0;
  // Optional, in the kernel's memory (XLA passes them as buffers): when set,
  // *step_ptr replaces step and lr is multiplied by *lr_scale_ptr (in fp64).
  const int32_t* step_ptr = nullptr;
  const float* lr_scale_ptr = nullptr;
  int32_t* skipped_blocks = nullptr;  // [1] or null; set to the count (CUDA: device memory)
  // [n] fp32 or null. When set, param is only read, and update[i] receives the
  // fp32 u with fp32(param[i] + u) == the new parameter (rounded to the
  // parameter's dtype), optim8::update_to: for a framework that applies
  // updates itself (optax). A skipped block's update is 0. May be the fp32
  // gradient's own buffer (each gradient element is read before its update
  // is written).
  float* update = nullptr;
};

namespace cpu {
Status gemm_4bit(const Gemm4bitParams& p);
Status gemm_4bit_w4a8(const Gemm4bitParams& p);  // contract in q4/w4a8.h
Status gemm_4bit_grad_input(const Gemm4bitGradInputParams& p);
Status int8_quantize_rows(const Int8QuantizeRowsParams& p);
Status int8_linear(const Int8LinearParams& p);
Status int8_grad_input(const Int8GradInputParams& p);
Status quantize_4bit(const Quantize4bitParams& p);
// The 'mse' scale of each of n_blocks full fp32 blocks of x (contiguous):
// the candidate fp32(absmax * (32 - j) / 32), j = 0..15, with the smallest
// squared error of its nearest-code encoding, summed in a fixed order
// (cpu/quant4.cc); ties keep the larger scale; a block whose absmax is 0,
// NaN or inf keeps it. The scalar and AVX2 paths give the same bits.
Status search_scales_4bit(const float* x, int64_t n_blocks, int64_t blocksize, int32_t quant_type, float* scales);
// The nibbles of n_blocks full fp32 blocks with given scales: encode(x *
// fp32(1 / floor(scales[b]))), packed as quantize_4bit packs them.
Status encode_4bit(const float* x, int64_t n_blocks, int64_t blocksize, int32_t quant_type, const float* scales,
                   uint8_t* packed);
Status dequantize_4bit(const Dequantize4bitParams& p);
Status quantize_blockwise(const QuantizeBlockwiseParams& p);
Status dequantize_blockwise(const DequantizeBlockwiseParams& p);
Status quantize_nested(const QuantizeNestedParams& p);
Status optimizer_update_8bit(const Optim8bitParams& p);
}  // namespace cpu

#if defined(Q4_WITH_CUDA)
namespace cuda {
// Same contracts; every pointer is device memory, work is enqueued on `stream`
// (a cudaStream_t) and not synchronised. quantize_nested writes offset on device.
Status quantize_4bit(const Quantize4bitParams& p, void* stream);
Status dequantize_4bit(const Dequantize4bitParams& p, void* stream);
Status quantize_blockwise(const QuantizeBlockwiseParams& p, void* stream);
Status dequantize_blockwise(const DequantizeBlockwiseParams& p, void* stream);
Status quantize_nested(const QuantizeNestedParams& p, void* stream);
// dequantize_blockwise with the offset read from device memory (XLA passes it
// as a buffer); offset == nullptr means no offset.
Status dequantize_blockwise_device_offset(const DequantizeBlockwiseParams& p, const float* offset, void* stream);
Status gemm_4bit(const Gemm4bitParams& p, void* stream);
Status gemm_4bit_w4a8(const Gemm4bitParams& p, void* stream);
Status gemm_4bit_grad_input(const Gemm4bitGradInputParams& p, void* stream);
Status int8_quantize_rows(const Int8QuantizeRowsParams& p, void* stream);
Status int8_linear(const Int8LinearParams& p, void* stream);
Status int8_grad_input(const Int8GradInputParams& p, void* stream);
Status optimizer_update_8bit(const Optim8bitParams& p, void* stream);
}  // namespace cuda
#endif

// Argument checks shared by the CPU and CUDA ops (kernels/validate.cc).
// quant_type: a format of q4/formats.h ("quant_type must be 0 (nf4) or 1 (fp4), got ...").
Status validate_quant_type(int64_t quant_type);
Status validate(const Gemm4bitParams& p);
// validate(p), and k a multiple of W4A8's activation block (q4/w4a8.h)
Status validate_w4a8(const Gemm4bitParams& p);
Status validate(const Gemm4bitGradInputParams& p);
Status validate(const Int8QuantizeRowsParams& p);
Status validate(const Int8LinearParams& p);
Status validate(const Int8GradInputParams& p);
Status validate(const Quantize4bitParams& p);
Status validate(const Dequantize4bitParams& p);
Status validate(const QuantizeBlockwiseParams& p);
Status validate(const DequantizeBlockwiseParams& p);
Status validate(const QuantizeNestedParams& p);
// Host-side values only (sizes, pointers, hyperparameters); the CPU op also
// checks that the maps are sorted.
Status validate(const Optim8bitParams& p);
// A host-memory code book must be sorted ascending (null = dynamic map).
Status validate_code_book(const float* code);

// Runtime configuration of the CPU kernels. ISA levels, each implying the
// ones below it (kernels/cpu/dispatch.h): scalar; avx2 (+FMA, F16C); avx512
// (F, BW, VL: 512-bit fp32 kernels); avx512_bf16 (+AVX512_BF16 and
// AVX512_VNNI: bf16 dot products for bf16 inputs). The default is the best
// level the processor and the OS support.
//
// The levels, lowest first, one row each: X(name, Name) gives Isa value
// kIsa<Name> (its index: the C ABI's isa code) and the name Q4_ISA /
// q4.set_cpu_isa take; Python reads the names through q4_cpu_isa_names().
#define Q4_ISA_LEVELS(X)     \
  X(scalar, Scalar)          \
  X(avx2, Avx2)              \
  X(avx512, Avx512)          \
  X(avx512_bf16, Avx512Bf16) \
  X(amx, Amx)
enum Isa : int32_t {
#define Q4_ISA_ENUM(name, Name) kIsa##Name,
  Q4_ISA_LEVELS(Q4_ISA_ENUM)
#undef Q4_ISA_ENUM
      kIsaLevels
};
Isa cpu_isa();                          // active level
const char* cpu_isa_name(int32_t isa);  // "scalar", ..., or "" if out of range
bool cpu_has_isa(int32_t isa);          // whether the processor and the OS support level isa
bool cpu_has_avx2();                    // what the processor supports
bool cpu_has_avx512();
bool cpu_has_avx512_bf16();
bool cpu_has_amx();               // the amx level: AMX-TILE/BF16/INT8 and the OS permission for tile data
Status set_cpu_isa(int32_t isa);  // force one (scalar always; others if supported)
// Detected features, the active level, each op's kernel chain and the kernel
// each op last ran, as a JSON object.
std::string cpu_features_json();
// The L1 data cache size the kernels tune their blocking for: env
// Q4_L1D_BYTES (a positive byte count; the Python loader refuses anything
// else), else the OS's figure (sysconf), else 32 KiB. Read once.
int64_t cpu_l1d_bytes();
int cpu_num_threads();
void set_cpu_num_threads(int n);  // n <= 0: back to the default

// Running the CPU kernels' threads on the host framework's own workers, so
// that two thread pools do not compete for the cores (a pool that spins
// after its work, as OpenMP's and Eigen's do, takes the cores from a second
// one). Both are plain C callbacks: the library stays framework-free.
//
// A fork-join entry point with the OpenMP runtime's GOMP_parallel signature:
// fork_join(fn, data, num_threads, 0) runs fn(data) on num_threads threads
// (the caller's included) and returns when all are done. Process-wide;
// nullptr goes back to q4's own pool.
using ForkJoinFn = void (*)(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags);
void set_cpu_fork_join(ForkJoinFn fn);
ForkJoinFn cpu_fork_join();

// A task scheduler for the current thread only (e.g. XLA's intra-op pool
// during a custom call): schedule(ctx, task, data) runs task(data) later on
// one of num_threads workers. Installed for the lifetime of the object;
// takes precedence over the fork-join entry point and q4's own pool.
struct TaskScheduler {
  void* ctx = nullptr;
  void (*schedule)(void* ctx, void (*task)(void*), void* data) = nullptr;
  int num_threads = 0;
};
class ScopedTaskScheduler {
 public:
  explicit ScopedTaskScheduler(const TaskScheduler& s);
  ~ScopedTaskScheduler();
  ScopedTaskScheduler(const ScopedTaskScheduler&) = delete;
  ScopedTaskScheduler& operator=(const ScopedTaskScheduler&) = delete;

 private:
  const TaskScheduler* saved_;
  TaskScheduler own_;
};

}  // namespace q4
