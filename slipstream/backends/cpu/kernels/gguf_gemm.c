// y[M, N] (row stride ldy) = x[M, K] . W[N, K]^T for float32 x and y, W in one of GGUF's block
// formats exactly as the file stores it: each row of W a run of blocks along K (the `format`
// argument is the file's ggml type id: Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13,
// Q6_K 14). Decode is bound by the bytes of W it streams, so W is never widened in memory.
//
// Every group of 32 weights, whatever its format, is seen as integer codes c with a float scale
// s and offset b per 16 of them (w = s * c + b): Q4_0 s = d, b = -8d; Q4_1 s = d, b = m; Q5_0
// and Q5_1 alike with 5-bit codes; Q8_0 s = d, b = 0 with signed codes; Q4_K / Q5_K s = d * sc,
// b = -dmin * mn per group; Q6_K s = d * sc, b = -32 d sc per 16. Then
//   sum w . x = s_lo * (c . x)_lo + s_hi * (c . x)_hi + b_lo * (sum x)_lo + b_hi * (sum x)_hi,
// the codes widened to float32 in registers and multiplied with float32 FMAs, the sums of x per
// 16 taken once per call: the result is dequantize-then-multiply to float32 rounding.
//
// Why not llama.cpp's integer dot products (x quantized to int8 per 32-block, VNNI vpdpbusd):
// we built that first. On one core of the development machine (AVX-512 VNNI) it streamed Q4_1
// 1.3-1.6x faster at 1 row (SmolLM2's gate_up: 0.12 vs 0.20 ms) and was even at Q8_0 (the LM
// head: 3.3 vs 2.8 ms) and for k-quants at 4-16 rows, but its 0.5% error per GEMM moved
// SmolLM2's prompt logprobs by 0.06-0.1 on average (0.04 for bf16 weights) and its greedy
// tokens off transformers' within the first few, where this one keeps them.
//
// Each thread takes an equal share of W's rows; a tile of 4 rows of W x 1 of x (decode) or 2 x 4
// (batches) keeps its sums in registers over K. AVX-512, AVX2 and plain C compute the same sums.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

typedef struct {        // sums of one 32-block of a row of x: whole, and its two halves
    float sum, lo, hi;
} XSums;

typedef struct {        // MR rows of x: K values and K/32 XSums each
    const float *x;
    const XSums *s;
    int64_t k;
} Acts;

typedef struct {        // one group of 32 weights: w = s * c + b per half of 16
    float s_lo, s_hi, b_lo, b_hi;
} Scales;

static inline float half_to_float(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else {  // zero or subnormal: man * 2^-24, exact in float32
        float f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static void k_scale_min(const uint8_t *s, int g, int *sc, int *mn) {  // Q4_K / Q5_K 6-bit scales
    if (g < 4) {
        *sc = s[g] & 63;
        *mn = s[g + 4] & 63;
    } else {
        *sc = (s[g + 4] & 0x0F) | ((s[g - 4] >> 6) << 4);
        *mn = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
    }
}

static inline int block_size(int format) { return format >= Q4_K ? 256 : 32; }

static inline int type_size(int format) {
    switch (format) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

// the scales of group g (of 32 weights) of block blk
static inline Scales group_scales(int format, const uint8_t *blk, int g) {
    float d = half_to_float(blk);
    switch (format) {
    case Q4_0: return (Scales){d, d, -8 * d, -8 * d};
    case Q5_0: return (Scales){d, d, -16 * d, -16 * d};
    case Q4_1: case Q5_1: {
        float m = half_to_float(blk + 2);
        return (Scales){d, d, m, m};
    }
    case Q8_0: return (Scales){d, d, 0, 0};
    case Q4_K: case Q5_K: {
        int sc, mn;
        k_scale_min(blk + 4, g, &sc, &mn);
        float s = d * sc, b = -half_to_float(blk + 2) * mn;
        return (Scales){s, s, b, b};
    }
    default: {  // Q6_K: int8 scales per 16, d at the end
        const int8_t *sc = (const int8_t *)(blk + 192);
        float d6 = half_to_float(blk + 208), lo = d6 * sc[2 * g], hi = d6 * sc[2 * g + 1];
        return (Scales){lo, hi, -32 * lo, -32 * hi};
    }
    }
}

#if defined(__AVX2__)
static inline __m256i nibbles32(const uint8_t *qs) {  // 16 bytes -> low nibbles, then high nibbles
    __m128i v = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

static inline __m256i fifth_bits(const uint8_t *qh) {  // 32 bits -> 16 where set, byte per bit
    uint32_t bits;
    memcpy(&bits, qh, 4);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                    _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    __m256i mask = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, mask), mask), _mm256_set1_epi8(16));
}

static inline __m256i bits_at(__m256i v, int shift, int mask) {  // (v >> shift) & mask per byte
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8((char)mask));
}

