// AMX kernels of the fused 4-bit matmuls (and of LLM.int8's input gradient,
// which shares the 4-bit gradients' tile walks): bf16 compute for bf16 inputs
// on the tile unit (TDPBF16PS), at the amx level (AVX512_BF16 + AMX-TILE,
// AMX-BF16, AMX-INT8, and the OS's permission for the tile data; isa.cc).
//
// Contract: the bf16-compute contract of x86/avx512_bf16/gemm4.cc. Each W
// element is decode(nibble) * scale(block) in fp32 rounded once to bf16 (the
// same decode, bf16_decode.h); TDPBF16PS, like vdpbf16ps, multiplies bf16
// pairs exactly, accumulates in fp32 rounding to nearest even, treats denormal
// inputs as zero and flushes denormal results. Only the order of the fp32
// additions differs from the avx512_bf16 paths (the error bound there holds
// as it is). Work is split over W row tiles (forward) and dX column strips
// (gradient), each output summed in a fixed order: results do not depend on
// the thread count.
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
// Input gradient, dX[m, c] = sum_n dY[m, n] W[n, c]: dY is the A operand, read
// in place (rows 2n bytes apart) up to kGradInPlaceN columns, packed once into
// A tiles beyond ([16-row group][32-column step][16 rows][32 words], zero past
// m and n: at n = 4096 its rows would all fall in one L1 set); the rows after
// the last whole 32-row pair are always packed.
// Threads own strips of kAmxStrip dX columns; per dY block (rows whose strip
// sums fit kL2Budget: one block up to 1536 rows, so W is decoded once) and
// strip, W is decoded kSegN rows at a time as interleaved row pairs
// (bf16_decode.h decode_pair: B tiles of 16 pairs x 16 columns, 1 KiB each)
// into an L2 buffer, and C = 2 dY row groups x 2 column groups is carried in
// memory between segments (64-row segments in L1 measured slower: a C round
// trip every 2 k steps). A strip reads 32
// bytes of every W row per 64 columns, rows k/2 bytes apart: latency-bound
// (53 cycles per row pair from L3 against 17 from L2 in a microbenchmark), so
// strips are 256 columns wide (two whole lines of each row).
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
#include "q4/common.h"
#include "q4/int8.h"
#include "q4/kernels.h"
#include "q4/quant4.h"

#if defined(__x86_64__) || defined(__i386__)

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,avx2,fma,f16c,amx-tile,amx-bf16,amx-int8")
// GCC 12's AVX-512 intrinsic headers trip -Wmaybe-uninitialized (GCC bug 105593)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include "../avx512/scale_decoder.h"
#include "../avx512_bf16/bf16_decode.h"
#include "tiles.h"

