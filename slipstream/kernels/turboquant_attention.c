// Decode attention over a paged TurboQuant cache, reading the packed codes: one query token per sequence.
//
// Cache layout (kvcache/turboquant_cache.py): [num_blocks, block_size, kv_heads, nbytes] uint8, one row per
// (token, KV head). A row is a few pieces (kvcache/turboquant.py, TurboQuantizer.row_layout): `count` codes of
// `bits` bits, LSB first, each standing for value[code] * norm (* gamma * factor for QJL signs), with norm and
// gamma fp16 in the row. Queries arrive rotated into that code space (and scaled) by the caller, so a key's
// score is a sum over pieces of scale * <q piece, value[codes]>, and the output is a weighted sum of code-space
// value rows that the caller rotates back once per head.
//
// As in paged_attention.c, each (sequence, KV head) pair is one task: its G query heads walk the sequence's
// own blocks once with an online softmax in float32. Each row is decoded once per task into a small float
// buffer (8 codes per step: a variable shift and an in-register table permute with AVX2), shared by the G
// query heads; nothing is gathered, padded or dequantized to the original space.
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define MAX_GROUP 16
#define MAX_WIDTH 512  // code-space width: head_dim, or 2 * head_dim for QJL keys
#define MAX_BLOCK 64
#define MAX_PIECES 4

typedef struct {
    int offset, bits, count, norm_at, gamma_at;  // byte offsets in the row; gamma_at < 0: no gamma
    float factor, values[16];
} Piece;

typedef struct {
    int count, nbytes, width;
    Piece pieces[MAX_PIECES];
} Layout;

