/*
 * Causal attention of a prompt's queries over its own keys on the CPU (AVX2 + FMA), in float32:
 * flash attention (blocks of keys, an online softmax), with the query heads that share a KV
 * head (GQA) stacked into one block of rows, so each key and value row is read once for all
 * of them.
 *
 * Why not torch's SDPA: below ~768 queries its CPU flash kernel runs each query head alone
 * over blocks of 64 queries, through small sgemm calls; for gemma-3-270m (4 query heads on 1
 * KV head, head_dim 256) a 512-token prompt's attention took 6.4 ms a layer there and 3.4 ms
 * here (AMD EPYC Zen 4, 2 threads; ~160 GFLOP/s), a 2,048-token one 62 and 51 ms. Past ~2k
 * keys torch's kernel is as fast or faster (cpu_backend.py then uses it). Its torch twin, and
 * this kernel's test oracle, is attention/backends/torch_backend.py: _attend_masked.
 *
 * The work of a job (one KV head, QB query positions: R = QB * group rows):
 *   Qs = its query rows times the softmax scale, row r = position r / group, head r % group;
 *   for each block of KB keys it can see: S = Qs Kᵀ (4 rows by 16 keys in registers, K read
 *   transposed), masked at the diagonal and the window's edge; the running max m, sum l and
 *   output O of each row rescaled to the new max; O += exp(S - m) V.
 *   out = O / l.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#include "tokenmill.h"

#define TM_TARGET __attribute__((target("avx2,fma,f16c")))
#define KB 64 /* keys a block */
/* Query rows a job, at most (QB positions times the group): each block of K and V is read
 * once per job, so past LONG_KEYS keys jobs grow to 256 rows and read them a quarter as
 * often: a 2,048-token chunk on 6,144 cached tokens took 467 ms with 64, 403 ms with 256
 * (AMD EPYC Zen 4, 2 threads). */
#define ROWS 64
#define ROWS_LONG 256
#define LONG_KEYS 1024

/* S[r][j] = Qs[r] · K[j] for 4 rows and 16 keys: kt is K transposed (row d: the keys' d-th
 * elements, kt_stride apart), so each step is 2 loads, 4 broadcasts and 8 FMAs. */
TM_TARGET static inline void scores_4x16(const float *qs, int64_t D, const float *kt,
                                         int64_t kt_stride, float *s) {
    __m256 acc[4][2];
    for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m256 k0 = _mm256_loadu_ps(kt + d * kt_stride), k1 = _mm256_loadu_ps(kt + d * kt_stride + 8);
        for (int r = 0; r < 4; r++) {
            const __m256 qv = _mm256_broadcast_ss(qs + r * D + d);
            acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
        }
    }
    for (int r = 0; r < 4; r++) {
        _mm256_storeu_ps(s + r * KB, acc[r][0]);
        _mm256_storeu_ps(s + r * KB + 8, acc[r][1]);
    }
}

