// One SiLU-gated expert on a group of tokens, in float32, added into the layer's output:
// out[tokens[j]] += weights[j] * down(silu(gate(x_j)) * up(x_j)) for bf16 x and bf16 weights
// in transformers' stacked layout (gate_up [2I][H]: gate rows, then up rows; down [H][I]).
//
// Why not torch: on CPUs without AMX, float32 FMAs run ~1.7x faster than bf16 dot products, but
// MKL's float32 GEMM needs float32 weights, so each expert's weights were widened into a buffer
// that MKL then packed again, and the gather, the activation and the weighted scatter-add were
// passes of their own. Here the weights are widened once, straight into the packed layout the
// tiles read, and the rest happens in the tiles' epilogues.
//
// Orientation: weights are the broadcast operand and tokens lie along the vectors, so packing
// a weight row is a plain widening (no transpose): MR rows at a time as [K/16][MR][16] float32.
// Activations are packed token-major per block of TB tokens, [block][K][TB]. A tile (MR
// features x TB tokens, 24 registers of sums) runs KC steps of K at a time, so that the
// block's KC x TB activations stay in L1 while the MC/MR tiles of a panel pass over them; the
// panel's MC weight rows are widened KC steps at a time, a slice that stays in L2 whatever K.
// The gate/up tile takes MR/2 gate rows and the matching up rows, so its epilogue writes
// silu(gate) * up straight into the down GEMM's packed input; the down epilogue adds the
// weighted sums into `out`. Threads split the panels of each GEMM.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "vector_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#define MR 6    // features per tile (gate/up: 3 gate + 3 up rows)
#define NV 4    // vectors of 16 tokens per tile
#define TB (16 * NV)
#define KC 128  // K steps per pass over a tile: a token block's KC x TB activations (32 KiB) stay in L1
// features per panel (a multiple of 16 and of MR). 144 rather than 48: more tiles share each
// L1 block of activations, +2-5% prefill (A/B, three runs).
#define MC 144

// Tokens of one block widened and laid token-major, xp[k][TB], zero past `count`: 16 tokens x
// 16 K-steps at a time through a register transpose.
static void pack_tokens(const uint16_t *x, int64_t h, const int64_t *tokens, int64_t count, float *xp) {
    for (int g = 0; g < NV; g++)
        for (int64_t k = 0; k < h; k += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = g * 16 + i < count ? widen16(x + tokens[g * 16 + i] * h + k) : _mm512_setzero_ps();
            transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_storeu_ps(xp + (k + i) * TB + 16 * g, r[i]);
        }
}

// rows[i] (i < mr) widened 16 K-steps at a time: wp[K/16][mr][16].
static void pack_rows(const uint16_t *const *rows, int mr, int64_t k, float *wp) {
    for (int64_t kb = 0; kb < k / 16; kb++)
        for (int i = 0; i < mr; i++) _mm512_storeu_ps(wp + (kb * mr + i) * 16, widen16(rows[i] + kb * 16));
}

