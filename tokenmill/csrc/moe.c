/*
 * Mixture-of-experts layers: the router (tm_moe_route) and the routed experts (tm_moe_experts),
 * the C twins of kernels/torch_backend.py's moe_route and moe_experts.
 *
 * tm_moe_experts sorts the (token, choice) pairs by expert (a stable counting sort) and runs
 * each expert that any token chose once, on its tokens' rows: tm_qgemm for [gate | up],
 * tm_act_mul, tm_qgemm for down, then the weighted rows are added to their tokens. An expert
 * no token chose costs nothing. Everything it needs besides the output goes in `work`, a
 * buffer the caller sizes (kernels/cpu_library.py: moe_work_bytes), so a recorded decode step
 * places it in the graphs' shared scratch like any intermediate (kernels/graph.py).
 *
 * A token's output does not depend on the rest of its batch: tm_qgemm's rows never do, and a
 * token's contributions are added to its zeroed row in order of expert id (for one expert
 * chosen twice, of choice), which only the token's own ids decide.
 *
 * The stacked weights come in a descriptor (a recorded call has at most 19 arguments),
 * int64 [TM_MOE_DESC_LEN]:
 *   [0] E (experts), [1] I (the inter size: gate_up has 2I rows an expert, down H),
 *   [2 .. 9] gate_up, [10 .. 17] down, each as
 *     kind (cpu_library.kind_code), codes, scales, offsets (0: none) base addresses, group,
 *     and the bytes from one expert's codes, scales, offsets to the next one's.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"
#include "tokenmill.h"

#define TM_TARGET __attribute__((target("avx2,fma,f16c")))

enum { D_EXPERTS, D_INTER, D_GATE_UP, D_DOWN = D_GATE_UP + 8 };
enum { W_KIND, W_CODES, W_SCALES, W_OFFSETS, W_GROUP, W_CODES_STRIDE, W_SCALES_STRIDE,
       W_OFFSETS_STRIDE };

TM_TARGET static float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float r = _mm_cvtss_f32(s);
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

/* Per token t of x [T, H]: softmax over the E logits x_t · router_eᵀ (router [E, H]), its k
 * largest probabilities, highest first (ties to the lower index), into weights [T, k] and
 * ids [T, k]; renorm: the k weights divided by their sum. E <= TM_MOE_MAX_EXPERTS. */
TM_TARGET void tm_moe_route(const float *x, int64_t T, int64_t H, const float *router,
                            int64_t E, int64_t k, int renorm, float *weights, int64_t *ids) {
#pragma omp parallel for schedule(static) if (T * E * H >= TM_PARALLEL_MIN_FLOATS * 16)
    for (int64_t t = 0; t < T; t++) {
        float p[TM_MOE_MAX_EXPERTS];
        uint8_t taken[TM_MOE_MAX_EXPERTS];
        const float *xt = x + t * H;
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            p[e] = dot(xt, router + e * H, H);
            mx = p[e] > mx ? p[e] : mx;
        }
        for (int64_t e = 0; e < E; e++) {
            p[e] = expf(p[e] - mx);
            sum += p[e];
        }
        const float inv = 1.0f / sum; /* as torch's softmax: times the reciprocal */
        memset(taken, 0, (size_t)E);
        float *w = weights + t * k, picked = 0.0f;
        int64_t *id = ids + t * k;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
            taken[best] = 1;
            id[j] = best;
            w[j] = p[best] * inv;
            picked += w[j];
        }
        if (renorm)
            for (int64_t j = 0; j < k; j++) w[j] /= picked;
    }
}

/* out [n] += a * y [n]. */
TM_TARGET static void add_scaled(float *out, const float *y, float a, int64_t n) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i,
                         _mm256_fmadd_ps(va, _mm256_loadu_ps(y + i), _mm256_loadu_ps(out + i)));
    for (; i < n; i++) out[i] += a * y[i];
}

static inline const void *at(const int64_t *w, int field, int64_t e) {
    return w[field] ? (const char *)(intptr_t)w[field] + e * w[field + W_CODES_STRIDE - W_CODES]
                    : NULL;
}

static inline size_t aligned(size_t nbytes) { return (nbytes + 63) / 64 * 64; }

/* Bytes of `work` tm_moe_experts needs (cpu_library.moe_work_bytes asks here). */
int64_t tm_moe_work_bytes(int64_t T, int64_t H, int64_t I, int64_t E, int64_t k) {
    return (int64_t)(aligned(sizeof(int64_t) * (size_t)(2 * E + 1)) +
                     aligned(sizeof(int64_t) * (size_t)(T * k)) +
                     aligned(sizeof(float) * (size_t)(T * H)) +
                     aligned(sizeof(float) * (size_t)(T * 2 * I)) +
                     aligned(sizeof(float) * (size_t)(T * I)));
}

