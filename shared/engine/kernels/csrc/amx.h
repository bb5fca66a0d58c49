// AMX tile units (bf16 products into fp32 tiles), where the build targets a CPU that has them: whether this
// process may use them, and the one tile shape the kernels use.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVRELAY_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>

namespace kvrelay {

// Linux hands out the tile registers' state only to processes that ask (oneDNN asks too; asking twice is fine).
// KVRELAY_DISABLE_AMX keeps the AVX512-BF16 kernels (A/B in benchmarks).
inline bool amx_permitted() {
  static const bool ok = [] {
    const char* off = std::getenv("KVRELAY_DISABLE_AMX");
    if (off != nullptr && *off != 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Every tile 16 rows x 64 bytes (16 x 32 bf16, or 16 x 16 fp32 sums); the config is per thread.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles() {
  TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = 16;
  }
  _tile_loadconfig(&c);
}

}  // namespace kvrelay
#endif
