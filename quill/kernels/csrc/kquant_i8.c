/* Opt-in int8 activations (KernelOptions.int8): the GEMV / GEMM reads the same weights as kquant.c
 * and quant_gemv.c, but each 32 activations are first rounded to int8 with their own fp32 scale,
 * so a 64-weight stretch is one integer dot-product instruction (AVX-512 VNNI vpdpbusd) instead of
 * sixteen fp32 FMAs (AVX2 rows without VNNI: vpmaddubsw and vpmaddwd, further below). This is the one
 * place where quill rounds anything beyond the file's own quantization; the exact fp32 kernels stay
 * the default.
 *
 * Activations (quill_act8_quantize): for each item and each group g of 32 inputs,
 *   dx[g] = max|x| / 127,  q = round-to-nearest-even(x * (1 / dx[g])) in -127..127,
 * and alongside them the integer sums the weight formats' offsets need: s16 (each 16 codes' sum, as
 * a float) and xs[g] = dx[g] * (sum of the group's 32 codes), and the codes again in "quad" order
 * (qp, below). One item's buffer is
 *   q: K int8 | dx: K/32 fp32 | xs: K/32 fp32 | s16: K/16 fp32 | qp: K int8   (act_bytes(K) = 2.5 K).
 * Quad order, per 128 inputs (four groups g0..g3): the first 16 codes of g0, g1, g2, g3, then their
 * last 16. A 64-byte load of it holds 16 codes of each of four groups, one group per 128-bit lane, so
 * the VNNI rows accumulate two such loads in one int32 register and scale it once per group (Q6_K
 * applies its per-16 int scales to the dots first); the weights are shuffled the same way, once per
 * block for a whole tile of items. The q4 / q8 layouts take this path for whole 256-weight stretches
 * where K % 128 == 0, and element order (q) otherwise.
 *
 * A row's result is then exactly sum over groups of (weight scale * dx) * (integer codes . q), minus
 * the formats' offsets, in fp32:
 *   Q4_K, Q5_K  w = d sc q - dmin m      -> sum_g d sc_g dx_g (q.x)_g - sum_g dmin m_g xs_g
 *   Q6_K        w = d sc (q - 32)        -> sum_c d sc_c dx_(c/2) (q.x)_c - 32 sum_c d sc_c dx_(c/2) s16_c
 *   IQ4_XS      w = d (ls - 32) k[q]     -> codes k[q] + 128 unsigned, minus 128 sum_g scale_g xs_g
 *   q4 layout   w = scale q + min        -> sum_g scale_g dx_g (q.x)_g + sum_g min_g xs_g
 *   q8 layout   (Q8_0, Q5_1) the same; its codes are signed, so x + 128 is the unsigned operand and
 *               the row's own 128 * sum(w) seeds the integer accumulator.
 * (c: 16-weight chunk, g: 32-weight group; integer dots are exact in int32.)
 *
 * Batch invariance: each (row, item) pair runs the same instructions in the same order wherever the
 * item sits in the batch; tiles of items only share the decoded weights. Block layouts: facts from
 * GGML's format (ggml-common.h); the code is written here.
 */
#include <immintrin.h>

#include "kformat.h"
#include "simd.h"
#include <stdint.h>
#include <string.h>

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define ALWAYS __attribute__((always_inline))
#define T8 8       /* items sharing one decode of a row's weights */
#define ROWS 16    /* rows per task: their weights and a tile of activations stay in L1/L2 together */

static inline long act_bytes(long K) { return K + K / 8 + K / 8 + K / 4 + K; }

typedef struct {
    const int8_t *q;
    const float *dx, *xs, *s16;
    const int8_t *qp;
} Act;

static inline Act act_at(const uint8_t *buf, long K, int b) {
    const uint8_t *p = buf + (long)b * act_bytes(K);
    return (Act){(const int8_t *)p, (const float *)(p + K), (const float *)(p + K + K / 8), (const float *)(p + K + K / 4),
                 (const int8_t *)(p + K + K / 2)};
}

long quill_act8_bytes(int B, int K) { return (long)B * act_bytes(K); }

/* What the CPU can run: 1 = AVX-512 with VNNI (probed once; a fact, not a choice). */
int quill_hw_vnni(void) {
    static int cached = -1;
    if (cached < 0)
        cached = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    return cached;
}

