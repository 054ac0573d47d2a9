// RMSNorm of bf16 rows, rounded as layers/norm.py rounds: normalise in float32, round to
// bf16, then multiply by the bf16 weight and round again (llama's order: cast, then scale);
// `rms_norm_cast_last_bf16` scales by (weight + offset) in float32 and rounds once (Gemma's order,
// offset 1 for Gemma 3's unit offset).
#include <math.h>

#include "bf16.h"

static float inverse_rms(const uint16_t *x, int dim, float eps) {
    float sum = 0.f;
    for (int i = 0; i < dim; i++) {
        float v = bf16_to_float(x[i]);
        sum += v * v;
    }
    return 1.f / sqrtf(sum / dim + eps);
}

void rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows, int dim, float eps,
                   int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * dim;
        uint16_t *o = out + r * dim;
        float inv = inverse_rms(xr, dim, eps);
        for (int i = 0; i < dim; i++) {
            float normed = bf16_to_float(float_to_bf16(bf16_to_float(xr[i]) * inv));
            o[i] = float_to_bf16(normed * bf16_to_float(weight[i]));
        }
    }
}

void rms_norm_cast_last_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows, int dim,
                             float eps, float offset, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * dim;
        float inv = inverse_rms(xr, dim, eps);
        for (int i = 0; i < dim; i++)
            out[r * dim + i] = float_to_bf16(bf16_to_float(xr[i]) * inv * (bf16_to_float(weight[i]) + offset));
    }
}
