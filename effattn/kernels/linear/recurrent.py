"""Hybrid sliding-window softmax + linear attention: one-token decoding with a constant-size state.

Same semantics as ``naive.py`` (read its docstring first). After ``seen`` positions the state holds

* the window cache: keys, values and feature-mapped keys of the last ``n = min(seen, window)``
  positions ``seen - n .. seen - 1``, kept exactly for the softmax terms;
* the linear state of every older key, ``S = sum_s fk_s v_s^T`` ([F, Dv] per head) and
  ``z = sum_s fk_s`` ([F] per head).

A step for query ``t = seen`` appends the new key to the cache; if the cache then holds more than
``window`` keys, the oldest one (position ``t - window``, which has just entered the far set ``F_t``)
leaves it and is folded into ``S`` and ``z``. The cache is then exactly ``W_t`` and ``S, z`` sum
over exactly ``F_t``, so

    out_t = (wf * sum_{W_t} exp(scale q_t.k_s - m_t) v_s + lf * fq_t^T S)
            / (wf * sum_{W_t} exp(scale q_t.k_s - m_t) + lf * fq_t . z + eps).

The state stops growing once ``window`` positions are seen (``window = 0``: it never holds a key).
``S`` and ``z`` are accumulated in float32 at least; the cache keeps the inputs' dtype. The state
is not detached: gradients flow through it like through the chunked kernel.
"""

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from effattn.kernels.linear.naive import check_hybrid_inputs, check_window, compute_dtype, head_weights


@dataclass
class HybridState:
    """Everything needed to continue a sequence; its size stops growing after ``window`` positions.

    With ``n = min(seen, window)``:

    Attributes:
        seen: number of positions processed so far (absolute position of the next one).
        window: the window size the state was built with.
        S: [B, H, F, Dv] ``sum fk_s v_s^T`` over the keys that left the window, positions ``< seen - n``.
        z: [B, H, F] ``sum fk_s`` over the same keys.
        k: [B, n, H, D] keys of positions ``seen - n .. seen - 1``.
        v: [B, n, H, Dv] their values.
        fk: [B, n, H, F] their feature-mapped keys (needed when they leave the window for S).
    """

    seen: int
    window: int
    S: Tensor
    z: Tensor
    k: Tensor
    v: Tensor
    fk: Tensor

    def nbytes(self) -> int:
        """Total size of the state's tensors in bytes."""
        return sum(
            x.numel() * x.element_size() for x in (getattr(self, f.name) for f in fields(self)) if isinstance(x, Tensor)
        )


def init_state(
    batch_size: int,
    heads: int,
    head_dim: int,
    value_dim: int,
    feature_dim: int,
    *,
    window: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> HybridState:
    """The empty state (no position seen); ``dtype`` is the inputs' dtype (S, z use float32 at least)."""
    check_window(window)
    stats = compute_dtype(dtype)
    return HybridState(
        seen=0,
        window=window,
        S=torch.zeros(batch_size, heads, feature_dim, value_dim, dtype=stats, device=device),
        z=torch.zeros(batch_size, heads, feature_dim, dtype=stats, device=device),
        k=torch.zeros(batch_size, 0, heads, head_dim, dtype=dtype, device=device),
        v=torch.zeros(batch_size, 0, heads, value_dim, dtype=dtype, device=device),
        fk=torch.zeros(batch_size, 0, heads, feature_dim, dtype=dtype, device=device),
    )


def state_from_prefill(k: Tensor, v: Tensor, fk: Tensor, window: int) -> HybridState:
    """The state after the T positions of a prefill.

    Args:
        k: [B, T, H, D] keys.
        v: [B, T, H, Dv] values.
        fk: [B, T, H, F] feature-mapped keys.
        window: >= 0, as for the attention calls that continue the sequence.
    """
    for name, x in (("k", k), ("v", v), ("fk", fk)):
        if not isinstance(x, Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a 4-dimensional tensor [batch, time, heads, dim], got {shape}; "
                             f"reshape it to [B, T, heads, dim].")  # fmt: skip
    if v.shape[:3] != k.shape[:3] or fk.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"k, v and fk must share batch, time and heads, got k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"fk {tuple(fk.shape)}; pass the tensors of one prefill."
        )
    check_window(window)
    T = k.shape[1]
    n = min(T, window)  # positions that stay in the window cache
    old = T - n  # positions 0 .. old - 1 have left the window
    dt = compute_dtype(k.dtype)
    fk_old, v_old = fk[:, :old].to(dt), v[:, :old].to(dt)  # [B, old, H, F], [B, old, H, Dv]
    return HybridState(
        seen=T,
        window=window,
        S=torch.einsum("bshf,bshe->bhfe", fk_old, v_old),  # [B, H, F, Dv]
        z=fk_old.sum(1),  # [B, H, F]
        k=k[:, old:],  # [B, n, H, D]
        v=v[:, old:],  # [B, n, H, Dv]
        fk=fk[:, old:],  # [B, n, H, F]
    )


