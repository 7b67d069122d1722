"""Transformer-VQ attention with heavy hitters: a bounded set of far keys keeps its own logit and value.

Why: on SmolLM2 at W = 64 most of the codes' perplexity gap lies in single far keys that a query looks
for (identifiers copied from far back), which no summary of their code recovers; keeping the far keys
that have drawn the most attention exact closes a quarter to a third of it (BENCHMARKS.md, "Where W=64's
gap sits"). This module is that cache.

Semantics, per sequence and KV head, on top of ``naive.py``'s (read it first):

* near keys, ``0 <= t - s < W``: exact RoPE, as there;
* a far key, ``t - s >= W``, is *exact* while it is in the set E: it is scored as ReRoPE alone scores it,
  ``<rope(q_t, F), k_s>``, with its own value; otherwise it is *coded*: scored through its code, at the
  codeword or (``key_means``) at the mean of the coded keys that share the code, with the code's mean
  value, as in ``naive.py``;
* a key joins E when it leaves the window (query ``s + W`` is the first to read it as far);
* at every position ``tau`` that is a multiple of ``U = update``, before query ``tau``, E keeps the
  ``budget`` keys that have received the most attention so far; the others leave it for good, into their
  codes (the state's per-code count, value sum and key sum);
* the attention a key has received is the sum of its softmax weights over every query that has read it
  (in the window or from E), summed over the query heads of its KV head: H2O's accumulated attention
  score (Zhang et al. 2023), from the model's own attention. Ties keep the older key.

Between two cuts E holds at most ``budget + U`` keys, so a query reads at most ``W + budget + U`` keys
plus ``C`` codes: time is linear in the length and the state is constant in size. There are no sinks:
the first positions are heavy hitters wherever they draw attention.

The readable reference is :func:`vq_heavy_naive` (every pair materialised, one period of U queries at a
time); :func:`vq_heavy_chunk` computes the same with one column per code and a state that continues the
sequence across calls, down to one token per call, and is what models run for prefill (its periods in C,
``native.c``'s ``vq_heavy_segment``, for float32 inference where it is built); their one-token steps take
``heavy_decode.py``'s fixed layout (in C likewise), which computes the same.
Gradients: the keys and values of coded pairs are detached (the codes hold detached statistics, like the
chunk kernel's aggregated pairs); the choice of E is not differentiable; a state passed between calls is
detached.
"""

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from effattn.kernels.rope import apply_rope
from effattn.kernels.vq.decode import MASKED  # native.c's finite stand-in for -inf
from effattn.kernels.vq.naive import check_vq_inputs, compute_dtype

try:  # the compiled prefill; absent where this file is bundled as a model's remote code
    from effattn.kernels.vq import native as _native
except ImportError:
    _native = None


