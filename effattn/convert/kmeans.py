"""k-means for codebooks: a batched torch implementation and scikit-learn's MiniBatchKMeans.

Both take points `x` [G, N, D] (one problem per KV head) and an optional metric `M` [G, D, D]
(positive definite): the distance is (x - c)ᵀ M (x - c). With M = E[q qᵀ] over the queries that
will read the keys, that is the mean squared error the quantization adds to the attention logits
(`vq-init --metric query`); M = I is plain key distance. Both whiten by M^½, cluster with Euclidean
distance, and return the centroids in the original space (cluster means commute with the map).

Optional sample weights `weights` [G, N] (`vq-init --metric attention`: the attention mass each key
receives from the queries that see it as far) make both seeding and centroids weighted: k-means++
samples by weight x squared distance, and each centroid is the weighted mean of its points, so the
fitted codebook minimises Σ_i w_i (x_i − c)ᵀ M (x_i − c).
"""

from __future__ import annotations

from typing import Literal, get_args

import time
from dataclasses import dataclass

import torch

KMeansMethod = Literal["torch", "sklearn"]
KMEANS = get_args(KMeansMethod)


@dataclass
class KMeansResult:
    centroids: torch.Tensor  # [G, C, D]
    counts: torch.Tensor  # [G, C] points per cluster
    error: float  # mean squared distance under the metric, per point
    seconds: float
    whitener: torch.Tensor  # [G, D, D] W with W Wᵀ = M: assign codes by ‖Wᵀ(x − c)‖²


def whitener(metric: torch.Tensor | None, dim: int, groups: int) -> torch.Tensor:
    """W [G, D, D] with W Wᵀ = M, so ‖Wᵀ(x − c)‖² = (x − c)ᵀ M (x − c)."""
    if metric is None:
        return torch.eye(dim).expand(groups, dim, dim)
    m = metric.double()
    m = m + 1e-6 * m.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None] * torch.eye(dim, dtype=m.dtype)
    return torch.linalg.cholesky(m).float()


