/* effattn's matrix-vector products for decoding on the CPU: y[m, :] = W x[m, :] + b, for a few rows m.
 *
 * A decode step of a small model is a chain of matrix-vector products whose weights (the whole model,
 * hundreds of MB) stream from memory once per token. PyTorch hands a one-row linear to MKL's GEMM, which
 * ran it on one thread at 10.7 GB/s on an AMD EPYC (measured: benchmarks/bench_gemv.py); here each thread
 * takes a contiguous block of W's rows and reads it once for all m, 20.2 GB/s on one thread and 25.7 GB/s
 * on two on that machine. The reference is torch.nn.functional.linear (naive.py).
 *
 * float32 (gemv_rows) and bfloat16 (gemv_rows_bf16, below). W [n, k] row-major, x [M, k], b [n] or NULL,
 * y [M, n]. Built with -fopenmp: the OpenMP runtime is the one PyTorch already loaded (the same
 * libgomp.so.1), so there is one pool of threads.
 */
#include <stddef.h>

void gemv_rows(const float *W, const float *x, const float *b, float *y, long M, long n, long k, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long i = 0; i < n; i++) {
        const float *w = W + i * k;
        float bias = b ? b[i] : 0.0f;
        for (long m = 0; m < M; m++) {
            const float *xm = x + m * k;
            float s = 0.0f;
            #pragma omp simd reduction(+:s)
            for (long j = 0; j < k; j++) s += w[j] * xm[j];
            y[m * n + i] = s + bias;
        }
    }
}

/* bfloat16: W, x, b and y in bfloat16 (uint16 bits), products and sums in float32, y rounded to nearest
 * even as PyTorch rounds a bfloat16 linear's float32 result. Half the bytes of float32 to stream. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

int gemv_rows_bf16(const uint16_t *W, const uint16_t *x, const uint16_t *b, uint16_t *y, long M, long n, long k,
                   int threads) {
    float *xf = malloc((size_t)(M * k) * sizeof(float));
    if (!xf) return 1;
    for (long j = 0; j < M * k; j++) xf[j] = bf16_to_float(x[j]);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long i = 0; i < n; i++) {
        const uint16_t *w = W + i * k;
        float bias = b ? bf16_to_float(b[i]) : 0.0f;
        for (long m = 0; m < M; m++) {
            const float *xm = xf + m * k;
            float s = 0.0f;
            #pragma omp simd reduction(+:s)
            for (long j = 0; j < k; j++) s += bf16_to_float(w[j]) * xm[j];
            y[m * n + i] = float_to_bf16(s + bias);
        }
    }
    free(xf);
    return 0;
}
