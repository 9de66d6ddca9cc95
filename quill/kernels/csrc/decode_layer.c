/* One decoder layer for B decode rows, fused: the whole layer is one call from Python.
 *
 *   x += o_proj(attention(rope(qkv(rmsnorm(x)))))      K/V of the new token written first
 *   x += down(silu(gate) * up)(rmsnorm(x))
 *
 * Every row is computed with the same sequence of operations whatever B is, so a
 * sequence's output does not depend on what else is in the batch (batch invariance).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

void quill_gemv_q4(const uint8_t *, const float *, const float *, const float *, float *, float *, int, int, int);
void quill_gemv_q8(const int8_t *, const float *, const float *, const float *, float *, float *, int, int, int);

typedef struct {
    int kind; /* 0 = q4, 1 = q8, 2 = f32 (codes points at an (N, K) float matrix) */
    int rows, groups;
    const void *codes;
    const float *scale, *mins, *bias;
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
    float *h, *qkv, *attn, *gu, *act, *tmp, *scores, *sums; /* scratch */
} StepArgs;

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
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

static void rmsnorm(const float *x, const float *w, float *out, int B, int H, float eps) {
    for (int b = 0; b < B; b++) {
        const float *xb = x + (long)b * H;
        float ss = 0.f;
        for (int i = 0; i < H; i++) ss += xb[i] * xb[i];
        float r = 1.0f / sqrtf(ss / H + eps);
        for (int i = 0; i < H; i++) out[(long)b * H + i] = xb[i] * r * w[i];
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

/* One task per (row, KV head): the q heads that share that KV head read each K and V
 * vector once (grouped-query attention), so the cache is streamed once, not once per q head. */
static void attention(const ModelShape *m, const LayerWeights *L, const StepArgs *s) {
    const int hd = m->head_dim, nh = m->heads, nkv = m->kv_heads, group = nh / nkv;
    const int qkv_n = (nh + 2 * nkv) * hd;
#pragma omp parallel for schedule(static) collapse(2)
    for (int b = 0; b < s->batch; b++)
        for (int kvh = 0; kvh < nkv; kvh++) {
            const long len = s->ctx_lens[b];
            const int64_t *slots = s->ctx_slots + (long)b * s->max_ctx;
            const float *q0 = s->qkv + (long)b * qkv_n + (long)kvh * group * hd;
            float *sc0 = s->scores + ((long)b * nh + (long)kvh * group) * s->max_ctx;
            float mx[MAX_GROUP], total[MAX_GROUP];
            for (int g = 0; g < group; g++) { mx[g] = -INFINITY; total[g] = 0.f; }
            for (long l = 0; l < len; l++) {
                const float *k = L->k_cache + (slots[l] * nkv + kvh) * hd;
                for (int g = 0; g < group; g++) {
                    float v = dot(q0 + g * hd, k, hd) * m->scale;
                    sc0[g * s->max_ctx + l] = v;
                    if (v > mx[g]) mx[g] = v;
                }
            }
            for (int g = 0; g < group; g++) {
                float *sc = sc0 + g * s->max_ctx;
                for (long l = 0; l < len; l++) { sc[l] = expf(sc[l] - mx[g]); total[g] += sc[l]; }
            }
            float *out0 = s->attn + (long)b * nh * hd + (long)kvh * group * hd;
            for (int i = 0; i < hd; i += 8) {
                __m256 acc[MAX_GROUP];
                for (int g = 0; g < group; g++) acc[g] = _mm256_setzero_ps();
                for (long l = 0; l < len; l++) {
                    __m256 v = _mm256_loadu_ps(L->v_cache + (slots[l] * nkv + kvh) * hd + i);
                    for (int g = 0; g < group; g++)
                        acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(sc0[g * s->max_ctx + l]), v, acc[g]);
                }
                for (int g = 0; g < group; g++)
                    _mm256_storeu_ps(out0 + g * hd + i, _mm256_mul_ps(acc[g], _mm256_set1_ps(1.0f / total[g])));
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
#pragma omp parallel for schedule(static) collapse(2)
    for (int b = 0; b < B; b++)
        for (int i = 0; i < I; i++) {
            float g = s->gu[(long)b * 2 * I + i], u = s->gu[(long)b * 2 * I + I + i];
            s->act[(long)b * I + i] = g / (1.0f + expf(-g)) * u;
        }
    gemv(&L->down, s->act, s->sums, s->tmp, B);
    for (long i = 0; i < (long)B * H; i++) x[i] += s->tmp[i];
}
