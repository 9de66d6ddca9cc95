/* Prefill GEMM on Intel AMX-BF16 tiles with fp32 accuracy: out (M, N) = x (M, K) @ w (N, K)^T, both fp32.
 *
 * Every fp32 value v is the exact sum of three bf16 parts: v0 = bf16(v) (round to nearest even), v1 =
 * bf16(v - v0), v2 = v - v0 - v1 (each difference is exact in fp32, and what is left after two 8-bit
 * roundings of a 24-bit significand fits in 8 bits). Of the nine products of x's parts with w's, the six
 * with i + j <= 2 are summed (x0 w0, x0 w1, x0 w2, x1 w0, x1 w1, x2 w0); the three left out are each at most
 * 2^-24 |x| |w|, below fp32's own rounding of the sum. A bf16 product is exact in fp32, and TDPBF16PS adds
 * the products into fp32 accumulators with round-to-nearest-even (inputs and results that are fp32
 * denormals are flushed to zero), so the result is an fp32 dot product in another summation order: on
 * random data its error is below that of a sequential fp32 FMA chain (tests/test_amx_gemm.py). A NaN or an
 * infinity in x or w makes the dot it enters NaN.
 *
 * quill_kq_gemm, further down, is the same product read straight from a K-quant AMX-tiled weight.
 *
 * Tiles: the weight is the A operand, 16 weight rows x 32 k (row-major bf16, as split here from w's
 * rows); x is the B operand, in VNNI order: tile row kk holds, for each of 16 tokens, the pair
 * (x[2kk], x[2kk + 1]). C is (weight row, token), transposed on the way out. A thread takes 128 weight
 * rows at a time and goes through K in blocks of 1024: it splits the block's weights into its scratch
 * (each weight is split once), then runs every 32 tokens (2 B tiles, read once per block from the x
 * parts split before) through the four 32-row pairs (2 A tiles each): 4 C tiles of fp32 per pair, 24 tile
 * products per 32 k, spilled to scratch between K blocks. The split weights (768 KiB) and a token
 * pair's x tiles stay in L2 (x as a whole, 6 bytes per element, need not: reading it once per 128 rows
 * instead of once per 32 made the kernel 1.3x faster).
 *
 * AMX-BF16 intrinsics need GCC 11 or clang 12; elsewhere quill_amx_bf16_hw() reports 0 and the caller
 * keeps BLAS. The AVX-512 emulation build with QUILL_EMULATE_AMX (isa.h) runs this code on its emulated
 * tile unit, so the tests check the layout and the arithmetic on any AVX2 host.
 */
#include "isa.h"

#include "amx_tiles.h"
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define X3_KB 1024   /* K block */
#define X3_PAIRS 4   /* 32-row pairs per thread's turn: its split weights are 4 x 32 x 1024 x 3 bf16 = 768 KiB */

#if AMX_COMPILER && (!defined(QUILL_EMULATE_AVX512) || defined(QUILL_EMULATE_AMX))

#ifdef QUILL_EMULATE_AMX
#define AMXBF __attribute__((unused))
#else
#define AMXBF __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq")))
#endif

int quill_amx_enable(void); /* amx_gemv.c: the OS's permission for the tile state */

/* What the CPU can run (a fact): the AMX tile unit with BF16 products, and AVX-512 BW. */
int quill_amx_bf16_hw(void) {
#ifdef QUILL_EMULATE_AMX
    return 1;
#else
    static int cached = -1;
    if (cached < 0) {
        const unsigned d = cpuid7_edx();
        cached = ((d >> 22) & 1) && ((d >> 24) & 1) && __builtin_cpu_supports("avx512bw");
    }
    return cached;
#endif
}

static inline int x3_blocks(int M) { return (M + 15) / 16; }

/* All eight tiles 16 rows x 64 bytes (both GEMMs here), for the calling thread. */
AMXBF static inline void x3_config_tiles(void) {
    const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    const TileConfig cfg = tile_config(rows);
    _tile_loadconfig(&cfg);
}

static inline long x3_thread_bytes(int M) {
    return (long)X3_PAIRS * 32 * X3_KB * 3 * 2 + (long)X3_PAIRS * ((x3_blocks(M) + 1) / 2) * 1024 * 4;
}

/* Bytes of scratch quill_x3_gemm needs: x's parts, and per thread the split weight rows and C spills. */
long quill_x3_scratch_bytes(int M, int K, int threads) {
    return 64 + (long)x3_blocks(M) * 16 * K * 3 * 2 + (long)(threads > 0 ? threads : 1) * x3_thread_bytes(M);
}

