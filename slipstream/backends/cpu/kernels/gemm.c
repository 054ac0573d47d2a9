// y[M, N] = x[M, K] . W[N, K]^T for bf16 x and bf16 y: the GEMM of every Linear at decode
// batch sizes. W is bf16 (`gemm_bf16`), int8 codes with one float32 scale per output column
// (`gemm_int8`: half the bytes to stream), or 4-bit codes in groups of 32 along K with a scale
// and a minimum per group and column (`gemm_int4`: a quarter). Each format has its own inner
// loop, below; what they share: W packed once in blocks of 16 output columns, register tiles
// of a few rows by 16-64 columns whose sums stay in registers over K, each thread an equal share
// of the columns.
//
// On CPUs without AMX, oneDNN's bf16 kernel and a vdpbf16ps kernel both top out near 75
// GFLOP/s per core, while float32 FMAs reach 110-120: so W stays bf16 in memory (half the
// bytes to stream) and is widened to float32 in registers, x is widened once per call.
// bf16 W is packed once (layers/linear.py) as [N/16][K][16]: each K step of 16 output columns
// is one 32-byte load. A tile of MR rows x 64 columns keeps its 4*MR sums in registers over
// the whole K loop; each thread streams its share of W's columns once per MR rows (from cache
// after the first).
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#define MR 6
#define NR 4  // 16-column blocks per tile

static inline __m512 widen(const uint16_t *bf16) {  // 16 bf16 -> float32: the bits move to the top half
    __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bf16));
    return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
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
    for (int64_t kk = 0; kk < k; kk++) {
        __m512 b[NR];
        for (int j = 0; j < nr; j++) b[j] = widen(w + (j * k + kk) * 16);
        for (int i = 0; i < mr; i++) {
            __m512 a = _mm512_set1_ps(x[i * k + kk]);
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

int gemm_bf16_available(void) { return 1; }

// Returns 0, or -1 when N is not a multiple of 16 or memory runs out.
int gemm_bf16(const uint16_t *x, const uint16_t *w_packed, uint16_t *y, int64_t m, int64_t n, int64_t k,
              int threads) {
    float *xf = n % 16 ? NULL : widened_rows(x, m * k);
    if (!xf) return -1;
#pragma omp parallel num_threads(threads)
    {
        int64_t begin, end;
        thread_blocks(n / 16, &begin, &end);
        for (int64_t b = begin; b < end; b += NR)
            column_tile(xf, m, k, w_packed + b * 16 * k, y + b * 16, n, end - b < NR ? (int)(end - b) : NR);
    }
    free(xf);
    return 0;
}

// --- int8: w = q * scale per output column ------------------------------------------------
// Integer arithmetic: each row of x becomes 16-bit fixed point (x = xq * row_scale, |xq| <=
// 32767: an error below 1/65534 of the row's largest value, far under bf16's own rounding of
// x), and `vpdpwssd` multiplies pairs of 16-bit activations and sign-extended codes into
// int32 sums: two ops per 32 multiply-adds, where widening codes to float32 took six. Codes
// are packed [N/16][K/2][16 columns][2]: a pair of K steps per column, 32 bytes per pair step.
// The int32 sums move to float32 every INT8_FLUSH pair steps, before they could overflow
// (128 * 2 * 32767 * 127 < 2^31).
#define INT8_FLUSH 128

#if defined(__AVX512VNNI__)
static inline __m512i dot_int16(__m512i acc, __m512i a, __m512i b) { return _mm512_dpwssd_epi32(acc, a, b); }
#else
static inline __m512i dot_int16(__m512i acc, __m512i a, __m512i b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
#endif

static int16_t *fixed_point_rows(const uint16_t *x, int64_t m, int64_t k, float *row_scale) {
    int16_t *xq = malloc(sizeof(int16_t) * m * k);
    for (int64_t i = 0; xq && i < m; i++) {
        float largest = 0.f;
        for (int64_t c = 0; c < k; c++) largest = fmaxf(largest, fabsf(bf16_to_float(x[i * k + c])));
        row_scale[i] = largest > 0.f ? largest / 32767.f : 1.f;
        float inverse = 1.f / row_scale[i];
        for (int64_t c = 0; c < k; c++) xq[i * k + c] = (int16_t)lrintf(bf16_to_float(x[i * k + c]) * inverse);
    }
    return xq;
}

static inline __attribute__((always_inline)) void tile_int8(const int16_t *xq, const float *row_scale, int64_t k,
                                                            const int8_t *w, const float *scale, uint16_t *y,
                                                            int64_t n, int mr, int nr) {
    __m512 total[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) total[i][j] = _mm512_setzero_ps();
    for (int64_t first = 0; first < k / 2; first += INT8_FLUSH) {
        int64_t last = first + INT8_FLUSH < k / 2 ? first + INT8_FLUSH : k / 2;
        __m512i acc[MR][NR];
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_si512();
        for (int64_t p = first; p < last; p++) {
            __m512i b[NR];
            for (int j = 0; j < nr; j++)
                b[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + (j * k / 2 + p) * 32)));
            for (int i = 0; i < mr; i++) {
                int32_t pair;
                __builtin_memcpy(&pair, xq + i * k + 2 * p, sizeof pair);
                __m512i a = _mm512_set1_epi32(pair);
                for (int j = 0; j < nr; j++) acc[i][j] = dot_int16(acc[i][j], a, b[j]);
            }
        }
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++) total[i][j] = _mm512_add_ps(total[i][j], _mm512_cvtepi32_ps(acc[i][j]));
    }
    for (int j = 0; j < nr; j++) {
        __m512 s = _mm512_loadu_ps(scale + 16 * j);
        for (int i = 0; i < mr; i++)
            store_bf16(y + i * n + 16 * j, _mm512_mul_ps(total[i][j], _mm512_mul_ps(s, _mm512_set1_ps(row_scale[i]))));
    }
}