namespace q4 {
namespace cpu {
namespace amx {
namespace {

using gemm4::kSlotAcc;
using gemm4::kSlotInput;
using gemm4::kSlotPanels;
using gemm4::kSlotRow;
using gemm4::log2_exact;

constexpr int64_t kMinM = 3;                          // x rows from which the tile path runs (measured crossover)
constexpr int64_t kWRows = 32;                        // W rows per decoded W tile (two A tiles)
constexpr int64_t kMaxRowStride = 4;                  // forward: a W tile's rows at most this many rows apart
constexpr int64_t kStreamedBytes = int64_t(4) << 20;  // forward: from this many bytes of W its tiles take spaced rows
static_assert(kMaxRowStride <= kMaxStoreStride, "store_tiles stores rows at most kMaxStoreStride apart");
constexpr int64_t kSegK = 256;  // W columns decoded per segment (32 rows: 16 KiB of bf16, stays in L1)
constexpr int64_t kXBlockBytes = int64_t(3) << 19;  // x panels kept in L2 while the W tiles pass (1.5 MiB)
constexpr int64_t kAmxStrip = 256;  // gradient: dX columns per strip (two whole 64-byte lines of each W row)
constexpr int64_t kSegN = 256;      // gradient: W rows decoded per segment (a strip's columns: 128 KiB, in L2)
constexpr int64_t kStripStep = kAmxStrip / 16 * 256;  // gradient: dwords per k step of a strip's W tiles
constexpr int64_t kL2Budget = int64_t(3) << 19;       // gradient: bytes of L2 for a dY block's strip sums
constexpr int64_t kGradInPlaceN = 1536;  // gradient: dY read in place up to this width (packed beyond: measured)

// The walk of a segment decode over W rows r0 + r * stride (r < rows) x
// columns [c0, c0 + len): asks for each row's bytes of the next segment (SEG
// columns wide), then calls chunk(bytes, b, d) for each 64-element chunk with
// its 32 packed bytes, its block b - b0 and its destination d = ws + r * SEG /
// 2 + c / 2.
template <int64_t SEG, typename F>
inline void for_each_segment_chunk(const uint8_t* packed, int64_t k, int shift, int64_t b0, int64_t r0, int64_t rows,
                                   int64_t stride, int64_t c0, int64_t len, uint32_t* ws, F&& chunk) {
  for (int64_t r = 0; r < rows; ++r) {
    uint64_t g = uint64_t((r0 + r * stride) * k + c0);
    if (c0 + len < k)
      for (int64_t l = 0; l < min64(SEG, k - c0 - len); l += 128)
        _mm_prefetch(reinterpret_cast<const char*>(packed + ((g + len + l) >> 1)), _MM_HINT_T0);
    uint32_t* d = ws + r * (SEG / 2);
    for (int64_t c = 0; c < len; c += kChunk, g += kChunk, d += 32)
      chunk(packed + (g >> 1), int64_t(g >> shift) - b0, d);
  }
}

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

// A [m, cols] bf16 -> ap[group of 16 rows][step of 32 columns][16 rows][32
// words], zero past m and cols: the A tiles of a group, 1 KiB each, contiguous
// (dY in the input gradient beyond kGradInPlaceN columns, and in both the
// forward and the gradient the rows after the last whole 32-row pair read in
// place, padded with zero rows).
void pack_a_tiles(const uint16_t* a, int64_t m, int64_t cols, int64_t steps, uint16_t* ap) {
  parallel_for(ceil_div(m, 16) * steps, 64, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t g = u / steps, c0 = (u % steps) * 32;
      const int64_t len = min64(32, cols - c0);
      const __mmask32 mk = len >= 32 ? ~__mmask32(0) : ((__mmask32(1) << len) - 1);
      uint16_t* dst = ap + u * 512;
      for (int l = 0; l < 16; ++l) {
        const int64_t row = g * 16 + l;
        const __m512i v = row < m ? _mm512_maskz_loadu_epi16(mk, a + row * cols + c0) : _mm512_setzero_si512();
        _mm512_store_si512(dst + l * 32, v);
      }
    }
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

// ------------------------------------------------------------ input gradient

// A strip's W segment -- rows [n0, n0 + rows), the strip's `halves` 64-column
// parts -- as B tiles in wt ([rows / 32 k steps][kAmxStrip / 16 column
// groups][16 row pairs][16 dwords]), PARTS sets of them part_stride dwords
// apart; row pairs past n are zero. decode(t, h, z) fills z[part][0..3] with
// row pair t's part h (decode_pair's four vectors).
template <int PARTS, typename Decode>
inline void decode_strip_segment(int64_t rows, int64_t halves, uint32_t* wt, int64_t part_stride, Decode&& decode) {
  const int64_t pairs = (rows + 1) / 2, steps = ceil_div(rows, 32);
  if (pairs % 16 != 0)  // pairs past n: zero
    for (int j = 0; j < PARTS; ++j)
      memset(wt + j * part_stride + (pairs / 16) * kStripStep, 0, size_t((steps - pairs / 16) * kStripStep) * 4);
  for (int64_t t = 0; t < pairs; ++t) {
    uint32_t* dst = wt + (t / 16) * kStripStep + (t % 16) * 16;
    for (int64_t h = 0; h < halves; ++h) {
      __m512i z[PARTS][4];
      decode(t, h, z);
      for (int j = 0; j < PARTS; ++j)
        for (int q = 0; q < 4; ++q) _mm512_store_si512(dst + j * part_stride + (4 * h + q) * 256, z[j][q]);
    }
  }
}

// C tiles 0-3 = dY rows 0-15 / 16-31 (A tiles: the groups at dy and dy + gs
// words, k step s at + s * ystep words, rows ldy bytes apart: packed groups
// by default, dY's rows in place with ystep 32, ldy 2n) x column groups g, g
// + 1 of the strip (B tiles at wt + q * 256 dwords, k step s at + s *
// kAmxStrip * 16) += their products over `steps` steps of 16 W row pairs; C
// starts at zero (fresh) or from acc[r * kAmxStrip + q * 16 + lane], and is
// stored there. G2: both dY row groups.
template <bool G2>
void grad_product(const uint16_t* dy, int64_t gs, const uint32_t* wt, int64_t steps, float* acc, bool fresh,
                  int64_t ystep = 512, int64_t ldy = 64) {
  constexpr int64_t lda = kAmxStrip * 4;  // bytes per row of acc
  if (fresh) {
    _tile_zero(0);
    _tile_zero(2);
    if (G2) {
      _tile_zero(1);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, acc, lda);
    _tile_loadd(2, acc + 16, lda);
    if (G2) {
      _tile_loadd(1, acc + 16 * kAmxStrip, lda);
      _tile_loadd(3, acc + 16 * kAmxStrip + 16, lda);
    }
  }
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(6, wt + s * kStripStep, 64);
    _tile_loadd(7, wt + s * kStripStep + 256, 64);
    _tile_loadd(4, dy + s * ystep, ldy);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    if (G2) {
      _tile_loadd(5, dy + gs + s * ystep, ldy);
      _tile_dpbf16ps(1, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, lda);
  _tile_stored(2, acc + 16, lda);
  if (G2) {
    _tile_stored(1, acc + 16 * kAmxStrip, lda);
    _tile_stored(3, acc + 16 * kAmxStrip + 16, lda);
  }
}

// The input gradients' work: (dY row block, strip) units, row-block major.
// A block has at most `most` rows (its sums for a strip stay in the L2),
// and fewer where the strips alone would not give each thread two units: at
// k = 384 (a strip of 256 columns and one of 128) two threads split by
// strips alone were one busy while the other did half as much. Rows are
// independent, so the blocking changes no bit.
struct GradUnits {
  int64_t m, strips, block, count;
  GradUnits(int64_t m_, int64_t k, int64_t most, int64_t align) : m(m_) {
    strips = ceil_div(k, kAmxStrip);
    const int64_t blocks = ceil_div(2 * int64_t(std::max(1, cpu_num_threads())), strips);
    block = max64(align, min64(most, ceil_div(ceil_div(m, blocks), align) * align));
    count = ceil_div(m, block) * strips;
  }
  struct Unit {
    int64_t r0, re, strip;  // dY rows [r0, re), the strip's index
  };
  Unit operator[](int64_t u) const {
    const int64_t r0 = (u / strips) * block;
    return {r0, min64(m, r0 + block), u % strips};
  }
};

// Asks for the bytes at `at` of W rows (row, row + 1) (rows `stride` bytes
// apart) kAheadPairs row pairs on, where they exist. A gradient strip reads a
// few lines of each W row, rows k / 2 (4-bit) or k (int8) bytes apart, each
// in its own 4 KiB page at k = 4096, which the hardware prefetchers do not
// follow. Measured (bf16 dY, 4096^2, in-process A/B): 4-bit 1.42 -> 1.14 ms
// at 4 rows, 2.06 -> 1.88 at 64, 9.0 -> 8.4 at 512; int8 2.02 -> 1.31 at 4
// rows, 3.46 -> 2.03 at 64; 2 and 8 pairs ahead alike, 16 worse; MiniLM's
// shapes (W in L2) unchanged. In asm: GCC 12 emitted no instruction for
// _mm_prefetch / __builtin_prefetch here (none in the gradients' loops).
constexpr int64_t kAheadPairs = 4;

inline void prefetch_ahead(const void* at, int64_t row, int64_t n, int64_t stride) {
  if (row + 2 * kAheadPairs + 1 < n) {
    const char* a = static_cast<const char*>(at) + 2 * kAheadPairs * stride;
    asm volatile("prefetcht0 %0" ::"m"(*a));
    asm volatile("prefetcht0 %0" ::"m"(*(a + stride)));
  }
}

// dX [m, k] (OutT) = dY [m, n] (bf16) . W [n, k] on the tile unit, W given by
// decode(row, col, has_b, z): rows (row, row + 1) x the 64 columns from col
// as decode_pair's four vectors (row + 1 zero when has_b is false). The
// 4-bit weights' gradient (grad below) and LLM.int8's (int8_grad) share it:
// only their W decodes differ.
template <typename OutT, typename Decode>
void grad_tiles(const uint16_t* dy, int64_t m, int64_t n, int64_t k, OutT* out, Decode&& decode) {
  const int64_t steps = ceil_div(n, 32), gs = steps * 512;  // k steps of 32 dY columns; words per dY group
  // up to kGradInPlaceN columns, whole 32-row pairs of dY are read in place
  // (the rest packed): the same values in the same order, so no bit changes
  const int64_t full = n <= kGradInPlaceN && n % 32 == 0 ? m / 32 * 32 : 0;
  uint16_t* dyp = scratch_as<uint16_t>(kSlotInput, ceil_div(m - full, 16) * gs * 2);
  if (full < m) pack_a_tiles(dy + full * n, m - full, n, steps, dyp);
  // dY rows per block: their sums for a strip (acc) stay in the L2 while the
  // strip's W segments pass; the packed dY rows stream from wherever they are
  // (a strip reads them once per W segment: ~4 bytes per cycle at 512 rows)
  const GradUnits units(m, k, max64(32, kL2Budget / (kAmxStrip * 4) / 32 * 32), 32);
  const int64_t block = units.block;
  parallel_for(units.count, 1, [&](int64_t u0, int64_t u1) {
    configure_tiles();
    // a segment of the strip's W: [kSegN / 32 steps][kAmxStrip / 16 column groups][16 pairs][16 dwords]
    uint32_t* wt = scratch_as<uint32_t>(kSlotRow, kSegN * kAmxStrip * 2);
    float* acc = scratch_as<float>(kSlotAcc, block * kAmxStrip * 4);
    for (int64_t u = u0; u < u1; ++u) {
      const auto [r0, re, st] = units[u];
      // the strip's 64-column parts (fewer in the last strip when k % kAmxStrip != 0)
      const int64_t c0 = st * kAmxStrip, halves = min64(kAmxStrip / kStrip, (k - c0) / kStrip);
      for (int64_t n0 = 0; n0 < n; n0 += kSegN) {
        const int64_t rows = min64(kSegN, n - n0), seg_steps = ceil_div(rows, 32);
        decode_strip_segment<1>(rows, halves, wt, 0, [&](int64_t t, int64_t h, __m512i z[1][4]) {
          decode(n0 + 2 * t, c0 + h * kStrip, n0 + 2 * t + 1 < n, z[0]);
        });
        for (int64_t r = r0; r < re; r += 32) {
          float* ac = acc + (r - r0) * kAmxStrip;
          if (r + 32 <= full) {
            const uint16_t* a = dy + r * n + n0;
            for (int g = 0; g < 4 * halves; g += 2)
              grad_product<true>(a, 16 * n, wt + g * 256, seg_steps, ac + g * 16, n0 == 0, 32, 2 * n);
            continue;
          }
          const uint16_t* a = dyp + ((r - full) / 16) * gs + (n0 / 32) * 512;
          for (int g = 0; g < 4 * halves; g += 2) {
            if (re - r > 16)
              grad_product<true>(a, gs, wt + g * 256, seg_steps, ac + g * 16, n0 == 0);
            else
              grad_product<false>(a, gs, wt + g * 256, seg_steps, ac + g * 16, n0 == 0);
          }
        }
      }
      for (int64_t r = r0; r < re; r += 32)
        for (int64_t h = 0; h < halves; ++h)
          store_strip<OutT>(acc + (r - r0) * kAmxStrip + h * kStrip, min64(32, re - r), k, c0 + h * kStrip, out + r * k,
                            kAmxStrip);
    }
    _tile_release();
  });
}

template <typename OutT, bool TWO>
void grad(const Gemm4bitGradInputParams& p, const ScaleDecoder& scales) {
  const int shift = log2_exact(p.blocksize);
  // every block scale, decoded once (the strips read them with stride k)
  const float* sc_all = decode_all_scales(scales, ceil_div(p.n * p.k, p.blocksize), gemm4::kSlotPanels);
  const __m512 codes = code_table(p.quant_type);
  const __m512i half = upper_half_bit(), i_lo = pair_index(0), i_hi = pair_index(16);
  const int64_t n = p.n, k = p.k;
  grad_tiles(static_cast<const uint16_t*>(p.grad_out), p.m, n, k, static_cast<OutT*>(p.grad_input),
             [&](int64_t row, int64_t col, bool has_b, __m512i z[4]) {
               prefetch_ahead(p.packed + (row * k + col) / 2, row, n, k / 2);
               decode_pair<TWO>(p.packed, sc_all, codes, shift, uint64_t(row * k + col), k, has_b, half, i_lo, i_hi, z);
             });
}

// ------------------------------------------------------------ LLM.int8 input gradient, bf16 dY

// bf16 dY (the bf16-compute contract, as the 4-bit weights'): each weight
// element is its fp32 value, fp32(float(CB[n, c]) * s[n]) with s[n] =
// fp32(SCB[n] * kInv127) (the exact contract's column scale, cpu/int8.cc),
// rounded once to bf16; products summed in fp32 on TDPBF16PS, the result
// rounded once to the output dtype. The error is that of a dense bf16 matmul
// with the dequantized weight, where the exact contract's one multiply and
// one add per term (fp32 dY . the int8 weight) runs on the FMA units at half
// their peak. W rows (2t, 2t + 1) x 64 columns become decode_pair's four
// vectors (columns 0, 2, .., 30 | 32, .., 62 | 1, .., 31 | 33, .., 63): each
// 16 widened to fp32 and scaled, the two rows' bf16 values interleaved word
// by word.
constexpr int64_t kInt8GradMinM = 4;  // dY rows from which the tile kernel runs (measured crossover: 3-4)

// The 16 int16 of v widened to fp32 and times s.
inline __m512 scaled_words(__m256i v, __m512 s) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(v)), s);
}

// The 64 int8 at w times s, rounded to bf16, as decode_chunk returns a 4-bit
// chunk (hi: columns 0, 2, .., 62; lo: 1, 3, .., 63): each word holds columns
// (2i, 2i + 1); its low byte sign-extended gives the even column, its high
// byte the odd one.
inline Chunk int8_chunk(const int8_t* w, float s) {
  const __m512i b = _mm512_loadu_si512(w);
  const __m512i even = _mm512_srai_epi16(_mm512_slli_epi16(b, 8), 8), odd = _mm512_srai_epi16(b, 8);
  const __m512 sv = _mm512_set1_ps(s);
  return {reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(scaled_words(_mm512_extracti64x4_epi64(even, 1), sv),
                                                        scaled_words(_mm512_castsi512_si256(even), sv))),
          reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(scaled_words(_mm512_extracti64x4_epi64(odd, 1), sv),
                                                        scaled_words(_mm512_castsi512_si256(odd), sv)))};
}

// W rows (row, row + 1) x 64 columns from col of the int8 weight (row stride
// k) scaled by sa, sb, as decode_pair's four vectors (the second row zero
// when has_b is false): decode_pair's interleave of two chunks.
inline void int8_pair(const int8_t* w, int64_t k, float sa, float sb, bool has_b, __m512i i_lo, __m512i i_hi,
                      __m512i z[4]) {
  const Chunk b = has_b ? int8_chunk(w + k, sb) : Chunk{_mm512_setzero_si512(), _mm512_setzero_si512()};
  interleave_pair(int8_chunk(w, sa), b, i_lo, i_hi, z);
}

// s[j] = fp32(SCB[j] * kInv127), the exact contract's column scales (cpu/int8.cc).
inline void int8_column_scales(const Int8GradInputParams& p, float* s) {
  for (int64_t j = 0; j < p.n; ++j) s[j] = p.weight_scale[j] * int8::kInv127;
}

template <typename OutT>
void int8_grad_tiles(const Int8GradInputParams& p) {
  const int64_t n = p.n, k = p.k;
  float* s = scratch_as<float>(gemm4::kSlotPanels, (n + 1) * 4);
  int8_column_scales(p, s);
  s[n] = 0.0f;  // (read for the missing row of a last pair)
  const __m512i i_lo = pair_index(0), i_hi = pair_index(16);
  grad_tiles(static_cast<const uint16_t*>(p.grad_out), p.m, n, k, static_cast<OutT*>(p.grad_input),
             [&](int64_t row, int64_t col, bool has_b, __m512i z[4]) {
               prefetch_ahead(p.weight + row * k + col, row, n, k);
               int8_pair(p.weight + row * k + col, k, s[row], s[row + 1], has_b, i_lo, i_hi, z);
             });
}

// ------------------------------------------------------------ fp32 forward in bf16 parts

// fp32 and fp16 inputs (the fp32 contract) from kSplitMinM rows: each x and
// W element v is split exactly into three bf16 parts, v = hi + mid + lo (hi
// = v rounded to bf16, mid = v - hi rounded to bf16, lo = v - hi - mid: each
// remainder is exact and lo has at most 8 significant bits; split3 below),
// and x . W is the sum of the six part products hi.hi, hi.mid, hi.lo,
// mid.hi, mid.mid, lo.hi on TDPBF16PS (bf16 products are exact in fp32). The
// three dropped ones, mid.lo, lo.mid and lo.lo, are below (2^-22 + 2^-31) of
// the product: the error bound is that of an fp32 sum five terms longer (in
// practice the error is below the fp32 kernels': 2.1e-7 against 2.9e-7 at
// 4096^2). hi.hi is summed in its own tiles, the five smaller products in
// another pair, and the two sums added once at the end (in one accumulator,
// where the small products round against the whole, the error measured 1.8x
// the fp32 kernels'). The tile unit reads denormal inputs as zero and
// flushes denormal results, so each x row is first scaled by the power of
// two 2^-E that brings its largest magnitude into [1, 2) (exact), its
// elements below 2^-60 after scaling are dropped (an added error of at most
// 2^-60 max|x_row| sum|w| per output), and the row's sums are scaled back by
// 2^E at the end (one rounding, and only where the result is denormal). With
// every nonzero block scale in [2^-32, 2^32], each kept product is then at
// least 2^-100 and a part product that flushes is below 2^-26 of it; no sum
// can overflow. Rows of tiny values (GELU's and SiLU's far tails, the
// gradients through them) and of huge ones keep the split; a NaN or an
// infinity anywhere in x, or a block scale outside that range, makes the
// call return false, and the avx512 level's fp32 kernel computes it (over
// whatever this one wrote). The blocking is the bf16 forward's with three
// segment and panel sets, one x panel at a time: each thread takes one share
// of the W tiles and walks the x blocks inside it.
constexpr int64_t kSplitMinM = 8;       // x rows from which the split path runs (measured crossover)
constexpr int64_t kSplitGradMinM = 64;  // dY rows from which the split gradient runs (measured crossover)
constexpr int64_t kSplitSegK = 128;     // W columns per segment: three parts of 32 rows, 24 KiB, in L1

constexpr uint32_t kSplitMinX = 0x21800000u;      // 2^-60: scaled x / dY below it are dropped
constexpr uint32_t kSplitMinScale = 0x2f800000u;  // 2^-32
constexpr uint32_t kSplitMaxScale = 0x4f800000u;  // 2^32

// Lanes of v (fp32 bits) outside {0} u [lo, hi] in magnitude (NaN and
// infinities are above hi).
inline __mmask16 out_of_range(__m512i v, uint32_t lo, uint32_t hi) {
  const __m512i a = _mm512_and_si512(v, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nonzero = _mm512_test_epi32_mask(a, a);
  return _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(int(hi))) |
         _mm512_mask_cmplt_epu32_mask(nonzero, a, _mm512_set1_epi32(int(lo)));
}

inline bool scales_in_range(const float* sc, int64_t count) {
  __mmask16 bad = 0;
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) bad |= out_of_range(_mm512_loadu_si512(sc + i), kSplitMinScale, kSplitMaxScale);
  if (i < count)
    bad |= out_of_range(_mm512_maskz_loadu_epi32(__mmask16((1u << (count - i)) - 1), sc + i), kSplitMinScale,
                        kSplitMaxScale);
  return bad == 0;
}

