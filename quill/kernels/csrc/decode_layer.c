/* One decoder layer for B decode rows, fused: the whole layer is one call from Python.
 *
 *   x += o_proj(attention(rope(qkv(rmsnorm(x)))))      K/V of the new token written first
 *   x += down(silu(gate) * up)(rmsnorm(x))
 *
 * Every row is computed with the same sequence of operations whatever B is, so a
 * sequence's output does not depend on what else is in the batch (batch invariance).
 */
#include <immintrin.h>

#include "simd.h"
#include <math.h>
#include <stdint.h>

void quill_gemv_q4(const uint8_t *, const float *, const float *, const float *, float *, float *, int, int, int);
void quill_gemv_q8(const int8_t *, const float *, const float *, const float *, float *, float *, int, int, int);
void quill_amx_gemv(int, const void *, const void *, const void *, const float *, float *, int, int, int, void *);

typedef struct {
    int kind; /* 0 = q4, 1 = q8, 2 = f32 (codes points at an (N, K) float matrix), 3 + k = AMX-tiled kind k */
    int rows, groups;
    const void *codes;
    const void *scale, *mins; /* fp32, or fp16 for AMX-tiled kinds with bit 1 */
    const float *bias;
} QWeight;

typedef struct {
    const float *norm1, *norm2;
    QWeight qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* (slots, kv_heads, head_dim) */
} LayerWeights;

typedef struct {
    int hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
    const float *cos, *sin; /* (positions, head_dim) */
} ModelShape;

typedef struct {
    int batch, max_ctx;
    const int64_t *positions;   /* (B,) */
    const int64_t *new_slots;   /* (B,) */
    const int64_t *ctx_slots;   /* (B, max_ctx) */
    const int64_t *ctx_lens;    /* (B,) */
    float *h, *qkv, *attn, *gu, *act, *tmp, *scores, *sums, *partials; /* scratch */
} StepArgs;


/* exp's constants, shared by the 8- and 16-lane versions: log2(e), ln 2 split in two for an
 * exact range reduction, and the degree-6 polynomial's coefficients from the highest. */
#define EXP_LOG2E 1.44269504089f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO (-2.12194440e-4f)
static const float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

/* exp(x) for 8 lanes: x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial for exp(r), times 2^n.
 * Relative error ~2e-7 over the softmax range (x <= 0); inputs below -87 give 0. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.3f);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[i]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* exp(v[i] - shift) in place for i < n; returns the sum (fixed order: 8 lanes, then the tail). */
static float exp_shift_sum(float *v, long n, float shift) {
    __m256 total = _mm256_setzero_ps(), s = _mm256_set1_ps(shift);
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(v + i), s));
        _mm256_storeu_ps(v + i, e);
        total = _mm256_add_ps(total, e);
    }
    float sum = 0.f;
    for (; i < n; i++) { v[i] = expf(v[i] - shift); sum += v[i]; }
    return hsum8(total) + sum;
}

static float dot(const float *a, const float *b, int n) { /* n % 8 == 0 */
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum8(acc);
}

static void gemv(const QWeight *w, const float *x, float *sums, float *out, int B) {
    int N = w->rows, K = w->groups * 32;
    if (w->kind == 0) quill_gemv_q4(w->codes, w->scale, w->mins, x, sums, out, N, w->groups, B);
    else if (w->kind == 1) quill_gemv_q8(w->codes, w->scale, w->mins, x, sums, out, N, w->groups, B);
    else if (w->kind >= 3) quill_amx_gemv(w->kind - 3, w->codes, w->scale, w->mins, x, out, N, K, B, sums);
    else {
        const float *W = (const float *)w->codes;
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++)
            for (int b = 0; b < B; b++) out[(long)b * N + n] = dot(W + (long)n * K, x + (long)b * K, K);
    }
    if (w->bias)
        for (int b = 0; b < B; b++)
            for (int n = 0; n < N; n++) out[(long)b * N + n] += w->bias[n];
}

/* Per row: eight-lane sum of squares in a fixed order (then the H % 8 tail), one scale. */
static void rmsnorm(const float *x, const float *w, float *out, int B, int H, float eps) {
    for (int b = 0; b < B; b++) {
        const float *xb = x + (long)b * H;
        float *ob = out + (long)b * H;
        __m256 acc = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 <= H; i += 8) {
            const __m256 v = _mm256_loadu_ps(xb + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum8(acc);
        for (int j = i; j < H; j++) ss += xb[j] * xb[j];
        const float r = 1.0f / sqrtf(ss / H + eps);
        const __m256 rv = _mm256_set1_ps(r);
        for (i = 0; i + 8 <= H; i += 8)
            _mm256_storeu_ps(ob + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + i), rv), _mm256_loadu_ps(w + i)));
        for (; i < H; i++) ob[i] = xb[i] * r * w[i];
    }
}

