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

With ``sinks = S``, a key that leaves the window at a position below S is not folded: it joins the
sink store (its key and value, kept exact), and the softmax runs over the sinks and the window with one
``m_t``. The store never holds a key the window holds, so nothing is counted twice.

The state stops growing once ``window + sinks`` positions are seen (``window = 0``: it never holds a key).
``S`` and ``z`` are accumulated in float32 at least; the cache keeps the inputs' dtype. The state
is not detached: gradients flow through it like through the chunked kernel.
"""

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from effattn.kernels.linear.naive import check_hybrid_inputs, check_sinks, check_window, compute_dtype, head_weights


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
        fk: [B, n, H, F] their feature-mapped keys (needed when they leave the window for S); zeros at
            positions below ``sinks``, which never join S.
        sinks: the number of first positions kept exact (``naive.py``), the state was built with.
        sink_k: [B, s, H, D] keys of positions ``0 .. s - 1``, ``s = min(sinks, seen - n)``: the sinks that
            have left the window (None: empty).
        sink_v: [B, s, H, Dv] their values.
    S and z then sum over the positions ``s .. seen - n - 1`` only.
    """

    seen: int
    window: int
    S: Tensor
    z: Tensor
    k: Tensor
    v: Tensor
    fk: Tensor
    sinks: int = 0
    sink_k: Tensor | None = None
    sink_v: Tensor | None = None

    def __post_init__(self):
        B, _, H, D = self.k.shape
        if self.sink_k is None:
            self.sink_k = self.k.new_zeros(B, 0, H, D)
        if self.sink_v is None:
            self.sink_v = self.v.new_zeros(B, 0, H, self.v.shape[3])

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
    sinks: int = 0,
) -> HybridState:
    """The empty state (no position seen); ``dtype`` is the inputs' dtype (S, z use float32 at least)."""
    check_window(window)
    check_sinks(sinks, window)
    stats = compute_dtype(dtype)
    return HybridState(
        seen=0,
        window=window,
        S=torch.zeros(batch_size, heads, feature_dim, value_dim, dtype=stats, device=device),
        z=torch.zeros(batch_size, heads, feature_dim, dtype=stats, device=device),
        k=torch.zeros(batch_size, 0, heads, head_dim, dtype=dtype, device=device),
        v=torch.zeros(batch_size, 0, heads, value_dim, dtype=dtype, device=device),
        fk=torch.zeros(batch_size, 0, heads, feature_dim, dtype=dtype, device=device),
        sinks=sinks,
    )


