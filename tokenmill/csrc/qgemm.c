/*
 * Packed-weight matmul for CPUs with AVX2 + FMA: y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias); the
 * int8 mode's dot products run on AVX512-VNNI or AVX-VNNI where the CPU has it (below).
 *
 * W stays packed with a scale per group of G elements (G = 16 or 32 · 2^j; float32, or float16
 * where the file's own scales are float16: Q8_0, Q5_0, Q4_0, IQ4_NL) and optionally a float32
 * offset per group: w = scale · code - offset. `kind` (tokenmill.h: TM_KIND_*) holds the
 * weight's layout (enum tm_layout, TM_LAYOUTS): int8 codes ("q8"); 4-bit codes + z, 0..15
 * ("q4", z as "u8"'s: GGUF Q4_0's 8); bytes holding code + z, 0..63 ("u8"); 4-bit indices,
 * stored as "q4", into IQ4's table of 16 int8 codes ("n4": GGUF IQ4_NL) or MXFP4's doubled e2m1
 * values ("m4": gpt-oss's experts, quant/mxfp4.py, float16 scales 2^(e - 128)); 5-bit codes + z,
 * 0..31, in a nibble and a bit plane ("q5", below, z as "u8"'s); GGUF Q2_K / Q3_K / Q4_K /
 * Q5_K / Q6_K / IQ4_XS super-blocks ("q2", "q3", "q4k", "q5k", "q6k", "n4k", below); and
 * whether the scales are float16, and z.
 *
 * Codes are stored in "lane order" (quant/packed.py: lane_order), built so that integer dot
 * products of many chunks accumulate side by side. A row's 32-element chunks go in blocks of
 * t = 8 chunks (4, then 2, at the tail; K is a multiple of 64). A block is t code vectors of 32
 * codes; in code vector u, the 4 bytes of lane l (l = 0..7) are elements 4·(u·8/t + l/t) .. +3
 * of chunk l mod t. One maddubs + madd over a code vector thus adds, in lane l, 4 products of
 * chunk l mod t alone: a block's integer sums per chunk build up in 8 int32 lanes, and the
 * chunk scales are applied once per block, 8 chunks at a time (the multiplier ports, which
 * also run the float work, are what bounds this kernel).
 *   "q8", "u8": code vector u is the 32 bytes at 32·u in the block;
 *   "q4", "n4": the 32 bytes at 32·v hold code vector 2v in their low nibbles, 2v + 1 in the
 *   high. "n4" indices become int8 codes with one pshufb against the table (table_codes), and
 *   are then multiplied exactly as "q8" codes are, sign flips, unsigned code + 128 and all.
 *   "q5" (GGUF Q5_0, Q5_1, Q5_K: 0.625 bytes a code where "u8" took 1): a block is a 32-byte
 *   plane holding each code's fifth bit (vector u's in bit u), then its low 4 bits as "q4"
 *   keeps them (q5_block, q5_high). Unsigned and small as "u8"'s codes, they take its dot
 *   products; at batch 1, 1.5x fewer bytes read (scales included).
 * maddubs multiplies unsigned by signed bytes. "q4" and "u8" bytes are unsigned already and
 * small enough (<= 63: 2 · 2 · 63 · 127 < 2^15) that two maddubs sums add in int16 before one
 * madd: 0.85 cycles a pair of 32-byte vectors. "q8" codes take a sign flip per product pair
 * (2.05 cycles a pair in an isolated loop), or, with act_int8 = 2, are made unsigned, code +
 * 128 (the top bit flipped), against activations of 7 bits (below): 1.32 cycles. The zero point
 * comes back exactly: sum (code + z) · x - z · sum x, with the integer sums of each lane's x
 * taken when x is quantized.
 * With VNNI, vpdpbusd does a maddubs + madd in one instruction, summing its 4 products in int32
 * (no int16 sums to bound): the same integer sums, so the same results, bit for bit; "q8" then
 * always runs unsigned (code + 128), against 8-bit activations too. tm_qgemm_isa says which
 * runs, chosen once at load (TOKENMILL_ISA=avx2 forces AVX2): from 8 rows 1.2-1.35x on "q4",
 * 1.15-1.75x on "q8" (Zen 5, one thread; benchmarks/qgemm_isa.py). On CPUs with AMX
 * ("amx": Intel Sapphire Rapids and later) batches of 16 rows and more run on the tile unit
 * (block_amx, below), with the same integer sums and float steps: the same bits again.
 * With G = 16 a chunk's first half is in code vectors u < t/2, its second half in the rest.
 * The k-quants ("q2", "q3", "q4k", "q6k": K a multiple of 256, every block 8 chunks, one
 * 256-element super-block) keep the file's bytes a weight: a super-block is its codes, then the
 * file's sub-block scale bytes (quant/packed.py: K_QUANT_KINDS), with the row's float16 d (and
 * "q2", "q4k": dmin) per super-block in `scales`. "q2", "q3" (G = 16): 2 planes of 32 bytes, code
 * vector 4p + s in bits 2s..2s+1 of plane p ("q3": a third plane, vector u's third bit in bit u;
 * code + 4, a zero point as "u8"'s). "q4k" (G = 32): the 8 code vectors as "q4" keeps them;
 * "q5k" (G = 32): those, then a plane of their fifth bits as "q5"'s.
 * "q6k" (G = 16): their low 4 bits so, then their top 2 bits in 2 planes as "q2"'s (code + 32).
 * "n4k" (G = 32): "n4"'s indices as "q4k" keeps its codes, then IQ4_XS's 6 scale bytes.
 * The codes come out in registers (kq_code: a shift and a mask or two), unsigned and small as
 * "u8"'s, and take its dot products ("n4k": looked up, signed, see dot_n4k); the sub-block scales (kq_scales) are formed as float32 d ·
 * scale, as ggml does, and the mins ("q2", "q4k"), dmin · min, meet the float sums of x over
 * their groups (xg). At batch 1, which reads every weight byte once a token, Q4_K then reads
 * 0.5625 bytes a weight where a float32 scale and offset a group took 0.75, Q6_K 0.82 for 1.25.
 *
 * Two ways to treat the activations, chosen per call:
 *   act_int8 = 1: each 32-element chunk of x is quantized to int8 with its own scale (as
 *                 llama.cpp does) and stored in the same lane order; the dot products run in
 *                 int8 (maddubs) and only the per-chunk sums are float. The fast mode.
 *   act_int8 = 2: as 1, but against "q8" weights x is quantized to [-64, 64] (7 bits), so
 *                 that the codes can run unsigned: one maddubs sum of two products, at most
 *                 2 · 255 · 64, fits int16. 1.1-1.3x faster on "q8" at many rows on AVX2
 *                 (with VNNI, act_int8 = 1 runs unsigned too: only the 7 bits differ).
 *   act_int8 = 0: x stays float32 (copied into lane order once per call); codes are widened
 *                 to float and multiplied with FMA, each lane's sums scaled once per block.
 *                 Exact up to float32 rounding.
 * The offsets' share, sum_g offset_g · sum(x over group g), always uses float x. A row's
 * result never depends on the batch it is in (same operations in the same order).
 *
 * Parallel over blocks of output rows with OpenMP; torch's CPU build ships the same libgomp
 * soname, so both share one thread pool. Called through ctypes (kernels/cpu_library.py); the
 * pure-torch reference of each function is in quant/packed.py.
 */
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lanes.h"
#include "simd.h"
#include "tokenmill.h"

#define TM_TARGET __attribute__((target("avx2,fma,f16c")))
/* The VNNI paths need a compiler that knows them (AVX-VNNI: GCC 11, AVX512-VNNI: GCC 8); an
 * older one compiles them as AVX2 and they are never chosen (TM_RUNS_*). */
#ifdef __has_include
#if __has_include(<avxvnniintrin.h>)
#define TM_HAS_AVXVNNI
#endif
#if __has_include(<avx512vnniintrin.h>)
#define TM_HAS_AVX512VNNI
#endif
#endif
#ifdef TM_HAS_AVXVNNI
#define TM_TARGET_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define TM_RUNS_AVXVNNI __builtin_cpu_supports("avxvnni")
#else
#define TM_TARGET_AVXVNNI TM_TARGET
#define TM_RUNS_AVXVNNI 0
#endif
#ifdef TM_HAS_AVX512VNNI
#define TM_TARGET_AVX512VNNI \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
#define TM_RUNS_AVX512VNNI                                                        \
    (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") && \
     __builtin_cpu_supports("avx512bw"))
#else
#define TM_TARGET_AVX512VNNI TM_TARGET
#define TM_RUNS_AVX512VNNI 0
#endif
/* AMX (AMX-TILE + AMX-INT8: Intel Sapphire Rapids and later) needs GCC 11's intrinsics, the
 * AVX512-VNNI path (its small batches and other layouts run there) and Linux, which hands out
 * the tile registers' state only to a process that asks (arch_prctl, once, in choose_isa). */
#if defined(TM_HAS_AVX512VNNI) && defined(__linux__) && __has_include(<amxint8intrin.h>)
#define TM_HAS_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TM_TARGET_AMX                                                                      \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni,"  \
                          "amx-tile,amx-int8")))
#endif
#define TM_INLINE static inline __attribute__((always_inline))
#ifndef TM_PREFETCH
#define TM_PREFETCH 2048 /* bytes ahead in the weight stream: measured 1.15-1.3x at batch 1 */
#endif
#ifndef TM_XPREFETCH
#define TM_XPREFETCH 1024 /* bytes ahead in a tile's activations, where they overflow L1 */
#endif
#define RA_MAX 8 /* activation rows per pass over a weight row */
#define MCHUNK 64 /* activation rows per tile of work */

int tm_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}

/* The instructions of the int8 mode's dot products (ISA_NAMES): maddubs + madd, or VNNI's
 * vpdpbusd (4 products u8 · s8 added into an int32 lane in one instruction, no int16 sums) in
 * its VEX (AVX-VNNI) or EVEX form (AVX512-VNNI on 256-bit vectors, AVX512VL; the compiler then
 * also has 32 vector registers). The integer sums are the same on each (maddubs never
 * saturates here) and so is the float work after them: results are bit-identical. */
enum { ISA_AVX2, ISA_AVXVNNI, ISA_AVX512VNNI, ISA_AMX, NUM_ISAS };
static const char *const ISA_NAMES[NUM_ISAS] = {"avx2", "avxvnni", "avx512vnni", "amx"};
static int qgemm_isa = ISA_AVX2;

/* "amx": AVX512-VNNI, with the tile unit's int8 products for batches of AMX_MIN_ROWS rows and
 * more (amx_takes says which layouts). The CPU must have AMX-TILE and AMX-INT8 (CPUID leaf 7,
 * EDX bits 24, 25) and the kernel must grant this process the tile data (XFEATURE 18). */
static int amx_runs(void) {
#ifdef TM_HAS_AMX
    unsigned a, b, c, d;
    if (!TM_RUNS_AVX512VNNI || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!(d >> 24 & 1) || !(d >> 25 & 1)) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
#else
    return 0;
#endif
}

/* Chosen once, at load: the fastest the CPU runs, or TOKENMILL_ISA's where the CPU runs that
 * (TOKENMILL_ISA=avx2: the AVX2 path, for tests and A/B timings). */
__attribute__((constructor)) static void choose_isa(void) {
    __builtin_cpu_init();
    const int runs[NUM_ISAS] = {1, TM_RUNS_AVXVNNI, TM_RUNS_AVX512VNNI, amx_runs()};
    const char *want = getenv("TOKENMILL_ISA");
    int fastest = ISA_AVX2, wanted = -1;
    for (int isa = 0; isa < NUM_ISAS; isa++) {
        if (!runs[isa]) continue;
        fastest = isa;
        if (want && !strcmp(want, ISA_NAMES[isa])) wanted = isa;
    }
    qgemm_isa = wanted >= 0 ? wanted : fastest;
}

/* Which of ISA_NAMES the int8 mode runs. */
const char *tm_qgemm_isa(void) { return ISA_NAMES[qgemm_isa]; }

/* The k-quants ("q2", "q3", "q4k", "q5k", "q6k", "n4k"): the file's super-blocks, codes and
 * sub-block scales together (tokenmill.h: TM_LAYOUTS). Their traits are constants wherever
 * KIND is (the kernels are inlined once per layout), so these fold away. */
#define IS_KQ(KIND) (TM_LAYOUT_TRAITS[KIND].block_bytes > 0)
/* "q4k", "q5k", "n4k": a 6-bit scale (and "q4k", "q5k": min) a 32-element sub-block (Q4_K's
 * 12 bytes, Q5_K's the same; IQ4_XS's 6), a sub-block a lane. */
#define KQ_G32(KIND) (IS_KQ(KIND) && TM_LAYOUT_TRAITS[KIND].group == 32)
/* Float16 scales a k-quant super-block has in `scales`: d, and dmin (KQ_MINS). */
#define KQ_DS(KIND) (TM_LAYOUT_TRAITS[KIND].ds)
/* The k-quants with mins (dmin · min a group, against the float sums of x over it: xg). */
#define KQ_MINS(KIND) (KQ_DS(KIND) == 2)

/* Code vector u of the block starting at chunk c0: bytes, or (four_bit: "q4") unsigned 0..15. */
TM_TARGET TM_INLINE __m256i code_vector(int four_bit, const uint8_t *row, int64_t c0, int u) {
    if (!four_bit) return _mm256_loadu_si256((const __m256i *)(row + c0 * 32 + u * 32));
    __m256i b = _mm256_loadu_si256((const __m256i *)(row + c0 * 16 + (u >> 1) * 32));
    if (u & 1) b = _mm256_srli_epi16(b, 4);
    return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}