static void rope(float *v, const float *cos, const float *sin, int hd) { /* rotate-half layout */
    int half = hd / 2;
    for (int i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

#define MAX_GROUP 16
#define SPLIT 64          /* context positions per attention task */

int quill_attention_split(void) { return SPLIT; } /* sizes the partials buffer in fused_decode.py */

/* Lane j = dot(q, k_j) for eight key vectors (hd % 8 == 0): eight FMA chains, one transpose-add. */
static inline __m256 dot8(const float *q, const float *const k[8], int hd) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int i = 0; i < hd; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + i), a[j]);
    }
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* acc[g][0..32) += sum_l p[g][l] * V[l][i0 .. i0+32) for NG (1..3) q heads: 4 x NG
 * accumulators in registers, every V vector read once. */
static inline __attribute__((always_inline)) void v_block(const float *vc, const int64_t *slots, long l0, long l1,
                                                          int nkv, int kvh, int hd, int i0, const float *p,
                                                          long pstride, const int NG, float *out) {
    __m256 a[3][4];
    for (int g = 0; g < NG; g++)
        for (int u = 0; u < 4; u++) a[g][u] = _mm256_setzero_ps();
    for (long l = l0; l < l1; l++) {
        const float *v = vc + (slots[l] * nkv + kvh) * hd + i0;
        const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
                     v3 = _mm256_loadu_ps(v + 24);
        for (int g = 0; g < NG; g++) {
            const __m256 w = _mm256_set1_ps(p[g * pstride + l]);
            a[g][0] = _mm256_fmadd_ps(w, v0, a[g][0]);
            a[g][1] = _mm256_fmadd_ps(w, v1, a[g][1]);
            a[g][2] = _mm256_fmadd_ps(w, v2, a[g][2]);
            a[g][3] = _mm256_fmadd_ps(w, v3, a[g][3]);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int u = 0; u < 4; u++) _mm256_storeu_ps(out + (long)g * hd + i0 + 8 * u, a[g][u]);
}

/* acc (group, hd) = sum over l in [l0, l1) of p[g][l] * V[l]. */
static void v_accumulate(const float *vc, const int64_t *slots, long l0, long l1, int nkv, int kvh, int hd,
                         const float *p, long pstride, int group, float *acc) {
    for (int g0 = 0; g0 < group; g0 += 3) {
        const int ng = group - g0 < 3 ? group - g0 : 3;
        const float *pg = p + (long)g0 * pstride;
        float *ag = acc + (long)g0 * hd;
        int i0 = 0;
        for (; i0 + 32 <= hd; i0 += 32) {
            if (ng == 3) v_block(vc, slots, l0, l1, nkv, kvh, hd, i0, pg, pstride, 3, ag);
            else if (ng == 2) v_block(vc, slots, l0, l1, nkv, kvh, hd, i0, pg, pstride, 2, ag);
            else v_block(vc, slots, l0, l1, nkv, kvh, hd, i0, pg, pstride, 1, ag);
        }
        for (; i0 < hd; i0 += 8) /* hd % 32 tail, 8 floats at a time */
            for (int g = 0; g < ng; g++) {
                __m256 a = _mm256_setzero_ps();
                for (long l = l0; l < l1; l++)
                    a = _mm256_fmadd_ps(_mm256_set1_ps(pg[g * pstride + l]),
                                        _mm256_loadu_ps(vc + (slots[l] * nkv + kvh) * hd + i0), a);
                _mm256_storeu_ps(ag + (long)g * hd + i0, a);
            }
    }
}

typedef struct {
    const float *q0, *k_cache, *v_cache;
    const int64_t *slots;
    long l0, l1;
    int nkv, kvh, hd, group;
    float scale;
    float *sc0; /* scores: row g at sc0 + g * sstride, positions l0 .. l1 */
    long sstride;
} Split;

/* One (row, KV head, split) task: max, exp-sum and unnormalized output of each q head of the group. */
static void attend_split_256(const Split *t, float *mx, float *total, float *acc) {
    const int hd = t->hd, group = t->group, nkv = t->nkv, kvh = t->kvh;
    const long l0 = t->l0, l1 = t->l1;
    const int64_t *slots = t->slots;
    const float *q0 = t->q0;
    float *sc0 = t->sc0;
    for (int g = 0; g < group; g++) mx[g] = -INFINITY;
    long l = l0;
    __m256 vmx[MAX_GROUP];
    for (int g = 0; g < group; g++) vmx[g] = _mm256_set1_ps(-INFINITY);
    for (; l + 8 <= l1; l += 8) {
        const float *k[8];
        for (int j = 0; j < 8; j++) k[j] = t->k_cache + (slots[l + j] * nkv + kvh) * hd;
        for (int g = 0; g < group; g++) {
            __m256 v = _mm256_mul_ps(dot8(q0 + g * hd, k, hd), _mm256_set1_ps(t->scale));
            _mm256_storeu_ps(sc0 + g * t->sstride + l, v);
            vmx[g] = _mm256_max_ps(vmx[g], v);
        }
    }
    for (int g = 0; g < group; g++) mx[g] = hmax8(vmx[g]);
    for (; l < l1; l++) {
        const float *k = t->k_cache + (slots[l] * nkv + kvh) * hd;
        for (int g = 0; g < group; g++) {
            float v = dot(q0 + g * hd, k, hd) * t->scale;
            sc0[g * t->sstride + l] = v;
            if (v > mx[g]) mx[g] = v;
        }
    }
    for (int g = 0; g < group; g++) total[g] = exp_shift_sum(sc0 + g * t->sstride + l0, l1 - l0, mx[g]);
    v_accumulate(t->v_cache, slots, l0, l1, nkv, kvh, hd, sc0, t->sstride, group, acc);
}

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

AVX512 static inline __m512 exp16(__m512 x) { /* exp8's polynomial, 16 lanes */
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[i]));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* Lane j = sum of the lanes of a[j]: 16 dot products' partial sums reduced in one tree. */
AVX512 static inline __m512 reduce16(const __m512 a[16]) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* c[i] lane 4u + w holds keys 4i + w summed over 128-bit block u: add the four blocks */
    __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
    __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, 0x88), _mm512_shuffle_f32x4(e01, e23, 0xDD));
}

