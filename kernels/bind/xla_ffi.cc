// XLA FFI handlers (CPU) for the q4 ops: the bindings and batched bodies of
// xla_ffi_batched.h, each item run by q4::cpu::<op>. Registered from Python
// with jax.ffi.register_ffi_target(..., platform="cpu").
#include <algorithm>
#include <cstring>

#include "c_api.h"
#include "q4/kernels.h"
#include "xla_ffi_batched.h"

namespace q4 {
namespace xla_bind {
namespace {

// Runs `body` with XLA's intra-op thread pool as the kernels' task scheduler,
// so their threads are XLA's own (no second pool competing for the cores).
template <typename F>
ffi::Error on_pool(ffi::ThreadPool& pool, F&& body) {
  TaskScheduler s;
  s.ctx = &pool;
  s.schedule = [](void* ctx, void (*task)(void*), void* data) {
    static_cast<ffi::ThreadPool*>(ctx)->Schedule([task, data] { task(data); });
  };
  s.num_threads = static_cast<int>(std::min<int64_t>(pool.num_threads(), cpu_num_threads()));
  ScopedTaskScheduler scoped(s);
  return body();
}

namespace host {  // the handlers, one per op of c_api_ops.inc

ffi::Error quantize_4bit(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::U8>> packed,
                         ffi::Result<ffi::Buffer<ffi::F32>> absmax, int64_t n, int64_t blocksize, int64_t quant_type) {
  return on_pool(pool, [&] {
    return quantize_4bit_batched(x, packed, absmax, n, blocksize, quant_type,
                                 [](const Quantize4bitParams& p) { return cpu::quantize_4bit(p); });
  });
}

ffi::Error dequantize_4bit(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::F32> absmax,
                           ffi::Result<ffi::AnyBuffer> out, int64_t n, int64_t blocksize, int64_t quant_type) {
  return on_pool(pool, [&] {
    return dequantize_4bit_batched(packed, absmax, out, n, blocksize, quant_type,
                                   [](const Dequantize4bitParams& p) { return cpu::dequantize_4bit(p); });
  });
}

ffi::Error quantize_blockwise(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> code,
                              ffi::Result<ffi::Buffer<ffi::U8>> codes, ffi::Result<ffi::Buffer<ffi::F32>> absmax,
                              int64_t n, int64_t blocksize) {
  return on_pool(pool, [&] {
    return quantize_blockwise_batched(x, code, codes, absmax, n, blocksize,
                                      [](const QuantizeBlockwiseParams& p) { return cpu::quantize_blockwise(p); });
  });
}

ffi::Error dequantize_blockwise(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> absmax,
                                ffi::Buffer<ffi::F32> code, ffi::Buffer<ffi::F32> offset,
                                ffi::Result<ffi::AnyBuffer> out, int64_t n, int64_t blocksize, int64_t add_offset) {
  return on_pool(pool, [&] {
    return dequantize_blockwise_batched(codes, absmax, code, offset, out, n, blocksize, add_offset,
                                        [](DequantizeBlockwiseParams p, const float* offset) {
                                          if (offset != nullptr) p.offset = *offset;  // host memory on CPU
                                          return cpu::dequantize_blockwise(p);
                                        });
  });
}

ffi::Error quantize_nested(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> absmax, ffi::Result<ffi::Buffer<ffi::U8>> codes,
                           ffi::Result<ffi::Buffer<ffi::F32>> absmax2, ffi::Result<ffi::Buffer<ffi::F32>> offset,
                           int64_t n_blocks) {
  return on_pool(pool, [&] {
    return quantize_nested_batched(absmax, codes, absmax2, offset, n_blocks,
                                   [](const QuantizeNestedParams& p) { return cpu::quantize_nested(p); });
  });
}

ffi::Error gemm_4bit(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> packed, ffi::AnyBuffer absmax,
                     ffi::Buffer<ffi::F32> nested_absmax, ffi::Buffer<ffi::F32> nested_offset, ffi::AnyBuffer bias,
                     ffi::Result<ffi::AnyBuffer> out, int64_t n, int64_t k, int64_t blocksize, int64_t quant_type,
                     int64_t nested) {
  return on_pool(pool, [&] {
    return gemm_4bit_batched(x, packed, absmax, nested_absmax, nested_offset, bias, out, n, k, blocksize, quant_type,
                             nested, [](const Gemm4bitParams& p) { return cpu::gemm_4bit(p); });
  });
}

ffi::Error gemm_4bit_w4a8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> packed, ffi::AnyBuffer absmax,
                          ffi::Buffer<ffi::F32> nested_absmax, ffi::Buffer<ffi::F32> nested_offset, ffi::AnyBuffer bias,
                          ffi::Result<ffi::AnyBuffer> out, int64_t n, int64_t k, int64_t blocksize, int64_t quant_type,
                          int64_t nested) {
  return on_pool(pool, [&] {
    return gemm_4bit_batched(x, packed, absmax, nested_absmax, nested_offset, bias, out, n, k, blocksize, quant_type,
                             nested, [](const Gemm4bitParams& p) { return cpu::gemm_4bit_w4a8(p); });
  });
}

ffi::Error gemm_4bit_grad_input(ffi::ThreadPool pool, ffi::AnyBuffer grad_out, ffi::Buffer<ffi::U8> packed,
                                ffi::AnyBuffer absmax, ffi::Buffer<ffi::F32> nested_absmax,
                                ffi::Buffer<ffi::F32> nested_offset, ffi::Result<ffi::AnyBuffer> grad_input, int64_t n,
                                int64_t k, int64_t blocksize, int64_t quant_type, int64_t nested) {
  return on_pool(pool, [&] {
    return gemm_4bit_grad_input_batched(grad_out, packed, absmax, nested_absmax, nested_offset, grad_input, n, k,
                                        blocksize, quant_type, nested,
                                        [](const Gemm4bitGradInputParams& p) { return cpu::gemm_4bit_grad_input(p); });
  });
}

ffi::Error int8_quantize_rows(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::S8>> q,
                              ffi::Result<ffi::Buffer<ffi::F32>> row_stats, int64_t cols) {
  return on_pool(pool, [&] {
    return int8_quantize_rows_batched(x, q, row_stats, cols,
                                      [](const Int8QuantizeRowsParams& p) { return cpu::int8_quantize_rows(p); });
  });
}

ffi::Error int8_linear(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S8> weight, ffi::Buffer<ffi::F32> scale,
                       ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out, int64_t n, int64_t k, float threshold) {
  return on_pool(pool, [&] {
    return int8_linear_batched(x, weight, scale, bias, out, n, k, threshold,
                               [](const Int8LinearParams& p) { return cpu::int8_linear(p); });
  });
}

ffi::Error int8_grad_input(ffi::ThreadPool pool, ffi::AnyBuffer grad_out, ffi::Buffer<ffi::S8> weight,
                           ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::AnyBuffer> grad_input, int64_t n, int64_t k) {
  return on_pool(pool, [&] {
    return int8_grad_input_batched(grad_out, weight, scale, grad_input, n, k,
                                   [](const Int8GradInputParams& p) { return cpu::int8_grad_input(p); });
  });
}

ffi::Error optimizer_update_8bit(ffi::ThreadPool pool, ffi::AnyBuffer param, ffi::AnyBuffer grad,
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
  return on_pool(pool, [&] {
    return optimizer_update_8bit_ffi(
        param, grad, state1, absmax1, state2, absmax2, qmap1, qmap2, step, lr_scale, update, state1_out, absmax1_out,
        state2_out, absmax2_out, skipped, optimizer, lr, beta1, beta2, eps, weight_decay, gnorm_scale,
        [](void* dst, const void* src, int64_t bytes) {
          if (dst != src && bytes > 0) std::memcpy(dst, src, size_t(bytes));
          return ffi::Error::Success();
        },
        [](const Optim8bitParams& p) { return cpu::optimizer_update_8bit(p); });
  });
}

}  // namespace host
}  // namespace
}  // namespace xla_bind
}  // namespace q4

namespace xb = q4::xla_bind;

#define Q4_OP(name, params, args)                              \
  Q4_FFI_HANDLER(q4_ffi_##name)                                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(q4_ffi_##name, xb::host::name, \
                                xb::bind_##name(xb::ffi::Ffi::Bind().Ctx<xb::ffi::ThreadPool>()));
#include "c_api_ops.inc"
#undef Q4_OP
