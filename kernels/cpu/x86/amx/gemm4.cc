// AMX bf16 forwards of the fused 4-bit matmul (contract: walks.h; the
// entries gemm4, gemm4_rows and gemv_f32 of cpu/dispatch.h).
//
// Forward, C[W row][x row] = W . x^T: x is packed once into the avx512_bf16
// tiled path's panels ([k/2 pairs][16 rows] dwords: the 16 pairs of one
// 32-element k step of a panel are one B tile, 1 KiB). A thread takes tiles
// of 32 W rows; per x block (as many panels as fit kXBlockBytes, kept in L2
// while the W tiles pass) and W tile, W is decoded in segments of kSegK
// columns into an L1 buffer (row r at r * kSegK / 2 dwords: A tiles of rows
// 0-15 and 16-31 at a 512-byte stride) and multiplied by every panel pair of
// the block, C = 2 W row groups x 2 panels in the tile registers (kept there
// over all of k when the block is one panel pair, else carried in memory
// between segments). Decoding into L1 rather than a whole-k tile in L2 took
// the decode from ~8 to ~5 cycles per 64 elements: stores into L2-resident
// lines cost ~3.4 cycles per chunk. The decode and the tile products do not
// overlap on this core (measured: decode alone + tile products alone = the
// whole), so the decode is the cost to cut.
//
// Shapes served: bf16 inputs, k % 64 == 0, m >= kMinM (fewer rows take the
// avx512_bf16 gemv); other calls return false and the next kernel runs. From
// kRowsMinM rows with k <= kRowsMaxK the x-major forward (gemm4_rows, below)
// runs first: x read in place as A tiles, W decoded into B tiles, C in the
// output's orientation.
//
// gemv_f32: batch-1 bf16 inputs through the avx512 level's fp32 gemv (the fp32
// contract: W not rounded to bf16). On these cores `vdpbf16ps` issues at half
// the rate of an fp32 FMA (`make pipes`: one per ~2 cycles against two FMAs
// per cycle), so at batch 1, where the decode and the dot products share the
// core, the fp32 gemv is the faster (4096^2: 0.33-0.35 ms against 0.38); from
// two rows the bf16 gemv is (0.53 against 0.60).
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../../dispatch.h"
#include "../../gemm4_common.h"
#include "../../parallel.h"
#include "../unit.h"
#include "q4/common.h"
#include "q4/int8.h"
#include "q4/kernels.h"
#include "q4/quant4.h"

Q4_UNIT_BEGIN(amx)

#include "../avx512/scale_decoder.h"
#include "../avx512_bf16/bf16_decode.h"
#include "tiles.h"
#include "walks.h"