/* acc[g][i0 .. i0+64) += sum_l p[g][l] * V[l][i0 .. i0+64) for NG (1..3) heads, 4 x NG accumulators. */
AVX512 static inline __attribute__((always_inline)) void v_block_512(const Split *t, int i0, const float *p, const int NG,
                                                                     float *out) {
    __m512 a[3][4];
    for (int g = 0; g < NG; g++)
        for (int u = 0; u < 4; u++) a[g][u] = _mm512_setzero_ps();
    for (long l = t->l0; l < t->l1; l++) {
        const float *v = t->v_cache + (t->slots[l] * t->nkv + t->kvh) * t->hd + i0;
        const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32),
                     v3 = _mm512_loadu_ps(v + 48);
        for (int g = 0; g < NG; g++) {
            const __m512 w = _mm512_set1_ps(p[g * t->sstride + l]);
            a[g][0] = _mm512_fmadd_ps(w, v0, a[g][0]);
            a[g][1] = _mm512_fmadd_ps(w, v1, a[g][1]);
            a[g][2] = _mm512_fmadd_ps(w, v2, a[g][2]);
            a[g][3] = _mm512_fmadd_ps(w, v3, a[g][3]);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int u = 0; u < 4; u++) _mm512_storeu_ps(out + (long)g * t->hd + i0 + 16 * u, a[g][u]);
}

