/* Quantized GEMV / small GEMM for decode, and tile dequantization for prefill (AVX2 + FMA).
 *
 * Layout (quill/kernels/packed.py): a weight (N rows, K cols) is G = K/32 groups per row.
 *   q4: codes 0..15 packed two per byte, byte j of a group holds element j (low nibble)
 *       and element j+16 (high nibble) -- the GGUF Q4_0/Q4_1 order, so loading is a copy.
 *   q8: one signed byte per element.
 *   value = scale[n,g] * code + min[n,g]   (fp32 scale and min per group)
 *   mins may be NULL: every min is zero (Q8_0), and none are stored. See ZERO_MINS below for why
 *   skipping the min terms gives the very bits the all-zero mins gave.
 *
 * Batch invariance: every (row, batch item) is reduced in the same order, whatever B is or where
 * the item sits in the batch. A group's 32 codes are scaled once per tile (w = code * scale, one
 * rounding each, shared by the tile's items); then each item adds w * x into its own two
 * accumulators, one FMA per vector, groups in order (AVX-512: a group's weights 0-15 into the first,
 * 16-31 into the second; AVX2: 0-7 and 16-23 into the first, 8-15 and 24-31 into the second). The
 * two are added, the min terms' vector (mins times group sums) added to that, then one horizontal
 * sum. Tiling over B only changes which items share a weight load, never the arithmetic of one item;
 * nor does cutting a row into chunks of columns for large batches (Span, GEMV_FN), whose accumulators
 * wait in memory between chunks.
 */
#include "isa.h"

#include "simd.h"
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

/* ZERO_MINS -- mins == NULL means every min is zero and none is stored (Q8_0). The row kernels then
 * write hsum(A) + 0.f, A being the item's two accumulators summed (the scaled codes times x), bit for
 * bit what they write for an all-zero (+0) mins array: hsum(A + M), M the min terms' vector, FMAs from
 * +0 of +0 mins times group sums. For finite group sums each product is +-0 and +0 + +-0 = +0, so
 * M = +0 and A + M is A with its -0 lanes made +0; the same tree of adds over that gives hsum(A)'s
 * bits but in one case, every lane -0: hsum(A) = -0 against +0, which the explicit + 0.f (kept without
 * -ffast-math) makes +0 too. The one difference: a non-finite group sum (an inf or NaN in x, or a
 * group sum overflowing fp32) made the old min term 0 * inf = NaN; the output is now what the codes
 * give, for an inf or NaN in x non-finite too (inf, -inf or NaN), never a finite number.
 * The dequantized tile keeps its FMA, with a +0 min: the same bits as before. */

static void group_sums(const float *x, float *xs, int B, int G) {
    for (int b = 0; b < B; b++)
        for (int g = 0; g < G; g++) {
            const float *p = x + ((long)b * G + g) * 32;
            __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
            xs[(long)b * G + g] = hsum8(s);
        }
}

static inline void unpack_q4(const uint8_t *src, __m256 w[4]) {
    __m128i raw = _mm_loadu_si128((const __m128i *)src);
    __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(15));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15));
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

static inline void unpack_q8(const int8_t *src, __m256 w[4]) {
    __m256i raw = _mm256_loadu_si256((const __m256i *)src);
    __m128i a = _mm256_castsi256_si128(raw), c = _mm256_extracti128_si256(raw, 1);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8)));
}

/* The group's codes scaled: w[i] = code * scale, one rounding each (shared by a tile's items). */
#define UNPACK_SCALED(UNPACK, src, s, w)                                                           \
    do {                                                                                          \
        UNPACK(src, w);                                                                           \
        for (int i_ = 0; i_ < 4; i_++) w[i_] = _mm256_mul_ps(w[i_], s);                           \
    } while (0)

