/* The exact digit tiles on AVX2 (CPUs without AVX-512 VNNI, as AMD Zen 1-3, or an engine with isa 256): the
 * tiled layout (tiled.py, amx_gemv.c's header) of Q4_K, Q5_K, Q6_K, Q3_K and Q2_K weights, met by x's three
 * int8 digit planes (digits.h, tiled_digits.h) in the integer dots of kquant_i8.c's VNNI tiles, computed
 * here with vpmaddubsw, and the same float sequence after them. So a tiled weight gives the VNNI tiles'
 * outputs bit for bit on either CPU kind, and each row the same bits alone and in any batch. With int8 activations
 * (the opt-in) Q4_K, Q5_K and Q6_K run the same loops on one plane of them (quill_gemv_tiled_i8_avx2), the VNNI
 * tiles' int8 bits.
 *
 * A line of the layout is 64 bytes: 16 rows' codes of four columns, row r in dword r. Here it is two halves,
 * rows 0-7 and rows 8-15, one 256-bit register each, lane r holding row 8h + r's four codes. vpmaddubsw
 * multiplies them (unsigned) by four digits of an item broadcast to every lane (signed) and adds pairs into
 * int16; those are summed in int16 over a run of lines and widened to int32 (vpmaddwd by ones) once per run.
 * No int16 sum can overflow: a pair is at most 2 * 128 * cmax, so a run of R lines is safe while
 * 256 * cmax * R <= 32767:
 *   Q4_K (codes 0..15): R = 8, a whole unit;  Q5_K (0..31): R = 4;  Q6_K (0..63): R = 2;
 *   Q3_K (0..7) and Q2_K (0..3): R = 4, a whole unit.
 * Per unit (a 32-weight group; Q3_K, Q2_K: a 16-weight chunk), the int32 dot starts from the unit's
 * offset term (DIG_FROM) as the VNNI tiles' does, so every integer is theirs (Q4_K's odd groups: a sixteenth
 * of theirs, since they take those codes as 16 q, the high nibbles in place, which digits_unit8 takes back
 * exactly), and digits_unit8 is their digits_unit on eight lanes.
 *
 * Without vpdpbusd each plane's dot is two instructions (vpmaddubsw, vpaddw) per 32 products, so at larger batches
 * the three planes cost about what one fp32 FMA per weight and item does (figures: tiled.tile_for_avx2). Q6_K's
 * codes up to 63 allow runs of two lines only (R = 2): with int8 activations, one plane, that costs little, and
 * tiled.tile_for_avx2 tiles Q6_K for this kernel then; with the digits' three planes its batch 16 ran 1.7x the
 * time of its blocks' FMAs, so the exact path keeps those (the kernel takes it either way). Not here: IQ4_XS and
 * Q8_0, whose codes (table values or signed bytes, + 128) reach 255, so their int16 pairs would saturate; on AVX2
 * they keep their layouts and kernels (kquant_i8_avx2.c, quant_gemv.c). */
#include "isa.h"

#include "deal.h"
#include "digits.h"
#include "kquant_i8.h"
#include "simd.h"
#include "tiled_digits.h"
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

void quill_act8_quantize(const float *x, uint8_t *buf, int B, int K, int threads); /* kquant_i8.c */

#define ITEMS8 2   /* items a pass dots at once from each decoded line: 2 x 3 planes' int16 runs and int32 dots */
#define DCHUNK8 64 /* items per pass over the weights (their digit planes stay in L2, as the VNNI tiles' DCHUNK) */

/* 1 for the kinds this file takes: 0 Q4_K, 1 Q6_K, 5 Q5_K, KQ_Q3K, KQ_Q2K. */
static inline int avx2_tiled_kind(int kind) { return kind == 0 || kind == 1 || kind == 5 || kind == KQ_Q3K || kind == KQ_Q2K; }

/* Lines per int16 run (the header's R). */
static inline int run_lines(int kind) { return kind == 0 ? 8 : kind == 1 ? 2 : 4; }

/* ---- The digits (the VNNI tiles' split_digits on eight lanes: the same buffer, byte for byte) ---- */

/* v * 2^k with one rounding, as vscalefps does it: 2^k as one factor where it is a normal float, else (k > 127,
 * a span whose largest |x| is below 2^-105) in two steps up, each exact. */
