// 8-bit blockwise quantization with a 256-entry code book (the signed dynamic
// map by default), and the nested quantization of 4-bit absmax, bit for bit
// as the compatible format computes them on the CPU (blockwise8.h):
//   absmax[b] = max |x| over the block's non-NaN elements (0 if none)
//   code      = table[bin(x * (1 / absmax[b]))], 0 for a block with absmax 0
//   dequantize: out = code[q] * absmax[b] + offset, each step rounded to fp32
//   nested:   offset = PyTorch's CPU float32 mean of the absmax (one thread),
//             then the 8-bit quantize of fp32(absmax - offset) in blocks of 256
//             with the dynamic map
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#include "parallel.h"
#include "q4/blockwise8.h"
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
    for (int i = 0; i < 256; ++i) v[i] = code ? code[i] : dynamic8::kValues.v[i];
  }
};

// bin -> code index, built from the threshold form (blockwise8.h): bins
// [T[j-1], T[j]) take code j, bins from T[254] on take 255.
struct BinTable {
  uint8_t v[blockwise8::kBins];
  explicit BinTable(const float* code) {
    int start = 0;
    for (int j = 0; j < 255; ++j) {
      const int t = std::max(start, blockwise8::first_bin_above(blockwise8::midpoint(code, j)));
      std::memset(v + start, j, size_t(t - start));
      start = t;
    }
    std::memset(v + start, 255, size_t(blockwise8::kBins - start));
  }
};

const BinTable& dynamic_table() {
  static const BinTable table(CodeBook(nullptr).v);
  return table;
}

template <typename T>
void quantize_blocks(const T* x, int64_t n, int64_t bs, const uint8_t* table, uint8_t* out, float* absmax, int64_t b0,
                     int64_t b1) {
  constexpr int kLanes = 8;
  constexpr int64_t kChunk = 256;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * bs, len = std::min(bs, n - start);
    const T* xb = x + start;
    // The largest non-NaN |x|: `a > m` is false for NaN a. Taken per lane, then
    // over the lanes: the maximum of a set of non-NaN values has no order.
    float lane[kLanes];
    for (float& m : lane) m = -std::numeric_limits<float>::infinity();
    int64_t i = 0;
    for (; i + kLanes <= len; i += kLanes)
      for (int l = 0; l < kLanes; ++l) {
        const float a = std::fabs(Elem<T>::load(xb, i + l));
        lane[l] = a > lane[l] ? a : lane[l];
      }
    for (; i < len; ++i) {
      const float a = std::fabs(Elem<T>::load(xb, i));
      lane[0] = a > lane[0] ? a : lane[0];
    }
    float m = 0.0f;
    for (const float v : lane) m = v > m ? v : m;
    absmax[b] = m;
    uint8_t* ob = out + start;
    if (m == 0.0f) {
      std::memset(ob, 0, size_t(len));
      continue;
    }
    const float inv = 1.0f / m;
    uint16_t bins[kChunk];
    for (int64_t c0 = 0; c0 < len; c0 += kChunk) {
      const int64_t c1 = std::min(len, c0 + kChunk);
      for (int64_t k = c0; k < c1; ++k) bins[k - c0] = uint16_t(blockwise8::bin_of(Elem<T>::load(xb, k) * inv));
      for (int64_t k = c0; k < c1; ++k) ob[k] = table[bins[k - c0]];
    }
  }
}

// PyTorch's CPU float32 sum of x[0..n) with one intra-op thread (blockwise8.h).
float torch_sum(const float* x, int64_t n) {
  if (n < 8) return blockwise8::sum_short(x, n);
  constexpr int kCols = 32;  // a row: 4 vectors of 8 lanes
  const int64_t vecs = n / 8, rows = vecs / 4;
  const int p = blockwise8::cascade_power(rows);
  const int64_t step = int64_t(1) << p;
  float acc[kCols][4] = {};
  int64_t r = 0;
  for (; r + step <= rows; r += step) {
    float g[kCols] = {};
    for (int64_t q = r; q < r + step; ++q)
      for (int c = 0; c < kCols; ++c) g[c] += x[q * kCols + c];
    const int carries = blockwise8::cascade_carries(r + step, p);
    for (int c = 0; c < kCols; ++c) blockwise8::cascade_add(acc[c], g[c], carries);
  }
  float col[kCols] = {};
  for (; r < rows; ++r)
    for (int c = 0; c < kCols; ++c) col[c] += x[r * kCols + c];
  for (int c = 0; c < kCols; ++c) col[c] = blockwise8::cascade_finish(acc[c], col[c]);
  for (int64_t v = rows * 4; v < vecs; ++v)
    for (int l = 0; l < 8; ++l) col[l] += x[v * 8 + l];
  for (int v = 1; v < 4; ++v)
    for (int l = 0; l < 8; ++l) col[l] += col[v * 8 + l];
  float s = 0.0f;
  for (int64_t k = vecs * 8; k < n; ++k) s += x[k];
  for (int l = 0; l < 8; ++l) s += col[l];
  return 0.0f + s;
}

}  // namespace

Status quantize_blockwise(const QuantizeBlockwiseParams& p) {
  Status s = validate(p);
  if (s.ok()) s = validate_code_book(p.code);
  if (!s.ok()) return s;
  std::unique_ptr<BinTable> custom;
  if (p.code) custom.reset(new BinTable(p.code));
  const uint8_t* table = custom ? custom->v : dynamic_table().v;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / p.blocksize);
  Q4_DTYPE_SWITCH(p.x_dtype, T, [&] {
    parallel_for(p.absmax_size, grain, [&](int64_t b0, int64_t b1) {
      quantize_blocks<T>(static_cast<const T*>(p.x), p.n, p.blocksize, table, p.codes, p.absmax, b0, b1);
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
  const float offset = blockwise8::div_rn(torch_sum(p.absmax, p.n_blocks), static_cast<float>(p.n_blocks));
  // centred = fp32(absmax - offset), quantized in blocks of 256 with the dynamic map
  const uint8_t* table = dynamic_table().v;
  parallel_for(p.absmax2_size, 16, [&](int64_t b0, int64_t b1) {
    float centred[kNestedBlocksize];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * kNestedBlocksize, len = std::min(kNestedBlocksize, p.n_blocks - start);
      for (int64_t i = 0; i < len; ++i) centred[i] = p.absmax[start + i] - offset;
      quantize_blocks<float>(centred, len, kNestedBlocksize, table, p.codes + start, p.absmax2 + b, 0, 1);
    }
  });
  *p.offset = offset;
  return Status::Ok();
}

}  // namespace cpu
}  // namespace q4
