// Attention over a paged bf16 or float32 KV cache, each query row over its own sequence's tokens as the last of
// them: decode tokens, and on batch-invariant backends a prefill chunk's queries too.
//
// Cache layout (kvcache/cache.py): [kv_heads, num_blocks, block_size, head_dim], bf16 or float32; the queries
// bf16 or float32 (a float32 model's), whichever the cache is.
// Each (tile, KV head) pair is one task: a tile is a decode token, or up to MAX_VECTORS / G consecutive
// queries of one sequence, whose G = q_heads / kv_heads query heads each walk the sequence's blocks
// once, with an online softmax (running max and sum, rescaled per block), so every key and value row
// is read once per tile, only up to the sequence's own length, and nothing is gathered or padded.
// Scores, softmax and the value sum stay in float32. Keys are scored 16 at a time, transposed in
// registers so that one FMA takes a channel of 16 keys (no horizontal sums), and the value sums of
// 64 channels stay in registers over a block's rows. 4k-token prompts, one thread, 512 queries
// per call: SmolLM2's shape 135 -> 77 ms, Gemma 3's (MQA, head size 256) 168 -> 99 ms against
// one dot product and one horizontal sum per (query head, key) (cpu model 207, no AVX512-BF16).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "decode_batch.h"
#include "vector_math.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_BLOCK 64
#define MAX_VECTORS 32  // query vectors (rows x the KV head's query heads) of one task

// One layer's cache and the shape of its attention.
typedef struct {
    const void *k_cache, *v_cache;  // [kv_heads, num_blocks, block_size, head_dim]
    int64_t num_blocks, window;     // window > 0 limits each query to its last `window` tokens
    int32_t block_size, q_heads, kv_heads, head_dim;
    float scale;
    int32_t q_float32, kv_float32;  // the queries' (and outputs') and the cache's elements: float32 (1) or bf16 (0)
} PagedAttention;

// Read by backends/cpu/abi.py: the per-task buffers' limits (backends/cpu/decode_stack.py checks shapes against
// them before a call), and the sizes its mirrors of the structs are checked against.
const int32_t paged_attention_max_group = MAX_GROUP, paged_attention_max_head_dim = MAX_DIM,
              paged_attention_max_block = MAX_BLOCK;
const int32_t sizeof_PagedAttention = sizeof(PagedAttention), sizeof_DecodeBatch = sizeof(DecodeBatch);

// e^x for x <= 0 (softmax exponents after the max is taken off), in a form gcc vectorizes:
// 2^n * e^r with |r| <= ln2/2, e^r by its degree-6 Taylor polynomial (relative error < 2e-7).
static inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    float n = __builtin_roundf(x * 1.44269504f);
    float r = x - n * 0.693147181f;
    float p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (int32_t)n << 23;
    memcpy(&p, &bits, sizeof p);
    return p;
}

// A query's or a transposed key's lane. With bf16 dot products and both operands bf16 (`pairs`), two channels:
// a query as its channel pairs, 16 keys as their pairs transposed, so that one vdpbf16ps scores two channels of 16
// keys (half the FMAs of widened keys, and nothing widened), the scale multiplying the sums; Zen 4, one core, 512
// queries of one prompt: SmolLM2's shape 5.1-5.2 -> 4.7 ms, Gemma 3's 7.2-7.3 -> 6.0-6.2. Otherwise one float32
// channel, the query's times the scale.
typedef union {
    float f;
    uint32_t pair;
} Lane;

// A call's element types: its queries (and outputs) and its cache are each bf16 (0) or float32 (1). The flags are
// constants wherever the kernels below are inlined, so each combination compiles to code of its own.
static inline int lanes_are_pairs(int q_f32, int kv_f32) {
#if defined(__AVX512BF16__)
    return !q_f32 && !kv_f32;
#else
    (void)q_f32, (void)kv_f32;
    return 0;
#endif
}

static inline float element(const void *p, int64_t i, int f32) {
    return f32 ? ((const float *)p)[i] : bf16_to_float(((const uint16_t *)p)[i]);
}

static inline const void *elements_at(const void *p, int64_t i, int f32) {
    return (const char *)p + i * (f32 ? sizeof(float) : sizeof(uint16_t));
}

