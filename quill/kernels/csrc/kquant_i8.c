/* Opt-in int8 activations (KernelOptions.int8): the GEMV / GEMM reads the same weights as kquant.c
 * and quant_gemv.c, but each 32 activations are first rounded to int8 with their own fp32 scale,
 * so four weights times four activations are one lane of an integer dot-product instruction
 * (AVX-512 VNNI vpdpbusd; without VNNI, kquant_i8_avx2.c: vpmaddubsw and vpmaddwd) instead of
 * four fp32 FMAs. This is the one place where quill rounds anything beyond the file's own
 * quantization; the exact kernels stay the default. On VNNI CPUs the exact path of the block kinds
 * runs on the same tiles (quill_gemv_tiles_exact, at the end of the VNNI part) with x as three int8
 * digits per element (digits.h: at most 2^-22 of its group's largest |x| off, the size of fp32's own
 * rounding in a sum): the decode is shared, each digit plane takes the same integer dots, and the three
 * are recombined in fp32.
 *
 * Activations (quill_act8_quantize): for each item and each group g of 32 inputs,
 *   dx[g] = max|x| / 127,  q = round-to-nearest-even(x * (1 / dx[g])) in -127..127,
 * and alongside them what the weight formats' offsets and mins need, from the sums s16 (each 16 codes') and
 * s32 (each group's): the offset terms o16 = -32 s16 (Q6_K's) and o32 = -128 s32 (IQ4_XS's and Q8_0's),
 * int32, and xs[g] = dx[g] * s32[g]. One item's buffer is
 *   q: K int8 | dx: K/32 fp32 | xs: K/32 fp32 | o16: K/16 int32 | o32: K/32 int32   (act_bytes(K) = 1.625 K).
 *
 * A row's result is then sum over groups of (weight scale * dx) * (integer codes . q), plus the
 * formats' offsets, in fp32:
 *   Q4_K, Q5_K  w = d sc q - dmin m      -> per group: (d sc_g dx_g) (q.x)_g - (dmin m_g) xs_g
 *   Q6_K        w = d sc (q - 32)        -> per 16-chunk: (d sc_c dx_(c/2)) ((q.x)_c - 32 s16_c)
 *   IQ4_XS      w = d (ls - 32) k[q]     -> codes k[q] + 128 unsigned: (scale_g dx_g) ((k.x)_g - 128 s32_g)
 *   q4 layout   w = scale q + min        -> (scale_g dx_g) (q.x)_g + min_g xs_g
 *   q8 layout   (Q8_0, Q5_1) codes w + 128 unsigned: (scale_g dx_g) ((w.x)_g - 128 s32_g) + min_g xs_g
 * (c: 16-weight chunk, g: 32-weight group; integer dots are exact in int32, and each dot starts from its
 * offset term (o16, o32), so the offsets are taken off in the integers: the same floats as subtracting them
 * in fp32, every term being an integer below 2^24, without an fp32 operation per unit and item.)
 *
 * Batch invariance: each (row, item) pair runs the same instructions in the same order wherever the
 * item sits in the batch; items only share the decoded weights. Block layouts: facts from GGML's
 * format (ggml-common.h); the code is written here.
 */
#include "isa.h"

#include "amx_tiles.h"
#include "digits.h"
#include "kquant_i8.h"
#include "tiled_digits.h"
#include "simd.h"
#include "deal.h"
#include <omp.h>
#include <stdint.h>
#include <string.h>

long quill_act8_bytes(int B, int K) { return (long)B * act_bytes(K); }

/* What the CPU can run: 1 = AVX-512 with VNNI (probed once; a fact, not a choice). */
int quill_hw_vnni(void) {
    static int cached = -1;
    if (cached < 0)
        cached = CPU_HAS("avx512f") && CPU_HAS("avx512bw") &&
                 CPU_HAS("avx512vl") && CPU_HAS("avx512vnni");
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
        float *dx = (float *)(p + K), *xs = (float *)(p + K + K / 8);
        int32_t *o16 = (int32_t *)(p + K + K / 4), *o32 = (int32_t *)(p + K + K / 2);
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
            const int lo = (int)hsum8(_mm256_cvtepi32_ps(_mm256_add_epi32(i[0], i[1]))); /* |sum| <= 2032: exact */
            const int hi = (int)hsum8(_mm256_cvtepi32_ps(_mm256_add_epi32(i[2], i[3])));
            o16[2 * g] = -32 * lo;
            o16[2 * g + 1] = -32 * hi;
            o32[g] = -128 * (lo + hi);
            dx[g] = d;
            xs[g] = d * (float)(lo + hi);
        }
    }
}

/* ---- AVX-512 VNNI: tiles of 16 weight rows, one row per 32-bit lane ----
 *
 * The 16 rows' bytes of one super-block (or of 256 weights of a q4 / q8 row) are transposed so that
 * dword j of every row sits in one register, lane r holding row r (transpose16); the format is then
 * decoded lane-wise, the same arithmetic as GGML's reference for one row, into 64 registers of four
 * unsigned codes per lane (C[j]: weights 4j..4j+3 of the 256) and per-lane scales. An item's dot is
 * then vpdpbusd of C[j] with four of its int8 activations broadcast to every lane: sixteen rows'
 * partial dots in one instruction, no horizontal sums, and each decoded register serves every item of
 * the batch (the batch's reuse of a decoded weight tile). Each (row, item) pair's float sequence --
 * per block, per group in order: one FMA of the scaled dot, then one of the min -- is the same for any
 * batch, so one kernel serves decode and prefill.
 *
 * A pass with a single item (batch 1, where decode is bound by the weight read) skips the tile in
 * memory: each decoded register goes straight into the item's vpdpbusd (emit / Fuse), and the decode is
 * unrolled so every register index is a constant (with run-time indices the codes and dots went through
 * the stack). Batch 1 takes about 0.8x the time of the tile path; the integer dots are the same, so the
 * floats are too. */

#define IT 8     /* items whose accumulators a pass over a decoded tile keeps in registers */
#define CHUNK 64 /* items per pass over the weights: their activations stay in L2 while each tile meets them */

typedef struct {
    __m512i c[64];  /* codes: c[j] lane r = row r's weights 4j..4j+3 (unsigned bytes) */
    __m512 sc[16];  /* per 32-group (Q6_K: per 16-chunk) weight scale, lane r = row r */
    __m512 mn[16];  /* per 32-group min (Q4_K, Q5_K: dmin m; q4 / q8 layouts: min; Q2_K per 16: dmin m) */
} Tile;

/* One item meeting the tile as it is decoded (a pass with a single item: nothing to reuse, so the codes
 * go straight into its dots instead of through memory): d[p][k] lane r = row r's integer dot over codes
 * c[4k .. 4k + 4) with the item's activations q[p] (the block's 256): nd = 1 plane of rounded int8
 * activations, or the exact path's 3 digit planes. */
typedef struct {
    int nd; /* a constant where made */
    __m512i d[3][16];
    const int8_t *q[3];
} Fuse;

VNNI static inline __m512i bcast4(const int8_t *p) { /* four activations in every lane */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* acc + the dot of codes c with the four int8 at p in every lane (bcast4): vpdpbusd with its memory operand
 * broadcast ({1to16}). GCC 12 does not fold the broadcast into vpdpbusd and issues a vpbroadcastd for each
 * dot: a chain of them took 1.16 cycles per dot on the AMD EPYC Zen 4 against 1.02 with the operand folded
 * (and the batch-1 Q4_K tiles 0.92x the time). The emulation builds (SIMDe) keep the intrinsics. */
VNNI static inline ALWAYS __m512i dot4(__m512i acc, __m512i c, const int8_t *p) {
#ifdef QUILL_EMULATE_AVX512
    return _mm512_dpbusd_epi32(acc, c, bcast4(p));
#else
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(c), "m"(*(const int32_t *)p));
    return acc;
#endif
}

/* Codes c[j] of the tile: kept for the items of a pass, or (f) dotted at once with f's item: vpdpbusd
 * with each of its activation planes. */
VNNI static inline ALWAYS void emit(Tile *t, Fuse *f, int j, __m512i v) {
    if (!f) {
        t->c[j] = v;
    } else {
        for (int p = 0; p < f->nd; p++) f->d[p][j / 4] = dot4(f->d[p][j / 4], v, f->q[p] + 4 * j);
    }
}