/* IQ4's codes (quant/gguf_blocks.py: IQ4_KVALUES), index 0..15 -> int8. */
#define TM_IQ4_KVALUES -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113

/* MXFP4's e2m1 values doubled (quant/mxfp4.py: E2M1_DOUBLED), index 0..15 -> int8. */
#define TM_E2M1_DOUBLED 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12

/* The layouts whose 4-bit indices pick an int8 code from a table ("n4", "m4"), signed or run
 * unsigned. */
#define IS_TABLE(KIND) \
    ((KIND) == TM_N4 || (KIND) == TM_N4_UNSIGNED || (KIND) == TM_M4 || (KIND) == TM_M4_UNSIGNED)

/* "n4", "m4": 32 indices 0..15 -> their int8 codes (pshufb looks up within each 128-bit half). */
TM_TARGET TM_INLINE __m256i table_codes(int kind, __m256i idx) {
    if (kind == TM_M4 || kind == TM_M4_UNSIGNED)
        return _mm256_shuffle_epi8(_mm256_setr_epi8(TM_E2M1_DOUBLED, TM_E2M1_DOUBLED), idx);
    return _mm256_shuffle_epi8(_mm256_setr_epi8(TM_IQ4_KVALUES, TM_IQ4_KVALUES), idx);
}

/* "q5": the fifth bits of code vector u (bit u of each plane byte) in place, as 16. A 16-bit
 * shift by at most 4 keeps bit 4 of each byte within its byte. */
TM_TARGET TM_INLINE __m256i q5_high(__m256i plane, int u) {
    const __m256i h = u <= 4 ? _mm256_slli_epi16(plane, 4 - u) : _mm256_srli_epi16(plane, u - 4);
    return _mm256_and_si256(h, _mm256_set1_epi8(0x10));
}

/* Code vector u as bytes for tile_int8 / widen_codes' KIND ("q8", "q4", "u8", "n4", "q5", and
 * the forms run unsigned, TM_Q8_UNSIGNED and TM_N4_UNSIGNED): "n4" indices looked up, signed
 * like "q8". */
TM_TARGET TM_INLINE __m256i kind_vector(int kind, const uint8_t *row, int64_t c0, int u) {
    if (IS_TABLE(kind)) return table_codes(kind, code_vector(1, row, c0, u));
    if (kind == TM_Q5) {
        const uint8_t *src = row + q5_block(c0);
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32 + (u >> 1) * 32));
        if (u & 1) b = _mm256_srli_epi16(b, 4);
        b = _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
        return _mm256_or_si256(b, q5_high(_mm256_loadu_si256((const __m256i *)src), u));
    }
    return code_vector(kind == TM_Q4, row, c0, u);
}

/* The k-quants (IS_KQ): bytes of a stored super-block; where its sub-block scales start: 64
 * ("q2": 16 bytes, scale | min << 4), 96 ("q3": Q3_K's 12 bytes of 6-bit scales), 128 ("q4k":
 * Q4_K's 12 bytes of 6-bit scales and mins), 160 ("q5k": Q5_K's, as Q4_K's), 192 ("q6k": 16
 * int8 scales) or 128 ("n4k": IQ4_XS's 2 + 4 bytes of 6-bit scales). */
#define KQ_BYTES(KIND) (TM_LAYOUT_TRAITS[KIND].block_bytes)
#define KQ_SUB(KIND) (TM_LAYOUT_TRAITS[KIND].scales_at)

/* Bytes a row of K codes takes for a KIND (kind_vector; "q2", "q3": with the sub-block scales). */
static inline int64_t row_bytes(int kind, int64_t K) {
    if (IS_KQ(kind)) return K / 256 * KQ_BYTES(kind);
    if (kind == TM_Q5) return K / 2 + 32 * num_blocks(K / 32);
    return kind == TM_Q4 || IS_TABLE(kind) ? K / 2 : K;
}

/* Scales a row has: one a group, or (the k-quants) d, and dmin (KQ_MINS), a super-block. */
static inline int64_t row_scale_count(int kind, int64_t K, int64_t G) {
    return IS_KQ(kind) ? K / 256 * KQ_DS(kind) : K / G;
}

/* Float sums of x a row has for the mins (KQ_MINS): "q2" one a 16-element group, "q4k" and
 * "q5k" one a 32-element chunk. */
static inline int64_t xg_len(int kind, int64_t K) { return KQ_G32(kind) ? K / 32 : K / 16; }

/* Code vector u (0..7) of a "q2" / "q3" super-block from its planes p0, p1 (and hb: "q3"'s
 * third bits): codes 0..3, "q3" 0..7. A 16-bit shift moves no bit of one byte into the two
 * (three) bits kept of the other. */
TM_TARGET TM_INLINE __m256i kq_vector(const int KIND, __m256i p0, __m256i p1, __m256i hb, int u) {
    __m256i c = _mm256_srli_epi16(u < 4 ? p0 : p1, 2 * (u & 3));
    c = _mm256_and_si256(c, _mm256_set1_epi8(3));
    if (KIND == TM_Q3) {
        __m256i h = u < 2 ? _mm256_slli_epi16(hb, 2 - u) : _mm256_srli_epi16(hb, u - 2);
        c = _mm256_or_si256(c, _mm256_and_si256(h, _mm256_set1_epi8(4)));
    }
    return c;
}

/* A k-quant super-block's (src) 2-bit planes p0, p1 ("q2", "q3" at 0; "q6k" at 128), "q3"'s
 * third bits hb and "q5k"'s fifth bits hb (at 128; zero where it has none). */
TM_TARGET TM_INLINE void kq_planes(const int KIND, const uint8_t *src, __m256i *p0, __m256i *p1,
                                   __m256i *hb) {
    const int at = KIND == TM_Q6K ? 128 : 0;
    *p0 = *p1 = *hb = _mm256_setzero_si256();
    if (KIND == TM_Q5K) *hb = _mm256_loadu_si256((const __m256i *)(src + 128));
    if (KQ_G32(KIND)) return;
    *p0 = _mm256_loadu_si256((const __m256i *)(src + at));
    *p1 = _mm256_loadu_si256((const __m256i *)(src + at + 32));
    if (KIND == TM_Q3) *hb = _mm256_loadu_si256((const __m256i *)(src + 64));
}

/* Code vector u (0..7) of a k-quant super-block (src, its planes from kq_planes): "q2" 0..3,
 * "q3" 0..7, "q4k" 0..15 (the nibbles of the 32 bytes at 32 · (u / 2)), "q5k" 0..31 (those
 * nibbles, and the fifth bits as "q5"'s plane keeps them), "q6k" 0..63 (those nibbles, and its
 * planes' 2 bits above them: a 16-bit shift of values <= 3 by 4 stays in their bytes), "n4k"
 * IQ4's int8 codes (those nibbles looked up, signed). */
TM_TARGET TM_INLINE __m256i kq_code(const int KIND, const uint8_t *src, __m256i p0, __m256i p1,
                                    __m256i hb, int u) {
    if (KIND == TM_Q2 || KIND == TM_Q3) return kq_vector(KIND, p0, p1, hb, u);
    __m256i b = _mm256_loadu_si256((const __m256i *)(src + (u >> 1) * 32));
    if (u & 1) b = _mm256_srli_epi16(b, 4);
    b = _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
    if (KIND == TM_Q6K) b = _mm256_or_si256(b, _mm256_slli_epi16(kq_vector(6, p0, p1, hb, u), 4));
    if (KIND == TM_Q5K) b = _mm256_or_si256(b, q5_high(hb, u));
    if (KIND == TM_N4K) b = table_codes(TM_N4, b);
    return b;
}

/* The float16 d (and dmin: KQ_MINS) of a row's super-blocks (s) as float32, in their order:
 * out[0 .. row_scale_count). Converted once a row, where a batch-1 matmul spent a tenth of
 * its time converting them one super-block at a time. */
TM_TARGET static void kq_row_d(int kind, int64_t K, const void *s, float *out) {
    const uint16_t *h = (const uint16_t *)s;
    const int64_t n = row_scale_count(kind, K, 16);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) out[i] = _cvtsh_ss(h[i]);
}

/* A k-quant super-block's (src) sub-block scales by lane, float32 d · scale as ggml forms
 * them: G = 16 ("q2", "q3", "q6k"), lane l's chunk holds groups 2l (*a) and 2l + 1 (*b); G = 32
 * ("q4k", "q5k"), group l (*a = *b). "q2", "q4k" and "q5k" also give their offsets, dmin · min
 * (*ma, *mb). d:
 * the super-block's d as float32 (kq_row_d), dmin after it. */
TM_TARGET TM_INLINE void kq_scales(const int KIND, const uint8_t *src, const float *d,
                                   __m256 *a, __m256 *b, __m256 *ma, __m256 *mb) {
    const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    __m128i v;
    if (KIND == TM_N4K) { /* IQ4_XS: scale j's top 2 bits at bits 2j of the uint16 h, its low 4 in
                       * nibble j of the uint32 l after it; less 32. Each field spread to a
                       * byte of a word, halving the spacing thrice (no mins). */
        uint16_t h16;
        uint32_t l32;
        memcpy(&h16, src + KQ_SUB(12), 2);
        memcpy(&l32, src + KQ_SUB(12) + 2, 4);
        uint64_t lo = l32, hi = h16;
        lo = (lo | lo << 16) & 0x0000FFFF0000FFFFULL;
        lo = (lo | lo << 8) & 0x00FF00FF00FF00FFULL;
        lo = (lo | lo << 4) & 0x0F0F0F0F0F0F0F0FULL;
        hi = (hi | hi << 24) & 0x000000FF000000FFULL;
        hi = (hi | hi << 12) & 0x000F000F000F000FULL;
        hi = (hi | hi << 6) & 0x0303030303030303ULL;
        v = _mm_sub_epi8(_mm_cvtsi64_si128((long long)(lo | hi << 4)), _mm_set1_epi8(32));
        *a = *b = _mm256_mul_ps(_mm256_broadcast_ss(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
        return;
    }
    if (KQ_G32(KIND)) { /* 8 scales, then 8 mins, 6 bits each: j < 4 in bytes j, 4 + j; j >= 4 low
                      * 4 bits in byte 8 + j - 4 (mins: its high nibble), top 2 in bits 6, 7 of
                      * bytes j - 4, j (as ggml's get_scale_min_k4). In one vector: the 16 bytes
                      * ending with the 12 (b[k] at byte 4 + k) put where each scale and min is
                      * made, masked and shifted into place. */
        const __m128i q = _mm_loadu_si128((const __m128i *)(src + KQ_SUB(KIND) - 4));
        /* bytes 0-7: scales, 8-15: mins; low: the bytes holding their low bits (mins 4..7: the
         * high nibbles of bytes 8..11), top: those holding the top 2 bits of scales / mins 4..7 */
        const __m128i low = _mm_shuffle_epi8(
            q, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
        const __m128i top = _mm_shuffle_epi8(
            q, _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
        const __m128i keep =
            _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
        const __m128i nib = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15);
        const __m128i high = _mm_and_si128(_mm_srli_epi16(low, 4), nib);
        __m128i v6 = _mm_or_si128(_mm_and_si128(low, keep), high);
        v6 = _mm_or_si128(v6, _mm_srli_epi16(_mm_and_si128(top, _mm_set1_epi8((char)0xC0)), 2));
        const __m256 d8 = _mm256_broadcast_ss(d), dmin = _mm256_broadcast_ss(d + 1);
        const __m256i mins = _mm256_cvtepu8_epi32(_mm_srli_si128(v6, 8));
        *a = *b = _mm256_mul_ps(d8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v6)));
        *ma = *mb = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mins));
        return;
    }
    if (KIND == TM_Q6K) { /* 16 int8 scales */
        v = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(src + KQ_SUB(10))), split);
    } else if (KIND == TM_Q2) {
        const __m128i low = _mm_set1_epi8(0x0F);
        v = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(src + KQ_SUB(6))), split);
        const __m128i mn = _mm_and_si128(_mm_srli_epi16(v, 4), low);
        const __m256 dmin = _mm256_broadcast_ss(d + 1);
        *ma = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn)));
        *mb = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(mn, 8))));
        v = _mm_and_si128(v, low);
    } else { /* scale j: low 4 bits in byte j mod 8 (j >= 8: its high nibble), top 2 in byte 8 +
              * j mod 4, bits 2 (j / 4)..: four words of 4 scales, then less 32 */
        uint32_t w[3], x[4];
        memcpy(w, src + KQ_SUB(7), 12);
        const uint32_t low = 0x0F0F0F0F, two = 0x03030303;
        x[0] = (w[0] & low) | ((w[2] & two) << 4);
        x[1] = (w[1] & low) | (((w[2] >> 2) & two) << 4);
        x[2] = ((w[0] >> 4) & low) | (((w[2] >> 4) & two) << 4);
        x[3] = ((w[1] >> 4) & low) | (((w[2] >> 6) & two) << 4);
        v = _mm_sub_epi8(_mm_loadu_si128((const __m128i *)x), _mm_set1_epi8(32));
        v = _mm_shuffle_epi8(v, split);
    }
    const __m256 d8 = _mm256_broadcast_ss(d);
    const __m128i hi = _mm_srli_si128(v, 8);
    const __m256i ia = KIND == TM_Q2 ? _mm256_cvtepu8_epi32(v) : _mm256_cvtepi8_epi32(v);
    const __m256i ib = KIND == TM_Q2 ? _mm256_cvtepu8_epi32(hi) : _mm256_cvtepi8_epi32(hi);
    *a = _mm256_mul_ps(d8, _mm256_cvtepi32_ps(ia));
    *b = _mm256_mul_ps(d8, _mm256_cvtepi32_ps(ib));
}

