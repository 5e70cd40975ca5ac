// AVX-512 fp32 fused 4-bit matmuls for more than one row: the forward
// Y = X . W^T (+ bias) for m >= 2 and the input gradient dX = dY . W (every m),
// with 512-bit FMAs and register tiles sized for 32 zmm registers. Contract as
// the scalar reference: each W element is decode(nibble) * scale(block) in
// fp32 (the value dequantize_4bit returns), products and sums in fp32 (FMA),
// the bias added in fp32, one rounding to the output dtype. Each output
// element is summed in a fixed order whatever the thread count (threads split
// the outputs only, by rows or by columns, never a sum): FMA chains over chunks
// of the reduction (kKc / kKcGrad terms, 16 lanes in the row-dot path), the
// chunk sums added in order -- a blocked sum, so the error grows with the
// chunk length, not with k.
//
// The decode: 16 packed bytes (32 elements) widen to 16 int32 lanes (byte j
// in lane j); `permutexvar` looks a 16-entry table up with the low 4 bits of
// each lane, so the odd elements (low nibbles) need no masking and the even
// ones (high nibbles) one shift. The table is the code book times the block's
// scale (computed once per block; table[q] * scale is the same fp32 product as
// code * scale per element). A 32-element group therefore decodes to [even
// elements | odd elements]; the other operand of each product is laid out in
// that order too (the "group order" of k), so no shuffle is needed. A final
// 16-element group (k % 32 == 16) decodes to [8 even | 8 odd].
//
// Paths (k % 16 == 0; other shapes return false and the next kernel runs):
//   forward, small m (m <= kRowDotMaxM, and a last partial panel of at most
//     kRowDotTail rows): R W rows at a time are decoded into registers and
//     dotted with every X row (X copied once in group order); each of the
//     R x m accumulators is reduced once at the end.
//   forward, larger m: X is packed into panels of 16 rows ([k][16], group
//     order); per k chunk of kKc, a tile of R W rows is decoded once into an
//     L1 buffer [R][kKc] and reused by every panel: each decoded value is
//     broadcast against Q panels (R x Q zmm accumulators: 14 x 2, 9 x 3 or
//     24 x 1). Partial sums live in a per-thread buffer between k chunks, so
//     the X chunk of every panel (m x kKc floats) stays in L2 while the tiles
//     of the thread go by; the next tile's packed bytes are prefetched.
//   gradient, m <= 8: a strip of NZ*16 columns of every W row is decoded into
//     registers and multiplied straight into m x NZ accumulators.
//   gradient, larger m: dY is packed into slivers of <= 6 rows ([n][rows]);
//     per chunk of kKcGrad W rows, a strip of 64 columns of W is decoded once
//     into an L1 buffer [rows][64] (group order) and reused by every sliver:
//     each dY value is broadcast against 4 decoded vectors (6 x 4
//     accumulators). The columns are put back in order when dX is written.
//     Threads take strips of columns, or runs of dY rows when dY outweighs W
//     (grad_tiled).
// The dequantized weight never exists beyond one L1 tile; nothing is cached
// across calls and the packed parameter is only read (the per-call scratch
// holds the packed input and, for nested absmax, the decoded block scales).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../../dispatch.h"
#include "../../gemm4_common.h"
#include "../../parallel.h"
#include "../unit.h"
#include "q4/common.h"
#include "q4/kernels.h"
#include "q4/quant4.h"

Q4_UNIT_BEGIN(avx512)

#include "scale_decoder.h"
#include "transpose16.h"