/* x (B, K) fp32 -> B activation buffers (layout above). AVX2: every CPU the kernels run on. */
void quill_act8_quantize(const float *x, uint8_t *buf, int B, int K, int threads) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
#pragma omp parallel for schedule(static) if (B >= 4) num_threads(threads > 0 ? threads : 1)
    for (int b = 0; b < B; b++) {
        uint8_t *p = buf + (long)b * act_bytes(K);
        int8_t *q = (int8_t *)p;
        float *dx = (float *)(p + K), *xs = (float *)(p + K + K / 8), *s16 = (float *)(p + K + K / 4);
        int8_t *qp = (int8_t *)(p + K + K / 2);
        for (int g = 0; g < K / 32; g++) {
            const float *xg = x + (long)b * K + 32L * g;
            __m256 v[4];
            for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xg + 8 * i);
            __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float d = _mm_cvtss_f32(h) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            __m256i i[4];
            for (int k = 0; k < 4; k++) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(id)));
            /* packs interleave 128-bit lanes; the permute puts the 32 bytes back in element order */
            const __m256i bytes = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])), order);
            _mm256_storeu_si256((__m256i *)(q + 32L * g), bytes);
            if (K % 128 == 0) { /* quad order: g's first 16 codes, then (64 bytes on) its last 16 */
                int8_t *at = qp + 128L * (g / 4) + 16 * (g % 4);
                _mm_storeu_si128((__m128i *)at, _mm256_castsi256_si128(bytes));
                _mm_storeu_si128((__m128i *)(at + 64), _mm256_extracti128_si256(bytes, 1));
            }
            const float lo = hsum8(_mm256_cvtepi32_ps(_mm256_add_epi32(i[0], i[1])));
            const float hi = hsum8(_mm256_cvtepi32_ps(_mm256_add_epi32(i[2], i[3])));
            s16[2 * g] = lo;
            s16[2 * g + 1] = hi;
            dx[g] = d;
            xs[g] = d * (lo + hi);
        }
    }
}


/* Lanes 0-7 take element 2j of an 8-float vector, lanes 8-15 element 2j + 1: one group pair's scales. */
VNNI static inline __m512i pair_index(int j) {
    return _mm512_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                             2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1);
}

/* Q4_K / Q5_K's eight 6-bit scales and mins of a block, times d and dmin. */
static inline void kmins_scales(const uint8_t *blk, __m256 *sc, __m256 *mn) {
    const __m128i bytes = k4_scales_mins(blk);
    *sc = _mm256_mul_ps(_mm256_set1_ps(f16(blk)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)));
    *mn = _mm256_mul_ps(_mm256_set1_ps(f16(blk + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))));
}

/* Two 32-byte halves (element order) as one 64-byte vector. */
VNNI static inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

/* 32 bytes of 4-bit pairs in the [16 low nibbles, 16 high nibbles] per-group order (Q4_0, IQ4) ->
 * 64 codes of two 32-groups in element order. */
VNNI static inline __m512i nibble_pairs(__m256i raw) {
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m512i t = join(_mm256_and_si256(raw, m4), _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4));
    return _mm512_shuffle_i64x2(t, t, _MM_SHUFFLE(3, 1, 2, 0));
}

/* ---- 256-weight super-block kinds: 0 Q4_K, 1 Q6_K, 4 IQ4_XS, 5 Q5_K ---- */

/* Bytes per super-block of the block kinds with an int8 kernel. */
static inline int super_bytes(int kind) {
    return kind == 0 ? Q4K_BYTES : kind == 5 ? Q5K_BYTES : kind == 1 ? Q6K_BYTES : IQ4XS_BYTES;
}

/* One super-block decoded for every item of the tile: w[4] the 256 unsigned codes in element order,
 * per-group scales (8 floats) or per-16 scales (Q6_K: 16 floats), and the offset's weight factors. */
typedef struct {
    __m512i w[4];
    __m256 sc;      /* Q4_K/Q5_K: d sc; IQ4_XS: d (ls - 32) */
    __m512 sc16;    /* Q6_K: d sc per 16 weights */
    __m512i isc[4]; /* Q6_K: w[j]'s per-16 int8 scales, one per 128-bit lane (quad order) */
    __m512 noff;    /* the offset's factor, signed and scaled: Q4_K/Q5_K -dmin m (lanes 0-7; 8-15 zero),
                       IQ4_XS -128 scale (the same lanes), Q6_K -32 d sc (all 16) */
} Block;

