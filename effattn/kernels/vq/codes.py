"""Code assignment: the nearest codeword of every key, the quantization step of Transformer-VQ."""

import torch
from torch import Tensor

try:  # the compiled scorer; absent where this file is bundled as a model's remote code
    from effattn.kernels.vq import native as _native
except ImportError:
    _native = None

# Positions scored per pass: the (G, B * CHUNK, C) score buffer stays a few megabytes, so the
# memory used does not grow with the sequence.
CHUNK = 1024


@torch.no_grad()
def code_table(codebook: Tensor, metric: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor | None, Tensor]:
    """What ``nearest_codes`` scores keys against: the whitened codebook (G, C, E), the metric in ``dtype``
    (or None) and ``-‖c‖² / 2`` (G, 1, C). Depends on the codebook only, so callers that keep it fixed
    (inference) may compute it once and pass it as ``table``."""
    codebook = codebook.to(dtype)
    w = None if metric is None else metric.to(dtype)
    if w is not None:
        codebook = codebook @ w  # (G, C, E)
    return codebook, w, -0.5 * codebook.square().sum(-1)[:, None, :]


@torch.no_grad()
def nearest_codes(k: Tensor, codebook: Tensor, metric: Tensor | None = None, table=None) -> Tensor:
    """Index of the nearest codeword of every key: k (B, T, G, D), codebook (G, C, D) -> (B, T, G) int64.

    ``metric`` (G, D, E) is a whitening map W: the distance is ``‖Wᵀ(k − c)‖²`` (W = I: the plain
    distance). The nearest codeword maximises ``<k, c> − ‖c‖² / 2`` (in whitened space), one batched
    matrix product per ``CHUNK`` positions (float32 on the CPU: native.c's ``vq_nearest``, 128 rows at a
    time in cache, rows split over threads, unless ``EFFATTN_NATIVE=0``). Ties go to the lower index.
    ``table``: ``code_table``'s result for this codebook, metric and k's dtype, if the caller keeps it.
    """
    B, T, G, D = k.shape
    codebook, w, neg_half_norms = table if table is not None else code_table(codebook, metric, k.dtype)
    if B * T <= 16:  # a decode step: a few rows, where the plain argmax is the cheaper one
        piece = k.reshape(B * T, G, D).transpose(0, 1)  # (G, B*T, D)
        scores = torch.baddbmm(neg_half_norms, piece if w is None else piece @ w, codebook.mT)
        return scores.argmax(-1).T.reshape(B, T, G)
    if k.dtype == torch.float32 and k.device.type == "cpu" and _native is not None and _native.available():
        piece = k if w is None else torch.einsum("btgd,gde->btge", k, w)
        return _native.nearest_codes(piece, codebook, neg_half_norms[:, 0, :])
    codes = torch.empty(B, T, G, dtype=torch.int64, device=k.device)
    scores = None
    for i in range(0, T, CHUNK):
        piece = k[:, i : i + CHUNK].permute(2, 0, 1, 3).reshape(G, -1, D)  # (G, B*n, D)
        if w is not None:
            piece = piece @ w
        if scores is None or scores.shape[1] != piece.shape[1]:
            scores = piece.new_empty(G, piece.shape[1], codebook.shape[1])
        torch.baddbmm(neg_half_norms, piece, codebook.mT, out=scores)  # (G, B*n, C)
        codes[:, i : i + CHUNK] = _first_argmax(scores).view(G, B, -1).permute(1, 2, 0)
    return codes


def _first_argmax(scores: Tensor, width: int = 32) -> Tensor:
    """Index of the first maximum along the last dimension, like ``scores.argmax(-1)`` but faster.

    A max-with-index over C scores is several times slower than a plain max: take the plain max of
    every run of ``width`` scores, the first run that holds the overall maximum, then the index
    within that run.
    """
    C = scores.shape[-1]
    if C % width or C < 2 * width:
        return scores.max(-1).indices
    runs = scores.view(*scores.shape[:-1], C // width, width)
    best = runs.amax(-1).max(-1).indices  # (...,) the first run holding the maximum
    chosen = runs.gather(-2, best[..., None, None].expand(*best.shape, 1, width)).squeeze(-2)
    return best * width + chosen.max(-1).indices