static inline __m256i group_vector(int format, const uint8_t *blk, int g) {
    switch (format) {
    case Q4_0: return nibbles32(blk + 2);
    case Q4_1: return nibbles32(blk + 4);
    case Q5_0: return _mm256_or_si256(nibbles32(blk + 6), fifth_bits(blk + 2));
    case Q5_1: return _mm256_or_si256(nibbles32(blk + 8), fifth_bits(blk + 4));
    case Q8_0: return _mm256_loadu_si256((const __m256i *)(blk + 2));
    case Q4_K: return bits_at(_mm256_loadu_si256((const __m256i *)(blk + 16 + (g / 2) * 32)), 4 * (g % 2), 15);
    case Q5_K: {
        __m256i low = bits_at(_mm256_loadu_si256((const __m256i *)(blk + 48 + (g / 2) * 32)), 4 * (g % 2), 15);
        __m256i high = bits_at(_mm256_loadu_si256((const __m256i *)(blk + 16)), g, 1);
        return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
    }
    default: {
        int h = g / 4, j = g % 4;
        __m256i low = bits_at(_mm256_loadu_si256((const __m256i *)(blk + h * 64 + (j % 2) * 32)), 4 * (j / 2), 15);
        __m256i high = bits_at(_mm256_loadu_si256((const __m256i *)(blk + 128 + h * 32)), 2 * j, 3);
        return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
    }
    }
}

#if defined(__AVX512F__)
// a group's codes as float32, its first and second 16
static inline void group_floats(int format, const uint8_t *blk, int g, __m512 *lo, __m512 *hi) {
    if (format == Q4_0 || format == Q4_1) {  // straight from the 16 bytes: low nibbles, then high
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + (format == Q4_0 ? 2 : 4))));
        *lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
        *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
        return;
    }
    __m256i c = group_vector(format, blk, g);
    __m128i c0 = _mm256_castsi256_si128(c), c1 = _mm256_extracti128_si256(c, 1);
    *lo = _mm512_cvtepi32_ps(format == Q8_0 ? _mm512_cvtepi8_epi32(c0) : _mm512_cvtepu8_epi32(c0));
    *hi = _mm512_cvtepi32_ps(format == Q8_0 ? _mm512_cvtepi8_epi32(c1) : _mm512_cvtepu8_epi32(c1));
}

static inline void dequantize_group(int format, const uint8_t *blk, int g, float *out) {
    __m512 lo, hi;
    group_floats(format, blk, g, &lo, &hi);
    Scales s = group_scales(format, blk, g);
    _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_set1_ps(s.s_lo), lo, _mm512_set1_ps(s.b_lo)));
    _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(_mm512_set1_ps(s.s_hi), hi, _mm512_set1_ps(s.b_hi)));
}