/* 16 fp32 -> its three bf16 parts, each in the low half of an int32 lane. */
AMXBF static inline void split3(__m512 v, __m512i part[3]) {
    for (int p = 0; p < 3; p++) {
        const __m512i bits = _mm512_castps_si512(v);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        const __m512i h = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
        part[p] = h;
        v = _mm512_sub_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
    }
}

/* x's 16-token block mb, k chunk kc -> three 1 KiB B tiles (VNNI order) at dst. */
AMXBF static void split_x_tile(const float *x, int M, int K, int mb, int kc, uint16_t *dst) {
    _Alignas(64) uint32_t pairs[3][16][16]; /* [part][token][kk] */
    for (int j = 0; j < 16; j++) {
        const int m = mb * 16 + j;
        for (int h = 0; h < 2; h++) {
            __m512i part[3];
            split3(m < M ? _mm512_loadu_ps(x + (long)m * K + kc * 32 + 16 * h) : _mm512_setzero_ps(), part);
            for (int p = 0; p < 3; p++) _mm256_store_si256((__m256i *)&pairs[p][j][8 * h], _mm512_cvtepi32_epi16(part[p]));
        }
    }
    uint32_t *t = (uint32_t *)dst;
    for (int p = 0; p < 3; p++)
        for (int kk = 0; kk < 16; kk++)
            for (int j = 0; j < 16; j++) t[p * 256 + kk * 16 + j] = pairs[p][j][kk];
}

/* 16 weight rows, k in [k0, k0 + kn) -> per k chunk three 1 KiB A tiles (row-major) at dst. */
AMXBF static void split_w_rows(const float *w, int K, int k0, int kn, uint16_t *dst) {
    for (int r = 0; r < 16; r++)
        for (int kc = 0; kc < kn / 32; kc++)
            for (int h = 0; h < 2; h++) {
                __m512i part[3];
                split3(_mm512_loadu_ps(w + (long)r * K + k0 + kc * 32 + 16 * h), part);
                for (int p = 0; p < 3; p++)
                    _mm256_store_si256((__m256i *)(dst + ((long)kc * 3 + p) * 512 + r * 32 + 16 * h),
                                       _mm512_cvtepi32_epi16(part[p]));
            }
}

/* C tile (16 weight rows x 16 tokens) -> out rows m0.., columns n0.. (tokens past M dropped). */
static inline void store_transposed(const float *c, float *out, long ldo, int m0, int M, int n0) {
    for (int j = 0; j < 16 && m0 + j < M; j++)
        for (int r = 0; r < 16; r++) out[(long)(m0 + j) * ldo + n0 + r] = c[r * 16 + j];
}

/* Tile registers: C in 0-3 ((w0, x0), (w0, x1), (w1, x0), (w1, x1)), weight parts in 4/5, x parts in 6/7. */
#define X3_LW(p) do { _tile_loadd(4, wa + (p) * 512, 64); _tile_loadd(5, wb + (p) * 512, 64); } while (0)
#define X3_LX(p) do { _tile_loadd(6, xa + (p) * 512, 64); _tile_loadd(7, xb + (p) * 512, 64); } while (0)
#define X3_DP4 do { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); } while (0)

/* out (M, ldo) columns [0, N) = x (M, K) @ w (N, K)^T. Returns 0, or -1 where it cannot run (N or K not
 * a multiple of 32, no AMX-BF16, or the OS refused the tile state): the caller then uses BLAS.
 * scratch: quill_x3_scratch_bytes(M, K, threads) bytes. */
