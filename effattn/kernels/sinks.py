"""Attention sinks on a sliding window (StreamingLLM, Xiao et al. 2023): a readable reference and the
chunked kernel the model runs.

A query at position i sees the keys j <= i with i - j < W (the window, itself included) and the first
S tokens (the sinks). StreamingLLM's cache holds those S + W tokens and numbers them by their slot in
the cache, not by their position in the text, so relative distances stay within what the model was
trained on however long the stream grows:
  * a window key is at distance i - j (the window is contiguous and ends at the query);
  * a sink j outside the window is at distance min(i, S + W - 1) - j, as if the sinks sat right
    before the window (before the cache is full, positions are the text's own: distance i - j).
RoPE scores depend on distance only, so a query needs two rotations: at i (window keys, rotated at
their own positions) and at min(i, S + W - 1) (the sinks, rotated at theirs, 0..S-1).
"""

from __future__ import annotations

import math

import torch

from effattn.kernels.rope import apply_rope


def _rope_at(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
    """x (B, T, h, D) pre-RoPE rotated at `positions` (T,), HF rotate-half layout (the reference's own tables)."""
    freqs = positions.double()[:, None] * inv_freq.double()[None]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = (emb.cos() * attention_scaling).to(x.dtype), (emb.sin() * attention_scaling).to(x.dtype)
    return apply_rope(x, cos[None, :, None], sin[None, :, None])


def sink_attention_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inv_freq: torch.Tensor, *, window: int,
                         sinks: int, scale: float, attention_scaling: float = 1.0) -> torch.Tensor:
    """The reference: StreamingLLM's cache simulated literally, one query at a time.

    q (B, T, H, D), k and v (B, T, G, D) before RoPE, positions 0..T-1 -> (B, T, H, D). For query i the
    cache holds the sinks and the last `window` tokens (the whole prefix while it fits); each is
    rotated at its slot in that cache, the query at the last slot, and softmax attention runs over it.
    """
    B, T, H, D = q.shape
    G = k.shape[2]
    out = torch.empty_like(q)
    for i in range(T):
        held = list(range(i + 1)) if i < sinks + window else list(range(sinks)) + list(range(i - window + 1, i + 1))
        slots = torch.arange(len(held))
        keys = _rope_at(k[:, held], slots, inv_freq, attention_scaling)  # (B, n, G, D)
        query = _rope_at(q[:, i : i + 1], slots[-1:], inv_freq, attention_scaling)  # (B, 1, H, D)
        keys = keys.repeat_interleave(H // G, dim=2)
        values = v[:, held].repeat_interleave(H // G, dim=2)
        acc = torch.promote_types(q.dtype, torch.float32)
        scores = torch.einsum("bqhd,bkhd->bhqk", query.to(acc), keys.to(acc)) * scale
        out[:, i] = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), values.to(acc))[:, 0].to(q.dtype)
    return out


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, rope,
                   *, window: int | None, sinks: int, scale: float, chunk: int = 1024) -> torch.Tensor:
    """The kernel: queries in chunks, each against the sinks and the keys of its own window only.

    q (B, Tq, H, D) and k, v (B, Tk, G, D) before RoPE, at positions q_pos (Tq,) and k_pos (Tk,),
    ascending (the cache's sinks, its recent keys, then the new ones). `rope(positions)` -> cos, sin
    (n, D): the model's own tables. Every rotation is at a small position (a distance within the chunk,
    its window and the sinks), so a stream millions of tokens long rotates exactly as its first
    thousand did. window None: full causal attention, rotated at the text's positions (a layer that
    keeps full attention). Scores in float32. -> (B, Tq, H, D).
    """
    B, Tq, H, D = q.shape
    G = k.shape[2]
    rep = H // G
    out = q.new_empty(B, Tq, H, D)
    acc = torch.promote_types(q.dtype, torch.float32)  # float32 scores, float64 where the inputs are
    rot = lambda x, pos: apply_rope(x, *(t[None, :, None].to(x.dtype) for t in rope(pos)))
    n_sink = int((k_pos < sinks).sum()) if window is not None else 0
    if n_sink:
        k_sinks = rot(k[:, :n_sink], k_pos[:n_sink])  # at their own positions 0..S-1
    for a in range(0, Tq, chunk):
        qp = q_pos[a : a + chunk]
        lo = 0 if window is None else int(torch.searchsorted(k_pos, qp[0] - window + 1))
        hi = int(torch.searchsorted(k_pos, qp[-1], right=True))
        lo = max(lo, n_sink)  # the sinks come separately (never counted twice)
        base = int(k_pos[lo]) if window is not None and lo < hi else 0
        kp = k_pos[lo:hi]
        kk = rot(k[:, lo:hi], kp - base)
        qq = rot(q[:, a : a + chunk], qp - base)
        vv = v[:, lo:hi]
        rel = qp[:, None] - kp[None]  # (C, n)
        visible = (rel >= 0) & (rel < window) if window is not None else rel >= 0
        if n_sink:  # the sinks: seen at distance min(i, S + W - 1) - j (their own distance within the window)
            sink_rel = qp[:, None] - k_pos[None, :n_sink]
            # a sink inside the query's window is at its text distance i - j; then i < S + W - 1, so
            # rotating the query at min(i, S + W - 1) serves both cases
            q_sinks = rot(q[:, a : a + chunk], torch.clamp(qp, max=sinks + window - 1))
            vv = torch.cat((v[:, :n_sink], vv), 1)
            visible = torch.cat((sink_rel >= 0, visible), 1)
        # grouped: query head h reads KV head h // rep (no repeated copies of the keys)
        group = lambda t: t.reshape(B, t.shape[1], G, rep, D)  # noqa: E731
        scores = torch.einsum("bqgrd,bkgd->bgrqk", group(qq).to(acc), kk.to(acc)) * scale
        if n_sink:
            sink_scores = torch.einsum("bqgrd,bkgd->bgrqk", group(q_sinks).to(acc), k_sinks.to(acc)) * scale
            scores = torch.cat((sink_scores, scores), -1)
        scores = scores.masked_fill(~visible, -math.inf)
        o = torch.einsum("bgrqk,bkgd->bqgrd", scores.softmax(-1), vv.to(acc))
        out[:, a : a + chunk] = o.reshape(B, o.shape[1], H, D).to(out.dtype)
    return out