/* O[r][0..15] += sum_j P[r][j] V[j][0..15] for 4 rows (o, v: the slice's first column). */
TM_TARGET static inline void accumulate_4(const float *p, const float *v, int64_t v_stride,
                                          int64_t nkeys, int64_t D, float *o) {
    __m256 acc[4][2];
    for (int r = 0; r < 4; r++) {
        acc[r][0] = _mm256_loadu_ps(o + r * D);
        acc[r][1] = _mm256_loadu_ps(o + r * D + 8);
    }
    for (int64_t j = 0; j < nkeys; j++) {
        const __m256 v0 = _mm256_loadu_ps(v + j * v_stride), v1 = _mm256_loadu_ps(v + j * v_stride + 8);
        for (int r = 0; r < 4; r++) {
            const __m256 pv = _mm256_broadcast_ss(p + r * KB + j);
            acc[r][0] = _mm256_fmadd_ps(pv, v0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(pv, v1, acc[r][1]);
        }
    }
    for (int r = 0; r < 4; r++) {
        _mm256_storeu_ps(o + r * D, acc[r][0]);
        _mm256_storeu_ps(o + r * D + 8, acc[r][1]);
    }
}

/* One job's rows (positions p0 .. p0 + npos - 1 of KV head h) over their keys. */
TM_TARGET static void attend_rows(const float *q, const float *kt, int64_t kt_stride, const float *v,
                                  int64_t H, int64_t KVH, int64_t D, int64_t group, int64_t h,
                                  int64_t i0, int64_t npos, int64_t q0, int64_t k0,
                                  int64_t window, float scale, float *qs, float *s, float *o,
                                  float *m, float *l, float *out) {
    const int64_t rows = npos * group, padded = (rows + 3) / 4 * 4;
    const __m256 sv = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < npos; i++) { /* the group's heads are adjacent in q */
        const float *src = q + ((i0 + i) * H + h * group) * D;
        for (int64_t e = 0; e < group * D; e += 8)
            _mm256_storeu_ps(qs + i * group * D + e, _mm256_mul_ps(_mm256_loadu_ps(src + e), sv));
    }
    memset(qs + rows * D, 0, sizeof(float) * (size_t)((padded - rows) * D));
    memset(o, 0, sizeof(float) * (size_t)(padded * D));
    for (int64_t r = 0; r < padded; r++) m[r] = -INFINITY, l[r] = 0.0f;
    const int64_t p_lo = q0 + i0, p_hi = p_lo + npos - 1; /* the job's first and last position */
    int64_t j_lo = 0, j_hi = p_hi - k0 + 1;                 /* keys [j_lo, j_hi) */
    if (window > 0 && p_lo - window + 1 - k0 > 0) j_lo = p_lo - window + 1 - k0;
    const int64_t v_stride = KVH * D;
    for (int64_t j0 = j_lo; j0 < j_hi; j0 += KB) {
        const int64_t nkeys = j_hi - j0 < KB ? j_hi - j0 : KB, strips = (nkeys + 15) / 16;
        /* a strip of 16 keys (D rows of kt) stays in L1 while every row meets it */
        for (int64_t t = 0; t < strips; t++)
            for (int64_t r = 0; r < padded; r += 4)
                scores_4x16(qs + r * D, D, kt + j0 + t * 16, kt_stride, s + r * KB + t * 16);
        /* Positions of the block's keys a row may not see: after it, or out of its window. */
        const int edge = k0 + j0 + nkeys - 1 > p_lo || (window > 0 && k0 + j0 <= p_hi - window);
        for (int64_t r = 0; r < rows; r++) {
            float *sr = s + r * KB;
            const int64_t p = p_lo + r / group;
            if (edge)
                for (int64_t j = 0; j < nkeys; j++) {
                    const int64_t kp = k0 + j0 + j;
                    if (kp > p || (window > 0 && kp <= p - window)) sr[j] = -INFINITY;
                }
            float mx = -INFINITY;
            for (int64_t j = 0; j < nkeys; j++) mx = sr[j] > mx ? sr[j] : mx;
            if (mx == -INFINITY) { /* nothing visible in this block */
                for (int64_t j = 0; j < KB; j++) sr[j] = 0.0f;
                continue;
            }
            const float m_new = mx > m[r] ? mx : m[r];
            const float alpha = expf(m[r] - m_new); /* 0 on the first visible block */
            const __m256 mv = _mm256_set1_ps(m_new);
            __m256 sum = _mm256_setzero_ps();
            int64_t j = 0;
            for (; j + 8 <= nkeys; j += 8) {
                const __m256 x = _mm256_loadu_ps(sr + j);
                /* masked keys weigh exactly 0 (tm_exp8 clamps -inf to a tiny number) */
                const __m256 seen = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_GT_OQ);
                const __m256 e = _mm256_and_ps(tm_exp8(_mm256_sub_ps(x, mv)), seen);
                _mm256_storeu_ps(sr + j, e);
                sum = _mm256_add_ps(sum, e);
            }
            float tail = 0.0f;
            for (; j < nkeys; j++) tail += sr[j] = expf(sr[j] - m_new);
            for (; j < KB; j++) sr[j] = 0.0f;
            l[r] = l[r] * alpha + tm_hsum8(sum) + tail;
            if (alpha != 1.0f) {
                const __m256 av = _mm256_set1_ps(alpha);
                for (int64_t c = 0; c < D; c += 8)
                    _mm256_storeu_ps(o + r * D + c, _mm256_mul_ps(_mm256_loadu_ps(o + r * D + c), av));
            }
            m[r] = m_new;
        }
        for (int64_t r = rows; r < padded; r++) memset(s + r * KB, 0, sizeof(float) * KB);
        /* 16 columns of the block's V rows stay in L1 while every row adds them */
        for (int64_t c = 0; c < D; c += 16)
            for (int64_t r = 0; r < padded; r += 4)
                accumulate_4(s + r * KB, v + (j0 * KVH + h) * D + c, v_stride, nkeys, D, o + r * D + c);
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = i0 + r / group, head = h * group + r % group;
        const __m256 inv = _mm256_set1_ps(l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
        float *dst = out + (i * H + head) * D;
        for (int64_t c = 0; c < D; c += 8)
            _mm256_storeu_ps(dst + c, _mm256_mul_ps(_mm256_loadu_ps(o + r * D + c), inv));
    }
}

