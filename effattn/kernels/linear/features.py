"""Feature maps for linear attention: ``[B, T, H, D] -> [B, T, H, F]``.

All but ``taylor`` give non-negative features; ``taylor``'s features take both signs, but their dot
products are at least 1/2, which is what linear attention needs (positive weights).

A feature map ``phi`` replaces the softmax kernel ``exp(q . k / sqrt(D))`` by the dot product
``phi(q) . phi(k)``, which linear attention can sum over keys in a running state. The same module
maps queries and keys (``fq = phi(q)``, ``fk = phi(k)``); each module has ``feature_dim`` (F).

* ``elu``: ``elu(x) + 1`` (Katharopoulos et al. 2020), F = D; no kernel it approximates.
* ``performer``: FAVOR+ positive orthogonal random features (Choromanski et al. 2021), an unbiased
  estimate of ``exp(q . k / sqrt(D))``; F = ``num_features``.
* ``taylor``: the second-order Taylor expansion of ``exp(q . k / sqrt(D))`` (as in Based, Arora et al.
  2024), exact: ``phi(q) . phi(k) = 1 + s + s^2 / 2`` with ``s = q . k / sqrt(D)``; F = 1 + D + D (D + 1) / 2
  (the quadratic block's upper triangle).
* ``hedgehog``: the learned per-head map of Hedgehog / LoLCATs (Zhang et al. 2024),
  ``[softmax(x W), softmax(-x W)]``; F = 2 * ``projection_dim``.

``feature_map(name, head_dim, heads, **kw)`` builds one from the registry ``FEATURE_MAPS``.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from effattn.kernels.linear.naive import compute_dtype


def _check_size(name: str, value, low: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}; pass a positive integer.")


class _FeatureMap(nn.Module):
    """Common checks: maps act on [B, T, H, D] with the heads and head_dim they were built for."""

    def __init__(self, head_dim: int, heads: int):
        super().__init__()
        _check_size("head_dim", head_dim)
        _check_size("heads", heads)
        self.head_dim, self.heads = head_dim, heads

    def _check(self, x: Tensor) -> None:
        if not isinstance(x, Tensor) or x.dim() != 4 or tuple(x.shape[2:]) != (self.heads, self.head_dim):
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(
                f"{type(self).__name__} expects [batch, time, heads={self.heads}, head_dim={self.head_dim}], "
                f"got {shape}; pass queries or keys of the attention it was built for."
            )


class EluFeatureMap(_FeatureMap):
    """``phi(x) = elu(x) + 1``: positive, F = D."""

    def __init__(self, head_dim: int, heads: int):
        super().__init__(head_dim, heads)
        self.feature_dim = head_dim

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, T, H, D] -> [B, T, H, D]."""
        self._check(x)
        return F.elu(x) + 1


