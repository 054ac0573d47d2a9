// Decode attention over a paged bf16 KV cache: one query token per sequence.
//
// Cache layout (kvcache/cache.py): [kv_heads, num_blocks, block_size, head_dim], bf16.
// Each (sequence, KV head) pair is one task: its G = q_heads / kv_heads query heads walk the
// sequence's blocks once, with an online softmax (running max and sum, rescaled per block), so
// every key and value row is read once per step, only up to the sequence's own length, and
// nothing is gathered or padded. Scores, softmax and the value sum stay in float32.
#include <math.h>
#include <string.h>

#include "bf16.h"
#include "decode_batch.h"

#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_BLOCK 64

// One layer's bf16 cache and the shape of its attention.
typedef struct {
    const uint16_t *k_cache, *v_cache;  // [kv_heads, num_blocks, block_size, head_dim]
    int64_t num_blocks, window;         // window > 0 limits each query to its last `window` tokens
    int32_t block_size, q_heads, kv_heads, head_dim;
    float scale;
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

// Each key and value row is widened to float32 once and used by all `group` query heads.
// Always inlined so that the callers below compile it once per common head size.
static inline __attribute__((always_inline)) void attend_one(const uint16_t *q, const uint16_t *k_head, const uint16_t *v_head, const int64_t *table,
                       int64_t start, int64_t end, uint16_t *out, int group, int dim, int block_size,
                       float scale) {
    float qf[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], m[MAX_GROUP], l[MAX_GROUP];
    float s[MAX_GROUP][MAX_BLOCK], row[MAX_DIM];
    for (int g = 0; g < group; g++) {
        for (int d = 0; d < dim; d++) {
            qf[g][d] = bf16_to_float(q[g * dim + d]) * scale;
            acc[g][d] = 0.f;
        }
        m[g] = -INFINITY;
        l[g] = 0.f;
    }
    int64_t block_stride = (int64_t)block_size * dim;
    for (int64_t first = start - start % block_size; first < end; first += block_size) {
        int64_t block = table[first / block_size];
        const uint16_t *kb = k_head + block * block_stride, *vb = v_head + block * block_stride;
        int lo = first < start ? (int)(start - first) : 0;
        int hi = end - first < block_size ? (int)(end - first) : block_size;
        for (int t = lo; t < hi; t++) {
            for (int d = 0; d < dim; d++) row[d] = bf16_to_float(kb[(int64_t)t * dim + d]);
            for (int g = 0; g < group; g++) {
                float dot = 0.f;
                for (int d = 0; d < dim; d++) dot += qf[g][d] * row[d];
                s[g][t] = dot;
            }
        }
        for (int g = 0; g < group; g++) {
            float block_max = m[g];
            for (int t = lo; t < hi; t++) block_max = s[g][t] > block_max ? s[g][t] : block_max;
            float correction = l[g] > 0.f ? exp_nonpositive(m[g] - block_max) : 0.f;
            m[g] = block_max;
            float sum = 0.f;
            for (int t = lo; t < hi; t++) {
                s[g][t] = exp_nonpositive(s[g][t] - block_max);
                sum += s[g][t];
            }
            l[g] = l[g] * correction + sum;
            for (int d = 0; d < dim; d++) acc[g][d] *= correction;
        }
        for (int t = lo; t < hi; t++) {
            for (int d = 0; d < dim; d++) row[d] = bf16_to_float(vb[(int64_t)t * dim + d]);
            for (int g = 0; g < group; g++) {
                float p = s[g][t];
                for (int d = 0; d < dim; d++) acc[g][d] += p * row[d];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int d = 0; d < dim; d++) out[g * dim + d] = float_to_bf16(acc[g][d] * inv);
    }
}


// q, out: [batch, q_heads, dim]; block_tables: [batch, max_blocks]; context_lens: [batch].
// window > 0 limits each query to its last `window` tokens (sliding-window layers).
// Returns 0, or -1 when a shape exceeds the fixed per-task buffers (caller falls back).
// Positional, for C callers: decoder_layer.c includes this file and calls it directly.
static int paged_decode_attention_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                       const int64_t *block_tables, const int64_t *context_lens, uint16_t *out,
                                       int batch, int q_heads, int kv_heads, int dim, int64_t num_blocks,
                                       int block_size, int max_blocks, float scale, int64_t window, int threads) {
    int group = q_heads / kv_heads;
    if (group > MAX_GROUP || dim > MAX_DIM || block_size > MAX_BLOCK) return -1;
    int64_t head_stride = num_blocks * block_size * dim;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads)
    for (int b = 0; b < batch; b++) {
        for (int h = 0; h < kv_heads; h++) {
            int64_t end = context_lens[b];
            int64_t start = window > 0 && end > window ? end - window : 0;
            int64_t row = ((int64_t)b * q_heads + (int64_t)h * group) * dim;
            const int64_t *table = block_tables + (int64_t)b * max_blocks;
            const uint16_t *k = k_cache + h * head_stride, *v = v_cache + h * head_stride;
            if (dim == 64)  // constant head sizes let the compiler unroll the row loops
                attend_one(q + row, k, v, table, start, end, out + row, group, 64, block_size, scale);
            else if (dim == 128)
                attend_one(q + row, k, v, table, start, end, out + row, group, 128, block_size, scale);
            else
                attend_one(q + row, k, v, table, start, end, out + row, group, dim, block_size, scale);
        }
    }
    return 0;
}

// The entry point for Python: q, out: [batch->batch, a->q_heads, a->head_dim] bf16. Returns 0, or -1 as above.
int paged_decode_attention(const PagedAttention *a, const DecodeBatch *b, const uint16_t *q, uint16_t *out) {
    return paged_decode_attention_bf16(q, a->k_cache, a->v_cache, b->block_tables, b->context_lens, out, (int)b->batch,
                                       a->q_heads, a->kv_heads, a->head_dim, a->num_blocks, a->block_size,
                                       b->max_blocks, a->scale, a->window, b->threads);
}
