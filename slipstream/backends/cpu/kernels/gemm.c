// y[M, N] = x[M, K] . W[N, K]^T for bf16 x and bf16 y: the GEMM of every Linear below the
// sizes where a library GEMM takes over. W is bf16 (`gemm_bf16`), int8 codes with one float32
// scale per output column (`gemm_int8`: half the bytes to stream), or 4-bit codes in groups of
// 32 along K with a scale and a minimum (or zero point) per group and column: int4 and GGUF's
// nibble formats (`gemm_blocks`: about a quarter). Each
// format has an AVX-512 inner loop, a bf16 dot-product version where those run at the FMA's rate
// (`gemm_*_dots`), and on CPUs with AMX a tile version (`gemm_*_amx`, at the end), all reading the
// same packed W; backends/cpu/linear.py decides which serves how many rows. What they share: W
// packed once in blocks of 16 output columns, sums that stay in registers or tiles over K, each
// thread an equal share of the columns.
//
// On Intel's CPUs without AMX, oneDNN's bf16 kernel and a vdpbf16ps kernel both top out near 75
// GFLOP/s per core, while float32 FMAs reach 110-120: so the loops keep W bf16 in memory (half the
// bytes to stream) and widen it to float32 in registers, x is widened once per call.
// bf16 W is packed once (backends/cpu/linear.py) as [N/16][K/2][16][2]: each pair of K steps of 16
// output columns is one 64-byte load, and the layout of AMX's B tiles (16 pairs of K steps x
// 16 columns). A shift (even K step) or a mask (odd) widens it to float32. A tile of MR rows x
// 64 columns keeps its 4*MR sums in registers over the whole K loop; each thread streams its
// share of W's columns once per MR rows (from cache after the first).
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "vector_math.h"

// 4-bit codes on nibbles (`gemm_blocks`): GGUF's formats (gguf_repack.py): float16 scale and low (NULL: -8
// scale, or -16 with a plane of fifth bits), k-quants' group scales and minimums, Q6_K's int8 scales and sixth
// bits; or int4's bf16 scale and zero point (`zero`; w = (q - 8) * scale + zero)
typedef struct {
    const uint16_t *scale, *low;
    const uint32_t *high, *sixth;
    const uint8_t *group;
    const uint16_t *zero;
} Blocks;

#if defined(__AVX2__) && defined(__FMA__)  // gemm_bf16's loops: AVX-512 and AVX2 builds
// The 16-column blocks [begin, end) of the calling thread: equal, contiguous shares, so that a
// few hundred columns (an output projection of one decode row) still split evenly.
static void thread_blocks(int64_t blocks, int64_t *begin, int64_t *end) {
    int64_t thread = omp_get_thread_num(), count = omp_get_num_threads();
    *begin = blocks * thread / count;
    *end = blocks * (thread + 1) / count;
}

static float *widened_rows(const uint16_t *x, int64_t count) {
    float *xf = malloc(sizeof(float) * count);
    for (int64_t i = 0; xf && i < count; i++) {
        uint32_t bits = (uint32_t)x[i] << 16;
        __builtin_memcpy(xf + i, &bits, sizeof bits);
    }
    return xf;
}

#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#define MR 6
#define NR 4  // 16-column blocks per tile

// 16 columns' pair of bf16 K steps -> the even (first) or odd step as float32
static inline __m512 even_step(const uint16_t *pairs) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(pairs), 16));
}

static inline __m512 odd_step(const uint16_t *pairs) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(pairs), _mm512_set1_epi32((int)0xFFFF0000)));
}

static inline void store_bf16(uint16_t *dst, __m512 v) {  // round to nearest even
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

static inline __attribute__((always_inline)) void tile(const float *x, int64_t k, const uint16_t *w, uint16_t *y,
                                                       int64_t n, int mr, int nr) {
    __m512 acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k / 2; p++) {  // K steps in order, as the sums were always taken
        __m512 b[NR];
        for (int j = 0; j < nr; j++) b[j] = even_step(w + (j * k / 2 + p) * 32);
        for (int i = 0; i < mr; i++) {
            __m512 a = _mm512_set1_ps(x[i * k + 2 * p]);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
        }
        for (int j = 0; j < nr; j++) b[j] = odd_step(w + (j * k / 2 + p) * 32);
        for (int i = 0; i < mr; i++) {
            __m512 a = _mm512_set1_ps(x[i * k + 2 * p + 1]);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) store_bf16(y + i * n + 16 * j, acc[i][j]);
}

// Rows of one 64-column tile, MR at a time; the row count is a constant in each call of
// `tile` so that its sums stay in registers.
static inline __attribute__((always_inline)) void column_tile(const float *x, int64_t m, int64_t k, const uint16_t *w,
                                                              uint16_t *y, int64_t n, int nr) {
    int64_t i = 0;
    if (nr != NR) {  // a thread's last, narrower tile: row by row, its width a constant
        for (; i < m; i++) switch (nr) {
            case 3: tile(x + i * k, k, w, y + i * n, n, 1, 3); break;
            case 2: tile(x + i * k, k, w, y + i * n, n, 1, 2); break;
            default: tile(x + i * k, k, w, y + i * n, n, 1, 1);
        }
        return;
    }
    for (; i + MR <= m; i += MR) tile(x + i * k, k, w, y + i * n, n, MR, NR);
    switch (m - i) {
        case 5: tile(x + i * k, k, w, y + i * n, n, 5, NR); break;
        case 4: tile(x + i * k, k, w, y + i * n, n, 4, NR); break;
        case 3: tile(x + i * k, k, w, y + i * n, n, 3, NR); break;
        case 2: tile(x + i * k, k, w, y + i * n, n, 2, NR); break;
        case 1: tile(x + i * k, k, w, y + i * n, n, 1, NR); break;
    }
}

int gemm_bf16_available(void) { return 1; }

// gemm_bf16's share of one thread: the 16-column blocks [begin, end), NR at a time.
static void bf16_blocks(const float *xf, int64_t m, int64_t k, const uint16_t *w_packed, uint16_t *y, int64_t n,
                        int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b += NR)
        column_tile(xf, m, k, w_packed + b * 16 * k, y + b * 16, n, end - b < NR ? (int)(end - b) : NR);
}

// act [tokens][width] = silu(gate) * up of a fused projection's output [tokens][gate | up] (width
// each), rounded as the AMX kernels' `_silu` epilogue rounds (vector_math.h); with gelu, the tanh
// approximation of GELU in silu's place (Gemma's MLP; no epilogue has it). Returns 0.
static int gated_activation(const uint16_t *gate_up, uint16_t *act, int64_t tokens, int64_t width, int gelu,
                            int threads) {
#pragma omp parallel for num_threads(threads) if (tokens > 16)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *gate = gate_up + t * 2 * width, *up = gate + width;
        for (int64_t i = 0; i < width; i += 16) {
            uint16_t g[16] = {0}, u[16] = {0}, out[16];  // the last 16 may be partial
            int count = width - i < 16 ? (int)(width - i) : 16;
            memcpy(g, gate + i, count * sizeof(uint16_t));
            memcpy(u, up + i, count * sizeof(uint16_t));
            __m512 gate16 = widen16(g), up16 = widen16(u);
            __m256i product = gelu ? gelu_tanh_and_mul_bf16x16(gate16, up16) : silu_and_mul_bf16x16(gate16, up16);
            _mm256_storeu_si256((__m256i *)out, product);
            memcpy(act + t * width + i, out, count * sizeof(uint16_t));
        }
    }
    return 0;
}

int silu_and_mul_bf16(const uint16_t *gate_up, uint16_t *act, int64_t tokens, int64_t width, int threads) {
    return gated_activation(gate_up, act, tokens, width, 0, threads);
}

int gelu_tanh_and_mul_bf16(const uint16_t *gate_up, uint16_t *act, int64_t tokens, int64_t width, int threads) {
    return gated_activation(gate_up, act, tokens, width, 1, threads);
}