/* out[j] lane r = dword j of the n bytes at rows[r] (n <= 64; dwords past n read as zero). A 16 x 16
 * transpose of 32-bit elements in four rounds of unpacks and 128-bit shuffles. */
VNNI static inline ALWAYS void transpose16(const uint8_t *const *rows, long off, int n, __m512i out[16]) {
    const __mmask64 m = n >= 64 ? ~0ULL : (1ULL << n) - 1;
    __m512i r[16], a[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_maskz_loadu_epi8(m, rows[i] + off);
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i + c] 128-bit lane L: rows 4i..4i+3's dword 4L + c */
        r[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i lo0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), hi0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xee);
        const __m512i lo1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44), hi1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xee);
        out[c] = _mm512_shuffle_i32x4(lo0, lo1, 0x88);
        out[4 + c] = _mm512_shuffle_i32x4(lo0, lo1, 0xdd);
        out[8 + c] = _mm512_shuffle_i32x4(hi0, hi1, 0x88);
        out[12 + c] = _mm512_shuffle_i32x4(hi0, hi1, 0xdd);
    }
}

VNNI static inline __m512 lanes_f16(__m512i v, int shift) { /* the fp16 at bits [shift, shift + 16) of each lane */
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, shift)));
}

/* Dword i of a super-block (lane r = row r), decoded into t as it arrives; `keep` holds what later
 * dwords need (Q4_K / Q5_K: the header; Q5_K: the fifth bits; Q6_K: the high pairs, which are
 * transposed first). */
VNNI static inline ALWAYS void put_dword(const int kind, int i, __m512i v, Tile *t, Fuse *f, __m512i *keep) {
    const __m512i n4 = _mm512_set1_epi8(15);
    if (kind == 0 || kind == 5) { /* d, dmin; 12 bytes of 6-bit scales and mins; Q5_K: 32 bytes of fifth bits */
        const int qs = kind == 5 ? 12 : 4; /* first dword of the 128 bytes of nibbles */
        if (i < 4) {
            keep[i] = v;
            if (i < 3) return;
            const __m512 d = lanes_f16(keep[0], 0), dmin = lanes_f16(keep[0], 16);
            /* the twelve bytes as four lanes of four 6-bit values each (kformat.h's k4_scales_mins, lane-wise):
             * scales 0-3, scales 4-7, mins 0-3, mins 4-7 */
            const __m512i u0 = keep[1], u1 = keep[2], u2 = v, lo6 = _mm512_set1_epi8(0x3f), n4b = _mm512_set1_epi8(15),
                          top2 = _mm512_set1_epi8(0x30);
            const __m512i q[4] = {_mm512_and_si512(u0, lo6),
                                  _mm512_ternarylogic_epi32(n4b, u2, _mm512_and_si512(_mm512_srli_epi32(u0, 2), top2), 0xca),
                                  _mm512_and_si512(u1, lo6),
                                  _mm512_ternarylogic_epi32(n4b, _mm512_srli_epi32(u2, 4), _mm512_and_si512(_mm512_srli_epi32(u1, 2), top2), 0xca)};
            for (int g = 0; g < 8; g++) {
                /* byte g % 4 of each lane, zero-extended; Q4_K's odd groups scaled by 1/16 (their codes are the
                 * high nibbles in place, 16 times the value: the product is the same, powers of two being exact) */
                const __m512i pick = _mm512_set1_epi32((int)(0x80808000u | (unsigned)(g % 4)));
                const __m512i sel = _mm512_add_epi32(pick, _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12));
                /* (vpshufb indexes bytes within each 128-bit lane: dword k's byte g % 4 is byte 4k + g % 4 there) */
                const __m512 sc = _mm512_cvtepi32_ps(_mm512_shuffle_epi8(q[g / 4], sel));
                const __m512 mn = _mm512_cvtepi32_ps(_mm512_shuffle_epi8(q[2 + g / 4], sel));
                t->sc[g] = _mm512_mul_ps(kind == 0 && g % 2 ? _mm512_mul_ps(d, _mm512_set1_ps(0.0625f)) : d, sc);
                t->mn[g] = _mm512_mul_ps(dmin, mn);
            }
        } else if (i < qs) {
            keep[i] = v; /* Q5_K's qh, dwords 4..11 */
        } else { /* 32 bytes per 64 weights: low nibbles weights 64j + l, high 64j + 32 + l */
            const int j = (i - qs) / 8, e = (i - qs) % 8;
            __m512i lo = _mm512_and_si512(v, n4), hi = kind == 0 ? _mm512_andnot_si512(n4, v) : _mm512_and_si512(_mm512_srli_epi32(v, 4), n4);
            if (kind == 5) { /* bit 2j (2j + 1) of qh's byte l: weight 64j + l's (64j + 32 + l's) fifth bit */
                const __m512i qh = keep[4 + e], one = _mm512_set1_epi8(1);
                lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh, 2 * j), one), 4));
                hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh, 2 * j + 1), one), 4));
            }
            emit(t, f, 16 * j + e, lo);
            emit(t, f, 16 * j + 8 + e, hi);
        }
    } else if (kind == 1) { /* Q6_K: 128 bytes low nibbles, 64 bytes high pairs, 16 int8 scales, d */
        if (i >= 32 && i < 48) {
            keep[i - 32] = v;
        } else if (i >= 48) {
            if (i < 52) {
                keep[16 + i - 48] = v;
                return;
            }
            const __m512 d = lanes_f16(v, 0);
            for (int c = 0; c < 16; c++) /* byte c of the scales, sign-extended */
                t->sc[c] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(keep[16 + c / 4], 24 - 8 * (c % 4)), 24)));
        } else { /* ql[l] (ql[l + 32]) of half h with qh[l] -> weights 128h + l and 128h + l + 64 (+ 32) */
            const int h = i / 16, second = (i % 16) / 8, e = i % 8;
            /* each code: its 4 low bits from ql, bits 4-5 from its pair of qh moved there, masked */
            const __m512i qh = keep[8 * h + e], top2 = _mm512_set1_epi8(0x30);
            const __m512i lo_hi2 = second ? _mm512_slli_epi32(qh, 2) : _mm512_slli_epi32(qh, 4);
            const __m512i hi_hi2 = second ? _mm512_srli_epi32(qh, 2) : qh;
            emit(t, f, 32 * h + 8 * second + e, _mm512_ternarylogic_epi32(n4, v, _mm512_and_si512(lo_hi2, top2), 0xca));
            emit(t, f, 32 * h + 16 + 8 * second + e, _mm512_ternarylogic_epi32(n4, _mm512_srli_epi32(v, 4), _mm512_and_si512(hi_hi2, top2), 0xca));
        }
    } else { /* IQ4_XS: d, 16 bits of high scale bits, 4 bytes of low scale nibbles, 128 bytes of indices */
        if (i < 2) {
            keep[i] = v;
            if (i == 0) return;
            const __m512 d = lanes_f16(keep[0], 0);
            for (int g = 0; g < 8; g++) {
                const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(v, 8 * (g / 2) + 4 * (g % 2)), _mm512_set1_epi32(15));
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(keep[0], 16 + 2 * g), _mm512_set1_epi32(3));
                t->sc[g] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32))));
            }
            return;
        }
        const __m512i table = _mm512_broadcast_i32x4(_mm_add_epi8(_mm_loadu_si128((const __m128i *)IQ4_TABLE), _mm_set1_epi8((char)128)));
        const int g = (i - 2) / 4, e = (i - 2) % 4; /* 16 bytes per group: low nibbles weights 32g + l, high 32g + 16 + l */
        const __m512i lo = _mm512_and_si512(v, n4), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), n4);
        emit(t, f, 8 * g + e, _mm512_shuffle_epi8(table, lo));
        emit(t, f, 8 * g + 4 + e, _mm512_shuffle_epi8(table, hi));
    }
}

/* Super-block b of a block kind (0 Q4_K, 1 Q6_K, 4 IQ4_XS, 5 Q5_K) for 16 rows -> t, one transposed
 * span of 64 bytes at a time (Q6_K: its high pairs, the third span, first). */
