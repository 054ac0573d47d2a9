// Rotary embedding ("rotate half" layout) applied in place to bf16 q and k rows.
// q: [tokens, q_heads, dim] and k: [tokens, k_heads, dim], each token q_stride / k_stride elements
// after the last (views into one fused QKV output, or each normalised into its own tensor); cos/sin:
// float32 [tokens, dim/2], row t for token t's position.
// Arithmetic in float32, rounded to bf16 once, as layers/rotary.py does.
#include "bf16.h"

static void rotate_heads(uint16_t *x, int heads, int dim, const float *cos, const float *sin) {
    int half = dim / 2;
    for (int h = 0; h < heads; h++) {
        uint16_t *row = x + (int64_t)h * dim;
        for (int i = 0; i < half; i++) {
            float x1 = bf16_to_float(row[i]), x2 = bf16_to_float(row[i + half]);
            row[i] = float_to_bf16(x1 * cos[i] - x2 * sin[i]);
            row[i + half] = float_to_bf16(x2 * cos[i] + x1 * sin[i]);
        }
    }
}

void rotary_bf16(uint16_t *q, uint16_t *k, int64_t q_stride, int64_t k_stride, int64_t tokens, int q_heads,
                 int k_heads, int dim, const float *cos, const float *sin, int threads) {
    int half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (tokens > 16)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        rotate_heads(q + t * q_stride, q_heads, dim, c, s);
        rotate_heads(k + t * k_stride, k_heads, dim, c, s);
    }
}
