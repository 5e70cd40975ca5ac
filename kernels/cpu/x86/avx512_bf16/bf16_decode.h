// The bf16 decode of 4-bit weights shared by the bf16-compute units
// (x86/avx512_bf16 and x86/amx): the per-chunk bf16 tables, the chunk
// decode, the W tile decoder, the x panel packing and the W row-pair
// interleave of the input gradient. The bf16-compute contract and the decode
// itself are described in x86/avx512_bf16/gemm4.cc. Include after the unit's
// `#pragma GCC target` (AVX512_BF16); everything here has internal linkage,
// so each unit keeps its own copy.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../../gemm4_common.h"
#include "../../parallel.h"
#include "../avx512/scale_decoder.h"
#include "../avx512/store16.h"
#include "../avx512/transpose16.h"
#include "q4/common.h"
#include "q4/quant4.h"

namespace q4 {
namespace cpu {
namespace {

constexpr int64_t kChunk = 64;  // W elements decoded per step (32 packed bytes)
constexpr int kPanel = 16;      // x rows per panel (one per fp32 lane)
constexpr int64_t kStrip = 64;  // input gradient: dX columns per strip (4 zmm of 16)

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// A 64-byte aligned view of a scratch slot of at least `bytes` bytes.
template <typename T>
T* scratch_as(int slot, int64_t bytes) {
  float* p = scratch(slot, (bytes + 3) / 4 + 16);
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63);
  return reinterpret_cast<T*>(a);
}

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }
inline __m512 dot(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, as_bh(a), as_bh(b)); }

// The 16 fp32 codes of the format.
inline __m512 code_table(QuantType qt) {
  alignas(64) float t[16];
  Q4_QUANT_SWITCH(qt, QT, [&] {
    for (int q = 0; q < 16; ++q) t[q] = Code4<QT>::decode(q);
  });
  return _mm512_load_ps(t);
}

// Word j of the bf16 table: bit 4 set for j >= 16 (selects the second block's
// half of the table when a chunk spans two blocks).
inline __m512i upper_half_bit() { return _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1); }

// bf16 table of one chunk: codes * s0 in both halves, or codes * s0 in words
// 0-15 and codes * s1 in words 16-31 (TWO: blocksize 32).
template <bool TWO>
inline __m512i chunk_table(__m512 codes, float s0, float s1) {
  const __m512 a = _mm512_mul_ps(codes, _mm512_set1_ps(s0));
  if (!TWO) return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(a, a));
  const __m512 b = _mm512_mul_ps(codes, _mm512_set1_ps(s1));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
}

struct Chunk {
  __m512i hi, lo;  // bf16 W of chunk elements 0, 2, ..., 62 and 1, 3, ..., 63
};

// The 32 packed bytes of a 64-element chunk, one per word.
inline __m512i widen_chunk(const uint8_t* bytes) {
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
}

// Decode a widened chunk v with table `tab`.
template <bool TWO>
inline Chunk lookup_chunk(__m512i v, __m512i tab, __m512i half) {
  __m512i ih = _mm512_srli_epi16(v, 4), il = v;
  if (TWO) {
    ih = _mm512_or_si512(ih, half);
    il = _mm512_ternarylogic_epi32(v, _mm512_set1_epi16(15), half, 0xea);  // (v & 15) | half
  }
  return {_mm512_permutexvar_epi16(ih, tab), _mm512_permutexvar_epi16(il, tab)};
}

// Decode the 64-element chunk at `bytes` (32 packed bytes) with table `tab`.
template <bool TWO>
inline Chunk decode_chunk(const uint8_t* bytes, __m512i tab, __m512i half) {
  return lookup_chunk<TWO>(widen_chunk(bytes), tab, half);
}

// Word indices that deinterleave 64 words held in two vectors: even words,
// then odd words.
inline __m512i deinterleave_index(int parity) {
  alignas(64) uint16_t idx[32];
  for (int i = 0; i < 32; ++i) idx[i] = uint16_t(2 * i + parity);
  return _mm512_load_si512(idx);
}

