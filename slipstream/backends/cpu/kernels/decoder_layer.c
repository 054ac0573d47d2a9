// One decode step through a stack of llama-family or Gemma 3 decoder layers in a single call. Each layer:
// RMSNorm, fused QKV projection, per-head q/k norms (Qwen3, Gemma 3), rotary, cache write, paged attention,
// output projection (+ Gemma's norm of it) + residual, RMSNorm, fused gate/up projection, SiLU or GELU(gate) * up,
// down projection (+ Gemma's norm of it) + residual.
//
// Why: at one token per sequence a layer's work is ~10 kernels of microseconds each, and
// calling them one by one from Python (module calls, ctypes argument conversion, tensor
// allocation) cost more than reading the weights. This file strings together the same
// kernels the torch path calls (they are included below), rounding every intermediate to
// bf16 where the torch path does, so the two paths agree bit for bit (batch invariance: a
// decode token's output does not depend on whether its step took this path).
#include <math.h>
#include <stdlib.h>

#include "cache_write.c"
#include "gemm.c"
#include "norm.c"
#include "paged_attention.c"
#include "rotary.c"
#include "turboquant.h"

enum { WEIGHT_BF16, WEIGHT_INT8, WEIGHT_BLOCKS, WEIGHT_Q8, WEIGHT_SEGMENTS };
enum { KERNEL_LOOPS, KERNEL_AMX, KERNEL_DOTS };  // gemm.c's AVX-512 loops, AMX tiles, bf16 dot products

// A linear layer's weight [n, k] as gemm.c takes it (packed by backends/cpu/linear.py and gguf_linear.py):
// int8 with a float32 scale per column, blocks (4-bit codes: int4, GGUF's formats repacked on nibbles,
// `gemm_blocks`), q8 (GGUF's Q8_0: int8 with a float16 scale per group, `gemm_q8`),
// or segments: `parts` weights of those kinds side by side in the output (a projection fused from two formats).
typedef struct Weight {
    int32_t kind, parts;
    const void *weight;       // segments: the parts' Weights
    const void *scale;  // float32; float16 for q8
    const Blocks *blocks;
    int64_t n;
} Weight;

// A layer whose cache holds TurboQuant codes (kvcache/turboquant_cache.py), with the kernels of
// turboquant_attention.c and turboquant_encode.c, built as their own libraries and passed in as functions. The
// fields that change with each step (the encoders' rows, slots and tokens; the 16-bit window's own tokens) are
// filled per call, as is attention.dense: the window below (bf16 or float32, as its bf16 says), unless its staging_of
// is NULL (codes alone).
typedef struct {
    TurboQuantAttention attention;
    DenseTokens window;
    TurboQuantEncode keys, values;
    int (*attend)(const TurboQuantAttention *, const DecodeBatch *, const float *, float *);
    int (*encode)(const TurboQuantEncode *);
} TurboQuantLayer;

// Norms are RMSNorm in layers/norm.py's llama form (cast, then scale) or, with unit_offset, Gemma's (scale by
// weight + 1, cast last); the NULL ones are absent.
typedef struct {
    const uint16_t *input_norm, *mlp_norm;                // before attention, before the MLP
    const uint16_t *attention_out_norm, *mlp_out_norm;    // Gemma 3's norms of each block's output
    const uint16_t *q_norm, *k_norm;                      // per head
    Weight qkv, o, gate_up, down;
    const TurboQuantLayer *turboquant;  // NULL: the bf16 cache below
    uint16_t *k_cache, *v_cache;  // [kv_heads, num_blocks, block_size, head_dim]
    int64_t num_blocks, window;   // window: 0, or the sliding window of the layer
    int32_t block_size, q_heads, kv_heads, head_dim, hidden, intermediate;
    int32_t unit_offset, gelu, rope;  // rope: which of the step's rotations (Gemma's local and global bases)
    float eps, scale;
} Layer;

