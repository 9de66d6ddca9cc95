/* GEMV / small GEMM and dequantization straight from GGUF's own K-quant blocks, so a weight stays
 * as small in memory as in the file (Q2_K: 2.625 bits per weight, Q3_K: 3.4375, Q4_K: 4.5, Q6_K: 6.5625).
 *
 * A row of K weights is K / 256 super-blocks. Each block is read as 8 groups of 32 weights; a
 * group's 32 codes become fp32 weights exactly as GGUF defines them (the same products, in the
 * same order, as gguf-py's and llama.cpp's reference dequantization):
 *   Q4_K (144 bytes: d, dmin fp16; 12 bytes of 6-bit scales and mins; 128 bytes of nibbles)
 *        w = (d * sc[g]) * q - (dmin * m[g]),   q in 0..15
 *   Q6_K (210 bytes: 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d fp16)
 *        w = (d * sc[16-element chunk]) * (q - 32),   q in 0..63
 *   Q2_K (84 bytes: 16 bytes of 4-bit scale | 4-bit min << 4, 64 bytes of 2-bit codes, d, dmin fp16)
 *        w = (d * sc[chunk]) * q - (dmin * m[chunk]),   q in 0..3
 *   Q3_K (110 bytes: 32 bytes of high bits, 64 bytes of 2-bit low codes, 12 bytes of 6-bit scales, d fp16)
 *        w = (d * (sc[chunk] - 32)) * q,   q = low - (high bit ? 0 : 4), in -4..3
 * Dequantization computes exactly those weights. The GEMV computes the same dot product
 * reassociated: per group sc * (codes . x) (Q6_K, Q2_K, Q3_K: per 16 weights), minus min * sum(x)
 * for Q4_K / Q5_K / Q2_K (the AVX-512 Q2_K / Q3_K rows scale each 16 weights once instead of the dot).
 * Activations stay fp32 here: nothing is rounded beyond the file's own quantization and fp32 sums.
 *
 * Batch invariance: each (row, item) accumulates groups in order in two accumulators, then one
 * horizontal sum, whatever B is or where the item sits. Tiles over B only share the decoded
 * codes between items.
 *
 * (On CPUs with AMX, unless QUILL_NO_AMX turns it off, those four load as AMX tiles, tiled.py, and run amx_gemv.c.)
 * On AVX-512 CPUs with VNNI (isa 512), Q4_K, Q5_K, Q6_K and IQ4_XS take kquant_i8.c's tiles instead, at
 * every batch (quill_gemv_tiles_exact: 16 rows decoded at once, each code register reused by every item;
 * x as three int8 digits per element, digits.h: at most 2^-22 of its group's largest |x| off, the size of
 * fp32's own rounding in a sum). With isa 256 (AVX2) the same kinds take kquant_i8_avx2.c's 8-row tiles
 * (quill_gemv_tiles_f32_avx2): 0.75-0.85x the rows' time at batch 1, 0.68-0.73x at batch 16 (before
 * that file's passes over two tiles, which took another 0.81-0.89x at batch 16 on a Zen 1). An engine
 * loads most weights of those kinds tiled, though (tiled.for_cpu): on the VNNI tiles' tiled layout, and
 * with isa 256 Q4_K, Q5_K, Q3_K and Q2_K on that layout's AVX2 kernel (tiled_avx2.c), so these block
 * kernels serve the rest (Q6_K and IQ4_XS on AVX2, shapes the tiles do not take). The rows below serve
 * the other kinds, and AVX-512 without VNNI.
 *
 * Block layouts are facts from GGML's format (ggml-common.h block_q2_K .. block_q6_K and the
 * reference dequantize_row_q2_K .. _q6_K); the code is written here.
 */
#include "isa.h"

#include "kformat.h"
#include "simd.h"
#include <stdint.h>
#include <string.h>

#define QK 256
#define HAS_MIN(kind) ((kind) == 0 || (kind) == 5 || (kind) == 8) /* Q4_K, Q5_K, Q2_K: w = d sc q - dmin m, q unsigned */
#define PER16(kind) ((kind) == 1 || (kind) == 8 || (kind) == 9) /* Q6_K, Q2_K, Q3_K: a scale per 16 weights */
#define SUPER_BYTES(kind) \
    ((kind) == 0 ? Q4K_BYTES : (kind) == 5 ? Q5K_BYTES : (kind) == 8 ? Q2K_BYTES : (kind) == 9 ? Q3K_BYTES : Q6K_BYTES)

int quill_isa_used(int isa);
int quill_gemv_tiles_exact(int, const uint8_t *, const float *, const float *, uint8_t *, float *, int, int, int, int, int);
int quill_gemv_tiled_exact(int, const uint8_t *, const int8_t *, const int8_t *, const uint16_t *, const uint16_t *,
                           const float *, const float *, uint8_t *, float *, int, int, int, int, int);
int quill_gemv_tiled_exact_avx2(int, const uint8_t *, const int8_t *, const int8_t *, const uint16_t *, const uint16_t *,
                                const float *, const float *, uint8_t *, float *, int, int, int, int, int); /* tiled_avx2.c */
