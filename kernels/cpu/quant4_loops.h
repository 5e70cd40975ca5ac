// The 4-bit quantize / dequantize drivers (contracts in cpu/quant4.cc),
// shared by the scalar reference (cpu/quant4.cc) and the AVX2 unit
// (x86/avx2/quant4.cc). Each block function a driver runs is a static member
// of a Loops class L: ScalarLoops below, Avx2Loops in the AVX2 unit. L serves
// full blocks; a partial block always takes the scalar path. The op drivers
// (quantize_op, dequantize_op, encode_op, search_op) are the bodies of the
// quant4 chains' entries (cpu/dispatch.h): which loops run is decided by the
// kernel table alone.
#pragma once

#include <algorithm>
#include <cmath>

#include "dispatch.h"
#include "parallel.h"
#include "q4/kernels.h"
#include "q4/quant4.h"

namespace q4 {
namespace cpu {
namespace quant4_loops {
// Internal linkage in each including unit, as when these lived in one .cc:
// GCC then specialises and inlines the scalar loops as it did (a named
// namespace cost the scalar int8 gradient ~25%).
namespace {

constexpr int64_t kGrainElements = 1 << 16;

template <typename T>
float block_absmax_scalar(const T* x, int64_t len) {
  float m = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < len; ++i) {
    const float a = std::fabs(Elem<T>::load(x, i));
    nan |= (a != a);
    m = a > m ? a : m;
  }
  return nan ? __builtin_nanf("") : m;
}

// Nibbles of a full block's x * inv (scalar).
template <QuantType QT>
void encode_block_scalar(const float* x, int64_t len, float inv, uint8_t* packed) {
  for (int64_t i = 0; i < len; i += 2)
    packed[i / 2] = pack2(Code4<QT>::encode(x[i] * inv), Code4<QT>::encode(x[i + 1] * inv));
}

// Encodes one block (scalar). `partial` selects the division form.
template <QuantType QT, typename T>
void quantize_block_scalar(const T* x, int64_t len, bool partial, uint8_t* packed, float* absmax) {
  const float amax = block_absmax_scalar(x, len);
  const float floor_amax = absmax_floor(amax);
  const float inv = 1.0f / floor_amax;
  auto scaled = [&](int64_t i) {
    const float v = Elem<T>::load(x, i);
    return partial ? v / floor_amax : v * inv;
  };
  const int pad = Code4<QT>::encode(0.0f);
  for (int64_t i = 0; i < len; i += 2) {
    const int e = Code4<QT>::encode(scaled(i));
    const int o = i + 1 < len ? Code4<QT>::encode(scaled(i + 1)) : pad;
    packed[i / 2] = pack2(e, o);
  }
  *absmax = partial ? floor_amax : amax;
}

template <QuantType QT, typename T>
void dequantize_block_scalar(const uint8_t* packed, int64_t len, float absmax, T* out) {
  for (int64_t i = 0; i < len; i += 2) {
    const uint8_t b = packed[i / 2];
    Elem<T>::store(out, i, Code4<QT>::decode(unpack_even(b)) * absmax);
    if (i + 1 < len) Elem<T>::store(out, i + 1, Code4<QT>::decode(unpack_odd(b)) * absmax);
  }
}

// ------------------------------------------------------ mse scale search
// ------------------------------------------------------ mse scale search
// search_scales_4bit (q4/_src/quantizers.py 'mse'): for a full block x[0, bs)
// (fp32) with a = max|x| finite and > 0, candidate j (0..15) has scale
// s_j = fp32(a * (32 - j) / 32) and error
//   err_j = ((L0 + L1) + (L2 + L3)) + ((L4 + L5) + (L6 + L7)),
//   L_l = sum over i = l (mod 8), in increasing i, of fp32(d_i * d_i),
//   d_i = x_i - fp32(sorted_value(rank(fp32(x_i * fp32(1 / floor(s_j))))) * s_j)
// (every operation fp32, no FMA: the scalar and AVX2 paths give the same
// bits). The block's scale is the s_j of smallest err_j (ties: lowest j). A
// block whose a is 0, NaN or inf keeps a.
constexpr int kMseCandidates = 16;
inline float mse_fraction(int j) { return float(32 - j) / 32.0f; }

inline float lane_tree(const float l[8]) { return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])); }