// What every layer of a step shares: one decode token per sequence.
typedef struct {
    int64_t tokens;
    const int64_t *slots, *block_tables, *context_lens;  // block_tables [tokens, max_blocks]
    const int64_t *positions;
    const float *cos[2], *sin[2];  // tables [positions covered, head_dim / 2]: row p holds position p's rotations
    int32_t max_blocks, threads;
    int32_t kernel[WEIGHT_SEGMENTS];  // per weight kind, the kernel its projections take at this many tokens
} Step;

// Read by backends/cpu/abi.py: the weight kinds, and the sizes its mirrors of the structs are checked against.
const int32_t weight_kind_bf16 = WEIGHT_BF16, weight_kind_int8 = WEIGHT_INT8, weight_kind_blocks = WEIGHT_BLOCKS,
              weight_kind_q8 = WEIGHT_Q8, weight_kind_segments = WEIGHT_SEGMENTS;
const int32_t sizeof_Weight = sizeof(Weight), sizeof_Layer = sizeof(Layer), sizeof_Step = sizeof(Step),
              sizeof_TurboQuantLayer = sizeof(TurboQuantLayer);

// The multiple of K each kind's AMX kernel tiles (gemm.c); other layers keep the AVX-512 loops.
static int amx_tiles(int32_t kind, int64_t k) { return k % (kind == WEIGHT_INT8 ? 64 : 32) == 0; }

static int project(const Weight *w, const Step *s, const uint16_t *x, uint16_t *y, int64_t k);

// Each part into its columns of y: directly for one token, else through a buffer of the part's rows.
static int project_segments(const Weight *w, const Step *s, const uint16_t *x, uint16_t *y, int64_t k) {
    const Weight *parts = w->weight;
    int64_t m = s->tokens, col = 0;
    uint16_t *part_out = m > 1 ? malloc(sizeof(uint16_t) * m * w->n) : NULL;
    int status = m > 1 && !part_out ? -1 : 0;
    for (int32_t i = 0; i < w->parts && !status; col += parts[i++].n) {
        status = project(parts + i, s, x, m > 1 ? part_out : y + col, k);
        for (int64_t t = 0; m > 1 && t < m; t++)
            memcpy(y + t * w->n + col, part_out + t * parts[i].n, sizeof(uint16_t) * parts[i].n);
    }
    free(part_out);
    return status;
}

static int project(const Weight *w, const Step *s, const uint16_t *x, uint16_t *y, int64_t k) {
    int64_t m = s->tokens;
    if (w->kind == WEIGHT_SEGMENTS) return project_segments(w, s, x, y, k);
    int threads = s->threads, amx = s->kernel[w->kind] == KERNEL_AMX && amx_tiles(w->kind, k);
    if (s->kernel[w->kind] == KERNEL_DOTS) switch (w->kind) {
            case WEIGHT_BF16: return gemm_bf16_dots(x, w->weight, y, m, w->n, k, threads);
            case WEIGHT_INT8: return gemm_int8_dots(x, w->weight, w->scale, y, m, w->n, k, threads);
            case WEIGHT_BLOCKS: return gemm_blocks_dots(x, w->weight, w->blocks, y, m, w->n, k, threads);
            case WEIGHT_Q8: return gemm_q8_dots(x, w->weight, w->scale, y, m, w->n, k, threads);
        }
    switch (w->kind) {
        case WEIGHT_BF16:
            return (amx ? gemm_bf16_amx : gemm_bf16)(x, w->weight, y, m, w->n, k, threads);
        case WEIGHT_INT8:
            return (amx ? gemm_int8_amx : gemm_int8)(x, w->weight, w->scale, y, m, w->n, k, threads);
        case WEIGHT_BLOCKS:
            return (amx ? gemm_blocks_amx : gemm_blocks)(x, w->weight, w->blocks, y, m, w->n, k, threads);
        case WEIGHT_Q8:  // no AMX form
            return gemm_q8(x, w->weight, w->scale, y, m, w->n, k, threads);
    }
    return -1;
}

