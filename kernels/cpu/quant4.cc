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
#include "q4/quant4.h"

#include <algorithm>
#include <cmath>

#include "parallel.h"
#include "q4/kernels.h"
#include "simd_avx2.h"

namespace q4 {
namespace cpu {
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

#if Q4_HAVE_AVX2_CODE
// Rank of s among the 15 sorted midpoints (= number of midpoints m with
// !(s <= m)) by a 4-level branchless binary search: level k compares against
// the midpoint selected by the bits found so far. Equal to the linear count
// because the midpoints are strictly increasing; NaN compares above all.
struct RankTables {
  __m256 m7, m3, m11;
  __m256 level3;  // midpoints 1, 5, 9, 13 (index = 2*b3 + b2)
  __m256 level4;  // midpoints 0, 2, ..., 14 (index = 4*b3 + 2*b2 + b1)
};

template <QuantType QT>
Q4_AVX2 RankTables rank_tables() {
  RankTables t;
  t.m7 = _mm256_set1_ps(Code4<QT>::midpoint(7));
  t.m3 = _mm256_set1_ps(Code4<QT>::midpoint(3));
  t.m11 = _mm256_set1_ps(Code4<QT>::midpoint(11));
  t.level3 = _mm256_setr_ps(Code4<QT>::midpoint(1), Code4<QT>::midpoint(5), Code4<QT>::midpoint(9),
                            Code4<QT>::midpoint(13), 0.f, 0.f, 0.f, 0.f);
  t.level4 =
      _mm256_setr_ps(Code4<QT>::midpoint(0), Code4<QT>::midpoint(2), Code4<QT>::midpoint(4), Code4<QT>::midpoint(6),
                     Code4<QT>::midpoint(8), Code4<QT>::midpoint(10), Code4<QT>::midpoint(12), Code4<QT>::midpoint(14));
  return t;
}

Q4_AVX2 __m256i rank15(const RankTables& t, __m256 s) {
  const __m256i one = _mm256_set1_epi32(1);
  const __m256 c1 = _mm256_cmp_ps(s, t.m7, _CMP_NLE_UQ);
  const __m256 c2 = _mm256_cmp_ps(s, _mm256_blendv_ps(t.m3, t.m11, c1), _CMP_NLE_UQ);
  // idx = 2*b3 + b2
  __m256i idx = _mm256_or_si256(_mm256_and_si256(_mm256_castps_si256(c1), _mm256_set1_epi32(2)),
                                _mm256_and_si256(_mm256_castps_si256(c2), one));
  const __m256 c3 = _mm256_cmp_ps(s, _mm256_permutevar8x32_ps(t.level3, idx), _CMP_NLE_UQ);
  idx = _mm256_or_si256(_mm256_slli_epi32(idx, 1), _mm256_and_si256(_mm256_castps_si256(c3), one));
  const __m256 c4 = _mm256_cmp_ps(s, _mm256_permutevar8x32_ps(t.level4, idx), _CMP_NLE_UQ);
  return _mm256_or_si256(_mm256_slli_epi32(idx, 1), _mm256_and_si256(_mm256_castps_si256(c4), one));
}

// Full blocks only (len a multiple of 32): the nibbles of x * inv.
template <QuantType QT, typename T>
Q4_AVX2 void encode_block_avx2(const T* x, int64_t len, float inv_scale, uint8_t* packed) {
  const __m256 inv = _mm256_set1_ps(inv_scale);
  const RankTables tables = rank_tables<QT>();
  alignas(16) uint8_t rank_to_nibble[16];
  for (int r = 0; r < 16; ++r) rank_to_nibble[r] = uint8_t(Code4<QT>::nibble_of_rank(r));
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(rank_to_nibble)));
  const __m256i pair_weights = _mm256_set1_epi16(0x0110);  // high nibble * 16 + low nibble * 1
  const __m256i fix_lanes = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < len; i += 32) {
    __m256i rank[4];
    for (int k = 0; k < 4; ++k) rank[k] = rank15(tables, _mm256_mul_ps(avx2::Vec<T>::load(x + i + 8 * k), inv));
    // int32 ranks -> 32 bytes in element order
    const __m256i ab = _mm256_packus_epi32(rank[0], rank[1]);
    const __m256i cd = _mm256_packus_epi32(rank[2], rank[3]);
    __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, cd), fix_lanes);
    if (QT != kNF4) bytes = _mm256_shuffle_epi8(lut, bytes);
    const __m256i pairs = _mm256_maddubs_epi16(bytes, pair_weights);  // 16 x (even<<4 | odd)
    const __m128i out = _mm_packus_epi16(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(packed + i / 2), out);
  }
}