// --- int8: w = q * scale per output column ------------------------------------------------
// Integer arithmetic: each row of x becomes 16-bit fixed point (x = xq * row_scale, |xq| <=
// 32767: an error below 1/65534 of the row's largest value, far under bf16's own rounding of
// x unless one channel dwarfs the rest; the kernels that flush per group, gemm_q8 and int4,
// take a scale per group of the row instead), and `vpdpwssd` multiplies pairs of 16-bit
// activations and sign-extended codes into int32 sums: two ops per 32 multiply-adds, where
// widening codes to float32 took six. Codes
// are packed [N/16][K/4][16 columns][4]: four K steps per column in the order k0 k2 k1 k3, 64
// bytes per quad step. Shifting each 16-bit half left and back (arithmetic) gives the
// sign-extended pair (k0, k1), shifting it right gives (k2, k3); the same bytes are AMX's
// int8 B tiles (the tile kernel permutes x's bytes alike). The int32 sums move to float32
// every INT8_FLUSH pair steps, before they could overflow (128 * 2 * 32767 * 127 < 2^31).
// `gemm_q8` is the same with a float16 scale per group of 32 K steps and column instead, [N/16][K/32][16]
// (GGUF's Q8_0 repacked from a file's blocks): the sums move to float32 times their group's scale
// every group.
// One row's prefetches (tile_int8, tile_int4): Intel's cores measured best asking for the next tile's lines into
// L1, AMD's Zen 4 (gcc 12 names it znver3) for the tile after it into L2: SmolLM2 as stored, one thread, 8.73 ->
// 7.12 ms a decode step (medians of 3, alternated); at two threads 5.57 -> 5.47 (medians of 9, noise +-10%).
// ROW_BLOCKS: the 16-column blocks of a 4-bit tile of one row. Zen 4 streams one block's codes (one stream, two
// chains of sums) faster than four side by side: a 576 x 1536 layer, cold, one thread, 45-52 -> 36-40 us a call.
#if defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
#define ROW_PREFETCH _MM_HINT_T1
#define ROW_PREFETCH_TILES 2
#define ROW_BLOCKS 1
#else
#define ROW_PREFETCH _MM_HINT_T0
#define ROW_PREFETCH_TILES 1
#define ROW_BLOCKS (2 * NR4)
#endif
#define INT8_FLUSH 128
#define Q8_GROUP 32

#if defined(__AVX512VNNI__)
static inline __m512i dot_int16(__m512i acc, __m512i a, __m512i b) { return _mm512_dpwssd_epi32(acc, a, b); }
#else
static inline __m512i dot_int16(__m512i acc, __m512i a, __m512i b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
#endif

// x / scale rounded to nearest even, 16 values at a time (as lrintf rounds one), a scale per `group`
// consecutive values of a row (group divides k; k: one per row); the scalar loop this replaced
// (fmaxf, lrintf) cost ~6 ns per value, the whole GEMM at 16 columns. Per row, Gemma 3's
// activations (a few channels hundreds of times the rest) cost twice the perplexity against float32.
static int16_t *fixed_point_rows(const uint16_t *x, int64_t m, int64_t k, int64_t group, float *scale) {
    int16_t *xq = malloc(sizeof(int16_t) * m * k);
    for (int64_t r = 0; xq && r < m * (k / group); r++) {
        const uint16_t *in = x + r * group;
        int16_t *out = xq + r * group;
        __m512 largest = _mm512_setzero_ps();
        int64_t c = 0;
        for (; c + 16 <= group; c += 16) largest = _mm512_max_ps(largest, _mm512_abs_ps(widen16(in + c)));
        float top = _mm512_reduce_max_ps(largest);
        for (; c < group; c++) top = fmaxf(top, fabsf(bf16_to_float(in[c])));
        scale[r] = top > 0.f ? top / 32767.f : 1.f;
        float inverse = 1.f / scale[r];
        for (c = 0; c + 16 <= group; c += 16) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(widen16(in + c), _mm512_set1_ps(inverse)));
            _mm256_storeu_si256((__m256i *)(out + c), _mm512_cvtepi32_epi16(q));
        }
        for (; c < group; c++) out[c] = (int16_t)lrintf(bf16_to_float(in[c]) * inverse);
    }
    return xq;
}

// scale: per column (float32), row_scale per row; or with group_scale per group and column (float16; scale
// NULL), row_scale per group of the row
static inline __attribute__((always_inline)) void tile_int8(const int16_t *xq, const float *row_scale, int64_t k,
                                                            const int8_t *w, const float *scale,
                                                            const uint16_t *group_scale, uint16_t *y, int64_t n,
                                                            int mr, int nr) {
    __m512 total[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) total[i][j] = _mm512_setzero_ps();
    int64_t flush = group_scale ? Q8_GROUP / 2 : INT8_FLUSH, groups = k / Q8_GROUP;
    for (int64_t first = 0; first < k / 2; first += flush) {
        int64_t last = first + flush < k / 2 ? first + flush : k / 2;
        __m512i acc[MR][NR];
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_si512();
        for (int j = 0; mr == 1 && group_scale && j < nr; j++)  // as the codes below, the next tile's scales
            _mm_prefetch((const char *)(group_scale +
                                        ((ROW_PREFETCH_TILES * nr + j) * groups + first / (Q8_GROUP / 2)) * 16),
                         ROW_PREFETCH);
        for (int64_t q = first / 2; q < last / 2; q++) {
            for (int j = 0; mr == 1 && j < nr; j++)  // one row: a later tile's line asked for (see tile_int4)
                _mm_prefetch((const char *)(w + ((ROW_PREFETCH_TILES * nr + j) * k / 4 + q) * 64), ROW_PREFETCH);
            for (int half = 0; half < 2; half++) {  // pair steps 2q and 2q + 1, in order
                __m512i b[NR];
                for (int j = 0; j < nr; j++) {
                    __m512i quads = _mm512_loadu_si512(w + (j * k / 4 + q) * 64);
                    b[j] = half ? _mm512_srai_epi16(quads, 8) : _mm512_srai_epi16(_mm512_slli_epi16(quads, 8), 8);
                }
                for (int i = 0; i < mr; i++) {
                    int32_t pair;
                    __builtin_memcpy(&pair, xq + i * k + 4 * q + 2 * half, sizeof pair);
                    __m512i a = _mm512_set1_epi32(pair);
                    for (int j = 0; j < nr; j++) acc[i][j] = dot_int16(acc[i][j], a, b[j]);
                }
            }
        }
        for (int j = 0; j < nr && group_scale; j++) {
            const uint16_t *g = group_scale + (j * groups + first / (Q8_GROUP / 2)) * 16;
            __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
            for (int i = 0; i < mr; i++) {
                __m512 x_scale = _mm512_set1_ps(row_scale[i * groups + first / (Q8_GROUP / 2)]);
                total[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][j]), _mm512_mul_ps(s, x_scale), total[i][j]);
            }
        }
        for (int i = 0; i < mr && !group_scale; i++)
            for (int j = 0; j < nr; j++) total[i][j] = _mm512_add_ps(total[i][j], _mm512_cvtepi32_ps(acc[i][j]));
    }
    for (int j = 0; j < nr; j++)
        for (int i = 0; i < mr; i++)
            store_bf16(y + i * n + 16 * j, group_scale ? total[i][j] : _mm512_mul_ps(total[i][j],
                       opaque(_mm512_mul_ps(_mm512_loadu_ps(scale + 16 * j), _mm512_set1_ps(row_scale[i])))));
}

static inline __attribute__((always_inline)) void column_tile_int8(const int16_t *xq, const float *row_scale,
                                                                   int64_t m, int64_t k, const int8_t *w,
                                                                   const float *scale, const uint16_t *group_scale,
                                                                   uint16_t *y, int64_t n, int nr) {
    int64_t i = 0;
    int64_t scales = group_scale ? k / Q8_GROUP : 1;  // of x per row
#define TILE_INT8(rows, cols) \
    tile_int8(xq + i * k, row_scale + i * scales, k, w, scale, group_scale, y + i * n, n, rows, cols)
    if (nr != NR) {  // a thread's last, narrower tile: row by row, its width a constant
        for (; i < m; i++) switch (nr) {
            case 3: TILE_INT8(1, 3); break;
            case 2: TILE_INT8(1, 2); break;
            default: TILE_INT8(1, 1);
        }
        return;
    }
    for (; i + MR <= m; i += MR) TILE_INT8(MR, NR);
    switch (m - i) {
        case 5: TILE_INT8(5, NR); break;
        case 4: TILE_INT8(4, NR); break;
        case 3: TILE_INT8(3, NR); break;
        case 2: TILE_INT8(2, NR); break;
        case 1: TILE_INT8(1, NR); break;
    }
#undef TILE_INT8
}

static int int8_gemm(const uint16_t *x, const int8_t *w_packed, const float *scale, const uint16_t *group_scale,
                     uint16_t *y, int64_t m, int64_t n, int64_t k, int threads) {
    int64_t group = group_scale ? Q8_GROUP : k;
    float *row_scale = n % 16 || k % (group_scale ? Q8_GROUP : 4) ? NULL : malloc(sizeof(float) * m * (k / group));
    int16_t *xq = row_scale ? fixed_point_rows(x, m, k, group, row_scale) : NULL;
    if (!xq) {
        free(row_scale);
        return -1;
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t begin, end;
        thread_blocks(n / 16, &begin, &end);
        for (int64_t b = begin; b < end; b += NR)
            column_tile_int8(xq, row_scale, m, k, w_packed + b * 16 * k, scale ? scale + b * 16 : NULL,
                             group_scale ? group_scale + b * 16 * (k / Q8_GROUP) : NULL, y + b * 16, n,
                             end - b < NR ? (int)(end - b) : NR);
    }
    free(xq);
    free(row_scale);
    return 0;
}

// Returns 0, or -1 when N % 16 or K % 4 is not zero or memory runs out.
int gemm_int8(const uint16_t *x, const int8_t *w_packed, const float *scale, uint16_t *y, int64_t m, int64_t n,
              int64_t k, int threads) {
    return int8_gemm(x, w_packed, scale, NULL, y, m, n, k, threads);
}

