// Paged attention over a TurboQuant cache, reading the packed codes: any number of query rows per sequence.
//
// Cache layout (kvcache/turboquant_cache.py): [num_blocks, block_size, kv_heads, nbytes] uint8, one row per
// (token, KV head). A row is a few pieces (kvcache/turboquant.py, TurboQuantizer.row_layout): `count` codes of
// `bits` bits, LSB first, each standing for value[code] * norm (* gamma * factor for QJL signs), with gamma fp16
// in the row and the norm fp16 or one byte (NORM8). Queries are rotated into that code space, so a key's score is
// a sum over pieces of scale * <q piece, value[codes]>, and the output is a weighted sum of code-space value rows,
// rotated back.
//
// A sequence with one query row (decode) is one task per KV head, or one for all its KV heads when there are
// sequences enough to keep the threads busy (heads_per_task): it rotates each head's G query heads into code space,
// walks the sequence's own blocks once with an online softmax in float32, and rotates the G sums back (neither
// where every token it sees is in the 16-bit window: reads_codes). Where those tasks are too few to keep every
// thread busy, a sequence's tokens are split into parts, each a task, whose sums the last to finish merges
// (part_limit). Each code row is decoded once per task, VW codes per step (with AVX-512
// a broadcast load, a multishift and an in-register table lookup), and shared by the G query heads; nothing is
// padded or dequantized to the original space. With AVX-512, keys of 2- or 4-bit pieces are scored a block at a
// time, the block's 16 rows as the lanes (score_block).
// A sequence with several rows (a prefill chunk over a cached prefix, or tokens to verify) is split into tiles of up
// to MAX_VECTORS query vectors (rows x heads), each a task that walks the blocks once: a decoded row is scored
// against every vector of the tile at once (the vectors are the SIMD lanes: a small matrix product per token, no
// horizontal sums), each query row causal over the chunk's own tokens (written to the cache before attention) and
// within its own sliding window. With the recent/sink window, the tokens read in 16 bits join the same softmax
// (attention/turboquant.py decides which, per query); a tile that reads no code rotates nothing (tile_reads_codes).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "bf16.h"
#include "decode_batch.h"
#include "turboquant.h"
#include "vector_math.h"

#define MAX_GROUP 16
#define MAX_WIDTH 512  // code-space width: head_dim, or 2 * head_dim for QJL keys
#define MAX_BLOCK 64
#define MAX_PIECES 4
#define MAX_VECTORS 32 // query vectors (rows x group) of a tile: a multiple of VW, the lanes of its scores
#define ROW_SLACK 16   // bytes a decoder may read past a row's end (the AVX-512 path's 16-byte load)

// Read by backends/cpu/abi.py: the slack the cache allocates after its last row, and the sizes its
// mirrors of the structs are checked against.
const int32_t turboquant_row_slack = ROW_SLACK;
const int32_t sizeof_CodeRows = sizeof(CodeRows), sizeof_DenseTokens = sizeof(DenseTokens),
              sizeof_TurboQuantAttention = sizeof(TurboQuantAttention);

// `VW` codes at a time: AVX-512 (with VBMI byte permutes), AVX2, or plain C.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define VW 16
typedef __m512 vec;
typedef struct {
    __m512i offset;  // per lane, in its low byte: the bit offset of its code in the 16 codes' 64 bits
    __m512 table;    // the 16 values that vpermps indexes by the low 4 bits (repeated for bits < 4)
} Decoder;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vsplat(float x) { return _mm512_set1_ps(x); }
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
static inline vec vload_bf16(const uint16_t *p) { return widen16(p); }
static void make_decoder(Decoder *d, int bits, const float *values) {
    uint32_t offset[16];
    float table[16];
    for (int i = 0; i < 16; i++) {
        offset[i] = (uint32_t)(i * bits);
        table[i] = values[i % (1 << bits)];
    }
    d->offset = _mm512_loadu_si512(offset);
    d->table = _mm512_loadu_ps(table);
}
// The 16 codes' 64 bits in every 64-bit lane (a broadcast load), and each lane's 8 bits from its code's offset on
// (vpmultishiftqb): one shuffle less than a byte permute and a shift. The 8-byte load reads past the 2 * bits bytes
// of the 16 codes, into the rest of the row, the next rows, or the slack that TurboQuantLayerCache allocates after
// the last row (ROW_SLACK); those bytes are never used.
static inline vec decode(const Decoder *d, int bits, const uint8_t *src) {
    (void)bits;
    int64_t word;
    memcpy(&word, src, sizeof word);
    __m512i code = _mm512_multishift_epi64_epi8(d->offset, _mm512_set1_epi64(word));
    return _mm512_permutexvar_ps(code, d->table);
}
#elif defined(__AVX2__)
#define VW 8
typedef __m256 vec;
typedef struct {
    __m256i shift;      // each lane's bit offset in the 32-bit word
    __m256 low, high;   // vpermps reads the low 3 bits: values 0-7 (repeated for bits < 3), and 8-15
} Decoder;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vsplat(float x) { return _mm256_set1_ps(x); }
static inline float vsum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vec vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static void make_decoder(Decoder *d, int bits, const float *values) {
    uint32_t shift[8];
    float table[16];
    for (int i = 0; i < 16; i++) table[i] = values[i % (1 << bits)];
    for (int i = 0; i < 8; i++) shift[i] = i * bits;
    d->shift = _mm256_loadu_si256((const __m256i *)shift);
    d->low = _mm256_loadu_ps(table);
    d->high = _mm256_loadu_ps(table + 8);
}
// The 4-byte load reads up to 3 bytes past the `bits` bytes of the 8 codes: within the row, the next rows, or
// the slack after the last row (ROW_SLACK).
static inline vec decode(const Decoder *d, int bits, const uint8_t *src) {
    uint32_t word;
    memcpy(&word, src, 4);
    __m256i code = _mm256_srlv_epi32(_mm256_set1_epi32((int)word), d->shift);
    __m256 v = _mm256_permutevar8x32_ps(d->low, code);
    if (bits == 4)  // bit 3 moved to the sign bit picks the upper half
        v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(d->high, code),
                             _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
    return v;
}
#else
#define VW 8
typedef struct { float x[8]; } vec;
typedef struct { float table[16]; } Decoder;
static inline vec vzero(void) { vec v = {{0}}; return v; }
static inline vec vload(const float *p) { vec v; memcpy(v.x, p, sizeof v.x); return v; }
static inline void vstore(float *p, vec v) { memcpy(p, v.x, sizeof v.x); }
static inline vec vfma(vec a, vec b, vec c) { for (int j = 0; j < 8; j++) c.x[j] += a.x[j] * b.x[j]; return c; }
static inline vec vadd(vec a, vec b) { for (int j = 0; j < 8; j++) a.x[j] += b.x[j]; return a; }
static inline vec vsplat(float x) { vec v; for (int j = 0; j < 8; j++) v.x[j] = x; return v; }
static inline float vsum(vec v) { float s = 0.f; for (int j = 0; j < 8; j++) s += v.x[j]; return s; }
static inline vec vload_bf16(const uint16_t *p) {
    vec v;
    for (int j = 0; j < 8; j++) v.x[j] = bf16_to_float(p[j]);
    return v;
}
static void make_decoder(Decoder *d, int bits, const float *values) {
    (void)bits;
    memcpy(d->table, values, sizeof d->table);
}
static inline vec decode(const Decoder *d, int bits, const uint8_t *src) {
    uint32_t word = 0;
    for (int b = 0; b < bits; b++) word |= (uint32_t)src[b] << (8 * b);
    vec v;
    for (int j = 0; j < 8; j++) v.x[j] = d->table[word >> (bits * j) & ((1u << bits) - 1)];
    return v;
}
#endif

typedef struct {
    int offset, bits, count, norm_at, gamma_at;  // byte offsets in the row; gamma_at < 0: no gamma
    int norm_bytes;                              // 2: fp16, 1: NORM8
    float factor;
    Decoder decoder;
} Piece;

typedef struct {
    int count, width, bytes;  // pieces, code-space width, bytes per row
    int by_tokens;            // score_block serves it: AVX-512, every piece 2 or 4 bits without gamma
    Piece pieces[MAX_PIECES];
} Layout;

static inline float half_to_float(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
}

static inline float piece_norm(const Piece *piece, const uint8_t *row) {
    if (piece->norm_bytes == 2) return half_to_float(row + piece->norm_at);
    uint32_t bits = ((uint32_t)row[piece->norm_at] << 19) + NORM8_BIAS;
    float x;
    memcpy(&x, &bits, sizeof x);
    return row[piece->norm_at] ? x : 0.f;
}

static inline float piece_scale(const Piece *piece, const uint8_t *row) {
    float s = piece_norm(piece, row) * piece->factor;
    return piece->gamma_at < 0 ? s : s * half_to_float(row + piece->gamma_at);
}

// Each of x[0..count) (count <= ROWS_PER_SUM) summed across its lanes, into out[0..count). On AVX2 one transposing
// tree of horizontal adds serves 8 rows (a shuffle-and-add reduction per row drew 12% of the decode kernel's samples
// under perf, SmolLM2 at 16 x 4k, tq3, AMD Zen 3); elsewhere row by row. A row's sum does not depend on the rows
// beside it.
#define ROWS_PER_SUM 8
static inline void vsums(vec *x, int count, float *out) {
#if VW == 8 && defined(__AVX2__)
    for (int i = count; i < ROWS_PER_SUM; i++) x[i] = vzero();
    __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
    __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
    float sums[ROWS_PER_SUM];  // row i's lanes 0-3, plus its lanes 4-7
    _mm256_storeu_ps(sums, _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                                         _mm256_permute2f128_ps(low, high, 0x31)));
    memcpy(out, sums, sizeof(float) * count);