// v rounded to bf16, as fp32: to nearest even (v finite), or toward zero.
template <bool NEAREST>
inline __m512 round_bf16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v), hi = _mm512_set1_epi32(int(0xffff0000u));
  if (!NEAREST) return _mm512_castsi512_ps(_mm512_and_si512(b, hi));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), odd);
  return _mm512_castsi512_ps(_mm512_and_si512(r, hi));
}

// The three parts (hi, mid, lo) of the 16 fp32 values v, each remainder
// rounded to bf16 to nearest (the inputs: |mid| <= 2^-8 |v|, |lo| <= 2^-16
// |v|) or toward zero (the weight, in the decode's inner loop, where it is
// 4 integer operations less per part: |mid| < 2^-7 |v|, |lo| < 2^-15 |v|).
struct Parts {
  __m512 p[3];
};
template <bool NEAREST>
inline Parts split3(__m512 v) {
  const __m512 hi = round_bf16<NEAREST>(v), r = _mm512_sub_ps(v, hi), mid = round_bf16<NEAREST>(r);
  return {{hi, mid, _mm512_sub_ps(r, mid)}};
}

// Words 0-15 = bf16 of a, 16-31 = bf16 of b (exact: the parts are bf16 values).
inline __m512i to_bf16(__m512 a, __m512 b) { return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)); }

