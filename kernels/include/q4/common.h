// Shared definitions for every q4 kernel: host/device qualifiers, element
// types, and the bit-exact fp16/bf16 <-> fp32 conversions used by the CPU
// and CUDA kernels alike.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define Q4_HD __host__ __device__ __forceinline__
#define Q4_HDC __host__ __device__ constexpr
#else
#define Q4_HD inline
#define Q4_HDC constexpr
#endif

namespace q4 {

// Element types a kernel reads or writes. Values are part of the C ABI.
enum DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2, kU8 = 3, kI8 = 4, kI32 = 5 };

// Error codes returned by every entry point. Values are part of the C ABI.
enum StatusCode : int32_t {
  kOk = 0,
  kInvalidArgument = 1,  // bad size, pointer, block size, dtype, ...
  kUnsupported = 2,      // valid request this build cannot serve (e.g. no CUDA)
  kInternal = 3,         // CUDA launch failure or similar
};

constexpr int64_t kMinBlocksize = 32;
constexpr int64_t kMaxBlocksize = 4096;
// 8-bit blockwise blocks may be longer (bitsandbytes' CPU path takes 16384)
constexpr int64_t kMaxBlocksize8 = 16384;
constexpr int64_t kNestedBlocksize = 256;  // block size of the nested absmax
// Largest element count of any tensor an op takes (2^48). Every entry point
// rejects larger counts and larger products of dimensions, so each offset a
// kernel forms (count * 4 bytes, row * k + col, item * count) fits in int64.
constexpr int64_t kMaxElements = int64_t(1) << 48;
// Lower bound applied to absmax before taking its reciprocal, so an all-zero
// block scales by 1e38 instead of inf (zeros stay zero). Stored as the absmax
// of a partial last block, as the reference format does.
constexpr float kAbsmaxFloor = 1e-38f;

Q4_HD uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
Q4_HD float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

// bf16 is the high half of an fp32; widening is exact.
Q4_HD float bf16_to_f32(uint16_t h) { return bits_f32(uint32_t(h) << 16); }

// fp32 -> bf16, round to nearest even; NaN stays a quiet NaN of the same sign.
Q4_HD uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// IEEE binary16 -> fp32, exact (subnormals included).
Q4_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp != 0) return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_f32(sign);
  // subnormal: value = mant * 2^-24, exact in fp32
  float v = float(mant) * 5.9604644775390625e-8f;
  return sign ? -v : v;
}

// fp32 -> IEEE binary16, round to nearest even, overflow to inf, NaN kept.
Q4_HD uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // nan
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);                        // rounds to >= 65520: inf
  if (a < 0x38800000u) {
    // result is subnormal or zero: add 0.5 in fp32 so the hardware rounds the
    // mantissa bits to nearest even at the 2^-24 position.
    const float r = bits_f32(a) + 0.5f;
    return uint16_t(sign | uint16_t(f32_bits(r) - f32_bits(0.5f)));
  }
  const uint32_t mant_odd = (a >> 13) & 1u;
  const uint32_t v = a + 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round
  return uint16_t(sign | uint16_t(v >> 13));
}

template <typename T>
struct Elem;  // load/store an element of a kernel dtype as fp32
template <>
struct Elem<float> {
  static constexpr DType kType = kF32;
  Q4_HD static float load(const float* p, int64_t i) { return p[i]; }
  Q4_HD static void store(float* p, int64_t i, float v) { p[i] = v; }
};
struct f16_t {
  uint16_t bits;
};
struct bf16_t {
  uint16_t bits;
};
static_assert(sizeof(f16_t) == 2 && sizeof(bf16_t) == 2, "16-bit storage types");
template <>
struct Elem<f16_t> {
  static constexpr DType kType = kF16;
  Q4_HD static float load(const f16_t* p, int64_t i) { return f16_to_f32(p[i].bits); }
  Q4_HD static void store(f16_t* p, int64_t i, float v) { p[i].bits = f32_to_f16(v); }
};
template <>
struct Elem<bf16_t> {
  static constexpr DType kType = kBF16;
  Q4_HD static float load(const bf16_t* p, int64_t i) { return bf16_to_f32(p[i].bits); }
  Q4_HD static void store(bf16_t* p, int64_t i, float v) { p[i].bits = f32_to_bf16(v); }
};

// s rounded half to even, for |s| < 2^22 (the int8 quantizers' last step).
Q4_HD int round_half_even_small(float s) {
#if defined(__CUDA_ARCH__)
  return __float2int_rn(s);
#else
  constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: (s + M) - M rounds |s| < 2^22 half-even
  return int((s + kRoundMagic) - kRoundMagic);
#endif
}

// ceil(a / b) for b > 0, without forming a + b (0 for a <= 0).
Q4_HD int64_t ceil_div(int64_t a, int64_t b) { return a <= 0 ? 0 : 1 + (a - 1) / b; }
Q4_HD bool is_pow2(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

// absmax -> the multiplier used to scale a block into [-1, 1]. NaN stays NaN
// (so a block holding NaN encodes as all 0xF nibbles); zero scales by 1e38.
Q4_HD float absmax_floor(float absmax) {
  return (absmax != absmax) ? absmax : (absmax < kAbsmaxFloor ? kAbsmaxFloor : absmax);
}

}  // namespace q4