VNNI static inline ALWAYS void decode_block(const int kind, const uint8_t *blk, Block *k) {
    const __m256i m4 = _mm256_set1_epi8(15);
    if (kind == 0 || kind == 5) {
        __m256 mn;
        kmins_scales(blk, &k->sc, &mn);
        k->noff = _mm512_zextps256_ps512(_mm256_sub_ps(_mm256_setzero_ps(), mn));
        const uint8_t *qs = blk + (kind == 5 ? 48 : 16);
        const __m256i qh = kind == 5 ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            if (kind == 5) { /* bit g of qh's byte l is element l of group g's fifth bit */
                const __m256i one = _mm256_set1_epi8(1);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j)), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j + 1)), one), 4));
            }
            k->w[j] = join(lo, hi);
        }
    } else if (kind == 1) {
        k->sc16 = _mm512_mul_ps(_mm512_set1_ps(f16(blk + 208)),
                                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)))));
        const __m512i n4 = _mm512_set1_epi8(15), m2 = _mm512_set1_epi8(3);
        for (int h = 0; h < 2; h++) { /* as kquant.c's row_q6k_512_n: runs 0, 1 then runs 2, 3 of each half */
            const __m512i ql = _mm512_loadu_si512((const void *)(blk + 64 * h));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            const __m512i qh2 = join(qh, _mm256_srli_epi16(qh, 2));
            k->w[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, n4), _mm512_slli_epi16(_mm512_and_si512(qh2, m2), 4));
            k->w[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), n4),
                                              _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh2, 4), m2), 4));
        }
        k->noff = _mm512_mul_ps(k->sc16, _mm512_set1_ps(-32.0f));
        k->sc = _mm256_set1_ps(f16(blk + 208));
        /* in quad order w[j]'s lane m holds 16-chunk 2m + j (j < 2) or 8 + 2m + j - 2 of the block */
        const __m512i ints = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)));
        for (int j = 0; j < 4; j++) {
            const int c = j < 2 ? j : 6 + j;
            k->isc[j] = _mm512_permutexvar_epi32(_mm512_setr_epi32(c, c, c, c, c + 2, c + 2, c + 2, c + 2, c + 4, c + 4,
                                                                   c + 4, c + 4, c + 6, c + 6, c + 6, c + 6), ints);
        }
    } else { /* IQ4_XS: d fp16, 2 bytes of high scale bits, 4 bytes of low scale nibbles, 128 bytes of indices */
        const float d = f16(blk);
        const int high = blk[2] | (blk[3] << 8);
        float s[8];
        for (int ib = 0; ib < 8; ib++)
            s[ib] = d * (float)((((blk[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (((high >> (2 * ib)) & 3) << 4)) - 32);
        k->sc = _mm256_loadu_ps(s);
        k->noff = _mm512_zextps256_ps512(_mm256_mul_ps(k->sc, _mm256_set1_ps(-128.0f)));
        __m128i t = _mm_loadu_si128((const __m128i *)IQ4_TABLE);
        const __m512i table = _mm512_broadcast_i32x4(_mm_add_epi8(t, _mm_set1_epi8((char)128)));
        for (int j = 0; j < 4; j++)
            k->w[j] = _mm512_shuffle_epi8(table, nibble_pairs(_mm256_loadu_si256((const __m256i *)(blk + 8 + 32 * j))));
    }
    for /* element order (two groups per vector) -> quad order, as the activations' qp */ (int j = 0; j < 4; j += 2) {
            const __m512i a = k->w[j], c = k->w[j + 1];
            k->w[j] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(2, 0, 2, 0));
            k->w[j + 1] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(3, 1, 3, 1));
        }
}

/* One item's contribution of one super-block (index b of the row) to its accumulator: the codes' dots
 * scaled per group (Q6_K: per 16), then the format's offset, both into the same 16 lanes. */
