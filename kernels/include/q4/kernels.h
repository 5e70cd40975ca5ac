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

namespace q4 {

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

namespace cpu {
Status quantize_4bit(const Quantize4bitParams& p);
Status dequantize_4bit(const Dequantize4bitParams& p);
Status quantize_blockwise(const QuantizeBlockwiseParams& p);
Status dequantize_blockwise(const DequantizeBlockwiseParams& p);
Status quantize_nested(const QuantizeNestedParams& p);
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
}  // namespace cuda
#endif

// Argument checks shared by the CPU and CUDA ops (kernels/validate.cc).
Status validate(const Quantize4bitParams& p);
Status validate(const Dequantize4bitParams& p);
Status validate(const QuantizeBlockwiseParams& p);
Status validate(const DequantizeBlockwiseParams& p);
Status validate(const QuantizeNestedParams& p);
// A host-memory code book must be sorted ascending (null = dynamic map).
Status validate_code_book(const float* code);

// Runtime configuration of the CPU kernels.
enum Isa : int32_t { kIsaScalar = 0, kIsaAvx2 = 1 };
Isa cpu_isa();                    // active instruction set
bool cpu_has_avx2();              // what the processor supports
Status set_cpu_isa(int32_t isa);  // force one (scalar always; avx2 if supported)
int cpu_num_threads();
void set_cpu_num_threads(int n);  // n <= 0: back to the default

}  // namespace q4
