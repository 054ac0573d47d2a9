// AMX (Advanced Matrix Extensions) set-up shared by the kernels that use its tiles: the Linux
// permission to use tile state, and the tile configuration. Compiled only where the compiler
// targets AMX (-march=native on a CPU with amx_tile, amx_bf16, amx_int8); elsewhere HAVE_AMX
// stays undefined and callers keep their AVX-512 code.
//
// A tile is up to 16 rows of 64 bytes; a kernel names tiles by number (tmm0-tmm7) in each
// instruction, so the number of rows of every tile is fixed by `configure_tiles` beforehand,
// per thread (the configuration is thread state).
#pragma once
#include <stdint.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

// Linux enables the 8 KiB tile state for a process only when it asks, once; a kernel without
// the permission would die on its first tile instruction. 1 when granted.
static int amx_ready(void) {
    static int state = 0;  // 0: not asked yet, 1: granted, -1: refused (old kernel, disabled by the VM)
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

// rows[t] x 64 bytes for tiles t < 8 (0 rows: unused); loaded only when it changes.
static void configure_tiles(const uint8_t rows[8], TileConfig *current) {
    TileConfig config = {.palette = 1};
    for (int t = 0; t < 8; t++) {
        config.rows[t] = rows[t];
        config.colsb[t] = rows[t] ? 64 : 0;
    }
    if (__builtin_memcmp(&config, current, sizeof config) == 0) return;
    *current = config;
    // gcc 12 does not count ldtilecfg as reading its operand and drops the stores without this
    __asm__ __volatile__("" : : "r"(current) : "memory");
    _tile_loadconfig(current);
}
#endif