#else
    for (int i = 0; i < count; i++) out[i] = vsum(x[i]);
#endif
}

// Scores of one key row for `group` query heads (q: [group][width]), unsummed: lanes[g][r] holds head g's, whose
// lanes sum to it (vsums); inlined with a constant `group`, so that the per-head accumulators stay in registers.
static inline __attribute__((always_inline)) void score_row(const Layout *kl, const uint8_t *row, const float *q,
                                                            int group, float scale, vec lanes[][ROWS_PER_SUM],
                                                            int r) {
    vec total[MAX_GROUP];  // pieces summed as vectors: one horizontal sum per head, not one per piece
    for (int g = 0; g < group; g++) total[g] = vzero();
    for (int p = 0, at = 0; p < kl->count; at += kl->pieces[p].count, p++) {
        const Piece *piece = &kl->pieces[p];
        const uint8_t *src = row + piece->offset;
        vec acc[MAX_GROUP];
        for (int g = 0; g < group; g++) acc[g] = vzero();
        for (int i = 0; i < piece->count; i += VW, src += piece->bits * VW / 8) {
            vec v = decode(&piece->decoder, piece->bits, src);
            for (int g = 0; g < group; g++) acc[g] = vfma(vload(q + g * kl->width + at + i), v, acc[g]);
        }
        vec s = vsplat(piece_scale(piece, row) * scale);
        for (int g = 0; g < group; g++) total[g] = vfma(s, acc[g], total[g]);
    }
    for (int g = 0; g < group; g++) lanes[g][r] = total[g];
}

// The last `count` rows that score_row left in lanes, summed into scores s[g][end - count..end).
static inline void sum_rows(vec lanes[][ROWS_PER_SUM], int group, int count, float s[][MAX_BLOCK], int end) {
    for (int g = 0; g < group; g++) vsums(lanes[g], count, s[g] + end - count);
}

#if VW == 16
// Words [0, count) (count <= 8) of 16 rows at first + t * stride, transposed: word[i] holds word i of row t in lane
// t. Sixteen masked row loads and up to 32 shuffles instead of a gather of 16 lanes per word: 4-bit keys' eight
// gathers a block took ~18% of this kernel's cycles at 16 x 4k on Zen 4 (tq3, 4 x 4k, one core: 1.00 -> 0.84 ms).
// The halves of z[j] are rows a and a + 4; the unpacks transpose 4 x 4 words within each 128-bit lane, and the lane
// shuffles put rows 0..15 in order.
static inline void transposed_words(const uint8_t *first, int64_t stride, int count, __m512i word[8]) {
    __mmask8 mask = (__mmask8)((1u << count) - 1);
    __m512i z[8];
    for (int j = 0; j < 8; j++) {
        int a = j < 4 ? j : j + 4;
        z[j] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_maskz_loadu_epi32(mask, first + a * stride)),
                                  _mm256_maskz_loadu_epi32(mask, first + (a + 4) * stride), 1);
    }
    for (int h = 0; h < 8; h += 4) {
        __m512i t0 = _mm512_unpacklo_epi32(z[h], z[h + 1]), t1 = _mm512_unpackhi_epi32(z[h], z[h + 1]);
        __m512i t2 = _mm512_unpacklo_epi32(z[h + 2], z[h + 3]), t3 = _mm512_unpackhi_epi32(z[h + 2], z[h + 3]);
        z[h] = _mm512_unpacklo_epi64(t0, t2), z[h + 1] = _mm512_unpackhi_epi64(t0, t2);
        z[h + 2] = _mm512_unpacklo_epi64(t1, t3), z[h + 3] = _mm512_unpackhi_epi64(t1, t3);
    }
    for (int i = 0; i < 4; i++) {  // z[i]: word i in lanes 0 and 2, word i + 4 in 1 and 3
        word[i] = _mm512_shuffle_i32x4(z[i], z[4 + i], 0x88);
        word[i + 4] = _mm512_shuffle_i32x4(z[i], z[4 + i], 0xDD);
    }
}

// The fp16 numbers at first + t * stride of 16 rows, row t in lane t.
static inline __m512 lane_halves(const uint8_t *first, int64_t stride) {
    __m512i word[8];  // the fp16 in the low half of word 0
    transposed_words(first, stride, 1, word);
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(word[0]));
}

// The norms of 16 rows, row t at first + t * stride, row t in lane t.
static inline __m512 lane_norms(const Piece *piece, const uint8_t *first, int64_t stride) {
    if (piece->norm_bytes == 2) return lane_halves(first + piece->norm_at, stride);
    __m512i word[8];
    transposed_words(first + piece->norm_at, stride, 1, word);
    __m512i byte = _mm512_and_si512(word[0], _mm512_set1_epi32(0xFF));
    __m512 x = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(byte, 19), _mm512_set1_epi32(NORM8_BIAS)));
    return _mm512_maskz_mov_ps(_mm512_test_epi32_mask(byte, byte), x);
}

// piece_scale of 16 rows, row t at first + t * stride, into scales[piece][t].
static inline void block_scales(const Layout *l, const uint8_t *first, int64_t stride, float scales[][MAX_BLOCK]) {
    for (int p = 0; p < l->count; p++) {
        const Piece *piece = &l->pieces[p];
        vec s = _mm512_mul_ps(lane_norms(piece, first, stride), vsplat(piece->factor));
        if (piece->gamma_at >= 0) s = _mm512_mul_ps(s, lane_halves(first + piece->gamma_at, stride));
        vstore(scales[p], s);
    }
}

// One piece's codes of 16 rows (row t's words at first + t * stride) against `group` query heads, the rows as
// the lanes: each 32-bit word of codes is taken from the 16 rows once, and each code in it is shifted to the
// low 4 bits, which vpermps reads (a 2-bit code's table repeats, as decode's does). Two sums per head, for
// two chains of FMAs.
static inline __attribute__((always_inline)) void score_words(const Piece *piece, const uint8_t *first,
                                                              int64_t stride, const float *q, int width, int group,
                                                              const int bits, __m512 acc[][2]) {
    int words = piece->count * bits / 32;
    const float *qg[MAX_GROUP];  // each head's query at the word: constant offsets in the FMAs, no index arithmetic
    for (int g = 0; g < group; g++) qg[g] = q + (ptrdiff_t)g * width;
    for (int w0 = 0; w0 < words; w0 += 8) {
        __m512i word[8];
        int n = words - w0 < 8 ? words - w0 : 8;
        transposed_words(first + 4 * w0, stride, n, word);
        for (int w = 0; w < n; w++) {
#pragma GCC unroll 16  // 2-bit codes too: a loop here kept the sums in memory, at two thirds of tq2.5's speed
            for (int c = 0; c < 32 / bits; c++) {
                __m512i code = _mm512_srli_epi32(word[w], (unsigned)(c * bits));
                __m512 v = _mm512_permutexvar_ps(code, piece->decoder.table);
                for (int g = 0; g < group; g++) acc[g][c & 1] = vfma(v, vsplat(qg[g][c]), acc[g][c & 1]);
            }
            for (int g = 0; g < group; g++) qg[g] += 32 / bits;
        }
    }
}

// Scores of a whole block of 16 rows (row t at first_row + t * stride) for `group` heads, scores[g][t], with no
// horizontal sums (score_row, row by row, took 43% of this kernel's cycles at 16 x 4k). Rows the caller then drops
// (read in 16 bits, outside the window, past the sequence) are scored too: they lie inside the block's memory.
static inline __attribute__((always_inline)) void score_block(const Layout *kl, const uint8_t *first_row,
                                                              int64_t stride, const float *q, int group,
                                                              float scale, float scores[][MAX_BLOCK]) {
    vec total[MAX_GROUP];
    for (int g = 0; g < group; g++) total[g] = vzero();
    for (int p = 0, at = 0; p < kl->count; at += kl->pieces[p].count, p++) {
        const Piece *piece = &kl->pieces[p];
        vec acc[MAX_GROUP][2];
        for (int g = 0; g < group; g++) acc[g][0] = acc[g][1] = vzero();
        if (piece->bits == 4)
            score_words(piece, first_row + piece->offset, stride, q + at, kl->width, group, 4, acc);
        else
            score_words(piece, first_row + piece->offset, stride, q + at, kl->width, group, 2, acc);
        vec s = _mm512_mul_ps(lane_norms(piece, first_row, stride), vsplat(piece->factor * scale));
        for (int g = 0; g < group; g++) total[g] = vfma(_mm512_add_ps(acc[g][0], acc[g][1]), s, total[g]);
    }
    for (int g = 0; g < group; g++) vstore(scores[g], total[g]);
}
#endif

