"""Hybrid sliding-window softmax + linear attention (LoLCATs): the readable quadratic reference.

For query position t (0-based) every key position s falls in one of three sets:

* the window ``W_t = {s : t - window < s <= t}``: exact softmax terms ``exp(scale * q_t . k_s - m_t)``,
  with ``m_t = max_{s in W_t} scale * q_t . k_s``;
* the far keys ``F_t = {s : s <= t - window}``: linear-attention terms ``fq_t . fk_s`` of the
  feature-mapped (non-negative) queries and keys;
* the future ``s > t``: masked.

With ``sinks = S > 0`` (StreamingLLM's attention sinks, Xiao et al. 2023) the first S positions of the
sequence never leave the softmax: ``W_t`` also holds every ``s < S`` (``s <= t``), and ``F_t`` loses
them. Attention heads of pretrained LLMs put much of their weight on the first token, a spike the
feature maps cannot reproduce among thousands of far keys; kept exact, it costs S keys and values per
head in the cache. ``m_t`` is then the largest logit over the window and the sinks together.

Both kinds share one normaliser, each weighted by a per-head factor:

    num_t = window_factor * sum_{s in W_t} exp(scale q_t.k_s - m_t) v_s + linear_factor * sum_{s in F_t} (fq_t.fk_s) v_s
    den_t = window_factor * sum_{s in W_t} exp(scale q_t.k_s - m_t)     + linear_factor * sum_{s in F_t} (fq_t.fk_s)
    out_t = num_t / (den_t + eps)

The window max ``m_t`` is subtracted inside the exponential only; the linear terms are *not* rescaled
by ``exp(-m_t)``, so ``m_t`` is part of the function, not a mere stabiliser. As in LoLCATs'
``hybrid_attention_quadratic`` it is not detached: gradients flow through it (to the arg-max
query/key pair). ``window = 0`` leaves ``W_t`` empty and ``F_t = {s <= t}``: pure causal linear
attention, with no softmax term and no ``m_t``. ``window >= T`` leaves ``F_t`` empty: causal softmax
attention (up to ``eps`` and ``window_factor``).

Every implementation of this package (``chunk.py``, ``recurrent.py``) follows these semantics,
including the placement of ``eps`` and the non-detached ``m_t``, so outputs and gradients agree.
"""

from typing import NamedTuple

import torch
from torch import Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float32 for half/bfloat16/float32 inputs, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_window(window) -> None:
    """Raise ``ValueError`` unless ``window`` is an integer >= 0."""
    if not _is_int(window) or window < 0:
        raise ValueError(
            f"window must be an integer >= 0, got {window!r}; pass the number of most recent keys "
            f"(the query's own included) that get exact softmax, or 0 for pure linear attention."
        )


def check_sinks(sinks, window) -> None:
    """Raise ``ValueError`` unless ``sinks`` is an integer >= 0, and 0 where ``window`` is 0."""
    if not _is_int(sinks) or sinks < 0:
        raise ValueError(f"sinks must be an integer >= 0, got {sinks!r}; pass the number of first positions "
                         f"kept under exact softmax (0: none).")
    if sinks and not window:
        raise ValueError(f"sinks={sinks} needs a window > 0: sinks join the window's softmax; pass window >= 1 "
                         f"or sinks=0.")


def check_hybrid_inputs(q, k, v, fq, fk, window, window_factor, linear_factor, scale, eps, sinks=0) -> None:
    """Raise ``ValueError`` with a one-sentence explanation if the hybrid attention inputs are inconsistent."""
    for name, x in (("q", q), ("k", k), ("v", v), ("fq", fq), ("fk", fk)):
        if not isinstance(x, Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(
                f"{name} must be a 4-dimensional tensor [batch, time, heads, dim], got {shape}; "
                f"reshape it to [B, T, heads, dim]."
            )
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}; cast it to a float dtype.")
    B, T, H, D = q.shape
    if k.shape != q.shape:
        raise ValueError(
            f"k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}; pass one key per query "
            f"position and head, with the queries' head_dim."
        )
    if v.shape[:3] != (B, T, H):
        raise ValueError(
            f"v must share batch, time and heads with q {tuple(q.shape[:3])}, got {tuple(v.shape)}; "
            f"pass one value per key."
        )
    if fk.shape != fq.shape:
        raise ValueError(
            f"fk must have the shape of fq {tuple(fq.shape)}, got {tuple(fk.shape)}; map queries and keys "
            f"with the same feature map."
        )
    if fq.shape[:3] != (B, T, H):
        raise ValueError(
            f"fq and fk must share batch, time and heads with q {tuple(q.shape[:3])}, got {tuple(fq.shape)}; "
            f"feature-map the same q and k."
        )
    if T == 0:
        raise ValueError("The sequence is empty (T=0); pass at least one position.")
    check_window(window)
    check_sinks(sinks, window)
    for name, factor in (("window_factor", window_factor), ("linear_factor", linear_factor)):
        if _is_real(factor):
            continue
        if not isinstance(factor, Tensor) or factor.shape not in ((H,), ()) or not factor.is_floating_point():
            got = f"{factor.dtype} {tuple(factor.shape)}" if isinstance(factor, Tensor) else repr(factor)
            raise ValueError(
                f"{name} must be a number or a floating-point tensor of shape [heads] = [{H}], got {got}; "
                f"pass one non-negative weight per head."
            )
    if not _is_real(scale):
        raise ValueError(f"scale must be a real number, got {scale!r}; pass e.g. head_dim ** -0.5.")
    if not _is_real(eps) or eps < 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}; pass a small non-negative float such as 1e-6.")


