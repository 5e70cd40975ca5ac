// The AMX tile configuration of the amx units: eight tiles of 16 rows x 64
// bytes (palette 1). The tile state is per thread: each worker loads the
// configuration before its first tile instruction and releases the tiles
// when it is done (so the OS need not save them). Include after the unit's
// `#pragma GCC target` (amx-tile).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace q4 {
namespace cpu {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of each tile
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

inline void configure_tiles() {
  TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = 16;
  }
  _tile_loadconfig(&c);
}

}  // namespace
}  // namespace cpu
}  // namespace q4
