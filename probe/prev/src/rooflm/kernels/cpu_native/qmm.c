/* Weight-only quantized matmul on the CPU with 8-bit activations: y[M, N] = x[M, K] @ W[N, K]^T.
 *
 * The scheme of llama.cpp's CPU kernels (Q4_1 / Q8_0 weights times Q8_1 activations): the activations are quantized
 * once per call to int8 per block of 32 columns (d = max|x| / 127, q = round(x / d), and the block's code sum), and
 * every block's product is an integer dot product of weight codes with activation codes, scaled once:
 *
 *     y[m, n] = sum_b  s_w[n, b] * d_x[m, b] * dot(q_w[n, b], q_x[m, b])  +  min_w[n, b] * d_x[m, b] * sum(q_x[m, b])
 *
 * for W = q_w * s_w + min_w. Every path (AVX512-VNNI, AVX2, portable C) evaluates this in the same order, with one
 * fused multiply-add per term (the scale terms and the min terms summed apart, then added), so their results are
 * the same bits, and a row's result never depends on the other rows of the call: a speculative verify step of M rows
 * scores each row exactly as a one-row decode step would.
 *
 * Weight layout (built by rooflm.kernels.cpu_native.matmul.pack_native): output rows in groups of 16 (N padded with
 * zero rows), and for each group its 32-column blocks in order; within a (group, block) the 16 rows' codes are
 * interleaved four columns at a time, so that one 512-bit vpdpbusd multiplies four columns of all 16 rows by the
 * same four activation codes (broadcast) and leaves each row's partial sum in its own 32-bit lane: no horizontal
 * reduction, and the unpacked weights of a block serve every activation row of the call. This is what makes a few-row
 * product (a verify step) cost about what a one-row product does: the weights' bytes bound both.
 *   4 bits: 256 bytes per (group, block): 4 x 64 bytes, octet o (columns 8o .. 8o + 7), byte 4r + j holds column
 *           8o + j of row r in its low nibble and column 8o + 4 + j in its high nibble; unsigned codes in [0, 15].
 *   8 bits: 512 bytes per (group, block): 8 x 64 bytes, quad t (columns 4t .. 4t + 3), byte 4r + j holds column
 *           4t + j of row r as u = q + 128 (vpdpbusd multiplies unsigned by signed bytes; the offset is removed in
 *           integer arithmetic by starting the sum at -128 * the activation codes' sum, so it stays exact).
 *   scales, mins: [groups, blocks, 16] float32 or float16 (mins may be NULL).
 *
 * Instruction sets, chosen at compile time from -march: AVX512-VNNI, AVX2 (vpmaddubsw + vpmaddwd) and portable C.
 * Groups of rows are spread over threads: compiled with -fopenmp (the loader does so when torch's own runtime is GNU
 * libgomp, which this library then shares), on torch's OpenMP threads; else on a small persistent pthread pool whose
 * workers spin briefly after a call (a decode step makes about a hundred calls a few microseconds apart), yielding
 * their core, and then sleep on a condition variable. A second set of spinning threads beside torch's would take
 * turns with them for the two cores of a small machine.
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
#define GR 16         /* output rows interleaved in a group */
#if QMM_ISA == 1
#define MT_MAX 4      /* activation rows per register tile: AVX2 has 16 vector registers */
#else
#define MT_MAX 8
#endif
#define MAX_THREADS 256
#ifndef CHUNKS_PER_THREAD
#define CHUNKS_PER_THREAD 2
#endif
#ifndef QMM_PREFETCH
#define QMM_PREFETCH 4096 /* bytes ahead of the codes being read (a software prefetch: +20% at 2 threads) */
#endif

typedef struct qmm_weight {
    const uint8_t *codes;
    const void *scales; /* float32, or float16 when f16 */
    const void *mins;   /* as scales; NULL: no min term */
    int64_t n, k;       /* output rows, input columns (k % 32 == 0) */
    int64_t nb;         /* blocks per row */
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

/* scale or min i, either storage */
static inline __attribute__((always_inline)) float ld(const void *p, int64_t i, const int f16) {
    return f16 ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

int qmm_isa(void) { return QMM_ISA; }

/* ---- activation scratch (one call at a time: guarded by call_mu) ---- */
static int8_t *s_qx;    /* [M, nb * 32] codes */
static float *s_d;      /* [M, nb] block scales */
static float *s_c;      /* [M, nb] d * sum(codes): the min term's factor */
static int32_t *s_off;  /* [M, nb] -128 * sum(codes): the 8-bit codes' offset */
static size_t s_cap;    /* elements of s_qx allocated */

static int grow(size_t nq) {
    if (nq <= s_cap) return 0;
    free(s_qx); free(s_d); free(s_c); free(s_off);
    s_qx = NULL; s_d = s_c = NULL; s_off = NULL; s_cap = 0;
    size_t nblk = nq / BLK;
    if (posix_memalign((void **)&s_qx, 64, nq) || posix_memalign((void **)&s_d, 64, nblk * 4) ||
        posix_memalign((void **)&s_c, 64, nblk * 4) || posix_memalign((void **)&s_off, 64, nblk * 4))
        return -1;
    s_cap = nq;
    return 0;
}

/* A block's codes: q = round-half-even(x * id), their sum returned. The AVX2 form does the same operations on 8
 * lanes (one product, the same rounding, exact integer sums), so the same codes: a decode step quantizes about 4k
 * activations per layer, 2.2 us per 576 in the scalar loop on a Zen 3 core against about a tenth of that here. */
static inline int quantize_block(const float *xb, float id, int8_t *q) {
#if QMM_ISA >= 1
    const __m256 s = _mm256_set1_ps(id);
    __m256i v[4];
    for (int u = 0; u < 4; u++)
        v[u] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * u), s),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    /* |codes| <= 127: the saturating packs are exact; the permutation undoes their lane interleaving */
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i t = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
    const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    const __m128i h2 = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 0xB1)));
