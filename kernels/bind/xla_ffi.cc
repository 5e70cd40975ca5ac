// XLA FFI handlers (CPU) for the q4 ops: the bindings and batched bodies of
// xla_ffi_batched.h, each item run by q4::cpu::<op>. Registered from Python
// with jax.ffi.register_ffi_target(..., platform="cpu").
#include "c_api.h"
#include "q4/kernels.h"
#include "xla_ffi_batched.h"

namespace q4 {
namespace xla_bind {
namespace {

ffi::Error Quantize4bit(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::U8>> packed,
                        ffi::Result<ffi::Buffer<ffi::F32>> absmax, int64_t n, int64_t blocksize, int64_t quant_type) {
  return quantize_4bit_batched(x, packed, absmax, n, blocksize, quant_type,
                               [](const Quantize4bitParams& p) { return cpu::quantize_4bit(p); });
}

ffi::Error Dequantize4bit(ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::F32> absmax, ffi::Result<ffi::AnyBuffer> out,
                          int64_t n, int64_t blocksize, int64_t quant_type) {
  return dequantize_4bit_batched(packed, absmax, out, n, blocksize, quant_type,
                                 [](const Dequantize4bitParams& p) { return cpu::dequantize_4bit(p); });
}

ffi::Error QuantizeBlockwise(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> code, ffi::Result<ffi::Buffer<ffi::U8>> codes,
                             ffi::Result<ffi::Buffer<ffi::F32>> absmax, int64_t n, int64_t blocksize) {
  return quantize_blockwise_batched(x, code, codes, absmax, n, blocksize,
                                    [](const QuantizeBlockwiseParams& p) { return cpu::quantize_blockwise(p); });
}

ffi::Error DequantizeBlockwise(ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> absmax, ffi::Buffer<ffi::F32> code,
                               ffi::Buffer<ffi::F32> offset, ffi::Result<ffi::AnyBuffer> out, int64_t n,
                               int64_t blocksize, int64_t add_offset) {
  return dequantize_blockwise_batched(codes, absmax, code, offset, out, n, blocksize, add_offset,
                                      [](DequantizeBlockwiseParams p, const float* offset) {
                                        if (offset != nullptr) p.offset = *offset;  // host memory on CPU
                                        return cpu::dequantize_blockwise(p);
                                      });
}

ffi::Error QuantizeNested(ffi::Buffer<ffi::F32> absmax, ffi::Result<ffi::Buffer<ffi::U8>> codes,
                          ffi::Result<ffi::Buffer<ffi::F32>> absmax2, ffi::Result<ffi::Buffer<ffi::F32>> offset,
                          int64_t n_blocks) {
  return quantize_nested_batched(absmax, codes, absmax2, offset, n_blocks,
                                 [](const QuantizeNestedParams& p) { return cpu::quantize_nested(p); });
}

}  // namespace
}  // namespace xla_bind
}  // namespace q4

namespace xb = q4::xla_bind;

Q4_FFI_HANDLER(q4_ffi_quantize_4bit)
XLA_FFI_DEFINE_HANDLER_SYMBOL(q4_ffi_quantize_4bit, xb::Quantize4bit, xb::bind_quantize_4bit(xb::ffi::Ffi::Bind()));
Q4_FFI_HANDLER(q4_ffi_dequantize_4bit)
XLA_FFI_DEFINE_HANDLER_SYMBOL(q4_ffi_dequantize_4bit, xb::Dequantize4bit,
                              xb::bind_dequantize_4bit(xb::ffi::Ffi::Bind()));
Q4_FFI_HANDLER(q4_ffi_quantize_blockwise)
XLA_FFI_DEFINE_HANDLER_SYMBOL(q4_ffi_quantize_blockwise, xb::QuantizeBlockwise,
                              xb::bind_quantize_blockwise(xb::ffi::Ffi::Bind()));
Q4_FFI_HANDLER(q4_ffi_dequantize_blockwise)
XLA_FFI_DEFINE_HANDLER_SYMBOL(q4_ffi_dequantize_blockwise, xb::DequantizeBlockwise,
                              xb::bind_dequantize_blockwise(xb::ffi::Ffi::Bind()));
Q4_FFI_HANDLER(q4_ffi_quantize_nested)
XLA_FFI_DEFINE_HANDLER_SYMBOL(q4_ffi_quantize_nested, xb::QuantizeNested,
                              xb::bind_quantize_nested(xb::ffi::Ffi::Bind()));
