// XLA FFI handlers (CUDA) for the q4 ops: the twins of xla_ffi.cc with the
// same bindings, attributes and batch semantics (the buffers hold `batch`
// independent items of the per-item sizes given by the attributes; the op is
// enqueued once per item), plus the platform stream as the first binding.
// Every buffer is device memory and nothing is read back on the host: the
// nested offset of dequantize_blockwise is read by the kernel.
//
// Layers: a typed Impl over ffi buffers -> the params struct of q4/kernels.h
// -> q4::cuda::<op>(params, stream). Attributes are int64 (a Python int is S64).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "c_api.h"
#include "q4/kernels.h"
#include "q4/packing.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace q4 {
namespace xla_cuda_bind {
namespace {

ffi::Error to_ffi(const Status& s) {
  switch (s.code) {
    case kOk: return ffi::Error::Success();
    case kInvalidArgument: return ffi::Error(ffi::ErrorCode::kInvalidArgument, s.message);
    case kUnsupported: return ffi::Error(ffi::ErrorCode::kUnimplemented, s.message);
    default: return ffi::Error(ffi::ErrorCode::kInternal, s.message);
  }
}

ffi::Error invalid(const std::string& m) { return ffi::Error(ffi::ErrorCode::kInvalidArgument, m); }

bool dtype_of(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = kF32; return true;
    case ffi::DataType::F16: *out = kF16; return true;
    case ffi::DataType::BF16: *out = kBF16; return true;
    default: return false;
  }
}
int64_t elem_bytes(DType d) { return d == kF32 ? 4 : 2; }

// Number of items in a buffer of `count` elements holding items of `per_item`.
ffi::Error batch_of(const char* what, int64_t count, int64_t per_item, int64_t* batch) {
  if (per_item <= 0 || count % per_item != 0)
    return invalid(std::string(what) + " has " + std::to_string(count) + " elements, not a multiple of " +
                   std::to_string(per_item));
  *batch = count / per_item;
  return ffi::Error::Success();
}

ffi::Error same_batch(const char* what, int64_t got, int64_t want) {
  if (got != want)
    return invalid(std::string(what) + " holds " + std::to_string(got) + " items, expected " + std::to_string(want));
  return ffi::Error::Success();
}

#define Q4_FFI_CHECK(expr)       \
  do {                           \
    ffi::Error _e = (expr);      \
    if (_e.failure()) return _e; \
  } while (0)

ffi::Error Quantize4bitImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::U8>> packed,
                            ffi::Result<ffi::Buffer<ffi::F32>> absmax, int64_t n, int64_t blocksize,
                            int64_t quant_type) {
  Quantize4bitParams p;
  if (!dtype_of(x.element_type(), &p.x_dtype))
    return invalid("quantize_4bit input must be float32, float16 or bfloat16");
  p.n = n;
  p.blocksize = blocksize;
  p.quant_type = static_cast<QuantType>(quant_type);
  p.packed_size = packed_bytes(n);
  p.absmax_size = blocksize > 0 ? ceil_div(n, blocksize) : 0;
  Q4_FFI_CHECK(to_ffi(validate(Quantize4bitParams{x.untyped_data(), p.x_dtype, n, blocksize, p.quant_type,
                                                  packed->typed_data(), p.packed_size, absmax->typed_data(),
                                                  p.absmax_size})));
  int64_t batch = 0, b2 = 0, b3 = 0;
  Q4_FFI_CHECK(batch_of("input", x.element_count(), n, &batch));
  Q4_FFI_CHECK(batch_of("packed output", packed->element_count(), p.packed_size, &b2));
  Q4_FFI_CHECK(batch_of("absmax output", absmax->element_count(), p.absmax_size, &b3));
  Q4_FFI_CHECK(same_batch("packed output", b2, batch));
  Q4_FFI_CHECK(same_batch("absmax output", b3, batch));
  const char* xb = static_cast<const char*>(x.untyped_data());
  for (int64_t i = 0; i < batch; ++i) {
    p.x = xb + i * n * elem_bytes(p.x_dtype);
    p.packed = packed->typed_data() + i * p.packed_size;
    p.absmax = absmax->typed_data() + i * p.absmax_size;
    Q4_FFI_CHECK(to_ffi(cuda::quantize_4bit(p, stream)));
  }
  return ffi::Error::Success();
}