/* Scale i of a row's scales (float16 or float32). */
TM_TARGET TM_INLINE float scale_at(const void *s, int64_t i, int f16) {
    return f16 ? _cvtsh_ss(((const uint16_t *)s)[i]) : ((const float *)s)[i];
}

/* Row n's scales. */
static inline const void *row_scales(const void *scales, int64_t n, int64_t ng, int f16) {
    return (const char *)scales + n * ng * (f16 ? 2 : 4);
}

/* Lane l's scale for the block (c0, t): group (c0 + l mod t) >> gshift (G = 32 << gshift). */
TM_TARGET TM_INLINE __m256 lane_scales(const void *s, int64_t c0, int t, int f16, int gshift) {
    if (gshift == 0 && f16) {
        const uint16_t *h = (const uint16_t *)s + c0;
        __m128i v = t == 8   ? _mm_loadu_si128((const __m128i *)h)
                    : t == 4 ? _mm_set1_epi64x(*(const int64_t *)h)
                             : _mm_set1_epi32(*(const int32_t *)h);
        return _mm256_cvtph_ps(v);
    }
    if (gshift == 0) {
        const float *f = (const float *)s + c0;
        if (t == 8) return _mm256_loadu_ps(f);
        if (t == 4) return _mm256_broadcast_ps((const __m128 *)f);
        return _mm256_castpd_ps(_mm256_broadcast_sd((const double *)f));
    }
    float v[8];
    for (int l = 0; l < 8; l++) v[l] = scale_at(s, (c0 + l % t) >> gshift, f16);
    return _mm256_loadu_ps(v);
}

/* G = 16 (float32 scales): lane l's scales of the first (*a) and second (*b) half of its chunk. */
TM_TARGET TM_INLINE void lane_scales16(const float *s, int64_t c0, int t, __m256 *a, __m256 *b) {
    const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    const __m256i odd = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
    const float *f = s + 2 * c0;
    __m256 v0 = t == 2 ? _mm256_castps128_ps256(_mm_loadu_ps(f)) : _mm256_loadu_ps(f);
    if (t == 2) { /* lanes 0..3 of v0 hold [a0 b0 a1 b1] */
        *a = _mm256_permutevar8x32_ps(v0, _mm256_setr_epi32(0, 2, 0, 2, 0, 2, 0, 2));
        *b = _mm256_permutevar8x32_ps(v0, _mm256_setr_epi32(1, 3, 1, 3, 1, 3, 1, 3));
        return;
    }
    __m256 a0 = _mm256_permutevar8x32_ps(v0, even), b0 = _mm256_permutevar8x32_ps(v0, odd);
    if (t == 4) {
        *a = a0;
        *b = b0;
        return;
    }
    __m256 v1 = _mm256_loadu_ps(f + 8);
    *a = _mm256_blend_ps(a0, _mm256_permutevar8x32_ps(v1, even), 0xF0);
    *b = _mm256_blend_ps(b0, _mm256_permutevar8x32_ps(v1, odd), 0xF0);
}

/* 32 floats -> int8 codes in [-qmax, qmax] + scale (round to nearest even, like torch.round). */
TM_TARGET TM_INLINE __m256i quantize_chunk_vector(const float *xc, float *d, float qmax) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(xc + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    float mx = _mm_cvtss_f32(m);
    *d = mx / qmax;
    __m256 id = _mm256_set1_ps(mx > 0.0f ? qmax / mx : 0.0f);
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
    return _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

TM_TARGET static void quantize_chunk(const float *xc, int8_t *q, float *d, float qmax) {
    _mm256_storeu_si256((__m256i *)q, quantize_chunk_vector(xc, d, qmax));
}

/* A block of 8 chunks in lane order (quantize_row_lanes' t = 8): vector g's lane j is chunk
 * j's group g (4 bytes), an 8 x 8 transpose of int32s; sums[h][j] += the sum of the codes
 * of lane j over vectors 4h .. 4h + 3 (the same integers as the scalar loop's). */
TM_TARGET static void quantize_block8_lanes(const float *x, int8_t *q, int64_t vstride, float *d,
                                            int32_t sums[2][8], float qmax) {
    __m256i r[8], t[8], u[8];
    for (int j = 0; j < 8; j++) r[j] = quantize_chunk_vector(x + j * 32, &d[j], qmax);
    for (int j = 0; j < 8; j += 2) {
        t[j] = _mm256_unpacklo_epi32(r[j], r[j + 1]);
        t[j + 1] = _mm256_unpackhi_epi32(r[j], r[j + 1]);
    }
    for (int j = 0; j < 8; j += 4) {
        u[j] = _mm256_unpacklo_epi64(t[j], t[j + 2]);
        u[j + 1] = _mm256_unpackhi_epi64(t[j], t[j + 2]);
        u[j + 2] = _mm256_unpacklo_epi64(t[j + 1], t[j + 3]);
        u[j + 3] = _mm256_unpackhi_epi64(t[j + 1], t[j + 3]);
    }
    if (sums) {
        const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
        for (int h = 0; h < 2; h++) {
            __m256i acc = _mm256_loadu_si256((const __m256i *)sums[h]);
            for (int g = 4 * h; g < 4 * h + 4; g++) {
                const __m256i v = _mm256_permute2x128_si256(u[g % 4], u[4 + g % 4], g < 4 ? 0x20 : 0x31);
                _mm256_storeu_si256((__m256i *)(q + g * vstride), v);
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, v), ones16));
            }
            _mm256_storeu_si256((__m256i *)sums[h], acc);
        }
        return;
    }
    for (int g = 0; g < 8; g++)
        _mm256_storeu_si256((__m256i *)(q + g * vstride),
                            _mm256_permute2x128_si256(u[g % 4], u[4 + g % 4], g < 4 ? 0x20 : 0x31));
}

/* An x row -> int8 codes in lane order + each block's chunk scales by lane. Vector v of the row
 * goes to q + v · vstride, block b's scales to d8 + b · dstride: rows of a tile interleave
 * (tile_int8 reads each activation row's vectors at one stride from one pointer). With zs
 * (a zero point z), zs + b · dstride · (split ? 2 : 1) gets -z times the sum of each lane's
 * codes over the block's first half of vectors, then over its second half (split: G = 16
 * splits there), or, not split, over the whole block: the tile's integer sums start from these
 * as they are (one load a row and block, no integer ops). */
TM_TARGET static void quantize_row_lanes(const float *x, int64_t K, int8_t *q, int64_t vstride,
                                         float *d8, int64_t dstride, int32_t *zs, int z,
                                         int split, float qmax) {
    const int64_t nc = K / 32;
    int64_t b = 0;
    for (int64_t c0 = 0; c0 < nc; c0 += block_chunks(nc, c0), b++) {
        const int t = block_chunks(nc, c0), per = 8 / t;
        float d[8];
        int32_t sums[2][8] = {{0}};
        if (t == 8) quantize_block8_lanes(x + c0 * 32, q + c0 * vstride, vstride, d, zs ? sums : NULL, qmax);
        for (int j = 0; t < 8 && j < t; j++) {
            int8_t chunk[32];
            quantize_chunk(x + (c0 + j) * 32, chunk, &d[j], qmax);
            for (int g = 0; g < 8; g++) { /* group g's 4 bytes: vector g / per, lane (g % per)·t + j */
                memcpy(q + (c0 + g / per) * vstride + ((g % per) * t + j) * 4, chunk + 4 * g, 4);
                if (zs)
                    sums[g / per >= t / 2][(g % per) * t + j] +=
                        chunk[4 * g] + chunk[4 * g + 1] + chunk[4 * g + 2] + chunk[4 * g + 3];
            }
        }
        for (int l = 0; l < 8; l++) d8[b * dstride + l] = d[l % t];
        int32_t *zb = zs ? zs + b * dstride * (split ? 2 : 1) : NULL;
        for (int l = 0; zb && l < 8; l++) {
            zb[l] = -z * (split ? sums[0][l] : sums[0][l] + sums[1][l]);
            if (split) zb[8 + l] = -z * sums[1][l];
        }
    }
}

/* EXPAND(KIND, G16, F16) for the weight's layout (KIND: enum tm_layout, with "q8" and "n4" run
 * unsigned as TM_Q8_UNSIGNED, TM_N4_UNSIGNED, below); G16 for 16-element groups (float32 scales, or the k-quants' own; never "q4", "n4", "q5", "q4k");
 * F16 for float16 scales (the k-quants: always, d and dmin). */
#define TM_BY_LAYOUT(EXPAND, kind, f16, G)                                                    \
    do {                                                                                      \
        if ((kind) == TM_Q4K) EXPAND(TM_Q4K, 0, 1)                                                      \
        else if ((kind) == TM_N4K) EXPAND(TM_N4K, 0, 1)                                               \
        else if ((kind) == TM_Q5K) EXPAND(TM_Q5K, 0, 1)                                               \
        else if ((kind) == TM_Q6K) EXPAND(TM_Q6K, 1, 1)                                               \
        else if ((kind) == TM_Q2) EXPAND(TM_Q2, 1, 1)                                                 \
        else if ((kind) == TM_Q3) EXPAND(TM_Q3, 1, 1)                                                 \
        else if ((kind) == TM_Q5 && (f16)) EXPAND(TM_Q5, 0, 1)                                        \
        else if ((kind) == TM_Q5) EXPAND(TM_Q5, 0, 0)                                                 \
        else if ((kind) == TM_Q4 && (f16)) EXPAND(TM_Q4, 0, 1)                                        \
        else if ((kind) == TM_Q4) EXPAND(TM_Q4, 0, 0)                                                 \
        else if ((kind) == TM_U8 && (G) == 16) EXPAND(TM_U8, 1, 0)                                    \
        else if ((kind) == TM_U8 && (f16)) EXPAND(TM_U8, 0, 1)                                        \
        else if ((kind) == TM_U8) EXPAND(TM_U8, 0, 0)                                                 \
        else if ((kind) == TM_Q8_UNSIGNED && (G) == 16) EXPAND(TM_Q8_UNSIGNED, 1, 0)                                    \
        else if ((kind) == TM_Q8_UNSIGNED && (f16)) EXPAND(TM_Q8_UNSIGNED, 0, 1)                                        \
        else if ((kind) == TM_Q8_UNSIGNED) EXPAND(TM_Q8_UNSIGNED, 0, 0)                                                 \
        else if ((kind) == TM_N4 && (f16)) EXPAND(TM_N4, 0, 1)                                        \
        else if ((kind) == TM_N4) EXPAND(TM_N4, 0, 0)                                                 \
        else if ((kind) == TM_N4_UNSIGNED && (f16)) EXPAND(TM_N4_UNSIGNED, 0, 1)                                        \
        else if ((kind) == TM_N4_UNSIGNED) EXPAND(TM_N4_UNSIGNED, 0, 0)                                                 \
        else if ((kind) == TM_M4 && (f16)) EXPAND(TM_M4, 0, 1)                                        \
        else if ((kind) == TM_M4) EXPAND(TM_M4, 0, 0)                                                 \
        else if ((kind) == TM_M4_UNSIGNED && (f16)) EXPAND(TM_M4_UNSIGNED, 0, 1)                                        \
        else if ((kind) == TM_M4_UNSIGNED) EXPAND(TM_M4_UNSIGNED, 0, 0)                                                 \
        else if ((G) == 16) EXPAND(TM_Q8, 1, 0)                                                   \
        else if (f16) EXPAND(TM_Q8, 0, 1)                                                         \
        else EXPAND(TM_Q8, 0, 0)                                                                  \
    } while (0)

/* Activation rows go in tiles of `most` rows (8, or 4 for G = 16), then 4, 2, 1: tile_rows gives
 * the size of the tile that starts at row m. */
static inline int tile_rows(int64_t M, int64_t m, int most) {
    int64_t left = M - m;
    return left >= most ? most : left >= 4 ? 4 : left >= 2 ? 2 : 1;
}

/* The first row of the tile that holds row m. */
static inline int64_t tile_start(int64_t M, int64_t m, int most) {
    int64_t m0 = M - M % most; /* full tiles of `most` rows before this */
    if (m < m0) return m - m % most;
    while (m0 + tile_rows(M, m0, most) <= m) m0 += tile_rows(M, m0, most);
    return m0;
}

/* Code vector u's 32 codes (kind_vector) as 4 int32 vectors (vector k: lanes 2k, 2k + 1), zero
 * point removed. */
TM_TARGET TM_INLINE void widen_codes(int kind, int z, __m256i codes, __m256i wi[4]) {
    const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    const int is_signed =
        TM_LAYOUT_TRAITS[kind].is_signed || kind == TM_N4_UNSIGNED || kind == TM_M4_UNSIGNED;
    for (int k = 0; k < 4; k++) {
        wi[k] = is_signed ? _mm256_cvtepi8_epi32(part[k]) : _mm256_cvtepu8_epi32(part[k]);
        if (z) wi[k] = _mm256_sub_epi32(wi[k], _mm256_set1_epi32(z));
    }
}

/* Lanes 2k and 2k + 1 of a per-lane vector, each repeated 4 times: to match widen_codes' k. */
TM_TARGET TM_INLINE __m256 lane_pair(__m256 v, int k) {
    return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(2 * k, 2 * k, 2 * k, 2 * k, 2 * k + 1,
                                                         2 * k + 1, 2 * k + 1, 2 * k + 1));
}

/* Row of W -> float32 in element order: codes widened 8 at a time (lanes 2k, 2k + 1 of a code
 * vector), scaled by their lanes' scales, each 4 stored where their elements belong. */