namespace q4 {
namespace cpu {
namespace avx512 {
namespace {

using gemm4::Scales;

constexpr int64_t kKc = 256;        // forward: k values per chunk (the decoded tile's row length)
constexpr int64_t kKcGrad = 128;    // gradient: W rows per chunk (the decoded strip's length)
constexpr int kRowDotMaxM = 10;     // forward: the largest m of the row-dot path
constexpr int64_t kRowDotTail = 8;  // forward: a last partial panel of at most this many rows goes row-dot
// Partial sums kept per thread between k chunks (forward) or W row chunks
// (gradient): at most this many floats (4 MiB); a thread's range is done in
// pieces beyond it (each piece reads the packed input once more).
constexpr int64_t kMaxAccFloats = int64_t(1) << 20;
constexpr int64_t kGradPrefetchRows = 16;  // gradient: W rows ahead of the decode to prefetch

// A scratch buffer of `count` floats aligned to 64 bytes.
float* aligned_scratch(int slot, int64_t count) {
  float* p = scratch(slot, count + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

template <QuantType QT>
__m512 code_table() {
  alignas(64) float t[16];
  for (int q = 0; q < 16; ++q) t[q] = Code4<QT>::decode(q);
  return _mm512_load_ps(t);
}

// The scale of every block as one fp32 array: the absmax itself, or the
// nested absmax decoded (ScaleDecoder) into `buf` [n_blocks].
const float* block_scales(const Absmax4& a, float* buf) {
  if (!a.nested()) return a.absmax;
  const ScaleDecoder dec(a);
  parallel_for(a.n_blocks, int64_t(1) << 14, [&](int64_t b0, int64_t b1) { dec.decode(b0, b1, buf + b0); });
  return buf;
}

// Block scales looked up by flat element index: sc[f >> shift].
struct BlockScales {
  const float* sc;
  int shift;
};

// The 32 codes of the group whose 16 bytes start at `bytes`, as int32 lanes.
inline __m512i load_group(const uint8_t* bytes) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
}
// The 16 codes of a final half group (8 bytes); lanes 8..15 are zero.
inline __m512i load_half_group(const uint8_t* bytes) {
  return _mm512_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
}

// Decodes the groups of W: the 16-entry code table is multiplied by the scale
// of the current block once per block (table[q] * scale is the same fp32
// product as code * scale per element), so a group costs one widening load,
// one shift and two lookups.
template <QuantType QT>
class Decoder {
 public:
  Decoder() : Decoder(BlockScales{nullptr, 0}) {}
  explicit Decoder(const BlockScales& bs) : table_(code_table<QT>()), scaled_(table_), bs_(bs) {}

  // The even (e) and odd (o) elements of the group at flat index f (f % 16 == 0).
  void group(const uint8_t* packed, int64_t f, __m512& e, __m512& o) {
    const __m512i v = load_group(packed + (f >> 1));
    const __m512i hi = _mm512_srli_epi32(v, 4);
    const int64_t b = f >> bs_.shift;
    if (b != block_) set(b);
    if (((f + 16) >> bs_.shift) == b) {
      e = _mm512_permutexvar_ps(hi, scaled_);
      o = _mm512_permutexvar_ps(v, scaled_);
      return;
    }
    // a block boundary at f + 16: lanes 8..15 (elements f+16..f+31) scale by the next block
    const __m512 next = _mm512_mul_ps(table_, _mm512_set1_ps(bs_.sc[b + 1]));
    e = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(hi, scaled_), __mmask16(0xFF00), hi, next);
    o = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(v, scaled_), __mmask16(0xFF00), v, next);
    block_ = b + 1;
    scaled_ = next;
  }
  // The first flat index past f's block, and the scaled table of f's block.
  int64_t block_end(int64_t f) const { return ((f >> bs_.shift) + 1) << bs_.shift; }
  __m512 table_at(int64_t f) {
    const int64_t b = f >> bs_.shift;
    if (b != block_) set(b);
    return scaled_;
  }
  // A final half group at f (16 elements): lanes 0..7 of e and o are valid.
  void half_group(const uint8_t* packed, int64_t f, __m512& e, __m512& o) {
    const __m512i v = load_half_group(packed + (f >> 1));
    const int64_t b = f >> bs_.shift;
    if (b != block_) set(b);
    e = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), scaled_);
    o = _mm512_permutexvar_ps(v, scaled_);
  }

 private:
  void set(int64_t b) {
    block_ = b;
    scaled_ = _mm512_mul_ps(table_, _mm512_set1_ps(bs_.sc[b]));
  }
  __m512 table_, scaled_;
  BlockScales bs_;
  int64_t block_ = -1;
};

// W elements [f, f + len) of one row (f % 16 == 0, len % 16 == 0, whole
// groups except a final half group) into out, scaled, in group order.
template <QuantType QT>
inline void decode_segment(Decoder<QT>& d, const uint8_t* packed, int64_t f, int64_t len, float* out) {
  if ((f & 31) == 0) {  // groups never straddle a block: one table per block, no checks per group
    int64_t t = 0;
    while (t + 32 <= len) {
      const int64_t end = std::min(len & ~int64_t(31), d.block_end(f + t) - f);
      const __m512 table = d.table_at(f + t);
      for (; t < end; t += 32) {
        const __m512i v = load_group(packed + ((f + t) >> 1));
        _mm512_storeu_ps(out + t, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table));
        _mm512_storeu_ps(out + t + 16, _mm512_permutexvar_ps(v, table));
      }
    }
    if (t < len) {
      __m512 e, o;
      d.half_group(packed, f + t, e, o);
      _mm256_storeu_ps(out + t, _mm512_castps512_ps256(e));
      _mm256_storeu_ps(out + t + 8, _mm512_castps512_ps256(o));
    }
    return;
  }
  int64_t t = 0;
  for (; t + 32 <= len; t += 32) {
    __m512 e, o;
    d.group(packed, f + t, e, o);
    _mm512_storeu_ps(out + t, e);
    _mm512_storeu_ps(out + t + 16, o);
  }
  if (t < len) {
    __m512 e, o;
    d.half_group(packed, f + t, e, o);
    _mm256_storeu_ps(out + t, _mm512_castps512_ps256(e));
    _mm256_storeu_ps(out + t + 8, _mm512_castps512_ps256(o));
  }
}

// Group order of a row of `len` values (len % 16 == 0): src -> dst.
void to_group_order(const float* src, int64_t len, float* dst) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  int64_t t = 0;
  for (; t + 32 <= len; t += 32) {
    const __m512 a = _mm512_loadu_ps(src + t), b = _mm512_loadu_ps(src + t + 16);
    _mm512_storeu_ps(dst + t, _mm512_permutex2var_ps(a, even, b));
    _mm512_storeu_ps(dst + t + 16, _mm512_permutex2var_ps(a, odd, b));
  }
  if (t < len) {
    const __m512i half = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    _mm512_storeu_ps(dst + t, _mm512_permutexvar_ps(half, _mm512_loadu_ps(src + t)));
  }
}

// Sum of the 16 lanes, in a fixed order.
inline float hsum(__m512 v) {
  const __m512 h = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xEE));  // lanes 0..7: l + l+8
  __m128 q = _mm_add_ps(_mm512_castps512_ps128(h), _mm512_castps512_ps128(_mm512_shuffle_f32x4(h, h, 0x01)));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

template <typename T>
inline void put(void* out, int64_t i, float v) {
  Elem<T>::store(static_cast<T*>(out), i, v);
}

// The caller's scratch: `count` floats of packed operand, then (for nested
// absmax) room for the decoded block scales.
struct CallBuffers {
  float* packed;
  BlockScales scales;
};
CallBuffers call_buffers(int64_t count, const Absmax4& a, int64_t blocksize) {
  const int64_t padded = (count + 15) / 16 * 16;
  float* buf = aligned_scratch(gemm4::kSlotPanels, padded + (a.nested() ? a.n_blocks : 0));
  return {buf, {block_scales(a, buf + padded), gemm4::log2_exact(blocksize)}};
}

