// Blockwise 8-bit optimizer states and the arithmetic of one update step,
// exactly as the compatible format (bitsandbytes 0.50.2's CPU optimizers)
// computes it; shared by the CPU and CUDA kernels.
//
// State layout (per parameter of n elements, blocks of kBlock = 256):
//   state1[n] u8 codes of the first state (Adam's m, momentum, Lion's m,
//   RMSprop's mean square) in the signed dynamic map (dynamic8.h), state2[n]
//   u8 codes of Adam's v in the unsigned dynamic map (below); absmax1/2
//   [ceil(n/256)] fp32. Decoded state = fp32(code[q] * absmax[block]); the
//   re-quantization is blockwise8.h's 8-bit quantize (bin table of the map).
//
// Constants (Consts): each is computed in fp64 from the step's hyperparameters
// and rounded once to fp32, as the reference's PyTorch tensor ops consume
// Python floats. Per element, every operation is one IEEE fp32 operation
// rounded to nearest, in the order below; fma is one fused multiply-add:
//   adam:     m = fma(g, 1-b1, m*b1); v = fma((1-b2)*g, g, v*b2)
//             d = sqrt(v) / c2 + eps          (c2 = sqrt(1 - b2^step))
//             p = p*decay (weight_decay > 0); p = p + (step_size*m) / d
//             (step_size = -lr / (1 - b1^step); decay = 1 - lr*weight_decay)
//   momentum: g = fma(p, wd, g); m = g at step 1, else m*b1 + g; p = fma(m, -lr, p)
//   lion:     p = p*decay (weight_decay > 0); u = sign(m*b1 + g*(1-b1));
//             p = fma(u, -lr, p); m = fma(g, 1-b2, m*b2)
//   rmsprop:  g = fma(p, wd, g); m = fma((1-b1)*g, g, m*b1); p = p + (-lr*g) / (sqrt(m) + eps)
// with g = fp32(grad * gnorm_scale) and sqrt correctly rounded (the reference
// takes PyTorch's, which on x86 is MKL's and not always correctly rounded: its
// Adam / RMSprop parameters can then differ in the last place; its states
// cannot, since no square root reaches them).
#pragma once

#include <cmath>
#include <cstdint>

#include "q4/common.h"

