"""Transformer-VQ attention with ReRoPE: the blockwise, linear-time kernel.

Same semantics as ``naive.py`` (read its docstring first). Queries are processed in blocks of
``L = block_size`` positions aligned to absolute multiples of L. For a block starting at ``t0`` the
keys split into

* the *span* ``[t0 - W + 1, t1)``: the W - 1 keys carried from earlier blocks plus the block's own.
  Every near pair of the block lies here, and so do the block's far pairs with keys younger than
  ``t0 - W + 1`` (at most the first ``L - 1`` span keys); they get per-pair logits with full gradients;
* the *aggregated* keys ``s <= t0 - W``, far for the whole block. Their logit
  ``<rope(q_t, W), codebook[z_s]>`` depends on s only through its code, so they enter the softmax as
  one column per code, weighted by the number of keys with that code (``counts``; added as a
  ``log(count)`` bias) and carrying the mean of their values (``sums / counts``). Sinks are kept
  exact in their own columns.

All columns share one softmax, so the block costs ``O(L * (W + L + C + sinks))`` whatever its
position: time is linear in T and the working memory is flat. After the block, the keys that leave
the span are scatter-added (detached) into the per-code statistics.

The recurrence state is a :class:`VQState`; passing it back in continues the sequence, so any
chunking of a sequence (down to one token per call) reproduces the output of a single call.
"""

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from effattn.kernels.rope import apply_rope
from effattn.kernels.vq.naive import check_vq_inputs, compute_dtype


@dataclass
class VQState:
    """Everything needed to continue a sequence; its size does not grow past ``window`` + ``sinks``.

    With ``n = min(seen, window - 1)`` recent and ``m = min(seen, sinks)`` sink positions:

    Attributes:
        seen: number of positions processed so far (absolute position of the next one).
        window, sinks: the settings the state was built with.
        recent_k: (B, G, n, D) pre-RoPE keys of positions ``seen - n .. seen - 1``.
        recent_v: (B, G, n, Dv) their values.
        recent_codes: (B, G, n) their codes.
        recent_cos, recent_sin: (n, D) RoPE table rows of those positions.
        sink_k: (B, G, m, D) pre-RoPE keys of positions ``0 .. m - 1``.
        sink_v: (B, G, m, Dv) their values.
        counts: (B, G, C) number of non-sink keys older than the recent ones, per code (float, exact
            up to 2**24 keys in float32).
        sums: (B, G, C, Dv) sum of their values, per code.

    All tensors are detached: gradients never cross calls (truncated backpropagation).
    """

    seen: int
    window: int
    sinks: int
    recent_k: Tensor
    recent_v: Tensor
    recent_codes: Tensor
    recent_cos: Tensor
    recent_sin: Tensor
    sink_k: Tensor
    sink_v: Tensor
    counts: Tensor
    sums: Tensor

    def nbytes(self) -> int:
        """Total size of the state's tensors in bytes."""
        return sum(
            x.numel() * x.element_size() for x in (getattr(self, f.name) for f in fields(self)) if isinstance(x, Tensor)
        )


def _empty_state(q: Tensor, k: Tensor, v: Tensor, codebook: Tensor, cos: Tensor, window: int, sinks: int) -> VQState:
    B, _, G, D = k.shape
    Dv, C = v.shape[3], codebook.shape[1]
    stats_dtype = compute_dtype(q.dtype)
    return VQState(
        seen=0,
        window=window,
        sinks=sinks,
        recent_k=k.new_zeros(B, G, 0, D),
        recent_v=v.new_zeros(B, G, 0, Dv),
        recent_codes=torch.zeros(B, G, 0, dtype=torch.int64, device=k.device),
        recent_cos=cos.new_zeros(0, D),
        recent_sin=cos.new_zeros(0, D),
        sink_k=k.new_zeros(B, G, 0, D),
        sink_v=v.new_zeros(B, G, 0, Dv),
        counts=torch.zeros(B, G, C, dtype=stats_dtype, device=k.device),
        sums=torch.zeros(B, G, C, Dv, dtype=stats_dtype, device=k.device),
    )