inline void prefetch_range(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
}

// ------------------------------------------------------- forward, small m

// R W rows, row r0 + r * stride for r < R, against all M rows of X (xg:
// [M][k] in group order).
template <QuantType QT, int R, int M, typename T>
void rowdot_rows(const Gemm4bitParams& p, const float* xg, const BlockScales& bs, int64_t r0, int64_t stride) {
  const int64_t k = p.k;
  __m512 acc[R][M];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 32
    for (int i = 0; i < M; ++i) acc[r][i] = _mm512_setzero_ps();
  Decoder<QT> dec[R];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r) dec[r] = Decoder<QT>(bs);
  int64_t t = 0;
  for (; t + 32 <= k; t += 32) {
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      __m512 e, o;
      dec[r].group(p.packed, (r0 + r * stride) * k + t, e, o);
#pragma GCC unroll 32
      for (int i = 0; i < M; ++i) {
        acc[r][i] = _mm512_fmadd_ps(e, _mm512_loadu_ps(xg + i * k + t), acc[r][i]);
        acc[r][i] = _mm512_fmadd_ps(o, _mm512_loadu_ps(xg + i * k + t + 16), acc[r][i]);
      }
    }
  }
  if (t < k) {
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      __m512 e, o;
      dec[r].half_group(p.packed, (r0 + r * stride) * k + t, e, o);
#pragma GCC unroll 32
      for (int i = 0; i < M; ++i) {
        acc[r][i] = _mm512_fmadd_ps(e, _mm512_maskz_loadu_ps(0xFF, xg + i * k + t), acc[r][i]);
        acc[r][i] = _mm512_fmadd_ps(o, _mm512_maskz_loadu_ps(0xFF, xg + i * k + t + 8), acc[r][i]);
      }
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r * stride;
    const float bias = gemm4::load_bias(p.bias, p.bias_dtype, row);
#pragma GCC unroll 32
    for (int i = 0; i < M; ++i) put<T>(p.out, i * p.n + row, hsum(acc[r][i]) + bias);
  }
}

template <int M>
constexpr int rowdot_r() {
  return M <= 2 ? 8 : (M <= 4 ? 24 / M : (M <= 8 ? 3 : (M <= 12 ? 2 : 1)));
}

template <QuantType QT, int M, typename T>
void rowdot(const Gemm4bitParams& p, const float* x, const Scales& /*scales*/) {
  constexpr int R = rowdot_r<M>();
  const int64_t k = p.k;
  const CallBuffers cb = call_buffers(M * k, p.scales, p.blocksize);
  float* xg = cb.packed;
  for (int i = 0; i < M; ++i) to_group_order(x + i * k, k, xg + i * k);
  const int64_t full = p.n / R;
  // Tiles of R rows; the last "tile" is the leftover rows, one at a time. A
  // chunk of tiles [a, b) covers rows [a R, b R) as R streams of b - a rows:
  // tile i takes row i of every stream, each stream in pages of its own,
  // where R adjacent rows shared pages (as the batch-1 gemv,
  // x86/avx512/gemm4.cc). The Xeon VM, 4096^2 nested, 32 layers cycled
  // through the C ABI, alternating rounds of both builds: from DRAM batch 2
  // 1.17-1.28 -> 0.95-1.03 ms, batch 4 1.55-1.76 -> 1.28-1.40, batch 8
  // 2.42-2.65 -> 2.36-2.54; from L3 the same or up to 10% faster. A software
  // prefetch of each stream's next row on top cost 9% from L3 at batch 2 and
  // gained nothing from DRAM. A row's sums do not depend on the other rows of
  // its tile: no output bit changes.
  parallel_for(full + (p.n % R != 0), 4, [&](int64_t a, int64_t b) {
    const int64_t run = std::max<int64_t>(0, std::min(b, full) - a);  // rows per stream
    for (int64_t i = 0; i < run; ++i) rowdot_rows<QT, R, M, T>(p, xg, cb.scales, a * R + i, run);
    if (b > full)
      for (int64_t r = full * R; r < p.n; ++r) rowdot_rows<QT, 1, M, T>(p, xg, cb.scales, r, 1);
  });
}

// ----------------------------------------------------- forward, tiled