// A query's lanes from its channels.
static inline void query_lanes(const void *q, int q_f32, int pairs, int dim, float scale, Lane *out) {
    if (pairs) {
        memcpy(out, q, sizeof(uint16_t) * dim);
        return;
    }
    for (int d = 0; d < dim; d++) out[d].f = element(q, d, q_f32) * scale;
}

// Keys [c, c + 16) of a block transposed into lanes, kt[l][j] = lane l of key c + j, so that one vector op
// scores 16 keys; keys outside [low, high) are zero (they may lie beyond the block).
static inline void transposed_keys(const void *kb, int kv_f32, int pairs, int c, int low, int high, int dim,
                                   Lane kt[][16]) {
#if defined(__AVX512F__)
    if (kv_f32 && dim % 16 == 0) {  // 16 channels of 16 keys transposed
        for (int dc = 0; dc < dim; dc += 16) {
            __m512 r[16];
            for (int j = 0; j < 16; j++)
                r[j] = c + j >= low && c + j < high ? _mm512_loadu_ps((const float *)kb + (int64_t)(c + j) * dim + dc)
                                                    : _mm512_setzero_ps();
            transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_storeu_ps((float *)kt[dc + i], r[i]);
        }
        return;
    }
    if (!kv_f32 && dim % 32 == 0) {  // 32 channels of 16 keys as 16 x 16 dwords (channel pairs) transposed
        const uint16_t *k16 = kb;
        for (int dc = 0; dc < dim; dc += 32) {
            __m512 r[16];
            for (int j = 0; j < 16; j++)
                r[j] = c + j >= low && c + j < high ? _mm512_loadu_ps(k16 + (int64_t)(c + j) * dim + dc)
                                                    : _mm512_setzero_ps();
            transpose16(r);
            for (int i = 0; i < 16; i++) {  // the pair's low half is the even channel
                if (pairs) {
                    _mm512_storeu_ps((float *)kt[dc / 2 + i], r[i]);
                    continue;
                }
                __m512i pair = _mm512_castps_si512(r[i]);
                _mm512_storeu_ps((float *)kt[dc + 2 * i], _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)));
                _mm512_storeu_ps((float *)kt[dc + 2 * i + 1],
                                 _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32((int)0xFFFF0000))));
            }
        }
        return;
    }
#endif
    for (int j = 0; j < 16; j++) {
        int64_t key = (int64_t)(c + j) * dim;
        int inside = c + j >= low && c + j < high;
        if (pairs) {
            const uint16_t *k16 = kb;
            for (int l = 0; l < dim / 2; l++)
                kt[l][j].pair = inside ? k16[key + 2 * l] | (uint32_t)k16[key + 2 * l + 1] << 16 : 0;
        } else {
            for (int d = 0; d < dim; d++) kt[d][j].f = inside ? element(kb, key + d, kv_f32) : 0.f;
        }
    }
}

// s[i][0..16) = the scores of query vectors q[i] (i < n) against 16 transposed keys: the lanes l = j mod 4
// summed in order for each j, one vector op per lane, then the four sums pairwise, so a score's bits do not
// depend on which other vectors share the call (batch invariance); 4n chains interleaved hide the latency
// and keep each short (with two chains of 32, SmolLM2's as-stored prompt logprobs moved 0.51 from float32
// transformers at most, against 0.40 before this kernel and 0.37 now). Inlined per constant n. (dim % 4 == 0:
// the callers check it.)
static inline __attribute__((always_inline)) void scores16(const Lane *const *q, const Lane kt[][16], int dim,
                                                           float scale, float *const *s, const int n,
                                                           const int pairs) {
#if defined(__AVX512BF16__)
    if (pairs) {
        __m512 acc[4][4];  // [vector][lane mod 4]
        for (int i = 0; i < n; i++)
            for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
        int l = 0;
        for (; l + 4 <= dim / 2; l += 4)
            for (int j = 0; j < 4; j++) {
                __m512bh k = (__m512bh)_mm512_loadu_si512(kt[l + j]);
                for (int i = 0; i < n; i++)
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)_mm512_set1_epi32((int)q[i][l + j].pair), k);
            }
        for (; l < dim / 2; l++) {  // dim % 8 == 4
            __m512bh k = (__m512bh)_mm512_loadu_si512(kt[l]);
            for (int i = 0; i < n; i++)
                acc[i][l % 4] = _mm512_dpbf16_ps(acc[i][l % 4], (__m512bh)_mm512_set1_epi32((int)q[i][l].pair), k);
        }
        for (int i = 0; i < n; i++)
            _mm512_storeu_ps(s[i], _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(acc[i][0], acc[i][2]),
                                                               _mm512_add_ps(acc[i][1], acc[i][3])),
                                                 _mm512_set1_ps(scale)));
        return;
    }