def orthogonal_gaussian(heads: int, head_dim: int, num_features: int, generator: torch.Generator) -> Tensor:
    """[H, D, m] random projections: per head, m columns in blocks of D mutually orthogonal directions,
    each with the length of a D-dimensional standard Gaussian vector (so each column is marginally
    N(0, I), as FAVOR+ needs, with less variance than independent draws)."""
    blocks = -(-num_features // head_dim)
    w = torch.empty(heads, head_dim, num_features, dtype=torch.float64)
    for h in range(heads):
        gauss = torch.randn(blocks, head_dim, head_dim, generator=generator, dtype=torch.float64)
        ortho = torch.linalg.qr(gauss).Q  # [blocks, D, D], orthonormal columns
        directions = ortho.transpose(0, 1).reshape(head_dim, blocks * head_dim)[:, :num_features]  # [D, m]
        lengths = torch.randn(head_dim, num_features, generator=generator, dtype=torch.float64).norm(dim=0)  # [m]
        w[h] = directions * lengths
    return w


class PerformerFeatureMap(_FeatureMap):
    """FAVOR+ positive random features (Choromanski et al. 2021, "Rethinking Attention with Performers").

    With ``x' = x / D^(1/4)`` (so that ``q' . k' = q . k / sqrt(D)``) and orthogonal Gaussian
    projections ``w_1 .. w_m`` ([H, D, m], drawn once from ``seed``):

        phi(x)_i = exp(w_i . x' - |x'|^2 / 2) / sqrt(m),

    and ``E[phi(q) . phi(k)] = exp(-|q'|^2/2 - |k'|^2/2) E[exp(w . (q' + k'))] = exp(q' . k')``.

    Stabilisation. By default nothing is subtracted, which keeps the estimate unbiased and the map
    causal and stateless (decode = prefill); the exponent is at most ``|w_i|^2 / 2`` (complete the
    square), about D / 2, and is computed in float32 at least, so the features are returned in
    float32 at least (not in a half dtype whose range ``exp`` would exceed). ``stabilize=True``
    subtracts, per token, the (detached) max of the exponent over the features: every feature then
    lies in ``(0, 1/sqrt(m)]``, but ``phi(q) . phi(k)`` carries the factor ``exp(-c_q - c_k)`` of the
    two tokens' maxima. In pure linear attention the query's factor cancels while the key's reweights
    the keys; in the hybrid neither cancels. Use it only where a learned map or factor absorbs this.
    (A max shared by all tokens would keep the ratios, but it would look at future tokens.)
    """

    def __init__(self, head_dim: int, heads: int, num_features: int = 256, seed: int = 0, stabilize: bool = False):
        super().__init__(head_dim, heads)
        _check_size("num_features", num_features)
        self.feature_dim, self.stabilize = num_features, stabilize
        generator = torch.Generator().manual_seed(seed)
        self.register_buffer("projection", orthogonal_gaussian(heads, head_dim, num_features, generator).float())

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, T, H, D] -> [B, T, H, m] in float32 at least."""
        self._check(x)
        dt = compute_dtype(x.dtype)
        x = x.to(dt) * self.head_dim**-0.25  # [B, T, H, D], x'
        proj = torch.einsum("bthd,hdm->bthm", x, self.projection.to(dt))  # [B, T, H, m], w_i . x'
        exponent = proj - x.square().sum(-1, keepdim=True) / 2  # [B, T, H, m]
        if self.stabilize:
            exponent = exponent - exponent.amax(-1, keepdim=True).detach()
        return torch.exp(exponent) * self.feature_dim**-0.5


class TaylorFeatureMap(_FeatureMap):
    """Second-order Taylor features of ``exp(q . k / sqrt(D))`` (Based, Arora et al. 2024).

    With ``x' = x / D^(1/4)`` (so that ``q' . k' = s = q . k / sqrt(D)``):

        phi(x) = [1, x', x'_i^2 / sqrt(2) (i = 1..D), x'_i x'_j (i < j)],   F = 1 + D + D (D + 1) / 2,

    so ``phi(q) . phi(k) = 1 + s + s^2 / 2`` exactly: ``s^2 / 2 = sum_ij q'_i q'_j k'_i k'_j / 2`` is the
    diagonal terms halved plus each pair i < j once. Based writes the quadratic block as the whole outer
    product ``vec(x' x'^T) / sqrt(2)`` (F = 1 + D + D^2: 4,161 at D = 64); its D (D - 1) / 2 mirrored
    entries add nothing the upper triangle does not, so this map has 2,145 features at D = 64, and the
    state and the far part's work shrink by the same factor. It is positive: 1 + s + s^2/2 >= 1/2.
    """

    def __init__(self, head_dim: int, heads: int):
        super().__init__(head_dim, heads)
        self.feature_dim = 1 + head_dim + head_dim * (head_dim + 1) // 2

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, T, H, D] -> [B, T, H, 1 + D + D (D + 1) / 2], a view of head-major memory (as the kernels
        read it); written row by row of the triangle into one buffer (concatenated under autograd)."""
        self._check(x)
        D = self.head_dim
        x = (x * D**-0.25).transpose(1, 2)  # [B, H, T, D], x' with x' . y' = s
        rows = [x[..., i : i + 1] * x[..., i:] for i in range(D)]  # row i of the triangle: x'_i x'_j, j >= i
        if torch.is_grad_enabled() and x.requires_grad:  # autograd: in-place writes into a buffer do not differentiate
            rows = [r * torch.cat((r.new_full((1,), 2**-0.5), r.new_ones(D - i - 1))) for i, r in enumerate(rows)]
            return torch.cat((torch.ones_like(x[..., :1]), x, *rows), dim=-1).transpose(1, 2)
        out = x.new_empty((*x.shape[:3], self.feature_dim))  # [B, H, T, F]
        out[..., 0] = 1
        out[..., 1 : 1 + D] = x
        at = 1 + D
        for i, r in enumerate(rows):
            out[..., at : at + D - i] = r
            out[..., at] *= 2**-0.5  # the square x'_i^2 / sqrt(2)
            at += D - i
        return out.transpose(1, 2)