AMXBF int quill_x3_gemm(const float *x, const float *w, float *out, int M, int N, int K, int ldo, void *scratch,
                        int threads) {
    if (N % 32 || K % 32 || M < 1 || !quill_amx_bf16_hw() || !quill_amx_enable()) return -1;
    threads = threads > 0 ? threads : 1;
    const int MB = x3_blocks(M), KC = K / 32, MP = (MB + 1) / 2, NP = N / 32;
    uint16_t *xp = (uint16_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    char *per_thread = (char *)(xp + (long)MB * 16 * K * 3);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for collapse(2) schedule(static)
        for (int mb = 0; mb < MB; mb++)
            for (int kc = 0; kc < KC; kc++) split_x_tile(x, M, K, mb, kc, xp + ((long)mb * KC + kc) * 1536);
        /* (the loop's barrier: every x tile is written before any product) */
        x3_config_tiles();
        uint16_t *wp = (uint16_t *)(per_thread + (long)omp_get_thread_num() * x3_thread_bytes(M));
        float *spill = (float *)(wp + (long)X3_PAIRS * 32 * X3_KB * 3);
        _Alignas(64) float ct[4][256];
#pragma omp for schedule(static)
        for (int turn = 0; turn < (NP + X3_PAIRS - 1) / X3_PAIRS; turn++) {
            const int p0 = turn * X3_PAIRS, pairs = NP - p0 < X3_PAIRS ? NP - p0 : X3_PAIRS;
            for (int k0 = 0; k0 < K; k0 += X3_KB) {
                const int kn = K - k0 < X3_KB ? K - k0 : X3_KB, kcn = kn / 32, last = k0 + kn == K;
                for (int r = 0; r < 2 * pairs; r++) /* 16-row half r of the turn's rows */
                    split_w_rows(w + ((long)p0 * 32 + 16L * r) * K, K, k0, kn, wp + (long)r * kcn * 1536);
                for (int mb = 0; mb < MB; mb += 2) {
                    const int mb1 = mb + 1 < MB ? mb + 1 : mb; /* an odd last block runs twice, kept once */
                    for (int g = 0; g < pairs; g++) {
                        const uint16_t *wg = wp + 2L * g * kcn * 1536;
                        float *c = spill + ((long)g * MP + mb / 2) * 1024;
                        if (k0 == 0) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
                        else { _tile_loadd(0, c, 64); _tile_loadd(1, c + 256, 64); _tile_loadd(2, c + 512, 64); _tile_loadd(3, c + 768, 64); }
                        for (int kc = 0; kc < kcn; kc++) {
                            const uint16_t *wa = wg + (long)kc * 1536, *wb = wg + (long)(kcn + kc) * 1536;
                            const uint16_t *xa = xp + ((long)mb * KC + k0 / 32 + kc) * 1536;
                            const uint16_t *xb = xp + ((long)mb1 * KC + k0 / 32 + kc) * 1536;
                            /* the six products, ordered so that 16 tile loads serve 24 products */
                            X3_LX(0); X3_LW(0); X3_DP4; X3_LW(1); X3_DP4; X3_LW(2); X3_DP4;
                            X3_LX(1); X3_LW(1); X3_DP4; X3_LW(0); X3_DP4;
                            X3_LX(2); X3_DP4;
                        }
                        if (!last) {
                            _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64); _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64);
                            continue;
                        }
                        for (int t = 0; t < 4; t++) {
                            switch (t) { /* tile register numbers must be literals */
                            case 0: _tile_stored(0, ct[0], 64); break;
                            case 1: _tile_stored(1, ct[1], 64); break;
                            case 2: _tile_stored(2, ct[2], 64); break;
                            default: _tile_stored(3, ct[3], 64); break;
                            }
                            if ((t & 1) && mb1 == mb) continue;
                            store_transposed(ct[t], out, ldo, ((t & 1) ? mb1 : mb) * 16, M, (p0 + g) * 32 + (t >> 1) * 16);
                        }
                    }
                }
            }
        }
        _tile_release();
    }
    return 0;
}


/* The same product straight from a K-quant tiled weight (amx_gemv.c's layout, kind bit 2: Q4_K, Q5_K,
 * IQ4_XS, Q6_K), without an fp32 copy of it: out (M, ldo) columns [0, N) = x (M, K) @ W^T where W's row n,
 * superblock b (256 columns) is scale_d[n, b] * code * scale + mins_d[n, b] * min per group (amx_gemv.c).
 *
 * Each code * scale is an integer that two bf16 parts hold exactly (quill_amx_kq_rows), so of the six
 * products of x's three parts with them, the five with i + j <= 2 are summed (the one left out is below
 * 2^-24 |x| |w|, as in quill_x3_gemm): five tile products per 32 k instead of six, and the weight is
 * unpacked from its 4.5 to 6.5 bits into the thread's scratch, never written out in fp32. Per superblock
 * the four C tiles start from zero, take the 8 steps' products, and are added to the fp32 sums scaled by
 * the superblock's factor, with the mins times x's group sums (summed once per token and group). So an
 * output is the fp32 sum over superblocks of scale_d times an fp32 dot product of exact integers with x:
 * its error is within a few fp32 roundings of sum |x| |w| (tests/test_amx_gemm.py). */

void quill_amx_kq_rows(int kind, const void *codes, const void *scale, int K, int rb, int c0, int cn, uint16_t *dst);

static inline long kq_thread_bytes(int M) {
    return (long)X3_PAIRS * 32 * 256 * 2 * 2 + (long)X3_PAIRS * ((x3_blocks(M) + 1) / 2) * 1024 * 4;
}