VNNI static inline ALWAYS void block_item(const int kind, const Block *k, Act a, int b, __m512 *acc) {
    if (kind == 1) { /* per-16 int scales applied to the int32 dots, then d dx per group as for the others */
        const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        const __m256 dx8 = _mm256_loadu_ps(a.dx + 8L * b);
        const __m512 dx = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(dx8));
        const int8_t *xq = a.qp + 256L * b;
        __m512i d[4];
        for (int j = 0; j < 4; j++)
            d[j] = _mm512_mullo_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), k->w[j], _mm512_loadu_si512((const void *)(xq + 64 * j))), k->isc[j]);
        const __m512 p = _mm512_castps256_ps512(_mm256_mul_ps(k->sc, dx8));
        const __m512i quad0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        const __m512i quad1 = _mm512_add_epi32(quad0, _mm512_set1_epi32(4));
        *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d[0], d[1])), _mm512_permutexvar_ps(quad0, p), *acc);
        *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d[2], d[3])), _mm512_permutexvar_ps(quad1, p), *acc);
        *acc = _mm512_fmadd_ps(_mm512_mul_ps(k->noff, dx), _mm512_loadu_ps(a.s16 + 16L * b), *acc);
        return;
    }
    /* k->w in quad order (decode_block): w[0], w[1] hold groups 0-3 one per 128-bit lane, w[2], w[3]
     * groups 4-7; two integer accumulators, each scaled once */
    const int8_t *xq = a.qp + 256L * b;
    const __m512 p = _mm512_castps256_ps512(_mm256_mul_ps(k->sc, _mm256_loadu_ps(a.dx + 8L * b)));
    const __m512i lo = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), k->w[0], _mm512_loadu_si512((const void *)xq)),
                                           k->w[1], _mm512_loadu_si512((const void *)(xq + 64)));
    const __m512i hi = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), k->w[2], _mm512_loadu_si512((const void *)(xq + 128))),
                                           k->w[3], _mm512_loadu_si512((const void *)(xq + 192)));
    const __m512i quad0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i quad1 = _mm512_add_epi32(quad0, _mm512_set1_epi32(4));
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_permutexvar_ps(quad0, p), *acc);
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_permutexvar_ps(quad1, p), *acc);
    *acc = _mm512_fmadd_ps(k->noff, _mm512_maskz_loadu_ps(0xff, a.xs + 8L * b), *acc);
}

VNNI static inline ALWAYS void kq_row_n(const int kind, const uint8_t *row, int nblk, const uint8_t *act, long K,
                                        float *out, int ld, int n, int b0, const int nb) {
    const int bytes = super_bytes(kind);
    __m512 acc[T8];
    for (int t = 0; t < nb; t++) acc[t] = _mm512_setzero_ps();
    for (int b = 0; b < nblk; b++) {
        Block k;
        decode_block(kind, row + (long)b * bytes, &k);
        for (int t = 0; t < nb; t++) block_item(kind, &k, act_at(act, K, b0 + t), b, &acc[t]);
    }
    for (int t = 0; t < nb; t++) out[(long)(b0 + t) * ld + n] = _mm512_reduce_add_ps(acc[t]);
}

VNNI static void kq_row(int kind, const uint8_t *row, int nblk, const uint8_t *act, long K, float *out, int ld, int n,
                        int b0, int nb) {
    if (kind == 0) { NB_SWITCH(kq_row_n, 0, row, nblk, act, K, out, ld, n, b0) }
    else if (kind == 1) { NB_SWITCH(kq_row_n, 1, row, nblk, act, K, out, ld, n, b0) }
    else if (kind == 4) { NB_SWITCH(kq_row_n, 4, row, nblk, act, K, out, ld, n, b0) }
    else { NB_SWITCH(kq_row_n, 5, row, nblk, act, K, out, ld, n, b0) }
}

/* ---- quant_gemv.c's layouts: 32-weight groups with an fp32 scale and min per (row, group) ---- */

/* Eight whole groups (256 weights) of a q4 / q8 row in quad order (see block_item): the codes shuffled
 * once for the tile; q8's seeds (-128 * the lane's weight sums) shuffled with them. */
