// RMSNorm of bf16 rows, rounded as layers/norm.py rounds: normalise in float32, round to
// bf16, then multiply by the bf16 weight and round again (llama's order: cast, then scale).
#include <math.h>

#include "bf16.h"

void rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows, int dim, float eps,
                   int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * dim;
        uint16_t *o = out + r * dim;
        float sum = 0.f;
        for (int i = 0; i < dim; i++) {
            float v = bf16_to_float(xr[i]);
            sum += v * v;
        }
        float inv = 1.f / sqrtf(sum / dim + eps);
        for (int i = 0; i < dim; i++) {
            float normed = bf16_to_float(float_to_bf16(bf16_to_float(xr[i]) * inv));
            o[i] = float_to_bf16(normed * bf16_to_float(weight[i]));
        }
    }
}