static void norm_rows(const Layer *l, const uint16_t *weight, const uint16_t *x, uint16_t *out, int64_t rows,
                      int dim, int threads) {
    if (l->unit_offset)
        rms_norm_cast_last_bf16(x, weight, out, rows, dim, l->eps, 1.f, threads);
    else
        rms_norm_bf16(x, weight, out, rows, dim, l->eps, threads);
}

// Each token's q and k heads normalised in place, before the rotation (models/llama.py's LlamaAttention).
static void head_norms(const Layer *l, const Step *s, uint16_t *qkv, int64_t width) {
    int64_t q_size = (int64_t)l->q_heads * l->head_dim;
    for (int64_t t = 0; l->q_norm && t < s->tokens; t++) {
        norm_rows(l, l->q_norm, qkv + t * width, qkv + t * width, l->q_heads, l->head_dim, 1);
        norm_rows(l, l->k_norm, qkv + t * width + q_size, qkv + t * width + q_size, l->kv_heads, l->head_dim, 1);
    }
}

// x += delta, after Gemma's norm of delta where the layer has one
static void add_residual(const Layer *l, const uint16_t *out_norm, const Step *s, uint16_t *x, uint16_t *delta) {
    int64_t count = s->tokens * l->hidden;
    if (out_norm) norm_rows(l, out_norm, delta, delta, s->tokens, l->hidden, s->threads);
    for (int64_t i = 0; i < count; i++) x[i] = float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(delta[i]));
}

// A float32 into element i of bf16 (bf16 = 1, rounded to nearest even) or float32 rows: paged_attention.c's
// `element`, the other way.
static inline void element_put(void *x, int bf16, int64_t i, float value) {
    if (bf16)
        ((uint16_t *)x)[i] = float_to_bf16(value);
    else
        ((float *)x)[i] = value;
}

// A layer's TurboQuant attention for a step of decode tokens, one per sequence: attention/turboquant.py's
// paged_attention for such a step, rounding where it rounds. K/V widened to float32 and encoded into their code
// rows; those whose block has staging (placed by Staging.assign before the step) copied there too, in the window's
// dtype; then the kernel on float32 queries, its output rounded to the inputs' dtype. q [m, q_heads, dim], k and v
// [m, kv_heads, dim]: each token's heads contiguous, tokens q_stride / kv_stride elements apart, bf16 (bf16 = 1) or
// float32; out [m, q_heads, dim] contiguous, in their dtype. The decode stack below and the per-layer path's decode
// steps (backends/cpu/attention.py) call it. Returns 0, or -1 when memory runs out or the kernels decline.
int turboquant_decode_attention(const TurboQuantLayer *tq, const DecodeBatch *batch, const int64_t *slots,
                                const void *q, const void *k, const void *v, int64_t q_stride, int64_t kv_stride,
                                int32_t bf16, void *out) {
    const TurboQuantAttention *a = &tq->attention;
    int64_t m = batch->batch, kv_size = (int64_t)a->kv_heads * a->dim, q_size = kv_size * a->group;
    int own_bf16 = tq->window.bf16;
    int64_t row_bytes = (own_bf16 ? sizeof(uint16_t) : sizeof(float)) * kv_size;
    float *buffer = malloc(sizeof(float) * m * (2 * q_size + 2 * kv_size));
    char *own_k = malloc(2 * m * row_bytes), *own_v = own_k + m * row_bytes;  // the window's dtype
    if (!buffer || !own_k) return free(buffer), free(own_k), -1;
    float *queries = buffer, *sums = queries + m * q_size;
    float *keys_in = sums + m * q_size, *values_in = keys_in + m * kv_size;
    for (int64_t t = 0; t < m; t++) {
        for (int64_t i = 0; i < q_size; i++) queries[t * q_size + i] = element(q, t * q_stride + i, !bf16);
        for (int64_t i = 0, at = t * kv_size; i < kv_size; i++) {
            keys_in[at + i] = element(k, t * kv_stride + i, !bf16);
            values_in[at + i] = element(v, t * kv_stride + i, !bf16);
            element_put(own_k, own_bf16, at + i, keys_in[at + i]);
            element_put(own_v, own_bf16, at + i, values_in[at + i]);
        }
    }
    TurboQuantEncode keys = tq->keys, values = tq->values;
    keys.x = keys_in, values.x = values_in;
    keys.slots = values.slots = slots;
    keys.tokens = values.tokens = m;
    keys.threads = values.threads = batch->threads;
    keys.staged = values.staged = NULL;  // the window's copies are made below, from its own dtype's rows
    int status = tq->encode(&keys) || tq->encode(&values) ? -1 : 0;
    DenseTokens window = tq->window;
    TurboQuantAttention attention = *a;
    attention.query_start = NULL;
    attention.dense = NULL;
    if (window.staging_of) {
        window.own_k = own_k, window.own_v = own_v;
        attention.dense = &window;
        for (int64_t t = 0; t < m; t++) {  // RecentWindow.write
            int64_t block = slots[t] / a->block_size, staging = window.staging_of[block];
            if (staging < 0) continue;
            int64_t row = staging * a->block_size + slots[t] % a->block_size;
            memcpy((char *)window.staged_k + row * row_bytes, own_k + t * row_bytes, row_bytes);
            memcpy((char *)window.staged_v + row * row_bytes, own_v + t * row_bytes, row_bytes);
        }
    }
    status = status || tq->attend(&attention, batch, queries, sums) ? -1 : 0;
    for (int64_t i = 0; !status && i < m * q_size; i++) element_put(out, bf16, i, sums[i]);
    free(buffer);
    free(own_k);
    return status;
}