static inline __m256 scale_pow2(__m256 v, int k) {
    if (k > 127) {
        v = _mm256_mul_ps(v, _mm256_set1_ps(ldexpf(1.f, k / 2)));
        k -= k / 2;
    }
    return _mm256_mul_ps(v, _mm256_set1_ps(ldexpf(1.f, k)));
}

/* 8 integers |v| <= 2^22 -> their balanced digits (digits.h's digits3). */
static inline void digits3_8(__m256i v, __m256i d[3]) {
    for (int p = 0; p < 3; p++) {
        d[p] = p == 2 ? v : _mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24);
        v = _mm256_srai_epi32(_mm256_sub_epi32(v, d[p]), 8);
    }
}

/* Sum of eight int32 lanes. */
static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

/* x (B, K) with its sums xs -> B digit buffers, as kquant_i8.c's split_digits writes them. */
static void split_digits8(int kind, const float *x, const float *xs, uint8_t *buf, int B, long K, int threads) {
    const int off = code_offset(kind), q6 = per16(kind), mins = kmins(kind);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
#pragma omp parallel for schedule(static) if (B >= 4) num_threads(threads > 0 ? threads : 1)
    for (int b = 0; b < B; b++) {
        for (long g = 0; g < K / 32; g++) {
            uint8_t *blk = (uint8_t *)dig_block(buf, K, b, g / 8);
            const int u = (int)(g % 8);
            const float *p = x + (long)b * K + 32 * g;
            __m256 v[4];
            for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(p + 8 * i);
            const int nan = _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(v[0], v[1], _CMP_UNORD_Q), _mm256_cmp_ps(v[2], v[3], _CMP_UNORD_Q)));
            const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                           _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h)); /* (no NaN reaches here that matters: nan carries it) */
            int e;
            const float unit = digit_unit(_mm_cvtss_f32(h), nan != 0, &e);
            ((float *)(blk + DIG_UNIT))[u] = unit;
            if (mins && q6) /* Q2_K: its two 16-weight sums where the offset terms would be (it has none) */
                for (int k = 0; k < 2; k++) ((float *)(blk + DIG_FROM))[2 * u + k] = xs[(long)b * (K / 16) + 2 * g + k];
            else if (mins)
                ((float *)(blk + DIG_XS))[u] = xs[(long)b * (K / 32) + g];
            __m256i d[4][3];
            for (int i = 0; i < 4; i++)
                if (unit > 0.f) /* |v| <= 2^22 */
                    digits3_8(_mm256_cvtps_epi32(scale_pow2(v[i], 22 - e)), d[i]);
                else
                    d[i][0] = d[i][1] = d[i][2] = _mm256_setzero_si256();
            int32_t *from = (int32_t *)(blk + DIG_FROM);
            for (int q = 0; q < 3; q++) {
                /* packs interleave 128-bit lanes; the permute puts the 32 bytes back in element order */
                const __m256i bytes = _mm256_permutevar8x32_epi32(
                    _mm256_packs_epi16(_mm256_packs_epi32(d[0][q], d[1][q]), _mm256_packs_epi32(d[2][q], d[3][q])), order);
                _mm256_storeu_si256((__m256i *)(blk + DIG_Q + 256 * q + 32 * u), bytes);
                if (q6 && off)
                    for (int k = 0; k < 2; k++) from[3 * (2 * u + k) + q] = -off * hsum_epi32(_mm256_add_epi32(d[2 * k][q], d[2 * k + 1][q]));
                else if (off)
                    from[3 * u + q] = -off * hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(d[0][q], d[1][q]), _mm256_add_epi32(d[2][q], d[3][q])));
            }
        }
    }
}

/* ---- The weights ---- */

/* Half h (rows 8h .. 8h + 7) of line l (0..15) of the 64-column run at src: the codes the VNNI tiles' decode_tiled
 * makes of it (Q4_K: the plain nibble q for the odd group's lines too, see the header). Every shift is 16-bit
 * and none carries a bit across a byte into the bits kept. */
