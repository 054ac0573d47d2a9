// y[M, N] = x[M, K] . W[N, K]^T for bf16 x, float32 products and sums, bf16 y: the GEMM of
// every Linear at decode batch sizes. W is bf16 (`gemm_bf16`), int8 codes with one float32
// scale per output column (`gemm_int8`: half the bytes to stream), or 4-bit codes in groups of
// 32 along K with a scale and a minimum per group and column (`gemm_int4`: a quarter).
//
// On CPUs without AMX, oneDNN's bf16 kernel and a vdpbf16ps kernel both top out near 75
// GFLOP/s per core, while float32 FMAs reach 110-120: so W stays bf16 in memory (half the
// bytes to stream) and is widened to float32 in registers, x is widened once per call.
// W is packed once (layers/linear.py) as [N/16][K][16]: each K step of 16 output columns is
// one 32-byte (bf16) or 16-byte (int8) load. A tile of MR rows x 64 columns keeps its 4*MR sums in registers over
// the whole K loop; tiles of 64 columns are split across threads, each streaming its columns
// of W once per MR rows (from cache after the first).
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#define MR 6
#define NR 4  // 16-column blocks per tile

static inline __m512 widen(const uint16_t *bf16) {  // 16 bf16 -> float32: the bits move to the top half
    __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bf16));
    return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}

static inline __m512 widen_int8(const int8_t *codes) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes)));
}

static inline void store_bf16(uint16_t *dst, __m512 v) {  // round to nearest even
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

// `w` is bf16, or int8 when `scale` is not NULL (then column j of y is multiplied by scale[j]).
static inline __attribute__((always_inline)) void tile(const float *x, int64_t k, const void *w, const float *scale,
                                                       uint16_t *y, int64_t n, int mr, int nr) {
    __m512 acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        __m512 b[NR];
        for (int j = 0; j < nr; j++)
            b[j] = scale ? widen_int8((const int8_t *)w + (j * k + kk) * 16) : widen((const uint16_t *)w + (j * k + kk) * 16);
        for (int i = 0; i < mr; i++) {
            __m512 a = _mm512_set1_ps(x[i * k + kk]);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
        }
    }
    for (int j = 0; j < nr; j++) {
        __m512 s = scale ? _mm512_loadu_ps(scale + 16 * j) : _mm512_set1_ps(1.f);
        for (int i = 0; i < mr; i++) store_bf16(y + i * n + 16 * j, _mm512_mul_ps(acc[i][j], s));
    }
}

// Rows of one 64-column tile, MR at a time; the row count is a constant in each call of
// `tile` so that its sums stay in registers. Inlined into each entry point, so that whether
// `scale` is NULL is known at compile time too.
static inline __attribute__((always_inline)) void column_tile(const float *x, int64_t m, int64_t k, const void *w,
                                                              const float *scale, uint16_t *y, int64_t n, int nr) {
    int64_t i = 0;
    if (nr != NR) {
        for (; i < m; i += MR) tile(x + i * k, k, w, scale, y + i * n, n, m - i < MR ? (int)(m - i) : MR, nr);
        return;
    }
    for (; i + MR <= m; i += MR) tile(x + i * k, k, w, scale, y + i * n, n, MR, NR);
    switch (m - i) {
        case 5: tile(x + i * k, k, w, scale, y + i * n, n, 5, NR); break;
        case 4: tile(x + i * k, k, w, scale, y + i * n, n, 4, NR); break;
        case 3: tile(x + i * k, k, w, scale, y + i * n, n, 3, NR); break;
        case 2: tile(x + i * k, k, w, scale, y + i * n, n, 2, NR); break;
        case 1: tile(x + i * k, k, w, scale, y + i * n, n, 1, NR); break;
    }
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

// Both return 0, or -1 when N is not a multiple of 16 or memory runs out.
int gemm_bf16(const uint16_t *x, const uint16_t *w_packed, uint16_t *y, int64_t m, int64_t n, int64_t k,
              int threads) {
    float *xf = n % 16 ? NULL : widened_rows(x, m * k);
    if (!xf) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t col = 0; col < n; col += 16 * NR)
        column_tile(xf, m, k, w_packed + col * k, NULL, y + col, n, n - col < 16 * NR ? (int)((n - col) / 16) : NR);
    free(xf);
    return 0;
}