def _prologue(q, k, v, codebook, codes, cos, sin, far_cos, far_sin, window, update, budget, scale):
    """Check the inputs (as the plain kernels do, and the budget), then cast the float ones to the compute
    dtype. Returns (q, k, v, codebook, cos, sin, far_cos, far_sin) cast, the logit scale and q's dtype."""
    check_vq_inputs(q, k, v, codebook, codes, cos, sin, far_cos, far_sin, window, update, 0)
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"budget must be an integer >= 1 (far keys kept exact per KV head), got {budget!r}; "
                         "pass a positive number of keys, or use the plain VQ kernels for none.")
    dt = compute_dtype(q.dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return tuple(x.to(dt) for x in (q, k, v, codebook, cos, sin, far_cos, far_sin)), scale, q.dtype


def _rotated(q, k, cos, sin, far_cos, far_sin, scale):
    """(near queries, far queries, near keys): queries scaled, near ones at their positions, far ones at F."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return apply_rope(q, cos, sin) * scale, apply_rope(q, far_cos, far_sin) * scale, apply_rope(k, cos, sin)


def _keep_order(score: Tensor, budget: int) -> tuple[Tensor, Tensor]:
    """Indices (along the last dim) of the ``budget`` largest scores, ties to the lower index (the older
    key), in ascending order; and the indices of the rest."""
    order = torch.sort(-score, dim=-1, stable=True).indices
    return torch.sort(order[..., :budget], dim=-1).values, order[..., budget:]


@torch.no_grad()
def vq_heavy_naive(
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
    update: int,
    budget: int,
    scale: float | None = None,
    key_means: bool = False,
) -> Tensor:
    """Quadratic reference of heavy-hitter VQ attention (module docstring). Inference only.

    Arguments as :func:`effattn.kernels.vq.naive.vq_attention_naive`'s, with ``update`` (U, the period of
    E's cuts) and ``budget`` (E's size after a cut, per KV head). Returns (B, T, H, Dv) in q's dtype.
    """
    (q, k, v, codebook, cos, sin, far_cos, far_sin), scale, in_dtype = _prologue(
        q, k, v, codebook, codes, cos, sin, far_cos, far_sin, window, update, budget, scale)
    B, T, H, D = q.shape
    G, C, R, dt = k.shape[2], codebook.shape[1], H // k.shape[2], q.dtype
    q_near, q_far, k_near = _rotated(q, k, cos, sin, far_cos, far_sin, scale)

    def per_head(x):  # (B, T, H, D) -> (B, G, R, T, D)
        return x.reshape(B, T, G, R, -1).permute(0, 2, 3, 1, 4)

    q_near, q_far = per_head(q_near), per_head(q_far)
    kt, k_near, vt = (x.transpose(1, 2) for x in (k, k_near, v))  # (B, G, T, *)
    near = torch.einsum("bgrtd,bgsd->bgrts", q_near, k_near)  # (B, G, R, T, T)
    exact = torch.einsum("bgrtd,bgsd->bgrts", q_far, kt)
    z = codes.long().transpose(1, 2)  # (B, G, T)
    onehot = torch.nn.functional.one_hot(z, C).to(dt)  # (B, G, T, C)
    delta = torch.arange(T)[:, None] - torch.arange(T)[None, :]  # (T, T): query t, key s
    coded = torch.zeros(B, G, T, dtype=torch.bool)  # keys that have left E, into their codes
    score = torch.zeros(B, G, T, dtype=dt)  # attention received so far
    out = torch.empty(B, G, R, T, vt.shape[-1], dtype=dt)
    for tau in range(0, T, update):
        if tau:  # the cut before query tau: of the far keys still exact, the `budget` most attended stay
            exact_far = (torch.arange(T) <= tau - window) & ~coded  # (B, G, T), as many per head
            n = int(exact_far[0, 0].sum())
            if n > budget:
                cand = exact_far.nonzero()[:, 2].reshape(B, G, n)  # positions, ascending
                _, rest = _keep_order(score.gather(-1, cand), budget)
                coded.scatter_(-1, cand.gather(-1, rest), True)
        rows = slice(tau, min(T, tau + update))
        if key_means:  # every coded key is scored at its code's mean over the coded keys
            cnt = (coded.to(dt)[..., None] * onehot).sum(2)  # (B, G, C)
            mean = torch.einsum("bgtc,bgtd->bgcd", coded.to(dt)[..., None] * onehot, kt) / cnt.clamp(min=1)[..., None]
            code_key = mean.gather(2, z[..., None].expand(-1, -1, -1, D))  # (B, G, T, D)
        else:
            code_key = codebook[torch.arange(G)[None, :, None], z]  # (B, G, T, D)
        code_logit = torch.einsum("bgrtd,bgsd->bgrts", q_far[:, :, :, rows], code_key)
        dl = delta[rows]  # (Q, T)
        far = torch.where(coded[:, :, None, None, :], code_logit, exact[:, :, :, rows])
        logits = torch.where(dl < window, near[:, :, :, rows], far).masked_fill(dl < 0, float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # (B, G, R, Q, T)
        out[:, :, :, rows] = probs @ vt[:, :, None]
        score += probs.sum((2, 3))
    return out.permute(0, 3, 1, 2, 4).reshape(B, T, H, -1).to(in_dtype)


@dataclass
class HeavyState:
    """Everything needed to continue a sequence; constant in size (at most ``W - 1 + budget + U`` keys).

    Attributes (n = min(seen, W - 1) recent positions, m keys in E):
        seen: positions processed so far.
        window, update, budget: the settings the state was built with.
        recent_k, recent_rk: (B, G, n, D) the recent keys, pre-RoPE and rotated to their positions.
        recent_v: (B, G, n, Dv); recent_codes: (B, G, n); recent_score: (B, G, n) attention received.
        heavy_k: (B, G, m, D) pre-RoPE keys of E (oldest first); heavy_v (B, G, m, Dv); heavy_codes,
            heavy_score, heavy_pos (B, G, m): their codes, attention received and positions.
        counts (B, G, C), sums (B, G, C, Dv), key_sums (B, G, C, D) or None: the coded keys per code.
    """

    seen: int
    window: int
    update: int
    budget: int
    recent_k: Tensor
    recent_rk: Tensor
    recent_v: Tensor
    recent_codes: Tensor
    recent_score: Tensor
    heavy_k: Tensor
    heavy_v: Tensor
    heavy_codes: Tensor
    heavy_score: Tensor
    heavy_pos: Tensor
    counts: Tensor
    sums: Tensor
    key_sums: Tensor | None = None

    def nbytes(self) -> int:
        """Total size of the state's tensors in bytes."""
        return sum(x.numel() * x.element_size() for x in (getattr(self, f.name) for f in fields(self))
                   if isinstance(x, Tensor))


