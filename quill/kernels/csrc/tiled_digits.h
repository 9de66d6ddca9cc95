/* What the exact digit tiles share: kquant_i8.c's (AVX-512 VNNI) and tiled_avx2.c's (AVX2, the same integer
 * dots with vpmaddubsw) -- the block kinds' facts, the digit buffers' layout, the tiled layout's runs and how
 * a pass asks for them ahead. Both kernels read the same buffers and the same weights and give the same bits. */
#ifndef QUILL_TILED_DIGITS_H
#define QUILL_TILED_DIGITS_H
#include "isa.h"

#include "kquant_i8.h"
#include "simd.h"
#include <stdint.h>

#ifndef ALWAYS
#define ALWAYS __attribute__((always_inline))
#endif

#define KQ_Q2K 8 /* kquant.c's block kinds of Q2_K and Q3_K: on the VNNI tiles only in the tiled layout (tiled.py's */
#define KQ_Q3K 9 /* q2 and q3) */
/* Whether a kind's scales (and digit units) are per 16 weights: Q6_K's, Q3_K's and Q2_K's. */
static inline int per16(int kind) { return kind == 1 || kind == KQ_Q3K || kind == KQ_Q2K; }
/* Whether a kind's weights are d sc q - dmin m (mins subtracted per unit): Q4_K, Q5_K, Q2_K. */
static inline int kmins(int kind) { return kind == 0 || kind == 5 || kind == KQ_Q2K; }

/* The exact path's activations (quill_gemv_tiles_exact): x's digits (digits.h), per item and
 * 32-element group, in one buffer per item of K / 256 blocks of 1024 bytes, block b holding all that
 * super-block b's dots read (so one pointer per item reaches it at constant offsets):
 *   DIG_Q   3 planes of 256 int8 (digit p of element 256 b + k at 256 p + k)
 *   DIG_UNIT 8 fp32: each group's unit
 *   DIG_XS  8 fp32: each group's exact sum of x (the caller's xs, for the mins of Q4_K and Q5_K; the
 *           other kinds neither write nor read it)
 *   DIG_FROM 16 x 3 int32: per scale unit (Q6_K: 16-chunk; IQ4_XS: group) and plane, that plane's share
 *           of the format's offset: Q6_K -32, Q3_K -4, IQ4_XS and Q8_0 -128 times the plane's digit sum over
 *           the unit (Q4_K and Q5_K have no offset: not written, not read; Q2_K, which has none, keeps its
 *           two sums of x per group there, as fp32, for its mins per 16 weights).
 * Each plane meets the decoded codes in the same integer dots as the int8 activations, starting from its
 * offset term; per group (Q6_K: per 16-chunk) the three dots are exact integers below 2^20, recombined as
 * d0 + 2^8 d1 in int32 (exact), then one FMA of 2^16 d2 in fp32: the group's dot with x / unit, rounded
 * once or twice as an fp32 sum would be. */
enum { DIG_Q = 0, DIG_UNIT = 768, DIG_XS = 800, DIG_FROM = 832, DIG_BLOCK = 1024 };
static inline long dig_bytes(long K) { return K / 256 * DIG_BLOCK; }

/* The offset a kind's unsigned codes carry, which the offset terms take back: Q6_K's codes are q (0..63) for
 * q - 32, IQ4_XS's table values and Q8_0's signed codes are + 128; Q4_K and Q5_K have none. */
static inline int code_offset(int kind) {
    return kind == 1 ? 32 : kind == KQ_Q3K ? 4 : kind == 4 || kind == LAYOUT_Q8 ? 128 : 0;
}

/* Item b's block `blk` of the digit buffers at buf. */
static inline const uint8_t *dig_block(const uint8_t *buf, long K, int b, long blk) {
    return buf + (long)b * dig_bytes(K) + DIG_BLOCK * blk;
}

/* Bytes of one 64-column run of 16 rows' codes in the tiled layout, per block kind. */
static inline long tiled_run_bytes(int kind) {
    return kind == LAYOUT_Q8 ? 1024 : kind == 1 ? 768 : kind == 5 ? 640 : kind == KQ_Q3K ? 384 : kind == KQ_Q2K ? 256 : 512;
}

typedef struct {
    const uint8_t *codes;
    const int8_t *scale, *mins;
    const uint16_t *scale_d, *mins_d;
} TiledSrc;

/* Where super-block b of row block rb starts in w's codes: its four 64-column runs of tiled_run_bytes(kind) each. */
static inline const uint8_t *tiled_codes(int kind, const TiledSrc *w, long K, long rb, long b) {
    return w->codes + (rb * (K / 64) + 4 * b) * tiled_run_bytes(kind);
}

/* 1 where a tiled weight of block kind `kind` (one of the tiled kernels') fits them: K a multiple of 256, N of
 * 16, and the scale streams the kind needs (Q4_K, Q5_K: mins and their factors; Q2_K: both factors; Q8_0: no
 * mins). The one check for every tiled entry (kquant_i8.c's, tiled_avx2.c's), each of which adds its kinds. */
static inline int tiled_src_fits(int kind, const TiledSrc *w, long K, int N) {
    if (K % 256 || N % 16) return 0;
    if (kind == KQ_Q2K && !(w->scale_d && w->mins_d)) return 0;
    if ((kind == 0 || kind == 5) && !(w->mins && w->mins_d)) return 0;
    return !(kind == LAYOUT_Q8 && w->mins);
}

