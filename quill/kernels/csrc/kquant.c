/* GEMV / small GEMM and dequantization straight from GGUF's own K-quant blocks, so a weight stays
 * as small in memory as in the file (Q4_K: 4.5 bits per weight, Q6_K: 6.5625).
 *
 * A row of K weights is K / 256 super-blocks. Each block is read as 8 groups of 32 weights; a
 * group's 32 codes become fp32 weights exactly as GGUF defines them (the same products, in the
 * same order, as gguf-py's and llama.cpp's reference dequantization):
 *   Q4_K (144 bytes: d, dmin fp16; 12 bytes of 6-bit scales and mins; 128 bytes of nibbles)
 *        w = (d * sc[g]) * q - (dmin * m[g]),   q in 0..15
 *   Q6_K (210 bytes: 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d fp16)
 *        w = (d * sc[16-element chunk]) * (q - 32),   q in 0..63
 * Activations stay fp32: nothing is rounded beyond the file's own quantization.
 *
 * Batch invariance: each (row, item) accumulates groups in order in two accumulators (the group's
 * first and second 16 weights), then one horizontal sum, whatever B is or where the item sits. Tiles
 * over B only share the decoded weights between items.
 *
 * Block layouts are facts from GGML's format (ggml-common.h block_q4_K / block_q6_K and the
 * reference dequantize_row_q4_K / _q6_K); the code is written here.
 */
#include <immintrin.h>

#include "simd.h"
#include <stdint.h>

#define QK 256
#define Q4K_BYTES 144
#define Q6K_BYTES 210

int quill_isa_used(int isa);

static inline float f16(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8))); }

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

/* One group's 32 codes as bytes (Q4_K: 0..15 unsigned; Q6_K: q - 32 signed) and the scale(s) and
 * min that turn them into weights: s0 for codes 0..15, s1 for 16..31 (equal for Q4_K), mn (0 for Q6_K). */
static inline __m256i group_codes(int kind, const uint8_t *blk, int g, float *s0, float *s1, float *mn) {
    if (kind == 0) {
        const float d = f16(blk), dmin = f16(blk + 2);
        int sc, m;
        q4k_scale_min(blk + 4, g, &sc, &m);
        *s0 = *s1 = d * (float)sc;
        *mn = dmin * (float)m;
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * (g >> 1)));
        const __m256i nib = (g & 1) ? _mm256_srli_epi16(raw, 4) : raw;
        return _mm256_and_si256(nib, _mm256_set1_epi8(15));
    }
    const int h = g >> 2, sub = g & 3; /* half of the block, and which of its four 32-runs */
    const float d = f16(blk + 208);
    const int8_t *sc = (const int8_t *)(blk + 192) + 8 * h + 2 * sub;
    *s0 = d * (float)sc[0];
    *s1 = d * (float)sc[1];
    *mn = 0.f;
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (sub & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    const __m256i lo = _mm256_and_si256((sub >> 1) ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(15));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * sub), _mm256_set1_epi8(3));
    const __m256i q = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)); /* bytes 0..63: the shifts never cross bytes */
    return _mm256_sub_epi8(q, _mm256_set1_epi8(32));
}

/* codes (32 bytes) -> four 8-wide weight vectors: w = s * q - mn, as a product then a difference. */
static inline void weights8(int kind, __m256i codes, float s0, float s1, float mn, __m256 w[4]) {
    const __m128i a = _mm256_castsi256_si128(codes), c = _mm256_extracti128_si256(codes, 1);
    __m256i v[4];
    if (kind == 0) {
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
    const __m256 m = _mm256_set1_ps(mn);
    for (int i = 0; i < 4; i++)
        w[i] = _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v[i]), _mm256_set1_ps(i < 2 ? s0 : s1)), m);
}

#define TILE 4

/* Row n for items [b0, b0 + nb), nb <= TILE: 8 lanes wide. */
static void row_256(int kind, const uint8_t *row, int nblk, const float *x, long K, float *out, int N, int n, int b0,
                    int nb) {
    const int bytes = kind == 0 ? Q4K_BYTES : Q6K_BYTES;
    __m256 acc[TILE], acc2[TILE];
    for (int t = 0; t < nb; t++) acc[t] = acc2[t] = _mm256_setzero_ps();
    for (int b = 0; b < nblk; b++) {
        const uint8_t *blk = row + (long)b * bytes;
        for (int g = 0; g < 8; g++) {
            float s0, s1, mn;
            __m256 w[4];
            const __m256i codes = group_codes(kind, blk, g, &s0, &s1, &mn); /* sets s0, s1, mn first */
            weights8(kind, codes, s0, s1, mn, w);
            for (int t = 0; t < nb; t++) {
                const float *xg = x + (long)(b0 + t) * K + (long)b * QK + 32 * g;
                acc[t] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xg), acc[t]));
                acc2[t] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), acc2[t]));
            }
        }
    }
    for (int t = 0; t < nb; t++) out[(long)(b0 + t) * N + n] = hsum8(_mm256_add_ps(acc[t], acc2[t]));
}

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define TILE512 8

