// AVX2 block functions of the 4-bit quantize / dequantize (contracts in
// cpu/quant4.cc; the drivers in cpu/quant4_loops.h): the same bytes and
// values as the scalar ones (no FMA contraction anywhere). Entries of the
// quantize4 / dequantize4 / encode4 / search4 chains from the avx2 level.
#include "q4/quant4.h"

#include <immintrin.h>

#include <cmath>

#include "../../dispatch.h"
#include "../../quant4_loops.h"
#include "../../simd_avx2.h"
#include "../unit.h"

Q4_UNIT_BEGIN(avx2)

namespace q4 {
namespace cpu {
namespace avx2 {
namespace {

using namespace quant4_loops;  // NOLINT: the drivers' constants and scalar pieces
namespace simd = ::q4::avx2;

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
RankTables rank_tables() {
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

__m256i rank15(const RankTables& t, __m256 s) {
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
void encode_block_avx2(const T* x, int64_t len, float inv_scale, uint8_t* packed) {
  const __m256 inv = _mm256_set1_ps(inv_scale);
  const RankTables tables = rank_tables<QT>();
  alignas(16) uint8_t rank_to_nibble[16];
  for (int r = 0; r < 16; ++r) rank_to_nibble[r] = uint8_t(Code4<QT>::nibble_of_rank(r));
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(rank_to_nibble)));
  const __m256i pair_weights = _mm256_set1_epi16(0x0110);  // high nibble * 16 + low nibble * 1
  const __m256i fix_lanes = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < len; i += 32) {
    __m256i rank[4];
    for (int k = 0; k < 4; ++k) rank[k] = rank15(tables, _mm256_mul_ps(simd::Vec<T>::load(x + i + 8 * k), inv));
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
void quantize_block_avx2(const T* x, int64_t len, uint8_t* packed, float* absmax_out) {
  const float amax = simd::absmax(x, len);
  encode_block_avx2<QT, T>(x, len, 1.0f / absmax_floor(amax), packed);
  *absmax_out = amax;
}

template <QuantType QT>
__m256 code_lo() {
  return _mm256_setr_ps(Code4<QT>::decode(0), Code4<QT>::decode(1), Code4<QT>::decode(2), Code4<QT>::decode(3),
                        Code4<QT>::decode(4), Code4<QT>::decode(5), Code4<QT>::decode(6), Code4<QT>::decode(7));
}
template <QuantType QT>
__m256 code_hi() {
  return _mm256_setr_ps(Code4<QT>::decode(8), Code4<QT>::decode(9), Code4<QT>::decode(10), Code4<QT>::decode(11),
                        Code4<QT>::decode(12), Code4<QT>::decode(13), Code4<QT>::decode(14), Code4<QT>::decode(15));
}

// Dequantize one full block. The 16 possible outputs of the block are
// computed once (decode(q) * absmax, rounded to T); each nibble then only
// selects one.
template <QuantType QT, typename T>
void dequantize_block_avx2(const uint8_t* packed, int64_t len, float absmax, T* out) {
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
    simd::Vec<T>::store(vals, _mm256_mul_ps(code_lo<QT>(), scale));
    simd::Vec<T>::store(vals + 8, _mm256_mul_ps(code_hi<QT>(), scale));
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
        _mm256_storeu_ps(out + i + 8 * k, simd::lookup16(t_lo, t_hi, _mm256_cvtepu8_epi32(groups[k])));
    }
  }
}

template <QuantType QT>
float search_block_avx2(const float* x, int64_t bs) {
  const float amax = simd::absmax(x, bs);
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

struct Avx2Loops {
  template <QuantType QT, typename T>
  static void quantize_block(const T* x, int64_t len, uint8_t* packed, float* absmax) {
    quantize_block_avx2<QT, T>(x, len, packed, absmax);
  }
  template <QuantType QT, typename T>
  static void dequantize_block(const uint8_t* packed, int64_t len, float absmax, T* out) {
    dequantize_block_avx2<QT, T>(packed, len, absmax, out);
  }
  template <QuantType QT>
  static void encode_block(const float* x, int64_t len, float inv, uint8_t* packed) {
    encode_block_avx2<QT, float>(x, len, inv, packed);
  }
  template <QuantType QT>
  static float search_block(const float* x, int64_t bs) {
    return search_block_avx2<QT>(x, bs);
  }
};

}  // namespace

bool quantize4(const Quantize4bitParams& p) {
  quantize_op<Avx2Loops>(p);
  return true;
}
bool dequantize4(const Dequantize4bitParams& p) {
  dequantize_op<Avx2Loops>(p);
  return true;
}
bool encode4(const Blocks4& a) {
  encode_op<Avx2Loops>(a);
  return true;
}
bool search4(const Blocks4& a) {
  search_op<Avx2Loops>(a);
  return true;
}

}  // namespace avx2
}  // namespace cpu
}  // namespace q4

Q4_UNIT_END