#else
    (void)scale, (void)pairs;
#endif
#if defined(__AVX512F__)
    __m512 acc[4][4];  // [vector][channel mod 4]
    for (int i = 0; i < n; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    for (int d = 0; d < dim; d += 4)
        for (int j = 0; j < 4; j++) {
            __m512 k = _mm512_loadu_ps((const float *)kt[d + j]);
            for (int i = 0; i < n; i++) acc[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(q[i][d + j].f), k, acc[i][j]);
        }
    for (int i = 0; i < n; i++)
        _mm512_storeu_ps(s[i],
                         _mm512_add_ps(_mm512_add_ps(acc[i][0], acc[i][2]), _mm512_add_ps(acc[i][1], acc[i][3])));
#elif defined(__AVX2__)
    // 16 keys as two halves of 8 lanes; two vectors share each key load (the plain loop below loads a key for every
    // multiply, and AVX2's 16 registers hold no more), each summing its even and its odd channels apart. With the
    // value sums below held in registers, SmolLM2's shape at 16 x 4k decode tokens, one thread, AMD Zen 3: a bf16
    // cache 42-44 -> 18-22 ms a call, a float32 one 57-63 -> 25-31 (what is left waits on memory).
    for (int i = 0; i < n; i += 2) {
        const int both = i + 1 < n;
        __m256 acc[2][2][2];  // [vector][channel mod 2][half]
        for (int v = 0; v < 2; v++)
            for (int j = 0; j < 2; j++) acc[v][j][0] = acc[v][j][1] = _mm256_setzero_ps();
        for (int d = 0; d < dim; d += 2)
            for (int j = 0; j < 2; j++) {
                __m256 lo = _mm256_loadu_ps(&kt[d + j][0].f), hi = _mm256_loadu_ps(&kt[d + j][8].f);
                for (int v = 0; v <= both; v++) {
                    __m256 b = _mm256_set1_ps(q[i + v][d + j].f);
                    acc[v][j][0] = _mm256_fmadd_ps(b, lo, acc[v][j][0]);
                    acc[v][j][1] = _mm256_fmadd_ps(b, hi, acc[v][j][1]);
                }
            }
        for (int v = 0; v <= both; v++) {
            _mm256_storeu_ps(s[i + v], _mm256_add_ps(acc[v][0][0], acc[v][1][0]));
            _mm256_storeu_ps(s[i + v] + 8, _mm256_add_ps(acc[v][0][1], acc[v][1][1]));
        }
    }
#else
    for (int i = 0; i < n; i++) {
        float acc[4][16] = {{0.f}};
        for (int d = 0; d < dim; d += 4)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 16; l++) acc[j][l] += q[i][d + j].f * kt[d + j][l].f;
        for (int l = 0; l < 16; l++) s[i][l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
#endif
}

// scores16 over `count` vectors, four at a time
static inline void scores_of(const Lane *const *q, const Lane kt[][16], int dim, float scale, float *const *s,
                             int count, int pairs) {
    int i = 0;
    for (; i + 4 <= count; i += 4) scores16(q + i, kt, dim, scale, s + i, 4, pairs);
    switch (count - i) {
        case 3: scores16(q + i, kt, dim, scale, s + i, 3, pairs); break;
        case 2: scores16(q + i, kt, dim, scale, s + i, 2, pairs); break;
        case 1: scores16(q + i, kt, dim, scale, s + i, 1, pairs); break;
    }
}

// acc += the sum of p[t] * value row t over [lo, hi): per channel in the order of t, as a decode token's alone
// (batch invariance), 64 channels at a time held in registers over the rows.
static inline void add_values(float *acc, const float *p, const float vf[][MAX_DIM], int lo, int hi, int dim) {
#if defined(__AVX512F__)
    if (dim % 64 == 0) {
        for (int dc = 0; dc < dim; dc += 64) {
            __m512 a[4];
            for (int i = 0; i < 4; i++) a[i] = _mm512_loadu_ps(acc + dc + 16 * i);
            for (int t = lo; t < hi; t++) {
                __m512 weight = _mm512_set1_ps(p[t]);
                for (int i = 0; i < 4; i++)
                    a[i] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(vf[t] + dc + 16 * i), a[i]);
            }
            for (int i = 0; i < 4; i++) _mm512_storeu_ps(acc + dc + 16 * i, a[i]);
        }
        return;
    }
#elif defined(__AVX2__)
    if (dim % 64 == 0) {
        for (int dc = 0; dc < dim; dc += 64) {
            __m256 a[8];
            for (int i = 0; i < 8; i++) a[i] = _mm256_loadu_ps(acc + dc + 8 * i);
            for (int t = lo; t < hi; t++) {
                __m256 weight = _mm256_set1_ps(p[t]);
                for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(vf[t] + dc + 8 * i), a[i]);
            }
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + dc + 8 * i, a[i]);
        }
        return;
    }