VNNI static inline ALWAYS void quad_stretch(const int q8, const uint8_t *src, __m256 sc, __m512 mn, int has_mins,
                                            const uint8_t *act, long K, int g0, int b0, const int nb, __m512 *acc) {
    __m512i w[4];
    for (int j = 0; j < 4; j++)
        w[j] = q8 ? _mm512_loadu_si512((const void *)(src + 64 * j)) : nibble_pairs(_mm256_loadu_si256((const __m256i *)(src + 32 * j)));
    for (int j = 0; j < 4; j += 2) {
        const __m512i a = w[j], c = w[j + 1];
        w[j] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(2, 0, 2, 0));
        w[j + 1] = _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(3, 1, 3, 1));
    }
    __m512i seed[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    if (q8)
        for (int h = 0; h < 2; h++) {
            const __m512i ones = _mm512_set1_epi8(1);
            const __m512i sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, w[2 * h]), ones, w[2 * h + 1]);
            seed[h] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7));
        }
    const __m512i quad0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i quad1 = _mm512_add_epi32(quad0, _mm512_set1_epi32(4)), flip = _mm512_set1_epi8((char)0x80);
    for (int t = 0; t < nb; t++) {
        const Act a = act_at(act, K, b0 + t);
        const int8_t *xq = a.qp + 32L * g0;
        __m512i d[2];
        for (int h = 0; h < 2; h++) {
            const __m512i x0 = _mm512_loadu_si512((const void *)(xq + 128 * h)), x1 = _mm512_loadu_si512((const void *)(xq + 128 * h + 64));
            d[h] = q8 ? _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(seed[h], _mm512_xor_si512(x0, flip), w[2 * h]), _mm512_xor_si512(x1, flip), w[2 * h + 1])
                      : _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(seed[h], w[2 * h], x0), w[2 * h + 1], x1);
        }
        const __m512 p = _mm512_castps256_ps512(_mm256_mul_ps(sc, _mm256_loadu_ps(a.dx + g0)));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[0]), _mm512_permutexvar_ps(quad0, p), acc[t]);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[1]), _mm512_permutexvar_ps(quad1, p), acc[t]);
        if (has_mins) acc[t] = _mm512_fmadd_ps(mn, _mm512_maskz_loadu_ps(0xff, a.xs + g0), acc[t]);
    }
}

/* Row n of a q4 (16 bytes per group) or q8 (32 signed bytes per group) layout, eight groups at a time
 * (the last stretch masked where G is not a multiple of 8). */
VNNI static inline ALWAYS void pk_row_n(const int q8, const uint8_t *codes, const float *scale, const float *mins,
                                        int G, const uint8_t *act, long K, float *out, int ld, int n, int b0,
                                        const int nb) {
    const int per = q8 ? 32 : 16;
    const uint8_t *row = codes + (long)n * G * per;
    const float *sr = scale + (long)n * G, *mr = mins ? mins + (long)n * G : NULL;
    __m512 acc[T8];
    for (int t = 0; t < nb; t++) acc[t] = _mm512_setzero_ps();
    for (int g0 = 0; g0 < G; g0 += 8) {
        const int ng = G - g0 < 8 ? G - g0 : 8, pairs = (ng + 1) / 2;
        const __mmask8 gm = (__mmask8)((1u << ng) - 1);
        const __m256 sc = _mm256_maskz_loadu_ps(gm, sr + g0);
        const __m512 mn = mr ? _mm512_maskz_loadu_ps(gm, mr + g0) : _mm512_setzero_ps(); /* lanes 8-15 zero */
        __m512i w[4], seed[4];
        if (ng == 8 && K % 128 == 0) { /* a whole 256-weight stretch: quad order, as the block kinds */
            quad_stretch(q8, row + (long)g0 * per, sc, mn, mr != NULL, act, K, g0, b0, nb, acc);
            continue;
        }
        for (int j = 0; j < pairs; j++) {
            const int two = g0 + 2 * j + 1 < G; /* both groups of the pair exist */
            const uint8_t *src = row + (long)(g0 + 2 * j) * per;
            if (q8) {
                const __m512i raw = _mm512_maskz_loadu_epi8(two ? ~0ULL : 0xffffffffULL, src);
                w[j] = raw; /* signed: the activations take the unsigned side, x + 128 */
                /* -128 * (each lane's four weights' sum): the dot of x + 128 then starts from it */
                const __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), raw);
                seed[j] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7));
            } else {
                const __m256i raw = _mm256_maskz_loadu_epi8(two ? 0xffffffffu : 0xffffu, src);
                w[j] = nibble_pairs(raw);
                seed[j] = _mm512_setzero_si512();
            }
        }
        for (int t = 0; t < nb; t++) {
            const Act a = act_at(act, K, b0 + t);
            const __m512 p = _mm512_castps256_ps512(_mm256_mul_ps(sc, _mm256_maskz_loadu_ps(gm, a.dx + g0)));
            for (int j = 0; j < pairs; j++) {
                const __mmask64 xm = g0 + 2 * j + 1 < G ? ~0ULL : 0xffffffffULL;
                const __m512i x = _mm512_maskz_loadu_epi8(xm, a.q + 32L * (g0 + 2 * j));
                const __m512i d = q8 ? _mm512_dpbusd_epi32(seed[j], _mm512_xor_si512(x, _mm512_set1_epi8((char)0x80)), w[j])
                                     : _mm512_dpbusd_epi32(seed[j], w[j], x); /* q8: (x + 128) . w - 128 sum(w) */
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(pair_index(j), p), acc[t]);
            }
            if (mr) acc[t] = _mm512_fmadd_ps(mn, _mm512_maskz_loadu_ps(gm, a.xs + g0), acc[t]);
        }
    }
    for (int t = 0; t < nb; t++) out[(long)(b0 + t) * ld + n] = _mm512_reduce_add_ps(acc[t]);
}