/* Bytes of scratch quill_kq_gemm needs: x's parts and group sums, and per thread the weight parts and sums. */
long quill_kq_scratch_bytes(int M, int K, int threads) {
    return 128 + (long)x3_blocks(M) * 16 * K * 3 * 2 + (long)x3_blocks(M) * 16 * (K / 32) * 4
           + (long)(threads > 0 ? threads : 1) * kq_thread_bytes(M);
}

/* The five products of one 32-k step (x0 w0, x0 w1, x1 w1, x1 w0, x2 w0): 12 tile loads serve 20 tile
 * products, each load issued right after the last product that reads its register's previous contents (on
 * the Xeon measured, as fast as loading before each group of four, no faster). Registers: C 0-3 as in x3, w in 4
 * (rows a) and 5 (rows b), x in 6 (tokens a) and 7 (tokens b). The last products load the next step's
 * x0 and w0 (at xa + nx, wa + nw), none after a superblock's last step (nx = 0: those are loaded again). */
#define KQ_STEP_FIRST do { _tile_loadd(4, wa, 64); _tile_loadd(5, wb, 64); _tile_loadd(6, xa, 64); _tile_loadd(7, xb, 64); } while (0)
#define KQ_STEP(nx, nw) do {                                                                               \
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_loadd(4, wa + 512, 64);                  \
        _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); _tile_loadd(5, wb + 512, 64);                  \
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(2, 5, 6); _tile_loadd(6, xa + 512, 64);                  \
        _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(3, 5, 7); _tile_loadd(7, xb + 512, 64);                  \
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_loadd(4, wa, 64);                        \
        _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); _tile_loadd(5, wb, 64);                        \
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(2, 5, 6); _tile_loadd(6, xa + 1024, 64);                 \
        _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(3, 5, 7); _tile_loadd(7, xb + 1024, 64);                 \
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);                                                 \
        if (nx) _tile_loadd(4, wa + (nw), 64);                                                           \
        _tile_dpbf16ps(2, 5, 6);                                                                         \
        if (nx) _tile_loadd(6, xa + (nx), 64);                                                           \
        _tile_dpbf16ps(3, 5, 7);                                                                         \
        if (nx) { _tile_loadd(5, wb + (nw), 64); _tile_loadd(7, xb + (nx), 64); }                        \
    } while (0)

/* acc (16 weight rows x 16 tokens) += d[r] * c[r] + sum over the superblock's groups of m[r][g] * xs[g] */
AMXBF static inline void kq_add(float *acc, const float *c, const float *d, const float (*m)[8], const float *xs,
                                long xs_ld, int first) {
    for (int r = 0; r < 16; r++) {
        __m512 v = _mm512_mul_ps(_mm512_set1_ps(d[r]), _mm512_load_ps(c + 16 * r));
        if (m)
            for (int g = 0; g < 8; g++) v = _mm512_fmadd_ps(_mm512_set1_ps(m[r][g]), _mm512_loadu_ps(xs + g * xs_ld), v);
        _mm512_store_ps(acc + 16 * r, first ? v : _mm512_add_ps(_mm512_load_ps(acc + 16 * r), v));
    }
}

/* Returns 0, or -1 where it cannot run (not a K-quant tiled kind, N not a multiple of 32 or K of 256, no
 * AMX-BF16, or the OS refused the tile state): the caller then dequantizes and uses quill_x3_gemm or BLAS.
 * scratch: quill_kq_scratch_bytes(M, K, threads) bytes. */