// Per row of v [m, cols] (fp32): e[r] = E, the exponent of the row's
// largest magnitude (in [2^E, 2^(E+1)); 0 for a row of zeros), as a float
// for vscalefps. False when some value is a NaN or an infinity.
bool row_exponents(const float* v, int64_t m, int64_t cols, float* e) {
  std::atomic<bool> bad{false};
  parallel_for(m, 16, [&](int64_t r0, int64_t r1) {
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = v + r * cols;
      __m512i mx = _mm512_setzero_si512();
      int64_t c = 0;
      for (; c + 16 <= cols; c += 16)
        mx = _mm512_max_epu32(mx, _mm512_and_si512(_mm512_loadu_si512(row + c), magnitude));
      if (c < cols)
        mx = _mm512_max_epu32(
            mx, _mm512_and_si512(_mm512_maskz_loadu_epi32(__mmask16((1u << (cols - c)) - 1), row + c), magnitude));
      const uint32_t b = _mm512_reduce_max_epu32(mx);
      if (b >= 0x7f800000u) bad.store(true, std::memory_order_relaxed);
      // normal: the biased exponent; denormal (b * 2^-149): its top bit's place
      e[r] = float(b >= 0x00800000u ? int(b >> 23) - 127 : b == 0 ? 0 : (31 - __builtin_clz(b)) - 149);
    }
  });
  return !bad.load();
}

// v * 2^-e (exact), with the lanes below 2^-60 after it set to zero: a row's
// values as the split multiplies them.
inline __m512 scaled_row(__m512 v, __m512 neg_e) {
  const __m512 s = _mm512_scalef_ps(v, neg_e);
  const __m512i a = _mm512_and_si512(_mm512_castps_si512(s), _mm512_set1_epi32(0x7fffffff));
  return _mm512_maskz_mov_ps(_mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(int(kSplitMinX))), s);
}

