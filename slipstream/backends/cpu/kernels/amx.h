// AMX (Advanced Matrix Extensions) shared by the kernels that use its tiles: the Linux
// permission to use tile state, the tile configuration, and the bf16 tile products of a block.
// Compiled only where the compiler targets AMX (-march=native on a CPU with amx_tile, amx_bf16,
// amx_int8); elsewhere HAVE_AMX stays undefined and callers keep their AVX-512 code.
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

// bf16 W for the tiles is packed in pairs of K steps, [N/16][K/2][16][2]: a B tile is 16 pair
// rows of 16 columns (1 KiB per 32 K steps of a 16-column block).
//
// Sums of up to 32 rows of bf16 x (row stride lda) over k steps times one or two 16-column
// blocks of W (w0, w1), in float32: tile 2 r + c of `sums` holds row tile r (16 rows) and
// column block c. Tiles: tmm0-3 the sums, tmm4-5 x, tmm6-7 W. row_tiles and cols are
// constants in each inlined call: tile numbers must be.
static inline __attribute__((always_inline)) void amx_bf16_tiles(const uint16_t *x, int64_t lda, int64_t k,
                                                                 const uint16_t *w0, const uint16_t *w1, int row_tiles,
                                                                 int cols, float (*sums)[256]) {
    _tile_zero(0);
    if (cols == 2) _tile_zero(1);
    if (row_tiles == 2) _tile_zero(2);
    if (row_tiles == 2 && cols == 2) _tile_zero(3);
    for (int64_t s = 0; s < k / 32; s++) {
        _tile_loadd(6, w0 + s * 512, 64);
        if (cols == 2) _tile_loadd(7, w1 + s * 512, 64);
        _tile_loadd(4, x + s * 32, lda * 2);
        _tile_dpbf16ps(0, 4, 6);
        if (cols == 2) _tile_dpbf16ps(1, 4, 7);
        if (row_tiles == 2) {
            _tile_loadd(5, x + 16 * lda + s * 32, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (cols == 2) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, sums[0], 64);
    if (cols == 2) _tile_stored(1, sums[1], 64);
    if (row_tiles == 2) _tile_stored(2, sums[2], 64);
    if (row_tiles == 2 && cols == 2) _tile_stored(3, sums[3], 64);
}

// `amx_bf16_tiles` for `rows` rows (1-32) and `cols` column blocks (1-2); returns the rows of
// the top row tile (16, or all of them).
static int amx_bf16_sums(const uint16_t *x, int64_t lda, int rows, int64_t k, const uint16_t *w0, const uint16_t *w1,
                         int cols, TileConfig *config, float (*sums)[256]) {
    int top = rows < 16 ? rows : 16, bottom = rows - top;
    uint8_t shape[8] = {top, top, bottom, bottom, top, bottom, 16, 16};
    configure_tiles(shape, config);
    if (bottom && cols == 2) amx_bf16_tiles(x, lda, k, w0, w1, 2, 2, sums);
    else if (bottom) amx_bf16_tiles(x, lda, k, w0, w1, 2, 1, sums);
    else if (cols == 2) amx_bf16_tiles(x, lda, k, w0, w1, 1, 2, sums);
    else amx_bf16_tiles(x, lda, k, w0, w1, 1, 1, sums);
    return top;
}
#endif
