/* Weight-only quantized matmul on the CPU with 8-bit activations: y[M, N] = x[M, K] @ W[N, K]^T.
 *
 * The scheme of llama.cpp's CPU kernels (Q4_1 / Q8_0 weights times Q8_1 activations): the activations are quantized
 * once per call to int8 per block of 32 columns (d = max|x| / 127, q = round(x / d), and the block's code sum), and
 * every block's product is an integer dot product of weight codes with activation codes, scaled once:
 *
 *     y[m, n] = sum_b  s_w[n, b] * d_x[m, b] * dot(q_w[n, b], q_x[m, b])  +  min_w[n, b] * d_x[m, b] * sum(q_x[m, b])
 *
 * for W = q_w * s_w + min_w. A row of weights is read once for all M activation rows, so a few-row product (a
 * speculative verify step) costs about what a one-row product does: the weights' bytes bound both.
 *
 * Weight layout (built by rooflm.kernels.cpu_native.matmul.pack_native): blocks come in pairs (the block count is
 * padded to an even number with zero codes and zero scales).
 *   4 bits: per row, per pair of blocks (2b, 2b + 1): 32 bytes; byte j holds column j of block 2b in its low nibble
 *           and column j of block 2b + 1 in its high nibble; codes are unsigned in [0, 15].
 *   8 bits: per row, per block: 32 bytes of unsigned codes u = q + 128 (the signed code q is u - 128).
 *   scales, mins: float32 [N, nb] (mins may be NULL).
 * The 8-bit codes are stored unsigned because VNNI's vpdpbusd multiplies unsigned by signed bytes; the offset is
 * removed in integer arithmetic (the accumulator starts at -128 * the activation codes' partial sums), so the
 * integer dot product stays exact.
 *
 * Instruction sets, chosen at compile time from -march: AVX512-VNNI (two blocks per 512-bit vpdpbusd), AVX2
 * (vpmaddubsw + vpmaddwd per block) and portable C. Rows are spread over threads in chunks: compiled with -fopenmp
 * (the loader does so when torch's own runtime is GNU libgomp, which this library then shares), on torch's OpenMP
 * threads; else on a small persistent pthread pool whose workers spin briefly after a call (a decode step makes about
 * a hundred calls a few microseconds apart), yielding their core, and then sleep on a condition variable. A second
 * set of spinning threads beside torch's would take turns with them for the two cores of a small machine.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sched.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define QMM_PAUSE() _mm_pause()
#else
#define QMM_PAUSE() ((void)0)
#endif

#if !defined(QMM_FORCE_SCALAR) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QMM_ISA 2
#elif !defined(QMM_FORCE_SCALAR) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QMM_ISA 1
#else
#define QMM_ISA 0
#endif

#ifdef _OPENMP
#define USE_OPENMP 1
#else
#define USE_OPENMP 0
#endif

#define BLK 32
#define MT_MAX 8      /* activation rows per register tile */
#define ROWS_CHUNK 16 /* output rows a thread takes at a time */
#define MAX_THREADS 256