/* attend_split_256 16 lanes wide, for head_dim % 16 == 0. */
AVX512 static void attend_split_512(const Split *t, float *mx, float *total, float *acc) {
    const int hd = t->hd, group = t->group, nkv = t->nkv, kvh = t->kvh;
    const long l0 = t->l0, l1 = t->l1;
    const __m512 scale = _mm512_set1_ps(t->scale);
    long l = l0;
    __m512 vmx[MAX_GROUP];
    for (int g = 0; g < group; g++) vmx[g] = _mm512_set1_ps(-INFINITY);
    for (; l + 16 <= l1; l += 16) {
        const float *k[16];
        for (int j = 0; j < 16; j++) k[j] = t->k_cache + (t->slots[l + j] * nkv + kvh) * hd;
        /* the cache rows sit where the block table puts them: fetch the next keys, and these
           positions' values for the second pass, ahead of use */
        for (long j = l + 16; j < l + 32 && j < l1; j++)
            for (int i = 0; i < hd; i += 16) _mm_prefetch((const char *)(t->k_cache + (t->slots[j] * nkv + kvh) * hd + i), _MM_HINT_T0);
        for (long j = l; j < l + 16; j++)
            for (int i = 0; i < hd; i += 16) _mm_prefetch((const char *)(t->v_cache + (t->slots[j] * nkv + kvh) * hd + i), _MM_HINT_T1);
        for (int g = 0; g < group; g++) {
            const float *q = t->q0 + g * hd;
            __m512 a[16];
            for (int j = 0; j < 16; j++) a[j] = _mm512_setzero_ps();
            for (int i = 0; i < hd; i += 16) {
                const __m512 qv = _mm512_loadu_ps(q + i);
                for (int j = 0; j < 16; j++) a[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[j] + i), a[j]);
            }
            const __m512 v = _mm512_mul_ps(reduce16(a), scale);
            _mm512_storeu_ps(t->sc0 + g * t->sstride + l, v);
            vmx[g] = _mm512_max_ps(vmx[g], v);
        }
    }
    for (int g = 0; g < group; g++) mx[g] = _mm512_reduce_max_ps(vmx[g]);
    for (; l < l1; l++) {
        const float *k = t->k_cache + (t->slots[l] * nkv + kvh) * hd;
        for (int g = 0; g < group; g++) {
            __m512 d = _mm512_setzero_ps();
            for (int i = 0; i < hd; i += 16) d = _mm512_fmadd_ps(_mm512_loadu_ps(t->q0 + g * hd + i), _mm512_loadu_ps(k + i), d);
            const float v = _mm512_reduce_add_ps(d) * t->scale;
            t->sc0[g * t->sstride + l] = v;
            if (v > mx[g]) mx[g] = v;
        }
    }
    for (int g = 0; g < group; g++) { /* exp in place and the sum, 16 lanes then the tail */
        float *p = t->sc0 + g * t->sstride;
        const __m512 shift = _mm512_set1_ps(mx[g]);
        __m512 sum = _mm512_setzero_ps();
        long i = l0;
        for (; i + 16 <= l1; i += 16) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + i), shift));
            _mm512_storeu_ps(p + i, e);
            sum = _mm512_add_ps(sum, e);
        }
        float tail = 0.f;
        for (; i < l1; i++) { p[i] = expf(p[i] - mx[g]); tail += p[i]; }
        total[g] = _mm512_reduce_add_ps(sum) + tail;
    }
    for (int g0 = 0; g0 < group; g0 += 3) {
        const int ng = group - g0 < 3 ? group - g0 : 3;
        const float *pg = t->sc0 + (long)g0 * t->sstride;
        float *ag = acc + (long)g0 * hd;
        int i0 = 0;
        for (; i0 + 64 <= hd; i0 += 64) {
            if (ng == 3) v_block_512(t, i0, pg, 3, ag);
            else if (ng == 2) v_block_512(t, i0, pg, 2, ag);
            else v_block_512(t, i0, pg, 1, ag);
        }
        for (; i0 < hd; i0 += 16) /* hd % 64 tail, 16 floats at a time */
            for (int g = 0; g < ng; g++) {
                __m512 a = _mm512_setzero_ps();
                for (long j = l0; j < l1; j++)
                    a = _mm512_fmadd_ps(_mm512_set1_ps(pg[g * t->sstride + j]),
                                        _mm512_loadu_ps(t->v_cache + (t->slots[j] * nkv + kvh) * hd + i0), a);
                _mm512_storeu_ps(ag + (long)g * hd + i0, a);
            }
    }
}

int quill_kernel_isa(void);

/* One task per (row, KV head, SPLIT positions of its context): the q heads that share the KV
 * head read each K and V vector once (grouped-query attention), and long contexts spread over
 * all threads. Each task keeps its max, exp-sum and unnormalized output; a second pass merges
 * the splits in order. The splits depend only on the row's own length, so a row's result is the
 * same whatever else is in the batch. */