long quill_digits_bytes(int B, int K);
int quill_gemv_tiles_f32_avx2(int, const uint8_t *, const float *, const float *, float *, int, int, int, int, int);


/* Q4_K's 6-bit scale and min of group j (0..7) from its 12 packed bytes. */
static inline void q4k_scale_min(const uint8_t *q, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* One group's 32 codes as bytes: Q4_K 0..15 / Q2_K 0..3 unsigned, Q6_K q - 32 / Q3_K -4..3 signed. */
static inline __m256i group_codes(int kind, const uint8_t *blk, int g) {
    if (kind == 8 || kind == 9) { /* field g % 4 of the 2-bit codes in bytes [32 (g / 4), +32); Q3_K: bit g of hmask */
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + (kind == 8 ? 16 : 32) + 32 * (g >> 2)));
        const __m256i low = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * (g & 3)), _mm256_set1_epi8(3));
        if (kind == 8) return low;
        /* bytes whose bit g is clear hold 1 << g after the andnot; moved to 4 (no bit crosses a byte), then subtracted */
        const __m256i clear = _mm256_andnot_si256(_mm256_loadu_si256((const __m256i *)blk), _mm256_set1_epi8((char)(1 << g)));
        return _mm256_sub_epi8(low, g >= 2 ? _mm256_srli_epi16(clear, g - 2) : _mm256_slli_epi16(clear, 2 - g));
    }
    if (HAS_MIN(kind)) { /* Q5_K: the nibbles start after 32 bytes whose bit g is each element's fifth bit */
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + (kind == 5 ? 48 : 16) + 32 * (g >> 1)));
        const __m256i nib = _mm256_and_si256((g & 1) ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(15));
        if (kind == 0) return nib;
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
        return _mm256_or_si256(nib, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, g), _mm256_set1_epi8(1)), 4));
    }
    const int h = g >> 2, sub = g & 3; /* half of the block, and which of its four 32-runs */
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (sub & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    const __m256i lo = _mm256_and_si256((sub >> 1) ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(15));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * sub), _mm256_set1_epi8(3));
    const __m256i q = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)); /* bytes 0..63: the shifts never cross bytes */
    return _mm256_sub_epi8(q, _mm256_set1_epi8(32));
}

/* codes (32 bytes) -> four 8-wide float vectors of the plain codes. */
static inline void codes8(int kind, __m256i codes, __m256 w[4]) {
    const __m128i a = _mm256_castsi256_si128(codes), c = _mm256_extracti128_si256(codes, 1);
    __m256i v[4];
    if (HAS_MIN(kind)) {
        v[0] = _mm256_cvtepu8_epi32(a);
        v[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8));
        v[2] = _mm256_cvtepu8_epi32(c);
        v[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(c, 8));
    } else {
        v[0] = _mm256_cvtepi8_epi32(a);
        v[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8));
        v[2] = _mm256_cvtepi8_epi32(c);
        v[3] = _mm256_cvtepi8_epi32(_mm_srli_si128(c, 8));
    }
    for (int i = 0; i < 4; i++) w[i] = _mm256_cvtepi32_ps(v[i]);
}

/* One group's weights exactly as GGUF's reference dequantization computes them: (scale * code) - min,
 * a product then a difference (s0, m0 for codes 0..15, s1, m1 for 16..31). */
static inline void weights8(int kind, __m256i codes, float s0, float s1, float m0, float m1, __m256 w[4]) {
    codes8(kind, codes, w);
    for (int i = 0; i < 4; i++)
        w[i] = _mm256_sub_ps(_mm256_mul_ps(w[i], _mm256_set1_ps(i < 2 ? s0 : s1)), _mm256_set1_ps(i < 2 ? m0 : m1));
}

/* A block's scales (and mins) as fp32, decoded once per 256 weights with vector ops:
 * Q4_K: sc[g] = d * scale_g, mn[g] = dmin * min_g (g < 8); Q6_K: sc[c] = d * scale_c (c < 16);
 * Q2_K: sc[c] = d * (byte c & 15), mn[c] = dmin * (byte c >> 4); Q3_K: sc[c] = d * (scale_c - 32).
 * Q3_K's twelve bytes: scale c has its low 4 bits in byte c % 8's nibble c / 8 and, for c = 4k + i, its
 * high 2 bits at bit 2k of byte 8 + i (so word k of u2 >> 2k, masked, holds scales 4k..4k+3).
 * Q4_K's twelve bytes: kformat.h's k4_scales_mins (the bit arithmetic of q4k_scale_min above). */
