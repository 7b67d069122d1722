"""Hybrid sliding-window softmax + linear attention: the chunked kernel, linear in T.

Same semantics as ``naive.py`` (read its docstring first); the two terms of the shared numerator
and denominator are computed separately, then combined with the per-head factors.

Far (linear) part. Key s enters the far set of every query ``t >= s + window``. Delaying the keys and
values by ``window`` positions (``fk'_u = fk_{u - window}``, zero for ``u < window``) turns it into
plain causal linear attention of ``fq`` over ``(fk', v')``, computed chunk by chunk as in
fla-org/flash-linear-attention's ``chunk`` kernels: with chunks of C positions,

    sum_{u <= t} (fq_t . fk'_u) v'_u = fq_t^T S_n  +  sum_{u in chunk n, u <= t} (fq_t . fk'_u) v'_u,

where ``S_n = sum_{u < nC} fk'_u v'_u^T`` ([F, Dv] per head) is the state entering chunk n (an
exclusive prefix sum of per-chunk ``fk'^T v'``), and the second term is a [C, C] causally masked
product inside the chunk. The denominator uses ``z_n = sum_{u < nC} fk'_u`` the same way.

Window (softmax) part. It is banded: query t reads keys ``t - w + 1 .. t`` with
``w = min(window, T)`` (a window reaching past the sequence start is the whole prefix). A block of C
queries starting at ``t0`` therefore reads the span of ``C + w - 1`` keys starting at
``t0 - w + 1``; ``unfold`` gives every block its span (a strided view of the front-padded keys),
and one masked softmax numerator per block follows.

Sinks (``sinks = S``). The feature keys of positions below S are zeroed (in the segment holding them), so no sink ever
reaches S or z, and the sinks that have left a query's window join its softmax: a [T, S] product of
the queries with the first S keys, masked where the sink is still in the window (there it already
counts), under the same ``m_t`` as the window's logits.

Long sequences go in segments of ``segment_size`` positions, each continuing the state the one
before leaves (``recurrent.HybridState``: the window's keys, values and feature keys plus S, z), so
the working memory is one segment's, flat in T; a call can also continue a given state (a chunked
prefill after a cached prefix) and return the state after its positions.

Without autograd, for windows of 16-256 positions (``FAST_WINDOWS``), ``_fast_segment`` computes the
same in blocks of exactly ``window`` positions: a block's window then lies in itself and the block
before (one [C, 2C] product with an overlapping strided view of the keys, no span copies), the far
keys in the block before are the complementary triangle, and S is carried by a scan over the blocks
instead of being stored per block (one layer at 32K: 0.66-0.86 s against 0.90-1.02 s, BENCHMARKS).
``EFFATTN_LINEAR_FAST=0`` turns it off.

``hybrid_attention_parts`` returns the four sums (window and far, numerator and denominator) before the
per-head factors weigh them (naive.py's ``combine_parts`` weighs them): fitting only the factors needs them once.
Without autograd the far part carries S by a scan over the chunks rather than storing it per chunk.

Cost: ``O(T * (C * (D + Dv) + w * (D + Dv) + F * Dv))`` time and, per segment of G positions,
``O(G * (C + w + F * Dv / C))`` memory. Plain PyTorch ops: autograd gives the backward pass.
"""

import os

import torch
from torch import Tensor

from effattn.kernels.linear.naive import HybridParts, check_hybrid_inputs, compute_dtype, head_weights
from effattn.kernels.linear.recurrent import HybridState, check_state, init_state


def _rows(x: Tensor, *parts) -> Tensor:
    """Concatenate along time (dim 1) the pieces given: tensors [BH, n, E], or ints (that many zero rows)."""
    rows = [x.new_zeros(x.shape[0], p, x.shape[2]) if isinstance(p, int) else p for p in parts]
    rows = [r for r in rows if r.shape[1]]
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)  # one piece: no copy