// The register tile of both tiled kernels: acc[i][j] = sum over t < len of
// the broadcast scalar s[i * s_i + t * s_t] times the 16 floats at
// v + j * v_j + t * v_t (one FMA chain per accumulator, t in order), stored at
// c + i * c_i + j * c_j, or added to what is there when `load`.
template <int I, int J>
__attribute__((always_inline)) inline void outer_micro(const float* s, int64_t s_i, int64_t s_t, const float* v,
                                                       int64_t v_j, int64_t v_t, int64_t len, float* c, int64_t c_i,
                                                       int64_t c_j, bool load) {
  __m512 acc[I][J];
#pragma GCC unroll 32
  for (int i = 0; i < I; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < J; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    __m512 vv[J];
#pragma GCC unroll 16
    for (int j = 0; j < J; ++j) vv[j] = _mm512_load_ps(v + j * v_j + t * v_t);
#pragma GCC unroll 32
    for (int i = 0; i < I; ++i) {
      const __m512 sv = _mm512_set1_ps(s[i * s_i + t * s_t]);
#pragma GCC unroll 16
      for (int j = 0; j < J; ++j) acc[i][j] = _mm512_fmadd_ps(sv, vv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 32
  for (int i = 0; i < I; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < J; ++j) {
      float* cv = c + i * c_i + j * c_j;
      _mm512_store_ps(cv, load ? _mm512_add_ps(_mm512_load_ps(cv), acc[i][j]) : acc[i][j]);
    }
}

// c[r][q] (+)= sum_t w[r][t] * xp_q[t][0..16) for t < len, for R decoded W
// rows (w: [R][kKc]) and Q panels (xp + q * ldp: [len][16]); c[r][q] at c + q *
// c_vec + r * 16. The chunk's sum starts from zero and is added to c when
// `load` (a blocked sum: the error grows with kKc + k / kKc, not with k).
template <int R, int Q>
void fwd_micro(const float* w, const float* xp, int64_t ldp, int64_t len, float* c, int64_t c_vec, bool load) {
  outer_micro<R, Q>(w, kKc, 1, xp, ldp, 16, len, c, 16, c_vec, load);
}

template <int R, int Q>
void fwd_micro_tail(int q, const float* w, const float* xp, int64_t ldp, int64_t len, float* c, int64_t c_vec,
                    bool load) {
  if constexpr (Q > 1) {
    if (q == Q) return fwd_micro<R, Q>(w, xp, ldp, len, c, c_vec, load);
    return fwd_micro_tail<R, Q - 1>(q, w, xp, ldp, len, c, c_vec, load);
  } else {
    return fwd_micro<R, 1>(w, xp, ldp, len, c, c_vec, load);
  }
}

// Output columns [r0, r0 + rows) of every row from a tile's sums (per panel:
// [R][16 lanes]); an fp32 output a panel at a time through a 16 x 16
// transpose (R <= 16), others element by element.
template <int R, typename T>
void store_fwd_tile(const Gemm4bitParams& p, const float* ct, int64_t r0, int rows) {
  float bias[R];
  for (int r = 0; r < rows; ++r) bias[r] = gemm4::load_bias(p.bias, p.bias_dtype, r0 + r);
  if constexpr (std::is_same<T, float>::value && R <= 16) {
    const __mmask16 cols = __mmask16((1u << rows) - 1);
    const __m512 b = _mm512_maskz_loadu_ps(cols, bias);
    float* out = static_cast<float*>(p.out);
    for (int64_t pn = 0; pn * 16 < p.m; ++pn) {
      __m512 v[16];
      for (int r = 0; r < 16; ++r) v[r] = r < R ? _mm512_load_ps(ct + (pn * R + r) * 16) : _mm512_setzero_ps();
      transpose16(v);
      const int lanes = int(std::min<int64_t>(16, p.m - pn * 16));
      for (int l = 0; l < lanes; ++l)
        _mm512_mask_storeu_ps(out + (pn * 16 + l) * p.n + r0, cols, _mm512_add_ps(v[l], b));
    }
    return;
  }
  for (int64_t m = 0; m < p.m; ++m) {
    const float* a = ct + (m / 16) * R * 16 + m % 16;
    for (int r = 0; r < rows; ++r) put<T>(p.out, m * p.n + r0 + r, a[r * 16] + bias[r]);
  }
}

// W row tiles [t0, t1) of R rows against all P panels (xp: [P][k][16]): per
// k chunk, each tile is decoded once into an L1 buffer and meets every panel
// (the X chunk of all panels stays in L2); the packed bytes of the next tile
// are prefetched meanwhile (a tile row's chunk is 2 cache lines, rows k/2
// bytes apart: too short a stream for the hardware prefetchers).
template <QuantType QT, int R, int Q, typename T>
void fwd_tile_range(const Gemm4bitParams& p, const float* xp, int64_t P, const BlockScales& bs, int64_t t0,
                    int64_t t1) {
  const int64_t k = p.k, n = p.n;
  Decoder<QT> dec(bs);
  float* wd = aligned_scratch(gemm4::kSlotRow, R * kKc);
  const int64_t tile_acc = P * R * 16;
  float* acc = aligned_scratch(gemm4::kSlotAcc, (t1 - t0) * tile_acc);
  auto prefetch_tile = [&](int64_t tile, int64_t c0) {
    const int64_t len = std::min(kKc, k - c0);
    for (int64_t r = tile * R; r < std::min(n, tile * R + R); ++r) {
      const int64_t f = r * k + c0;
      prefetch_range(p.packed + (f >> 1), len / 2);
      _mm_prefetch(reinterpret_cast<const char*>(bs.sc + (f >> bs.shift)), _MM_HINT_T0);
    }
  };
  for (int64_t c0 = 0; c0 < k; c0 += kKc) {
    const int64_t len = std::min(kKc, k - c0);
    for (int64_t tile = t0; tile < t1; ++tile) {
      const int64_t r0 = tile * R;
      const int rows = int(std::min<int64_t>(R, n - r0));
      for (int r = 0; r < rows; ++r) decode_segment(dec, p.packed, (r0 + r) * k + c0, len, wd + r * kKc);
      for (int r = rows; r < R; ++r) std::fill(wd + r * kKc, wd + r * kKc + len, 0.0f);
      // The tile after next into L2 first, then (above) the next into L1:
      // from DRAM the L1 prefetch alone, one tile ahead, left the decode
      // waiting on its loads (two threads, Zen 4, 4096^2 fp32, 16 layers
      // cycled from DRAM: batch 32 7.1-7.2 -> 5.4 ms; from L3 within 1%).
      if (tile + 2 < t1) {
        for (int64_t r = (tile + 2) * R; r < std::min(n, (tile + 2) * R + R); ++r) {
          const uint8_t* row = p.packed + ((r * k + c0) >> 1);
          for (int64_t o = 0; o < len / 2; o += 64) prefetch_stream(row + o);
        }
      }
      if (tile + 1 < t1)
        prefetch_tile(tile + 1, c0);
      else if (c0 + kKc < k)
        prefetch_tile(t0, c0 + kKc);
      float* ct = acc + (tile - t0) * tile_acc;
      const float* xc = xp + c0 * 16;
      int64_t pn = 0;
      for (; pn + Q <= P; pn += Q) {
        // the sums of the next panel group (or tile), so the first FMAs do not wait on them
        if (c0 > 0) prefetch_range(ct + (pn + Q) * R * 16, Q * R * 64);
        fwd_micro<R, Q>(wd, xc + pn * k * 16, k * 16, len, ct + pn * R * 16, R * 16, c0 > 0);
      }
      if (pn < P)
        fwd_micro_tail<R, Q>(int(P - pn), wd, xc + pn * k * 16, k * 16, len, ct + pn * R * 16, R * 16, c0 > 0);
    }
  }
  for (int64_t tile = t0; tile < t1; ++tile) {
    const int64_t r0 = tile * R;
    store_fwd_tile<R, T>(p, acc + (tile - t0) * tile_acc, r0, int(std::min<int64_t>(R, n - r0)));
  }
}

// As fwd_tile_range, in pieces whose partial sums fit in kMaxAccFloats.
template <QuantType QT, int R, int Q, typename T>
void fwd_tiles(const Gemm4bitParams& p, const float* xp, int64_t P, const BlockScales& bs, int64_t t0, int64_t t1) {
  const int64_t step = std::max<int64_t>(1, kMaxAccFloats / (P * R * 16));
  for (int64_t a = t0; a < t1; a += step) fwd_tile_range<QT, R, Q, T>(p, xp, P, bs, a, std::min(t1, a + step));
}

// Panels [a, b) of X [m, k] (16 rows each) into xp[panel][t][lane], group
// order, rows past m zero. Per group: each row's values put in group order,
// then 16 x 16 transposes.
void pack_panel_range(const float* x, int64_t m, int64_t k, int64_t a, int64_t b, float* xp) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512i half = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int64_t pn = a; pn < b; ++pn) {
    float* dst = xp + pn * k * 16;
    const int rows = int(std::min<int64_t>(16, m - pn * 16));
    const float* src = x + pn * 16 * k;
    int64_t g = 0;
    for (; g + 32 <= k; g += 32) {
      __m512 e[16], o[16];
      for (int r = 0; r < 16; ++r) {
        if (r < rows) {
          const __m512 lo = _mm512_loadu_ps(src + r * k + g), hi = _mm512_loadu_ps(src + r * k + g + 16);
          e[r] = _mm512_permutex2var_ps(lo, even, hi);
          o[r] = _mm512_permutex2var_ps(lo, odd, hi);
        } else {
          e[r] = o[r] = _mm512_setzero_ps();
        }
      }
      transpose16(e);
      transpose16(o);
      for (int j = 0; j < 16; ++j) {
        _mm512_store_ps(dst + (g + j) * 16, e[j]);
        _mm512_store_ps(dst + (g + 16 + j) * 16, o[j]);
      }
    }
    if (g < k) {  // a final half group: [8 even | 8 odd]
      __m512 v[16];
      for (int r = 0; r < 16; ++r)
        v[r] = r < rows ? _mm512_permutexvar_ps(half, _mm512_loadu_ps(src + r * k + g)) : _mm512_setzero_ps();
      transpose16(v);
      for (int j = 0; j < 16; ++j) _mm512_store_ps(dst + (g + j) * 16, v[j]);
    }
  }
}

// [0, units) as one run per thread, each a multiple of `align` units where
// it can be (the last one shorter): fn(begin, end) for each run. The split by
// X panels (forward) and by dY rows (gradient).
template <typename F>
void for_each_thread_run(int64_t units, int64_t threads, int64_t align, F&& fn) {
  const int64_t per = ceil_div(ceil_div(units, threads), align) * align;
  parallel_for(ceil_div(units, per), 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) fn(g * per, std::min(units, (g + 1) * per));
  });
}