static float half_to_float(const uint8_t *p) {
    uint32_t h = p[0] | (uint32_t)p[1] << 8, sign = (h & 0x8000u) << 16, exp = h >> 10 & 0x1f, mant = h & 0x3ff;
    float f;
    if (exp == 0) {  // zero or subnormal: mant * 2^-24
        f = (float)mant * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    uint32_t u = sign | (exp == 31 ? 0x7f800000u : (exp + 112) << 23) | mant << 13;
    memcpy(&f, &u, sizeof f);
    return f;
}

// 8 codes of `bits` bits, LSB first, from the `bits` bytes at src -> their values.
// The 4-byte load reads up to 3 bytes past a piece's codes; every piece is followed in its row by at least
// as many bytes (fp16 norm, gamma, or the next piece), so it never leaves the row.
#ifdef __AVX2__
typedef __m256 vec8;
static inline vec8 decode8(const uint8_t *src, int bits, __m256 low, __m256 high) {
    uint32_t word;
    memcpy(&word, src, 4);
    __m256i shifts = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bits));
    __m256i code = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts),
                                    _mm256_set1_epi32((1 << bits) - 1));
    __m256 v = _mm256_permutevar8x32_ps(low, code);  // uses the low 3 bits of each code
    if (bits == 4)  // bit 3 moved to the sign bit picks the upper half of the table
        v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(high, code), _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
    return v;
}
#define TABLE_LOW(values) _mm256_loadu_ps(values)
#define TABLE_HIGH(values) _mm256_loadu_ps((values) + 8)
#define ZERO8() _mm256_setzero_ps()
#define FMA8(acc, a, b) _mm256_fmadd_ps(a, b, acc)
#define LOAD8(p) _mm256_loadu_ps(p)
#define STORE8(p, v) _mm256_storeu_ps(p, v)
#define SPLAT8(x) _mm256_set1_ps(x)
static inline float sum8(vec8 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
typedef struct { float x[8]; } vec8;
static inline vec8 decode8(const uint8_t *src, int bits, const float *values, const float *unused) {
    (void)unused;
    uint32_t word, mask = (1u << bits) - 1;
    memcpy(&word, src, 4);
    vec8 v;
    for (int j = 0; j < 8; j++) v.x[j] = values[word >> (bits * j) & mask];
    return v;
}
#define TABLE_LOW(values) (values)
#define TABLE_HIGH(values) (values)
static inline vec8 ZERO8(void) { vec8 v = {{0}}; return v; }
static inline vec8 FMA8(vec8 acc, vec8 a, vec8 b) { for (int j = 0; j < 8; j++) acc.x[j] += a.x[j] * b.x[j]; return acc; }
static inline vec8 LOAD8(const float *p) { vec8 v; memcpy(v.x, p, sizeof v.x); return v; }
#define STORE8(p, v) memcpy(p, (v).x, sizeof (v).x)
static inline vec8 SPLAT8(float x) { vec8 v; for (int j = 0; j < 8; j++) v.x[j] = x; return v; }
static inline float sum8(vec8 v) { float s = 0.f; for (int j = 0; j < 8; j++) s += v.x[j]; return s; }
#endif

static inline float piece_scale(const Piece *piece, const uint8_t *row) {
    float s = half_to_float(row + piece->norm_at) * piece->factor;
    return piece->gamma_at < 0 ? s : s * half_to_float(row + piece->gamma_at);
}

// Scores of one key row for `group` query heads (q: [group][width]). Inlined with a constant `group` for the
// common sizes, so that the per-head accumulators stay in registers.
static inline __attribute__((always_inline)) void score_row(const Layout *kl, const uint8_t *row, const float *q,
                                                            int group, float *scores) {
    vec8 acc[MAX_GROUP];
    for (int g = 0; g < group; g++) scores[g] = 0.f;
    for (int p = 0, at = 0; p < kl->count; at += kl->pieces[p].count, p++) {
        const Piece *piece = &kl->pieces[p];
        const uint8_t *src = row + piece->offset;
        for (int g = 0; g < group; g++) acc[g] = ZERO8();
        for (int i = 0; i < piece->count; i += 8, src += piece->bits) {
            vec8 v = decode8(src, piece->bits, TABLE_LOW(piece->values), TABLE_HIGH(piece->values));
            for (int g = 0; g < group; g++) acc[g] = FMA8(acc[g], LOAD8(q + g * kl->width + at + i), v);
        }
        float scale = piece_scale(piece, row);
        for (int g = 0; g < group; g++) scores[g] += scale * sum8(acc[g]);
    }
}

// acc[g] += weights[g] * value row, for `group` heads (acc: [group][width]).
static inline __attribute__((always_inline)) void accumulate_row(const Layout *vl, const uint8_t *row,
                                                                 const float *weights, int group, float *acc) {
    for (int p = 0, at = 0; p < vl->count; at += vl->pieces[p].count, p++) {
        const Piece *piece = &vl->pieces[p];
        const uint8_t *src = row + piece->offset;
        float scale = piece_scale(piece, row);
        vec8 w[MAX_GROUP];
        for (int g = 0; g < group; g++) w[g] = SPLAT8(weights[g] * scale);
        for (int i = 0; i < piece->count; i += 8, src += piece->bits) {
            vec8 v = decode8(src, piece->bits, TABLE_LOW(piece->values), TABLE_HIGH(piece->values));
            for (int g = 0; g < group; g++) {
                float *a = acc + g * vl->width + at + i;
                STORE8(a, FMA8(LOAD8(a), w[g], v));
            }
        }
    }
}

// e^x for x <= 0 (Cephes expf: about 1 ulp), written so that loops over it vectorize; e^-inf is not 0 here,
// callers zero skipped tokens themselves.
static inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

// Code tokens of one query that are read in 16 bits instead (attention/turboquant.py, recent window):
// near the query (among the newest `recent` or the first `sinks`) and staged, or the query's own token.
static inline int read_dense(int64_t t, int64_t query, const uint8_t *staged, int64_t recent, int64_t sinks) {
    return staged && (t > query - recent || t < sinks) && (staged[t] || t == query);
}

static inline __attribute__((always_inline)) void attend_one(
        const float *q, const uint8_t *k_head, const uint8_t *v_head, const Layout *kl, const Layout *vl,
        const int64_t *table, const uint8_t *staged, int64_t start, int64_t end, int64_t recent, int64_t sinks,
        float *out, float *lse, int group, int block_size, int64_t row_stride_k, int64_t row_stride_v) {
    float acc[MAX_GROUP * MAX_WIDTH / 2], m[MAX_GROUP], l[MAX_GROUP];
    float s[MAX_GROUP][MAX_BLOCK], p[MAX_BLOCK][MAX_GROUP];
    uint8_t skip[MAX_BLOCK];
    memset(acc, 0, sizeof(float) * group * vl->width);
    for (int g = 0; g < group; g++) {
        m[g] = -INFINITY;
        l[g] = 0.f;
    }
    for (int64_t first = start - start % block_size; first < end; first += block_size) {
        int64_t slot0 = table[first / block_size] * block_size;
        int lo = first < start ? (int)(start - first) : 0;
        int hi = end - first < block_size ? (int)(end - first) : block_size;
        int read = 0;
        for (int t = lo; t < hi; t++) {
            float scores[MAX_GROUP];
            skip[t] = read_dense(first + t, end - 1, staged, recent, sinks);
            if (skip[t]) continue;
            score_row(kl, k_head + (slot0 + t) * row_stride_k, q, group, scores);
            for (int g = 0; g < group; g++) s[g][t] = scores[g];
            read++;
        }
        if (!read) continue;
        for (int g = 0; g < group; g++) {
            float block_max = m[g];
            for (int t = lo; t < hi; t++)
                if (!skip[t]) block_max = s[g][t] > block_max ? s[g][t] : block_max;
            float correction = exp_nonpositive(m[g] - block_max) * (m[g] > -INFINITY);
            m[g] = block_max;
            l[g] *= correction;
            for (int d = 0; d < vl->width; d++) acc[g * vl->width + d] *= correction;
            float sum = 0.f;
            for (int t = lo; t < hi; t++) {
                float e = exp_nonpositive(s[g][t] - block_max);
                p[t][g] = skip[t] ? 0.f : e;
                sum += p[t][g];
            }
            l[g] += sum;
        }
        for (int t = lo; t < hi; t++)
            if (!skip[t]) accumulate_row(vl, v_head + (slot0 + t) * row_stride_v, p[t], group, acc);
    }
    for (int g = 0; g < group; g++) {
        float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int d = 0; d < vl->width; d++) out[(int64_t)g * vl->width + d] = acc[g * vl->width + d] * inv;
        if (lse) lse[g] = l[g] > 0.f ? m[g] + logf(l[g]) : -INFINITY;
    }
}