/* Item `item`'s inputs for super-block b: with digits (nd = 3, act: digit buffers) its digit block, whose plane
 * p starts at item_plane's; with int8 activations (nd = 1, act: quill_act8_quantize's) its 256 values, and *a
 * its Act (the scales and sums the float sequence reads). */
static inline const uint8_t *item_inputs(const uint8_t *act, int nd, long K, int item, long b, Act *a) {
    if (nd == 3) return dig_block(act, K, item, b);
    *a = act_at(act, K, item);
    return (const uint8_t *)(a->q + 256 * b);
}

/* Plane p of an item's inputs (item_inputs): a digit block's plane at DIG_Q, or the int8 values themselves. */
static inline const uint8_t *item_plane(const uint8_t *blk, int nd, int p) {
    return nd == 3 ? blk + DIG_Q + 256 * p : blk;
}

/* How a pass over the tiled layout asks for its weights ahead (each stream: the codes, and the scale
 * streams apart from them). A fact about the CPU and the pass, probed once; the outputs are the same
 * bits whichever form runs.
 * - AHEAD_BOTH (simd.h's prefetch_block: into L2 far ahead, then into L1 near) on CPUs other than AMD's:
 *   from memory at batch 1, 16384 x 2048 x 22 copies, AMX off on the Intel Xeon, the scales' requests
 *   against none for them: Q4_K 0.94-0.96x the time, IQ4_XS 0.95-0.99x, Q6_K 0.87-0.90x.
 * - AHEAD_L2 (the far step alone, prefetch_block_l2) on AMD CPUs, at every batch, except where the pass is
 *   bound by the read alone (read_bound): there, none. The near step into L1 is what cost on the AMD EPYC
 *   Zen 4: with it, from memory at batch 1, the tiles ran 1.03-1.37x the time they take without any
 *   request, while the far step alone takes less than without. 2026-12-07, 2 threads, batch 1, GB/s of
 *   the weights' bytes, medians of 7 rounds interleaved in one process (none -> L2 only), 10-12 copies:
 *   8192 x 2048 Q4_K 26.3 -> 32.0, Q6_K 19.7 -> 26.5; 2048 x 8192 Q4_K 26.8 -> 33.9, Q6_K 21.6 -> 35.1;
 *   8192 x 2048 IQ4_XS 21.2 -> 26.0, Q5_K 17.4 -> 29.8; 16384 x 2048 Q4_K 23.9 -> 30.4, Q6_K 17.7 ->
 *   31.6, IQ4_XS 24.0 -> 29.0. At batch 2 Q4_K 1.26x and Q6_K 1.29x the GB/s, at batch 16 (against
 *   AHEAD_BOTH) 1.03-1.05x. One thread alone read Q6_K at 14 GB/s without requests, 22 with, and a plain
 *   read at 26-28: without them the core waits for each line it decodes.
 * - AHEAD_NONE: Q8_0 passes of up to 3 items on AMD (read_bound: a byte per weight, little arithmetic per
 *   byte). In the engine, 1B Q8_0 at batch 1, the far step took 0.90-0.99x the tokens per second (5
 *   alternating rounds); earlier, against AHEAD_BOTH from memory (8192 x 2048 x 8 copies), none took
 *   0.81x the time at batch 2 and 0.85x at 3 (0.97x at 4). */
enum { AHEAD_NONE, AHEAD_BOTH, AHEAD_L2 };

static inline int read_bound(int kind, int items) { return kind == LAYOUT_Q8 && items <= 3; }

static int tiled_ahead(int kind, int items) {
    static int amd = -1;
    if (amd < 0) amd = __builtin_cpu_is("amd");
    return !amd ? AHEAD_BOTH : read_bound(kind, items) ? AHEAD_NONE : AHEAD_L2;
}

/* (Always inlined: GCC takes a function of nothing but prefetches for one without effect and drops its calls; see
 * simd.h.) Super-block b of row block rb's streams, asked for ahead in `form` (tiled_ahead): the codes 2 *
 * STREAM_AHEAD bytes ahead, the scales and their factors (AHEAD_L2: 8 super-blocks ahead; AHEAD_BOTH: as
 * prefetch_block asks for any stream). */
static inline ALWAYS void tiled_prefetch(int form, int kind, const TiledSrc *w, long nblk, long C, long run, long rb,
                                       long b) {
    const long sb = rb * nblk + b, per = per16(kind) || kind == LAYOUT_Q8 ? 256 : 128; /* int8 scales (Q8_0: fp16) */
    const uint8_t *codes = tiled_codes(kind, w, C * 64, rb, b);
    /* ASK(p, n, ahead) for each stream: its n bytes of this super-block (the L2 form 2 * ahead bytes ahead) */
#define STREAMS(ASK)                                                                                 \
    do {                                                                                             \
        ASK(codes, 4 * run, STREAM_AHEAD);                                                           \
        ASK(w->scale + sb * per, per, 4 * per);                                                      \
        if (w->scale_d) ASK(w->scale_d + sb * 16, 32, 4 * 32);                                       \
        if (w->mins) ASK(w->mins + sb * per, per, 4 * per);                                          \
        if (w->mins_d) ASK(w->mins_d + sb * 16, 32, 4 * 32);                                         \
    } while (0)
#define BOTH_STEPS(p, n, ahead) prefetch_block(p, n)
    if (form == AHEAD_BOTH) STREAMS(BOTH_STEPS);
    else if (form == AHEAD_L2) STREAMS(prefetch_block_l2);
#undef BOTH_STEPS
#undef STREAMS
}
#endif
