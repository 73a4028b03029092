/*
 * Float16 and bfloat16 weights computed as they are stored (a GGUF's F16 / BF16 tensors):
 *   tm_half_gemm: y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias), W in halves, x and y float32;
 *   tm_half_rows: rows ``ids`` of a half table (token embeddings), times a multiplier.
 * Each weight is widened to float32 as it is read (F16C's vcvtph2ps; bfloat16 is a float32's
 * top half) and multiplied with FMA, so the result is the float32 matmul of the widened
 * weight, up to float32 summation order. The weight stream is read once per call (each row
 * against every activation row), half the bytes of the float32 weight: a small batch's
 * matmul runs at memory bandwidth. Larger batches expand tiles for torch's float GEMM
 * (kernels/cpu_backend.py). The pure-torch twin is quant/packed.py's reference_matmul.
 */
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"
#include "tokenmill.h"

#define TM_TARGET __attribute__((target("avx2,fma,f16c")))

TM_TARGET static inline __m256 widen(const uint16_t *w, int bf16) {
    __m128i h = _mm_loadu_si128((const __m128i *)w);
    if (bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

TM_TARGET static inline float widen1(uint16_t w, int bf16) {
    if (bf16) {
        union { uint32_t u; float f; } v = {(uint32_t)w << 16};
        return v.f;
    }
    return _cvtsh_ss(w);
}

/* One activation row against one weight row: four accumulators, so the FMAs' latency
 * overlaps (one chain ran at a quarter of the load rate). */
TM_TARGET static inline float dot_row(const uint16_t *w, const float *x, int64_t K, int bf16) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        a0 = _mm256_fmadd_ps(widen(w + k, bf16), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(widen(w + k + 8, bf16), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(widen(w + k + 16, bf16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(widen(w + k + 24, bf16), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(widen(w + k, bf16), _mm256_loadu_ps(x + k), a0);
    float s = tm_hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < K; k++) s += widen1(w[k], bf16) * x[k];
    return s;
}

TM_TARGET void tm_half_gemm(int64_t M, int64_t N, int64_t K, const float *x, const uint16_t *w,
                            int bf16, const float *bias, float *y) {
    /* Every (row, activation) pair through dot_row: a row's result never depends on the
     * batch it is in. The weight row stays in L1 across the activation rows. */
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++)
            y[m * N + n] = dot_row(w + n * K, x + m * K, K, bf16) + (bias ? bias[n] : 0.0f);
}

TM_TARGET void tm_half_rows(const int64_t *ids, int64_t n, int64_t K, const uint16_t *table,
                            int bf16, float mult, float *out) {
    const __m256 m = _mm256_set1_ps(mult);
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *src = table + ids[i] * K;
        float *row = out + i * K;
        int64_t j = 0;
        for (; j + 8 <= K; j += 8) _mm256_storeu_ps(row + j, _mm256_mul_ps(widen(src + j, bf16), m));
        for (; j < K; j++) row[j] = widen1(src[j], bf16) * mult;
    }
}