// acc[g] += sum over the n rows of weights[g][r] * scales[piece][r] * the piece's codes, for `group` heads
// (acc: [group][width]). Codes outer, rows inner: the accumulators stay in registers for a whole block.
static inline __attribute__((always_inline)) void accumulate_rows(const Layout *vl, const uint8_t *const *rows,
                                                                  int n, float weights[][MAX_BLOCK],
                                                                  float scales[][MAX_BLOCK], int group, float *acc) {
    for (int p = 0, at = 0; p < vl->count; at += vl->pieces[p].count, p++) {
        const Piece *piece = &vl->pieces[p];
        float w[MAX_GROUP][MAX_BLOCK];
        for (int g = 0; g < group; g++)
            for (int r = 0; r < n; r++) w[g][r] = weights[g][r] * scales[p][r];
        for (int i = 0; i < piece->count; i += VW) {
            const int byte = piece->offset + piece->bits * i / 8;
            // even and odd rows in two chains of FMAs, each waiting on half as many (with score_row's 8-row sums,
            // SmolLM2 16 x 4k, tq3, AMD Zen 3: 13.1 -> 11.6 ms a layer at one thread, 7.2 -> 6.6 at two)
            vec sum[MAX_GROUP], odd[MAX_GROUP];
            for (int g = 0; g < group; g++) sum[g] = vload(acc + g * vl->width + at + i), odd[g] = vzero();
            int r = 0;
            for (; r + 1 < n; r += 2) {
                vec v = decode(&piece->decoder, piece->bits, rows[r] + byte);
                vec u = decode(&piece->decoder, piece->bits, rows[r + 1] + byte);
                for (int g = 0; g < group; g++) {
                    sum[g] = vfma(vsplat(w[g][r]), v, sum[g]);
                    odd[g] = vfma(vsplat(w[g][r + 1]), u, odd[g]);
                }
            }
            if (r < n) {
                vec v = decode(&piece->decoder, piece->bits, rows[r] + byte);
                for (int g = 0; g < group; g++) sum[g] = vfma(vsplat(w[g][r]), v, sum[g]);
            }
            for (int g = 0; g < group; g++) vstore(acc + g * vl->width + at + i, vadd(sum[g], odd[g]));
        }
    }
}

// e^x for x <= 0 (Cephes expf, about 1 ulp), 0 below -87 (so e^-inf = 0); written so that loops over it vectorize.
static inline float exp_nonpositive(float x) {
    float clamped = x < -87.f ? -87.f : x;
    float n = rintf(clamped * 1.44269504088896341f);
    float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
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
    return x < -87.f ? 0.f : p * two_n;
}

typedef struct {
    Layout keys, values;
    const uint8_t *k, *v;  // code rows of KV head 0; a head's rows are `heads` rows apart
    int heads, group, dim, block_size;
    float scale;
    // DenseTokens' fields, or staging_of == NULL
    const int64_t *staging_of;
    const void *staged_k, *staged_v, *own_k, *own_v;
    int bf16;
    int64_t recent, sinks;
    const float *key_mean;
} Step;

static inline void load_row(const void *base, int64_t row, int dim, int bf16, float *dst) {
    if (!bf16) {
        memcpy(dst, (const float *)base + row * dim, sizeof(float) * dim);
        return;
    }
    const uint16_t *src = (const uint16_t *)base + row * dim;
    for (int d = 0; d < dim; d++) dst[d] = bf16_to_float(src[d]);
}

// VW channels of a 16-bit window row from element `at` on (bf16 bits, or float32), as floats: the kernels' head
// sizes are multiples of VW (layouts: every code piece is).
static inline vec load_channels(const void *base, int64_t at, int bf16) {
    return bf16 ? vload_bf16((const uint16_t *)base + at) : vload((const float *)base + at);
}

// The largest of x[0..n) and init, in four independent chains (one chain waited on each compare's latency; the
// compiler vectorizes no float max without -ffast-math).
static inline float max_of(const float *x, int n, float init) {
    float m[4] = {init, init, init, init};
    int r = 0;
    for (; r + 4 <= n; r += 4)
        for (int j = 0; j < 4; j++) m[j] = x[r + j] > m[j] ? x[r + j] : m[j];
    for (; r < n; r++) m[0] = x[r] > m[0] ? x[r] : m[0];
    float a = m[0] > m[1] ? m[0] : m[1], b = m[2] > m[3] ? m[2] : m[3];
    return a > b ? a : b;
}

// One block's online-softmax step, each head's scores s[g][0..count) turned into weights, in place; m, l: the
// running maximum and sum; correction[g]: what the sums so far are to be multiplied by.
static inline __attribute__((always_inline)) void softmax_rows(float s[][MAX_BLOCK], int count, int group, float *m,
                                                               float *l, float *correction) {
    for (int g = 0; g < group; g++) {
        float block_max = max_of(s[g], count, m[g]), sum = 0.f;
        // the running maximum settles early: most blocks need no correction (e^0 is 1 here too)
        correction[g] = block_max > m[g] ? exp_nonpositive(m[g] - block_max) : 1.f;
        m[g] = block_max;
        for (int r = 0; r < count; r++) {
            s[g][r] = exp_nonpositive(s[g][r] - block_max);
            sum += s[g][r];
        }
        l[g] = l[g] * correction[g] + sum;
    }
}

#if VW == 16
// softmax_rows for count <= 16 rows: a head's block is one vector (the scalar loops took a fifth of this kernel's
// cycles at 16 x 4k, tq3, on a Xeon with AMX).
static inline __attribute__((always_inline)) void softmax_lanes(float s[][MAX_BLOCK], int count, int group, float *m,
                                                                float *l, float *correction) {
    __mmask16 live = (__mmask16)((1u << count) - 1);
    for (int g = 0; g < group; g++) {
        __m512 x = _mm512_mask_loadu_ps(vsplat(-INFINITY), live, s[g]);
        float block_max = _mm512_reduce_max_ps(x);
        block_max = block_max > m[g] ? block_max : m[g];
        correction[g] = block_max > m[g] ? exp_nonpositive(m[g] - block_max) : 1.f;
        m[g] = block_max;
        __m512 e = exp512(_mm512_sub_ps(x, vsplat(block_max)));  // lanes past `count`: e^-103, never read
        vstore(s[g], e);
        l[g] = l[g] * correction[g] + _mm512_mask_reduce_add_ps(live, e);
    }
}
#endif

// Blocks are wherever the block table puts them, so the hardware prefetchers lose the stream at every block edge
// and the first rows of a block stalled the decode loop on memory: the rows of the block PREFETCH ahead are asked
// for while this one is scored.
#define PREFETCH 2
static inline void prefetch_block(const uint8_t *k_head, const uint8_t *v_head, int64_t slot0, int bs,
                                  int64_t k_stride, int64_t v_stride, int k_bytes, int v_bytes) {
    for (int t = 0; t < bs; t++) {
        const uint8_t *k = k_head + (slot0 + t) * k_stride, *v = v_head + (slot0 + t) * v_stride;
        __builtin_prefetch(k);
        __builtin_prefetch(k + k_bytes - 1);
        __builtin_prefetch(v);
        __builtin_prefetch(v + v_bytes - 1);
    }
}

// A block of a decode task: its first token, where its rows are, which of its tokens the query sees, and where the
// window keeps it (staged: its staging slot, or -1 when it is not staged or none of its tokens is among the newest
// `recent` or the first `sinks`: most blocks).
typedef struct {
    int64_t first, slot0, staged;
    int lo, hi;
} Block;

// Whether the query, the last of `end` tokens, reads token `t` of block b in 16 bits instead of codes
// (attention/turboquant.py, _near): its own token, or a staged one among the newest `recent` or the first `sinks`.
static inline int read_dense(const Step *st, const Block *b, int64_t t, int64_t end) {
    return t == end - 1 || (b->staged >= 0 && (t >= end - st->recent || t < st->sinks));
}

// Whether it reads every token of b it sees so (none of them lies between the sinks and the recent window): then
// b's codes are neither read nor prefetched.
static inline int all_dense(const Step *st, const Block *b, int64_t end) {
    int64_t from = b->first + b->lo > st->sinks ? b->first + b->lo : st->sinks;
    int64_t to = b->first + b->hi < end - st->recent ? b->first + b->hi : end - st->recent;
    return b->staged >= 0 && from >= to;
}

// One KV head's running state in a decode task: its G query heads' queries (q [G][k_width] in key code space,
// q_channels [G][dim] as given), online-softmax maxima and sums, and the unnormalised sums (acc [G][v_width] in value
// code space, dense [G][dim] of 16-bit tokens).
typedef struct {
    int h;
    const float *q, *q_channels;
    float *acc, *dense, *m, *l, *mean_score;
} HeadState;

