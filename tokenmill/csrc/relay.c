/*
 * GGUF blocks re-laid for the packed matmul at load (quant/packed.py: pack_gguf is the torch
 * twin and the oracle): the same bytes in another order, one pass over the file's bytes, in
 * parallel. Q4_K / Q5_K / Q6_K super-blocks (tm_relay_kquant, below), Q4_0 / Q5_0 / Q8_0
 * blocks of 32 (tm_relay_q32, at the end). At 1B-8B sizes the torch twin (codes unpacked to
 * int16, then gathered into lane order) took most of a first load; this is bound by the bytes it
 * moves.
 *
 * A super-block's 256 codes go from the file's block to the kernel's lane order (csrc/qgemm.c):
 * code vector u (0..7), byte 4l + b holds element 32l + 4u + b (lane l is chunk l). Stored per
 * super-block:
 *   "q4k" (GGUF Q4_K, 144 bytes: f16 d, f16 dmin, 12 scale bytes, 128 of nibble pairs):
 *         the vectors in pairs (vector 2v in the low nibbles of the 32 bytes at 32v), then the
 *         12 scale bytes: 140 bytes; d and dmin to `d`.
 *   "q5k" (GGUF Q5_K, 176 bytes: f16 d, f16 dmin, 12 scale bytes, 32 of fifth bits, 128 of
 *         nibble pairs): "q4k"'s 128 bytes, a plane of fifth bits (vector u's in bit u), the 12
 *         scale bytes: 172 bytes; d and dmin to `d`.
 *   "q6k" (GGUF Q6_K, 210 bytes: 128 of low nibbles, 64 of top 2-bit pairs, 16 int8 scales,
 *         f16 d): the codes' low 4 bits as "q4k"'s, their top 2 bits in two planes (vector
 *         4p + s in bits 2s of plane p's bytes), then the 16 scales: 208 bytes; d to `d`.
 *   "n4k" (GGUF IQ4_XS, 136 bytes: f16 d, 2 + 4 bytes of 6-bit scales, 128 of index nibbles):
 *         the indices as "q4k" keeps its codes, then the 6 scale bytes: 134 bytes; d to `d`.
 */
#include <stdint.h>
#include <string.h>

#include "lanes.h"
#include "tokenmill.h"

enum { GGML_Q4_0 = 2, GGML_Q5_0 = 6, GGML_Q8_0 = 8 };
enum { GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_IQ4_XS = 23 };

/* Eight bytes at a time (a uint64, little-endian), as the re-lay's unit: a lane's 4 bytes of
 * two code vectors come from 8 consecutive bytes of the file. Bytewise, a 3B load spent over
 * a second here (1.6 GB/s); as words it is bound by the bytes it moves. */
static inline uint64_t load8(const uint8_t *p) {
    uint64_t x;
    memcpy(&x, p, 8);
    return x;
}

static inline void store4(uint8_t *p, uint32_t x) { memcpy(p, &x, 4); }

#define NIBBLES 0x0F0F0F0F0F0F0F0FULL
#define PAIRS 0x0303030303030303ULL

/* Lane bytes of code vectors 2v, 2v + 1 from the 8 bytes s (elements 8v .. 8v + 7 of a chunk,
 * in the nibble at shift): byte b holds element 8v + b in its low nibble, 8v + 4 + b in its
 * high. */
static inline uint32_t nibble_pair(uint64_t s, int shift) {
    const uint64_t n = s >> shift & NIBBLES;
    return (uint32_t)n | (uint32_t)(n >> 32) << 4;
}

/* The file's nibbles (qs: 4 rows of 32 bytes) as "q4k" / "q6k" keep them: out byte 32v + 4c + b
 * holds chunk c's elements 8v + b (low nibble) and 8v + 4 + b (high). Chunk c is row
 * row_of[c]'s bytes, in the nibble at 4 · nib_of[c]. */
static void nibble_pairs(const uint8_t *qs, const int row_of[8], const int nib_of[8],
                         uint8_t *out) {
    for (int v = 0; v < 4; v++)
        for (int c = 0; c < 8; c++) {
            const uint64_t s = load8(qs + 32 * row_of[c] + 8 * v);
            store4(out + 32 * v + 4 * c, nibble_pair(s, 4 * nib_of[c]));
        }
}

/* IQ4_XS's indices, as Q4_0's nibbles a 32-element chunk: chunk c's element i < 16 in the low
 * nibble of qs byte 16c + i, element 16 + i in its high. Vector pair v's 8 elements 8v .. 8v + 7
 * (v < 2: low nibbles) or 8(v - 2) + 16 .. (high) are 8 consecutive bytes' nibbles. */
static void iq4_xs_pairs(const uint8_t *qs, uint8_t *out) {
    for (int v = 0; v < 4; v++)
        for (int c = 0; c < 8; c++) {
            const uint64_t s = load8(qs + 16 * c + 8 * (v & 1));
            store4(out + 32 * v + 4 * c, nibble_pair(s, 4 * (v >> 1)));
        }
}

