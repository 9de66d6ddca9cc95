/* The one place that names the instruction sets. Every kernel file includes this instead of
 * <immintrin.h>.
 *
 * The library is built for AVX2 + FMA + F16C; the 16-lane functions carry AVX512 (or VNNI) as a
 * target attribute, so one library holds both widths and each call picks its width at run time
 * (its caller's `isa`). CPU_HAS(feature) is what the CPU can run, probed with CPUID.
 *
 * Built with -DQUILL_EMULATE_AVX512 (native.load(emulate=...); for tests, never for an engine), the
 * same AVX-512 source compiles for any AVX2 CPU: SIMDe, a header library, supplies each _mm512_*
 * intrinsic from AVX2 code with the instruction's defined result (fused FMAs stay fused), the
 * attributes are empty, and CPU_HAS reports AVX-512 F/BW/VL/DQ, and VNNI unless
 * QUILL_EMULATE_NO_VNNI is defined too. With QUILL_EMULATE_AMX as well, the AMX tile unit is
 * emulated below and amx_gemv.c builds its tile GEMV on it (amx_gemm.c its BF16 GEMM). So the AVX-512 rows, VNNI tiles, AMX
 * tiles and attention run, as written, on the AVX2-only hosts CI may have, only slower.
 */
#ifndef QUILL_ISA_H
#define QUILL_ISA_H
#include <immintrin.h>

#ifdef QUILL_EMULATE_AVX512
#include <math.h>
#include <string.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#undef I /* SIMDe pulls in <complex.h>, whose I would shadow the kernels' variables */

#define AVX512
#define VNNI
#ifdef QUILL_EMULATE_NO_VNNI
#define CPU_HAS(feature) (__builtin_strcmp(feature, "avx512vnni") != 0)
#else
#define CPU_HAS(feature) 1
#endif

/* The intrinsics the kernels use that SIMDe 0.8.2 lacks or does not do as the instruction does,
 * from their definitions in the Intel intrinsics guide: the reductions in GCC's order (high half with
 * low half, then 128-bit halves, then lanes (2, 3) with (0, 1), then lane 1 with lane 0; SIMDe's max
 * scans the lanes, which differs from the hardware's on NaN and on zeros' signs); masked loads
 * and stores touch no element outside the mask (SIMDe's read all 64 bytes, and its masked store
 * writes zeros to the unmasked lanes: past the end of a row's output); and, for amx_gemv.c, abs (the
 * sign bit cleared), scalef (SIMDe's exp2 overflows past 2^127: split_chunk scales by up to 2^171)
 * and the truncating int32 -> int8 narrowing SIMDe lacks; and the int32 sum it lacks too (kquant_i8.c's
 * digit sums). */
