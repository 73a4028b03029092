/*
 * GGUF k-quant super-blocks re-laid for the packed matmul at load (quant/packed.py:
 * pack_k_quant is the torch twin and the oracle): the same bytes in another order, one pass
 * over the file's bytes, in parallel. At 1B-8B sizes the torch twin (codes unpacked to int16,
 * then gathered into lane order) took most of a first load; this is bound by the bytes it moves.
 *
 * A super-block's 256 codes come out of the file's block as bytes in element order, then go to
 * the kernel's lane order (csrc/qgemm.c): code vector u (0..7), byte 4l + b holds element
 * 32l + 4u + b (lane l is chunk l). Stored per super-block:
 *   "q4k" (GGUF Q4_K, 144 bytes: f16 d, f16 dmin, 12 scale bytes, 128 of nibble pairs):
 *         the vectors in pairs (vector 2v in the low nibbles of the 32 bytes at 32v), then the
 *         12 scale bytes: 140 bytes; d and dmin to `d`.
 *   "q6k" (GGUF Q6_K, 210 bytes: 128 of low nibbles, 64 of top 2-bit pairs, 16 int8 scales,
 *         f16 d): the codes' low 4 bits as "q4k"'s, their top 2 bits in two planes (vector
 *         4p + s in bits 2s of plane p's bytes), then the 16 scales: 208 bytes; d to `d`.
 */
#include <stdint.h>
#include <string.h>

enum { GGML_Q4_K = 12, GGML_Q6_K = 14 };

/* Q4_K: element 64j + i in the low nibble of qs byte 32j + i, element 64j + 32 + i in its high. */
static void q4_k_codes(const uint8_t *qs, uint8_t *e) {
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 32; i++) {
            e[64 * j + i] = qs[32 * j + i] & 0x0F;
            e[64 * j + 32 + i] = qs[32 * j + i] >> 4;
        }
}

/* Q6_K: each half of 128 elements from 64 bytes of low nibbles and 32 of top bits (ggml's
 * dequantize_row_q6_K), code + 32 as stored: 0..63. */
static void q6_k_codes(const uint8_t *ql, const uint8_t *qh, uint8_t *e) {
    for (int half = 0; half < 2; half++, ql += 64, qh += 32, e += 128)
        for (int l = 0; l < 32; l++) {
            e[l] = (ql[l] & 0x0F) | (qh[l] & 3) << 4;
            e[l + 32] = (ql[l + 32] & 0x0F) | (qh[l] >> 2 & 3) << 4;
            e[l + 64] = (ql[l] >> 4) | (qh[l] >> 4 & 3) << 4;
            e[l + 96] = (ql[l + 32] >> 4) | (qh[l] >> 6 & 3) << 4;
        }
}

/* Byte j (= 4l + b) of code vector u. */
static inline uint8_t lane_code(const uint8_t *e, int u, int j) {
    return e[32 * (j >> 2) + 4 * u + (j & 3)];
}

/* Codes' bits shift..shift + 3 of vectors 2v, 2v + 1 as nibble pairs, 4 x 32 bytes at out. */
static void nibble_pairs(const uint8_t *e, int shift, uint8_t *out) {
    for (int v = 0; v < 4; v++)
        for (int j = 0; j < 32; j++)
            out[32 * v + j] = (lane_code(e, 2 * v, j) >> shift & 0x0F) |
                              (lane_code(e, 2 * v + 1, j) >> shift & 0x0F) << 4;
}

/* Codes' bits shift, shift + 1 of vector 4p + s in bits 2s of plane p: 2 x 32 bytes at out. */
static void bit_planes(const uint8_t *e, int shift, uint8_t *out) {
    for (int p = 0; p < 2; p++)
        for (int j = 0; j < 32; j++) {
            uint8_t byte = 0;
            for (int s = 0; s < 4; s++) byte |= (lane_code(e, 4 * p + s, j) >> shift & 3) << 2 * s;
            out[32 * p + j] = byte;
        }
}

/* num_blocks super-blocks of ggml_type (Q4_K or Q6_K) at src -> codes (140 or 208 bytes a
 * block) and their float16 d (and dmin) at d (4 or 2 bytes a block). Returns 0, or -1 for a
 * type it does not re-lay. */
int tm_relay_kquant(int ggml_type, const uint8_t *src, int64_t num_blocks, uint8_t *codes,
                    uint8_t *d) {
    if (ggml_type != GGML_Q4_K && ggml_type != GGML_Q6_K) return -1;
    const int q4 = ggml_type == GGML_Q4_K;
    const int64_t in = q4 ? 144 : 210, out = q4 ? 140 : 208, dn = q4 ? 4 : 2;
#pragma omp parallel for schedule(static) if (num_blocks >= 1024)
    for (int64_t i = 0; i < num_blocks; i++) {
        const uint8_t *b = src + i * in;
        uint8_t *o = codes + i * out, e[256];
        if (q4) {
            q4_k_codes(b + 16, e);
            nibble_pairs(e, 0, o);
            memcpy(o + 128, b + 4, 12);
            memcpy(d + i * dn, b, 4);
        } else {
            q6_k_codes(b, b + 128, e);
            nibble_pairs(e, 0, o);
            bit_planes(e, 4, o + 128);
            memcpy(o + 192, b + 192, 16);
            memcpy(d + i * dn, b + 208, 2);
        }
    }
    return 0;
}