int gemm_int8(const uint16_t *x, const int8_t *w_packed, const float *scale, uint16_t *y, int64_t m, int64_t n,
              int64_t k, int threads) {
    float *xf = n % 16 ? NULL : widened_rows(x, m * k);
    if (!xf) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t col = 0; col < n; col += 16 * NR)
        column_tile(xf, m, k, w_packed + col * k, scale + col, y + col, n,
                    n - col < 16 * NR ? (int)((n - col) / 16) : NR);
    free(xf);
    return 0;
}
// --- int4: w = q * scale + low per group of GROUP input channels ---------------------------
// Codes are packed [N/16][K/2][16] bytes, low nibble K step 2t, high nibble 2t+1; scale and low
// [N/16][K/GROUP][16] float32. Per group, sums of x*q run in `part` and join the total as
// part * scale + (sum of the group's x) * low, so the inner loop is FMAs on widened nibbles.
#define GROUP 32
#define MR4 4
#define NR4 2  // two 16-column blocks: two sets of sums must fit the 32 registers

static inline __attribute__((always_inline)) void tile_int4(const float *x, const float *xsum, int64_t k,
                                                            const uint8_t *w, const float *scale, const float *low,
                                                            uint16_t *y, int64_t n, int mr, int nr) {
    int64_t groups = k / GROUP;
    __m512 acc[MR4][NR4];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 part[MR4][NR4];
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++) part[i][j] = _mm512_setzero_ps();
        for (int t = 0; t < GROUP / 2; t++) {
            __m512 even[NR4], odd[NR4];
            for (int j = 0; j < nr; j++) {
                __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + (j * k / 2 + g * GROUP / 2 + t) * 16)));
                even[j] = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
                odd[j] = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
            }
            for (int i = 0; i < mr; i++) {
                __m512 a0 = _mm512_set1_ps(x[i * k + g * GROUP + 2 * t]), a1 = _mm512_set1_ps(x[i * k + g * GROUP + 2 * t + 1]);
                for (int j = 0; j < nr; j++) part[i][j] = _mm512_fmadd_ps(a1, odd[j], _mm512_fmadd_ps(a0, even[j], part[i][j]));
            }
        }
        for (int j = 0; j < nr; j++) {
            __m512 s = _mm512_loadu_ps(scale + (j * groups + g) * 16), m = _mm512_loadu_ps(low + (j * groups + g) * 16);
            for (int i = 0; i < mr; i++)
                acc[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[i * groups + g]), m, _mm512_fmadd_ps(part[i][j], s, acc[i][j]));
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) store_bf16(y + i * n + 16 * j, acc[i][j]);
}

static inline __attribute__((always_inline)) void column_tile_int4(const float *x, const float *xsum, int64_t m,
                                                                   int64_t k, const uint8_t *w, const float *scale,
                                                                   const float *low, uint16_t *y, int64_t n, int nr) {
    int64_t i = 0, groups = k / GROUP;
    if (nr == NR4)
        for (; i + MR4 <= m; i += MR4) tile_int4(x + i * k, xsum + i * groups, k, w, scale, low, y + i * n, n, MR4, NR4);
    for (; i < m; i++) tile_int4(x + i * k, xsum + i * groups, k, w, scale, low, y + i * n, n, 1, nr);
}

// Returns 0, or -1 when N % 16 or K % GROUP is not zero or memory runs out.
int gemm_int4(const uint16_t *x, const uint8_t *w_packed, const float *scale, const float *low, uint16_t *y,
              int64_t m, int64_t n, int64_t k, int threads) {
    float *xf = n % 16 || k % GROUP ? NULL : widened_rows(x, m * k);
    float *xsum = xf ? malloc(sizeof(float) * m * (k / GROUP)) : NULL;
    if (!xsum) {
        free(xf);
        return -1;
    }
    for (int64_t r = 0; r < m * (k / GROUP); r++) {
        float total = 0.f;
        for (int t = 0; t < GROUP; t++) total += xf[r * GROUP + t];
        xsum[r] = total;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t col = 0; col < n; col += 16 * NR4)
        column_tile_int4(xf, xsum, m, k, w_packed + col * k / 2, scale + col * (k / GROUP), low + col * (k / GROUP),
                         y + col, n, n - col < 16 * NR4 ? (int)((n - col) / 16) : NR4);
    free(xsum);
    free(xf);
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