// Threads split the tiled forward by W rows (each thread: all panels, its
// tiles of W), or, when the packed X outweighs W (8 m > n: 4 bytes per X
// element against half a byte per W element) and every thread gets two
// panels or more, by panels (each thread packs its own panels and runs every
// tile of W over them). Split by W rows, X is packed by every thread and read
// by every thread, and the next call's packing then writes lines the other
// core holds. Split by panels, each thread writes and reads only its own X
// (W is read by both, never written) and the call is one fork-join, not two;
// W is decoded once per thread. Two threads, Zen 4, all-MiniLM-L6-v2 shapes
// at batch 256: 384 x 384 +5%, 1536 -> 384 +3%, 384 -> 1536 even. (The bf16
// forward, whose x panels are half the size, lost 3-8% split this way.) Each
// output is summed in the same order either way.
template <QuantType QT, int R, int Q, typename T>
void forward_tiled(const Gemm4bitParams& p, const float* x, const Scales& /*scales*/) {
  const int64_t P = ceil_div(p.m, int64_t(16)), tiles = ceil_div(p.n, int64_t(R));
  const CallBuffers cb = call_buffers(P * p.k * 16, p.scales, p.blocksize);
  const int64_t threads = std::max(1, cpu_num_threads());
  if (threads > 1 && 8 * p.m > p.n && P >= 2 * threads) {
    for_each_thread_run(P, threads, Q, [&](int64_t a, int64_t b) {
      pack_panel_range(x, p.m, p.k, a, b, cb.packed);
      Gemm4bitParams part = p;
      part.m = std::min(p.m, b * 16) - a * 16;
      part.out = static_cast<T*>(p.out) + a * 16 * p.n;
      fwd_tiles<QT, R, Q, T>(part, cb.packed + a * p.k * 16, b - a, cb.scales, 0, tiles);
    });
    return;
  }
  parallel_for(P, 1, [&](int64_t a, int64_t b) { pack_panel_range(x, p.m, p.k, a, b, cb.packed); });
  parallel_for(tiles, 1, [&](int64_t t0, int64_t t1) { fwd_tiles<QT, R, Q, T>(p, cb.packed, P, cb.scales, t0, t1); });
}