// The deinterleaved chunk of 64 bf16 held as words 0-31 in a and 32-63 in
// b: e = elements 0, 2, ..., 62; o = 1, 3, ..., 63.
inline void deinterleave64(__m512i a, __m512i b, __m512i ie, __m512i io, __m512i* e, __m512i* o) {
  *e = _mm512_permutex2var_epi16(a, ie, b);
  *o = _mm512_permutex2var_epi16(a, io, b);
}

// The same for the 64 bf16 at src.
inline void deinterleave64(const uint16_t* src, __m512i ie, __m512i io, __m512i* e, __m512i* o) {
  deinterleave64(_mm512_loadu_si512(src), _mm512_loadu_si512(src + 32), ie, io, e, o);
}

template <typename T>
inline float load_bias_as(const void* bias, int64_t i) {
  return bias == nullptr ? 0.0f : Elem<T>::load(static_cast<const T*>(bias), i);
}

// Decodes W rows [r0, r0 + rows) x columns [c0, c0 + len) into wt (row r at
// wt + r * ldw dwords, chunk by chunk: 32 words hi, 32 words lo), one chunk
// per step(), so that the decode of the next tile can run inside the
// dot-product loop of the current one (where it costs a fraction of its cost
// alone). sc[b - b0] = scale of block b.
template <bool TWO>
struct TileDecoder {
  const uint8_t* packed;
  int64_t k;
  int shift;
  __m512 codes;
  const float* sc;
  int64_t b0, r0, rows, c0, len;
  uint32_t* wt;
  int64_t ldw;
  int64_t n;             // W rows in all (the prefetch stays inside W)
  int64_t tile_k;        // columns per tile (the next tile is prefetched)
  int64_t r = 0, c = 0;  // next chunk

  bool done() const { return r >= rows; }
  __attribute__((always_inline)) inline void step() {
    const uint64_t f = uint64_t((r0 + r) * k + c0 + c);
    const int64_t b = int64_t(f >> shift) - b0;
    // this row's bytes of the tile decoded next (the next k tile, or the
    // next row tile's first) into L1: each tile row is a run of 2 lines of
    // its own, which the hardware prefetchers do not catch in time
    // (measured: the decode waited on these loads for a fifth of the time at
    // m = 32); both prefetches stay inside that tile's run
    const bool same_rows = c0 + tile_k < k;
    if (c == 0 && (same_rows || r0 + rows + r < n)) {
      const uint64_t g = same_rows ? f + tile_k : uint64_t((r0 + rows + r) * k);
      const int64_t next_len = same_rows ? min64(tile_k, k - c0 - tile_k) : min64(tile_k, k);
      _mm_prefetch(reinterpret_cast<const char*>(packed + (g >> 1)), _MM_HINT_T0);
      if (next_len > 128) _mm_prefetch(reinterpret_cast<const char*>(packed + (g >> 1)) + 64, _MM_HINT_T0);
    }
    const __m512i tab = chunk_table<TWO>(codes, sc[b], TWO ? sc[b + 1] : 0.0f);
    const Chunk w = decode_chunk<TWO>(packed + (f >> 1), tab, upper_half_bit());
    uint32_t* dst = wt + r * ldw + c / 2;
    _mm512_store_si512(dst, w.hi);
    _mm512_store_si512(dst + 16, w.lo);
    c += kChunk;
    if (c >= len) {
      c = 0;
      ++r;
    }
  }
  void finish() {
    while (!done()) step();
  }
};

