"""Transformer-VQ attention with ReRoPE: the blockwise, linear-time kernel.

Same semantics as ``naive.py`` (read its docstring first). Queries are processed in steps of about
``TILE`` positions (a multiple of ``L = block_size``, starting at a multiple of L). For a step
``[t0, t1)`` the keys split into

* the *span* ``[t0 - W + 1, t1)``: the W - 1 keys carried from earlier steps plus the step's own.
  Every near pair of the step lies here, and so do its far pairs with keys younger than
  ``t0 - W + 1`` (at most the first ``t1 - t0 - 1`` span keys); they get per-pair logits;
* the *aggregated* keys ``s <= t0 - W``, far for the whole step. Their logit
  ``<rope(q_t, F), codebook[z_s]>`` depends on s only through its code, so they enter the softmax as
  one column per code, weighted by the number of keys with that code (``counts``, added as a
  ``log(count)`` bias) and carrying the mean of their values (``sums / counts``). Sinks are kept
  exact in their own columns.

All columns share one softmax, so a step costs ``O(TILE * (W + TILE + C + sinks))`` wherever it is:
time is linear in T and the working memory is flat. After the step, the keys that leave the span
are scatter-added (detached) into the per-code statistics.

Gradients follow the stop-gradient rule of ``naive.py`` exactly: statistics are detached, and far
span pairs that the rule aggregates (possible when a step holds several blocks of L) pass no
gradient to their key and value (see :class:`_StepAttention`). The step size is therefore a pure
performance choice, independent of L when ``L <= TILE``.

The recurrence state is a :class:`VQState`; passing it back in continues the sequence, so any
chunking of a sequence (down to one token per call) reproduces the output of a single call.

With ``key_means`` (see ``naive.py``) the code columns are scored at the per-code sums of the
aggregated keys (rotated by -F), divided by their counts; the far span keys of a step are kept
exact and, for the queries they are far for, folded into their codes' sums and counts on the fly,
so that every query sees the mean of exactly its own far keys, whatever the step.

For float32 inference on the CPU the steps of each segment run in C instead (``native.c``, see
``native.py``): the same columns, masks and statistics, with the per-step work fused and no Python
between steps. The PyTorch loop below stays the one autograd, other dtypes and devices use.
"""

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from effattn.kernels.rope import apply_rope
from effattn.kernels.vq.naive import check_vq_inputs, compute_dtype

try:  # the compiled step loop; absent where this file is bundled as a model's remote code
    from effattn.kernels.vq import native as _native
except ImportError:
    _native = None

# Queries per step (rounded to a multiple of block_size). Larger steps amortise PyTorch's per-op
# overhead but widen the span every query is scored against (W - 1 + TILE keys, plus TILE - 1 far
# ones); 64 is the fastest on a 2-core AVX-512 CPU for W = 256, C = 512 (see effattn/bench.py).
TILE = 64
# Positions per segment: the per-position work (RoPE, quantization, layouts) of a segment's steps
# is done in one go, leaving the step loop only the attention itself. Bounds the working memory
# (tens of megabytes at most, whatever the sequence length); fewer, larger segments cost less
# per-op overhead and give the compiled loop's threads longer runs of steps.
SEGMENT = 4096


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
        key_sums: (B, G, C, D) sum of their pre-RoPE keys, per code (``key_means`` only, else None).

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
    key_sums: Tensor | None = None

    def nbytes(self) -> int:
        """Total size of the state's tensors in bytes."""
        return sum(
            x.numel() * x.element_size() for x in (getattr(self, f.name) for f in fields(self)) if isinstance(x, Tensor)
        )


def _empty_state(q: Tensor, k: Tensor, v: Tensor, codebook: Tensor, cos: Tensor, window: int, sinks: int,
                 key_means: bool) -> VQState:
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
        key_sums=torch.zeros(B, G, C, D, dtype=stats_dtype, device=k.device) if key_means else None,
    )


def _check_state(state: VQState, k: Tensor, v: Tensor, codebook: Tensor, window: int, sinks: int,
                 key_means: bool) -> None:
    if state.window != window or state.sinks != sinks or (state.key_sums is not None) != key_means:
        raise ValueError(
            f"The state was built with window={state.window}, sinks={state.sinks}, "
            f"key_means={state.key_sums is not None} but this call uses window={window}, sinks={sinks}, "
            f"key_means={key_means}; continue a sequence with the settings that started it."
        )
    B, _, G, D = k.shape
    expected = {"counts": (B, G, codebook.shape[1]), "sums": (B, G, codebook.shape[1], v.shape[3])}
    if key_means:
        expected["key_sums"] = (B, G, codebook.shape[1], D)
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