static inline void block_scales(int kind, const uint8_t *blk, float *sc, float *mn) {
    if (kind == 8) {
        const __m128i b = _mm_loadu_si128((const __m128i *)blk), m4 = _mm_set1_epi8(15);
        const __m128i s = _mm_and_si128(b, m4), m = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
        const __m256 d = _mm256_set1_ps(f16(blk + 80)), dmin = _mm256_set1_ps(f16(blk + 82));
        _mm256_storeu_ps(sc, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(s))));
        _mm256_storeu_ps(sc + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(s, 8)))));
        _mm256_storeu_ps(mn, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m))));
        _mm256_storeu_ps(mn + 8, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(m, 8)))));
        return;
    }
    if (kind == 9) {
        const __m128i m4 = _mm_set1_epi8(15), lo8 = _mm_loadl_epi64((const __m128i *)(blk + 96));
        uint32_t u2;
        memcpy(&u2, blk + 104, 4);
        const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(lo8, m4), _mm_and_si128(_mm_srli_epi16(lo8, 4), m4));
        const __m128i high = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)u2), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
        const __m128i q = _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi32(high, 4)), _mm_set1_epi8(32));
        const __m256 d = _mm256_set1_ps(f16(blk + 108));
        _mm256_storeu_ps(sc, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
        _mm256_storeu_ps(sc + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))));
        return;
    }
    if (HAS_MIN(kind)) {
        const __m128i bytes = k4_scales_mins(blk); /* 8 scales, then 8 mins */
        _mm256_storeu_ps(sc, _mm256_mul_ps(_mm256_set1_ps(f16(blk)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes))));
        _mm256_storeu_ps(mn, _mm256_mul_ps(_mm256_set1_ps(f16(blk + 2)),
                                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)))));
    } else {
        const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 192));
        const __m256 d = _mm256_set1_ps(f16(blk + 208));
        _mm256_storeu_ps(sc, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
        _mm256_storeu_ps(sc + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))));
    }
}

/* Sum over g < G of mn[g] * xs[g], eight lanes then the tail, in a fixed order. */
static inline float min_terms(const float *mn, const float *xs, int G) {
    __m256 acc = _mm256_setzero_ps();
    int g = 0;
    for (; g + 8 <= G; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(mn + g), _mm256_loadu_ps(xs + g), acc);
    float tail = 0.f;
    for (; g < G; g++) tail += mn[g] * xs[g];
    return hsum8(acc) + tail;
}

/* Sum of each 32-weight group of x (16-weight chunk for Q2_K), per item: the min terms are m_g * sum(x_g). */
static void kq_group_sums(const float *x, float *xs, int B, int K, int width) {
    for (int b = 0; b < B; b++)
        for (int g = 0; g < K / width; g++) {
            const float *p = x + (long)b * K + (long)width * g;
            xs[(long)b * (K / width) + g] = width == 32 ? sum32(p) : hsum8(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)));
        }
}

/* The GEMV computes, per item and row, sum over groups g of sc * (codes_g . x_g) - mn_g * sum(x_g)
 * (Q4_K), or sum over 16-chunks c of sc_c * (codes_c . x_c) with codes q - 32 (Q6_K), minus
 * mn_c * sum(x_c) for Q2_K: the same dot product as the dequantized weights', reassociated; every
 * sum in a fixed order. */

#define TILE 4

/* Row n for items [b0, b0 + nb), nb <= TILE: 8 lanes wide. */
static inline __attribute__((always_inline)) void row_256_k(const int kind, const uint8_t *row, int nblk,
                                                             const float *x, const float *xs, long K, float *out, int ld,
                                                             int n, int b0, int nb) {
    const int bytes = SUPER_BYTES(kind), nmin = PER16(kind) ? 16 : 8; /* mins per block */
    __m256 acc[TILE], acc2[TILE];
    float mrow[HAS_MIN(kind) ? nmin * nblk : 1]; /* the row's mins, dotted with the group sums at the end */
    for (int t = 0; t < nb; t++) acc[t] = acc2[t] = _mm256_setzero_ps();
    for (int b = 0; b < nblk; b++) {
        const uint8_t *blk = row + (long)b * bytes;
        float sc[16], *mn = HAS_MIN(kind) ? mrow + nmin * b : NULL;
        prefetch_block(blk, bytes);
        block_scales(kind, blk, sc, mn);
        for (int g = 0; g < 8; g++) {
            __m256 w[4];
            codes8(kind, group_codes(kind, blk, g), w);
            const __m256 a = _mm256_set1_ps(PER16(kind) ? sc[2 * g] : sc[g]), c = _mm256_set1_ps(PER16(kind) ? sc[2 * g + 1] : sc[g]);
            for (int t = 0; t < nb; t++) {
                const float *xg = x + (long)(b0 + t) * K + (long)b * QK + 32 * g;
                const __m256 lo = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), _mm256_mul_ps(w[0], _mm256_loadu_ps(xg)));
                if (!PER16(kind)) { /* one scale for the 32: one dot, one scaled add */
                    const __m256 d = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), lo));
                    acc[t] = _mm256_fmadd_ps(a, d, acc[t]);
                } else {
                    acc[t] = _mm256_fmadd_ps(a, lo, acc[t]);
                    acc2[t] = _mm256_fmadd_ps(c, _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), _mm256_mul_ps(w[2], _mm256_loadu_ps(xg + 16))), acc2[t]);
                }
            }
        }
    }
    for (int t = 0; t < nb; t++)
        out[(long)(b0 + t) * ld + n] = hsum8(_mm256_add_ps(acc[t], acc2[t]))
                                       - (HAS_MIN(kind) ? min_terms(mrow, xs + (long)(b0 + t) * nmin * nblk, nmin * nblk) : 0.f);
}