// Chunk c (64 columns) of x panel `panel` into the panels at xp
// (xp[panel][k/2][16]: dword t of row l of a panel at xp[(panel * k/2 + t) *
// 16 + l], t indexing the deinterleaved pairs), for P parts of x at once
// (part j's panels at xp + j * stride): row(r, l, e, o) sets e[j][l] and
// o[j][l] to part j of x row r's 64 bf16 of the chunk deinterleaved
// (deinterleave64); rows past m are zero.
template <int P = 1, typename Row>
inline void pack_panel_chunk(int64_t m, int64_t k, int64_t panel, int64_t c, uint32_t* xp, int64_t stride, Row&& row) {
  __m512i e[P][16], o[P][16];
  for (int l = 0; l < kPanel; ++l) {
    const int64_t r = panel * kPanel + l;
    if (r < m) {
      row(r, l, e, o);
    } else {
      for (int j = 0; j < P; ++j) e[j][l] = o[j][l] = _mm512_setzero_si512();
    }
  }
  for (int j = 0; j < P; ++j) {
    transpose16(e[j]);
    transpose16(o[j]);
    uint32_t* dst = xp + j * stride + (panel * (k / 2) + c / 2) * kPanel;
    for (int t = 0; t < 16; ++t) {
      _mm512_store_si512(dst + t * 16, e[j][t]);
      _mm512_store_si512(dst + (16 + t) * 16, o[j][t]);
    }
  }
}

// x [m, k] bf16 -> its panels at xp (pack_panel_chunk's layout).
inline void pack_panels(const uint16_t* x, int64_t m, int64_t k, uint32_t* xp) {
  const int64_t panels = ceil_div(m, kPanel), chunks = k / kChunk;
  parallel_for(panels * chunks, 16, [&](int64_t u0, int64_t u1) {
    const __m512i ie = deinterleave_index(0), io = deinterleave_index(1);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t panel = u / chunks, c = (u % chunks) * kChunk;
      pack_panel_chunk(m, k, panel, c, xp, 0, [&](int64_t r, int l, __m512i(*e)[16], __m512i(*o)[16]) {
        deinterleave64(x + r * k + c, ie, io, &e[0][l], &o[0][l]);
      });
    }
  });
}

// Word indices interleaving two rows' deinterleaved halves: word 2i = a[i0 +
// i], word 2i + 1 = b[i0 + i] (b's words are 32..63 of vpermt2w's table).
inline __m512i pair_index(int i0) {
  alignas(64) uint16_t idx[32];
  for (int i = 0; i < 16; ++i) {
    idx[2 * i] = uint16_t(i0 + i);
    idx[2 * i + 1] = uint16_t(32 + i0 + i);
  }
  return _mm512_load_si512(idx);
}

// Dword indices interleaving two fp32 vectors: lane 2i = a[i0 + i], 2i + 1 =
// b[i0 + i].
inline __m512i lane_pair_index(int i0) {
  alignas(64) int32_t idx[16];
  for (int i = 0; i < 8; ++i) {
    idx[2 * i] = i0 + i;
    idx[2 * i + 1] = 16 + i0 + i;
  }
  return _mm512_load_si512(idx);
}

// Two rows' decoded chunks a, b as decode_pair returns them.
inline void interleave_pair(const Chunk& a, const Chunk& b, __m512i i_lo, __m512i i_hi, __m512i z[4]) {
  z[0] = _mm512_permutex2var_epi16(a.hi, i_lo, b.hi);
  z[1] = _mm512_permutex2var_epi16(a.hi, i_hi, b.hi);
  z[2] = _mm512_permutex2var_epi16(a.lo, i_lo, b.lo);
  z[3] = _mm512_permutex2var_epi16(a.lo, i_hi, b.lo);
}

