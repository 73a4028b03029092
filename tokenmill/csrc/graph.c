/*
 * Decode-step graphs: CUDA graphs' idea on the CPU.
 *
 * A batch-1 decode step of a small model runs ~250 kernels of a few microseconds to a few
 * hundred; called one by one from Python each pays ~10-40 us of interpreter and dispatch cost,
 * as much as the arithmetic of the whole step. tokenmill/worker/decode_graph.py records the
 * kernel calls of one decode step (pointers into the weights, the KV cache, fixed input buffers
 * and kept-alive intermediate tensors) and replays them here in one call.
 *
 * An op is a row of TM_OP_WIDTH int64: the op kind, then its arguments in the order of the
 * kernel it calls (pointers and integers as int64, floats as the bits of a double).
 *
 * Also here, the small ops a decode step needs besides tokenmill/csrc/decode_ops.c's:
 *   tm_embed_rows:  rows of a packed table (token embeddings) times a multiplier;
 *   tm_gather_rows: the same for a float32 table;
 *   tm_act_mul:     act(gate) * up over a fused [gate | up] projection (GELU-tanh, SiLU);
 *   tm_kv_write:    new K and V rows into a float32 (or float16) paged cache at their slots;
 *   tm_kv_write_q8: the same into an int8 or fp8 cache, with a scale per token per KV head;
 *   tm_add:         the residual stream's a + b.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "simd.h"
#include "tokenmill.h"

#define TM_TARGET __attribute__((target("avx2,fma,f16c")))
/* out[i] = table row ids[i] (dequantized) * mult; K-element rows. */
TM_TARGET void tm_embed_rows(const int64_t *ids, int64_t n, int64_t K, int kind,
                             const uint8_t *w, const void *scales, const float *offsets,
                             int64_t G, float mult, float *out) {
    const __m256 m = _mm256_set1_ps(mult);
    for (int64_t i = 0; i < n; i++) {
        float *row = out + i * K;
        tm_dequant_rows(ids[i], ids[i] + 1, K, kind, w, scales, offsets, G, row);
        if (mult != 1.0f)
            for (int64_t j = 0; j < K; j += 8)
                _mm256_storeu_ps(row + j, _mm256_mul_ps(_mm256_loadu_ps(row + j), m));
    }
}

/* out[i] = table row ids[i] * mult; K-element float32 rows. */
TM_TARGET void tm_gather_rows(const int64_t *ids, int64_t n, int64_t K, const float *table,
                              float mult, float *out) {
    const __m256 m = _mm256_set1_ps(mult);
    for (int64_t i = 0; i < n; i++) {
        const float *src = table + ids[i] * K;
        float *row = out + i * K;
        int64_t j = 0;
        if (mult != 1.0f)
            for (; j + 8 <= K; j += 8)
                _mm256_storeu_ps(row + j, _mm256_mul_ps(_mm256_loadu_ps(src + j), m));
        for (; j < K; j++) row[j] = mult != 1.0f ? src[j] * mult : src[j];
    }
}

/* GELU, tanh form: 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3). */
TM_TARGET static inline __m256 gelu_tanh8(__m256 x) {
    __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                             _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x),
                                             _mm256_mul_ps(x, x), x));
    __m256 e = tm_exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), u));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