/* row_256_k with the kind a constant, so no kind test is left in its loops. */
static void row_256(int kind, const uint8_t *row, int nblk, const float *x, const float *xs, long K, float *out,
                    int ld, int n, int b0, int nb) {
    if (kind == 0) row_256_k(0, row, nblk, x, xs, K, out, ld, n, b0, nb);
    else if (kind == 5) row_256_k(5, row, nblk, x, xs, K, out, ld, n, b0, nb);
    else if (kind == 8) row_256_k(8, row, nblk, x, xs, K, out, ld, n, b0, nb);
    else if (kind == 9) row_256_k(9, row, nblk, x, xs, K, out, ld, n, b0, nb);
    else row_256_k(1, row, nblk, x, xs, K, out, ld, n, b0, nb);
}

#define TILE512 8

/* codes (32 bytes) -> two 16-wide float vectors of the plain codes. */
AVX512 static inline void codes16(int kind, __m256i codes, __m512 w[2]) {
    const __m128i a = _mm256_castsi256_si128(codes), c = _mm256_extracti128_si256(codes, 1);
    w[0] = _mm512_cvtepi32_ps(HAS_MIN(kind) ? _mm512_cvtepu8_epi32(a) : _mm512_cvtepi8_epi32(a));
    w[1] = _mm512_cvtepi32_ps(HAS_MIN(kind) ? _mm512_cvtepu8_epi32(c) : _mm512_cvtepi8_epi32(c));
}

/* Q4_K / Q5_K row n for items [b0, b0 + nb): 16 lanes wide, inlined per constant kind and nb so the
 * accumulators stay in registers and no branch is left in the loop. */
AVX512 static inline __attribute__((always_inline)) void row_512_n(const int kind, const uint8_t *row, int nblk,
                                                                   const float *x, const float *xs, long K,
                                                                   float *out, int ld, int n, int b0, const int nb) {
    const int bytes = SUPER_BYTES(kind);
    __m512 acc[TILE512];
    float mrow[8 * nblk]; /* the row's mins, dotted with the group sums at the end */
    for (int t = 0; t < nb; t++) acc[t] = _mm512_setzero_ps();
    for (int b = 0; b < nblk; b++) {
        const uint8_t *blk = row + (long)b * bytes;
        float sc[16], *mn = mrow + 8 * b;
        prefetch_block(blk, bytes);
        block_scales(kind, blk, sc, mn);
        for (int g = 0; g < 8; g++) {
            __m512 w[2];
            codes16(kind, group_codes(kind, blk, g), w);
            const __m512 a = _mm512_set1_ps(sc[g]);
            for (int t = 0; t < nb; t++) { /* one scale for the group: one product, then the scaled add */
                const float *xg = x + (long)(b0 + t) * K + (long)b * QK + 32 * g;
                acc[t] = _mm512_fmadd_ps(a, _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xg + 16), _mm512_mul_ps(w[0], _mm512_loadu_ps(xg))), acc[t]);
            }
        }
    }
    for (int t = 0; t < nb; t++)
        out[(long)(b0 + t) * ld + n] = _mm512_reduce_add_ps(acc[t]) - min_terms(mrow, xs + (long)(b0 + t) * (K / 32), 8 * nblk);
}

/* Q6_K, 16 lanes: a half-block (128 weights) unpacked at once from its 64 low-nibble bytes and 32
 * high-bit bytes with 512-bit byte ops; each 16 weights scaled once (d * sc * (q - 32), the exact
 * dequantized weight), then one FMA per item. */
AVX512 static inline __attribute__((always_inline)) void row_q6k_512_n(const uint8_t *row, int nblk, const float *x,
                                                                       long K, float *out, int ld, int n, int b0,
                                                                       const int nb) {
    __m512 acc[TILE512], acc2[TILE512];
    for (int t = 0; t < nb; t++) acc[t] = acc2[t] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(15), m2 = _mm512_set1_epi8(3), off = _mm512_set1_epi8(32);
    for (int b = 0; b < nblk; b++) {
        const uint8_t *blk = row + (long)b * Q6K_BYTES;
        float sc[16], unused[8];
        prefetch_block(blk, Q6K_BYTES);
        block_scales(1, blk, sc, unused);
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512((const void *)(blk + 64 * h));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            /* bytes 0..31: bits for runs 0 and 2 (shift 0 / 4); bytes 32..63: runs 1 and 3 (shift 2 / 6) */
            const __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
            const __m512i lo = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(ql, m4),
                                                               _mm512_slli_epi16(_mm512_and_si512(qh2, m2), 4)), off);
            const __m512i hi = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh2, 4), m2), 4)), off);
            for (int r = 0; r < 4; r++) { /* run r of the half: lo for runs 0, 1 and hi for runs 2, 3 */
                const __m512i codes = r < 2 ? lo : hi;
                const int lane = 2 * (r & 1); /* which 32 bytes of the 64 */
                const float *s = sc + 8 * h + 2 * r;
                const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(codes, lane))), _mm512_set1_ps(s[0]));
                const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(codes, lane + 1))), _mm512_set1_ps(s[1]));
                for (int t = 0; t < nb; t++) {
                    const float *xg = x + (long)(b0 + t) * K + (long)b * QK + 128 * h + 32 * r;
                    acc[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xg), acc[t]);
                    acc2[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + 16), acc2[t]);
                }
            }
        }
    }
    for (int t = 0; t < nb; t++) out[(long)(b0 + t) * ld + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t], acc2[t]));
}

