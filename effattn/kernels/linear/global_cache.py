"""The hybrid attention with a sparse global cache (LoLA): far keys the linear state would recall badly stay exact.

LoLA (McDermott, Heath, Parhi 2025, "LoLA: Low-Rank Linear Attention With Sparse Caching", arXiv:2505.23666)
adds a third memory to the LoLCATs hybrid (``naive.py``; read its docstring first): besides the sliding window
(exact softmax) and the linear state (every older key), a cache of at most ``capacity`` = G far keys per head,
also under exact softmax, holding the keys whose values the state predicts worst. Memory stays constant: the
window, the sinks, G keys and values per head and the state, whatever the sequence's length. It needs no
training: the maps and the mix are the hybrid's.

Semantics (this package's definition; LoLA's reference decides per chunk of its kernel, the same idea):
with window ``W >= 1`` and ``sinks = S``, the far keys ``s >= S`` leave the window in blocks of W positions,
block b holding positions ``S + bW .. S + (b+1)W - 1``. Block b is *decided* once its last key has left the
window, i.e. for every query ``t >= S + (b+2)W - 1``; so query t sees ``n_t = max(0, (t - S + 1) // W - 1)``
decided blocks. The decisions run in order, from an empty cache ``C_0`` and an empty state (``Sum_0 = 0``,
``z_0 = 0``). Decision b scores every candidate, the cache ``C_b`` and block b's keys, by its self-recall error
against the state before it,

    e_s = || v_s - (fk_s^T Sum_b) / (fk_s . z_b + eps) ||_2,

(the state read with the key's own feature vector as the query, as LoLA does), keeps the G largest in
``C_{b+1}`` and folds the others into the state: ``Sum_{b+1} = Sum_b + sum_losers fk_s v_s^T``, likewise z.
Query t then attends

* exactly (the softmax terms, with ``m_t`` their largest logit): the sinks ``s < S``, the window
  ``t - W < s <= t``, and the cache ``C_{n_t}``;
* linearly (``fq_t . fk_s``): every other key ``S <= s <= t``, i.e. the decided keys not in the cache (through
  the state ``Sum_{n_t}, z_{n_t}``) and the far keys of the blocks not yet decided (at most W - 1 of them);

under one normaliser with the per-head factors, as in ``naive.py``. ``capacity = 0`` is the hybrid itself. A key
in the cache can be pushed out later by a block whose keys the state recalls worse, and then joins the state.

The selection is a discrete choice: no gradient flows through the scores; through the selected keys and values,
and through the state, it does.

* :func:`global_cache_naive`: the quadratic reference: the decisions on whole-sequence tensors, then the
  masked [T, T] attention;
* :func:`global_cache_attention`: linear in T, and the decode step (one position continuing a state): queries in
  runs that see the same decided blocks (at most W), each over the sinks, the cache and the keys not yet
  decided, then the decision that ends the run. Plain PyTorch ops; autograd gives the backward.

Decoding with Hedgehog's maps (no autograd, float32 on the CPU) runs a compiled step instead, decisions included:
``decode.py``'s :class:`GlobalDecodeState` and ``native.c``'s ``global_decode``, tested against this kernel.
"""

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from effattn.kernels.linear.naive import check_hybrid_inputs, compute_dtype, head_weights


def check_capacity(capacity, window) -> None:
    """Raise ``ValueError`` unless ``capacity`` is an integer >= 0, and 0 where ``window`` is 0."""
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
        raise ValueError(f"capacity must be an integer >= 0, got {capacity!r}; pass the number of far keys per head "
                         f"kept exact (0: none).")
    if capacity and not window:
        raise ValueError(f"a global cache (capacity={capacity}) needs a window > 0: far keys leave the window in "
                         f"blocks of its size; pass window >= 1 or capacity=0.")