static inline ALWAYS __m256i line_codes(const int kind, const uint8_t *src, const int l, const int h) {
    const __m256i n4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
#define LOAD(off) _mm256_loadu_si256((const __m256i *)(src + (off) + 32 * h))
    if (kind == 0) { /* 512 bytes: line i's codes are the low nibbles of bytes 64 i, line 8 + i's the high ones */
        const __m256i v = LOAD(64 * (l % 8));
        return l < 8 ? _mm256_and_si256(v, n4) : _mm256_and_si256(_mm256_srli_epi16(v, 4), n4);
    }
    if (kind == KQ_Q2K) { /* 256 bytes: line l's codes are bits 2 (l / 4) .. of bytes 64 (l % 4) */
        const __m256i v = LOAD(64 * (l % 4));
        return _mm256_and_si256(l / 4 ? _mm256_srli_epi16(v, 2 * (l / 4)) : v, m3);
    }
    if (kind == KQ_Q3K) { /* the 2-bit plane as Q2_K's, then the top bit: bit l / 2 of the top plane's bytes 64 (l % 2) */
        const __m256i v = LOAD(64 * (l % 4)), hb = LOAD(256 + 64 * (l % 2));
        const int at = l / 2;
        const __m256i top = _mm256_and_si256(at < 2 ? _mm256_slli_epi16(hb, 2 - at) : at > 2 ? _mm256_srli_epi16(hb, at - 2) : hb,
                                             _mm256_set1_epi8(4));
        return _mm256_or_si256(_mm256_and_si256(l / 4 ? _mm256_srli_epi16(v, 2 * (l / 4)) : v, m3), top);
    }
    /* Q5_K (w = 1), Q6_K (w = 2): nibbles as Q4_K's, then a plane of the codes' top w bits, bits w k .. of its byte i
     * for line (span k + i) / 64 (kquant_i8.c's tiled_line), shifted straight to bit 4 and masked there */
    const int w = kind == 5 ? 1 : 2, parts = 8 / w, span = 1024 / parts, lines = span / 64;
    const int k = l / lines, i = 64 * (l % lines), at = w * k;
    const __m256i v = LOAD((span * k + i) % 512), hb = LOAD(512 + i);
    const __m256i nib = k < parts / 2 ? _mm256_and_si256(v, n4) : _mm256_and_si256(_mm256_srli_epi16(v, 4), n4);
    const __m256i top = at < 4 ? _mm256_slli_epi16(hb, 4 - at) : at > 4 ? _mm256_srli_epi16(hb, at - 4) : hb;
    return _mm256_or_si256(nib, _mm256_and_si256(top, _mm256_set1_epi8((char)(((1 << w) - 1) << 4))));
#undef LOAD
}

/* Half h of a super-block's fp16 factors (one per 16 rows and 256 columns) at d, for group `group` of 2^shift. */
static inline __m256 factors8(const uint16_t *d, long group, int shift, int h) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + (group >> shift) * 16 + 8 * h)));
}

/* Half h of unit u's scales *sc and mins *mn of super-block b of row block rb (f: half h's factors, factors8):
 * kquant_i8.c's tiled_unit_scales on eight lanes, the same products, except that the mins stay as the layout
 * keeps them (-dmin m), to be added where the VNNI tiles subtract dmin m (the same sum, one rounding). */
static inline ALWAYS void unit_scales8(const int kind, const TiledSrc *w, long K, long rb, long b, int u, int h,
                                       const __m256 f[2], __m256 *sc, __m256 *mn) {
    const long g = per16(kind) ? rb * (K / 16) + 16 * b + u : rb * (K / 32) + 8 * b + u;
    const __m128i raw = _mm_loadl_epi64((const __m128i *)(w->scale + g * 16 + 8 * h));
    *mn = _mm256_setzero_ps();
    if (kind == KQ_Q2K) { /* the file's scale bytes sc | m << 4 */
        const __m256i q = _mm256_cvtepu8_epi32(raw);
        *sc = _mm256_mul_ps(f[0], _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(15))));
        *mn = _mm256_mul_ps(f[1], _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)));
        return;
    }
    *sc = _mm256_mul_ps(f[0], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)));
    if (kind == 0 && u % 2) *sc = _mm256_mul_ps(*sc, _mm256_set1_ps(0.0625f)); /* the VNNI tiles' 16 q: see the header */
    if (kmins(kind))
        *mn = _mm256_mul_ps(f[1], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w->mins + g * 16 + 8 * h)))));
}

/* s after unit u of a digit item (blk: its block) whose three planes' dots, offset terms in, are D: the VNNI
 * tiles' digits_unit (and digits_dot) on eight lanes, the same operations in the same order; with x16 (Q4_K's odd
 * groups) the unit is taken 16 times, for the VNNI tiles' dot of 16 q (exact: every value here 16 times, each
 * rounding the same). */