VNNI static inline ALWAYS void decode_blocks(const int kind, const uint8_t *const *rows, long b, Tile *t, Fuse *f) {
    const int bytes = super_bytes(kind), spans = (bytes + 63) / 64;
    __m512i keep[20];
#pragma GCC unroll 4
    for (int k = 0; k < spans; k++) { /* unrolled: every index below is a constant, the codes stay in registers */
        const int s = kind == 1 ? (k == 0 ? 2 : k <= 2 ? k - 1 : 3) : k;
        __m512i T[16];
        transpose16(rows, (long)b * bytes + 64 * s, bytes - 64 * s, T);
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++)
            if (4 * j < bytes - 64 * s) put_dword(kind, 16 * s + j, T[j], t, f, keep); /* the dwords holding its bytes */
    }
}

/* Groups [8b, 8b + ng) of a q4 (16 bytes per group) or q8 (32 signed bytes) layout for 16 rows -> t,
 * with the rows' per-group scales and mins (fp32, G per row; mins may be NULL). */
VNNI static inline ALWAYS void decode_layout(const int q8, const uint8_t *const *rows, const uint8_t *const *srows,
                                             const uint8_t *const *mrows, long b, int ng, Tile *t, Fuse *f) {
    const int per = q8 ? 32 : 16, n = ng * per, gs = 64 / per; /* gs groups per transposed span */
    __m512i S[16];
    transpose16(srows, 32L * b, 4 * ng, S);
    for (int g = 0; g < ng; g++) t->sc[g] = _mm512_castsi512_ps(S[g]);
    if (mrows) {
        transpose16(mrows, 32L * b, 4 * ng, S);
        for (int g = 0; g < ng; g++) t->mn[g] = _mm512_castsi512_ps(S[g]);
    }
    const __m512i n4 = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
#pragma GCC unroll 4
    for (int s = 0; 64 * s < n; s++) { /* each span decoded as it is transposed */
        __m512i T[16];
        transpose16(rows, 8L * b * per + 64 * s, n - 64 * s, T);
#pragma GCC unroll 4
        for (int k = 0; k < gs; k++) {
            const int g = gs * s + k;
            if (g >= ng) break;
            const __m512i *v = T + k * per / 4;
            if (q8) /* signed codes + 128: unsigned for vpdpbusd (the 128 s32 offset takes it back) */
                for (int e = 0; e < 8; e++) emit(t, f, 8 * g + e, _mm512_xor_si512(v[e], flip));
            else /* 16 bytes: low nibbles weights 32g + l, high 32g + 16 + l */
                for (int e = 0; e < 4; e++) {
                    emit(t, f, 8 * g + e, _mm512_and_si512(v[e], n4));
                    emit(t, f, 8 * g + 4 + e, _mm512_and_si512(_mm512_srli_epi32(v[e], 4), n4));
                }
        }
    }
}

/* x (B, K) fp32 with its sums xs (B, K / 32; read where the kind has mins) -> B digit buffers (layout
 * above) for a block kind's weights. */
VNNI static void split_digits(int kind, const float *x, const float *xs, uint8_t *buf, int B, long K, int threads) {
    const int off = code_offset(kind), q6 = per16(kind), mins = kmins(kind);
#pragma omp parallel for schedule(static) if (B >= 4) num_threads(threads > 0 ? threads : 1)
    for (int b = 0; b < B; b++) {
        for (long g = 0; g < K / 32; g++) {
            uint8_t *blk = (uint8_t *)dig_block(buf, K, b, g / 8);
            const int u = (int)(g % 8);
            int32_t *from = (int32_t *)(blk + DIG_FROM);
            __m512i d[2][3];
            ((float *)(blk + DIG_UNIT))[u] = group_digits(x + (long)b * K + 32 * g, d);
            if (mins && q6) /* Q2_K: its two 16-weight sums where the offset terms would be (it has none) */
                for (int h = 0; h < 2; h++) ((float *)(blk + DIG_FROM))[2 * u + h] = xs[(long)b * (K / 16) + 2 * g + h];
            else if (mins)
                ((float *)(blk + DIG_XS))[u] = xs[(long)b * (K / 32) + g];
            for (int p = 0; p < 3; p++) {
                for (int h = 0; h < 2; h++)
                    _mm_storeu_si128((__m128i *)(blk + DIG_Q + 256 * p + 32 * u + 16 * h), _mm512_cvtepi32_epi8(d[h][p]));
                if (q6 && off)
                    for (int h = 0; h < 2; h++) from[3 * (2 * u + h) + p] = -off * _mm512_reduce_add_epi32(d[h][p]);
                else if (off)
                    from[3 * u + p] = -off * _mm512_reduce_add_epi32(_mm512_add_epi32(d[0][p], d[1][p]));
            }
        }
    }
}

/* A group's (Q6_K: a chunk's) dot from the three planes' integer dots D (the format's offset already
 * taken off each), recombined as the section's header states. */
VNNI static inline ALWAYS __m512 digits_dot(const __m512i D[3]) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(D[2]), _mm512_set1_ps(65536.0f),
                           _mm512_cvtepi32_ps(_mm512_add_epi32(D[0], _mm512_slli_epi32(D[1], 8))));
}

/* A digit item's offset term for unit u in plane p (blk: its block; offset: the format's, 0 for none). */
VNNI static inline ALWAYS __m512i digits_from(const uint8_t *blk, int u, int p, int offset) {
    return offset ? _mm512_set1_epi32(((const int32_t *)(blk + DIG_FROM))[3 * u + p]) : _mm512_setzero_si512();
}

/* s with unit u's min taken off (minus: Q4_K, Q5_K) or added (the layouts): one FMA of the min times the
 * unit's sum of x. */
VNNI static inline ALWAYS __m512 with_min(__m512 mn, int minus, float sum, __m512 s) {
    const __m512 x = _mm512_set1_ps(sum);
    return minus ? _mm512_fnmadd_ps(mn, x, s) : _mm512_fmadd_ps(mn, x, s);
}

/* s after unit u (a group; Q6_K: a 16-chunk) of a digit item (blk: its block) whose three planes' dots,
 * offset terms in, are D: (dot * unit) times the scale, which stays in fp32's normal range wherever the
 * product does (scale * unit alone leaves it for |x| below about 2^-100), then, with mins, the min *mn (with_min).
 * The one definition of the digits' float sequence, for tile_items and fuse_chunk, whose sums agree bit
 * for bit. */
VNNI static inline ALWAYS __m512 digits_unit(__m512 sc, const __m512 *mn, const uint8_t *blk, int u, int q6, int mins, int minus,
                                             const __m512i D[3], __m512 s) {
    const __m512 unit = _mm512_set1_ps(((const float *)(blk + DIG_UNIT))[q6 ? u / 2 : u]);
    s = _mm512_fmadd_ps(_mm512_mul_ps(digits_dot(D), unit), sc, s);
    return mins ? with_min(*mn, minus, ((const float *)(blk + (q6 ? DIG_FROM : DIG_XS)))[u], s) : s; /* q6: Q2_K's */
}

/* Where an int8 item's dot of unit u (a group; Q6_K: a 16-chunk) of super-block b starts (a: its activations):
 * the format's offset term (o16: Q6_K's 32 per code; o32: IQ4_XS's and Q8_0's 128), or zero. Started there,
 * the dot has the offset taken off in the integers (exact), which int8_unit's float sequence reads. */
VNNI static inline ALWAYS __m512i int8_from(const Act *a, long b, int u, int offset) {
    return offset == 32 ? _mm512_set1_epi32(a->o16[16 * b + u]) : offset == 128 ? _mm512_set1_epi32(a->o32[8 * b + u])
                                                                 : _mm512_setzero_si512();
}

/* s after unit u (a group; Q6_K: a 16-chunk) of super-block b of an int8 item (a: its activations) whose integer
 * dot, less the format's offset times the unit's sum of codes (int8_from), is D: the dot times (the scale * dx),
 * then, where the format has them, the min. The one definition of the int8 float sequence, for tile_items and
 * fuse_chunk, whose sums agree bit for bit. */
VNNI static inline ALWAYS __m512 int8_unit(__m512 sc, const __m512 *mn, const Act *a, long b, int u, int q6,
                                           int has_mins, int minus, __m512i D, __m512 s) {
    const __m512 f = _mm512_cvtepi32_ps(D);
    s = _mm512_fmadd_ps(f, _mm512_mul_ps(sc, _mm512_set1_ps(a->dx[8 * b + (q6 ? u / 2 : u)])), s);
    return has_mins && !q6 ? with_min(*mn, minus, a->xs[8 * b + u], s) : s;
}

