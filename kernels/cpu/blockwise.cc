// 8-bit blockwise quantization with a sorted 256-entry code book (the signed
// dynamic map by default), and the nested quantization of 4-bit absmax.
//   absmax[b] = max |x| over the block (NaN if any element is NaN)
//   code index = encode8_nearest (dynamic8.h): the exact nearest
//                reconstruction code[j] * absmax[b], ties to the lower index
//   dequantize: out = code[q] * absmax[b] + offset, each step rounded to fp32
#include <algorithm>
#include <cmath>

#include "parallel.h"
#include "q4/dynamic8.h"
#include "q4/kernels.h"
#include "q4/quant4.h"

namespace q4 {
namespace cpu {
namespace {

constexpr int64_t kGrainElements = 1 << 15;

struct CodeBook {
  float v[256];
  explicit CodeBook(const float* code) {
    for (int i = 0; i < 256; ++i) v[i] = code ? code[i] : dynamic8::value(i);
  }
};

template <typename T>
void quantize_blocks(const T* x, int64_t n, int64_t bs, const float* code, uint8_t* out, float* absmax, int64_t b0,
                     int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * bs, len = std::min(bs, n - start);
    float m = 0.0f;
    bool nan = false;
    for (int64_t i = 0; i < len; ++i) {
      const float a = std::fabs(Elem<T>::load(x, start + i));
      nan |= (a != a);
      m = a > m ? a : m;
    }
    if (nan) m = __builtin_nanf("");
    const float scale = absmax_floor(m);
    const float inv = 1.0f / scale;
    for (int64_t i = 0; i < len; ++i)
      out[start + i] = uint8_t(encode8_nearest(code, Elem<T>::load(x, start + i), scale, inv));
    absmax[b] = m;
  }
}

}  // namespace

Status quantize_blockwise(const QuantizeBlockwiseParams& p) {
  Status s = validate(p);
  if (s.ok()) s = validate_code_book(p.code);
  if (!s.ok()) return s;
  const CodeBook book(p.code);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / p.blocksize);
  Q4_DTYPE_SWITCH(p.x_dtype, T, [&] {
    parallel_for(p.absmax_size, grain, [&](int64_t b0, int64_t b1) {
      quantize_blocks<T>(static_cast<const T*>(p.x), p.n, p.blocksize, book.v, p.codes, p.absmax, b0, b1);
    });
  });
  return Status::Ok();
}

Status dequantize_blockwise(const DequantizeBlockwiseParams& p) {
  Status s = validate(p);
  if (!s.ok()) return s;
  const CodeBook book(p.code);
  hint_fresh_output(p.out, p.n * (p.out_dtype == kF32 ? 4 : 2));
  Q4_DTYPE_SWITCH(p.out_dtype, T, [&] {
    T* out = static_cast<T*>(p.out);
    parallel_for(p.n, kGrainElements, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const float scaled = book.v[p.codes[i]] * p.absmax[i / p.blocksize];
        Elem<T>::store(out, i, p.add_offset ? scaled + p.offset : scaled);
      }
    });
  });
  return Status::Ok();
}

Status quantize_nested(const QuantizeNestedParams& p) {
  Status s = validate(p);
  if (!s.ok()) return s;
  ScopedIeeeFloat ieee;
  double sum = 0.0;
  for (int64_t i = 0; i < p.n_blocks; ++i) sum += p.absmax[i];
  const float offset = static_cast<float>(sum / static_cast<double>(p.n_blocks));
  // centred = fp32(absmax - offset), quantized in blocks of 256 with the dynamic map
  const CodeBook book(nullptr);
  parallel_for(p.absmax2_size, 16, [&](int64_t b0, int64_t b1) {
    float centred[kNestedBlocksize];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * kNestedBlocksize, len = std::min(kNestedBlocksize, p.n_blocks - start);
      for (int64_t i = 0; i < len; ++i) centred[i] = p.absmax[start + i] - offset;
      quantize_blocks<float>(centred, len, kNestedBlocksize, book.v, p.codes + start, p.absmax2 + b, 0, 1);
    }
  });
  *p.offset = offset;
  return Status::Ok();
}

}  // namespace cpu
}  // namespace q4