// x [m, k] fp32 -> the panels of its three parts (part j at xp + j * stride
// dwords, each laid out as pack_panels lays out a bf16 x), row r scaled by
// 2^-e[r] (scaled_row).
void pack_panels_split(const float* x, const float* e, int64_t m, int64_t k, uint32_t* xp, int64_t stride) {
  const int64_t panels = ceil_div(m, kPanel), chunks = k / kChunk;
  parallel_for(panels * chunks, 16, [&](int64_t u0, int64_t u1) {
    const __m512i ie = deinterleave_index(0), io = deinterleave_index(1);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t panel = u / chunks, c = (u % chunks) * kChunk;
      pack_panel_chunk<3>(m, k, panel, c, xp, stride, [&](int64_t r, int l, __m512i(*ev)[16], __m512i(*ov)[16]) {
        const __m512 neg_e = _mm512_set1_ps(-e[r]);
        Parts v[4];
        for (int i = 0; i < 4; ++i) v[i] = split3<true>(scaled_row(_mm512_loadu_ps(x + r * k + c + 16 * i), neg_e));
        for (int part = 0; part < 3; ++part)
          deinterleave64(to_bf16(v[0].p[part], v[1].p[part]), to_bf16(v[2].p[part], v[3].p[part]), ie, io, &ev[part][l],
                         &ov[part][l]);
      });
    }
  });
}

// The three bf16 parts of W rows [r0, r0 + rows) x columns [c0, c0 + len)
// into ws (part j at ws + j * kWRows * kSplitSegK / 2 dwords, each laid out
// as decode_segment lays out its segment, with rows kSplitSegK / 2 dwords
// apart), asking for each row's bytes of the next segment.
template <bool TWO>
void decode_segment_split(const uint8_t* packed, int64_t k, int shift, __m512 codes, const float* sc, int64_t b0,
                          int64_t r0, int64_t rows, int64_t c0, int64_t len, uint32_t* ws) {
  constexpr int64_t part_stride = kWRows * kSplitSegK / 2;
  const __m512i half = upper_half_bit();
  for_each_segment_chunk<kSplitSegK>(packed, k, shift, b0, r0, rows, 1, c0, len, ws,
                                     [&](const uint8_t* bytes, int64_t b, uint32_t* d) {
                                       const __m512 a = _mm512_mul_ps(codes, _mm512_set1_ps(sc[b]));
                                       const __m512 a2 = TWO ? _mm512_mul_ps(codes, _mm512_set1_ps(sc[b + 1])) : a;
                                       const __m512i v = widen_chunk(bytes);
                                       const Parts pa = split3<false>(a), pa2 = TWO ? split3<false>(a2) : pa;
                                       for (int part = 0; part < 3; ++part) {
                                         const Chunk w = lookup_chunk<TWO>(v, to_bf16(pa.p[part], pa2.p[part]), half);
                                         _mm512_store_si512(d + part * part_stride, w.hi);
                                         _mm512_store_si512(d + part * part_stride + 16, w.lo);
                                       }
                                     });
}