/* Unit u's (Q6_K: 16-chunk; the others: group) 16 scales *sc and mins *mn (Q4_K and Q5_K; the others: zero) of
 * super-block b of row block rb, as decode_blocks makes them. A fused pass takes each chunk's as it ends, in
 * registers: filling the tile's and reading them back took the batch-1 Q4_K tiles 1.1x the time (Zen 4). */
VNNI static inline ALWAYS void tiled_unit_scales(const int kind, const TiledSrc *w, long K, long rb, long b, int u,
                                                 __m512 *sc, __m512 *mn) {
    *mn = _mm512_setzero_ps();
    if (kind == KQ_Q2K) { /* the file's scale bytes sc | m << 4: d sc, and -(-dmin m) as Q4_K's below */
        const long g = rb * (K / 16) + 16 * b + u;
        *sc = kscale_nibble(w->scale, w->scale_d, g, 4, 0);
        *mn = _mm512_xor_ps(kscale_nibble(w->scale, w->mins_d, g, 4, 1), _mm512_set1_ps(-0.0f));
    } else if (per16(kind)) {
        *sc = kscale_group(w->scale, w->scale_d, rb * (K / 16) + 16 * b + u, 4);
    } else if (kind == LAYOUT_Q8) { /* Q8_0: the file's fp16 scale per 32 weights, as they are */
        *sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w->scale + (rb * (K / 32) + 8 * b + u) * 16)));
    } else {
        const long G = K / 32;
        *sc = kscale_group(w->scale, w->scale_d, rb * G + 8 * b + u, 3);
        if (kind == 0 && u % 2) *sc = _mm512_mul_ps(*sc, _mm512_set1_ps(0.0625f)); /* codes 16 q: below */
        if (kind == 0 || kind == 5) /* -(-dmin * m): dmin * m, as decode_blocks */
            *mn = _mm512_xor_ps(kscale_group(w->mins, w->mins_d, rb * G + 8 * b + u, 3), _mm512_set1_ps(-0.0f));
    }
}

/* Line l (0..15) of the tiled run at src (one 64-column chunk of 16 rows): its 16 lanes' four codes each, as the
 * tiles take them. The one decode of the tiled layout, for decode_tiled (every line of a chunk, unrolled) and
 * tile_items' fly (a unit's lines as the items meet them). Every shift is 16-bit, and none carries a bit across a byte into the
 * bits kept. */
VNNI static inline ALWAYS __m512i tiled_line(const int kind, const uint8_t *src, const int l) {
    const __m512i n4 = _mm512_set1_epi8(15);
    if (kind == LAYOUT_Q8) /* signed codes + 128: unsigned for vpdpbusd (the offset terms take it back) */
        return _mm512_xor_si512(_mm512_loadu_si512(src + 64 * l), _mm512_set1_epi8((char)0x80));
    if (kind == 0 || kind == 4) { /* 512 bytes: line l's codes are the low nibbles of bytes 64 l, line 8 + l's the high */
        const __m512i v = _mm512_loadu_si512(src + 64 * (l % 8));
        if (kind == 0) /* the high nibbles in place, 16 q, with the odd groups' scales times 1/16 (tiled_unit_scales, as
                        * decode_blocks): one AND instead of a shift and an AND, and every product and sum the same
                        * float (16 D converts exactly where D does, powers of two) */
            return l < 8 ? _mm512_and_si512(v, n4) : _mm512_andnot_si512(n4, v);
        const __m512i table = _mm512_broadcast_i32x4(_mm_add_epi8(_mm_loadu_si128((const __m128i *)IQ4_TABLE), _mm_set1_epi8((char)128)));
        return _mm512_shuffle_epi8(table, _mm512_and_si512(l < 8 ? v : _mm512_srli_epi16(v, 4), n4)); /* IQ4_XS: value + 128 */
    }
    if (kind == KQ_Q2K) { /* codes 0..3: line l's are bits 2 (l / 4) .. of the plane's 64 bytes l % 4 */
        const __m512i v = _mm512_loadu_si512(src + 64 * (l % 4));
        return _mm512_and_si512(l / 4 ? _mm512_srli_epi16(v, 2 * (l / 4)) : v, _mm512_set1_epi8(3));
    }
    if (kind == KQ_Q3K) { /* codes 0..7: the low 2 bits as Q2_K's, the top bit bit l / 2 of the top plane's 64 bytes l % 2
                           * (tiled.py's _tiles), shifted into place and masked there; one vpternlogd joins them */
        const __m512i v = _mm512_loadu_si512(src + 64 * (l % 4)), h = _mm512_loadu_si512(src + 256 + 64 * (l % 2));
        const int at = l / 2, k = l / 4;
        const __m512i top = _mm512_and_si512(at < 2 ? _mm512_slli_epi16(h, 2 - at) : at > 2 ? _mm512_srli_epi16(h, at - 2) : h,
                                             _mm512_set1_epi8(4));
        return _mm512_ternarylogic_epi32(_mm512_set1_epi8(3), k ? _mm512_srli_epi16(v, 2 * k) : v, top, 0xea); /* (lo & 3) | top */
    }
    /* Q5_K (w = 1), Q6_K (w = 2): the nibbles as Q4_K's, then a plane of the codes' top w bits, bits w k .. of its byte i
     * for line (span k + i) / 64. Those bits are shifted straight to bit 4 of each byte and masked there, and one
     * vpternlogd takes the nibble and adds them: three operations a line (four for the high nibbles) where masking the
     * bits at 0 and shifting them up took five or six (Zen 4, one thread, 256 x 2048 in L2: batch 1 0.96x the time,
     * Q6_K and Q5_K). Q6_K's codes are q - 32 + 32: the codes 0..63 its offset terms expect. */
    const int w = kind == 5 ? 1 : 2, parts = 8 / w, span = 1024 / parts, lines = span / 64;
    const int k = l / lines, i = 64 * (l % lines), at = w * k;
    const __m512i v = _mm512_loadu_si512(src + (span * k + i) % 512), h = _mm512_loadu_si512(src + 512 + i);
    const __m512i tops = _mm512_set1_epi8((char)(((1 << w) - 1) << 4)); /* the top bits' place in a code */
    const __m512i top = _mm512_and_si512(at < 4 ? _mm512_slli_epi16(h, 4 - at) : at > 4 ? _mm512_srli_epi16(h, at - 4) : h, tops);
    return _mm512_ternarylogic_epi32(n4, k < parts / 2 ? v : _mm512_srli_epi16(v, 4), top, 0xea); /* (nib & 15) | top */
}

/* Items [i0, i0 + nb) meet the decoded tile of super-block / stretch b (ng groups): acc[i] (16 rows of
 * item i0 + i) += its contribution, in the float sequence the headers state: nd = 1, act holds rounded
 * int8 activations (Act); nd = 3, act holds digit buffers (DIG_*, with the mins' sums of x). Per group
 * (Q6_K: per 16-chunk) in order: one FMA of the scaled dot, then, where the format has them, one of the
 * min. With fz (nb = 1) the integer dots are already in fz: the same integers, so the same floats. With fly
 * (the tiled layout w, row block rb; no t) each line is decoded as the items meet it (tiled_line) and each
 * unit's scales as it starts (tiled_unit_scales): the tile's integers and scales, so the same bits. */
