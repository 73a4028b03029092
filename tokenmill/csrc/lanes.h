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

#endif
