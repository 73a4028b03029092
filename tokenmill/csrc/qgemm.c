/*
 * Packed-weight matmul for CPUs with AVX2 + FMA: y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias).
 *
 * W stays in a packed form and is expanded 32 elements at a time in registers:
 *   kind 0 ("q8"): int8 codes [N, K]
 *   kind 1 ("q4"): 4-bit codes [N, K/2], per 32-element chunk byte j holds element j (low
 *                  nibble) and element j+16 (high nibble), as ggml's Q4_0/Q4_K do
 * with a scale per group of G elements (G = 16 or a multiple of 32; float32, or float16 where
 * the file's own scales are float16: Q8_0, Q5_0) and optionally a float32 offset per group:
 * w = scale · code - offset. `kind` says both: bit 0 set for "q4" codes, bit 1 for float16 scales.
 *
 * Two ways to treat the activations, chosen per call:
 *   act_int8 = 1: each 32-element chunk of x is quantized to int8 with its own scale (as
 *                 llama.cpp does); the chunk dot products run in int8 (maddubs) and only the
 *                 per-chunk sums are float. Reads the fewest bytes and does the least work.
 *   act_int8 = 0: x stays float32; codes are widened to float and multiplied with FMA.
 *                 Exact up to float32 rounding.
 * The offsets' share, sum_g offset_g · sum(x over group g), always uses float x.
 *
 * Parallel over output rows with OpenMP; torch's CPU build ships the same libgomp soname, so
 * both share one thread pool. Called through ctypes (tokenmill/quant/kernels.py), which also
 * holds the pure-torch reference of every function here.
 */
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TM_TARGET __attribute__((target("avx2,fma,f16c")))
#define MB 8 /* rows of x per pass over a weight row */
#ifndef TM_PREFETCH
#define TM_PREFETCH 2048 /* bytes ahead in the weight stream: measured 1.15-1.3x at batch 1 */
#endif

int tm_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

TM_TARGET static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 codes of one chunk as bytes in element order (q4: unsigned 0..15). */
TM_TARGET static inline __m256i load_codes(int kind, const uint8_t *row, int64_t c) {
    if (kind == 0) return _mm256_loadu_si256((const __m256i *)(row + c * 32));
    __m128i b = _mm_loadu_si128((const __m128i *)(row + c * 16));
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

/* Scale i of a row's scales (float16 or float32). */
TM_TARGET static inline float scale_at(const void *s, int64_t i, int f16) {
    return f16 ? _cvtsh_ss(((const uint16_t *)s)[i]) : ((const float *)s)[i];
}

/* Scale vector of chunk c: one scale for G >= 32 (G / 32 = 2^gshift chunks share it), two
 * halves for G == 16. */
TM_TARGET static inline __m256 chunk_scale(const void *s, int64_t c, int g16, int gshift,
                                           int f16) {
    if (g16)
        return _mm256_set_m128(_mm_set1_ps(scale_at(s, 2 * c + 1, f16)),
                               _mm_set1_ps(scale_at(s, 2 * c, f16)));
    return _mm256_set1_ps(scale_at(s, c >> gshift, f16));
}

/* Row n's scales. */
static inline const void *row_scales(const void *scales, int64_t n, int64_t ng, int f16) {
    return (const char *)scales + n * ng * (f16 ? 2 : 4);
}

/* x row -> int8 codes + one scale per 32 elements (round to nearest even, like torch.round). */
TM_TARGET static void quantize_row(const float *x, int64_t K, int8_t *q, float *d) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t c = 0; c < K / 32; c++) {
        const float *xc = x + c * 32;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xc + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        float mx = _mm_cvtss_f32(m);
        d[c] = mx / 127.0f;
        __m256 id = _mm256_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
        __m256i iv[4];
        for (int i = 0; i < 4; i++) {
            __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], id),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            iv[i] = _mm256_cvtps_epi32(r);
        }
        /* pack 4x8 int32 -> 32 int8, then undo the lane interleave of the packs */
        __m256i p16a = _mm256_packs_epi32(iv[0], iv[1]);
        __m256i p16b = _mm256_packs_epi32(iv[2], iv[3]);
        __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + c * 32), p8);
    }
}