VNNI static inline ALWAYS void tile_items(const int kind, const int nd, const Tile *t, const Fuse *fz, const int fly,
                                          const TiledSrc *w, long rb, int has_mins, const uint8_t *act, long K, long b,
                                          int ng, float *acc, int i0, const int nb) {
    const int q6 = per16(kind), per = q6 ? 16 : 32, units = q6 ? 16 : ng < 8 ? ng : 8; /* Q6_K, Q3_K: per 16-chunk scales */
    const int offset = code_offset(kind);
    const int minus = kmins(kind); /* Q4_K / Q5_K / Q2_K subtract their mins; the layouts add them */
    const long run = fly ? tiled_run_bytes(kind) : 0;
    const uint8_t *src = fly ? tiled_codes(kind, w, K, rb, b) : NULL;
    __m512 s[IT];
    const int8_t *qb[IT]; /* each item's activations of this block (digits: its block, planes at DIG_Q + 256 p) */
    Act ai[IT];           /* int8: each item's scales and sums */
    for (int i = 0; i < nb; i++) {
        s[i] = _mm512_loadu_ps(acc + 16 * i);
        if (nd == 1) ai[i] = act_at(act, K, i0 + i);
        qb[i] = nd == 1 ? ai[i].q + 256 * b : (const int8_t *)dig_block(act, K, i0 + i, b);
    }
    for (int u = 0; u < units; u++) {
        /* DD[i][p]: item i's dot of unit u in plane p (int8: one plane; digits: three), each from its offset
         * term. Through the tile (no fz) each code register is loaded once, into every item's chains. */
        __m512i DD[IT][3];
        for (int i = 0; i < nb; i++)
            for (int p = 0; p < nd; p++) {
                const __m512i from = nd == 3 ? digits_from((const uint8_t *)qb[i], u, p, offset) : int8_from(&ai[i], b, u, offset);
                DD[i][p] = !fz ? from : _mm512_add_epi32(from, q6 ? fz->d[p][u] : _mm512_add_epi32(fz->d[p][2 * u], fz->d[p][2 * u + 1]));
            }
        if (!fz)
#pragma GCC unroll 8
            for (int j = 0; j < per / 4; j++) { /* unrolled: every offset from qb[i] a constant */
                const int line = u * per / 4 + j;
                const __m512i c = fly ? tiled_line(kind, src + line / 16 * run, line % 16) : t->c[line];
                for (int i = 0; i < nb; i++)
                    for (int p = 0; p < nd; p++)
                        DD[i][p] = dot4(DD[i][p], c, qb[i] + DIG_Q + 256 * p + per * u + 4 * j);
            }
        __m512 fsc, fmn;
        if (fly) tiled_unit_scales(kind, w, K, rb, b, u, &fsc, &fmn);
        const __m512 sc = fly ? fsc : t->sc[u], *mn = fly ? &fmn : &t->mn[u];
        for (int i = 0; i < nb; i++) {
            if (nd == 3) {
                s[i] = digits_unit(sc, has_mins ? mn : NULL, (const uint8_t *)qb[i], u, q6, has_mins, minus, DD[i], s[i]);
                continue;
            }
            s[i] = int8_unit(sc, mn, &ai[i], b, u, q6, has_mins, minus, DD[i][0], s[i]);
        }
    }
    for (int i = 0; i < nb; i++) _mm512_storeu_ps(acc + 16 * i, s[i]);
}

/* F(k, ...) with the kind a constant k, so the inlined loops keep no kind test. */
#define KIND_CONST(F, kind, ...)                                                                     \
    do {                                                                                             \
        if ((kind) == 0) { F(0, __VA_ARGS__); }                                                      \
        else if ((kind) == 1) { F(1, __VA_ARGS__); }                                                 \
        else if ((kind) == 4) { F(4, __VA_ARGS__); }                                                 \
        else if ((kind) == 5) { F(5, __VA_ARGS__); }                                                 \
        else if ((kind) == LAYOUT_Q4) { F(LAYOUT_Q4, __VA_ARGS__); }                                 \
        else { F(LAYOUT_Q8, __VA_ARGS__); }                                                          \
    } while (0)

/* F(k, ...) for a kind the digits' tiles take (the block kinds, LAYOUT_Q8: Q8_0 in the tiled layout, and
 * KQ_Q3K: Q3_K, which only the tiled layout holds). */
#define TILED_CONST(F, kind, ...)                                                                    \
    do {                                                                                             \
        if ((kind) == LAYOUT_Q8) { F(LAYOUT_Q8, __VA_ARGS__); }                                      \
        else if ((kind) == KQ_Q3K) { F(KQ_Q3K, __VA_ARGS__); }                                       \
        else if ((kind) == KQ_Q2K) { F(KQ_Q2K, __VA_ARGS__); }                                       \
        else { BLOCK_CONST(F, kind, __VA_ARGS__); }                                                  \
    } while (0)

/* F(k, ...) for a tiled kind with an int8 kernel (quill_gemv_tiled_i8's: the block kinds, LAYOUT_Q8). */
#define I8_TILED_CONST(F, kind, ...)                                                                 \
    do {                                                                                             \
        if ((kind) == LAYOUT_Q8) { F(LAYOUT_Q8, __VA_ARGS__); }                                      \
        else { BLOCK_CONST(F, kind, __VA_ARGS__); }                                                  \
    } while (0)

#define ITEMS_I8(k, ...) NB_SWITCH(tile_items, k, 1, __VA_ARGS__)
#define ITEMS_DIGITS(k, ...) NB_SWITCH(tile_items, k, 3, __VA_ARGS__)
VNNI static void items_pass(int kind, int nd, const Tile *t, int has_mins, const uint8_t *act, long K,
                            long b, int ng, float *acc, int i0, int nb) {
    if (nd == 3) TILED_CONST(ITEMS_DIGITS, kind, t, NULL, 0, NULL, 0, has_mins, act, K, b, ng, acc, i0);
    else KIND_CONST(ITEMS_I8, kind, t, NULL, 0, NULL, 0, has_mins, act, K, b, ng, acc, i0);
}

VNNI static inline ALWAYS void decode_kind(const int kind, const uint8_t *const *rows, const uint8_t *const *srows,
                                           const uint8_t *const *mrows, long b, int ng, Tile *t, Fuse *f) {
    if (kind >= LAYOUT_Q4) decode_layout(kind == LAYOUT_Q8, rows, srows, mrows, b, ng, t, f);
    else decode_blocks(kind, rows, b, t, f);
}

VNNI static void decode_any(int kind, const uint8_t *const *rows, const uint8_t *const *srows,
                            const uint8_t *const *mrows, long b, int ng, Tile *t) {
    KIND_CONST(decode_kind, kind, rows, srows, mrows, b, ng, t, NULL);
}

/* A fused pass (one item): decode straight into the item's dots (nd planes), then its floats. */
VNNI static inline ALWAYS void one_item_k(const int kind, const int nd, const uint8_t *const *rows,
                                          const uint8_t *const *srows, const uint8_t *const *mrows, long b, int ng,
                                          int has_mins, const uint8_t *act, long K, float *acc, int item) {
    Tile t;
    Fuse f;
    f.nd = nd;
    for (int p = 0; p < nd; p++) {
        for (int k = 0; k < 16; k++) f.d[p][k] = _mm512_setzero_si512();
        f.q[p] = nd == 1 ? act_at(act, K, item).q + 256 * b : (const int8_t *)dig_block(act, K, item, b) + DIG_Q + 256 * p;
    }
    decode_kind(kind, rows, srows, mrows, b, ng, &t, &f);
    tile_items(kind, nd, &t, &f, 0, NULL, 0, has_mins, act, K, b, ng, acc, item, 1);
}

/* ng a constant wherever it is 8 (every block, every whole stretch): the indices stay constants */
#define ONE_ITEM_I8(k, ...) one_item_k(k, 1, rows, srows, mrows, b, 8, __VA_ARGS__)
#define ONE_ITEM_DIGITS(k, ...) one_item_k(k, 3, rows, srows, mrows, b, 8, __VA_ARGS__)
VNNI static void one_item(int kind, int nd, const uint8_t *const *rows, const uint8_t *const *srows,
                          const uint8_t *const *mrows, long b, int ng, int has_mins, const uint8_t *act,
                          long K, float *acc, int item) {
    if (nd == 3) /* the block kinds */
        BLOCK_CONST(ONE_ITEM_DIGITS, kind, has_mins, act, K, acc, item);
    else if (ng < 8) /* a layout's last, shorter stretch */
        one_item_k(kind == LAYOUT_Q4 ? LAYOUT_Q4 : LAYOUT_Q8, 1, rows, srows, mrows, b, ng, has_mins, act, K, acc, item);
    else
        KIND_CONST(ONE_ITEM_I8, kind, has_mins, act, K, acc, item);
}