// One block of one KV head: scores, the online-softmax step and the weighted value sums.
static inline __attribute__((always_inline)) void attend_block(const Step *st, int group, int64_t own, int64_t end,
                                                               const Block *b, const HeadState *hs) {
    const Layout *kl = &st->keys, *vl = &st->values;
    int width = vl->width, dim = st->dim, bs = st->block_size, h = hs->h;
    int64_t k_stride = (int64_t)st->heads * kl->bytes, v_stride = (int64_t)st->heads * vl->bytes;
    const uint8_t *k_head = st->k + (int64_t)h * kl->bytes, *v_head = st->v + (int64_t)h * vl->bytes;
    float s[MAX_GROUP][MAX_BLOCK], v_scales[MAX_PIECES][MAX_BLOCK];
    const int blockwise = kl->by_tokens && bs == VW;
    const uint8_t *rows[MAX_BLOCK];
    const void *dense_v[MAX_BLOCK];
    int64_t dense_row[MAX_BLOCK];
    int n = 0, nd = 0;  // tokens read from codes (s[][0..n), rows) and in 16 bits (s[][n..n+nd), dense_*)
    const int near = st->staging_of && (b->staged >= 0 || b->first + bs >= end);
    const int codes = !all_dense(st, b, end);
    vec lanes[MAX_GROUP][ROWS_PER_SUM];  // rows scored row by row, not yet summed: s[][n - pending..n)
    int pending = 0;
#if VW == 16
    if (blockwise && codes) score_block(kl, k_head + b->slot0 * k_stride, k_stride, hs->q, group, st->scale, s);
    if (blockwise && !near && b->lo == 0 && b->hi == bs) {  // most blocks: every token from codes, in order
        for (int t = 0; t < bs; t++) rows[t] = v_head + (b->slot0 + t) * v_stride;
        block_scales(vl, rows[0], v_stride, v_scales);
        n = bs;
    }
    else
#endif
    for (int t = b->lo; codes && t < b->hi; t++) {
        if (near && read_dense(st, b, b->first + t, end)) continue;
        if (blockwise)  // s[g][t] moves to s[g][n], n <= t
            for (int g = 0; g < group; g++) s[g][n] = s[g][t];
        else
            score_row(kl, k_head + (b->slot0 + t) * k_stride, hs->q, group, st->scale, lanes, pending++);
        rows[n] = v_head + (b->slot0 + t) * v_stride;
        // the value row's scales read here, where the scoring around them hides the first touch of the row
        for (int p = 0; p < vl->count; p++) v_scales[p][n] = piece_scale(&vl->pieces[p], rows[n]);
        n++;
        if (pending == ROWS_PER_SUM) sum_rows(lanes, group, pending, s, n), pending = 0;
    }
    if (pending) sum_rows(lanes, group, pending, s, n);
    for (int t = b->lo; near && t < b->hi; t++) {
        int64_t pos = b->first + t;
        if (!read_dense(st, b, pos, end)) continue;
        const void *k_base = st->own_k;
        int64_t index = own * st->heads + h;
        dense_v[nd] = st->own_v;
        if (pos != end - 1) {
            index = (b->staged * bs + t) * st->heads + h;
            k_base = st->staged_k;
            dense_v[nd] = st->staged_v;
        }
        // straight from the row into registers, not through a float copy on the stack (one sequence of 192 tokens,
        // tq3's window of 144 + 4, one thread, Zen 4: 0.053 -> 0.047 ms a layer, kv_kernels.py --recent)
        vec dot[MAX_GROUP];
        for (int g = 0; g < group; g++) dot[g] = vzero();
        for (int d = 0; d < dim; d += VW) {
            vec x = load_channels(k_base, index * dim + d, st->bf16);
            for (int g = 0; g < group; g++) dot[g] = vfma(vload(hs->q_channels + g * dim + d), x, dot[g]);
        }
        for (int g = 0; g < group; g++) s[g][n + nd] = (vsum(dot[g]) - hs->mean_score[g]) * st->scale;
        dense_row[nd++] = index;
    }
    if (!n && !nd) return;
    float correction[MAX_GROUP];
#if VW == 16
    if (n + nd <= VW)
        softmax_lanes(s, n + nd, group, hs->m, hs->l, correction);
    else
#endif
        softmax_rows(s, n + nd, group, hs->m, hs->l, correction);
    for (int g = 0; g < group; g++)
        if (correction[g] != 1.f) {
            for (int d = 0; d < width; d++) hs->acc[g * width + d] *= correction[g];
            for (int d = 0; d < dim; d++) hs->dense[g * dim + d] *= correction[g];
        }
    accumulate_rows(vl, rows, n, s, v_scales, group, hs->acc);
    // channels outer, rows inner: the sums stay in registers over the block's 16-bit rows
    for (int d = 0; nd && d < dim; d += VW) {
        vec sum[MAX_GROUP];
        for (int g = 0; g < group; g++) sum[g] = vload(hs->dense + g * dim + d);
        for (int r = 0; r < nd; r++) {
            vec x = load_channels(dense_v[r], dense_row[r] * dim + d, st->bf16);
            for (int g = 0; g < group; g++) sum[g] = vfma(vsplat(s[g][n + r]), x, sum[g]);
        }
        for (int g = 0; g < group; g++) vstore(hs->dense + g * dim + d, sum[g]);
    }
}

// The tokens a decode task reads: [start, stop) of a sequence of `end` tokens whose last is the query, through
// the sequence's block table. stop < end: one part of a sequence split over several tasks (attend_decode).
typedef struct {
    const int64_t *table;
    int64_t start, stop, end;
} Tokens;

// The block from token `first` on of a task over `tk`.
static inline Block block(const Step *st, const Tokens *tk, int64_t first) {
    int64_t bs = st->block_size, slot = tk->table[first / bs];
    int window = st->staging_of && (first < st->sinks || first + bs > tk->end - st->recent);
    return (Block){first, slot * bs, window ? st->staging_of[slot] : -1,
                   first < tk->start ? (int)(tk->start - first) : 0,
                   tk->stop - first < bs ? (int)(tk->stop - first) : (int)bs};
}

// The cache lines of a whole block, every KV head's rows: what a task over several heads reads next.
static inline void prefetch_lines(const uint8_t *k, int64_t k_bytes, const uint8_t *v, int64_t v_bytes) {
    for (int64_t i = 0; i < k_bytes; i += 64) __builtin_prefetch(k + i);
    for (int64_t i = 0; i < v_bytes; i += 64) __builtin_prefetch(v + i);
}

// The 16-bit rows of KV heads [h0, h0 + heads) that a staged block keeps in the window, K and V: the window is as
// scattered as the blocks (a staging slot per block), so the prefetchers miss it as they miss the codes (one
// sequence of 192 tokens, tq3's window, one thread, Zen 4: most of the kernel's samples sat on those rows' loads).
static inline void prefetch_staged(const Step *st, int64_t slot, int h0, int heads) {
    int64_t head = (int64_t)st->dim * (st->bf16 ? 2 : 4), row = st->heads * head;
    int64_t at = slot * st->block_size * row + h0 * head;
    const uint8_t *k = st->staged_k, *v = st->staged_v;
    for (int t = 0; t < st->block_size; t++, at += row) prefetch_lines(k + at, heads * head, v + at, heads * head);
}

// KV heads [h0, h0 + heads) of one sequence's single query row, walking its blocks once: each block's rows of
// every head are read while in cache (one task per head read each block's lines once per head). `own` is the row
// of the query's own token in DenseTokens' own_k/own_v. Per head, q [group][k_width] in key code space and
// q_channels [group][dim] as given, in head order; writes the normalised sums, in value code space to sums
// [heads][group][v_width] and of 16-bit tokens to dense [heads][group][dim], and (lse not NULL) each query
// head's log of the softmax's denominator to lse [heads][group], by which parts of a split sequence merge.
static inline __attribute__((always_inline)) void attend_one(const Step *st, int group, int64_t own, int h0,
                                                             int heads, const float *q, const float *q_channels,
                                                             const Tokens *tk, float *sums, float *dense,
                                                             float *lse) {
    const Layout *kl = &st->keys, *vl = &st->values;
    int width = vl->width, dim = st->dim, bs = st->block_size, vectors = heads * group;
    int64_t k_stride = (int64_t)st->heads * kl->bytes, v_stride = (int64_t)st->heads * vl->bytes;
    float acc[MAX_GROUP * MAX_WIDTH / 2], m[MAX_GROUP], l[MAX_GROUP], mean_score[MAX_GROUP];
    HeadState hs[MAX_GROUP];
    memset(acc, 0, sizeof(float) * vectors * width);
    memset(dense, 0, sizeof(float) * vectors * dim);
    for (int i = 0; i < heads; i++)
        hs[i] = (HeadState){h0 + i, q + i * group * kl->width, q_channels + i * group * dim, acc + i * group * width,
                            dense + i * group * dim, m + i * group, l + i * group, mean_score + i * group};
    for (int v = 0; v < vectors; v++) {
        m[v] = -INFINITY;
        l[v] = 0.f;
        mean_score[v] = 0.f;
        if (st->staging_of)
            for (int d = 0; d < dim; d++)
                mean_score[v] += q_channels[v * dim + d] * st->key_mean[(int64_t)(h0 + v / group) * dim + d];
    }
    for (int64_t first = tk->start - tk->start % bs; first < tk->stop; first += bs) {
        Block b = block(st, tk, first);
        if (first + PREFETCH * bs < tk->stop) {
            Block next = block(st, tk, first + PREFETCH * bs);
            int64_t ahead = next.slot0;
            int codes = !all_dense(st, &next, tk->end);
            if (next.staged >= 0) prefetch_staged(st, next.staged, h0, heads);
            if (codes && heads == 1)
                prefetch_block(st->k + (int64_t)h0 * kl->bytes, st->v + (int64_t)h0 * vl->bytes, ahead, bs, k_stride,
                               v_stride, kl->bytes, vl->bytes);
            else if (codes)
                prefetch_lines(st->k + ahead * k_stride, bs * k_stride, st->v + ahead * v_stride, bs * v_stride);
        }
        for (int i = 0; i < heads; i++) attend_block(st, group, own, tk->end, &b, &hs[i]);
    }
    for (int v = 0; v < vectors; v++) {
        float inv = l[v] > 0.f ? 1.f / l[v] : 0.f;
        for (int d = 0; d < width; d++) sums[v * width + d] = acc[v * width + d] * inv;
        for (int d = 0; d < dim; d++) dense[v * dim + d] *= inv;
        if (lse) lse[v] = l[v] > 0.f ? m[v] + logf(l[v]) : -INFINITY;
    }
}

