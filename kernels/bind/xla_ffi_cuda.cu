// XLA FFI handlers (CUDA) for the q4 ops: the same bindings and batched
// bodies as the CPU handlers (xla_ffi_batched.h), with the platform stream as
// the first binding and each item enqueued by q4::cuda::<op>(params, stream).
// Every buffer is device memory and nothing is read back on the host: the
// nested offsets of dequantize_blockwise and of the fused matmuls are read by
// the kernels.
#include <cuda_runtime.h>

#include "c_api.h"
#include "q4/kernels.h"
#include "xla_ffi_batched.h"

namespace q4 {
namespace xla_bind {
namespace {

using Stream = ffi::PlatformStream<cudaStream_t>;

namespace device {  // the handlers, one per op of c_api_ops.inc

ffi::Error quantize_4bit(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::U8>> packed,
                         ffi::Result<ffi::Buffer<ffi::F32>> absmax, int64_t n, int64_t blocksize, int64_t quant_type) {
  return quantize_4bit_batched(x, packed, absmax, n, blocksize, quant_type,
                               [&](const Quantize4bitParams& p) { return cuda::quantize_4bit(p, stream); });
}

ffi::Error dequantize_4bit(cudaStream_t stream, ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::F32> absmax,
                           ffi::Result<ffi::AnyBuffer> out, int64_t n, int64_t blocksize, int64_t quant_type) {
  return dequantize_4bit_batched(packed, absmax, out, n, blocksize, quant_type,
                                 [&](const Dequantize4bitParams& p) { return cuda::dequantize_4bit(p, stream); });
}

ffi::Error quantize_blockwise(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> code,
                              ffi::Result<ffi::Buffer<ffi::U8>> codes, ffi::Result<ffi::Buffer<ffi::F32>> absmax,
                              int64_t n, int64_t blocksize) {
  return quantize_blockwise_batched(x, code, codes, absmax, n, blocksize, [&](const QuantizeBlockwiseParams& p) {
    return cuda::quantize_blockwise(p, stream);
  });
}

ffi::Error dequantize_blockwise(cudaStream_t stream, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> absmax,
                                ffi::Buffer<ffi::F32> code, ffi::Buffer<ffi::F32> offset,
                                ffi::Result<ffi::AnyBuffer> out, int64_t n, int64_t blocksize, int64_t add_offset) {
  return dequantize_blockwise_batched(codes, absmax, code, offset, out, n, blocksize, add_offset,
                                      [&](const DequantizeBlockwiseParams& p, const float* offset_on_device) {
                                        return cuda::dequantize_blockwise_device_offset(p, offset_on_device, stream);
                                      });
}

ffi::Error quantize_nested(cudaStream_t stream, ffi::Buffer<ffi::F32> absmax, ffi::Result<ffi::Buffer<ffi::U8>> codes,
                           ffi::Result<ffi::Buffer<ffi::F32>> absmax2, ffi::Result<ffi::Buffer<ffi::F32>> offset,
                           int64_t n_blocks) {
  return quantize_nested_batched(absmax, codes, absmax2, offset, n_blocks,
                                 [&](const QuantizeNestedParams& p) { return cuda::quantize_nested(p, stream); });
}

ffi::Error gemm_4bit(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> packed, ffi::AnyBuffer absmax,
                     ffi::Buffer<ffi::F32> nested_absmax, ffi::Buffer<ffi::F32> nested_offset, ffi::AnyBuffer bias,
                     ffi::Result<ffi::AnyBuffer> out, int64_t n, int64_t k, int64_t blocksize, int64_t quant_type,
                     int64_t nested) {
  return gemm_4bit_batched(x, packed, absmax, nested_absmax, nested_offset, bias, out, n, k, blocksize, quant_type,
                           nested, [&](const Gemm4bitParams& p) { return cuda::gemm_4bit(p, stream); });
}

ffi::Error gemm_4bit_w4a8(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> packed, ffi::AnyBuffer absmax,
                          ffi::Buffer<ffi::F32> nested_absmax, ffi::Buffer<ffi::F32> nested_offset, ffi::AnyBuffer bias,
                          ffi::Result<ffi::AnyBuffer> out, int64_t n, int64_t k, int64_t blocksize, int64_t quant_type,
                          int64_t nested) {
  return gemm_4bit_batched(x, packed, absmax, nested_absmax, nested_offset, bias, out, n, k, blocksize, quant_type,
                           nested, [&](const Gemm4bitParams& p) { return cuda::gemm_4bit_w4a8(p, stream); });
}

ffi::Error gemm_4bit_grad_input(cudaStream_t stream, ffi::AnyBuffer grad_out, ffi::Buffer<ffi::U8> packed,
                                ffi::AnyBuffer absmax, ffi::Buffer<ffi::F32> nested_absmax,
                                ffi::Buffer<ffi::F32> nested_offset, ffi::Result<ffi::AnyBuffer> grad_input, int64_t n,
                                int64_t k, int64_t blocksize, int64_t quant_type, int64_t nested) {
  return gemm_4bit_grad_input_batched(
      grad_out, packed, absmax, nested_absmax, nested_offset, grad_input, n, k, blocksize, quant_type, nested,
      [&](const Gemm4bitGradInputParams& p) { return cuda::gemm_4bit_grad_input(p, stream); });
}

ffi::Error int8_quantize_rows(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::S8>> q,
                              ffi::Result<ffi::Buffer<ffi::F32>> row_stats, int64_t cols) {
  return int8_quantize_rows_batched(
      x, q, row_stats, cols, [&](const Int8QuantizeRowsParams& p) { return cuda::int8_quantize_rows(p, stream); });
}

ffi::Error int8_linear(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S8> weight, ffi::Buffer<ffi::F32> scale,
                       ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out, int64_t n, int64_t k, float threshold) {
  return int8_linear_batched(x, weight, scale, bias, out, n, k, threshold,
                             [&](const Int8LinearParams& p) { return cuda::int8_linear(p, stream); });
}

ffi::Error int8_grad_input(cudaStream_t stream, ffi::AnyBuffer grad_out, ffi::Buffer<ffi::S8> weight,
                           ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::AnyBuffer> grad_input, int64_t n, int64_t k) {
  return int8_grad_input_batched(grad_out, weight, scale, grad_input, n, k,
                                 [&](const Int8GradInputParams& p) { return cuda::int8_grad_input(p, stream); });
}

ffi::Error optimizer_update_8bit(cudaStream_t stream, ffi::AnyBuffer param, ffi::AnyBuffer grad,
                                 ffi::Buffer<ffi::U8> state1, ffi::Buffer<ffi::F32> absmax1,
                                 ffi::Buffer<ffi::U8> state2, ffi::Buffer<ffi::F32> absmax2,
                                 ffi::Buffer<ffi::F32> qmap1, ffi::Buffer<ffi::F32> qmap2, ffi::Buffer<ffi::S32> step,
                                 ffi::Buffer<ffi::F32> lr_scale, ffi::Result<ffi::Buffer<ffi::F32>> update,
                                 ffi::Result<ffi::Buffer<ffi::U8>> state1_out,
                                 ffi::Result<ffi::Buffer<ffi::F32>> absmax1_out,
                                 ffi::Result<ffi::Buffer<ffi::U8>> state2_out,
                                 ffi::Result<ffi::Buffer<ffi::F32>> absmax2_out,
                                 ffi::Result<ffi::Buffer<ffi::S32>> skipped, int64_t optimizer, double lr, double beta1,
                                 double beta2, double eps, double weight_decay, double gnorm_scale) {
  return optimizer_update_8bit_ffi(
      param, grad, state1, absmax1, state2, absmax2, qmap1, qmap2, step, lr_scale, update, state1_out, absmax1_out,
      state2_out, absmax2_out, skipped, optimizer, lr, beta1, beta2, eps, weight_decay, gnorm_scale,
      [&](void* dst, const void* src, int64_t bytes) {
        if (dst != src && bytes > 0 &&
            cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDeviceToDevice, stream) != cudaSuccess)
          return ffi::Error(ffi::ErrorCode::kInternal, "optimizer_update_8bit: copying an unaliased operand failed");
        return ffi::Error::Success();
      },
      [&](const Optim8bitParams& p) { return cuda::optimizer_update_8bit(p, stream); });
}

}  // namespace device
}  // namespace
}  // namespace xla_bind
}  // namespace q4

namespace xb = q4::xla_bind;
#define Q4_CUDA_BIND() xb::ffi::Ffi::Bind().Ctx<xb::Stream>()

#define Q4_OP(name, params, args)    \
  Q4_FFI_HANDLER(q4_ffi_cuda_##name) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(q4_ffi_cuda_##name, xb::device::name, xb::bind_##name(Q4_CUDA_BIND()));
#include "c_api_ops.inc"
#undef Q4_OP
