// Argument validation shared by the CPU and CUDA ops. Messages name the bad
// value and the expected one; callers surface them unchanged.
#include <string>

#include "q4/int8.h"
#include "q4/kernels.h"
#include "q4/packing.h"
#include "q4/w4a8.h"

namespace q4 {
namespace {

std::string S(int64_t v) { return std::to_string(v); }

Status check_blocksize(int64_t bs, const char* what) {
  if (!is_pow2(bs) || bs < kMinBlocksize || bs > kMaxBlocksize)
    return Status::Invalid(std::string(what) + " must be a power of two in [32, 4096], got " + S(bs));
  return Status::Ok();
}
Status check_blocksize8(int64_t bs, const char* what) {
  if (!is_pow2(bs) || bs < kMinBlocksize || bs > kMaxBlocksize8)
    return Status::Invalid(std::string(what) + " must be a power of two in [32, " + S(kMaxBlocksize8) + "], got " +
                           S(bs));
  return Status::Ok();
}
Status check_float_dtype(DType d, const char* what) {
  if (d != kF32 && d != kF16 && d != kBF16)
    return Status::Invalid(std::string(what) + " must be float32, float16 or bfloat16 (dtype code 0, 1, 2), got code " +
                           S(d));
  return Status::Ok();
}
Status check_quant_type(QuantType q) { return validate_quant_type(q); }
Status check_n(int64_t n) {
  if (n <= 0) return Status::Invalid("element count must be positive, got " + S(n));
  if (n > kMaxElements)
    return Status::Invalid("element count " + S(n) + " exceeds the largest supported count " + S(kMaxElements));
  return Status::Ok();
}
// a * b as an element count: fails when the product overflows or exceeds kMaxElements.
Status check_product(const char* what, int64_t a, int64_t b, int64_t* out = nullptr) {
  const int64_t r = checked_count(a, b);
  if (r < 0)
    return Status::Invalid(std::string(what) + " = " + S(a) + " * " + S(b) +
                           " overflows or exceeds the largest supported count " + S(kMaxElements));
  if (out) *out = r;
  return Status::Ok();
}
Status check_size(const char* what, int64_t got, int64_t want) {
  if (got != want) return Status::Invalid(std::string(what) + " has " + S(got) + " elements, expected " + S(want));
  return Status::Ok();
}
Status check_ptr(const void* p, const char* what) {
  if (p == nullptr) return Status::Invalid(std::string(what) + " is a null pointer");
  return Status::Ok();
}

#define Q4_RETURN_IF_ERROR(expr) \
  do {                           \
    Status _s = (expr);          \
    if (!_s.ok()) return _s;     \
  } while (0)

}  // namespace

Status validate_quant_type(int64_t q) {
  if (is_quant_type(q)) return Status::Ok();
  std::string names;  // "0 (nf4) or 1 (fp4)", from the format list
  int i = 0;
#define Q4_FORMAT_NAME(name, NAME, id, w4a8_scale) \
  names += std::string(i == 0 ? "" : i + 1 == kFormats ? " or " : ", ") + #id " (" #name ")", ++i;
  Q4_FORMATS(Q4_FORMAT_NAME)
#undef Q4_FORMAT_NAME
  return Status::Invalid("quant_type must be " + names + ", got " + S(q));
}

Status validate(const Quantize4bitParams& p) {
  Q4_RETURN_IF_ERROR(check_n(p.n));
  Q4_RETURN_IF_ERROR(check_blocksize(p.blocksize, "blocksize"));
  Q4_RETURN_IF_ERROR(check_float_dtype(p.x_dtype, "input dtype"));
  Q4_RETURN_IF_ERROR(check_quant_type(p.quant_type));
  Q4_RETURN_IF_ERROR(check_ptr(p.x, "input"));
  Q4_RETURN_IF_ERROR(check_ptr(p.packed, "packed output"));
  Q4_RETURN_IF_ERROR(check_ptr(p.absmax, "absmax output"));
  Q4_RETURN_IF_ERROR(check_size("packed output", p.packed_size, packed_bytes(p.n)));
  Q4_RETURN_IF_ERROR(check_size("absmax output", p.absmax_size, ceil_div(p.n, p.blocksize)));
  return Status::Ok();
}

Status validate(const Dequantize4bitParams& p) {
  Q4_RETURN_IF_ERROR(check_n(p.n));
  Q4_RETURN_IF_ERROR(check_blocksize(p.blocksize, "blocksize"));
  Q4_RETURN_IF_ERROR(check_float_dtype(p.out_dtype, "output dtype"));
  Q4_RETURN_IF_ERROR(check_quant_type(p.quant_type));
  Q4_RETURN_IF_ERROR(check_ptr(p.packed, "packed input"));
  Q4_RETURN_IF_ERROR(check_ptr(p.absmax, "absmax"));
  Q4_RETURN_IF_ERROR(check_ptr(p.out, "output"));
  Q4_RETURN_IF_ERROR(check_size("packed input", p.packed_size, packed_bytes(p.n)));
  Q4_RETURN_IF_ERROR(check_size("absmax", p.absmax_size, ceil_div(p.n, p.blocksize)));
  return Status::Ok();
}

Status validate(const QuantizeBlockwiseParams& p) {
  Q4_RETURN_IF_ERROR(check_n(p.n));
  Q4_RETURN_IF_ERROR(check_blocksize8(p.blocksize, "blocksize"));
  Q4_RETURN_IF_ERROR(check_float_dtype(p.x_dtype, "input dtype"));
  Q4_RETURN_IF_ERROR(check_ptr(p.x, "input"));
  Q4_RETURN_IF_ERROR(check_ptr(p.codes, "codes output"));
  Q4_RETURN_IF_ERROR(check_ptr(p.absmax, "absmax output"));
  Q4_RETURN_IF_ERROR(check_size("codes output", p.codes_size, p.n));
  Q4_RETURN_IF_ERROR(check_size("absmax output", p.absmax_size, ceil_div(p.n, p.blocksize)));
  return Status::Ok();
}

Status validate(const DequantizeBlockwiseParams& p) {
  Q4_RETURN_IF_ERROR(check_n(p.n));
  Q4_RETURN_IF_ERROR(check_blocksize8(p.blocksize, "blocksize"));
  Q4_RETURN_IF_ERROR(check_float_dtype(p.out_dtype, "output dtype"));
  Q4_RETURN_IF_ERROR(check_ptr(p.codes, "codes"));
  Q4_RETURN_IF_ERROR(check_ptr(p.absmax, "absmax"));
  Q4_RETURN_IF_ERROR(check_ptr(p.out, "output"));
  Q4_RETURN_IF_ERROR(check_size("absmax", p.absmax_size, ceil_div(p.n, p.blocksize)));
  return Status::Ok();
}

Status validate(const QuantizeNestedParams& p) {
  Q4_RETURN_IF_ERROR(check_n(p.n_blocks));
  Q4_RETURN_IF_ERROR(check_ptr(p.absmax, "absmax"));
  Q4_RETURN_IF_ERROR(check_ptr(p.codes, "nested codes output"));
  Q4_RETURN_IF_ERROR(check_ptr(p.absmax2, "nested absmax output"));
  Q4_RETURN_IF_ERROR(check_ptr(p.offset, "nested offset output"));
  Q4_RETURN_IF_ERROR(check_size("nested absmax output", p.absmax2_size, ceil_div(p.n_blocks, kNestedBlocksize)));
  return Status::Ok();
}

namespace {

// Positive dimensions whose products m*k (input), n*k (weight) and m*n
// (output) are valid element counts.
Status check_dims(int64_t m, int64_t n, int64_t k) {
  if (m <= 0 || n <= 0 || k <= 0)
    return Status::Invalid("matmul dimensions must be positive, got m=" + S(m) + " n=" + S(n) + " k=" + S(k));
  Q4_RETURN_IF_ERROR(check_product("input size m*k", m, k));
  Q4_RETURN_IF_ERROR(check_product("weight size n*k", n, k));
  return check_product("output size m*n", m, n);
}

Status check_scales(const Absmax4& a, int64_t n_elements, int64_t blocksize) {
  const int64_t want = ceil_div(n_elements, blocksize);
  if (a.n_blocks != want)
    return Status::Invalid("absmax has " + S(a.n_blocks) + " elements, expected " + S(want) + " (ceil(" +
                           S(n_elements) + " / blocksize " + S(blocksize) + "))");
  if (!a.nested()) return check_ptr(a.absmax, "absmax");
  Q4_RETURN_IF_ERROR(check_ptr(a.nested_absmax, "nested absmax"));
  return check_size("nested absmax", a.nested_absmax_size, ceil_div(a.n_blocks, kNestedBlocksize));
}

template <class P>
Status check_4bit_weight(const P& p) {
  Q4_RETURN_IF_ERROR(check_dims(p.m, p.n, p.k));
  Q4_RETURN_IF_ERROR(check_blocksize(p.blocksize, "blocksize"));
  Q4_RETURN_IF_ERROR(check_quant_type(p.quant_type));
  Q4_RETURN_IF_ERROR(check_ptr(p.packed, "packed weight"));
  Q4_RETURN_IF_ERROR(check_size("packed weight", p.packed_size, packed_bytes(p.n * p.k)));
  return check_scales(p.scales, p.n * p.k, p.blocksize);
}

}  // namespace

Status validate(const Gemm4bitParams& p) {
  Q4_RETURN_IF_ERROR(check_4bit_weight(p));
  Q4_RETURN_IF_ERROR(check_float_dtype(p.x_dtype, "input dtype"));
  Q4_RETURN_IF_ERROR(check_float_dtype(p.out_dtype, "output dtype"));
  if (p.bias != nullptr) Q4_RETURN_IF_ERROR(check_float_dtype(p.bias_dtype, "bias dtype"));
  Q4_RETURN_IF_ERROR(check_ptr(p.x, "input"));
  return check_ptr(p.out, "output");
}

Status validate_w4a8(const Gemm4bitParams& p) {
  Q4_RETURN_IF_ERROR(validate(p));
  const int64_t ba = w4a8::act_block(p.blocksize);
  if (p.k % ba != 0)
    return Status::Invalid("W4A8 (int8 activations) needs in_features k to be a multiple of " + S(ba) +
                           " (its activation block for blocksize " + S(p.blocksize) + "), got k = " + S(p.k));
  return Status::Ok();
}

Status validate(const Gemm4bitGradInputParams& p) {
  Q4_RETURN_IF_ERROR(check_4bit_weight(p));
  Q4_RETURN_IF_ERROR(check_float_dtype(p.grad_out_dtype, "grad_out dtype"));
  Q4_RETURN_IF_ERROR(check_float_dtype(p.grad_input_dtype, "grad_input dtype"));
  Q4_RETURN_IF_ERROR(check_ptr(p.grad_out, "grad_out"));
  return check_ptr(p.grad_input, "grad_input");
}

Status validate(const Int8QuantizeRowsParams& p) {
  if (p.rows <= 0 || p.cols <= 0)
    return Status::Invalid("int8 row quantization needs a non-empty matrix, got " + S(p.rows) + " x " + S(p.cols));
  Q4_RETURN_IF_ERROR(check_product("input size rows*cols", p.rows, p.cols));
  Q4_RETURN_IF_ERROR(check_float_dtype(p.x_dtype, "input dtype"));
  if (!(p.threshold >= 0.0f))
    return Status::Invalid("threshold must be >= 0 (0 disables outliers), got " + std::to_string(p.threshold));
  Q4_RETURN_IF_ERROR(check_ptr(p.x, "input"));
  Q4_RETURN_IF_ERROR(check_ptr(p.q, "int8 output"));
  return check_ptr(p.row_stats, "row_stats output");
}

Status validate(const Int8LinearParams& p) {
  Q4_RETURN_IF_ERROR(check_dims(p.m, p.n, p.k));
  Q4_RETURN_IF_ERROR(check_float_dtype(p.x_dtype, "input dtype"));
  Q4_RETURN_IF_ERROR(check_float_dtype(p.out_dtype, "output dtype"));
  if (p.bias != nullptr) Q4_RETURN_IF_ERROR(check_float_dtype(p.bias_dtype, "bias dtype"));
  if (!(p.threshold >= 0.0f))
    return Status::Invalid("threshold must be >= 0 (0 disables outliers), got " + std::to_string(p.threshold));
  Q4_RETURN_IF_ERROR(check_ptr(p.x, "input"));
  Q4_RETURN_IF_ERROR(check_ptr(p.weight, "int8 weight"));
  Q4_RETURN_IF_ERROR(check_ptr(p.weight_scale, "weight scale"));
  Q4_RETURN_IF_ERROR(check_ptr(p.out, "output"));
  if (p.k > int8::kMaxK)  // |sum_k q * CB| <= 128 * 127 * k fits in int32
    return Status::Invalid("int8 linear: k = " + std::to_string(p.k) + " overflows the int32 accumulator (max " +
                           std::to_string(int8::kMaxK) + ")");
  return Status::Ok();
}

Status validate(const Int8GradInputParams& p) {
  Q4_RETURN_IF_ERROR(check_dims(p.m, p.n, p.k));
  Q4_RETURN_IF_ERROR(check_float_dtype(p.grad_out_dtype, "grad_out dtype"));
  Q4_RETURN_IF_ERROR(check_float_dtype(p.grad_input_dtype, "grad_input dtype"));
  Q4_RETURN_IF_ERROR(check_ptr(p.grad_out, "grad_out"));
  Q4_RETURN_IF_ERROR(check_ptr(p.weight, "int8 weight"));
  Q4_RETURN_IF_ERROR(check_ptr(p.weight_scale, "weight scale"));
  return check_ptr(p.grad_input, "grad_input");
}

Status validate(const Optim8bitParams& p) {
  if (p.optimizer < 0 || p.optimizer > 3)
    return Status::Invalid("optimizer must be 0 (adam), 1 (momentum), 2 (lion) or 3 (rmsprop), got " + S(p.optimizer));
  Q4_RETURN_IF_ERROR(check_n(p.n));
  Q4_RETURN_IF_ERROR(check_float_dtype(p.param_dtype, "parameter dtype"));
  Q4_RETURN_IF_ERROR(check_float_dtype(p.grad_dtype, "gradient dtype"));
  Q4_RETURN_IF_ERROR(check_ptr(p.param, "parameter"));
  Q4_RETURN_IF_ERROR(check_ptr(p.grad, "gradient"));
  Q4_RETURN_IF_ERROR(check_ptr(p.state1, "state1"));
  Q4_RETURN_IF_ERROR(check_ptr(p.absmax1, "absmax1"));
  Q4_RETURN_IF_ERROR(check_ptr(p.qmap1, "qmap1"));
  Q4_RETURN_IF_ERROR(check_size("absmax", p.absmax_size, ceil_div(p.n, 256)));
  if (p.optimizer == 0) {
    Q4_RETURN_IF_ERROR(check_ptr(p.state2, "state2"));
    Q4_RETURN_IF_ERROR(check_ptr(p.absmax2, "absmax2"));
    Q4_RETURN_IF_ERROR(check_ptr(p.qmap2, "qmap2"));
  }
  if (p.step_ptr == nullptr && p.step < 1) return Status::Invalid("step must be >= 1, got " + S(p.step));
  auto finite_nonneg = [](double v) { return v >= 0.0 && v <= 1.7976931348623157e308; };
  if (!finite_nonneg(p.lr)) return Status::Invalid("lr must be finite and >= 0, got " + std::to_string(p.lr));
  if (!finite_nonneg(p.eps)) return Status::Invalid("eps must be finite and >= 0, got " + std::to_string(p.eps));
  if (!finite_nonneg(p.weight_decay))
    return Status::Invalid("weight_decay must be finite and >= 0, got " + std::to_string(p.weight_decay));
  if (!finite_nonneg(p.gnorm_scale))
    return Status::Invalid("gnorm_scale must be finite and >= 0, got " + std::to_string(p.gnorm_scale));
  if (!(p.beta1 >= 0.0 && p.beta1 < 1.0))
    return Status::Invalid("beta1 must be in [0, 1), got " + std::to_string(p.beta1));
  if (!(p.beta2 >= 0.0 && p.beta2 < 1.0))
    return Status::Invalid("beta2 must be in [0, 1), got " + std::to_string(p.beta2));
  return Status::Ok();
}

Status validate_code_book(const float* code) {
  if (code == nullptr) return Status::Ok();
  for (int i = 0; i + 1 < 256; ++i)
    if (!(code[i] <= code[i + 1]))
      return Status::Invalid("code book must be sorted ascending without NaN; entry " + S(i + 1) +
                             " is smaller than entry " + S(i));
  return Status::Ok();
}

}  // namespace q4