typedef void AttendFn(const Step *, int64_t, int, int, const float *, const float *, const Tokens *, float *, float *,
                      float *);

// One copy per common group size (GQA 3 of SmolLM2, MQA 4 of Gemma 3, ...) with `group` a constant; one generic.
#define ATTEND_FOR(G)                                                                                             \
    static void attend_##G(const Step *st, int64_t own, int h0, int heads, const float *q, const float *q_channels, \
                           const Tokens *tk, float *sums, float *dense, float *lse) {                            \
        attend_one(st, G, own, h0, heads, q, q_channels, tk, sums, dense, lse);                                   \
    }
ATTEND_FOR(1)
ATTEND_FOR(2)
ATTEND_FOR(3)
ATTEND_FOR(4)

static void attend_group(const Step *st, int64_t own, int h0, int heads, const float *q, const float *q_channels,
                         const Tokens *tk, float *sums, float *dense, float *lse) {
    attend_one(st, st->group, own, h0, heads, q, q_channels, tk, sums, dense, lse);
}

// A tile's query vectors (rows x group heads, row-major) against KV head h: each vector's position and first
// visible token (qpos -1: padding, which sees nothing and whose sums are never read).
typedef struct {
    int h;
    const int64_t *table;
    int64_t qpos[MAX_VECTORS], from[MAX_VECTORS];
    int64_t own_from, own_row;  // tokens from position own_from on are the step's own, own_from's in row own_row
} Tile;

// A code row decoded to floats in code space, each piece times its scale and `scale`.
static inline void decode_row(const Layout *l, const uint8_t *row, float scale, float *dst) {
    for (int p = 0, at = 0; p < l->count; at += l->pieces[p].count, p++) {
        const Piece *piece = &l->pieces[p];
        const uint8_t *src = row + piece->offset;
        vec s = vsplat(piece_scale(piece, row) * scale);
        for (int i = 0; i < piece->count; i += VW, src += piece->bits * VW / 8)
            vstore(dst + at + i, vfma(s, decode(&piece->decoder, piece->bits, src), vzero()));
    }
}

// s[v] = <x, q_t[:, v]> for every vector of a tile, q_t [width][MAX_VECTORS]: the vectors are the lanes. SETS
// partial sums over interleaved coordinates keep 8 independent FMA chains in flight (and shorten each sum).
#define LANES (MAX_VECTORS / VW)
#define SETS (8 / LANES)
static inline void score_vectors(const float *x, const float *q_t, int width, float *s) {
    vec acc[SETS][LANES];
    for (int k = 0; k < SETS; k++)
        for (int j = 0; j < LANES; j++) acc[k][j] = vzero();
    for (int i = 0; i < width; i += SETS)  // width: a multiple of VW
        for (int k = 0; k < SETS; k++) {
            vec xi = vsplat(x[i + k]);
            for (int j = 0; j < LANES; j++)
                acc[k][j] = vfma(xi, vload(q_t + (i + k) * MAX_VECTORS + j * VW), acc[k][j]);
        }
    for (int j = 0; j < LANES; j++) {
        vec sum = acc[0][j];
        for (int k = 1; k < SETS; k++) sum = vfma(acc[k][j], vsplat(1.f), sum);
        vstore(s + j * VW, sum);
    }
}

// acc[v] += sum over the n rows [n][width] of p[r][v] * row r, for every vector; eight accumulators in registers.
static inline void accumulate_vectors(const float *rows, int n, int width, float p[][MAX_VECTORS], float *acc) {
    for (int v = 0; v < MAX_VECTORS; v += 8)
        for (int i = 0; i < width; i += VW) {
            vec sum[8];
            for (int j = 0; j < 8; j++) sum[j] = vload(acc + (v + j) * width + i);
            for (int r = 0; r < n; r++) {
                vec x = vload(rows + r * width + i);
                for (int j = 0; j < 8; j++) sum[j] = vfma(vsplat(p[r][v + j]), x, sum[j]);
            }
            for (int j = 0; j < 8; j++) vstore(acc + (v + j) * width + i, sum[j]);
        }
}

// How vector v reads token t: 0 not at all, 1 from its codes, 2 in 16 bits (attention/turboquant.py's rule, per
// query): with a window, the step's own tokens always, staged ones (staged) when near.
static inline int token_kind(const Step *st, const Tile *tile, int v, int64_t t, int staged) {
    if (t > tile->qpos[v] || t < tile->from[v]) return 0;
    if (st->staging_of && t >= tile->own_from) return 2;
    return staged && (t > tile->qpos[v] - st->recent || t < st->sinks) ? 2 : 1;
}

// Scores of one 16-bit token for the vectors that read it so (kind 2; -inf for the rest); returns its V row.
static inline int64_t score_dense(const Step *st, const Tile *tile, int64_t pos, const unsigned char *kind,
                                  const float *q_channels, const float *mean_score, float *row, float *s,
                                  const void **v_base) {
    int64_t index = (tile->own_row + pos - tile->own_from) * st->heads + tile->h;
    const void *k_base = st->own_k;
    *v_base = st->own_v;
    if (pos < tile->own_from) {
        index = (st->staging_of[tile->table[pos / st->block_size]] * st->block_size + pos % st->block_size)
                * st->heads + tile->h;
        k_base = st->staged_k;
        *v_base = st->staged_v;
    }
    load_row(k_base, index, st->dim, st->bf16, row);
    for (int v = 0; v < MAX_VECTORS; v++) {
        float dot = 0.f;
        for (int d = 0; kind[v] == 2 && d < st->dim; d++) dot += q_channels[v * st->dim + d] * row[d];
        s[v] = kind[v] == 2 ? (dot - mean_score[v]) * st->scale : -INFINITY;
    }
    return index;
}

// The online-softmax step of a block for every vector: its `rows` scores become weights; `correction` is what the
// sums so far are to be multiplied by.
static inline void softmax_block(float s[][MAX_VECTORS], int rows, float *m, float *l, float *correction) {
    float top[MAX_VECTORS], sum[MAX_VECTORS];
    for (int v = 0; v < MAX_VECTORS; v++) top[v] = m[v], sum[v] = 0.f;
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < MAX_VECTORS; v++) top[v] = s[r][v] > top[v] ? s[r][v] : top[v];
    for (int v = 0; v < MAX_VECTORS; v++) {
        float base = top[v] == -INFINITY ? 0.f : top[v];  // nothing seen yet: every weight stays 0
        correction[v] = exp_nonpositive(m[v] - base);
        m[v] = top[v];
        top[v] = base;
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < MAX_VECTORS; v++) {
            s[r][v] = exp_nonpositive(s[r][v] - top[v]);
            sum[v] += s[r][v];
        }
    for (int v = 0; v < MAX_VECTORS; v++) l[v] = l[v] * correction[v] + sum[v];
}

// A tile's first and last token, and whether a block's tokens [lo, hi] are read from their codes by every
// vector (no masks to apply).
typedef struct {
    int64_t start, end, latest_from, earliest_query;
} Span;

static Span tile_span(const Tile *tile) {
    Span span = {INT64_MAX, 0, 0, INT64_MAX};
    for (int v = 0; v < MAX_VECTORS; v++) {
        if (tile->qpos[v] < 0) continue;
        span.start = tile->from[v] < span.start ? tile->from[v] : span.start;
        span.end = tile->qpos[v] + 1 > span.end ? tile->qpos[v] + 1 : span.end;
        span.latest_from = tile->from[v] > span.latest_from ? tile->from[v] : span.latest_from;
        span.earliest_query = tile->qpos[v] < span.earliest_query ? tile->qpos[v] : span.earliest_query;
    }
    return span;
}

static inline int all_codes(const Step *st, const Tile *tile, const Span *span, int64_t lo, int64_t hi) {
    int64_t last = hi - 1 + (st->staging_of ? st->recent : 0);
    return lo >= span->latest_from && last <= span->earliest_query
           && (!st->staging_of || (lo >= st->sinks && hi <= tile->own_from));
}

// Whether any vector of a tile reads a token from codes (token_kind 1; as reads_codes for a decode task): if none
// does, as in Gemma 3's sliding layers, whose window is staged whole, its queries are not rotated into code space nor
// its sums out. It stops at the first such token.
static int tile_reads_codes(const Step *st, const Tile *tile) {
    Span span = tile_span(tile);
    for (int64_t t = span.start; t < span.end; t++) {
        int staged = st->staging_of && st->staging_of[tile->table[t / st->block_size]] >= 0;
        for (int v = 0; v < MAX_VECTORS; v++)
            if (token_kind(st, tile, v, t, staged) == 1) return 1;
    }
    return 0;
}

