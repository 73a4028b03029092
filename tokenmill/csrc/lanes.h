/* The packed matmul's lane order (csrc/qgemm.c's header), shared by the kernel and the re-lay
 * at load (csrc/relay.c): a row's 32-element chunks go in blocks of 8 chunks, then 4, then 2
 * at its tail. */
#ifndef TM_LANES_H
#define TM_LANES_H
#include <stdint.h>

/* Chunks in the block that starts at chunk c0 of a row of nc chunks (nc even). */
static inline int block_chunks(int64_t nc, int64_t c0) {
    int64_t left = nc - c0;
    return left >= 8 ? 8 : left >= 4 ? 4 : 2;
}

/* Blocks in a row of nc chunks. */
static inline int64_t num_blocks(int64_t nc) {
    int64_t n = 0;
    for (int64_t c0 = 0; c0 < nc; c0 += block_chunks(nc, c0)) n++;
    return n;
}

/* "q5": where the block starting at chunk c0 is: every block before a row's tail holds 8 chunks
 * (32 + 128 bytes); a block at c0 mod 8 = 4 follows a tail block of 4 chunks (32 + 64). */
static inline int64_t q5_block(int64_t c0) { return c0 / 8 * 160 + (c0 % 8 ? 96 : 0); }

#endif
