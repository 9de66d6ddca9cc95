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
 * QUILL_EMULATE_NO_VNNI is defined too. The AMX tile unit is not emulated (amx_gemv.c builds the
 * GEMV's stub; test_amx_emulated.py checks that path's arithmetic in numpy). So the AVX-512 rows,
 * tiles and attention run, as written, on the AVX2-only hosts CI may have, only slower.
 */
#ifndef QUILL_ISA_H
#define QUILL_ISA_H
#include <immintrin.h>

#ifdef QUILL_EMULATE_AVX512
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
 * writes zeros to the unmasked lanes: past the end of a row's output). */
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
#define _mm512_cvtepu8_epi32(a) quill_emu_cvtepu8_epi32(a)
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

#else
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define CPU_HAS(feature) __builtin_cpu_supports(feature)
#endif

#endif