// One tile: q [MAX_VECTORS][k_width] in key code space (NULL where it reads no code), q_channels [MAX_VECTORS][dim]
// as given. Writes the normalised sums: in value code space to sums [MAX_VECTORS][v_width], of 16-bit tokens to
// dense [MAX_VECTORS][dim].
static void attend_tile(const Step *st, const Tile *tile, const float *q, const float *q_channels, float *sums,
                        float *dense) {
    const Layout *kl = &st->keys, *vl = &st->values;
    int width = vl->width, dim = st->dim, bs = st->block_size;
    int64_t k_stride = (int64_t)st->heads * kl->bytes, v_stride = (int64_t)st->heads * vl->bytes;
    const uint8_t *k_head = st->k + (int64_t)tile->h * kl->bytes, *v_head = st->v + (int64_t)tile->h * vl->bytes;
    float q_t[MAX_WIDTH * MAX_VECTORS], acc[MAX_VECTORS * MAX_WIDTH / 2], values[MAX_BLOCK * MAX_WIDTH / 2];
    float m[MAX_VECTORS], l[MAX_VECTORS], mean_score[MAX_VECTORS], correction[MAX_VECTORS], row[MAX_WIDTH];
    float s[2 * MAX_BLOCK][MAX_VECTORS];
    unsigned char kind[MAX_BLOCK][MAX_VECTORS];
    const void *dense_v[MAX_BLOCK];
    int64_t dense_row[MAX_BLOCK];
    for (int i = 0; q && i < kl->width; i++)
        for (int v = 0; v < MAX_VECTORS; v++) q_t[i * MAX_VECTORS + v] = q[v * kl->width + i];
    memset(acc, 0, sizeof(float) * MAX_VECTORS * width);
    memset(dense, 0, sizeof(float) * MAX_VECTORS * dim);
    for (int v = 0; v < MAX_VECTORS; v++) {
        m[v] = -INFINITY;
        l[v] = mean_score[v] = 0.f;
        for (int d = 0; st->staging_of && d < dim; d++)
            mean_score[v] += q_channels[v * dim + d] * st->key_mean[(int64_t)tile->h * dim + d];
    }
    Span span = tile_span(tile);
    for (int64_t first = span.start - span.start % bs; first < span.end; first += bs) {
        int64_t slot0 = tile->table[first / bs] * bs;
        int lo = first < span.start ? (int)(span.start - first) : 0;
        int hi = span.end - first < bs ? (int)(span.end - first) : bs;
        int easy = all_codes(st, tile, &span, first + lo, first + hi), n = 0, nd = 0;
        int staged = st->staging_of && st->staging_of[tile->table[first / bs]] >= 0;  // the block's, for each token
        for (int t = lo; t < hi && !easy; t++)
            for (int v = 0; v < MAX_VECTORS; v++)
                kind[t][v] = (unsigned char)token_kind(st, tile, v, first + t, staged);
        for (int t = lo; t < hi; t++) {  // tokens some vector reads from codes
            int any = easy;
            for (int v = 0; v < MAX_VECTORS && !any; v++) any = kind[t][v] == 1;
            if (!any) continue;
            decode_row(kl, k_head + (slot0 + t) * k_stride, st->scale, row);
            score_vectors(row, q_t, kl->width, s[n]);
            for (int v = 0; v < MAX_VECTORS && !easy; v++) s[n][v] = kind[t][v] == 1 ? s[n][v] : -INFINITY;
            decode_row(vl, v_head + (slot0 + t) * v_stride, 1.f, values + n * width);
            n++;
        }
        for (int t = lo; t < hi && !easy; t++) {  // tokens some vector reads in 16 bits
            int any = 0;
            for (int v = 0; v < MAX_VECTORS && !any; v++) any = kind[t][v] == 2;
            if (any)
                dense_row[nd] = score_dense(st, tile, first + t, kind[t], q_channels, mean_score, row, s[n + nd],
                                            &dense_v[nd]), nd++;
        }
        if (!n && !nd) continue;
        softmax_block(s, n + nd, m, l, correction);
        for (int v = 0; v < MAX_VECTORS; v++) {
            for (int d = 0; correction[v] != 1.f && d < width; d++) acc[v * width + d] *= correction[v];
            for (int d = 0; correction[v] != 1.f && d < dim; d++) dense[v * dim + d] *= correction[v];
        }
        accumulate_vectors(values, n, width, s, acc);
        for (int r = 0; r < nd; r++) {
            load_row(dense_v[r], dense_row[r], dim, st->bf16, row);
            for (int v = 0; v < MAX_VECTORS; v++)
                for (int d = 0; s[n + r][v] != 0.f && d < dim; d++) dense[v * dim + d] += s[n + r][v] * row[d];
        }
    }
    for (int v = 0; v < MAX_VECTORS; v++) {
        float inv = l[v] > 0.f ? 1.f / l[v] : 0.f;
        for (int d = 0; d < width; d++) sums[v * width + d] = acc[v * width + d] * inv;
        for (int d = 0; d < dim; d++) dense[v * dim + d] *= inv;
    }
}

static int make_layout(Layout *layout, const int32_t *ints, const float *floats, int count, int width, int bytes) {
    if (count > MAX_PIECES) return -1;
    layout->count = count;
    layout->width = width;
    layout->bytes = bytes;
    layout->by_tokens = 1;
    int total = 0;
    for (int p = 0; p < count; p++) {
        Piece *piece = &layout->pieces[p];
        piece->offset = ints[6 * p];
        piece->bits = ints[6 * p + 1];
        piece->count = ints[6 * p + 2];
        piece->norm_at = ints[6 * p + 3];
        piece->gamma_at = ints[6 * p + 4];
        piece->norm_bytes = ints[6 * p + 5];
        piece->factor = floats[17 * p];
        if (piece->bits < 1 || piece->bits > 4 || piece->count % VW || piece->norm_bytes < 1 || piece->norm_bytes > 2)
            return -1;
        make_decoder(&piece->decoder, piece->bits, floats + 17 * p + 1);
        layout->by_tokens &= VW == 16 && (piece->bits == 2 || piece->bits == 4) && piece->gamma_at < 0;
        total += piece->count;
    }
    return total == width ? 0 : -1;
}

// c [m x p] = a [m x n] @ b [n x p], row-major: 4 * VW columns at a time summed in registers (a tile rotates 32
// query vectors in and out per KV head), any columns left one by one.
static void matmul(const float *a, const float *b, int m, int n, int p, float *c) {
    for (int i = 0; i < m; i++) {
        const float *x = a + (int64_t)i * n;
        float *row = c + (int64_t)i * p;
        int j = 0;
        for (; j + 4 * VW <= p; j += 4 * VW) {
            vec acc[4] = {vzero(), vzero(), vzero(), vzero()};
            for (int k = 0; k < n; k++)
                for (int u = 0; u < 4; u++) acc[u] = vfma(vsplat(x[k]), vload(b + (int64_t)k * p + j + u * VW), acc[u]);
            for (int u = 0; u < 4; u++) vstore(row + j + u * VW, acc[u]);
        }
        for (; j < p; j++) {
            float sum = 0.f;
            for (int k = 0; k < n; k++) sum += x[k] * b[(int64_t)k * p + j];
            row[j] = sum;
        }
    }
}

// One sequence's query rows: its block table, its length after this step, its number of rows and the first's row
// in q (and in DenseTokens' own_k/own_v).
typedef struct {
    const int64_t *table;
    int64_t end, rows, row0;
} Sequence;

// Rows [first, first + count) of a sequence, KV heads [h0, h0 + heads), of q [rows, kv_heads, group, dim]: in key
// code space (rotated [count][heads][group][k_width]; NULL where they read no code) and as given (channels
// [count][heads][group][dim]).
static void queries_in(const TurboQuantAttention *a, const Sequence *seq, int64_t first, int count, int h0,
                       int heads, const float *q, float *rotated, float *channels) {
    int group = a->group, dim = a->dim, k_width = a->keys.width;
    for (int r = 0; r < count; r++)
        for (int i = 0, h = h0; i < heads; i++, h++) {
            const float *row = q + ((seq->row0 + first + r) * a->kv_heads + h) * group * dim;
            int at = (r * heads + i) * group;
            if (rotated)
                matmul(row, a->to_keys + (int64_t)h * dim * k_width, group, dim, k_width, rotated + at * k_width);
            memcpy(channels + at * dim, row, sizeof(float) * group * dim);
        }
}

// Their normalised sums, in value code space (sums [count][heads][group][v_width]; NULL where they read no code)
// and of 16-bit tokens (dense, the same order, [dim] each), rotated back into out [rows, kv_heads, group, dim].
static void sums_out(const TurboQuantAttention *a, const Sequence *seq, int64_t first, int count, int h0, int heads,
                     const float *sums, const float *dense, float *out) {
    int group = a->group, dim = a->dim, v_width = a->values.width;
    for (int r = 0; r < count; r++)
        for (int i = 0, h = h0; i < heads; i++, h++) {
            float *row = out + ((seq->row0 + first + r) * a->kv_heads + h) * group * dim;
            int at = (r * heads + i) * group;
            if (!sums) {
                memcpy(row, dense + at * dim, sizeof(float) * group * dim);
                continue;
            }
            matmul(sums + at * v_width, a->back + (int64_t)h * v_width * dim, group, v_width, dim, row);
            for (int j = 0; j < group * dim; j++) row[j] += dense[at * dim + j];
        }
}