static int attention_block(const Layer *l, const Step *s, uint16_t *x, uint16_t *normed, uint16_t *qkv,
                           uint16_t *q, uint16_t *attn, uint16_t *delta) {
    int64_t m = s->tokens, q_size = (int64_t)l->q_heads * l->head_dim, kv_size = (int64_t)l->kv_heads * l->head_dim;
    int64_t width = q_size + 2 * kv_size;
    norm_rows(l, l->input_norm, x, normed, m, l->hidden, s->threads);
    if (project(&l->qkv, s, normed, qkv, l->hidden)) return -1;
    head_norms(l, s, qkv, width);
    for (int64_t t = 0, half = l->head_dim / 2; t < m; t++)
        rotary_bf16(qkv + t * width, qkv + t * width + q_size, width, width, 1, l->q_heads, l->kv_heads, l->head_dim,
                    s->cos[l->rope] + s->positions[t] * half, s->sin[l->rope] + s->positions[t] * half, 1);
    if (l->turboquant) {
        DecodeBatch batch = {m, s->block_tables, s->context_lens, s->max_blocks, s->threads};
        if (turboquant_decode_attention(l->turboquant, &batch, s->slots, qkv, qkv + q_size, qkv + q_size + kv_size,
                                        width, width, 1, attn))
            return -1;
    } else {
        cache_write_bf16(qkv + q_size, qkv + q_size + kv_size, l->k_cache, l->v_cache, s->slots, m, width,
                         l->kv_heads, l->head_dim, l->num_blocks * l->block_size);
        for (int64_t t = 0; t < m; t++) memcpy(q + t * q_size, qkv + t * width, q_size * sizeof(uint16_t));
        if (paged_attention_typed(q, l->k_cache, l->v_cache, s->block_tables, s->context_lens, attn, (int)m, l->q_heads,
                                  l->kv_heads, l->head_dim, l->num_blocks, l->block_size, s->max_blocks, l->scale,
                                  l->window, s->threads, 0, 0))
            return -1;
    }
    if (project(&l->o, s, attn, delta, q_size)) return -1;
    add_residual(l, l->attention_out_norm, s, x, delta);
    return 0;
}