/* The mins' dot product with the group sums: 8-wide FMAs from +0, the last G % 8 through zeroed lanes. */
static inline __m256 min_terms8(const float *mn, const float *xst, int G) {
    static const int32_t ones[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    __m256 m = _mm256_setzero_ps();
    int h = 0;
    for (; h + 8 <= G; h += 8) m = _mm256_fmadd_ps(_mm256_loadu_ps(mn + h), _mm256_loadu_ps(xst + h), m);
    if (h < G) {
        const __m256i k = _mm256_loadu_si256((const __m256i *)(ones + 8 - (G - h)));
        m = _mm256_fmadd_ps(_mm256_maskload_ps(mn + h, k), _mm256_maskload_ps(xst + h, k), m);
    }
    return m;
}

/* Group g's codes, scale and mins asked for STREAM_AHEAD bytes of codes ahead (simd.h). The rows of a
 * thread's range lie one after another in each of the three arrays, so one distance serves all three. */
#define PREFETCH_GROUP(row, sc, mn, g, BYTES_PER_GROUP)                                            \
    do {                                                                                          \
        prefetch_ahead(row + (long)(g) * (BYTES_PER_GROUP), STREAM_AHEAD);                        \
        prefetch_ahead(sc + (g), STREAM_AHEAD / (BYTES_PER_GROUP) * 4);                           \
        if (mn) prefetch_ahead(mn + (g), STREAM_AHEAD / (BYTES_PER_GROUP) * 4);                   \
    } while (0)

/* The groups [g0, g1) of a row one call covers (the whole row: 0 and G). st holds the call's items'
 * accumulators between the calls of a row's chunks (GEMV_FN): loaded when g0 > 0, stored when g1 < G; the
 * call that ends at G writes the outputs. An item's arithmetic is the same however its row is cut (a
 * chunk holds whole pairs of groups), so the outputs are bit-identical. */
typedef struct {
    int g0, g1;
    float *st;
} Span;

#define TILE 6

/* One row n for batch items [b0, b0+nb): always inlined with a constant nb (1..TILE) so the
 * accumulators stay in registers (two per item: 2 * TILE + the 4 scaled weights fill AVX2's 16; x is
 * each FMA's memory operand). 6 items per pass rather than 5: batch 16 in 3 passes of the codes' unpack
 * instead of 4, 0.89-0.94x the time at batch 12-16 and 0.81x at 6 (Q8_0, one thread on a Zen 1). */
#define ROW_KERNEL(NAME, CODE_T, BYTES_PER_GROUP, UNPACK)                                         \
    static inline __attribute__((always_inline)) void NAME##_n(                                   \
        const CODE_T *row, const float *sc, const float *mn, const float *x, const float *xs,     \
        float *out, int N, int n, int G, int b0, const Span sp, const int nb) {                   \
        __m256 acc[TILE], acc2[TILE];                                                             \
        _Pragma("GCC unroll 8") for (int t = 0; t < nb; t++) {                                    \
            acc[t] = sp.g0 ? _mm256_load_ps(sp.st + 16 * t) : _mm256_setzero_ps();                \
            acc2[t] = sp.g0 ? _mm256_load_ps(sp.st + 16 * t + 8) : _mm256_setzero_ps();           \
        }                                                                                         \
        const long K = (long)G * 32;                                                              \
        const float *xb = x + (long)b0 * K;                                                       \
        for (int g = sp.g0; g < sp.g1; g++) {                                                     \
            __m256 w[4];                                                                          \
            UNPACK_SCALED(UNPACK, row + (long)g * BYTES_PER_GROUP, _mm256_set1_ps(sc[g]), w);     \
            PREFETCH_GROUP(row, sc, mn, g, BYTES_PER_GROUP);                                      \
            _Pragma("GCC unroll 8") for (int t = 0; t < nb; t++) {                                \
                const float *xg = xb + t * K + (long)g * 32;                                      \
                acc[t] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xg), acc[t]);                      \
                acc2[t] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), acc2[t]);                \
                acc[t] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), acc[t]);                 \
                acc2[t] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), acc2[t]);               \
            }                                                                                     \
        }                                                                                         \
        if (sp.g1 < G) { /* a chunk of the row: its accumulators wait in sp.st */                 \
            _Pragma("GCC unroll 8") for (int t = 0; t < nb; t++) {                                \
                _mm256_store_ps(sp.st + 16 * t, acc[t]);                                          \
                _mm256_store_ps(sp.st + 16 * t + 8, acc2[t]);                                     \
            }                                                                                     \
            return;                                                                               \
        }                                                                                         \
        _Pragma("GCC unroll 8") for (int t = 0; t < nb; t++) {                                    \
            const __m256 sum = _mm256_add_ps(acc[t], acc2[t]);                                    \
            out[(long)(b0 + t) * N + n] = mn ? hsum8(_mm256_add_ps(sum, min_terms8(mn, xs + (long)(b0 + t) * G, G))) \
                                             : hsum8(sum) + 0.f; /* ZERO_MINS */                  \
        }                                                                                         \
    }                                                                                             \
    static void NAME(const CODE_T *row, const float *sc, const float *mn, const float *x,         \
                     const float *xs, float *out, int N, int n, int G, int b0, Span sp, int nb) { \
        switch (nb) {                                                                             \
        case 1: NAME##_n(row, sc, mn, x, xs, out, N, n, G, b0, sp, 1); break;                     \
        case 2: NAME##_n(row, sc, mn, x, xs, out, N, n, G, b0, sp, 2); break;                     \
        case 3: NAME##_n(row, sc, mn, x, xs, out, N, n, G, b0, sp, 3); break;                     \
        case 4: NAME##_n(row, sc, mn, x, xs, out, N, n, G, b0, sp, 4); break;                     \
        case 5: NAME##_n(row, sc, mn, x, xs, out, N, n, G, b0, sp, 5); break;                     \
        default: NAME##_n(row, sc, mn, x, xs, out, N, n, G, b0, sp, 6); break;                    \
        }                                                                                         \
    }