def state_from_prefill(k: Tensor, v: Tensor, fk: Tensor, window: int, sinks: int = 0) -> HybridState:
    """The state after the T positions of a prefill.

    Args:
        k: [B, T, H, D] keys.
        v: [B, T, H, Dv] values.
        fk: [B, T, H, F] feature-mapped keys.
        window: >= 0, as for the attention calls that continue the sequence.
        sinks: >= 0, likewise.
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
    check_sinks(sinks, window)
    T = k.shape[1]
    n = min(T, window)  # positions that stay in the window cache
    old = T - n  # positions 0 .. old - 1 have left the window
    s = min(sinks, old)  # of them, positions 0 .. s - 1 are sinks
    dt = compute_dtype(k.dtype)
    fk_old, v_old = fk[:, s:old].to(dt), v[:, s:old].to(dt)  # [B, old - s, H, F], [B, old - s, H, Dv]
    return HybridState(
        seen=T,
        window=window,
        S=torch.einsum("bshf,bshe->bhfe", fk_old, v_old),  # [B, H, F, Dv]
        z=fk_old.sum(1),  # [B, H, F]
        k=k[:, old:],  # [B, n, H, D]
        v=v[:, old:],  # [B, n, H, Dv]
        fk=torch.cat((torch.zeros_like(fk[:, old:sinks]), fk[:, max(old, sinks):]), dim=1),  # [B, n, H, F], sinks 0
        sinks=sinks,
        sink_k=k[:, :s],  # [B, s, H, D]
        sink_v=v[:, :s],  # [B, s, H, Dv]
    )


def check_state(state: HybridState, k: Tensor, v: Tensor, fk: Tensor, window: int, sinks: int = 0) -> None:
    if not isinstance(state, HybridState):
        raise ValueError(f"state must be a HybridState or None, got {type(state).__name__}; "
                         f"pass the state returned by the previous step, init_state or state_from_prefill.")  # fmt: skip
    if state.window != window:
        raise ValueError(
            f"The state was built with window={state.window} but this call uses window={window}; "
            f"continue a sequence with the window that started it."
        )
    if state.sinks != sinks:
        raise ValueError(f"The state was built with sinks={state.sinks} but this call uses sinks={sinks}; "
                         f"continue a sequence with the sinks that started it.")  # fmt: skip
    B, _, H, D = k.shape
    Dv, Fd = v.shape[3], fk.shape[3]
    n = min(state.seen, window)
    s = min(sinks, state.seen - n)
    expected = {"S": (B, H, Fd, Dv), "z": (B, H, Fd), "k": (B, n, H, D), "v": (B, n, H, Dv), "fk": (B, n, H, Fd),
                "sink_k": (B, s, H, D), "sink_v": (B, s, H, Dv)}
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
    sinks: int = 0,
) -> tuple[Tensor, HybridState]:
    """Attention of one new position over the state and itself; the inputs of one token.

    Args:
        q, k: [B, 1, H, D] query and key of position ``state.seen``.
        v: [B, 1, H, Dv] its value.
        fq, fk: [B, 1, H, F] its feature-mapped query and key.
        state: the state after the previous positions, or None to start a sequence.
        window, window_factor, linear_factor, scale, eps, sinks: as for :func:`hybrid_attention_naive`.

    Returns:
        ``(out, new_state)``: out [B, 1, H, Dv] in the dtype of ``q``, and the state including this position.
    """
    check_hybrid_inputs(q, k, v, fq, fk, window, window_factor, linear_factor, scale, eps, sinks)
    B, T, H, D = q.shape
    if T != 1:
        raise ValueError(f"hybrid_attention_step takes one position (T=1), got T={T}; "
                         f"use hybrid_attention_chunk or state_from_prefill for several.")  # fmt: skip
    if state is None:
        state = init_state(B, H, D, v.shape[3], fq.shape[3], window=window, dtype=q.dtype, device=q.device,
                           sinks=sinks)
    check_state(state, k, v, fk, window, sinks)
    in_dtype, dt = q.dtype, compute_dtype(q.dtype)
    wf = head_weights(window_factor, H, dt, q.device)  # [H]
    lf = head_weights(linear_factor, H, dt, q.device)  # [H]

    # 1. the new key joins the window cache
    k_win = torch.cat((state.k, k.to(state.k.dtype)), dim=1)  # [B, n + 1, H, D]
    v_win = torch.cat((state.v, v.to(state.v.dtype)), dim=1)  # [B, n + 1, H, Dv]
    fk_new = fk.to(state.fk.dtype) if state.seen >= sinks else torch.zeros_like(fk, dtype=state.fk.dtype)  # sinks: 0
    fk_win = torch.cat((state.fk, fk_new), dim=1)  # [B, n + 1, H, F]
    S, z, sink_k, sink_v = state.S, state.z, state.sink_k, state.sink_v
    # 2. a full cache overflows by one: its oldest key (position t - window) enters F_t, fold it into S, z;
    #    a sink (position < sinks) joins the sink store instead
    if k_win.shape[1] > window:
        if state.seen - window < sinks:
            sink_k, sink_v = torch.cat((sink_k, k_win[:, :1]), dim=1), torch.cat((sink_v, v_win[:, :1]), dim=1)
        else:
            fk_old, v_old = fk_win[:, 0].to(dt), v_win[:, 0].to(dt)  # [B, H, F], [B, H, Dv]
            S = torch.addcmul(S, fk_old[..., :, None], v_old[..., None, :])  # S + fk_old v_old^T, [B, H, F, Dv]
            z = z + fk_old  # [B, H, F]
        k_win, v_win, fk_win = k_win[:, 1:], v_win[:, 1:], fk_win[:, 1:]  # [B, min(n + 1, window), H, *]

    # 3. attend: linear terms from the state, softmax terms over the cache (= W_t); [B, H, 1, *] matrices
    q_t, fq_t = q.to(dt).transpose(1, 2), fq.to(dt).transpose(1, 2)  # [B, H, 1, D], [B, H, 1, F]
    num = torch.matmul(fq_t, S) * lf[:, None, None]  # [B, H, 1, Dv]
    den = torch.matmul(fq_t, z[..., None]) * lf[:, None, None]  # [B, H, 1, 1]
    if window > 0:  # (not in place: gradients flow through the step)
        keys, values = torch.cat((sink_k, k_win), dim=1), torch.cat((sink_v, v_win), dim=1)  # the sinks, then W_t
        logits = torch.matmul(q_t, keys.to(dt).permute(0, 2, 3, 1)) * scale  # [B, H, 1, s + n]
        a = torch.exp(logits - logits.amax(-1, keepdim=True))  # m_t subtracted
        w = wf[:, None, None]
        num = num + torch.matmul(a, values.to(dt).transpose(1, 2)) * w
        den = den + a.sum(-1, keepdim=True) * w
    out = (num / (den + eps))[:, :, 0]  # [B, H, Dv]
    new_state = HybridState(seen=state.seen + 1, window=window, S=S, z=z, k=k_win, v=v_win, fk=fk_win, sinks=sinks,
                            sink_k=sink_k, sink_v=sink_v)
    return out[:, None].to(in_dtype), new_state  # [B, 1, H, Dv]