def _check_state(state: VQState, k: Tensor, v: Tensor, codebook: Tensor, window: int, sinks: int) -> None:
    if state.window != window or state.sinks != sinks:
        raise ValueError(
            f"The state was built with window={state.window}, sinks={state.sinks} but this call uses "
            f"window={window}, sinks={sinks}; continue a sequence with the settings that started it."
        )
    B, _, G, D = k.shape
    expected = {"counts": (B, G, codebook.shape[1]), "sums": (B, G, codebook.shape[1], v.shape[3])}
    expected["recent_k"] = (B, G, min(state.seen, window - 1), D)
    for name, shape in expected.items():
        if tuple(getattr(state, name).shape) != shape:
            raise ValueError(
                f"state.{name} has shape {tuple(getattr(state, name).shape)} but these inputs need {shape}; "
                f"pass the state returned for this sequence, batch and codebook."
            )


def _straight_through(k: Tensor, codes: Tensor, codebook: Tensor, first_position: int, sinks: int) -> Tensor:
    """Quantized keys ``k + (c_z - k).detach()``; keys at absolute positions < sinks stay exact.

    k: (B, G, n, D) for positions ``first_position ..``, codes: (B, G, n), codebook: (G, C, D) detached.
    """
    G = codebook.shape[0]
    codewords = codebook[torch.arange(G, device=k.device)[None, :, None], codes]  # (B, G, n, D)
    k_hat = k + (codewords - k).detach()
    n_sink = min(k.shape[2], max(0, sinks - first_position))
    if n_sink:
        k_hat = torch.cat((k[:, :, :n_sink], k_hat[:, :, n_sink:]), dim=2)
    return k_hat


def _last(x: Tensor, n: int, dim: int) -> Tensor:
    """The last ``min(n, size)`` entries of ``x`` along ``dim``."""
    size = x.shape[dim]
    return x.narrow(dim, size - min(n, size), min(n, size))