AMXBF int quill_kq_gemm(int kind, const void *codes, const void *scale, const void *mins, const void *scale_d,
                        const void *mins_d, const float *x, float *out, int M, int N, int K, int ldo, void *scratch,
                        int threads) {
    if (!(kind & KIND_KSCALES) || N % 32 || K % 256 || M < 1 || !quill_amx_bf16_hw() || !quill_amx_enable()) return -1;
    threads = threads > 0 ? threads : 1;
    const int MB = x3_blocks(M), KC = K / 32, MP = (MB + 1) / 2, NP = N / 32, G = K / 32, F = K / 256;
    const int MR = MB * 16; /* x's group sums: (G, MR), zero for the padding tokens */
    const uint16_t *sd = (const uint16_t *)scale_d, *md = (const uint16_t *)mins_d;
    const int8_t *mn = (const int8_t *)mins; /* (N/16, G, 16) where present: only with 32-weight groups */
    uint16_t *xp = (uint16_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float *xs = (float *)(xp + (long)MB * 16 * K * 3);
    char *per_thread = (char *)(((uintptr_t)(xs + (long)G * MR) + 63) & ~(uintptr_t)63);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for collapse(2) schedule(static)
        for (int mb = 0; mb < MB; mb++)
            for (int kc = 0; kc < KC; kc++) {
                split_x_tile(x, M, K, mb, kc, xp + ((long)mb * KC + kc) * 1536);
                if (mins)
                    for (int j = 0; j < 16; j++) {
                        const int m = mb * 16 + j;
                        xs[(long)kc * MR + m] = m < M ? _mm512_reduce_add_ps(_mm512_add_ps(
                            _mm512_loadu_ps(x + (long)m * K + kc * 32), _mm512_loadu_ps(x + (long)m * K + kc * 32 + 16))) : 0.f;
                    }
            }
        x3_config_tiles();
        uint16_t *wp = (uint16_t *)(per_thread + (long)omp_get_thread_num() * kq_thread_bytes(M));
        float *sums = (float *)(wp + (long)X3_PAIRS * 32 * 256 * 2);
        _Alignas(64) float ct[4][256];
        float d[2][16], mv[2][16][8];
#pragma omp for schedule(static)
        for (int turn = 0; turn < (NP + X3_PAIRS - 1) / X3_PAIRS; turn++) {
            const int p0 = turn * X3_PAIRS, pairs = NP - p0 < X3_PAIRS ? NP - p0 : X3_PAIRS;
            for (int f = 0; f < F; f++) { /* superblock f: x's part of it (M x 256 x 6 bytes) stays in L2 for the pairs */
                for (int r = 0; r < 2 * pairs; r++) /* 16-row half r of the turn's rows: 8 steps x 2 parts */
                    quill_amx_kq_rows(kind, codes, scale, K, 2 * p0 + r, 4 * f, 4, wp + (long)r * 8 * 1024);
                for (int g = 0; g < pairs; g++) {
                    for (int h = 0; h < 2; h++) /* the superblock's factors and mins for the pair's two row blocks */
                        for (int r = 0; r < 16; r++) {
                            const long rb = 2L * (p0 + g) + h;
                            d[h][r] = _cvtsh_ss(sd[(rb * F + f) * 16 + r]);
                            const float dm = mins ? _cvtsh_ss(md[(rb * F + f) * 16 + r]) : 0.f;
                            for (int e = 0; mins && e < 8; e++) mv[h][r][e] = dm * mn[(rb * G + 8 * f + e) * 16 + r];
                        }
                    for (int mb = 0; mb < MB; mb += 2) {
                        const int mb1 = mb + 1 < MB ? mb + 1 : mb; /* an odd last block runs twice, kept once */
                        const uint16_t *xa = xp + ((long)mb * KC + 8 * f) * 1536, *xb = xp + ((long)mb1 * KC + 8 * f) * 1536;
                        const uint16_t *wa = wp + 2L * g * 8 * 1024, *wb = wa + 8 * 1024;
                        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                        KQ_STEP_FIRST;
                        for (int s = 0; s < 8; s++, xa += 1536, xb += 1536, wa += 1024, wb += 1024) {
                            if (s < 7) KQ_STEP(1536, 1024);
                            else KQ_STEP(0, 0);
                        }
                        _tile_stored(0, ct[0], 64); _tile_stored(1, ct[1], 64);
                        _tile_stored(2, ct[2], 64); _tile_stored(3, ct[3], 64);
                        float *acc = sums + ((long)g * MP + mb / 2) * 1024;
                        for (int t = 0; t < 4; t++)
                            kq_add(acc + 256 * t, ct[t], d[t >> 1], mins ? (const float (*)[8])mv[t >> 1] : NULL,
                                   xs + 8L * f * MR + ((t & 1) ? mb1 : mb) * 16, MR, f == 0);
                        if (f == F - 1)
                            for (int t = 0; t < 4; t++) {
                                if ((t & 1) && mb1 == mb) continue;
                                store_transposed(acc + 256 * t, out, ldo, ((t & 1) ? mb1 : mb) * 16, M,
                                                 (p0 + g) * 32 + (t >> 1) * 16);
                            }
                    }
                }
            }
        }
        _tile_release();
    }
    return 0;
}
#else /* no AMX-BF16 support in this compiler, or the AVX-512 emulation build without the tile unit */

int quill_amx_bf16_hw(void) { return 0; }
long quill_x3_scratch_bytes(int M, int K, int threads) { return 0; }
int quill_x3_gemm(const float *x, const float *w, float *out, int M, int N, int K, int ldo, void *scratch,
                  int threads) { return -1; }
long quill_kq_scratch_bytes(int M, int K, int threads) { return 0; }
int quill_kq_gemm(int kind, const void *codes, const void *scale, const void *mins, const void *scale_d,
                  const void *mins_d, const float *x, float *out, int M, int N, int K, int ldo, void *scratch,
                  int threads) { return -1; }

#endif