// out[r * ldo + c] = row c of W (of NW rows from w) . row r of x (of MR rows), for constant NW and MR:
// NW * MR independent sums hide the latency of each one's chain of FMAs
static inline __attribute__((always_inline)) void tile(int format, int nw, int mr, const uint8_t *w,
                                                       int64_t row_bytes, const Acts *a, float *out, int64_t ldo) {
    __m512 acc[4][4];
    float off[4][4];
    for (int c = 0; c < nw; c++)
        for (int r = 0; r < mr; r++) acc[c][r] = _mm512_setzero_ps(), off[c][r] = 0;
    int groups = block_size(format) / 32, size = type_size(format);
    for (int64_t b = 0; b < a->k / block_size(format); b++)
        for (int g = 0; g < groups; g++) {
            int64_t j = b * groups + g;  // the 32-block of x
            for (int c = 0; c < nw; c++) {
                const uint8_t *blk = w + c * row_bytes + b * size;
                __m512 lo, hi;
                group_floats(format, blk, g, &lo, &hi);
                Scales s = group_scales(format, blk, g);
                for (int r = 0; r < mr; r++) {
                    const float *x = a->x + r * a->k + j * 32;
                    const XSums *xs = a->s + r * (a->k / 32) + j;
                    __m512 plo = _mm512_mul_ps(lo, _mm512_loadu_ps(x)), phi = _mm512_mul_ps(hi, _mm512_loadu_ps(x + 16));
                    if (format == Q6_K) {  // two scales per group
                        acc[c][r] = _mm512_fmadd_ps(_mm512_set1_ps(s.s_lo), plo, acc[c][r]);
                        acc[c][r] = _mm512_fmadd_ps(_mm512_set1_ps(s.s_hi), phi, acc[c][r]);
                        off[c][r] += s.b_lo * xs->lo + s.b_hi * xs->hi;
                    } else {
                        acc[c][r] = _mm512_fmadd_ps(_mm512_set1_ps(s.s_lo), _mm512_add_ps(plo, phi), acc[c][r]);
                        off[c][r] += s.b_lo * xs->sum;
                    }
                }
            }
        }
    for (int c = 0; c < nw; c++)
        for (int r = 0; r < mr; r++) out[r * ldo + c] = _mm512_reduce_add_ps(acc[c][r]) + off[c][r];
}
#else  // AVX2: the same sums, 8 lanes at a time
static inline __m256 widen8(__m256i c, int part, int is_signed) {  // codes 8 * part .. 8 * part + 7
    __m128i half = part < 2 ? _mm256_castsi256_si128(c) : _mm256_extracti128_si256(c, 1);
    __m128i eight = part % 2 ? _mm_unpackhi_epi64(half, half) : half;
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight));
}

static inline void dequantize_group(int format, const uint8_t *blk, int g, float *out) {
    __m256i codes = group_vector(format, blk, g);
    Scales s = group_scales(format, blk, g);
    for (int part = 0; part < 4; part++) {
        float sc = part < 2 ? s.s_lo : s.s_hi, off = part < 2 ? s.b_lo : s.b_hi;
        _mm256_storeu_ps(out + 8 * part,
                         _mm256_fmadd_ps(_mm256_set1_ps(sc), widen8(codes, part, format == Q8_0), _mm256_set1_ps(off)));
    }
}

