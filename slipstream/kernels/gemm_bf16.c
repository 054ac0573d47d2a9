// y[M, N] = x[M, K] . W[N, K]^T for bf16 x and W, float32 accumulation, bf16 y: the GEMM of
// every Linear at decode batch sizes, where oneDNN's bf16 kernel reaches ~60 GFLOP/s per core
// on CPUs without AMX.
//
// W is packed once (layers/linear.py) into pairs along K: [N/16][K/2][16][2], so that one
// 512-bit load holds two K steps of 16 output columns, the operand vdpbf16ps expects. A tile
// of MR rows x 64 columns keeps its 4*MR float32 sums in registers over the whole K loop,
// broadcasting each row's (x[k], x[k+1]) pair once per K step. Tiles of 64 columns are split
// across threads; each streams its columns of W once per MR rows (from cache after the first).
#include <stdint.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#define MR 6
#define NR 4  // 16-column blocks per tile

static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t k_pairs, const uint16_t *w,
                                                       uint16_t *y, int64_t n, int mr, int nr) {
    __m512 acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    const uint32_t *pairs = (const uint32_t *)x;
    for (int64_t k = 0; k < k_pairs; k++) {
        __m512bh b[NR];
        for (int j = 0; j < nr; j++) b[j] = (__m512bh)_mm512_loadu_si512(w + (j * k_pairs + k) * 32);
        for (int i = 0; i < mr; i++) {
            __m512bh a = (__m512bh)_mm512_set1_epi32((int)pairs[i * k_pairs + k]);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++)
            _mm256_storeu_si256((__m256i *)(y + i * n + 16 * j), (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
}

// Rows of one 64-column tile, MR at a time; the row count is a constant in each call of
// `tile` so that its sums stay in registers.
static void column_tile(const uint16_t *x, int64_t m, int64_t k_pairs, const uint16_t *w, uint16_t *y, int64_t n,
                        int nr) {
    int64_t i = 0;
    if (nr == NR) {
        for (; i + MR <= m; i += MR) tile(x + i * 2 * k_pairs, k_pairs, w, y + i * n, n, MR, NR);
        switch (m - i) {
            case 5: tile(x + i * 2 * k_pairs, k_pairs, w, y + i * n, n, 5, NR); return;
            case 4: tile(x + i * 2 * k_pairs, k_pairs, w, y + i * n, n, 4, NR); return;
            case 3: tile(x + i * 2 * k_pairs, k_pairs, w, y + i * n, n, 3, NR); return;
            case 2: tile(x + i * 2 * k_pairs, k_pairs, w, y + i * n, n, 2, NR); return;
            case 1: tile(x + i * 2 * k_pairs, k_pairs, w, y + i * n, n, 1, NR); return;
        }
        return;
    }
    for (; i < m; i += MR) tile(x + i * 2 * k_pairs, k_pairs, w, y + i * n, n, m - i < MR ? (int)(m - i) : MR, nr);
}

int gemm_bf16_available(void) { return 1; }

// Returns 0, or -1 when the shape is not supported (N % 16 or K % 2 not zero).
int gemm_bf16(const uint16_t *x, const uint16_t *w_packed, uint16_t *y, int64_t m, int64_t n, int64_t k,
              int threads) {
    if (n % 16 || k % 2) return -1;
    int64_t k_pairs = k / 2, tiles = (n + 16 * NR - 1) / (16 * NR);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t col = t * 16 * NR;
        int nr = n - col < 16 * NR ? (int)((n - col) / 16) : NR;
        column_tile(x, m, k_pairs, w_packed + col * k, y + col, n, nr);
    }
    return 0;
}
#else
int gemm_bf16_available(void) { return 0; }

int gemm_bf16(const uint16_t *x, const uint16_t *w_packed, uint16_t *y, int64_t m, int64_t n, int64_t k,
              int threads) {
    return -1;  // built without AVX512-BF16: callers keep oneDNN
}
#endif