def _empty(B, G, C, D, Dv, dt, device, window, update, budget, key_means) -> HeavyState:
    z = lambda *shape, dtype=dt: torch.zeros(*shape, dtype=dtype, device=device)
    return HeavyState(0, window, update, budget, z(B, G, 0, D), z(B, G, 0, D), z(B, G, 0, Dv),
                      z(B, G, 0, dtype=torch.int64), z(B, G, 0), z(B, G, 0, D), z(B, G, 0, Dv),
                      z(B, G, 0, dtype=torch.int64), z(B, G, 0), z(B, G, 0, dtype=torch.int64), z(B, G, C),
                      z(B, G, C, Dv), z(B, G, C, D) if key_means else None)


def code_rows(state: HeavyState, codebook: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """The codes as rows of one softmax, per sequence and KV head (rows ``b * G + g``): their keys (BG, C, D)
    (the mean of the keys a code holds with key means, else its codeword), their mean values (BG, C, Dv) and
    their logit bias (BG, C): ``log(count)``, ``MASKED`` for an empty code. The compiled prefill's far block
    and the decode layout hold the codes so (``code_sums`` is the way back)."""
    B, G, C = state.counts.shape
    counts = state.counts.reshape(B * G, C).to(dtype)
    count = counts.clamp(min=1.0)[..., None]
    flat = lambda x: x.reshape(B * G, C, -1).to(dtype)  # noqa: E731
    keys = flat(state.key_sums) / count if state.key_sums is not None else codebook.detach().to(dtype).repeat(B, 1, 1)
    return keys, flat(state.sums) / count, counts.log().clamp(min=MASKED)


def code_sums(keys: Tensor, values: Tensor, counts: Tensor, key_means: bool, B: int) -> tuple[Tensor, Tensor | None]:
    """The state's (sums, key_sums), (B, G, C, *), from the code rows ``code_rows`` gives and their counts."""
    per_head = lambda x: (x * counts[..., None]).reshape(B, -1, *x.shape[1:])  # noqa: E731
    return per_head(values), per_head(keys) if key_means else None


def _fold(state: HeavyState, keep: Tensor, rest: Tensor) -> None:
    """Cut E to the indices ``keep``; the keys at ``rest`` go into their codes (detached). Out of place:
    a state handed back to a caller earlier is left as it was."""
    pick = lambda x, idx: x.gather(2, idx if x.dim() == 3 else idx[..., None].expand(-1, -1, -1, x.shape[-1]))
    z = state.heavy_codes.gather(2, rest)
    state.counts = state.counts.scatter_add(2, z, torch.ones_like(z, dtype=state.counts.dtype))
    per_code = lambda x: z[..., None].expand(-1, -1, -1, x.shape[-1])
    state.sums = state.sums.scatter_add(2, per_code(state.sums), pick(state.heavy_v, rest).detach())
    if state.key_sums is not None:
        state.key_sums = state.key_sums.scatter_add(2, per_code(state.key_sums), pick(state.heavy_k, rest).detach())
    for name in ("heavy_k", "heavy_v", "heavy_codes", "heavy_score", "heavy_pos"):
        setattr(state, name, pick(getattr(state, name), keep))


def vq_heavy_chunk(
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
    update: int,
    budget: int,
    scale: float | None = None,
    key_means: bool = False,
    state: HeavyState | None = None,
    return_state: bool = False,
):
    """Heavy-hitter VQ attention of T positions continuing ``state`` (module docstring), one period of U
    queries at a time, one column per code. cos, sin: (T, D) at the absolute positions ``state.seen ..``.

    Returns the output (B, T, H, Dv) in q's dtype, and with ``return_state`` also the state after it.
    """
    (q, k, v, codebook, cos, sin, far_cos, far_sin), scale, in_dtype = _prologue(
        q, k, v, codebook, codes, cos, sin, far_cos, far_sin, window, update, budget, scale)
    B, T, H, D = q.shape
    G, C, Dv, R, dt = k.shape[2], codebook.shape[1], v.shape[3], H // k.shape[2], q.dtype
    if state is None:
        state = _empty(B, G, C, D, Dv, dt, q.device, window, update, budget, key_means)
    elif (state.window, state.update, state.budget, state.key_sums is not None) != (window, update, budget, key_means):
        raise ValueError(f"The state was built with window={state.window}, update={state.update}, budget={state.budget}, "
                         f"key_means={state.key_sums is not None} but this call uses window={window}, update={update}, "
                         f"budget={budget}, key_means={key_means}; continue a sequence with the settings that started it.")
    elif state.counts.shape != (B, G, C):
        raise ValueError(f"state.counts has shape {tuple(state.counts.shape)} but these inputs need {(B, G, C)}; "
                         "pass the state returned for this sequence, batch and codebook.")
    else:
        state = HeavyState(**{f.name: getattr(state, f.name) for f in fields(state)})  # the caller's stays as it was
    keep_graph = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if (not keep_graph and in_dtype == dt == torch.float32 and q.device.type == "cpu" and _native is not None
            and _native.available()):  # the same periods, compiled (native.c)
        out, state = _chunk_native(q, k, v, codebook, codes, cos, sin, far_cos, far_sin, state, scale)
        return (out, state) if return_state else out
    # batch and KV heads flattened (BG), a KV head's query heads and queries the rows of one product
    heads_first = lambda x: x.reshape(B, -1, G, R, D).permute(0, 2, 3, 1, 4).reshape(B * G, R * x.shape[1], D)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, G, T, *)
    z = codes.long().transpose(1, 2)
    flat = lambda x: x.reshape(B * G, *x.shape[2:])
    outs = []  # per period; rotated copies are made period by period, so the working memory stays flat
    a = 0
    while a < T:
        t0 = state.seen
        if t0 and t0 % update == 0 and state.heavy_k.shape[2] > budget:  # the cut before query t0
            _fold(state, *_keep_order(state.heavy_score, budget))
        b = min(T, a + update - t0 % update)  # up to the next cut
        Q, n, m = b - a, state.recent_k.shape[2], state.heavy_k.shape[2]
        q_near, q_far, k_near = _rotated(q[:, a:b], k[:, :, a:b].transpose(1, 2), cos[a:b], sin[a:b], far_cos, far_sin,
                                         scale)
        qn, qf = heads_first(q_near), heads_first(q_far)  # (BG, R * Q, D), rows (head, query)
        span_k = torch.cat((state.recent_k, k[:, :, a:b]), 2)
        span_rk = torch.cat((state.recent_rk, k_near.transpose(1, 2)), 2)
        span_v = torch.cat((state.recent_v, v[:, :, a:b]), 2)
        span_z = torch.cat((state.recent_codes, z[:, :, a:b]), 2)
        if Q == 1 and n < window:  # one query (a decode step): every span key is near, none is masked
            l_span = qn @ flat(span_rk).mT
        else:
            delta = n + torch.arange(Q, device=q.device)[:, None] - torch.arange(n + Q, device=q.device)  # (Q, S)
            delta = delta.repeat(R, 1)  # (R * Q, S)
            l_span = torch.where(delta < window, qn @ flat(span_rk).mT, qf @ flat(span_k).mT)
            l_span = l_span.masked_fill(delta < 0, float("-inf"))
        count = state.counts.clamp(min=1)[..., None]
        code_k = state.key_sums / count if key_means else codebook[None].expand(B, -1, -1, -1)
        log_count = state.counts.log().masked_fill(state.counts == 0, float("-inf"))  # (B, G, C)
        l_heavy = qf @ flat(state.heavy_k).mT
        l_code = torch.baddbmm(flat(log_count)[:, None, :], qf, flat(code_k).mT)
        probs = torch.softmax(torch.cat((l_span, l_heavy, l_code), -1), dim=-1)  # (BG, R * Q, S + m + C)
        p_span, p_heavy, p_code = probs.split((n + Q, m, C), dim=-1)
        out = (p_span @ flat(span_v)).baddbmm_(p_heavy, flat(state.heavy_v)).baddbmm_(p_code, flat(state.sums / count))
        outs.append(out.view(B, G, R, Q, Dv))
        received = probs.detach()[..., : n + Q + m].reshape(B, G, R * Q, -1).sum(2)  # (B, G, S + m): attention received
        span_score = torch.cat((state.recent_score, received.new_zeros(B, G, Q)), 2) + received[..., : n + Q]
        heavy_score = state.heavy_score + received[..., n + Q: n + Q + m]
        # keys that leave the window for the next query (position <= b_abs - W) join E; the last W - 1 stay recent
        leave = max(0, n + Q - (window - 1))
        first = t0 - n  # position of span key 0
        state.heavy_k = torch.cat((state.heavy_k, span_k[:, :, :leave]), 2)
        state.heavy_v = torch.cat((state.heavy_v, span_v[:, :, :leave]), 2)
        state.heavy_codes = torch.cat((state.heavy_codes, span_z[:, :, :leave]), 2)
        state.heavy_score = torch.cat((heavy_score, span_score[:, :, :leave]), 2)
        pos = torch.arange(first, first + leave, device=q.device).expand(B, G, leave)
        state.heavy_pos = torch.cat((state.heavy_pos, pos), 2)
        state.recent_k, state.recent_rk, state.recent_v, state.recent_codes, state.recent_score = (
            x[:, :, leave:] for x in (span_k, span_rk, span_v, span_z, span_score))
        state.seen = t0 + Q
        a = b
    out = torch.cat(outs, 3).permute(0, 3, 1, 2, 4).reshape(B, T, H, Dv).to(in_dtype)
    if not return_state:
        return out
    for f in fields(state):
        x = getattr(state, f.name)
        if isinstance(x, Tensor):
            setattr(state, f.name, x.detach())
    return out, state


