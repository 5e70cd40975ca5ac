// 4-bit blockwise quantize / dequantize on the CPU.
//
// Per block b of elements [b*bs, min(n, (b+1)*bs)):
//   amax = max |x| (NaN if any element is NaN)
//   full block:    s = x * (1.0f / floor(amax)), stored absmax = amax
//   partial block: s = x / floor(amax),          stored absmax = floor(amax)
// where floor(a) = max(a, 1e-38) keeping NaN. The nibble is the code book's
// encode(s) (nf4.h / fp4.h). Dequantize: out = decode(nibble) * absmax[b] in
// fp32, rounded to the output dtype to nearest even. The scalar and AVX2
// paths produce identical bytes and values (no FMA contraction anywhere).
// The drivers and the scalar block functions are in quant4_loops.h; the
// AVX2 ones in x86/avx2/quant4.cc.
#include "q4/quant4.h"

#include <string>

#include "dispatch.h"
#include "q4/kernels.h"
#include "quant4_loops.h"

namespace q4 {
namespace cpu {

namespace scalar {
bool quantize4(const Quantize4bitParams& p) {
  quant4_loops::quantize_op<quant4_loops::ScalarLoops>(p);
  return true;
}
bool dequantize4(const Dequantize4bitParams& p) {
  quant4_loops::dequantize_op<quant4_loops::ScalarLoops>(p);
  return true;
}
bool encode4(const Blocks4& a) {
  quant4_loops::encode_op<quant4_loops::ScalarLoops>(a);
  return true;
}
bool search4(const Blocks4& a) {
  quant4_loops::search_op<quant4_loops::ScalarLoops>(a);
  return true;
}
}  // namespace scalar

namespace {
// The first entry of `chain` that serves the call (the scalar one serves every call).
template <typename Fn, typename P>
Status run_first(const Chain<Fn>& chain, const P& p) {
  for (int i = 0; i < chain.size; ++i)
    if (chain.entries[i].fn(p)) return Status::Ok();
  return Status::Invalid("no kernel serves the call");
}
}  // namespace

Status quantize_4bit(const Quantize4bitParams& p) {
  Status s = validate(p);
  if (!s.ok()) return s;
  return run_first(kernel_table().quantize4, p);
}

Status dequantize_4bit(const Dequantize4bitParams& p) {
  Status s = validate(p);
  if (!s.ok()) return s;
  return run_first(kernel_table().dequantize4, p);
}

namespace {
Status check_block_args(const float* x, int64_t n_blocks, int64_t blocksize, int32_t quant_type, const void* out) {
  if (n_blocks < 1) return Status::Invalid("n_blocks must be >= 1, got " + std::to_string(n_blocks));
  if (blocksize < kMinBlocksize || blocksize > kMaxBlocksize || (blocksize & (blocksize - 1)) != 0)
    return Status::Invalid("blocksize must be a power of two in [" + std::to_string(kMinBlocksize) + ", " +
                           std::to_string(kMaxBlocksize) + "], got " + std::to_string(blocksize));
  Status st = validate_quant_type(quant_type);
  if (!st.ok()) return st;
  if (checked_count(n_blocks, blocksize) < 0)
    return Status::Invalid("n_blocks * blocksize (" + std::to_string(n_blocks) + " * " + std::to_string(blocksize) +
                           ") overflows or exceeds the largest supported count");
  if (x == nullptr || out == nullptr) return Status::Invalid("x and the output must not be null");
  return Status::Ok();
}
}  // namespace

Status encode_4bit(const float* x, int64_t n_blocks, int64_t blocksize, int32_t quant_type, const float* scales,
                   uint8_t* packed) {
  Status st = check_block_args(x, n_blocks, blocksize, quant_type, packed);
  if (!st.ok()) return st;
  if (scales == nullptr) return Status::Invalid("scales must not be null");
  return run_first(kernel_table().encode4, Blocks4{x, n_blocks, blocksize, quant_type, scales, packed, nullptr});
}

Status search_scales_4bit(const float* x, int64_t n_blocks, int64_t blocksize, int32_t quant_type, float* scales) {
  Status st = check_block_args(x, n_blocks, blocksize, quant_type, scales);
  if (!st.ok()) return st;
  return run_first(kernel_table().search4, Blocks4{x, n_blocks, blocksize, quant_type, nullptr, nullptr, scales});
}

}  // namespace cpu
}  // namespace q4