/* group_codes for Q2_K / Q3_K with AVX-512 byte masks: Q3_K subtracts 4 where bit g of hmask is clear. */
AVX512 static inline __m256i q23k_codes_512(const int kind, const uint8_t *blk, int g) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + (kind == 8 ? 16 : 32) + 32 * (g >> 2)));
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * (g & 3)), _mm256_set1_epi8(3));
    if (kind == 8) return low;
    const __mmask32 clear = _mm256_testn_epi8_mask(_mm256_loadu_si256((const __m256i *)blk), _mm256_set1_epi8((char)(1 << g)));
    return _mm256_mask_sub_epi8(low, clear, low, _mm256_set1_epi8(4));
}

/* Q2_K / Q3_K, 16 lanes: each 16 weights scaled once (d * sc * q, Q3_K's exact dequantized weight), then
 * one FMA per item; Q2_K's 16 mins per block dotted with x's 16-weight sums (xs) after the block. */
AVX512 static inline __attribute__((always_inline)) void row_q23k_512_n(const int kind, const uint8_t *row, int nblk,
                                                                        const float *x, const float *xs, long K,
                                                                        float *out, int ld, int n, int b0,
                                                                        const int nb) {
    __m512 acc[TILE512], acc2[TILE512];
    for (int t = 0; t < nb; t++) acc[t] = acc2[t] = _mm512_setzero_ps();
    for (int b = 0; b < nblk; b++) {
        const uint8_t *blk = row + (long)b * SUPER_BYTES(kind);
        float sc[16], mn[16];
        prefetch_block(blk, SUPER_BYTES(kind));
        block_scales(kind, blk, sc, mn);
        for (int g = 0; g < 8; g++) {
            __m512 w[2];
            codes16(kind, q23k_codes_512(kind, blk, g), w);
            for (int i = 0; i < 2; i++) w[i] = _mm512_mul_ps(w[i], _mm512_set1_ps(sc[2 * g + i]));
            for (int t = 0; t < nb; t++) {
                const float *xg = x + (long)(b0 + t) * K + (long)b * QK + 32 * g;
                acc[t] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xg), acc[t]);
                acc2[t] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xg + 16), acc2[t]);
            }
        }
        if (kind == 8)
            for (int t = 0; t < nb; t++)
                acc[t] = _mm512_fnmadd_ps(_mm512_loadu_ps(mn), _mm512_loadu_ps(xs + (long)(b0 + t) * (K / 16) + 16L * b), acc[t]);
    }
    for (int t = 0; t < nb; t++) out[(long)(b0 + t) * ld + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t], acc2[t]));
}

AVX512 static void row_512(int kind, const uint8_t *row, int nblk, const float *x, const float *xs, long K,
                           float *out, int ld, int n, int b0, int nb) {
    if (kind == 0) { NB_SWITCH(row_512_n, 0, row, nblk, x, xs, K, out, ld, n, b0) }
    else if (kind == 5) { NB_SWITCH(row_512_n, 5, row, nblk, x, xs, K, out, ld, n, b0) }
    else if (kind == 8) { NB_SWITCH(row_q23k_512_n, 8, row, nblk, x, xs, K, out, ld, n, b0) }
    else if (kind == 9) { NB_SWITCH(row_q23k_512_n, 9, row, nblk, x, xs, K, out, ld, n, b0) }
    else { NB_SWITCH(row_q6k_512_n, row, nblk, x, K, out, ld, n, b0) }
}

/* ---- Formats read 32 weights at a time with one scale per 32: Q5_0 (kind 2), IQ4_NL (3), IQ4_XS (4).
 * Each group's codes become signed bytes (Q5_0: q - 16; IQ4: the format's table value for each 4-bit
 * index, looked up with a byte shuffle) and its scale an fp32 (Q5_0, IQ4_NL: d; IQ4_XS: d * (ls - 32)
 * with ls the group's 6-bit scale). weight = scale * code, exactly gguf's. The GEMV sums
 * scale * (codes . x) per group in a fixed order. Layouts: ggml-common.h block_q5_0, block_iq4_nl,
 * block_iq4_xs, and the kvalues_iq4nl table. */


/* A row's bytes per 32 weights (IQ4_XS: 136 per 256, so 17), for the weight stream's prefetch. */
#define G32_STRIDE(kind) ((kind) == 2 ? Q5_0_BYTES : (kind) == 3 ? IQ4NL_BYTES : IQ4XS_BYTES / 8)

/* Group gi of a row: its 32 signed codes. */
static inline __m256i g32_codes(int kind, const uint8_t *row, int gi) {
    if (kind == 2) {
        const uint8_t *blk = row + (long)gi * Q5_0_BYTES;
        uint32_t qh;
        memcpy(&qh, blk + 2, 4);
        /* bit j of qh -> 0x10 in byte j: each byte picks qh's byte j / 8, then tests its bit j % 8 */
        const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                              2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
        const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), pick);
        const __m256i fifth = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(16));
        return _mm256_sub_epi8(_mm256_or_si256(nibbles32(blk + 6), fifth), _mm256_set1_epi8(16));
    }
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_TABLE));
    if (kind == 3) return _mm256_shuffle_epi8(table, nibbles32(row + (long)gi * IQ4NL_BYTES + 2));
    return _mm256_shuffle_epi8(table, nibbles32(row + (long)(gi >> 3) * IQ4XS_BYTES + 8 + 16 * (gi & 7)));
}

