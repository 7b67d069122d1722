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

/* The exact part of a step: softmax over up to three segments of keys (the ring, the sinks out of it, a global cache:
 * keys k[i] (rows x D), values v[i] (rows x Dv), n[i] rows), weighted by wf: adds wf sum_j a_j v_j to o and returns
 * wf sum_j a_j, a_j = exp(scale q.k_j - m), m the largest logit. logits: scratch of sum n[i] floats. */
static float exact_read(const float *qr, int D, int Dv, float scale, float wf, const float *const k[3],
                        const float *const v[3], const int n[3], float *logits, float *o) {
    float m = -1e30f; /* finite: built with -ffast-math */
    int j = 0;
    for (int seg = 0; seg < 3; seg++)
        for (int r = 0; r < n[seg]; r++, j++) {
            const float *kj = k[seg] + (long)r * D;
            float s = 0.0f;
            for (int i = 0; i < D; i++) s += qr[i] * kj[i];
            logits[j] = s * scale;
            m = logits[j] > m ? logits[j] : m;
        }
    float sum = 0.0f;
    j = 0;
    for (int seg = 0; seg < 3; seg++)
        for (int r = 0; r < n[seg]; r++, j++) {
            const float a = expf(logits[j] - m), aw = a * wf, *vj = v[seg] + (long)r * Dv;
            sum += a;
            for (int e = 0; e < Dv; e++) o[e] += aw * vj[e];
        }
    return wf * sum;
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
                const float *ks[3] = {rk, sk, NULL}, *vs[3] = {rv, sv, NULL}; /* the ring's n rows, the sinks' ns */
                const int ns3[3] = {n, ns, 0};
                den += exact_read(qr, D, Dv, scale, wf, ks, vs, ns3, logits, o);
            }
            const float inv = 1.0f / (den + eps);
            for (int e = 0; e < Dv; e++) o[e] *= inv;
        }
    }
}

/* ---- The hybrid with LoLA's global cache (global_cache.py; read its docstring first) ----
 *
 * decode.py's GlobalDecodeState holds the state in the layout read here. Besides linear_decode's ring,
 * sinks and state S, z (of the decided keys not cached): the cache, `cached` rows per head (the same for
 * every head) of rotated keys, values and positions (cache_k (B, H, C, D), cache_v (B, H, C, Dv), cache_pos
 * (B, H, C)), and the pending block, the far keys not yet decided (pend_k, pend_v, pend_fk (B, H, W, *)),
 * position first + i in slot i, first = NS + decided * W. Step t (= seen):
 *
 *   1. the key leaving the ring, p = t - W: a sink (p < NS) takes sink slot p; the last key of a block
 *      (p - NS + 1 a multiple of W) was decided at the end of step t - 1 and is dropped; any other key takes
 *      pending slot (p - NS) % W;
 *   2. RoPE, Hedgehog's maps, the new key into the ring (its feature key zeroed if it is a sink);
 *   3. out = (wf sum_exact exp(scale q.k - m) v + lf (fq^T S + sum_pending (fq.fk) v))
 *            / (wf sum_exact exp(scale q.k - m) + lf (fq.z + sum_pending fq.fk) + eps),
 *      "exact" the ring, the sinks out of it and the cache;
 *   4. when query t + 1 sees one more decided block than query t, that block (the W - 1 pending keys and the
 *      ring's oldest key, position t + 1 - W) and the cache compete: each candidate's self-recall error
 *      |v - fk^T S / (fk.z + eps)| against S, z (the cached keys' feature keys computed again by the key map);
 *      the C largest stay, in candidate order (the cache's first), the others are folded into S and z. Among
 *      equal errors the later candidate leaves first.
 *
 * The cache holds min(C, decided * W) rows. Hedgehog maps only (the model's default; other maps decode through
 * global_cache_attention in PyTorch).
 */

long global_decode_work_floats(int D, int Dv, int F, int W, int NS, int C) {
    return 2L * D + 2L * F + (W + NS + C) + F + (long)(C + W) * (F + 2) + Dv;
}

