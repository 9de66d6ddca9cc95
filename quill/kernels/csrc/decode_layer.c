/* One decoder layer for B decode rows, fused: the whole layer is one call from Python.
 *
 *   x += r * norm_out?(o_proj(attention(rope?(qk_norm?(qkv(norm_in?(x)))))))   K/V of the new token written first
 *   x += r * norm_out?(down(act(gate) * up)(norm_in?(x)))
 *
 * The layer's recipe comes with its weights (LayerWeights): which of the four RMSNorms exist
 * (pre-norm, sandwich or post-norm layouts), q/k norm per head or over the whole projection,
 * RoPE tables or none, a sliding window or none; the model's (ModelShape): rotated dims, the
 * activation (SiLU or tanh GELU), the score scale and the residual multiplier r.
 *
 * Every row is computed with the same sequence of operations whatever B is, so a
 * sequence's output does not depend on what else is in the batch (batch invariance).
 */
#include "isa.h"

#include "kformat.h"
#include "simd.h"
#include <math.h>
#include <stdint.h>

void quill_gemv_q4_ld(const uint8_t *, const float *, const float *, const float *, float *, float *, int, int, int, int, int, int);
void quill_gemv_q8_ld(const int8_t *, const float *, const float *, const float *, float *, float *, int, int, int, int, int, int);
void quill_gemv_kq(int, const uint8_t *, const float *, float *, float *, int, int, int, int, int, int);
void quill_tiled_gemv(int, const void *, const void *, const void *, const void *, const void *, const float *, float *,
                    int, int, int, int, void *, int);
int quill_tiled_gemv_i8(int, const void *, const void *, const void *, const void *, const void *, const float *, float *,
                    int, int, int, int, void *, int);
int quill_isa_used(int isa);
int quill_gemv_i8(int, const uint8_t *, const float *, const float *, const float *, uint8_t *, float *, int, int, int, int, int, int);

typedef struct QWeight {
    int kind; /* 0 = q4, 1 = q8, 2 = f32 (codes points at an (N, K) float matrix), 3 = AMX-tiled (of kind amx),
                 7 + k = GGUF blocks of kquant.c's kind k (0..9: Q4_K, Q6_K, Q5_0, IQ4_NL, IQ4_XS, Q5_K, F16, BF16,
                 Q2_K, Q3_K),
                 SPLIT = `parts` stacked */
    int rows, groups;
    const void *codes;
    const void *scale, *mins; /* fp32, or as the AMX-tiled kind says (amx_gemv.c) */
    const float *bias;
    const struct QWeight *parts; /* kind SPLIT: the parts, each writing its rows of the output */
    int nparts;
    int amx;                      /* kind 3: amx_gemv.c's kind */
    const void *scale_d, *mins_d; /* kind 3 with K-quant scales: their fp16 factors */
} QWeight;

typedef struct {
    const float *attn_in, *attn_out, *mlp_in, *mlp_out; /* (hidden,) RMSNorm weights around each branch, or NULL */
    QWeight qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* (kv_heads, slots, head_dim), float or fp16 as ModelShape.kv16 says */
    const float *q_norm, *k_norm; /* RMSNorm weights on q / k before RoPE, or NULL */
    int qk_norm_full; /* 1: q_norm / k_norm span the whole projection (heads x head_dim); 0: one head */
    int window;       /* a query attends the last `window` positions (itself included); 0: all */
    const float *cos, *sin; /* (positions, rotary_dim) RoPE tables of this layer, or NULL (no RoPE) */
} LayerWeights;

typedef struct {
    int hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
    int kv16; /* the KV cache holds fp16 (else fp32) */
    long kv_slots; /* slots per KV head in the cache */
    int rotary_dim; /* leading dims of each head RoPE rotates (rotate-half within them) */
    int act;        /* 0: SiLU (SwiGLU), 1: tanh GELU (GeGLU) */
    int isa;     /* the caller's choice: 512 = AVX-512 kernels where the CPU has them, 256 = AVX2 */
    int threads; /* the caller's OpenMP team size for every parallel region of a call */
    float residual_scale; /* each residual branch is multiplied by it before the add (1 but for Granite) */
    int int8; /* the caller's choice: activations rounded to int8 where kquant_i8.c has a kernel for the weight */
} ModelShape;

/* One step's rows. Cache slots come from the block tables here, so the caller's per-step work
 * is O(batch): position p of row b lives in slot block_tables[b][p / block_size] * block_size +
 * p % block_size. */