typedef struct {
    const uint8_t *codes;
    const void *scales; /* float32, or float16 when f16 */
    const void *mins;   /* as scales; NULL: no min term */
    int64_t n, k;       /* output rows, input columns (k % 32 == 0) */
    int64_t nb;         /* blocks per row, padded to even */
    int64_t bits;       /* 4 or 8 */
    int64_t f16;        /* scales and mins stored as IEEE half (exact for GGUF's fp16 block scales) */
} qmm_weight;

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FF) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* scale or min i of a row, either storage */
static inline __attribute__((always_inline)) float ld(const void *p, int64_t i, const int f16) {
    return f16 ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

int qmm_isa(void) { return QMM_ISA; }

/* ---- activation scratch (one call at a time: guarded by call_mu) ---- */
static int8_t *s_qx;    /* [M, nb * 32] codes */
static float *s_d;      /* [M, nb] block scales */
static float *s_c;      /* [M, nb] d * sum(codes): the min term's factor */
static float *s_dv;     /* [M, nb, 8] d repeated over a block's 8 int32 lanes (AVX512) */
static int32_t *s_corr; /* [M, nb, 8] -128 * partial code sums, the 8-bit codes' offset (AVX512) */
static size_t s_cap;    /* elements of s_qx allocated */

static int grow(size_t nq) {
    if (nq <= s_cap) return 0;
    free(s_qx); free(s_d); free(s_c); free(s_dv); free(s_corr);
    s_qx = NULL; s_d = s_c = s_dv = NULL; s_corr = NULL; s_cap = 0;
    size_t nblk = nq / BLK;
    if (posix_memalign((void **)&s_qx, 64, nq) || posix_memalign((void **)&s_d, 64, nblk * 4) ||
        posix_memalign((void **)&s_c, 64, nblk * 4) || posix_memalign((void **)&s_dv, 64, nblk * 32) ||
        posix_memalign((void **)&s_corr, 64, nblk * 32))
        return -1;
    s_cap = nq;
    return 0;
}

static void quantize_block(const float *x, int valid, int odd, int8_t *q, float *d, float *c, float *dv,
                           int32_t *corr) {
    float amax = 0.f;
    for (int i = 0; i < valid; i++) amax = fmaxf(amax, fabsf(x[i]));
    float dd = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int i = 0; i < BLK; i++) {
        int v = i < valid ? (int)nearbyintf(x[i] * id) : 0;
        q[i] = (int8_t)v;
        sum += v;
    }
    *d = dd;
    *c = dd * (float)sum;
#if QMM_ISA == 2
    /* the AVX512 path masks a 4-bit pair's odd block in place (16 q) instead of shifting it: 1/16 is exact */
    const float dodd = odd ? dd / 16.f : dd;
#else
    const float dodd = dd;
    (void)odd;
#endif
    for (int j = 0; j < 8; j++) {
        dv[j] = dodd;
        corr[j] = -128 * (q[4 * j] + q[4 * j + 1] + q[4 * j + 2] + q[4 * j + 3]);
    }
}

static void quantize_rows(const float *x, int64_t m, int64_t k, int64_t nb, int odd16) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < nb; b++) {
            int64_t i = r * nb + b;
            int valid = b * BLK < k ? BLK : 0;
            quantize_block(x + r * k + b * BLK, valid, odd16 && (b & 1), s_qx + i * BLK, s_d + i, s_c + i, s_dv + i * 8, s_corr + i * 8);
        }
}

/* ---- one output row against a tile of mt activation rows ---- */
#if QMM_ISA == 2
/* the pair (2p, 2p + 1) of a row's scales or mins as [s0 x 8, s1 x 8] */
static inline __attribute__((always_inline)) __m512 pair_vec(const void *p, int64_t i, const int f16) {
    const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 v;
    if (f16)
        v = _mm512_cvtph_ps(_mm256_castsi128_si256(_mm_loadu_si32((const uint16_t *)p + i)));
    else
        v = _mm512_maskz_loadu_ps(3, (const float *)p + i);
    return _mm512_permutexvar_ps(pick, v);
}