VNNI static void pk_row(int q8, const uint8_t *codes, const float *scale, const float *mins, int G, const uint8_t *act,
                        long K, float *out, int ld, int n, int b0, int nb) {
    if (q8) { NB_SWITCH(pk_row_n, 1, codes, scale, mins, G, act, K, out, ld, n, b0) }
    else { NB_SWITCH(pk_row_n, 0, codes, scale, mins, G, act, K, out, ld, n, b0) }
}

/* ---- AVX2 without VNNI (and AVX-512 hosts asked for isa 256): 32 weights at a time. A group's integer
 * dot is vpmaddubsw (unsigned codes x signed activations, pairs to int16: |sum| <= 2 * 63 * 127 for Q6_K,
 * no saturation) then vpmaddwd by ones (or Q6_K's per-16 scales) to eight int32 lanes; four groups'
 * lanes are then added horizontally so each is scaled once. Signed codes (IQ4_XS's table values, the
 * q8 layout) use |w| and x with w's sign, so no offset is needed there. Each (row, item) runs the same
 * instructions in the same order wherever the item sits in the batch. */

#define T4 4

static inline __m256i dot32_u(__m256i w, __m256i x) { return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)); }
static inline __m256i dot32_s(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
}

/* One group of a super-block kind: its codes; Q6_K: also its two per-16 scales (int16 lanes, sc16). */
typedef struct {
    __m256i w, sc16;
} Group;

static inline __attribute__((always_inline)) void group_of(const int kind, const uint8_t *blk, int g, Group *o) {
    const __m256i m4 = _mm256_set1_epi8(15);
    if (kind == 0 || kind == 5) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + (kind == 5 ? 48 : 16) + 32 * (g >> 1)));
        __m256i q = _mm256_and_si256((g & 1) ? _mm256_srli_epi16(raw, 4) : raw, m4);
        if (kind == 5) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
            q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(g)), _mm256_set1_epi8(1)), 4));
        }
        o->w = q;
    } else if (kind == 1) {
        const int h = g >> 2, r = g & 3;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (r & 1)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        const __m256i lo = _mm256_and_si256((r >> 1) ? _mm256_srli_epi16(ql, 4) : ql, m4);
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * r)), _mm256_set1_epi8(3));
        o->w = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
        const int8_t *s8 = (const int8_t *)(blk + 192);
        o->sc16 = _mm256_set_m128i(_mm_set1_epi16(s8[2 * g + 1]), _mm_set1_epi16(s8[2 * g]));
    } else {
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_TABLE));
        o->w = _mm256_shuffle_epi8(table, nibbles32(blk + 8 + 16 * g));
    }
}