TM_TARGET static void dequant_row(int kind, int f16, int z, int64_t K, int64_t G,
                                  const uint8_t *row, const void *s, const float *off, float *out) {
    const int64_t nc = K / 32;
    const int g16 = G == 16, gshift = g16 ? 0 : __builtin_ctzll((unsigned long long)(G / 32));
    const int has_off = off || KQ_MINS(kind);
    float kd[IS_KQ(kind) ? K / 128 : 1]; /* the k-quants' d (and dmin) as float32 */
    if (IS_KQ(kind)) kq_row_d(kind, K, s, kd);
    for (int64_t c0 = 0; c0 < nc; c0 += block_chunks(nc, c0)) {
        const int t = block_chunks(nc, c0), per = 8 / t;
        const uint8_t *src = row + c0 / 8 * KQ_BYTES(kind); /* the k-quants: the super-block */
        __m256 sc[2], of[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        __m256i p0 = _mm256_setzero_si256(), p1 = p0, hb = p0;
        if (IS_KQ(kind)) {
            kq_planes(kind, src, &p0, &p1, &hb);
            kq_scales(kind, src, kd + c0 / 8 * KQ_DS(kind), &sc[0], &sc[1], &of[0], &of[1]);
        } else if (g16) {
            lane_scales16((const float *)s, c0, t, &sc[0], &sc[1]);
            if (off) lane_scales16(off, c0, t, &of[0], &of[1]);
        } else {
            sc[0] = sc[1] = lane_scales(s, c0, t, f16, gshift);
            if (off) of[0] = of[1] = lane_scales(off, c0, t, 0, gshift); /* float32, per group */
        }
        for (int u = 0; u < t; u++) {
            __m256i wi[4];
            const __m256i codes =
                IS_KQ(kind) ? kq_code(kind, src, p0, p1, hb, u) : kind_vector(kind, row, c0, u);
            widen_codes(kind, z, codes, wi);
            const int h = g16 && u >= t / 2;
            for (int k = 0; k < 4; k++) {
                __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(wi[k]), lane_pair(sc[h], k));
                if (has_off) v = _mm256_sub_ps(v, lane_pair(of[h], k));
                for (int j = 0; j < 2; j++) { /* lane l = 2k + j */
                    const int l = 2 * k + j;
                    const int64_t e = (c0 + l % t) * 32 + (u * per + l / t) * 4;
                    _mm_storeu_ps(out + e, j ? _mm256_extractf128_ps(v, 1) : _mm256_castps256_ps128(v));
                }
            }
        }
    }
}

/* NOTE: the VNNI forms are not always_inline: GCC inlines a function only into one whose target
 * includes its own, which tile_int8 (AVX2) is not; it does once tile_int8 sits in
 * block_int8_<isa> of that target, and in the other instances the branches calling them fold
 * away. */
TM_TARGET_AVXVNNI static inline __m256i dpbusd_vex(__m256i acc, __m256i u, __m256i s) {
#ifdef TM_HAS_AVXVNNI
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return acc; /* never runs: TM_RUNS_AVXVNNI is 0 */
#endif
}

TM_TARGET_AVX512VNNI static inline __m256i dpbusd_evex(__m256i acc, __m256i u, __m256i s) {
#ifdef TM_HAS_AVX512VNNI
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return acc; /* never runs: TM_RUNS_AVX512VNNI is 0 */
#endif
}

/* acc + in each int32 lane the sum of its 4 products u · s (unsigned by signed bytes). AVX2:
 * maddubs sums pairs of products in int16 (exact here: the header's bounds), madd the pairs. */
TM_TARGET TM_INLINE __m256i dot1(const int ISA, __m256i acc, __m256i u, __m256i s) {
    if (ISA == ISA_AVX512VNNI) return dpbusd_evex(acc, u, s);
    if (ISA == ISA_AVXVNNI) return dpbusd_vex(acc, u, s);
    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
    return _mm256_add_epi32(acc, p);
}

/* dot1 of two pairs of vectors. AVX2, for codes <= 63 only: the two maddubs sums add in int16
 * (2 · 2 · 63 · 127 < 2^15) before one madd. */
TM_TARGET TM_INLINE __m256i dot2(const int ISA, __m256i acc, __m256i u0, __m256i s0, __m256i u1,
                                 __m256i s1) {
    if (ISA != ISA_AVX2) return dot1(ISA, dot1(ISA, acc, u0, s0), u1, s1);
    __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

/* "n4k": acc + code · x in each lane for a vector of IQ4's signed codes w (once a vector, for
 * every activation row: VNNI's w + 128 as an unsigned byte, its top bit flipped, or AVX2's |w|
 * in wu and w itself in ws to move the sign onto x). VNNI: dpbusd's int32 sums take the codes
 * + 128, and the zero point leaves as "q8" run unsigned's does (the sums start from -128 ·
 * sum x: qgemm_rows); AVX2: a maddubs pair of |w| · |x| <= 2 · 127 · 127 < 2^15. The same
 * integer sums, against 8-bit activations on both. */
TM_TARGET TM_INLINE void n4k_weights(const int ISA, __m256i w, __m256i *wu, __m256i *ws) {
    *ws = w;
    *wu = ISA == ISA_AVX2 ? _mm256_sign_epi8(w, w) : _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
}
TM_TARGET TM_INLINE __m256i dot_n4k(const int ISA, __m256i acc, __m256i wu, __m256i ws, __m256i x) {
    return dot1(ISA, acc, wu, ISA == ISA_AVX2 ? _mm256_sign_epi8(x, ws) : x);
}

/* A tile's activations are one stream of RA · K bytes, read again for each weight row: past
 * 32 KiB (K > 4096 at 8 rows) they come from L2 each time, where the VNNI loops, denser in
 * loads, stall on them: prefetched TM_XPREFETCH ahead, 1.2x there (K = 7168, "q4"), AVX2 about
 * the same. `bytes`: what the step from p reads. */
TM_TARGET TM_INLINE void prefetch_x(int on, const int8_t *p, int bytes) {
    for (int j = 0; on && j < bytes; j += 64)
        _mm_prefetch((const char *)(p + TM_XPREFETCH + j), _MM_HINT_T0);
}

/* One block of tile_int8 (chunks c0 .. c0 + t - 1, the b-th block): its integer sums, then
 * their scales into facc. t is a constant where tile_int8 calls it with 8 (every block but a
 * row's tail): the vector loops then unroll, and GCC keeps each row's sums in one register
 * across them instead of copying them between registers on every pass. */
TM_TARGET TM_INLINE void tile_block(const int ISA, const int KIND, const int G16, const int F16,
                                    const int RA, const int t, int gshift, int64_t K, int64_t c0,
                                    int64_t b, int xpf, const uint8_t *row, const void *s,
                                    const float *kd, const int8_t *xq, const float *xd8,
                                    const int32_t *xz, const float *xg, __m256 *facc) {
    __m256i ia[RA_MAX], ib[RA_MAX];
    const int8_t *xb = xq + c0 * RA * 32; /* the block's activations: fixed offsets from here */
    if (xz) /* start from -z · sum x: the sums then come out for code, not code + z */
        for (int i = 0; i < RA; i++) {
            const __m256i *zi = (const __m256i *)(xz + (b * RA + i) * (G16 ? 16 : 8));
            ia[i] = _mm256_loadu_si256(zi);
            ib[i] = G16 ? _mm256_loadu_si256(zi + 1) : _mm256_setzero_si256();
        }
    else
        for (int i = 0; i < RA; i++) ia[i] = ib[i] = _mm256_setzero_si256();
    if (IS_KQ(KIND)) { /* a super-block: pairs of code vectors unpacked in registers (kq_code) */
        const uint8_t *src = row + c0 / 8 * KQ_BYTES(KIND);
        if (RA == 1)
            for (int j = 0; j < KQ_BYTES(KIND); j += 64)
                _mm_prefetch((const char *)(src + j + TM_PREFETCH), _MM_HINT_T0);
        prefetch_x(xpf, xb, 8 * RA * 32);
        __m256i p0, p1, hb;
        kq_planes(KIND, src, &p0, &p1, &hb);
        #pragma GCC unroll 8
        for (int u = 0; u < 8; u += 2) {
            const __m256i w0 = kq_code(KIND, src, p0, p1, hb, u);
            const __m256i w1 = kq_code(KIND, src, p0, p1, hb, u + 1);
            __m256i u0, s0, u1, s1; /* "n4k": dot_n4k's forms of w0, w1 */
            if (KIND == TM_N4K) {
                n4k_weights(ISA, w0, &u0, &s0);
                n4k_weights(ISA, w1, &u1, &s1);
            }
            for (int i = 0; i < RA; i++) {
                const int8_t *xv = xb + (u * RA + i) * 32;
                __m256i x0 = _mm256_loadu_si256((const __m256i *)xv);
                __m256i x1 = _mm256_loadu_si256((const __m256i *)(xv + RA * 32));
                __m256i *acc = (G16 || KQ_G32(KIND)) && u >= 4 ? &ib[i] : &ia[i];
                if (KIND == TM_N4K) *acc = dot_n4k(ISA, dot_n4k(ISA, *acc, u0, s0, x0), u1, s1, x1);
                else *acc = dot2(ISA, *acc, w0, x0, w1, x1);
            }
        }
    } else if (KIND == TM_Q5) { /* "q5": "q4"'s nibble pairs, each code's fifth bit from the plane */
        const uint8_t *src = row + q5_block(c0);
        const __m256i low = _mm256_set1_epi8(0x0F);
        const __m256i plane = _mm256_loadu_si256((const __m256i *)src);
        if (RA == 1)
            for (int j = 0; j < 32 + 16 * t; j += 64)
                _mm_prefetch((const char *)(src + j + TM_PREFETCH), _MM_HINT_T0);
        #pragma GCC unroll 4
        for (int v = 0; v < t / 2; v++) {
            prefetch_x(xpf, xb + 2 * v * RA * 32, 2 * RA * 32);
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(src + 32 + v * 32));
            const __m256i w0 = _mm256_or_si256(_mm256_and_si256(bytes, low), q5_high(plane, 2 * v));
            const __m256i w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low),
                                               q5_high(plane, 2 * v + 1));
            for (int i = 0; i < RA; i++) {
                const int8_t *xv = xb + (2 * v * RA + i) * 32;
                ia[i] = dot2(ISA, ia[i], w0, _mm256_loadu_si256((const __m256i *)xv), w1,
                             _mm256_loadu_si256((const __m256i *)(xv + RA * 32)));
            }
        }
    } else if (KIND == TM_U8 && !(G16 && t == 2)) { /* vectors in pairs (G = 16: never across halves) */
        #pragma GCC unroll 8
        for (int u = 0; u < t; u += 2) {
            const uint8_t *src = row + c0 * 32 + u * 32;
            if (RA == 1) {
                _mm_prefetch((const char *)(src + TM_PREFETCH), _MM_HINT_T0);
                _mm_prefetch((const char *)(src + 32 + TM_PREFETCH), _MM_HINT_T0);
            }
            prefetch_x(xpf, xb + u * RA * 32, 2 * RA * 32);
            __m256i w0 = _mm256_loadu_si256((const __m256i *)src);
            __m256i w1 = _mm256_loadu_si256((const __m256i *)(src + 32));
            for (int i = 0; i < RA; i++) {
                const int8_t *xv = xb + (u * RA + i) * 32;
                __m256i x0 = _mm256_loadu_si256((const __m256i *)xv);
                __m256i x1 = _mm256_loadu_si256((const __m256i *)(xv + RA * 32));
                if (G16 && u >= t / 2) ib[i] = dot2(ISA, ib[i], w0, x0, w1, x1);
                else ia[i] = dot2(ISA, ia[i], w0, x0, w1, x1);
            }
        }
    } else if (KIND == TM_U8) { /* G = 16 over 2 chunks: one vector a half */
        for (int u = 0; u < 2; u++) {
            __m256i w = code_vector(0, row, c0, u);
            for (int i = 0; i < RA; i++) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(xb + (u * RA + i) * 32));
                if (u) ib[i] = dot1(ISA, ib[i], w, x);
                else ia[i] = dot1(ISA, ia[i], w, x);
            }
        }
    } else if (KIND != TM_Q4) { /* int8 codes: "q8", or "n4" / "m4" looked up */
        const int unsig = KIND == TM_Q8_UNSIGNED || KIND == TM_N4_UNSIGNED || KIND == TM_M4_UNSIGNED;
        const int vbytes = IS_TABLE(KIND) ? 16 : 32;
        #pragma GCC unroll 8
        for (int u = 0; u < t; u++) {
            if (RA == 1) _mm_prefetch((const char *)(row + (c0 + u) * vbytes + TM_PREFETCH), _MM_HINT_T0);
            prefetch_x(xpf, xb + u * RA * 32, RA * 32);
            __m256i w = kind_vector(KIND, row, c0, u), aw;
            if (unsig) /* code + 128 as an unsigned byte: the top bit flipped */
                w = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
            else
                aw = _mm256_sign_epi8(w, w);
            for (int i = 0; i < RA; i++) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(xb + (u * RA + i) * 32));
                __m256i wu = unsig ? w : aw, xs = unsig ? x : _mm256_sign_epi8(x, w);
                if (G16 && u >= t / 2) ib[i] = dot1(ISA, ib[i], wu, xs);
                else ia[i] = dot1(ISA, ia[i], wu, xs);
            }
        }
    } else {
        const __m256i low = _mm256_set1_epi8(0x0F);
        #pragma GCC unroll 8
        for (int v = 0; v < t / 2; v++) {
            const uint8_t *src = row + c0 * 16 + v * 32;
            if (RA == 1) _mm_prefetch((const char *)(src + TM_PREFETCH), _MM_HINT_T0);
            prefetch_x(xpf, xb + 2 * v * RA * 32, 2 * RA * 32);
            __m256i bytes = _mm256_loadu_si256((const __m256i *)src);
            __m256i lo = _mm256_and_si256(bytes, low);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
            for (int i = 0; i < RA; i++) {
                const int8_t *xv = xb + (2 * v * RA + i) * 32;
                ia[i] = dot2(ISA, ia[i], lo, _mm256_loadu_si256((const __m256i *)xv), hi,
                             _mm256_loadu_si256((const __m256i *)(xv + RA * 32)));
            }
        }
    }
    if (G16) {
        __m256 sa, sb, ma, mb;
        if (IS_KQ(KIND))
            kq_scales(KIND, row + c0 / 8 * KQ_BYTES(KIND), kd + b * KQ_DS(KIND), &sa, &sb, &ma,
                      &mb);
        else lane_scales16((const float *)s, c0, t, &sa, &sb);
        for (int i = 0; i < RA; i++) {
            __m256 dx = _mm256_loadu_ps(xd8 + (b * RA + i) * 8);
            __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[i]), sa,
                                       _mm256_mul_ps(_mm256_cvtepi32_ps(ib[i]), sb));
            facc[i] = _mm256_fmadd_ps(v, dx, facc[i]);
            if (KIND == TM_Q2) { /* the mins' share: dmin · min times the group's sum of x */
                const float *g = xg + i * xg_len(KIND, K) + b * 16;
                facc[i] = _mm256_fnmadd_ps(ma, _mm256_loadu_ps(g), facc[i]);
                facc[i] = _mm256_fnmadd_ps(mb, _mm256_loadu_ps(g + 8), facc[i]);
            }
        }
    } else if (KQ_G32(KIND)) { /* "q4k", "q5k", "n4k": a scale (and a min) a chunk (lane) */
        __m256 sw, sw2, mn, mn2;
        kq_scales(KIND, row + c0 / 8 * KQ_BYTES(KIND), kd + b * KQ_DS(KIND), &sw, &sw2, &mn,
                  &mn2);
        for (int i = 0; i < RA; i++) {
            __m256 dd = _mm256_mul_ps(sw, _mm256_loadu_ps(xd8 + (b * RA + i) * 8));
            const __m256i sum = _mm256_add_epi32(ia[i], ib[i]);
            facc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), dd, facc[i]);
            if (KQ_MINS(KIND)) { /* mins as "q2"'s */
                const float *g = xg + i * xg_len(KIND, K) + b * 8;
                facc[i] = _mm256_fnmadd_ps(mn, _mm256_loadu_ps(g), facc[i]);
            }
        }
    } else {
        __m256 sw = lane_scales(s, c0, t, F16, gshift);
        for (int i = 0; i < RA; i++) {
            __m256 dd = _mm256_mul_ps(sw, _mm256_loadu_ps(xd8 + (b * RA + i) * 8));
            facc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[i]), dd, facc[i]);
        }
    }
}