void global_decode(int B, int H, int G, int D, int Dv, int F, int W, int NS, int C, long seen, float scale,
                  float eps, const float *q, const float *k, const float *v, const float *cos, const float *sin,
                  const float *wq, const float *bq, const float *wk, const float *bk, const float *wfac,
                  float *ring_k, float *ring_v, float *ring_fk, float *S, float *z, float *sink_k, float *sink_v,
                  float *cache_k, float *cache_v, long *cache_pos, float *pend_k, float *pend_v, float *pend_fk,
                  float *out, float *work) {
    const int R = H / G, P = F / 2;
    const long t = seen, slot = t % W, leaving = t - W;
    const int n = t + 1 < W ? (int)(t + 1) : W;                       /* ring rows after this step */
    const long past = t + 1 - W;
    const int ns = past > 0 ? (past < NS ? (int)past : NS) : 0;       /* sinks out of the ring */
    const long d0 = (t - NS + 1) / W - 1, d1 = (t - NS + 2) / W - 1;  /* decided blocks for queries t, t + 1 */
    const long decided = t - NS + 1 >= 0 && d0 > 0 ? d0 : 0, first = NS + decided * W;
    const int npend = t - W - first + 1 > 0 ? (int)(t - W - first + 1) : 0;
    const int decide = t - NS + 2 >= 0 && d1 > decided;
    const int to_sink = leaving >= 0 && leaving < NS;
    const int to_pend = leaving >= NS && (leaving - NS + 1) % W != 0;
    const int g = decided * W < C ? (int)(decided * W) : C; /* the cache's rows: each decision adds W, keeps C */
    const int cand = g + W, drop = cand > C ? cand - C : 0;
    float *qr = work, *kr = qr + D, *fq = kr + D, *fk = fq + F, *logits = fk + F, *proj = logits + W + NS + C;
    float *cfk = proj + F, *err = cfk + (long)(C + W) * F, *lose = err + C + W, *rec = lose + C + W;
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < H; h++) {
            const int gh = h / R;
            const long bh = (long)b * H + h;
            const float *qx = q + bh * D, *kx = k + ((long)b * G + gh) * D, *vx = v + ((long)b * G + gh) * Dv;
            float *rk = ring_k + bh * W * D, *rv = ring_v + bh * W * Dv, *rf = ring_fk + bh * W * F;
            float *Sh = S + bh * F * Dv, *zh = z + bh * F, *o = out + bh * Dv;
            float *sk = sink_k + bh * NS * D, *sv = sink_v + bh * NS * Dv;
            float *ck = cache_k + bh * C * D, *cv = cache_v + bh * C * Dv;
            long *cp = cache_pos + bh * C;
            float *pk = pend_k + bh * W * D, *pv = pend_v + bh * W * Dv, *pf = pend_fk + bh * W * F;
            const float *wkh = wk + (long)h * D * P, *bkh = bk ? bk + (long)h * P : NULL;
            if (to_sink) {
                memcpy(sk + leaving * D, rk + slot * D, sizeof(float) * D);
                memcpy(sv + leaving * Dv, rv + slot * Dv, sizeof(float) * Dv);
            } else if (to_pend) {
                const long i = (leaving - NS) % W;
                memcpy(pk + i * D, rk + slot * D, sizeof(float) * D);
                memcpy(pv + i * Dv, rv + slot * Dv, sizeof(float) * Dv);
                memcpy(pf + i * F, rf + slot * F, sizeof(float) * F);
            }
            rope(qx, cos, sin, D, qr);
            rope(kx, cos, sin, D, kr);
            hedgehog(qr, wq + (long)h * D * P, bq ? bq + (long)h * P : NULL, D, P, proj, fq);
            hedgehog(kr, wkh, bkh, D, P, proj, fk);
            if (t < NS) memset(fk, 0, sizeof(float) * F); /* a sink never joins S */
            memcpy(rk + slot * D, kr, sizeof(float) * D);
            memcpy(rv + slot * Dv, vx, sizeof(float) * Dv);
            memcpy(rf + slot * F, fk, sizeof(float) * F);
            const float wf = 1.0f / (1.0f + expf(-wfac[h])), lf = 1.0f - wf;
            /* the linear part: fq^T S, fq.z, and the pending keys one by one */
            for (int e = 0; e < Dv; e++) o[e] = 0.0f;
            float lin_den = 0.0f;
            for (int f = 0; f < F; f++) {
                const float c = fq[f], *row = Sh + (long)f * Dv;
                for (int e = 0; e < Dv; e++) o[e] += c * row[e];
                lin_den += c * zh[f];
            }
            for (int j = 0; j < npend; j++) {
                const float *fj = pf + (long)j * F, *vj = pv + (long)j * Dv;
                float a = 0.0f;
                for (int f = 0; f < F; f++) a += fq[f] * fj[f];
                for (int e = 0; e < Dv; e++) o[e] += a * vj[e];
                lin_den += a;
            }
            for (int e = 0; e < Dv; e++) o[e] *= lf;
            float den = lf * lin_den;
            /* the exact part: the ring's n rows, the sinks' ns, the cache's g */
            const float *ks[3] = {rk, sk, ck}, *vs[3] = {rv, sv, cv};
            const int ns3[3] = {n, ns, g};
            den += exact_read(qr, D, Dv, scale, wf, ks, vs, ns3, logits, o);
            const float inv = 1.0f / (den + eps);
            for (int e = 0; e < Dv; e++) o[e] *= inv;
            if (!decide) continue;
            /* the decision: candidates 0 .. g - 1 the cache, g .. g + W - 2 the pending keys, g + W - 1 the
             * ring's oldest key (slot (t + 1) % W, position t + 1 - W) */
            const long last = (t + 1) % W;
            for (int i = 0; i < cand; i++) {
                float *fi = cfk + (long)i * F;
                const float *vi;
                if (i < g) {
                    hedgehog(ck + (long)i * D, wkh, bkh, D, P, proj, fi);
                    vi = cv + (long)i * Dv;
                } else if (i < cand - 1) {
                    memcpy(fi, pf + (long)(i - g) * F, sizeof(float) * F);
                    vi = pv + (long)(i - g) * Dv;
                } else {
                    memcpy(fi, rf + last * F, sizeof(float) * F);
                    vi = rv + last * Dv;
                }
                float dz = 0.0f;
                for (int e = 0; e < Dv; e++) rec[e] = 0.0f;
                for (int f = 0; f < F; f++) {
                    const float c = fi[f], *row = Sh + (long)f * Dv;
                    for (int e = 0; e < Dv; e++) rec[e] += c * row[e];
                    dz += c * zh[f];
                }
                const float id = 1.0f / (dz + eps);
                float e2 = 0.0f;
                for (int e = 0; e < Dv; e++) {
                    const float r = vi[e] - rec[e] * id;
                    e2 += r * r;
                }
                err[i] = e2; /* the squared norm orders the candidates as the norm does */
                lose[i] = 0.0f;
            }
            for (int d = 0; d < drop; d++) { /* the smallest errors leave; among equal ones the later candidate */
                int worst = -1;
                for (int i = 0; i < cand; i++)
                    if (lose[i] == 0.0f && (worst < 0 || err[i] <= err[worst])) worst = i;
                lose[worst] = 1.0f;
            }
            int w = 0; /* compact the cache in place: winners in candidate order */
            for (int i = 0; i < cand; i++) {
                const float *ki, *vi;
                long pos;
                if (i < g) {
                    ki = ck + (long)i * D, vi = cv + (long)i * Dv, pos = cp[i];
                } else if (i < cand - 1) {
                    ki = pk + (long)(i - g) * D, vi = pv + (long)(i - g) * Dv, pos = first + (i - g);
                } else {
                    ki = rk + last * D, vi = rv + last * Dv, pos = t + 1 - W;
                }
                if (lose[i] != 0.0f) { /* folded into S, z */
                    const float *fi = cfk + (long)i * F;
                    for (int f = 0; f < F; f++) {
                        float *row = Sh + (long)f * Dv;
                        const float a = fi[f];
                        for (int e = 0; e < Dv; e++) row[e] += a * vi[e];
                        zh[f] += a;
                    }
                } else {
                    if (ki != ck + (long)w * D) {
                        memmove(ck + (long)w * D, ki, sizeof(float) * D);
                        memmove(cv + (long)w * Dv, vi, sizeof(float) * Dv);
                    }
                    cp[w++] = pos;
                }
            }
        }
    }
}