/* A super-block's per-group scales (Q6_K: d alone) and offset factors as fp32. */
static inline void block_floats(int kind, const uint8_t *blk, float *sc, float *mn) {
    if (kind == 0 || kind == 5) {
        __m256 s, m;
        kmins_scales(blk, &s, &m);
        _mm256_storeu_ps(sc, s);
        _mm256_storeu_ps(mn, m);
    } else if (kind == 1) {
        sc[0] = f16(blk + 208);
    } else {
        const float d = f16(blk);
        const int high = blk[2] | (blk[3] << 8);
        for (int ib = 0; ib < 8; ib++)
            sc[ib] = d * (float)((((blk[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (((high >> (2 * ib)) & 3) << 4)) - 32);
    }
}

/* Four groups' int32 dots (eight lanes each) -> lanes i and i + 4 hold group i's two halves: the
 * horizontal adds keep each lane to one group, so one convert and one FMA scale all four. */
static inline __m256i quad_sums(__m256i d0, __m256i d1, __m256i d2, __m256i d3) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(d0, d1), _mm256_hadd_epi32(d2, d3));
}

static inline __attribute__((always_inline)) void kq_row_avx2_n(const int kind, const uint8_t *row, int nblk,
                                                                 const uint8_t *act, long K, float *out, int ld, int n,
                                                                 int b0, int nb) {
    const int bytes = super_bytes(kind);
    const __m256i lo4 = _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3), hi4 = _mm256_setr_epi32(4, 5, 6, 7, 4, 5, 6, 7);
    __m256 acc[T4];
    for (int t = 0; t < nb; t++) acc[t] = _mm256_setzero_ps();
    for (int b = 0; b < nblk; b++) {
        const uint8_t *blk = row + (long)b * bytes;
        float sc[8], mn[8];
        block_floats(kind, blk, sc, mn);
        const __m256 SC = kind == 1 ? _mm256_set1_ps(sc[0]) : _mm256_loadu_ps(sc);
        for (int qd = 0; qd < 2; qd++) {
            Group k[4];
            for (int i = 0; i < 4; i++) group_of(kind, blk, 4 * qd + i, &k[i]);
            for (int t = 0; t < nb; t++) {
                const Act a = act_at(act, K, b0 + t);
                __m256i d[4];
                for (int i = 0; i < 4; i++) {
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(a.q + 256L * b + 32 * (4 * qd + i)));
                    d[i] = kind == 1 ? _mm256_madd_epi16(_mm256_maddubs_epi16(k[i].w, x), k[i].sc16)
                           : kind == 4 ? dot32_s(k[i].w, x) : dot32_u(k[i].w, x);
                }
                const __m256 p = _mm256_mul_ps(SC, _mm256_loadu_ps(a.dx + 8L * b));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(quad_sums(d[0], d[1], d[2], d[3])),
                                         _mm256_permutevar8x32_ps(p, qd ? hi4 : lo4), acc[t]);
            }
        }
        for (int t = 0; t < nb; t++) { /* the format's offset, one vector op per block */
            const Act a = act_at(act, K, b0 + t);
            if (kind == 0 || kind == 5)
                acc[t] = _mm256_fnmadd_ps(_mm256_loadu_ps(mn), _mm256_loadu_ps(a.xs + 8L * b), acc[t]);
            else if (kind == 1) { /* -32 d sc_c dx_(c/2) s16_c over the 16 chunks */
                const __m256 dx = _mm256_loadu_ps(a.dx + 8L * b);
                const __m128i s8 = _mm_loadu_si128((const __m128i *)(blk + 192));
                for (int h = 0; h < 2; h++) {
                    const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h ? _mm_srli_si128(s8, 8) : s8));
                    const __m256 dxd = _mm256_permutevar8x32_ps(dx, h ? _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)
                                                                      : _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
                    acc[t] = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_mul_ps(scf, _mm256_set1_ps(32.0f * sc[0])), dxd),
                                              _mm256_loadu_ps(a.s16 + 16L * b + 8 * h), acc[t]);
                }
            }
        }
    }
    for (int t = 0; t < nb; t++) out[(long)(b0 + t) * ld + n] = hsum8(acc[t]);
}

static void kq_row_avx2(int kind, const uint8_t *row, int nblk, const uint8_t *act, long K, float *out, int ld, int n,
                        int b0, int nb) {
    if (kind == 0) kq_row_avx2_n(0, row, nblk, act, K, out, ld, n, b0, nb);
    else if (kind == 1) kq_row_avx2_n(1, row, nblk, act, K, out, ld, n, b0, nb);
    else if (kind == 4) kq_row_avx2_n(4, row, nblk, act, K, out, ld, n, b0, nb);
    else kq_row_avx2_n(5, row, nblk, act, K, out, ld, n, b0, nb);
}