// gemm_int8 with float16 scales per group of 32 and column; -1 when N % 16 or K % 32 is not zero
int gemm_q8(const uint16_t *x, const int8_t *w_packed, const uint16_t *scale, uint16_t *y, int64_t m, int64_t n,
            int64_t k, int threads) {
    return int8_gemm(x, w_packed, NULL, scale, y, m, n, k, threads);
}

// --- int4: w = q * scale + low per group of GROUP input channels ---------------------------
// The int8 path's integer arithmetic (16-bit fixed-point rows of x, `vpdpwssd`), on nibbles.
// Codes are packed [N/16][K/8][16 columns][4 bytes]: one column's dword holds eight K steps, its
// nibbles in the order k0 k2 k4 k6 k1 k3 k5 k7, so that (dword >> 4t) & 0x000F000F is the pair
// of 16-bit codes for steps 2t and 2t+1, ready for `vpdpwssd`: three ops per 32 multiply-adds,
// where widening nibbles to float32 took seven. Per group, the int32 sums of xq * q join the
// total as (sum * scale + (sum of the group's xq) * low) * the group's scale of x. scale, low:
// [N/16][K/GROUP][16] float16: GGUF's Q4_1 and Q4_0 repacked from a file's blocks as the file stores
// them, the same bytes per weight; Q4_0 has no low (NULL), which is -8 * scale. int4 (layers/quantization.py)
// gives scale and `zero` in bf16, the values PyTorch's kernel takes, and low is zero - 8 * scale (exact).
// `gemm_blocks` takes int4 and every GGUF format repacked on nibbles (gguf_repack.py), described by a `Blocks`:
// Q5_0 / Q5_1 add each code's fifth bit from a plane `high`, one dword
// per group and column ([N/16][K/GROUP][16], the file's 4 bytes per block): bit p holds K step 2p of
// the group, bit 16 + p step 2p + 1, so that rotating the dword right by p - 4 and masking with
// 0x00100010 gives the fifth bits of pair p = 4c + t as the nibbles above give its low four. Q5_0
// has no low: -16 * scale. Q4_K / Q5_K (high NULL for Q4_K) take their
// float16 d and dmin per 256 K steps and column as scale and low ([N/16][K/256][16]) and a group's 6-bit
// scale and minimum from `group` ([N/16][K/GROUP][2][16] bytes): the group's scale d * sc and low
// -dmin * mn, each exact in float32, as the format defines them. Q6_K
// adds a second plane, of sixth bits, and takes an int8 scale per 16 K steps and column from `group`
// ([N/16][K/16][16]) times d per 256: each group's sums are flushed per half, times d * sc, plus the
// half's sum of xq times -32 d sc. Sums of x are taken per 16 for that; a group's is their sum, exact.
#define GROUP 32
#define MR4 4
#define MR8 8  // prefill's rows per tile: 16 independent sums in flight, each pair's codes decoded once for 8 rows
#define NR4 2  // 16-column blocks per tile of MR4 or MR8 rows; fewer rows take ROW_BLOCKS, a row at a time

typedef struct {
    const uint16_t *scale, *low;  // float16; with zero, scale is bf16 and low NULL
    const uint16_t *zero;  // int4's zero points (bf16), or NULL
    const uint32_t *high;  // fifth bits (gemm_q5), or NULL
    const uint8_t *group;  // k-quants' 6-bit scale and minimum per group (gemm_qk), Q6_K's int8 scales, or NULL
    const uint32_t *sixth;  // Q6_K's sixth bits, or NULL
} GroupScales;

// pair p's bits of a plane moved to bits `bit` and 16 + `bit` and OR-ed into its codes (0xF8: a | (b & c))
static inline __m512i with_bit(__m512i pair, __m512i plane, int p, int bit) {
    __m512i bits = _mm512_rorv_epi32(plane, _mm512_set1_epi32((p + 32 - bit) % 32));
    return _mm512_ternarylogic_epi32(pair, bits, _mm512_set1_epi32(0x00010001 << bit), 0xF8);
}

// What a kernel copy reads besides the nibbles, a constant in each: testing the GroupScales per pair or
// per group cost Q4 a third of its speed.
enum { PLAIN, FIFTH, K_QUANT, K_QUANT_FIFTH, Q6K };

static inline int kind_of(const GroupScales *gs) {
    if (gs->sixth) return Q6K;
    if (gs->group) return gs->high ? K_QUANT_FIFTH : K_QUANT;
    return gs->high ? FIFTH : PLAIN;
}

static inline int planes_of(int kind) { return kind == Q6K ? 2 : kind == FIFTH || kind == K_QUANT_FIFTH; }

// pair p of a dword of nibbles with its planes' bits (c: the dword's index in its group, t: the pair's in it)
static inline __m512i codes_at(int kind, __m512i codes, __m512i high, __m512i sixth, int c, int t) {
    __m512i q = _mm512_and_si512(_mm512_srli_epi32(codes, 4 * t), _mm512_set1_epi32(0x000F000F));
    if (planes_of(kind) > 0) q = with_bit(q, high, 4 * c + t, 4);
    if (planes_of(kind) > 1) q = with_bit(q, sixth, 4 * c + t, 5);
    return q;
}

static inline __m512 scales16(const uint16_t *p, int64_t at) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + at)));
}

// scale and low of the 16 columns whose first entry is `at`, for the group's first or second `half` (Q6_K)
static inline void scale_and_low(const GroupScales *gs, int kind, int64_t at, int half, __m512 *s, __m512 *m) {
    if (kind == Q6K) {  // at / 16: the group's index over all column blocks; eight groups per d
        __m128i sc = _mm_loadu_si128((const __m128i *)(gs->group + at * 2 + half * 16));
        *s = _mm512_mul_ps(scales16(gs->scale, at / 128 * 16), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
        *m = _mm512_mul_ps(*s, _mm512_set1_ps(-32.0f));
        return;
    }
    if (kind == K_QUANT || kind == K_QUANT_FIFTH) {
        const uint8_t *sc = gs->group + at * 2;
        __m512 d = scales16(gs->scale, at / 128 * 16), dmin = scales16(gs->low, at / 128 * 16);
        *s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sc))));
        *m = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), dmin),
                           _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sc + 16)))));
        return;
    }
    if (gs->zero) {
        *s = widen16(gs->scale + at);
        *m = _mm512_fmadd_ps(*s, _mm512_set1_ps(-8.0f), widen16(gs->zero + at));
        return;
    }
    *s = scales16(gs->scale, at);
    *m = gs->low ? scales16(gs->low, at) : _mm512_mul_ps(*s, _mm512_set1_ps(kind == FIFTH ? -16.0f : -8.0f));
}

// Asks for what a 16-column block's group at `at` (as scale_and_low takes it) reads besides its codes.
static inline void prefetch_scales(const GroupScales *gs, int kind, int64_t at) {
    if (planes_of(kind) > 0) _mm_prefetch((const char *)(gs->high + at), ROW_PREFETCH);
    if (planes_of(kind) > 1) _mm_prefetch((const char *)(gs->sixth + at), ROW_PREFETCH);
    if (gs->group) {
        _mm_prefetch((const char *)(gs->group + at * 2), ROW_PREFETCH);
        return;
    }
    _mm_prefetch((const char *)(gs->scale + at), ROW_PREFETCH);
    if (gs->low) _mm_prefetch((const char *)(gs->low + at), ROW_PREFETCH);
    if (gs->zero) _mm_prefetch((const char *)(gs->zero + at), ROW_PREFETCH);
}