// One specialised copy per common group size (GQA 3 of SmolLM2, MQA 4 of Gemma 3, ...), one generic.
#define ATTEND_FOR(G) \
    static void attend_##G(const float *q, const uint8_t *k, const uint8_t *v, const Layout *kl, const Layout *vl, \
                           const int64_t *table, const uint8_t *staged, int64_t start, int64_t end, int64_t recent, \
                           int64_t sinks, float *out, float *lse, int group, int block_size, int64_t sk, int64_t sv) { \
        attend_one(q, k, v, kl, vl, table, staged, start, end, recent, sinks, out, lse, G, block_size, sk, sv); \
        (void)group; \
    }
ATTEND_FOR(1)
ATTEND_FOR(2)
ATTEND_FOR(3)
ATTEND_FOR(4)
ATTEND_FOR(group)

static int make_layout(Layout *layout, const int32_t *ints, const float *floats, int count, int nbytes, int width) {
    if (count > MAX_PIECES) return -1;
    layout->count = count;
    layout->nbytes = nbytes;
    layout->width = width;
    int total = 0;
    for (int p = 0; p < count; p++) {
        Piece *piece = &layout->pieces[p];
        piece->offset = ints[5 * p];
        piece->bits = ints[5 * p + 1];
        piece->count = ints[5 * p + 2];
        piece->norm_at = ints[5 * p + 3];
        piece->gamma_at = ints[5 * p + 4];
        piece->factor = floats[17 * p];
        memcpy(piece->values, floats + 17 * p + 1, sizeof piece->values);
        if (piece->bits < 1 || piece->bits > 4 || piece->count % 8) return -1;
        total += piece->count;
    }
    return total == width ? 0 : -1;
}

// q: [batch, kv_heads, group, k_width] float32 in key code space (rotated and scaled by the caller).
// k_pieces/k_values (and v_): TurboQuantizer.row_layout, k_count pieces. block_tables: [batch, max_blocks];
// context_lens: [batch]. out: [batch, kv_heads, group, v_width] float32, normalised, in value code space.
// window > 0 limits each query to its last `window` tokens (sliding-window layers).
// staged: NULL, or [batch, max_blocks * block_size] flags of tokens with a 16-bit copy; then tokens that the
// caller reads in 16 bits are skipped (see read_dense), and lse [batch, kv_heads, group] receives each row's
// log-sum-exp of scores (-inf if none) so that the caller can merge in its 16-bit tokens.
// Returns 0, or -1 when a shape exceeds the fixed per-task buffers (caller falls back).
int turboquant_decode_attention(const float *q, const uint8_t *k_cache, const uint8_t *v_cache,
                                const int32_t *k_pieces, const float *k_values, int k_count, int k_bytes,
                                int k_width, const int32_t *v_pieces, const float *v_values, int v_count,
                                int v_bytes, int v_width, const int64_t *block_tables, const int64_t *context_lens,
                                const uint8_t *staged, float *out, float *lse, int batch, int kv_heads, int group,
                                int block_size, int max_blocks, int64_t window, int64_t recent, int64_t sinks,
                                int threads) {
    Layout kl, vl;
    if (make_layout(&kl, k_pieces, k_values, k_count, k_bytes, k_width) ||
        make_layout(&vl, v_pieces, v_values, v_count, v_bytes, v_width))
        return -1;
    if (group > MAX_GROUP || k_width > MAX_WIDTH || v_width > MAX_WIDTH / 2 || block_size > MAX_BLOCK) return -1;
    static void (*const specialised[])(const float *, const uint8_t *, const uint8_t *, const Layout *,
                                       const Layout *, const int64_t *, const uint8_t *, int64_t, int64_t, int64_t,
                                       int64_t, float *, float *, int, int, int64_t, int64_t) = {
        attend_group, attend_1, attend_2, attend_3, attend_4};
    void (*attend)(const float *, const uint8_t *, const uint8_t *, const Layout *, const Layout *, const int64_t *,
                   const uint8_t *, int64_t, int64_t, int64_t, int64_t, float *, float *, int, int, int64_t,
                   int64_t) = specialised[group <= 4 ? group : 0];
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads)
    for (int b = 0; b < batch; b++) {
        for (int h = 0; h < kv_heads; h++) {
            int64_t end = context_lens[b];
            int64_t start = window > 0 && end > window ? end - window : 0;
            int64_t row = (int64_t)b * kv_heads + h;
            attend(q + row * group * k_width, k_cache + (int64_t)h * k_bytes, v_cache + (int64_t)h * v_bytes,
                       &kl, &vl, block_tables + (int64_t)b * max_blocks,
                       staged ? staged + (int64_t)b * max_blocks * block_size : NULL, start, end, recent, sinks,
                       out + row * group * v_width, lse ? lse + row * group : NULL, group, block_size,
                       (int64_t)kv_heads * k_bytes, (int64_t)kv_heads * v_bytes);
        }
    }
    return 0;
}