#endif
    for (int t = lo; t < hi; t++)
        for (int d = 0; d < dim; d++) acc[d] += p[t] * vf[t][d];
}

// `rows` consecutive query rows of one sequence: row r's `group` query heads (q + r * q_stride) attend
// over its tokens [start, ends[r]) (start: 0, or the last `window`). Each key and value row is widened
// (keys also transposed) once and used by every query vector of the tile that reads it; each vector's scores,
// softmax and sums are the same operations, in the same order, whatever else the tile holds (a row
// computed alone, as a decode token, gives the same bits). Always inlined so that the callers below
// compile it once per common head size and element types (q_f32, kv_f32: lanes_are_pairs).
static inline __attribute__((always_inline)) void attend_rows(const void *q, int64_t q_stride, const void *k_head,
                                                              const void *v_head, const int64_t *table,
                                                              const int64_t *ends, int rows, int64_t window,
                                                              void *out, int group, int dim, int block_size,
                                                              float scale, int q_f32, int kv_f32) {
    Lane qf[MAX_VECTORS][MAX_DIM], kt[MAX_DIM][16];
    float acc[MAX_VECTORS][MAX_DIM], m[MAX_VECTORS], l[MAX_VECTORS], s[MAX_VECTORS][MAX_BLOCK + 16];
    float vf[MAX_BLOCK][MAX_DIM];
    int64_t start[MAX_VECTORS], from = INT64_MAX, to = 0;
    int pairs = lanes_are_pairs(q_f32, kv_f32);
    for (int r = 0; r < rows; r++) {
        start[r] = window > 0 && ends[r] > window ? ends[r] - window : 0;
        from = start[r] - start[r] % block_size < from ? start[r] - start[r] % block_size : from;
        to = ends[r] > to ? ends[r] : to;
        for (int g = 0; g < group; g++) {
            int v = r * group + g;
            query_lanes(elements_at(q, r * q_stride + g * dim, q_f32), q_f32, pairs, dim, scale, qf[v]);
            for (int d = 0; d < dim; d++) acc[v][d] = 0.f;
            m[v] = -INFINITY;
            l[v] = 0.f;
        }
    }
    int64_t block_stride = (int64_t)block_size * dim, block_bytes = block_stride * (kv_f32 ? 4 : 2);
    for (int64_t first = from; first < to; first += block_size) {
        int64_t block = table[first / block_size];
        const void *kb = elements_at(k_head, block * block_stride, kv_f32),
                   *vb = elements_at(v_head, block * block_stride, kv_f32);
        if (rows == 1 && first + block_size < to) {  // a decode token's blocks lie anywhere in the cache, and its
            // work per block is too short to hide their latency: fetch the next one's rows while this one is worked
            int64_t next = table[first / block_size + 1] * block_bytes;
            for (int64_t i = 0; i < block_bytes; i += 64) {
                __builtin_prefetch((const char *)k_head + next + i);
                __builtin_prefetch((const char *)v_head + next + i);
            }
        }
        int lo[MAX_VECTORS], hi[MAX_VECTORS], low = block_size, high = 0;
        for (int r = 0; r < rows; r++) {  // an empty [lo, hi): the block is not the row's
            int inside = first >= start[r] - start[r] % block_size && first < ends[r];
            lo[r] = first < start[r] ? (int)(start[r] - first) : 0;
            hi[r] = !inside ? lo[r] : ends[r] - first < block_size ? (int)(ends[r] - first) : block_size;
            low = lo[r] < hi[r] && lo[r] < low ? lo[r] : low;
            high = hi[r] > high ? hi[r] : high;
        }
        for (int c = low - low % 16; c < high; c += 16) {
            transposed_keys(kb, kv_f32, pairs, c, low, high, dim, kt);
            const Lane *qs[MAX_VECTORS];
            float *ss[MAX_VECTORS];
            int n = 0;
            for (int v = 0; v < rows * group; v++) {  // the vectors whose tokens this chunk holds
                int r = v / group;
                if (lo[r] < hi[r] && hi[r] > c && lo[r] < c + 16) qs[n] = qf[v], ss[n++] = s[v] + c;
            }
            scores_of(qs, (const Lane(*)[16])kt, dim, scale, ss, n, pairs);
        }
        for (int r = 0; r < rows; r++) {
            if (lo[r] >= hi[r]) continue;
            for (int g = 0; g < group; g++) {
                int v = r * group + g;
                float block_max = m[v];
                for (int t = lo[r]; t < hi[r]; t++) block_max = s[v][t] > block_max ? s[v][t] : block_max;
                float correction = l[v] > 0.f ? exp_nonpositive(m[v] - block_max) : 0.f;
                m[v] = block_max;
                float sum = 0.f;
                for (int t = lo[r]; t < hi[r]; t++) {
                    s[v][t] = exp_nonpositive(s[v][t] - block_max);
                    sum += s[v][t];
                }
                l[v] = l[v] * correction + sum;
                for (int d = 0; d < dim; d++) acc[v][d] *= correction;
            }
        }
        for (int t = low; t < high; t++)
            for (int d = 0; d < dim; d++) vf[t][d] = element(vb, (int64_t)t * dim + d, kv_f32);
        for (int v = 0; v < rows * group; v++)
            if (lo[v / group] < hi[v / group]) add_values(acc[v], s[v], (const float(*)[MAX_DIM])vf, lo[v / group],
                                                          hi[v / group], dim);
    }
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < group; g++) {
            int v = r * group + g;
            float inv = l[v] > 0.f ? 1.f / l[v] : 0.f;
            int64_t at = r * q_stride + g * dim;
            for (int d = 0; d < dim; d++) {
                if (q_f32)
                    ((float *)out)[at + d] = acc[v][d] * inv;
                else
                    ((uint16_t *)out)[at + d] = float_to_bf16(acc[v][d] * inv);
            }
        }
}