static inline __attribute__((always_inline)) void row_tile(const qmm_weight *w, int64_t n, int64_t m0, const int mt,
                                                           const int f16, float *out) {
    const int64_t nb = w->nb, np = nb / 2;
    __m512 acc[MT_MAX];
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    /* a pair's 32 bytes twice: the low nibbles give block 2p, the high ones 16 x block 2p + 1 (its activation
     * scale carries the 1/16), with one AND and no shift */
    const __m512i nib = _mm512_inserti64x4(_mm512_set1_epi8(0x0F), _mm256_set1_epi8((char)0xF0), 1);
    const int8_t *qx = s_qx + m0 * nb * BLK;
    const float *dv = s_dv + m0 * nb * 8;
    const int32_t *corr = s_corr + m0 * nb * 8;
    if (w->bits == 4) {
        const uint8_t *wc = w->codes + n * nb * 16;
        for (int64_t p = 0; p < np; p++) {
            __m512i q = _mm512_and_si512(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(wc + p * 32))),
                                         nib);
            __m512 sw = pair_vec(w->scales, n * nb + 2 * p, f16);
            for (int i = 0; i < mt; i++) {
                __m512i xi = _mm512_loadu_si512(qx + i * nb * BLK + p * 64);
                __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xi);
                __m512 s = _mm512_mul_ps(sw, _mm512_loadu_ps(dv + i * nb * 8 + p * 16));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[i]);
            }
        }
    } else {
        const uint8_t *wc = w->codes + n * nb * 32;
        for (int64_t p = 0; p < np; p++) {
            __m512i q = _mm512_loadu_si512(wc + p * 64);
            __m512 sw = pair_vec(w->scales, n * nb + 2 * p, f16);
            for (int i = 0; i < mt; i++) {
                __m512i xi = _mm512_loadu_si512(qx + i * nb * BLK + p * 64);
                __m512i dot = _mm512_dpbusd_epi32(_mm512_loadu_si512(corr + i * nb * 8 + p * 16), q, xi);
                __m512 s = _mm512_mul_ps(sw, _mm512_loadu_ps(dv + i * nb * 8 + p * 16));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[i]);
            }
        }
    }
    if (w->mins) {
        for (int64_t b = 0; b < nb; b += 16) {
            __mmask16 k = nb - b >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nb - b)) - 1);
            __m512 mv = f16 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)w->mins + n * nb + b))
                            : _mm512_maskz_loadu_ps(k, (const float *)w->mins + n * nb + b);
            for (int i = 0; i < mt; i++)
                acc[i] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, s_c + (m0 + i) * nb + b), acc[i]);
        }
    }
    for (int i = 0; i < mt; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
}
#elif QMM_ISA == 1
static inline __attribute__((always_inline)) __m256 block_dot(__m256i q, __m256i x, int bits) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (bits == 8) { /* signed codes; |q| * sign(x, q): pairs sum to at most 2 * 128 * 127, no saturation */
        q = _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80));
        x = _mm256_sign_epi8(x, q);
        q = _mm256_abs_epi8(q);
    }
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q, x), ones));
}

static inline __attribute__((always_inline)) void row_tile(const qmm_weight *w, int64_t n, int64_t m0, const int mt,
                                                           const int f16, float *out) {
    const int64_t nb = w->nb;
    __m256 acc[MT_MAX];
    for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    const int8_t *qx = s_qx + m0 * nb * BLK;
    const float *d = s_d + m0 * nb;
    for (int64_t b = 0; b < nb; b += 2) {
        __m256i q0, q1;
        if (w->bits == 4) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(w->codes + n * nb * 16 + b * 16));
            q0 = _mm256_and_si256(v, lo4);
            q1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
        } else {
            q0 = _mm256_loadu_si256((const __m256i *)(w->codes + n * nb * 32 + b * 32));
            q1 = _mm256_loadu_si256((const __m256i *)(w->codes + n * nb * 32 + b * 32 + 32));
        }
        const float s0 = ld(w->scales, n * nb + b, f16), s1 = ld(w->scales, n * nb + b + 1, f16);
        for (int i = 0; i < mt; i++) {
            const int8_t *xi = qx + i * nb * BLK + b * BLK;
            __m256 p0 = block_dot(q0, _mm256_loadu_si256((const __m256i *)xi), (int)w->bits);
            __m256 p1 = block_dot(q1, _mm256_loadu_si256((const __m256i *)(xi + BLK)), (int)w->bits);
            acc[i] = _mm256_fmadd_ps(p0, _mm256_set1_ps(s0 * d[i * nb + b]), acc[i]);
            acc[i] = _mm256_fmadd_ps(p1, _mm256_set1_ps(s1 * d[i * nb + b + 1]), acc[i]);
        }
    }
    for (int i = 0; i < mt; i++) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        float r = _mm_cvtss_f32(s);
        if (w->mins)
            for (int64_t b = 0; b < nb; b++) r += ld(w->mins, n * nb + b, f16) * s_c[(m0 + i) * nb + b];
        out[i] = r;
    }
}
#else
/* Not auto-vectorised: GCC 12 with VNNI enabled turns the 8-bit loop below into a wrong dot product. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-vectorize")))
#endif
static inline void row_tile(const qmm_weight *w, int64_t n, int64_t m0, const int mt, const int f16, float *out) {
    const int64_t nb = w->nb;
    for (int i = 0; i < mt; i++) {
        const int8_t *qx = s_qx + (m0 + i) * nb * BLK;
        float r = 0.f;
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *xb = qx + b * BLK;
            int32_t dot = 0;
            if (w->bits == 4) {
                const uint8_t *c = w->codes + n * nb * 16 + (b / 2) * 32;
                const int shift = (b & 1) ? 4 : 0;
                for (int j = 0; j < BLK; j++) dot += ((c[j] >> shift) & 0x0F) * xb[j];
            } else {
                const uint8_t *c = w->codes + n * nb * 32 + b * 32;
                for (int j = 0; j < BLK; j++) dot += ((int)c[j] - 128) * xb[j];
            }
            r += ld(w->scales, n * nb + b, f16) * s_d[(m0 + i) * nb + b] * (float)dot;
            if (w->mins) r += ld(w->mins, n * nb + b, f16) * s_c[(m0 + i) * nb + b];
        }
        out[i] = r;
    }
}
#endif

static void rows(const qmm_weight *w, int64_t m, float *y, int64_t n0, int64_t n1) {
    float out[MT_MAX];
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m0 = 0; m0 < m; m0 += MT_MAX) {
            int64_t mt = m - m0 < MT_MAX ? m - m0 : MT_MAX;
            /* constant tile sizes and scale storage: the compiler keeps the accumulators in registers */
