/*
 * Small per-token operations of a decode step, on float32 CPU tensors (AVX2 + FMA).
 *
 * At batch 1 a decode step of gemma-3-270m runs ~100 RMSNorms, 18 RoPEs and 18 attentions over
 * tensors of a few hundred floats; through torch each costs 20-60 us of dispatch against well
 * under a microsecond of arithmetic. These do the arithmetic in one call each:
 *   tm_rmsnorm:     out = residual + x / rms(x) * (w + offset) (residual optional), by row;
 *   tm_rope_neox:   rotate-half RoPE of [tokens, heads, head_dim] in place from cos/sin tables;
 *   tm_decode_attn: one query per sequence against its paged K/V (block table, length,
 *                   sliding window, GQA), softmax in float32, without gathering blocks;
 *   tm_argmax_rows: the sampler's argmax over the vocabulary.
 *   tm_apply_bitmask: a grammar's token bitmask on a logits row (disallowed -> -inf).
 * Each has a torch twin in tokenmill/layers and tokenmill/attention, which tests compare.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"
#include "tokenmill.h"

#define TM_TARGET __attribute__((target("avx2,fma,f16c")))

/* gain = weight + weight_offset (Gemma stores 1 + w as w); dim must be a multiple of 8.
 * Row r of x starts at x + (r / inner) * outer_stride + (r % inner) * dim: groups of `inner`
 * adjacent rows, groups outer_stride apart (q or k heads viewed in a fused q/k/v projection);
 * out and residual are dense [rows, dim]. */
TM_TARGET void tm_rmsnorm(const float *x, int64_t outer_stride, int64_t inner,
                          const float *weight, float weight_offset, const float *residual,
                          float *out, int64_t rows, int64_t dim, float eps) {
    const __m256 offset = _mm256_set1_ps(weight_offset);
#pragma omp parallel for schedule(static) if (rows * dim >= TM_PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + (r / inner) * outer_stride + (r % inner) * dim;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < dim; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        __m256 inv = _mm256_set1_ps(1.0f / sqrtf(tm_hsum8(acc) / (float)dim + eps));
        float *o = out + r * dim;
        const float *res = residual ? residual + r * dim : NULL;
        for (int64_t i = 0; i < dim; i += 8) {
            __m256 gain = _mm256_add_ps(_mm256_loadu_ps(weight + i), offset);
            __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), inv), gain);
            if (res) v = _mm256_add_ps(v, _mm256_loadu_ps(res + i));
            _mm256_storeu_ps(o + i, v);
        }
    }
}

/* x [tokens, heads, dim], token t at x + t * token_stride (q or k inside a fused q/k/v
 * projection), heads dense; cos/sin [max_position, dim / 2]; dim / 2 a multiple of 8. */
TM_TARGET void tm_rope_neox(float *x, int64_t token_stride, const int64_t *positions,
                            const float *cos_t, const float *sin_t, int64_t tokens, int64_t heads,
                            int64_t dim) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * dim >= TM_PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_t + positions[t] * half, *s = sin_t + positions[t] * half;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * token_stride + h * dim;
            for (int64_t i = 0; i < half; i += 8) {
                __m256 x1 = _mm256_loadu_ps(v + i), x2 = _mm256_loadu_ps(v + half + i);
                __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
                _mm256_storeu_ps(v + i, _mm256_fmsub_ps(x1, cv, _mm256_mul_ps(x2, sv)));
                _mm256_storeu_ps(v + half + i, _mm256_fmadd_ps(x2, cv, _mm256_mul_ps(x1, sv)));
            }
        }
    }
}

/* 8 cached elements as floats: float32 rows, or one-byte codes (int8, or fp8 e4m3 decoded
 * through a 256-entry table); their per-token scale is applied by the caller. */
/* 8 cache elements as float: bytes 0 = float32, 2 = float16, 1 = int8 (or fp8 through lut). */
TM_TARGET static inline __m256 load8(const void *base, int64_t idx, int bytes, const float *lut) {
    if (!bytes) return _mm256_loadu_ps((const float *)base + idx);
    if (bytes == 2) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + idx)));
    __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)base + idx));
    if (lut) return _mm256_i32gather_ps(lut, _mm256_cvtepu8_epi32(b), 4);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}


