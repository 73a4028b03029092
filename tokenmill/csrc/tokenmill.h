/*
 * The C kernels' one interface: every function the extension exports, the packed weight
 * layouts and their traits, the ops a decode-step graph records and the constants Python
 * shares with the kernels. Python reads this file (kernels/abi.py): it binds each function
 * from its prototype here, and takes the layouts, ops and constants from here. Every .c file
 * includes it, so the compiler holds each definition to its prototype.
 *
 * To add a weight layout: a row of TM_LAYOUTS, its kind in quant/packed.py (checked against
 * the row at load and in tests/kernels/test_abi.py), then its code in qgemm.c.
 */
#ifndef TOKENMILL_H
#define TOKENMILL_H
#include <stdint.h>

/*
 * The packed weight layouts (quant/packed.py's kinds; their byte layouts in qgemm.c's header):
 * X(code, kind, super-block bytes, scale bytes at, group, d a super-block, signed codes).
 * The k-quants (super-block bytes > 0) keep the file's 256-element super-blocks: codes, then
 * the file's sub-block scale bytes from `scale bytes at`, with d (and dmin: 2) as float16 in
 * the weight's scales; group: elements a sub-block. Signed: int8 codes (else unsigned, with a
 * zero point). Kind "": the kernel's own forms of a layout, never stored ("q8", "n4" and "m4"
 * codes run as unsigned bytes code + 128).
 */
#define TM_LAYOUTS(X)                        \
    X(TM_Q8, "q8", 0, 0, 0, 0, 1)            \
    X(TM_Q4, "q4", 0, 0, 0, 0, 0)            \
    X(TM_U8, "u8", 0, 0, 0, 0, 0)            \
    X(TM_Q8_UNSIGNED, "", 0, 0, 0, 0, 0)     \
    X(TM_N4, "n4", 0, 0, 0, 0, 1)            \
    X(TM_N4_UNSIGNED, "", 0, 0, 0, 0, 0)     \
    X(TM_Q2, "q2", 80, 64, 16, 2, 0)         \
    X(TM_Q3, "q3", 108, 96, 16, 1, 0)        \
    X(TM_Q5, "q5", 0, 0, 0, 0, 0)            \
    X(TM_Q4K, "q4k", 140, 128, 32, 2, 0)     \
    X(TM_Q6K, "q6k", 208, 192, 16, 1, 0)     \
    X(TM_Q5K, "q5k", 172, 160, 32, 2, 0)     \
    X(TM_N4K, "n4k", 134, 128, 32, 1, 1)     \
    X(TM_M4, "m4", 0, 0, 0, 0, 1)            \
    X(TM_M4_UNSIGNED, "", 0, 0, 0, 0, 0)

#define TM_LAYOUT_ENUM(code, kind, bytes, at, group, ds, is_signed) code,
enum tm_layout { TM_LAYOUTS(TM_LAYOUT_ENUM) TM_LAYOUT_COUNT };
#undef TM_LAYOUT_ENUM

typedef struct {
    int block_bytes, scales_at, group, ds, is_signed;
} tm_layout_traits;

#define TM_LAYOUT_ROW(code, kind, bytes, at, group, ds, is_signed) {bytes, at, group, ds, is_signed},
static const tm_layout_traits TM_LAYOUT_TRAITS[TM_LAYOUT_COUNT] = {TM_LAYOUTS(TM_LAYOUT_ROW)};
#undef TM_LAYOUT_ROW

/* A weight's `kind` argument: its layout, float16 scales, and its codes' zero point. */
#define TM_KIND_LAYOUT(kind) ((kind) & 63)
#define TM_KIND_F16(kind) ((kind) >> 6 & 1)
#define TM_KIND_ZERO(kind) ((kind) >> 8 & 0xFF)

/* The ops of a recorded decode step (graph.c): a row of TM_OP_WIDTH int64, the op, then its
 * kernel's arguments in order. */
enum tm_op {
    TM_OP_QGEMM = 1,
    TM_OP_RMSNORM,
    TM_OP_ROPE,
    TM_OP_ATTN,
    TM_OP_EMBED,
    TM_OP_ACT_MUL,
    TM_OP_KV_WRITE,
    TM_OP_ADD,
    TM_OP_GATHER,
    TM_OP_KV_WRITE_Q8,
    TM_OP_MOE_ROUTE,
    TM_OP_MOE_EXPERTS,
    TM_OP_HALF_GEMM,
    TM_OP_HALF_ROWS,
};
#define TM_OP_WIDTH 20