// scales: the first of this tile's 16-column block in gs; x_scale: x's per group, row after row
static inline __attribute__((always_inline)) void tile_int4(const int16_t *xq, const float *x_scale,
                                                            const float *xsum, int64_t k, const uint8_t *w,
                                                            const GroupScales *gs, int64_t scales, uint16_t *y,
                                                            int64_t n, int mr, int nr, int kind) {
    int64_t groups = k / GROUP;
    int chains = mr == 1 && nr == 1 ? 2 : 1;  // one block's sums as two chains (odd pairs apart): twice in flight
    __m512 acc[MR8][2 * NR4];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i high[2 * NR4], sixth[2 * NR4], part[MR8][2 * NR4];
        for (int j = 0; j < nr; j++) {
            int64_t at = scales + (j * groups + g) * 16;
            high[j] = planes_of(kind) > 0 ? _mm512_loadu_si512(gs->high + at) : _mm512_setzero_si512();
            sixth[j] = planes_of(kind) > 1 ? _mm512_loadu_si512(gs->sixth + at) : _mm512_setzero_si512();
        }
        // One row (decode) reads each weight once, from memory: a later tile's group g is asked for now, one or
        // two tiles of arithmetic before its use (ROW_PREFETCH; the hardware prefetchers, which lose a stream at
        // each tile's edge and start each column block cold, left loads and arithmetic taking turns)
        for (int j = 0; mr == 1 && j < nr; j++) {
            const char *next = (const char *)(w + ((ROW_PREFETCH_TILES * nr + j) * k / 8 + g * GROUP / 8) * 64);
            for (int line = 0; line < 4; line++) _mm_prefetch(next + 64 * line, ROW_PREFETCH);
            prefetch_scales(gs, kind, scales + ((ROW_PREFETCH_TILES * nr + j) * groups + g) * 16);
        }
        int halves = kind == Q6K ? 2 : 1;  // Q6_K's scales change every 16 K steps
        for (int h = 0; h < halves; h++) {
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nr + chains - 1; j++) part[i][j] = _mm512_setzero_si512();
            for (int c = h * 4 / halves; c < (h + 1) * 4 / halves; c++) {
                __m512i codes[2 * NR4];
                for (int j = 0; j < nr; j++) codes[j] = _mm512_loadu_si512(w + (j * k / 8 + g * GROUP / 8 + c) * 64);
                for (int t = 0; t < 4; t++) {
                    __m512i q[2 * NR4];
                    for (int j = 0; j < nr; j++) q[j] = codes_at(kind, codes[j], high[j], sixth[j], c, t);
                    for (int i = 0; i < mr; i++) {
                        int32_t pair;
                        __builtin_memcpy(&pair, xq + i * k + g * GROUP + c * 8 + 2 * t, sizeof pair);
                        __m512i x_pair = _mm512_set1_epi32(pair);
                        for (int j = 0; j < nr; j++) {
                            int to = chains == 2 ? t & 1 : j;
                            part[i][to] = dot_int16(part[i][to], x_pair, q[j]);
                        }
                    }
                }
            }
            if (chains == 2) part[0][0] = _mm512_add_epi32(part[0][0], part[0][1]);
            for (int j = 0; j < nr; j++) {  // the sums join the total
                __m512 s, m;
                scale_and_low(gs, kind, scales + (j * groups + g) * 16, h, &s, &m);
                for (int i = 0; i < mr; i++) {
                    const float *x16 = xsum + i * 2 * groups + 2 * g;  // the group's sums of xq per 16
                    float xs = halves == 2 ? x16[h] : x16[0] + x16[1], unit = x_scale[i * groups + g];
                    acc[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(xs * unit), m,
                                                _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[i][j]),
                                                                _mm512_mul_ps(s, _mm512_set1_ps(unit)), acc[i][j]));
                }
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) store_bf16(y + i * n + 16 * j, acc[i][j]);
}

static inline __attribute__((always_inline)) void column_tile_int4(const int16_t *xq, const float *x_scale,
                                                                   const float *xsum, int64_t m, int64_t k,
                                                                   const uint8_t *w, const GroupScales *gs,
                                                                   int64_t scales, uint16_t *y, int64_t n, int nr,
                                                                   int kind) {
    int64_t i = 0, groups = k / GROUP;
#define TILE_INT4(rows, cols) \
    tile_int4(xq + i * k, x_scale + i * groups, xsum + i * 2 * groups, k, w, gs, scales, y + i * n, n, rows, cols, kind)
    if (nr == NR4) {
        for (; i + MR8 <= m; i += MR8) TILE_INT4(MR8, NR4);
        for (; i + MR4 <= m; i += MR4) TILE_INT4(MR4, NR4);
    }
    for (; i < m; i++) {  // constant widths keep the sums in registers
        if (nr == 2 * NR4)
            TILE_INT4(1, 2 * NR4);
        else if (nr == 3)
            TILE_INT4(1, 3);
        else if (nr == NR4)
            TILE_INT4(1, NR4);
        else
            TILE_INT4(1, 1);
    }
#undef TILE_INT4
}

static int int4_gemm(const uint16_t *x, const uint8_t *w_packed, const GroupScales *gs, uint16_t *y, int64_t m,
                     int64_t n, int64_t k, int threads) {
    float *x_scale = n % 16 || k % GROUP ? NULL : malloc(sizeof(float) * m * 3 * (k / GROUP));
    int16_t *xq = x_scale ? fixed_point_rows(x, m, k, GROUP, x_scale) : NULL;
    if (!xq) {
        free(x_scale);
        return -1;
    }
    float *xsum = x_scale + m * (k / GROUP);
    for (int64_t r = 0; r < m * (2 * k / GROUP); r++) {  // per 16: exact integers in float32
        int32_t total = 0;
        for (int t = 0; t < GROUP / 2; t++) total += xq[r * GROUP / 2 + t];
        xsum[r] = (float)total;
    }
    int width = m < MR4 ? ROW_BLOCKS : NR4;
#pragma omp parallel num_threads(threads)
    {
        int64_t begin, end;
        thread_blocks(n / 16, &begin, &end);
        for (int64_t b = begin; b < end; b += width) {
#define COLUMN_TILE(kind)                                                                                          \
    column_tile_int4(xq, x_scale, xsum, m, k, w_packed + b * 8 * k, gs, b * 16 * (k / GROUP), y + b * 16, n, \
                     end - b < width ? (int)(end - b) : width, kind)
            switch (kind_of(gs)) {
                case PLAIN: COLUMN_TILE(PLAIN); break;
                case FIFTH: COLUMN_TILE(FIFTH); break;
                case K_QUANT: COLUMN_TILE(K_QUANT); break;
                case K_QUANT_FIFTH: COLUMN_TILE(K_QUANT_FIFTH); break;
                default: COLUMN_TILE(Q6K);
            }
#undef COLUMN_TILE
        }
    }
    free(xq);
    free(x_scale);
    return 0;
}

static GroupScales block_scales(const Blocks *b) {
    return (GroupScales){b->scale, b->low, b->zero, b->high, b->group, b->sixth};
}

// Returns 0, or -1 when N % 16 or K % GROUP is not zero, K % 256 for the k-quants' and Q6_K's super-blocks,
// or memory runs out.
int gemm_blocks(const uint16_t *x, const uint8_t *w_packed, const Blocks *b, uint16_t *y, int64_t m, int64_t n,
                int64_t k, int threads) {
    GroupScales gs = block_scales(b);
    return b->group && k % 256 ? -1 : int4_gemm(x, w_packed, &gs, y, m, n, k, threads);
}
#if defined(__AVX512BF16__)
static inline int min_int(int64_t a, int64_t b) { return (int)(a < b ? a : b); }

// What a block's sums become: bf16 columns of y, times scale[col] when given; or, with silu,
// silu(first block) * second block into 16 columns of y.
typedef struct {
    const float *scale;
    int silu;
} Epilogue;

// A row of one or two 16-column blocks of float32 sums to bf16 y, as one store (cvtne2ps2bf16
// rounds to nearest even, as store_bf16 does, and flushes denormals, which sums of products of
// bf16 weights and activations do not reach): a whole cache line per row of a 32-column panel.
static inline void store_row(uint16_t *y, __m512 first, __m512 second, int cols, const Epilogue *e) {
    if (e->scale) {
        first = _mm512_mul_ps(first, _mm512_loadu_ps(e->scale));
        if (cols == 2) second = _mm512_mul_ps(second, _mm512_loadu_ps(e->scale + 16));
    }
    if (e->silu)
        _mm256_storeu_si256((__m256i *)y, silu_and_mul_bf16x16(first, second));
    else if (cols == 2)
        _mm512_storeu_si512(y, (__m512i)_mm512_cvtne2ps_pbh(second, first));
    else
        _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(first));
}

// The column blocks of W a thread's panels pair up, and where their columns go in y: blocks b
// and b + 1 into columns 16 b.., or (silu) gate block b and up block b + half into 16 b..
typedef struct {
    int64_t first, second, out;
    int cols;
} Panel;

static Panel panel_at(int64_t b, int64_t end, int silu, int64_t half) {
    if (silu) return (Panel){b, b + half, 16 * b, 2};
    return (Panel){b, b + 1, 16 * b, end - b < 2 ? 1 : 2};
}

// Output blocks: N/16 of y's columns, or (silu) the I/16 gate blocks.
static int64_t output_blocks(int64_t n, int silu) { return silu ? n / 32 : n / 16; }

// Codes of one 16-column block widened to bf16 pairs [k/2][16][2] for the bf16 tiles.
typedef struct {
    const void *w;
    GroupScales scales;  // int4: per group and column; int8: a NULL scale (exact codes)
    const uint16_t *group_scale;  // Q8_0's int8 codes: float16 per group of Q8_GROUP and column (NULL: none)
} Codes;