/* One job: the `group` query heads of KV head kvh over context positions [lo, hi) of one
 * sequence. Each K and V row is read once for all of them (GQA). Leaves the unnormalized
 * output o[g][D], the running max m[g] and the sum of exponentials l[g] (flash-decoding's
 * partial state; an empty range gives m = -inf, l = 0, o = 0). Inlined into one copy per
 * group size so the per-head accumulators live in registers. */
TM_TARGET static inline __attribute__((always_inline)) void attend_span_impl(
    const int64_t group, const float *q, const void *k_cache, const void *v_cache,
    const float *k_scales, const float *v_scales, const float *lut, int q8, const int64_t *table,
    int64_t kvh, int64_t KVH, int64_t D, int64_t bs, int64_t lo, int64_t hi, float scale,
    float *scores, float *o, float *m, float *l) {
    const int64_t row = KVH * D, n = hi - lo;
    for (int64_t g = 0; g < group; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(o + g * D + i, _mm256_setzero_ps());
    }
    if (n <= 0) return;
    const int64_t stride = (n + 7) / 8 * 8; /* scores rows padded for 8-wide exp */
    /* Block by block: position p sits in slot table[p / bs] * bs + p % bs. */
#define TM_FOR_POSITIONS(BODY)                                                               \
    for (int64_t b = lo / bs; b * bs < hi; b++) {                                            \
        const int64_t p0 = b * bs > lo ? b * bs : lo, p1 = (b + 1) * bs < hi ? (b + 1) * bs : hi; \
        for (int64_t p = p0, slot = table[b] * bs + p0 - b * bs; p < p1; p++, slot++) {      \
            const int64_t at = slot * row + kvh * D;                                         \
            BODY                                                                             \
        }                                                                                    \
    }
    /* Scores: a K row against every head's query. */
    TM_FOR_POSITIONS({
        __m256 acc[TM_MAX_GROUP];
        for (int64_t g = 0; g < group; g++) acc[g] = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 8) {
            __m256 kv = load8(k_cache, at + i, q8, lut);
            for (int64_t g = 0; g < group; g++)
                acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + i), kv, acc[g]);
        }
        const float ks = scale * (q8 == 1 ? k_scales[slot * KVH + kvh] : 1.0f);
        for (int64_t g = 0; g < group; g++) {
            float sc = tm_hsum8(acc[g]) * ks;
            scores[g * stride + p - lo] = sc;
            m[g] = sc > m[g] ? sc : m[g];
        }
    })
    /* exp(score - max), with each V row's scale folded in (int8 / fp8 caches). */
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * stride;
        for (int64_t j = n; j < stride; j++) sg[j] = -INFINITY;
        const __m256 mv = _mm256_set1_ps(m[g]);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t j = 0; j < stride; j += 8) {
            __m256 e = tm_exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), mv));
            e = j + 8 <= n ? e : _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                _mm256_set1_epi32((int)(n - j)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
            _mm256_storeu_ps(sg + j, e);
            sum = _mm256_add_ps(sum, e);
        }
        l[g] = tm_hsum8(sum);
    }
    if (q8 == 1)
        TM_FOR_POSITIONS({
            for (int64_t g = 0; g < group; g++) scores[g * stride + p - lo] *= v_scales[slot * KVH + kvh];
        })
    /* Outputs 8 columns at a time, summed over the span in registers: V's rows stream from
     * L1/L2 once per column slice, and nothing is stored until the slice is done. */
    for (int64_t i = 0; i < D; i += 8) {
        __m256 acc[TM_MAX_GROUP];
        for (int64_t g = 0; g < group; g++) acc[g] = _mm256_setzero_ps();
        TM_FOR_POSITIONS({
            __m256 vv = load8(v_cache, at + i, q8, lut);
            for (int64_t g = 0; g < group; g++)
                acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(scores[g * stride + p - lo]), vv, acc[g]);
        })
        for (int64_t g = 0; g < group; g++) _mm256_storeu_ps(o + g * D + i, acc[g]);
    }
#undef TM_FOR_POSITIONS
}

#define TM_SPAN_ARGS                                                                         \
    const float *q, const void *k_cache, const void *v_cache, const float *k_scales,         \
        const float *v_scales, const float *lut, int q8, const int64_t *table, int64_t kvh,  \
        int64_t KVH, int64_t D, int64_t bs, int64_t lo, int64_t hi, float scale,             \
        float *scores, float *o, float *m, float *l
#define TM_SPAN_CALL(G)                                                                      \
    attend_span_impl(G, q, k_cache, v_cache, k_scales, v_scales, lut, q8, table, kvh, KVH, D, \
                     bs, lo, hi, scale, scores, o, m, l)