/* Sums of x over each group of G elements (the offsets' share). */
static void group_sums(const float *x, int64_t K, int64_t G, float *out) {
    for (int64_t g = 0; g < K / G; g++) {
        float s = 0.0f;
        for (int64_t i = 0; i < G; i++) s += x[g * G + i];
        out[g] = s;
    }
}

TM_TARGET static float offsets_dot(const float *off, const float *xs, int64_t ng) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= ng; g += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(off + g), _mm256_loadu_ps(xs + g), acc);
    float s = hsum(acc);
    for (; g < ng; g++) s += off[g] * xs[g];
    return s;
}

/* One x row (batch-1 decode): bandwidth-bound, so the weight stream is prefetched ahead. The
 * arithmetic and its order are those of the general path: a row's result does not depend on
 * the batch it is in. */
TM_TARGET static inline __attribute__((always_inline)) void rows_int8_m1_impl(
    const int kind, const int g16, const int f16, int gshift, int64_t K, int64_t ng,
    const uint8_t *w, int64_t wrow, const void *scales, const int8_t *xq, const float *xd,
    int64_t n0, int64_t n1, float *y) {
    const int64_t nc = K / 32, cbytes = kind == 0 ? 32 : 16;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * wrow;
        const void *s = row_scales(scales, n, ng, f16);
        __m256 acc = _mm256_setzero_ps();
        for (int64_t c = 0; c < nc; c++) {
            _mm_prefetch((const char *)(row + c * cbytes + TM_PREFETCH), _MM_HINT_T0);
            __m256i codes = load_codes(kind, row, c);
            __m256i ucodes = kind == 0 ? _mm256_sign_epi8(codes, codes) : codes;
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + c * 32));
            if (kind == 0) xv = _mm256_sign_epi8(xv, codes);
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(ucodes, xv), ones);
            __m256 dd = _mm256_mul_ps(chunk_scale(s, c, g16, gshift, f16), _mm256_set1_ps(xd[c]));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dd, acc);
        }
        y[n] = hsum(acc);
    }
}

/* Rows [n0, n1) of y for x rows [m0, m0 + mb), int8 activations. Inlined into one copy per
 * (kind, G == 16) so the inner loop has no branches on them. */
TM_TARGET static inline __attribute__((always_inline)) void rows_int8_impl(
    const int kind, const int g16, const int f16, int gshift, int64_t K, int64_t ng,
    const uint8_t *w, int64_t wrow, const void *scales, int64_t m0, int mb, const int8_t *xq,
    const float *xd, int64_t n0, int64_t n1, float *y, int64_t N) {
    const int64_t nc = K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * wrow;
        const void *s = row_scales(scales, n, ng, f16);
        __m256 acc[MB];
        for (int i = 0; i < mb; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t c = 0; c < nc; c++) {
            __m256i codes = load_codes(kind, row, c);
            __m256i ucodes = kind == 0 ? _mm256_sign_epi8(codes, codes) : codes;
            __m256 sc = chunk_scale(s, c, g16, gshift, f16);
            for (int i = 0; i < mb; i++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (m0 + i) * K + c * 32));
                if (kind == 0) xv = _mm256_sign_epi8(xv, codes);
                __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(ucodes, xv), ones);
                __m256 f = _mm256_cvtepi32_ps(p);
                __m256 dd = _mm256_mul_ps(sc, _mm256_set1_ps(xd[(m0 + i) * nc + c]));
                acc[i] = _mm256_fmadd_ps(f, dd, acc[i]);
            }
        }
        for (int i = 0; i < mb; i++) y[(m0 + i) * N + n] = hsum(acc[i]);
    }
}