// 16 columns' values at an even and the next odd K step -> their bf16 pairs, rounded to nearest even.
static inline __m512i bf16_pairs(__m512 even, __m512 odd) {
    static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                            8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(interleave), (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

// int8: quads [k/4][16][4] (k0 k2 k1 k3) -> the exact codes as bf16 pairs; with Q8_0's `group_scale`
// ([k/Q8_GROUP][16] float16), each code times its group's scale, rounded to bf16 once.
static void widen_int8_block(const int8_t *w, const uint16_t *group_scale, int64_t k, uint16_t *out) {
    __m512 s = _mm512_set1_ps(1.f);
    for (int64_t q = 0; q < k / 4; q++) {
        if (group_scale && q % (Q8_GROUP / 4) == 0)
            s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(group_scale + q / (Q8_GROUP / 4) * 16)));
        __m512i quads = _mm512_loadu_si512(w + q * 64);
        __m512i pairs[2] = {_mm512_srai_epi16(_mm512_slli_epi16(quads, 8), 8), _mm512_srai_epi16(quads, 8)};
        for (int h = 0; h < 2; h++) {  // each dword: two int16 codes, exact in float32 and in bf16
            __m512 even = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pairs[h], 16), 16)), s);
            __m512 odd = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(pairs[h], 16)), s);
            _mm512_storeu_si512(out + (2 * q + h) * 32, bf16_pairs(even, odd));
        }
    }
}

// int4: codes [k/8][16][4 bytes] (and the planes of higher bits), each kind's scales -> bf16 pairs of
// q * scale + low; `kind` a constant in each copy, as for `tile_int4`.
static inline __attribute__((always_inline)) void widen_codes(const uint8_t *w, const GroupScales *gs, int64_t scales,
                                                              int64_t k, uint16_t *out, int kind) {
    for (int64_t g = 0; g < k / GROUP; g++) {
        __m512i high = planes_of(kind) > 0 ? _mm512_loadu_si512(gs->high + scales + g * 16) : _mm512_setzero_si512();
        __m512i sixth = planes_of(kind) > 1 ? _mm512_loadu_si512(gs->sixth + scales + g * 16) : _mm512_setzero_si512();
        __m512 s, m;
        for (int c = 0; c < GROUP / 8; c++) {
            if (c == 0 || (kind == Q6K && c == 2)) scale_and_low(gs, kind, scales + g * 16, c / 2, &s, &m);
            __m512i codes = _mm512_loadu_si512(w + (g * GROUP / 8 + c) * 64);
            for (int t = 0; t < 4; t++) {  // K steps 2t and 2t + 1 of the dword, as for `tile_int4`
                __m512i pair = codes_at(kind, codes, high, sixth, c, t);
                __m512 even = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(pair, _mm512_set1_epi32(0xFFFF))), s, m);
                __m512 odd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(pair, 16)), s, m);
                _mm512_storeu_si512(out + ((g * GROUP / 8 + c) * 4 + t) * 32, bf16_pairs(even, odd));
            }
        }
    }
}

static void widen_int4_block(const uint8_t *w, const GroupScales *gs, int64_t scales, int64_t k, uint16_t *out) {
    switch (kind_of(gs)) {
        case PLAIN: widen_codes(w, gs, scales, k, out, PLAIN); break;
        case FIFTH: widen_codes(w, gs, scales, k, out, FIFTH); break;
        case K_QUANT: widen_codes(w, gs, scales, k, out, K_QUANT); break;
        case K_QUANT_FIFTH: widen_codes(w, gs, scales, k, out, K_QUANT_FIFTH); break;
        default: widen_codes(w, gs, scales, k, out, Q6K);
    }
}

static void widen_block(const Codes *c, int64_t b, int64_t k, uint16_t *out) {
    if (c->scales.scale)
        widen_int4_block((const uint8_t *)c->w + b * 8 * k, &c->scales, b * 16 * (k / GROUP), k, out);
    else
        widen_int8_block((const int8_t *)c->w + b * 16 * k, c->group_scale ? c->group_scale + b * 16 * (k / Q8_GROUP)
                         : NULL, k, out);
}

// --- bf16 dot products ----------------------------------------------------------------------
// Where `vdpbf16ps` (two bf16 products added into each float32 lane) issues at the float32 FMA's rate
// (AMD Zen 4: `CpuCapability.bf16_dots_win`), a thread's panel of two column blocks in bf16 pairs (the packed
// bf16 weight as it is; int8, Q8_0 and 4-bit codes widened per call, as the AMX path widens them) is multiplied
// by DOT_ROWS rows of x at a time, each row's bf16 pair broadcast against 16 columns' pairs: twice the
// multiply-adds of the AVX-512 loops per instruction. Widened values are the AMX path's (int8 codes exact; Q8_0's
// q * scale and 4-bit q * scale + low rounded to bf16 once); x is taken in bf16 as it is.
#define DOT_ROWS 8

static inline __attribute__((always_inline)) void dots_rows(const uint16_t *x, int64_t k, const uint16_t *w0,
                                                            const uint16_t *w1, int cols, const Epilogue *e,
                                                            uint16_t *y, int64_t n, const int rows) {
    __m512 acc[DOT_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k / 2; p++) {
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + p * 32);
        __m512bh b1 = (__m512bh)_mm512_loadu_si512((cols == 2 ? w1 : w0) + p * 32);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            __builtin_memcpy(&pair, x + r * k + 2 * p, sizeof pair);
            __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
        }
    }
    for (int r = 0; r < rows; r++) store_row(y + r * n, acc[r][0], acc[r][1], cols, e);
}

static void dots_panel(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w0, const uint16_t *w1, int cols,
                       const Epilogue *e, uint16_t *y, int64_t n) {
    int64_t i = 0;
    for (; i + DOT_ROWS <= m; i += DOT_ROWS) dots_rows(x + i * k, k, w0, w1, cols, e, y + i * n, n, DOT_ROWS);
    switch (m - i) {  // constant row counts keep the sums in registers
        case 7: dots_rows(x + i * k, k, w0, w1, cols, e, y + i * n, n, 7); break;
        case 6: dots_rows(x + i * k, k, w0, w1, cols, e, y + i * n, n, 6); break;
        case 5: dots_rows(x + i * k, k, w0, w1, cols, e, y + i * n, n, 5); break;
        case 4: dots_rows(x + i * k, k, w0, w1, cols, e, y + i * n, n, 4); break;
        case 3: dots_rows(x + i * k, k, w0, w1, cols, e, y + i * n, n, 3); break;
        case 2: dots_rows(x + i * k, k, w0, w1, cols, e, y + i * n, n, 2); break;
        case 1: dots_rows(x + i * k, k, w0, w1, cols, e, y + i * n, n, 1); break;
    }
}

// The column scales of a panel's two blocks (silu: gate's and up's) into `scaled`; NULL without them.
static const float *panel_scale(const float *column_scale, Panel p, float scaled[32]) {
    if (!column_scale) return NULL;
    memcpy(scaled, column_scale + 16 * p.first, 16 * sizeof(float));
    if (p.cols == 2) memcpy(scaled + 16, column_scale + 16 * p.second, 16 * sizeof(float));  // a lone block has none
    return scaled;
}

// bf16 weights packed as panels already (`plain`), or int8 (scale per column applied at the end) and 4-bit codes
// through a widened panel per thread.
static int dots_gemm(const uint16_t *x, const uint16_t *plain, const Codes *codes, const float *column_scale,
                     uint16_t *y, int64_t m, int64_t n, int64_t k, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        uint16_t *panel = plain ? NULL : aligned_alloc(64, sizeof(uint16_t) * 32 * k);
        int64_t begin, end;
        thread_blocks(n / 16, &begin, &end);
        for (int64_t b = begin; (plain || panel) && b < end; b += 2) {
            Panel p = panel_at(b, end, 0, 0);
            const uint16_t *w0, *w1;
            if (plain) {
                w0 = plain + p.first * 16 * k, w1 = plain + p.second * 16 * k;
            } else {
                widen_block(codes, p.first, k, panel);
                if (p.cols == 2) widen_block(codes, p.second, k, panel + 16 * k);
                w0 = panel, w1 = panel + 16 * k;
            }
            float scaled[32];
            Epilogue e = {panel_scale(column_scale, p, scaled), 0};
            dots_panel(x, m, k, w0, w1, p.cols, &e, y + p.out, n);
        }
        if (!plain && !panel) {
#pragma omp atomic write
            failed = 1;
        }
        free(panel);
    }
    return failed ? -1 : 0;
}

// gemm_bf16 with bf16 dot products on the packed weight as it is; -1 when N % 16 or K % 2 is not zero
int gemm_bf16_dots(const uint16_t *x, const uint16_t *w_packed, uint16_t *y, int64_t m, int64_t n, int64_t k,
                   int threads) {
    return n % 16 || k % 2 ? -1 : dots_gemm(x, w_packed, NULL, NULL, y, m, n, k, threads);
}

// gemm_int8, gemm_q8 and gemm_blocks with bf16 dot products on widened panels; -1 when N % 16 or
// K % 4 (int8), K % 32 (Q8_0, int4), K % 256 (k-quants) is not zero or memory runs out. int8 multiplies bf16 x by the
// exact codes, not x's 16-bit fixed point: its sums differ from gemm_int8's by x's rounding.
int gemm_int8_dots(const uint16_t *x, const int8_t *w_packed, const float *scale, uint16_t *y, int64_t m, int64_t n,
                   int64_t k, int threads) {
    Codes codes = {w_packed, {NULL, NULL}};
    return n % 16 || k % 4 ? -1 : dots_gemm(x, NULL, &codes, scale, y, m, n, k, threads);
}