/* Group g's scale: Q5_0 and IQ4_NL read their block's d; IQ4_XS's come from `pre` (g32_scales). */
static inline float g32_scale(int kind, const uint8_t *row, int g, const float *pre) {
    return kind == 4 ? pre[g] : f16(row + (long)g * (kind == 2 ? Q5_0_BYTES : IQ4NL_BYTES));
}

/* IQ4_XS: the scales of a row's G groups, d * (ls - 32), each super-block's d and bits read once. */
static inline void g32_scales(int kind, const uint8_t *row, int G, float *s) {
    if (kind != 4) return;
    for (int b = 0; b < G / 8; b++) {
        const uint8_t *blk = row + (long)b * IQ4XS_BYTES;
        const float d = f16(blk);
        const int high = blk[2] | (blk[3] << 8);
        for (int ib = 0; ib < 8; ib++) {
            const int ls = ((blk[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (((high >> (2 * ib)) & 3) << 4);
            s[8 * b + ib] = d * (float)(ls - 32);
        }
    }
}

static inline __attribute__((always_inline)) void g32_row_256_k(const int kind, const uint8_t *row, int G,
                                                                 const float *x, long K, float *out, int ld, int n,
                                                                 int b0, int nb) {
    __m256 acc[TILE], acc2[TILE];
    float scale[kind == 4 ? G : 1]; /* IQ4_XS's precomputed scales */
    g32_scales(kind, row, G, scale);
    for (int t = 0; t < nb; t++) acc[t] = acc2[t] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m256 w[4];
        codes8(1, g32_codes(kind, row, g), w);
        prefetch_ahead(row + (long)g * G32_STRIDE(kind), STREAM_AHEAD);
        const __m256 sv = _mm256_set1_ps(g32_scale(kind, row, g, scale));
        for (int t = 0; t < nb; t++) {
            const float *xg = x + (long)(b0 + t) * K + 32L * g;
            acc[t] = _mm256_fmadd_ps(sv, _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), _mm256_mul_ps(w[0], _mm256_loadu_ps(xg))), acc[t]);
            acc2[t] = _mm256_fmadd_ps(sv, _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), _mm256_mul_ps(w[2], _mm256_loadu_ps(xg + 16))), acc2[t]);
        }
    }
    for (int t = 0; t < nb; t++) out[(long)(b0 + t) * ld + n] = hsum8(_mm256_add_ps(acc[t], acc2[t]));
}

static void g32_row_256(int kind, const uint8_t *row, int G, const float *x, long K, float *out, int ld, int n, int b0,
                        int nb) {
    if (kind == 2) g32_row_256_k(2, row, G, x, K, out, ld, n, b0, nb);
    else if (kind == 3) g32_row_256_k(3, row, G, x, K, out, ld, n, b0, nb);
    else g32_row_256_k(4, row, G, x, K, out, ld, n, b0, nb);
}

AVX512 static inline __attribute__((always_inline)) void g32_row_512_n(const int kind, const uint8_t *row, int G,
                                                                       const float *x, long K, float *out, int ld,
                                                                       int n, int b0, const int nb) {
    __m512 acc[TILE512], acc2[TILE512];
    float scale[kind == 4 ? G : 1]; /* IQ4_XS's precomputed scales */
    g32_scales(kind, row, G, scale);
    for (int t = 0; t < nb; t++) acc[t] = acc2[t] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m512 w[2];
        codes16(1, g32_codes(kind, row, g), w);
        prefetch_ahead(row + (long)g * G32_STRIDE(kind), STREAM_AHEAD);
        const __m512 sv = _mm512_set1_ps(g32_scale(kind, row, g, scale));
        __m512 *into = (g & 1) ? acc2 : acc; /* even and odd groups: two independent chains */
        for (int t = 0; t < nb; t++) {
            const float *xg = x + (long)(b0 + t) * K + 32L * g;
            into[t] = _mm512_fmadd_ps(sv, _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xg + 16), _mm512_mul_ps(w[0], _mm512_loadu_ps(xg))), into[t]);
        }
    }
    for (int t = 0; t < nb; t++) out[(long)(b0 + t) * ld + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t], acc2[t]));
}

AVX512 static void g32_row_512(int kind, const uint8_t *row, int G, const float *x, long K, float *out, int ld, int n,
                               int b0, int nb) {
    if (kind == 2) { NB_SWITCH(g32_row_512_n, 2, row, G, x, K, out, ld, n, b0) }
    else if (kind == 3) { NB_SWITCH(g32_row_512_n, 3, row, G, x, K, out, ld, n, b0) }
    else { NB_SWITCH(g32_row_512_n, 4, row, G, x, K, out, ld, n, b0) }
}

/* ---- 16-bit float weights (F16: kind 6, BF16: kind 7) kept 16-bit: widened to fp32 exactly on load. */