/*
 * out[i · ostride] = row · x_i for a tile of RA activation rows x_i: int8 codes in lane order,
 * vector v of row i at xq + (v · RA + i) · 32, lane scales of block b at xd8 + (b · RA + i) · 8
 * and (a zero point z > 0) its zero-point terms at xz + (b · RA + i) · 16 (G = 16: two halves of
 * 8), else at xz + (b · RA + i) · 8. KIND: enum tm_layout; TM_Q8_UNSIGNED is "q8" run
 * unsigned (z = 128), "n4" runs as "q8" once looked up (TM_N4_UNSIGNED as TM_Q8_UNSIGNED), "q3"
 * has z = 4, "q5" z as "u8"'s, "q6k" z = 32, "n4k" z = 128 on VNNI (dot_n4k).
 * "q2", "q4k", "q5k": the float sums of x_i for the mins at xg + i · xg_len: "q2" over its
 * groups, 16 a block as the lanes' halves; "q4k", "q5k" over their chunks, 8 a block.
 * Inlined into one copy per (ISA, KIND, G16, F16, RA), so the inner loops have no branches on
 * them; ISA picks the instructions of the dot products (dot1, dot2), nothing else.
 */
TM_TARGET TM_INLINE void tile_int8(const int ISA, const int KIND, const int G16, const int F16,
                                   const int RA, int gshift, int64_t K, const uint8_t *row,
                                   const void *s, const int8_t *xq, const float *xd8,
                                   const int32_t *xz, const float *xg, float *out,
                                   int64_t ostride) {
    const int64_t nc = K / 32;
    const int xpf = RA > 1 && RA * K > 32768; /* prefetch_x */
    __m256 facc[RA_MAX];
    for (int i = 0; i < RA; i++) facc[i] = _mm256_setzero_ps();
    float kd[IS_KQ(KIND) ? K / 128 : 1]; /* the k-quants' d (and dmin) as float32 */
#define TM_BLOCK(T, C0, B) \
    tile_block(ISA, KIND, G16, F16, RA, T, gshift, K, C0, B, xpf, row, s, kd, xq, xd8, xz, xg, facc)
    if (IS_KQ(KIND)) { /* every block a super-block of 8 chunks: a plain count, which GCC turns
                        * into pointer steps (the general loop below cost registers and time) */
        kq_row_d(KIND, K, s, kd);
        for (int64_t b = 0; b < nc / 8; b++) TM_BLOCK(8, 8 * b, b);
    } else {
        int64_t b = 0;
        for (int64_t c0 = 0; c0 < nc; c0 += block_chunks(nc, c0), b++) {
            const int t = block_chunks(nc, c0);
            if (t == 8) TM_BLOCK(8, c0, b);
            else TM_BLOCK(t, c0, b);
        }
    }
#undef TM_BLOCK
    for (int i = 0; i < RA; i++) out[i * ostride] = tm_hsum8(facc[i]);
}

/* An x row (float32) in lane order: what code vector u's lane l byte b multiplies. */
static void permute_row_lanes(const float *x, int64_t K, float *out) {
    const int64_t nc = K / 32;
    for (int64_t c0 = 0; c0 < nc; c0 += block_chunks(nc, c0)) {
        const int t = block_chunks(nc, c0), per = 8 / t;
        for (int u = 0; u < t; u++)
            for (int l = 0; l < 8; l++)
                memcpy(out + (c0 + u) * 32 + l * 4, x + (c0 + l % t) * 32 + (u * per + l / t) * 4,
                       4 * sizeof(float));
    }
}

/* Float activations: out[i · ostride] = row · x_i for RA x rows in lane order (xp, stride K).
 * Codes of vector u are widened 8 at a time (float vector k: lanes 2k, 2k + 1) and scaled by
 * their lanes' scales, once for all RA rows, then multiplied with FMA. Offsets are the
 * caller's. */
TM_TARGET TM_INLINE void row_float(const int KIND, const int G16, const int F16, const int RA,
                                   int gshift, int z, int64_t K, const uint8_t *row, const void *s,
                                   const float *xp, const float *xg, float *out, int64_t ostride) {
    const int64_t nc = K / 32;
    __m256 acc[RA_MAX];
    for (int i = 0; i < RA; i++) acc[i] = _mm256_setzero_ps();
    float kd[IS_KQ(KIND) ? K / 128 : 1]; /* the k-quants' d (and dmin) as float32 */
    if (IS_KQ(KIND)) kq_row_d(KIND, K, s, kd);
    for (int64_t c0 = 0; c0 < nc; c0 += block_chunks(nc, c0)) {
        const int t = IS_KQ(KIND) ? 8 : block_chunks(nc, c0);
        const uint8_t *src = row + c0 / 8 * KQ_BYTES(KIND); /* the k-quants: the super-block */
        __m256 sc[2], sk[2][4], mn[2];
        __m256i p0 = _mm256_setzero_si256(), p1 = p0, hb = p0;
        if (IS_KQ(KIND)) {
            kq_planes(KIND, src, &p0, &p1, &hb);
            kq_scales(KIND, src, kd + c0 / 8 * KQ_DS(KIND), &sc[0], &sc[1], &mn[0], &mn[1]);
        } else if (G16) lane_scales16((const float *)s, c0, t, &sc[0], &sc[1]);
        else sc[0] = lane_scales(s, c0, t, F16, gshift);
        for (int h = 0; h < (G16 ? 2 : 1); h++)
            for (int k = 0; k < 4; k++) sk[h][k] = lane_pair(sc[h], k);
        for (int u = 0; u < t; u++) {
            __m256i wi[4];
            const __m256i codes =
                IS_KQ(KIND) ? kq_code(KIND, src, p0, p1, hb, u) : kind_vector(KIND, row, c0, u);
            widen_codes(KIND, KIND == TM_Q4 || KIND == TM_U8 || KIND == TM_Q3 || KIND == TM_Q5 || KIND == TM_Q6K ? z : 0, codes, wi);
            const int h = G16 && u >= t / 2;
            __m256 wf[4];
            for (int k = 0; k < 4; k++) wf[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(wi[k]), sk[h][k]);
            for (int i = 0; i < RA; i++)
                for (int k = 0; k < 4; k++)
                    acc[i] = _mm256_fmadd_ps(wf[k], _mm256_loadu_ps(xp + i * K + (c0 + u) * 32 + 8 * k),
                                             acc[i]);
        }
        for (int i = 0; KIND == TM_Q2 && i < RA; i++) { /* the mins' share, as tile_int8's */
            const float *g = xg + i * xg_len(KIND, K) + c0 / 8 * 16;
            acc[i] = _mm256_fnmadd_ps(mn[0], _mm256_loadu_ps(g), acc[i]);
            acc[i] = _mm256_fnmadd_ps(mn[1], _mm256_loadu_ps(g + 8), acc[i]);
        }
        for (int i = 0; KQ_G32(KIND) && KQ_MINS(KIND) && i < RA; i++) {
            const float *g = xg + i * xg_len(KIND, K) + c0;
            acc[i] = _mm256_fnmadd_ps(mn[0], _mm256_loadu_ps(g), acc[i]);
        }
    }
    for (int i = 0; i < RA; i++) out[i * ostride] = tm_hsum8(acc[i]);
}

TM_TARGET static void block_float(int kind, int f16, int z, int64_t G, int64_t K,
                                  const uint8_t *w, const void *scales, int64_t n0, int64_t n1,
                                  int64_t m0, int64_t m1, const float *xp, const float *xg,
                                  float *out, int64_t ostride) {
    const int gshift = G == 16 ? 0 : __builtin_ctzll((unsigned long long)(G / 32));
    const int64_t ng = row_scale_count(kind, K, G), wrow = row_bytes(kind, K);
    /* x rows RA_MAX at a time (each weight row widened once for all), then 4, 2, 1 */
#define TM_ROWS(KIND, G16, F16)                                                               \
    for (int64_t m = m0, ra; m < m1; m += ra) {                                               \
        ra = tile_rows(m1, m, RA_MAX);                                                        \
        for (int64_t n = n0; n < n1; n++) {                                                   \
            const uint8_t *r = w + n * wrow;                                                  \
            const void *sn = row_scales(scales, n, ng, F16);                                  \
            const float *xm = xp + m * K, *gm = xg ? xg + m * xg_len(kind, K) : NULL;         \
            float *o = out + (m - m0) * ostride + (n - n0);                                   \
            if (ra == 8) row_float(KIND, G16, F16, 8, gshift, z, K, r, sn, xm, gm, o, ostride); \
            else if (ra == 4)                                                                 \
                row_float(KIND, G16, F16, 4, gshift, z, K, r, sn, xm, gm, o, ostride);        \
            else if (ra == 2)                                                                 \
                row_float(KIND, G16, F16, 2, gshift, z, K, r, sn, xm, gm, o, ostride);        \
            else row_float(KIND, G16, F16, 1, gshift, z, K, r, sn, xm, gm, o, ostride);       \
        }                                                                                     \
    }
    TM_BY_LAYOUT(TM_ROWS, kind, f16, G);
#undef TM_ROWS
}

/* Weight rows [n0, n1) against activation rows [m0, m1) (int8 lanes, in the tiles of all M
 * rows; m0 starts a tile) into out[(m - m0) · ostride + n - n0]: a tile of activation rows at
 * a time over all the rows of the block (its weights stay in L1/L2). A row's result is the
 * same in every tile size. */
#define TM_TILE(KIND, G16, F16, RA)                                                           \
    tile_int8(ISA, KIND, G16, F16, RA, gshift, K, row, s, xt, dt, zt, gt, o + n - n0, ostride)
#define TM_TILES(KIND, G16, F16)                                                              \
    for (int64_t m = m0, ra; m < m1; m += ra) {                                               \
        ra = tile_rows(M, m, G16 ? 4 : 8);                                                    \
        const int8_t *xt = xq + m * K;                                                        \
        const float *dt = xd8 + m * nblk * 8;                                                 \
        const int32_t *zt = xz ? xz + m * nblk * (G16 ? 16 : 8) : NULL;                       \
        const float *gt = xg ? xg + m * xg_len(kind, K) : NULL;                               \
        float *o = out + (m - m0) * ostride;                                                  \
        for (int64_t n = n0; n < n1; n++) {                                                   \
            const uint8_t *row = w + (n - wn0) * wrow;                                        \
            const void *s = row_scales(scales, n, ng, F16);                                   \
            if (ra == 8 && !(G16)) TM_TILE(KIND, G16, F16, 8);                                \
            else if (ra == 4) TM_TILE(KIND, G16, F16, 4);                                     \
            else if (ra == 2) TM_TILE(KIND, G16, F16, 2);                                     \
            else TM_TILE(KIND, G16, F16, 1);                                                  \
        }                                                                                     \
    }

