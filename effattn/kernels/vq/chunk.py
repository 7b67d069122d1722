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

# Full blocks are batched into steps of about this many queries: one set of tensor ops per step
# amortises PyTorch's per-op overhead, while a step's logits stay small enough to be cache-friendly.
STEP_QUERIES = 128


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


def _pad_front(x: Tensor, size: int, dim: int) -> Tensor:
    """Prepend zeros to ``x`` along ``dim`` up to ``size`` entries."""
    shape = list(x.shape)
    shape[dim] = size - x.shape[dim]
    return torch.cat((x.new_zeros(shape), x), dim=dim)


def _steps(start: int, T: int, L: int) -> list[tuple[int, int]]:
    """Split positions ``start .. start + T - 1`` into steps ``(n_blocks, block_len)`` of aligned blocks.

    A leading partial block (``start`` not a multiple of L) and a trailing one get a step each; full
    blocks are batched ``STEP_QUERIES // L`` at a time.
    """
    head = min(T, -start % L)
    n_full, tail = divmod(T - head, L)
    per_step = max(1, STEP_QUERIES // L)
    steps = [(1, head)] if head else []
    steps += [(min(per_step, n_full - i), L) for i in range(0, n_full, per_step)]
    return steps + [(1, tail)] if tail else steps


def _span_bias(t0: int, n: int, ell: int, window: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive mask (0 or -inf) of the span columns of ``n`` blocks of ``ell`` queries from ``t0``.

    Block j's span holds the keys at positions ``t0 + j*ell - (W-1) + c``, c in [0, S = W-1+ell), and its
    query i sits at column ``W-1+i``, so ``delta = W-1+i-c``. The columns are the S near logits
    (allowed when ``0 <= delta < W``) followed by the far logits of the first ``ell-1`` span keys
    (allowed when ``delta >= W``); keys before the sequence start (zero padding) are masked.
    Returns (n, 1, ell, S + ell - 1), broadcasting over query heads.
    """
    P = window - 1
    delta = P + torch.arange(ell, device=device)[:, None] - torch.arange(P + ell, device=device)  # (ell, S)
    allowed = torch.cat(((delta >= 0) & (delta < window), delta[:, : ell - 1] >= window), dim=1)  # (ell, S+F)
    key_pos = t0 - P + torch.arange(n, device=device)[:, None] * ell + torch.arange(P + ell, device=device)  # (n, S)
    started = torch.cat((key_pos, key_pos[:, : ell - 1]), dim=1) >= 0  # (n, S+F)
    allowed = allowed[None] & started[:, None]  # (n, ell, S+F)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))[:, None]


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
    P = W - 1  # exact keys carried from one block to the next
    scale = D**-0.5 if scale is None else scale
    in_dtype, dt = q.dtype, compute_dtype(q.dtype)
    dev = q.device
    start = state.seen

    codebook = codebook.detach().to(dt)  # (G, C, D)
    far_cos, far_sin = far_cos.to(dt), far_sin.to(dt)
    counts, sums = state.counts, state.sums  # (B, G, C), (B, G, C, Dv)
    sink_k, sink_v = state.sink_k.to(dt), state.sink_v.to(dt)  # (B, G, m, D), (B, G, m, Dv)

    # The last W - 1 keys (rotated, quantized), values and codes, zero-padded before position 0.
    n_recent = state.recent_k.shape[2]
    recent_k = state.recent_k.to(dt)
    recent_rk = apply_rope(recent_k, state.recent_cos.to(dt), state.recent_sin.to(dt))
    recent_kq = _straight_through(recent_k, state.recent_codes, codebook, start - n_recent, sinks)
    buf_rk, buf_kq = _pad_front(recent_rk, P, 2), _pad_front(recent_kq, P, 2)  # (B, G, P, D)
    buf_v, buf_z = _pad_front(state.recent_v.to(dt), P, 2), _pad_front(state.recent_codes, P, 2)

    # split() gives autograd one node per input rather than one slice per step.
    steps = _steps(start, T, L)
    sizes = [n * ell for n, ell in steps]
    chunks = zip(*(x.split(sizes, dim=1) for x in (q, k, v, codes)), cos.split(sizes), sin.split(sizes))

    # Under autograd, writing steps into one output would copy the whole gradient per step, so the
    # steps are concatenated; without it they go straight into the output.
    keep_graph = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    out = None if keep_graph else q.new_empty(B, T, H, Dv)
    pieces = []
    span_biases = {}  # the mask depends on t0 only near the sequence start

    t0 = start
    for (n, ell), (q_s, k_s, v_s, z_s, cos_s, sin_s) in zip(steps, chunks):
        S, F = P + ell, ell - 1  # span keys per block; only the first F of them can be far
        block_starts = t0 + ell * torch.arange(n, device=dev)  # (n,)
        cos_s, sin_s = cos_s.to(dt), sin_s.to(dt)  # (n*ell, D)

        # Queries grouped by key/value head and block: (B, G, n, R, ell, D).
        q_s = q_s.to(dt).view(B, n, ell, G, R, D).permute(0, 3, 1, 4, 2, 5).contiguous()
        q_near = apply_rope(q_s, cos_s.view(n, 1, ell, D), sin_s.view(n, 1, ell, D)) * scale
        q_far = apply_rope(q_s, far_cos, far_sin) * scale  # rotated by the clipped distance W

        # The step's keys behind the W-1 recent ones; block j's span is entries [j*ell, j*ell + S).
        k_s, v_s, z_s = k_s.to(dt).transpose(1, 2), v_s.to(dt).transpose(1, 2), z_s.long().transpose(1, 2)
        all_rk = torch.cat((buf_rk, apply_rope(k_s, cos_s, sin_s)), dim=2)  # (B, G, P + n*ell, D)
        all_kq = torch.cat((buf_kq, _straight_through(k_s, z_s, codebook, t0, sinks)), dim=2)
        all_v = torch.cat((buf_v, v_s), dim=2)  # (B, G, P + n*ell, Dv)
        all_z = torch.cat((buf_z, z_s), dim=2)  # (B, G, P + n*ell)
        span_rk = all_rk.unfold(2, S, ell)  # (B, G, n, D, S)
        span_v = all_v.unfold(2, S, ell).mT  # (B, G, n, S, Dv)
        far_kq = all_kq[:, :, : n * ell].unflatten(2, (n, ell))[:, :, :, :F]  # (B, G, n, F, D)
        far_v = all_v[:, :, : n * ell].unflatten(2, (n, ell))[:, :, :, :F]  # (B, G, n, F, Dv)

        # After block j its first ell span keys leave the span for good: per-code statistics at the
        # start of each block are the running sums over the blocks before it (detached; no sinks).
        out_pos = t0 - P + torch.arange(n * ell, device=dev)  # positions of the keys leaving, in order
        counted = ((out_pos >= 0) & (out_pos >= sinks)).to(dt).view(n, ell)
        out_z = all_z[:, :, : n * ell].unflatten(2, (n, ell))  # (B, G, n, ell)
        out_v = all_v[:, :, : n * ell].detach().unflatten(2, (n, ell)) * counted[..., None]  # (B, G, n, ell, Dv)
        add_counts = counts.new_zeros(B, G, n, C).scatter_add_(3, out_z, counted.expand(B, G, n, ell))
        add_sums = sums.new_zeros(B, G, n, C, Dv).scatter_add_(3, out_z[..., None].expand(-1, -1, -1, -1, Dv), out_v)
        run_counts = torch.cat((counts[:, :, None], add_counts), dim=2).cumsum(2)  # (B, G, n+1, C)
        run_sums = torch.cat((sums[:, :, None], add_sums), dim=2).cumsum(2)  # (B, G, n+1, C, Dv)
        block_counts, counts = run_counts[:, :, :n], run_counts[:, :, n]
        block_means = run_sums[:, :, :n] / block_counts.clamp(min=1.0)[..., None]  # (B, G, n, C, Dv)
        sums = run_sums[:, :, n]

        # Sinks stay exact; block j sees a sink through its own column once it is aggregated.
        n_new = min(n * ell, max(0, sinks - t0))
        sink_k = torch.cat((sink_k, k_s[:, :, :n_new].detach()), dim=2)
        sink_v = torch.cat((sink_v, v_s[:, :, :n_new].detach()), dim=2)
        m = sink_k.shape[2]
        late = torch.arange(m, device=dev) > (block_starts - W)[:, None]  # (n, m) not yet aggregated
        sink_bias = torch.zeros(n, 1, 1, m, dtype=dt, device=dev).masked_fill_(late[:, None, None], float("-inf"))

        # Columns of the W-rotated queries: far span keys, one per code, sinks. One softmax over all.
        far_k = torch.cat(
            (far_kq, codebook[None, :, None].expand(B, G, n, C, D), sink_k[:, :, None].expand(B, G, n, m, D)), dim=3
        )  # (B, G, n, F + C + m, D)
        values = torch.cat(
            (span_v, far_v, block_means, sink_v[:, :, None].expand(B, G, n, m, Dv)), dim=3
        )  # (B, G, n, N, Dv), N = S + F + C + m
        logits = torch.cat(
            (q_near.flatten(3, 4) @ span_rk, q_far.flatten(3, 4) @ far_k.mT), dim=-1
        ).unflatten(3, (R, ell))  # (B, G, n, R, ell, N)
        bias_key = (n, ell, min(t0, P))
        if bias_key not in span_biases:
            span_biases[bias_key] = _span_bias(t0, n, ell, W, dt, dev)
        logits[..., : S + F] += span_biases[bias_key]  # (n, 1, ell, S + F): causal, near / far
        logits[..., S + F : S + F + C] += block_counts.log()[:, :, :, None, None, :]  # empty codes: -inf
        logits[..., S + F + C :] += sink_bias
        probs = torch.softmax(logits, dim=-1)
        o = (probs.flatten(3, 4) @ values).unflatten(3, (R, ell))  # (B, G, n, R, ell, Dv)
        o = o.permute(0, 2, 4, 1, 3, 5).reshape(B, n * ell, H, Dv)
        if keep_graph:
            pieces.append(o)
        else:
            out[:, t0 - start : t0 - start + n * ell] = o

        buf_rk, buf_kq, buf_v, buf_z = (x[:, :, n * ell :] for x in (all_rk, all_kq, all_v, all_z))
        t0 += n * ell

    out = torch.cat(pieces, dim=1).to(in_dtype) if keep_graph else out
    if not return_state:
        return out

    # The new state keeps the pre-RoPE inputs of the last W - 1 positions (exact, in their dtype).
    n_recent = min(start + T, P)

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