ffi::Error Dequantize4bitImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::F32> absmax,
                              ffi::Result<ffi::AnyBuffer> out, int64_t n, int64_t blocksize, int64_t quant_type) {
  Dequantize4bitParams p;
  if (!dtype_of(out->element_type(), &p.out_dtype))
    return invalid("dequantize_4bit output must be float32, float16 or bfloat16");
  p.n = n;
  p.blocksize = blocksize;
  p.quant_type = static_cast<QuantType>(quant_type);
  p.packed_size = packed_bytes(n);
  p.absmax_size = blocksize > 0 ? ceil_div(n, blocksize) : 0;
  {
    Dequantize4bitParams v = p;
    v.packed = packed.typed_data();
    v.absmax = absmax.typed_data();
    v.out = out->untyped_data();
    Q4_FFI_CHECK(to_ffi(validate(v)));
  }
  int64_t batch = 0, b2 = 0, b3 = 0;
  Q4_FFI_CHECK(batch_of("output", out->element_count(), n, &batch));
  Q4_FFI_CHECK(batch_of("packed input", packed.element_count(), p.packed_size, &b2));
  Q4_FFI_CHECK(batch_of("absmax", absmax.element_count(), p.absmax_size, &b3));
  Q4_FFI_CHECK(same_batch("packed input", b2, batch));
  Q4_FFI_CHECK(same_batch("absmax", b3, batch));
  char* ob = static_cast<char*>(out->untyped_data());
  for (int64_t i = 0; i < batch; ++i) {
    p.packed = packed.typed_data() + i * p.packed_size;
    p.absmax = absmax.typed_data() + i * p.absmax_size;
    p.out = ob + i * n * elem_bytes(p.out_dtype);
    Q4_FFI_CHECK(to_ffi(cuda::dequantize_4bit(p, stream)));
  }
  return ffi::Error::Success();
}

ffi::Error QuantizeBlockwiseImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> code,
                                 ffi::Result<ffi::Buffer<ffi::U8>> codes, ffi::Result<ffi::Buffer<ffi::F32>> absmax,
                                 int64_t n, int64_t blocksize) {
  QuantizeBlockwiseParams p;
  if (!dtype_of(x.element_type(), &p.x_dtype))
    return invalid("quantize_blockwise input must be float32, float16 or bfloat16");
  if (code.element_count() % 256 != 0) return invalid("code book must hold 256 values");
  p.n = n;
  p.blocksize = blocksize;
  p.codes_size = n;
  p.absmax_size = blocksize > 0 ? ceil_div(n, blocksize) : 0;
  int64_t batch = 0, b2 = 0, b3 = 0, b4 = 0;
  Q4_FFI_CHECK(batch_of("input", x.element_count(), n, &batch));
  Q4_FFI_CHECK(batch_of("codes output", codes->element_count(), n, &b2));
  Q4_FFI_CHECK(batch_of("absmax output", absmax->element_count(), p.absmax_size, &b3));
  Q4_FFI_CHECK(batch_of("code book", code.element_count(), 256, &b4));
  Q4_FFI_CHECK(same_batch("codes output", b2, batch));
  Q4_FFI_CHECK(same_batch("absmax output", b3, batch));
  const char* xb = static_cast<const char*>(x.untyped_data());
  for (int64_t i = 0; i < batch; ++i) {
    p.x = xb + i * n * elem_bytes(p.x_dtype);
    p.code = code.typed_data() + (b4 == batch ? i * 256 : 0);
    p.codes = codes->typed_data() + i * n;
    p.absmax = absmax->typed_data() + i * p.absmax_size;
    Q4_FFI_CHECK(to_ffi(cuda::quantize_blockwise(p, stream)));
  }
  return ffi::Error::Success();
}