static inline __m512i quill_emu_cvtepu8_epi32(__m128i a) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_cvtepu8_epi32(a)),
                              _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(a, a)), 1);
}
static inline __m512i quill_emu_cvtepi8_epi32(__m128i a) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_cvtepi8_epi32(a)),
                              _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(a, a)), 1);
}
static inline float quill_emu_reduce_add_ps(__m512 a) {
    __m256 h = _mm256_add_ps(_mm512_extractf32x8_ps(a, 1), _mm512_extractf32x8_ps(a, 0));
    __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
    q = _mm_add_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(q) + _mm_cvtss_f32(_mm_shuffle_ps(q, q, 1));
}
static inline float quill_emu_reduce_max_ps(__m512 a) { /* vmaxps keeps its second operand on NaN or +-0 */
    __m256 h = _mm256_max_ps(_mm512_extractf32x8_ps(a, 1), _mm512_extractf32x8_ps(a, 0));
    __m128 q = _mm_max_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
    q = _mm_max_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_max_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(0, 1, 0, 1))));
}
static inline uint32_t quill_emu_testn_epi8_mask(__m256i a, __m256i b) { /* bit i: (a & b) byte i is zero */
    return (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_and_si256(a, b), _mm256_setzero_si256()));
}
static inline __m256i quill_emu_mask_sub_epi8(__m256i src, uint32_t k, __m256i a, __m256i b) {
    /* byte i of the mask -> 0xff where bit i of k is set: byte i takes k's byte i / 8, then bit i % 8 */
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)k),
                                               _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i on = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_blendv_epi8(src, _mm256_sub_epi8(a, b), on);
}
static inline __m512 quill_emu_maskz_loadu_ps(uint16_t k, const void *p) {
    float v[16];
    for (int i = 0; i < 16; i++) v[i] = (k >> i) & 1 ? ((const float *)p)[i] : 0.0f;
    return _mm512_loadu_ps(v);
}
static inline void quill_emu_mask_storeu_ps(void *p, uint16_t k, __m512 a) {
    float v[16];
    _mm512_storeu_ps(v, a);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) ((float *)p)[i] = v[i];
}
static inline __m256i quill_emu_cvtepi32_epi16(__m512i a) { /* each lane's low 16 bits */
    int32_t v[16];
    int16_t r[16];
    _mm512_storeu_si512(v, a);
    for (int i = 0; i < 16; i++) r[i] = (int16_t)v[i];
    return _mm256_loadu_si256((const __m256i *)r);
}
static inline __m512i quill_emu_maskz_loadu_epi8(uint64_t k, const void *p) {
    int8_t v[64];
    for (int i = 0; i < 64; i++) v[i] = (k >> i) & 1 ? ((const int8_t *)p)[i] : 0;
    return _mm512_loadu_si512(v);
}
static inline int quill_emu_reduce_add_epi32(__m512i a) { /* integer sums: any order gives the same */
    int32_t v[16], s = 0;
    _mm512_storeu_si512(v, a);
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}
#define _mm512_cvtepu8_epi32(a) quill_emu_cvtepu8_epi32(a)
#define _mm512_reduce_add_epi32(a) quill_emu_reduce_add_epi32(a)
#define _mm512_cvtepi8_epi32(a) quill_emu_cvtepi8_epi32(a)
#define _mm512_reduce_add_ps(a) quill_emu_reduce_add_ps(a)
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps(a) quill_emu_reduce_max_ps(a)
#define _mm256_testn_epi8_mask(a, b) quill_emu_testn_epi8_mask(a, b)
#define _mm256_mask_sub_epi8(src, k, a, b) quill_emu_mask_sub_epi8(src, k, a, b)
#define _mm512_maskz_loadu_epi8(k, p) quill_emu_maskz_loadu_epi8(k, p)
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps(k, p) quill_emu_maskz_loadu_ps(k, p)
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps(p, k, a) quill_emu_mask_storeu_ps(p, k, a)
#define _mm512_cvtepi32_epi16(a) quill_emu_cvtepi32_epi16(a)

static inline __m512 quill_emu_abs_ps(__m512 a) { /* clears the sign bit, of -0 and NaN too */
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff)));
}
static inline __m512 quill_emu_scalef_ps(__m512 a, __m512 b) { /* a * 2^floor(b), one rounding; b finite or NaN */
    float va[16], vb[16];
    _mm512_storeu_ps(va, a);
    _mm512_storeu_ps(vb, b);
    for (int i = 0; i < 16; i++)
        va[i] = vb[i] != vb[i] ? vb[i] : ldexpf(va[i], (int)fmaxf(fminf(floorf(vb[i]), 1024.f), -1024.f));
    return _mm512_loadu_ps(va);
}
static inline __m128i quill_emu_cvtepi32_epi8(__m512i a) { /* each lane's low byte */
    int32_t v[16];
    int8_t r[16];
    _mm512_storeu_si512(v, a);
    for (int i = 0; i < 16; i++) r[i] = (int8_t)v[i];
    return _mm_loadu_si128((const __m128i *)r);
}
#undef _mm512_abs_ps
#define _mm512_abs_ps(a) quill_emu_abs_ps(a)
#undef _mm512_scalef_ps
#define _mm512_scalef_ps(a, b) quill_emu_scalef_ps(a, b)
#undef _mm512_cvtepi32_epi8
#define _mm512_cvtepi32_epi8(a) quill_emu_cvtepi32_epi8(a)