static inline __attribute__((always_inline)) void column_tile_int8(const int16_t *xq, const float *row_scale,
                                                                   int64_t m, int64_t k, const int8_t *w,
                                                                   const float *scale, uint16_t *y, int64_t n, int nr) {
    int64_t i = 0;
    if (nr != NR) {  // a thread's last, narrower tile: row by row, its width a constant
        for (; i < m; i++) switch (nr) {
            case 3: tile_int8(xq + i * k, row_scale + i, k, w, scale, y + i * n, n, 1, 3); break;
            case 2: tile_int8(xq + i * k, row_scale + i, k, w, scale, y + i * n, n, 1, 2); break;
            default: tile_int8(xq + i * k, row_scale + i, k, w, scale, y + i * n, n, 1, 1);
        }
        return;
    }
    for (; i + MR <= m; i += MR) tile_int8(xq + i * k, row_scale + i, k, w, scale, y + i * n, n, MR, NR);
    switch (m - i) {
        case 5: tile_int8(xq + i * k, row_scale + i, k, w, scale, y + i * n, n, 5, NR); break;
        case 4: tile_int8(xq + i * k, row_scale + i, k, w, scale, y + i * n, n, 4, NR); break;
        case 3: tile_int8(xq + i * k, row_scale + i, k, w, scale, y + i * n, n, 3, NR); break;
        case 2: tile_int8(xq + i * k, row_scale + i, k, w, scale, y + i * n, n, 2, NR); break;
        case 1: tile_int8(xq + i * k, row_scale + i, k, w, scale, y + i * n, n, 1, NR); break;
    }
}

// Returns 0, or -1 when N % 16 or K % 2 is not zero or memory runs out.
int gemm_int8(const uint16_t *x, const int8_t *w_packed, const float *scale, uint16_t *y, int64_t m, int64_t n,
              int64_t k, int threads) {
    float *row_scale = n % 16 || k % 2 ? NULL : malloc(sizeof(float) * m);
    int16_t *xq = row_scale ? fixed_point_rows(x, m, k, row_scale) : NULL;
    if (!xq) {
        free(row_scale);
        return -1;
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t begin, end;
        thread_blocks(n / 16, &begin, &end);
        for (int64_t b = begin; b < end; b += NR)
            column_tile_int8(xq, row_scale, m, k, w_packed + b * 16 * k, scale + b * 16, y + b * 16, n,
                             end - b < NR ? (int)(end - b) : NR);
    }
    free(xq);
    free(row_scale);
    return 0;
}

// --- int4: w = q * scale + low per group of GROUP input channels ---------------------------
// The int8 path's integer arithmetic (16-bit fixed-point rows of x, `vpdpwssd`), on nibbles.
// Codes are packed [N/16][K/8][16 columns][4 bytes]: one column's dword holds eight K steps, its
// nibbles in the order k0 k2 k4 k6 k1 k3 k5 k7, so that (dword >> 4t) & 0x000F000F is the pair
// of 16-bit codes for steps 2t and 2t+1, ready for `vpdpwssd`: three ops per 32 multiply-adds,
// where widening nibbles to float32 took seven. Per group, the int32 sums of xq * q join the
// total as sum * scale + (sum of the group's xq) * low. scale, low: [N/16][K/GROUP][16] float32.
#define GROUP 32
#define MR4 4
#define NR4 2  // 16-column blocks per tile of MR4 rows; fewer rows take twice as many (more independent sums)