typedef struct {
    int batch, max_ctx;            /* max_ctx >= every ctx_lens[b]: the scores' row stride */
    const int64_t *positions;      /* (B,) the new token's position */
    const int32_t *block_tables;   /* (B, max_blocks): row b = its sequence's physical block ids */
    int max_blocks, block_size;
    const int64_t *ctx_lens;       /* (B,) positions attended, 0 .. ctx_lens[b] - 1 (the new one included) */
    float *h, *qkv, *attn, *gu, *act, *tmp, *scores, *sums, *partials; /* scratch */
} StepArgs;

static inline int team(const ModelShape *m) { return m->threads > 0 ? m->threads : 1; } /* OpenMP team size */

/* x += branch, each branch scaled by the model's residual multiplier (1 but for Granite). */
static void add_residual(const ModelShape *m, float *x, const float *branch, long n) {
    const float r = m->residual_scale;
    if (r == 1.0f) for (long i = 0; i < n; i++) x[i] += branch[i];
    else for (long i = 0; i < n; i++) x[i] += branch[i] * r;
}

static inline long slot_of(const StepArgs *s, int b, long pos) {
    const int32_t *table = s->block_tables + (long)b * s->max_blocks;
    return (long)table[pos / s->block_size] * s->block_size + pos % s->block_size;
}


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

#define BLOCKS_FIRST 7 /* QWeight kinds BLOCKS_FIRST + k: kquant.c's kind k */
#define BLOCKS_LAST 16
#define SPLIT 20

/* out (B, ld) columns [0, w->rows) = x (B, K) @ W.T, without the bias. */
static void gemv_ld(const ModelShape *m, const QWeight *w, const float *x, float *sums, float *out, int B, int ld) {
    int N = w->rows, K = w->groups * 32, nt = team(m);
    if (m->int8) { /* kquant_i8.c's kinds: its q4 / q8 layouts, or kquant.c's block kinds */
        const int k8 = w->kind == 0 ? LAYOUT_Q4 : w->kind == 1 ? LAYOUT_Q8
                     : w->kind >= BLOCKS_FIRST && w->kind <= BLOCKS_LAST ? w->kind - BLOCKS_FIRST : -1;
        if (k8 >= 0 && quill_gemv_i8(k8, w->codes, w->scale, w->mins, x, (uint8_t *)sums, out, N, K, B, ld, m->isa, nt) == 0) return;
        if (w->kind == 3 && quill_tiled_gemv_i8(w->amx, w->codes, w->scale, w->mins, w->scale_d, w->mins_d, x, out, N, K, B,
                                                ld, sums, nt) == 0)
            return; /* the VNNI tiles' kinds that have an int8 kernel (amx_gemv.c's quill_tiled_i8_supported) */
    }
    if (w->kind == 0) quill_gemv_q4_ld(w->codes, w->scale, w->mins, x, sums, out, N, w->groups, B, ld, m->isa, nt);
    else if (w->kind == 1) quill_gemv_q8_ld(w->codes, w->scale, w->mins, x, sums, out, N, w->groups, B, ld, m->isa, nt);
    else if (w->kind == 3)
        quill_tiled_gemv(w->amx, w->codes, w->scale, w->mins, w->scale_d, w->mins_d, x, out, N, K, B, ld, sums, nt);
    else if (w->kind >= BLOCKS_FIRST && w->kind <= BLOCKS_LAST)
        quill_gemv_kq(w->kind - BLOCKS_FIRST, w->codes, x, sums, out, N, K, B, ld, m->isa, nt);
    else if (w->kind == SPLIT) {
        for (int p = 0, r = 0; p < w->nparts; r += w->parts[p].rows, p++) gemv_ld(m, &w->parts[p], x, sums, out + r, B, ld);
    } else {
        const float *W = (const float *)w->codes;
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int n = 0; n < N; n++)
            for (int b = 0; b < B; b++) out[(long)b * ld + n] = dot(W + (long)n * K, x + (long)b * K, K);
    }
}