TM_TARGET static void attend_span_1(TM_SPAN_ARGS) { TM_SPAN_CALL(1); }
TM_TARGET static void attend_span_2(TM_SPAN_ARGS) { TM_SPAN_CALL(2); }
TM_TARGET static void attend_span_4(TM_SPAN_ARGS) { TM_SPAN_CALL(4); }
TM_TARGET static void attend_span_8(TM_SPAN_ARGS) { TM_SPAN_CALL(8); }

TM_TARGET static void attend_span(int64_t group, TM_SPAN_ARGS) {
    switch (group) {
    case 1: attend_span_1(q, k_cache, v_cache, k_scales, v_scales, lut, q8, table, kvh, KVH, D, bs, lo, hi, scale, scores, o, m, l); break;
    case 2: attend_span_2(q, k_cache, v_cache, k_scales, v_scales, lut, q8, table, kvh, KVH, D, bs, lo, hi, scale, scores, o, m, l); break;
    case 4: attend_span_4(q, k_cache, v_cache, k_scales, v_scales, lut, q8, table, kvh, KVH, D, bs, lo, hi, scale, scores, o, m, l); break;
    case 8: attend_span_8(q, k_cache, v_cache, k_scales, v_scales, lut, q8, table, kvh, KVH, D, bs, lo, hi, scale, scores, o, m, l); break;
    default: TM_SPAN_CALL(group); /* other group sizes: accumulators in memory */
    }
}
#undef TM_SPAN_CALL
#undef TM_SPAN_ARGS

/*
 * q [nd, H, D] (sequence i's heads dense at q + i * q_stride); k_cache, v_cache [blocks, bs, KVH, D] float32 (float16 with kv_f16), or int8 / fp8 (fp8_lut: the
 * 256 e4m3 values) with k_scales, v_scales [blocks, bs, KVH] float32 (NULL for float32);
 * block_table [nd, max_blocks] int64;
 * seq_lens [nd] (the query is the last token); window 0 = none, else keys at positions
 * >= seq_len - window. out [nd, H, D]. D a multiple of 8, H / KVH <= 16. Returns -1 if scratch
 * memory fails.
 *
 * Jobs are (sequence, KV head, span of the context): a batch-1 step of a model with one KV head
 * would otherwise leave all but one thread idle, so long contexts are split into spans whose
 * partial softmax states are merged at the end (flash-decoding).
 */
TM_TARGET int tm_decode_attn(const float *q, int64_t q_stride, const void *k_cache,
                             const void *v_cache,
                             const float *k_scales, const float *v_scales, const float *fp8_lut,
                             const int64_t *block_table, const int64_t *seq_lens, int64_t nd,
                             int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t max_blocks,
                             int64_t window, float scale, float *out, int kv_f16) {
    /* element bytes code for load8; one-byte caches have a float32 scale per token per KV head */
    const int q8 = k_scales != NULL ? 1 : kv_f16 ? 2 : 0;
    const int64_t group = H / KVH;
    if (group > TM_MAX_GROUP) return -1;
    int64_t max_len = 1;
    for (int64_t i = 0; i < nd; i++) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    if (window > 0 && max_len > window) max_len = window;
    int64_t splits = 1; /* enough jobs for every thread, spans of at least 32 positions */
    const int64_t threads = omp_get_max_threads();
    while (nd * KVH * splits < threads && max_len / (2 * splits) >= 32) splits *= 2;
    const int64_t jobs = nd * KVH * splits, span_max = (max_len + splits - 1) / splits + 8;
    float *part = malloc(sizeof(float) * (size_t)(jobs * group * (D + 2)));
    if (!part) return -1;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * span_max));
        if (!scores) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < jobs; job++) {
            if (!scores) continue;
            const int64_t seq = job / (KVH * splits), kvh = job / splits % KVH, s = job % splits;
            const int64_t len = seq_lens[seq];
            const int64_t start = window > 0 && len > window ? len - window : 0;
            const int64_t lo = start + (len - start) * s / splits;
            const int64_t hi = start + (len - start) * (s + 1) / splits;
            float *o = part + job * group * (D + 2), *m = o + group * D, *l = m + group;
            attend_span(group, q + seq * q_stride + kvh * group * D, k_cache, v_cache, k_scales,
                        v_scales, fp8_lut, q8, block_table + seq * max_blocks, kvh, KVH, D, bs, lo,
                        hi, scale, scores, o, m, l);
        }
        free(scores);
    }
    /* Merge each head's spans: out = sum_s o_s e^(m_s - m) / sum_s l_s e^(m_s - m). */
    for (int64_t seq = 0; seq < nd && !failed; seq++)
        for (int64_t kvh = 0; kvh < KVH; kvh++)
            for (int64_t g = 0; g < group; g++) {
                const float *first = part + (seq * KVH + kvh) * splits * group * (D + 2);
                float mx = -INFINITY, denom = 0.0f;
                for (int64_t s = 0; s < splits; s++) {
                    const float ms = first[s * group * (D + 2) + group * D + g];
                    mx = ms > mx ? ms : mx;
                }
                float *dst = out + (seq * H + kvh * group + g) * D;
                for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(dst + i, _mm256_setzero_ps());
                for (int64_t s = 0; s < splits; s++) {
                    const float *ps = first + s * group * (D + 2);
                    const float ls = ps[group * D + group + g];
                    if (ls == 0.0f) continue; /* an empty span */
                    const float c = expf(ps[group * D + g] - mx);
                    denom += ls * c;
                    const __m256 cv = _mm256_set1_ps(c);
                    for (int64_t i = 0; i < D; i += 8)
                        _mm256_storeu_ps(dst + i, _mm256_fmadd_ps(cv, _mm256_loadu_ps(ps + g * D + i),
                                                                  _mm256_loadu_ps(dst + i)));
                }
                const __m256 inv = _mm256_set1_ps(1.0f / denom);
                for (int64_t i = 0; i < D; i += 8)
                    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_loadu_ps(dst + i), inv));
            }
    free(part);
    return failed ? -1 : 0;
}

