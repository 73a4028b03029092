/* SIMD helpers shared by tokenmill/csrc's kernels (AVX2 + FMA). */
#ifndef TM_SIMD_H
#define TM_SIMD_H
#include <immintrin.h>

/* Elementwise kernels (RMSNorm, RoPE, act * mul, add) split their rows over the threads from
 * this many floats: a prefill's [2048, 640] RMSNorm took ~1 ms on one thread; below it (a
 * decode step's few rows) waking the second thread costs more than it saves. Rows are
 * independent, so results do not depend on the split. */
#define TM_PARALLEL_MIN_FLOATS (1 << 16)

/* The sum of 8 floats: halves, then pairs, then the last pair (every kernel sums in this one
 * order, so paths that share it give the same bits). */
__attribute__((target("avx2,fma"))) static inline float tm_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) for 8 floats: Cephes' expf (range reduction by ln 2, degree-5 polynomial), ~1 ulp. */
__attribute__((target("avx2,fma"))) static inline __m256 tm_exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#endif