#define TM_BLOCK_INT8_ARGS                                                                    \
    int kind, int f16, int64_t G, int64_t M, int64_t K, const uint8_t *w, const void *scales, \
        int64_t n0, int64_t n1, int64_t m0, int64_t m1, const int8_t *xq, const float *xd8,   \
        const int32_t *xz, const float *xg, int64_t nblk, float *out, int64_t ostride

/* A "q5" row's codes as "u8" bytes (code vector u of the block at c0 at out + 32 · (c0 + u)). */
TM_TARGET TM_INLINE void q5_to_bytes(const uint8_t *row, int64_t K, uint8_t *out) {
    const int64_t nc = K / 32;
    for (int64_t c0 = 0; c0 < nc; c0 += block_chunks(nc, c0))
        for (int u = 0; u < block_chunks(nc, c0); u++)
            _mm256_storeu_si256((__m256i *)(out + (c0 + u) * 32), kind_vector(8, row, c0, u));
}

TM_TARGET TM_INLINE void block_int8(const int ISA, TM_BLOCK_INT8_ARGS) {
    const int gshift = G == 16 ? 0 : __builtin_ctzll((unsigned long long)(G / 32));
    const int64_t ng = row_scale_count(kind, K, G);
    int64_t wrow = row_bytes(kind, K), wn0 = 0; /* row n at w + (n - wn0) · wrow */
    /* "q5" against more than a tile of activation rows (a batch of decode rows; larger ones
     * qgemm_rows unpacks whole): the block's weight rows are unpacked once, as "u8" bytes, rather
     * than once a tile of 8 rows (1.15x at 512 rows); the same integer sums, so the same bits.
     * Batch-1 steps, bound by the bytes they read, keep the planes. */
    uint8_t *bytes = kind == TM_Q5 && m1 - m0 > 8 ? malloc((size_t)((n1 - n0) * K)) : NULL;
    if (bytes) {
        for (int64_t n = n0; n < n1; n++) q5_to_bytes(w + n * wrow, K, bytes + (n - n0) * K);
        w = bytes, wrow = K, wn0 = n0, kind = TM_U8;
    }
    TM_BY_LAYOUT(TM_TILES, kind, f16, G);
    free(bytes);
}
#undef TM_TILES
#undef TM_TILE

/* block_int8 compiled once per ISA, each for its instruction set: BLOCK_INT8[isa]. */
#define TM_BLOCK_INT8(NAME, TARGET, ISA)                                                      \
    TARGET static void NAME(TM_BLOCK_INT8_ARGS) {                                             \
        block_int8(ISA, kind, f16, G, M, K, w, scales, n0, n1, m0, m1, xq, xd8, xz, xg, nblk, \
                   out, ostride);                                                             \
    }
TM_BLOCK_INT8(block_int8_avx2, TM_TARGET, ISA_AVX2)
TM_BLOCK_INT8(block_int8_avxvnni, TM_TARGET_AVXVNNI, ISA_AVXVNNI)
TM_BLOCK_INT8(block_int8_avx512vnni, TM_TARGET_AVX512VNNI, ISA_AVX512VNNI)
typedef void block_int8_fn(TM_BLOCK_INT8_ARGS);
static block_int8_fn *const BLOCK_INT8[] = {block_int8_avx2, block_int8_avxvnni,
                                            block_int8_avx512vnni};
#undef TM_BLOCK_INT8
#undef TM_BLOCK_INT8_ARGS

/* "q2": sums of x over each 16-element group, as tile_int8 reads them: block b's lane l (chunk
 * 8b + l) at out[16b + l] (its first half) and out[16b + 8 + l] (its second). */
static void group_sums16_lanes(const float *x, int64_t K, float *out) {
    for (int64_t g = 0; g < K / 16; g++) {
        float s = 0.0f;
        for (int64_t i = 0; i < 16; i++) s += x[g * 16 + i];
        const int64_t chunk = g / 2;
        out[chunk / 8 * 16 + (g % 2) * 8 + chunk % 8] = s;
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

/* y rows [m0, m1), columns [n0, n1) = the tile's results (src, nb a row) - the offsets' share
 * (sum_g offset[n, g] · xs[m, g], from off_t: the tile's offsets by group, nb a group) + bias.
 * Each column is a chain of FMAs over g in order (8 columns a vector, 4 vectors side by side;
 * the tail's columns one at a time): a result does not depend on the tile it falls in. */
TM_TARGET static void finish_tile(const float *src, int64_t nb, const float *off_t,
                                  const float *xs, int64_t ng, const float *bias, int64_t m0,
                                  int64_t m1, int64_t n0, int64_t n1, float *y, int64_t N) {
    for (int64_t m = m0; m < m1; m++) {
        const float *row = src + (m - m0) * nb, *xm = xs ? xs + m * ng : NULL;
        float *dst = y + m * N + n0;
        int64_t n = 0;
        for (int64_t step; n + 8 <= n1 - n0; n += step) { /* 4 chains at a time: FMA latency */
            const int nv = n + 32 <= n1 - n0 ? 4 : 1;
            step = 8 * nv;
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                             _mm256_setzero_ps()};
            for (int64_t g = 0; xm && g < ng; g++) {
                const __m256 xg = _mm256_set1_ps(xm[g]);
                for (int v = 0; v < nv; v++)
                    acc[v] = _mm256_fmadd_ps(_mm256_loadu_ps(off_t + g * nb + n + 8 * v), xg, acc[v]);
            }
            for (int v = 0; v < nv; v++) {
                __m256 o = _mm256_loadu_ps(row + n + 8 * v);
                if (xm) o = _mm256_sub_ps(o, acc[v]);
                if (bias) o = _mm256_add_ps(o, _mm256_loadu_ps(bias + n0 + n + 8 * v));
                _mm256_storeu_ps(dst + n + 8 * v, o);
            }
        }
        for (; n < n1 - n0; n++) {
            __m128 v = _mm_set_ss(row[n]);
            if (xm) {
                __m128 acc = _mm_setzero_ps();
                for (int64_t g = 0; g < ng; g++)
                    acc = _mm_fmadd_ss(_mm_set_ss(off_t[g * nb + n]), _mm_set_ss(xm[g]), acc);
                v = _mm_sub_ss(v, acc);
            }
            if (bias) v = _mm_add_ss(v, _mm_set_ss(bias[n0 + n]));
            dst[n] = _mm_cvtss_f32(v);
        }
    }
}

/*
 * AMX: a tile instruction multiplies 16 activation rows by 16 weight rows over up to 64 bytes
 * of K (int32 sums, 16 x 16). The scales come per 32-element chunk on both sides, so each
 * instruction sums what one int32 lane of tile_int8 sums over a block (a "lane": chunk
 * l mod t, its part l / t: t code vectors' 4 bytes, 4t elements), and the float work is then
 * tile_int8's, lane by lane, in the same order: the same bits (tests/kernels/test_cpu_isa.py).
 *   Activations: quantized as for tile_int8 (quantize_row_lanes), then each block regrouped so
 *   that a chunk's lanes are its 32 bytes (amx_regroup). An activation tile is 16 rows of one
 *   chunk, 512 contiguous bytes.
 *   Weights: for each 16 rows, each lane as 8 rows of 64 bytes (row r: the 16 rows' 4 bytes
 *   that meet activation bytes 4r..4r+3 of the chunk; the tile unit's B layout), zero where
 *   the chunk's bytes belong to another lane (blocks of 4 chunks: 2 lanes a chunk; G = 16:
 *   its halves, 2 steps a lane), gathered once per call with the lanes' scales (amx_prepare).
 * Every instruction thus has one shape (K = 32), and the tile registers hold 2 x 2 sums
 * (32 activation rows by 32 weight rows). A lane's sums are stored while the next lane's
 * instructions run, then scaled into float partial sums (amx_scale, amx_scale16).
 * tdpbssd (signed x signed) for "q8" and "n4", tdpbsud (unsigned weights) for "q4" and "u8",
 * whose zero point leaves as tile_int8's does (the sums start from -z · sum x). Blocks of 8
 * and 4 chunks; "q2", "q3" and tails of 2 chunks stay on AVX512-VNNI.
 */
#define AMX_MIN_ROWS 32

static int amx_takes(int kind, int64_t G, int64_t nc) {
    if (kind != TM_Q8 && kind != TM_Q4 && kind != TM_U8 && kind != TM_N4) return 0;
    if (G == 16) return (kind == TM_Q8 || kind == TM_U8) && nc % 8 == 0;
    return nc % 8 == 0 || nc % 8 == 4;
}

/* A row quantized in lane order (vector u of block c0 at 32 · (c0 + u), lane l at 4l) -> each
 * chunk's lanes together, chunk c at out + 512 · c: lane l of block (c0, t) in chunk c0 +
 * l mod t at 4t · (l / t), its vector u's 4 bytes at + 4u (t = 8: the chunk in element order).
 * The caller puts row r of each 16 at out + 32r: an activation tile (16 rows of a chunk) is then
 * 512 contiguous bytes, 8 cache lines rather than 16 halves of lines K bytes apart (1.2x). */
static void amx_regroup(const int8_t *lanes, int64_t K, int8_t *out) {
    const int64_t nc = K / 32;
    for (int64_t c0 = 0; c0 < nc; c0 += block_chunks(nc, c0)) {
        const int t = block_chunks(nc, c0);
        for (int u = 0; u < t; u++)
            for (int l = 0; l < 8; l++)
                memcpy(out + 512 * (c0 + l % t) + 4 * t * (l / t) + 4 * u,
                       lanes + 32 * (c0 + u) + 4 * l, 4);
    }
}

#ifdef TM_HAS_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Tiles 0-3: sums of activation tile i by weight tile j in 2i + j; 4, 5: activation tiles
 * (16 rows x 32 bytes); 6, 7: weight tiles (8 rows of 16 x 4 bytes). */
TM_TARGET_AMX static void amx_configure(void) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = i < 6 ? 16 : 8;
        c.colsb[i] = i == 4 || i == 5 ? 32 : 64;
    }
    _tile_loadconfig(&c);
}

/* Steps (weight tiles of 512 bytes, scale vectors of 16) per block: a lane each, G = 16 a half
 * of a lane each. */
static inline int amx_steps(int64_t G) { return G == 16 ? 16 : 8; }

/* The 8 dwords at src of each of nn rows (stride bytes apart; rows from nn on zero) ->
 * out[l]: dword l of rows 0..15. Rows k and k + 8 share a vector; an 8 x 8 transpose then
 * runs in both halves at once (unpacks within 128-bit lanes, then 128-bit lanes paired). */
TM_TARGET_AMX static void amx_transpose(const uint8_t *src, int64_t stride, int nn,
                                        __m512i out[8]) {
    __m512i r[8], t[8], u[8];
    for (int k = 0; k < 8; k++) {
        const __m256i a = k < nn ? _mm256_loadu_si256((const __m256i *)(src + k * stride))
                                 : _mm256_setzero_si256();
        const __m256i b = k + 8 < nn ? _mm256_loadu_si256((const __m256i *)(src + (k + 8) * stride))
                                     : _mm256_setzero_si256();
        r[k] = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
    }
    for (int k = 0; k < 8; k += 2) {
        t[k] = _mm512_unpacklo_epi32(r[k], r[k + 1]);
        t[k + 1] = _mm512_unpackhi_epi32(r[k], r[k + 1]);
    }
    for (int k = 0; k < 8; k += 4)
        for (int j = 0; j < 2; j++) {
            u[k + 2 * j] = _mm512_unpacklo_epi64(t[k + j], t[k + j + 2]);
            u[k + 2 * j + 1] = _mm512_unpackhi_epi64(t[k + j], t[k + j + 2]);
        }
    /* u[q] (q < 4) holds dwords 4i + q' of rows 0-3 (and 8-11) in 128-bit lane i; u[4 + q] of
     * rows 4-7 (12-15): dword l is lane l / 4 of u[l % 4] beside the same of u[4 + l % 4] */
    const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int q = 0; q < 4; q++) {
        out[q] = _mm512_permutex2var_epi64(u[q], lo, u[4 + q]);
        out[4 + q] = _mm512_permutex2var_epi64(u[q], hi, u[4 + q]);
    }
}

/* Weight rows [n0, n0 + nn) (nn <= 16; the rest zero) as B tiles: step k of block b at
 * bt + 512 · (S · b + k) (S = amx_steps; k = l, or 2l + h for G = 16's half h), its row r
 * the 16 rows' 4 bytes of code vector r - 4p of lane l (p: the lane's part, t = 4), r (t = 8)
 * or r (G = 16, r in 4h..4h+3), zero elsewhere. The step's scales, each weight row's as
 * lane_scales / lane_scales16 give it, at sc + 16 · (S · b + k). */
