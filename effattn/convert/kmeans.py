"""k-means for codebooks: a batched torch implementation and scikit-learn's MiniBatchKMeans.

Both take points `x` [G, N, D] (one problem per KV head) and an optional metric `M` [G, D, D]
(positive definite): the distance is (x - c)ᵀ M (x - c). With M = E[q qᵀ] over the queries that
will read the keys, that is the mean squared error the quantization adds to the attention logits
(`vq-init --metric query`); M = I is plain key distance. Both whiten by M^½, cluster with Euclidean
distance, and return the centroids in the original space (cluster means commute with the map).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

KMEANS = ("torch", "sklearn")


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


def _lloyd(x: torch.Tensor, k: int, iters: int, gen: torch.Generator) -> torch.Tensor:
    centers = _plus_plus(x, k, gen)
    for _ in range(iters):
        labels, d = _assign(x, centers)
        sums = torch.zeros_like(centers).index_add_(0, labels, x)
        counts = torch.bincount(labels, minlength=k).to(x.dtype)
        empty = counts == 0
        new = sums / counts.clamp_min(1)[:, None]
        if empty.any():  # re-seed empty clusters at the points farthest from their centers
            far = d.topk(int(empty.sum())).indices
            new[empty] = x[far]
        shift = (new - centers).pow(2).sum(-1).max()
        centers = new
        if float(shift) < 1e-6 * float(centers.pow(2).sum(-1).mean()):
            break
    return centers


def _sklearn(x: torch.Tensor, k: int, iters: int, seed: int) -> torch.Tensor:
    from sklearn.cluster import MiniBatchKMeans

    km = MiniBatchKMeans(n_clusters=k, batch_size=max(4096, 4 * k), max_iter=iters, n_init=1, random_state=seed,
                         init="k-means++", init_size=min(x.shape[0], 20 * k))
    km.fit(x.numpy())
    return torch.from_numpy(km.cluster_centers_).float()


def kmeans(x: torch.Tensor, k: int, *, metric: torch.Tensor | None = None, method: str = "torch",
           iters: int = 15, seed: int = 0) -> KMeansResult:
    """Cluster each group x[g] ([G, N, D]) into k centroids under `metric` (see the module docstring)."""
    if method not in KMEANS:
        raise ValueError(f"unknown k-means implementation {method!r}; choose one of {KMEANS}")
    t0 = time.perf_counter()
    G, N, D = x.shape
    k = min(k, N)
    white = whitener(metric, D, G)
    gen = torch.Generator().manual_seed(seed)
    centroids, counts, err = [], [], 0.0
    for g in range(G):
        xw = x[g].float() @ white[g]  # rows: Wᵀ x
        centers = _lloyd(xw, k, iters, gen) if method == "torch" else _sklearn(xw, k, iters, seed + g)
        labels, d = _assign(xw, centers)
        count = torch.bincount(labels, minlength=k).float()
        # centroids in the original space: cluster means of x (the whitening is linear)
        means = torch.zeros(k, D).index_add_(0, labels, x[g].float()) / count.clamp_min(1)[:, None]
        unused = count == 0
        if unused.any():  # map unused centers back through the whitening
            means[unused] = torch.linalg.solve(white[g].T, centers[unused].T).T
        centroids.append(means)
        counts.append(count)
        err += float(d.mean()) / G
    return KMeansResult(torch.stack(centroids), torch.stack(counts), err, time.perf_counter() - t0,
                        white.contiguous())