def _segments(start: int, T: int, L: int) -> list[tuple[int, int]]:
    """Segments ``(step_len, n_steps)`` of equal steps covering positions ``start .. start + T - 1``.

    Steps hold ``max(1, TILE // L)`` whole blocks of L and start at multiples of L, so the
    statistics at a step's start only hold pairs that the stop-gradient rule aggregates; an
    unaligned ``start`` (continuing a state) first completes its block, and a shorter last step
    ends the sequence. Each of these two gets a segment of its own.
    """
    per_step = L * max(1, TILE // L)
    per_segment = max(1, SEGMENT // per_step)
    head = min(T, -start % L)
    body, tail = divmod(T - head, per_step)
    segments = [(head, 1)] if head else []
    segments += [(per_step, min(per_segment, body - i)) for i in range(0, body, per_segment)]
    return segments + ([(tail, 1)] if tail else [])


def _span_bias(t0: int, Q: int, window: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive mask (0 or -inf) of the span columns of the Q queries starting at ``t0``.

    The span holds the keys at positions ``t0 - (W-1) + c``, c in [0, S = W-1+Q), and query i sits at
    column ``W-1+i``, so ``delta = W-1+i-c``. The columns are the S near logits (allowed when
    ``0 <= delta < W``) followed by the far logits of the first ``Q-1`` span keys (allowed when
    ``delta >= W``); keys before the sequence start (zero padding) are masked. Returns (Q, S + Q - 1).
    """
    P = window - 1
    c = torch.arange(P + Q, device=device)
    delta = P + torch.arange(Q, device=device)[:, None] - c  # (Q, S)
    started = t0 - P + c >= 0  # (S,)
    near = (delta >= 0) & (delta < window) & started
    far = (delta[:, : Q - 1] >= window) & started[: Q - 1]
    allowed = torch.cat((near, far), dim=1)  # (Q, S + Q - 1)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


def _aggregated_pairs(t0: int, Q: int, window: int, block_size: int, device: torch.device) -> Tensor:
    """(Q, Q - 1) bool: which (query, far span key) pairs of the step the stop-gradient rule aggregates.

    Query ``t = t0 + i`` and key ``s = t0 - (W-1) + c`` are aggregated when ``s <= floor(t/L)*L - W``.
    """
    t = t0 + torch.arange(Q, device=device)[:, None]
    s = t0 - (window - 1) + torch.arange(Q - 1, device=device)
    return s <= torch.div(t, block_size, rounding_mode="floor") * block_size - window


def _scratch(workspace: dict, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """A buffer reused from step to step. A fresh multi-megabyte tensor per step is handed back to the
    operating system when freed, and the page faults of its next first touch cost about as much as
    the step's arithmetic."""
    buffer = workspace.get(name)
    if buffer is None or buffer.shape != shape:
        buffer = workspace[name] = like.new_empty(shape)
    return buffer


def _step_forward(q_near, q_far, span_rk, far_kq, codebook, sink_k, span_v, far_v, log_counts, means, sink_v,
                  near_masks, far_bias, workspace, saved):  # fmt: skip
    """The forward pass of :class:`_StepAttention` (read its docstring); returns ``(out, probs)``.

    Without ``saved`` (no backward pass to come), the probabilities and the output live in
    ``workspace`` buffers reused by the next step.
    """
    BG, M, _ = q_near.shape
    sizes = (span_rk.shape[1], far_kq.shape[1], codebook.shape[1], sink_k.shape[1])
    shape = (BG, M, sum(sizes))

    def buffer(name, shape, like):  # a fresh tensor (out=None) when it is saved for backward
        return None if saved else _scratch(workspace, name, shape, like)

    logits = _scratch(workspace, "logits", shape, q_near)  # (BG, M, N), never saved
    near, far, code, sink = logits.split(sizes, dim=-1)
    torch.bmm(q_near, span_rk.mT, out=near)
    for columns, bias in near_masks:
        near[..., columns] += bias
    torch.bmm(q_far, far_kq.mT, out=far).add_(far_bias)
    torch.bmm(q_far, codebook.mT, out=code).add_(log_counts[:, None, :])
    if sizes[3]:
        torch.bmm(q_far, sink_k.mT, out=sink)
    probs = torch.softmax(logits, dim=-1, out=buffer("probs", shape, q_near))

    p_near, p_far, p_code, p_sink = probs.split(sizes, dim=-1)
    out = torch.bmm(p_near, span_v, out=buffer("out", (BG, M, span_v.shape[2]), q_near))
    out.baddbmm_(p_far, far_v).baddbmm_(p_code, means)  # (BG, M, Dv)
    if sizes[3]:
        out.baddbmm_(p_sink, sink_v)
    return out, probs


class _StepAttention(torch.autograd.Function):
    """Softmax attention of one step's queries over its four column groups, with a hand-written backward.

    ==========  ====================  ==========================================  ==================
    columns     keys                  logits                                      values
    ==========  ====================  ==========================================  ==================
    near (S)    the span              ``q_near @ span_rk^T + near masks``         ``span_v``
    far (F)     first F span keys     ``q_far @ far_kq^T + far_bias``             ``far_v``
    codes (C)   the codewords         ``q_far @ codebook^T + log_counts``         ``means``
    sinks (m)   aggregated sinks      ``q_far @ sink_k^T``                        ``sink_v``
    ==========  ====================  ==========================================  ==================

    ``q_near`` are the queries rotated to their positions and ``span_rk`` the keys to theirs;
    ``q_far`` are the queries unrotated and the far keys (span keys quantized, codewords, sinks) are
    rotated by -F (F the far position), which gives the ReRoPE logit ``<rope(q, F), k>``. All keys
    carry the logit scale. A code column stands for all the aggregated keys with that code: its
    logit carries ``log(count)`` (``-inf`` drops empty codes) and its value is their mean value.

    The masks are 0 / -inf biases; the near ones are added only on the column bands where they mask
    something, ``near_masks = [(columns, bias), ...]``. The four products are written straight into
    one logits tensor and the output is accumulated part by part, so the largest tensors of a step are
    never concatenated or copied. Without a backward pass to come the kernel calls
    :func:`_step_forward` directly, which reuses the step's buffers from ``workspace``.

    Shapes, batch and key/value heads flattened into BG and M = R*Q rows ordered (head, query):
    q_near, q_far (BG, M, D); span_rk (BG, S, D); far_kq (BG, F, D); codebook (BG, C, D); sink_k (BG, m, D);
    span_v (BG, S, Dv); far_v (BG, F, Dv); log_counts (BG, C); means (BG, C, Dv); sink_v (BG, m, Dv);
    near_masks: biases (M, band width); far_bias (M, F); frozen (M, F) bool. Returns (BG, M, Dv).

    Gradients reach q_near, q_far, span_rk, far_kq, span_v and far_v. Codewords, statistics and sinks
    are constants (detached), and the far pairs flagged in ``frozen`` (aggregated by the stop-gradient
    rule) send no gradient to their key and value.
    """

    @staticmethod
    def forward(ctx, q_near, q_far, span_rk, far_kq, codebook, sink_k, span_v, far_v, log_counts, means, sink_v,
                near_masks, far_bias, frozen, workspace):  # fmt: skip
        out, probs = _step_forward(q_near, q_far, span_rk, far_kq, codebook, sink_k, span_v, far_v, log_counts,
                                   means, sink_v, near_masks, far_bias, workspace, saved=True)  # fmt: skip
        ctx.sizes = (span_rk.shape[1], far_kq.shape[1], codebook.shape[1], sink_k.shape[1])
        ctx.save_for_backward(q_near, q_far, span_rk, far_kq, codebook, sink_k, span_v, far_v, means, sink_v,
                              frozen, probs, out)  # fmt: skip
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (q_near, q_far, span_rk, far_kq, codebook, sink_k, span_v, far_v, means, sink_v,
         frozen, probs, out) = ctx.saved_tensors  # fmt: skip
        needs = ctx.needs_input_grad

        # softmax backward: d logits = P * (dP - rowsum(dO * O)), with dP = dO @ V^T part by part
        grad_logits = torch.empty_like(probs)
        for part, values in zip(grad_logits.split(ctx.sizes, dim=-1), (span_v, far_v, means, sink_v)):
            torch.bmm(grad_out, values.mT, out=part)
        grad_logits.sub_((grad_out * out).sum(-1, keepdim=True)).mul_(probs)
        g_near, g_far, g_code, g_sink = grad_logits.split(ctx.sizes, dim=-1)
        p_near, p_far, _, _ = probs.split(ctx.sizes, dim=-1)
        g_far_thawed, p_far_thawed = g_far.masked_fill(frozen, 0.0), p_far.masked_fill(frozen, 0.0)

        grad_q_near = g_near @ span_rk if needs[0] else None
        grad_q_far = (g_far @ far_kq).baddbmm_(g_code, codebook).baddbmm_(g_sink, sink_k) if needs[1] else None
        grad_span_rk = g_near.mT @ q_near if needs[2] else None
        grad_far_kq = g_far_thawed.mT @ q_far if needs[3] else None
        grad_span_v = p_near.mT @ grad_out if needs[6] else None
        grad_far_v = p_far_thawed.mT @ grad_out if needs[7] else None
        return (grad_q_near, grad_q_far, grad_span_rk, grad_far_kq, None, None, grad_span_v, grad_far_v,
                None, None, None, None, None, None, None)  # fmt: skip


def _step_key_means(q_near, q_far, span_rk, far_k, code_k, sink_k, span_v, far_v, counts, log_counts, means, sink_v,
                    far_codes, far_is_sink, near_masks, far_bias, frozen):  # fmt: skip
    """One step's attention with key means, in differentiable PyTorch operations (with and without
    autograd); the columns of :class:`_StepAttention` with two changes.

    * Code columns are scored at the mean key of each code: ``code_k`` (BG, C, D) holds the sums of
      the aggregated keys (rotated by -F, scaled), ``counts`` (BG, C) their numbers. The far span
      keys ``far_k`` (BG, F, D, exact, rotated by -F and scaled) with codes ``far_codes`` (BG, F) join
      their code for each query they are far for, in the sum of logits and in the count:
      ``logit_c = (<q, code_k_c> + sum_j <q, far_k_j>) / (count_c + n) + log(count_c + n)``.
    * Those far span keys have no columns of their own, except sinks (``far_is_sink`` (F,)), which
      keep their exact per-pair logit. A code's probability p_c spreads evenly over its keys, so a
      joined key's value gets ``p_c / (count_c + n)`` and the aggregated keys' mean value ``means_c``
      gets ``p_c * count_c / (count_c + n)``.

    The code columns are first scored from the aggregated keys alone, as in the codeword kernel
    (``<q, code_k_c / count_c> + log_counts_c``); the at most F codes that far span keys join are then
    rescored in (BG, M, F) space, through the first far span key of each code, and written back.
    Pairs flagged in ``frozen`` (M, F) pass no gradient to their key and value, as in
    :class:`_StepAttention`; statistics, codes and sinks are constants. Returns (BG, M, Dv).
    """
    S, C, F = span_rk.shape[1], code_k.shape[1], far_k.shape[1]
    dtype = q_near.dtype
    near = q_near @ span_rk.mT  # (BG, M, S)
    for columns, bias in near_masks:
        near[..., columns] += bias
    far = q_far @ far_k.mT  # (BG, M, F), exact far span logits
    if frozen.any():
        far = torch.where(frozen, q_far @ far_k.detach().mT, far)
    code = torch.baddbmm(log_counts[:, None, :], q_far, (code_k / counts.clamp(min=1.0)[..., None]).mT)  # (BG, M, C)

    is_far = far_bias == 0  # (M, F)
    eligible = ~far_is_sink  # (F,): span keys that can join a code (sinks never do)
    joins = (is_far & eligible).to(dtype)  # (M, F)
    same = (far_codes[:, :, None] == far_codes[:, None, :]) & eligible[:, None] & eligible[None, :]  # (BG, F, F)
    first = eligible & ~same.tril(-1).any(-1)  # (BG, F): the first joining key of each code
    to_code = far_codes[:, None, :].expand_as(far)  # (BG, M, F)
    count = counts.gather(1, far_codes)[:, None, :]  # (BG, 1, F): the aggregated count of each key's code
    n = count + joins @ same.to(dtype)  # (BG, M, F): with the joined keys of that code
    code_k_far = code_k.gather(1, far_codes[..., None].expand(-1, -1, code_k.shape[2]))  # (BG, F, D)
    total = torch.baddbmm(q_far @ code_k_far.mT, far * joins, same.to(dtype))  # (BG, M, F): the code's logit sum
    rescored = (total / n.clamp(min=1.0) + n.clamp(min=1.0).log()).masked_fill(n == 0, float("-inf"))
    # write through the first key of each code; the others go to a scratch column C, dropped after
    slot = torch.where(first[:, None, :], to_code, C)
    code = torch.cat((code, code.new_full(code.shape[:2] + (1,), float("-inf"))), dim=-1)
    code = code.scatter(2, slot, rescored)[..., :C]

    far_sinks = far + torch.zeros_like(far_bias).masked_fill_(~(is_far & far_is_sink), float("-inf"))
    probs = torch.softmax(torch.cat((near, far_sinks, code, q_far @ sink_k.mT), dim=-1), dim=-1)
    p_near, p_far, p_code, p_sink = probs.split((S, F, C, sink_k.shape[1]), dim=-1)
    share = p_code.gather(2, to_code) / n.clamp(min=1.0) * joins  # (BG, M, F): each joined key's probability
    means_far = means.gather(1, far_codes[..., None].expand(-1, -1, means.shape[2]))  # (BG, F, Dv)
    out = p_near @ span_v + p_code @ means - share @ means_far + p_sink @ sink_v
    w_far = p_far + share
    if frozen.any():
        return out + w_far.masked_fill(frozen, 0.0) @ far_v + w_far.masked_fill(~frozen, 0.0) @ far_v.detach()
    return out + w_far @ far_v


def _folded_keys(state: VQState, k: Tensor, codes: Tensor, T: int, P: int, sinks: int) -> tuple[Tensor, Tensor]:
    """The pre-RoPE keys (B, G, n, D) and codes (B, G, n) that a call over T positions folds into the
    statistics: positions ``start - P .. start + T - P - 1`` (none before 0 or among the sinks).
    k (B, T, G, D) and codes (B, T, G) are the call's own."""
    start, n_recent = state.seen, state.recent_k.shape[2]
    keys = torch.cat((state.recent_k.to(k.dtype), k.detach().transpose(1, 2)), dim=2)  # from start - n_recent
    all_codes = torch.cat((state.recent_codes, codes.long().transpose(1, 2)), dim=2)
    lo, hi = max(start - P, sinks, 0), start + T - P
    first = start - n_recent
    lo, hi = max(lo - first, 0), max(hi - first, 0)
    return keys[:, :, lo:hi], all_codes[:, :, lo:hi]


def _step_queries(q_step: Tensor, cos: Tensor, sin: Tensor, workspace: dict) -> tuple[Tensor, Tensor]:
    """One step's queries as the step reads them, without autograd: ``(q_near, q_far)``, each (BG, M, D).

    q_step: (B, Q, G, R, D) unrotated queries; cos, sin: (Q, D) their RoPE tables. Rows are ordered
    (head, query) within each group; ``q_near`` is ``apply_rope(q_far, cos, sin)`` written in place.
    """
    B, Q, G, R, D = q_step.shape
    q_view = q_step.permute(0, 2, 3, 1, 4)  # (B, G, R, Q, D)
    q_far = _scratch(workspace, "q_far", q_view.shape, q_step).copy_(q_view)
    q_near = torch.mul(q_far, cos, out=_scratch(workspace, "q_near", q_view.shape, q_step))
    h = D // 2  # rotate_half: [x1, x2] -> [-x2, x1]
    q_near[..., :h].addcmul_(q_far[..., h:], sin[:, :h], value=-1.0)
    q_near[..., h:].addcmul_(q_far[..., :h], sin[:, h:])
    return q_near.view(B * G, R * Q, D), q_far.view(B * G, R * Q, D)


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
    key_means: bool = False,
    bf16_products: bool = False,
) -> Tensor | tuple[Tensor, VQState]:
    """Blockwise linear-time Transformer-VQ attention with ReRoPE; same maths as ``vq_attention_naive``.

    Args:
        q: (B, T, H, D) pre-RoPE queries.
        k: (B, T, G, D) pre-RoPE keys, ``H % G == 0``; query head h reads key/value head ``h // (H // G)``.
        v: (B, T, G, Dv) values.
        codebook: (G, C, D) one codebook per key/value head, in pre-RoPE key space (gets no gradient).
        codes: (B, T, G) integer code of every key.
        cos, sin: (T, D) RoPE tables at this chunk's absolute positions (``state.seen ..``).
        far_cos, far_sin: (D,) RoPE table at ReRoPE's far relative position F (classically ``window``).
        window: W >= 1, keys with ``t - s < W`` are exact.
        block_size: L >= 1, block length of the stop-gradient rule (blocks aligned to multiples of L).
            It does not change the output; values above ``TILE`` make the steps, and so the work
            per query, larger.
        sinks: the first ``sinks`` positions of the sequence are never quantized.
        scale: logit scale, default ``D ** -0.5``.
        state: the state returned by the previous call of this sequence, or None to start one.
        return_state: also return the state after this chunk.
        key_means: score each far key's code at the mean of the far keys sharing it instead of at
            its codeword (see ``naive.py``); the state then also keeps per-code key sums.
        bf16_products: in the compiled loop, where the CPU has bfloat16 products (AMX or AVX-512 BF16,
            ``native.bf16_kernel``), compute the products with the span and code columns from bfloat16
            inputs (float32 accumulation): faster, and no longer float32-exact. Ignored (float32) wherever
            that loop or those products do not run.

    Returns:
        (B, T, H, Dv) output in the dtype of ``q``, and the new :class:`VQState` if ``return_state``.
    """
    check_vq_inputs(q, k, v, codebook, codes, cos, sin, far_cos, far_sin, window, block_size, sinks)
    if hasattr(state, "to_state"):  # a VQDecodeState (decode.py): continue from its plain form
        state = state.to_state()
    if state is None:
        state = _empty_state(q, k, v, codebook, cos, window, sinks, key_means)
    else:
        _check_state(state, k, v, codebook, window, sinks, key_means)
    B, T, H, D = q.shape
    G, Dv, C = k.shape[2], v.shape[3], codebook.shape[1]
    R = H // G  # query heads per key/value head
    W, L = window, block_size
    P = W - 1  # exact keys carried from one step to the next
    scale = D**-0.5 if scale is None else scale
    in_dtype, dt = q.dtype, compute_dtype(q.dtype)
    dev = q.device
    start = state.seen

    # Far logits <rope(q, F), k> = <q, rope(k, -F)>: the far keys and codewords are turned by -F
    # instead of the queries by +F (G instead of H rotations, none per query), and every key, near
    # or far, carries the logit scale.
    far_cos, far_sin = far_cos.to(dt) * scale, far_sin.to(dt) * -scale  # rotation by -F, scaled
    codebook = codebook.detach().to(dt)  # (G, C, D), for the codes of the keys
    codebook_far = apply_rope(codebook, far_cos, far_sin)  # (G, C, D), the code columns' keys
    counts = state.counts.reshape(B * G, C).clone()  # (BG, C), updated in place step by step
    sums = state.sums.reshape(B * G, C, Dv).clone()  # (BG, C, Dv)
    # What the code columns read, kept up to date code by code as keys are aggregated.
    log_counts = counts.log()  # (BG, C), -inf for empty codes
    means = sums / counts.clamp(min=1.0)[..., None]  # (BG, C, Dv)
    # key means: the code columns' keys are the per-code key sums, rotated by -F and scaled
    code_k = apply_rope(state.key_sums.to(dt), far_cos, far_sin).reshape(B * G, C, D) if key_means else None
    sink_k, sink_v = state.sink_k.to(dt), state.sink_v.to(dt)  # (B, G, m, D), (B, G, m, Dv)

    # The last W - 1 keys (rotated, quantized), values and codes, zero-padded before position 0.
    n_recent = state.recent_k.shape[2]
    recent_k = state.recent_k.to(dt)
    recent_rk = apply_rope(recent_k, state.recent_cos.to(dt) * scale, state.recent_sin.to(dt) * scale)
    # far span keys: quantized (straight-through) for codewords, exact for key means
    recent_kq = apply_rope(recent_k if key_means else
                           _straight_through(recent_k, state.recent_codes, codebook, start - n_recent, sinks),
                           far_cos, far_sin)  # fmt: skip
    buf_rk, buf_kq = _pad_front(recent_rk, P, 2), _pad_front(recent_kq, P, 2)  # (B, G, P, D)
    buf_v, buf_z = _pad_front(state.recent_v.to(dt), P, 2), _pad_front(state.recent_codes, P, 2)

    # split() gives autograd one node per input rather than one slice per segment.
    segments = _segments(start, T, L)
    sizes = [Q * n for Q, n in segments]
    chunks = zip(*(x.split(sizes, dim=1) for x in (q, k, v, codes)), cos.split(sizes), sin.split(sizes))

    # Under autograd, writing steps into one output would copy the whole gradient per step, so the
    # steps are concatenated; without it they go straight into the output.
    keep_graph = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    out = None if keep_graph else q.new_empty(B, T, H, Dv)
    native = (not keep_graph and in_dtype == dt == torch.float32 and dev.type == "cpu" and _native is not None
              and _native.available())  # fmt: skip
    if native:
        q_native, cos_native, sin_native = q.contiguous(), cos.to(dt).contiguous(), sin.to(dt).contiguous()
    pieces = []
    masks = {}  # most steps share their masks; they depend on t0 only near the sequence start
    workspace = {}  # step buffers reused without autograd
    codebook_bg = codebook_far.expand(B, G, C, D).reshape(B * G, C, D)
    ones = torch.ones(B * G, max(Q for Q, _ in segments), dtype=dt, device=dev)  # one count per leaving key

    t0 = start
    for (Q, n), (q_g, k_g, v_g, z_g, cos_g, sin_g) in zip(segments, chunks):
        S, F, M = P + Q, Q - 1, R * Q  # span keys, of which the first F can be far; query rows per group
        cos_g, sin_g = cos_g.to(dt), sin_g.to(dt)  # (n*Q, D)

        # Queries grouped by key/value head and step, each step's rows contiguous: (B, G, n, R, Q, D).
        # The far columns take them as they are; the near ones rotated to their positions. Without
        # autograd this is done step by step (_step_queries), on data that stays in cache.
        if keep_graph:
            q_far = q_g.to(dt).view(B, n, Q, G, R, D).permute(0, 3, 1, 4, 2, 5).contiguous()
            q_near = apply_rope(q_far, cos_g.view(n, 1, Q, D), sin_g.view(n, 1, Q, D))
            q_near, q_far = q_near.flatten(0, 1).flatten(2, 3), q_far.flatten(0, 1).flatten(2, 3)  # (BG, n, M, D)
        elif not native:
            q_steps = q_g.to(dt).view(B, n, Q, G, R, D)

        # The W-1 recent keys then the segment's own; step j's span is entries [j*Q, j*Q + S).
        k_g, v_g, z_g = k_g.to(dt).transpose(1, 2), v_g.to(dt).transpose(1, 2), z_g.long().transpose(1, 2)
        all_rk = torch.cat((buf_rk, apply_rope(k_g, cos_g * scale, sin_g * scale)), dim=2)  # (B, G, P + n*Q, D)
        k_far = k_g if key_means else _straight_through(k_g, z_g, codebook, t0, sinks)
        all_kq = torch.cat((buf_kq, apply_rope(k_far, far_cos, far_sin)), dim=2)
        all_v = torch.cat((buf_v, v_g), dim=2)  # (B, G, P + n*Q, Dv)
        all_z = torch.cat((buf_z, z_g), dim=2)  # (B, G, P + n*Q)
        n_new = min(n * Q, max(0, sinks - t0))  # sinks are read only once aggregated, so add them now
        sink_k = torch.cat((sink_k, k_g[:, :, :n_new].detach()), dim=2)
        sink_v = torch.cat((sink_v, v_g[:, :, :n_new].detach()), dim=2)

        # The steps work on batch and key/value heads flattened: (BG, ...).
        rk_bg, kq_bg, v_bg, z_bg = (x.flatten(0, 1) for x in (all_rk, all_kq, all_v, all_z))  # (BG, P + n*Q, ...)
        sink_k_bg = apply_rope(sink_k, far_cos, far_sin).flatten(0, 1)  # (BG, m, D)
        sink_v_bg = sink_v.flatten(0, 1)  # (BG, m, Dv)
        if native:  # the same steps, compiled (native.c)
            _native.run_segment(q=q_native, cos=cos_native, sin=sin_native, rk=rk_bg, kq=kq_bg, v=v_bg, z=z_bg,
                                codebook=codebook_bg, sink_k=sink_k_bg, sink_v=sink_v_bg,
                                stats=(counts, sums, log_counts, means), code_k=code_k, out=out, R=R, W=W,
                                Q=Q, n=n, seg_t0=t0, start=start, sinks=sinks,
                                bf16=bf16_products)  # fmt: skip
        else:
            for j in range(n):
                t_j, lo = t0 + j * Q, j * Q  # first position of the step, its span's start in the buffers
                n_sink = max(0, min(sinks, t_j - P))  # sinks far for the whole step (aggregated)
                mask_key = (Q, min(t_j, P), t_j % L)
                if mask_key not in masks:  # per query, repeated for the R heads of a group: rows (head, query)
                    bias = _span_bias(t_j, Q, W, dt, dev).repeat(R, 1)  # (M, S + F)
                    near_masks = [(slice(0, S), bias[:, :S])]
                    if t_j >= P and F < S - F:  # span columns F .. S-F-1 are near for every query: no mask
                        near_masks = [(slice(0, F), bias[:, :F]), (slice(S - F, S), bias[:, S - F : S])]
                    masks[mask_key] = (near_masks, bias[:, S:], _aggregated_pairs(t_j, Q, W, L, dev).repeat(R, 1))
                near_masks, far_bias, frozen = masks[mask_key]
                columns = (
                    rk_bg[:, lo : lo + S],  # (BG, S, D)
                    kq_bg[:, lo : lo + F],  # (BG, F, D)
                    codebook_bg,  # (BG, C, D)
                    sink_k_bg[:, :n_sink],  # (BG, m, D)
                    v_bg[:, lo : lo + S],  # (BG, S, Dv)
                    v_bg[:, lo : lo + F],  # (BG, F, Dv)
                )
                if key_means:
                    if keep_graph:
                        qn_j, qf_j = q_near[:, j], q_far[:, j]
                    else:
                        qn_j, qf_j = (x.clone() for x in _step_queries(q_steps[:, j], cos_g[lo : lo + Q],
                                                                        sin_g[lo : lo + Q], workspace))  # fmt: skip
                    far_is_sink = t_j - P + torch.arange(F, device=dev) < sinks
                    stats = (code_k, counts, log_counts, means)
                    if keep_graph:  # they are updated in place below: the graph keeps them as they are now
                        stats = tuple(x.clone() for x in stats)
                    o = _step_key_means(qn_j, qf_j, columns[0], columns[1], stats[0], columns[3], columns[4],
                                        columns[5], *stats[1:], sink_v_bg[:, :n_sink], z_bg[:, lo : lo + F],
                                        far_is_sink, near_masks, far_bias, frozen)  # fmt: skip
                    o = o.view(B, G, R, Q, Dv).permute(0, 3, 1, 2, 4)  # (B, Q, G, R, Dv)
                    if keep_graph:
                        pieces.append(o.reshape(B, Q, H, Dv))
                    else:
                        out[:, t_j - start : t_j - start + Q].view(B, Q, G, R, Dv).copy_(o)
                elif keep_graph:  # the means are saved for backward as they are now
                    stats = (log_counts, means.clone(), sink_v_bg[:, :n_sink])
                    o = _StepAttention.apply(q_near[:, j], q_far[:, j], *columns, *stats, near_masks, far_bias, frozen,
                                             workspace)  # fmt: skip
                    pieces.append(o.view(B, G, R, Q, Dv).permute(0, 3, 1, 2, 4).reshape(B, Q, H, Dv))
                else:
                    qn_j, qf_j = _step_queries(q_steps[:, j], cos_g[lo : lo + Q], sin_g[lo : lo + Q], workspace)
                    o, _ = _step_forward(qn_j, qf_j, *columns, log_counts, means, sink_v_bg[:, :n_sink], near_masks,
                                         far_bias, workspace, saved=False)  # fmt: skip
                    o = o.view(B, G, R, Q, Dv).permute(0, 3, 1, 2, 4)  # (B, Q, G, R, Dv)
                    out[:, t_j - start : t_j - start + Q].view(B, Q, G, R, Dv).copy_(o)

                # The step's first Q span keys leave the span for good: fold them (detached) into the
                # statistics. Padding before position 0 and sinks are never counted.
                first = lo + max(0, sinks - (t_j - P), P - t_j)
                z_out, v_out = z_bg[:, first : lo + Q], v_bg[:, first : lo + Q].detach()
                z_out_v = z_out[..., None].expand(-1, -1, Dv)
                counts.scatter_add_(1, z_out, ones[:, : z_out.shape[1]])
                sums.scatter_add_(1, z_out_v, v_out)
                if key_means:
                    code_k.scatter_add_(1, z_out[..., None].expand(-1, -1, D), kq_bg[:, first : lo + Q].detach())
                # only the codes of those keys changed (a code listed twice gets the same value twice)
                touched = counts.gather(1, z_out)
                log_counts.scatter_(1, z_out, touched.log())
                means.scatter_(1, z_out_v, sums.gather(1, z_out_v) / touched[..., None])

        buf_rk, buf_kq, buf_v, buf_z = (x[:, :, n * Q :] for x in (all_rk, all_kq, all_v, all_z))
        t0 += n * Q

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
        counts=counts.view(B, G, C),
        sums=sums.view(B, G, C, Dv),
    )
    if key_means:  # the pre-RoPE keys that left the span in this call join their codes' sums
        keys, key_codes = _folded_keys(state, k, codes, T, P, sinks)
        new_state.key_sums = state.key_sums.scatter_add(2, key_codes[..., None].expand(-1, -1, -1, D),
                                                        keys.to(state.key_sums.dtype))  # fmt: skip
    return out, new_state