def _chunk_native(q, k, v, codebook, codes, cos, sin, far_cos, far_sin, state: HeavyState, scale: float):
    """``vq_heavy_chunk``'s periods in C (``native.c``'s ``vq_heavy_segment``), float32 inference: the state is
    laid out in the buffers the C loop updates (the span of recent and new keys, E and the codes in one far
    block whose code rows hold means, not sums), and read back after. Returns (out, state)."""
    B, T, H, D = q.shape
    G, C, Dv = k.shape[2], codebook.shape[1], v.shape[3]
    W, U, budget = state.window, state.update, state.budget
    BG, P, S = B * G, budget + U, W - 1 + U
    n0, m0, key_means = state.recent_k.shape[2], state.heavy_k.shape[2], state.key_sums is not None
    flat = lambda x: x.reshape(BG, *x.shape[2:])  # noqa: E731

    def rows(n, x, dtype=torch.float32):  # (BG, n, *) zeros, x's rows first
        buf = torch.zeros(BG, n, *x.shape[3:], dtype=dtype)
        buf[:, : x.shape[2]] = flat(x)
        return buf

    span = (rows(S, state.recent_k), rows(S, state.recent_rk), rows(S, state.recent_v),
            rows(S, state.recent_codes, torch.int64), rows(S, state.recent_score))  # fmt: skip
    counts = flat(state.counts).clone()
    fk, fv, fb = torch.zeros(BG, P + C, D), torch.zeros(BG, P + C, Dv), torch.zeros(BG, P + C)
    fk[:, :m0], fv[:, :m0] = flat(state.heavy_k), flat(state.heavy_v)
    fk[:, P:], fv[:, P:], fb[:, P:] = code_rows(state, codebook, torch.float32)
    fb[:, m0:P] = MASKED
    heavy = (rows(P, state.heavy_codes, torch.int64), rows(P, state.heavy_pos, torch.int64), rows(P, state.heavy_score))
    out = q.new_empty(B, T, H, Dv)
    m = _native.heavy_segment(
        q=q, k=k, v=v, z=codes.long(), cos=cos, sin=sin, far_cos=far_cos, far_sin=far_sin, span=span, far=(fk, fv, fb),
        heavy=heavy, counts=counts, out=out, t0=state.seen, m0=m0, n0=n0, window=W, update=U, budget=budget, scale=scale,
        key_means=key_means)  # fmt: skip
    n = min(W - 1, n0 + T)
    per_head = lambda x, n: x[:, :n].reshape(B, G, n, *x.shape[2:]).clone()  # noqa: E731
    sums, key_sums = code_sums(fk[:, P:], fv[:, P:], counts, key_means, B)
    return out, HeavyState(
        seen=state.seen + T, window=W, update=U, budget=budget,
        recent_k=per_head(span[0], n), recent_rk=per_head(span[1], n), recent_v=per_head(span[2], n),
        recent_codes=per_head(span[3], n), recent_score=per_head(span[4], n),
        heavy_k=per_head(fk, m), heavy_v=per_head(fv, m), heavy_codes=per_head(heavy[0], m),
        heavy_pos=per_head(heavy[1], m), heavy_score=per_head(heavy[2], m),
        counts=counts.reshape(B, G, C), sums=sums, key_sums=key_sums,
    )  # fmt: skip