// Rows [0, m) of X by the row-dot path (m <= kRowDotMaxM).
template <QuantType QT, typename T>
void forward_rowdot(const Gemm4bitParams& p, const float* x, const Scales& scales) {
  switch (p.m) {
#define Q4_CASE(M) \
  case M:          \
    return rowdot<QT, M, T>(p, x, scales);
    Q4_CASE(1)
    Q4_CASE(2)
    Q4_CASE(3)
    Q4_CASE(4)
    Q4_CASE(5)
    Q4_CASE(6)
    Q4_CASE(7)
    Q4_CASE(8)
    Q4_CASE(9)
    Q4_CASE(10)
#undef Q4_CASE
    default:
      break;
  }
}

template <QuantType QT, typename T>
void forward(const Gemm4bitParams& p, const float* x, const Scales& scales) {
  if (p.m <= kRowDotMaxM) return forward_rowdot<QT, T>(p, x, scales);
  // A last panel of only a few rows costs a whole panel in the tiled path:
  // those rows go through the row-dot path instead (its own pass over W).
  const int64_t tail = p.m % 16;
  if (tail != 0 && tail <= kRowDotTail && p.m > 16) {
    Gemm4bitParams head = p, rest = p;
    head.m = p.m - tail;
    rest.m = tail;
    rest.out = static_cast<T*>(p.out) + head.m * p.n;
    forward<QT, T>(head, x, scales);
    return forward_rowdot<QT, T>(rest, x + head.m * p.k, scales);
  }
  const int64_t P = ceil_div(p.m, int64_t(16));
  if (P == 1) return forward_tiled<QT, 24, 1, T>(p, x, scales);
  if (P == 2) return forward_tiled<QT, 14, 2, T>(p, x, scales);
  if (P == 3) return forward_tiled<QT, 9, 3, T>(p, x, scales);
  return forward_tiled<QT, 14, 2, T>(p, x, scales);
}

// ------------------------------------------------------------ gradient

// dX rows [0, m) of a strip from its sums (row i at cs + i * ldc, group
// order), the columns put back in order.
template <int NZ, typename T>
void store_grad_strip(const Gemm4bitGradInputParams& p, const float* cs, int64_t ldc, int64_t c0) {
  constexpr int S = NZ * 16;
  const int64_t k = p.k, width = std::min<int64_t>(S, k - c0);
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const __m512i half = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  alignas(64) float row[S];
  for (int64_t i = 0; i < p.m; ++i) {
    const float* a = cs + i * ldc;
    int64_t g = 0;
    for (; g + 32 <= width; g += 32) {
      const __m512 e = _mm512_load_ps(a + g), o = _mm512_load_ps(a + g + 16);
      _mm512_store_ps(row + g, _mm512_permutex2var_ps(e, lo, o));
      _mm512_store_ps(row + g + 16, _mm512_permutex2var_ps(e, hi, o));
    }
    if (g < width) _mm512_store_ps(row + g, _mm512_permutexvar_ps(half, _mm512_load_ps(a + g)));
    if constexpr (std::is_same<T, float>::value) {
      std::memcpy(static_cast<float*>(p.grad_input) + i * k + c0, row, size_t(width) * sizeof(float));
    } else {
      for (int64_t c = 0; c < width; ++c) put<T>(p.grad_input, i * k + c0 + c, row[c]);
    }
  }
}

// Small m: a strip of NZ*16 columns of every W row is decoded into registers
// and multiplied straight into M x NZ accumulators (dY read in place).
template <QuantType QT, int M, int NZ, typename T>
void grad_strip_fused(const Gemm4bitGradInputParams& p, const float* dy, const BlockScales& bs, int64_t strip) {
  constexpr int S = NZ * 16, G = NZ / 2;
  Decoder<QT> dec(bs);
  const int64_t n = p.n, k = p.k, c0 = strip * S, width = std::min<int64_t>(S, k - c0);
  const int full = int(width / 32);   // whole groups in the strip
  const bool half = width % 32 != 0;  // and a final half group
  alignas(64) float sums[M * S];
  // blocks of kKcGrad rows, each summed from zero and added to `sums` (a
  // blocked sum, as in the tiled path)
  for (int64_t n0 = 0; n0 < n; n0 += kKcGrad) {
    __m512 acc[M][NZ];
#pragma GCC unroll 32
    for (int i = 0; i < M; ++i)
#pragma GCC unroll 16
      for (int z = 0; z < NZ; ++z) acc[i][z] = _mm512_setzero_ps();
    for (int64_t r = n0; r < std::min(n, n0 + kKcGrad); ++r) {
      const int64_t f = r * k + c0;
      __m512 g[M];
#pragma GCC unroll 32
      for (int i = 0; i < M; ++i) g[i] = _mm512_set1_ps(dy[i * n + r]);
#pragma GCC unroll 16
      for (int j = 0; j < G; ++j) {
        if (j < full) {
          __m512 e, o;
          dec.group(p.packed, f + 32 * j, e, o);
#pragma GCC unroll 32
          for (int i = 0; i < M; ++i) {
            acc[i][2 * j] = _mm512_fmadd_ps(g[i], e, acc[i][2 * j]);
            acc[i][2 * j + 1] = _mm512_fmadd_ps(g[i], o, acc[i][2 * j + 1]);
          }
        } else if (j == full && half) {
          __m512 e, o;
          dec.half_group(p.packed, f + 32 * j, e, o);
          // [8 even | 8 odd] in the low half of one vector, as decode_segment lays it out
          const __m512 eo = _mm512_shuffle_f32x4(e, o, 0x44);
#pragma GCC unroll 32
          for (int i = 0; i < M; ++i) acc[i][2 * j] = _mm512_fmadd_ps(g[i], eo, acc[i][2 * j]);
        }
      }
    }
#pragma GCC unroll 32
    for (int i = 0; i < M; ++i)
#pragma GCC unroll 16
      for (int z = 0; z < NZ; ++z) {
        float* sv = sums + i * S + z * 16;
        _mm512_store_ps(sv, n0 > 0 ? _mm512_add_ps(_mm512_load_ps(sv), acc[i][z]) : acc[i][z]);
      }
  }
  store_grad_strip<NZ, T>(p, sums, S, c0);
}