template <QuantType QT, typename T>
Q4_AVX2 void quantize_block_avx2(const T* x, int64_t len, uint8_t* packed, float* absmax_out) {
  const float amax = avx2::absmax(x, len);
  encode_block_avx2<QT, T>(x, len, 1.0f / absmax_floor(amax), packed);
  *absmax_out = amax;
}

template <QuantType QT>
Q4_AVX2 __m256 code_lo() {
  return _mm256_setr_ps(Code4<QT>::decode(0), Code4<QT>::decode(1), Code4<QT>::decode(2), Code4<QT>::decode(3),
                        Code4<QT>::decode(4), Code4<QT>::decode(5), Code4<QT>::decode(6), Code4<QT>::decode(7));
}
template <QuantType QT>
Q4_AVX2 __m256 code_hi() {
  return _mm256_setr_ps(Code4<QT>::decode(8), Code4<QT>::decode(9), Code4<QT>::decode(10), Code4<QT>::decode(11),
                        Code4<QT>::decode(12), Code4<QT>::decode(13), Code4<QT>::decode(14), Code4<QT>::decode(15));
}

// Dequantize one full block. The 16 possible outputs of the block are
// computed once (decode(q) * absmax, rounded to T); each nibble then only
// selects one.
template <QuantType QT, typename T>
Q4_AVX2 void dequantize_block_avx2(const uint8_t* packed, int64_t len, float absmax, T* out) {
  const __m128i low4 = _mm_set1_epi8(0x0f);
  auto nibbles = [&](int64_t i, __m128i* n0, __m128i* n1) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + i / 2));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
    const __m128i lo = _mm_and_si128(b, low4);
    *n0 = _mm_unpacklo_epi8(hi, lo);  // nibbles of elements 0..15 (even element first)
    *n1 = _mm_unpackhi_epi8(hi, lo);  // elements 16..31
  };
  if constexpr (sizeof(T) == 2) {
    // 16-bit outputs: a byte shuffle per output byte over the 16 block values
    // (rounded by the same SIMD conversion the other kernels use).
    alignas(32) T vals[16];
    const __m256 scale = _mm256_set1_ps(absmax);
    avx2::Vec<T>::store(vals, _mm256_mul_ps(code_lo<QT>(), scale));
    avx2::Vec<T>::store(vals + 8, _mm256_mul_ps(code_hi<QT>(), scale));
    const __m256i v16 = _mm256_load_si256(reinterpret_cast<const __m256i*>(vals));
    // split the 16-bit values into their low bytes and high bytes
    const __m256i split =
        _mm256_shuffle_epi8(v16, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8,
                                                  10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    const __m256i gathered = _mm256_permute4x64_epi64(split, 0xD8);  // lo0-7 lo8-15 | hi0-7 hi8-15
    const __m256i lo_tab = _mm256_permute2x128_si256(gathered, gathered, 0x00);
    const __m256i hi_tab = _mm256_permute2x128_si256(gathered, gathered, 0x11);
    for (int64_t i = 0; i < len; i += 32) {
      __m128i n0, n1;
      nibbles(i, &n0, &n1);
      const __m256i nib = _mm256_set_m128i(n1, n0);
      const __m256i lo = _mm256_shuffle_epi8(lo_tab, nib), hi = _mm256_shuffle_epi8(hi_tab, nib);
      const __m256i r0 = _mm256_unpacklo_epi8(lo, hi);  // elements 0..7 | 16..23
      const __m256i r1 = _mm256_unpackhi_epi8(lo, hi);  // elements 8..15 | 24..31
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_permute2x128_si256(r0, r1, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i + 16), _mm256_permute2x128_si256(r0, r1, 0x31));
    }
  } else {
    const __m256 scale = _mm256_set1_ps(absmax);
    const __m256 t_lo = _mm256_mul_ps(code_lo<QT>(), scale), t_hi = _mm256_mul_ps(code_hi<QT>(), scale);
    for (int64_t i = 0; i < len; i += 32) {
      __m128i n0, n1;
      nibbles(i, &n0, &n1);
      const __m128i groups[4] = {n0, _mm_srli_si128(n0, 8), n1, _mm_srli_si128(n1, 8)};
      for (int k = 0; k < 4; ++k)
        _mm256_storeu_ps(out + i + 8 * k, avx2::lookup16(t_lo, t_hi, _mm256_cvtepu8_epi32(groups[k])));
    }
  }
}
#endif