#else
    int sum = 0;
    for (int j = 0; j < BLK; j++) {
        const int v = (int)nearbyintf(xb[j] * id);
        q[j] = (int8_t)v;
        sum += v;
    }
    return sum;
#endif
}

static inline float block_amax(const float *xb) {
#if QMM_ISA >= 1
    const __m256 mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 a = _mm256_setzero_ps();
    for (int u = 0; u < 4; u++) a = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xb + 8 * u), mag), a);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h))); /* a maximum: exact in any order */
#else
    float amax = 0.f;
    for (int j = 0; j < BLK; j++) amax = fmaxf(amax, fabsf(xb[j]));
    return amax;
#endif
}

static void quantize_rows(const float *x, int64_t m, int64_t k, int64_t nb) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t i = r * nb + b;
            const float *xb = x + r * k + b * BLK;
            const float amax = block_amax(xb);
            const float id = amax > 0.f ? 127.f / amax : 0.f;
            const int sum = quantize_block(xb, id, s_qx + i * BLK);
            s_d[i] = amax / 127.f;
            s_c[i] = s_d[i] * (float)sum;
            s_off[i] = -128 * sum;
        }
}

#include "qmm_tiles.h" /* the register tiles of each instruction set */

/* output rows n0 .. n1 - 1 (n0 a multiple of 16) for all m activation rows */
static void rows(const qmm_weight *w, int64_t m, float *y, int64_t n0, int64_t n1) {
    float out[MT_MAX * GR] __attribute__((aligned(64)));
    for (int64_t n = n0; n < n1; n += GR) {
        const int64_t g = n / GR, nr = n1 - n < GR ? n1 - n : GR;
        for (int64_t m0 = 0; m0 < m; m0 += MT_MAX) {
            int64_t mt = m - m0 < MT_MAX ? m - m0 : MT_MAX;
            /* constant tile sizes and scale storage: the compiler keeps the accumulators in registers */
#define QMM_TILE(MT, F16) case MT: group_tile(w, g, m0, MT, F16, out); break;
#if MT_MAX == 8
#define QMM_TILES(F16) switch (mt) { QMM_TILE(1, F16) QMM_TILE(2, F16) QMM_TILE(3, F16) QMM_TILE(4, F16) \
                                     QMM_TILE(5, F16) QMM_TILE(6, F16) QMM_TILE(7, F16) default: \
                                     group_tile(w, g, m0, 8, F16, out); break; }
#else
#define QMM_TILES(F16) switch (mt) { QMM_TILE(1, F16) QMM_TILE(2, F16) QMM_TILE(3, F16) default: \
                                     group_tile(w, g, m0, 4, F16, out); break; }
#endif
            if (w->f16) {
                QMM_TILES(1)
            } else {
                QMM_TILES(0)
            }
            for (int64_t i = 0; i < mt; i++) memcpy(y + (m0 + i) * w->n + n, out + i * GR, nr * sizeof(float));
        }
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
    int64_t chunk_rows;
    int active; /* workers that may take rows in this call */
} job;

static void take_chunks(void) {
    for (;;) {
        int64_t c = atomic_fetch_add(&next_chunk, 1);
        if (c >= job.nchunks) break;
        int64_t n0 = c * job.chunk_rows, n1 = n0 + job.chunk_rows < job.w->n ? n0 + job.chunk_rows : job.w->n;
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
    if (w->k <= 0 || w->k % BLK || w->nb * BLK != w->k || (w->bits != 4 && w->bits != 8)) return -2;
    pthread_mutex_lock(&call_mu);
    if (grow((size_t)(m * w->nb * BLK))) {
        pthread_mutex_unlock(&call_mu);
        return -1;
    }
    quantize_rows(x, m, w->k, w->nb);
    /* chunks of whole groups, about CHUNKS_PER_THREAD per thread: long runs of consecutive rows, which the
     * prefetchers stream (chunks of one group, handed out one at a time, ran at half the speed on 2 cores), and
     * still several per thread, so a thread that loses its core for a while leaves its chunks to the others */
    const int64_t ng = (w->n + GR - 1) / GR;
    int64_t per = ng / (CHUNKS_PER_THREAD * (nthreads > 1 ? nthreads : 1));
    if (per < 1) per = 1;
    const int64_t chunk_rows = per * GR, nchunks = (ng + per - 1) / per;
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
            int64_t n0 = c * chunk_rows, n1 = n0 + chunk_rows < w->n ? n0 + chunk_rows : w->n;
            rows(w, m, y, n0, n1);
        }
#endif
    } else {
        job.w = w; job.m = m; job.y = y; job.nchunks = nchunks; job.chunk_rows = chunk_rows; job.active = workers;
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