ffi::Error DequantizeBlockwiseImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> absmax,
                                   ffi::Buffer<ffi::F32> code, ffi::Buffer<ffi::F32> offset,
                                   ffi::Result<ffi::AnyBuffer> out, int64_t n, int64_t blocksize, int64_t add_offset) {
  DequantizeBlockwiseParams p;
  if (!dtype_of(out->element_type(), &p.out_dtype))
    return invalid("dequantize_blockwise output must be float32, float16 or bfloat16");
  p.n = n;
  p.blocksize = blocksize;
  p.absmax_size = blocksize > 0 ? ceil_div(n, blocksize) : 0;
  p.add_offset = add_offset != 0;
  int64_t batch = 0, b2 = 0, b3 = 0, b4 = 0, b5 = 0;
  Q4_FFI_CHECK(batch_of("output", out->element_count(), n, &batch));
  Q4_FFI_CHECK(batch_of("codes", codes.element_count(), n, &b2));
  Q4_FFI_CHECK(batch_of("absmax", absmax.element_count(), p.absmax_size, &b3));
  Q4_FFI_CHECK(batch_of("code book", code.element_count(), 256, &b4));
  Q4_FFI_CHECK(batch_of("offset", offset.element_count(), 1, &b5));
  Q4_FFI_CHECK(same_batch("codes", b2, batch));
  Q4_FFI_CHECK(same_batch("absmax", b3, batch));
  char* ob = static_cast<char*>(out->untyped_data());
  for (int64_t i = 0; i < batch; ++i) {
    p.codes = codes.typed_data() + i * n;
    p.absmax = absmax.typed_data() + i * p.absmax_size;
    p.code = code.typed_data() + (b4 == batch ? i * 256 : 0);
    p.out = ob + i * n * elem_bytes(p.out_dtype);
    const float* off = offset.typed_data() + (b5 == batch ? i : 0);  // device memory
    Q4_FFI_CHECK(to_ffi(cuda::dequantize_blockwise_device_offset(p, off, stream)));
  }
  return ffi::Error::Success();
}

