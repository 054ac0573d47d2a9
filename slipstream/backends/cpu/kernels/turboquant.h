// The structs through which TurboQuant's kernels are called (turboquant_attention.c, turboquant_encode.c) and
// through which decoder_layer.c hands them a layer: mirrored by backends/cpu/abi.py.
#pragma once
#include <stdint.h>

// A one-byte norm (NORM8 in kvcache/turboquant.py): (byte << 19) + NORM8_BIAS are its float32 bits; byte 0 is 0.
#define NORM8_BIAS (119u << 23)

// K or V codes: the cache [num_blocks, block_size, kv_heads, bytes] uint8 and its row layout
// (TurboQuantizer.row_layout): `count` pieces as [count][6] ints (offset, bits, codes, norm_at, gamma_at, norm
// bytes; byte offsets in the row, gamma_at < 0: no gamma; a norm is fp16, or one byte as NORM8 in
// kvcache/turboquant.py) and [count][17] floats (factor, then the 16 code values).
typedef struct {
    const uint8_t *cache;
    const int32_t *pieces;
    const float *values;
    int32_t count, bytes, width;  // pieces, bytes per row, code-space width
} CodeRows;

// The recent/sink window's 16-bit tokens (kvcache/recent_window.py): per physical block its staging block
// or -1, the staged K/V [staging blocks, block_size, heads, dim] and the step's own K/V [query rows, heads, dim],
// both bf16 (bf16 = 1) or float32; codes hold k - key_mean ([heads, dim]), so 16-bit keys are read as k - mean.
typedef struct {
    const int64_t *staging_of;
    const void *staged_k, *staged_v, *own_k, *own_v;
    const float *key_mean;
    int64_t recent, sinks;
    int32_t bf16;
} DenseTokens;

// One layer. to_keys: [kv_heads, dim, keys.width] maps a query into key code space (rotation, QJL projection,
// key scale), back: [kv_heads, values.width, dim] maps value code space back to channels (value scale included:
// TurboQuantLayerCache.decode_maps); scores are scaled by `scale`.
typedef struct {
    CodeRows keys, values;
    const float *to_keys, *back;
    const DenseTokens *dense;  // NULL: every token is read from its codes
    const int64_t *query_start;  // NULL: one query row per sequence, else [batch + 1]: sequence b's rows in q
    int64_t window;            // > 0 limits each query to its last `window` tokens (sliding-window layers)
    int32_t kv_heads, group, dim, block_size;
    float scale;
} TurboQuantAttention;

// One call's rows and the quantizer's tables. Row (token t, head h) of x goes to
// cache + (slots[t] * heads + h) * nbytes; with `staged`, token staged_tokens[i]'s rows go as they are (rounded
// to bf16 where staged_bf16) to the 16-bit window's row staged_rows[i] too (RecentWindow.write).
typedef struct {
    const float *x;             // [tokens, heads, dim] float32
    const float *mean, *scale;  // each NULL (0, 1) or [heads, dim]: x is quantized as (x - mean) / scale
                                // (TurboQuantLayerCache.scaled_keys; values: scaled_values, no mean)
    const int64_t *order;       // NULL, or [heads, dim]: the channel order per head (outlier group first)
    const int32_t *group_info;  // [count, 5]: dim, mse bits, qjl, norm correction, norm bytes
    const float *constants;     // per group its rotation transposed (dim x dim), centroids, boundaries, and for
                                // QJL its residual-to-sketch matrix (dim x dim), back to back
    const int64_t *slots;       // [tokens]
    uint8_t *cache;
    int64_t tokens;
    int32_t count, heads, dim, nbytes, threads;
    int32_t staged_bf16;
    void *staged;                                // NULL, or the window's pool [rows, heads, dim]
    const int64_t *staged_tokens, *staged_rows;  // [staged_count] (Staging.writes)
    int64_t staged_count;
} TurboQuantEncode;