/* Q4_K: element 64j + i in the low nibble of qs byte 32j + i, element 64j + 32 + i in its high:
 * chunk c is row c / 2, nibble c mod 2. */
static const int Q4K_ROW[8] = {0, 0, 1, 1, 2, 2, 3, 3}, Q4K_NIB[8] = {0, 1, 0, 1, 0, 1, 0, 1};
/* Q6_K's low 4 bits (ggml's dequantize_row_q6_K): each half h of 128 elements holds chunk
 * 4h + q in ql row 2h + q mod 2, nibble q / 2. */
static const int Q6K_ROW[8] = {0, 1, 0, 1, 2, 3, 2, 3}, Q6K_NIB[8] = {0, 0, 1, 1, 0, 0, 1, 1};

/* Q6_K's top 2 bits (code + 32 as stored: 0..63): element 128h + 32q + l has them at bits 2q of
 * qh byte 32h + l. The planes: code vector 4p + s's in bits 2s of plane p's bytes, byte 4c + b
 * of chunk c = 4h + q, element 16p + 4s + b of it; the 8 bytes at 32h + 16p hold s = 0, 1, the
 * next 8 s = 2, 3. */
static void q6_k_planes(const uint8_t *qh, uint8_t *out) {
    for (int h = 0; h < 2; h++)
        for (int p = 0; p < 2; p++) {
            const uint64_t lo = load8(qh + 32 * h + 16 * p), hi = load8(qh + 32 * h + 16 * p + 8);
            for (int q = 0; q < 4; q++) {
                const uint64_t a = lo >> 2 * q & PAIRS, b = hi >> 2 * q & PAIRS;
                const uint32_t byte = (uint32_t)a | (uint32_t)(a >> 32) << 2 | (uint32_t)b << 4 |
                                      (uint32_t)(b >> 32) << 6;
                store4(out + 32 * p + 4 * (4 * h + q), byte);
            }
        }
}

/* The 8 x 8 bits of x transposed: bit l of byte u goes to bit u of byte l (Hacker's Delight's
 * transpose8, three rounds of swapping blocks across the diagonal). */
static inline uint64_t transpose8(uint64_t x) {
    uint64_t t = (x ^ (x >> 7)) & 0x00AA00AA00AA00AAULL;
    x ^= t ^ (t << 7);
    t = (x ^ (x >> 14)) & 0x0000CCCC0000CCCCULL;
    x ^= t ^ (t << 14);
    t = (x ^ (x >> 28)) & 0x00000000F0F0F0F0ULL;
    return x ^ t ^ (t << 28);
}

/* Q5_K's fifth bits (ggml's dequantize_row_q5_K): element i of chunk c has it at bit c of qh
 * byte i. "q5k" keeps them as "q5"'s plane: code vector u's in bit u of byte 4l + b (chunk l,
 * element 4u + b), i.e. bit l of qh byte 4u + b: for each b an 8 x 8 bit transpose. */
static void q5_k_plane(const uint8_t *qh, uint8_t *out) {
    for (int b = 0; b < 4; b++) {
        uint64_t x = 0;
        for (int u = 0; u < 8; u++) x |= (uint64_t)qh[4 * u + b] << 8 * u;
        x = transpose8(x);
        for (int l = 0; l < 8; l++) out[4 * l + b] = (uint8_t)(x >> 8 * l);
    }
}

/* num_blocks super-blocks of ggml_type (Q4_K, Q5_K, Q6_K or IQ4_XS) at src -> codes (140, 172,
 * 208 or 134 bytes a block) and their float16 d (and dmin) at d (4, 4, 2 or 2 bytes a block).
 * Returns 0, or -1 for a type it does not re-lay. */
int tm_relay_kquant(int ggml_type, const uint8_t *src, int64_t num_blocks, uint8_t *codes,
                    uint8_t *d) {
    if (ggml_type != GGML_Q4_K && ggml_type != GGML_Q5_K && ggml_type != GGML_Q6_K &&
        ggml_type != GGML_IQ4_XS)
        return -1;
    const int q4 = ggml_type == GGML_Q4_K, q5 = ggml_type == GGML_Q5_K;
    const int n4 = ggml_type == GGML_IQ4_XS;
    const int64_t in = q4 ? 144 : q5 ? 176 : n4 ? 136 : 210;
    const int64_t out = q4 ? 140 : q5 ? 172 : n4 ? 134 : 208;
    const int64_t dn = q4 || q5 ? 4 : 2;
#pragma omp parallel for schedule(static) if (num_blocks >= 1024)
    for (int64_t i = 0; i < num_blocks; i++) {
        const uint8_t *b = src + i * in;
        uint8_t *o = codes + i * out;
        if (q4) {
            nibble_pairs(b + 16, Q4K_ROW, Q4K_NIB, o);
            memcpy(o + 128, b + 4, 12);
            memcpy(d + i * dn, b, 4);
        } else if (q5) { /* d, dmin, 12 scale bytes as Q4_K's, 32 of fifth bits, 128 of nibbles */
            nibble_pairs(b + 48, Q4K_ROW, Q4K_NIB, o);
            q5_k_plane(b + 16, o + 128);
            memcpy(o + 160, b + 4, 12);
            memcpy(d + i * dn, b, 4);
        } else if (n4) { /* d, 6 scale bytes, 128 of index nibbles */
            iq4_xs_pairs(b + 8, o);
            memcpy(o + 128, b + 2, 6);
            memcpy(d + i * dn, b, 2);
        } else {
            nibble_pairs(b, Q6K_ROW, Q6K_NIB, o);
            q6_k_planes(b + 128, o + 128);
            memcpy(o + 192, b + 192, 16);
            memcpy(d + i * dn, b + 208, 2);
        }
    }
    return 0;
}

