/* One decode step of the hybrid sliding-window softmax + linear attention in C, for float32 inference.
 *
 * The maths is recurrent.py's hybrid_attention_step (read it and naive.py first); decode.py holds the
 * state in the layout this file reads. Per batch row b and query head h (key/value head g = h / R):
 *
 *   1. RoPE on the query and the key at this position (rotate-half layout, the row cos, sin), unless
 *      the caller passes them rotated (rope = 0);
 *   2. the feature maps: Hedgehog's [softmax(x W_h + b_h), softmax(-(x W_h + b_h))] of the rotated
 *      query and key (one product per map: the negative half is the same projection negated), or the
 *      caller's features (wq = NULL);
 *   3. the window is a ring of W slots, position p in slot p % W. The slot of this position holds
 *      position seen - W, the key that leaves the window now: it is folded into S and z (S += fk v^T,
 *      z += fk) and the new key, value and feature key take its slot. W = 0: the new key is folded
 *      at once (nothing stays exact);
 *      With NS sinks, a leaving key at a position below NS is not folded: it takes sink slot p (its key
 *      and value), and the feature keys of those positions are stored as zeros;
 *   4. out = (wf sum_win exp(scale q.k - m) v + lf fq^T S) / (wf sum_win exp(scale q.k - m) + lf fq.z + eps),
 *      wf = sigmoid(window_factors[h]), lf = 1 - wf, m the largest logit; "win" is the window and the
 *      sinks that have left it.
 *
 * The fold and the product fq^T S are one pass over S. About 5 F Dv + 4 D P + 2 W D multiply-adds per
 * head, no allocation. Build: cc -O3 -march=native -ffast-math -fPIC -shared (see native.py).
 */

#include <math.h>
#include <string.h>

