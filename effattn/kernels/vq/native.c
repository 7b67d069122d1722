/* Transformer-VQ attention with ReRoPE: the step loop of chunk.py in C, for float32 inference.
 *
 * Same maths as vq_attention_chunk without autograd (read chunk.py and naive.py first). One call
 * runs the steps [j_lo, j_hi) of one segment. The statistics a step reads depend only on the keys
 * before it, so a call first folds the keys that leave the span in steps [0, j_lo) into its own copy
 * of the statistics (cheap: no attention) and then runs its steps. The Python side gives each
 * thread a range of steps and a copy of the statistics, so the threads never wait for each other.
 *
 * Per step and key/value group the work is four matrix products by the BLAS sgemm (logits of the
 * span, far span, code and sink columns), one pass per row over its live columns that takes the
 * maximum, exponentiates and sums (dead columns are set to 0), and four products for the output,
 * scaled by 1 / sum at the end. Rows are ordered (head, query) as in chunk.py: row = r * Q + i is
 * query i of the group's r-th query head. With bf16 products the span and code products take
 * bfloat16 inputs: MKL's (AMX) or this file's own AVX-512 BF16 kernels (logits16 / out16).
 *
 * With key means (chunk.py's key_means) the code columns are scored at the per-code key sums
 * (code_k, rotated by -F and scaled, part of the statistics) divided by the counts; each query's far
 * span keys join their codes' logit sums and counts instead of having columns of their own, and
 * after the softmax each of them gets its code's probability divided by the code's count.
 *
 * Build: cc -O3 -march=native -ffast-math -fPIC -shared (see native.py). With -ffast-math the
 * maths must stay finite: masked logits are MASKED, not -inf, and so is an empty code's log count.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MASKED (-1e30f)

/* Fortran BLAS sgemm (column-major), as exported by MKL and OpenBLAS. */
typedef void (*sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n, const int *k,
                         const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
                         const float *beta, float *c, const int *ldc);

/* Row-major C (rows x cols, ldc) = A (rows x k, lda) @ B^T with B (cols x k, ldb) row-major. */
static void gemm_abt(sgemm_fn sgemm, int rows, int cols, int k, const float *a, int lda, const float *b, int ldb,
                     float *c, int ldc) {
    const float one = 1.0f, zero = 0.0f;
    if (rows <= 0 || cols <= 0) return;
    sgemm("T", "N", &cols, &rows, &k, &one, b, &ldb, a, &lda, &zero, c, &ldc);
}

/* Row-major C (rows x cols, ldc) (+)= A (rows x k, lda) @ B with B (k x cols, ldb) row-major. */
static void gemm_ab(sgemm_fn sgemm, int rows, int cols, int k, const float *a, int lda, const float *b, int ldb,
                    float beta, float *c, int ldc) {
    const float one = 1.0f;
    if (rows <= 0 || k <= 0) return;
    sgemm("N", "N", &cols, &rows, &k, &one, b, &ldb, a, &lda, &beta, c, &ldc);
}

/* MKL's cblas_gemm_bf16bf16f32: row-major C (m x n, float32) = alpha A (m x k) B (k x n) + beta C with
 * A and B in bfloat16 (AMX or AVX-512 BF16 where the CPU has them). */
typedef void (*gemm16_fn)(int layout, int transa, int transb, int m, int n, int k, float alpha, const uint16_t *a,
                          int lda, const uint16_t *b, int ldb, float beta, float *c, int ldc);
#define ROW_MAJOR 101
#define NO_TRANS 111
#define TRANS 112