// W rows (ra, ra + 1) x the strip's 64 columns starting at flat index fa
// (row ra + 1 at fa + k; zeros when has_b is false) as 4 vectors of 16
// columns x the 2 rows: columns 0,2,..,30 | 32,..,62 | 1,..,31 | 33,..,63.
template <bool TWO>
inline void decode_pair(const uint8_t* __restrict packed, const float* __restrict sc, __m512 codes, int shift,
                        uint64_t fa, int64_t k, bool has_b, __m512i half, __m512i i_lo, __m512i i_hi, __m512i z[4]) {
  const uint64_t fb = fa + uint64_t(k);
  const int64_t ba = int64_t(fa >> shift), bb = int64_t(fb >> shift);
  const __m512i ta = chunk_table<TWO>(codes, sc[ba], TWO ? sc[ba + 1] : 0.0f);
  const Chunk a = decode_chunk<TWO>(packed + (fa >> 1), ta, half);
  Chunk b{_mm512_setzero_si512(), _mm512_setzero_si512()};
  if (has_b) {
    const __m512i tb = chunk_table<TWO>(codes, sc[bb], TWO ? sc[bb + 1] : 0.0f);
    b = decode_chunk<TWO>(packed + (fb >> 1), tb, half);
  }
  interleave_pair(a, b, i_lo, i_hi, z);
}

// acc[(panel * lda + r) * 16 + lane] (the tiled forward's sums of W rows
// r < rows and the 16 x rows of each panel) plus the bias -> out[panel * 16 +
// lane][r0 + r * stride], for the m x rows. stride > 1 (1 <= stride <=
// kMaxStoreStride: the W rows of a tile that takes every stride-th row): the
// (cols - 1) * stride + 1 output columns of 16 sums are stored in runs of 16,
// each run's sums moved to their columns by one permute and stored under the
// mask of those columns, with the same rounding (the other columns are other
// tiles').
constexpr int64_t kMaxStoreStride = 16;
template <typename OutT, typename BiasT>
void store_tiles(const float* acc, int64_t lda, int64_t rows, int64_t m, int64_t n, int64_t r0, const void* bias,
                 OutT* out, int64_t stride = 1) {
  const int64_t panels = ceil_div(m, kPanel);
  for (int64_t rs = 0; rs < rows; rs += 16) {
    const int cols = int(min64(16, rows - rs));
    alignas(64) float b[16] = {};
    for (int i = 0; i < cols; ++i) b[i] = load_bias_as<BiasT>(bias, r0 + (rs + i) * stride);
    const __m512 bv = _mm512_load_ps(b);
    const int runs = stride == 1 ? 1 : int(((cols - 1) * stride) / 16 + 1);
    alignas(64) int32_t index[kMaxStoreStride][16];
    __mmask16 mask[kMaxStoreStride] = {};
    for (int q = 0; stride > 1 && q < runs; ++q)
      for (int l = 0; l < 16; ++l) {
        const int64_t col = 16 * q + l, i = col / stride;
        index[q][l] = int32_t(min64(i, 15));
        if (col % stride == 0 && i < cols) mask[q] = __mmask16(mask[q] | (1u << l));
      }
    for (int64_t pn = 0; pn < panels; ++pn) {
      __m512i v[16];
      for (int i = 0; i < 16; ++i)
        v[i] = i < cols ? _mm512_load_si512(acc + (pn * lda + rs + i) * 16) : _mm512_setzero_si512();
      transpose16(v);
      const int lanes = int(min64(16, m - pn * kPanel));
      for (int l = 0; l < lanes; ++l) {
        OutT* dst = out + (pn * kPanel + l) * n + r0 + rs * stride;
        const __m512 y = _mm512_add_ps(_mm512_castsi512_ps(v[l]), bv);
        if (stride == 1) {
          store16<OutT>(dst, y, cols);
          continue;
        }
        for (int q = 0; q < runs; ++q)
          store16_mask<OutT>(dst + 16 * q, _mm512_permutexvar_ps(_mm512_load_si512(index[q]), y), mask[q]);
      }
    }
  }
}