int gemm_q8_dots(const uint16_t *x, const int8_t *w_packed, const uint16_t *scale, uint16_t *y, int64_t m, int64_t n,
                 int64_t k, int threads) {
    Codes codes = {w_packed, {NULL, NULL}, scale};
    return n % 16 || k % Q8_GROUP ? -1 : dots_gemm(x, NULL, &codes, NULL, y, m, n, k, threads);
}

static int int4_dots(const uint16_t *x, const uint8_t *w_packed, GroupScales scales, uint16_t *y, int64_t m, int64_t n,
                     int64_t k, int threads) {
    Codes codes = {w_packed, scales};
    return n % 16 || k % GROUP ? -1 : dots_gemm(x, NULL, &codes, NULL, y, m, n, k, threads);
}

int gemm_blocks_dots(const uint16_t *x, const uint8_t *w_packed, const Blocks *b, uint16_t *y, int64_t m, int64_t n,
                     int64_t k, int threads) {
    return b->group && k % 256 ? -1 : int4_dots(x, w_packed, block_scales(b), y, m, n, k, threads);
}
#endif

// --- AMX tiles ------------------------------------------------------------------------------
// The same products on AMX's tile unit, for the row counts where it wins (backends/cpu/linear.py):
// one `tdpbf16ps` multiplies a tile of 16 rows x 32 K steps of x by 32 K steps x 16 columns of
// W into 16 x 16 float32 sums, 16 times the multiply-adds of an AVX-512 FMA (amx.h). Sums stay
// in tiles over the whole K loop, a block of up to 32 rows x 32 columns at a time. Each thread
// takes its share of W's columns, a panel of two 16-column blocks at a time, and runs every row
// block over the panel while it is in cache.
// - bf16: W's packed pairs are B tiles as they lie; float32 sums like the FMA loop's, in
//   another order.
// - int8: x in 16-bit fixed point as for `gemm_int8`, split into
//   a signed high byte and an unsigned low byte (xq = 256 hi + lo, the bytes of each quad
//   permuted as the codes are); `tdpbssd` (hi) and `tdpbusd` (lo) against the codes as they lie
//   give exact int32 sums, joined and added to float32 per chunk of K as `tile_int8` adds
//   them, so the two give the same bits. Two sums per block of 16 x 16, so
//   a block is 16 rows x 32 columns. The sums are `gemm_int8`'s to the bit, at every row count
//   (batch invariance).
// - int8 widened (`gemm_int8_amx_widened`), and int4: a panel's codes are first widened into a
//   per-thread buffer in the bf16 pair layout, then multiplied as bf16 with x as it is: int8
//   codes exactly (the column scale applied at the end), int4 as bf16 values q * scale + low
//   (computed in float32 and rounded once: a relative error up to 2^-9 of each weight, under a
//   tenth of its 4-bit step). Neither is the AVX-512 loops' arithmetic, so the batch-invariant
//   policy takes int4's tiles at every row count and never the widened int8 ones.
// Each has a `_silu` form for a fused gate/up projection, W = [gate; up] of 2I rows: a panel
// pairs gate block j with up block j + I/16, and the epilogue writes silu(gate) * up into y
// [M][I], rounded as `silu_and_mul_bf16` rounds the unfused projection's output.
// K must be a multiple of 32 (bf16, int4) or 64 (int8); other shapes keep the loops above.
#ifdef HAVE_AMX


int gemm_amx_available(void) { return amx_ready(); }

// One block of up to 32 rows x 32 columns (two column blocks w0, w1 of bf16 pairs) into y.
static void amx_bf16_block(const uint16_t *x, int rows, int64_t k, const uint16_t *w0, const uint16_t *w1, int cols,
                           const Epilogue *e, uint16_t *y, int64_t n, TileConfig *config) {
    float sums[4][256] __attribute__((aligned(64)));
    int top = amx_bf16_sums(x, k, rows, k, w0, w1, cols, config, sums);
    for (int r = 0; r < rows; r++) {
        const float *row = sums[(r >= top) * 2] + 16 * (r % 16);
        store_row(y + r * n, _mm512_load_ps(row), _mm512_load_ps(row + 256), cols, e);
    }
}

// Every row block of x over one panel of W.
static void amx_bf16_panel(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w0, const uint16_t *w1, int cols,
                           const Epilogue *e, uint16_t *y, int64_t n, TileConfig *config) {
    for (int64_t i = 0; i < m; i += 32)
        amx_bf16_block(x + i * k, min_int(32, m - i), k, w0, w1, cols, e, y + i * n, n, config);
}

static int gemm_bf16_tiles(const uint16_t *x, const uint16_t *w_packed, uint16_t *y, int64_t m, int64_t n, int64_t k,
                           int threads, int silu) {
    if (n % (silu ? 32 : 16) || k % 32 || !amx_ready()) return -1;
    int64_t blocks = output_blocks(n, silu), width = silu ? n / 2 : n;
    Epilogue e = {NULL, silu};
#pragma omp parallel num_threads(threads)
    {
        TileConfig config = {0};
        int64_t begin, end;
        thread_blocks(blocks, &begin, &end);
        for (int64_t b = begin; b < end; b += silu ? 1 : 2) {
            Panel p = panel_at(b, end, silu, blocks);
            amx_bf16_panel(x, m, k, w_packed + p.first * 16 * k, w_packed + p.second * 16 * k, p.cols, &e, y + p.out,
                           width, &config);
        }
        _tile_release();
    }
    return 0;
}

// Returns 0, or -1 when N % 16 or K % 32 is not zero or AMX is unavailable.
int gemm_bf16_amx(const uint16_t *x, const uint16_t *w_packed, uint16_t *y, int64_t m, int64_t n, int64_t k,
                  int threads) {
    return gemm_bf16_tiles(x, w_packed, y, m, n, k, threads, 0);
}

// y [M][N/2] = silu(gate) * up; -1 when N % 32 or K % 32 is not zero or AMX is unavailable.
int gemm_bf16_amx_silu(const uint16_t *x, const uint16_t *w_packed, uint16_t *y, int64_t m, int64_t n, int64_t k,
                       int threads) {
    return gemm_bf16_tiles(x, w_packed, y, m, n, k, threads, 1);
}

// int8: one row tile (rows <= 16) of split bytes [rows][stride] times one or two column blocks
// of codes over `steps` steps of 64 K.
static inline __attribute__((always_inline)) void amx_int8_tiles(const int8_t *hi, const uint8_t *lo, int64_t stride,
                                                                 int64_t steps, const int8_t *w0, const int8_t *w1,
                                                                 int cols, int32_t (*sums)[256]) {
    _tile_zero(0);
    _tile_zero(2);
    if (cols == 2) {
        _tile_zero(1);
        _tile_zero(3);
    }
    for (int64_t s = 0; s < steps; s++) {
        _tile_loadd(6, w0 + s * 1024, 64);
        if (cols == 2) _tile_loadd(7, w1 + s * 1024, 64);
        _tile_loadd(4, hi + s * 64, stride);
        _tile_loadd(5, lo + s * 64, stride);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbusd(2, 5, 6);
        if (cols == 2) {
            _tile_dpbssd(1, 4, 7);
            _tile_dpbusd(3, 5, 7);
        }
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(2, sums[2], 64);
    if (cols == 2) {
        _tile_stored(1, sums[1], 64);
        _tile_stored(3, sums[3], 64);
    }
}

// totals += the exact int32 sums 256 hi + lo of one K chunk, as float32: `tile_int8` adds its
// sums to float32 after the same chunks of 2 INT8_FLUSH K steps, so both give the same bits.
static inline void add_chunk(float *totals, const int32_t *hi, const int32_t *lo, int count) {
    for (int i = 0; i < count; i += 16) {
        __m512i exact = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(hi + i), 8), _mm512_load_si512(lo + i));
        _mm512_store_ps(totals + i, _mm512_add_ps(_mm512_load_ps(totals + i), _mm512_cvtepi32_ps(exact)));
    }
}