def decided_blocks(t: int, window: int, sinks: int) -> int:
    """How many far-key blocks query position t sees decided: ``max(0, (t - sinks + 1) // window - 1)``."""
    return max(0, (t - sinks + 1) // window - 1)


def recall_error(fk: Tensor, v: Tensor, S: Tensor, z: Tensor, eps: float) -> Tensor:
    """LoLA's self-recall error of keys [B, n, H, F] and values [B, n, H, Dv] against the state S [B, H, F, Dv],
    z [B, H, F]: ``|| v - fk^T S / (fk . z + eps) ||`` per key, [B, n, H], in the state's dtype."""
    fk, v = fk.to(S.dtype), v.to(S.dtype)
    num = torch.einsum("bnhf,bhfe->bnhe", fk, S)
    den = torch.einsum("bnhf,bhf->bnh", fk, z)
    return torch.linalg.vector_norm(v - num / (den + eps)[..., None], dim=-1)


@dataclass
class GlobalCacheState:
    """Everything needed to continue a sequence under `global_cache_attention`; constant in size.

    Attributes:
        seen: positions processed (the next query's position).
        window, sinks, capacity: the settings the state was built with. ``decided_blocks(seen, window, sinks)``
            far-key blocks are decided.
        S: [B, H, F, Dv] and z: [B, H, F]: the state of the decided keys not in the cache (float32 at least).
        sink_k, sink_v: [B, s, H, *], positions ``0 .. s - 1``, ``s = min(sinks, seen)``.
        cache_k, cache_v, cache_fk: [B, g, H, *], the global cache (g <= capacity; the same g for every head);
            cache_fk is None where the kernel is given the key map (``key_map``): the features of the cached keys are
            then computed again at each decision instead of stored (half a cached key's bytes with F = 2 x head_dim).
        cache_pos: [B, g, H], their positions.
        k, v, fk: [B, r, H, *], the keys not yet decided: positions ``sinks + n * window .. seen - 1`` with n the
            decided blocks (fewer than 2 * window of them).
    """

    seen: int
    window: int
    sinks: int
    capacity: int
    S: Tensor
    z: Tensor
    sink_k: Tensor
    sink_v: Tensor
    cache_k: Tensor
    cache_v: Tensor
    cache_fk: Tensor | None
    cache_pos: Tensor
    k: Tensor
    v: Tensor
    fk: Tensor

    def nbytes(self) -> int:
        """Total size of the state's tensors in bytes."""
        return sum(x.numel() * x.element_size() for x in (getattr(self, f.name) for f in fields(self))
                   if isinstance(x, Tensor))

    def detached(self) -> "GlobalCacheState":
        """The state with every tensor detached (a cache for generation, not for backpropagation)."""
        return replace(self, **{f.name: getattr(self, f.name).detach() for f in fields(self)
                                if isinstance(getattr(self, f.name), Tensor)})


def init_global_state(batch_size: int, heads: int, head_dim: int, value_dim: int, feature_dim: int, *, window: int,
                      sinks: int, capacity: int, dtype: torch.dtype = torch.float32,
                      device: torch.device | str | None = None, store_features: bool = True) -> GlobalCacheState:
    """The empty state (no position seen); ``dtype`` is the inputs' (S, z use float32 at least). Without
    ``store_features`` the cache keeps no feature keys (the kernel's ``key_map`` computes them)."""
    check_capacity(capacity, window)

    def empty(width: int) -> Tensor:
        return torch.zeros(batch_size, 0, heads, width, dtype=dtype, device=device)

    stats = compute_dtype(dtype)
    return GlobalCacheState(
        seen=0, window=window, sinks=sinks, capacity=capacity,
        S=torch.zeros(batch_size, heads, feature_dim, value_dim, dtype=stats, device=device),
        z=torch.zeros(batch_size, heads, feature_dim, dtype=stats, device=device),
        sink_k=empty(head_dim), sink_v=empty(value_dim),
        cache_k=empty(head_dim), cache_v=empty(value_dim), cache_fk=empty(feature_dim) if store_features else None,
        cache_pos=torch.zeros(batch_size, 0, heads, dtype=torch.long, device=device),
        k=empty(head_dim), v=empty(value_dim), fk=empty(feature_dim),
    )  # fmt: skip


def _check_state(state: GlobalCacheState, k: Tensor, v: Tensor, fk: Tensor, window: int, sinks: int,
                 capacity: int) -> None:
    if not isinstance(state, GlobalCacheState):
        raise ValueError(f"state must be a GlobalCacheState or None, got {type(state).__name__}; pass the state "
                         f"global_cache_attention returned for this sequence.")
    for name, want in (("window", window), ("sinks", sinks), ("capacity", capacity)):
        if getattr(state, name) != want:
            raise ValueError(f"The state was built with {name}={getattr(state, name)} but this call uses "
                             f"{name}={want}; continue a sequence with the settings that started it.")
    B, _, H, D = k.shape
    if state.k.shape[0] != B or state.k.shape[2] != H or state.S.shape[2:] != (fk.shape[3], v.shape[3]):
        raise ValueError(f"The state holds batch {state.k.shape[0]}, {state.k.shape[2]} heads and S of "
                         f"{tuple(state.S.shape[2:])}, these inputs need {B}, {H} and {(fk.shape[3], v.shape[3])}; "
                         f"pass the state returned for this sequence, batch and feature map.")


def _decide(state: GlobalCacheState, block: int, eps: float,
            key_map: Callable[[Tensor], Tensor] | None) -> GlobalCacheState:
    """Decision `block`: the cache and that block, the oldest W undecided keys, compete by self-recall error; the
    `capacity` largest stay, the others join the state. The cached keys' features come from the state, or from
    `key_map` where the state does not keep them."""
    W, G = state.window, state.capacity
    first = state.sinks + block * W  # the block's first position
    B, _, H, _ = state.k.shape
    block_pos = torch.arange(first, first + W, device=state.k.device).view(1, W, 1).expand(B, W, H)
    cand_k = torch.cat((state.cache_k, state.k[:, :W]), dim=1)  # [B, g + W, H, D]
    cand_v = torch.cat((state.cache_v, state.v[:, :W]), dim=1)
    stored = state.cache_fk is not None
    cache_fk = state.cache_fk if stored else key_map(state.cache_k).to(state.fk.dtype)
    cand_fk = torch.cat((cache_fk, state.fk[:, :W]), dim=1)
    cand_pos = torch.cat((state.cache_pos, block_pos), dim=1)  # [B, g + W, H]
    with torch.no_grad():
        score = recall_error(cand_fk.detach(), cand_v.detach(), state.S.detach(), state.z.detach(), eps)
        keep = score.topk(min(G, score.shape[1]), dim=1).indices.sort(dim=1).values  # [B, g', H], in candidate order
        lose = torch.ones_like(score, dtype=torch.bool).scatter_(1, keep, False)  # [B, g + W, H]
    dt = state.S.dtype
    gone = cand_fk.to(dt) * lose[..., None]  # the losers' feature keys, the others zeroed
    S = state.S + torch.einsum("bnhf,bnhe->bhfe", gone, cand_v.to(dt))
    z = state.z + gone.sum(1)

    def take(x: Tensor) -> Tensor:
        return x.gather(1, keep[..., None].expand(-1, -1, -1, x.shape[3]))

    return replace(state, S=S, z=z, cache_k=take(cand_k), cache_v=take(cand_v),
                   cache_fk=take(cand_fk) if stored else None, cache_pos=cand_pos.gather(1, keep), k=state.k[:, W:],
                   v=state.v[:, W:], fk=state.fk[:, W:])


def _run(q: Tensor, fq: Tensor, state: GlobalCacheState, t0: int, wf: Tensor, lf: Tensor, scale: float,
         eps: float) -> Tensor:
    """The outputs of the queries at positions t0 .. t0 + n - 1 (q [B, n, H, D], fq [B, n, H, F], in the compute
    dtype), which all see the blocks decided for t0, and whose keys the state already holds. [B, n, H, Dv]."""
    dt = q.dtype
    n, W, S0 = q.shape[1], state.window, state.sinks
    t = torch.arange(t0, t0 + n, device=q.device)[:, None]  # [n, 1]
    first = S0 + decided_blocks(t0, W, S0) * W  # the undecided keys' first position
    r_pos = torch.arange(first, first + state.k.shape[1], device=q.device)[None, :]  # [1, r]
    s_pos = torch.arange(state.sink_k.shape[1], device=q.device)[None, :]  # [1, s]
    g = state.cache_k.shape[1]
    exact = torch.cat((s_pos <= t, torch.ones(n, g, dtype=torch.bool, device=q.device),
                       (r_pos <= t) & (r_pos > t - W)), dim=1)  # [n, s + g + r]
    keys = torch.cat((state.sink_k, state.cache_k, state.k), dim=1).to(dt)  # [B, s + g + r, H, D]
    values = torch.cat((state.sink_v, state.cache_v, state.v), dim=1).to(dt)
    logits = torch.einsum("bthd,bshd->bhts", q, keys) * scale  # [B, H, n, s + g + r]
    logits = logits.masked_fill(~exact, float("-inf"))
    a = torch.exp(logits - logits.amax(-1, keepdim=True))  # every query has itself in its window: m_t finite
    far = (r_pos <= t - W).to(dt)  # [n, r]: undecided keys out of the window
    a_ln = torch.einsum("bthf,bshf->bhts", fq, state.fk.to(dt)) * far  # [B, H, n, r]
    w, l = wf[:, None, None], lf[:, None, None]  # noqa: E741
    num = (torch.matmul(a, values.transpose(1, 2)) * w + torch.matmul(a_ln, state.v.to(dt).transpose(1, 2)) * l
           + torch.einsum("bthf,bhfe->bhte", fq, state.S.to(dt)) * l)  # [B, H, n, Dv]
    den = a.sum(-1) * wf[:, None] + (a_ln.sum(-1) + torch.einsum("bthf,bhf->bht", fq, state.z.to(dt))) * lf[:, None]
    return (num / (den + eps)[..., None]).transpose(1, 2)  # [B, n, H, Dv]


def global_cache_attention(q: Tensor, k: Tensor, v: Tensor, fq: Tensor, fk: Tensor, *, window: int, sinks: int,
                           capacity: int, window_factor: Tensor | float, linear_factor: Tensor | float, scale: float,
                           eps: float = 1e-6, state: GlobalCacheState | None = None, return_state: bool = False,
                           key_map: Callable[[Tensor], Tensor] | None = None
                           ) -> Tensor | tuple[Tensor, GlobalCacheState]:
    """The hybrid with a global cache (module docstring), linear in T; continues ``state`` when given (one position
    after a cached prefix is the decode step). Arguments as `hybrid_attention_naive`'s, plus ``capacity`` (G >= 0,
    the far keys per head kept exact), ``state`` and ``key_map``: the feature map of the keys ([B, n, H, D] ->
    [B, n, H, F], what gave ``fk``); with it a new state keeps no feature keys for its cache and computes them at
    each decision (the same numbers, fewer bytes). Returns [B, T, H, Dv] in q's dtype (and the state after the T
    positions with ``return_state``)."""
    check_hybrid_inputs(q, k, v, fq, fk, window, window_factor, linear_factor, scale, eps, sinks)
    check_capacity(capacity, window)
    B, T, H, D = q.shape
    if state is None:
        state = init_global_state(B, H, D, v.shape[3], fq.shape[3], window=window, sinks=sinks, capacity=capacity,
                                  dtype=k.dtype, device=q.device, store_features=key_map is None)
    _check_state(state, k, v, fk, window, sinks, capacity)
    if state.cache_fk is None and key_map is None:
        raise ValueError("the state keeps no feature keys for its cache (it was built with a key_map); pass the same "
                         "key_map to continue it")
    in_dtype, dt = q.dtype, compute_dtype(q.dtype)
    wf, lf = head_weights(window_factor, H, dt, q.device), head_weights(linear_factor, H, dt, q.device)
    store = state.k.dtype
    outs, a = [], 0
    while a < T:
        t0 = state.seen
        decided = decided_blocks(t0, window, sinks)
        # the run: the queries that see as many decided blocks as t0 (up to the next decision)
        next_decision = sinks + (decided + 2) * window - 1
        e = a + min(T - a, max(next_decision - t0, 1))
        ks, vs, fks = k[:, a:e].to(store), v[:, a:e].to(store), fk[:, a:e].to(store)
        n_sink = min(max(sinks - t0, 0), e - a)  # positions of this run that are sinks
        state = replace(state, seen=t0 + e - a, sink_k=torch.cat((state.sink_k, ks[:, :n_sink]), 1),
                        sink_v=torch.cat((state.sink_v, vs[:, :n_sink]), 1), k=torch.cat((state.k, ks[:, n_sink:]), 1),
                        v=torch.cat((state.v, vs[:, n_sink:]), 1), fk=torch.cat((state.fk, fks[:, n_sink:]), 1))
        outs.append(_run(q[:, a:e].to(dt), fq[:, a:e].to(dt), state, t0, wf, lf, scale, eps))
        for block in range(decided, decided_blocks(state.seen, window, sinks)):  # the next query sees them decided
            state = _decide(state, block, eps, key_map)
        a = e
    out = (torch.cat(outs, 1) if len(outs) > 1 else outs[0]).to(in_dtype)
    return (out, state) if return_state else out


def global_cache_naive(q: Tensor, k: Tensor, v: Tensor, fq: Tensor, fk: Tensor, *, window: int, sinks: int,
                       capacity: int, window_factor: Tensor | float, linear_factor: Tensor | float, scale: float,
                       eps: float = 1e-6) -> Tensor:
    """The quadratic reference (module docstring): the decisions over whole-sequence tensors, then each query's
    exact and linear key sets as [T, T] masks. Arguments as `global_cache_attention`'s; [B, T, H, Dv]."""
    check_hybrid_inputs(q, k, v, fq, fk, window, window_factor, linear_factor, scale, eps, sinks)
    check_capacity(capacity, window)
    B, T, H, D = q.shape
    in_dtype, dt = q.dtype, compute_dtype(q.dtype)
    q, k, v, fq, fk = (x.to(dt) for x in (q, k, v, fq, fk))
    W, S0, G = window, sinks, capacity
    pos = torch.arange(T, device=q.device)
    # the decisions, in order: in_cache[b] is C_b as a [B, H, T] mask
    in_cache = [torch.zeros(B, H, T, dtype=torch.bool, device=q.device)]
    S = torch.zeros(B, H, fk.shape[3], v.shape[3], dtype=dt, device=q.device)
    z = torch.zeros(B, H, fk.shape[3], dtype=dt, device=q.device)
    for b in range(decided_blocks(T - 1, W, S0)):
        block = (pos >= S0 + b * W) & (pos < S0 + (b + 1) * W)  # [T]
        cand = in_cache[-1] | block  # [B, H, T]
        with torch.no_grad():
            score = recall_error(fk.detach(), v.detach(), S.detach(), z.detach(), eps).transpose(1, 2)  # [B, H, T]
            score = score.masked_fill(~cand, float("-inf"))
            keep = torch.zeros_like(cand).scatter_(-1, score.topk(min(G, int(cand[0, 0].sum())), -1).indices, True)
        lose = (cand & ~keep).to(dt).transpose(1, 2)[..., None]  # [B, T, H, 1]
        S = S + torch.einsum("bshf,bshe->bhfe", fk * lose, v)
        z = z + (fk * lose).sum(1)
        in_cache.append(keep & cand)
    n_t = [decided_blocks(t, W, S0) for t in range(T)]
    cached = torch.stack(in_cache)[torch.tensor(n_t, device=q.device)]  # [T, B, H, T]: C_{n_t} per query
    cached = cached.permute(1, 2, 0, 3)  # [B, H, T (query), T (key)]
    t, s = pos[:, None], pos[None, :]
    causal = s <= t
    exact = causal & ((s < S0) | (s > t - W) | cached)  # [B, H, T, T]
    linear = causal & (s >= S0) & ~exact
    logits = torch.einsum("bthd,bshd->bhts", q, k) * scale
    logits = logits.masked_fill(~exact, float("-inf"))
    a = torch.exp(logits - logits.amax(-1, keepdim=True))
    a_ln = torch.einsum("bthf,bshf->bhts", fq, fk) * linear
    wf, lf = head_weights(window_factor, H, dt, q.device), head_weights(linear_factor, H, dt, q.device)
    vh = v.transpose(1, 2)  # [B, H, T, Dv]
    num = torch.matmul(a, vh) * wf[:, None, None] + torch.matmul(a_ln, vh) * lf[:, None, None]
    den = a.sum(-1) * wf[:, None] + a_ln.sum(-1) * lf[:, None]
    return (num / (den + eps)[..., None]).transpose(1, 2).to(in_dtype)