// One k step of the six part products into C tiles 0 / 1 (hi.hi) and 2 / 3
// (the five smaller ones): tiles P0 / P1 hold the part of the operand that
// differs between C 0 and 1 (pair(j) loads part j there), S0 / S1 parts of
// the shared one (shared0(j), shared1(j)); PAIR_A: the pair is the A operand
// (the forward's W row groups), else B (the gradient's W column groups).
// Loads: parts hi, mid, lo of the shared operand, then mid again; hi, mid,
// lo of the pair.
template <bool PAIR_A, int P0, int P1, int S0, int S1>
struct SixProducts {
  // C += A . B for tile numbers given as template arguments (the
  // _tile_dpbf16ps macro pastes its arguments' text into the instruction)
  template <int C, int A, int B>
  static void tdp() {
    __asm__ volatile("tdpbf16ps %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C));
  }
  template <int C, int P, int S>
  static void dot() {
    if (PAIR_A)
      tdp<C, P, S>();
    else
      tdp<C, S, P>();
  }
  // PAIR_PARTS = 1: the pair operand is exact in bf16 (LLM.int8's weight),
  // its mid and lo parts zero: the first three products only.
  template <int PAIR_PARTS = 3, typename Pair, typename Shared0, typename Shared1>
  static void step(Pair&& pair, Shared0&& shared0, Shared1&& shared1) {
    pair(0);  // hi . hi -> C 0 / 1
    shared0(0);
    dot<0, P0, S0>();
    dot<1, P1, S0>();
    shared1(1);  // hi . mid
    dot<2, P0, S1>();
    dot<3, P1, S1>();
    shared1(2);  // hi . lo
    dot<2, P0, S1>();
    dot<3, P1, S1>();
    if constexpr (PAIR_PARTS == 1) return;
    pair(1);  // mid . hi
    dot<2, P0, S0>();
    dot<3, P1, S0>();
    shared1(1);  // mid . mid
    dot<2, P0, S1>();
    dot<3, P1, S1>();
    pair(2);  // lo . hi
    dot<2, P0, S0>();
    dot<3, P1, S0>();
  }
};

// C tiles 0 / 1 (W row groups 0 / 1, one panel) += hi.hi, and tiles 2 / 3
// += the five smaller part products, of the segment ws (part stride wst
// dwords) and the panel at xp (part stride xst dwords); acc: hi.hi at acc,
// the rest at acc + 512. Per k step 6 A and 4 B tile loads for 12 products.
void segment_product_split(const uint32_t* ws, int64_t wst, const uint32_t* xp, int64_t xst, int64_t steps, float* acc,
                           bool fresh, bool load, bool store) {
  if (fresh) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else if (load) {
    _tile_loadd(0, acc, 64);
    _tile_loadd(1, acc + 256, 64);
    _tile_loadd(2, acc + 512, 64);
    _tile_loadd(3, acc + 768, 64);
  }
  constexpr int64_t ldw = kSplitSegK * 2;  // bytes per W row of the segment
  for (int64_t s = 0; s < steps; ++s) {
    const uint32_t* w = ws + s * 16;
    const uint32_t* x = xp + s * 256;
    SixProducts<true, 4, 5, 6, 7>::step(
        [&](int j) {  // W part j, row groups 0 / 1
          _tile_loadd(4, w + j * wst, ldw);
          _tile_loadd(5, w + j * wst + 16 * (kSplitSegK / 2), ldw);
        },
        [&](int j) { _tile_loadd(6, x + j * xst, 64); }, [&](int j) { _tile_loadd(7, x + j * xst, 64); });
  }
  if (store) {
    _tile_stored(0, acc, 64);
    _tile_stored(1, acc + 256, 64);
    _tile_stored(2, acc + 512, 64);
    _tile_stored(3, acc + 768, 64);
  }
}

template <typename OutT, typename BiasT, bool TWO>
bool forward_split(const Gemm4bitParams& p, const float* xf, const ScaleDecoder& scales) {
  const int64_t m = p.m, n = p.n, k = p.k;
  const int shift = log2_exact(p.blocksize);
  const int64_t panels = ceil_div(m, kPanel), ps = (k / 2) * kPanel, xst = panels * ps;
  uint32_t* xp = scratch_as<uint32_t>(kSlotPanels, 3 * xst * 4 + panels * kPanel * 4);
  float* xe = reinterpret_cast<float*>(xp + 3 * xst);  // row exponents, zero past m
  std::fill(xe + m, xe + panels * kPanel, 0.0f);
  if (!row_exponents(xf, m, k, xe)) return false;
  pack_panels_split(xf, xe, m, k, xp, xst);
  const __m512 codes = code_table(p.quant_type);
  const int64_t block = max64(2, kXBlockBytes / (3 * ps * 4)) & ~int64_t(1);  // panels per x block
  constexpr int64_t wst = kWRows * kSplitSegK / 2;
  OutT* out = static_cast<OutT*>(p.out);
  std::atomic<bool> bad{false};
  // One share of the W tiles per thread, and in it the x blocks outside the
  // tiles: each thread reads each x block from the L3 once and from its L2
  // once per tile (with the blocks inside, every chunk of W tiles streamed
  // all of x again: at 384 W rows, k = 1536 and 1024 x rows, 8 x 9 MiB), and
  // no thread waits for the other between x blocks.
  const int64_t tiles = ceil_div(n, kWRows);
  parallel_for(tiles, ceil_div(tiles, max64(1, cpu_num_threads())), [&](int64_t t0, int64_t t1) {
    configure_tiles();
    const int64_t sc_count = ((kWRows * k) >> shift) + 4;
    uint32_t* ws = scratch_as<uint32_t>(kSlotRow, 3 * wst * 4 + sc_count * 4);
    float* sc = reinterpret_cast<float*>(ws + 3 * wst);
    float* acc = scratch_as<float>(kSlotAcc, block * kWRows * 32 * 4);
    for (int64_t q0 = 0; q0 < panels && !bad.load(std::memory_order_relaxed); q0 += block) {
      const int64_t qe = min64(panels, q0 + block);
      const bool one = qe - q0 == 1;  // one panel: C stays in the tile registers over all of k
      for (int64_t tile = t0; tile < t1; ++tile) {
        const int64_t r0 = tile * kWRows, rows = min64(kWRows, n - r0);
        const BlockSpan blocks = row_blocks(r0, rows, k, shift);
        const int64_t b0 = blocks.first, b1 = blocks.end;
        scales.decode(b0, b1, sc);
        if (!scales_in_range(sc, b1 - b0)) {
          bad.store(true, std::memory_order_relaxed);
          break;
        }
        if (rows < kWRows)
          for (int j = 0; j < 3; ++j)
            memset(ws + j * wst + rows * (kSplitSegK / 2), 0, size_t((kWRows - rows) * kSplitSegK * 2));
        for (int64_t c0 = 0; c0 < k; c0 += kSplitSegK) {
          const int64_t len = min64(kSplitSegK, k - c0);
          const bool last = c0 + len >= k;
          decode_segment_split<TWO>(p.packed, k, shift, codes, sc, b0, r0, rows, c0, len, ws);
          for (int64_t q = q0; q < qe; ++q)
            segment_product_split(ws, wst, xp + q * ps + (c0 / 2) * kPanel, xst, len / 32, acc + (q - q0) * kWRows * 32,
                                  c0 == 0, !one, !one || last);
        }
        for (int64_t q = q0; q < qe; ++q) {  // the two accumulators' sum scaled back, then bias and store
          float* a = acc + (q - q0) * kWRows * 32;
          const __m512 e = _mm512_loadu_ps(xe + q * kPanel);  // lanes = the panel's x rows
          for (int64_t i = 0; i < kWRows * 16; i += 16)
            _mm512_store_ps(
                a + i, _mm512_scalef_ps(_mm512_add_ps(_mm512_load_ps(a + i), _mm512_load_ps(a + kWRows * 16 + i)), e));
        }
        for (int64_t q = q0; q < qe; q += 2)
          store_tiles<OutT, BiasT>(acc + (q - q0) * kWRows * 32, 2 * kWRows, rows, min64(2 * kPanel, m - q * kPanel), n,
                                   r0, p.bias, out + q * kPanel * n);
      }
    }
    _tile_release();
  });
  return !bad.load();
}

// ------------------------------------------------------------ fp32 input gradient in bf16 parts

// fp32 dY from kSplitGradMinM rows, the forward's split (above) on the bf16
// gradient's blocking: dY's three parts packed as A tiles, W's decoded as B
// tiles; per dY group of 16 rows and pair of column groups, hi.hi into C
// tiles 0 / 1 and the five smaller products into 2 / 3 (acc and acc2), 10
// tile loads per 12 products. Each dY row scaled as the forward's x rows
// are. Declines (false) when a dY is not finite or a block scale is out of
// the split range, before writing anything.

// dY [m, n] fp32 -> the packed A tiles of its three parts (part j at dyp + j *
// stride words, each laid out as pack_a_tiles lays out a bf16 dY), row r scaled
// by 2^-e[r] (scaled_row).
void pack_dy_split(const float* dy, const float* e, int64_t m, int64_t n, int64_t steps, uint16_t* dyp,
                   int64_t stride) {
  const int64_t groups = ceil_div(m, 16);
  parallel_for(groups * steps, 64, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t g = u / steps, c0 = (u % steps) * 32;
      const int64_t len = min64(32, n - c0);
      const __mmask16 m0 = len >= 16 ? __mmask16(0xffff) : __mmask16((1u << len) - 1);
      const __mmask16 m1 = len >= 32 ? __mmask16(0xffff) : len <= 16 ? __mmask16(0) : __mmask16((1u << (len - 16)) - 1);
      for (int l = 0; l < 16; ++l) {
        const int64_t row = g * 16 + l;
        __m512 v0 = _mm512_setzero_ps(), v1 = _mm512_setzero_ps();
        if (row < m) {
          const __m512 neg_e = _mm512_set1_ps(-e[row]);
          v0 = scaled_row(_mm512_maskz_loadu_ps(m0, dy + row * n + c0), neg_e);
          v1 = scaled_row(_mm512_maskz_loadu_ps(m1, dy + row * n + c0 + 16), neg_e);
        }
        const Parts p0 = split3<true>(v0), p1 = split3<true>(v1);
        for (int part = 0; part < 3; ++part)
          _mm512_store_si512(dyp + part * stride + u * 512 + l * 32, to_bf16(p0.p[part], p1.p[part]));
      }
    }
  });
}

