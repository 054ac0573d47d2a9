// TurboQuant encoding of new K/V rows straight into the paged cache: the twin of `_Group.encode` in
// kvcache/turboquant.py, same math and byte layout. Why native: a decode step writes one token per layer,
// and the torch encoder is ~30 small ops (rotate, bucketize, pack, fp16 bytes) whose fixed cost per op made
// the write cost as much as attention itself.
//
// Per channel group (one, or two for 2.5/3.5 bits): y = R x; norm = |y|; u = y / norm; codes = bucketize(u)
// packed LSB first; with norm correction norm /= <u, c[codes]>; for QJL keys, the signs of (u - c[codes]) S^T
// and gamma = |u - c[codes]|; then fp16 gamma and the norm, fp16 or one byte (NORM8 in kvcache/turboquant.py). A row
// is the groups' bytes, concatenated.
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "turboquant.h"

#define MAX_DIM 256
#define MAX_GROUPS 2

typedef struct {
    int dim, mse_bits, qjl, norm_correction, norm_bytes;
    const float *rotation_t, *centroids, *boundaries, *sketch;  // rotation_t: R transposed, [dim][dim]
} Group;

static void put_half(uint8_t *dst, float x) {  // round to nearest even, as torch's .to(float16); little-endian
    _Float16 h = (_Float16)x;
    memcpy(dst, &h, sizeof h);
}

// Round half up in the float's bits to 4 exponent bits (2^-8 to 2^7) over 4 mantissa bits; byte 0 is 0.
static void put_norm8(uint8_t *dst, float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    int32_t code = (int32_t)((bits + (1u << 18)) >> 19) - (int32_t)(NORM8_BIAS >> 19);
    *dst = (uint8_t)(code < 0 ? 0 : code > 255 ? 255 : code);
}

static uint8_t *pack(const int *codes, int n, int bits, uint8_t *dst) {
    for (int i = 0; i < n; i += 8) {
        uint32_t word = 0;
        for (int j = 0; j < 8; j++) word |= (uint32_t)codes[i + j] << (bits * j);
        for (int b = 0; b < bits; b++) *dst++ = (uint8_t)(word >> (8 * b));
    }
    return dst;
}

static uint8_t *encode_group(const Group *g, const float *x, uint8_t *dst) {
    float y[MAX_DIM];
    int code[MAX_DIM];
    int d = g->dim, levels = 1 << g->mse_bits;
    memset(y, 0, sizeof(float) * d);
    for (int j = 0; j < d; j++)  // y = R x as columns of R scaled by x: contiguous, vectorized over i
        for (int i = 0; i < d; i++) y[i] += g->rotation_t[j * d + i] * x[j];
    float square = 0.f;
    for (int i = 0; i < d; i++) square += y[i] * y[i];
    float norm = sqrtf(square), divisor = norm > FLT_MIN ? norm : FLT_MIN;
    for (int i = 0; i < d; i++) y[i] /= divisor;
    if (g->mse_bits) {
        for (int i = 0; i < d; i++) code[i] = 0;
        for (int c = 0; c < levels - 1; c++)  // torch.bucketize: the number of boundaries strictly below
            for (int i = 0; i < d; i++) code[i] += g->boundaries[c] < y[i];
        float along = 0.f;
        for (int i = 0; i < d; i++) {
            along += y[i] * g->centroids[code[i]];
            y[i] -= g->centroids[code[i]];
        }
        dst = pack(code, d, g->mse_bits, dst);
        if (g->norm_correction) norm /= along > 1e-3f ? along : 1e-3f;
    }
    if (g->qjl) {
        float sketch[MAX_DIM], residual = 0.f;
        memset(sketch, 0, sizeof(float) * d);
        for (int j = 0; j < d; j++)
            for (int i = 0; i < d; i++) sketch[i] += y[j] * g->sketch[j * d + i];
        for (int i = 0; i < d; i++) {
            code[i] = sketch[i] >= 0.f;
            residual += y[i] * y[i];
        }
        dst = pack(code, d, 1, dst);
        put_half(dst, sqrtf(residual));
        dst += 2;
    }
    if (g->norm_bytes == 1)
        put_norm8(dst, norm);
    else
        put_half(dst, norm);
    return dst + g->norm_bytes;
}

static void mirror(const TurboQuantEncode *e) {
    int64_t width = (int64_t)e->heads * e->dim;
    for (int64_t i = 0; i < e->staged_count; i++) {
        const float *src = e->x + e->staged_tokens[i] * width;
        int64_t row = e->staged_rows[i] * width;
        if (e->staged_bf16)
            for (int64_t j = 0; j < width; j++) ((uint16_t *)e->staged)[row + j] = float_to_bf16(src[j]);
        else
            memcpy((float *)e->staged + row, src, sizeof(float) * width);
    }
}

// Read by backends/cpu/abi.py, which checks its mirror of the struct against it.
const int32_t sizeof_TurboQuantEncode = sizeof(TurboQuantEncode);

// Returns 0, or -1 for unsupported shapes or staged tokens beyond x.
int turboquant_encode(const TurboQuantEncode *e) {
    const float *x = e->x, *mean = e->mean, *scale = e->scale, *constants = e->constants;
    const int64_t *order = e->order, *slots = e->slots;
    const int32_t *group_info = e->group_info;
    int count = e->count, heads = e->heads, dim = e->dim, nbytes = e->nbytes;
    int64_t tokens = e->tokens;
    uint8_t *cache = e->cache;
    Group groups[MAX_GROUPS];
    if (count > MAX_GROUPS || dim > MAX_DIM) return -1;
    for (int64_t i = 0; e->staged && i < e->staged_count; i++)
        if (e->staged_tokens[i] < 0 || e->staged_tokens[i] >= tokens) return -1;  // a plan of another step
    for (int i = 0; i < count; i++) {
        Group *g = &groups[i];
        g->dim = group_info[5 * i];
        g->mse_bits = group_info[5 * i + 1];
        g->qjl = group_info[5 * i + 2];
        g->norm_correction = group_info[5 * i + 3];
        g->norm_bytes = group_info[5 * i + 4];
        g->rotation_t = constants;
        constants += g->dim * g->dim;
        g->centroids = constants;
        constants += g->mse_bits ? 1 << g->mse_bits : 0;
        g->boundaries = constants;
        constants += g->mse_bits ? (1 << g->mse_bits) - 1 : 0;
        g->sketch = constants;
        constants += g->qjl ? g->dim * g->dim : 0;
    }
#pragma omp parallel for schedule(static) num_threads(e->threads) if (tokens * heads > 16)
    for (int64_t r = 0; r < tokens * heads; r++) {
        int h = (int)(r % heads);
        float scaled[MAX_DIM], row[MAX_DIM];
        const float *src = x + r * dim;
        if (mean || scale) {
            for (int j = 0; j < dim; j++)
                scaled[j] = (src[j] - (mean ? mean[h * dim + j] : 0.f)) / (scale ? scale[h * dim + j] : 1.f);
            src = scaled;
        }
        for (int j = 0; j < dim; j++) row[j] = order ? src[order[(int64_t)h * dim + j]] : src[j];
        uint8_t *dst = cache + (slots[r / heads] * heads + h) * nbytes;
        for (int i = 0, start = 0; i < count; start += groups[i].dim, i++)
            dst = encode_group(&groups[i], row + start, dst);
    }
    if (e->staged) mirror(e);
    return 0;
}