static inline float hsum(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

static inline __attribute__((always_inline)) void tile(int format, int nw, int mr, const uint8_t *w,
                                                       int64_t row_bytes, const Acts *a, float *out, int64_t ldo) {
    __m256 acc[4][4];
    float off[4][4];
    for (int c = 0; c < nw; c++)
        for (int r = 0; r < mr; r++) acc[c][r] = _mm256_setzero_ps(), off[c][r] = 0;
    int groups = block_size(format) / 32, size = type_size(format);
    for (int64_t b = 0; b < a->k / block_size(format); b++)
        for (int g = 0; g < groups; g++) {
            int64_t j = b * groups + g;
            for (int c = 0; c < nw; c++) {
                const uint8_t *blk = w + c * row_bytes + b * size;
                __m256i codes = group_vector(format, blk, g);
                __m256 q[4];
                for (int part = 0; part < 4; part++) q[part] = widen8(codes, part, format == Q8_0);
                Scales s = group_scales(format, blk, g);
                for (int r = 0; r < mr; r++) {
                    const float *x = a->x + r * a->k + j * 32;
                    const XSums *xs = a->s + r * (a->k / 32) + j;
                    __m256 tlo = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(x + 8), _mm256_mul_ps(q[0], _mm256_loadu_ps(x)));
                    __m256 thi = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x + 24), _mm256_mul_ps(q[2], _mm256_loadu_ps(x + 16)));
                    acc[c][r] = _mm256_fmadd_ps(_mm256_set1_ps(s.s_lo), tlo, acc[c][r]);
                    acc[c][r] = _mm256_fmadd_ps(_mm256_set1_ps(s.s_hi), thi, acc[c][r]);
                    off[c][r] += s.b_lo * xs->lo + s.b_hi * xs->hi;
                }
            }
        }
    for (int c = 0; c < nw; c++)
        for (int r = 0; r < mr; r++) out[r * ldo + c] = hsum(acc[c][r]) + off[c][r];
}
#endif
#else  // plain C: the same sums, one code at a time
// group g's 32 codes in order, for the plain-C path (Q8_0's are signed)
static void group_codes(int format, const uint8_t *blk, int g, int32_t c[32]) {
    for (int l = 0; l < 32; l++) {
        switch (format) {
        case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
            const uint8_t *qs = blk + (format == Q4_0 ? 2 : format == Q5_1 ? 8 : format == Q5_0 ? 6 : 4);
            c[l] = l < 16 ? qs[l] & 15 : qs[l - 16] >> 4;
            if (format == Q5_0 || format == Q5_1) {
                const uint8_t *qh = blk + (format == Q5_0 ? 2 : 4);
                c[l] |= ((qh[l / 8] >> (l % 8)) & 1) << 4;
            }
            break;
        }
        case Q8_0: c[l] = ((const int8_t *)(blk + 2))[l]; break;
        case Q4_K: c[l] = (blk[16 + (g / 2) * 32 + l] >> (4 * (g % 2))) & 15; break;
        case Q5_K: c[l] = ((blk[48 + (g / 2) * 32 + l] >> (4 * (g % 2))) & 15) | (((blk[16 + l] >> g) & 1) << 4); break;
        default: {  // Q6_K: halves of 128, four groups each
            int h = g / 4, j = g % 4;
            int low = (blk[h * 64 + (j % 2) * 32 + l] >> (4 * (j / 2))) & 15;
            c[l] = low | (((blk[128 + h * 32 + l] >> (2 * j)) & 3) << 4);
        }
        }
    }
}

static inline __attribute__((always_inline)) void tile(int format, int nw, int mr, const uint8_t *w,
                                                       int64_t row_bytes, const Acts *a, float *out, int64_t ldo) {
    int groups = block_size(format) / 32, size = type_size(format);
    int32_t codes[32];
    for (int c = 0; c < nw; c++)
        for (int r = 0; r < mr; r++) out[r * ldo + c] = 0;
    for (int64_t b = 0; b < a->k / block_size(format); b++)
        for (int g = 0; g < groups; g++)
            for (int c = 0; c < nw; c++) {
                const uint8_t *blk = w + c * row_bytes + b * size;
                group_codes(format, blk, g, codes);
                Scales s = group_scales(format, blk, g);
                int64_t j = b * groups + g;
                for (int r = 0; r < mr; r++) {
                    const float *x = a->x + r * a->k + j * 32;
                    const XSums *xs = a->s + r * (a->k / 32) + j;
                    float lo = 0, hi = 0;
                    for (int l = 0; l < 16; l++) lo += codes[l] * x[l], hi += codes[l + 16] * x[l + 16];
                    out[r * ldo + c] += s.s_lo * lo + s.s_hi * hi + s.b_lo * xs->lo + s.b_hi * xs->hi;
                }
            }
}

static inline void dequantize_group(int format, const uint8_t *blk, int g, float *out) {
    int32_t codes[32];
    group_codes(format, blk, g, codes);
    Scales s = group_scales(format, blk, g);
    for (int l = 0; l < 32; l++) out[l] = l < 16 ? s.s_lo * codes[l] + s.b_lo : s.s_hi * codes[l] + s.b_hi;
}
#endif

// the tile shapes a call uses: 4 rows of W by 1 of x (decode), 2 by 4 (batches), and their edges
#define TILES(F)                                                                            \
    case F:                                                                                 \
        if (mr == 4) nw == 2 ? tile(F, 2, 4, w, rb, a, out, ldo) : tile(F, 1, 4, w, rb, a, out, ldo); \
        else nw == 4 ? tile(F, 4, 1, w, rb, a, out, ldo) : tile(F, 1, 1, w, rb, a, out, ldo);         \
        break;