TM_TARGET static void rows_int8(int kind, int f16, int64_t K, int64_t G, const uint8_t *w,
                                int64_t wrow, const void *scales, int64_t m0, int mb,
                                const int8_t *xq, const float *xd, int64_t n0, int64_t n1, float *y,
                                int64_t N) {
    const int gshift = G == 16 ? 0 : __builtin_ctzll((unsigned long long)(G / 32));
    const int64_t ng = K / G;
#define TM_ROWS(KIND, G16, F16)                                                              \
    do {                                                                                     \
        if (mb == 1)                                                                         \
            rows_int8_m1_impl(KIND, G16, F16, gshift, K, ng, w, wrow, scales, xq + m0 * K,   \
                              xd + m0 * (K / 32), n0, n1, y + m0 * N);                       \
        else                                                                                 \
            rows_int8_impl(KIND, G16, F16, gshift, K, ng, w, wrow, scales, m0, mb, xq, xd,   \
                           n0, n1, y, N);                                                    \
    } while (0)
    if (f16) { /* the file's float16 scales: Q8_0 and Q5_0, 32-element groups */
        if (kind == 0) TM_ROWS(0, 0, 1);
        else TM_ROWS(1, 0, 1);
    } else if (kind == 0 && G == 16) TM_ROWS(0, 1, 0);
    else if (kind == 0) TM_ROWS(0, 0, 0);
    else if (G == 16) TM_ROWS(1, 1, 0);
    else TM_ROWS(1, 0, 0);
#undef TM_ROWS
}