static inline __attribute__((always_inline)) void pk_row_avx2_n(const int q8, const uint8_t *codes, const float *scale,
                                                                 const float *mins, int G, const uint8_t *act, long K,
                                                                 float *out, int ld, int n, int b0, int nb) {
    const uint8_t *row = codes + (long)n * G * (q8 ? 32 : 16);
    const float *sr = scale + (long)n * G, *mr = mins ? mins + (long)n * G : NULL;
    __m256 acc[T4];
    float off[T4];
    for (int t = 0; t < nb; t++) acc[t] = _mm256_setzero_ps(), off[t] = 0.0f;
    int g = 0;
    for (; g + 4 <= G; g += 4) { /* four groups at a time, scaled once (quad_sums) */
        __m256i w[4];
        for (int i = 0; i < 4; i++)
            w[i] = q8 ? _mm256_loadu_si256((const __m256i *)(row + 32L * (g + i))) : nibbles32(row + 16L * (g + i));
        const __m128 s4 = _mm_loadu_ps(sr + g);
        const __m256 mn4 = mr ? _mm256_zextps128_ps256(_mm_loadu_ps(mr + g)) : _mm256_setzero_ps();
        for (int t = 0; t < nb; t++) {
            const Act a = act_at(act, K, b0 + t);
            __m256i d[4];
            for (int i = 0; i < 4; i++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(a.q + 32L * (g + i)));
                d[i] = q8 ? dot32_s(w[i], x) : dot32_u(w[i], x);
            }
            const __m128 p = _mm_mul_ps(s4, _mm_loadu_ps(a.dx + g));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(quad_sums(d[0], d[1], d[2], d[3])), _mm256_set_m128(p, p), acc[t]);
            if (mr) acc[t] = _mm256_fmadd_ps(mn4, _mm256_zextps128_ps256(_mm_loadu_ps(a.xs + g)), acc[t]);
        }
    }
    for (; g < G; g++) { /* the last G % 4 groups one at a time */
        const __m256i w = q8 ? _mm256_loadu_si256((const __m256i *)(row + 32L * g)) : nibbles32(row + 16L * g);
        for (int t = 0; t < nb; t++) {
            const Act a = act_at(act, K, b0 + t);
            const __m256i x = _mm256_loadu_si256((const __m256i *)(a.q + 32L * g));
            const __m256i d = q8 ? dot32_s(w, x) : dot32_u(w, x);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(sr[g] * a.dx[g]), acc[t]);
            if (mr) off[t] += mr[g] * a.xs[g];
        }
    }
    for (int t = 0; t < nb; t++) out[(long)(b0 + t) * ld + n] = hsum8(acc[t]) + off[t];
}

static void pk_row_avx2(int q8, const uint8_t *codes, const float *scale, const float *mins, int G, const uint8_t *act,
                        long K, float *out, int ld, int n, int b0, int nb) {
    if (q8) pk_row_avx2_n(1, codes, scale, mins, G, act, K, out, ld, n, b0, nb);
    else pk_row_avx2_n(0, codes, scale, mins, G, act, K, out, ld, n, b0, nb);
}

/* 1 where `kind` (kquant.c's block kinds, LAYOUT_Q4, LAYOUT_Q8) has an int8 kernel: every CPU the kernels
 * run on (AVX2) has one for these. */
int quill_i8_supported(int kind) {
    return kind == 0 || kind == 1 || kind == 4 || kind == 5 || kind == LAYOUT_Q4 || kind == LAYOUT_Q8;
}

/* out (B, ld) columns [0, N) = x (B, K) @ W.T with x rounded as above. W: `kind`'s blocks (0 Q4_K,
 * 1 Q6_K, 4 IQ4_XS, 5 Q5_K; K a multiple of 256), or LAYOUT_Q4 / LAYOUT_Q8 codes with per-group scale
 * and mins (mins may be NULL: all zero). act: scratch of quill_act8_bytes(B, K) bytes. Rows go to
 * threads in runs of ROWS; within a run, items in tiles meet each row in turn. isa: 512 = the VNNI rows
 * where the CPU has them, else AVX2. Returns 0, or -1 (nothing written) where the kind has no int8 kernel. */
int quill_gemv_i8(int kind, const uint8_t *codes, const float *scale, const float *mins, const float *x,
                  uint8_t *act, float *out, int N, int K, int B, int ld, int isa, int threads) {
    if (!quill_i8_supported(kind) || K % (kind >= LAYOUT_Q4 ? 32 : 256)) return -1;
    quill_act8_quantize(x, act, B, K, threads);
    const int vnni = isa >= 512 && quill_hw_vnni(), tile = vnni ? T8 : T4;
    const int runs = (N + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int r = 0; r < runs; r++) {
        const int n1 = (r + 1) * ROWS < N ? (r + 1) * ROWS : N;
        for (int b0 = 0; b0 < B; b0 += tile) {
            const int nb = B - b0 < tile ? B - b0 : tile;
            for (int n = r * ROWS; n < n1; n++) {
                if (kind >= LAYOUT_Q4)
                    (vnni ? pk_row : pk_row_avx2)(kind == LAYOUT_Q8, codes, scale, mins, K / 32, act, K, out, ld, n, b0, nb);
                else {
                    const long row_bytes = (long)(K / 256) * super_bytes(kind);
                    (vnni ? kq_row : kq_row_avx2)(kind, codes + (long)n * row_bytes, K / 256, act, K, out, ld, n, b0, nb);
                }
            }
        }
    }
    return 0;
}