// scale0, scale1: the columns' scales of the two blocks (silu: gate's and up's).
static void amx_int8_block(const int8_t *hi, const uint8_t *lo, const float *row_scale, int rows, int64_t k,
                           const int8_t *w0, const int8_t *w1, const float *scale0, const float *scale1, int cols,
                           const Epilogue *e, uint16_t *y, int64_t n, TileConfig *config) {
    uint8_t shape[8] = {rows, rows, rows, rows, rows, rows, 16, 16};
    configure_tiles(shape, config);
    int32_t sums[4][256] __attribute__((aligned(64)));
    float totals[2][256] __attribute__((aligned(64))) = {{0}};
    for (int64_t first = 0; first < k; first += 2 * INT8_FLUSH) {
        int64_t steps = (k - first < 2 * INT8_FLUSH ? k - first : 2 * INT8_FLUSH) / 64;
        if (cols == 2) amx_int8_tiles(hi + first, lo + first, k, steps, w0 + first * 16, w1 + first * 16, 2, sums);
        else amx_int8_tiles(hi + first, lo + first, k, steps, w0 + first * 16, w1 + first * 16, 1, sums);
        for (int c = 0; c < cols; c++) add_chunk(totals[c], sums[c], sums[c + 2], 16 * rows);
    }
    Epilogue scaled = {NULL, e->silu};  // the scales are applied here
    for (int r = 0; r < rows; r++) {
        __m512 first = _mm512_mul_ps(_mm512_load_ps(totals[0] + 16 * r),
                                     opaque(_mm512_mul_ps(_mm512_loadu_ps(scale0), _mm512_set1_ps(row_scale[r]))));
        __m512 second = cols == 2 ? _mm512_mul_ps(_mm512_load_ps(totals[1] + 16 * r),
                                                  opaque(_mm512_mul_ps(_mm512_loadu_ps(scale1), _mm512_set1_ps(row_scale[r]))))
                                  : _mm512_setzero_ps();
        store_row(y + r * n, first, second, cols, &scaled);
    }
}

// Fixed-point rows as signed high and unsigned low bytes, each quad of K steps in the codes'
// order k0 k2 k1 k3; count is a multiple of 64 (K is).
static void split_bytes(const int16_t *xq, int64_t count, int8_t *hi, uint8_t *lo) {
    static const uint16_t quads[32] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15,
                                       16, 18, 17, 19, 20, 22, 21, 23, 24, 26, 25, 27, 28, 30, 29, 31};
    const __m512i order = _mm512_loadu_si512(quads);
    for (int64_t i = 0; i < count; i += 32) {
        __m512i v = _mm512_permutexvar_epi16(order, _mm512_loadu_si512(xq + i));
        _mm256_storeu_si256((__m256i *)(hi + i), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
        _mm256_storeu_si256((__m256i *)(lo + i), _mm512_cvtepi16_epi8(_mm512_and_si512(v, _mm512_set1_epi16(0xFF))));
    }
}

static int gemm_int8_split(const uint16_t *x, const int8_t *w_packed, const float *scale, uint16_t *y, int64_t m,
                           int64_t n, int64_t k, int threads, int silu) {
    float *row_scale = malloc(sizeof(float) * m);
    int16_t *xq = row_scale ? fixed_point_rows(x, m, k, k, row_scale) : NULL;
    int8_t *hi = xq ? malloc(2 * m * k) : NULL;
    if (!hi) {
        free(xq);
        free(row_scale);
        return -1;
    }
    uint8_t *lo = (uint8_t *)hi + m * k;
    split_bytes(xq, m * k, hi, lo);
    int64_t blocks = output_blocks(n, silu), width = silu ? n / 2 : n;
    Epilogue e = {NULL, silu};
#pragma omp parallel num_threads(threads)
    {
        TileConfig config = {0};
        int64_t begin, end;
        thread_blocks(blocks, &begin, &end);
        for (int64_t b = begin; b < end; b += silu ? 1 : 2) {
            Panel p = panel_at(b, end, silu, blocks);
            for (int64_t i = 0; i < m; i += 16)
                amx_int8_block(hi + i * k, lo + i * k, row_scale + i, min_int(16, m - i), k, w_packed + p.first * 16 * k,
                               w_packed + p.second * 16 * k, scale + 16 * p.first, scale + 16 * p.second, p.cols, &e,
                               y + i * width + p.out, width, &config);
        }
        _tile_release();
    }
    free(hi);
    free(xq);
    free(row_scale);
    return 0;
}

// int8 (scale per column applied at the end) or int4, through a widened panel per thread.
static int gemm_widened(const uint16_t *x, const Codes *codes, const float *column_scale, uint16_t *y, int64_t m,
                        int64_t n, int64_t k, int threads, int silu) {
    int failed = 0;
    int64_t blocks = output_blocks(n, silu), width = silu ? n / 2 : n;
#pragma omp parallel num_threads(threads)
    {
        uint16_t *panel = aligned_alloc(64, sizeof(uint16_t) * 32 * k);
        TileConfig config = {0};
        int64_t begin, end;
        thread_blocks(blocks, &begin, &end);
        for (int64_t b = begin; panel && b < end; b += silu ? 1 : 2) {
            Panel p = panel_at(b, end, silu, blocks);
            widen_block(codes, p.first, k, panel);
            if (p.cols == 2) widen_block(codes, p.second, k, panel + 16 * k);
            float scaled[32];
            Epilogue e = {panel_scale(column_scale, p, scaled), silu};
            amx_bf16_panel(x, m, k, panel, panel + 16 * k, p.cols, &e, y + p.out, width, &config);
        }
        if (!panel) {
#pragma omp atomic write
            failed = 1;
        }
        _tile_release();
        free(panel);
    }
    return failed ? -1 : 0;
}

static int gemm_nibble_tiles(const uint16_t *x, const uint8_t *w_packed, GroupScales scales, uint16_t *y, int64_t m,
                           int64_t n, int64_t k, int threads, int silu) {
    if (n % (silu ? 32 : 16) || k % GROUP || !amx_ready()) return -1;
    Codes codes = {w_packed, scales};
    return gemm_widened(x, &codes, NULL, y, m, n, k, threads, silu);
}

// int8 codes widened to bf16 tiles, the column scale applied at the end: 1.0-1.4x the integer
// tiles from 128 rows, but a row's sums then depend on the kernel its row count picked, so the
// batch-invariant policy never takes it.
static int gemm_int8_widened(const uint16_t *x, const int8_t *w_packed, const float *scale, uint16_t *y, int64_t m,
                             int64_t n, int64_t k, int threads, int silu) {
    if (n % (silu ? 32 : 16) || k % 64 || !amx_ready()) return -1;
    Codes codes = {w_packed, {NULL, NULL}};
    return gemm_widened(x, &codes, scale, y, m, n, k, threads, silu);
}

int gemm_int8_amx_widened(const uint16_t *x, const int8_t *w_packed, const float *scale, uint16_t *y, int64_t m,
                          int64_t n, int64_t k, int threads) {
    return gemm_int8_widened(x, w_packed, scale, y, m, n, k, threads, 0);
}

int gemm_int8_amx_widened_silu(const uint16_t *x, const int8_t *w_packed, const float *scale, uint16_t *y, int64_t m,
                               int64_t n, int64_t k, int threads) {
    return gemm_int8_widened(x, w_packed, scale, y, m, n, k, threads, 1);
}

static int gemm_int8_tiles(const uint16_t *x, const int8_t *w_packed, const float *scale, uint16_t *y, int64_t m,
                           int64_t n, int64_t k, int threads, int silu) {
    if (n % (silu ? 32 : 16) || k % 64 || !amx_ready()) return -1;
    return gemm_int8_split(x, w_packed, scale, y, m, n, k, threads, silu);
}

// Returns 0, or -1 when N % 16 or K % 64 is not zero, AMX is unavailable or memory runs out.
int gemm_int8_amx(const uint16_t *x, const int8_t *w_packed, const float *scale, uint16_t *y, int64_t m, int64_t n,
                  int64_t k, int threads) {
    return gemm_int8_tiles(x, w_packed, scale, y, m, n, k, threads, 0);
}

// y [M][N/2] = silu(gate) * up; -1 when N % 32 or K % 64 is not zero, AMX is unavailable or
// memory runs out.
int gemm_int8_amx_silu(const uint16_t *x, const int8_t *w_packed, const float *scale, uint16_t *y, int64_t m,
                       int64_t n, int64_t k, int threads) {
    return gemm_int8_tiles(x, w_packed, scale, y, m, n, k, threads, 1);
}

// gemm_blocks on AMX tiles; -1 when N % 16 (silu: % 32) or K % 32 is not zero (K % 256 for the k-quants' and
// Q6_K's super-blocks), AMX is unavailable or memory runs out. _silu: y [M][N/2] = silu(gate) * up.
int gemm_blocks_amx(const uint16_t *x, const uint8_t *w_packed, const Blocks *b, uint16_t *y, int64_t m, int64_t n,
                    int64_t k, int threads) {
    return b->group && k % 256 ? -1 : gemm_nibble_tiles(x, w_packed, block_scales(b), y, m, n, k, threads, 0);
}

int gemm_blocks_amx_silu(const uint16_t *x, const uint8_t *w_packed, const Blocks *b, uint16_t *y, int64_t m,
                         int64_t n, int64_t k, int threads) {
    return b->group && k % 256 ? -1 : gemm_nibble_tiles(x, w_packed, block_scales(b), y, m, n, k, threads, 1);
}
#endif
#else
int gemm_bf16_available(void) { return 0; }

int silu_and_mul_bf16(const uint16_t *gate_up, uint16_t *act, int64_t tokens, int64_t width, int threads) {
    (void)gate_up, (void)act, (void)tokens, (void)width, (void)threads;
    return -1;
}