ffi::Error QuantizeNestedImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> absmax,
                              ffi::Result<ffi::Buffer<ffi::U8>> codes, ffi::Result<ffi::Buffer<ffi::F32>> absmax2,
                              ffi::Result<ffi::Buffer<ffi::F32>> offset, int64_t n_blocks) {
  QuantizeNestedParams p;
  p.n_blocks = n_blocks;
  p.absmax2_size = n_blocks > 0 ? ceil_div(n_blocks, kNestedBlocksize) : 0;
  int64_t batch = 0, b2 = 0, b3 = 0, b4 = 0;
  Q4_FFI_CHECK(batch_of("absmax", absmax.element_count(), n_blocks, &batch));
  Q4_FFI_CHECK(batch_of("nested codes", codes->element_count(), n_blocks, &b2));
  Q4_FFI_CHECK(batch_of("nested absmax", absmax2->element_count(), p.absmax2_size, &b3));
  Q4_FFI_CHECK(batch_of("nested offset", offset->element_count(), 1, &b4));
  Q4_FFI_CHECK(same_batch("nested codes", b2, batch));
  Q4_FFI_CHECK(same_batch("nested absmax", b3, batch));
  Q4_FFI_CHECK(same_batch("nested offset", b4, batch));
  for (int64_t i = 0; i < batch; ++i) {
    p.absmax = absmax.typed_data() + i * n_blocks;
    p.codes = codes->typed_data() + i * n_blocks;
    p.absmax2 = absmax2->typed_data() + i * p.absmax2_size;
    p.offset = offset->typed_data() + i;  // written on device
    Q4_FFI_CHECK(to_ffi(cuda::quantize_nested(p, stream)));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace xla_cuda_bind
}  // namespace q4

// The handler symbols are looked up by name from Python (ctypes), so they
// need default visibility despite -fvisibility=hidden.
#define Q4_FFI_HANDLER(name) extern "C" Q4_API XLA_FFI_Error* name(XLA_FFI_CallFrame* call_frame);

Q4_FFI_HANDLER(q4_ffi_cuda_quantize_4bit)
XLA_FFI_DEFINE_HANDLER_SYMBOL(q4_ffi_cuda_quantize_4bit, q4::xla_cuda_bind::Quantize4bitImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<ffi::AnyBuffer>()                     // x: [batch * n] f32/f16/bf16
                                  .Ret<ffi::Buffer<ffi::U8>>()               // packed: [batch * ceil(n/2)]
                                  .Ret<ffi::Buffer<ffi::F32>>()              // absmax: [batch * ceil(n/bs)]
                                  .Attr<int64_t>("n")                        // elements per item
                                  .Attr<int64_t>("blocksize")                // power of two in [32, 4096]
                                  .Attr<int64_t>("quant_type"));             // 0 nf4, 1 fp4

Q4_FFI_HANDLER(q4_ffi_cuda_dequantize_4bit)
XLA_FFI_DEFINE_HANDLER_SYMBOL(q4_ffi_cuda_dequantize_4bit, q4::xla_cuda_bind::Dequantize4bitImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<ffi::Buffer<ffi::U8>>()               // packed: [batch * ceil(n/2)]
                                  .Arg<ffi::Buffer<ffi::F32>>()              // absmax: [batch * ceil(n/bs)]
                                  .Ret<ffi::AnyBuffer>()                     // out: [batch * n] f32/f16/bf16
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("blocksize")
                                  .Attr<int64_t>("quant_type"));

Q4_FFI_HANDLER(q4_ffi_cuda_quantize_blockwise)
XLA_FFI_DEFINE_HANDLER_SYMBOL(q4_ffi_cuda_quantize_blockwise, q4::xla_cuda_bind::QuantizeBlockwiseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<ffi::AnyBuffer>()                     // x: [batch * n]
                                  .Arg<ffi::Buffer<ffi::F32>>()              // code book: [256] or [batch * 256]
                                  .Ret<ffi::Buffer<ffi::U8>>()               // codes: [batch * n]
                                  .Ret<ffi::Buffer<ffi::F32>>()              // absmax: [batch * ceil(n/bs)]
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("blocksize"));

Q4_FFI_HANDLER(q4_ffi_cuda_dequantize_blockwise)
XLA_FFI_DEFINE_HANDLER_SYMBOL(q4_ffi_cuda_dequantize_blockwise, q4::xla_cuda_bind::DequantizeBlockwiseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<ffi::Buffer<ffi::U8>>()               // codes: [batch * n]
                                  .Arg<ffi::Buffer<ffi::F32>>()              // absmax: [batch * ceil(n/bs)]
                                  .Arg<ffi::Buffer<ffi::F32>>()              // code book: [256] or [batch * 256]
                                  .Arg<ffi::Buffer<ffi::F32>>()              // offset: [1] or [batch]
                                  .Ret<ffi::AnyBuffer>()                     // out: [batch * n]
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("blocksize")
                                  .Attr<int64_t>("add_offset"));             // 1: nested absmax decode

Q4_FFI_HANDLER(q4_ffi_cuda_quantize_nested)
XLA_FFI_DEFINE_HANDLER_SYMBOL(q4_ffi_cuda_quantize_nested, q4::xla_cuda_bind::QuantizeNestedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<ffi::Buffer<ffi::F32>>()              // absmax: [batch * n_blocks]
                                  .Ret<ffi::Buffer<ffi::U8>>()               // codes: [batch * n_blocks]
                                  .Ret<ffi::Buffer<ffi::F32>>()              // absmax2: [batch * ceil(n_blocks/256)]
                                  .Ret<ffi::Buffer<ffi::F32>>()              // offset: [batch]
                                  .Attr<int64_t>("n_blocks"));