def check_state(state: HybridState, k: Tensor, v: Tensor, fk: Tensor, window: int) -> None:
    if not isinstance(state, HybridState):
        raise ValueError(f"state must be a HybridState or None, got {type(state).__name__}; "
                         f"pass the state returned by the previous step, init_state or state_from_prefill.")  # fmt: skip
    if state.window != window:
        raise ValueError(
            f"The state was built with window={state.window} but this call uses window={window}; "
            f"continue a sequence with the window that started it."
        )
    B, _, H, D = k.shape
    Dv, Fd = v.shape[3], fk.shape[3]
    n = min(state.seen, window)
    expected = {"S": (B, H, Fd, Dv), "z": (B, H, Fd), "k": (B, n, H, D), "v": (B, n, H, Dv), "fk": (B, n, H, Fd)}
    for name, shape in expected.items():
        if tuple(getattr(state, name).shape) != shape:
            raise ValueError(
                f"state.{name} has shape {tuple(getattr(state, name).shape)} but these inputs need {shape}; "
                f"pass the state returned for this sequence, batch and feature map."
            )


def hybrid_attention_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    fq: Tensor,
    fk: Tensor,
    state: HybridState | None,
    *,
    window: int,
    window_factor: Tensor | float,
    linear_factor: Tensor | float,
    scale: float,
    eps: float = 1e-6,
) -> tuple[Tensor, HybridState]:
    """Attention of one new position over the state and itself; the inputs of one token.

    Args:
        q, k: [B, 1, H, D] query and key of position ``state.seen``.
        v: [B, 1, H, Dv] its value.
        fq, fk: [B, 1, H, F] its feature-mapped query and key.
        state: the state after the previous positions, or None to start a sequence.
        window, window_factor, linear_factor, scale, eps: as for :func:`hybrid_attention_naive`.

    Returns:
        ``(out, new_state)``: out [B, 1, H, Dv] in the dtype of ``q``, and the state including this position.
    """
    check_hybrid_inputs(q, k, v, fq, fk, window, window_factor, linear_factor, scale, eps)
    B, T, H, D = q.shape
    if T != 1:
        raise ValueError(f"hybrid_attention_step takes one position (T=1), got T={T}; "
                         f"use hybrid_attention_chunk or state_from_prefill for several.")  # fmt: skip
    if state is None:
        state = init_state(B, H, D, v.shape[3], fq.shape[3], window=window, dtype=q.dtype, device=q.device)
    check_state(state, k, v, fk, window)
    in_dtype, dt = q.dtype, compute_dtype(q.dtype)
    wf = head_weights(window_factor, H, dt, q.device)  # [H]
    lf = head_weights(linear_factor, H, dt, q.device)  # [H]

    # 1. the new key joins the window cache
    k_win = torch.cat((state.k, k.to(state.k.dtype)), dim=1)  # [B, n + 1, H, D]
    v_win = torch.cat((state.v, v.to(state.v.dtype)), dim=1)  # [B, n + 1, H, Dv]
    fk_win = torch.cat((state.fk, fk.to(state.fk.dtype)), dim=1)  # [B, n + 1, H, F]
    S, z = state.S, state.z
    # 2. a full cache overflows by one: its oldest key (position t - window) enters F_t, fold it into S, z
    if k_win.shape[1] > window:
        fk_old, v_old = fk_win[:, 0].to(dt), v_win[:, 0].to(dt)  # [B, H, F], [B, H, Dv]
        S = torch.addcmul(S, fk_old[..., :, None], v_old[..., None, :])  # S + fk_old v_old^T, [B, H, F, Dv]
        z = z + fk_old  # [B, H, F]
        k_win, v_win, fk_win = k_win[:, 1:], v_win[:, 1:], fk_win[:, 1:]  # [B, min(n + 1, window), H, *]

    # 3. attend: linear terms from the state, softmax terms over the cache (= W_t); [B, H, 1, *] matrices
    q_t, fq_t = q.to(dt).transpose(1, 2), fq.to(dt).transpose(1, 2)  # [B, H, 1, D], [B, H, 1, F]
    num = torch.matmul(fq_t, S) * lf[:, None, None]  # [B, H, 1, Dv]
    den = torch.matmul(fq_t, z[..., None]) * lf[:, None, None]  # [B, H, 1, 1]
    if window > 0:  # (not in place: gradients flow through the step)
        logits = torch.matmul(q_t, k_win.to(dt).permute(0, 2, 3, 1)) * scale  # [B, H, 1, n]
        a = torch.exp(logits - logits.amax(-1, keepdim=True))  # m_t subtracted
        w = wf[:, None, None]
        num = num + torch.matmul(a, v_win.to(dt).transpose(1, 2)) * w
        den = den + a.sum(-1, keepdim=True) * w
    out = (num / (den + eps))[:, :, 0]  # [B, H, Dv]
    new_state = HybridState(seen=state.seen + 1, window=window, S=S, z=z, k=k_win, v=v_win, fk=fk_win)
    return out[:, None].to(in_dtype), new_state  # [B, 1, H, Dv]