/*
 * out [T, H] = Σ_j weights[t, j] · down_e(act(gate_e x_t) · up_e x_t), e = ids[t, j], for x
 * [T, H] and the stacked weights in desc (above); act: tm_act_mul's code; act_mode: tm_qgemm's
 * act_int8. counts (int64 [E], or NULL) += tokens each expert ran. shared [T, H] (or NULL)
 * with shared_gate [H]: out[t] += sigmoid(x_t · shared_gate) · shared[t]. Ids outside [0, E)
 * are skipped. work: tm_moe_work_bytes(T, H, I, E, k) bytes, 64-aligned.
 * Returns 0, or -1 when tm_qgemm could not allocate.
 */
TM_TARGET int tm_moe_experts(int64_t T, int64_t H, const float *x, int64_t k,
                             const float *weights, const int64_t *ids, const int64_t *desc,
                             int act, int act_mode, int64_t *counts, const float *shared,
                             const float *shared_gate, float *out, uint8_t *work) {
    const int64_t E = desc[D_EXPERTS], I = desc[D_INTER], n = T * k;
    const int64_t *gu_w = desc + D_GATE_UP, *down_w = desc + D_DOWN;
    /* | starts [E + 1] | cursor [E] | order [T k] | xs [T, H] | gu [T, 2I] | h [T, I] |;
     * ys [., H], the down projection's rows, reuses xs (dead once gu is computed). */
    int64_t *starts = (int64_t *)work, *cursor = starts + E + 1;
    int64_t *order = (int64_t *)(work + aligned(sizeof(int64_t) * (size_t)(2 * E + 1)));
    float *xs = (float *)((uint8_t *)order + aligned(sizeof(int64_t) * (size_t)n));
    float *gu = (float *)((uint8_t *)xs + aligned(sizeof(float) * (size_t)(T * H)));
    float *h = (float *)((uint8_t *)gu + aligned(sizeof(float) * (size_t)(T * 2 * I)));
    float *ys = xs;

    memset(starts, 0, sizeof(int64_t) * (size_t)(E + 1));
    for (int64_t p = 0; p < n; p++)
        if (ids[p] >= 0 && ids[p] < E) starts[ids[p] + 1]++;
    for (int64_t e = 0; e < E; e++) {
        if (counts) counts[e] += starts[e + 1];
        starts[e + 1] += starts[e];
        cursor[e] = starts[e];
    }
    for (int64_t p = 0; p < n; p++) /* stable: pairs of one expert stay in token order */
        if (ids[p] >= 0 && ids[p] < E) order[cursor[ids[p]]++] = p;

    memset(out, 0, sizeof(float) * (size_t)(T * H));
    for (int64_t e = 0; e < E; e++) {
        /* At most T rows at a time: more only where a token chose an expert twice. */
        for (int64_t p0 = starts[e]; p0 < starts[e + 1]; p0 += T) {
            const int64_t m = starts[e + 1] - p0 < T ? starts[e + 1] - p0 : T;
            for (int64_t r = 0; r < m; r++)
                memcpy(xs + r * H, x + order[p0 + r] / k * H, sizeof(float) * (size_t)H);
            if (tm_qgemm(m, 2 * I, H, xs, (int)gu_w[W_KIND], at(gu_w, W_CODES, e),
                         at(gu_w, W_SCALES, e), at(gu_w, W_OFFSETS, e), gu_w[W_GROUP], NULL, gu,
                         act_mode) != 0)
                return -1;
            tm_act_mul(gu, m, I, 2 * I, act, h);
            if (tm_qgemm(m, H, I, h, (int)down_w[W_KIND], at(down_w, W_CODES, e),
                         at(down_w, W_SCALES, e), at(down_w, W_OFFSETS, e), down_w[W_GROUP], NULL,
                         ys, act_mode) != 0)
                return -1;
            for (int64_t r = 0; r < m; r++) {
                const int64_t pair = order[p0 + r];
                add_scaled(out + pair / k * H, ys + r * H, weights[pair], H);
            }
        }
    }
    if (shared)
        for (int64_t t = 0; t < T; t++) {
            const float g = 1.0f / (1.0f + expf(-dot(x + t * H, shared_gate, H)));
            add_scaled(out + t * H, shared + t * H, g, H);
        }
    return 0;
}
