// A step's decode queries as the attention kernels read them (paged_attention.c, turboquant_attention.c):
// one query token per sequence, each sequence reading its own blocks up to its own length.
#pragma once
#include <stdint.h>

typedef struct {
    int64_t batch;                               // sequences, one query row each
    const int64_t *block_tables, *context_lens;  // [batch, max_blocks], [batch]
    int32_t max_blocks, threads;
} DecodeBatch;