def head_weights(factor, heads: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A per-head factor as an (H,) tensor of ``dtype``; a tensor keeps its autograd graph."""
    if isinstance(factor, Tensor):
        return factor.to(dtype=dtype, device=device).expand(heads)
    return torch.full((heads,), float(factor), dtype=dtype, device=device)


class HybridParts(NamedTuple):
    """The hybrid's four sums before the per-head factors combine them (`combine_parts`), in the compute
    dtype: ``window_num`` [B, T, H, Dv] and ``window_den`` [B, T, H], ``sum_{W_t} exp(scale q_t.k_s - m_t)
    (v_s, 1)``; ``far_num``, ``far_den`` likewise ``sum_{F_t} (fq_t.fk_s) (v_s, 1)``. They do not depend on
    the factors: fitting only the factors (attention transfer of a map without parameters) needs them once."""

    window_num: Tensor
    window_den: Tensor
    far_num: Tensor
    far_den: Tensor


def combine_parts(parts: HybridParts, window_factor: Tensor | float, linear_factor: Tensor | float,
                  eps: float = 1e-6) -> Tensor:
    """``out_t = (wf num_window + lf num_far) / (wf den_window + lf den_far + eps)`` per head: [B, T, H, Dv] in the
    parts' dtype (autograd reaches the factors)."""
    H, dt, device = parts.window_num.shape[2], parts.window_num.dtype, parts.window_num.device
    wf = head_weights(window_factor, H, dt, device)  # [H]
    lf = head_weights(linear_factor, H, dt, device)  # [H]
    num = wf[:, None] * parts.window_num + lf[:, None] * parts.far_num  # [B, T, H, Dv]
    den = wf * parts.window_den + lf * parts.far_den  # [B, T, H]
    return num / (den + eps)[..., None]


def hybrid_parts_naive(q: Tensor, k: Tensor, v: Tensor, fq: Tensor, fk: Tensor, *, window: int, scale: float,
                       sinks: int = 0) -> HybridParts:
    """The quadratic reference's four sums (`HybridParts`; arguments as `hybrid_attention_naive`'s), in the
    compute dtype."""
    check_hybrid_inputs(q, k, v, fq, fk, window, 1.0, 1.0, scale, 0.0, sinks)
    B, T, H, D = q.shape
    dt = compute_dtype(q.dtype)
    q, k, v, fq, fk = (x.to(dt) for x in (q, k, v, fq, fk))

    t = torch.arange(T, device=q.device)[:, None]  # query positions
    s = torch.arange(T, device=q.device)[None, :]  # key positions
    in_window = (s <= t) & ((s > t - window) | (s < sinks))  # [T, T], W_t with the sinks
    in_far = (s <= t - window) & (s >= sinks)  # [T, T], F_t

    v = v.transpose(1, 2)  # [B, H, T, Dv]
    # linear terms: a_ln[t, s] = fq_t . fk_s on the far keys
    a_ln = torch.einsum("bthf,bshf->bhts", fq, fk).masked_fill(~in_far, 0.0)  # [B, H, T, T]
    far_num, far_den = a_ln @ v, a_ln.sum(-1)  # [B, H, T, Dv], [B, H, T]
    if window > 0:
        # softmax terms: exp(scale q_t . k_s - m_t) on the window keys (and sinks); s = t is always there, so m_t is finite
        logits = torch.einsum("bthd,bshd->bhts", q, k) * scale  # [B, H, T, T]
        logits = logits.masked_fill(~in_window, float("-inf"))
        m = logits.amax(-1, keepdim=True)  # [B, H, T, 1], m_t (not detached)
        a_sm = torch.exp(logits - m)  # [B, H, T, T], zero outside the window
        win_num, win_den = a_sm @ v, a_sm.sum(-1)
    else:
        win_num, win_den = torch.zeros_like(far_num), torch.zeros_like(far_den)
    return HybridParts(*(x.transpose(1, 2) for x in (win_num, win_den, far_num, far_den)))  # [B, T, H, *]


def hybrid_attention_naive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    fq: Tensor,
    fk: Tensor,
    *,
    window: int,
    window_factor: Tensor | float,
    linear_factor: Tensor | float,
    scale: float,
    eps: float = 1e-6,
    sinks: int = 0,
) -> Tensor:
    """Quadratic reference for the hybrid attention (see the module docstring).

    Args:
        q: [B, T, H, D] queries (after RoPE, if any).
        k: [B, T, H, D] keys.
        v: [B, T, H, Dv] values.
        fq: [B, T, H, F] feature-mapped queries, non-negative.
        fk: [B, T, H, F] feature-mapped keys, non-negative.
        window: >= 0, the number of most recent keys (the query's own included) under exact softmax.
        window_factor: [H] (or a number) weight of the softmax terms, per head.
        linear_factor: [H] (or a number) weight of the linear terms, per head.
        scale: softmax scale (e.g. ``D ** -0.5``).
        eps: added to the shared normaliser.
        sinks: >= 0, the first positions kept under exact softmax for every later query (0: none; needs
            ``window > 0``).

    Returns:
        [B, T, H, Dv] in the dtype of ``q``; accumulated in float32 at least.
    """
    check_hybrid_inputs(q, k, v, fq, fk, window, window_factor, linear_factor, scale, eps, sinks)
    parts = hybrid_parts_naive(q, k, v, fq, fk, window=window, scale=scale, sinks=sinks)
    return combine_parts(parts, window_factor, linear_factor, eps).to(q.dtype)  # [B, T, H, Dv]