static inline ALWAYS __m256 digits_unit8(__m256 sc, __m256 mn, const uint8_t *blk, int u, int q6, int mins, int x16,
                                         const __m256i D[3], __m256 s) {
    const __m256 dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(D[2]), _mm256_set1_ps(65536.0f),
                                       _mm256_cvtepi32_ps(_mm256_add_epi32(D[0], _mm256_slli_epi32(D[1], 8))));
    const float unit = ((const float *)(blk + DIG_UNIT))[q6 ? u / 2 : u];
    s = _mm256_fmadd_ps(_mm256_mul_ps(dot, _mm256_set1_ps(x16 ? 16.f * unit : unit)), sc, s);
    if (mins) s = _mm256_fmadd_ps(mn, _mm256_set1_ps(((const float *)(blk + (q6 ? DIG_FROM : DIG_XS)))[u]), s);
    return s;
}

/* s after unit u of super-block b of an int8 item (a: its activations) whose integer dot is D: kquant_i8.c's
 * int8_unit on eight lanes (Q6_K: its offset, 32 times the 16-chunk's sum of codes, taken off the dot first, and
 * dx per 32); with x16 (Q4_K's odd groups, whose codes the
 * VNNI tiles hold as 16 q and their scale as a sixteenth) the scale times dx is taken 16 times, exactly, so the
 * product with the plain dot is theirs. The mins are added as the layout keeps them (-dmin m): their sum. */
static inline ALWAYS __m256 int8_unit8(__m256 sc, __m256 mn, const Act *a, long b, int u, int q6, int mins, int x16, __m256i D,
                                       __m256 s) {
    const __m256 f = _mm256_cvtepi32_ps(q6 ? _mm256_add_epi32(D, _mm256_set1_epi32(a->o16[16 * b + u])) : D); /* Q6_K's offset */
    __m256 m = _mm256_mul_ps(sc, _mm256_set1_ps(a->dx[8 * b + (q6 ? u / 2 : u)]));
    if (x16) m = _mm256_mul_ps(m, _mm256_set1_ps(16.f));
    s = _mm256_fmadd_ps(f, m, s);
    return mins ? _mm256_fmadd_ps(mn, _mm256_set1_ps(a->xs[8 * b + u]), s) : s;
}

/* v as it is at this point, in a register: an empty asm that GCC must assume reads and changes it. Without it
 * GCC reassociates each run's chain of int16 additions into a tree, computes every product of a unit first and
 * keeps them on the stack (AVX2 has 16 registers): the Q4_K tiles took 675 cycles per 16 x 256 super-block at
 * batch 1 (one thread, in L2, about 3.55 GHz), with it 585, and 567 once each super-block's scale factors were
 * converted once (the VNNI tiles: 286-340 on the same CPU). The same integers either way. */
#define IN_REG(v) __asm__("" : "+x"(v))

