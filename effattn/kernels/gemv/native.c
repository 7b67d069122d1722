/* effattn's matrix-vector products for decoding on the CPU: y[m, :] = W x[m, :] + b, for a few rows m.
 *
 * A decode step of a small model is a chain of matrix-vector products whose weights (the whole model,
 * hundreds of MB) stream from memory once per token. PyTorch hands a one-row linear to MKL's GEMM, which
 * ran it on one thread at 10.7 GB/s on an AMD EPYC (measured: benchmarks/bench_gemv.py); here each thread
 * takes a contiguous block of W's rows and reads it once for all m, 19.5 GB/s on one thread and 26.8 GB/s
 * on two on that machine. The reference is torch.nn.functional.linear (naive.py).
 *
 * float32 only. W [n, k] row-major, x [M, k], b [n] or NULL, y [M, n]. Built with -fopenmp: the OpenMP
 * runtime is the one PyTorch already loaded (the same libgomp.so.1), so there is one pool of threads.
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