static inline __m256 half8(int kind, const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return kind == 6 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static void f16_row_256(int kind, const uint16_t *row, const float *x, long K, float *out, int ld, int n, int b0, int nb) {
    __m256 acc[TILE], acc2[TILE];
    for (int t = 0; t < nb; t++) acc[t] = acc2[t] = _mm256_setzero_ps();
    for (long i = 0; i < K; i += 16) {
        prefetch_ahead(row + i, STREAM_AHEAD);
        const __m256 w0 = half8(kind, row + i), w1 = half8(kind, row + i + 8);
        for (int t = 0; t < nb; t++) {
            const float *xi = x + (long)(b0 + t) * K + i;
            acc[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xi), acc[t]);
            acc2[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xi + 8), acc2[t]);
        }
    }
    for (int t = 0; t < nb; t++) out[(long)(b0 + t) * ld + n] = hsum8(_mm256_add_ps(acc[t], acc2[t]));
}

AVX512 static inline __m512 half16(int kind, const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return kind == 6 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

AVX512 static inline __attribute__((always_inline)) void f16_row_512_n(const int kind, const uint16_t *row,
                                                                       const float *x, long K, float *out, int ld,
                                                                       int n, int b0, const int nb) {
    __m512 acc[TILE512], acc2[TILE512];
    for (int t = 0; t < nb; t++) acc[t] = acc2[t] = _mm512_setzero_ps();
    for (long i = 0; i < K; i += 32) {
        prefetch_ahead(row + i, STREAM_AHEAD);
        const __m512 w0 = half16(kind, row + i), w1 = half16(kind, row + i + 16);
        for (int t = 0; t < nb; t++) {
            const float *xi = x + (long)(b0 + t) * K + i;
            acc[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xi), acc[t]);
            acc2[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xi + 16), acc2[t]);
        }
    }
    for (int t = 0; t < nb; t++) out[(long)(b0 + t) * ld + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t], acc2[t]));
}

AVX512 static void f16_row_512(int kind, const uint16_t *row, const float *x, long K, float *out, int ld, int n, int b0,
                               int nb) {
    if (kind == 6) { NB_SWITCH(f16_row_512_n, 6, row, x, K, out, ld, n, b0) }
    else { NB_SWITCH(f16_row_512_n, 7, row, x, K, out, ld, n, b0) }
}

/* Bytes per row of a kind's blocks, or 0 for an unknown kind / a K not a multiple of 256. */
long quill_kq_row_bytes(int kind, int K) {
    switch (kind) {
    case 0: return K % QK ? 0 : (long)(K / QK) * Q4K_BYTES;
    case 1: return K % QK ? 0 : (long)(K / QK) * Q6K_BYTES;
    case 2: return K % 32 ? 0 : (long)(K / 32) * Q5_0_BYTES;
    case 3: return K % 32 ? 0 : (long)(K / 32) * IQ4NL_BYTES;
    case 4: return K % QK ? 0 : (long)(K / QK) * IQ4XS_BYTES;
    case 5: return K % QK ? 0 : (long)(K / QK) * Q5K_BYTES;
    case 6: case 7: return K % 32 ? 0 : 2L * K; /* F16, BF16 */
    case 8: return K % QK ? 0 : (long)(K / QK) * Q2K_BYTES;
    case 9: return K % QK ? 0 : (long)(K / QK) * Q3K_BYTES;
    default: return 0;
    }
}

/* The sums of x a kind's mins need, into xs: per 32 weights (Q4_K, Q5_K), per 16 (Q2_K: a min per 16), none for
 * the kinds without mins. */
static void kq_min_sums(int kind, const float *x, float *xs, int B, int K) {
    if (HAS_MIN(kind)) kq_group_sums(x, xs, B, K, kind == 8 ? 16 : 32);
}

/* Scratch bytes quill_gemv_kq needs for B items of K inputs: the sums of x (B * K / 16 floats), then the
 * VNNI tiles' digits of x. */
long quill_gemv_kq_scratch_bytes(int B, int K) { return 4L * B * (K / 16) + quill_digits_bytes(B, K); }

/* Where the VNNI tiles' digits sit in quill_gemv_kq's scratch: after the sums of x (per 16 weights). */
static inline uint8_t *kq_digits(float *xs, int B, int K) { return (uint8_t *)(xs + (long)B * (K / 16)); }

/* quill_gemv_kq for a K-quant or Q8_0 weight in the tiled layout (kind 0 Q4_K, 1 Q6_K, 4 IQ4_XS, 5 Q5_K, 8 Q2_K,
 * 9 Q3_K, LAYOUT_Q8; the pointers as amx_gemv.c's header states) on the digit tiles: the VNNI ones (kquant_i8.c's
 * quill_gemv_tiled_exact), or with avx2 the AVX2 ones (tiled_avx2.c, the same bits), with the same sums of x and
 * the same digits, so the same outputs as the blocks give. xs: scratch of quill_gemv_kq_scratch_bytes(B, K).
 * Returns 0, or -1 (nothing written) where the CPU has no VNNI (avx2 0) or the kernel does not take the kind. */