// attend_rows with constant head sizes where they are common, so that the compiler unrolls the row loops
static inline __attribute__((always_inline)) void attend_task(const void *q, int64_t q_stride, const void *k,
                                                              const void *v, const int64_t *table,
                                                              const int64_t *ends, int rows, int64_t window,
                                                              void *out, int group, int dim, int block_size,
                                                              float scale, int q_f32, int kv_f32) {
    if (dim == 64)
        attend_rows(q, q_stride, k, v, table, ends, rows, window, out, group, 64, block_size, scale, q_f32, kv_f32);
    else if (dim == 128)
        attend_rows(q, q_stride, k, v, table, ends, rows, window, out, group, 128, block_size, scale, q_f32, kv_f32);
    else
        attend_rows(q, q_stride, k, v, table, ends, rows, window, out, group, dim, block_size, scale, q_f32, kv_f32);
}

// Batch rows that are consecutive tokens of one sequence (a prefill chunk's queries, each with its
// sequence's block table and one token more than the row before) share a task, up to `most` rows;
// other rows (decode tokens) are tasks of their own. Returns the number of tiles written.
static int64_t tiles_of(const int64_t *tables, const int64_t *lens, int batch, int max_blocks, int block_size,
                        int most, int64_t *tiles) {
    int64_t count = 0;
    for (int b = 0; b < batch;) {
        int n = 1;
        while (b + n < batch && n < most && lens[b + n] == lens[b + n - 1] + 1 &&
               !memcmp(tables + (int64_t)(b + n) * max_blocks, tables + (int64_t)b * max_blocks,
                       sizeof(int64_t) * ((lens[b + n] + block_size - 1) / block_size)))
            n++;
        tiles[2 * count] = b, tiles[2 * count + 1] = n, count++;
        b += n;
    }
    return count;
}