namespace q4 {
namespace optim8 {

constexpr int64_t kBlock = 256;
constexpr int kCodes = 256;

enum Kind : int32_t { kAdam = 0, kMomentum = 1, kLion = 2, kRmsprop = 3, kKinds = 4 };
Q4_HD bool two_states(int32_t kind) { return kind == kAdam; }

// The unsigned 8-bit dynamic map (bitsandbytes' create_dynamic_map(signed=False)):
// 256 fp32 values, sorted ascending, from 0.0 to 1.0; each decade 10^-6..10^0
// holds 2^(i+1) linearly spaced means (i = 0..6), plus 0 and 1.
Q4_HDC float unsigned_value(int i) {
  // clang-format off
  constexpr float t[kCodes] = {
      0x0.0p+0f, 0x1.5cf7540000000p-22f, 0x1.a013300000000p-21f, 0x1.1d36700000000p-19f,
      0x1.2599ec0000000p-18f, 0x1.bc98a20000000p-18f, 0x1.29cbaa0000000p-17f, 0x1.0624dc0000000p-16f,
      0x1.c2e3400000000p-16f, 0x1.3fd0d00000000p-15f, 0x1.9e30000000000p-15f, 0x1.fc8f340000000p-15f,
      0x1.2d77320000000p-14f, 0x1.5ca6c80000000p-14f, 0x1.8bd6620000000p-14f, 0x1.0cb2960000000p-13f,
      0x1.82a9940000000p-13f, 0x1.f8a0920000000p-13f, 0x1.374bc80000000p-12f, 0x1.7247440000000p-12f,
      0x1.ad42c60000000p-12f, 0x1.e83e440000000p-12f, 0x1.119ce20000000p-11f, 0x1.2f1aa00000000p-11f,
      0x1.4c98600000000p-11f, 0x1.6a16200000000p-11f, 0x1.8793de0000000p-11f, 0x1.a511a00000000p-11f,
      0x1.c28f5e0000000p-11f, 0x1.e00d1c0000000p-11f, 0x1.fd8adc0000000p-11f, 0x1.2b020c0000000p-10f,
      0x1.74bc6a0000000p-10f, 0x1.be76c80000000p-10f, 0x1.0418940000000p-9f, 0x1.28f5c20000000p-9f,
      0x1.4dd2f00000000p-9f, 0x1.72b0200000000p-9f, 0x1.978d4e0000000p-9f, 0x1.bc6a800000000p-9f,
      0x1.e147ae0000000p-9f, 0x1.03126e0000000p-8f, 0x1.1581040000000p-8f, 0x1.27ef9e0000000p-8f,
      0x1.3a5e340000000p-8f, 0x1.4ccccc0000000p-8f, 0x1.5f3b640000000p-8f, 0x1.71a9fa0000000p-8f,
      0x1.8418940000000p-8f, 0x1.96872a0000000p-8f, 0x1.a8f5c20000000p-8f, 0x1.bb645c0000000p-8f,
      0x1.cdd2f00000000p-8f, 0x1.e0418a0000000p-8f, 0x1.f2b01e0000000p-8f, 0x1.028f5c0000000p-7f,
      0x1.0bc6a80000000p-7f, 0x1.14fdf20000000p-7f, 0x1.1e35400000000p-7f, 0x1.276c8a0000000p-7f,
      0x1.30a3d60000000p-7f, 0x1.39db240000000p-7f, 0x1.43126e0000000p-7f, 0x1.5eb8540000000p-7f,
      0x1.8cccce0000000p-7f, 0x1.bae1460000000p-7f, 0x1.e8f5c40000000p-7f, 0x1.0b851e0000000p-6f,
      0x1.228f5e0000000p-6f, 0x1.39999a0000000p-6f, 0x1.50a3d60000000p-6f, 0x1.67ae160000000p-6f,
      0x1.7eb8520000000p-6f, 0x1.95c28e0000000p-6f, 0x1.acccce0000000p-6f, 0x1.c3d70e0000000p-6f,
      0x1.dae1460000000p-6f, 0x1.f1eb860000000p-6f, 0x1.047ae00000000p-5f, 0x1.1000000000000p-5f,
      0x1.1b851e0000000p-5f, 0x1.270a3e0000000p-5f, 0x1.328f5e0000000p-5f, 0x1.3e147a0000000p-5f,
      0x1.49999a0000000p-5f, 0x1.551eb80000000p-5f, 0x1.60a3d60000000p-5f, 0x1.6c28f60000000p-5f,
      0x1.77ae140000000p-5f, 0x1.8333340000000p-5f, 0x1.8eb8500000000p-5f, 0x1.9a3d700000000p-5f,
      0x1.a5c28e0000000p-5f, 0x1.b147ae0000000p-5f, 0x1.bcccce0000000p-5f, 0x1.c851ee0000000p-5f,
      0x1.d3d70e0000000p-5f, 0x1.df5c2a0000000p-5f, 0x1.eae1460000000p-5f, 0x1.f666660000000p-5f,
      0x1.00f5c40000000p-4f, 0x1.06b8540000000p-4f, 0x1.0c7ae20000000p-4f, 0x1.123d700000000p-4f,
      0x1.1800000000000p-4f, 0x1.1dc2900000000p-4f, 0x1.2385200000000p-4f, 0x1.2947ae0000000p-4f,
      0x1.2f0a3e0000000p-4f, 0x1.34ccce0000000p-4f, 0x1.3a8f5e0000000p-4f, 0x1.4051ec0000000p-4f,
      0x1.46147c0000000p-4f, 0x1.4bd70a0000000p-4f, 0x1.51999a0000000p-4f, 0x1.575c2a0000000p-4f,
      0x1.5d1eb80000000p-4f, 0x1.62e1480000000p-4f, 0x1.68a3d60000000p-4f, 0x1.6e66660000000p-4f,
      0x1.7428f60000000p-4f, 0x1.79eb860000000p-4f, 0x1.7fae160000000p-4f, 0x1.8570a40000000p-4f,
      0x1.8b33340000000p-4f, 0x1.90f5c40000000p-4f, 0x1.96b8520000000p-4f, 0x1.a800000000000p-4f,
      0x1.c4cccc0000000p-4f, 0x1.e1999a0000000p-4f, 0x1.fe66660000000p-4f, 0x1.0d99980000000p-3f,
      0x1.1c00000000000p-3f, 0x1.2a66680000000p-3f, 0x1.38cccc0000000p-3f, 0x1.4733340000000p-3f,
      0x1.5599980000000p-3f, 0x1.6400000000000p-3f, 0x1.7266680000000p-3f, 0x1.80cccc0000000p-3f,
      0x1.8f33340000000p-3f, 0x1.9d99980000000p-3f, 0x1.ac00000000000p-3f, 0x1.ba66680000000p-3f,
      0x1.c8cccc0000000p-3f, 0x1.d733340000000p-3f, 0x1.e599980000000p-3f, 0x1.f400000000000p-3f,
      0x1.0133320000000p-2f, 0x1.0866660000000p-2f, 0x1.0f999a0000000p-2f, 0x1.16cccc0000000p-2f,
      0x1.1e00000000000p-2f, 0x1.2533340000000p-2f, 0x1.2c66660000000p-2f, 0x1.3399980000000p-2f,
      0x1.3acccc0000000p-2f, 0x1.4200000000000p-2f, 0x1.4933340000000p-2f, 0x1.5066660000000p-2f,
      0x1.5799980000000p-2f, 0x1.5ecccc0000000p-2f, 0x1.6600000000000p-2f, 0x1.6d33340000000p-2f,
      0x1.7466660000000p-2f, 0x1.7b99980000000p-2f, 0x1.82cccc0000000p-2f, 0x1.8a00000000000p-2f,
      0x1.9133340000000p-2f, 0x1.9866660000000p-2f, 0x1.9f99980000000p-2f, 0x1.a6cccc0000000p-2f,
      0x1.ae00000000000p-2f, 0x1.b533340000000p-2f, 0x1.bc66660000000p-2f, 0x1.c399980000000p-2f,
      0x1.cacccc0000000p-2f, 0x1.d200000000000p-2f, 0x1.d933340000000p-2f, 0x1.e066660000000p-2f,
      0x1.e799980000000p-2f, 0x1.eecccc0000000p-2f, 0x1.f600000000000p-2f, 0x1.fd33320000000p-2f,
      0x1.0233340000000p-1f, 0x1.05cccc0000000p-1f, 0x1.0966660000000p-1f, 0x1.0d00000000000p-1f,
      0x1.1099980000000p-1f, 0x1.1433340000000p-1f, 0x1.17cccc0000000p-1f, 0x1.1b66680000000p-1f,
      0x1.1f00000000000p-1f, 0x1.22999a0000000p-1f, 0x1.2633340000000p-1f, 0x1.29cccc0000000p-1f,
      0x1.2d66680000000p-1f, 0x1.3100000000000p-1f, 0x1.34999a0000000p-1f, 0x1.3833340000000p-1f,
      0x1.3bcccc0000000p-1f, 0x1.3f66680000000p-1f, 0x1.4300000000000p-1f, 0x1.46999a0000000p-1f,
      0x1.4a33340000000p-1f, 0x1.4dcccc0000000p-1f, 0x1.5166680000000p-1f, 0x1.5500000000000p-1f,
      0x1.58999a0000000p-1f, 0x1.5c33340000000p-1f, 0x1.5fcccc0000000p-1f, 0x1.6366680000000p-1f,
      0x1.6700000000000p-1f, 0x1.6a999a0000000p-1f, 0x1.6e33340000000p-1f, 0x1.71cccc0000000p-1f,
      0x1.7566680000000p-1f, 0x1.7900000000000p-1f, 0x1.7c999a0000000p-1f, 0x1.8033340000000p-1f,
      0x1.83cccc0000000p-1f, 0x1.8766680000000p-1f, 0x1.8b00000000000p-1f, 0x1.8e99980000000p-1f,
      0x1.9233340000000p-1f, 0x1.95cccc0000000p-1f, 0x1.9966680000000p-1f, 0x1.9d00000000000p-1f,
      0x1.a099980000000p-1f, 0x1.a433340000000p-1f, 0x1.a7cccc0000000p-1f, 0x1.ab66680000000p-1f,
      0x1.af00000000000p-1f, 0x1.b299980000000p-1f, 0x1.b633340000000p-1f, 0x1.b9cccc0000000p-1f,
      0x1.bd66680000000p-1f, 0x1.c100000000000p-1f, 0x1.c499980000000p-1f, 0x1.c833340000000p-1f,
      0x1.cbcccc0000000p-1f, 0x1.cf66680000000p-1f, 0x1.d300000000000p-1f, 0x1.d699980000000p-1f,
      0x1.da33340000000p-1f, 0x1.ddcccc0000000p-1f, 0x1.e166680000000p-1f, 0x1.e500000000000p-1f,
      0x1.e899980000000p-1f, 0x1.ec33340000000p-1f, 0x1.efcccc0000000p-1f, 0x1.f366680000000p-1f,
      0x1.f700000000000p-1f, 0x1.fa99980000000p-1f, 0x1.fe33340000000p-1f, 0x1.0000000000000p+0f,
  };
  // clang-format on
  return t[i & 255];
}

struct Consts {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, neg_lr, weight_decay;
  float decay;  // 1 - lr * weight_decay (used when has_decay)
  bool has_decay;
  float correction2, step_size;  // adam
  float gnorm_scale;
  bool first_step;
};

Q4_HD double pow_step(double b, int64_t step) {
#if defined(__CUDA_ARCH__)
  return ::pow(b, static_cast<double>(step));
#else
  return std::pow(b, static_cast<double>(step));
#endif
}

// The step's fp32 constants (fp64 arithmetic, one rounding each).
Q4_HD Consts make_consts(int32_t kind, int64_t step, double lr, double beta1, double beta2, double eps,
                         double weight_decay, double gnorm_scale) {
  Consts k{};
  k.beta1 = static_cast<float>(beta1);
  k.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  k.beta2 = static_cast<float>(beta2);
  k.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  k.eps = static_cast<float>(eps);
  k.neg_lr = static_cast<float>(-lr);
  k.weight_decay = static_cast<float>(weight_decay);
  k.has_decay = weight_decay > 0.0;
  k.decay = static_cast<float>(1.0 - lr * weight_decay);
  k.gnorm_scale = static_cast<float>(gnorm_scale);
  k.first_step = step == 1;
  if (kind == kAdam) {
    const double c1 = 1.0 - pow_step(beta1, step);
    k.correction2 = static_cast<float>(::sqrt(1.0 - pow_step(beta2, step)));
    k.step_size = static_cast<float>(-lr / c1);
  }
  return k;
}

Q4_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
Q4_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
Q4_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
Q4_HD float sign_of(float u) { return u > 0.0f ? 1.0f : (u < 0.0f ? -1.0f : 0.0f); }

// One element's step (the order in the header comment). g: the gradient as
// fp32, before gnorm_scale; p, m, v: decoded, updated in place.
template <int32_t K>
Q4_HD void update(const Consts& k, float g, float& p, float& m, float& v) {
  g = g * k.gnorm_scale;
  if (K == kAdam) {
    m = fma_rn(g, k.one_minus_beta1, m * k.beta1);
    v = fma_rn(k.one_minus_beta2 * g, g, v * k.beta2);
    const float d = div_rn(sqrt_rn(v), k.correction2) + k.eps;
    if (k.has_decay) p = p * k.decay;
    p = p + div_rn(k.step_size * m, d);
  } else if (K == kMomentum) {
    g = fma_rn(p, k.weight_decay, g);
    m = k.first_step ? g : m * k.beta1 + g;
    p = fma_rn(m, k.neg_lr, p);
  } else if (K == kLion) {
    if (k.has_decay) p = p * k.decay;
    const float u = sign_of(m * k.beta1 + g * k.one_minus_beta1);
    p = fma_rn(u, k.neg_lr, p);
    m = fma_rn(g, k.one_minus_beta2, m * k.beta2);
  } else {
    g = fma_rn(p, k.weight_decay, g);
    m = fma_rn(k.one_minus_beta1 * g, g, m * k.beta1);
    p = p + div_rn(k.neg_lr * g, sqrt_rn(m) + k.eps);
  }
}

// The fp32 u with fp32(p + u) == next (what optax's apply_updates computes):
// u = next - p, moved by one ulp towards the target at most twice while p + u
// rounds elsewhere. Such a u exists unless |next - p| > |next| (then p + u is
// within an ulp of u from next).
Q4_HD float nextafter_f(float x, bool up) {
  if (x != x) return x;
  if (x == 0.0f) return bits_f32(up ? 0x00000001u : 0x80000001u);
  const uint32_t b = f32_bits(x);
  return bits_f32(((x > 0.0f) == up) ? b + 1u : b - 1u);
}
Q4_HD float update_to(float p, float next) {
  float u = next - p;
  for (int i = 0; i < 2; ++i) {
    const float r = p + u;
    if (r == next || r != r) break;
    u = nextafter_f(u, r < next);
  }
  return u;
}

// Whether a gradient value is finite (blocks holding a non-finite gradient
// are left unchanged and counted; see Optim8bitParams).
Q4_HD bool finite_bits(float g) { return (f32_bits(g) & 0x7f800000u) != 0x7f800000u; }

#if !defined(__CUDACC__)
namespace detail {
constexpr bool unsigned_sorted() {
  for (int i = 0; i + 1 < kCodes; ++i)
    if (!(unsigned_value(i) < unsigned_value(i + 1))) return false;
  return unsigned_value(0) == 0.0f && unsigned_value(kCodes - 1) == 1.0f;
}
}  // namespace detail
static_assert(detail::unsigned_sorted(), "unsigned dynamic map must be sorted from 0 to 1");
#endif

}  // namespace optim8
}  // namespace q4