// act = silu(gate) * up: in the AMX kernel's epilogue where it serves this step, else the
// projection and gemm.c's `silu_and_mul_bf16`, which round alike (as the torch path's
// layers/linear.py `silu_and_mul` calls them); GELU's through `gelu_tanh_and_mul_bf16` (layers/mlp.py's).
static int gated_projection(const Layer *l, const Step *s, const uint16_t *x, uint16_t *gate_up, uint16_t *act) {
    const Weight *w = &l->gate_up;
    int64_t m = s->tokens, k = l->hidden;
    if (!l->gelu && s->kernel[w->kind] == KERNEL_AMX && amx_tiles(w->kind, k) && w->n % 32 == 0) switch (w->kind) {
            case WEIGHT_BF16: return gemm_bf16_amx_silu(x, w->weight, act, m, w->n, k, s->threads);
            case WEIGHT_INT8: return gemm_int8_amx_silu(x, w->weight, w->scale, act, m, w->n, k, s->threads);
            case WEIGHT_BLOCKS: return gemm_blocks_amx_silu(x, w->weight, w->blocks, act, m, w->n, k, s->threads);
        }
    if (project(w, s, x, gate_up, k)) return -1;
    return (l->gelu ? gelu_tanh_and_mul_bf16 : silu_and_mul_bf16)(gate_up, act, m, l->intermediate, s->threads);
}

static int mlp_block(const Layer *l, const Step *s, uint16_t *x, uint16_t *normed, uint16_t *gate_up,
                     uint16_t *act, uint16_t *delta) {
    norm_rows(l, l->mlp_norm, x, normed, s->tokens, l->hidden, s->threads);
    if (gated_projection(l, s, normed, gate_up, act)) return -1;
    if (project(&l->down, s, act, delta, l->intermediate)) return -1;
    add_residual(l, l->mlp_out_norm, s, x, delta);
    return 0;
}

static int64_t scratch_per_token(const Layer *l) {
    int64_t q_size = (int64_t)l->q_heads * l->head_dim, qkv_width = q_size + 2 * (int64_t)l->kv_heads * l->head_dim;
    return l->hidden * 2 + qkv_width + 2 * q_size + 3 * l->intermediate;
}

static int decode_layer(const Layer *l, const Step *s, uint16_t *x, uint16_t *scratch) {
    int64_t m = s->tokens, q_size = (int64_t)l->q_heads * l->head_dim;
    int64_t qkv_width = q_size + 2 * (int64_t)l->kv_heads * l->head_dim;
    uint16_t *normed = scratch, *delta = normed + m * l->hidden, *qkv = delta + m * l->hidden;
    uint16_t *q = qkv + m * qkv_width, *attn = q + m * q_size, *gate_up = attn + m * q_size;
    uint16_t *act = gate_up + m * 2 * l->intermediate;
    if (attention_block(l, s, x, normed, qkv, q, attn, delta)) return -1;
    return mlp_block(l, s, x, normed, gate_up, act, delta);
}

// Runs `count` layers in order on x: [tokens, hidden] bf16, then the model's final norm (in the layers' form),
// updated in place. Returns 0, or -1 when memory runs out or a shape is beyond the kernels;
// x is then unspecified, so the caller checks shapes before (backends/cpu/decode_stack.py).
int decoder_layers_decode(const Layer *layers, int32_t count, const uint16_t *final_norm, const Step *s,
                          uint16_t *x) {
    int64_t per_token = 0;
    for (int32_t i = 0; i < count; i++)
        per_token = scratch_per_token(layers + i) > per_token ? scratch_per_token(layers + i) : per_token;
    uint16_t *scratch = malloc(sizeof(uint16_t) * s->tokens * per_token);
    int status = scratch ? 0 : -1;
    for (int32_t i = 0; i < count && !status; i++) status = decode_layer(layers + i, s, x, scratch);
    if (!status) norm_rows(layers, final_norm, x, x, s->tokens, layers->hidden, s->threads);
    free(scratch);
    return status;
}