#ifdef QUILL_EMULATE_AMX
/* The AMX tile unit by the instructions' definitions: eight tiles of up to 16 rows x 64 bytes per
 * thread (as the hardware's tile registers are), shaped by the last _tile_loadconfig; a load or
 * store moves rows x colsb bytes, the rest of a tile reads as zero; TDPBSSD / TDPBSUD add
 * sum over k < colsb(A) / 4, r < 4 of A[m][4k + r] * B[k][4n + r] to C[m][n], signed A times
 * signed (SSD) or unsigned (SUD) B, in int32 that wraps. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) QuillEmuTileConfig;
static _Thread_local struct {
    QuillEmuTileConfig cfg;
    uint8_t reg[8][16][64];
} quill_emu_amx;
static inline void quill_emu_tile_loadconfig(const void *cfg) {
    memcpy(&quill_emu_amx.cfg, cfg, sizeof(QuillEmuTileConfig));
    memset(quill_emu_amx.reg, 0, sizeof quill_emu_amx.reg);
}
static inline void quill_emu_tile_loadd(int t, const void *base, long stride) {
    memset(quill_emu_amx.reg[t], 0, sizeof quill_emu_amx.reg[t]);
    for (int r = 0; r < quill_emu_amx.cfg.rows[t]; r++)
        memcpy(quill_emu_amx.reg[t][r], (const uint8_t *)base + r * stride, quill_emu_amx.cfg.colsb[t]);
}
static inline void quill_emu_tile_stored(int t, void *base, long stride) {
    for (int r = 0; r < quill_emu_amx.cfg.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, quill_emu_amx.reg[t][r], quill_emu_amx.cfg.colsb[t]);
}
static inline void quill_emu_tile_dp(int c, int a, int b, int b_signed) {
    const int M = quill_emu_amx.cfg.rows[c], N = quill_emu_amx.cfg.colsb[c] / 4, K = quill_emu_amx.cfg.colsb[a] / 4;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            uint32_t acc;
            memcpy(&acc, &quill_emu_amx.reg[c][m][4 * n], 4);
            for (int k = 0; k < K; k++)
                for (int r = 0; r < 4; r++) {
                    const int x = (int8_t)quill_emu_amx.reg[a][m][4 * k + r], y = quill_emu_amx.reg[b][k][4 * n + r];
                    acc += (uint32_t)(x * (b_signed ? (int8_t)y : y));
                }
            memcpy(&quill_emu_amx.reg[c][m][4 * n], &acc, 4);
        }
}
/* TDPBF16PS: C[m][n] (fp32) += A[m][2k] * B[k][2n] then += A[m][2k + 1] * B[k][2n + 1], for k < colsb(A) / 4,
 * each addition rounded to nearest even; bf16 inputs that are denormal read as zero, denormal results
 * are flushed to zero (a bf16 product is exact in fp32, so fmaf rounds as the instruction does). */
static inline float quill_emu_bf16(const uint8_t *p) {
    uint32_t u = (uint32_t)(p[0] | p[1] << 8) << 16;
    if (!(u & 0x7f800000u)) u &= 0x80000000u;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline float quill_emu_ftz(float f) { return fabsf(f) < 1.17549435e-38f ? copysignf(0.0f, f) : f; }
static inline void quill_emu_tile_dpbf16ps(int c, int a, int b) {
    const int M = quill_emu_amx.cfg.rows[c], N = quill_emu_amx.cfg.colsb[c] / 4, K = quill_emu_amx.cfg.colsb[a] / 4;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            float acc;
            memcpy(&acc, &quill_emu_amx.reg[c][m][4 * n], 4);
            for (int k = 0; k < K; k++)
                for (int r = 0; r < 2; r++)
                    acc = quill_emu_ftz(fmaf(quill_emu_bf16(&quill_emu_amx.reg[a][m][4 * k + 2 * r]),
                                             quill_emu_bf16(&quill_emu_amx.reg[b][k][4 * n + 2 * r]), acc));
            memcpy(&quill_emu_amx.reg[c][m][4 * n], &acc, 4);
        }
}
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbssd
#undef _tile_dpbsud
#undef _tile_dpbf16ps
#define _tile_loadconfig(cfg) quill_emu_tile_loadconfig(cfg)
#define _tile_release() ((void)0)
#define _tile_loadd(t, base, stride) quill_emu_tile_loadd(t, base, stride)
#define _tile_stored(t, base, stride) quill_emu_tile_stored(t, base, stride)
#define _tile_zero(t) memset(quill_emu_amx.reg[t], 0, sizeof quill_emu_amx.reg[t])
#define _tile_dpbssd(c, a, b) quill_emu_tile_dp(c, a, b, 1)
#define _tile_dpbsud(c, a, b) quill_emu_tile_dp(c, a, b, 0)
#define _tile_dpbf16ps(c, a, b) quill_emu_tile_dpbf16ps(c, a, b)
#endif

#else
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define CPU_HAS(feature) __builtin_cpu_supports(feature)
#endif

#endif