// decode_pair for the three parts: z[j] = part j.
template <bool TWO>
inline void decode_pair_split(const uint8_t* __restrict packed, const float* __restrict sc, __m512 codes, int shift,
                              uint64_t fa, int64_t k, bool has_b, __m512i half, __m512i i_lo, __m512i i_hi,
                              __m512i z[3][4]) {
  const uint64_t fb = fa + uint64_t(k);
  const int64_t ba = int64_t(fa >> shift), bb = int64_t(fb >> shift);
  const __m512 a0 = _mm512_mul_ps(codes, _mm512_set1_ps(sc[ba]));
  const __m512 a1 = TWO ? _mm512_mul_ps(codes, _mm512_set1_ps(sc[ba + 1])) : a0;
  const __m512i va = widen_chunk(packed + (fa >> 1));
  __m512 b0 = a0, b1 = a1;
  __m512i vb = _mm512_setzero_si512();
  if (has_b) {
    b0 = _mm512_mul_ps(codes, _mm512_set1_ps(sc[bb]));
    b1 = TWO ? _mm512_mul_ps(codes, _mm512_set1_ps(sc[bb + 1])) : b0;
    vb = widen_chunk(packed + (fb >> 1));
  }
  const Parts pa0 = split3<false>(a0), pa1 = TWO ? split3<false>(a1) : pa0;
  const Parts pb0 = split3<false>(b0), pb1 = TWO ? split3<false>(b1) : pb0;
  for (int part = 0; part < 3; ++part) {
    const Chunk a = lookup_chunk<TWO>(va, to_bf16(pa0.p[part], pa1.p[part]), half);
    Chunk b{_mm512_setzero_si512(), _mm512_setzero_si512()};
    if (has_b) b = lookup_chunk<TWO>(vb, to_bf16(pb0.p[part], pb1.p[part]), half);
    interleave_pair(a, b, i_lo, i_hi, z[part]);
  }
}

// C tiles 0 / 1 (hi.hi) and 2 / 3 (the smaller products) = the 16 dY rows of
// the packed A tiles at dy (part stride dps words, k step s at + s * 512) x
// column groups g, g + 1 of the strip (B tiles at wt, part stride wst dwords,
// k step s at + s * kAmxStrip * 16), over `steps` steps of 16 W row pairs;
// from zero (fresh) or from acc / acc2 [r * kAmxStrip + q * 16 + lane], and
// stored there.
template <int WPARTS>
void grad_product_split(const uint16_t* dy, int64_t dps, const uint32_t* wt, int64_t wst, int64_t steps, float* acc,
                        float* acc2, bool fresh) {
  constexpr int64_t lda = kAmxStrip * 4;  // bytes per row of acc
  if (fresh) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, acc, lda);
    _tile_loadd(1, acc + 16, lda);
    _tile_loadd(2, acc2, lda);
    _tile_loadd(3, acc2 + 16, lda);
  }
  for (int64_t s = 0; s < steps; ++s) {
    const uint32_t* w = wt + s * kStripStep;
    const uint16_t* a = dy + s * 512;
    SixProducts<false, 6, 7, 4, 5>::step<WPARTS>(
        [&](int j) {  // W part j, column groups 0 / 1
          _tile_loadd(6, w + j * wst, 64);
          _tile_loadd(7, w + j * wst + 256, 64);
        },
        [&](int j) { _tile_loadd(4, a + j * dps, 64); }, [&](int j) { _tile_loadd(5, a + j * dps, 64); });
  }
  _tile_stored(0, acc, lda);
  _tile_stored(1, acc + 16, lda);
  _tile_stored(2, acc2, lda);
  _tile_stored(3, acc2 + 16, lda);
}

// dX [m, k] (OutT) = dY [m, n] (fp32) . W [n, k] in bf16 parts on the tile
// unit: dY's three parts packed as A tiles (each row scaled by its power of
// two), W's WPARTS parts given by decode(row, col, has_b, z) (decode_pair's
// four vectors of rows (row, row + 1) x 64 columns from col, per part). The
// 4-bit weights' split gradient (three W parts) and LLM.int8's (one: the
// int8 weight is exact in bf16) share it. False, before anything is
// written, when a dY is not finite.
template <int WPARTS, typename OutT, typename Decode>
bool grad_tiles_split(const float* dy, int64_t m, int64_t n, int64_t k, OutT* out, Decode&& decode) {
  const int64_t steps = ceil_div(n, 32), gs = steps * 512;  // k steps of 32 dY columns; words per dY group
  const int64_t dps = ceil_div(m, 16) * gs;                 // words per dY part
  uint16_t* dyp = scratch_as<uint16_t>(kSlotInput, 3 * dps * 2 + m * 4);
  float* ye = reinterpret_cast<float*>(dyp + 3 * dps);  // dY row exponents
  if (!row_exponents(dy, m, n, ye)) return false;
  pack_dy_split(dy, ye, m, n, steps, dyp, dps);
  const GradUnits units(m, k, max64(16, kL2Budget / (2 * kAmxStrip * 4) / 16 * 16), 16);  // two sums per row
  const int64_t block = units.block;
  constexpr int64_t wst = kSegN * kAmxStrip / 2;  // dwords per W part of a segment
  parallel_for(units.count, 1, [&](int64_t u0, int64_t u1) {
    configure_tiles();
    uint32_t* wt = scratch_as<uint32_t>(kSlotRow, WPARTS * wst * 4);
    float* acc = scratch_as<float>(kSlotAcc, 2 * block * kAmxStrip * 4);
    float* acc2 = acc + block * kAmxStrip;
    for (int64_t u = u0; u < u1; ++u) {
      const auto [r0, re, st] = units[u];
      const int64_t c0 = st * kAmxStrip, halves = min64(kAmxStrip / kStrip, (k - c0) / kStrip);
      for (int64_t n0 = 0; n0 < n; n0 += kSegN) {
        const int64_t rows = min64(kSegN, n - n0), seg_steps = ceil_div(rows, 32);
        decode_strip_segment<WPARTS>(rows, halves, wt, wst, [&](int64_t t, int64_t h, __m512i z[WPARTS][4]) {
          decode(n0 + 2 * t, c0 + h * kStrip, n0 + 2 * t + 1 < n, z);
        });
        for (int64_t r = r0; r < re; r += 16) {
          const uint16_t* a = dyp + (r / 16) * gs + (n0 / 32) * 512;
          for (int g = 0; g < 4 * halves; g += 2)
            grad_product_split<WPARTS>(a, dps, wt + g * 256, wst, seg_steps, acc + (r - r0) * kAmxStrip + g * 16,
                                       acc2 + (r - r0) * kAmxStrip + g * 16, n0 == 0);
        }
      }
      for (int64_t r = r0; r < re; ++r) {  // the two sums' total, scaled back
        const __m512 e = _mm512_set1_ps(ye[r]);
        for (int64_t c = 0; c < halves * kStrip; c += 16) {
          float* a = acc + (r - r0) * kAmxStrip + c;
          _mm512_store_ps(a,
                          _mm512_scalef_ps(_mm512_add_ps(_mm512_load_ps(a), _mm512_load_ps(a + block * kAmxStrip)), e));
        }
      }
      for (int64_t r = r0; r < re; r += 32)
        for (int64_t h = 0; h < halves; ++h)
          store_strip<OutT>(acc + (r - r0) * kAmxStrip + h * kStrip, min64(32, re - r), k, c0 + h * kStrip, out + r * k,
                            kAmxStrip);
    }
    _tile_release();
  });
  return true;
}