ROW_KERNEL(row_q4, uint8_t, 16, unpack_q4)
ROW_KERNEL(row_q8, int8_t, 32, unpack_q8)

/* The same kernels 16 lanes wide, for CPUs with AVX-512 (chosen per call by the caller's `isa`;
 * QUILL_NO_AVX512=1 makes Python's default AVX2). Per item the order is again fixed. */

/* A group's 32 codes scaled, w = code * scale (one rounding each): for q4 the 16 products code * scale
 * are made once and each nibble picks its own (vpermps reads an index's low 4 bits only). */
AVX512 static inline void unpack_q4_512(const uint8_t *src, __m512 s, __m512 w[2]) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)src);
    const __m512 lut = _mm512_mul_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), s);
    w[0] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(raw), lut);
    w[1] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_srli_epi16(raw, 4)), lut);
}

AVX512 static inline void unpack_q8_512(const int8_t *src, __m512 s, __m512 w[2]) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)src);
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw))), s);
    w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1))), s);
}

#define TILE512 8

/* One row n for items [b0, b0+nb): always inlined with a constant nb (1..TILE512) so the
 * accumulators stay in registers. Two accumulators per item (each group's weights 0-15 and 16-31),
 * two groups per step; the min terms are one vector dot product after the loop. */
#define ROW_KERNEL_512(NAME, CODE_T, BYTES_PER_GROUP, UNPACK)                                     \
    AVX512 static inline __attribute__((always_inline)) void NAME##_n(                            \
        const CODE_T *row, const float *sc, const float *mn, const float *x, const float *xs,     \
        float *out, int N, int n, int G, int b0, const Span sp, const int nb) {                   \
        __m512 acc[TILE512], acc2[TILE512];                                                       \
        _Pragma("GCC unroll 8") for (int t = 0; t < nb; t++) {                                    \
            acc[t] = sp.g0 ? _mm512_load_ps(sp.st + 32 * t) : _mm512_setzero_ps();                \
            acc2[t] = sp.g0 ? _mm512_load_ps(sp.st + 32 * t + 16) : _mm512_setzero_ps();          \
        }                                                                                         \
        const long K = (long)G * 32;                                                              \
        const float *xb = x + (long)b0 * K;                                                       \
        int g = sp.g0;                                                                            \
        for (; g + 2 <= sp.g1; g += 2) {                                                          \
            __m512 w[2], v[2];                                                                    \
            UNPACK(row + (long)g * BYTES_PER_GROUP, _mm512_set1_ps(sc[g]), w);                    \
            UNPACK(row + (long)(g + 1) * BYTES_PER_GROUP, _mm512_set1_ps(sc[g + 1]), v);          \
            PREFETCH_GROUP(row, sc, mn, g, BYTES_PER_GROUP);                                      \
            _Pragma("GCC unroll 8") for (int t = 0; t < nb; t++) {                                \
                const float *xg = xb + t * K + (long)g * 32;                                      \
                acc[t] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xg), acc[t]);                      \
                acc2[t] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xg + 16), acc2[t]);               \
                acc[t] = _mm512_fmadd_ps(v[0], _mm512_loadu_ps(xg + 32), acc[t]);                 \
                acc2[t] = _mm512_fmadd_ps(v[1], _mm512_loadu_ps(xg + 48), acc2[t]);               \
            }                                                                                     \
        }                                                                                         \
        if (g < sp.g1) { /* an odd G's last group (chunks hold whole pairs) */                    \
            __m512 w[2];                                                                          \
            UNPACK(row + (long)g * BYTES_PER_GROUP, _mm512_set1_ps(sc[g]), w);                    \
            _Pragma("GCC unroll 8") for (int t = 0; t < nb; t++) {                                \
                const float *xg = xb + t * K + (long)g * 32;                                      \
                acc[t] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xg), acc[t]);                      \
                acc2[t] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xg + 16), acc2[t]);               \
            }                                                                                     \
        }                                                                                         \
        if (sp.g1 < G) { /* a chunk of the row: its accumulators wait in sp.st */                 \
            _Pragma("GCC unroll 8") for (int t = 0; t < nb; t++) {                                \
                _mm512_store_ps(sp.st + 32 * t, acc[t]);                                          \
                _mm512_store_ps(sp.st + 32 * t + 16, acc2[t]);                                    \
            }                                                                                     \
            return;                                                                               \
        }                                                                                         \
        _Pragma("GCC unroll 8") for (int t = 0; t < nb; t++) {                                    \
            const __m512 sum = _mm512_add_ps(acc[t], acc2[t]);                                    \
            if (!mn) { /* ZERO_MINS */                                                            \
                out[(long)(b0 + t) * N + n] = _mm512_reduce_add_ps(sum) + 0.f;                    \
                continue;                                                                         \
            }                                                                                     \
            const float *xst = xs + (long)(b0 + t) * G;                                           \
            __m512 m = _mm512_setzero_ps();                                                       \
            int h = 0;                                                                            \
            for (; h + 16 <= G; h += 16) m = _mm512_fmadd_ps(_mm512_loadu_ps(mn + h), _mm512_loadu_ps(xst + h), m); \
            if (h < G) { /* the last G % 16 through zeroed lanes */                               \
                const __mmask16 k = (__mmask16)((1u << (G - h)) - 1);                             \
                m = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, mn + h), _mm512_maskz_loadu_ps(k, xst + h), m); \
            }                                                                                     \
            out[(long)(b0 + t) * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(sum, m));            \
        }                                                                                         \
    }                                                                                             \
    AVX512 static void NAME(const CODE_T *row, const float *sc, const float *mn, const float *x,  \
                            const float *xs, float *out, int N, int n, int G, int b0, Span sp, int nb) { \
        switch (nb) {                                                                             \
        case 1: NAME##_n(row, sc, mn, x, xs, out, N, n, G, b0, sp, 1); break;                     \
        case 2: NAME##_n(row, sc, mn, x, xs, out, N, n, G, b0, sp, 2); break;                     \
        case 3: NAME##_n(row, sc, mn, x, xs, out, N, n, G, b0, sp, 3); break;                     \
        case 4: NAME##_n(row, sc, mn, x, xs, out, N, n, G, b0, sp, 4); break;                     \
        case 5: NAME##_n(row, sc, mn, x, xs, out, N, n, G, b0, sp, 5); break;                     \
        case 6: NAME##_n(row, sc, mn, x, xs, out, N, n, G, b0, sp, 6); break;                     \
        case 7: NAME##_n(row, sc, mn, x, xs, out, N, n, G, b0, sp, 7); break;                     \
        default: NAME##_n(row, sc, mn, x, xs, out, N, n, G, b0, sp, 8); break;                    \
        }                                                                                         \
    }