int gelu_tanh_and_mul_bf16(const uint16_t *gate_up, uint16_t *act, int64_t tokens, int64_t width, int threads) {
    (void)gate_up, (void)act, (void)tokens, (void)width, (void)threads;
    return -1;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// AVX2 (AMD Zen 3, Intel before AVX-512): gemm_bf16 alone, its loops on the same packed W with 8-lane registers:
// a tile of MR_AVX2 rows x 16 columns keeps its sums in 8 of the 16 registers over K, W's two 32-byte halves widened
// per pair of K steps (a shift, a mask) for all its rows. PyTorch's bf16 F.linear on that CPU (no oneDNN packing
// there) ran SmolLM2's projections at 16 rows at 11-17 GFLOP/s, two threads.
#define MR_AVX2 4

static inline void store_bf16x8(uint16_t *dst, __m256 v) {  // round to nearest even
    __m256i bits = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    _mm_storeu_si128((__m128i *)dst, _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}

static inline __attribute__((always_inline)) void tile8(const float *x, int64_t k, const uint16_t *w, uint16_t *y,
                                                        int64_t n, int mr) {
    __m256 acc[MR_AVX2][2];
    const __m256i odd = _mm256_set1_epi32((int)0xFFFF0000);
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t p = 0; p < k / 2; p++) {  // K steps in order, as the AVX-512 loops take them
        __m256i lo = _mm256_loadu_si256((const __m256i *)(w + p * 32));
        __m256i hi = _mm256_loadu_si256((const __m256i *)(w + p * 32 + 16));
        __m256 b0 = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), b1 = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
        for (int i = 0; i < mr; i++) {
            __m256 a = _mm256_broadcast_ss(x + i * k + 2 * p);
            acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
        }
        b0 = _mm256_castsi256_ps(_mm256_and_si256(lo, odd)), b1 = _mm256_castsi256_ps(_mm256_and_si256(hi, odd));
        for (int i = 0; i < mr; i++) {
            __m256 a = _mm256_broadcast_ss(x + i * k + 2 * p + 1);
            acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
        }
    }
    for (int i = 0; i < mr; i++) {
        store_bf16x8(y + i * n, acc[i][0]);
        store_bf16x8(y + i * n + 8, acc[i][1]);
    }
}

// gemm_bf16's share of one thread: the 16-column blocks [begin, end), each block's 16 x K weights kept in L1/L2
// over its rows.
static void bf16_blocks(const float *xf, int64_t m, int64_t k, const uint16_t *w_packed, uint16_t *y, int64_t n,
                        int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b++) {
        const uint16_t *w = w_packed + b * 16 * k;
        int64_t i = 0;
        for (; i + MR_AVX2 <= m; i += MR_AVX2) tile8(xf + i * k, k, w, y + i * n + b * 16, n, MR_AVX2);
        switch (m - i) {
            case 3: tile8(xf + i * k, k, w, y + i * n + b * 16, n, 3); break;
            case 2: tile8(xf + i * k, k, w, y + i * n + b * 16, n, 2); break;
            case 1: tile8(xf + i * k, k, w, y + i * n + b * 16, n, 1); break;
        }
    }
}
#endif

int gemm_int8(const uint16_t *x, const int8_t *w_packed, const float *scale, uint16_t *y, int64_t m, int64_t n,
              int64_t k, int threads) {
    return -1;
}

int gemm_blocks(const uint16_t *x, const uint8_t *w_packed, const Blocks *b, uint16_t *y, int64_t m, int64_t n,
                int64_t k, int threads) {
    return -1;
}

int gemm_q8(const uint16_t *x, const int8_t *w_packed, const uint16_t *scale, uint16_t *y, int64_t m, int64_t n,
            int64_t k, int threads) {
    return -1;
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
int gemm_bf16_loops_available(void) { return 1; }

// Returns 0, or -1 when N is not a multiple of 16, K is odd or memory runs out. Each thread takes an equal share of
// W's 16-column blocks through its build's tiles (bf16_blocks: AVX-512 or AVX2).
int gemm_bf16(const uint16_t *x, const uint16_t *w_packed, uint16_t *y, int64_t m, int64_t n, int64_t k,
              int threads) {
    float *xf = n % 16 || k % 2 ? NULL : widened_rows(x, m * k);
    if (!xf) return -1;
#pragma omp parallel num_threads(threads)
    {
        int64_t begin, end;
        thread_blocks(n / 16, &begin, &end);
        bf16_blocks(xf, m, k, w_packed, y, n, begin, end);
    }
    free(xf);
    return 0;
}
#else
int gemm_bf16_loops_available(void) { return 0; }

// built without AVX2: gemm_bf16_loops_available() tells callers to keep PyTorch's kernels
int gemm_bf16(const uint16_t *x, const uint16_t *w_packed, uint16_t *y, int64_t m, int64_t n, int64_t k,
              int threads) {
    return -1;
}
#endif

#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__))
// built without AVX512-BF16: the policy gives "dots" only where the CPU has it, and native builds use it there
int gemm_bf16_dots(const uint16_t *x, const uint16_t *w_packed, uint16_t *y, int64_t m, int64_t n, int64_t k,
                   int threads) {
    return -1;
}

int gemm_int8_dots(const uint16_t *x, const int8_t *w_packed, const float *scale, uint16_t *y, int64_t m, int64_t n,
                   int64_t k, int threads) {
    return -1;
}

int gemm_q8_dots(const uint16_t *x, const int8_t *w_packed, const uint16_t *scale, uint16_t *y, int64_t m, int64_t n,
                 int64_t k, int threads) {
    return -1;
}

int gemm_blocks_dots(const uint16_t *x, const uint8_t *w_packed, const Blocks *b, uint16_t *y, int64_t m, int64_t n,
                     int64_t k, int threads) {
    return -1;
}
#endif

#ifndef HAVE_AMX
int gemm_amx_available(void) { return 0; }

// built without AMX (or without AVX-512): gemm_amx_available() tells callers to keep the other paths
int gemm_bf16_amx(const uint16_t *x, const uint16_t *w_packed, uint16_t *y, int64_t m, int64_t n, int64_t k,
                  int threads) {
    return -1;
}

int gemm_int8_amx(const uint16_t *x, const int8_t *w_packed, const float *scale, uint16_t *y, int64_t m, int64_t n,
                  int64_t k, int threads) {
    return -1;
}

int gemm_bf16_amx_silu(const uint16_t *x, const uint16_t *w_packed, uint16_t *y, int64_t m, int64_t n, int64_t k,
                       int threads) {
    return -1;
}

int gemm_int8_amx_silu(const uint16_t *x, const int8_t *w_packed, const float *scale, uint16_t *y, int64_t m,
                       int64_t n, int64_t k, int threads) {
    return -1;
}

int gemm_int8_amx_widened(const uint16_t *x, const int8_t *w_packed, const float *scale, uint16_t *y, int64_t m,
                          int64_t n, int64_t k, int threads) {
    return -1;
}

int gemm_int8_amx_widened_silu(const uint16_t *x, const int8_t *w_packed, const float *scale, uint16_t *y, int64_t m,
                               int64_t n, int64_t k, int threads) {
    return -1;
}

int gemm_blocks_amx(const uint16_t *x, const uint8_t *w_packed, const Blocks *b, uint16_t *y, int64_t m,
                    int64_t n, int64_t k, int threads) {
    return -1;
}

int gemm_blocks_amx_silu(const uint16_t *x, const uint8_t *w_packed, const Blocks *b, uint16_t *y, int64_t m,
                         int64_t n, int64_t k, int threads) {
    return -1;
}
#endif

// out[count, K] float32 = rows `ids` of a weight laid out as `gemm_q8` reads it (GGUF's Q8_0 repacked:
// codes [N/16][K/4][16] quads k0 k2 k1 k3, float16 scales [N/16][K/32][16]), each d * code, the torch twin's
// values: a tied embedding's lookup. One call where torch's gather and dequantization take some forty ops,
// each slow on caches the step's weights have just streamed through. 0, or -1 for an id outside [0, N).
int q8_rows(const int8_t *w_packed, const uint16_t *scale, const int64_t *ids, int64_t count, int64_t n, int64_t k,
            float *out) {
    for (int64_t i = 0; i < count; i++) {
        if (ids[i] < 0 || ids[i] >= n) return -1;
        int64_t tile = ids[i] / 16, column = ids[i] % 16;
        const int8_t *codes = w_packed + tile * 16 * k + column * 4;
        const uint16_t *scales = scale + tile * (k / 32) * 16 + column;
        for (int64_t q = 0; q < k / 4; q++) {
            const int8_t *quad = codes + q * 64;
            _Float16 half;
            memcpy(&half, scales + q / 8 * 16, sizeof half);
            float d = (float)half, *o = out + i * k + 4 * q;
            o[0] = d * quad[0], o[1] = d * quad[2], o[2] = d * quad[1], o[3] = d * quad[3];
        }
    }
    return 0;
}