/*
 * q [n, H, D] at positions q0 .. q0 + n - 1; k, v [nk, KVH, D] at positions k0 .. k0 + nk - 1,
 * ending with the last query (q0 + n == k0 + nk); all dense float32. A query at position p
 * sees the keys at positions <= p and, with window > 0, > p - window. out [n, H, D]. D a
 * multiple of 16. Returns -1 when scratch memory fails.
 */
TM_TARGET int tm_prefill_attn(const float *q, const float *k, const float *v, int64_t n,
                              int64_t nk, int64_t H, int64_t KVH, int64_t D, int64_t q0,
                              int64_t k0, int64_t window, float scale, float *out) {
    const int64_t group = H / KVH, most = nk > LONG_KEYS ? ROWS_LONG : ROWS;
    const int64_t qb = most / group > 0 ? most / group : 1;
    /* K transposed, a KV head at a time: the scores' inner loop then reads 16 keys' d-th
     * elements at once. Rows of whole cache lines, padded so 16-key strips never run past. */
    const int64_t blocks = (n + qb - 1) / qb, jobs = blocks * KVH, kt_stride = (nk + 15) / 16 * 16 + 16;
    float *kt = aligned_alloc(64, sizeof(float) * (size_t)(KVH * D * kt_stride));
    if (!kt) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t hd = 0; hd < KVH * D; hd++) {
        const int64_t h = hd / D, d = hd % D;
        float *row = kt + hd * kt_stride;
        for (int64_t j = 0; j < nk; j++) row[j] = k[(j * KVH + h) * D + d];
        for (int64_t j = nk; j < kt_stride; j++) row[j] = 0.0f;
    }
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        const int64_t padded = (qb * group + 3) / 4 * 4;
        float *qs = malloc(sizeof(float) * (size_t)(padded * (2 * D + KB + 2)));
        if (!qs) failed = 1;
        /* Last query blocks first: they see the most keys (dynamic: threads balance the rest). */
#pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < jobs; job++) {
            if (!qs) continue;
            const int64_t b = blocks - 1 - job / KVH, h = job % KVH, i0 = b * qb;
            const int64_t npos = n - i0 < qb ? n - i0 : qb;
            float *o = qs + padded * D, *s = o + padded * D, *m = s + padded * KB, *l = m + padded;
            attend_rows(q, kt + h * D * kt_stride, kt_stride, v, H, KVH, D, group, h, i0, npos, q0, k0,
                        window, scale, qs, s, o, m, l, out);
        }
        free(qs);
    }
    free(kt);
    return failed ? -1 : 0;
}