/* float32 -> bfloat16, rounding to nearest even (the inputs are finite) */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static void rows_to_bf16(const float *x, long n, uint16_t *y) {
    long i = 0;
#if defined(__AVX512BF16__)
    for (; i + 16 <= n; i += 16) /* the same rounding, to nearest even */
        _mm256_storeu_si256((__m256i *)(y + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
#endif
    for (; i < n; i++) y[i] = to_bf16(x[i]);
}

/* x[c] = exp(x[c] - mx) for c < n, in place, and their sum; the argument is kept >= -87 (the inputs are
 * logits below their row's maximum mx). With masked, columns at MASKED (empty codes) get exactly 0.
 * AVX-512: exp(r) = 2^k exp(r - k ln 2), k = round(r / ln 2), ln 2 split in two for an exact reduction,
 * exp of the rest (|.| <= ln 2 / 2) by its Taylor polynomial of degree 7 (error < 1e-8, below
 * float32's rounding). */
static float exp_sum(float *x, int n, float mx, int masked) {
    float sum = 0.0f;
    int c = 0;
#if defined(__AVX512F__)
    const __m512 vmx = _mm512_set1_ps(mx), lo = _mm512_set1_ps(-87.0f), log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 ln2_hi = _mm512_set1_ps(0.693145751953125f), ln2_lo = _mm512_set1_ps(1.42860676533018e-06f);
    const __m512 half_masked = _mm512_set1_ps(0.5f * MASKED);
    __m512 acc = _mm512_setzero_ps();
    for (; c < n; c += 16) {
        const __mmask16 live = n - c >= 16 ? 0xFFFF : (__mmask16)((1u << (n - c)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(live, x + c);
        const __m512 r = _mm512_max_ps(_mm512_sub_ps(v, vmx), lo);
        const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(r, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 f = _mm512_fnmadd_ps(k, ln2_lo, _mm512_fnmadd_ps(k, ln2_hi, r));
        __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720.0f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
        __m512 e = _mm512_scalef_ps(p, k);
        const __mmask16 keep = masked ? _mm512_mask_cmp_ps_mask(live, v, half_masked, _CMP_GT_OQ) : live;
        e = _mm512_maskz_mov_ps(keep, e);
        _mm512_mask_storeu_ps(x + c, live, e);
        acc = _mm512_add_ps(acc, e);
    }
    sum = _mm512_reduce_add_ps(acc);
#else
    for (; c < n; c++) {
        const float d = x[c] - mx;
        const float e = expf(d < -87.0f ? -87.0f : d);
        x[c] = masked && x[c] <= 0.5f * MASKED ? 0.0f : e;
        sum += x[c];
    }
#endif
    return sum;
}

/* softmax of one row of n logits in place, with bias (n values, or NULL) added first; columns at MASKED
 * (masked keys, empty codes, unused rows of E) get exactly 0 */
static void softmax_row(float *row, int n, const float *bias) {
    float top = MASKED;
    if (bias)
        for (int j = 0; j < n; j++) row[j] += bias[j];
    for (int j = 0; j < n; j++) top = row[j] > top ? row[j] : top;
    const float inv = 1.0f / exp_sum(row, n, top, 1);
    for (int j = 0; j < n; j++) row[j] *= inv;
}

/* Row-major C (rows x cols) (+)= A (rows x k) @ B^T, B (cols x k), or @ B, B (k x cols): bfloat16 inputs. */
static void gemm16_abt(gemm16_fn g, int rows, int cols, int k, const uint16_t *a, int lda, const uint16_t *b, int ldb,
                       float *c, int ldc) {
    if (rows > 0 && cols > 0) g(ROW_MAJOR, NO_TRANS, TRANS, rows, cols, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
}

static void gemm16_ab(gemm16_fn g, int rows, int cols, int k, const uint16_t *a, int lda, const uint16_t *b, int ldb,
                      float beta, float *c, int ldc) {
    if (rows > 0 && k > 0) g(ROW_MAJOR, NO_TRANS, NO_TRANS, rows, cols, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
}


/* Own bfloat16 products with AVX-512 BF16's VDPBF16PS (float32 accumulation), for CPUs that have the
 * instruction but where MKL's cblas_gemm_bf16bf16f32 gains nothing over sgemm (AMD Zen 4: MKL's bf16
 * and float32 products both run at ~93 GFLOP/s on one core, these at ~200). VDPBF16PS multiplies pairs
 * of bfloat16 held in one 32-bit lane (low half first) and adds both products to a float32 lane, so
 * the operand whose rows are broadcast keeps its natural row-major layout and the other is packed
 * with pairs along the reduced dimension:
 *   logits16: C (rows x cols, ldc) = A (rows x 2 KP) . B^T, with B packed as Bp[kp * ldb + col] = pair
 *             (B[col][2 kp], B[col][2 kp + 1]); reads whole blocks of 32 columns (pad Bp to them)
 *   out16:    O (rows x Dv, ldo) (+)= P (rows x 2 KP) . V, with V packed as Vp[kp * Dv + d] = pair
 *             (V[2 kp][d], V[2 kp + 1][d]); Dv a multiple of 16 */
int vq_dpbf16_compiled(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)
#define DP(acc, a, b) acc = _mm512_dpbf16_ps(acc, (__m512bh)(a), (__m512bh)(b))

static void logits16(int rows, int cols, int KP, const uint32_t *A, int lda, const uint32_t *Bp, long ldb, float *C,
                     int ldc) {
    for (int r = 0; r < rows; r += 8) {
        const int mr = rows - r < 8 ? rows - r : 8;
        const uint32_t *a = A + (long)r * lda;
        for (int c = 0; c < cols; c += 32) {
            __m512 acc[8][2];
            for (int i = 0; i < 8; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
            const uint32_t *b = Bp + c;
            if (mr == 8) {
                for (int kp = 0; kp < KP; kp++) {
                    const __m512i b0 = _mm512_loadu_si512(b + kp * ldb), b1 = _mm512_loadu_si512(b + kp * ldb + 16);
#pragma GCC unroll 8
                    for (int i = 0; i < 8; i++) {
                        const __m512i x = _mm512_set1_epi32((int)a[(long)i * lda + kp]);
                        DP(acc[i][0], x, b0);
                        DP(acc[i][1], x, b1);
                    }
                }
            } else {
                for (int kp = 0; kp < KP; kp++) {
                    const __m512i b0 = _mm512_loadu_si512(b + kp * ldb), b1 = _mm512_loadu_si512(b + kp * ldb + 16);
                    for (int i = 0; i < mr; i++) {
                        const __m512i x = _mm512_set1_epi32((int)a[(long)i * lda + kp]);
                        DP(acc[i][0], x, b0);
                        DP(acc[i][1], x, b1);
                    }
                }
            }
            const int left = cols - c;
            const __mmask16 m0 = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
            const __mmask16 m1 = left >= 32 ? 0xFFFF : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
            for (int i = 0; i < mr; i++) {
                _mm512_mask_storeu_ps(C + (long)(r + i) * ldc + c, m0, acc[i][0]);
                _mm512_mask_storeu_ps(C + (long)(r + i) * ldc + c + 16, m1, acc[i][1]);
            }
        }
    }
}

static void out16(int rows, int KP, const uint32_t *P, int ldp, const uint32_t *Vp, int Dv, float beta, float *O,
                  int ldo) {
    for (int d0 = 0; d0 < Dv; d0 += 64) {
        const int nv = Dv - d0 >= 64 ? 4 : (Dv - d0) / 16;
        for (int r = 0; r < rows; r += 6) {
            const int mr = rows - r < 6 ? rows - r : 6;
            const uint32_t *p = P + (long)r * ldp;
            __m512 acc[6][4];
            for (int i = 0; i < 6; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = _mm512_setzero_ps();
            if (mr == 6 && nv == 4) {
                for (int kp = 0; kp < KP; kp++) {
                    const uint32_t *v = Vp + (long)kp * Dv + d0;
                    const __m512i v0 = _mm512_loadu_si512(v), v1 = _mm512_loadu_si512(v + 16);
                    const __m512i v2 = _mm512_loadu_si512(v + 32), v3 = _mm512_loadu_si512(v + 48);
#pragma GCC unroll 6
                    for (int i = 0; i < 6; i++) {
                        const __m512i x = _mm512_set1_epi32((int)p[(long)i * ldp + kp]);
                        DP(acc[i][0], x, v0);
                        DP(acc[i][1], x, v1);
                        DP(acc[i][2], x, v2);
                        DP(acc[i][3], x, v3);
                    }
                }
            } else {
                for (int kp = 0; kp < KP; kp++) {
                    const uint32_t *v = Vp + (long)kp * Dv + d0;
                    for (int i = 0; i < mr; i++) {
                        const __m512i x = _mm512_set1_epi32((int)p[(long)i * ldp + kp]);
                        for (int j = 0; j < nv; j++) DP(acc[i][j], x, _mm512_loadu_si512(v + 16 * j));
                    }
                }
            }
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nv; j++) {
                    float *o = O + (long)(r + i) * ldo + d0 + 16 * j;
                    _mm512_storeu_ps(o, beta != 0.0f ? _mm512_add_ps(acc[i][j], _mm512_loadu_ps(o)) : acc[i][j]);
                }
        }
    }
}
#else
static void logits16(int rows, int cols, int KP, const uint32_t *A, int lda, const uint32_t *Bp, long ldb, float *C,
                     int ldc) {
    (void)rows, (void)cols, (void)KP, (void)A, (void)lda, (void)Bp, (void)ldb, (void)C, (void)ldc;
}
static void out16(int rows, int KP, const uint32_t *P, int ldp, const uint32_t *Vp, int Dv, float beta, float *O,
                  int ldo) {
    (void)rows, (void)KP, (void)P, (void)ldp, (void)Vp, (void)Dv, (void)beta, (void)O, (void)ldo;
}
#endif

static inline uint32_t bf16_pair(float lo, float hi) { return (uint32_t)to_bf16(lo) | ((uint32_t)to_bf16(hi) << 16); }

/* one row of x (D) as column c of Bp (logits16's packed B, ld columns) */
static void pack_key(const float *x, int D, uint32_t *Bp, long ld, long c) {
    for (int kp = 0; kp < D / 2; kp++) Bp[kp * ld + c] = bf16_pair(x[2 * kp], x[2 * kp + 1]);
}

/* row c of V (Dv, or zeros for NULL) into its half of Vp's pair c / 2 (out16's packed V) */
static void pack_value(const float *x, int Dv, uint32_t *Vp, long c) {
    uint16_t *h = (uint16_t *)(Vp + (c / 2) * Dv) + (c & 1);
    for (int d = 0; d < Dv; d++) h[2 * d] = x ? to_bf16(x[d]) : 0;
}

/* rows [r0, r1) of x (rows x D) as columns of Bp */
static void pack_keys(const float *x, long r0, long r1, int D, uint32_t *Bp, long ld) {
    for (long r = r0; r < r1; r++) pack_key(x + r * D, D, Bp, ld, r);
}

/* row pairs [k0, k1) of x (n rows x Dv) into Vp; rows >= n are zero */
static void pack_values(const float *x, long n, long k0, long k1, int Dv, uint32_t *Vp) {
    for (long r = 2 * k0; r < 2 * k1; r++) pack_value(r < n ? x + r * Dv : 0, Dv, Vp, r);
}

/* One segment's inputs for one key/value group bg = b * G + g (see vq_segment for the shapes). */
typedef struct {
    int b, g, T, H, R, D, Dv, C, W, Q, key_means;
    long start, sinks; /* sinks may exceed any position (ReRoPE only: every key is a sink) */
    const float *q, *cos_t, *sin_t;         /* whole call */
    const float *rk, *kq, *v, *cb, *sk, *sv; /* this group's rows */
    const int64_t *z;
    float *counts, *sums, *log_counts, *means, *code_k, *out;
    float *d_logit; /* 2 C scratch floats at the end of the work buffer, zero between rows */
    /* bf16 products (gemm16 set): bf16 copies of the span's keys and values, of the code columns'
       keys (codewords, or key means' key sums) and mean values (kept in step with the float32 ones),
       and scratch for the step's queries and probabilities (sinks stay float32) */
    gemm16_fn gemm16;
    uint16_t *code16, *means16, *q16, *qn16, *p16, *rk16, *kq16, *v16;
    /* own bf16 products (dp: logits16 / out16) read packed operands instead: the span's keys (rkp, kqp,
       span_ld columns) and values (vp, row pairs), the code columns' keys (codep, C_ld columns) and mean
       values (meansp); q16 and qn16 as above, p16 rows of S2 + C2: the span (far span merged in, padded to
       even) then the codes (padded to even) */
    int dp, C_ld;
    long span_ld;
    uint32_t *rkp, *kqp, *vp, *codep, *meansp;
} group_t;

/* Attention of the step starting at absolute position t_j (span entries [lo, lo + P + Q)). */
static void attend(sgemm_fn sgemm, const group_t *a, long t_j, long lo, float *work) {
    const int P = a->W - 1, Q = a->Q, S = P + Q, F = Q - 1, C = a->C, D = a->D, Dv = a->Dv;
    const int rows = a->R * Q, h = D / 2;
    const long n_sink = t_j - P < a->sinks ? t_j - P : a->sinks; /* sinks far for the whole step */
    const int m = n_sink > 0 ? (int)n_sink : 0;
    const int N = S + F + C + m;
    float *logits = work;            /* rows x N */
    float *qn = logits + (long)rows * N; /* rows x D: queries rotated to their positions */
    float *qf = qn + (long)rows * D;     /* rows x D: queries unrotated */
    float *o = qf + (long)rows * D;      /* rows x Dv */
    float *inv_sum = o + (long)rows * Dv; /* rows */
    float *d_logit = a->d_logit;         /* C: key means, a row's far span logits summed per code */
    float *d_count = d_logit + C;         /* C: and their number (all zero between rows) */
    float *inv_count = o + (long)rows * Dv + rows;     /* C: key means, 1 / count (0 for an empty code) */
    float *join_value = inv_count + C;                 /* F: key means, the logits of the codes joined */
    long *join_code = (long *)(join_value + (F > 0 ? F : 1) + 1); /* F: and those codes */
    if (a->key_means)
        for (int c = 0; c < C; c++) inv_count[c] = a->counts[c] > 0.0f ? 1.0f / a->counts[c] : 0.0f;

    /* the step's queries: unrotated and rotated to their positions */
    for (int row = 0; row < rows; row++) {
        const int r = row / Q, i = row % Q;
        const long t_rel = t_j + i - a->start;
        const float *src = a->q + (((long)a->b * a->T + t_rel) * a->H + (long)a->g * a->R + r) * D;
        const float *c = a->cos_t + t_rel * D, *s = a->sin_t + t_rel * D;
        float *dn = qn + (long)row * D, *df = qf + (long)row * D;
        memcpy(df, src, sizeof(float) * D);
        for (int d = 0; d < h; d++) dn[d] = src[d] * c[d] - src[d + h] * s[d];
        for (int d = h; d < D; d++) dn[d] = src[d] * c[d] + src[d - h] * s[d];
    }

    /* logits: span (near), far span, codes, sinks */
    const int P16 = S + F + C; /* row length of the bf16 probabilities */
    const int S2 = S + (S & 1), C2 = C + (C & 1); /* own bf16 products: the span and codes padded to even */
    if (a->dp || a->gemm16) {
        rows_to_bf16(qn, (long)rows * D, a->qn16);
        rows_to_bf16(qf, (long)rows * D, a->q16);
    }
    if (a->dp) {
        const uint32_t *qn2 = (const uint32_t *)a->qn16, *qf2 = (const uint32_t *)a->q16;
        logits16(rows, S, D / 2, qn2, D / 2, a->rkp + lo, a->span_ld, logits, N);
        logits16(rows, F, D / 2, qf2, D / 2, a->kqp + lo, a->span_ld, logits + S, N);
        logits16(rows, C, D / 2, qf2, D / 2, a->codep, a->C_ld, logits + S + F, N);
    } else if (a->gemm16) {
        gemm16_abt(a->gemm16, rows, S, D, a->qn16, D, a->rk16 + lo * D, D, logits, N);
        gemm16_abt(a->gemm16, rows, F, D, a->q16, D, a->kq16 + lo * D, D, logits + S, N);
        gemm16_abt(a->gemm16, rows, C, D, a->q16, D, a->code16, D, logits + S + F, N);
    } else {
        gemm_abt(sgemm, rows, S, D, qn, D, a->rk + lo * D, D, logits, N);
        gemm_abt(sgemm, rows, F, D, qf, D, a->kq + lo * D, D, logits + S, N);
        gemm_abt(sgemm, rows, C, D, qf, D, a->key_means ? a->code_k : a->cb, D, logits + S + F, N);
    }
    gemm_abt(sgemm, rows, m, D, qf, D, a->sk, D, logits + S + F + C, N);

    /* per row: the live columns' logits (code biases added), exp(logit - row max) over them and the
       row sum; dead columns are set to exactly 0 */
    for (int row = 0; row < rows; row++) {
        const int i = row % Q;
        float *x = logits + (long)row * N, *xf = x + S, *xc = x + S + F, *xs = x + S + F + C;
        /* span column c holds key position t_j - P + c, at distance P + i - c from query i: near for
           i <= c <= P + i, far for c < i (far span column c is kept for c < i only); columns before
           position 0 (c < P - t_j) are dead in both. Far span columns below sk hold sinks (exact);
           with key means the others join their codes, else they are exact too */
        const int before = t_j < P ? (int)(P - t_j) : 0;
        const int near_lo = i > before ? i : before, near_hi = P + i + 1;
        const long sinks_left = a->sinks - (t_j - P);
        const int sk = sinks_left <= 0 ? 0 : sinks_left >= F ? F : (int)sinks_left;
        const int far_lo = before < i ? before : i, far_hi = i; /* empty when before >= i */
        const int join_lo = a->key_means ? (far_lo > sk ? far_lo : sk) : far_hi;
        const int exact_hi = join_lo < far_hi ? join_lo : far_hi; /* exact far columns: [far_lo, exact_hi) */
        if (a->key_means) {
            /* joined keys: their code's logit is (sum + far) / (count + n) + log(count + n) */
            for (int c = join_lo; c < far_hi; c++) {
                const long z = a->z[lo + c];
                d_logit[z] += xf[c];
                d_count[z] += 1.0f;
            }
            /* the codes those keys joined (at most F): their logit from the raw dot product, before the
               pass over every code below overwrites it */
            int joined = 0;
            for (int c = join_lo; c < far_hi; c++) {
                const long z = a->z[lo + c];
                if (d_count[z] < 0.0f) continue; /* done already (marked negative below) */
                const float n = a->counts[z] + d_count[z];
                join_code[joined] = z;
                join_value[joined++] = (xc[z] + d_logit[z]) / n + logf(n);
                d_count[z] = -d_count[z];
            }
            /* every code from its aggregated keys alone: dot / count + log count (empty: MASKED) */
            for (int c = 0; c < C; c++) xc[c] = xc[c] * inv_count[c] + a->log_counts[c];
            for (int k = 0; k < joined; k++) {
                xc[join_code[k]] = join_value[k];
                d_count[join_code[k]] = -d_count[join_code[k]];
            }
        } else {
            for (int c = 0; c < C; c++) xc[c] += a->log_counts[c];
        }
        float mx = MASKED;
        for (int c = near_lo; c < near_hi; c++) mx = x[c] > mx ? x[c] : mx;
        for (int c = far_lo; c < exact_hi; c++) mx = xf[c] > mx ? xf[c] : mx;
        for (int c = 0; c < C; c++) mx = xc[c] > mx ? xc[c] : mx;
        for (int c = 0; c < m; c++) mx = xs[c] > mx ? xs[c] : mx;
        const float sum = exp_sum(x + near_lo, near_hi - near_lo, mx, 0) + exp_sum(xf + far_lo, exact_hi - far_lo, mx, 0) +
                          exp_sum(xc, C, mx, 1) + exp_sum(xs, m, mx, 0);
        inv_sum[row] = 1.0f / sum;
        memset(x, 0, sizeof(float) * near_lo);
        memset(x + near_hi, 0, sizeof(float) * (S - near_hi));
        memset(xf, 0, sizeof(float) * far_lo);
        memset(xf + exact_hi, 0, sizeof(float) * (F - exact_hi));
        if (a->key_means) {
            /* each joined key reads its code's probability over the code's count; the code column keeps
               the aggregated keys' share, count / (count + n), for the means of their values */
            for (int c = join_lo; c < far_hi; c++) {
                const long z = a->z[lo + c];
                xf[c] = xc[z] / (a->counts[z] + d_count[z]);
            }
            for (int c = join_lo; c < far_hi; c++) {
                const long z = a->z[lo + c];
                if (d_count[z] > 0.0f) {
                    xc[z] *= a->counts[z] / (a->counts[z] + d_count[z]);
                    d_logit[z] = d_count[z] = 0.0f;
                }
            }
        }
        if (a->dp) { /* a far span key's share reads the same value row as its span column (far columns
                        are live below i, near ones from i): one column */
            uint16_t *pr = a->p16 + (long)row * (S2 + C2);
            memset(pr, 0, sizeof(uint16_t) * S2);
            rows_to_bf16(xf + far_lo, far_hi - far_lo, pr + far_lo);
            rows_to_bf16(x + near_lo, near_hi - near_lo, pr + near_lo);
            rows_to_bf16(xc, C, pr + S2);
            if (C2 > C) pr[S2 + C] = 0;
        } else if (a->gemm16) {
            rows_to_bf16(x, P16, a->p16 + (long)row * P16);
        }
    }

    /* output: probabilities times span values, far values, code means, sink values */
    if (a->dp) {
        const uint32_t *p2 = (const uint32_t *)a->p16;
        out16(rows, S2 / 2, p2, (S2 + C2) / 2, a->vp + (lo / 2) * Dv, Dv, 0.0f, o, Dv);
        out16(rows, C2 / 2, p2 + S2 / 2, (S2 + C2) / 2, a->meansp, Dv, 1.0f, o, Dv);
    } else if (a->gemm16) {
        gemm16_ab(a->gemm16, rows, Dv, S, a->p16, P16, a->v16 + lo * Dv, Dv, 0.0f, o, Dv);
        gemm16_ab(a->gemm16, rows, Dv, F, a->p16 + S, P16, a->v16 + lo * Dv, Dv, 1.0f, o, Dv);
        gemm16_ab(a->gemm16, rows, Dv, C, a->p16 + S + F, P16, a->means16, Dv, 1.0f, o, Dv);
    } else {
        gemm_ab(sgemm, rows, Dv, S, logits, N, a->v + lo * Dv, Dv, 0.0f, o, Dv);
        gemm_ab(sgemm, rows, Dv, F, logits + S, N, a->v + lo * Dv, Dv, 1.0f, o, Dv);
        gemm_ab(sgemm, rows, Dv, C, logits + S + F, N, a->means, Dv, 1.0f, o, Dv);
    }
    gemm_ab(sgemm, rows, Dv, m, logits + S + F + C, N, a->sv, Dv, 1.0f, o, Dv);
    for (int row = 0; row < rows; row++) {
        const int r = row / Q, i = row % Q;
        const long t_rel = t_j + i - a->start;
        float *dst = a->out + (((long)a->b * a->T + t_rel) * a->H + (long)a->g * a->R + r) * Dv;
        const float *src = o + (long)row * Dv;
        for (int d = 0; d < Dv; d++) dst[d] = src[d] * inv_sum[row];
    }
}

/* After the step at t_j its first Q span keys leave the span for good: fold them into the
   statistics. Padding before position 0 and sinks are never counted. */
static void fold(const group_t *a, long t_j, long lo) {
    const int P = a->W - 1, Dv = a->Dv;
    long skip = 0;
    if (a->sinks - (t_j - P) > skip) skip = a->sinks - (t_j - P);
    if (P - t_j > skip) skip = P - t_j;
    for (long s = lo + skip; s < lo + a->Q; s++) {
        const long c = a->z[s];
        a->counts[c] += 1.0f;
        for (int d = 0; d < Dv; d++) a->sums[c * Dv + d] += a->v[s * Dv + d];
        if (a->key_means)
            for (int d = 0; d < a->D; d++) a->code_k[c * a->D + d] += a->kq[s * a->D + d];
    }
    for (long s = lo + skip; s < lo + a->Q; s++) { /* a code seen twice is refreshed twice, same values */
        const long c = a->z[s];
        const float inv = 1.0f / a->counts[c];
        a->log_counts[c] = logf(a->counts[c]);
        for (int d = 0; d < Dv; d++) a->means[c * Dv + d] = a->sums[c * Dv + d] * inv;
        if (a->dp) {
            pack_value(a->means + c * Dv, Dv, a->meansp, c);
            if (a->key_means) pack_key(a->code_k + c * a->D, a->D, a->codep, a->C_ld, c);
        } else if (a->gemm16) {
            rows_to_bf16(a->means + c * Dv, Dv, a->means16 + c * Dv);
            if (a->key_means) rows_to_bf16(a->code_k + c * a->D, a->D, a->code16 + c * a->D);
        }
    }
}

/* Scratch bfloat16 values one call needs with bf16 products (vq_segment's work16), span_len = P + n Q:
   enough for MKL's products and for the own ones' packed operands. */
long vq_segment_work16(int R, int Q, int P, int C, int D, int Dv, long span_len) {
    const long rows = (long)R * Q, S = (long)P + Q, F = Q - 1;
    const long mkl = (long)C * (D + Dv) + rows * (2L * D + S + F + C) + span_len * (2L * D + Dv);
    const long C_ld = (C + 31L) / 32 * 32;
    const long own = rows * (2L * D + S + 1 + C + 1) + 2L * D * (span_len + 32) + 2L * (span_len / 2 + 2) * Dv +
                     C_ld * (D + Dv);
    return mkl > own ? mkl : own;
}

/* Scratch floats one call needs (attend's layout). */
long vq_segment_work_floats(int R, int Q, int P, int C, int m_max, int D, int Dv) {
    const long rows = (long)R * Q, S = (long)P + Q, F = Q - 1;
    return rows * (S + F + C + m_max) + 2 * rows * D + rows * Dv + rows + C + 4L * (F + 2) + 2L * C;
}

/*
 * Shapes (all float32 contiguous; BG = batch x key/value groups, group bg = b * G + g):
 *   q        (B, T, H, D)  unrotated queries of the whole call, H = G * R; positions start..start+T-1
 *   cos, sin (T, D)        their RoPE tables (rotate-half layout)
 *   rk       (BG, P + n*Q, D)  span keys rotated to their positions and scaled (P = W - 1 carried keys first)
 *   kq       (BG, P + n*Q, D)  the same keys quantized (sinks exact), rotated by -F and scaled
 *   v        (BG, P + n*Q, Dv) their values
 *   z        (BG, P + n*Q) int64 their codes
 *   codebook (BG, C, D)    codewords rotated by -F and scaled
 *   sink_k   (BG, m_max, D), sink_v (BG, m_max, Dv): the sinks, sink_k rotated by -F and scaled
 *   counts (BG, C), sums (BG, C, Dv), log_counts (BG, C), means (BG, C, Dv): statistics of the
 *            aggregated keys, updated in place (log_counts is MASKED for an empty code)
 *   code_k   (BG, C, D) with key_means: their key sums per code, rotated by -F and scaled (kq then
 *            holds the exact keys); updated in place. Unused (may be NULL) otherwise
 *   out      (B, T, H, Dv) written for the positions of the steps run
 *   work     vq_segment_work_floats(...) floats
 * Scalars: seg_t0 the absolute position of the segment's first query, start that of q's first row,
 * n steps of Q queries in the segment, W the window (P = W - 1), sinks the number of sink positions,
 * [j_lo, j_hi) the steps to run.
 */
void vq_segment(sgemm_fn sgemm, int B, int T, int G, int R, int D, int Dv, int C, int W, int Q, int n,
                long seg_t0, long start, long sinks, int m_max, int j_lo, int j_hi, int key_means,
                const float *q, const float *cos_t, const float *sin_t, const float *rk, const float *kq,
                const float *v, const int64_t *z, const float *codebook, const float *sink_k, const float *sink_v,
                float *counts, float *sums, float *log_counts, float *means, float *code_k, float *out,
                float *work, gemm16_fn gemm16, uint16_t *work16, int dp) {
    const long span_len = (long)(W - 1) + (long)n * Q;
    const long rows = (long)R * Q;
    /* own bf16 products: when built with AVX-512 BF16, for even D, Dv a multiple of 16, and span starts
       (j Q) on value pairs; otherwise MKL's bf16 products if given, else float32 */
    dp = dp && vq_dpbf16_compiled() && D % 2 == 0 && Dv % 16 == 0 && (Q % 2 == 0 || n == 1);
    if (dp) gemm16 = 0;
    for (int bg = 0; bg < B * G; bg++) {
        group_t a = {
            .b = bg / G, .g = bg % G, .T = T, .H = G * R, .R = R, .D = D, .Dv = Dv, .C = C, .W = W, .Q = Q,
            .sinks = sinks, .start = start, .q = q, .cos_t = cos_t, .sin_t = sin_t,
            .rk = rk + bg * span_len * D, .kq = kq + bg * span_len * D, .v = v + bg * span_len * Dv,
            .cb = codebook + (long)bg * C * D, .sk = sink_k + (long)bg * m_max * D,
            .sv = sink_v + (long)bg * m_max * Dv, .z = z + bg * span_len,
            .counts = counts + (long)bg * C, .sums = sums + (long)bg * C * Dv,
            .log_counts = log_counts + (long)bg * C, .means = means + (long)bg * C * Dv, .out = out,
            .key_means = key_means, .code_k = key_means ? code_k + (long)bg * C * D : 0,
            .d_logit = work + vq_segment_work_floats(R, Q, W - 1, C, m_max, D, Dv) - 2L * C,
            .gemm16 = gemm16, .dp = dp,
        };
        if (dp) { /* work16: q16 | qn16 | p16 | rkp | kqp | vp | codep | meansp */
            const long S = (long)(W - 1) + Q, S2 = S + (S & 1), C2 = C + (C & 1);
            a.span_ld = span_len + 32;
            a.C_ld = (C + 31) / 32 * 32;
            a.q16 = work16;
            a.qn16 = a.q16 + rows * D;
            a.p16 = a.qn16 + rows * D;
            a.rkp = (uint32_t *)(a.p16 + rows * (S2 + C2));
            a.kqp = a.rkp + (long)(D / 2) * a.span_ld;
            a.vp = a.kqp + (long)(D / 2) * a.span_ld;
            a.codep = a.vp + (span_len / 2 + 2) * Dv;
            a.meansp = a.codep + (long)(D / 2) * a.C_ld;
            if (j_hi > j_lo) { /* the rows this call's steps read */
                const long r0 = (long)j_lo * Q, r1 = (long)(j_hi - 1) * Q + S;
                pack_keys(a.rk, r0, r1, D, a.rkp, a.span_ld);
                pack_keys(a.kq, r0, r1, D, a.kqp, a.span_ld);
                pack_values(a.v, span_len, r0 / 2, (r1 + 1) / 2, Dv, a.vp);
            }
        } else if (gemm16) { /* work16: code16 | means16 | q16 | qn16 | p16 | rk16 | kq16 | v16 */
            const long P16 = (long)(W - 1) + Q + (Q - 1) + C;
            a.code16 = work16;
            a.means16 = a.code16 + (long)C * D;
            a.q16 = a.means16 + (long)C * Dv;
            a.qn16 = a.q16 + rows * D;
            a.p16 = a.qn16 + rows * D;
            a.rk16 = a.p16 + rows * P16;
            a.kq16 = a.rk16 + span_len * D;
            a.v16 = a.kq16 + span_len * D;
            if (j_hi > j_lo) { /* the span rows this call's steps read, once per group and call */
                const long r0 = (long)j_lo * Q, n_rows = (long)(j_hi - 1 - j_lo) * Q + (W - 1) + Q;
                rows_to_bf16(a.rk + r0 * D, n_rows * D, a.rk16 + r0 * D);
                rows_to_bf16(a.kq + r0 * D, n_rows * D, a.kq16 + r0 * D);
                rows_to_bf16(a.v + r0 * Dv, n_rows * Dv, a.v16 + r0 * Dv);
            }
        }
        memset(a.d_logit, 0, sizeof(float) * 2 * C);
        for (int j = 0; j < j_hi; j++) {
            const long t_j = seg_t0 + (long)j * Q, lo = (long)j * Q;
            if (dp && j == j_lo) { /* the packed code columns, as the statistics are now */
                pack_keys(key_means ? a.code_k : a.cb, 0, C, D, a.codep, a.C_ld);
                pack_values(a.means, C, 0, a.C_ld / 2, Dv, a.meansp);
            }
            if (gemm16 && j == j_lo) { /* the bf16 copies of the code columns, as the statistics are now */
                rows_to_bf16(key_means ? a.code_k : a.cb, (long)C * D, a.code16);
                rows_to_bf16(a.means, (long)C * Dv, a.means16);
            }
            if (j >= j_lo) attend(sgemm, &a, t_j, lo, work);
            fold(&a, t_j, lo);
        }
    }
}

/* The nearest code of n keys (codes.py's nearest_codes, float32): the first c maximising
 * <x_r, cb_c> + bias_c, for rows x_r = x + r * ldx (D floats), codebook cb (C, D), bias (C); written to
 * codes[r * stride]. Scores go through sgemm NEAREST_ROWS rows at a time, in work (NEAREST_ROWS x C). */
#define NEAREST_ROWS 128
long vq_nearest_work_floats(int C) { return (long)NEAREST_ROWS * C; }

void vq_nearest(sgemm_fn sgemm, long n, int D, int C, const float *x, long ldx, const float *cb, const float *bias,
                int64_t *codes, long stride, float *work) {
    for (long r0 = 0; r0 < n; r0 += NEAREST_ROWS) {
        const int rows = n - r0 < NEAREST_ROWS ? (int)(n - r0) : NEAREST_ROWS;
        gemm_abt(sgemm, rows, C, D, x + r0 * ldx, (int)ldx, cb, D, work, C);
        for (int r = 0; r < rows; r++) {
            float *score = work + (long)r * C, top = -3.0e38f;
            for (int c = 0; c < C; c++) {
                score[c] += bias[c];
                top = score[c] > top ? score[c] : top;
            }
            int best = 0;
            while (best < C - 1 && score[best] != top) best++; /* the first maximum */
            codes[(r0 + r) * stride] = best;
        }
    }
}

/* One decode step (decode.py's vq_decode_step, read it first): the query at position t of every
 * key/value group bg reads the W ring rows of its window (rotated queries) and the C code rows and m
 * sink rows (unrotated queries), with bias[bg, column] added; then the key leaving the window joins its
 * code. Shapes, all float32 except the codes, rows of bg = b * G + g:
 *   q (BG, R, D) pre-RoPE; k (BG, D) pre-RoPE; v (BG, Dv); z (BG) codes; cos, sin (D) position t;
 *   keys (BG, N, D), bias (BG, N), values (BG, N, Dv) with N = W + C + m;
 *   ring_k (BG, W, D), ring_z (BG, W), ring_cos, ring_sin (W, D); counts (BG, C); far_cos, far_sin (D)
 *   the scaled -F turn; out (BG, R, Dv); work: R * (N + D) floats. The code rows of values (and with key
 *   means of keys, turned) hold means: a key that joins its code moves them by (x - mean) / count.
 * Per group: two sgemm for the logits (window, far columns), a softmax pass, one sgemm for the output. */
static void rope_row(const float *x, const float *c, const float *s, float scale, int D, float *y) {
    int h = D / 2;
    for (int d = 0; d < h; d++) y[d] = (x[d] * c[d] - x[d + h] * s[d]) * scale;
    for (int d = h; d < D; d++) y[d] = (x[d] * c[d] + x[d - h] * s[d]) * scale;
}

void vq_decode(sgemm_fn sgemm, int BG, int R, int D, int Dv, int W, int C, int m, long t, float scale,
               int key_means, const float *q, const float *k, const float *v, const int64_t *z, const float *cos_t,
               const float *sin_t, float *keys, float *bias, float *values, float *ring_k, int64_t *ring_z,
               float *ring_cos, float *ring_sin, float *counts, const float *far_cos, const float *far_sin,
               float *out, float *work) {
    int N = W + C + m;
    int slot = (int)(t % W), leaving = (int)((t + 1) % W);
    float *logits = work, *qn = work + (long)R * N; /* (R, N) logits, (R, D) rotated queries */
    memcpy(ring_cos + (long)slot * D, cos_t, sizeof(float) * D);
    memcpy(ring_sin + (long)slot * D, sin_t, sizeof(float) * D);
    for (int bg = 0; bg < BG; bg++) {
        float *K = keys + (long)bg * N * D, *V = values + (long)bg * N * Dv, *bs = bias + (long)bg * N;
        const float *Q = q + (long)bg * R * D;
        /* the new key (rotated to t, scaled) and value take the ring row of position t - W */
        rope_row(k + (long)bg * D, cos_t, sin_t, scale, D, K + (long)slot * D);
        memcpy(V + (long)slot * Dv, v + (long)bg * Dv, sizeof(float) * Dv);
        memcpy(ring_k + ((long)bg * W + slot) * D, k + (long)bg * D, sizeof(float) * D);
        ring_z[(long)bg * W + slot] = z[bg];
        for (int r = 0; r < R; r++) rope_row(Q + (long)r * D, cos_t, sin_t, 1.0f, D, qn + (long)r * D);
        gemm_abt(sgemm, R, W, D, qn, D, K, D, logits, N);
        gemm_abt(sgemm, R, C + m, D, Q, D, K + (long)W * D, D, logits + W, N);
        for (int r = 0; r < R; r++) softmax_row(logits + (long)r * N, N, bs);
        gemm_ab(sgemm, R, Dv, N, logits, N, V, Dv, 0.0f, out + (long)bg * R * Dv, Dv);
        /* position t - W + 1 leaves the window: it joins its code */
        long c = ring_z[(long)bg * W + leaving];
        const float n = counts[(long)bg * C + c] += 1.0f;
        const float *vl = V + (long)leaving * Dv;
        float *mean = V + (long)(W + c) * Dv;
        for (int d = 0; d < Dv; d++) mean[d] += (vl[d] - mean[d]) / n;
        bs[W + c] = logf(n);
        if (key_means) { /* the code's key: the mean of its keys turned by -F, scaled */
            float *ck = K + (long)(W + c) * D;
            rope_row(ring_k + ((long)bg * W + leaving) * D, far_cos, far_sin, 1.0f, D, qn); /* qn is free now */
            for (int d = 0; d < D; d++) ck[d] += (qn[d] - ck[d]) / n;
        }
    }
}

typedef struct {
    float score;
    int index;
} ranked_t;

/* higher score first, ties to the lower index (the older key): torch.sort(-score, stable=True)'s order */
static int by_score(const void *a, const void *b) {
    const ranked_t *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return x->index - y->index;
}

/* E's cut (heavy.py's _keep_order and _fold) on one group's rows: E keeps its `budget` keys of highest
 * score (ties to the older), in order; the rest join their codes, whose means move by (x - mean) / count.
 * E's rows are FK / FV [0, m) with metadata hz, hp, hs; the codes' rows FK / FV [P, P + C), their log
 * counts fb[P + c] and counts cnt. rank, keep: scratch for m entries. */
static void heavy_cut(int m, int budget, int P, int D, int Dv, int key_means, float *FK, float *FV, float *fb, int64_t *hz,
                      int64_t *hp, float *hs, float *cnt, ranked_t *rank, int *keep) {
    for (int i = 0; i < m; i++) rank[i] = (ranked_t){hs[i], i};
    qsort(rank, m, sizeof *rank, by_score);
    memset(keep, 0, sizeof(int) * m);
    for (int i = 0; i < budget; i++) keep[rank[i].index] = 1;
    int w = 0;
    for (int i = 0; i < m; i++) {
        float *Ki = FK + (long)i * D, *Vi = FV + (long)i * Dv;
        if (keep[i]) {
            if (w != i) {
                memcpy(FK + (long)w * D, Ki, sizeof(float) * D);
                memcpy(FV + (long)w * Dv, Vi, sizeof(float) * Dv);
                hs[w] = hs[i], hz[w] = hz[i], hp[w] = hp[i];
            }
            w++;
            continue;
        }
        const long c = hz[i];
        const float n = cnt[c] += 1.0f;
        float *mean = FV + (P + c) * Dv;
        for (int d = 0; d < Dv; d++) mean[d] += (Vi[d] - mean[d]) / n;
        fb[P + c] = logf(n);
        if (key_means) {
            float *ck = FK + (P + c) * D;
            for (int d = 0; d < D; d++) ck[d] += (Ki[d] - ck[d]) / n;
        }
    }
    for (int i = budget; i < m; i++) fb[i] = MASKED;
}

/* One decode step of heavy-hitter VQ (heavy_decode.py's vq_heavy_decode_step, read it first). Per
 * key/value group bg the N = W + P + C columns are the window's ring (keys rotated to their positions,
 * read by the query rotated to t), the P rows of E (pre-RoPE keys, the first m live) and the C codes (the
 * code's key, pre-RoPE), both read by the query rotated to the far position. Shapes, float32 but for
 * the int64 codes and positions, rows of bg = b * G + g:
 *   q (BG, R, D), k (BG, D) pre-RoPE; v (BG, Dv); z (BG) the new key's code; cos, sin (D) position t;
 *   far_cos, far_sin (D) position F; keys (BG, N, D), bias (BG, N), values (BG, N, Dv), score (BG, W + P);
 *   ring_k (BG, W, D), ring_z (BG, W); heavy_z, heavy_pos (BG, P); counts (BG, C); out (BG, R, Dv);
 *   work: vq_heavy_decode_work_floats. The code rows of values (and with key means of keys) hold means: a
 *   key that joins its code moves them by (x - mean) / count.
 * Returns E's size after the step (the same in every group). */
long vq_heavy_decode_work_floats(int R, int D, int W, int P, int C) {
    return (long)R * (W + P + C) + 2L * R * D + 3L * P;
}

int vq_heavy_decode(sgemm_fn sgemm, int BG, int R, int D, int Dv, int W, int P, int C, int m, int budget, int U, long t,
                    float scale, int key_means, const float *q, const float *k, const float *v, const int64_t *z,
                    const float *cos_t, const float *sin_t, const float *far_cos, const float *far_sin, float *keys,
                    float *bias, float *values, float *score, float *ring_k, int64_t *ring_z, int64_t *heavy_z,
                    int64_t *heavy_pos, float *counts, float *out, float *work) {
    const int N = W + P + C, cut = t % U == 0 && m > budget, slot = (int)(t % W), leaving = (int)((t + 1) % W);
    const int live = cut ? budget : m; /* E's keys during the step */
    float *logits = work, *qn = work + (long)R * N, *qf = qn + (long)R * D;
    ranked_t *rank = (ranked_t *)(qf + (long)R * D);
    int *keep = (int *)(rank + P);
    for (int bg = 0; bg < BG; bg++) {
        float *K = keys + (long)bg * N * D, *V = values + (long)bg * N * Dv, *bs = bias + (long)bg * N;
        float *sc = score + (long)bg * (W + P), *cnt = counts + (long)bg * C;
        int64_t *hz = heavy_z + (long)bg * P, *hp = heavy_pos + (long)bg * P;
        const float *Q = q + (long)bg * R * D;
        if (cut) /* E keeps its `budget` keys of highest score, in order; the rest join their codes */
            heavy_cut(m, budget, P, D, Dv, key_means, K + (long)W * D, V + (long)W * Dv, bs + W, hz, hp, sc + W, cnt,
                      rank, keep);
        /* the new key (rotated to t) and value take the ring row of position t - W */
        rope_row(k + (long)bg * D, cos_t, sin_t, 1.0f, D, K + (long)slot * D);
        memcpy(V + (long)slot * Dv, v + (long)bg * Dv, sizeof(float) * Dv);
        memcpy(ring_k + ((long)bg * W + slot) * D, k + (long)bg * D, sizeof(float) * D);
        ring_z[(long)bg * W + slot] = z[bg];
        sc[slot] = 0.0f;
        for (int r = 0; r < R; r++) {
            rope_row(Q + (long)r * D, cos_t, sin_t, scale, D, qn + (long)r * D);
            rope_row(Q + (long)r * D, far_cos, far_sin, scale, D, qf + (long)r * D);
        }
        gemm_abt(sgemm, R, W, D, qn, D, K, D, logits, N);
        gemm_abt(sgemm, R, P + C, D, qf, D, K + (long)W * D, D, logits + W, N);
        for (int r = 0; r < R; r++) softmax_row(logits + (long)r * N, N, bs);
        gemm_ab(sgemm, R, Dv, N, logits, N, V, Dv, 0.0f, out + (long)bg * R * Dv, Dv);
        for (int r = 0; r < R; r++) /* the attention each window and E key received */
            for (int j = 0; j < W + live; j++) sc[j] += logits[(long)r * N + j];
        /* position t - W + 1 leaves the window: it joins E */
        const int j = W + live;
        memcpy(K + (long)j * D, ring_k + ((long)bg * W + leaving) * D, sizeof(float) * D);
        memcpy(V + (long)j * Dv, V + (long)leaving * Dv, sizeof(float) * Dv);
        sc[j] = sc[leaving], hz[live] = ring_z[(long)bg * W + leaving], hp[live] = t - W + 1, bs[j] = 0.0f;
    }
    return live + 1;
}

/* Heavy-hitter prefill (heavy.py's vq_heavy_chunk for float32 inference, read it first): T positions
 * t0 .. t0 + T - 1 of the groups bg in [bg_lo, bg_hi), one period of up to U queries at a time (up to the
 * next cut), continuing the state held in these buffers, per group bg = b * G + g (S = W - 1 + U):
 *   span: SK, SRK (BG, S, D) pre-RoPE and rotated keys, SV (BG, S, Dv), SZ (BG, S) codes, SS (BG, S) scores;
 *     rows [0, n0) the recent keys (oldest first), n0 = min(t0, W - 1);
 *   far block: FK (BG, P + C, D), FV (BG, P + C, Dv), FB (BG, P + C): rows [0, P) E (pre-RoPE keys, values,
 *     bias 0 for live rows [0, m0), MASKED after), rows [P, P + C) the codes (their key: mean or codeword;
 *     their mean value; bias log count, MASKED when empty); HZ, HP (BG, P) E's codes and positions, HS (BG, P)
 *     E's scores; counts (BG, C).
 *   q (B, T, H, D), k (B, T, G, D), v (B, T, G, Dv) pre-RoPE, z (B, T, G); cos, sin (T, D) at t0 ..;
 *   far_cos, far_sin (D) the far position; out (B, T, H, Dv); work: vq_heavy_segment_work_floats.
 * Per period and group: rows (r, i) = query i of query head r; the span's columns (near: rotated queries
 * and keys; far: both at F; masked after the query), E's and the codes' (at F) in one softmax; the output;
 * the scores; the keys leaving the window appended to E. Returns E's size after the call. */
long vq_heavy_segment_work_floats(int R, int D, int Dv, int W, int U, int P, int C) {
    const long rows = (long)R * U, S = W - 1 + U;
    return rows * (2L * D + S + P + C + S + Dv) + 3L * P;
}

int vq_heavy_segment(sgemm_fn sgemm, int B, int T, int G, int R, int D, int Dv, int W, int U, int P, int C, int budget,
                     long t0, int m0, int n0, float scale, int key_means, int bg_lo, int bg_hi, const float *q,
                     const float *k, const float *v, const int64_t *z, const float *cos, const float *sin,
                     const float *far_cos, const float *far_sin, float *SK, float *SRK, float *SV, int64_t *SZ, float *SS,
                     float *FK, float *FV, float *FB, int64_t *HZ, int64_t *HP, float *HS, float *counts, float *out,
                     float *work) {
    const int H = G * R, S = W - 1 + U, F = P + C;
    float *qn = work, *qf = qn + (long)R * U * D, *L = qf + (long)R * U * D, *far = L + (long)R * U * (S + F);
    float *o = far + (long)R * U * S;
    ranked_t *rank = (ranked_t *)(o + (long)R * U * Dv);
    int *keep = (int *)(rank + P);
    int m_end = m0;
    for (int bg = bg_lo; bg < bg_hi; bg++) {
        const int b = bg / G, g = bg % G;
        float *sk = SK + (long)bg * S * D, *srk = SRK + (long)bg * S * D, *sv = SV + (long)bg * S * Dv;
        float *ss = SS + (long)bg * S, *fk = FK + (long)bg * F * D, *fv = FV + (long)bg * F * Dv;
        float *fb = FB + (long)bg * F, *hs = HS + (long)bg * P, *cnt = counts + (long)bg * C;
        int64_t *sz = SZ + (long)bg * S, *hz = HZ + (long)bg * P, *hp = HP + (long)bg * P;
        int m = m0, n = n0;
        for (int a = 0; a < T;) {
            const long t = t0 + a;
            if (t && t % U == 0 && m > budget) {
                heavy_cut(m, budget, P, D, Dv, key_means, fk, fv, fb, hz, hp, hs, cnt, rank, keep);
                m = budget;
            }
            const int Q = (int)((T - a) < U - t % U ? (T - a) : U - t % U), cols = n + Q, ld = cols + F;
            for (int i = 0; i < Q; i++) { /* the period's keys join the span */
                const long src = ((long)b * T + a + i) * G + g;
                memcpy(sk + (long)(n + i) * D, k + src * D, sizeof(float) * D);
                rope_row(k + src * D, cos + (long)(a + i) * D, sin + (long)(a + i) * D, 1.0f, D, srk + (long)(n + i) * D);
                memcpy(sv + (long)(n + i) * Dv, v + src * Dv, sizeof(float) * Dv);
                sz[n + i] = z[src];
                ss[n + i] = 0.0f;
            }
            for (int r = 0; r < R; r++)
                for (int i = 0; i < Q; i++) {
                    const float *x = q + (((long)b * T + a + i) * H + g * R + r) * D;
                    rope_row(x, cos + (long)(a + i) * D, sin + (long)(a + i) * D, scale, D, qn + ((long)r * Q + i) * D);
                    rope_row(x, far_cos, far_sin, scale, D, qf + ((long)r * Q + i) * D);
                }
            const int rows = R * Q;
            gemm_abt(sgemm, rows, cols, D, qn, D, srk, D, L, ld);
            gemm_abt(sgemm, rows, cols, D, qf, D, sk, D, far, cols);
            gemm_abt(sgemm, rows, F, D, qf, D, fk, D, L + cols, ld);
            for (int row = 0; row < rows; row++) {
                const int i = row % Q;
                float *l = L + (long)row * ld, *lf = far + (long)row * cols;
                for (int j = 0; j < cols; j++) { /* span key j is at t - n + j; query i at t + i */
                    const int delta = n + i - j;
                    l[j] = delta < 0 ? MASKED : delta >= W ? lf[j] : l[j];
                }
                for (int j = 0; j < F; j++) l[cols + j] += fb[j];
                softmax_row(l, ld, NULL);
            }
            gemm_ab(sgemm, rows, Dv, cols, L, ld, sv, Dv, 0.0f, o, Dv);
            gemm_ab(sgemm, rows, Dv, F, L + cols, ld, fv, Dv, 1.0f, o, Dv);
            for (int r = 0; r < R; r++)
                for (int i = 0; i < Q; i++)
                    memcpy(out + (((long)b * T + a + i) * H + g * R + r) * Dv, o + ((long)r * Q + i) * Dv,
                           sizeof(float) * Dv);
            for (int row = 0; row < rows; row++) { /* the attention each span and E key received */
                const float *l = L + (long)row * ld;
                for (int j = 0; j < cols; j++) ss[j] += l[j];
                for (int e = 0; e < m; e++) hs[e] += l[cols + e];
            }
            /* the keys that leave the window for the next query join E; the last W - 1 stay in the span */
            const int leave = cols - (W - 1) > 0 ? cols - (W - 1) : 0;
            for (int e = 0; e < leave; e++) {
                memcpy(fk + (long)(m + e) * D, sk + (long)e * D, sizeof(float) * D);
                memcpy(fv + (long)(m + e) * Dv, sv + (long)e * Dv, sizeof(float) * Dv);
                hz[m + e] = sz[e], hp[m + e] = t - n + e, hs[m + e] = ss[e], fb[m + e] = 0.0f;
            }
            m += leave;
            n = cols - leave;
            memmove(sk, sk + (long)leave * D, sizeof(float) * n * D);
            memmove(srk, srk + (long)leave * D, sizeof(float) * n * D);
            memmove(sv, sv + (long)leave * Dv, sizeof(float) * n * Dv);
            memmove(sz, sz + leave, sizeof(int64_t) * n);
            memmove(ss, ss + leave, sizeof(float) * n);
            a += Q;
        }
        m_end = m;
    }
    return m_end;
}