template <typename OutT, bool TWO>
bool grad_split(const Gemm4bitGradInputParams& p, const ScaleDecoder& scales) {
  const int64_t k = p.k;
  const int shift = log2_exact(p.blocksize);
  const int64_t n_blocks = ceil_div(p.n * k, p.blocksize);
  const float* sc_all = decode_all_scales(scales, n_blocks, gemm4::kSlotPanels);
  if (!scales_in_range(sc_all, n_blocks)) return false;
  const __m512 codes = code_table(p.quant_type);
  const __m512i half = upper_half_bit(), i_lo = pair_index(0), i_hi = pair_index(16);
  return grad_tiles_split<3>(static_cast<const float*>(p.grad_out), p.m, p.n, k, static_cast<OutT*>(p.grad_input),
                             [&](int64_t row, int64_t col, bool has_b, __m512i z[3][4]) {
                               prefetch_ahead(p.packed + (row * k + col) / 2, row, p.n, k / 2);
                               decode_pair_split<TWO>(p.packed, sc_all, codes, shift, uint64_t(row * k + col), k, has_b,
                                                      half, i_lo, i_hi, z);
                             });
}

// ------------------------------------------------------------ LLM.int8 input gradient, fp32 dY

// fp32 dY from kInt8SplitMinM rows: g = fp32(dY * s[n]) as the exact
// contract computes it (cpu/int8.cc), then sum_n g . CB on the tile unit with
// g split exactly into three bf16 parts and CB exact in bf16 (|CB| <= 128): three
// part products per tile step, each exact in fp32, hi . CB summed in its own
// tiles and the two smaller ones in another pair, added once at the end.
// Each g row is scaled by a power of two (the split forward's rule: the
// largest magnitude into [1, 2), elements below 2^-60 of it dropped, the
// sums scaled back), so the tile unit's denormal flushing cannot matter. The
// error is within the fp32 bound of a sum a few terms longer (the exact
// contract's own bound); the bytes are not the exact contract's (other
// order, exact products). A NaN or infinity in g declines the call (false):
// the exact kernels run.
constexpr int64_t kInt8SplitMinM = 8;  // dY rows from which it runs (measured crossover: 4-8)

template <typename OutT>
bool int8_grad_split_tiles(const Int8GradInputParams& p) {
  const int64_t m = p.m, n = p.n, k = p.k;
  float* g = scratch_as<float>(gemm4::kSlotPanels, (m * n + n) * 4);
  float* s = g + m * n;
  int8_column_scales(p, s);
  const float* dy = static_cast<const float*>(p.grad_out);
  parallel_for(m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int64_t j = 0;
      for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(g + r * n + j, _mm512_mul_ps(_mm512_loadu_ps(dy + r * n + j), _mm512_loadu_ps(s + j)));
      for (; j < n; ++j) g[r * n + j] = dy[r * n + j] * s[j];
    }
  });
  const __m512i i_lo = pair_index(0), i_hi = pair_index(16);
  return grad_tiles_split<1>(g, m, n, k, static_cast<OutT*>(p.grad_input),
                             [&](int64_t row, int64_t col, bool has_b, __m512i z[1][4]) {
                               prefetch_ahead(p.weight + row * k + col, row, n, k);
                               int8_pair(p.weight + row * k + col, k, 1.0f, 1.0f, has_b, i_lo, i_hi, z[0]);
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

bool gemm4_split(const Gemm4bitParams& p, const gemm4::Scales&) {
  // no test on n: which kernel computes an output must not depend on how many
  // outputs the call has (a column-parallel shard gives one device's bytes)
  if ((p.x_dtype != kF32 && p.x_dtype != kF16) || p.k % kChunk != 0 || p.m < kSplitMinM) return false;
  const float* x = gemm4::as_f32(p.x, p.x_dtype, p.m * p.k);
  return typed_forward(p, [&](auto* o, auto* b, const ScaleDecoder& scales) {
    using OutT = std::remove_pointer_t<decltype(o)>;
    using BiasT = std::remove_pointer_t<decltype(b)>;
    return p.blocksize == 32 ? forward_split<OutT, BiasT, true>(p, x, scales)
                             : forward_split<OutT, BiasT, false>(p, x, scales);
  });
}

bool grad4_split(const Gemm4bitGradInputParams& p, const gemm4::Scales&) {
  if (p.grad_out_dtype != kF32 || p.k % kChunk != 0 || p.m < kSplitGradMinM) return false;  // none on k (above)
  return typed_grad(p, [&](auto* o, const ScaleDecoder& scales) {
    using OutT = std::remove_pointer_t<decltype(o)>;
    return p.blocksize == 32 ? grad_split<OutT, true>(p, scales) : grad_split<OutT, false>(p, scales);
  });
}

bool grad4(const Gemm4bitGradInputParams& p, const gemm4::Scales&) {
  return bf16_grad(p, kMinM, [&](auto* o, const ScaleDecoder& scales) {
    using OutT = std::remove_pointer_t<decltype(o)>;
    if (p.blocksize == 32) return grad<OutT, true>(p, scales);
    grad<OutT, false>(p, scales);
  });
}

bool int8_grad(const Int8GradInputParams& p) {
  if (p.grad_out_dtype != kBF16 || p.k % kStrip != 0 || p.m < kInt8GradMinM) return false;
  if (reinterpret_cast<uintptr_t>(p.grad_out) % 2 != 0) return false;
  hint_fresh_output(p.grad_input, p.m * p.k * (p.grad_input_dtype == kF32 ? 4 : 2));
  with_out_type(p.grad_input_dtype, [&](auto* o) { int8_grad_tiles<std::remove_pointer_t<decltype(o)>>(p); });
  return true;
}

bool int8_grad_split(const Int8GradInputParams& p) {
  if (p.grad_out_dtype != kF32 || p.k % kStrip != 0 || p.m < kInt8SplitMinM) return false;
  if (reinterpret_cast<uintptr_t>(p.grad_out) % 4 != 0) return false;
  hint_fresh_output(p.grad_input, p.m * p.k * (p.grad_input_dtype == kF32 ? 4 : 2));
  bool ok = false;
  with_out_type(p.grad_input_dtype,
                [&](auto* o) { ok = int8_grad_split_tiles<std::remove_pointer_t<decltype(o)>>(p); });
  return ok;
}

}  // namespace amx
}  // namespace cpu
}  // namespace q4

#pragma GCC diagnostic pop

#else  // not x86: no entries

namespace q4 {
namespace cpu {
namespace amx {
bool gemm4(const Gemm4bitParams&, const gemm4::Scales&) { return false; }
bool gemm4_rows(const Gemm4bitParams&, const gemm4::Scales&) { return false; }
bool gemv_f32(const Gemm4bitParams&, const gemm4::Scales&) { return false; }
bool gemm4_split(const Gemm4bitParams&, const gemm4::Scales&) { return false; }
bool grad4(const Gemm4bitGradInputParams&, const gemm4::Scales&) { return false; }
bool grad4_split(const Gemm4bitGradInputParams&, const gemm4::Scales&) { return false; }
bool int8_grad(const Int8GradInputParams&) { return false; }
bool int8_grad_split(const Int8GradInputParams&) { return false; }
}  // namespace amx
}  // namespace cpu
}  // namespace q4

#endif