static void rope(const float *x, const float *cos, const float *sin, int D, float *y) {
    int half = D / 2;
    for (int i = 0; i < half; i++) {
        y[i] = x[i] * cos[i] - x[i + half] * sin[i];
        y[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
    }
}

/* Hedgehog: phi = [softmax(p), softmax(-p)] with p = x W + b, W (D x P) row-major, b (P) or NULL */
static void hedgehog(const float *x, const float *w, const float *b, int D, int P, float *proj, float *phi) {
    for (int j = 0; j < P; j++) proj[j] = b ? b[j] : 0.0f;
    for (int i = 0; i < D; i++) {
        const float xi = x[i], *row = w + (long)i * P;
        for (int j = 0; j < P; j++) proj[j] += xi * row[j];
    }
    float hi = proj[0], lo = proj[0];
    for (int j = 1; j < P; j++) {
        hi = proj[j] > hi ? proj[j] : hi;
        lo = proj[j] < lo ? proj[j] : lo;
    }
    float sp = 0.0f, sn = 0.0f;
    for (int j = 0; j < P; j++) {
        phi[j] = expf(proj[j] - hi);
        phi[P + j] = expf(lo - proj[j]);
        sp += phi[j];
        sn += phi[P + j];
    }
    const float ip = 1.0f / sp, in = 1.0f / sn;
    for (int j = 0; j < P; j++) {
        phi[j] *= ip;
        phi[P + j] *= in;
    }
}

/* Floats of scratch that linear_decode needs (rows: W + NS, the most softmax terms a step has). */
long linear_decode_work_floats(int D, int F, int rows) { return 2L * D + 2L * F + rows + F; }

/* q (B, H, D), k and v (B, G, D / Dv): this position's query, key and value (pre-RoPE when rope = 1).
 * cos, sin (D): its RoPE row. wq, wk (H, D, P) and bq, bk (H, P) or NULL: the Hedgehog maps (F = 2P);
 * with wq = NULL, fq and fk (B, H, F) are the features. wfac (H): window_factors.
 * ring_k (B, H, W, D), ring_v (B, H, W, Dv), ring_fk (B, H, W, F), S (B, H, F, Dv), z (B, H, F): the
 * state after `seen` positions, updated in place. NS sinks (W > 0): sink_k (B, H, NS, D), sink_v (B, H, NS, Dv),
 * slot p holding position p once it has left the window. out (B, H, Dv). */
void linear_decode(int B, int H, int G, int D, int Dv, int F, int W, int NS, long seen, float scale, float eps,
                   int use_rope, const float *q, const float *k, const float *v, const float *cos, const float *sin,
                   const float *wq, const float *bq, const float *wk, const float *bk, const float *fq_in,
                   const float *fk_in, const float *wfac, float *ring_k, float *ring_v, float *ring_fk, float *S,
                   float *z, float *sink_k, float *sink_v, float *out, float *work) {
    const int R = H / G, P = F / 2;
    const long slot = W > 0 ? seen % W : 0;
    const int n = W > 0 ? (seen + 1 < W ? (int)(seen + 1) : W) : 0; /* slots in the window after this step */
    const long leaving = seen - W;                                    /* the position that leaves the window */
    const int to_sink = W > 0 && leaving >= 0 && leaving < NS;        /* it is a sink: kept, not folded */
    const int fold = (W == 0 || seen >= W) && !to_sink;               /* a key enters the far part now */
    const long past = seen + 1 - W;                                   /* sinks out of the window after this step */
    const int ns = W > 0 && past > 0 ? (past < NS ? (int)past : NS) : 0;
    float *qr = work, *kr = qr + D, *fq = kr + D, *fk = fq + F, *logits = fk + F, *proj = logits + W + NS;
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < H; h++) {
            const int g = h / R;
            const long bh = (long)b * H + h;
            const float *qx = q + bh * D, *kx = k + ((long)b * G + g) * D, *vx = v + ((long)b * G + g) * Dv;
            if (use_rope) {
                rope(qx, cos, sin, D, qr);
                rope(kx, cos, sin, D, kr);
            } else {
                memcpy(qr, qx, sizeof(float) * D);
                memcpy(kr, kx, sizeof(float) * D);
            }
            if (wq) {
                hedgehog(qr, wq + (long)h * D * P, bq ? bq + (long)h * P : NULL, D, P, proj, fq);
                hedgehog(kr, wk + (long)h * D * P, bk ? bk + (long)h * P : NULL, D, P, proj, fk);
            } else {
                memcpy(fq, fq_in + bh * F, sizeof(float) * F);
                memcpy(fk, fk_in + bh * F, sizeof(float) * F);
            }
            float *rk = ring_k + bh * W * D, *rv = ring_v + bh * W * Dv, *rf = ring_fk + bh * W * F;
            float *Sh = S + bh * F * Dv, *zh = z + bh * F, *o = out + bh * Dv;
            float *sk = sink_k + bh * NS * D, *sv = sink_v + bh * NS * Dv;
            if (to_sink) {
                memcpy(sk + leaving * D, rk + slot * D, sizeof(float) * D);
                memcpy(sv + leaving * Dv, rv + slot * Dv, sizeof(float) * Dv);
            }
            if (seen < NS) memset(fk, 0, sizeof(float) * F); /* a sink never joins S */
            /* the key that enters the far part: the slot's old key (W > 0) or this one (W = 0) */
            const float *f_old = W > 0 ? rf + slot * F : fk, *v_old = W > 0 ? rv + slot * Dv : vx;
            const float wf = 1.0f / (1.0f + expf(-wfac[h])), lf = 1.0f - wf;
            /* fold and fq^T S in one pass over S; then fq . z */
            for (int e = 0; e < Dv; e++) o[e] = 0.0f;
            float lin_den = 0.0f;
            for (int f = 0; f < F; f++) {
                float *row = Sh + (long)f * Dv;
                if (fold) {
                    const float a = f_old[f];
                    for (int e = 0; e < Dv; e++) row[e] += a * v_old[e];
                    zh[f] += a;
                }
                const float c = fq[f];
                for (int e = 0; e < Dv; e++) o[e] += c * row[e];
                lin_den += c * zh[f];
            }
            for (int e = 0; e < Dv; e++) o[e] *= lf;
            float den = lf * lin_den;
            if (W > 0) {
                memcpy(rk + slot * D, kr, sizeof(float) * D);
                memcpy(rv + slot * Dv, vx, sizeof(float) * Dv);
                memcpy(rf + slot * F, fk, sizeof(float) * F);
                float m = -1e30f; /* finite: built with -ffast-math */
                for (int j = 0; j < n + ns; j++) { /* the ring's n rows, then the sinks' ns */
                    const float *kj = j < n ? rk + (long)j * D : sk + (long)(j - n) * D;
                    float s = 0.0f;
                    for (int i = 0; i < D; i++) s += qr[i] * kj[i];
                    logits[j] = s * scale;
                    m = logits[j] > m ? logits[j] : m;
                }
                float sum = 0.0f;
                for (int j = 0; j < n + ns; j++) {
                    const float a = expf(logits[j] - m);
                    sum += a;
                    const float aw = a * wf, *vj = j < n ? rv + (long)j * Dv : sv + (long)(j - n) * Dv;
                    for (int e = 0; e < Dv; e++) o[e] += aw * vj[e];
                }
                den += wf * sum;
            }
            const float inv = 1.0f / (den + eps);
            for (int e = 0; e < Dv; e++) o[e] *= inv;
        }
    }
}