def _plus_plus(x: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k-means++ seeding (D² sampling) on a random sample of 4k points of x [N, D]."""
    n = x.shape[0]
    sample = x[torch.randperm(n, generator=gen)[: min(n, 4 * k)]]
    norms = sample.pow(2).sum(-1)
    chosen = [int(torch.randint(len(sample), (1,), generator=gen))]
    d2 = (norms - 2 * sample @ sample[chosen[0]] + norms[chosen[0]]).clamp_min(0)
    for _ in range(1, k):
        total = float(d2.sum())
        i = int(torch.multinomial(d2 / total, 1, generator=gen)) if total > 0 else int(torch.randint(len(sample), (1,), generator=gen))
        chosen.append(i)
        d2 = torch.minimum(d2, (norms - 2 * sample @ sample[i] + norms[i]).clamp_min(0))
    return sample[chosen].clone()


def _weighted_plus_plus(x: torch.Tensor, w: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """Weighted k-means++ seeding on all points of x [N, D]: pick points with probability ∝ w · D²."""
    norms = x.pow(2).sum(-1)
    live = w > 0
    if int(live.sum()) < k:  # too few weighted points: fall back to every point with a small weight
        w = w + (w.max() if bool(live.any()) else 1.0) * 1e-6
    first = int(torch.multinomial(w / w.sum(), 1, generator=gen))
    chosen = [first]
    d2 = (norms - 2 * x @ x[first] + norms[first]).clamp_min(0)
    for _ in range(1, k):
        p = d2 * w
        total = float(p.sum())
        i = int(torch.multinomial(p / total, 1, generator=gen)) if total > 0 else int(torch.multinomial(w / w.sum(), 1, generator=gen))
        chosen.append(i)
        d2 = torch.minimum(d2, (norms - 2 * x @ x[i] + norms[i]).clamp_min(0))
    return x[chosen].clone()


def _means(x: torch.Tensor, labels: torch.Tensor, k: int, w: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-cluster (weighted) means of x [N, D] and the number of points per cluster. A cluster whose
    points all have weight 0 gets their unweighted mean; a cluster with no point gets zeros."""
    count = torch.bincount(labels, minlength=k).to(x.dtype)
    plain = torch.zeros(k, x.shape[1], dtype=x.dtype).index_add_(0, labels, x) / count.clamp_min(1)[:, None]
    if w is None:
        return plain, count
    mass = torch.zeros(k, dtype=x.dtype).index_add_(0, labels, w.to(x.dtype))
    weighted = torch.zeros(k, x.shape[1], dtype=x.dtype).index_add_(0, labels, x * w.to(x.dtype)[:, None])
    weighted = weighted / mass.clamp_min(torch.finfo(x.dtype).tiny)[:, None]
    return torch.where((mass > 0)[:, None], weighted, plain), count


def _assign(x: torch.Tensor, centers: torch.Tensor, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest center and squared distance of every point: x [N, D], centers [C, D]."""
    labels, dists = [], []
    c2 = centers.pow(2).sum(-1)
    for i in range(0, x.shape[0], chunk):
        xi = x[i:i + chunk]
        d = xi.pow(2).sum(-1, keepdim=True) - 2 * xi @ centers.T + c2
        best = d.min(-1)
        labels.append(best.indices)
        dists.append(best.values.clamp_min(0))
    return torch.cat(labels), torch.cat(dists)


def _lloyd(x: torch.Tensor, k: int, iters: int, gen: torch.Generator, w: torch.Tensor | None = None) -> torch.Tensor:
    centers = _plus_plus(x, k, gen) if w is None else _weighted_plus_plus(x, w, k, gen)
    for _ in range(iters):
        labels, d = _assign(x, centers)
        new, counts = _means(x, labels, k, w)
        empty = counts == 0
        if empty.any():  # re-seed empty clusters at the points with the largest (weighted) error
            far = (d if w is None else d * w).topk(int(empty.sum())).indices
            new[empty] = x[far]
        shift = (new - centers).pow(2).sum(-1).max()
        centers = new
        if float(shift) < 1e-6 * float(centers.pow(2).sum(-1).mean()):
            break
    return centers


def _sklearn(x: torch.Tensor, k: int, iters: int, seed: int, w: torch.Tensor | None = None) -> torch.Tensor:
    from sklearn.cluster import MiniBatchKMeans

    km = MiniBatchKMeans(n_clusters=k, batch_size=max(4096, 4 * k), max_iter=iters, n_init=1, random_state=seed,
                         init="k-means++", init_size=min(x.shape[0], 20 * k))
    km.fit(x.numpy(), sample_weight=None if w is None else w.double().numpy())
    return torch.from_numpy(km.cluster_centers_).float()


def kmeans(x: torch.Tensor, k: int, *, metric: torch.Tensor | None = None, weights: torch.Tensor | None = None,
           method: str = "torch", iters: int = 15, seed: int = 0) -> KMeansResult:
    """Cluster each group x[g] ([G, N, D]) into k centroids under `metric`, with optional nonnegative
    sample `weights` [G, N] (see the module docstring). `error` is the (weighted) mean squared distance."""
    if method not in KMEANS:
        raise ValueError(f"unknown k-means implementation {method!r}; choose one of {KMEANS}")
    t0 = time.perf_counter()
    G, N, D = x.shape
    k = min(k, N)
    white = whitener(metric, D, G)
    gen = torch.Generator().manual_seed(seed)
    centroids, counts, err = [], [], 0.0
    if weights is not None:
        if weights.shape != (G, N) or bool((weights < 0).any()) or not bool(torch.isfinite(weights).all()):
            raise ValueError(f"weights must be finite, nonnegative and of shape {(G, N)}, got {tuple(weights.shape)}")
        weights = weights.float()
    for g in range(G):
        xw = x[g].float() @ white[g]  # rows: Wᵀ x
        w = None if weights is None else weights[g]
        centers = _lloyd(xw, k, iters, gen, w) if method == "torch" else _sklearn(xw, k, iters, seed + g, w)
        labels, d = _assign(xw, centers)
        # centroids in the original space: cluster (weighted) means of x (the whitening is linear)
        means, count = _means(x[g].float(), labels, k, w)
        unused = count == 0
        if unused.any():  # map unused centers back through the whitening
            means[unused] = torch.linalg.solve(white[g].T, centers[unused].T).T
        centroids.append(means)
        counts.append(count)
        err += (float(d.mean()) if w is None else float((d * w).sum() / w.sum().clamp_min(1e-30))) / G
    return KMeansResult(torch.stack(centroids), torch.stack(counts), err, time.perf_counter() - t0,
                        white.contiguous())