int quill_gemv_kq_tiled(int kind, const uint8_t *codes, const int8_t *scale, const int8_t *mins, const uint16_t *scale_d,
                        const uint16_t *mins_d, const float *x, float *xs, float *out, int N, int K, int B, int ld,
                        int avx2, int threads) {
    kq_min_sums(kind, x, xs, B, K);
    return (avx2 ? quill_gemv_tiled_exact_avx2 : quill_gemv_tiled_exact)(kind, codes, scale, mins, scale_d, mins_d, x, xs,
                                                                        kq_digits(xs, B, K), out, N, K, B, ld, threads);
}

/* out (B, ld) columns [0, N) = x (B, K) @ W.T for W (N, K) in `kind`'s blocks (0 = Q4_K, 1 = Q6_K,
 * 2 = Q5_0, 3 = IQ4_NL, 4 = IQ4_XS, 5 = Q5_K, 6 = F16, 7 = BF16, 8 = Q2_K, 9 = Q3_K);
 * ld is out's row stride (N for a whole output, more when W is one part of a fused projection);
 * xs: scratch of quill_gemv_kq_scratch_bytes(B, K) (the sums of x the mins need: per 32 weights, Q2_K per
 * 16; and the VNNI tiles' digits).
 * isa: 512 = the AVX-512 rows where the CPU has them, else AVX2; threads: this call's OpenMP team. */
void quill_gemv_kq(int kind, const uint8_t *blocks, const float *x, float *xs, float *out, int N, int K, int B, int ld,
                   int isa, int threads) {
    const long row_bytes = quill_kq_row_bytes(kind, K);
    if (!row_bytes) return;
    const int wide = quill_isa_used(isa) == 512, nblk = K / QK, tile = wide ? TILE512 : TILE;
    kq_min_sums(kind, x, xs, B, K);
    if (wide && quill_gemv_tiles_exact(kind, blocks, x, xs, kq_digits(xs, B, K), out, N, K, B, ld, threads) == 0)
        return; /* VNNI CPUs: the tiles of kquant_i8.c for the kinds they take */
    if (!wide && quill_gemv_tiles_f32_avx2(kind, blocks, x, xs, out, N, K, B, ld, threads) == 0)
        return; /* AVX2: kquant_i8_avx2.c's 8-row tiles for the same kinds */
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int n = 0; n < N; n++) {
        const uint8_t *row = blocks + (long)n * row_bytes;
        for (int b0 = 0; b0 < B; b0 += tile) {
            const int nb = B - b0 < tile ? B - b0 : tile;
            if (kind == 6 || kind == 7)
                (wide ? f16_row_512 : f16_row_256)(kind, (const uint16_t *)row, x, K, out, ld, n, b0, nb);
            else if (kind >= 2 && kind <= 4) (wide ? g32_row_512 : g32_row_256)(kind, row, K / 32, x, K, out, ld, n, b0, nb);
            else if (wide) row_512(kind, row, nblk, x, xs, K, out, ld, n, b0, nb);
            else row_256(kind, row, nblk, x, xs, K, out, ld, n, b0, nb);
        }
    }
}

/* Rows [0, N) of `kind`'s blocks -> out (N, K) fp32: prefill tiles and embedding rows. */
void quill_dequant_kq(int kind, const uint8_t *blocks, float *out, int N, int K, int threads) {
    const long row_bytes = quill_kq_row_bytes(kind, K);
    if (!row_bytes) return;
    if (kind == 6 || kind == 7) {
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
        for (int n = 0; n < N; n++)
            for (long i = 0; i < K; i += 8)
                _mm256_storeu_ps(out + (long)n * K + i, half8(kind, (const uint16_t *)(blocks + (long)n * row_bytes) + i));
        return;
    }
    if (kind >= 2 && kind <= 4) { /* weight = scale * code, one product as gguf computes it */
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
        for (int n = 0; n < N; n++) {
            const uint8_t *row = blocks + (long)n * row_bytes;
            float scale[kind == 4 ? K / 32 : 1];
            g32_scales(kind, row, K / 32, scale);
            for (int g = 0; g < K / 32; g++) {
                __m256 w[4];
                codes8(1, g32_codes(kind, row, g), w);
                float *o = out + (long)n * K + 32L * g;
                for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(w[i], _mm256_set1_ps(g32_scale(kind, row, g, scale))));
            }
        }
        return;
    }
    const int bytes = SUPER_BYTES(kind);
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int n = 0; n < N; n++)
        for (int b = 0; b < K / QK; b++) {
            const uint8_t *blk = blocks + (long)n * row_bytes + (long)b * bytes;
            float sc[16], mn[16];
            block_scales(kind, blk, sc, mn);
            for (int g = 0; g < 8; g++) {
                __m256 w[4];
                const __m256i codes = group_codes(kind, blk, g);
                if (!PER16(kind)) weights8(kind, codes, sc[g], sc[g], mn[g], mn[g], w);
                else if (kind == 8) weights8(8, codes, sc[2 * g], sc[2 * g + 1], mn[2 * g], mn[2 * g + 1], w);
                else weights8(kind, codes, sc[2 * g], sc[2 * g + 1], 0.0f, 0.0f, w);
                float *o = out + (long)n * K + (long)b * QK + 32 * g;
                for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + 8 * i, w[i]);
            }
        }
}