/* What tm_act_mul computes. */
enum tm_act { TM_ACT_GELU_TANH = 0, TM_ACT_SILU = 1 };

/* Query heads a KV head tm_decode_attn takes. */
#define TM_MAX_GROUP 16
/* Experts tm_moe_route takes (its per-token buffer). */
#define TM_MOE_MAX_EXPERTS 1024
/* int64 in tm_moe_experts' descriptor of the stacked weights (moe.c). */
#define TM_MOE_DESC_LEN 18

/* qgemm.c: the packed matmul. */
int tm_cpu_supported(void);
const char *tm_qgemm_isa(void);
int tm_qgemm(int64_t M, int64_t N, int64_t K, const float *x, int kind, const uint8_t *w,
             const void *scales, const float *offsets, int64_t G, const float *bias, float *y,
             int act_int8);
void tm_dequant_rows(int64_t n0, int64_t n1, int64_t K, int kind, const uint8_t *w,
                     const void *scales, const float *offsets, int64_t G, float *out);

/* relay.c: GGUF blocks re-laid at load. */
int tm_relay_kquant(int ggml_type, const uint8_t *src, int64_t num_blocks, uint8_t *codes,
                    uint8_t *d);
int tm_relay_q32(int ggml_type, const uint8_t *src, int64_t rows, int64_t cols, uint8_t *codes,
                 uint8_t *d);

/* half.c: float16 / bfloat16 weights. */
void tm_half_gemm(int64_t M, int64_t N, int64_t K, const float *x, const uint16_t *w, int bf16,
                  const float *bias, float *y);
void tm_half_rows(const int64_t *ids, int64_t n, int64_t K, const uint16_t *table, int bf16,
                  float mult, float *out);

/* decode_ops.c: a decode step's small ops. */
void tm_rmsnorm(const float *x, int64_t outer_stride, int64_t inner, const float *weight,
                float weight_offset, const float *residual, float *out, int64_t rows, int64_t dim,
                float eps);
void tm_rope_neox(float *x, int64_t token_stride, const int64_t *positions, const float *cos_t,
                  const float *sin_t, int64_t tokens, int64_t heads, int64_t dim);
int tm_decode_attn(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                   const float *k_scales, const float *v_scales, const float *fp8_lut,
                   const int64_t *block_table, const int64_t *seq_lens, int64_t nd, int64_t H,
                   int64_t KVH, int64_t D, int64_t bs, int64_t max_blocks, int64_t window,
                   float scale, float *out, int kv_f16);
int tm_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out);
void tm_apply_bitmask(float *logits, const int32_t *mask, int64_t n);

/* prefill_attn.c: causal attention over a prompt. */
int tm_prefill_attn(const float *q, const float *k, const float *v, int64_t n, int64_t nk,
                    int64_t H, int64_t KVH, int64_t D, int64_t q0, int64_t k0, int64_t window,
                    float scale, float *out);

/* graph.c: decode-step graphs, and the ops only they and the decode step use. */
void tm_embed_rows(const int64_t *ids, int64_t n, int64_t K, int kind, const uint8_t *w,
                   const void *scales, const float *offsets, int64_t G, float mult, float *out);
void tm_gather_rows(const int64_t *ids, int64_t n, int64_t K, const float *table, float mult,
                    float *out);
void tm_act_mul(const float *gu, int64_t n, int64_t d, int64_t ld, int act, float *out);
void tm_kv_write(const float *k, int64_t k_ld, const float *v, int64_t v_ld, const int64_t *slots,
                 int64_t n, int64_t row, void *k_cache, void *v_cache, int f16);
void tm_kv_write_q8(const float *k, int64_t k_ld, const float *v, int64_t v_ld,
                    const int64_t *slots, int64_t n, int64_t KVH, int64_t D, int fp8,
                    uint8_t *k_cache, uint8_t *v_cache, float *k_scales, float *v_scales);
void tm_add(const float *a, const float *b, float *out, int64_t n);
int tm_graph_run(const int64_t *ops, int64_t n_ops, double *times);

/* moe.c: mixture-of-experts layers. */
void tm_moe_route(const float *x, int64_t T, int64_t H, const float *router, int64_t E,
                  int64_t k, int renorm, float *weights, int64_t *ids);
int64_t tm_moe_work_bytes(int64_t T, int64_t H, int64_t I, int64_t E, int64_t k);
int tm_moe_experts(int64_t T, int64_t H, const float *x, int64_t k, const float *weights,
                   const int64_t *ids, const int64_t *desc, int act, int act_mode,
                   int64_t *counts, const float *shared, const float *shared_gate, float *out,
                   uint8_t *work);

#endif