// c[i][16v..] (+)= sum over kc steps of wp row i times tokens 16v..16v+15 of xp. mr and nv are
// constants in every inlined call, so the sums stay in registers over the kc steps.
static inline __attribute__((always_inline)) void tile(const float *wp, const float *xp, int64_t kc, int mr, int nv,
                                                       float *c, int first) {
    __m512 acc[MR][NV];
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) acc[i][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * TB + 16 * v);
    for (int64_t kb = 0; kb < kc / 16; kb++) {
        const float *w = wp + kb * mr * 16;
        for (int kk = 0; kk < 16; kk++) {
            const float *x = xp + (kb * 16 + kk) * TB;
            __m512 b[NV];
            for (int v = 0; v < nv; v++) b[v] = _mm512_loadu_ps(x + 16 * v);
            for (int i = 0; i < mr; i++) {
                __m512 a = _mm512_set1_ps(w[i * 16 + kk]);
                for (int v = 0; v < nv; v++) acc[i][v] = _mm512_fmadd_ps(a, b[v], acc[i][v]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(c + i * TB + 16 * v, acc[i][v]);
}

// A last, narrower tile (fewer features or fewer tokens): one compiled tile per shape.
#define ROWS(nv)                                                                                      \
    switch (mr) {                                                                                     \
        case 1: tile(wp, xp, kc, 1, nv, c, first); return;                                            \
        case 2: tile(wp, xp, kc, 2, nv, c, first); return;                                            \
        case 3: tile(wp, xp, kc, 3, nv, c, first); return;                                            \
        case 4: tile(wp, xp, kc, 4, nv, c, first); return;                                            \
        case 5: tile(wp, xp, kc, 5, nv, c, first); return;                                            \
        case 6: tile(wp, xp, kc, 6, nv, c, first); return;                                            \
    }
static void tile_any(const float *wp, const float *xp, int64_t kc, int mr, int nv, float *c, int first) {
    switch (nv) {
        case 1: ROWS(1) return;
        case 2: ROWS(2) return;
        case 3: ROWS(3) return;
        case 4: ROWS(4) return;
    }
}
#undef ROWS

static inline void run_tile(const float *wp, const float *xp, int64_t kc, int mr, int nv, float *c, int first) {
    if (mr == MR && nv == NV)
        tile(wp, xp, kc, MR, NV, c, first);
    else
        tile_any(wp, xp, kc, mr, nv, c, first);
}

static inline int64_t block_tokens(int64_t m, int64_t b) { return m - b * TB < TB ? m - b * TB : TB; }
static inline int vectors(int64_t count) { return (int)((count + 15) / 16); }

// One panel of up to MC features: the bf16 weight rows of tile t at rows[t * MR ...] (MR rows,
// last_rows in the last tile) times every token block of xp ([block][k][TB]), sums in
// c[block][tile][MR][TB]. The rows are widened KC steps at a time into wp ([tile][KC/16][mr][16]),
// so that the widened slice stays in L2 while every token block passes over it.
static void panel(const uint16_t *const *rows, int tiles, int last_rows, const float *xp, int64_t blocks, int64_t m,
                  int64_t k, float *wp, float *c) {
    for (int64_t pc = 0; pc < k; pc += KC) {
        int64_t kc = k - pc < KC ? k - pc : KC;
        for (int t = 0; t < tiles; t++) {
            const uint16_t *slice[MR];
            int mr = t == tiles - 1 ? last_rows : MR;
            for (int i = 0; i < mr; i++) slice[i] = rows[t * MR + i] + pc;
            pack_rows(slice, mr, kc, wp + t * MR * KC);
        }
        for (int64_t b = 0; b < blocks; b++) {
            int nv = vectors(block_tokens(m, b));
            for (int t = 0; t < tiles; t++) {
                int mr = t == tiles - 1 ? last_rows : MR;
                run_tile(wp + t * MR * KC, xp + (b * k + pc) * TB, kc, mr, nv, c + (b * (MC / MR) + t) * MR * TB,
                         pc == 0);
            }
        }
    }
}

// gp[block][I][TB] = silu(gate) * up for every token block; panels split across threads. A tile
// holds MR/2 gate rows and the matching up rows.
static void gate_up_pass(const float *xp, int64_t blocks, int64_t m, int64_t h, const uint16_t *gate_up,
                         int64_t inter, float *gp, float *wp, float *c) {
    const int half = MR / 2;
#pragma omp for schedule(static)
    for (int64_t f0 = 0; f0 < inter; f0 += MC / 2) {
        int64_t features = inter - f0 < MC / 2 ? inter - f0 : MC / 2;
        int tiles = (int)((features + half - 1) / half), last_rows = 0;
        const uint16_t *rows[MC];
        for (int t = 0; t < tiles; t++) {
            int64_t f = f0 + t * half;
            int n = inter - f < half ? (int)(inter - f) : half;
            for (int i = 0; i < n; i++) {
                rows[t * MR + i] = gate_up + (f + i) * h;
                rows[t * MR + n + i] = gate_up + (inter + f + i) * h;
            }
            last_rows = 2 * n;
        }
        panel(rows, tiles, last_rows, xp, blocks, m, h, wp, c);
        for (int64_t b = 0; b < blocks; b++)
            for (int t = 0; t < tiles; t++) {
                const float *sums = c + (b * (MC / MR) + t) * MR * TB;
                int n = (t == tiles - 1 ? last_rows : MR) / 2, nv = vectors(block_tokens(m, b));
                for (int i = 0; i < n; i++)
                    for (int v = 0; v < nv; v++)
                        _mm512_storeu_ps(gp + (b * inter + f0 + t * half + i) * TB + 16 * v,
                                         silu_times(_mm512_loadu_ps(sums + i * TB + 16 * v),
                                                    _mm512_loadu_ps(sums + (n + i) * TB + 16 * v)));
            }
    }
}

// out[tokens[j]][f] += weights[j] * sums[f][j] for one token block's panel sums (row f at
// sums + f * TB): 16 features x 16 tokens at a time through a register transpose. `features`
// is a multiple of 16, as H and MC are.
static void add_weighted(const float *sums, int64_t features, const int64_t *tokens, const float *weights,
                         int64_t count, float *out, int64_t h) {
    for (int64_t f = 0; f < features; f += 16)
        for (int64_t j0 = 0; j0 < count; j0 += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(sums + (f + i) * TB + j0);
            transpose16(r);
            for (int j = 0; j < 16 && j0 + j < count; j++) {
                float *dst = out + tokens[j0 + j] * h + f;
                _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_set1_ps(weights[j0 + j]), r[j], _mm512_loadu_ps(dst)));
            }
        }
}

// out[tokens[j]][f] += weights[j] * (down row f . g_j); panels of output features split across threads.
static void down_pass(const float *gp, int64_t blocks, int64_t m, int64_t inter, const uint16_t *down, int64_t h,
                      const int64_t *tokens, const float *weights, float *out, float *wp, float *c) {
#pragma omp for schedule(static)
    for (int64_t f0 = 0; f0 < h; f0 += MC) {
        int64_t features = h - f0 < MC ? h - f0 : MC;
        int tiles = (int)((features + MR - 1) / MR), last_rows = (int)(features - (tiles - 1) * MR);
        const uint16_t *rows[MC];
        for (int f = 0; f < features; f++) rows[f] = down + (f0 + f) * inter;
        panel(rows, tiles, last_rows, gp, blocks, m, inter, wp, c);
        for (int64_t b = 0; b < blocks; b++)
            add_weighted(c + b * MC * TB, features, tokens + b * TB, weights + b * TB, block_tokens(m, b), out + f0, h);
    }
}

int moe_expert_available(void) { return 1; }

// Returns 0, or -1 when H or I is not a multiple of 16 or memory runs out. Tokens must be
// distinct rows of `out` (top-k experts are distinct, so one expert sees a token once).
int moe_expert_silu(const uint16_t *x, const int64_t *tokens, const float *weights, int64_t m, const uint16_t *gate_up,
                    const uint16_t *down, float *out, int64_t h, int64_t inter, int threads) {
    if (h % 16 || inter % 16) return -1;
    int64_t blocks = (m + TB - 1) / TB;
    float *xp = aligned_alloc(64, sizeof(float) * blocks * h * TB);
    float *gp = aligned_alloc(64, sizeof(float) * blocks * inter * TB);
    int failed = !xp || !gp;
#pragma omp parallel num_threads(threads) if (!failed)
    {
        float *wp = failed ? NULL : aligned_alloc(64, sizeof(float) * MC * KC);
        float *c = wp ? aligned_alloc(64, sizeof(float) * blocks * MC * TB) : NULL;
        if (!c) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++)
                pack_tokens(x, h, tokens + b * TB, block_tokens(m, b), xp + b * h * TB);
            gate_up_pass(xp, blocks, m, h, gate_up, inter, gp, wp, c);
            down_pass(gp, blocks, m, inter, down, h, tokens, weights, out, wp, c);
        }
        free(c);
        free(wp);
    }
    free(xp);
    free(gp);
    return failed ? -1 : 0;
}
// --- AMX tiles --------------------------------------------------------------------------------
// The same expert on AMX's bf16 tiles (amx.h), where oneDNN's bf16 GEMM already outruns the
// float32 loops above. Tokens lie along the tiles' rows here, features along their columns:
// - the group's rows of x are gathered into one bf16 matrix [m][H];
// - gate/up: each thread takes 16 features at a time, packs their gate rows and their up rows
//   into the tiles' pair layout (a 16 x 16 transpose of K-step pairs per 32 K steps), and
//   multiplies every block of 32 tokens by the two: the sums' epilogue writes silu(gate) * up,
//   rounded to bf16 once, into the down projection's input [m][I];
// - down: 32 output features at a time, packed the same way; the epilogue adds weight * sum
//   into each token's float32 output row.
// Each weight row is read from memory and packed once per call; packing costs a few shuffles
// per 32 K steps, shared by all of the group's tokens. H and I must be multiples of 32.
#ifdef HAVE_AMX