TM_TARGET static inline __m256 silu8(__m256 x) {
    __m256 e = tm_exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

/* gu [n, ld]: gate in columns [0, d), up in [d, 2d); out [n, d]. d a multiple of 8. */
TM_TARGET void tm_act_mul(const float *gu, int64_t n, int64_t d, int64_t ld, int act,
                          float *out) {
#pragma omp parallel for schedule(static) if (n * d >= TM_PARALLEL_MIN_FLOATS / 4) /* exp: 4x the work */
    for (int64_t r = 0; r < n; r++) {
        const float *g = gu + r * ld, *u = g + d;
        float *o = out + r * d;
        for (int64_t i = 0; i < d; i += 8) {
            __m256 x = _mm256_loadu_ps(g + i);
            __m256 a = act == TM_ACT_SILU ? silu8(x) : gelu_tanh8(x);
            _mm256_storeu_ps(o + i, _mm256_mul_ps(a, _mm256_loadu_ps(u + i)));
        }
    }
}

/* Token t's K and V (row elements each, at k + t * k_ld, v + t * v_ld) into slot slots[t]. */
/* f16: the caches hold float16 (rounded to nearest even, as torch's .half()); row a
 * multiple of 8 then. */
TM_TARGET void tm_kv_write(const float *k, int64_t k_ld, const float *v, int64_t v_ld,
                           const int64_t *slots, int64_t n, int64_t row, void *k_cache,
                           void *v_cache, int f16) {
    for (int64_t t = 0; t < n; t++) {
        if (!f16) {
            memcpy((float *)k_cache + slots[t] * row, k + t * k_ld, sizeof(float) * (size_t)row);
            memcpy((float *)v_cache + slots[t] * row, v + t * v_ld, sizeof(float) * (size_t)row);
            continue;
        }
        uint16_t *kd = (uint16_t *)k_cache + slots[t] * row, *vd = (uint16_t *)v_cache + slots[t] * row;
        for (int64_t i = 0; i < row; i += 8) {
            _mm_storeu_si128((__m128i *)(kd + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(k + t * k_ld + i), _MM_FROUND_TO_NEAREST_INT));
            _mm_storeu_si128((__m128i *)(vd + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(v + t * v_ld + i), _MM_FROUND_TO_NEAREST_INT));
        }
    }
}

/* float -> float8 e4m3fn, rounding to nearest even: c10's conversion, bit for bit (|f| >= 480
 * gives NaN; callers clamp to 448 first). */
static inline uint8_t to_fp8_e4m3fn(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    const uint32_t sign = b & 0x80000000u;
    b ^= sign;
    uint8_t r;
    if (b >= 1087u << 20) {
        r = 0x7f;
    } else if (b < 121u << 23) { /* subnormal in e4m3: let a float add do the rounding */
        const uint32_t denorm_bits = 141u << 23;
        float g, denorm;
        memcpy(&g, &b, sizeof g);
        memcpy(&denorm, &denorm_bits, sizeof denorm);
        g += denorm;
        uint32_t gb;
        memcpy(&gb, &g, sizeof gb);
        r = (uint8_t)(gb - denorm_bits);
    } else {
        const uint32_t odd = (b >> 20) & 1u;
        b += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + odd;
        r = (uint8_t)(b >> 20);
    }
    return r | (uint8_t)(sign >> 24);
}

/* One KV head's row x [D] -> one-byte codes (int8, or fp8 e4m3fn) and its scale amax / qmax,
 * as attention/kv_cache.py's quantize_kv does it (x / scale; int8 rounded half to even; both
 * clamped to +-qmax), so both give the same bytes. */
TM_TARGET static void quantize_head(const float *x, int64_t D, int fp8, uint8_t *q, float *scale) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8)
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    float m[8], mx = 0.0f;
    _mm256_storeu_ps(m, amax);
    for (int i = 0; i < 8; i++) mx = m[i] > mx ? m[i] : mx;
    const float qmax = fp8 ? 448.0f : 127.0f, s = mx / qmax;
    *scale = s;
    const __m256 d = _mm256_set1_ps(s > 1.17549435e-38f ? s : 1.17549435e-38f);
    const __m256 lo = _mm256_set1_ps(-qmax), hi = _mm256_set1_ps(qmax);
    for (int64_t i = 0; i < D; i += 8) {
        __m256 y = _mm256_div_ps(_mm256_loadu_ps(x + i), d);
        if (!fp8) y = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        y = _mm256_min_ps(_mm256_max_ps(y, lo), hi);
        if (fp8) {
            float f[8];
            _mm256_storeu_ps(f, y);
            for (int j = 0; j < 8; j++) q[i + j] = to_fp8_e4m3fn(f[j]);
        } else {
            int32_t w[8];
            _mm256_storeu_si256((__m256i *)w, _mm256_cvtps_epi32(y));
            for (int j = 0; j < 8; j++) q[i + j] = (uint8_t)(int8_t)w[j];
        }
    }
}

/* Token t's K and V ([KVH, D] each, at k + t * k_ld, v + t * v_ld) into slot slots[t] of
 * one-byte caches [slots, KVH, D] (int8, or fp8 e4m3fn) and their scales [slots, KVH].
 * D a multiple of 8. */