TM_TARGET_AMX static void amx_prepare(int kind, int f16, int64_t G, int64_t K, const uint8_t *w,
                                      const void *scales, int64_t n0, int nn, uint8_t *bt,
                                      float *sc) {
    const int64_t nc = K / 32, wrow = row_bytes(kind, K), ng = row_scale_count(kind, K, G);
    const int gshift = G == 16 ? 0 : __builtin_ctzll((unsigned long long)(G / 32));
    const int S = amx_steps(G), g16 = G == 16;
    const __mmask16 rows = nn >= 16 ? 0xFFFF : (__mmask16)((1u << nn) - 1);
    const __m512i n16 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i sat = _mm512_mullo_epi32(n16, _mm512_set1_epi32((int)(ng * (f16 ? 2 : 4))));
    const __m512i low = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    const __m512i iq4 = _mm512_broadcast_i32x4(_mm_setr_epi8(TM_IQ4_KVALUES));
    const uint8_t *base = w + n0 * wrow;
    const char *sbase = (const char *)scales + n0 * ng * (f16 ? 2 : 4);
    int64_t b = 0;
    for (int64_t c0 = 0; c0 < nc; c0 += block_chunks(nc, c0), b++) {
        const int t = block_chunks(nc, c0);
        __m512i vec[8][8]; /* [vector u][lane l]: the 16 rows' 4 bytes */
        if (kind == TM_Q8 || kind == TM_U8) /* a byte a code: vector u at 32 · (c0 + u) */
            for (int u = 0; u < t; u++) amx_transpose(base + 32 * (c0 + u), wrow, nn, vec[u]);
        else /* "q4", "n4": the 32 bytes at 16 · c0 + 32v hold vectors 2v, 2v + 1 */
            for (int v = 0; v < t / 2; v++) {
                __m512i packed[8];
                amx_transpose(base + 16 * c0 + 32 * v, wrow, nn, packed);
                for (int l = 0; l < 8; l++) {
                    const __m512i p = packed[l];
                    __m512i lo = _mm512_and_si512(p, low);
                    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
                    if (kind == TM_N4) {
                        lo = _mm512_shuffle_epi8(iq4, lo);
                        hi = _mm512_shuffle_epi8(iq4, hi);
                    }
                    vec[2 * v][l] = lo;
                    vec[2 * v + 1][l] = hi;
                }
            }
        for (int k = 0; k < S; k++) {
            const int l = g16 ? k / 2 : k, h = g16 ? k % 2 : 0;
            uint8_t *tile = bt + 512 * (S * b + k);
            for (int r = 0; r < 8; r++) {
                int u = -1;
                if (g16) u = r / 4 == h ? r : -1;
                else if (t == 8) u = r;
                else u = r / 4 == l / 4 ? r % 4 : -1; /* t = 4: part l / 4 is rows 4p..4p+3 */
                _mm512_storeu_si512(tile + 64 * r, u < 0 ? zero : vec[u][l]);
            }
            /* the step's scale: group (c0 + l mod t) >> gshift, or G = 16's 2 (c0 + l) + h */
            const int64_t grp = g16 ? 2 * (c0 + l) + h : (c0 + l % t) >> gshift;
            __m512 s;
            if (!f16) {
                s = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), rows, sat, sbase + 4 * grp, 1);
            } else { /* the aligned 4 bytes holding it (ng is even), then its half */
                __m512i d = _mm512_mask_i32gather_epi32(zero, rows, sat, sbase + 2 * (grp & ~1), 1);
                if (grp & 1) d = _mm512_srli_epi32(d, 16);
                s = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d));
            }
            _mm512_store_ps(sc + 16 * (S * b + k), s);
        }
    }
}

/* acc[r] (+)= cvt(sums[r] + z_r) · (sw · dx_r) for the 16 rows r of a tile: tile_int8's float
 * step (lane_scales · xd8, one FMA; first: acc starts at zero). zr, dr: the rows' zero-point
 * terms (zst apart) and scales (dst apart). */
TM_TARGET_AMX TM_INLINE void amx_scale(const int32_t *sums, const int32_t *zr, int64_t zst,
                                       const float *dr, int64_t dst, __m512 sw, float *acc,
                                       int first) {
    for (int r = 0; r < 16; r++) {
        __m512i s = _mm512_load_si512(sums + 16 * r);
        if (zr) s = _mm512_add_epi32(s, _mm512_set1_epi32(zr[r * zst]));
        const __m512 dd = _mm512_mul_ps(sw, _mm512_set1_ps(dr[r * dst]));
        float *a = acc + 16 * r;
        const __m512 in = first ? _mm512_setzero_ps() : _mm512_load_ps(a);
        _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), dd, in));
    }
}

/* G = 16: acc[r] (+)= (cvt(a_r + za_r) · sa + cvt(b_r + zb_r) · sb) · dx_r for a lane's two
 * halves (their zero-point terms 8 apart), as tile_int8's. */
TM_TARGET_AMX TM_INLINE void amx_scale16(const int32_t *as, const int32_t *bs, const int32_t *zr,
                                         int64_t zst, const float *dr, int64_t dst, __m512 sa,
                                         __m512 sb, float *acc, int first) {
    for (int r = 0; r < 16; r++) {
        __m512i a = _mm512_load_si512(as + 16 * r), b = _mm512_load_si512(bs + 16 * r);
        if (zr) {
            a = _mm512_add_epi32(a, _mm512_set1_epi32(zr[r * zst]));
            b = _mm512_add_epi32(b, _mm512_set1_epi32(zr[r * zst + 8]));
        }
        const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), sa,
                                         _mm512_mul_ps(_mm512_cvtepi32_ps(b), sb));
        float *o = acc + 16 * r;
        const __m512 in = first ? _mm512_setzero_ps() : _mm512_load_ps(o);
        _mm512_store_ps(o, _mm512_fmadd_ps(v, _mm512_set1_ps(dr[r * dst]), in));
    }
}

/* 2 x 2 tiles of sums for one step: activation tiles at xa, xa + 16 K, weight tiles b0, b1,
 * stored at sums + 256 · (2i + j). */
#define AMX_ROUND(SIGNED, xa, K, b0, b1, sums)                                                \
    do {                                                                                      \
        _tile_loadd(4, xa, 32);                                                               \
        _tile_loadd(5, (xa) + 16 * (K), 32);                                                  \
        _tile_loadd(6, b0, 64);                                                               \
        _tile_loadd(7, b1, 64);                                                               \
        _tile_zero(0);                                                                        \
        _tile_zero(1);                                                                        \
        _tile_zero(2);                                                                        \
        _tile_zero(3);                                                                        \
        if (SIGNED) {                                                                         \
            _tile_dpbssd(0, 4, 6);                                                            \
            _tile_dpbssd(1, 4, 7);                                                            \
            _tile_dpbssd(2, 5, 6);                                                            \
            _tile_dpbssd(3, 5, 7);                                                            \
        } else {                                                                              \
            _tile_dpbsud(0, 4, 6);                                                            \
            _tile_dpbsud(1, 4, 7);                                                            \
            _tile_dpbsud(2, 5, 6);                                                            \
            _tile_dpbsud(3, 5, 7);                                                            \
        }                                                                                     \
        _tile_stored(0, sums, 64);                                                            \
        _tile_stored(1, (sums) + 256, 64);                                                    \
        _tile_stored(2, (sums) + 512, 64);                                                    \
        _tile_stored(3, (sums) + 768, 64);                                                    \
    } while (0)

/*
 * block_int8's work on AMX, for all the call's activation rows at once: weight rows [n0, n1)
 * against rows [m0, m1) into out[(m - m0) · ostride + n - n0]. xq: regrouped codes, 16 rows
 * interleaved chunk by chunk (amx_regroup), rows padded with zeros to a multiple of 32; xd8, xz: tile_int8's lane scales and zero-point
 * terms, a row's nblk blocks together. Each 32 weight rows are prepared once, then every 32
 * activation rows run over them, a step (lane) at a time, the sums of step s scaled while the
 * instructions of step s + 1 run. Returns 0, or -1 when its scratch could not be allocated.
 */
TM_TARGET_AMX static int block_amx(int kind, int f16, int64_t G, int64_t K, const uint8_t *w,
                                   const void *scales, int64_t n0, int64_t n1, int64_t m0,
                                   int64_t m1, const int8_t *xq, const float *xd8,
                                   const int32_t *xz, int64_t nblk, float *out, int64_t ostride) {
    const int64_t nc = K / 32, zw = G == 16 ? 16 : 8, S = amx_steps(G), nsteps = nblk * 8;
    const int is_signed = kind == TM_Q8 || kind == TM_N4, g16 = G == 16, per = g16 ? 2 : 1;
    const size_t tiles = (size_t)(nblk * S);
    uint8_t *bt = aligned_alloc(64, 2 * tiles * 512);
    float *sc = aligned_alloc(64, sizeof(float) * 2 * tiles * 16);
    float *acc = aligned_alloc(64, sizeof(float) * 4 * 8 * 256); /* [tile 2i + j][lane][16 x 16] */
    int32_t *sums = aligned_alloc(64, sizeof(int32_t) * 2 * 2 * 4 * 256); /* [s & 1][half][tile] */
    const int ok = bt && sc && acc && sums;
    if (!ok) goto done;
    amx_configure();
    for (int64_t nt = n0; nt < n1; nt += 32) {
        const int nn = n1 - nt < 32 ? (int)(n1 - nt) : 32;
        amx_prepare(kind, f16, G, K, w, scales, nt, nn < 16 ? nn : 16, bt, sc);
        amx_prepare(kind, f16, G, K, w, scales, nt + 16, nn > 16 ? nn - 16 : 0, bt + tiles * 512,
                    sc + tiles * 16);
        for (int64_t mt = m0; mt < m1; mt += 32) {
            const int8_t *xt = xq + mt * K;
            /* step s: lane s % 8 of block s / 8; its rounds go to sums[s & 1], scaled at s + 1 */
            for (int64_t s = 0; s <= nsteps; s++) {
                if (s < nsteps) {
                    const int64_t b = s / 8, l = s % 8;
                    /* the lane's chunk: blocks before the last are all of 8, so c0 = 8b */
                    const int64_t chunk = 8 * b + l % block_chunks(nc, 8 * b);
                    const int8_t *xa = xt + 512 * chunk;
                    int32_t *sm = sums + (s & 1) * 2048;
                    for (int h = 0; h < per; h++) {
                        const int64_t k = S * b + per * l + h;
                        const uint8_t *b0 = bt + 512 * k, *b1 = bt + (tiles + k) * 512;
                        if (is_signed) AMX_ROUND(1, xa, K, b0, b1, sm + 1024 * h);
                        else AMX_ROUND(0, xa, K, b0, b1, sm + 1024 * h);
                    }
                }
                if (s == 0) continue;
                const int64_t p = s - 1, b = p / 8, l = p % 8;
                const int32_t *sm = sums + (p & 1) * 2048;
                for (int i = 0; i < 2; i++)
                    for (int j = 0; j < 2; j++) {
                        const int64_t row = mt + 16 * i;
                        const float *dr = xd8 + row * nblk * 8 + b * 8 + l;
                        const int32_t *zr = xz ? xz + row * nblk * zw + b * zw + l : NULL;
                        const float *scj = sc + j * tiles * 16 + 16 * (S * b + per * l);
                        float *a = acc + (2 * i + j) * 2048 + 256 * l;
                        const int32_t *t0 = sm + 256 * (2 * i + j);
                        if (g16)
                            amx_scale16(t0, t0 + 1024, zr, nblk * zw, dr, nblk * 8,
                                        _mm512_load_ps(scj), _mm512_load_ps(scj + 16), a, b == 0);
                        else
                            amx_scale(t0, zr, nblk * zw, dr, nblk * 8, _mm512_load_ps(scj), a,
                                      b == 0);
                    }
            }
            /* hsum's order over the 8 lanes: ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)) */
            for (int i = 0; i < 2; i++)
                for (int j = 0; j < 2 && 16 * j < nn; j++) {
                    const int cn = nn - 16 * j < 16 ? nn - 16 * j : 16;
                    const __mmask16 cols = cn >= 16 ? 0xFFFF : (__mmask16)((1u << cn) - 1);
                    for (int r = 0; r < 16 && mt + 16 * i + r < m1; r++) {
                        const float *a = acc + (2 * i + j) * 2048 + 16 * r;
                        __m512 v[8];
                        for (int l = 0; l < 8; l++) v[l] = _mm512_load_ps(a + 256 * l);
                        __m512 e = _mm512_add_ps(_mm512_add_ps(v[0], v[4]), _mm512_add_ps(v[2], v[6]));
                        __m512 o = _mm512_add_ps(_mm512_add_ps(v[1], v[5]), _mm512_add_ps(v[3], v[7]));
                        _mm512_mask_storeu_ps(out + (mt + 16 * i + r - m0) * ostride + (nt + 16 * j - n0),
                                              cols, _mm512_add_ps(e, o));
                    }
                }
        }
    }
    _tile_release();
done:
    free(bt);
    free(sc);
    free(acc);
    free(sums);
    return ok ? 0 : -1;
}
#endif

/* finish_tile on AVX-512: 4 rows by 4 vectors of 16 columns (nb <= 64) at a time, each
 * column's chain of FMAs over g as finish_tile's, so the same bits. */
TM_TARGET_AVX512VNNI static void finish_tile_avx512(const float *src, int64_t nb,
                                                    const float *off_t, const float *xs,
                                                    int64_t ng, const float *bias, int64_t m0,
                                                    int64_t m1, int64_t n0, int64_t n1, float *y,
                                                    int64_t N) {
#ifdef TM_HAS_AVX512VNNI
    const int64_t cols = n1 - n0;
    __mmask16 mask[4];
    for (int v = 0; v < 4; v++) {
        const int64_t left = cols - 16 * v;
        mask[v] = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
    }
    for (int64_t m = m0; m < m1; m += 4) {
        const int rows = m1 - m < 4 ? (int)(m1 - m) : 4;
        __m512 acc[4][4];
        for (int r = 0; r < 4; r++)
            for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();
        for (int64_t g = 0; xs && g < ng; g++) {
            __m512 o[4];
            for (int v = 0; v < 4; v++) o[v] = _mm512_maskz_loadu_ps(mask[v], off_t + g * nb + 16 * v);
            for (int r = 0; r < rows; r++) {
                const __m512 xg = _mm512_set1_ps(xs[(m + r) * ng + g]);
                for (int v = 0; v < 4; v++) acc[r][v] = _mm512_fmadd_ps(o[v], xg, acc[r][v]);
            }
        }
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < 4 && mask[v]; v++) {
                __m512 t = _mm512_maskz_loadu_ps(mask[v], src + (m + r - m0) * nb + 16 * v);
                if (xs) t = _mm512_sub_ps(t, acc[r][v]);
                if (bias) t = _mm512_add_ps(t, _mm512_maskz_loadu_ps(mask[v], bias + n0 + 16 * v));
                _mm512_mask_storeu_ps(y + (m + r) * N + n0 + 16 * v, mask[v], t);
            }
    }