/* out (B, ld) columns [0, N) for the VNNI tiles: items in chunks (CHUNK with int8 activations, DCHUNK with
 * digits: their planes stay in L2, or L3 for the widest inputs), each chunk meeting every 16-row tile (tiles
 * split among threads); within a tile, each super-block / stretch is decoded once and meets the chunk's
 * items IT (digits: DIT) at a time (a chunk of one item: one_item). A last partial tile repeats row N - 1
 * and stores only its real rows. DCHUNK matters only above 16 items (a prefill): 512-token prefill on the
 * Zen 4, in-engine, 64 against 16: 1B Q4_K_M 1.037x the tokens per second (32: 1.023x), Q8_0 1.125x. */
#define DCHUNK 64
#define DIT 6 /* items per pass over a decoded tile with digits: 3 chains each, 18 in all (8: spills) */
VNNI static void tile_gemm(int kind, int nd, const uint8_t *codes, const float *scale, const float *mins,
                           const uint8_t *act, long K, int N, int B, float *out, int ld, int threads) {
    const int layout = kind >= LAYOUT_Q4, G = (int)(K / 32), nblk = (G + 7) / 8, per_pass = nd == 3 ? DCHUNK : CHUNK;
    const int it = nd == 3 ? DIT : IT;
    const long row_bytes = layout ? (long)G * (kind == LAYOUT_Q8 ? 32 : 16) : (long)(K / 256) * super_bytes(kind);
    const int tiles = (N + 15) / 16, has_mins = layout ? mins != NULL : kind == 0 || kind == 5;
    for (int c0 = 0; c0 < B; c0 += per_pass) {
        const int nc = B - c0 < per_pass ? B - c0 : per_pass;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
        for (int tile = 0; tile < tiles; tile++) {
            const uint8_t *rows[16], *srows[16], *mrows[16];
            for (int r = 0; r < 16; r++) {
                const long n = 16L * tile + r < N ? 16L * tile + r : N - 1;
                rows[r] = codes + n * row_bytes;
                srows[r] = layout ? (const uint8_t *)(scale + n * G) : NULL;
                mrows[r] = layout && mins ? (const uint8_t *)(mins + n * G) : NULL;
            }
            Tile t;
            float acc[CHUNK * 16] __attribute__((aligned(64)));
            memset(acc, 0, sizeof(float) * 16 * nc);
            for (long b = 0; b < nblk; b++) {
                const int ng = layout && G - 8 * b < 8 ? (int)(G - 8 * b) : 8;
                if (tile + 1 < tiles) { /* the next tile's rows in address order, a sixteenth per b: sixteen
                                           * streams at once would defeat the hardware prefetcher */
                    const long rows_next = 16L * tile + 32 <= N ? 16 : N - 16L * tile - 16;
                    prefetch_part((const char *)(codes + (16L * tile + 16) * row_bytes), rows_next * row_bytes, b, nblk);
                    if (layout) prefetch_part((const char *)(scale + (16L * tile + 16) * G), rows_next * G * 4, b, nblk);
                    if (layout && mins) prefetch_part((const char *)(mins + (16L * tile + 16) * G), rows_next * G * 4, b, nblk);
                }
                if (nc == 1) {
                    one_item(kind, nd, rows, srows, mins ? mrows : NULL, b, ng, has_mins, act, K, acc, c0);
                    continue;
                }
                decode_any(kind, rows, srows, mins ? mrows : NULL, b, ng, &t);
                for (int i0 = 0; i0 < nc; i0 += it) {
                    const int nb = nc - i0 < it ? nc - i0 : it;
                    items_pass(kind, nd, &t, has_mins, act, K, b, ng, acc + 16 * i0, c0 + i0, nb);
                }
            }
            const int real = N - 16 * tile < 16 ? N - 16 * tile : 16;
            const __mmask16 keep = (__mmask16)((1u << real) - 1);
            for (int i = 0; i < nc; i++) _mm512_mask_storeu_ps(out + (long)(c0 + i) * ld + 16L * tile, keep, _mm512_loadu_ps(acc + 16 * i));
        }
    }
}

/* 1 where `kind` (kquant.c's block kinds, LAYOUT_Q4, LAYOUT_Q8) has an int8 kernel: every CPU the kernels
 * run on (AVX2) has one for these. */
int quill_i8_supported(int kind) {
    return tile_block_kind(kind) || kind == LAYOUT_Q4 || kind == LAYOUT_Q8;
}

/* out (B, ld) columns [0, N) = x (B, K) @ W.T with x rounded as above. W: `kind`'s blocks (0 Q4_K,
 * 1 Q6_K, 4 IQ4_XS, 5 Q5_K; K a multiple of 256), or LAYOUT_Q4 / LAYOUT_Q8 codes with per-group scale
 * and mins (mins may be NULL: all zero). act: scratch of quill_act8_bytes(B, K) bytes. isa: 512 = the
 * VNNI tiles where the CPU has VNNI, else kquant_i8_avx2.c's (8-row tiles for the block kinds, rows for
 * the layouts). Returns 0, or -1 (nothing written) where the kind has no int8 kernel. */
int quill_gemv_i8(int kind, const uint8_t *codes, const float *scale, const float *mins, const float *x,
                  uint8_t *act, float *out, int N, int K, int B, int ld, int isa, int threads) {
    if (!quill_i8_supported(kind) || K % (kind >= LAYOUT_Q4 ? 32 : 256)) return -1;
    quill_act8_quantize(x, act, B, K, threads);
    if (isa >= 512 && quill_hw_vnni()) {
        tile_gemm(kind, 1, codes, scale, mins, act, K, N, B, out, ld, threads);
        return 0;
    }
    quill_i8_tiles_avx2(kind, codes, scale, mins, act, K, N, B, out, ld, threads);
    return 0;
}

/* Bytes of quill_gemv_tiles_exact's digits for B items of K inputs. */
long quill_digits_bytes(int B, int K) { return (long)B * dig_bytes(K); }

/* out (B, ld) columns [0, N) = x (B, K) @ W.T with x exact (its digits, above), on the VNNI CPUs' tiles,
 * for W in the block kinds 0 Q4_K, 1 Q6_K, 4 IQ4_XS, 5 Q5_K (K a multiple of 256). xs: each item's K / 32
 * sums of x per 32 weights (the mins' terms; read for Q4_K and Q5_K), made by the caller (kquant.c, which
 * makes them for its rows too); digits: scratch of quill_digits_bytes(B, K). Returns 0, or -1 (nothing
 * written) where this CPU or the kind has no tile kernel, for kquant.c to run its rows. The q4 / q8
 * layouts keep their rows (quant_gemv.c). */
int quill_gemv_tiles_exact(int kind, const uint8_t *blocks, const float *x, const float *xs, uint8_t *digits, float *out,
                           int N, int K, int B, int ld, int threads) {
    if (!quill_hw_vnni() || !tile_block_kind(kind) || K % 256) return -1;
    split_digits(kind, x, xs, digits, B, K, threads);
    tile_gemm(kind, 3, blocks, NULL, NULL, digits, K, N, B, out, ld, threads);
    return 0;
}

/* ---- The same exact tiles, reading the tiled layout (amx_gemv.c's header; quill/kernels/tiled.py) ----
 *
 * On CPUs with VNNI but without AMX (AMD Zen 4, or AMX turned off), the K-quant weights can take the AMX
 * tiled layout too: for each 16 rows, the codes of each 64 columns in one run of 512 bytes (q4, iq4), 640
 * (q5) or 768 (q6) whose 64-byte lines are already what the tiles above build from the file's blocks with
 * transpose16 (line kk, lane r: row r's codes of columns 4kk .. 4kk + 3), then the 16 rows' int8 scales
 * and mins side by side with one fp16 factor per 256 columns. So a super-block of 16 rows is one
 * contiguous read and needs no transposes: read from memory, 16 rows of GGUF blocks 1152 bytes apart took
 * 1.23-1.38x their in-cache time on the Intel Xeon, one contiguous tile 1.08x.
 *
 * decode_tiled fills the same Tile (or the same fused dots) as decode_blocks, with the same integers and
 * scales: Q4_K's codes are the plain nibbles where decode_blocks keeps the odd groups' high nibbles in
 * place (16 times the value) and scales them by 1/16, which leaves every product and sum the same float;
 * Q6_K's tiles hold q - 32 (32 is added back: the codes 0..63 the offset terms expect), IQ4_XS's the
 * table's signed values (+128 as decode_blocks makes them), and the tiled mins are -dmin times m (negated
 * back, exactly). So the outputs are bit-identical to quill_gemv_tiles_exact's on the blocks.
 *
 * Q8_0 tiles too (kind LAYOUT_Q8 here: 1024 bytes of signed codes per run, the file's fp16 scale per 32
 * weights, no mins): its codes + 128 meet the digits as IQ4_XS's do, with the same offset terms, so a
 * batch of items reuses each decoded line as for the K-quants, where the q8 rows (quant_gemv.c) spend
 * one fp32 FMA per weight per item. */