// The input gradient's strip sums acc[r * lda + j] (columns in decode_pair's
// order: 0, 2, .., 30 | 32, .., 62 | 1, .., 31 | 33, .., 63) -> out[r * k +
// c0 + column] for r < m.
template <typename OutT>
void store_strip(const float* acc, int64_t m, int64_t k, int64_t c0, OutT* out, int64_t lda = kStrip) {
  const __m512i l_lo = lane_pair_index(0), l_hi = lane_pair_index(8);
  for (int64_t r = 0; r < m; ++r) {
    const float* a = acc + r * lda;
    const __m512 e0 = _mm512_load_ps(a), e1 = _mm512_load_ps(a + 16);
    const __m512 o0 = _mm512_load_ps(a + 32), o1 = _mm512_load_ps(a + 48);
    OutT* dst = out + r * k + c0;
    store16<OutT>(dst, _mm512_permutex2var_ps(e0, l_lo, o0), 16);
    store16<OutT>(dst + 16, _mm512_permutex2var_ps(e0, l_hi, o0), 16);
    store16<OutT>(dst + 32, _mm512_permutex2var_ps(e1, l_lo, o1), 16);
    store16<OutT>(dst + 48, _mm512_permutex2var_ps(e1, l_hi, o1), 16);
  }
}

// All n_blocks block scales of a weight, decoded once into the calling
// thread's scratch slot `slot` (the input gradients read them with stride k).
inline const float* decode_all_scales(const ScaleDecoder& scales, int64_t n_blocks, int slot) {
  float* sc = scratch_as<float>(slot, n_blocks * 4);
  parallel_for(ceil_div(n_blocks, 4096), 1,
               [&](int64_t u0, int64_t u1) { scales.decode(u0 * 4096, min64(n_blocks, u1 * 4096), sc + u0 * 4096); });
  return sc;
}

template <typename F>
void with_out_type(DType dt, F&& f) {
  if (dt == kF32) return f(static_cast<float*>(nullptr));
  if (dt == kBF16) return f(static_cast<bf16_t*>(nullptr));
  f(static_cast<f16_t*>(nullptr));
}

// The element types and scale decoder of a forward call: run(OutT*, BiasT*,
// scales) with null pointers of the output and bias element types; returns
// what run returns (true when it returns nothing).
template <typename F>
bool typed_forward(const Gemm4bitParams& p, F&& run) {
  const ScaleDecoder scales(p.scales);
  hint_fresh_output(p.out, p.m * p.n * (p.out_dtype == kF32 ? 4 : 2));
  bool ok = true;
  with_out_type(p.out_dtype, [&](auto* o) {
    with_out_type(p.bias == nullptr ? kF32 : p.bias_dtype, [&](auto* b) {
      if constexpr (std::is_void_v<decltype(run(o, b, scales))>)
        run(o, b, scales);
      else
        ok = run(o, b, scales);
    });
  });
  return ok;
}

// The same for the input gradient: run(OutT*, scales).
template <typename F>
bool typed_grad(const Gemm4bitGradInputParams& p, F&& run) {
  const ScaleDecoder scales(p.scales);
  hint_fresh_output(p.grad_input, p.m * p.k * (p.grad_input_dtype == kF32 ? 4 : 2));
  bool ok = true;
  with_out_type(p.grad_input_dtype, [&](auto* o) {
    if constexpr (std::is_void_v<decltype(run(o, scales))>)
      run(o, scales);
    else
      ok = run(o, scales);
  });
  return ok;
}

// The entry of a bf16-compute forward kernel: serves bf16 x (at an even
// address), k % 64 == 0 and m >= min_m through typed_forward; false otherwise.
template <typename F>
bool bf16_forward(const Gemm4bitParams& p, int64_t min_m, F&& run) {
  if (p.x_dtype != kBF16 || p.k % kChunk != 0 || p.m < min_m) return false;
  if (reinterpret_cast<uintptr_t>(p.x) % 2 != 0) return false;
  return typed_forward(p, run);
}

// The same for the input gradient, bf16 dY.
template <typename F>
bool bf16_grad(const Gemm4bitGradInputParams& p, int64_t min_m, F&& run) {
  if (p.grad_out_dtype != kBF16 || p.k % kChunk != 0 || p.m < min_m) return false;
  if (reinterpret_cast<uintptr_t>(p.grad_out) % 2 != 0) return false;
  return typed_grad(p, run);
}

}  // namespace
}  // namespace cpu
}  // namespace q4