#define QMM_TILES(F16)                                     \
    switch (mt) {                                          \
    case 1: row_tile(w, n, m0, 1, F16, out); break;        \
    case 2: row_tile(w, n, m0, 2, F16, out); break;        \
    case 3: row_tile(w, n, m0, 3, F16, out); break;        \
    case 4: row_tile(w, n, m0, 4, F16, out); break;        \
    case 5: row_tile(w, n, m0, 5, F16, out); break;        \
    case 6: row_tile(w, n, m0, 6, F16, out); break;        \
    case 7: row_tile(w, n, m0, 7, F16, out); break;        \
    default: row_tile(w, n, m0, 8, F16, out); break;       \
    }
            if (w->f16) {
                QMM_TILES(1)
            } else {
                QMM_TILES(0)
            }
            for (int64_t i = 0; i < mt; i++) y[(m0 + i) * w->n + n] = out[i];
        }
}

/* ---- thread pool ----
 * A call publishes its rows as chunks and opens the job; workers that wake while it is open take chunks, and the
 * caller takes them too. When every chunk is taken the caller closes the job and waits only for the workers still
 * inside it: a worker that did not get a core in time (two cores shared with torch's threads) is never waited for. */
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t sleep_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sleep_cv = PTHREAD_COND_INITIALIZER;
static int pool_size;           /* worker threads started */
static atomic_uint gen;         /* bumped once per parallel call */
static atomic_int sleepers;     /* workers waiting on sleep_cv */
static atomic_int open_job;     /* 1 while the current call's chunks may be taken */
static atomic_int inside;       /* workers inside the current call */
static atomic_long next_chunk;  /* next chunk of output rows to take */
static int spin_iters = 4000;   /* polls a worker makes before sleeping; it yields its core every 16 */
static struct {
    const qmm_weight *w;
    int64_t m;
    float *y;
    int64_t nchunks;
    int active; /* workers that may take rows in this call */
} job;

static void take_chunks(void) {
    for (;;) {
        int64_t c = atomic_fetch_add(&next_chunk, 1);
        if (c >= job.nchunks) break;
        int64_t n0 = c * ROWS_CHUNK, n1 = n0 + ROWS_CHUNK < job.w->n ? n0 + ROWS_CHUNK : job.w->n;
        rows(job.w, job.m, job.y, n0, n1);
    }
}

static unsigned start_gen[MAX_THREADS];