// Rows [first, first + count) of a sequence with several (a prefill chunk, tokens to verify), as one tile against
// KV head h.
static void attend_tile_rows(const TurboQuantAttention *a, const Step *st, const Sequence *seq, int64_t first,
                             int count, int h, const float *q, float *out) {
    int group = a->group, dim = a->dim, k_width = a->keys.width;
    float rotated[MAX_VECTORS * MAX_WIDTH], channels[MAX_VECTORS * MAX_WIDTH / 2];
    float sums[MAX_VECTORS * MAX_WIDTH / 2], dense[MAX_VECTORS * MAX_WIDTH / 2];
    Tile tile = {.h = h, .table = seq->table, .own_from = seq->end - seq->rows, .own_row = seq->row0};
    int n = count * group;  // padding vectors: zero queries
    for (int v = 0; v < MAX_VECTORS; v++) {
        int64_t pos = v < n ? tile.own_from + first + v / group : -1;
        tile.qpos[v] = pos;
        tile.from[v] = a->window > 0 && pos >= a->window ? pos - a->window + 1 : 0;
    }
    float *in_codes = tile_reads_codes(st, &tile) ? rotated : NULL;
    queries_in(a, seq, first, count, h, 1, q, in_codes, channels);
    if (in_codes) memset(rotated + n * k_width, 0, sizeof(float) * (MAX_VECTORS - n) * k_width);
    memset(channels + n * dim, 0, sizeof(float) * (MAX_VECTORS - n) * dim);
    attend_tile(st, &tile, in_codes, channels, sums, dense);
    sums_out(a, seq, first, count, h, 1, in_codes ? sums : NULL, dense, out);
}

// Sequences of several query rows (a->query_start): a task per tile of up to MAX_VECTORS / group rows and KV head.
static int attend_chunks(const TurboQuantAttention *a, const Step *st, const DecodeBatch *batch, const float *q,
                         float *out) {
    const int64_t *starts = a->query_start;
    int per_tile = MAX_VECTORS / a->group;
    int64_t tiles = 0;
    for (int64_t b = 0; b < batch->batch; b++) tiles += (starts[b + 1] - starts[b] + per_tile - 1) / per_tile;
    int64_t (*task)[2] = malloc(sizeof(*task) * (tiles ? tiles : 1));  // (sequence, first row) of each tile
    if (!task) return -1;
    for (int64_t b = 0, i = 0; b < batch->batch; b++)
        for (int64_t first = 0; first < starts[b + 1] - starts[b]; first += per_tile, i++)
            task[i][0] = b, task[i][1] = first;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(batch->threads)
    for (int64_t i = 0; i < tiles; i++)
        for (int h = 0; h < a->kv_heads; h++) {
            int64_t b = task[i][0], rows = starts[b + 1] - starts[b];
            Sequence seq = {batch->block_tables + b * batch->max_blocks, batch->context_lens[b], rows, starts[b]};
            int count = rows - task[i][1] < per_tile ? (int)(rows - task[i][1]) : per_tile;
            attend_tile_rows(a, st, &seq, task[i][1], count, h, q, out);
        }
    free(task);
    return 0;
}

// KV heads per decode task: all of a sequence's, so that each block's cache lines are read once and not once per
// head (SmolLM2, tq3, 16 x 4k, two threads, the kernel alone: 1.64 -> 1.47 ms a layer), unless the longest
// sequence's task would then be more than a thread's share of the step and leave a thread idle.
static int heads_per_task(const DecodeBatch *batch, int kv_heads, int group) {
    int64_t longest = 0, total = 0;
    for (int64_t b = 0; b < batch->batch; b++) {
        longest = batch->context_lens[b] > longest ? batch->context_lens[b] : longest;
        total += batch->context_lens[b];
    }
    return kv_heads * group <= MAX_GROUP && longest * batch->threads <= total ? kv_heads : 1;
}

// A decode task: sequence b's tokens [start, stop), against `heads` KV heads. A sequence split into `parts` > 1
// tasks keeps their sums in Parts at [first_part, first_part + parts), this task's at `part`.
typedef struct {
    int64_t b, start, stop, first_part, part;
    int parts;
} DecodeTask;

// The sums of split sequences' parts until the last of a sequence's parts to finish merges them: per part, KV head
// and query head, the normalised sums (sums [v_width], dense [dim]) and the log of the softmax's denominator
// (lse); per first part and KV head, how many of those parts have finished.
typedef struct {
    float *sums, *dense, *lse;
    int *done;
} Parts;

#define MIN_PART 4  // blocks: the fewest a part reads (each part rotates its queries into code space again)
// A token read in 16 bits against one read from codes: with parts cut by token count alone, one sequence of 4,096
// tokens with tq3's window kept one thread ~20% longer than the other (the part with the window), about 4 to 1.
#define DENSE_COST 4

// The first token a decode query sees.
static int64_t first_visible(const TurboQuantAttention *a, const DecodeBatch *batch, int64_t b) {
    int64_t end = batch->context_lens[b];
    return a->window > 0 && end > a->window ? end - a->window : 0;
}

// Whether a decode task over `tk` reads any token from codes: if not (every token it sees is staged in 16 bits, as
// in Gemma 3's sliding layers, whose 512 tokens the window holds, or a short sequence's first steps), its queries
// are not rotated into code space nor its sums out of it. Gemma 3's rotations are 256 x 256 floats each way, read
// again by every sequence: its shapes at 4 x 512 tokens, all in the window, two threads, Zen 4, 0.30-0.33 -> 0.23
// ms a layer (the bf16 cache's kernel 0.22).
static int reads_codes(const Step *st, const Tokens *tk) {
    for (int64_t first = tk->start - tk->start % st->block_size; first < tk->stop; first += st->block_size) {
        Block b = block(st, tk, first);
        if (!all_dense(st, &b, tk->end)) return 1;
    }
    return 0;
}

// What reading tokens [from, to) of a sequence of `end` costs a decode task, in tokens read from codes: the window's
// (the first `sinks`, the newest `recent`) are read in 16 bits.
static int64_t cost(const Step *st, int64_t from, int64_t to, int64_t end) {
    if (!st->staging_of) return to - from;
    int64_t sinks_end = to < st->sinks ? to : st->sinks;
    sinks_end = sinks_end > from ? sinks_end : from;  // [from, sinks_end): sinks
    int64_t recent = end - st->recent > sinks_end ? end - st->recent : sinks_end;  // [recent, to): the newest
    return to - from + (DENSE_COST - 1) * (sinks_end - from + (to > recent ? to - recent : 0));
}

// Sequence b's decode tasks: parts that cost at most about `limit` each, cut at block edges, written to task
// (unless NULL) with their sums at Parts' first_part on; returns how many.
static int64_t decode_tasks(const TurboQuantAttention *a, const Step *st, const DecodeBatch *batch, int64_t b,
                            int64_t limit, int64_t first_part, DecodeTask *task) {
    int64_t start = first_visible(a, batch, b), end = batch->context_lens[b], bs = a->block_size;
    int64_t whole = cost(st, start, end, end), parts = whole <= limit ? 1 : (whole + limit - 1) / limit, n = 0;
    if (parts == 1) {
        if (task) *task = (DecodeTask){b, start, end, -1, -1, 1};
        return 1;
    }
    for (int64_t from = start, edge = start - start % bs + bs; from < end; edge += bs)
        if (edge >= end || cost(st, start, edge, end) * parts >= whole * (n + 1)) {  // part n's share reached
            if (task) task[n] = (DecodeTask){b, from, edge < end ? edge : end, first_part, first_part + n, 0};
            from = edge, n++;
        }
    for (int64_t i = 0; task && i < n; i++) task[i].parts = (int)n;
    return n;
}

// When the step's tasks, handed out in order to whichever thread is free, would finish (in cost) with parts of at
// most `limit`.
static int64_t finish(const TurboQuantAttention *a, const Step *st, const DecodeBatch *batch, int heads,
                      int64_t limit, int64_t *load) {
    int64_t last = 0;
    memset(load, 0, sizeof(int64_t) * batch->threads);
    for (int64_t b = 0; b < batch->batch; b++) {
        int64_t end = batch->context_lens[b], whole = cost(st, first_visible(a, batch, b), end, end);
        int64_t parts = whole <= limit ? 1 : (whole + limit - 1) / limit;
        for (int64_t i = 0; i < parts * (a->kv_heads / heads); i++) {
            int idle = 0;
            for (int t = 1; t < batch->threads; t++) idle = load[t] < load[idle] ? t : idle;
            load[idle] += whole / parts * heads;
            last = load[idle] > last ? load[idle] : last;
        }
    }
    return last;
}

// The most a decode task costs (cost). A task per sequence and KV head group can leave threads idle for most of
// the step (one sequence on SmolLM2's 3 KV heads is 3 tasks for 2 threads, one on Gemma 3's single KV head 1):
// then sequences are split into parts of at most 1/k of a thread's even share, k the least of 1..4 that finishes
// within 10% of the even share. The parts' sums merge by their denominators, so a split sequence's attention
// differs from the unsplit one in rounding.
static int64_t part_limit(const TurboQuantAttention *a, const Step *st, const DecodeBatch *batch, int heads) {
    int threads = batch->threads, groups = a->kv_heads / heads;
    int64_t total = 0, bs = a->block_size, best = INT64_MAX, best_finish = INT64_MAX;
    if (threads < 2 || batch->batch * groups >= 4 * threads) return INT64_MAX;  // tasks enough to even out
    int64_t *load = malloc(sizeof(int64_t) * threads);
    if (!load) return INT64_MAX;
    for (int64_t b = 0; b < batch->batch; b++)
        total += cost(st, first_visible(a, batch, b), batch->context_lens[b], batch->context_lens[b]) * a->kv_heads;
    for (int k = 0; k <= 4; k++) {
        int64_t limit = k ? total / ((int64_t)k * threads * heads) : INT64_MAX;
        limit = limit > MIN_PART * bs ? limit : MIN_PART * bs;
        int64_t last = finish(a, st, batch, heads, limit, load);
        if (last < best_finish) best = limit, best_finish = last;
        if (last * 10 * threads <= total * 11) break;
    }
    free(load);
    return best;
}