static inline __attribute__((always_inline)) void tile_int4(const int16_t *xq, const float *row_scale,
                                                            const float *xsum, int64_t k, const uint8_t *w,
                                                            const float *scale, const float *low, uint16_t *y,
                                                            int64_t n, int mr, int nr) {
    int64_t groups = k / GROUP;
    __m512 acc[MR4][2 * NR4];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i part[MR4][2 * NR4];
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++) part[i][j] = _mm512_setzero_si512();
        for (int c = 0; c < GROUP / 8; c++) {
            __m512i codes[2 * NR4];
            for (int j = 0; j < nr; j++) codes[j] = _mm512_loadu_si512(w + (j * k / 8 + g * GROUP / 8 + c) * 64);
            for (int t = 0; t < 4; t++) {
                for (int i = 0; i < mr; i++) {
                    int32_t pair;
                    __builtin_memcpy(&pair, xq + i * k + g * GROUP + c * 8 + 2 * t, sizeof pair);
                    __m512i x_pair = _mm512_set1_epi32(pair);
                    for (int j = 0; j < nr; j++) {
                        __m512i q = _mm512_and_si512(_mm512_srli_epi32(codes[j], 4 * t), _mm512_set1_epi32(0x000F000F));
                        part[i][j] = dot_int16(part[i][j], x_pair, q);
                    }
                }
            }
        }
        for (int j = 0; j < nr; j++) {
            __m512 s = _mm512_loadu_ps(scale + (j * groups + g) * 16), m = _mm512_loadu_ps(low + (j * groups + g) * 16);
            for (int i = 0; i < mr; i++)
                acc[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[i * groups + g]), m,
                                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[i][j]), s, acc[i][j]));
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) store_bf16(y + i * n + 16 * j, _mm512_mul_ps(acc[i][j], _mm512_set1_ps(row_scale[i])));
}

static inline __attribute__((always_inline)) void column_tile_int4(const int16_t *xq, const float *row_scale,
                                                                   const float *xsum, int64_t m, int64_t k,
                                                                   const uint8_t *w, const float *scale,
                                                                   const float *low, uint16_t *y, int64_t n, int nr) {
    int64_t i = 0, groups = k / GROUP;
    if (nr == NR4)
        for (; i + MR4 <= m; i += MR4)
            tile_int4(xq + i * k, row_scale + i, xsum + i * groups, k, w, scale, low, y + i * n, n, MR4, NR4);
    for (; i < m; i++) {  // constant widths keep the sums in registers
        const int16_t *xr = xq + i * k;
        if (nr == 2 * NR4)
            tile_int4(xr, row_scale + i, xsum + i * groups, k, w, scale, low, y + i * n, n, 1, 2 * NR4);
        else if (nr == 3)
            tile_int4(xr, row_scale + i, xsum + i * groups, k, w, scale, low, y + i * n, n, 1, 3);
        else if (nr == NR4)
            tile_int4(xr, row_scale + i, xsum + i * groups, k, w, scale, low, y + i * n, n, 1, NR4);
        else
            tile_int4(xr, row_scale + i, xsum + i * groups, k, w, scale, low, y + i * n, n, 1, 1);
    }
}

// Returns 0, or -1 when N % 16 or K % GROUP is not zero or memory runs out.
int gemm_int4(const uint16_t *x, const uint8_t *w_packed, const float *scale, const float *low, uint16_t *y,
              int64_t m, int64_t n, int64_t k, int threads) {
    float *row_scale = n % 16 || k % GROUP ? NULL : malloc(sizeof(float) * m * (1 + k / GROUP));
    int16_t *xq = row_scale ? fixed_point_rows(x, m, k, row_scale) : NULL;
    if (!xq) {
        free(row_scale);
        return -1;
    }
    float *xsum = row_scale + m;
    for (int64_t r = 0; r < m * (k / GROUP); r++) {
        int32_t total = 0;
        for (int t = 0; t < GROUP; t++) total += xq[r * GROUP + t];
        xsum[r] = (float)total;
    }
    int width = m < MR4 ? 2 * NR4 : NR4;
#pragma omp parallel num_threads(threads)
    {
        int64_t begin, end;
        thread_blocks(n / 16, &begin, &end);
        for (int64_t b = begin; b < end; b += width)
            column_tile_int4(xq, row_scale, xsum, m, k, w_packed + b * 8 * k, scale + b * 16 * (k / GROUP),
                             low + b * 16 * (k / GROUP), y + b * 16, n, end - b < width ? (int)(end - b) : width);
    }
    free(xq);
    free(row_scale);
    return 0;
}
#else
int gemm_bf16_available(void) { return 0; }

// built without AVX-512: gemm_bf16_available() tells callers to keep PyTorch's kernels
int gemm_bf16(const uint16_t *x, const uint16_t *w_packed, uint16_t *y, int64_t m, int64_t n, int64_t k,
              int threads) {
    return -1;
}

int gemm_int8(const uint16_t *x, const int8_t *w_packed, const float *scale, uint16_t *y, int64_t m, int64_t n,
              int64_t k, int threads) {
    return -1;
}

int gemm_int4(const uint16_t *x, const uint8_t *w_packed, const float *scale, const float *low, uint16_t *y,
              int64_t m, int64_t n, int64_t k, int threads) {
    return -1;
}
#endif