namespace q4 {
namespace cpu {
namespace amx {
namespace {

// Decodes W rows r0 + r * stride (r < rows) x columns [c0, c0 + len) into the segment
// buffer ws (row r at ws + r * kSegK / 2 dwords; each 64-element chunk as its
// 32 even elements, then its 32 odd ones: k steps 2c and 2c + 1 of chunk c),
// and asks for each row's bytes of the next segment. sc[b - b0] = scale of
// block b.
template <bool TWO>
void decode_segment(const uint8_t* packed, int64_t k, int shift, __m512 codes, const float* sc, int64_t b0, int64_t r0,
                    int64_t rows, int64_t stride, int64_t c0, int64_t len, uint32_t* ws) {
  const __m512i half = upper_half_bit();
  for_each_segment_chunk<kSegK>(packed, k, shift, b0, r0, rows, stride, c0, len, ws,
                                [&](const uint8_t* bytes, int64_t b, uint32_t* d) {
                                  const __m512i tab = chunk_table<TWO>(codes, sc[b], TWO ? sc[b + 1] : 0.0f);
                                  const Chunk w = decode_chunk<TWO>(bytes, tab, half);
                                  _mm512_store_si512(d, w.hi);
                                  _mm512_store_si512(d + 16, w.lo);
                                });
}

// C tiles 0-3 = W rows 0-15 / 16-31 x panels 0 / 1 (Q panels) += the W
// segment ws times the panels at xp (panel stride ps dwords) over `steps` k
// steps. C is zeroed first (fresh), else loaded from acc (load) or kept in the
// tile registers from the previous segment; stored to acc[(panel * kWRows +
// r) * 16 + lane] when `store`.
template <int Q>
void segment_product(const uint32_t* ws, const uint32_t* xp, int64_t ps, int64_t steps, float* acc, bool fresh,
                     bool load, bool store) {
  if (fresh) {
    _tile_zero(0);
    _tile_zero(1);
    if (Q == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  } else if (load) {
    _tile_loadd(0, acc, 64);
    _tile_loadd(1, acc + 256, 64);
    if (Q == 2) {
      _tile_loadd(2, acc + 512, 64);
      _tile_loadd(3, acc + 768, 64);
    }
  }
  constexpr int64_t ldw = kSegK * 2;  // bytes per W row of the segment
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, ws + s * 16, ldw);
    _tile_loadd(5, ws + 16 * (kSegK / 2) + s * 16, ldw);
    _tile_loadd(6, xp + s * 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if (Q == 2) {
      _tile_loadd(7, xp + ps + s * 256, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  if (store) {
    _tile_stored(0, acc, 64);
    _tile_stored(1, acc + 256, 64);
    if (Q == 2) {
      _tile_stored(2, acc + 512, 64);
      _tile_stored(3, acc + 768, 64);
    }
  }
}

template <typename OutT, typename BiasT, bool TWO>
void forward(const Gemm4bitParams& p, const ScaleDecoder& scales) {
  const int64_t m = p.m, n = p.n, k = p.k;
  const int shift = log2_exact(p.blocksize);
  const int64_t panels = ceil_div(m, kPanel), ps = (k / 2) * kPanel;
  uint32_t* xp = scratch_as<uint32_t>(kSlotPanels, panels * ps * 4);
  pack_panels(static_cast<const uint16_t*>(p.x), m, k, xp);
  const __m512 codes = code_table(p.quant_type);
  const int64_t block = max64(2, kXBlockBytes / (ps * 4)) & ~int64_t(1);  // panels per x block
  OutT* out = static_cast<OutT*>(p.out);
  // W tiles in groups of S: the group's S * kWRows rows from g0, tile u of it
  // rows g0 + u + S * i (i < kWRows), so that a tile's rows lie a page or more
  // apart (one stream per page: see the gemv in x86/avx512/gemm4.cc) where k
  // / 2 bytes of a row are less than a page, for a W too large for L2. The
  // group's scales are decoded once. 4096^2 nested, bf16 x, 32 layers cycled
  // through the C ABI, alternating rounds of both builds: from DRAM batch 4
  // 0.94-1.05 -> 0.88-0.99 ms, batch 8 1.01-1.02 -> 0.94-0.97, batch 16 0.96
  // -> 0.94; from L3 3-4% faster at 4 and 8. (The rest of the DRAM penalty,
  // 0.3 ms, is not the pages: kernels/NOTES.md.) Only up to one panel pair
  // (32 x rows, W decoded once, its tiles' products short): with more panels
  // the spaced tiles measured slower (bf16 x, 512 rows, alternating rounds:
  // 4-32% from L3, 64 rows up to 10%; the rows' 4 KiB spacing puts a tile's
  // segment lines in the same L1 sets).
  const int64_t S = panels <= 2 && n * k / 2 >= kStreamedBytes ? min64(kMaxRowStride, max64(1, 8192 / k)) : 1;
  const int64_t group = S * kWRows;
  parallel_for(ceil_div(n, group), 1, [&](int64_t t0, int64_t t1) {
    configure_tiles();
    const int64_t sc_count = ((group * k) >> shift) + 4;
    uint32_t* ws = scratch_as<uint32_t>(kSlotRow, kWRows * kSegK * 2 + sc_count * 4);
    float* sc = reinterpret_cast<float*>(ws + kWRows * kSegK / 2);
    float* acc = scratch_as<float>(kSlotAcc, block * kWRows * 16 * 4);
    for (int64_t q0 = 0; q0 < panels; q0 += block) {
      const int64_t qe = min64(panels, q0 + block);
      const bool one = qe - q0 <= 2;  // one panel pair: C stays in the tile registers over all of k
      for (int64_t tile = t0 * S; tile < t1 * S; ++tile) {
        const int64_t g0 = tile / S * group, u = tile % S, r0 = g0 + u;
        if (r0 >= n) break;
        const int64_t rows = min64(kWRows, (n - r0 + S - 1) / S);                      // rows r0 + S i < n
        const BlockSpan blocks = row_blocks(g0, min64(n, g0 + group) - g0, k, shift);  // the group's blocks
        const int64_t b0 = blocks.first;
        if (u == 0) scales.decode(blocks.first, blocks.end, sc);
        if (rows < kWRows) memset(ws + rows * (kSegK / 2), 0, size_t((kWRows - rows) * kSegK * 2));
        for (int64_t c0 = 0; c0 < k; c0 += kSegK) {
          const int64_t len = min64(kSegK, k - c0);
          const bool last = c0 + len >= k;
          decode_segment<TWO>(p.packed, k, shift, codes, sc, b0, r0, rows, S, c0, len, ws);
          for (int64_t q = q0; q < qe; q += 2) {
            float* a = acc + (q - q0) * kWRows * 16;
            const uint32_t* x = xp + q * ps + (c0 / 2) * kPanel;
            if (qe - q >= 2)
              segment_product<2>(ws, x, ps, len / 32, a, c0 == 0, !one, !one || last);
            else
              segment_product<1>(ws, x, ps, len / 32, a, c0 == 0, !one, !one || last);
          }
        }
        for (int64_t q = q0; q < qe; q += 2)
          store_tiles<OutT, BiasT>(acc + (q - q0) * kWRows * 16, kWRows, rows, min64(2 * kPanel, m - q * kPanel), n, r0,
                                   p.bias, out + q * kPanel * n, S);
      }
    }
    _tile_release();
  });
}

// ------------------------------------------------------------ forward, x rows read in place

// From kRowsMinM x rows the forward turns the product around: C[x row][W
// row] = x . W^T, x's rows read in place as the A tiles (16 rows x 32 bf16,
// the row stride 2k bytes: no packing) and W decoded into B tiles in the
// VNNI layout ([k pair][16 W rows] dwords, 1 KiB), so that C is in the
// output's orientation and is stored without a transpose. The transposes
// move to W: (n / 16) (k / 32) B tiles per x block, against (m / 16) (k / 32)
// panel halves plus (m / 16) (n / 16) C tiles above -- fewer once the rows
// outnumber ~32 (bounded below by kRowsMinM, measured). Each k step sums the
// pairs (2i, 2i + 1) of 32 consecutive elements, where the W-major forward
// sums a chunk's even elements, then its odd ones: same contract, other bytes,
// so the kernel is chosen by the row count and the reduction length (never by
// n: a column shard keeps every output's bytes). Beyond kRowsMaxK the x
// blocks that fit the L2 get short and W's transposing decode repeats for
// each (k = 4096: slower than the W-major kernel below 512 rows).
constexpr int64_t kRowsMinM = 64;                  // x rows from which the x-in-place forward runs (measured crossover)
constexpr int64_t kRowsMaxK = 3072;                // ... up to this k (measured)
constexpr int64_t kRowsWBytes = int64_t(1) << 19;  // B tiles of W decoded at once per thread (in L2)

// W rows [r0, r0 + rows) (rows <= kWRows) x all k as B tiles at wb: k step s,
// W row group g (rows 16g .. 16g + 15) at wb + s * 512 + g * 256 dwords, row
// i of the tile = k pair 32s / 2 + i, dword j = (W[16g + j][32s + 2i], W[16g +
// j][32s + 2i + 1]); rows past `rows` are zero. The chunk decode (the W-major
// forward's, so the same bf16 values) gives each row's even and odd elements
// in two vectors; a 16 x 16 dword transpose of each puts element pairs (4j,
// 4j + 2) and (4j + 1, 4j + 3) of the 16 rows in vector j, and two word
// blends make the pairs (4j, 4j + 1) and (4j + 2, 4j + 3).
template <bool TWO>
void decode_b_tiles(const uint8_t* packed, int64_t k, int shift, __m512 codes, const float* sc, int64_t b0, int64_t r0,
                    int64_t rows, uint32_t* wb) {
  const __m512i half = upper_half_bit();
  const __mmask32 odd = 0xAAAAAAAAu;  // the high word of each dword
  for (int64_t g = 0; g < kWRows / 16; ++g)
    for (int64_t c = 0; c < k; c += kChunk) {
      __m512i e[16], o[16];
#pragma GCC unroll 16
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t r = 16 * g + i;
        if (r < rows) {
          const uint64_t f = uint64_t((r0 + r) * k + c);
          const int64_t b = int64_t(f >> shift) - b0;
          const Chunk w =
              decode_chunk<TWO>(packed + (f >> 1), chunk_table<TWO>(codes, sc[b], TWO ? sc[b + 1] : 0.0f), half);
          e[i] = w.hi;
          o[i] = w.lo;
        } else {
          e[i] = o[i] = _mm512_setzero_si512();
        }
      }
      transpose16(e);
      transpose16(o);
      uint32_t* d = wb + (c / 32) * 512 + g * 256;
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {  // pairs 2j, 2j + 1 of the chunk: k step c / 32 + j / 8, tile row 2j % 16
        uint32_t* dst = d + (j / 8) * 512 + (2 * j % 16) * 16;
        _mm512_store_si512(dst, _mm512_mask_blend_epi16(odd, e[j], _mm512_slli_epi32(o[j], 16)));
        _mm512_store_si512(dst + 16, _mm512_mask_blend_epi16(odd, _mm512_srli_epi32(e[j], 16), o[j]));
      }
    }
}

// The sums cb[i][j] (x row r + i, W row r0 + j; `rows` x `cols`) plus the bias -> out.
template <typename OutT>
inline void store_rows(const float* cb, const float* bias, int64_t rows, int64_t cols, int64_t n, OutT* out) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t g = 0; g < cols; g += 16)
      store16<OutT>(out + i * n + g, _mm512_add_ps(_mm512_load_ps(cb + i * 32 + g), _mm512_load_ps(bias + g)),
                    int(min64(16, cols - g)));
}

// A block's sums waiting in a C buffer for their stores, which run a few rows
// at a time between the next block's tile products (stored all at once after
// their block, they did not overlap the products: 1024 rows, 384 -> 1536 and
// 1536 -> 384 took 5-8% longer).
template <typename OutT>
struct PendingRows {
  const float* cb = nullptr;
  const float* bias = nullptr;
  int64_t rows = 0, cols = 0, n = 0, done = 0;
  OutT* out = nullptr;
  void store(int64_t count) {
    count = min64(count, rows - done);
    if (count <= 0) return;
    store_rows<OutT>(cb + done * 32, bias, count, cols, n, out + done * n);
    done += count;
  }
  void finish() { store(rows); }
};

// C tiles 0-3 = x rows 0-15 (A tiles at x0) / 16-31 (at x1; X2) x W row groups
// 0 / 1 (B tiles at wb + s * 512 and + 256) over `steps` k steps, from zero;
// stored to cb[x row][W row] (32 x 32 floats). x's k step s is at + s * xstep
// words, its rows ldx bytes apart. The pending rows are stored meanwhile, all
// of them before C is stored (so cb may be the pending rows' buffer).
template <bool X2, typename OutT>
void rows_product(const uint16_t* x0, const uint16_t* x1, int64_t xstep, int64_t ldx, const uint32_t* wb, int64_t steps,
                  float* cb, PendingRows<OutT>& pending) {
  const int64_t per_step = ceil_div(pending.rows, steps);
  _tile_zero(0);
  _tile_zero(1);
  if (X2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, wb + s * 512, 64);
    _tile_loadd(5, wb + s * 512 + 256, 64);
    _tile_loadd(6, x0 + s * xstep, ldx);
    _tile_dpbf16ps(0, 6, 4);
    _tile_dpbf16ps(1, 6, 5);
    if (X2) {
      _tile_loadd(7, x1 + s * xstep, ldx);
      _tile_dpbf16ps(2, 7, 4);
      _tile_dpbf16ps(3, 7, 5);
    }
    pending.store(per_step);
  }
  pending.finish();
  _tile_stored(0, cb, 128);
  _tile_stored(1, cb + 16, 128);
  if (X2) {
    _tile_stored(2, cb + 16 * 32, 128);
    _tile_stored(3, cb + 16 * 32 + 16, 128);
  }
}

template <typename OutT, typename BiasT, bool TWO>
void forward_rows(const Gemm4bitParams& p, const ScaleDecoder& scales) {
  const int64_t m = p.m, n = p.n, k = p.k, steps = k / 32;
  const int shift = log2_exact(p.blocksize);
  const uint16_t* x = static_cast<const uint16_t*>(p.x);
  // whole 32-row pairs are read in place; the rows after them packed into
  // tiles padded with zero rows (a tile load reads 16 rows)
  const int64_t full = m / 32 * 32, gs = steps * 512;  // words per packed group of 16 rows
  uint16_t* xa = nullptr;
  if (full < m) {
    xa = scratch_as<uint16_t>(kSlotPanels, ceil_div(m - full, 16) * gs * 2);
    pack_a_tiles(x + full * k, m - full, k, steps, xa);
  }
  const int64_t block = max64(32, kXBlockBytes / (k * 2) / 32 * 32);  // x rows per block (kept in L2 while W passes)
  const __m512 codes = code_table(p.quant_type);
  OutT* out = static_cast<OutT*>(p.out);
  parallel_for(ceil_div(n, kWRows), 1, [&](int64_t t0, int64_t t1) {
    configure_tiles();
    const int64_t tb = kWRows * k / 2;                                       // dwords of one W tile's B tiles
    const int64_t group = min64(t1 - t0, max64(1, kRowsWBytes / (tb * 4)));  // W tiles decoded at once
    const int64_t sc_count = ((kWRows * k) >> shift) + 4;
    uint32_t* wb = scratch_as<uint32_t>(kSlotRow, group * tb * 4 + sc_count * 4);
    float* sc = reinterpret_cast<float*>(wb + group * tb);
    // one C buffer: a product stores its C after it has finished the pending
    // stores of the previous one
    float* cb = scratch_as<float>(kSlotAcc, (32 * 32 + group * kWRows) * 4);
    float* bias = cb + 32 * 32;  // the group's tiles' bias
    for (int64_t q0 = 0; q0 < m; q0 += block) {
      const int64_t qe = min64(m, q0 + block);
      for (int64_t ga = t0; ga < t1; ga += group) {
        const int64_t ge = min64(t1, ga + group);
        for (int64_t tile = ga; tile < ge; ++tile) {
          const int64_t r0 = tile * kWRows, rows = min64(kWRows, n - r0);
          const BlockSpan blocks = row_blocks(r0, rows, k, shift);
          const int64_t b0 = blocks.first, b1 = blocks.end;
          scales.decode(b0, b1, sc);
          decode_b_tiles<TWO>(p.packed, k, shift, codes, sc, b0, r0, rows, wb + (tile - ga) * tb);
          for (int64_t j = 0; j < kWRows; ++j)
            bias[(tile - ga) * kWRows + j] = j < rows ? load_bias_as<BiasT>(p.bias, r0 + j) : 0.0f;
        }
        // x pairs outside, the group's W tiles inside: the pair's rows stay in
        // L1 while the W tiles pass
        PendingRows<OutT> pending;
        for (int64_t r = q0; r < qe; r += 32)
          for (int64_t tile = ga; tile < ge; ++tile) {
            const int64_t r0 = tile * kWRows;
            const uint32_t* w = wb + (tile - ga) * tb;
            float* c = cb;
            if (r + 32 <= full) {
              rows_product<true>(x + r * k, x + (r + 16) * k, 32, 2 * k, w, steps, c, pending);
            } else {
              const uint16_t* xr = xa + ((r - full) / 16) * gs;
              if (qe - r > 16)
                rows_product<true>(xr, xr + gs, 512, 64, w, steps, c, pending);
              else
                rows_product<false>(xr, nullptr, 512, 64, w, steps, c, pending);
            }
            pending = {
                c, bias + (tile - ga) * kWRows, min64(32, qe - r), min64(kWRows, n - r0), n, 0, out + r * n + r0};
          }
        pending.finish();
      }
    }
    _tile_release();
  });
}

}  // namespace

bool gemm4(const Gemm4bitParams& p, const gemm4::Scales&) {
  return bf16_forward(p, kMinM, [&](auto* o, auto* b, const ScaleDecoder& scales) {
    using OutT = std::remove_pointer_t<decltype(o)>;
    using BiasT = std::remove_pointer_t<decltype(b)>;
    if (p.blocksize == 32) return forward<OutT, BiasT, true>(p, scales);
    forward<OutT, BiasT, false>(p, scales);
  });
}

bool gemm4_rows(const Gemm4bitParams& p, const gemm4::Scales&) {
  if (p.k > kRowsMaxK) return false;
  return bf16_forward(p, kRowsMinM, [&](auto* o, auto* b, const ScaleDecoder& scales) {
    using OutT = std::remove_pointer_t<decltype(o)>;
    using BiasT = std::remove_pointer_t<decltype(b)>;
    if (p.blocksize == 32) return forward_rows<OutT, BiasT, true>(p, scales);
    forward_rows<OutT, BiasT, false>(p, scales);
  });
}

bool gemv_f32(const Gemm4bitParams& p, const gemm4::Scales& scales) {
  if (p.x_dtype != kBF16 || p.m != 1) return false;
  return avx512::gemm4(p, scales);
}

}  // namespace amx
}  // namespace cpu
}  // namespace q4

Q4_UNIT_END