def _window_part(q: Tensor, k: Tensor, v: Tensor, k_prev: Tensor, v_prev: Tensor, w: int, scale: float, C: int,
                 grad: bool, sinks: tuple | None = None) -> tuple[Tensor, Tensor]:
    """Banded softmax numerator and denominator, ``sum_{W_t} exp(scale q_t.k_s - m_t) (v_s, 1)``, of the
    T queries after the n positions of ``k_prev`` / ``v_prev`` (the window kept from before).

    ``sinks`` = (sink_k [BH, s, D], sink_v [BH, s, Dv], first, window): the keys and values of positions
    0 .. s - 1, ``first`` the position of k_prev's first row; a sink joins the softmax of the queries whose
    window it has left (position <= t - window), under the same m_t.

    Head-major: q, k: [BH, T, D], v: [BH, T, Dv], k_prev/v_prev: [BH, n, *]; 1 <= w <= n + T, C >= 1.
    The n + T positions are cut into blocks of C queries (the n leading ones are zeros, their rows
    dropped); block b reads the span of C + w - 1 keys ending with its last query. Returns
    ([BH, T, Dv], [BH, T]).
    """
    BH, T, D = q.shape
    Dv, n = v.shape[2], k_prev.shape[1]
    L = n + T
    N = -(-L // C)  # query blocks
    P = w - 1  # keys a block reads before its first query
    S = C + P  # span length
    end = N * C - L  # rows that complete the last block

    q_blocks = _rows(q, n, q, end).reshape(BH, N, C, D)  # [BH, N, C, D]
    # span of block b: padded rows bC .. bC + S - 1, i.e. true positions bC - P .. bC + C - 1
    k_span = _rows(k, P, k_prev, k, end).unfold(1, S, C)  # [BH, N, D, S]
    v_span = _rows(v, P, v_prev, v, end).unfold(1, S, C).transpose(2, 3)  # [BH, N, S, Dv]
    # query i of block b sits at t = bC + i, span column j at s = bC - P + j: t - s = i + P - j,
    # which lies in [0, w) for j in [i, i + P]; columns before the sequence start are padding
    i = torch.arange(C, device=q.device)[:, None]
    j = torch.arange(S, device=q.device)[None, :]
    band = (j >= i) & (j <= i + P)  # [C, S]
    started = torch.arange(N, device=q.device)[:, None] * C - P + j >= 0  # [N, S]
    bias = torch.zeros(N, C, S, dtype=q.dtype, device=q.device).masked_fill_(~(band[None] & started[:, None]),
                                                                            float("-inf"))  # [N, C, S]
    logits = torch.matmul(q_blocks, k_span)  # [BH, N, C, S]
    if sinks is not None:
        sink_k, sink_v, first, window = sinks
        t = first + torch.arange(N * C, device=q.device).view(N, C, 1)  # the rows' positions
        left = torch.arange(sink_k.shape[1], device=q.device) <= t - window  # [N, C, s]: out of the window
        sink_bias = torch.zeros(left.shape, dtype=q.dtype, device=q.device).masked_fill_(~left, float("-inf"))
        sink_logits = torch.matmul(q_blocks, sink_k.transpose(1, 2)[:, None]) * scale + sink_bias  # [BH, N, C, s]
    if grad:
        logits = logits * scale + bias
        m = logits.amax(-1, keepdim=True)  # m_t over the window (column i + P is t itself)
        if sinks is not None:
            m = torch.maximum(m, sink_logits.amax(-1, keepdim=True))  # and the sinks
        a = torch.exp(logits - m)
    else:  # in place: no autograd to keep the intermediates for
        logits.mul_(scale).add_(bias)
        m = logits.amax(-1, keepdim=True)
        if sinks is not None:
            m = torch.maximum(m, sink_logits.amax(-1, keepdim=True))
        a = logits.sub_(m).exp_()
    num = torch.matmul(a, v_span)  # [BH, N, C, Dv]
    den = a.sum(-1)  # [BH, N, C]
    if sinks is not None:
        a_sink = torch.exp(sink_logits - m)  # [BH, N, C, s]
        num = num + torch.matmul(a_sink, sink_v[:, None])
        den = den + a_sink.sum(-1)
    return num.reshape(BH, N * C, Dv)[:, n:L], den.reshape(BH, N * C)[:, n:L]  # [BH, T, Dv], [BH, T]


def _delayed(fk: Tensor, v: Tensor, fk_prev: Tensor, v_prev: Tensor, lag: int, end: int = 0) -> tuple[Tensor, Tensor]:
    """Rows 0 .. T-1 of [lag zeros, the kept window, this call's keys] (and values), then `end` zero rows:
    row u holds the key that leaves the window at query u, exactly the keys that leave it by the last
    query (no later one may reach S). [BH, T + end, F], [BH, T + end, Dv]."""
    T, n = fk.shape[1], fk_prev.shape[1]
    zeros, old, new = min(lag, T), min(max(T - lag, 0), n), max(T - lag - n, 0)
    return (_rows(fk, zeros, fk_prev[:, :old], fk[:, :new], end),
            _rows(v, zeros, v_prev[:, :old], v[:, :new], end))  # fmt: skip


def _far_part(fq: Tensor, fk: Tensor, v: Tensor, fk_prev: Tensor, v_prev: Tensor, lag: int, C: int, S0: Tensor,
              z0: Tensor, grad: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Linear numerator and denominator of the T queries, on top of an incoming state.

    Head-major: fq [BH, T, F], fk [BH, T, F], v [BH, T, Dv]; fk_prev/v_prev [BH, n, *]: the window kept
    from before, positions ``seen - n .. seen - 1``. Query row u reads the keys older than the window,
    whose newest is position ``seen + u - window``: the rows of ``[lag zeros, fk_prev, fk]`` (lag =
    window - n > 0 only while the sequence is shorter than the window) delayed so that row u holds it.
    S0 [BH, F, Dv], z0 [BH, F]: the sums over every key before. Returns (num [BH, T, Dv], den [BH, T],
    S, z): S and z then include every key that left the window by the last query. Without ``grad`` the
    states are carried by a scan over the chunks (in place) instead of stored per chunk: the same sums,
    without the [BH, N, F, Dv] tensors a large F makes large.
    """
    BH, T, Fd = fq.shape
    Dv = v.shape[2]
    N = -(-T // C)
    end = N * C - T
    fq_c = _rows(fq, fq, end).reshape(BH, N, C, Fd)  # [BH, N, C, F]
    fk_d, v_d = _delayed(fk, v, fk_prev, v_prev, lag, end)
    fk_c, v_c = fk_d.reshape(BH, N, C, Fd), v_d.reshape(BH, N, C, Dv)  # [BH, N, C, *], delayed
    if not grad:
        A = torch.matmul(fq_c, fk_c.transpose(2, 3)).tril_()  # [BH, N, C, C], row t, column u
        num, den = torch.matmul(A, v_c), A.sum(-1)  # [BH, N, C, Dv], [BH, N, C]: the chunks' own terms
        S = torch.cat((S0, z0[..., None]), dim=-1)  # [BH, F, Dv + 1]: the normaliser as a last column
        for b in range(N):  # S before chunk b, then chunk b's keys into it
            inter = torch.bmm(fq_c[:, b], S)  # [BH, C, Dv + 1]
            num[:, b] += inter[..., :Dv]
            den[:, b] += inter[..., Dv]
            S[..., :Dv].baddbmm_(fk_c[:, b].transpose(1, 2), v_c[:, b])
            S[..., Dv] += fk_c[:, b].sum(1)
        return num.view(BH, N * C, Dv)[:, :T], den.view(BH, N * C)[:, :T], S[..., :Dv].contiguous(), S[..., Dv].contiguous()

    # inter-chunk: S_b = S0 + the sum of fk'^T v' over the chunks before b (exclusive prefix sum), z_b likewise
    S_incl = torch.matmul(fk_c.transpose(2, 3), v_c).cumsum(1) + S0[:, None]  # [BH, N, F, Dv], through chunk b
    S = torch.cat((S0[:, None], S_incl[:, :-1]), dim=1)  # [BH, N, F, Dv], before chunk b
    z_incl = fk_c.sum(2).cumsum(1) + z0[:, None]  # [BH, N, F]
    z = torch.cat((z0[:, None], z_incl[:, :-1]), dim=1)  # [BH, N, F]
    # intra-chunk: (fq_t . fk'_u) for u <= t inside the chunk
    A = torch.matmul(fq_c, fk_c.transpose(2, 3)).tril()  # [BH, N, C, C], row t, column u
    num = torch.matmul(fq_c, S) + torch.matmul(A, v_c)  # [BH, N, C, Dv]
    den = torch.matmul(fq_c, z[..., None])[..., 0] + A.sum(-1)  # [BH, N, C]
    return num.view(BH, N * C, Dv)[:, :T], den.view(BH, N * C)[:, :T], S_incl[:, -1], z_incl[:, -1]


def fla_kernel(device: torch.device):
    """flash-linear-attention's chunked linear attention (``fla.ops.linear_attn.chunk_linear_attn``) where
    the far part should run through it: on CUDA, with fla-core installed (``pip install effattn[fla]``)
    and ``EFFATTN_FLA`` not 0; None elsewhere (the PyTorch far part runs)."""
    if torch.device(device).type != "cuda" or os.environ.get("EFFATTN_FLA", "1") == "0":
        return None
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except ImportError:
        return None
    return chunk_linear_attn


def _far_part_fla(kernel, fq: Tensor, fk: Tensor, v: Tensor, fk_prev: Tensor, v_prev: Tensor, lag: int, S0: Tensor,
                  z0: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`_far_part` through flash-linear-attention: the same delayed keys and values, the values with a
    column of ones (the normaliser: [num, den] from one unnormalised call), the state [S, z] as fla's
    initial and final state. `kernel` has the signature of ``fla.ops.linear_attn.chunk_linear_attn``
    (its ``fused_recurrent_linear_attn`` computes the same, and runs in Triton's CPU interpreter)."""
    Dv = v.shape[2]
    fk_d, v_d = _delayed(fk, v, fk_prev, v_prev, lag)  # [BH, T, F], [BH, T, Dv]
    v1 = torch.cat((v_d, torch.ones_like(v_d[..., :1])), dim=-1)  # [BH, T, Dv + 1]

    def fla_layout(x: Tensor) -> Tensor:  # [BH, T, E] -> [1, T, BH, E]: the B * H heads as fla's heads
        return x.transpose(0, 1)[None].contiguous()

    state = torch.cat((S0, z0[..., None]), dim=-1)[None].contiguous()  # [1, BH, F, Dv + 1]
    out, state = kernel(fla_layout(fq), fla_layout(fk_d), fla_layout(v1), scale=1.0, initial_state=state,
                        output_final_state=True, normalize=False)  # fmt: skip
    out = out[0].transpose(0, 1)  # [BH, T, Dv + 1]
    return out[..., :Dv], out[..., Dv], state[0, ..., :Dv], state[0, ..., Dv]


def _with_sinks(state: tuple, k: Tensor, v: Tensor, T: int, sinks: int, window: int) -> tuple:
    """``state`` (head-major, as `_segment` takes it) with its sink store extended to every sink that leaves
    the window by the last of the next T positions, whose first keys and values are ``k``, ``v`` (head-major,
    [BH, r, *], r >= min(sinks, T)): positions 0 .. min(sinks, seen + T - window) - 1. They come from the store, then the kept window,
    then these positions (they follow on: the store is short only while its next position is the kept
    window's first). A segment's queries read the extended store (each only the sinks out of its window), and
    it is the store of the state after them."""
    seen, k_prev, v_prev, fk_prev, S, z, sink_k, sink_v = state
    n, have = k_prev.shape[1], sink_k.shape[1]
    more = min(sinks, max(seen + T - window, 0)) - have
    if more <= 0:
        return state
    r = max(more - n, 0)
    return (seen, k_prev, v_prev, fk_prev, S, z, _rows(k, sink_k, k_prev[:, :more], k[:, :r]),
            _rows(v, sink_v, v_prev[:, :more], v[:, :r]))


def _segment(q: Tensor, k: Tensor, v: Tensor, fq: Tensor, fk: Tensor, state: tuple, *, window: int, wf: Tensor | None,
             lf: Tensor | None, scale: float, eps: float, C: int, grad: bool, fla=None) -> tuple[Tensor | tuple, tuple]:
    """The T positions after ``state`` (head-major inputs in the compute dtype; state = (seen, k, v, fk, S, z,
    sink_k, sink_v), head-major): (out [BH, T, Dv], the state after them). ``fla``: ``fla_kernel``'s answer for
    the device. The feature keys of sink positions come zeroed and the sink store extended (`_with_sinks`).
    With ``wf`` and ``lf`` None, the four sums (window num [BH, T, Dv], den [BH, T], far num, den) instead of out."""
    seen, k_prev, v_prev, fk_prev, S, z, sink_k, sink_v = state
    T, n = q.shape[1], k_prev.shape[1]
    L = n + T
    win_num = win_den = far_num = far_den = None  # a part that does not arise here is zeros (made below)
    if window > 0:
        with_sinks = (sink_k, sink_v, seen - n, window) if sink_k.shape[1] else None
        win_num, win_den = _window_part(q, k, v, k_prev, v_prev, min(window, L), scale, min(C, L), grad, with_sinks)
    if seen + T > window:  # some key leaves the window in this segment (or already has)
        if fla is not None:  # CUDA: flash-linear-attention's chunked kernel
            far_num, far_den, S, z = _far_part_fla(fla, fq, fk, v, fk_prev, v_prev, window - n, S, z)
        else:
            far_num, far_den, S, z = _far_part(fq, fk, v, fk_prev, v_prev, window - n, min(C, T), S, z, grad)
    keep = min(window, L)  # the window keeps the last `keep` positions: of this call's, and the kept ones before
    kept = tuple(new[:, T - keep:] if keep <= T else _rows(new, prev[:, n - (keep - T):], new)
                 for prev, new in ((k_prev, k), (v_prev, v), (fk_prev, fk)))
    after = (seen + T, *kept, S, z, sink_k, sink_v)
    if win_num is None or far_num is None:
        zeros = q.new_zeros(*v.shape), q.new_zeros(v.shape[:2])
        win_num, win_den = (win_num, win_den) if win_num is not None else zeros
        far_num, far_den = (far_num, far_den) if far_num is not None else zeros
    if wf is None:
        return (win_num, win_den, far_num, far_den), after
    num = wf[:, :, None] * win_num + lf[:, :, None] * far_num
    den = wf * win_den + lf * far_den
    return num / (den + eps)[..., None], after


# positions per segment: the working memory of a long sequence stays that of one segment
SEGMENT_SIZE = 4096

# Without autograd and with a window of FAST_WINDOWS, `hybrid_attention_chunk` runs `_fast_segment`;
# EFFATTN_LINEAR_FAST=0 keeps the general path (same results within rounding; tests compare them).
FAST_WINDOWS = range(16, 257)


def _fast_segment(q: Tensor, k: Tensor, v: Tensor, fq: Tensor, fk: Tensor, state: tuple, *, window: int,
                  wf: Tensor, lf: Tensor, scale: float, eps: float, dt: torch.dtype) -> tuple[Tensor, tuple]:
    """`_segment` without autograd, in blocks of C = window positions, with fewer passes over memory.

    Inputs batch-major [B, T, H, *] (any dtype); state head-major as in `_segment`. The rows are laid
    out as `ext`: C rows before the segment (the kept window, front-padded with zeros while shorter),
    then the segment's T rows (end-padded to whole blocks); query block b is ext block b + 1.

    Window: query i of block b reads ext rows bC + j' for i < j' <= C + i (its own block up to itself
    and the later part of the block before), so each block's logits are one [C, 2C] product with a
    span of 2C rows, an overlapping strided view (no copy), and one band mask.
    Far: the earlier part of the block before (j <= i: `window` back or more), one [C, C] product, plus
    every older block through S, kept by a scan over the blocks: S ([F, Dv + 1] per head; the values
    carry a column of ones for the normaliser) instead of a state per block. The window's and the
    in-block terms run one head (all its blocks) at a time; the scan runs all heads at once.
    Sinks that have left a query's window add columns to its softmax (one [C, s] product per block).
    """
    B, T, H, D = q.shape
    Dv, Fd, BH, C = v.shape[3], fq.shape[3], q.shape[0] * q.shape[2], window
    E = Dv + 1
    seen, k_prev, v_prev, fk_prev, S, z, sink_k, sink_v = state
    n = k_prev.shape[1]  # kept rows, <= C
    N = -(-T // C)

    def ext(x: Tensor, prev: Tensor | None, width: int, front: int = C) -> Tensor:  # [BH, rows, width]
        buf = x.new_empty((BH, front + N * C, width), dtype=dt)
        if front:
            buf[:, : C - n].zero_()
            buf[:, C - n : C, : x.shape[3]] = prev
        buf[:, front + T :].zero_()
        buf[:, front : front + T, : x.shape[3]].view(B, H, T, x.shape[3]).copy_(x.transpose(1, 2))
        return buf

    qb = ext(q, None, D, front=0).mul_(scale).view(BH, N, C, D)  # the scale folded into the queries
    kb, vb = ext(k, k_prev, D), ext(v, v_prev, E)
    vb[:, :, Dv] = 1.0  # the normaliser's column (padded rows weigh nothing: masked, or fk = 0)
    if T % C == 0:  # whole blocks: the feature maps as they lie (a view when head-major, as hedgehog's)
        fqb = fq.transpose(1, 2).reshape(BH, T, Fd).to(dt).view(BH, N, C, Fd)
        fk_rest = fk.transpose(1, 2).reshape(BH, T, Fd).to(dt).view(BH, N, C, Fd)
        fk_first = fk_prev.new_zeros((BH, C, Fd), dtype=dt)
        fk_first[:, C - n :] = fk_prev
    else:
        fqb = ext(fq, None, Fd, front=0).view(BH, N, C, Fd)
        fkb = ext(fk, fk_prev, Fd)
        fk_first, fk_rest = fkb[:, :C], fkb[:, C:].view(BH, N, C, Fd)

    def span(x: Tensor) -> Tensor:  # one head's [L, W] rows -> [N, 2C, W]: block b's rows bC .. bC + 2C - 1
        return x.as_strided((N, 2 * C, x.shape[1]), (C * x.shape[1], x.shape[1], 1))

    v_blocks = vb.view(BH, N + 1, C, E)  # ext block b: the values of the block before query block b
    i = torch.arange(C, device=q.device)[:, None]
    j = torch.arange(2 * C, device=q.device)[None, :]
    outside = (j <= i) | (j > i + C)  # [C, 2C]: not in query i's window
    s_n = sink_k.shape[1]
    if s_n:  # the sinks' keys and values (with the normaliser's column), and where each query reads them
        sink_vb = torch.cat((sink_v.to(dt), sink_v.new_ones((BH, s_n, 1), dtype=dt)), dim=-1)  # [BH, s, E]
        t = seen + torch.arange(N * C, device=q.device).view(N, C, 1)
        sink_out = torch.arange(s_n, device=q.device) > t - window  # [N, C, s]: still in the window (or padding)
    res = q.new_empty((BH, N, C, E), dtype=dt)
    for h in range(BH):  # window and in-block far terms, one head (all its blocks) at a time
        logits = torch.matmul(qb[h], span(kb[h]).transpose(1, 2)).masked_fill_(outside, float("-inf"))  # [N, C, 2C]
        if n < C:  # the first block's rows before the sequence start
            logits[0, :, : C - n] = float("-inf")
        m = logits.amax(-1, keepdim=True)  # m_t: the max over the window
        if s_n:
            sink_logits = torch.matmul(qb[h], sink_k[h].to(dt).T).masked_fill_(sink_out, float("-inf"))  # [N, C, s]
            m = torch.maximum(m, sink_logits.amax(-1, keepdim=True))  # and the sinks
        a = logits.sub_(m).exp_()
        out = torch.matmul(a, span(vb[h]), out=res[h])
        if s_n:
            out.add_(torch.matmul(sink_logits.sub_(m).exp_(), sink_vb[h]))
        out.mul_(wf[h])
        # far keys of the block before (j <= i): for block 0 the kept window, for block b the block b - 1
        out[0].addmm_(torch.mm(fqb[h, 0], fk_first[h].T).tril_().mul_(lf[h]), v_blocks[h, 0])
        if N > 1:
            near = torch.matmul(fqb[h, 1:], fk_rest[h, :-1].transpose(1, 2)).tril_().mul_(lf[h])
            out[1:].baddbmm_(near, v_blocks[h, 1:N])
    # older blocks: S before query block b sums ext blocks < b (and every key before the kept window)
    S = torch.cat((S.to(dt), z.to(dt)[..., None]), dim=-1)  # [BH, F, E]
    lfs = lf.view(BH, 1, 1)
    inter = q.new_empty((N, BH, C, E), dtype=dt)
    for b in range(N):
        torch.bmm(fqb[:, b], S * lfs, out=inter[b])
        rows = C if b < N - 1 else T - (N - 1) * C  # the last block adds only keys that left the window
        fk_b = fk_first if b == 0 else fk_rest[:, b - 1]
        S.baddbmm_(fk_b[:, :rows].transpose(1, 2), v_blocks[:, b, :rows])
    res.add_(inter.transpose(0, 1))
    res = res.view(BH, N * C, E)[:, :T]
    out = res[..., :Dv] / (res[..., Dv:] + eps)  # [BH, T, Dv]
    keep = min(C, n + T)  # the kept window: the last `keep` real rows
    fk_all = fk_rest.view(BH, -1, Fd)[:, :T]
    fk_kept = fk_all[:, T - keep :] if keep <= T else torch.cat((fk_first[:, C - (keep - T) :], fk_all), dim=1)
    kept = (kb[:, C + T - keep : C + T].clone(), vb[:, C + T - keep : C + T, :Dv].clone(), fk_kept.clone())
    return out, (seen + T, *kept, S[..., :Dv].contiguous(), S[..., Dv].contiguous(), sink_k, sink_v)


def _segments(q: Tensor, k: Tensor, v: Tensor, fq: Tensor, fk: Tensor, hm: tuple, *, window: int, sinks: int, wf,
              lf, scale: float, eps: float, chunk_size: int, segment_size: int, grad: bool, fla, fast, heads_major):
    """The positions of q .. fk in segments of `segment_size`, each continuing the head-major state `hm`:
    (each segment's result, the state after the last). Inputs head-major, or batch-major for `fast` (then
    `_fast_segment` with its dtype bound); `heads_major` lays a batch-major tensor out head-major."""
    T = q.shape[1]
    outs = []
    for a in range(0, T, segment_size):
        part = slice(a, a + segment_size)
        fk_part = fk[:, part]
        if hm[0] < sinks:  # sinks never reach the linear state: their feature keys count as zeros
            r = min(sinks - hm[0], fk_part.shape[1])
            fk_part = torch.cat((torch.zeros_like(fk_part[:, :r]), fk_part[:, r:]), dim=1)
        if sinks:  # the fast path's inputs are batch-major: the sinks' first rows go head-major
            first = slice(a, min(a + segment_size, a + sinks, T))
            lay = heads_major if fast else (lambda x: x)
            hm = _with_sinks(hm, lay(k[:, first]), lay(v[:, first]), fk_part.shape[1], sinks, window)
        if fast:  # batch-major inputs: the fast path lays them out itself
            out, hm = fast(q[:, part], k[:, part], v[:, part], fq[:, part], fk_part, hm, window=window,
                           wf=wf, lf=lf, scale=scale, eps=eps)
        else:
            out, hm = _segment(q[:, part], k[:, part], v[:, part], fq[:, part], fk_part, hm, window=window,
                               wf=wf, lf=lf, scale=scale, eps=eps, C=chunk_size, grad=grad, fla=fla)
        outs.append(out)
    return outs, hm


def hybrid_attention_chunk(
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
    chunk_size: int = 64,
    state: HybridState | None = None,
    segment_size: int = SEGMENT_SIZE,
    return_state: bool = False,
    sinks: int = 0,
) -> Tensor | tuple[Tensor, HybridState]:
    """Chunked hybrid attention, linear in T; same arguments and result as :func:`hybrid_attention_naive`,
    optionally continuing a sequence.

    Args:
        q: [B, T, H, D] queries.
        k: [B, T, H, D] keys.
        v: [B, T, H, Dv] values.
        fq: [B, T, H, F] feature-mapped queries, non-negative.
        fk: [B, T, H, F] feature-mapped keys, non-negative.
        window: >= 0, the number of most recent keys (the query's own included) under exact softmax.
        window_factor: [H] (or a number) weight of the softmax terms, per head.
        linear_factor: [H] (or a number) weight of the linear terms, per head.
        scale: softmax scale.
        eps: added to the shared normaliser.
        chunk_size: C >= 1, positions per chunk (and per query block of the window part); a
            performance choice only.
        state: the state after the positions before these (``recurrent.HybridState``), or None to start
            a sequence: the T positions continue it, exactly as if the whole sequence were one call.
        segment_size: >= 1, positions processed at once, each segment continuing the state of the one
            before: the working memory is a segment's, flat in T (a performance choice only).
        return_state: also return the state after the T positions.
        sinks: >= 0, the first positions kept under exact softmax (``naive.py``; needs ``window > 0``).

    Returns:
        [B, T, H, Dv] in the dtype of ``q``, accumulated in float32 at least; with ``return_state`` the
        pair (out, state).
    """
    check_hybrid_inputs(q, k, v, fq, fk, window, window_factor, linear_factor, scale, eps, sinks)
    for name, value in (("chunk_size", chunk_size), ("segment_size", segment_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}; pass e.g. 64.")
    B, T, H, D = q.shape
    Dv, Fd = v.shape[3], fq.shape[3]
    in_dtype, dt = q.dtype, compute_dtype(q.dtype)
    if state is None:
        state = init_state(B, H, D, Dv, Fd, window=window, dtype=in_dtype, device=q.device, sinks=sinks)
    check_state(state, k, v, fk, window, sinks)
    store = state.k.dtype  # the window cache keeps the dtype of the inputs that started the sequence
    grad = torch.is_grad_enabled() and any(
        isinstance(x, Tensor) and x.requires_grad for x in (q, k, v, fq, fk, window_factor, linear_factor,
                                                            state.S, state.k))

    def heads_major(x: Tensor) -> Tensor:  # [B, T, H, E] -> [B * H, T, E]
        return x.to(dt).transpose(1, 2).reshape(B * H, x.shape[1], x.shape[3])

    wf = head_weights(window_factor, H, dt, q.device).repeat(B)[:, None]  # [B * H, 1]
    lf = head_weights(linear_factor, H, dt, q.device).repeat(B)[:, None]  # [B * H, 1]
    hm = (state.seen, *map(heads_major, (state.k, state.v, state.fk)), state.S.to(dt).reshape(B * H, Fd, Dv),
          state.z.to(dt).reshape(B * H, Fd), *map(heads_major, (state.sink_k, state.sink_v)))
    fla = fla_kernel(q.device)  # looked up once per call
    fast = (not grad and window in FAST_WINDOWS and os.environ.get("EFFATTN_LINEAR_FAST", "1") != "0"
            and fla is None)  # fmt: skip
    if not fast:
        q, k, v, fq, fk = map(heads_major, (q, k, v, fq, fk))
    outs, hm = _segments(q, k, v, fq, fk, hm, window=window, sinks=sinks, wf=wf, lf=lf, scale=scale, eps=eps,
                         chunk_size=chunk_size, segment_size=segment_size, grad=grad, fla=fla,
                         fast=(lambda *a, **kw: _fast_segment(*a, **kw, dt=dt)) if fast else None,
                         heads_major=heads_major)
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]  # [B * H, T, Dv]
    out = out.view(B, H, T, Dv).transpose(1, 2).to(in_dtype)  # [B, T, H, Dv]
    if not return_state:
        return out
    seen, k_w, v_w, fk_w, S, z, sink_k, sink_v = hm

    def batch_major(x: Tensor) -> Tensor:  # [B * H, n, E] -> [B, n, H, E]
        return x.view(B, H, x.shape[1], x.shape[2]).transpose(1, 2).to(store)

    return out, HybridState(seen=seen, window=window, S=S.view(B, H, Fd, Dv), z=z.view(B, H, Fd),
                            k=batch_major(k_w), v=batch_major(v_w), fk=batch_major(fk_w), sinks=sinks,
                            sink_k=batch_major(sink_k), sink_v=batch_major(sink_v))


def hybrid_attention_parts(q: Tensor, k: Tensor, v: Tensor, fq: Tensor, fk: Tensor, *, window: int, scale: float,
                           chunk_size: int = 64, segment_size: int = SEGMENT_SIZE, sinks: int = 0) -> HybridParts:
    """The chunked kernel's four sums of a whole sequence before the factors combine them (`HybridParts`, in
    the compute dtype, batch-major), linear in T: ``combine_parts(parts, wf, lf, eps)`` is
    ``hybrid_attention_chunk`` with those factors, and `hybrid_parts_naive` the reference. Arguments as
    `hybrid_attention_chunk`'s (its generic path: autograd reaches q, k, v, fq, fk when they need it)."""
    check_hybrid_inputs(q, k, v, fq, fk, window, 1.0, 1.0, scale, 0.0, sinks)
    B, T, H, D = q.shape
    Dv, Fd = v.shape[3], fq.shape[3]
    dt = compute_dtype(q.dtype)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, fq, fk))

    def heads_major(x: Tensor) -> Tensor:  # [B, T, H, E] -> [B * H, T, E]
        return x.to(dt).transpose(1, 2).reshape(B * H, x.shape[1], x.shape[3])

    state = init_state(B, H, D, Dv, Fd, window=window, dtype=q.dtype, device=q.device, sinks=sinks)
    hm = (state.seen, *map(heads_major, (state.k, state.v, state.fk)), state.S.to(dt).reshape(B * H, Fd, Dv),
          state.z.to(dt).reshape(B * H, Fd), *map(heads_major, (state.sink_k, state.sink_v)))
    outs, _ = _segments(*map(heads_major, (q, k, v, fq, fk)), hm, window=window, sinks=sinks, wf=None, lf=None,
                        scale=scale, eps=0.0, chunk_size=chunk_size, segment_size=segment_size, grad=grad,
                        fla=fla_kernel(q.device), fast=None, heads_major=heads_major)

    def batch_major(i: int) -> Tensor:  # part i of every segment, [B * H, T, *] -> [B, T, H, *]
        x = torch.cat([o[i] for o in outs], dim=1) if len(outs) > 1 else outs[0][i]
        return x.view(B, H, T, -1).transpose(1, 2) if x.dim() == 3 else x.view(B, H, T).transpose(1, 2)

    return HybridParts(*(batch_major(i) for i in range(4)))