template <QuantType QT, int M, int NZ, typename T>
void grad_fused(const Gemm4bitGradInputParams& p, const float* dy, const Scales& /*scales*/) {
  const CallBuffers cb = call_buffers(0, p.scales, p.blocksize);
  parallel_for(ceil_div(p.k, int64_t(NZ * 16)), 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) grad_strip_fused<QT, M, NZ, T>(p, dy, cb.scales, s);
  });
}

// c[j][z] (+)= sum_t dy[t * ld + j] * ws[t][16z .. 16z+16) for t < len, j < RA
// rows of a sliver, z < NZ; c[j][z] at c + j * NZ * 16 + z * 16 (the chunk's
// sum added to it when `load`, as in fwd_micro).
template <int RA, int NZ>
void grad_micro(const float* dy, int64_t ld, const float* ws, int64_t len, float* c, bool load) {
  outer_micro<RA, NZ>(dy, 1, ld, ws, 16, NZ * 16, len, c, NZ * 16, 16, load);
}

template <int RA, int NZ>
void grad_micro_rows(int rows, const float* dy, int64_t ld, const float* ws, int64_t len, float* c, bool load) {
  if constexpr (RA > 1) {
    if (rows == RA) return grad_micro<RA, NZ>(dy, ld, ws, len, c, load);
    return grad_micro_rows<RA - 1, NZ>(rows, dy, ld, ws, len, c, load);
  } else {
    return grad_micro<1, NZ>(dy, ld, ws, len, c, load);
  }
}

// dY rows split into slivers of at most max_sliver<NZ>() rows, as even as
// possible (sliver s: rows [first(s), first(s) + rows(s))), each packed as
// [n][rows].
template <int NZ>
constexpr int max_sliver() {
  return NZ == 2 ? 14 : 6;  // NZ = 4: 6 x 4 accumulators
}
struct Slivers {
  int64_t count, base, extra;  // the first `extra` slivers have base + 1 rows
  Slivers(int64_t m, int max_rows) : count(ceil_div(m, int64_t(max_rows))), base(m / count), extra(m % count) {}
  int rows(int64_t s) const { return int(base + (s < extra)); }
  int64_t first(int64_t s) const { return s * base + std::min(s, extra); }
};

// dX column strips [s0, s1) of NZ*16 columns; dyp: the packed slivers (sliver
// s at dyp + first(s) * n).
template <QuantType QT, int NZ, typename T>
void grad_strip_range(const Gemm4bitGradInputParams& p, const float* dyp, const BlockScales& bs, int64_t s0,
                      int64_t s1) {
  constexpr int S = NZ * 16;
  const int64_t n = p.n, k = p.k, m = p.m;
  const Slivers sl(m, max_sliver<NZ>());
  Decoder<QT> dec(bs);
  float* ws = aligned_scratch(gemm4::kSlotRow, kKcGrad * S);
  float* acc = aligned_scratch(gemm4::kSlotAcc, (s1 - s0) * m * S);  // per strip: [m][S]
  for (int64_t n0 = 0; n0 < n; n0 += kKcGrad) {
    const int64_t len = std::min(kKcGrad, n - n0);
    for (int64_t strip = s0; strip < s1; ++strip) {
      const int64_t c0 = strip * S, width = std::min<int64_t>(S, k - c0);
      for (int64_t r = 0; r < len; ++r) {
        // rows are k/2 bytes apart: prefetch a few rows ahead (bytes and scale)
        if (n0 + r + kGradPrefetchRows < n) {
          const int64_t fa = (n0 + r + kGradPrefetchRows) * k + c0;
          _mm_prefetch(reinterpret_cast<const char*>(p.packed + (fa >> 1)), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(bs.sc + (fa >> bs.shift)), _MM_HINT_T0);
        }
        decode_segment(dec, p.packed, (n0 + r) * k + c0, width, ws + r * S);
        if (width < S) std::fill(ws + r * S + width, ws + r * S + S, 0.0f);
      }
      float* cs = acc + (strip - s0) * m * S;
      for (int64_t s = 0; s < sl.count; ++s) {
        const int rows = sl.rows(s);
        const int64_t i0 = sl.first(s);
        // the sums of the next sliver (or strip), so the first FMAs do not wait on them
        if (n0 > 0) prefetch_range(cs + (i0 + rows) * S, int64_t(sl.rows(s + 1)) * S * 4);
        grad_micro_rows<max_sliver<NZ>(), NZ>(rows, dyp + i0 * n + n0 * rows, rows, ws, len, cs + i0 * S, n0 > 0);
      }
    }
  }
  for (int64_t strip = s0; strip < s1; ++strip) store_grad_strip<NZ, T>(p, acc + (strip - s0) * m * S, S, strip * S);
}