template <QuantType QT, typename T>
void quantize_range(const Quantize4bitParams& p, int64_t b0, int64_t b1, bool simd) {
  const T* x = static_cast<const T*>(p.x);
  const int64_t bs = p.blocksize;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * bs, len = std::min(bs, p.n - start);
    const bool partial = len < bs;
#if Q4_HAVE_AVX2_CODE
    if (simd && !partial) {
      quantize_block_avx2<QT, T>(x + start, len, p.packed + start / 2, p.absmax + b);
      continue;
    }
#endif
    quantize_block_scalar<QT, T>(x + start, len, partial, p.packed + start / 2, p.absmax + b);
  }
}

template <QuantType QT, typename T>
void dequantize_range(const Dequantize4bitParams& p, int64_t b0, int64_t b1, bool simd) {
  T* out = static_cast<T*>(p.out);
  const int64_t bs = p.blocksize;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * bs, len = std::min(bs, p.n - start);
#if Q4_HAVE_AVX2_CODE
    if (simd && len == bs) {
      dequantize_block_avx2<QT, T>(p.packed + start / 2, len, p.absmax[b], out + start);
      continue;
    }
#endif
    dequantize_block_scalar<QT, T>(p.packed + start / 2, len, p.absmax[b], out + start);
  }
}

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

#if Q4_HAVE_AVX2_CODE
template <QuantType QT>
Q4_AVX2 float search_block_avx2(const float* x, int64_t bs) {
  const float amax = avx2::absmax(x, bs);
  if (!(amax > 0.0f) || !std::isfinite(amax)) return amax;
  const RankTables tables = rank_tables<QT>();
  alignas(32) float lo[8], hi[8];  // values in sorted (rank) order
  for (int r = 0; r < 8; ++r) {
    lo[r] = Code4<QT>::decode(Code4<QT>::nibble_of_rank(r));
    hi[r] = Code4<QT>::decode(Code4<QT>::nibble_of_rank(r + 8));
  }
  const __m256 vlo = _mm256_load_ps(lo), vhi = _mm256_load_ps(hi);
  float best = amax, best_err = 0.0f;
  for (int j = 0; j < kMseCandidates; ++j) {
    const float s = amax * mse_fraction(j);
    const __m256 inv = _mm256_set1_ps(1.0f / absmax_floor(s)), sv = _mm256_set1_ps(s);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < bs; i += 8) {
      const __m256 xv = _mm256_loadu_ps(x + i);
      const __m256i r = rank15(tables, _mm256_mul_ps(xv, inv));
      // rank >= 8 (bit 3) selects the upper table; permutevar8x32 uses the low 3 bits
      const __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(r, 28));
      const __m256 val = _mm256_blendv_ps(_mm256_permutevar8x32_ps(vlo, r), _mm256_permutevar8x32_ps(vhi, r), upper);
      const __m256 d = _mm256_sub_ps(xv, _mm256_mul_ps(val, sv));
      acc = _mm256_add_ps(acc, _mm256_mul_ps(d, d));
    }
    alignas(32) float lane[8];
    _mm256_store_ps(lane, acc);
    const float err = lane_tree(lane);
    if (j == 0 || err < best_err) {
      best_err = err;
      best = s;
    }
  }
  return best;
}
#endif

}  // namespace

