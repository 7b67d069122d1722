"""Where key-means VQ loses quality: the far keys' logits or their values? Oracles on a converted model.

    python benchmarks/vq_far_oracles.py OUT_FROM_VQ_INIT [--corpora python] [--variants base,var,lse,exact,within,cov]
        [--outliers F | --heavy B]

Scores the model (as `effattn eval --context 2048`: 8,192 tokens per corpus in blocks of 2,048) with the
quadratic reference in place of the model's VQ kernel, the far part of every query's softmax computed in
one of these ways (the near window stays exact RoPE; inference only):

  base   what effattn computes with key means: the far keys of a code share one logit, the query's
         logit with the mean of those keys, and the code's mean value;
  var    base plus the second cumulant of the code's logits, ½ Σ_d q_d² Var_c(k_d) (a diagonal
         covariance of the code's far keys, from the sequence itself): a normaliser correction that
         needs one more vector per code;
  lse    an oracle normaliser: each code's logit is log mean exp of its keys' exact logits, so the
         code's keys get their exact total weight; their values are still averaged alike;
  exact  every far key's own logit and value (ReRoPE alone at this window: no codebook);
  within an oracle for the values: each code keeps base's total weight, shared among its keys in
         proportion to their exact exp(logit) (so a code returns its keys' attention-weighted value);
  cov    the first-order value correction: a code returns v̄ + Cov(v, k) q (each far key's share
         scaled by 1 + q·(k − k̄)), at base's weight; it would need a D x D matrix per code.

`lse` bounds what any correction of the codes' logits alone (a learned bias, cumulants) can reach,
`within` what a correction of the values alone can reach at base's weights; `lse` and `within` together
are `exact`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

import effattn.attention.vq as vq_module
from effattn.data.corpora import load_text, token_blocks
from effattn.evaluate import corpus_scores
from effattn.io.load import load_model
from effattn.kernels.rope import apply_rope

VARIANTS = ("base", "var", "lse", "exact", "within", "cov")


def code_spread(q_far: torch.Tensor, k: torch.Tensor, codes: torch.Tensor, size: int, window: int, sinks: int,
                tile: int = 64) -> torch.Tensor:
    """corr[b, h, t, c] = Σ_d q_far[b, t, h, d]² Var(k_d) over the far keys s ≤ t − W (s ≥ sinks) of code c
    (0 where the code holds none). q_far (B, T, H, D), k (B, T, G, D), codes (B, T, G). Runs over query tiles
    with running per-code sums, so memory stays (tile, tile, tile) and (C, D), not (T, C, D)."""
    B, T, H, D = q_far.shape
    G = k.shape[2]
    group = H // G
    corr = q_far.new_zeros(B, H, T, size)
    for b in range(B):
        for g in range(G):
            onehot = F.one_hot(codes[b, :, g].long(), size).to(q_far.dtype)  # (T, C)
            kg = k[b, :, g]
            sum1, sum2, count0 = kg.new_zeros(size, D), kg.new_zeros(size, D), kg.new_zeros(size)
            for t0 in range(0, T, tile):
                t1 = min(T, t0 + tile)
                start = t0 - window + 1  # the running sums hold the keys s < start: far for every query here
                lo, hi = max(start, sinks, 0), max(t1 - window, 0)  # keys far for some queries of the tile
                extra = hi > lo
                count = count0[None, :].expand(t1 - t0, -1)
                if extra:
                    ke, ohe = kg[lo:hi], onehot[lo:hi]
                    seen = (torch.arange(lo, hi)[None, :] <= torch.arange(t0, t1)[:, None] - window).to(kg.dtype)
                    same = ohe @ ohe.T
                    count = count + seen @ ohe
                n = count.clamp(min=1.0)
                for h in range(g * group, (g + 1) * group):
                    q2 = q_far[b, t0:t1, h].square()  # (tile, D)
                    second = q2 @ sum2.T  # Σ_d q_d² Σ_s k_sd², per code
                    first_sq = q2 @ sum1.square().T  # Σ_d q_d² (Σ_s k_sd)², the running part
                    if extra:
                        second = second + (seen * (q2 @ ke.square().T)) @ ohe
                        first_sq = first_sq + 2 * (seen * (q2 @ ((ohe @ sum1) * ke).T)) @ ohe
                        pairs = torch.einsum("td,ed,fd->tef", q2, ke, ke)
                        mask = seen[:, :, None] * seen[:, None, :] * same[None]
                        first_sq = first_sq + (pairs * mask).sum(-1) @ ohe
                    corr[b, h, t0:t1] = (second / n - first_sq / n.square()).clamp(min=0) * (count > 0)
                a, z = max(start, sinks, 0), max(min(t1 - window + 1, T), 0)  # the next tile's running sums
                if z > a:
                    sum1 += onehot[a:z].T @ kg[a:z]
                    sum2 += onehot[a:z].T @ kg[a:z].square()
                    count0 += onehot[a:z].sum(0)
    return corr


def heavy_hitters(probs: torch.Tensor, group: int, window: int, sinks: int, budget: int) -> torch.Tensor:
    """kept[b, h, t, s]: whether far key s is one of the `budget` heavy hitters of its KV head when query t
    reads it, chosen online as H2O (Zhang et al. 2023) chooses them. A key that leaves the window joins the
    set; when the set is over budget, the member with the least attention received so far (from every query
    before t, summed over the KV head's query heads; `probs` (B, H, T, T)) leaves it for good, into its code.
    Causal: the choice for query t uses the attention of queries before t only."""
    B, H, T, _ = probs.shape
    score = probs.reshape(B, H // group, group, T, T).sum(2).cumsum(2)  # (B, G, T, T): received up to query t
    member = torch.zeros(B, H // group, T, dtype=torch.bool)
    kept = torch.zeros(B, H // group, T, T, dtype=torch.bool)
    for t in range(window, T):
        new = t - window  # the key that leaves the window for query t
        if new >= sinks:
            member[:, :, new] = True
            over = member.sum(-1) > budget  # (B, G)
            if over.any():
                worst = score[:, :, t - 1].masked_fill(~member, float("inf")).argmin(-1)  # (B, G)
                member.scatter_(-1, worst[..., None], ~over[..., None] & member.gather(-1, worst[..., None]))
        kept[:, :, t] = member
    return kept.repeat_interleave(group, dim=1)


def far_oracle(variant: str, outliers: float = 0.0, heavy: int = 0):
    """A drop-in for the quadratic reference `vq_attention_naive` (same arguments) computing `variant`.

    outliers: the fraction of keys (per sequence and KV head) farthest from their codeword, ‖k − c‖, that
    leave their code and keep their own logit and value, as sinks do.
    heavy: a budget of far keys per KV head, chosen online by the attention they received (H2O's heavy
    hitters, `heavy_hitters`; the attention is the exact one, every far key at its own logit), that keep
    their own logit and value; the rest of the far keys stay in their codes."""

    @torch.no_grad()
    def attention(q, k, v, codebook, codes, cos, sin, far_cos, far_sin, *, window, block_size, sinks=0, scale=None,
                  key_means=False):
        B, T, H, D = q.shape
        G, size = k.shape[2], codebook.shape[1]
        group = H // G
        scale = D**-0.5 if scale is None else scale
        cos, sin = cos[:, None, :], sin[:, None, :]
        q_near = apply_rope(q, cos, sin) * scale
        q_far = apply_rope(q, far_cos, far_sin) * scale
        kk, vv = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        near = torch.einsum("bthd,bshd->bhts", q_near, apply_rope(kk, cos, sin))
        exact = torch.einsum("bthd,bshd->bhts", q_far, kk)  # every far key's own logit
        t, s = torch.arange(T)[:, None], torch.arange(T)[None, :]
        delta = t - s
        in_code = ((delta >= window) & (s >= sinks))[None, None]  # (1, 1, T, T); per head once outliers leave
        kept = torch.zeros(B, H, 1, T, dtype=torch.bool)  # far keys scored on their own
        if outliers > 0:
            err = (k - torch.stack([codebook[g][codes[:, :, g].long()] for g in range(G)], 2)).square().sum(-1)
            limit = torch.quantile(err, 1 - outliers, dim=1, keepdim=True)  # (B, 1, G)
            kept = (err > limit).repeat_interleave(group, dim=2).transpose(1, 2)[:, :, None, :]
            in_code = in_code & ~kept
        if heavy > 0:
            full = torch.where(delta < window, near, exact).masked_fill(delta < 0, float("-inf"))
            kept = heavy_hitters(torch.softmax(full, -1), group, window, sinks, heavy)  # (B, H, T, T)
            in_code = in_code & ~kept
        onehot = F.one_hot(codes.long(), size).to(q.dtype).repeat_interleave(group, dim=2).transpose(1, 2)
        count = in_code.to(q.dtype) @ onehot  # (B, H, T, C)
        key_code = codes.long().repeat_interleave(group, dim=2).transpose(1, 2)[:, :, None, :].expand(-1, -1, T, -1)
        if variant in ("lse", "within"):  # exp of each far key's exact logit, shifted by the query's largest one
            top = exact.masked_fill(~in_code, -1e30).amax(-1, keepdim=True).clamp(min=-1e4)
            e = torch.exp(exact - top).masked_fill(~in_code, 0.0)
            mass = (e @ onehot).clamp(min=1e-30)  # per code
        if variant == "exact":
            far = exact
        elif variant == "lse":
            far = (mass.log() + top - count.clamp(min=1.0).log()).gather(-1, key_code)
        else:
            code_logit = (exact.masked_fill(~in_code, 0.0) @ onehot) / count.clamp(min=1.0)
            if variant == "var":
                code_logit = code_logit + 0.5 * code_spread(q_far, k, codes, size, window, sinks)
            far = code_logit.gather(-1, key_code)
        if variant != "exact":  # sinks keep their own logit
            far = torch.where((s < sinks)[None, None] | kept, exact, far)
        logits = torch.where(delta < window, near, far).masked_fill(delta < 0, float("-inf"))
        # the values: a code's keys share one weight, so reading each key's own value is reading their mean
        probs = torch.softmax(logits, -1)
        if variant == "within":  # the code's total weight as in base, shared among its keys by their exact logits
            share = e / mass.gather(-1, key_code) * count.gather(-1, key_code)
            probs = torch.where(in_code, probs * share, probs)
        elif variant == "cov":  # first order in q·(k − mean): a code returns v̄ + Cov(v, k) q
            probs = torch.where(in_code, probs * (1 + exact - far), probs)
        return (probs @ vv.transpose(1, 2)).transpose(1, 2)

    return attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a folder written by effattn vq-init (key means)")
    ap.add_argument("--corpora", default="python")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--outliers", type=float, default=0.0,
                    help="fraction of keys farthest from their codeword scored on their own (0 to 1)")
    ap.add_argument("--heavy", type=int, default=0,
                    help="far keys per KV head kept exact, chosen online by the attention they received (H2O)")
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:  # before the model loads
        ap.error(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    if not 0 <= args.outliers < 1:
        ap.error(f"--outliers {args.outliers}: give a fraction of the keys, from 0 up to (not including) 1")
    if args.heavy < 0:
        ap.error(f"--heavy {args.heavy}: give a number of keys per KV head, 0 or more")
    if args.outliers and args.heavy:
        ap.error("--outliers and --heavy choose the exact far keys two ways: give one of them")
    if (args.outliers or args.heavy) and "var" in variants:
        ap.error("--outliers and --heavy do not apply to var (its spread counts every far key): leave var out of --variants")
    model, tok, _ = load_model(args.model)  # in eval mode
    model.config.vq_kernel = "naive"  # the layers share this config: each runs the reference, patched below
    for corpus in args.corpora.split(","):
        blocks = token_blocks(tok, load_text(corpus), 2048, args.tokens, spread=True)
        for variant in variants:
            vq_module.vq_attention_naive = far_oracle(variant, args.outliers, args.heavy)
            t0 = time.perf_counter()
            scores = corpus_scores(model, blocks, None, batch_size=1)
            print(json.dumps({"corpus": corpus, "variant": variant, "outliers": args.outliers,
                              "heavy": args.heavy, "perplexity": round(scores["perplexity"], 4),
                              "tokens": scores["tokens"], "seconds": round(time.perf_counter() - t0)}), flush=True)


if __name__ == "__main__":
    main()
