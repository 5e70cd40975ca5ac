// Shared by the CPU (xla_ffi.cc) and CUDA (xla_ffi_cuda.cu) XLA FFI handlers:
// the argument bindings of each op and its batched implementation.
//
// Batching: every buffer may hold `batch` independent items of the per-item
// sizes given by the attributes (what vmap_method="broadcast_all" produces);
// the op runs once per item. The code book and the offset may be given once
// for all items. `run(params)` executes one item on the handler's device
// (dequantize_blockwise: `run(params, offset_ptr)`, offset_ptr pointing into
// the offset buffer in that device's memory, or null).
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "q4/kernels.h"
#include "q4/packing.h"
#include "xla/ffi/api/ffi.h"

namespace q4 {
namespace xla_bind {

namespace ffi = ::xla::ffi;

inline ffi::Error to_ffi(const Status& s) {
  switch (s.code) {
    case kOk:
      return ffi::Error::Success();
    case kInvalidArgument:
      return ffi::Error(ffi::ErrorCode::kInvalidArgument, s.message);
    case kUnsupported:
      return ffi::Error(ffi::ErrorCode::kUnimplemented, s.message);
    default:
      return ffi::Error(ffi::ErrorCode::kInternal, s.message);
  }
}

inline ffi::Error invalid(const std::string& m) { return ffi::Error(ffi::ErrorCode::kInvalidArgument, m); }

inline bool dtype_of(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32:
      *out = kF32;
      return true;
    case ffi::DataType::F16:
      *out = kF16;
      return true;
    case ffi::DataType::BF16:
      *out = kBF16;
      return true;
    default:
      return false;
  }
}
inline int64_t elem_bytes(DType d) { return d == kF32 ? 4 : 2; }

// Number of items in a buffer of `count` elements holding items of `per_item`.
inline ffi::Error batch_of(const char* what, int64_t count, int64_t per_item, int64_t* batch) {
  if (per_item <= 0 || count % per_item != 0)
    return invalid(std::string(what) + " has " + std::to_string(count) + " elements, not a multiple of " +
                   std::to_string(per_item));
  *batch = count / per_item;
  return ffi::Error::Success();
}

// A buffer given once (1 item) or once per item.
inline ffi::Error batch_or_one(const char* what, int64_t count, int64_t per_item, int64_t batch, bool* per_item_out) {
  int64_t b = 0;
  ffi::Error e = batch_of(what, count, per_item, &b);
  if (e.failure()) return e;
  if (b != batch && b != 1)
    return invalid(std::string(what) + " holds " + std::to_string(b) + " items, expected 1 or " +
                   std::to_string(batch));
  *per_item_out = (b == batch);
  return ffi::Error::Success();
}

inline ffi::Error same_batch(const char* what, int64_t count, int64_t per_item, int64_t batch) {
  int64_t b = 0;
  ffi::Error e = batch_of(what, count, per_item, &b);
  if (e.failure()) return e;
  if (b != batch)
    return invalid(std::string(what) + " holds " + std::to_string(b) + " items, expected " + std::to_string(batch));
  return ffi::Error::Success();
}

// *out = a * b as an element count (see kMaxElements), or an error naming `what`.
inline ffi::Error count_of(const char* what, int64_t a, int64_t b, int64_t* out) {
  *out = checked_count(a, b);
  if (*out < 0)
    return invalid(std::string(what) + " = " + std::to_string(a) + " * " + std::to_string(b) +
                   " overflows or exceeds the largest supported count " + std::to_string(kMaxElements));
  return ffi::Error::Success();
}

#define Q4_FFI_CHECK(expr)         \
  do {                             \
    ::xla::ffi::Error _e = (expr); \
    if (_e.failure()) return _e;   \
  } while (0)

// ------------------------------------------------------------------ bindings
// Each takes the start of a binding (plain, or with a platform-stream context)
// and appends the op's arguments, results and attributes.

template <class B>
auto bind_quantize_4bit(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()         // x: [batch * n] f32/f16/bf16
      .template Ret<ffi::Buffer<ffi::U8>>()   // packed: [batch * ceil(n/2)]
      .template Ret<ffi::Buffer<ffi::F32>>()  // absmax: [batch * ceil(n/bs)]
      .template Attr<int64_t>("n")            // elements per item
      .template Attr<int64_t>("blocksize")    // power of two in [32, 4096]
      .template Attr<int64_t>("quant_type");  // a QuantType (q4/formats.h)
}

template <class B>
auto bind_dequantize_4bit(B b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::U8>>()   // packed: [batch * ceil(n/2)]
      .template Arg<ffi::Buffer<ffi::F32>>()  // absmax: [batch * ceil(n/bs)]
      .template Ret<ffi::AnyBuffer>()         // out: [batch * n] f32/f16/bf16
      .template Attr<int64_t>("n")
      .template Attr<int64_t>("blocksize")
      .template Attr<int64_t>("quant_type");
}

template <class B>
auto bind_quantize_blockwise(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()         // x: [batch * n]
      .template Arg<ffi::Buffer<ffi::F32>>()  // code book: [256] or [batch * 256]
      .template Ret<ffi::Buffer<ffi::U8>>()   // codes: [batch * n]
      .template Ret<ffi::Buffer<ffi::F32>>()  // absmax: [batch * ceil(n/bs)]
      .template Attr<int64_t>("n")
      .template Attr<int64_t>("blocksize");
}

template <class B>
auto bind_dequantize_blockwise(B b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::U8>>()   // codes: [batch * n]
      .template Arg<ffi::Buffer<ffi::F32>>()  // absmax: [batch * ceil(n/bs)]
      .template Arg<ffi::Buffer<ffi::F32>>()  // code book: [256] or [batch * 256]
      .template Arg<ffi::Buffer<ffi::F32>>()  // offset: [1] or [batch]
      .template Ret<ffi::AnyBuffer>()         // out: [batch * n]
      .template Attr<int64_t>("n")
      .template Attr<int64_t>("blocksize")
      .template Attr<int64_t>("add_offset");  // 1: nested absmax decode
}

template <class B>
auto bind_quantize_nested(B b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::F32>>()  // absmax: [batch * n_blocks]
      .template Ret<ffi::Buffer<ffi::U8>>()   // codes: [batch * n_blocks]
      .template Ret<ffi::Buffer<ffi::F32>>()  // absmax2: [batch * ceil(n_blocks/256)]
      .template Ret<ffi::Buffer<ffi::F32>>()  // offset: [batch]
      .template Attr<int64_t>("n_blocks");
}

// gemm_4bit / gemm_4bit_grad_input. Scales: `absmax` is f32 [n_blocks] or, with
// nested=1, u8 codes [n_blocks] plus nested_absmax f32 and nested_offset f32[1]
// (pass empty arrays when not nested). Bias: f32/f16/bf16 [n] or empty.
template <class B>
auto bind_gemm_4bit(B&& b) {  // (a reference: gemm_4bit_w4a8 passes its own on)
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()         // x: [..., m, k] (rows = all leading dims)
      .template Arg<ffi::Buffer<ffi::U8>>()   // packed W [n, k] (or [batch, ...] stacked)
      .template Arg<ffi::AnyBuffer>()         // absmax: f32, or u8 codes when nested
      .template Arg<ffi::Buffer<ffi::F32>>()  // nested_absmax (empty when plain)
      .template Arg<ffi::Buffer<ffi::F32>>()  // nested_offset: [1] per weight (empty when plain)
      .template Arg<ffi::AnyBuffer>()         // bias [n] (empty: none)
      .template Ret<ffi::AnyBuffer>()         // y: [..., m, n]
      .template Attr<int64_t>("n")
      .template Attr<int64_t>("k")
      .template Attr<int64_t>("blocksize")
      .template Attr<int64_t>("quant_type")
      .template Attr<int64_t>("nested");
}

template <class B>
auto bind_gemm_4bit_w4a8(B&& b) {  // gemm_4bit's operands and attributes
  return bind_gemm_4bit(std::move(b));
}

template <class B>
auto bind_gemm_4bit_grad_input(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()         // grad_out: [..., m, n]
      .template Arg<ffi::Buffer<ffi::U8>>()   // packed W [n, k]
      .template Arg<ffi::AnyBuffer>()         // absmax (see bind_gemm_4bit)
      .template Arg<ffi::Buffer<ffi::F32>>()  // nested_absmax
      .template Arg<ffi::Buffer<ffi::F32>>()  // nested_offset
      .template Ret<ffi::AnyBuffer>()         // grad_input: [..., m, k]
      .template Attr<int64_t>("n")
      .template Attr<int64_t>("k")
      .template Attr<int64_t>("blocksize")
      .template Attr<int64_t>("quant_type")
      .template Attr<int64_t>("nested");
}

// LLM.int8 row quantization without outliers (threshold 0; what an int8
// weight is stored as): x [..., cols] -> q int8 [..., cols], row_stats f32
// [...]. Every leading dim is rows, so a stacked (vmapped) call is one call.
template <class B>
auto bind_int8_quantize_rows(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()         // x: [..., cols]
      .template Ret<ffi::Buffer<ffi::S8>>()   // q: [..., cols]
      .template Ret<ffi::Buffer<ffi::F32>>()  // row_stats: [...]
      .template Attr<int64_t>("cols");
}

// LLM.int8 linear and its input gradient. Weight: int8 CB [n, k] and fp32
// SCB [n] (stacked: [batch, n, k] / [batch, n]).
template <class B>
auto bind_int8_linear(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()         // x: [..., m, k]
      .template Arg<ffi::Buffer<ffi::S8>>()   // CB [n, k]
      .template Arg<ffi::Buffer<ffi::F32>>()  // SCB [n]
      .template Arg<ffi::AnyBuffer>()         // bias [n] (empty: none)
      .template Ret<ffi::AnyBuffer>()         // y: [..., m, n]
      .template Attr<int64_t>("n")
      .template Attr<int64_t>("k")
      .template Attr<float>("threshold");  // 0: no outlier decomposition
}

template <class B>
auto bind_int8_grad_input(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()         // grad_out: [..., m, n]
      .template Arg<ffi::Buffer<ffi::S8>>()   // CB [n, k]
      .template Arg<ffi::Buffer<ffi::F32>>()  // SCB [n]
      .template Ret<ffi::AnyBuffer>()         // grad_input: [..., m, k]
      .template Attr<int64_t>("n")
      .template Attr<int64_t>("k");
}

// Blockwise 8-bit optimizer step (Optim8bitParams). The parameter is only
// read: the first result is the fp32 update u with param + u == the new
// parameter (Optim8bitParams::update, what optax applies). The states are
// updated in place: each state result aliases its operand (the caller passes
// input_output_aliases); an unaliased one is first copied from its operand.
// One parameter per call (no batching). For the 1-state optimizers state2 /
// absmax2 / qmap2 are empty.
template <class B>
auto bind_optimizer_update_8bit(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()         // param: [n] f32/f16/bf16
      .template Arg<ffi::AnyBuffer>()         // grad: [n] f32/f16/bf16
      .template Arg<ffi::Buffer<ffi::U8>>()   // state1: [n]
      .template Arg<ffi::Buffer<ffi::F32>>()  // absmax1: [ceil(n/256)]
      .template Arg<ffi::Buffer<ffi::U8>>()   // state2: [n] (adam) or empty
      .template Arg<ffi::Buffer<ffi::F32>>()  // absmax2: [ceil(n/256)] (adam) or empty
      .template Arg<ffi::Buffer<ffi::F32>>()  // qmap1: [256]
      .template Arg<ffi::Buffer<ffi::F32>>()  // qmap2: [256] (adam) or empty
      .template Arg<ffi::Buffer<ffi::S32>>()  // step: [1], >= 1
      .template Arg<ffi::Buffer<ffi::F32>>()  // lr_scale: [1], the step's lr = lr * lr_scale
      .template Ret<ffi::Buffer<ffi::F32>>()  // update: [n]
      .template Ret<ffi::Buffer<ffi::U8>>()   // state1
      .template Ret<ffi::Buffer<ffi::F32>>()  // absmax1
      .template Ret<ffi::Buffer<ffi::U8>>()   // state2
      .template Ret<ffi::Buffer<ffi::F32>>()  // absmax2
      .template Ret<ffi::Buffer<ffi::S32>>()  // skipped blocks: [1]
      .template Attr<int64_t>("optimizer")    // 0 adam, 1 momentum, 2 lion, 3 rmsprop
      .template Attr<double>("lr")
      .template Attr<double>("beta1")
      .template Attr<double>("beta2")
      .template Attr<double>("eps")
      .template Attr<double>("weight_decay")
      .template Attr<double>("gnorm_scale");
}

// ------------------------------------------------------- batched operations

template <class Run>
ffi::Error quantize_4bit_batched(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::U8>> packed,
                                 ffi::Result<ffi::Buffer<ffi::F32>> absmax, int64_t n, int64_t blocksize,
                                 int64_t quant_type, Run run) {
  Quantize4bitParams p;
  if (!dtype_of(x.element_type(), &p.x_dtype))
    return invalid("quantize_4bit input must be float32, float16 or bfloat16");
  p.n = n;
  p.blocksize = blocksize;
  p.quant_type = static_cast<QuantType>(quant_type);
  p.packed_size = packed_bytes(n);
  p.absmax_size = blocksize > 0 ? ceil_div(n, blocksize) : 0;
  p.x = x.untyped_data();
  p.packed = packed->typed_data();
  p.absmax = absmax->typed_data();
  Q4_FFI_CHECK(to_ffi(validate(p)));
  int64_t batch = 0;
  Q4_FFI_CHECK(batch_of("input", x.element_count(), n, &batch));
  Q4_FFI_CHECK(same_batch("packed output", packed->element_count(), p.packed_size, batch));
  Q4_FFI_CHECK(same_batch("absmax output", absmax->element_count(), p.absmax_size, batch));
  const char* xb = static_cast<const char*>(x.untyped_data());
  for (int64_t i = 0; i < batch; ++i) {
    p.x = xb + i * n * elem_bytes(p.x_dtype);
    p.packed = packed->typed_data() + i * p.packed_size;
    p.absmax = absmax->typed_data() + i * p.absmax_size;
    Q4_FFI_CHECK(to_ffi(run(p)));
  }
  return ffi::Error::Success();
}

template <class Run>
ffi::Error dequantize_4bit_batched(ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::F32> absmax,
                                   ffi::Result<ffi::AnyBuffer> out, int64_t n, int64_t blocksize, int64_t quant_type,
                                   Run run) {
  Dequantize4bitParams p;
  if (!dtype_of(out->element_type(), &p.out_dtype))
    return invalid("dequantize_4bit output must be float32, float16 or bfloat16");
  p.n = n;
  p.blocksize = blocksize;
  p.quant_type = static_cast<QuantType>(quant_type);
  p.packed_size = packed_bytes(n);
  p.absmax_size = blocksize > 0 ? ceil_div(n, blocksize) : 0;
  p.packed = packed.typed_data();
  p.absmax = absmax.typed_data();
  p.out = out->untyped_data();
  Q4_FFI_CHECK(to_ffi(validate(p)));
  int64_t batch = 0;
  Q4_FFI_CHECK(batch_of("output", out->element_count(), n, &batch));
  Q4_FFI_CHECK(same_batch("packed input", packed.element_count(), p.packed_size, batch));
  Q4_FFI_CHECK(same_batch("absmax", absmax.element_count(), p.absmax_size, batch));
  char* ob = static_cast<char*>(out->untyped_data());
  for (int64_t i = 0; i < batch; ++i) {
    p.packed = packed.typed_data() + i * p.packed_size;
    p.absmax = absmax.typed_data() + i * p.absmax_size;
    p.out = ob + i * n * elem_bytes(p.out_dtype);
    Q4_FFI_CHECK(to_ffi(run(p)));
  }
  return ffi::Error::Success();
}

template <class Run>
ffi::Error quantize_blockwise_batched(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> code,
                                      ffi::Result<ffi::Buffer<ffi::U8>> codes,
                                      ffi::Result<ffi::Buffer<ffi::F32>> absmax, int64_t n, int64_t blocksize,
                                      Run run) {
  QuantizeBlockwiseParams p;
  if (!dtype_of(x.element_type(), &p.x_dtype))
    return invalid("quantize_blockwise input must be float32, float16 or bfloat16");
  p.n = n;
  p.blocksize = blocksize;
  p.codes_size = n;
  p.absmax_size = blocksize > 0 ? ceil_div(n, blocksize) : 0;
  int64_t batch = 0;
  bool code_per_item = false;
  Q4_FFI_CHECK(batch_of("input", x.element_count(), n, &batch));
  Q4_FFI_CHECK(same_batch("codes output", codes->element_count(), n, batch));
  Q4_FFI_CHECK(same_batch("absmax output", absmax->element_count(), p.absmax_size, batch));
  Q4_FFI_CHECK(batch_or_one("code book", code.element_count(), 256, batch, &code_per_item));
  const char* xb = static_cast<const char*>(x.untyped_data());
  for (int64_t i = 0; i < batch; ++i) {
    p.x = xb + i * n * elem_bytes(p.x_dtype);
    p.code = code.typed_data() + (code_per_item ? i * 256 : 0);
    p.codes = codes->typed_data() + i * n;
    p.absmax = absmax->typed_data() + i * p.absmax_size;
    Q4_FFI_CHECK(to_ffi(run(p)));
  }
  return ffi::Error::Success();
}

template <class Run>
ffi::Error dequantize_blockwise_batched(ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> absmax,
                                        ffi::Buffer<ffi::F32> code, ffi::Buffer<ffi::F32> offset,
                                        ffi::Result<ffi::AnyBuffer> out, int64_t n, int64_t blocksize,
                                        int64_t add_offset, Run run) {
  DequantizeBlockwiseParams p;
  if (!dtype_of(out->element_type(), &p.out_dtype))
    return invalid("dequantize_blockwise output must be float32, float16 or bfloat16");
  p.n = n;
  p.blocksize = blocksize;
  p.absmax_size = blocksize > 0 ? ceil_div(n, blocksize) : 0;
  p.add_offset = add_offset != 0;
  int64_t batch = 0;
  bool code_per_item = false, offset_per_item = false;
  Q4_FFI_CHECK(batch_of("output", out->element_count(), n, &batch));
  Q4_FFI_CHECK(same_batch("codes", codes.element_count(), n, batch));
  Q4_FFI_CHECK(same_batch("absmax", absmax.element_count(), p.absmax_size, batch));
  Q4_FFI_CHECK(batch_or_one("code book", code.element_count(), 256, batch, &code_per_item));
  Q4_FFI_CHECK(batch_or_one("offset", offset.element_count(), 1, batch, &offset_per_item));
  char* ob = static_cast<char*>(out->untyped_data());
  for (int64_t i = 0; i < batch; ++i) {
    p.codes = codes.typed_data() + i * n;
    p.absmax = absmax.typed_data() + i * p.absmax_size;
    p.code = code.typed_data() + (code_per_item ? i * 256 : 0);
    p.out = ob + i * n * elem_bytes(p.out_dtype);
    const float* off = p.add_offset ? offset.typed_data() + (offset_per_item ? i : 0) : nullptr;
    Q4_FFI_CHECK(to_ffi(run(p, off)));
  }
  return ffi::Error::Success();
}

template <class Run>
ffi::Error quantize_nested_batched(ffi::Buffer<ffi::F32> absmax, ffi::Result<ffi::Buffer<ffi::U8>> codes,
                                   ffi::Result<ffi::Buffer<ffi::F32>> absmax2,
                                   ffi::Result<ffi::Buffer<ffi::F32>> offset, int64_t n_blocks, Run run) {
  QuantizeNestedParams p;
  p.n_blocks = n_blocks;
  p.absmax2_size = n_blocks > 0 ? ceil_div(n_blocks, kNestedBlocksize) : 0;
  int64_t batch = 0;
  Q4_FFI_CHECK(batch_of("absmax", absmax.element_count(), n_blocks, &batch));
  Q4_FFI_CHECK(same_batch("nested codes", codes->element_count(), n_blocks, batch));
  Q4_FFI_CHECK(same_batch("nested absmax", absmax2->element_count(), p.absmax2_size, batch));
  Q4_FFI_CHECK(same_batch("nested offset", offset->element_count(), 1, batch));
  for (int64_t i = 0; i < batch; ++i) {
    p.absmax = absmax.typed_data() + i * n_blocks;
    p.codes = codes->typed_data() + i * n_blocks;
    p.absmax2 = absmax2->typed_data() + i * p.absmax2_size;
    p.offset = offset->typed_data() + i;
    Q4_FFI_CHECK(to_ffi(run(p)));
  }
  return ffi::Error::Success();
}

// The weight operands of a fused 4-bit matmul, for item `i` of `items`
// stacked weights. The nested offset stays a pointer (device memory on CUDA).
struct Weight4 {
  const uint8_t* packed;
  Absmax4 scales;
};

inline ffi::Error weight4_items(ffi::Buffer<ffi::U8> packed, ffi::AnyBuffer absmax, ffi::Buffer<ffi::F32> nested_absmax,
                                ffi::Buffer<ffi::F32> nested_offset, int64_t n, int64_t k, int64_t blocksize,
                                int64_t nested, int64_t* items) {
  if (n <= 0 || k <= 0 || blocksize <= 0) return invalid("n, k and blocksize must be positive");
  int64_t nk = 0;
  Q4_FFI_CHECK(count_of("weight size n*k", n, k, &nk));
  const int64_t per = packed_bytes(nk), blocks = ceil_div(nk, blocksize);
  Q4_FFI_CHECK(batch_of("packed weight", packed.element_count(), per, items));
  const ffi::DataType want = nested ? ffi::DataType::U8 : ffi::DataType::F32;
  if (absmax.element_type() != want)
    return invalid(nested ? "nested absmax codes must be uint8" : "absmax must be float32");
  Q4_FFI_CHECK(same_batch("absmax", absmax.element_count(), blocks, *items));
  if (nested) {
    Q4_FFI_CHECK(
        same_batch("nested absmax", nested_absmax.element_count(), ceil_div(blocks, kNestedBlocksize), *items));
    Q4_FFI_CHECK(same_batch("nested offset", nested_offset.element_count(), 1, *items));
  }
  return ffi::Error::Success();
}

inline Weight4 weight4_item(ffi::Buffer<ffi::U8> packed, ffi::AnyBuffer absmax, ffi::Buffer<ffi::F32> nested_absmax,
                            ffi::Buffer<ffi::F32> nested_offset, int64_t n, int64_t k, int64_t blocksize,
                            int64_t nested, int64_t i) {
  const int64_t blocks = ceil_div(n * k, blocksize), blocks2 = ceil_div(blocks, kNestedBlocksize);
  Weight4 w;
  w.packed = packed.typed_data() + i * packed_bytes(n * k);
  w.scales.n_blocks = blocks;
  if (nested) {
    w.scales.nested_codes = static_cast<const uint8_t*>(absmax.untyped_data()) + i * blocks;
    w.scales.nested_absmax = nested_absmax.typed_data() + i * blocks2;
    w.scales.nested_absmax_size = blocks2;
    w.scales.nested_offset_ptr = nested_offset.typed_data() + i;
  } else {
    w.scales.absmax = static_cast<const float*>(absmax.untyped_data()) + i * blocks;
  }
  return w;
}

template <class Run>
ffi::Error gemm_4bit_batched(ffi::AnyBuffer x, ffi::Buffer<ffi::U8> packed, ffi::AnyBuffer absmax,
                             ffi::Buffer<ffi::F32> nested_absmax, ffi::Buffer<ffi::F32> nested_offset,
                             ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out, int64_t n, int64_t k,
                             int64_t blocksize, int64_t quant_type, int64_t nested, Run run) {
  int64_t items = 0;
  Q4_FFI_CHECK(weight4_items(packed, absmax, nested_absmax, nested_offset, n, k, blocksize, nested, &items));
  Gemm4bitParams p;
  if (!dtype_of(x.element_type(), &p.x_dtype)) return invalid("gemm_4bit input must be float32, float16 or bfloat16");
  if (!dtype_of(out->element_type(), &p.out_dtype)) return invalid("gemm_4bit output must be a float type");
  int64_t rows = 0, k_items = 0, n_items = 0;
  Q4_FFI_CHECK(count_of("input row size k*items", k, items, &k_items));
  Q4_FFI_CHECK(count_of("output row size n*items", n, items, &n_items));
  Q4_FFI_CHECK(batch_of("input (rows of k)", x.element_count(), k_items, &rows));
  Q4_FFI_CHECK(same_batch("output", out->element_count(), n_items, rows));
  const bool has_bias = bias.element_count() > 0;
  if (has_bias) {
    if (!dtype_of(bias.element_type(), &p.bias_dtype)) return invalid("bias must be a float type");
    Q4_FFI_CHECK(same_batch("bias", bias.element_count(), n, items));
  }
  p.m = rows;
  p.n = n;
  p.k = k;
  p.packed_size = packed_bytes(n * k);
  p.blocksize = blocksize;
  p.quant_type = static_cast<QuantType>(quant_type);
  for (int64_t i = 0; i < items; ++i) {
    const Weight4 w = weight4_item(packed, absmax, nested_absmax, nested_offset, n, k, blocksize, nested, i);
    p.packed = w.packed;
    p.scales = w.scales;
    p.x = static_cast<const char*>(x.untyped_data()) + i * rows * k * elem_bytes(p.x_dtype);
    p.bias = has_bias ? static_cast<const char*>(bias.untyped_data()) + i * n * elem_bytes(p.bias_dtype) : nullptr;
    p.out = static_cast<char*>(out->untyped_data()) + i * rows * n * elem_bytes(p.out_dtype);
    Q4_FFI_CHECK(to_ffi(run(p)));
  }
  return ffi::Error::Success();
}

template <class Run>
ffi::Error gemm_4bit_grad_input_batched(ffi::AnyBuffer grad_out, ffi::Buffer<ffi::U8> packed, ffi::AnyBuffer absmax,
                                        ffi::Buffer<ffi::F32> nested_absmax, ffi::Buffer<ffi::F32> nested_offset,
                                        ffi::Result<ffi::AnyBuffer> grad_input, int64_t n, int64_t k, int64_t blocksize,
                                        int64_t quant_type, int64_t nested, Run run) {
  int64_t items = 0;
  Q4_FFI_CHECK(weight4_items(packed, absmax, nested_absmax, nested_offset, n, k, blocksize, nested, &items));
  Gemm4bitGradInputParams p;
  if (!dtype_of(grad_out.element_type(), &p.grad_out_dtype)) return invalid("grad_out must be a float type");
  if (!dtype_of(grad_input->element_type(), &p.grad_input_dtype)) return invalid("grad_input must be a float type");
  int64_t rows = 0, k_items = 0, n_items = 0;
  Q4_FFI_CHECK(count_of("grad_input row size k*items", k, items, &k_items));
  Q4_FFI_CHECK(count_of("grad_out row size n*items", n, items, &n_items));
  Q4_FFI_CHECK(batch_of("grad_out (rows of n)", grad_out.element_count(), n_items, &rows));
  Q4_FFI_CHECK(same_batch("grad_input", grad_input->element_count(), k_items, rows));
  p.m = rows;
  p.n = n;
  p.k = k;
  p.packed_size = packed_bytes(n * k);
  p.blocksize = blocksize;
  p.quant_type = static_cast<QuantType>(quant_type);
  for (int64_t i = 0; i < items; ++i) {
    const Weight4 w = weight4_item(packed, absmax, nested_absmax, nested_offset, n, k, blocksize, nested, i);
    p.packed = w.packed;
    p.scales = w.scales;
    p.grad_out = static_cast<const char*>(grad_out.untyped_data()) + i * rows * n * elem_bytes(p.grad_out_dtype);
    p.grad_input = static_cast<char*>(grad_input->untyped_data()) + i * rows * k * elem_bytes(p.grad_input_dtype);
    Q4_FFI_CHECK(to_ffi(run(p)));
  }
  return ffi::Error::Success();
}

template <class Run>
ffi::Error int8_quantize_rows_batched(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::S8>> q,
                                      ffi::Result<ffi::Buffer<ffi::F32>> row_stats, int64_t cols, Run run) {
  if (cols <= 0) return invalid("cols must be positive");
  Int8QuantizeRowsParams p;
  if (!dtype_of(x.element_type(), &p.x_dtype)) return invalid("int8_quantize_rows input must be a float type");
  int64_t rows = 0;
  Q4_FFI_CHECK(batch_of("input (rows of cols)", x.element_count(), cols, &rows));
  Q4_FFI_CHECK(same_batch("q", q->element_count(), cols, rows));
  Q4_FFI_CHECK(same_batch("row_stats", row_stats->element_count(), 1, rows));
  p.x = x.untyped_data();
  p.rows = rows;
  p.cols = cols;
  p.threshold = 0.0f;
  p.q = q->typed_data();
  p.row_stats = row_stats->typed_data();
  p.outlier_cols = nullptr;
  return to_ffi(run(p));
}

// The stacked int8 weights (CB [items, n, k], SCB [items, n]) of an LLM.int8
// matmul: their number, and the row sizes k * items and n * items.
inline ffi::Error int8_weight_items(ffi::Buffer<ffi::S8> weight, ffi::Buffer<ffi::F32> scale, int64_t n, int64_t k,
                                    int64_t* items, int64_t* k_items, int64_t* n_items) {
  if (n <= 0 || k <= 0) return invalid("n and k must be positive");
  int64_t nk = 0;
  Q4_FFI_CHECK(count_of("weight size n*k", n, k, &nk));
  Q4_FFI_CHECK(batch_of("int8 weight", weight.element_count(), nk, items));
  Q4_FFI_CHECK(count_of("k*items", k, *items, k_items));
  Q4_FFI_CHECK(count_of("n*items", n, *items, n_items));
  return same_batch("weight scale", scale.element_count(), n, *items);
}

template <class Run>
ffi::Error int8_linear_batched(ffi::AnyBuffer x, ffi::Buffer<ffi::S8> weight, ffi::Buffer<ffi::F32> scale,
                               ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out, int64_t n, int64_t k,
                               float threshold, Run run) {
  int64_t items = 0, rows = 0, k_items = 0, n_items = 0;
  Q4_FFI_CHECK(int8_weight_items(weight, scale, n, k, &items, &k_items, &n_items));
  Int8LinearParams p;
  if (!dtype_of(x.element_type(), &p.x_dtype)) return invalid("int8_linear input must be a float type");
  if (!dtype_of(out->element_type(), &p.out_dtype)) return invalid("int8_linear output must be a float type");
  Q4_FFI_CHECK(batch_of("input (rows of k)", x.element_count(), k_items, &rows));
  Q4_FFI_CHECK(same_batch("output", out->element_count(), n_items, rows));
  const bool has_bias = bias.element_count() > 0;
  if (has_bias) {
    if (!dtype_of(bias.element_type(), &p.bias_dtype)) return invalid("bias must be a float type");
    Q4_FFI_CHECK(same_batch("bias", bias.element_count(), n, items));
  }
  p.m = rows;
  p.n = n;
  p.k = k;
  p.threshold = threshold;
  for (int64_t i = 0; i < items; ++i) {
    p.x = static_cast<const char*>(x.untyped_data()) + i * rows * k * elem_bytes(p.x_dtype);
    p.weight = weight.typed_data() + i * n * k;
    p.weight_scale = scale.typed_data() + i * n;
    p.bias = has_bias ? static_cast<const char*>(bias.untyped_data()) + i * n * elem_bytes(p.bias_dtype) : nullptr;
    p.out = static_cast<char*>(out->untyped_data()) + i * rows * n * elem_bytes(p.out_dtype);
    Q4_FFI_CHECK(to_ffi(run(p)));
  }
  return ffi::Error::Success();
}

template <class Run>
ffi::Error int8_grad_input_batched(ffi::AnyBuffer grad_out, ffi::Buffer<ffi::S8> weight, ffi::Buffer<ffi::F32> scale,
                                   ffi::Result<ffi::AnyBuffer> grad_input, int64_t n, int64_t k, Run run) {
  int64_t items = 0, rows = 0, k_items = 0, n_items = 0;
  Q4_FFI_CHECK(int8_weight_items(weight, scale, n, k, &items, &k_items, &n_items));
  Int8GradInputParams p;
  if (!dtype_of(grad_out.element_type(), &p.grad_out_dtype)) return invalid("grad_out must be a float type");
  if (!dtype_of(grad_input->element_type(), &p.grad_input_dtype)) return invalid("grad_input must be a float type");
  Q4_FFI_CHECK(batch_of("grad_out (rows of n)", grad_out.element_count(), n_items, &rows));
  Q4_FFI_CHECK(same_batch("grad_input", grad_input->element_count(), k_items, rows));
  p.m = rows;
  p.n = n;
  p.k = k;
  for (int64_t i = 0; i < items; ++i) {
    p.grad_out = static_cast<const char*>(grad_out.untyped_data()) + i * rows * n * elem_bytes(p.grad_out_dtype);
    p.weight = weight.typed_data() + i * n * k;
    p.weight_scale = scale.typed_data() + i * n;
    p.grad_input = static_cast<char*>(grad_input->untyped_data()) + i * rows * k * elem_bytes(p.grad_input_dtype);
    Q4_FFI_CHECK(to_ffi(run(p)));
  }
  return ffi::Error::Success();
}

// copy(dst, src, bytes) copies an operand into its unaliased result on the
// handler's device; run(params) executes the step.
template <class Copy, class Run>
ffi::Error optimizer_update_8bit_ffi(
    ffi::AnyBuffer param, ffi::AnyBuffer grad, ffi::Buffer<ffi::U8> state1, ffi::Buffer<ffi::F32> absmax1,
    ffi::Buffer<ffi::U8> state2, ffi::Buffer<ffi::F32> absmax2, ffi::Buffer<ffi::F32> qmap1,
    ffi::Buffer<ffi::F32> qmap2, ffi::Buffer<ffi::S32> step, ffi::Buffer<ffi::F32> lr_scale,
    ffi::Result<ffi::Buffer<ffi::F32>> update, ffi::Result<ffi::Buffer<ffi::U8>> state1_out,
    ffi::Result<ffi::Buffer<ffi::F32>> absmax1_out, ffi::Result<ffi::Buffer<ffi::U8>> state2_out,
    ffi::Result<ffi::Buffer<ffi::F32>> absmax2_out, ffi::Result<ffi::Buffer<ffi::S32>> skipped, int64_t optimizer,
    double lr, double beta1, double beta2, double eps, double weight_decay, double gnorm_scale, Copy copy, Run run) {
  Optim8bitParams p;
  if (!dtype_of(param.element_type(), &p.param_dtype))
    return invalid("optimizer_update_8bit parameter must be float32, float16 or bfloat16");
  if (!dtype_of(grad.element_type(), &p.grad_dtype))
    return invalid("optimizer_update_8bit gradient must be float32, float16 or bfloat16");
  const int64_t n = param.element_count();
  const bool two = optimizer == 0;
  p.optimizer = static_cast<int32_t>(optimizer);
  p.n = n;
  p.absmax_size = ceil_div(n, 256);
  Q4_FFI_CHECK(same_batch("gradient", grad.element_count(), n, 1));
  Q4_FFI_CHECK(same_batch("state1", state1.element_count(), n, 1));
  Q4_FFI_CHECK(same_batch("absmax1", absmax1.element_count(), p.absmax_size, 1));
  Q4_FFI_CHECK(same_batch("qmap1", qmap1.element_count(), 256, 1));
  if (two) {
    Q4_FFI_CHECK(same_batch("state2", state2.element_count(), n, 1));
    Q4_FFI_CHECK(same_batch("absmax2", absmax2.element_count(), p.absmax_size, 1));
    Q4_FFI_CHECK(same_batch("qmap2", qmap2.element_count(), 256, 1));
  }
  Q4_FFI_CHECK(same_batch("update", update->element_count(), n, 1));
  if (step.element_count() != 1 || lr_scale.element_count() != 1 || skipped->element_count() != 1)
    return invalid("optimizer_update_8bit step, lr_scale and skipped must hold one element each");
  p.param = const_cast<void*>(param.untyped_data());  // only read: p.update is set
  p.update = update->typed_data();
  p.grad = grad.untyped_data();
  p.state1 = state1_out->typed_data();
  p.absmax1 = absmax1_out->typed_data();
  p.qmap1 = qmap1.typed_data();
  if (two) {
    p.state2 = state2_out->typed_data();
    p.absmax2 = absmax2_out->typed_data();
    p.qmap2 = qmap2.typed_data();
  }
  p.step_ptr = step.typed_data();
  p.lr_scale_ptr = lr_scale.typed_data();
  p.skipped_blocks = skipped->typed_data();
  p.lr = lr;
  p.beta1 = beta1;
  p.beta2 = beta2;
  p.eps = eps;
  p.weight_decay = weight_decay;
  p.gnorm_scale = gnorm_scale;
  Q4_FFI_CHECK(to_ffi(validate(p)));
  Q4_FFI_CHECK(copy(state1_out->typed_data(), state1.typed_data(), n));
  Q4_FFI_CHECK(copy(absmax1_out->typed_data(), absmax1.typed_data(), p.absmax_size * 4));
  if (two) {
    Q4_FFI_CHECK(copy(state2_out->typed_data(), state2.typed_data(), n));
    Q4_FFI_CHECK(copy(absmax2_out->typed_data(), absmax2.typed_data(), p.absmax_size * 4));
  }
  return to_ffi(run(p));
}

}  // namespace xla_bind
}  // namespace q4

// The handler symbols are looked up by name from Python (ctypes), so they
// need default visibility despite -fvisibility=hidden.
#define Q4_FFI_HANDLER(name) extern "C" Q4_API XLA_FFI_Error* name(XLA_FFI_CallFrame* call_frame);