static void gemv(const ModelShape *m, const QWeight *w, const float *x, float *sums, float *out, int B) {
    const int N = w->rows;
    gemv_ld(m, w, x, sums, out, B, N);
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

static void rope(float *v, const float *cos, const float *sin, int rd) { /* rotate-half within the first rd dims */
    int half = rd / 2;
    for (int i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

#define MAX_GROUP 16
#define ATTN_SPLIT 64     /* context positions per attention task */

int quill_attention_split(void) { return ATTN_SPLIT; } /* sizes the partials buffer in fused_decode.py */

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

typedef struct {
    const float *q0;
    const void *k_cache, *v_cache; /* this KV head's slot 0 (rows hd apart), float or fp16 (uint16_t) elements */
    const long *rows; /* element offset of position l0 + j's row from k_cache / v_cache, j < l1 - l0 */
    long l0, l1;
    int hd, group;
    float scale;
    float *sc0; /* scores: row g at sc0 + g * sstride, positions l0 .. l1 */
    long sstride;
} Split;


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

#define KV_T float
#define KV_NAME(f) f##_f32
#define KV_LOAD8(p) _mm256_loadu_ps(p)
#define KV_LOAD16(p) _mm512_loadu_ps(p)
#include "attend_kv.h"

#define KV_T uint16_t
#define KV_NAME(f) f##_f16
#define KV_LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define KV_LOAD16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#include "attend_kv.h"

/* rows[j] = element offset of position l0 + j's row in one head's (slots, hd) cache, for positions
 * [l0, l1): one division per block, then the block's rows are hd apart. */
static void split_rows(const int32_t *table, int bs, long l0, long l1, int hd, long *rows) {
    for (long l = l0; l < l1;) {
        const long blk = l / bs, off = l - blk * bs, n = bs - off < l1 - l ? bs - off : l1 - l;
        const long base = ((long)table[blk] * bs + off) * hd;
        for (long j = 0; j < n; j++) rows[l - l0 + j] = base + j * hd;
        l += n;
    }
}

/* The first position a row of context length len attends: len - window under a sliding window. */
static inline long window_start(const LayerWeights *L, long len) {
    return L->window > 0 && len > L->window ? len - L->window : 0;
}

/* One task per (row, KV head, ATTN_SPLIT positions of its context): the q heads that share the KV
 * head read each K and V vector once (grouped-query attention), and long contexts spread over
 * all threads. Each task keeps its max, exp-sum and unnormalized output; a second pass merges
 * the splits in order. The splits depend only on the row's own length, so a row's result is the
 * same whatever else is in the batch. */
static void attention(const ModelShape *m, const LayerWeights *L, const StepArgs *s) {
    const int hd = m->head_dim, nh = m->heads, nkv = m->kv_heads, group = nh / nkv;
    const int qkv_n = (nh + 2 * nkv) * hd, B = s->batch;
    const int nsplit = (s->max_ctx + ATTN_SPLIT - 1) / ATTN_SPLIT;
    const long part = (long)group * (hd + 2); /* per task: max[group], sum[group], acc[group][hd] */
    const int wide = hd % 16 == 0 && quill_isa_used(m->isa) == 512;
#pragma omp parallel num_threads(team(m))
    {
#pragma omp for schedule(static) collapse(3)
        for (int b = 0; b < B; b++)
            for (int kvh = 0; kvh < nkv; kvh++)
                for (int c = 0; c < nsplit; c++) {
                    const long len = s->ctx_lens[b], first = window_start(L, len);
                    const long l0 = first + (long)c * ATTN_SPLIT, l1 = l0 + ATTN_SPLIT < len ? l0 + ATTN_SPLIT : len;
                    if (l0 >= len) continue;
                    long rows[ATTN_SPLIT];
                    split_rows(s->block_tables + (long)b * s->max_blocks, s->block_size, l0, l1, hd, rows);
                    const float *q0 = s->qkv + (long)b * qkv_n + (long)kvh * group * hd;
                    float *sc0 = s->scores + ((long)b * nh + (long)kvh * group) * s->max_ctx;
                    float *pt = s->partials + (((long)b * nkv + kvh) * nsplit + c) * part;
                    const long head = (long)kvh * m->kv_slots * hd * (m->kv16 ? 2 : 4); /* bytes to this head's rows */
                    const Split sp = {q0, (const char *)L->k_cache + head, (const char *)L->v_cache + head, rows, l0, l1,
                                      hd, group, m->scale, sc0, s->max_ctx};
                    if (m->kv16) (wide ? attend_split_512_f16 : attend_split_256_f16)(&sp, pt, pt + group, pt + 2 * group);
                    else (wide ? attend_split_512_f32 : attend_split_256_f32)(&sp, pt, pt + group, pt + 2 * group);
                }
#pragma omp for schedule(static) collapse(2)
        for (int b = 0; b < B; b++)
            for (int kvh = 0; kvh < nkv; kvh++) {
                const long len = s->ctx_lens[b], first = window_start(L, len);
                const int used = (int)((len - first + ATTN_SPLIT - 1) / ATTN_SPLIT);
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

/* x += r * [out_norm](branch): the branch output in tmp, normalized in place when the layer has the norm. */
static void add_branch(const ModelShape *m, float *x, float *tmp, const float *out_norm, int B) {
    if (out_norm) rmsnorm(tmp, out_norm, tmp, B, m->hidden, m->eps);
    add_residual(m, x, tmp, (long)B * m->hidden);
}

/* gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), with tanh(y) = 1 - 2 / (exp(2y) + 1). */
#define GELU_K 0.7978845608028654f
static inline __m256 gelu_tanh8(__m256 g) {
    const __m256 y = _mm256_mul_ps(_mm256_set1_ps(GELU_K), _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g),
                                                                             _mm256_mul_ps(g, g), g));
    const __m256 e = exp8(_mm256_add_ps(y, y));
    const __m256 t = _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(_mm256_set1_ps(1.0f), t));
}

static inline float gelu_tanh1(float g) {
    const float y = GELU_K * (g + 0.044715f * g * g * g);
    return 0.5f * g * (1.0f + (1.0f - 2.0f / (expf(2.0f * y) + 1.0f)));
}

void quill_decode_layer(const ModelShape *m, const LayerWeights *L, const StepArgs *s, float *x) {
    const int B = s->batch, H = m->hidden, hd = m->head_dim, nh = m->heads, nkv = m->kv_heads;
    const int qkv_n = (nh + 2 * nkv) * hd, I = m->inter, rd = m->rotary_dim;
    const float *in = x;
    if (L->attn_in) { rmsnorm(x, L->attn_in, s->h, B, H, m->eps); in = s->h; }
    gemv(m, &L->qkv, in, s->sums, s->qkv, B);
    for (int b = 0; b < B; b++) {
        float *row = s->qkv + (long)b * qkv_n;
        if (L->q_norm) { /* in place, as the torch path's q_norm / k_norm */
            if (L->qk_norm_full) {
                rmsnorm(row, L->q_norm, row, 1, nh * hd, m->eps);
                rmsnorm(row + (long)nh * hd, L->k_norm, row + (long)nh * hd, 1, nkv * hd, m->eps);
            } else {
                rmsnorm(row, L->q_norm, row, nh, hd, m->eps);
                rmsnorm(row + (long)nh * hd, L->k_norm, row + (long)nh * hd, nkv, hd, m->eps);
            }
        }
        if (L->cos) {
            const float *c = L->cos + s->positions[b] * rd, *sn = L->sin + s->positions[b] * rd;
            for (int h = 0; h < nh + nkv; h++) rope(row + h * hd, c, sn, rd); /* q heads then k heads */
        }
        const float *k = row + nh * hd, *v = k + nkv * hd;
        for (int h = 0; h < nkv; h++) {
            const long at = (h * m->kv_slots + slot_of(s, b, s->positions[b])) * hd;
            const float *kh = k + h * hd, *vh = v + h * hd;
            if (m->kv16) { /* round to nearest even, as torch's .half() does on the prefill path */
                uint16_t *kd = (uint16_t *)L->k_cache + at, *vd = (uint16_t *)L->v_cache + at;
                for (int i = 0; i < hd; i++) { kd[i] = _cvtss_sh(kh[i], 0); vd[i] = _cvtss_sh(vh[i], 0); }
            } else {
                float *kd = (float *)L->k_cache + at, *vd = (float *)L->v_cache + at;
                for (int i = 0; i < hd; i++) { kd[i] = kh[i]; vd[i] = vh[i]; }
            }
        }
    }
    attention(m, L, s);
    gemv(m, &L->o, s->attn, s->sums, s->tmp, B);
    add_branch(m, x, s->tmp, L->attn_out, B);
    in = x;
    if (L->mlp_in) { rmsnorm(x, L->mlp_in, s->h, B, H, m->eps); in = s->h; }
    gemv(m, &L->gate_up, in, s->sums, s->gu, B);
    const int gelu = m->act == 1;
#pragma omp parallel for schedule(static) num_threads(team(m))
    for (int b = 0; b < B; b++) {
        const float *g = s->gu + (long)b * 2 * I, *u = g + I;
        float *a = s->act + (long)b * I;
        int i = 0;
        if (gelu) {
            for (; i + 8 <= I; i += 8)
                _mm256_storeu_ps(a + i, _mm256_mul_ps(gelu_tanh8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
            for (; i < I; i++) a[i] = gelu_tanh1(g[i]) * u[i];
            continue;
        }
        for (; i + 8 <= I; i += 8) { /* silu(g) * u = g / (1 + exp(-g)) * u */
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
            _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    gemv(m, &L->down, s->act, s->sums, s->tmp, B);
    add_branch(m, x, s->tmp, L->mlp_out, B);
}
