// extern "C" entry points: build a params struct, call the CPU op, turn the
// Status into an error code plus a thread-local message.
#include "c_api.h"

#include <string>

#include "c_api_params.h"
#include "q4/dynamic8.h"
#include "q4/fp4.h"
#include "q4/kernels.h"
#include "q4/nf4.h"

using q4::capi::finish;

extern "C" {

const char* q4_last_error(void) { return q4::capi::last_error().c_str(); }
int32_t q4_abi_version(void) { return 1; }
int32_t q4_has_cuda(void) {
#if defined(Q4_WITH_CUDA)
  return 1;
#else
  return 0;
#endif
}

int32_t q4_code_table(int32_t which, float* out, int64_t out_size) {
  const int64_t want = which == 2 ? 256 : 16;
  if (which < 0 || which > 2)
    return finish(q4::Status::Invalid("table must be 0 (nf4), 1 (fp4) or 2 (dynamic8), got " + std::to_string(which)));
  if (out == nullptr || out_size != want)
    return finish(
        q4::Status::Invalid("table output needs " + std::to_string(want) + " floats, got " + std::to_string(out_size)));
  for (int64_t i = 0; i < want; ++i)
    out[i] = which == 0 ? q4::nf4::value(int(i)) : which == 1 ? q4::fp4::value(int(i)) : q4::dynamic8::kValues.v[i];
  return finish(q4::Status::Ok());
}

int32_t q4_fp4_rank_order(int32_t* out, int64_t out_size) {
  if (out == nullptr || out_size != 16)
    return finish(q4::Status::Invalid("rank order output needs 16 ints, got " + std::to_string(out_size)));
  for (int r = 0; r < 16; ++r) out[r] = q4::fp4::nibble_of_rank(r);
  return finish(q4::Status::Ok());
}

int64_t q4_min_blocksize(void) { return q4::kMinBlocksize; }
int64_t q4_max_blocksize(void) { return q4::kMaxBlocksize; }
int64_t q4_nested_blocksize(void) { return q4::kNestedBlocksize; }

int32_t q4_cpu_isa(void) { return q4::cpu_isa(); }
int32_t q4_cpu_has_avx2(void) { return q4::cpu_has_avx2() ? 1 : 0; }
int32_t q4_cpu_has_avx512(void) { return q4::cpu_has_avx512() ? 1 : 0; }
int32_t q4_cpu_has_avx512_bf16(void) { return q4::cpu_has_avx512_bf16() ? 1 : 0; }
const char* q4_cpu_features_json(void) {
  thread_local std::string json;
  json = q4::cpu_features_json();
  return json.c_str();
}
int32_t q4_set_cpu_isa(int32_t isa) { return finish(q4::set_cpu_isa(isa)); }
int32_t q4_cpu_num_threads(void) { return q4::cpu_num_threads(); }
void q4_set_cpu_num_threads(int32_t n) { q4::set_cpu_num_threads(n); }
void q4_set_cpu_fork_join(void* gomp_parallel) {
  q4::set_cpu_fork_join(reinterpret_cast<q4::ForkJoinFn>(gomp_parallel));
}
void* q4_cpu_fork_join(void) { return reinterpret_cast<void*>(q4::cpu_fork_join()); }

int32_t q4_quantize_4bit(const void* x, int32_t x_dtype, int64_t n, int64_t blocksize, int32_t quant_type,
                         uint8_t* packed, int64_t packed_size, float* absmax, int64_t absmax_size) {
  return finish(q4::cpu::quantize_4bit(
      q4::capi::quantize_4bit(x, x_dtype, n, blocksize, quant_type, packed, packed_size, absmax, absmax_size)));
}

int32_t q4_dequantize_4bit(const uint8_t* packed, int64_t packed_size, const float* absmax, int64_t absmax_size,
                           int64_t n, int64_t blocksize, int32_t quant_type, void* out, int32_t out_dtype) {
  return finish(q4::cpu::dequantize_4bit(
      q4::capi::dequantize_4bit(packed, packed_size, absmax, absmax_size, n, blocksize, quant_type, out, out_dtype)));
}

int32_t q4_quantize_blockwise(const void* x, int32_t x_dtype, int64_t n, int64_t blocksize, const float* code,
                              uint8_t* codes, int64_t codes_size, float* absmax, int64_t absmax_size) {
  return finish(q4::cpu::quantize_blockwise(
      q4::capi::quantize_blockwise(x, x_dtype, n, blocksize, code, codes, codes_size, absmax, absmax_size)));
}

int32_t q4_dequantize_blockwise(const uint8_t* codes, int64_t n, const float* absmax, int64_t absmax_size,
                                int64_t blocksize, const float* code, int32_t add_offset, float offset, void* out,
                                int32_t out_dtype) {
  return finish(q4::cpu::dequantize_blockwise(q4::capi::dequantize_blockwise(
      codes, n, absmax, absmax_size, blocksize, code, add_offset, offset, out, out_dtype)));
}

int32_t q4_quantize_nested(const float* absmax, int64_t n_blocks, uint8_t* codes, float* absmax2, int64_t absmax2_size,
                           float* offset) {
  return finish(
      q4::cpu::quantize_nested(q4::capi::quantize_nested(absmax, n_blocks, codes, absmax2, absmax2_size, offset)));
}

int32_t q4_gemm_4bit(const void* x, int32_t x_dtype, int64_t m, int64_t n, int64_t k, const uint8_t* packed,
                     int64_t packed_size, const float* absmax, const uint8_t* nested_codes, const float* nested_absmax,
                     int64_t nested_absmax_size, const float* nested_code, float nested_offset, int64_t n_blocks,
                     int64_t blocksize, int32_t quant_type, const void* bias, int32_t bias_dtype, void* out,
                     int32_t out_dtype) {
  const q4::Absmax4 scales =
      q4::capi::scales(absmax, nested_codes, nested_absmax, nested_absmax_size, nested_code, nested_offset, n_blocks);
  return finish(q4::cpu::gemm_4bit(q4::capi::gemm_4bit(x, x_dtype, m, n, k, packed, packed_size, scales, blocksize,
                                                       quant_type, bias, bias_dtype, out, out_dtype)));
}

int32_t q4_gemm_4bit_grad_input(const void* grad_out, int32_t grad_out_dtype, int64_t m, int64_t n, int64_t k,
                                const uint8_t* packed, int64_t packed_size, const float* absmax,
                                const uint8_t* nested_codes, const float* nested_absmax, int64_t nested_absmax_size,
                                const float* nested_code, float nested_offset, int64_t n_blocks, int64_t blocksize,
                                int32_t quant_type, void* grad_input, int32_t grad_input_dtype) {
  const q4::Absmax4 scales =
      q4::capi::scales(absmax, nested_codes, nested_absmax, nested_absmax_size, nested_code, nested_offset, n_blocks);
  return finish(q4::cpu::gemm_4bit_grad_input(q4::capi::gemm_4bit_grad_input(grad_out, grad_out_dtype, m, n, k, packed,
                                                                             packed_size, scales, blocksize, quant_type,
                                                                             grad_input, grad_input_dtype)));
}

int32_t q4_int8_quantize_rows(const void* x, int32_t x_dtype, int64_t rows, int64_t cols, float threshold, int8_t* q,
                              float* row_stats, uint8_t* outlier_cols) {
  return finish(q4::cpu::int8_quantize_rows(
      q4::capi::int8_quantize_rows(x, x_dtype, rows, cols, threshold, q, row_stats, outlier_cols)));
}

int32_t q4_int8_linear(const void* x, int32_t x_dtype, int64_t m, int64_t n, int64_t k, const int8_t* weight,
                       const float* weight_scale, float threshold, const void* bias, int32_t bias_dtype, void* out,
                       int32_t out_dtype) {
  return finish(q4::cpu::int8_linear(
      q4::capi::int8_linear(x, x_dtype, m, n, k, weight, weight_scale, threshold, bias, bias_dtype, out, out_dtype)));
}

int32_t q4_int8_grad_input(const void* grad_out, int32_t grad_out_dtype, int64_t m, int64_t n, int64_t k,
                           const int8_t* weight, const float* weight_scale, void* grad_input,
                           int32_t grad_input_dtype) {
  return finish(q4::cpu::int8_grad_input(q4::capi::int8_grad_input(grad_out, grad_out_dtype, m, n, k, weight,
                                                                   weight_scale, grad_input, grad_input_dtype)));
}

}  // extern "C"