#endif
}

static int qgemm_rows(int64_t M, int64_t N, int64_t K, const float *x, int kind,
                      const uint8_t *w, const void *scales, const float *offsets, int64_t G,
                      const float *bias, float *y, int act_int8);

/*
 * y[M, N] = x[M, K] · Wᵀ - offsets' share + bias. K must be a multiple of 64 and of G.
 * Returns 0, or -1 when a scratch buffer could not be allocated.
 *
 * A long prefill's rows go MSLICE at a time: its scratch (int8 codes, their scales, sums)
 * then stays in L2 rather than spanning megabytes. Measured on AMD EPYC (Zen 5, AVX512-VNNI,
 * 2 threads), an 8,192-row [4096 x 640] Q5_0 matmul: 258 GOP/s whole, 467 in slices of 512.
 * A row's result never depends on the other rows (tiles of 8 rows, and MSLICE is a multiple
 * of 8), so slicing changes no bit.
 */
#define MSLICE 512
TM_TARGET int tm_qgemm(int64_t M, int64_t N, int64_t K, const float *x, int kind,
                       const uint8_t *w, const void *scales, const float *offsets, int64_t G,
                       const float *bias, float *y, int act_int8) {
    for (int64_t m0 = 0; m0 < M; m0 += MSLICE) {
        const int64_t rows = M - m0 < MSLICE ? M - m0 : MSLICE;
        if (qgemm_rows(rows, N, K, x + m0 * K, kind, w, scales, offsets, G, bias, y + m0 * N,
                       act_int8))
            return -1;
    }
    return 0;
}

TM_TARGET static int qgemm_rows(int64_t M, int64_t N, int64_t K, const float *x, int kind,
                                const uint8_t *w, const void *scales, const float *offsets,
                                int64_t G, const float *bias, float *y, int act_int8) {
    const int f16 = TM_KIND_F16(kind), z = TM_KIND_ZERO(kind);
    kind = TM_KIND_LAYOUT(kind);
    /* "q5" against more activation rows than a tile of work takes: the whole weight is unpacked
     * to "u8" bytes once (in parallel), rather than once for each tile of MCHUNK rows
     * (block_int8); the same integer sums, so the same bits. */
    uint8_t *bytes = kind == TM_Q5 && act_int8 && M > MCHUNK ? malloc((size_t)(N * K)) : NULL;
    if (bytes) {
        const int64_t wrow = row_bytes(8, K);
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n++) q5_to_bytes(w + n * wrow, K, bytes + n * K);
        w = bytes, kind = TM_U8;
    }
    /* act_int8 = 2: "q8" codes run as unsigned bytes code + 128 (KIND 3, zero point 128, as
     * "u8"): maddubs then needs no sign flip per product pair (an isolated loop: 1.32 cycles a
     * pair of vectors, 2.05 with the flip), and one sum of two products, at most 2 · 255 · 64 <
     * 2^15, stays exact with activations in [-64, 64]: 7 bits instead of 8. With VNNI, whose
     * sums of products are int32, they run so against 8-bit activations too (act_int8 = 1):
     * the same integer sums as the sign flips give, one instruction less a vector and row.
     * "n4" and "m4" codes, int8 once looked up, run as "q8" do (TM_N4_UNSIGNED, TM_M4_UNSIGNED).
     * AMX takes "n4" (its table in amx_prepare) but not "m4": those run on AVX512-VNNI. */
    const int64_t nc = K / 32, ng = K / G, nblk = num_blocks(nc);
    /* AMX multiplies signed "q8" and "n4" codes as they are (block_amx): no code + 128. */
    const int amx = qgemm_isa == ISA_AMX && act_int8 && M >= AMX_MIN_ROWS && amx_takes(kind, G, nc);
    const int vnni_isa = qgemm_isa == ISA_AMX ? ISA_AVX512VNNI : qgemm_isa;
    const int int8_codes = kind == TM_Q8 || kind == TM_N4 || kind == TM_M4;
    const int unsig = !amx && int8_codes && (act_int8 == 2 || qgemm_isa != ISA_AVX2);
    const int ikind = !unsig            ? kind
                      : kind == TM_N4   ? TM_N4_UNSIGNED
                      : kind == TM_M4   ? TM_M4_UNSIGNED
                                        : TM_Q8_UNSIGNED;
    /* the sums' zero point ("n4k" on VNNI: codes + 128, dot_n4k) */
    const int zx = unsig || (kind == TM_N4K && vnni_isa != ISA_AVX2) ? 128
                   : kind == TM_Q4 || kind == TM_U8 || kind == TM_Q3 || kind == TM_Q5 || kind == TM_Q6K ? z
                                                                                    : 0;
    const float qmax = int8_codes && act_int8 == 2 ? 64.0f : 127.0f;
    const int64_t zw = G == 16 ? 16 : 8; /* zero-point terms a row and block: 8 lanes a half */
    int8_t *xq = NULL;
    float *xd8 = NULL, *xs = NULL, *xp = NULL, *xg = NULL;
    int32_t *xz = NULL;
    int failed = 0;
    if (amx) { /* rows padded to whole pairs of tiles of 16, codes regrouped (amx_regroup) */
        const int64_t Mp = (M + 31) / 32 * 32;
        xq = calloc((size_t)(Mp * K), 1);
        xd8 = calloc((size_t)(Mp * nblk * 8), sizeof(float));
        if (zx) xz = calloc((size_t)(Mp * nblk * zw), sizeof(int32_t));
        if (!xq || !xd8 || (zx && !xz)) goto fail;
#pragma omp parallel for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            int8_t *lanes = malloc((size_t)K);
            if (!lanes) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            quantize_row_lanes(x + m * K, K, lanes, 32, xd8 + m * nblk * 8, 8,
                               xz ? xz + m * nblk * zw : NULL, zx, G == 16, qmax);
            amx_regroup(lanes, K, xq + m / 16 * 16 * K + m % 16 * 32);
            free(lanes);
        }
        if (failed) goto fail;
    } else if (act_int8) {
        xq = malloc((size_t)(M * K));
        xd8 = malloc(sizeof(float) * (size_t)(M * nblk * 8));
        if (zx) xz = malloc(sizeof(int32_t) * (size_t)(M * nblk * zw));
        if (!xq || !xd8 || (zx && !xz)) goto fail;
        const int most = G == 16 ? 4 : 8;
#pragma omp parallel for schedule(static) if (M >= 16)
        for (int64_t m = 0; m < M; m++) {
            const int64_t m0 = tile_start(M, m, most);
            const int ra = tile_rows(M, m0, most);
            quantize_row_lanes(x + m * K, K, xq + m0 * K + (m - m0) * 32, ra * 32,
                               xd8 + m0 * nblk * 8 + (m - m0) * 8, ra * 8,
                               xz ? xz + m0 * nblk * zw + (m - m0) * zw : NULL, zx, G == 16, qmax);
        }
    }
    if (!act_int8) {
        xp = malloc(sizeof(float) * (size_t)(M * K));
        if (!xp) goto fail;
        for (int64_t m = 0; m < M; m++) permute_row_lanes(x + m * K, K, xp + m * K);
    }
    if (offsets) {
        xs = malloc(sizeof(float) * (size_t)(M * ng));
        if (!xs) goto fail;
        for (int64_t m = 0; m < M; m++) group_sums(x + m * K, K, G, xs + m * ng);
    }
    if (KQ_MINS(kind)) { /* "q2"'s and "q4k"'s mins meet float sums of x, as the offsets do */
        const int64_t len = xg_len(kind, K);
        xg = malloc(sizeof(float) * (size_t)(M * len));
        if (!xg) goto fail;
        for (int64_t m = 0; m < M; m++) {
            if (kind == TM_Q2) group_sums16_lanes(x + m * K, K, xg + m * len);
            else group_sums(x + m * K, K, 32, xg + m * len); /* a block's 8 chunks, its lanes */
        }
    }
    /* Work in tiles of up to MCHUNK activation rows by nb weight rows: enough to share among
     * the threads, small enough that each writes whole cache lines of y and few pages at a
     * time (results go through a per-thread buffer: writing y a float at a time, M rows
     * apart, cost 1.4x at 32 rows; 64-float row pieces of 1,024 rows, 20% of the time). */
    /* AMX: all rows in one tile of work, so each weight row is prepared once (block_amx) */
    const int64_t mchunk = amx || M < MCHUNK ? M : MCHUNK, mchunks = (M + mchunk - 1) / mchunk;
    const int64_t threads = omp_get_max_threads();
    int64_t nb = 64;
    while (nb > (amx ? 32 : 8) && mchunks * ((N + nb - 1) / nb) < 4 * threads) nb /= 2;
    const int64_t nblocks = (N + nb - 1) / nb;
    const int64_t tile_share = mchunks > 1 ? 1 : (nblocks + threads - 1) / threads;
#pragma omp parallel
    {
        float *ybuf = malloc(sizeof(float) * (size_t)(mchunk * nb));
        float *off_t = xs ? malloc(sizeof(float) * (size_t)(ng * nb)) : NULL;
        if (!ybuf || (xs && !off_t)) {
#pragma omp atomic write
            failed = 1;
        }
        /* Many activation rows (a prefill): tiles handed out one at a time as threads free
         * up, since on a shared VM one thread is often delayed (steal time) and an even split
         * left the other waiting at the barrier: prefill 512 +10% (AMD EPYC Zen 4, 2 threads).
         * Few rows (decode): one contiguous share a thread, as a static split, which streams
         * the weights best. A tile's result does not depend on the thread that computes it. */
#pragma omp for schedule(dynamic, tile_share)
        for (int64_t tile = 0; tile < mchunks * nblocks; tile++) {
            if (!ybuf || (xs && !off_t)) continue;
            const int64_t b = tile % nblocks, m0 = tile / nblocks * mchunk;
            const int64_t n0 = b * nb, n1 = n0 + nb < N ? n0 + nb : N;
            const int64_t m1 = m0 + mchunk < M ? m0 + mchunk : M;
            if (amx) {
#ifdef TM_HAS_AMX
                if (block_amx(kind, f16, G, K, w, scales, n0, n1, m0, m1, xq, xd8, xz, nblk, ybuf,
                              nb)) {
#pragma omp atomic write
                    failed = 1;
                }
#endif
            } else if (act_int8)
                BLOCK_INT8[vnni_isa](ikind, f16, G, M, K, w, scales, n0, n1, m0, m1, xq, xd8, xz,
                                     xg, nblk, ybuf, nb);
            else
                block_float(kind, f16, z, G, K, w, scales, n0, n1, m0, m1, xp, xg, ybuf, nb);
            if (!xs && !bias) {
                for (int64_t m = m0; m < m1; m++)
                    memcpy(y + m * N + n0, ybuf + (m - m0) * nb, sizeof(float) * (size_t)(n1 - n0));
                continue;
            }
            for (int64_t n = n0; xs && n < n1; n++)
                for (int64_t g = 0; g < ng; g++) off_t[g * nb + n - n0] = offsets[n * ng + g];
            if (qgemm_isa >= ISA_AVX512VNNI && nb <= 64)
                finish_tile_avx512(ybuf, nb, off_t, xs, ng, bias, m0, m1, n0, n1, y, N);
            else
                finish_tile(ybuf, nb, off_t, xs, ng, bias, m0, m1, n0, n1, y, N);
        }
        free(ybuf);
        free(off_t);
    }
    free(xq);
    free(xd8);
    free(xz);
    free(xp);
    free(xs);
    free(xg);
    free(bytes);
    return failed ? -1 : 0;
fail:
    free(bytes);
    free(xq);
    free(xd8);
    free(xz);
    free(xp);
    free(xs);
    free(xg);
    return -1;
}

/* Float rows [n0, n1) of W into out[(n1 - n0), K] in element order (a float GEMM's tile, or
 * embedding rows). */
TM_TARGET void tm_dequant_rows(int64_t n0, int64_t n1, int64_t K, int kind, const uint8_t *w,
                               const void *scales, const float *offsets, int64_t G,
                               float *out) {
    const int f16 = TM_KIND_F16(kind), z = TM_KIND_ZERO(kind);
    kind = TM_KIND_LAYOUT(kind);
    const int64_t ng = row_scale_count(kind, K, G), wrow = row_bytes(kind, K);
#pragma omp parallel for schedule(static) if (n1 - n0 > 1)
    for (int64_t n = n0; n < n1; n++)
        dequant_row(kind, f16, z, K, G, w + n * wrow, row_scales(scales, n, ng, f16),
                    offsets ? offsets + n * ng : NULL, out + (n - n0) * K);
}

/* A module so setuptools builds this as an extension and Python can find the file. */
static struct PyModuleDef tm_module = {PyModuleDef_HEAD_INIT, "_qgemm", NULL, -1, NULL};
PyMODINIT_FUNC PyInit__qgemm(void) { return PyModule_Create(&tm_module); }