Status quantize_4bit(const Quantize4bitParams& p) {
  Status s = validate(p);
  if (!s.ok()) return s;
  const bool simd = cpu_isa() >= kIsaAvx2;
  const int64_t blocks = p.absmax_size;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / p.blocksize);
  Q4_QUANT_SWITCH(p.quant_type, QT, [&] {
    Q4_DTYPE_SWITCH(p.x_dtype, T, [&] {
      parallel_for(blocks, grain, [&](int64_t b0, int64_t b1) { quantize_range<QT, T>(p, b0, b1, simd); });
    });
  });
  return Status::Ok();
}

Status dequantize_4bit(const Dequantize4bitParams& p) {
  Status s = validate(p);
  if (!s.ok()) return s;
  const bool simd = cpu_isa() >= kIsaAvx2;
  const int64_t blocks = p.absmax_size;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / p.blocksize);
  hint_fresh_output(p.out, p.n * (p.out_dtype == kF32 ? 4 : 2));
  Q4_QUANT_SWITCH(p.quant_type, QT, [&] {
    Q4_DTYPE_SWITCH(p.out_dtype, T, [&] {
      parallel_for(blocks, grain, [&](int64_t b0, int64_t b1) { dequantize_range<QT, T>(p, b0, b1, simd); });
    });
  });
  return Status::Ok();
}

namespace {
Status check_block_args(const float* x, int64_t n_blocks, int64_t blocksize, int32_t quant_type, const void* out) {
  if (n_blocks < 1) return Status::Invalid("n_blocks must be >= 1, got " + std::to_string(n_blocks));
  if (blocksize < kMinBlocksize || blocksize > kMaxBlocksize || (blocksize & (blocksize - 1)) != 0)
    return Status::Invalid("blocksize must be a power of two in [" + std::to_string(kMinBlocksize) + ", " +
                           std::to_string(kMaxBlocksize) + "], got " + std::to_string(blocksize));
  if (quant_type != kNF4 && quant_type != kFP4)
    return Status::Invalid("quant_type must be 0 (nf4) or 1 (fp4), got " + std::to_string(quant_type));
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
  const bool simd = cpu_isa() >= kIsaAvx2;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / blocksize);
  Q4_QUANT_SWITCH(quant_type, QT, [&] {
    parallel_for(n_blocks, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const float inv = 1.0f / absmax_floor(scales[b]);
#if Q4_HAVE_AVX2_CODE
        if (simd) {
          encode_block_avx2<QT, float>(x + b * blocksize, blocksize, inv, packed + b * blocksize / 2);
          continue;
        }
#endif
        encode_block_scalar<QT>(x + b * blocksize, blocksize, inv, packed + b * blocksize / 2);
      }
    });
  });
  return Status::Ok();
}

Status search_scales_4bit(const float* x, int64_t n_blocks, int64_t blocksize, int32_t quant_type, float* scales) {
  Status st = check_block_args(x, n_blocks, blocksize, quant_type, scales);
  if (!st.ok()) return st;
  const bool simd = cpu_isa() >= kIsaAvx2;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / (16 * blocksize));
  Q4_QUANT_SWITCH(quant_type, QT, [&] {
    parallel_for(n_blocks, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
#if Q4_HAVE_AVX2_CODE
        if (simd) {
          scales[b] = search_block_avx2<QT>(x + b * blocksize, blocksize);
          continue;
        }
#endif
        scales[b] = search_block_scalar<QT>(x + b * blocksize, blocksize);
      }
    });
  });
  return Status::Ok();
}

}  // namespace cpu
}  // namespace q4