int moe_expert_amx_available(void) { return amx_ready(); }

// 16 rows (features) of a row-major bf16 weight, stride `stride`, K steps [0, k) -> pairs
// [k/2][16][2] (amx.h): pair p of every feature is one 64-byte row.
static void pack_features(const uint16_t *rows, int64_t stride, int64_t k, uint16_t *out) {
    for (int64_t s = 0; s < k / 32; s++) {
        __m512 r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_castsi512_ps(_mm512_loadu_si512(rows + i * stride + 32 * s));
        transpose16(r);
        for (int p = 0; p < 16; p++) _mm512_storeu_si512(out + (16 * s + p) * 32, _mm512_castps_si512(r[p]));
    }
}

static inline void store_bf16(uint16_t *dst, __m512 v) {  // round to nearest even
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

// act[j][f0..f0+15] = silu(gate) * up for every token j, from the packed gate and up rows.
static void gate_up_features(const uint16_t *xs, int64_t m, int64_t h, const uint16_t *gate, const uint16_t *up,
                             uint16_t *act, int64_t inter, TileConfig *config) {
    float sums[4][256] __attribute__((aligned(64)));
    for (int64_t i = 0; i < m; i += 32) {
        int rows = m - i < 32 ? (int)(m - i) : 32;
        int top = amx_bf16_sums(xs + i * h, h, rows, h, gate, up, 2, config, sums);
        for (int r = 0; r < rows; r++) {
            const float *g = sums[(r >= top) * 2] + 16 * (r % 16), *u = sums[(r >= top) * 2 + 1] + 16 * (r % 16);
            store_bf16(act + (i + r) * inter, silu_times(_mm512_load_ps(g), _mm512_load_ps(u)));
        }
    }
}

// out[tokens[j]][f0..f0+16 cols) += weights[j] * (down rows . act_j) for every token j.
static void down_features(const uint16_t *act, int64_t m, int64_t inter, const uint16_t *w0, const uint16_t *w1,
                          int cols, const int64_t *tokens, const float *weights, float *out, int64_t h,
                          TileConfig *config) {
    float sums[4][256] __attribute__((aligned(64)));
    for (int64_t i = 0; i < m; i += 32) {
        int rows = m - i < 32 ? (int)(m - i) : 32;
        int top = amx_bf16_sums(act + i * inter, inter, rows, inter, w0, w1, cols, config, sums);
        for (int r = 0; r < rows; r++) {
            float *dst = out + tokens[i + r] * h;
            __m512 w = _mm512_set1_ps(weights[i + r]);
            for (int c = 0; c < cols; c++)
                _mm512_storeu_ps(dst + 16 * c, _mm512_fmadd_ps(w, _mm512_load_ps(sums[(r >= top) * 2 + c] + 16 * (r % 16)),
                                                               _mm512_loadu_ps(dst + 16 * c)));
        }
    }
}

// Returns 0, or -1 when H or I is not a multiple of 32, AMX is unavailable or memory runs out.
// Same arguments and result as moe_expert_silu, in bf16 tiles (the activations rounded to bf16).
int moe_expert_silu_amx(const uint16_t *x, const int64_t *tokens, const float *weights, int64_t m,
                        const uint16_t *gate_up, const uint16_t *down, float *out, int64_t h, int64_t inter,
                        int threads) {
    if (h % 32 || inter % 32 || !amx_ready()) return -1;
    uint16_t *xs = malloc(sizeof(uint16_t) * m * (h + inter));
    int failed = !xs;
#pragma omp parallel num_threads(threads) if (!failed)
    {
        int64_t k = h > inter ? h : inter;
        uint16_t *panel = failed ? NULL : aligned_alloc(64, sizeof(uint16_t) * 32 * k);
        if (!panel) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            TileConfig config = {0};
            uint16_t *act = xs + m * h;
#pragma omp for schedule(static)
            for (int64_t j = 0; j < m; j++) memcpy(xs + j * h, x + tokens[j] * h, sizeof(uint16_t) * h);
#pragma omp for schedule(static)
            for (int64_t f = 0; f < inter; f += 16) {
                pack_features(gate_up + f * h, h, h, panel);
                pack_features(gate_up + (inter + f) * h, h, h, panel + 16 * h);
                gate_up_features(xs, m, h, panel, panel + 16 * h, act + f, inter, &config);
            }
#pragma omp for schedule(static)
            for (int64_t f = 0; f < h; f += 32) {
                int cols = h - f < 32 ? 1 : 2;
                for (int c = 0; c < cols; c++) pack_features(down + (f + 16 * c) * inter, inter, inter, panel + c * 16 * inter);
                down_features(act, m, inter, panel, panel + 16 * inter, cols, tokens, weights, out + f, h, &config);
            }
            _tile_release();
        }
        free(panel);
    }
    free(xs);
    return failed ? -1 : 0;
}
#endif
#else
int moe_expert_available(void) { return 0; }

// built without AVX-512: moe_expert_available() tells callers to keep the torch path
int moe_expert_silu(const uint16_t *x, const int64_t *tokens, const float *weights, int64_t m, const uint16_t *gate_up,
                    const uint16_t *down, float *out, int64_t h, int64_t inter, int threads) {
    return -1;
}
#endif

#ifndef HAVE_AMX
int moe_expert_amx_available(void) { return 0; }

// built without AMX (or without AVX-512): moe_expert_amx_available() tells callers to keep the other paths
int moe_expert_silu_amx(const uint16_t *x, const int64_t *tokens, const float *weights, int64_t m,
                        const uint16_t *gate_up, const uint16_t *down, float *out, int64_t h, int64_t inter,
                        int threads) {
    return -1;
}
#endif