// q, out: [batch, q_heads, dim], float32 where q_f32 else bf16; the caches [kv_heads, num_blocks, block_size, dim],
// float32 where kv_f32 else bf16; block_tables: [batch, max_blocks]; context_lens: [batch].
// window > 0 limits each query to its last `window` tokens (sliding-window layers).
// Returns 0, or -1 when a shape exceeds the fixed per-task buffers (caller falls back) or memory runs out.
// Positional, for C callers: decoder_layer.c includes this file and calls it directly.
static int paged_attention_typed(const void *q, const void *k_cache, const void *v_cache, const int64_t *block_tables,
                                 const int64_t *context_lens, void *out, int batch, int q_heads, int kv_heads, int dim,
                                 int64_t num_blocks, int block_size, int max_blocks, float scale, int64_t window,
                                 int threads, int q_f32, int kv_f32) {
    int group = q_heads / kv_heads;
    if (group > MAX_GROUP || dim > MAX_DIM || dim % 4 || block_size > MAX_BLOCK) return -1;
    int64_t *tiles = malloc(sizeof(int64_t) * 2 * (batch > 0 ? batch : 1));
    if (!tiles) return -1;
    int64_t count = tiles_of(block_tables, context_lens, batch, max_blocks, block_size, MAX_VECTORS / group, tiles);
    int64_t head_stride = num_blocks * block_size * dim, q_stride = (int64_t)q_heads * dim;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < count; i++) {
        for (int h = 0; h < kv_heads; h++) {
            int64_t b = tiles[2 * i], at = b * q_stride + (int64_t)h * group * dim;
            int rows = (int)tiles[2 * i + 1];
            const int64_t *table = block_tables + b * max_blocks, *ends = context_lens + b;
            const void *k = elements_at(k_cache, h * head_stride, kv_f32), *v = elements_at(v_cache, h * head_stride, kv_f32);
            const void *qa = elements_at(q, at, q_f32);
            void *oa = (void *)elements_at(out, at, q_f32);
            if (!q_f32 && !kv_f32)
                attend_task(qa, q_stride, k, v, table, ends, rows, window, oa, group, dim, block_size, scale, 0, 0);
            else if (!kv_f32)
                attend_task(qa, q_stride, k, v, table, ends, rows, window, oa, group, dim, block_size, scale, 1, 0);
            else if (q_f32)
                attend_task(qa, q_stride, k, v, table, ends, rows, window, oa, group, dim, block_size, scale, 1, 1);
            else
                attend_task(qa, q_stride, k, v, table, ends, rows, window, oa, group, dim, block_size, scale, 0, 1);
        }
    }
    free(tiles);
    return 0;
}

// The entry point for Python: q, out: [batch->batch, a->q_heads, a->head_dim], of the types a names. Returns 0, or
// -1 as above.
int paged_decode_attention(const PagedAttention *a, const DecodeBatch *b, const void *q, void *out) {
    return paged_attention_typed(q, a->k_cache, a->v_cache, b->block_tables, b->context_lens, out, (int)b->batch,
                                 a->q_heads, a->kv_heads, a->head_dim, a->num_blocks, a->block_size, b->max_blocks,
                                 a->scale, a->window, b->threads, a->q_float32, a->kv_float32);
}