/* codes (32 bytes) -> two 16-wide weight vectors. */
AVX512 static inline void weights16(int kind, __m256i codes, float s0, float s1, float mn, __m512 w[2]) {
    const __m128i a = _mm256_castsi256_si128(codes), c = _mm256_extracti128_si256(codes, 1);
    const __m512i v0 = kind == 0 ? _mm512_cvtepu8_epi32(a) : _mm512_cvtepi8_epi32(a);
    const __m512i v1 = kind == 0 ? _mm512_cvtepu8_epi32(c) : _mm512_cvtepi8_epi32(c);
    const __m512 m = _mm512_set1_ps(mn);
    w[0] = _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(v0), _mm512_set1_ps(s0)), m);
    w[1] = _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(v1), _mm512_set1_ps(s1)), m);
}

/* Row n for items [b0, b0 + nb): 16 lanes wide, inlined per constant nb so accumulators stay in registers. */
AVX512 static inline __attribute__((always_inline)) void row_512_n(int kind, const uint8_t *row, int nblk,
                                                                   const float *x, long K, float *out, int N, int n,
                                                                   int b0, const int nb) {
    const int bytes = kind == 0 ? Q4K_BYTES : Q6K_BYTES;
    __m512 acc[TILE512], acc2[TILE512];
    for (int t = 0; t < nb; t++) acc[t] = acc2[t] = _mm512_setzero_ps();
    for (int b = 0; b < nblk; b++) {
        const uint8_t *blk = row + (long)b * bytes;
        for (int g = 0; g < 8; g++) {
            float s0, s1, mn;
            __m512 w[2];
            const __m256i codes = group_codes(kind, blk, g, &s0, &s1, &mn); /* sets s0, s1, mn first */
            weights16(kind, codes, s0, s1, mn, w);
            for (int t = 0; t < nb; t++) {
                const float *xg = x + (long)(b0 + t) * K + (long)b * QK + 32 * g;
                acc[t] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xg), acc[t]);
                acc2[t] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xg + 16), acc2[t]);
            }
        }
    }
    for (int t = 0; t < nb; t++) out[(long)(b0 + t) * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t], acc2[t]));
}

AVX512 static void row_512(int kind, const uint8_t *row, int nblk, const float *x, long K, float *out, int N, int n,
                           int b0, int nb) {
    switch (nb) {
    case 1: row_512_n(kind, row, nblk, x, K, out, N, n, b0, 1); break;
    case 2: row_512_n(kind, row, nblk, x, K, out, N, n, b0, 2); break;
    case 3: row_512_n(kind, row, nblk, x, K, out, N, n, b0, 3); break;
    case 4: row_512_n(kind, row, nblk, x, K, out, N, n, b0, 4); break;
    case 5: row_512_n(kind, row, nblk, x, K, out, N, n, b0, 5); break;
    case 6: row_512_n(kind, row, nblk, x, K, out, N, n, b0, 6); break;
    case 7: row_512_n(kind, row, nblk, x, K, out, N, n, b0, 7); break;
    default: row_512_n(kind, row, nblk, x, K, out, N, n, b0, 8); break;
    }
}

/* Bytes per row of a kind's blocks, or 0 for an unknown kind / a K not a multiple of 256. */
long quill_kq_row_bytes(int kind, int K) {
    if (K % QK || (kind != 0 && kind != 1)) return 0;
    return (long)(K / QK) * (kind == 0 ? Q4K_BYTES : Q6K_BYTES);
}

/* out (B, ld) columns [0, N) = x (B, K) @ W.T for W (N, K) in `kind`'s blocks (0 = Q4_K, 1 = Q6_K);
 * ld is out's row stride (N for a whole output, more when W is one part of a fused projection).
 * isa: 512 = the AVX-512 rows where the CPU has them, else AVX2; threads: this call's OpenMP team. */
void quill_gemv_kq(int kind, const uint8_t *blocks, const float *x, float *out, int N, int K, int B, int ld, int isa,
                   int threads) {
    const long row_bytes = quill_kq_row_bytes(kind, K);
    if (!row_bytes) return;
    const int wide = quill_isa_used(isa) == 512, nblk = K / QK, tile = wide ? TILE512 : TILE;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int n = 0; n < N; n++) {
        const uint8_t *row = blocks + (long)n * row_bytes;
        for (int b0 = 0; b0 < B; b0 += tile) {
            const int nb = B - b0 < tile ? B - b0 : tile;
            if (wide) row_512(kind, row, nblk, x, K, out, ld, n, b0, nb);
            else row_256(kind, row, nblk, x, K, out, ld, n, b0, nb);
        }
    }
}

/* Rows [0, N) of `kind`'s blocks -> out (N, K) fp32: prefill tiles and embedding rows. */
void quill_dequant_kq(int kind, const uint8_t *blocks, float *out, int N, int K, int threads) {
    const long row_bytes = quill_kq_row_bytes(kind, K);
    if (!row_bytes) return;
    const int bytes = kind == 0 ? Q4K_BYTES : Q6K_BYTES;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int n = 0; n < N; n++)
        for (int b = 0; b < K / QK; b++) {
            const uint8_t *blk = blocks + (long)n * row_bytes + (long)b * bytes;
            for (int g = 0; g < 8; g++) {
                float s0, s1, mn;
                __m256 w[4];
                const __m256i codes = group_codes(kind, blk, g, &s0, &s1, &mn); /* sets s0, s1, mn first */
            weights8(kind, codes, s0, s1, mn, w);
                float *o = out + (long)n * K + (long)b * QK + 32 * g;
                for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + 8 * i, w[i]);
            }
        }
}