// As grad_strip_range, in pieces whose partial sums fit in kMaxAccFloats.
template <QuantType QT, int NZ, typename T>
void grad_strips(const Gemm4bitGradInputParams& p, const float* dyp, const BlockScales& bs, int64_t s0, int64_t s1) {
  const int64_t step = std::max<int64_t>(1, kMaxAccFloats / (p.m * NZ * 16));
  for (int64_t a = s0; a < s1; a += step) grad_strip_range<QT, NZ, T>(p, dyp, bs, a, std::min(s1, a + step));
}

// Slivers [s0, s1) of dY [m, n] (slivers of at most max_rows rows): sliver s
// is [n][rows(s)] at dyp + first(s) * n.
void pack_sliver_range(const float* dy, int64_t m, int64_t n, int max_rows, int64_t s0, int64_t s1, float* dyp) {
  const Slivers sl(m, max_rows);
  for (int64_t s = s0; s < s1; ++s) {
    const int rows = sl.rows(s);
    const int64_t i0 = sl.first(s);
    float* dst = dyp + i0 * n;
    for (int j = 0; j < rows; ++j) {
      const float* src = dy + (i0 + j) * n;
      for (int64_t t = 0; t < n; ++t) dst[t * rows + j] = src[t];
    }
  }
}

// Threads split the gradient by dX column strips (each thread: all of the
// packed dY, its strips of W), or, when the packed dY outweighs W (8 m > k:
// 4 bytes per dY element against half a byte per W element) and every thread
// gets two slivers or more, by dY rows (each thread packs its own rows and
// runs every strip of W over them), as the forward splits by panels of X
// (forward_tiled): two threads, Zen 4, batch 256: 384 x 384 +6%, 384 -> 1536
// (k = 384) +3%, 1536 -> 384 -2 to +1%; batch 64, 384 x 384: +22%. Each dX
// element is summed in the same order either way (a row's sums never depend
// on the rows beside it).
template <QuantType QT, int NZ, typename T>
void grad_tiled(const Gemm4bitGradInputParams& p, const float* dy, const Scales& /*scales*/) {
  constexpr int kRows = max_sliver<NZ>();
  const CallBuffers cb = call_buffers(p.m * p.n, p.scales, p.blocksize);
  const int64_t strips = ceil_div(p.k, int64_t(NZ * 16)), slivers = Slivers(p.m, kRows).count;
  const int64_t threads = std::max(1, cpu_num_threads());
  if (threads > 1 && 8 * p.m > p.k && slivers >= 2 * threads) {
    // runs of whole slivers where they can be
    for_each_thread_run(p.m, threads, kRows, [&](int64_t a, int64_t b) {
      Gemm4bitGradInputParams part = p;
      part.m = b - a;
      part.grad_input = static_cast<T*>(p.grad_input) + a * p.k;
      float* dyp = cb.packed + a * p.n;
      pack_sliver_range(dy + a * p.n, part.m, p.n, kRows, 0, Slivers(part.m, kRows).count, dyp);
      grad_strips<QT, NZ, T>(part, dyp, cb.scales, 0, strips);
    });
    return;
  }
  parallel_for(slivers, 1, [&](int64_t a, int64_t b) { pack_sliver_range(dy, p.m, p.n, kRows, a, b, cb.packed); });
  parallel_for(strips, 1, [&](int64_t s0, int64_t s1) { grad_strips<QT, NZ, T>(p, cb.packed, cb.scales, s0, s1); });
}

template <QuantType QT, typename T>
void grad(const Gemm4bitGradInputParams& p, const float* dy, const Scales& scales) {
  switch (p.m) {
    case 1:
      return grad_fused<QT, 1, 8, T>(p, dy, scales);
    case 2:
      return grad_fused<QT, 2, 8, T>(p, dy, scales);
    case 3:
      return grad_fused<QT, 3, 6, T>(p, dy, scales);
    case 4:
      return grad_fused<QT, 4, 4, T>(p, dy, scales);
    case 5:
      return grad_fused<QT, 5, 4, T>(p, dy, scales);
    case 6:
      return grad_fused<QT, 6, 4, T>(p, dy, scales);
    case 7:
      return grad_fused<QT, 7, 2, T>(p, dy, scales);
    case 8:
      return grad_fused<QT, 8, 2, T>(p, dy, scales);
    default:
      return grad_tiled<QT, 4, T>(p, dy, scales);
  }
}

}  // namespace

bool gemm4_tiled(const Gemm4bitParams& p, const gemm4::Scales& scales) {
  if (p.m < 2 || p.k % 16 != 0) return false;
  const float* x = gemm4::as_f32(p.x, p.x_dtype, p.m * p.k);
  Q4_QUANT_SWITCH(p.quant_type, QT, [&] { Q4_DTYPE_SWITCH(p.out_dtype, T, [&] { forward<QT, T>(p, x, scales); }); });
  return true;
}

bool grad4(const Gemm4bitGradInputParams& p, const gemm4::Scales& scales) {
  if (p.k % 16 != 0) return false;
  const float* dy = gemm4::as_f32(p.grad_out, p.grad_out_dtype, p.m * p.n);
  Q4_QUANT_SWITCH(p.quant_type, QT,
                  [&] { Q4_DTYPE_SWITCH(p.grad_input_dtype, T, [&] { grad<QT, T>(p, dy, scales); }); });
  return true;
}

}  // namespace avx512
}  // namespace cpu
}  // namespace q4

Q4_UNIT_END