// one copy of `tile` per format and shape, with the unpacking and scales resolved at compile time
static void tile_of(int format, int nw, int mr, const uint8_t *w, int64_t rb, const Acts *a, float *out, int64_t ldo) {
    switch (format) {
    TILES(Q4_0) TILES(Q4_1) TILES(Q5_0) TILES(Q5_1) TILES(Q8_0) TILES(Q4_K) TILES(Q5_K) TILES(Q6_K)
    }
}

static void block_sums(const float *x, int64_t k, XSums *s) {
    for (int64_t j = 0; j < k / 32; j++) {
        float lo = 0, hi = 0;
        for (int l = 0; l < 16; l++) lo += x[j * 32 + l], hi += x[j * 32 + 16 + l];
        s[j] = (XSums){lo + hi, lo, hi};
    }
}

// W's rows [c0, c1) times every row of x
static void columns(int format, const uint8_t *w, int64_t rb, const float *x, const XSums *xs, float *y,
                    int64_t m, int64_t k, int64_t ldy, int64_t c0, int64_t c1) {
    for (int64_t i = 0; i < m;) {
        int mr = m - i >= 4 ? 4 : 1;
        Acts a = {x + i * k, xs + i * (k / 32), k};
        int full = mr == 4 ? 2 : 4;
        for (int64_t c = c0; c < c1;) {
            int nw = c1 - c >= full ? full : 1;
            tile_of(format, nw, mr, w + c * rb, rb, &a, y + i * ldy + c, ldy);
            c += nw;
        }
        i += mr;
    }
}

// 0, or -1 for a format without a kernel, K not whole blocks, or no memory for x's sums
int gguf_gemm(int32_t format, const float *x, const uint8_t *w, float *y, int64_t m, int64_t n, int64_t k,
              int64_t ldy, int32_t threads) {
    if (type_size(format) == 0 || k % block_size(format)) return -1;
    XSums *xs = malloc((size_t)(m * (k / 32)) * sizeof(XSums));
    if (xs == NULL) return -1;
    for (int64_t i = 0; i < m; i++) block_sums(x + i * k, k, xs + i * (k / 32));
    int64_t rb = k / block_size(format) * type_size(format);
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        // equal shares of W's rows, on multiples of 4 so that tiles stay whole
        int64_t share = (n + 4 * nt - 1) / (4 * nt) * 4, c0 = t * share, c1 = c0 + share < n ? c0 + share : n;
        if (c0 < c1) columns(format, w, rb, x, xs, y, m, k, ldy, c0, c1);
    }
    free(xs);
    return 0;
}

// one copy per format, as for the GEMM
static void dequantize_row(int format, const uint8_t *w, int64_t k, float *out) {
    int groups = block_size(format) / 32, size = type_size(format);
    for (int64_t b = 0; b < k / block_size(format); b++)
        for (int g = 0; g < groups; g++) dequantize_group(format, w + b * size, g, out + (b * groups + g) * 32);
}

#define DEQUANTIZE(F) \
    case F:           \
        dequantize_row(F, w, k, out); \
        break;

static void dequantize_row_of(int format, const uint8_t *w, int64_t k, float *out) {
    switch (format) { DEQUANTIZE(Q4_0) DEQUANTIZE(Q4_1) DEQUANTIZE(Q5_0) DEQUANTIZE(Q5_1) DEQUANTIZE(Q8_0)
                      DEQUANTIZE(Q4_K) DEQUANTIZE(Q5_K) DEQUANTIZE(Q6_K) }
}

// out[N, K] float32 = W's blocks dequantized, w = s * c + b (tests hold the values to the torch twin's;
// zeros come out +0); 0, or -1 for a format without a kernel or K not whole blocks. Large batches
// multiply such tiles on a dense GEMM.
int gguf_dequantize(int32_t format, const uint8_t *w, float *out, int64_t n, int64_t k, int32_t threads) {
    if (type_size(format) == 0 || k % block_size(format)) return -1;
    int64_t rb = k / block_size(format) * type_size(format);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t row = 0; row < n; row++) dequantize_row_of(format, w + row * rb, k, out + row * k);
    return 0;
}