#define FUSE_ITEMS 2 /* items decode_tiled dots at once, straight from the codes */
#define FUSE_BATCH 4 /* batches up to this many go FUSE_ITEMS at a time without the stored tile */



/* One chunk's (64 columns') three planes' dots acc[p][k] (over lines 4k .. 4k + 3) -> the item's 16 sums s, unit
 * by unit (Q6_K: its four 16-chunks; the others: their two groups; sc[j] and mn[j]: unit j's scales and mins,
 * tiled_unit_scales'): each unit's dot from its dots, which decode_tiled started from the unit's offset term
 * (integers, exact in any order), then digits_unit, as tile_items does over stored dots. So the sums
 * are bit-identical to those, without the 48 stores and loads per super-block that cost a Zen 4 (a 512-bit
 * store there takes 2.4 cycles) more than a quarter of its batch-1 time. */
VNNI static inline ALWAYS void fuse_chunk(const int kind, const int nd, const __m512 *sc, const __m512 *mn, const uint8_t *blk,
                                          const Act *a, long b, __m512i acc[3][4], int cc, const int lpa, __m512 *s) {
    const int q6 = per16(kind), per = q6 ? 4 : 2;
    const int mins = kmins(kind);
    for (int j = 0; j < per; j++) {
        const int u = per * cc + j;
        __m512i D[3]; /* lpa: lines per accumulator, 4 (a unit's dot in one or two of them) or 8 (one) */
        for (int p = 0; p < nd; p++) /* (the offset terms are in, decode_tiled starts each unit's dots from them) */
            D[p] = q6 || lpa == 8 ? acc[p][j] : _mm512_add_epi32(acc[p][2 * j], acc[p][2 * j + 1]);
        *s = nd == 3 ? digits_unit(sc[j], &mn[j], blk, u, q6, mins, mins, D, *s)
                     : int8_unit(sc[j], &mn[j], a, b, u, q6, mins, mins, D[0], *s);
    }
}

/* Super-block b of row block rb -> t, as decode_blocks would leave it (ni = 0); or the dots of ni items
 * (blks[i]: item i's digit block of super-block b, its three planes at DIG_Q) combined chunk by chunk into
 * their 16 sums s[i] (fuse_chunk). One item keeps four lines per accumulator, so six dot chains are open at
 * once for vpdpbusd's latency; two keep a whole unit's lines in one (Q6_K: four lines, its unit), so their
 * 12 (Q6_K: 24) accumulators stay in registers. The integer dots are the same either way. */
VNNI static inline ALWAYS void decode_tiled(const int kind, const TiledSrc *w, long K, long rb, long b, Tile *t,
                                            const int ni, const int nd, const uint8_t *const *blks, const Act *acts, __m512 *s) {
    const long run = tiled_run_bytes(kind);
    const uint8_t *src = tiled_codes(kind, w, K, rb, b);
    for (int u = 0; !ni && u < (per16(kind) ? 16 : 8); u++) { /* the tile's (a fused pass takes them chunk by chunk) */
        __m512 mn;
        tiled_unit_scales(kind, w, K, rb, b, u, &t->sc[u], &mn);
        if (kmins(kind)) t->mn[u] = mn;
    }
    const int lpa = ni > 1 && !per16(kind) ? 8 : 4;
#pragma GCC unroll 1
    for (int cc = 0; cc < 4; cc++, src += run) { /* a chunk at a time: its 16 lines unrolled, its dots in registers */
        __m512i acc[FUSE_ITEMS][3][4];
        for (int i = 0; i < ni; i++)
            for (int p = 0; p < nd; p++)
                for (int k = 0; k < 16 / lpa; k++) { /* each unit's first accumulator starts from its offset term
                                                         * (fuse_chunk then adds the dots alone): integers, so the
                                                         * same sums, and 3 fewer additions per unit. Zen 4, one
                                                         * thread, 256 x 2048 in L2, batch 1: Q6_K 0.945x the time,
                                                         * IQ4_XS 0.96x, Q8_0 0.98x (Q4_K and Q5_K have no offset) */
                    const int line = 16 * cc + lpa * k, unit_lines = per16(kind) ? 4 : 8; /* a 16-chunk or a group */
                    acc[i][p][k] = line % unit_lines ? _mm512_setzero_si512()
                                   : nd == 1 ? int8_from(&acts[i], b, line / unit_lines, code_offset(kind))
                                             : digits_from(blks[i], line / unit_lines, p, code_offset(kind));
                }
#define PUT(line, v)                                                                                          \
    do {                                                                                                      \
        const __m512i v_ = (v);                                                                               \
        if (!ni) t->c[16 * cc + (line)] = v_;                                                                 \
        const int l_ = (line); /* (before the loops: a caller's line index may be called i) */              \
        for (int i_ = 0; i_ < ni; i_++) /* blks: item_inputs' */                                          \
            for (int p_ = 0; p_ < nd; p_++)                                                                   \
                acc[i_][p_][l_ / lpa] = dot4(acc[i_][p_][l_ / lpa], v_,                                       \
                                             (const int8_t *)item_plane(blks[i_], nd, p_) + 4 * (16 * cc + l_));   \
    } while (0)
#pragma GCC unroll 16
        for (int l = 0; l < 16; l++) PUT(l, tiled_line(kind, src, l));
#undef PUT
        if (ni) {
            const int per = per16(kind) ? 4 : 2;
            __m512 sc[4], mn[4];
            for (int j = 0; j < per; j++) tiled_unit_scales(kind, w, K, rb, b, per * cc + j, &sc[j], &mn[j]);
            for (int i = 0; i < ni; i++) fuse_chunk(kind, nd, sc, mn, blks[i], nd == 1 ? &acts[i] : NULL, b, acc[i], cc, lpa, &s[i]);
        }
    }
}

VNNI static void decode_tiled_any(int kind, const TiledSrc *w, long K, long rb, long b, Tile *t) {
#define DECODE_TILED(k, ...) decode_tiled(k, __VA_ARGS__)
    TILED_CONST(DECODE_TILED, kind, w, K, rb, b, t, 0, 3, NULL, NULL, NULL);
#undef DECODE_TILED
}

/* Passes over a super-block's codes (of `it` items each) up to which decoding each line again in every pass
 * (tile_items' fly) beats storing the decoded tile once and reading it back (a 512-bit store takes a Zen 4 2.4 cycles):
 * Q4_K, IQ4_XS and Q8_0, whose lines take one or two operations, two; the kinds whose lines join a plane of top
 * bits, one. Zen 4, 8192 x 2048 from memory, two threads, GB/s of the weights, stored tile -> decoded as met, int8
 * activations: Q4_K batch 8 12.1-12.2 -> 15.2-15.4, batch 16 (two passes) 7.8-8.2 -> 8.9; Q5_K batch 8
 * 14.4-15.2 -> 16.9-17.6; but Q6_K batch 16 8.4-8.6 -> 6.7-7.2, so it stays at one pass. In the engine, 1B
 * Q4_K_M, int8, batch 8: 125.9 -> 131.2 tok/s (medians of three alternating runs). */
static inline int fly_passes(int kind) { return kind == 0 || kind == 4 || kind == LAYOUT_Q8 ? 2 : 1; }

/* items_pass on the tiled layout without a stored tile (tile_items' fly). */
VNNI static void fly_pass(int kind, int nd, const TiledSrc *w, long rb, const uint8_t *act, long K, long b, float *acc, int i0,
                          int nb) {
    if (nd == 3) TILED_CONST(ITEMS_DIGITS, kind, NULL, NULL, 1, w, rb, kmins(kind), act, K, b, 8, acc, i0);
    else I8_TILED_CONST(ITEMS_I8, kind, NULL, NULL, 1, w, rb, kmins(kind), act, K, b, 8, acc, i0);
}