ROW_KERNEL_512(row_q4_512, uint8_t, 16, unpack_q4_512)
ROW_KERNEL_512(row_q8_512, int8_t, 32, unpack_q8_512)

/* What the CPU can run (a fact, probed once): 1 = the 16-lane kernels (AVX-512 F and BW). Which
 * width a call uses is its caller's choice, passed in as `isa` -- never read from here. */
int quill_hw_avx512(void) {
    static int cached = -1;
    if (cached < 0) cached = CPU_HAS("avx512f") && CPU_HAS("avx512bw");
    return cached;
}

/* The width a call with `isa` (256 or 512) runs: 512 only where the CPU has it. */
int quill_isa_used(int isa) { return isa >= 512 && quill_hw_avx512() ? 512 : 256; }

/* Batches of CHUNK_MIN_B items or more whose x outgrows L1 go through the rows in chunks: CHUNK_GROUPS
 * groups (1024 columns) of CHUNK_ROWS rows in turn, each row's items' accumulators waiting in between
 * (Span), so those columns of x are read from L1 by every row of the block instead of from L2 by each row
 * whole. Kernel alone, Q8_0, 2 threads, from memory, interleaved on the Intel Xeon: 8192 x 2048, batches
 * 8-16 took 0.61-0.79x the time (AVX-512) and 0.64-0.84x (AVX2); 2048 x 8192, batch 16 0.62x. Smaller
 * batches are bound by the weights' bandwidth, and chunks (which read 16 rows at once) cost them: batch 6
 * 1.0-1.04x, batch 2 at 8192 columns 1.2x; so they keep whole rows. (4 rows or 512 columns: 0.61-0.85x.) */
