// extern "C" entry points: build a params struct, call the CPU op, turn the
// Status into an error code plus a thread-local message.
#include "c_api.h"

#include <string>

#include "c_api_params.h"
#include "q4/dynamic8.h"
#include "q4/fp4.h"
#include "q4/kernels.h"
#include "q4/optim8.h"
#include "q4/quant4.h"
#include "q4/w4a8.h"

using q4::capi::finish;

extern "C" {

const char* q4_last_error(void) { return q4::capi::last_error().c_str(); }
int32_t q4_abi_version(void) { return 2; }
int32_t q4_has_cuda(void) {
#if defined(Q4_WITH_CUDA)
  return 1;
#else
  return 0;
#endif
}

const char* q4_formats(void) {
#define Q4_FORMAT_LINE(name, NAME, id, w4a8_scale) #name " " #id "\n"
  return Q4_FORMATS(Q4_FORMAT_LINE);
#undef Q4_FORMAT_LINE
}

// Tables 2 and 3 are the 8-bit dynamic maps; every other index is a format's id.
constexpr int32_t kDynamicTable = 2, kUnsignedDynamicTable = 3;
#define Q4_FORMAT_ID_FREE(name, NAME, id, w4a8_scale) \
  static_assert(id != kDynamicTable && id != kUnsignedDynamicTable, "ids 2 and 3 are the dynamic maps");
Q4_FORMATS(Q4_FORMAT_ID_FREE)
#undef Q4_FORMAT_ID_FREE

int32_t q4_code_table(int32_t which, float* out, int64_t out_size) {
  const bool dynamic = which == kDynamicTable || which == kUnsignedDynamicTable;
  if (!dynamic && !q4::is_quant_type(which)) {
    std::string names;  // "0 (nf4), 1 (fp4), 2 (dynamic8) or 3 (unsigned dynamic8)"
#define Q4_FORMAT_NAME(name, NAME, id, w4a8_scale) names += #id " (" #name "), ";
    Q4_FORMATS(Q4_FORMAT_NAME)
#undef Q4_FORMAT_NAME
    return finish(q4::Status::Invalid("table must be " + names + "2 (dynamic8) or 3 (unsigned dynamic8), got " +
                                      std::to_string(which)));
  }
  const int64_t want = dynamic ? 256 : 16;
  if (out == nullptr || out_size != want)
    return finish(
        q4::Status::Invalid("table output needs " + std::to_string(want) + " floats, got " + std::to_string(out_size)));
  if (dynamic) {
    for (int64_t i = 0; i < want; ++i)
      out[i] = which == kDynamicTable ? q4::dynamic8::kValues.v[i] : q4::optim8::unsigned_value(int(i));
  } else {
    Q4_QUANT_SWITCH(which, QT, [&] {
      for (int i = 0; i < 16; ++i) out[i] = q4::Code4<QT>::value(i);
    });
  }
  return finish(q4::Status::Ok());
}

int32_t q4_fp4_rank_order(int32_t* out, int64_t out_size) {
  if (out == nullptr || out_size != 16)
    return finish(q4::Status::Invalid("rank order output needs 16 ints, got " + std::to_string(out_size)));
  for (int r = 0; r < 16; ++r) out[r] = q4::fp4::nibble_of_rank(r);
  return finish(q4::Status::Ok());
}

int32_t q4_search_scales_4bit(const float* x, int64_t n_blocks, int64_t blocksize, int32_t quant_type, float* scales) {
  return finish(q4::cpu::search_scales_4bit(x, n_blocks, blocksize, quant_type, scales));
}

int32_t q4_encode_4bit(const float* x, int64_t n_blocks, int64_t blocksize, int32_t quant_type, const float* scales,
                       uint8_t* packed) {
  return finish(q4::cpu::encode_4bit(x, n_blocks, blocksize, quant_type, scales, packed));
}

int64_t q4_min_blocksize(void) { return q4::kMinBlocksize; }
int64_t q4_max_blocksize(void) { return q4::kMaxBlocksize; }
int64_t q4_max_blocksize8(void) { return q4::kMaxBlocksize8; }
int64_t q4_nested_blocksize(void) { return q4::kNestedBlocksize; }
int64_t q4_w4a8_act_block(int64_t blocksize) { return q4::w4a8::act_block(blocksize); }

int32_t q4_cpu_isa(void) { return q4::cpu_isa(); }
const char* q4_cpu_isa_names(void) {
#define Q4_ISA_LINE(name, Name) #name "\n"
  return Q4_ISA_LEVELS(Q4_ISA_LINE);
#undef Q4_ISA_LINE
}
int32_t q4_cpu_has_isa(int32_t isa) { return q4::cpu_has_isa(isa) ? 1 : 0; }
int32_t q4_cpu_has_avx2(void) { return q4::cpu_has_avx2() ? 1 : 0; }
int32_t q4_cpu_has_avx512(void) { return q4::cpu_has_avx512() ? 1 : 0; }
int32_t q4_cpu_has_avx512_bf16(void) { return q4::cpu_has_avx512_bf16() ? 1 : 0; }
int32_t q4_cpu_has_amx(void) { return q4::cpu_has_amx() ? 1 : 0; }
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

const char* q4_ops(void) {
#define Q4_OP(name, params, args) #name #params "\n"
  return
#include "c_api_ops.inc"
      ;
#undef Q4_OP
}

#define Q4_OP(name, params, args) \
  int32_t q4_##name params { return finish(q4::cpu::name(Q4_CAPI_PARAMS(name, args))); }
#include "c_api_ops.inc"
#undef Q4_OP

}  // extern "C"