TM_TARGET void tm_kv_write_q8(const float *k, int64_t k_ld, const float *v, int64_t v_ld,
                              const int64_t *slots, int64_t n, int64_t KVH, int64_t D, int fp8,
                              uint8_t *k_cache, uint8_t *v_cache, float *k_scales,
                              float *v_scales) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t h = 0; h < KVH; h++) {
            const int64_t at = slots[t] * KVH + h;
            quantize_head(k + t * k_ld + h * D, D, fp8, k_cache + at * D, k_scales + at);
            quantize_head(v + t * v_ld + h * D, D, fp8, v_cache + at * D, v_scales + at);
        }
}

/* out = a + b over n floats. */
TM_TARGET void tm_add(const float *a, const float *b, float *out, int64_t n) {
    const int64_t n8 = n / 8 * 8;
#pragma omp parallel for schedule(static) if (n >= TM_PARALLEL_MIN_FLOATS)
    for (int64_t i = 0; i < n8; i += 8)
        _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    for (int64_t i = n8; i < n; i++) out[i] = a[i] + b[i];
}

static inline float f32(int64_t bits) {
    double d;
    memcpy(&d, &bits, sizeof d);
    return (float)d;
}

#define P(i) ((void *)(intptr_t)a[i])

static inline double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Runs ops [n_ops, TM_OP_WIDTH] in order; returns 0, or -1 when a kernel could not allocate.
 * times (optional, [n_ops]): each op's wall time in seconds, for profiling. */
int tm_graph_run(const int64_t *ops, int64_t n_ops, double *times) {
    for (int64_t i = 0; i < n_ops; i++) {
        const double start = times ? seconds() : 0.0;
        const int64_t *a = ops + i * TM_OP_WIDTH + 1;
        int rc = 0;
        switch (ops[i * TM_OP_WIDTH]) {
        case TM_OP_QGEMM:
            rc = tm_qgemm(a[0], a[1], a[2], P(3), (int)a[4], P(5), P(6), P(7), a[8], P(9), P(10),
                          (int)a[11]);
            break;
        case TM_OP_RMSNORM:
            tm_rmsnorm(P(0), a[1], a[2], P(3), f32(a[4]), P(5), P(6), a[7], a[8], f32(a[9]));
            break;
        case TM_OP_ROPE:
            tm_rope_neox(P(0), a[1], P(2), P(3), P(4), a[5], a[6], a[7]);
            break;
        case TM_OP_ATTN:
            rc = tm_decode_attn(P(0), a[1], P(2), P(3), P(4), P(5), P(6), P(7), P(8), a[9], a[10],
                                a[11], a[12], a[13], a[14], a[15], f32(a[16]), P(17), (int)a[18]);
            break;
        case TM_OP_EMBED:
            tm_embed_rows(P(0), a[1], a[2], (int)a[3], P(4), P(5), P(6), a[7], f32(a[8]), P(9));
            break;
        case TM_OP_ACT_MUL:
            tm_act_mul(P(0), a[1], a[2], a[3], (int)a[4], P(5));
            break;
        case TM_OP_GATHER:
            tm_gather_rows(P(0), a[1], a[2], P(3), f32(a[4]), P(5));
            break;
        case TM_OP_KV_WRITE_Q8:
            tm_kv_write_q8(P(0), a[1], P(2), a[3], P(4), a[5], a[6], a[7], (int)a[8], P(9), P(10),
                           P(11), P(12));
            break;
        case TM_OP_ADD:
            tm_add(P(0), P(1), P(2), a[3]);
            break;
        case TM_OP_KV_WRITE:
            tm_kv_write(P(0), a[1], P(2), a[3], P(4), a[5], a[6], P(7), P(8), (int)a[9]);
            break;
        case TM_OP_MOE_ROUTE:
            tm_moe_route(P(0), a[1], a[2], P(3), a[4], a[5], (int)a[6], P(7), P(8));
            break;
        case TM_OP_MOE_EXPERTS:
            rc = tm_moe_experts(a[0], a[1], P(2), a[3], P(4), P(5), P(6), (int)a[7], (int)a[8],
                                P(9), P(10), P(11), P(12), P(13));
            break;
        case TM_OP_HALF_GEMM:
            tm_half_gemm(a[0], a[1], a[2], P(3), P(4), (int)a[5], P(6), P(7));
            break;
        case TM_OP_HALF_ROWS:
            tm_half_rows(P(0), a[1], a[2], P(3), (int)a[4], f32(a[5]), P(6));
            break;
        default:
            return -1;
        }
        if (rc != 0) return -1;
        if (times) times[i] = seconds() - start;
    }
    return 0;
}