#define X_IN_L1 (48 * 1024)
#define CHUNK_MIN_B 8
#define CHUNK_GROUPS 32
#define CHUNK_ROWS 16

/* out (B, ld) columns [0, N) = x (B, K) @ W.T ; xs is scratch of B*G floats (unused when mins is NULL: all
 * zero, no min terms); ld is out's row stride (N
 * for a whole output, more when W is one part of a fused projection whose parts differ in type).
 * isa: 512 = the AVX-512 rows where the CPU has them, else AVX2; threads: the OpenMP team for this call
 * (the caller's own count). */
#define GEMV_FN(NAME, CODE_T, BYTES_PER_GROUP, ROW, ROW512)                                          \
    void NAME##_ld(const CODE_T *codes, const float *scale, const float *mins, const float *x, float *xs, \
                   float *out, int N, int G, int B, int ld, int isa, int threads) {                  \
        if (mins) group_sums(x, xs, B, G); /* only the min terms read them */                      \
        const int wide = quill_isa_used(isa) == 512, tile = wide ? TILE512 : TILE;                \
        /* whole rows (a block of one row, one chunk of G groups) unless the batch gains from chunks */ \
        const int chunked = B >= CHUNK_MIN_B && (long)B * G * 32 * 4 > X_IN_L1;                    \
        const int block_rows = chunked ? CHUNK_ROWS : 1, chunk = chunked ? CHUNK_GROUPS : G;        \
        const int blocks = (N + block_rows - 1) / block_rows;                                       \
        _Pragma("omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)")          \
        for (int blk = 0; blk < blocks; blk++) {                                                  \
            float st[CHUNK_ROWS][TILE512 * 32] __attribute__((aligned(64)));                      \
            const int n0 = blk * block_rows, rows = N - n0 < block_rows ? N - n0 : block_rows;    \
            for (int b0 = 0; b0 < B; b0 += tile) {                                                \
                const int nb = B - b0 < tile ? B - b0 : tile;                                     \
                for (int g0 = 0; g0 < G; g0 += chunk)                                             \
                    for (int r = 0; r < rows; r++) {                                              \
                        const long n = n0 + r;                                                    \
                        const float *mn = mins ? mins + n * G : NULL; /* NULL: ZERO_MINS */       \
                        const Span sp = {g0, G - g0 < chunk ? G : g0 + chunk, st[r]};             \
                        (wide ? ROW512 : ROW)(codes + n * G * BYTES_PER_GROUP, scale + n * G, mn, x, xs, out, \
                                              ld, (int)n, G, b0, sp, nb);                         \
                    }                                                                             \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    void NAME(const CODE_T *codes, const float *scale, const float *mins, const float *x, float *xs,  \
              float *out, int N, int G, int B, int isa, int threads) {                               \
        NAME##_ld(codes, scale, mins, x, xs, out, N, G, B, N, isa, threads);                         \
    }

GEMV_FN(quill_gemv_q4, uint8_t, 16, row_q4, row_q4_512)
GEMV_FN(quill_gemv_q8, int8_t, 32, row_q8, row_q8_512)

/* Dequantize rows [0, N) into out (N, K) fp32: the reused tile buffer prefill GEMMs read. */
#define DEQUANT_FN(NAME, CODE_T, BYTES_PER_GROUP, UNPACK)                                            \
    void NAME(const CODE_T *codes, const float *scale, const float *mins, float *out, int N, int G,  \
              int threads) {                                                                         \
        _Pragma("omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)")          \
        for (int n = 0; n < N; n++)                                                                  \
            for (int g = 0; g < G; g++) {                                                            \
                __m256 w[4];                                                                         \
                UNPACK(codes + ((long)n * G + g) * BYTES_PER_GROUP, w);                              \
                __m256 s = _mm256_set1_ps(scale[(long)n * G + g]);                                   \
                __m256 m = mins ? _mm256_set1_ps(mins[(long)n * G + g]) : _mm256_setzero_ps(); /* ZERO_MINS */ \
                float *o = out + ((long)n * G + g) * 32;                                             \
                for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(w[i], s, m)); \
            }                                                                                        \
    }

DEQUANT_FN(quill_dequant_q4, uint8_t, 16, unpack_q4)
DEQUANT_FN(quill_dequant_q8, int8_t, 32, unpack_q8)

/* STREAM-like read bandwidth probe: sums n floats with all threads into vector accumulators. Each thread
 * reads its share as `streams` runs side by side, 128 bytes of each in turn, with (prefetch = 1) or
 * without a T0 request STREAM_AHEAD bytes ahead; quill bench latency takes the fastest form as the
 * roofline. Each form alone read less than some kernel reaches, flattering the roofline: on the Intel
 * Xeon (512 MiB, interleaved medians) one stream per thread with no prefetch read 22.8 GB/s and with it
 * 31.5 (an earlier form, one horizontal sum and a double add per 128 bytes: 27.0); on the AMD EPYC Zen 4
 * one stream read 31-35 GB/s either way and 4-8 streams 36-38, where quill's Q8_0 rows, several rows at
 * a time, read 38. The sum's value is not used. */
static inline void read_block(const float *p, __m256 *acc, __m256 *acc2) { /* the probe's 32 floats at p */
    *acc = _mm256_add_ps(*acc, _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)));
    *acc2 = _mm256_add_ps(*acc2, _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
}

double quill_read_sum(const float *a, long n, int streams, int prefetch) {
    double total = 0.0;
    if (streams < 1) streams = 1;
#pragma omp parallel reduction(+ : total)
    {
        __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const long blocks = n / 32, per = blocks / T, first = per * t, mine = t == T - 1 ? blocks - first : per;
        const long run = mine / streams; /* blocks of 32 floats per stream; the remainder read after */
        for (long i = 0; i < run; i++)
            for (int k = 0; k < streams; k++) {
                const float *p = a + (first + k * run + i) * 32;
                if (prefetch) _mm_prefetch((const char *)p + STREAM_AHEAD, _MM_HINT_T0);
                read_block(p, &acc, &acc2);
            }
        for (long i = first + run * streams; i < first + mine; i++) read_block(a + i * 32, &acc, &acc2);
        total += hsum8(_mm256_add_ps(acc, acc2));
    }
    return total;
}