/* The same with float activations: codes widened to float32, 8 at a time. */
TM_TARGET static void rows_float(int kind, int f16, int64_t K, int64_t G, const uint8_t *w,
                                 int64_t wrow, const void *scales, int64_t m0, int mb,
                                 const float *x, int64_t n0, int64_t n1, float *y, int64_t N) {
    const int64_t nc = K / 32, ng = K / G;
    const int gshift = G == 16 ? 0 : __builtin_ctzll((unsigned long long)(G / 32));
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * wrow;
        const void *s = row_scales(scales, n, ng, f16);
        __m256 acc[MB];
        for (int i = 0; i < mb; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t c = 0; c < nc; c++) {
            __m256i codes = load_codes(kind, row, c);
            __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
            __m256 wf[4];
            if (kind == 0) {
                wf[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
                wf[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
                wf[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
                wf[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
            } else {
                wf[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                wf[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
                wf[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                wf[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
            }
            if (G == 16) {
                __m256 sa = _mm256_set1_ps(scale_at(s, 2 * c, f16));
                __m256 sb = _mm256_set1_ps(scale_at(s, 2 * c + 1, f16));
                for (int i = 0; i < mb; i++) {
                    const float *xc = x + (m0 + i) * K + c * 32;
                    __m256 ta = _mm256_mul_ps(wf[0], _mm256_loadu_ps(xc));
                    ta = _mm256_fmadd_ps(wf[1], _mm256_loadu_ps(xc + 8), ta);
                    __m256 tb = _mm256_mul_ps(wf[2], _mm256_loadu_ps(xc + 16));
                    tb = _mm256_fmadd_ps(wf[3], _mm256_loadu_ps(xc + 24), tb);
                    acc[i] = _mm256_fmadd_ps(ta, sa, acc[i]);
                    acc[i] = _mm256_fmadd_ps(tb, sb, acc[i]);
                }
            } else {
                __m256 sc = _mm256_set1_ps(scale_at(s, c >> gshift, f16));
                for (int i = 0; i < mb; i++) {
                    const float *xc = x + (m0 + i) * K + c * 32;
                    __m256 t = _mm256_mul_ps(wf[0], _mm256_loadu_ps(xc));
                    t = _mm256_fmadd_ps(wf[1], _mm256_loadu_ps(xc + 8), t);
                    t = _mm256_fmadd_ps(wf[2], _mm256_loadu_ps(xc + 16), t);
                    t = _mm256_fmadd_ps(wf[3], _mm256_loadu_ps(xc + 24), t);
                    acc[i] = _mm256_fmadd_ps(t, sc, acc[i]);
                }
            }
        }
        for (int i = 0; i < mb; i++) y[(m0 + i) * N + n] = hsum(acc[i]);
    }
}

/*
 * y[M, N] = x[M, K] · Wᵀ - offsets' share + bias. K must be a multiple of 32 and of G (or G = 16).
 * Returns 0, or -1 when a scratch buffer could not be allocated.
 */
TM_TARGET int tm_qgemm(int64_t M, int64_t N, int64_t K, const float *x, int kind,
                       const uint8_t *w, const void *scales, const float *offsets, int64_t G,
                       const float *bias, float *y, int act_int8) {
    const int f16 = kind >> 1 & 1;
    kind &= 1;
    const int64_t nc = K / 32, ng = K / G;
    const int64_t wrow = kind == 0 ? K : K / 2;
    int8_t *xq = NULL;
    float *xd = NULL, *xs = NULL;
    if (act_int8) {
        xq = malloc((size_t)(M * K));
        xd = malloc(sizeof(float) * (size_t)(M * nc));
        if (!xq || !xd) goto fail;
        for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, xq + m * K, xd + m * nc);
    }
    if (offsets) {
        xs = malloc(sizeof(float) * (size_t)(M * ng));
        if (!xs) goto fail;
        for (int64_t m = 0; m < M; m++) group_sums(x + m * K, K, G, xs + m * ng);
    }
    /* Blocks of rows small enough to balance threads, large enough to reuse x from L1. */
    const int64_t nb = 16, nblocks = (N + nb - 1) / nb;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        int64_t n0 = b * nb, n1 = n0 + nb < N ? n0 + nb : N;
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            int mb = (int)(M - m0 < MB ? M - m0 : MB);
            if (act_int8)
                rows_int8(kind, f16, K, G, w, wrow, scales, m0, mb, xq, xd, n0, n1, y, N);
            else
                rows_float(kind, f16, K, G, w, wrow, scales, m0, mb, x, n0, n1, y, N);
        }
        if (offsets || bias) {
            for (int64_t m = 0; m < M; m++)
                for (int64_t n = n0; n < n1; n++) {
                    float v = y[m * N + n];
                    if (offsets) v -= offsets_dot(offsets + n * ng, xs + m * ng, ng);
                    if (bias) v += bias[n];
                    y[m * N + n] = v;
                }
        }
    }
    free(xq);
    free(xd);
    free(xs);
    return 0;
fail:
    free(xq);
    free(xd);
    free(xs);
    return -1;
}

/* Float rows [n0, n1) of W into out[(n1 - n0), K]: the tile a float GEMM consumes. */
TM_TARGET void tm_dequant_rows(int64_t n0, int64_t n1, int64_t K, int kind, const uint8_t *w,
                               const void *scales, const float *offsets, int64_t G,
                               float *out) {
    const int f16 = kind >> 1 & 1;
    kind &= 1;
    const int64_t nc = K / 32, ng = K / G;
    const int64_t wrow = kind == 0 ? K : K / 2;
    const int g16 = G == 16, gshift = g16 ? 0 : __builtin_ctzll((unsigned long long)(G / 32));
#pragma omp parallel for schedule(static)
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * wrow;
        const void *s = row_scales(scales, n, ng, f16);
        const float *o = offsets ? offsets + n * ng : NULL;
        float *dst = out + (n - n0) * K;
        for (int64_t c = 0; c < nc; c++) {
            __m256i codes = load_codes(kind, row, c);
            __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
            __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int i = 0; i < 4; i++) {
                __m256i v = kind == 0 ? _mm256_cvtepi8_epi32(parts[i]) : _mm256_cvtepu8_epi32(parts[i]);
                int64_t g = g16 ? 2 * c + i / 2 : c >> gshift;
                __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(scale_at(s, g, f16)));
                if (o) f = _mm256_sub_ps(f, _mm256_set1_ps(o[g]));
                _mm256_storeu_ps(dst + c * 32 + 8 * i, f);
            }
        }
    }
}

/* A module so setuptools builds this as an extension and Python can find the file. */
static struct PyModuleDef tm_module = {PyModuleDef_HEAD_INIT, "_qgemm", NULL, -1, NULL};
PyMODINIT_FUNC PyInit__qgemm(void) { return PyModule_Create(&tm_module); }