class HedgehogFeatureMap(_FeatureMap):
    """The learned feature map of Hedgehog / LoLCATs (Zhang et al. 2024), one linear layer per head:

        phi(x) = [softmax(x W_h + b_h), softmax(-(x W_h + b_h))],   W: [H, D, P],  F = 2P,

    softmax along the feature axis, so each half is a distribution (the features sum to 2 per head).
    ``W_h`` is initialised to the identity when ``P == D`` (as in LoLCATs), else to seeded
    ``N(0, 1/D)`` entries; the optional bias starts at zero.
    """

    def __init__(self, head_dim: int, heads: int, projection_dim: int = 64, bias: bool = False, seed: int = 0):
        super().__init__(head_dim, heads)
        _check_size("projection_dim", projection_dim)
        self.projection_dim, self.feature_dim = projection_dim, 2 * projection_dim
        if projection_dim == head_dim:
            weight = torch.eye(head_dim).expand(heads, head_dim, head_dim).clone()  # [H, D, D]
        else:
            generator = torch.Generator().manual_seed(seed)
            weight = torch.randn(heads, head_dim, projection_dim, generator=generator) * head_dim**-0.5  # [H, D, P]
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(torch.zeros(heads, projection_dim)) if bias else None

    def _signed(self, dt: torch.dtype) -> tuple[Tensor, Tensor | None]:
        """([W, -W] [H, D, 2P], [b, -b] [H, 2P] or None) in `dt`; without autograd, kept until the
        parameters change (a decoding step would otherwise build them once per token and layer)."""
        params = (self.weight,) if self.bias is None else (self.weight, self.bias)

        def build() -> tuple[Tensor, Tensor | None]:
            w, b = (None if p is None else p.to(dt) for p in (self.weight, self.bias))
            return torch.cat((w, -w), dim=-1), None if b is None else torch.cat((b, -b), dim=-1)

        # under autograd, or parameters made in inference mode (no version counter to tell a change by)
        if (torch.is_grad_enabled() and any(p.requires_grad for p in params)) or any(p.is_inference() for p in params):
            return build()
        key = (dt, *((p.data_ptr(), p._version, p.device) for p in params))
        cached = self.__dict__.get("_signed_cache")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                self.__dict__["_signed_cache"] = cached = (key, build())
        return cached[1]

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, T, H, D] -> [B, T, H, 2P] in the dtype of x (softmax in float32 at least)."""
        self._check(x)
        dt = compute_dtype(x.dtype)
        # [x W, -(x W)] from one product with [W, -W] (negation is exact), then both softmaxes at once, in
        # head-major memory: the result is a [B, T, H, 2P] view of [B, H, T, 2P], as the kernels read it
        w, b = self._signed(dt)
        proj = torch.matmul(x.to(dt).transpose(1, 2), w)  # [B, H, T, 2P]
        if b is not None:
            proj = proj + b[:, None]
        phi = proj.unflatten(-1, (2, self.projection_dim)).softmax(-1).flatten(-2)  # [B, H, T, 2P]
        return phi.transpose(1, 2).to(x.dtype)


FEATURE_MAPS: dict[str, type[_FeatureMap]] = {
    "elu": EluFeatureMap,
    "performer": PerformerFeatureMap,
    "taylor": TaylorFeatureMap,
    "hedgehog": HedgehogFeatureMap,
}


def feature_map(name: str, head_dim: int, heads: int, **kw) -> nn.Module:
    """Build the feature map ``name`` for ``heads`` heads of ``head_dim``; ``kw`` go to its class."""
    if name not in FEATURE_MAPS:
        raise ValueError(f"Unknown feature map {name!r}; use one of {sorted(FEATURE_MAPS)}.")
    return FEATURE_MAPS[name](head_dim, heads, **kw)
