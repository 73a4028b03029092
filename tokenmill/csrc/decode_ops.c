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
 * Each has a torch twin in tokenmill/layers and tokenmill/attention, which tests compare.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define TM_TARGET __attribute__((target("avx2,fma")))

TM_TARGET static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* gain = weight + weight_offset (Gemma stores 1 + w as w); dim must be a multiple of 8.
 * Row r of x starts at x + (r / inner) * outer_stride + (r % inner) * dim: groups of `inner`
 * adjacent rows, groups outer_stride apart (q or k heads viewed in a fused q/k/v projection);
 * out and residual are dense [rows, dim]. */
TM_TARGET void tm_rmsnorm(const float *x, int64_t outer_stride, int64_t inner,
                          const float *weight, float weight_offset, const float *residual,
                          float *out, int64_t rows, int64_t dim, float eps) {
    const __m256 offset = _mm256_set1_ps(weight_offset);
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + (r / inner) * outer_stride + (r % inner) * dim;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < dim; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum8(acc) / (float)dim + eps));
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

/* x [tokens, heads, dim]; cos/sin [max_position, dim / 2]; dim / 2 a multiple of 8. */
TM_TARGET void tm_rope_neox(float *x, const int64_t *positions, const float *cos_t,
                            const float *sin_t, int64_t tokens, int64_t heads, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_t + positions[t] * half, *s = sin_t + positions[t] * half;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + (t * heads + h) * dim;
            for (int64_t i = 0; i < half; i += 8) {
                __m256 x1 = _mm256_loadu_ps(v + i), x2 = _mm256_loadu_ps(v + half + i);
                __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
                _mm256_storeu_ps(v + i, _mm256_fmsub_ps(x1, cv, _mm256_mul_ps(x2, sv)));
                _mm256_storeu_ps(v + half + i, _mm256_fmadd_ps(x2, cv, _mm256_mul_ps(x1, sv)));
            }
        }
    }
}

/*
 * q [nd, H, D]; k_cache, v_cache [blocks, bs, KVH, D] float32, or int8 / fp8 (fp8_lut: the
 * 256 e4m3 values) with k_scales, v_scales [blocks, bs, KVH] float32 (NULL for float32);
 * block_table [nd, max_blocks] int64;
 * seq_lens [nd] (the query is the last token); window 0 = none, else keys at positions
 * >= seq_len - window. out [nd, H, D]. D a multiple of 8. Returns -1 if scratch memory fails.
 */
/* 8 cached elements as floats: float32 rows, or one-byte codes (int8, or fp8 e4m3 decoded
 * through a 256-entry table); their per-token scale is applied by the caller. */
TM_TARGET static inline __m256 load8(const void *base, int64_t idx, int bytes, const float *lut) {
    if (!bytes) return _mm256_loadu_ps((const float *)base + idx);
    __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)base + idx));
    if (lut) return _mm256_i32gather_ps(lut, _mm256_cvtepu8_epi32(b), 4);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

TM_TARGET int tm_decode_attn(const float *q, const void *k_cache, const void *v_cache,
                             const float *k_scales, const float *v_scales, const float *fp8_lut,
                             const int64_t *block_table, const int64_t *seq_lens, int64_t nd,
                             int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t max_blocks,
                             int64_t window, float scale, float *out) {
    /* A one-byte cache (int8, or fp8 with fp8_lut) has a float32 scale per token per KV head. */
    const int q8 = k_scales != NULL;
    int64_t max_len = 0;
    for (int64_t i = 0; i < nd; i++) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    const int64_t group = H / KVH, row = KVH * D;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(max_len > 0 ? max_len : 1));
        if (!scores) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < nd * H; job++) {
            if (!scores) continue;
            const int64_t seq = job / H, h = job % H, kvh = h / group;
            const int64_t len = seq_lens[seq];
            const int64_t start = window > 0 && len > window ? len - window : 0;
            const float *qv = q + (seq * H + h) * D;
            const int64_t *table = block_table + seq * max_blocks;
            float mx = -INFINITY;
            for (int64_t p = start; p < len; p++) {
                const int64_t slot = table[p / bs] * bs + p % bs, at = slot * row + kvh * D;
                __m256 acc = _mm256_setzero_ps();
                for (int64_t i = 0; i < D; i += 8)
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(qv + i), load8(k_cache, at + i, q8, fp8_lut), acc);
                float sc = hsum8(acc) * scale * (q8 ? k_scales[slot * KVH + kvh] : 1.0f);
                scores[p] = sc;
                mx = sc > mx ? sc : mx;
            }
            float denom = 0.0f;
            for (int64_t p = start; p < len; p++) {
                scores[p] = expf(scores[p] - mx);
                denom += scores[p];
            }
            /* V rows are read in order (one pass over the context); the sum stays in L1. */
            float *o = out + (seq * H + h) * D;
            for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(o + i, _mm256_setzero_ps());
            for (int64_t p = start; p < len; p++) {
                const int64_t slot = table[p / bs] * bs + p % bs, at = slot * row + kvh * D;
                __m256 w = _mm256_set1_ps(scores[p] * (q8 ? v_scales[slot * KVH + kvh] : 1.0f));
                for (int64_t i = 0; i < D; i += 8)
                    _mm256_storeu_ps(
                        o + i, _mm256_fmadd_ps(w, load8(v_cache, at + i, q8, fp8_lut), _mm256_loadu_ps(o + i)));
            }
            const __m256 inv = _mm256_set1_ps(1.0f / denom);
            for (int64_t i = 0; i < D; i += 8)
                _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), inv));
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* out[r] = the first index of the largest value of row r of x [rows, n] (torch.argmax's
 * answer; torch's own is scalar, ~0.4 ms over a 262k vocabulary). Returns -1 when a row
 * holds a NaN, which the caller leaves to torch. */
TM_TARGET int tm_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * n;
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
        int64_t at = -1;
        for (int64_t j = 0; j + 8 <= n && at < 0; j += 8) {
            int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + j), b, _CMP_EQ_OQ));
            if (mask) at = j + __builtin_ctz(mask);
        }
        for (int64_t j = i; j < n && at < 0; j++)
            if (v[j] == best) at = j;
        out[r] = at;
    }
    return 0;
}