static inline ALWAYS __m256i bcast4_8(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The integer dots of unit j (lines ul j .. ul j + ul - 1) of the run at src (chunk cc) with ni items' three planes
 * (blks[i]: item i's digit block), for halves h0 .. h0 + nh - 1: D[i][p][h] from the unit's offset term (off_u,
 * or zero), each line decoded once (or read from the stored tile, store_tile8's, where tile is given) and met by
 * every item and plane; int16 runs of R lines, widened at each end. */
static inline ALWAYS void unit_dots8(const int kind, const int ni, const int nd, const int nh, const int h0, const uint8_t *src,
                                     const __m256i *tile, int cc, int j, int u, const uint8_t *const *blks, __m256i D[][3][2]) {
    const int q6 = per16(kind), ul = q6 ? 4 : 8, R = run_lines(kind), offset = code_offset(kind);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i r16[ITEMS8][3][2];
#pragma GCC unroll 8
    for (int k = 0; k < ul; k++) {
        const int l = ul * j + k;
        __m256i c[2];
        for (int h = 0; h < nh; h++) c[h] = tile ? tile[2 * (16 * cc + l) + h0 + h] : line_codes(kind, src, l, h0 + h);
        for (int i = 0; i < ni; i++)
            for (int p = 0; p < nd; p++) { /* blks: item_inputs' */
                const __m256i x = bcast4_8(item_plane(blks[i], nd, p) + 4 * (16 * cc + l));
                for (int h = 0; h < nh; h++) {
                    const __m256i prod = _mm256_maddubs_epi16(c[h], x);
                    r16[i][p][h] = k % R ? _mm256_add_epi16(r16[i][p][h], prod) : prod;
                    IN_REG(r16[i][p][h]); /* each sum in its register as it goes (see IN_REG) */
                    if (k % R == R - 1) { /* the run's end: its sum joins the dot, which the first run starts from the
                                           * unit's offset term (so nothing but the runs is live before it) */
                        const __m256i from = k >= R ? D[i][p][h]
                                           : offset && nd == 3 ? _mm256_set1_epi32(((const int32_t *)(blks[i] + DIG_FROM))[3 * u + p])
                                                    : _mm256_setzero_si256();
                        D[i][p][h] = _mm256_add_epi32(from, _mm256_madd_epi16(r16[i][p][h], ones));
                    }
                }
            }
    }
}

/* Super-block b of row block rb met by ni items (blks[i]: item i's digit block of it), their sums s[i][h] (rows
 * 8h .. 8h + 7) advanced unit by unit. One item takes both halves of each line at once (its 6 int16 runs and 6
 * dots fit the 16 registers), and so do two for Q4_K and Q5_K (each broadcast serving two halves: Q4_K at batch
 * 16, one thread in L2, 0.78x the time of a half at a time); two items of Q3_K or Q2_K take one half at a time
 * (both at once took 1.46x the time there). */
static inline ALWAYS void tiled_block8(const int kind, const int ni, const int nd, const TiledSrc *w, long K, long rb, long b,
                                       const __m256i *tile, const uint8_t *const *blks, const Act *acts, __m256 s[][2]) {
    const long run = tiled_run_bytes(kind);
    const int q6 = per16(kind), units = q6 ? 4 : 2, mins = kmins(kind), nh = ni == 1 || !q6 || nd == 1 ? 2 : 1;
    const uint8_t *src = tiled_codes(kind, w, K, rb, b);
    const int shift = q6 ? 4 : 3;
    const long g0 = (q6 ? rb * (K / 16) + 16 * b : rb * (K / 32) + 8 * b);
    __m256 f[2][2]; /* half h's scale factors f[h][0] and min factors f[h][1] */
    for (int h = 0; h < 2; h++) {
        f[h][0] = factors8(w->scale_d, g0, shift, h);
        f[h][1] = kmins(kind) ? factors8(w->mins_d, g0, shift, h) : _mm256_setzero_ps();
    }
#pragma GCC unroll 1
    for (int cc = 0; cc < 4; cc++, src += run)
#pragma GCC unroll 1
        for (int j = 0; j < units; j++) {
            const int u = units * cc + j;
#pragma GCC unroll 2
            for (int h0 = 0; h0 < 2; h0 += nh) {
                __m256i D[ITEMS8][3][2];
                unit_dots8(kind, ni, nd, nh, h0, src, tile, cc, j, u, blks, D);
                for (int h = 0; h < nh; h++) {
                    __m256 sc, mn;
                    unit_scales8(kind, w, K, rb, b, u, h0 + h, f[h0 + h], &sc, &mn);
                    for (int i = 0; i < ni; i++) {
                        if (nd == 1) {
                            s[i][h0 + h] = int8_unit8(sc, mn, &acts[i], b, u, q6, mins, kind == 0 && j, D[i][0][h], s[i][h0 + h]);
                            continue;
                        }
                        const __m256i Dh[3] = {D[i][0][h], D[i][1][h], D[i][2][h]};
                        s[i][h0 + h] = digits_unit8(sc, mn, blks[i], u, q6, mins, kind == 0 && j, Dh, s[i][h0 + h]);
                    }
                }
            }
        }
}

/* F(k, ...) with kind a constant k: every kind this file takes (AVX2_CONST), or those with an int8 kernel (I8_CONST). */
#define AVX2_CONST(F, kind, ...)                                                                     \
    do {                                                                                             \
        if ((kind) == 0) F(0, __VA_ARGS__);                                                          \
        else if ((kind) == 1) F(1, __VA_ARGS__);                                                     \
        else if ((kind) == 5) F(5, __VA_ARGS__);                                                     \
        else if ((kind) == KQ_Q3K) F(KQ_Q3K, __VA_ARGS__);                                           \
        else F(KQ_Q2K, __VA_ARGS__);                                                                 \
    } while (0)
#define I8_CONST(F, kind, ...) /* Q4_K, Q6_K, Q5_K */                                                \
    do {                                                                                             \
        if ((kind) == 0) F(0, __VA_ARGS__);                                                          \
        else if ((kind) == 1) F(1, __VA_ARGS__);                                                     \
        else F(5, __VA_ARGS__);                                                                      \
    } while (0)

/* Passes of ITEMS8 items over a super-block up to which each pass decodes its lines again (line_codes); beyond,
 * store_tile8 decodes them once into a stored tile that every pass reads: Q4_K, whose lines take two operations,
 * four passes; the kinds whose lines join a plane of top bits, one. Zen 4 with the AVX2 kernels forced, one thread,
 * 256 x 2048 in L2, microseconds per item, each pass decoding -> the stored tile: int8 Q6_K batch 8 14.6 -> 11.0,
 * batch 64 12.8 -> 8.5; Q5_K batch 8 11.2 -> 9.6; exact digits Q3_K batch 16 28.6 -> 21.7, Q5_K batch 64 19.9 ->
 * 15.2; Q4_K about even below batch 16 (int8 batch 8 8.9 -> 9.1), exact batch 64 15.1 -> 14.3. */
static inline int fly_passes8(int kind) { return kind == 0 ? 4 : 1; }

/* Super-block b of row block rb's 64 lines, both halves, decoded once into tile: line l of chunk cc, half h at
 * 2 (16 cc + l) + h (the codes line_codes gives, so the same integers). */
static inline ALWAYS void store_tile8_k(const int kind, const TiledSrc *w, long K, long rb, long b, __m256i *tile) {
    const long run = tiled_run_bytes(kind);
    const uint8_t *src = tiled_codes(kind, w, K, rb, b);
#pragma GCC unroll 1
    for (int cc = 0; cc < 4; cc++, src += run)
#pragma GCC unroll 16
        for (int l = 0; l < 16; l++)
            for (int h = 0; h < 2; h++) tile[2 * (16 * cc + l) + h] = line_codes(kind, src, l, h);
}

static void store_tile8(int kind, const TiledSrc *w, long K, long rb, long b, __m256i *tile) {
    AVX2_CONST(store_tile8_k, kind, w, K, rb, b, tile);
}

/* ni items (item .. item + ni - 1, sums at acc) meet super-block b of row block rb: from the stored tile where
 * tile is given (store_tile8's), else each line decoded as they meet it. */
static void tiled_pass8(int kind, int ni, int nd, const TiledSrc *w, long K, long rb, long b, const __m256i *tile,
                        const uint8_t *act, float *acc, int item) {
    const uint8_t *blks[ITEMS8];
    Act acts[ITEMS8];
    __m256 s[ITEMS8][2];
    for (int i = 0; i < ni; i++) {
        blks[i] = item_inputs(act, nd, K, item + i, b, &acts[i]);
        for (int h = 0; h < 2; h++) s[i][h] = _mm256_loadu_ps(acc + 16 * i + 8 * h);
    }
#define ONE8(k, ...) tiled_block8(k, 1, 3, __VA_ARGS__)
#define TWO8(k, ...) tiled_block8(k, 2, 3, __VA_ARGS__)
#define ONE8_I8(k, ...) tiled_block8(k, 1, 1, __VA_ARGS__)
#define TWO8_I8(k, ...) tiled_block8(k, 2, 1, __VA_ARGS__)
#define PASS8(T) /* T: the tile or NULL, a constant in each branch below */                           \
    do {                                                                                             \
        if (nd == 1 && ni == 1) I8_CONST(ONE8_I8, kind, w, K, rb, b, T, blks, acts, s);              \
        else if (nd == 1) I8_CONST(TWO8_I8, kind, w, K, rb, b, T, blks, acts, s);                    \
        else if (ni == 1) AVX2_CONST(ONE8, kind, w, K, rb, b, T, blks, acts, s);                     \
        else AVX2_CONST(TWO8, kind, w, K, rb, b, T, blks, acts, s);                                  \
    } while (0)
    if (tile) PASS8(tile);
    else PASS8(NULL);
#undef PASS8
#undef ONE8
#undef TWO8
#undef ONE8_I8
#undef TWO8_I8
    for (int i = 0; i < ni; i++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(acc + 16 * i + 8 * h, s[i][h]);
}

/* The VNNI tiles' tiled_gemm on AVX2: items in chunks of DCHUNK8; row blocks dealt to the threads (deal.h), each
 * asked for ahead as tiled_ahead says; each super-block met by the chunk's items ITEMS8 at a time, from its lines
 * decoded in each pass or, past fly_passes8, from the tile stored once. */
static void tiled_gemm8(int kind, int nd, const TiledSrc *w, const uint8_t *act, long K, int N, int B, float *out, int ld,
                        int threads) {
    const long nblk = K / 256, run = tiled_run_bytes(kind), C = K / 64;
    const int RB = N / 16;
    for (int c0 = 0; c0 < B; c0 += DCHUNK8) {
        const int nc = B - c0 < DCHUNK8 ? B - c0 : DCHUNK8, ahead = tiled_ahead(kind, nc);
        const int nt = threads > 0 ? threads : 1;
        Deal deals[nt];
        deal_init(deals, nt, RB);
#pragma omp parallel num_threads(nt)
        for (long rb; (rb = deal_next(deals, omp_get_thread_num(), nt)) >= 0;) {
            float acc[DCHUNK8 * 16] __attribute__((aligned(32)));
            __m256i tile[128];
            const int stored = (nc + ITEMS8 - 1) / ITEMS8 > fly_passes8(kind);
            memset(acc, 0, sizeof(float) * 16 * nc);
            for (long b = 0; b < nblk; b++) {
                tiled_prefetch(ahead, kind, w, nblk, C, run, rb, b);
                if (stored) store_tile8(kind, w, K, rb, b, tile);
                for (int i = 0; i < nc; i += ITEMS8)
                    tiled_pass8(kind, nc - i < ITEMS8 ? nc - i : ITEMS8, nd, w, K, rb, b, stored ? tile : NULL, act,
                                acc + 16 * i, c0 + i);
            }
            for (int i = 0; i < nc; i++)
                for (int h = 0; h < 2; h++)
                    _mm256_storeu_ps(out + (long)(c0 + i) * ld + 16L * rb + 8 * h, _mm256_loadu_ps(acc + 16 * i + 8 * h));
        }
    }
}

/* kquant_i8.c's quill_gemv_tiled_exact on AVX2, for kinds 0 Q4_K, 1 Q6_K, 5 Q5_K, KQ_Q3K and KQ_Q2K in the tiled
 * layout (the same arguments; the same outputs, bit for bit). Returns 0, or -1 (nothing written) for another kind
 * or shape. */
int quill_gemv_tiled_exact_avx2(int kind, const uint8_t *codes, const int8_t *scale, const int8_t *mins,
                                const uint16_t *scale_d, const uint16_t *mins_d, const float *x, const float *xs,
                                uint8_t *digits, float *out, int N, int K, int B, int ld, int threads) {
    const TiledSrc w = {codes, scale, mins, scale_d, mins_d};
    if (!avx2_tiled_kind(kind) || !tiled_src_fits(kind, &w, K, N)) return -1;
    split_digits8(kind, x, xs, digits, B, K, threads);
    tiled_gemm8(kind, 3, &w, digits, K, N, B, out, ld, threads);
    return 0;
}

/* kquant_i8.c's quill_gemv_tiled_i8 on AVX2, for kinds 0 Q4_K, 1 Q6_K and 5 Q5_K in the tiled layout (one plane of int8
 * activations, quill_act8_quantize's, where the digits take three; int8_unit8 the VNNI tiles' int8 float
 * sequence, so the same outputs bit for bit). act: scratch of quill_act8_bytes(B, K). Returns 0, or -1 (nothing
 * written) for another kind or shape. */
int quill_gemv_tiled_i8_avx2(int kind, const uint8_t *codes, const int8_t *scale, const int8_t *mins,
                             const uint16_t *scale_d, const uint16_t *mins_d, const float *x, uint8_t *act, float *out,
                             int N, int K, int B, int ld, int threads) {
    const TiledSrc w = {codes, scale, mins, scale_d, mins_d};
    if (!(kind == 0 || kind == 1 || kind == 5) || !tiled_src_fits(kind, &w, K, N)) return -1;
    quill_act8_quantize(x, act, B, K, threads);
    tiled_gemm8(kind, 1, &w, act, K, N, B, out, ld, threads);
    return 0;
}