template <QuantType QT>
float search_block_scalar(const float* x, int64_t bs) {
  const float amax = block_absmax_scalar(x, bs);
  if (!(amax > 0.0f) || !std::isfinite(amax)) return amax;
  float best = amax, best_err = 0.0f;
  for (int j = 0; j < kMseCandidates; ++j) {
    const float s = amax * mse_fraction(j), inv = 1.0f / absmax_floor(s);
    float lane[8] = {};
    for (int64_t i = 0; i < bs; ++i) {
      const float q = Code4<QT>::decode(Code4<QT>::encode(x[i] * inv)) * s;
      const float d = x[i] - q;
      lane[i & 7] += d * d;
    }
    const float err = lane_tree(lane);
    if (j == 0 || err < best_err) {
      best_err = err;
      best = s;
    }
  }
  return best;
}

// The reference block functions (full blocks).
struct ScalarLoops {
  template <QuantType QT, typename T>
  static void quantize_block(const T* x, int64_t len, uint8_t* packed, float* absmax) {
    quantize_block_scalar<QT, T>(x, len, false, packed, absmax);
  }
  template <QuantType QT, typename T>
  static void dequantize_block(const uint8_t* packed, int64_t len, float absmax, T* out) {
    dequantize_block_scalar<QT, T>(packed, len, absmax, out);
  }
  template <QuantType QT>
  static void encode_block(const float* x, int64_t len, float inv, uint8_t* packed) {
    encode_block_scalar<QT>(x, len, inv, packed);
  }
  template <QuantType QT>
  static float search_block(const float* x, int64_t bs) {
    return search_block_scalar<QT>(x, bs);
  }
};

// ------------------------------------------------------ the op drivers

template <class L>
void quantize_op(const Quantize4bitParams& p) {
  const int64_t bs = p.blocksize;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / bs);
  Q4_QUANT_SWITCH(p.quant_type, QT, [&] {
    Q4_DTYPE_SWITCH(p.x_dtype, T, [&] {
      const T* x = static_cast<const T*>(p.x);
      parallel_for(p.absmax_size, grain, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t start = b * bs, len = std::min(bs, p.n - start);
          if (len < bs)
            quantize_block_scalar<QT, T>(x + start, len, true, p.packed + start / 2, p.absmax + b);
          else
            L::template quantize_block<QT, T>(x + start, len, p.packed + start / 2, p.absmax + b);
        }
      });
    });
  });
}

template <class L>
void dequantize_op(const Dequantize4bitParams& p) {
  const int64_t bs = p.blocksize;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / bs);
  hint_fresh_output(p.out, p.n * (p.out_dtype == kF32 ? 4 : 2));
  Q4_QUANT_SWITCH(p.quant_type, QT, [&] {
    Q4_DTYPE_SWITCH(p.out_dtype, T, [&] {
      T* out = static_cast<T*>(p.out);
      parallel_for(p.absmax_size, grain, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t start = b * bs, len = std::min(bs, p.n - start);
          if (len < bs)
            dequantize_block_scalar<QT, T>(p.packed + start / 2, len, p.absmax[b], out + start);
          else
            L::template dequantize_block<QT, T>(p.packed + start / 2, len, p.absmax[b], out + start);
        }
      });
    });
  });
}

template <class L>
void encode_op(const Blocks4& a) {
  const int64_t bs = a.blocksize;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / bs);
  Q4_QUANT_SWITCH(a.quant_type, QT, [&] {
    parallel_for(a.n_blocks, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        L::template encode_block<QT>(a.x + b * bs, bs, 1.0f / absmax_floor(a.scales_in[b]), a.packed + b * bs / 2);
    });
  });
}

template <class L>
void search_op(const Blocks4& a) {
  const int64_t bs = a.blocksize;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / (16 * bs));
  Q4_QUANT_SWITCH(a.quant_type, QT, [&] {
    parallel_for(a.n_blocks, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) a.scales_out[b] = L::template search_block<QT>(a.x + b * bs, bs);
    });
  });
}

}  // namespace
}  // namespace quant4_loops
}  // namespace cpu
}  // namespace q4
