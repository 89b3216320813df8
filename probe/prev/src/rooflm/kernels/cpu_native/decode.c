/* A decoder layer of a one-token decode step in one call: the operators of qmm.c and ops.c in the order the
 * layer's modules call them, without going back to Python between them.
 *
 * On a small CPU a decode step of a small model is dominated by host overhead: SmolLM2-135M's step runs about 15
 * native calls and a dozen torch operators per layer, each a few microseconds of Python, dispatch and argument
 * checking for well under a microsecond of work (llama.cpp evaluates the same step as one graph in C). Here the work
 * between one layer's SiLU product and the next layer's is one call, ``decode_segment``:
 *
 *     [down projection of the previous layer's SiLU product, residual add]
 *     rms_norm -> qkv projection -> rotary embedding + K/V cache write -> attention over the paged cache
 *     -> o projection -> residual add -> rms_norm -> gate_up projection
 *
 * calling the very functions the per-operator path calls (qmm_matmul, ops_rms_norm, ops_rope_write, ops_attend)
 * with the same arguments, and adding the residual in float32 as torch does, so every float is the same as on that
 * path. The SiLU product stays with the caller (torch's silu), for the same reason.
 *
 * ops_rope_write, the rotary embedding (Su et al. 2021) of a step's q and k heads and the write of its K and V to the
 * paged cache, lives here too; the per-operator path calls it for steps of any number of tokens.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

struct qmm_weight;
int qmm_matmul(const struct qmm_weight *w, const float *x, float *y, int64_t m, int nthreads);
void ops_rms_norm(const float *x, const float *w, float eps, float *out, int64_t rows, int64_t dim);
int ops_attend(const float *q, float *out, int64_t T, int64_t hq, int64_t hkv, int64_t d, float scale, const float *k,
               const float *v, int64_t rs, const int64_t *nkeys, const int64_t *pos, const int64_t *blocks, int64_t bs,
               int64_t table_stride, int nthreads);

/* Rotary embedding (Su et al. 2021, the rotate-half layout) of the q and k heads of T tokens, and the cache write:
 * qk rows [hq + hkv heads of d] qk_rs floats apart, v rows [hkv heads of d] v_rs apart; cos2 = [cos, cos] and
 * sin2 = [-sin, sin] per token ([T, d]); x' = x * cos2 + roll(x, d / 2) * sin2. The rotated heads go to qk_out
 * [T, hq + hkv, d]; token t's rotated K and its V to the caches' row slots[t] (hkv * d floats a row; a negative slot
 * is not written). */
void ops_rope_write(const float *qk, int64_t qk_rs, const float *v, int64_t v_rs, const float *cos2, const float *sin2,
                    int64_t T, int64_t hq, int64_t hkv, int64_t d, float *qk_out, float *kcache, float *vcache,
                    const int64_t *slots) {
    const int64_t half = d / 2, heads = hq + hkv;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos2 + t * d, *sn = sin2 + t * d;
        for (int64_t h = 0; h < heads; h++) {
            const float *x = qk + t * qk_rs + h * d;
            float *y = qk_out + (t * heads + h) * d;
            for (int64_t i = 0; i < half; i++) y[i] = fmaf(x[i + half], sn[i], x[i] * c[i]);
            for (int64_t i = half; i < d; i++) y[i] = fmaf(x[i - half], sn[i], x[i] * c[i]);
        }
        if (slots[t] >= 0) {
            memcpy(kcache + slots[t] * hkv * d, qk_out + (t * heads + hq) * d, (size_t)(hkv * d) * sizeof(float));
            memcpy(vcache + slots[t] * hkv * d, v + t * v_rs, (size_t)(hkv * d) * sizeof(float));
        }
    }
}

/* one layer's weights and cache (fixed for the life of the model) */
typedef struct {
    const struct qmm_weight *qkv, *o, *gate_up, *down;
    const float *norm1, *norm2; /* input_layernorm and post_attention_layernorm weights */
    float eps1, eps2;
    float *kcache, *vcache; /* this layer's K and V planes: [blocks * block_size, hkv, d] */
} decode_layer;

/* the step: sizes, the token's rotary tables, slot and block table, and the buffers (float32, caller-owned) */
typedef struct {
    int64_t hidden, hq, hkv, d;
    float scale;
    const float *cos2, *sin2; /* [d] each: [cos, cos] and [-sin, sin] of the token's position */
    int64_t slot;             /* the cache row of the token's K and V */
    int64_t nkeys;            /* keys the token attends to: the context, itself included */
    const int64_t *blocks;    /* the sequence's block table */
    int64_t block_size;
    int64_t nthreads;
    float *residual; /* [hidden]: the residual stream, updated in place */
    float *act;      /* [inter]: the previous layer's SiLU product (read when a previous layer is given) */
    float *normed;   /* [hidden] */
    float *qkv;      /* [(hq + 2 hkv) d] */
    float *qk;       /* [(hq + hkv) d]: q and k rotated */
    float *attn;     /* [hq d] */
    float *proj;     /* [hidden]: an o or down projection's output */
    float *gate_up;  /* [2 inter]: the result */
} decode_step;

static void add_into(float *residual, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) residual[i] = x[i] + residual[i];
}

/* ``prev``: the previous layer, whose down projection of s->act starts the segment (NULL for the first layer: the
 * residual stream already holds the layer's input). 0 on success, else the failing operator's code. */
int decode_segment(const decode_layer *prev, const decode_layer *cur, decode_step *s) {
    const int nt = (int)s->nthreads;
    const int64_t hd = s->hidden, q_kv = (s->hq + s->hkv) * s->d, rs = s->hkv * s->d;
    int rc;
    if (prev) {
        if ((rc = qmm_matmul(prev->down, s->act, s->proj, 1, nt))) return rc;
        add_into(s->residual, s->proj, hd);
    }
    ops_rms_norm(s->residual, cur->norm1, cur->eps1, s->normed, 1, hd);
    if ((rc = qmm_matmul(cur->qkv, s->normed, s->qkv, 1, nt))) return rc;
    ops_rope_write(s->qkv, q_kv + rs, s->qkv + q_kv, rs, s->cos2, s->sin2, 1, s->hq, s->hkv, s->d, s->qk, cur->kcache,
                   cur->vcache, &s->slot);
    if ((rc = ops_attend(s->qk, s->attn, 1, s->hq, s->hkv, s->d, s->scale, cur->kcache, cur->vcache, rs, &s->nkeys,
                         0, s->blocks, s->block_size, 0, nt)))
        return rc;
    if ((rc = qmm_matmul(cur->o, s->attn, s->proj, 1, nt))) return rc;
    add_into(s->residual, s->proj, hd);
    ops_rms_norm(s->residual, cur->norm2, cur->eps2, s->normed, 1, hd);
    return qmm_matmul(cur->gate_up, s->normed, s->gate_up, 1, nt);
}