/* out[r] = the first index of the largest value of row r of x [rows, n] (torch.argmax's
 * answer; torch's own is scalar, ~0.4 ms over a 262k vocabulary). Returns -1 when a row
 * holds a NaN, which the caller leaves to torch. */
/* The first index of v's largest value; -1 if v holds a NaN. */
TM_TARGET static int64_t argmax_row(const float *v, int64_t n) {
    __m256 mx = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_loadu_ps(v + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        mx = _mm256_max_ps(mx, a);
    }
    if (_mm256_movemask_ps(nan)) return -1;
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    float best = _mm_cvtss_f32(m);
    for (int64_t j = i; j < n; j++) {
        if (v[j] != v[j]) return -1;
        best = v[j] > best ? v[j] : best;
    }
    const __m256 b = _mm256_set1_ps(best);
    for (int64_t j = 0; j + 8 <= n; j += 8) {
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + j), b, _CMP_EQ_OQ));
        if (mask) return j + __builtin_ctz(mask);
    }
    for (int64_t j = i; j < n; j++)
        if (v[j] == best) return j;
    return -1; /* unreachable: best is one of v's values */
}

/* Rows split over the threads: at 32 rows of a 262k vocabulary one thread read 33 MB. */
TM_TARGET int tm_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
    int bad = 0;
#pragma omp parallel for schedule(static) if (rows > 1) reduction(| : bad)
    for (int64_t r = 0; r < rows; r++) {
        out[r] = argmax_row(x + r * n, n);
        bad |= out[r] < 0;
    }
    return bad ? -1 : 0;
}

/* logits[t] = -inf for every token t whose bit (bit t % 32 of word t / 32) is 0: a grammar's
 * allowed tokens on one logits row of n floats. Words of all ones (inside a JSON string, most
 * of the vocabulary) are skipped, words of all zeros filled 8 at a time: ~10-50 us a 262k row,
 * where torch.where over the unpacked mask took ~0.5 ms. */
TM_TARGET void tm_apply_bitmask(float *logits, const int32_t *mask, int64_t n) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t w = 0; w * 32 < n; w++) {
        const uint32_t bits = (uint32_t)mask[w];
        if (bits == 0xFFFFFFFFu) continue;
        float *v = logits + w * 32;
        const int64_t len = n - w * 32 < 32 ? n - w * 32 : 32;
        if (bits == 0 && len == 32) {
            for (int i = 0; i < 32; i += 8) _mm256_storeu_ps(v + i, ninf);
            continue;
        }
        for (int64_t i = 0; i < len; i++)
            if (!((bits >> i) & 1u)) v[i] = -INFINITY;
    }
}