static void *worker(void *arg) {
    int id = (int)(intptr_t)arg;
    unsigned seen = start_gen[id]; /* the generation when it was created: a call made since is still run */
    for (;;) {
        unsigned g;
        int spins = 0;
        while ((g = atomic_load(&gen)) == seen) {
            if (spins++ < spin_iters) {
                if (spins % 16)
                    QMM_PAUSE();
                else
                    sched_yield(); /* let a runnable thread (torch's) have this core */
                continue;
            }
            pthread_mutex_lock(&sleep_mu);
            atomic_fetch_add(&sleepers, 1);
            while (atomic_load(&gen) == seen) pthread_cond_wait(&sleep_cv, &sleep_mu);
            atomic_fetch_sub(&sleepers, 1);
            pthread_mutex_unlock(&sleep_mu);
        }
        seen = g;
        atomic_fetch_add(&inside, 1);
        if (atomic_load(&open_job) && id < job.active) take_chunks();
        atomic_fetch_sub(&inside, 1);
    }
    return NULL;
}

static void reset_after_fork(void) { /* the child has none of the parent's workers */
    pool_size = 0;
    pthread_mutex_init(&call_mu, NULL);
    pthread_mutex_init(&sleep_mu, NULL);
    pthread_cond_init(&sleep_cv, NULL);
    atomic_store(&sleepers, 0);
    atomic_store(&inside, 0);
    atomic_store(&open_job, 0);
}

static void grow_pool(int want) {
    static int fork_hook;
    if (!fork_hook) fork_hook = !pthread_atfork(NULL, NULL, reset_after_fork);
    while (pool_size < want && pool_size < MAX_THREADS) {
        pthread_t t;
        pthread_attr_t attr;
        start_gen[pool_size] = atomic_load(&gen);
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, worker, (void *)(intptr_t)pool_size);
        pthread_attr_destroy(&attr);
        if (rc) break;
        pool_size++;
    }
}

void qmm_set_spin(int iters) { spin_iters = iters < 0 ? 0 : iters; }

/* y[m, w->n] = x[m, w->k] @ W^T, both float32 and contiguous. 0 on success, -1 when out of memory, -2 on bad
 * arguments. */
int qmm_matmul(const qmm_weight *w, const float *x, float *y, int64_t m, int nthreads) {
    if (m <= 0 || w->n <= 0) return 0;
    if (w->k <= 0 || w->k % BLK || w->nb * BLK < w->k || w->nb % 2 || (w->bits != 4 && w->bits != 8)) return -2;
    pthread_mutex_lock(&call_mu);
    if (grow((size_t)(m * w->nb * BLK))) {
        pthread_mutex_unlock(&call_mu);
        return -1;
    }
    quantize_rows(x, m, w->k, w->nb, w->bits == 4);
    int64_t nchunks = (w->n + ROWS_CHUNK - 1) / ROWS_CHUNK;
    int workers = nthreads - 1;
    if (workers > nchunks - 1) workers = (int)(nchunks - 1);
    if (workers > 0 && !USE_OPENMP) grow_pool(workers);
    if (!USE_OPENMP && workers > pool_size) workers = pool_size;
    if (workers <= 0) {
        rows(w, m, y, 0, w->n);
    } else if (USE_OPENMP) {
#ifdef _OPENMP
        /* built against the OpenMP runtime torch already loaded: its threads, no second pool */
#pragma omp parallel for schedule(dynamic, 1) num_threads(workers + 1)
        for (int64_t c = 0; c < nchunks; c++) {
            int64_t n0 = c * ROWS_CHUNK, n1 = n0 + ROWS_CHUNK < w->n ? n0 + ROWS_CHUNK : w->n;
            rows(w, m, y, n0, n1);
        }
#endif
    } else {
        job.w = w; job.m = m; job.y = y; job.nchunks = nchunks; job.active = workers;
        atomic_store(&next_chunk, 0);
        atomic_store(&open_job, 1);
        atomic_fetch_add(&gen, 1);
        if (atomic_load(&sleepers) > 0) {
            pthread_mutex_lock(&sleep_mu);
            pthread_cond_broadcast(&sleep_cv);
            pthread_mutex_unlock(&sleep_mu);
        }
        take_chunks();
        atomic_store(&open_job, 0);
        while (atomic_load(&inside) > 0) QMM_PAUSE(); /* only workers that are taking rows of this call */
    }
    pthread_mutex_unlock(&call_mu);
    return 0;
}