/* one_item_k for the tiled layout: decode straight into the ni items' three digit planes' dots (items
 * item .. item + ni - 1, sums at acc), each chunk's combined into the items' sums as it ends (fuse_chunk). */
VNNI static inline ALWAYS void fused_tiled_k(const int kind, const int ni, const int nd, const TiledSrc *w, long K, long rb,
                                             long b, const uint8_t *act, float *acc, int item) {
    Tile t;
    const uint8_t *blks[FUSE_ITEMS];
    Act acts[FUSE_ITEMS];
    __m512 s[FUSE_ITEMS];
    for (int i = 0; i < ni; i++) {
        blks[i] = item_inputs(act, nd, K, item + i, b, &acts[i]);
        s[i] = _mm512_loadu_ps(acc + 16 * i);
    }
    decode_tiled(kind, w, K, rb, b, &t, ni, nd, blks, acts, s);
    for (int i = 0; i < ni; i++) _mm512_storeu_ps(acc + 16 * i, s[i]);
}

/* ni (1 or 2) items, nd = 3: digits, 1: int8 activations (kinds with an int8 kernel only). */
VNNI static void fused_tiled(int kind, int ni, int nd, const TiledSrc *w, long K, long rb, long b, const uint8_t *act,
                             float *acc, int item) {
#define ONE_TILED(k, ...) fused_tiled_k(k, 1, 3, __VA_ARGS__)
#define TWO_TILED(k, ...) fused_tiled_k(k, 2, 3, __VA_ARGS__)
#define ONE_I8(k, ...) fused_tiled_k(k, 1, 1, __VA_ARGS__)
#define TWO_I8(k, ...) fused_tiled_k(k, 2, 1, __VA_ARGS__)
    if (nd == 1 && ni == 1) I8_TILED_CONST(ONE_I8, kind, w, K, rb, b, act, acc, item);
    else if (nd == 1) I8_TILED_CONST(TWO_I8, kind, w, K, rb, b, act, acc, item);
    else if (ni == 1) TILED_CONST(ONE_TILED, kind, w, K, rb, b, act, acc, item);
    else TILED_CONST(TWO_TILED, kind, w, K, rb, b, act, acc, item);
#undef ONE_TILED
#undef TWO_TILED
#undef ONE_I8
#undef TWO_I8
}


/* tile_gemm's loop over the tiled layout (N a multiple of 16), with digits (nd = 3) or int8 activations
 * (nd = 1, act: quill_act8_quantize's; decode_tiled's integers and scales are decode_blocks', and int8_unit
 * the float sequence, so each row is the blocks' int8 kernel's bits): each thread's row blocks are
 * one stream, asked for ahead as tiled_ahead says, dealt (deal.h)
 * so that a thread done with its own takes the others' last ones: the whole 1B Q4_K_M model at batch 1
 * on the AMD EPYC Zen 4, in-engine A/B, 1.026x the tokens per second (3B: 1.048x), the closing barrier's
 * wait from 11% of the samples to under 1%. Each super-block meets the items in pairs straight from the codes
 * (batches up to FUSE_BATCH), `it` at a time with each line decoded as they meet it (up to fly_passes), or through
 * the decoded tile stored once. */
VNNI static void tiled_gemm(int kind, int nd, const TiledSrc *w, const uint8_t *act, long K, int N, int B, float *out,
                            int ld, int threads) {
    const long nblk = K / 256, run = tiled_run_bytes(kind), C = K / 64;
    const int RB = N / 16, has_mins = kmins(kind), per_pass = nd == 3 ? DCHUNK : CHUNK, it = nd == 3 ? DIT : IT;
    for (int c0 = 0; c0 < B; c0 += per_pass) {
        const int nc = B - c0 < per_pass ? B - c0 : per_pass, ahead = tiled_ahead(kind, nc);
        const int nt = threads > 0 ? threads : 1;
        Deal deals[nt];
        deal_init(deals, nt, RB);
#pragma omp parallel num_threads(nt)
        for (long rb; (rb = deal_next(deals, omp_get_thread_num(), nt)) >= 0;) {
            Tile t;
            float acc[DCHUNK * 16] __attribute__((aligned(64)));
            memset(acc, 0, sizeof(float) * 16 * nc);
            for (long b = 0; b < nblk; b++) {
                tiled_prefetch(ahead, kind, w, nblk, C, run, rb, b);
                if (nc <= FUSE_BATCH) { /* the items in pairs (an odd one alone), each straight from the codes */
                    for (int i = 0; i < nc; i += FUSE_ITEMS)
                        fused_tiled(kind, nc - i < FUSE_ITEMS ? nc - i : FUSE_ITEMS, nd, w, K, rb, b, act, acc + 16 * i, c0 + i);
                    continue;
                }
                if ((nc + it - 1) / it <= fly_passes(kind)) { /* it items a pass, each line decoded in every pass */
                    for (int i0 = 0; i0 < nc; i0 += it)
                        fly_pass(kind, nd, w, rb, act, K, b, acc + 16 * i0, c0 + i0, nc - i0 < it ? nc - i0 : it);
                    continue;
                }
                decode_tiled_any(kind, w, K, rb, b, &t);
                for (int i0 = 0; i0 < nc; i0 += it) {
                    const int nb = nc - i0 < it ? nc - i0 : it;
                    items_pass(kind, nd, &t, has_mins, act, K, b, 8, acc + 16 * i0, c0 + i0, nb);
                }
            }
            for (int i = 0; i < nc; i++) _mm512_storeu_ps(out + (long)(c0 + i) * ld + 16L * rb, _mm512_loadu_ps(acc + 16 * i));
        }
    }
}

/* quill_gemv_tiles_exact for a weight in the tiled layout: kind 0 Q4_K, 1 Q6_K, 4 IQ4_XS, 5 Q5_K, or
 * LAYOUT_Q8 (Q8_0: int8 codes, fp16 scales, scale_d and mins NULL); codes, scale, mins, scale_d, mins_d as
 * amx_gemv.c's header states (mins NULL for Q6_K and IQ4_XS); N a multiple of 16, K of 256; xs and digits
 * as there. Returns 0, or -1 (nothing written) without VNNI or for another kind or shape. */
int quill_gemv_tiled_exact(int kind, const uint8_t *codes, const int8_t *scale, const int8_t *mins,
                           const uint16_t *scale_d, const uint16_t *mins_d, const float *x, const float *xs,
                           uint8_t *digits, float *out, int N, int K, int B, int ld, int threads) {
    const TiledSrc w = {codes, scale, mins, scale_d, mins_d};
    if (!quill_hw_vnni() || !(tile_block_kind(kind) || kind == LAYOUT_Q8 || kind == KQ_Q3K || kind == KQ_Q2K) ||
        !tiled_src_fits(kind, &w, K, N))
        return -1;
    split_digits(kind, x, xs, digits, B, K, threads);
    tiled_gemm(kind, 3, &w, digits, K, N, B, out, ld, threads);
    return 0;
}

/* quill_gemv_i8 (x rounded to int8 per 32, the header's Act) for a weight in the tiled layout: kinds 0 Q4_K,
 * 1 Q6_K, 4 IQ4_XS, 5 Q5_K and LAYOUT_Q8, whose blocks have an int8 kernel (Q3_K and Q2_K have none); the
 * same outputs, bit for bit, as quill_gemv_i8 on the weight's blocks (the decoded tile is theirs). act: scratch
 * of quill_act8_bytes(B, K). Returns 0, or -1 (nothing written) without VNNI or for another kind or shape. */
int quill_gemv_tiled_i8(int kind, const uint8_t *codes, const int8_t *scale, const int8_t *mins,
                        const uint16_t *scale_d, const uint16_t *mins_d, const float *x, uint8_t *act, float *out,
                        int N, int K, int B, int ld, int threads) {
    const TiledSrc w = {codes, scale, mins, scale_d, mins_d};
    if (!quill_hw_vnni() || !(tile_block_kind(kind) || kind == LAYOUT_Q8) || !tiled_src_fits(kind, &w, K, N)) return -1;
    quill_act8_quantize(x, act, B, K, threads);
    tiled_gemm(kind, 1, &w, act, K, N, B, out, ld, threads);
    return 0;
}