/* Element e (0..31) of a Q4_0 / Q5_0 block's 16 bytes of low 4 bits: e < 16 in the low nibble
 * of byte e, else the high nibble of byte e - 16. */
static inline uint8_t low_bits(const uint8_t *qs, int e) {
    return e < 16 ? qs[e] & 0x0F : qs[e - 16] >> 4;
}

/* rows x cols of ggml_type Q4_0 (18 bytes a block of 32: float16 d, 16 of nibbles), Q5_0 (22:
 * float16 d, 4 of fifth bits, element j's in bit j, 16 of nibbles) or Q8_0 (34: float16 d, 32
 * int8) at src -> "q4" (cols / 2 bytes a row), "q5" (cols / 2 + 32 a block of chunks) or "q8"
 * (cols) codes in lane order (qgemm.c: in code vector u of the block of t chunks from c0, lane
 * l's 4 bytes are elements 4 · (u · 8/t + l/t) .. + 3 of chunk c0 + l mod t; "q4": vector 2v in
 * the low nibbles of the 32 bytes at 32v of the block, 2v + 1 in their high; "q5": a 32-byte
 * plane of fifth bits, vector u's in bit u, then the low 4 bits as "q4"'s), and each chunk's
 * d (2 bytes) at d. The codes are the file's as they are: Q4_0's nibbles are "q4"'s code + 8,
 * Q5_0's 5 bits "q5"'s code + 16, Q8_0's bytes "q8"'s. Returns 0, or -1 for another type or
 * rows not in lane order (cols not a multiple of 64). */
int tm_relay_q32(int ggml_type, const uint8_t *src, int64_t rows, int64_t cols, uint8_t *codes,
                 uint8_t *d) {
    if (ggml_type != GGML_Q4_0 && ggml_type != GGML_Q5_0 && ggml_type != GGML_Q8_0) return -1;
    if (cols % 64) return -1;
    const int q4 = ggml_type == GGML_Q4_0, q5 = ggml_type == GGML_Q5_0;
    const int64_t nc = cols / 32, in = q4 ? 18 : q5 ? 22 : 34;
    const int64_t row_out = q4 ? cols / 2 : q5 ? cols / 2 + 32 * num_blocks(nc) : cols;
#pragma omp parallel for schedule(static) if (rows * cols >= (1 << 20))
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = src + r * nc * in;
        uint8_t *o = codes + r * row_out;
        for (int64_t c = 0; c < nc; c++) memcpy(d + (r * nc + c) * 2, row + c * in, 2);
        for (int64_t c0 = 0; c0 < nc; c0 += block_chunks(nc, c0)) {
            const int t = block_chunks(nc, c0), per = 8 / t;
            /* "q5": the block's plane, then its nibble pairs; "q4": the nibble pairs alone */
            uint8_t *plane = q5 ? o + q5_block(c0) : NULL;
            uint8_t *nibbles = q5 ? plane + 32 : o + c0 * 16;
            if (q5) memset(plane, 0, 32);
            for (int u = 0; u < t; u++)
                for (int l = 0; l < 8; l++) {
                    const uint8_t *block = row + (c0 + l % t) * in;
                    const int e = 4 * (u * per + l / t);
                    if (!q4 && !q5) {
                        memcpy(o + (c0 + u) * 32 + 4 * l, block + 2 + e, 4);
                        continue;
                    }
                    const uint8_t *qs = block + (q5 ? 6 : 2);
                    uint32_t qh = 0;
                    if (q5) memcpy(&qh, block + 2, 4);
                    uint8_t *out = nibbles + (u >> 1) * 32 + 4 * l;
                    for (int b = 0; b < 4; b++) {
                        const uint8_t low = low_bits(qs, e + b);
                        out[b] = u & 1 ? (uint8_t)(out[b] | low << 4) : low;
                        if (q5) plane[4 * l + b] |= (uint8_t)((qh >> (e + b) & 1) << u);
                    }
                }
        }
    }
    return 0;
}
