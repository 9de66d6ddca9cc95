/* What amx_gemv.c and amx_gemm.c share: whether the compiler has the AMX intrinsics, the kind bits of
 * amx_gemv.c's tiled layout (amx_gemm.c's quill_kq_gemm reads that layout too, and kquant_i8.c's VNNI
 * tiles its K-quants), a K-quant scale group of that layout, the tile configuration record, and the CPUID
 * bits both probe. */
#ifndef QUILL_AMX_TILES_H
#define QUILL_AMX_TILES_H
#include "isa.h"

#include <stdint.h>
#include <string.h>

/* AMX intrinsics need GCC 11 or clang 12. */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define AMX_COMPILER 1
#else
#define AMX_COMPILER 0
#endif

/* A tiled weight's kind (quill/kernels/tiled.py's native_kind): bit 0 = q8 codes (else q4), bit 1 = fp16
 * scales and mins, bit 2 = K-quant scales (int8 per group, fp16 per 256), bit 3 = iq4 codes, bit 4 = q6
 * codes, bit 5 = q5 codes; bit 6: a K-quant weight tiled for the VNNI tiles (kquant_i8.c), on a CPU or an
 * engine without AMX; bit 7 = q3 codes, bit 8 = q2 codes (both with bit 6 always); bit 9: with bit 6, run by
 * the AVX2 digit tiles (tiled_avx2.c) instead of the VNNI ones. */
#define KIND_Q8 1
#define KIND_F16 2
#define KIND_KSCALES 4
#define KIND_IQ4 8
#define KIND_Q6 16
#define KIND_Q5 32
#define KIND_VNNI 64
#define KIND_Q3 128 /* q3 codes (Q3_K: 0..7 for q + 4, scales per 16 weights): the VNNI tiles only */
#define KIND_Q2 256 /* q2 codes (Q2_K: 0..3; scale bytes sc | m << 4 per 16 weights, mins_d -dmin): VNNI tiles only */
#define KIND_AVX2 512 /* with bit 6: the digit tiles' AVX2 kernel (tiled_avx2.c), for an engine or a CPU without VNNI */

/* 16 rows' values of K-quant scale (or min) group `group` of the tiled layout: the int8 per group times its
 * fp16 factor (one per 2^shift groups), an fp16 times a small integer, so exact in fp32. */
AVX512 static inline __m512 kscale_group(const int8_t *v, const uint16_t *d, long group, int shift) {
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + (group >> shift) * 16))),
                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(v + group * 16)))));
}

/* kscale_group for q2's scale bytes (sc | m << 4): the low nibble (high = 0, the scale) or the high one (the
 * min) as the integer. */
AVX512 static inline __m512 kscale_nibble(const int8_t *v, const uint16_t *d, long group, int shift, int high) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(v + group * 16)));
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + (group >> shift) * 16))),
                         _mm512_cvtepi32_ps(high ? _mm512_srli_epi32(b, 4) : _mm512_and_si512(b, _mm512_set1_epi32(15))));
}

/* LDTILECFG's 64-byte record (palette 1). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

/* Tile t: rows[t] rows of 64 bytes; the caller loads it (_tile_loadconfig needs its target attributes). */
static inline TileConfig tile_config(const uint8_t rows[8]) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = rows[t], cfg.colsb[t] = rows[t] ? 64 : 0;
    return cfg;
}

/* CPUID leaf 7, sub-leaf 0, EDX: AMX-BF16 is bit 22, AMX-TILE bit 24, AMX-INT8 bit 25. */
static inline unsigned cpuid7_edx(void) {
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    return d;
}
#endif