static void attention(const ModelShape *m, const LayerWeights *L, const StepArgs *s) {
    const int hd = m->head_dim, nh = m->heads, nkv = m->kv_heads, group = nh / nkv;
    const int qkv_n = (nh + 2 * nkv) * hd, B = s->batch;
    const int nsplit = (s->max_ctx + SPLIT - 1) / SPLIT;
    const long part = (long)group * (hd + 2); /* per task: max[group], sum[group], acc[group][hd] */
    const int wide = hd % 16 == 0 && quill_kernel_isa() == 512;
#pragma omp parallel
    {
#pragma omp for schedule(static) collapse(3)
        for (int b = 0; b < B; b++)
            for (int kvh = 0; kvh < nkv; kvh++)
                for (int c = 0; c < nsplit; c++) {
                    const long len = s->ctx_lens[b], l0 = (long)c * SPLIT, l1 = l0 + SPLIT < len ? l0 + SPLIT : len;
                    if (l0 >= len) continue;
                    const int64_t *slots = s->ctx_slots + (long)b * s->max_ctx;
                    const float *q0 = s->qkv + (long)b * qkv_n + (long)kvh * group * hd;
                    float *sc0 = s->scores + ((long)b * nh + (long)kvh * group) * s->max_ctx;
                    float *pt = s->partials + (((long)b * nkv + kvh) * nsplit + c) * part;
                    const Split sp = {q0, L->k_cache, L->v_cache, slots, l0, l1, nkv, kvh, hd, group, m->scale, sc0, s->max_ctx};
                    (wide ? attend_split_512 : attend_split_256)(&sp, pt, pt + group, pt + 2 * group);
                }
#pragma omp for schedule(static) collapse(2)
        for (int b = 0; b < B; b++)
            for (int kvh = 0; kvh < nkv; kvh++) {
                const long len = s->ctx_lens[b];
                const int used = (int)((len + SPLIT - 1) / SPLIT);
                const float *p0 = s->partials + ((long)b * nkv + kvh) * nsplit * part;
                float *out0 = s->attn + (long)b * nh * hd + (long)kvh * group * hd;
                for (int g = 0; g < group; g++) {
                    float top = -INFINITY, total = 0.f;
                    for (int c = 0; c < used; c++) top = fmaxf(top, p0[c * part + g]);
                    float *o = out0 + (long)g * hd;
                    for (int i = 0; i < hd; i++) o[i] = 0.f;
                    for (int c = 0; c < used; c++) {
                        const float w = expf(p0[c * part + g] - top);
                        total += w * p0[c * part + group + g];
                        const float *a = p0 + c * part + 2 * group + (long)g * hd;
                        for (int i = 0; i < hd; i += 8)
                            _mm256_storeu_ps(o + i, _mm256_fmadd_ps(_mm256_set1_ps(w), _mm256_loadu_ps(a + i), _mm256_loadu_ps(o + i)));
                    }
                    const __m256 inv = _mm256_set1_ps(1.0f / total);
                    for (int i = 0; i < hd; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), inv));
                }
            }
    }
}

void quill_decode_layer(const ModelShape *m, const LayerWeights *L, const StepArgs *s, float *x) {
    const int B = s->batch, H = m->hidden, hd = m->head_dim, nh = m->heads, nkv = m->kv_heads;
    const int qkv_n = (nh + 2 * nkv) * hd, I = m->inter;
    rmsnorm(x, L->norm1, s->h, B, H, m->eps);
    gemv(&L->qkv, s->h, s->sums, s->qkv, B);
    for (int b = 0; b < B; b++) {
        float *row = s->qkv + (long)b * qkv_n;
        const float *c = m->cos + s->positions[b] * hd, *sn = m->sin + s->positions[b] * hd;
        for (int h = 0; h < nh + nkv; h++) rope(row + h * hd, c, sn, hd); /* q heads then k heads */
        const float *k = row + nh * hd, *v = k + nkv * hd;
        float *kd = L->k_cache + s->new_slots[b] * nkv * hd, *vd = L->v_cache + s->new_slots[b] * nkv * hd;
        for (int i = 0; i < nkv * hd; i++) { kd[i] = k[i]; vd[i] = v[i]; }
    }
    attention(m, L, s);
    gemv(&L->o, s->attn, s->sums, s->tmp, B);
    for (long i = 0; i < (long)B * H; i++) x[i] += s->tmp[i];
    rmsnorm(x, L->norm2, s->h, B, H, m->eps);
    gemv(&L->gate_up, s->h, s->sums, s->gu, B);
#pragma omp parallel for schedule(static)
    for (int b = 0; b < B; b++) {
        const float *g = s->gu + (long)b * 2 * I, *u = g + I;
        float *a = s->act + (long)b * I;
        int i = 0;
        for (; i + 8 <= I; i += 8) { /* silu(g) * u = g / (1 + exp(-g)) * u */
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
            _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    gemv(&L->down, s->act, s->sums, s->tmp, B);
    for (long i = 0; i < (long)B * H; i++) x[i] += s->tmp[i];
}
