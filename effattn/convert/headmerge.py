"""The math of merging attention heads without breaking RoPE.

RoPE in Hugging Face's rotate-half layout rotates the pair of dims (f, f + d/2) of every query and
key by the angle θ_f·position. Writing that pair as one complex number z_f = x_f + i·x_{f+d/2},
RoPE is z_f -> z_f·e^{iθ_f·pos}, and the logit contribution of frequency f is Re(w_f·conj(z_f)·
e^{iθ_f(t-s)}) for query w and key z. A linear map on keys commutes with RoPE exactly when it acts
on each frequency separately as multiplication by a complex number (a 2x2 rotation-and-scale on the
pair): it may combine *heads* with complex coefficients per frequency, never mix frequencies.

Keys (per new KV head j, serving query heads Q_j that used old KV heads S_j):
  for every frequency f, pick complex coefficients a_{g,f} and form the new key z'_f = Σ_g a_{g,f} z_{g,f};
  the query heads reading old head g are multiplied by conj(b_{g,f}) where z_g ≈ b_g·z' (the
  least-squares regression of the old key on the new one). Then w'·conj(z') = w·conj(b_g z') ≈ w·conj(z_g)
  for every relative position: RoPE stays exact, only the rank-1 approximation error remains.
  The best a, b minimise Σ_i E_{t,s}|w_{i,t}|²·|z_{g(i),s} − b_g z'_s|² (the logit error summed over all
  query/key token pairs, which factorises), i.e. a rank-1 complex PCA of the keys weighted by the
  energy ω_g = Σ_{i reads g} E|w_{i,f}|² of the queries that read them (Eckart–Young).

The slowest pairs barely turn over the whole context: there the constraint buys almost nothing, and
`PooledKeys` merges them by one real PCA across their frequencies instead (a bounded logit error).

Values carry no RoPE: any linear map on values can be undone in o_proj. The new value head is the
top-d principal subspace of the stacked old values of S_j, each head weighted by how much o_proj
amplifies it (L_g = (W_o,gᵀ W_o,g)^{1/2}); o_proj is then either the PCA reconstruction or refitted
by least squares on calibration activations (see calibrate.py).

Everything here is computed in float64 / complex128.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


def to_complex(x: torch.Tensor) -> torch.Tensor:
    """[..., d] real (rotate-half layout) -> [..., d/2] complex: z_f = x_f + i·x_{f+d/2}."""
    half = x.shape[-1] // 2
    return torch.complex(x[..., :half].double(), x[..., half:].double())


def from_complex(z: torch.Tensor) -> torch.Tensor:
    """Inverse of `to_complex`: [..., d/2] complex -> [..., d] float64."""
    return torch.cat([z.real, z.imag], dim=-1)


def complex_rows(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """A head-major projection weight [heads*d, D] (or bias [heads*d]) -> complex [heads, d/2, D] (or [heads, d/2])."""
    blocks = w.double().reshape(heads, head_dim, *w.shape[1:])  # (h, d, ...)
    return to_complex(blocks.movedim(1, -1)).movedim(-1, 1)  # (h, d/2, ...)


def real_rows(z: torch.Tensor) -> torch.Tensor:
    """Inverse of `complex_rows`: complex [heads, d/2, ...] -> real [heads*d, ...]."""
    x = from_complex(z.movedim(1, -1)).movedim(-1, 1)  # (h, d, ...)
    return x.reshape(-1, *x.shape[2:])


@dataclass
class KeyMerge:
    """Per-frequency complex coefficients of one new KV head: z' = Σ_g a[g]·z_g and z_g ≈ b[g]·z'."""

    members: list[int]  # old KV heads S_j, in order
    a: torch.Tensor  # [r, F] complex
    b: torch.Tensor  # [r, F] complex


def merge_keys(key_cov: torch.Tensor, weight: torch.Tensor, members: list[int]) -> KeyMerge:
    """Rank-1 complex PCA per frequency of the keys of `members`, weighted by query energy.

    key_cov: [F, G, G] complex, E[z_g conj(z_h)] per frequency over calibration tokens (all old heads).
    weight:  [G, F] real ≥ 0, ω_g: energy of the queries (of this new head) that read old head g.
    """
    idx = torch.tensor(members)
    cov = key_cov[:, idx][:, :, idx]  # (F, r, r)
    omega = weight[idx].T.clamp_min(0)  # (F, r)
    scale = omega.sqrt() + 1e-12 * omega.sqrt().amax(dim=1, keepdim=True).clamp_min(1e-30)
    whitened = scale[:, :, None] * cov * scale[:, None, :]  # Ω^½ Σ Ω^½, (F, r, r)
    evals, evecs = torch.linalg.eigh(whitened)  # ascending
    u = evecs[:, :, -1]  # top eigenvector per frequency, (F, r)
    lam = evals[:, -1].clamp_min(0)
    a = u.conj() * scale  # z' = u^H Ω^½ z
    b = u / scale  # Ω^½ z ≈ u z'  =>  z_g ≈ (u_g / ω_g^½) z'
    # Scale z' to the mean energy of the old keys so the new weights have familiar magnitudes.
    target = torch.diagonal(cov, dim1=1, dim2=2).real.mean(dim=1)
    norm = torch.where(lam > 0, (target / lam.clamp_min(1e-300)).sqrt(), torch.ones_like(lam))
    return KeyMerge(members, (a * norm[:, None]).T.contiguous(), (b / norm[:, None]).T.contiguous())


def align_keys(key_cov: torch.Tensor, members: list[int]) -> KeyMerge:
    """Per-frequency phase alignment of the member heads' keys to the first one, then the mean.

    The rotation e^{iφ_g} that best aligns z_g with z_ref is φ_g = −arg E[z_g conj(z_ref)]; it is
    orthogonal and commutes with RoPE, so applying it to keys and queries alike changes no logit.
    Averaging the aligned keys is the only approximation (Align-heads-before-merging, 2024).
    """
    idx = torch.tensor(members)
    cross = key_cov[:, idx, idx[0]]  # (F, r): E[z_g conj(z_ref)]
    phase = torch.exp(-1j * torch.angle(cross)).T  # (r, F), unit modulus
    r = len(members)
    return KeyMerge(members, phase / r, phase.conj())


def align_values(value_cov: torch.Tensor, members: list[int], head_dim: int) -> ValueMerge:
    """Orthogonal Procrustes rotation of each member's values onto the first one's, then the mean.

    R_g = argmin_R ‖R v_g − v_ref‖ over rotations: with E[v_ref v_gᵀ] = U S Vᵀ, R_g = U Vᵀ. The
    rotation is undone exactly in o_proj (v_g = R_gᵀ R_g v_g); only the averaging loses information.
    """
    d, r = head_dim, len(members)
    ref = slice(members[0] * d, (members[0] + 1) * d)
    P, B = [], []
    for g in members:
        cross = value_cov[ref, g * d:(g + 1) * d]  # E[v_ref v_gᵀ]
        U, _, Vh = torch.linalg.svd(cross)
        R = U @ Vh
        P.append(R / r)
        B.append(R.T)
    return ValueMerge(members, torch.stack(P), torch.stack(B))


def apply_key_merge(keys: torch.Tensor, merge: KeyMerge) -> torch.Tensor:
    """New key from the old keys of the members: keys [..., r, d] (real, rotate-half) -> [..., d] float64."""
    z = to_complex(keys)  # (..., r, F)
    return from_complex((merge.a * z).sum(dim=-2))


def merged_key_rows(k_rows: torch.Tensor, merge: KeyMerge) -> torch.Tensor:
    """New key head's complex rows [F, ...] from old heads' complex rows [G, F, ...]."""
    rows = k_rows[torch.tensor(merge.members)]  # (r, F, ...)
    a = merge.a.reshape(*merge.a.shape, *([1] * (rows.dim() - 2)))
    return (a * rows).sum(dim=0)


@dataclass
class ValueMerge:
    """New value head v' = Σ_g P[g] v_g and its reconstruction v_g ≈ B[g] v'."""

    members: list[int]
    P: torch.Tensor  # [r, d, d]: v' = Σ_g P[g] @ v_g
    B: torch.Tensor  # [r, d, d]: v_g ≈ B[g] @ v'


def merge_values(value_cov: torch.Tensor, out_metric: torch.Tensor, members: list[int], head_dim: int,
                 eps: float = 1e-6) -> ValueMerge:
    """Top-d PCA of the stacked values of `members`, each head weighted by its output metric.

    value_cov:  [G*d, G*d] E[v vᵀ] over calibration tokens (all old heads stacked).
    out_metric: [G, d, d] M_g = Σ_{i reads g} W_o,iᵀ W_o,i (how o_proj amplifies head g's values).
    """
    d = head_dim
    r = len(members)
    blocks = torch.cat([torch.arange(g * d, (g + 1) * d) for g in members])
    cov = value_cov[blocks][:, blocks]  # (r*d, r*d)
    L, L_inv = [], []
    for g in members:
        M = out_metric[g]
        evals, evecs = torch.linalg.eigh(M + eps * M.diagonal().mean().clamp_min(1e-30) * torch.eye(d, dtype=M.dtype))
        L.append(evecs @ torch.diag(evals.sqrt()) @ evecs.T)
        L_inv.append(evecs @ torch.diag(evals.rsqrt()) @ evecs.T)
    Lbig = torch.block_diag(*L)  # (r*d, r*d)
    weighted = Lbig @ cov @ Lbig.T
    _, evecs = torch.linalg.eigh(weighted)
    U = evecs[:, -d:].flip(-1)  # top-d principal directions, (r*d, d)
    P = torch.stack([U[i * d:(i + 1) * d].T @ L[i] for i in range(r)])  # (r, d, d)
    B = torch.stack([L_inv[i] @ U[i * d:(i + 1) * d] for i in range(r)])  # (r, d, d)
    return ValueMerge(members, P, B)


@dataclass
class PooledKeys:
    """The keys of the slow RoPE pairs of one new KV head, merged across frequencies.

    A pair that turns by less than about a radian over the whole context rotates almost alike at every
    distance, so it may hold any mix of the members' slow pairs, not only its own frequency's: the slow
    block is merged by one real PCA over all its dims (y = A x) instead of one complex number per
    frequency, and the PCA puts the new key's dims where the members' keys have their energy. The queries
    reading member g are compensated by B_gᵀ (x_g ≈ B_g y). Exact for the logits at distance 0; at distance
    Δ a pair's new content turns by its own angle θ·Δ instead of its source's, an error bounded by the
    block's largest θ·Δ, which the caller keeps small by choosing the pairs.
    """

    members: list[int]
    dims: list[int]  # the block's dims in rotate-half layout: [f, f + d/2 for each pair f, fastest first]
    A: torch.Tensor  # [n, r*n] real: y = A @ [x_g for g in members]
    B: torch.Tensor  # [r, n, n] real: x_g ≈ B[g] @ y


def pair_dims(pairs: list[int], head_dim: int) -> list[int]:
    """The rotate-half dims of RoPE pairs `pairs` (sorted by frequency index, fastest first)."""
    return [x for f in sorted(pairs) for x in (f, f + head_dim // 2)]


def block_key_merge(merge: KeyMerge, dims: list[int], head_dim: int) -> torch.Tensor:
    """The per-frequency merge `merge` restricted to the block `dims` (pair_dims layout), as the real
    matrix [n, r*n] that maps the members' stacked block dims to the new key's: on each pair, the
    complex coefficient a acts as the 2x2 rotation-and-scale [[Re a, −Im a], [Im a, Re a]]."""
    F, n, r = head_dim // 2, len(dims), len(merge.members)
    pairs = dims[0::2]
    out = torch.zeros(n, r * n, dtype=torch.float64)
    for i, f in enumerate(pairs):
        assert dims[2 * i + 1] == f + F, "dims must be pair_dims(...)"
        for m in range(r):
            a = merge.a[m, f]
            c = m * n + 2 * i
            out[2 * i:2 * i + 2, c:c + 2] = torch.tensor([[a.real, -a.imag], [a.imag, a.real]], dtype=torch.float64)
    return out


def merge_pooled_keys(key_cov: torch.Tensor, q_cov: torch.Tensor, members: list[int], dims: list[int],
                      eps: float = 1e-6, reference: torch.Tensor | None = None) -> PooledKeys:
    """Weighted PCA of the members' keys on `dims`, all frequencies of the block at once.

    key_cov: [G*n, G*n] real, E[x xᵀ] of every old head's keys on the n block dims (head-major).
    q_cov:   [G, n, n] real, Q_g = Σ_{i reads g} E[q_i q_iᵀ] on those dims (the queries of this new head).
    Minimises Σ_g E (q·(x_g − B_g y))² over the block, with q and x independent: tr Q_g E[e eᵀ], a PCA
    of the keys whitened by Q_g^½ (Eckart–Young), keeping n of r·n dims.

    The PCA's largest components go to the slowest pairs (the least rotation). With `reference` ([n, r*n],
    block_key_merge of the per-frequency merge): where that merge already keeps the whole block (heads
    that are copies), it is returned as it is (RoPE-exact), with its least-squares B.
    """
    n, r = len(dims), len(members)
    idx = torch.cat([torch.arange(g * n, (g + 1) * n) for g in members])
    cov = key_cov[idx][:, idx]  # (r n, r n)
    S, S_inv = [], []
    for g in members:
        Q = q_cov[g]
        evals, evecs = torch.linalg.eigh(Q)
        evals = evals.clamp_min(eps * evals.amax().clamp_min(1e-30))
        S.append(evecs @ torch.diag(evals.sqrt()) @ evecs.T)
        S_inv.append(evecs @ torch.diag(evals.rsqrt()) @ evecs.T)
    big = torch.block_diag(*S)
    if reference is not None:
        whole = torch.trace(big @ cov @ big)
        cross = big @ cov @ reference.T  # E[(S x) y_refᵀ]
        gram = reference @ cov @ reference.T  # E[y_ref y_refᵀ]
        fit = torch.linalg.lstsq(gram, cross.T).solution.T  # S x ≈ fit y_ref
        if whole - torch.trace(fit @ cross.T) <= 1e-9 * whole.clamp_min(1e-300):
            return PooledKeys(members, dims, reference.clone(),
                              torch.stack([S_inv[i] @ fit[i * n:(i + 1) * n] for i in range(r)]))
    evals, evecs = torch.linalg.eigh(big @ cov @ big)
    # ascending: the largest components go last, i.e. to the slowest pair of the block
    U, lam = evecs[:, -n:], evals[-n:].clamp_min(0)
    A = U.T @ big
    B = torch.stack([S_inv[i] @ U[i * n:(i + 1) * n] for i in range(r)])
    # scale y to the members' mean key energy per dim, as merge_keys scales z'
    target = torch.diagonal(cov).mean()
    scale = torch.where(lam > 0, (target / lam.clamp_min(1e-300)).sqrt(), torch.ones_like(lam))
    A, B = A * scale[:, None], B / scale[None, None, :]  # now E[y yᵀ] = target·I on the kept components
    return PooledKeys(members, dims, A, B)


def captured_key_energy(key_cov: torch.Tensor, weight: torch.Tensor, members: list[int]) -> float:
    """Weighted key energy a rank-1-per-frequency merge of `members` keeps (higher is better)."""
    idx = torch.tensor(members)
    cov = key_cov[:, idx][:, :, idx]
    s = weight[idx].T.clamp_min(0).sqrt()
    return torch.linalg.eigvalsh(s[:, :, None] * cov * s[:, None, :])[:, -1].sum().item()


def choose_groups(key_cov: torch.Tensor, weight: torch.Tensor, n_groups: int, exhaustive_limit: int = 20000) -> list[list[int]]:
    """Partition G old KV heads into `n_groups` equal groups that lose the least key energy.

    Which heads share a new head matters: heads whose keys are similar merge with little loss.
    Small problems are solved exactly by enumerating partitions; larger ones start from the
    contiguous grouping and improve it by swapping heads between groups while that helps.
    """
    G = key_cov.shape[1]
    size = G // n_groups
    score = lambda group: captured_key_energy(key_cov, weight, list(group))  # noqa: E731
    if n_groups == 1 or size == 1:
        return [list(range(j * size, (j + 1) * size)) for j in range(n_groups)]
    partitions = _count_partitions(G, size)
    if partitions <= exhaustive_limit:
        cache: dict[tuple[int, ...], float] = {}

        def cached(group: tuple[int, ...]) -> float:
            if group not in cache:
                cache[group] = score(group)
            return cache[group]

        best = max(_partitions(tuple(range(G)), size), key=lambda p: sum(cached(g) for g in p))
        return [list(g) for g in best]
    groups = [list(range(j * size, (j + 1) * size)) for j in range(n_groups)]
    improved = True
    while improved:
        improved = False
        for x, y in itertools.combinations(range(n_groups), 2):
            for i, j in itertools.product(range(size), range(size)):
                a, b = groups[x][:], groups[y][:]
                a[i], b[j] = b[j], a[i]
                if score(sorted(a)) + score(sorted(b)) > score(groups[x]) + score(groups[y]) + 1e-12:
                    groups[x], groups[y] = sorted(a), sorted(b)
                    improved = True
    return sorted(groups)


def _partitions(items: tuple[int, ...], size: int):
    """All partitions of `items` into groups of `size` (the first item always opens a group)."""
    if not items:
        yield ()
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        remaining = tuple(x for x in rest if x not in others)
        for tail in _partitions(remaining, size):
            yield ((first, *others), *tail)


def _count_partitions(n: int, size: int) -> int:
    from math import factorial

    groups = n // size
    return factorial(n) // (factorial(size) ** groups * factorial(groups))
