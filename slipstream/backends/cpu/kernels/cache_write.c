// Store a step's new K/V rows into the paged cache by slot (block_id * block_size + offset).
// k, v: [tokens, heads, dim] bf16, each token `stride` elements after the last (views into the
// fused QKV output); caches: [heads, num_slots, dim]. One call per layer instead of two
// advanced-indexing writes and their transposes.
#include <stdint.h>
#include <string.h>

void cache_write_bf16(const uint16_t *k, const uint16_t *v, uint16_t *k_cache, uint16_t *v_cache,
                      const int64_t *slots, int64_t tokens, int64_t stride, int heads, int dim, int64_t num_slots) {
    size_t row = (size_t)dim * sizeof(uint16_t);
    for (int64_t t = 0; t < tokens; t++) {
        for (int h = 0; h < heads; h++) {
            int64_t dst = ((int64_t)h * num_slots + slots[t]) * dim, src = t * stride + (int64_t)h * dim;
            memcpy(k_cache + dst, k + src, row);
            memcpy(v_cache + dst, v + src, row);
        }
    }
}