// The parts of t's sequence merged for KV heads [h0, h0 + heads): each part's normalised sums weighted by its share
// of the whole softmax's denominator, the parts in order (the same bits whichever part finished last).
static void merge_parts(const TurboQuantAttention *a, const Parts *p, const DecodeTask *t, int h0, int heads,
                        float *sums, float *dense) {
    int width = a->values.width, dim = a->dim;
    int64_t step = (int64_t)a->kv_heads * a->group;  // from a part's vector to the next part's
    for (int v = 0; v < heads * a->group; v++) {
        int64_t first = (t->first_part * a->kv_heads + h0) * a->group + v;
        float top = -INFINITY, total = 0.f;
        for (int i = 0; i < t->parts; i++) top = p->lse[first + i * step] > top ? p->lse[first + i * step] : top;
        memset(sums + v * width, 0, sizeof(float) * width);
        memset(dense + v * dim, 0, sizeof(float) * dim);
        for (int i = 0; i < t->parts && top > -INFINITY; i++) {
            int64_t at = first + i * step;
            float w = expf(p->lse[at] - top);
            total += w;
            for (int d = 0; d < width; d++) sums[v * width + d] += w * p->sums[at * width + d];
            for (int d = 0; d < dim; d++) dense[v * dim + d] += w * p->dense[at * dim + d];
        }
        float inv = total > 0.f ? 1.f / total : 0.f;
        for (int d = 0; d < width; d++) sums[v * width + d] *= inv;
        for (int d = 0; d < dim; d++) dense[v * dim + d] *= inv;
    }
}

// One decode task over KV heads [h0, h0 + heads): a whole sequence's attention written out, or one part's sums
// kept, the last part of the sequence to finish merging them and writing them out.
static void decode_task(const TurboQuantAttention *a, const Step *st, AttendFn *attend, const DecodeBatch *batch,
                        const DecodeTask *t, int h0, int heads, const Parts *parts, const float *q, float *out) {
    int group = a->group, dim = a->dim, v_width = a->values.width;
    float rotated[MAX_GROUP * MAX_WIDTH], channels[MAX_GROUP * MAX_WIDTH / 2];
    float sums[MAX_GROUP * MAX_WIDTH / 2], dense[MAX_GROUP * MAX_WIDTH / 2];
    Sequence seq = {batch->block_tables + t->b * batch->max_blocks, batch->context_lens[t->b], 1, t->b};
    Tokens tk = {seq.table, t->start, t->stop, seq.end};
    int codes = reads_codes(st, &tk);
    queries_in(a, &seq, 0, 1, h0, heads, q, codes ? rotated : NULL, channels);
    if (t->parts == 1) {
        attend(st, t->b, h0, heads, rotated, channels, &tk, sums, dense, NULL);
        sums_out(a, &seq, 0, 1, h0, heads, codes ? sums : NULL, dense, out);
        return;
    }
    int64_t v0 = (t->part * a->kv_heads + h0) * group;
    attend(st, t->b, h0, heads, rotated, channels, &tk, parts->sums + v0 * v_width, parts->dense + v0 * dim,
           parts->lse + v0);
    // acquire and release: the last to count sees every other part's sums
    if (__atomic_add_fetch(parts->done + t->first_part * a->kv_heads + h0, 1, __ATOMIC_ACQ_REL) < t->parts) return;
    merge_parts(a, parts, t, h0, heads, sums, dense);
    Tokens all = {seq.table, first_visible(a, batch, t->b), seq.end, seq.end};
    sums_out(a, &seq, 0, 1, h0, heads, reads_codes(st, &all) ? sums : NULL, dense, out);
}

// One query row per sequence: a task per sequence, or part of one (part_limit), and KV head group.
static int attend_decode(const TurboQuantAttention *a, const Step *st, AttendFn *attend, const DecodeBatch *batch,
                         const float *q, float *out) {
    int kv_heads = a->kv_heads, heads = heads_per_task(batch, kv_heads, a->group);
    int64_t limit = part_limit(a, st, batch, heads), tasks = 0, split = 0;
    for (int64_t b = 0; b < batch->batch; b++) {
        int64_t n = decode_tasks(a, st, batch, b, limit, 0, NULL);
        tasks += n;
        split += n > 1 ? n : 0;
    }
    int64_t vectors = split * kv_heads * a->group;
    DecodeTask *task = malloc(sizeof(*task) * (tasks ? tasks : 1));
    Parts parts = {0};
    if (split) {
        parts.sums = malloc(sizeof(float) * vectors * (a->values.width + a->dim + 1));
        parts.dense = parts.sums + vectors * a->values.width;
        parts.lse = parts.dense + vectors * a->dim;
        parts.done = calloc(split * kv_heads, sizeof(int));
    }
    if (!task || (split && (!parts.sums || !parts.done))) {
        free(task), free(parts.sums), free(parts.done);
        return -1;
    }
    for (int64_t b = 0, i = 0, first_part = 0; b < batch->batch; b++) {
        int64_t n = decode_tasks(a, st, batch, b, limit, first_part, task + i);
        i += n;
        first_part += n > 1 ? n : 0;
    }
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(batch->threads)
    for (int64_t i = 0; i < tasks; i++)
        for (int h = 0; h < kv_heads; h += heads)
            decode_task(a, st, attend, batch, &task[i], h, heads, &parts, q, out);
    free(task), free(parts.sums), free(parts.done);
    return 0;
}

// The layer's row layouts, or -1 where a shape or layout is beyond this kernel.
static int layouts(const TurboQuantAttention *a, Layout *keys, Layout *values) {
    const CodeRows *k = &a->keys, *v = &a->values;
    if (make_layout(keys, k->pieces, k->values, k->count, k->width, k->bytes) ||
        make_layout(values, v->pieces, v->values, v->count, v->width, v->bytes))
        return -1;
    return a->group > MAX_GROUP || k->width > MAX_WIDTH || v->width > MAX_WIDTH / 2 || a->dim > MAX_WIDTH / 2 ||
                   a->block_size > MAX_BLOCK
               ? -1
               : 0;
}

// 0 where turboquant_paged_attention serves this layer, else -1: asked before a caller that cannot fall back
// (decoder_layer.c) takes it.
int turboquant_attention_fits(const TurboQuantAttention *a) {
    Layout keys, values;
    return layouts(a, &keys, &values);
}

// q, out: [query rows, kv_heads, group, dim] float32, each sequence's rows in order (a->query_start; NULL: one
// each). Returns 0, or -1 when a shape or layout is beyond this kernel (caller falls back).
int turboquant_paged_attention(const TurboQuantAttention *a, const DecodeBatch *batch, const float *q, float *out) {
    const DenseTokens none = {0}, *tokens = a->dense ? a->dense : &none;
    Step st = {.k = a->keys.cache, .v = a->values.cache, .heads = a->kv_heads, .group = a->group, .dim = a->dim,
               .block_size = a->block_size, .scale = a->scale, .staging_of = tokens->staging_of,
               .staged_k = tokens->staged_k, .staged_v = tokens->staged_v, .own_k = tokens->own_k,
               .own_v = tokens->own_v, .bf16 = tokens->bf16, .recent = tokens->recent, .sinks = tokens->sinks,
               .key_mean = tokens->key_mean};
    if (layouts(a, &st.keys, &st.values)) return -1;
    AttendFn *const specialised[] = {attend_group, attend_1, attend_2, attend_3, attend_4};
    if (a->query_start) return attend_chunks(a, &st, batch, q, out);
    return attend_decode(a, &st, specialised[a->group <= 4 ? a->group : 0], batch, q, out);
}

// The first `length` tokens of one sequence (block table `table`) as code-space rows, out [heads][length][width],
// float32 or (bf16 = 1) bf16: what a long prefill chunk's queries and weights meet in one GEMM each
// (attention/turboquant.py, expanded_prefill). Returns 0, or -1 for a row layout beyond the decoders.
int turboquant_expand(const CodeRows *rows, const int64_t *table, int64_t length, int32_t heads, int32_t block_size,
                      int32_t bf16, void *out, int32_t threads) {
    Layout l;
    if (rows->width > MAX_WIDTH || make_layout(&l, rows->pieces, rows->values, rows->count, rows->width, rows->bytes))
        return -1;
    int64_t blocks = (length + block_size - 1) / block_size;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int h = 0; h < heads; h++)
        for (int64_t b = 0; b < blocks; b++) {
            float row[MAX_WIDTH];
            for (int64_t pos = b * block_size; pos < (b + 1) * block_size && pos < length; pos++) {
                int64_t slot = table[b] * block_size + pos % block_size, at = (h * length + pos) * l.width;
                const uint8_t *src = rows->cache + (slot * heads + h) * l.bytes;
                if (!bf16) {
                    decode_row(&l, src, 1.f, (float *)out + at);
                    continue;
                }
                decode_row(&l, src, 1.f, row);
                for (int i = 0; i < l.width; i++) ((uint16_t *)out)[at + i] = float_to_bf16(row[i]);
            }
        }
    return 0;
}