def _span_bias(n_queries: int, n_recent: int, window: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive mask (0 or -inf) of a block's span columns: near logits first, then far ones.

    Query i of the block sits at span index ``n_recent + i``; span key j is near when
    ``0 <= n_recent + i - j < W`` and far when the distance is >= W, which only the first
    ``n_far = n_queries + n_recent - W`` span keys can be.
    Returns (n_queries, n_recent + n_queries + n_far).
    """
    delta = (torch.arange(n_queries, device=device)[:, None] + n_recent) - torch.arange(
        n_recent + n_queries, device=device
    )  # (ell, S)
    n_far = max(0, n_queries + n_recent - window)
    allowed = torch.cat(((delta >= 0) & (delta < window), delta[:, :n_far] >= window), dim=1)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


def vq_attention_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    codebook: Tensor,
    codes: Tensor,
    cos: Tensor,
    sin: Tensor,
    far_cos: Tensor,
    far_sin: Tensor,
    *,
    window: int,
    block_size: int,
    sinks: int = 0,
    scale: float | None = None,
    state: VQState | None = None,
    return_state: bool = False,
) -> Tensor | tuple[Tensor, VQState]:
    """Blockwise linear-time Transformer-VQ attention with ReRoPE; same maths as ``vq_attention_naive``.

    Args:
        q: (B, T, H, D) pre-RoPE queries.
        k: (B, T, G, D) pre-RoPE keys, ``H % G == 0``; query head h reads key/value head ``h // (H // G)``.
        v: (B, T, G, Dv) values.
        codebook: (G, C, D) one codebook per key/value head, in pre-RoPE key space (gets no gradient).
        codes: (B, T, G) integer code of every key.
        cos, sin: (T, D) RoPE tables at this chunk's absolute positions (``state.seen ..``).
        far_cos, far_sin: (D,) RoPE table at relative position ``window``.
        window: W >= 1, keys with ``t - s < W`` are exact.
        block_size: L >= 1, queries per block (blocks are aligned to absolute multiples of L).
        sinks: the first ``sinks`` positions of the sequence are never quantized.
        scale: logit scale, default ``D ** -0.5``.
        state: the state returned by the previous call of this sequence, or None to start one.
        return_state: also return the state after this chunk.

    Returns:
        (B, T, H, Dv) output in the dtype of ``q``, and the new :class:`VQState` if ``return_state``.
    """
    check_vq_inputs(q, k, v, codebook, codes, cos, sin, far_cos, far_sin, window, block_size, sinks)
    if state is None:
        state = _empty_state(q, k, v, codebook, cos, window, sinks)
    else:
        _check_state(state, k, v, codebook, window, sinks)
    B, T, H, D = q.shape
    G, Dv, C = k.shape[2], v.shape[3], codebook.shape[1]
    R = H // G  # query heads per key/value head
    W, L = window, block_size
    scale = D**-0.5 if scale is None else scale
    in_dtype, dt = q.dtype, compute_dtype(q.dtype)
    start = state.seen

    codebook = codebook.detach().to(dt)  # (G, C, D)
    far_cos, far_sin = far_cos.to(dt), far_sin.to(dt)
    counts, sums = state.counts.clone(), state.sums.clone()  # updated in place block by block
    sink_k, sink_v = state.sink_k.to(dt), state.sink_v.to(dt)  # (B, G, m, D), (B, G, m, Dv)

    # The span carried between blocks: the last W - 1 keys, rotated and quantized once.
    n_recent = state.recent_k.shape[2]
    recent_k = state.recent_k.to(dt)
    span_rk = apply_rope(recent_k, state.recent_cos.to(dt), state.recent_sin.to(dt))  # (B, G, n, D)
    span_kq = _straight_through(recent_k, state.recent_codes, codebook, start - n_recent, sinks)
    span_v, span_z = state.recent_v.to(dt), state.recent_codes  # (B, G, n, Dv), (B, G, n)

    # Blocks end at absolute multiples of L; split() gives autograd one node per input, not one per block.
    ends = list(range((start // L + 1) * L, start + T, L)) + [start + T]
    sizes = [e - s for s, e in zip([start] + ends[:-1], ends)]
    blocks = zip(*(x.split(sizes, dim=1) for x in (q, k, v, codes)), cos.split(sizes), sin.split(sizes))

    # Under autograd, writing blocks into one output would copy the whole gradient per block, so
    # the blocks are concatenated; without it they go straight into the output.
    keep_graph = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    out = None if keep_graph else q.new_empty(B, T, H, Dv)
    pieces = []
    span_biases = {}  # the mask depends only on (block length, recent keys), so most blocks share one

    t0 = start
    for q_blk, k_blk, v_blk, z_blk, cos_blk, sin_blk in blocks:
        ell = q_blk.shape[1]
        cos_blk, sin_blk = cos_blk.to(dt), sin_blk.to(dt)  # (ell, D)
        q_blk = q_blk.to(dt).unflatten(2, (G, R)).permute(0, 2, 3, 1, 4).contiguous()  # (B, G, R, ell, D)
        q_near = apply_rope(q_blk, cos_blk, sin_blk) * scale
        q_far = apply_rope(q_blk, far_cos, far_sin) * scale  # rotated by the clipped distance W
        k_blk = k_blk.to(dt).transpose(1, 2)  # (B, G, ell, D)
        z_blk = z_blk.long().transpose(1, 2)  # (B, G, ell)
        span_rk = torch.cat((span_rk, apply_rope(k_blk, cos_blk, sin_blk)), dim=2)  # (B, G, S, D)
        span_kq = torch.cat((span_kq, _straight_through(k_blk, z_blk, codebook, t0, sinks)), dim=2)
        v_blk = v_blk.to(dt).transpose(1, 2)  # (B, G, ell, Dv)
        span_v = torch.cat((span_v, v_blk), dim=2)  # (B, G, S, Dv)
        span_z = torch.cat((span_z, z_blk), dim=2)  # (B, G, S)
        S = n_recent + ell
        n_far = max(0, S - W)  # span keys that are far for at least one query of the block
        n_sink = max(0, min(sinks, t0 - W + 1))  # sinks far for the whole block (aggregated)

        # Columns seen by the W-rotated queries: far span keys, one summary per code, aggregated sinks.
        means = sums / counts.clamp(min=1.0)[..., None]  # (B, G, C, Dv)
        far_k = torch.cat((span_kq[:, :, :n_far], codebook.expand(B, G, C, D), sink_k[:, :, :n_sink]), dim=2)
        values = torch.cat((span_v, span_v[:, :, :n_far], means, sink_v[:, :, :n_sink]), dim=2)  # (B, G, N, Dv)

        logits = torch.cat(
            (q_near.flatten(2, 3) @ span_rk.mT, q_far.flatten(2, 3) @ far_k.mT), dim=-1
        ).unflatten(2, (R, ell))  # (B, G, R, ell, N), N = S + n_far + C + n_sink
        if (ell, n_recent) not in span_biases:
            span_biases[ell, n_recent] = _span_bias(ell, n_recent, W, dt, q.device)
        logits[..., : S + n_far] += span_biases[ell, n_recent]  # causal, near / far split
        logits[..., S + n_far : S + n_far + C] += counts.log()[:, :, None, None, :]  # empty codes -> -inf
        probs = torch.softmax(logits, dim=-1)
        o = (probs.flatten(2, 3) @ values).unflatten(2, (R, ell))  # (B, G, R, ell, Dv)
        o = o.permute(0, 3, 1, 2, 4).flatten(2, 3)  # (B, ell, H, Dv)
        if keep_graph:
            pieces.append(o)
        else:
            out[:, t0 - start : t0 - start + ell] = o

        # Keys older than the next block's span leave it: fold them (detached) into the statistics.
        n_leave = max(0, S - (W - 1))
        first_counted = min(n_leave, max(0, sinks - (t0 - n_recent)))  # sinks are never counted
        z_out = span_z[:, :, first_counted:n_leave]  # (B, G, n_out)
        counts.scatter_add_(2, z_out, torch.ones_like(z_out, dtype=counts.dtype))
        sums.scatter_add_(2, z_out[..., None].expand(-1, -1, -1, Dv), span_v[:, :, first_counted:n_leave].detach())
        span_rk, span_kq, span_v, span_z = (x[:, :, n_leave:] for x in (span_rk, span_kq, span_v, span_z))
        if t0 < sinks:  # the block holds sink positions: keep them exact for later blocks
            n_new = min(ell, sinks - t0)
            sink_k = torch.cat((sink_k, k_blk[:, :, :n_new].detach()), dim=2)
            sink_v = torch.cat((sink_v, v_blk[:, :, :n_new].detach()), dim=2)
        n_recent = S - n_leave
        t0 += ell

    out = torch.cat(pieces, dim=1).to(in_dtype) if keep_graph else out
    if not return_state:
        return out

    # The new state keeps the pre-RoPE inputs of the last W - 1 positions (exact, in their dtype).
    def recent(previous: Tensor, current: Tensor, dim: int) -> Tensor:
        return _last(torch.cat((_last(previous, n_recent, dim), _last(current, n_recent, dim)), dim=dim), n_recent, dim)

    new_state = VQState(
        seen=start + T,
        window=W,
        sinks=sinks,
        recent_k=recent(state.recent_k, k.detach().transpose(1, 2), dim=2),
        recent_v=recent(state.recent_v, v.detach().transpose(1, 2), dim=2),
        recent_codes=recent(state.recent_codes, codes.long().transpose(1, 2), dim=2),
        recent_cos=recent(state.recent_cos, cos, dim=0),
        recent_sin=recent(state.recent_sin, sin, dim=0),
        sink_k=sink_k.to(k.dtype),
        sink_v=sink_v.to(v.dtype),
        counts=counts,
        sums=sums,
    )
    return out, new_state
