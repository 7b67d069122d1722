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

Cost: ``O(T * (C * (D + Dv) + w * (D + Dv) + F * Dv))`` time and ``O(T * (C + w + F * Dv / C))``
memory, linear in T. Plain PyTorch ops: autograd gives the backward pass.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from effattn.kernels.linear.naive import check_hybrid_inputs, compute_dtype, head_weights


def _window_part(q: Tensor, k: Tensor, v: Tensor, w: int, scale: float, C: int) -> tuple[Tensor, Tensor]:
    """Banded softmax numerator and denominator, ``sum_{W_t} exp(scale q_t.k_s - m_t) (v_s, 1)``.

    q, k: [B, T, H, D], v: [B, T, H, Dv], 1 <= w <= T, C >= 1. Returns ([B, T, H, Dv], [B, T, H]).
    """
    B, T, H, D = q.shape
    Dv = v.shape[3]
    N = -(-T // C)  # number of query blocks
    P = w - 1  # keys a block reads before its first query
    L = C + P  # span length
    end = N * C - T  # padding that completes the last block

    q_blocks = F.pad(q, (0, 0, 0, 0, 0, end)).view(B, N, C, H, D)  # [B, N, C, H, D]
    # span of block n: padded positions nC .. nC + L - 1, i.e. true positions nC - P .. nC + C - 1
    k_span = F.pad(k, (0, 0, 0, 0, P, end)).unfold(1, L, C)  # [B, N, H, D, L]
    v_span = F.pad(v, (0, 0, 0, 0, P, end)).unfold(1, L, C)  # [B, N, H, Dv, L]

    logits = torch.einsum("bnchd,bnhdl->bnhcl", q_blocks, k_span) * scale  # [B, N, H, C, L]
    # query i of block n sits at t = nC + i, span column j at s = nC - P + j: t - s = i + P - j,
    # which lies in [0, w) for j in [i, i + P]; columns before the sequence start are padding
    i = torch.arange(C, device=q.device)[:, None]
    j = torch.arange(L, device=q.device)[None, :]
    band = (j >= i) & (j <= i + P)  # [C, L]
    started = torch.arange(N, device=q.device)[:, None] * C - P + j >= 0  # [N, L]
    allowed = band[None] & started[:, None, :]  # [N, C, L]
    logits = logits.masked_fill(~allowed[None, :, None], float("-inf"))
    m = logits.amax(-1, keepdim=True)  # [B, N, H, C, 1], m_t over the window (column i + P is t itself)
    a = torch.exp(logits - m)  # [B, N, H, C, L]

    num = torch.einsum("bnhcl,bnhel->bnche", a, v_span)  # [B, N, C, H, Dv]
    den = a.sum(-1).transpose(2, 3)  # [B, N, C, H]
    return num.reshape(B, N * C, H, Dv)[:, :T], den.reshape(B, N * C, H)[:, :T]  # [B, T, H, Dv], [B, T, H]


def _far_part(fq: Tensor, fk: Tensor, v: Tensor, window: int, C: int) -> tuple[Tensor, Tensor]:
    """Linear numerator and denominator, ``sum_{s <= t - window} (fq_t . fk_s) (v_s, 1)``.

    fq, fk: [B, T, H, F], v: [B, T, H, Dv], 0 <= window < T, C >= 1. Returns ([B, T, H, Dv], [B, T, H]).
    """
    B, T, H, Fd = fq.shape
    Dv = v.shape[3]
    N = -(-T // C)
    end = N * C - T

    # delay keys and values by `window`: position u holds key u - window (zeros before the start);
    # then pad the end to whole chunks
    fk_d = F.pad(fk, (0, 0, 0, 0, window, end))[:, : N * C]  # [B, N*C, H, F]
    v_d = F.pad(v, (0, 0, 0, 0, window, end))[:, : N * C]  # [B, N*C, H, Dv]
    fq_c = F.pad(fq, (0, 0, 0, 0, 0, end)).view(B, N, C, H, Fd)  # [B, N, C, H, F]
    fk_c = fk_d.reshape(B, N, C, H, Fd)  # [B, N, C, H, F]
    v_c = v_d.reshape(B, N, C, H, Dv)  # [B, N, C, H, Dv]

    # inter-chunk: S_n = sum of fk'^T v' over the chunks before n (exclusive prefix sum), z_n likewise
    kv = torch.einsum("bnchf,bnche->bnhfe", fk_c, v_c)  # [B, N, H, F, Dv], one chunk's fk'^T v'
    S = torch.cat((torch.zeros_like(kv[:, :1]), kv[:, :-1]), dim=1).cumsum(1)  # [B, N, H, F, Dv]
    ksum = fk_c.sum(2)  # [B, N, H, F]
    z = torch.cat((torch.zeros_like(ksum[:, :1]), ksum[:, :-1]), dim=1).cumsum(1)  # [B, N, H, F]
    num = torch.einsum("bnchf,bnhfe->bnche", fq_c, S)  # [B, N, C, H, Dv]
    den = torch.einsum("bnchf,bnhf->bnch", fq_c, z)  # [B, N, C, H]

    # intra-chunk: (fq_t . fk'_u) for u <= t inside the chunk
    causal = torch.ones(C, C, dtype=torch.bool, device=fq.device).tril()  # [C, C], row t, column u
    A = torch.einsum("bnchf,bnuhf->bnhcu", fq_c, fk_c).masked_fill(~causal, 0.0)  # [B, N, H, C, C]
    num = num + torch.einsum("bnhcu,bnuhe->bnche", A, v_c)
    den = den + A.sum(-1).transpose(2, 3)
    return num.reshape(B, N * C, H, Dv)[:, :T], den.reshape(B, N * C, H)[:, :T]  # [B, T, H, Dv], [B, T, H]


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
) -> Tensor:
    """Chunked hybrid attention, linear in T; same arguments and result as :func:`hybrid_attention_naive`.

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

    Returns:
        [B, T, H, Dv] in the dtype of ``q``; accumulated in float32 at least.
    """
    check_hybrid_inputs(q, k, v, fq, fk, window, window_factor, linear_factor, scale, eps)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}; pass e.g. 64.")
    B, T, H, _ = q.shape
    in_dtype, dt = q.dtype, compute_dtype(q.dtype)
    q, k, v, fq, fk = (x.to(dt) for x in (q, k, v, fq, fk))
    wf = head_weights(window_factor, H, dt, q.device)  # [H]
    lf = head_weights(linear_factor, H, dt, q.device)  # [H]
    C = min(chunk_size, T)  # no block longer than the sequence

    num = v.new_zeros(B, T, H, v.shape[3])  # [B, T, H, Dv]
    den = v.new_zeros(B, T, H)  # [B, T, H]
    if window > 0:  # window >= T: every query's window is its whole prefix
        win_num, win_den = _window_part(q, k, v, min(window, T), scale, C)
        num = num + wf[:, None] * win_num
        den = den + wf * win_den
    if window < T:  # window >= T: no key ever leaves the window
        far_num, far_den = _far_part(fq, fk, v, window, C)
        num = num + lf[:, None] * far_num
        den = den + lf * far_den
    return (num / (den + eps)[..., None]).to(in_dtype)  # [B, T, H, Dv]
