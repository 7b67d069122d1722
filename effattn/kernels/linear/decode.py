"""Decoding the hybrid attention one token per call with nothing but the step's arithmetic.

``hybrid_attention_step`` (recurrent.py) is the readable step: it concatenates the new key to the
window, slices the oldest one off, and builds a new state, about thirty small PyTorch operations per
layer and token, plus RoPE and the two feature maps before it. In a decoding loop those operations,
not the arithmetic, are most of the attention's time. :class:`LinearDecodeState` holds the same state
in the layout of a decode step, updated in place:

* ``ring_k``, ``ring_v``, ``ring_fk`` (B, H, W, *): the window's rotated keys, values and feature keys
  in a ring, position ``p`` in slot ``p % W``. When position ``t`` arrives, its slot holds position
  ``t - W``, exactly the key that leaves the window: it is folded into ``S``, ``z`` and overwritten;
* ``S`` (B, H, F, Dv) and ``z`` (B, H, F): the linear state of every older key;
* ``sink_k``, ``sink_v`` (B, H, sinks, *): with sinks, slot p holds position p once it has left the window.

The order of the window's keys does not matter to a softmax, so the ring computes
``hybrid_attention_step``'s output up to float rounding. The step itself is ``native.c``'s
``linear_decode``: RoPE, Hedgehog's maps (or features the caller computed), the fold, the window's
softmax and the linear read, in one call per layer. Inference only (no autograd), float32 on the CPU;
``from_state`` and ``to_state`` convert from and to the plain :class:`HybridState`, so a chunked
prefill can continue a decoded sequence.

:class:`GlobalDecodeState` does the same for the hybrid with LoLA's global cache (``global_cache.py``): the ring
and the sinks as above, the cache in fixed slots, and the far keys not yet decided in a pending block; the step
(``native.c``'s ``global_decode``, Hedgehog maps) also makes the block decisions, so a decoded token is one call per
layer there too. ``from_global_state`` and ``GlobalDecodeState.to_state`` convert from and to
:class:`GlobalCacheState`.
"""

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from effattn.kernels.linear.global_cache import GlobalCacheState, decided_blocks
from effattn.kernels.linear.recurrent import HybridState

try:  # the compiled step; absent where this file is bundled as a model's remote code
    from effattn.kernels.linear import native as _native
except ImportError:
    _native = None


@dataclass
class LinearDecodeState:
    """A :class:`HybridState` in a decode step's layout (module docstring); ``seen`` as there."""

    seen: int
    window: int
    ring_k: Tensor  # (B, H, W, D) rotated keys
    ring_v: Tensor  # (B, H, W, Dv)
    ring_fk: Tensor  # (B, H, W, F)
    S: Tensor  # (B, H, F, Dv)
    z: Tensor  # (B, H, F)
    work: Tensor  # the step's scratch
    sinks: int = 0
    sink_k: Tensor | None = None  # (B, H, sinks, D)
    sink_v: Tensor | None = None  # (B, H, sinks, Dv)

    def _sinks_out(self) -> int:
        """Sinks that have left the window (held in sink slots 0 .. s - 1)."""
        return min(self.sinks, max(self.seen - self.window, 0))

    def nbytes(self) -> int:
        """The state's bytes (the scratch excluded), as :meth:`HybridState.nbytes` counts them."""
        n, s = min(self.seen, self.window), self._sinks_out()
        return (sum(x[:, :, :n].nbytes for x in (self.ring_k, self.ring_v, self.ring_fk)) + self.S.nbytes
                + self.z.nbytes + sum(x[:, :, :s].nbytes for x in (self.sink_k, self.sink_v) if x is not None))

    def _slots(self) -> Tensor:
        """Ring slots of the window's positions seen - n .. seen - 1, oldest first."""
        n = min(self.seen, self.window)
        return (torch.arange(self.seen - n, self.seen) % max(self.window, 1)).to(self.ring_k.device)

    def to_state(self) -> HybridState:
        """The plain state (window oldest first, [B, n, H, *]); copies, shares nothing with the ring."""
        slots = self._slots()
        k, v, fk = (x[:, :, slots].transpose(1, 2).contiguous() for x in (self.ring_k, self.ring_v, self.ring_fk))
        s = self._sinks_out()
        sink_k, sink_v = ((x[:, :, :s].transpose(1, 2).contiguous() for x in (self.sink_k, self.sink_v)) if self.sinks
                          else (None, None))  # fmt: skip
        return HybridState(seen=self.seen, window=self.window, S=self.S.clone(), z=self.z.clone(), k=k, v=v, fk=fk,
                           sinks=self.sinks, sink_k=sink_k, sink_v=sink_v)


def from_state(state: HybridState) -> LinearDecodeState:
    """``state`` in the ring layout (new buffers; ``state`` is left as it was)."""
    B, n, H, D = state.k.shape
    W, Dv, F, NS = state.window, state.v.shape[-1], state.fk.shape[-1], state.sinks
    ring = [x.new_zeros(B, H, W, x.shape[-1]) for x in (state.k, state.v, state.fk)]
    sinks = [x.new_zeros(B, H, NS, x.shape[-1]) for x in (state.k, state.v)]
    decode = LinearDecodeState(seen=state.seen, window=W, ring_k=ring[0], ring_v=ring[1], ring_fk=ring[2],
                               S=state.S.detach().clone().contiguous(), z=state.z.detach().clone().contiguous(),
                               work=torch.empty(_native.work_floats(D, F, W, NS) if _native else 0),
                               sinks=NS, sink_k=sinks[0], sink_v=sinks[1])  # fmt: skip
    slots = decode._slots()
    for buffer, x in zip(ring, (state.k, state.v, state.fk)):
        buffer[:, :, slots] = x.detach().transpose(1, 2).to(buffer.dtype)
    s = state.sink_k.shape[1]
    for buffer, x in zip(sinks, (state.sink_k, state.sink_v)):
        buffer[:, :, :s] = x.detach().transpose(1, 2).to(buffer.dtype)
    return decode


def can_decode(state, q: Tensor, *tensors: Tensor) -> bool:
    """Whether the compiled step can advance ``state`` (a HybridState or LinearDecodeState) for the one
    query ``q`` [B, 1, H, D]: no autograd, float32 on the CPU, the library built."""
    if state is None or q.shape[1] != 1 or torch.is_grad_enabled() or _native is None:
        return False
    dtypes = {x.dtype for x in (q, state.S, state.z, *tensors) if x is not None}
    return dtypes == {torch.float32} and q.device.type == "cpu" and _native.available()


def decode_step(state: LinearDecodeState, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
                window_factors: Tensor, **settings) -> Tensor:  # fmt: skip
    """``native.decode_step`` (read it): one position through the compiled step, ``state`` advanced in
    place; call it where :func:`can_decode` holds."""
    return _native.decode_step(state, q, k, v, cos, sin, window_factors, **settings)


@dataclass
class GlobalDecodeState:
    """A :class:`GlobalCacheState` in the layout of ``native.c``'s ``global_decode`` (read its comment); updated in
    place. ``seen``, ``window``, ``sinks``, ``capacity`` as there. ``decided_blocks(seen, window, sinks)`` blocks are
    decided, the first undecided far key is at ``first()``, and the cache's first ``cached`` rows are filled."""

    seen: int
    window: int
    sinks: int
    capacity: int
    ring_k: Tensor  # (B, H, W, D) rotated keys, position p in slot p % W
    ring_v: Tensor  # (B, H, W, Dv)
    ring_fk: Tensor  # (B, H, W, F)
    S: Tensor  # (B, H, F, Dv) the decided keys not cached
    z: Tensor  # (B, H, F)
    sink_k: Tensor  # (B, H, sinks, D), slot p: position p once it has left the ring
    sink_v: Tensor  # (B, H, sinks, Dv)
    cache_k: Tensor  # (B, H, capacity, D), rows 0 .. cached - 1 filled
    cache_v: Tensor  # (B, H, capacity, Dv)
    cache_pos: Tensor  # (B, H, capacity) int64
    pend_k: Tensor  # (B, H, W, D): the far keys not yet decided, position first() + i in slot i
    pend_v: Tensor  # (B, H, W, Dv)
    pend_fk: Tensor  # (B, H, W, F)
    work: Tensor  # the step's scratch

    @property
    def cached(self) -> int:
        """Rows of the cache in use (the same for every head): each decision adds a block of W, at most capacity."""
        return min(self.capacity, decided_blocks(self.seen, self.window, self.sinks) * self.window)

    def first(self) -> int:
        """The first undecided far key's position."""
        return self.sinks + decided_blocks(self.seen, self.window, self.sinks) * self.window

    def _pending(self) -> int:
        """Undecided far keys in the pending block: positions first() .. seen - W - 1 (seen - W is still in the
        ring)."""
        return max(0, self.seen - self.window - self.first())

    def nbytes(self) -> int:
        """The state's bytes as :meth:`GlobalCacheState.nbytes` counts them for the same state (the cache's feature
        keys not stored, the scratch and empty slots excluded)."""
        item = self.ring_k.element_size()
        D, Dv, F = self.ring_k.shape[-1], self.ring_v.shape[-1], self.ring_fk.shape[-1]
        rows = self.ring_k.shape[0] * self.ring_k.shape[1]  # B x H
        sinks, undecided = min(self.sinks, self.seen), max(0, self.seen - self.first())
        per_row = sinks * (D + Dv) * item + self.cached * ((D + Dv) * item + 8) + undecided * (D + Dv + F) * item
        return rows * per_row + self.S.nbytes + self.z.nbytes

    def to_state(self) -> GlobalCacheState:
        """The plain state ([B, n, H, *] tensors, cache_fk None: a key map continues it); copies, shares nothing."""
        W, NS, first = self.window, self.sinks, self.first()

        def rows(x: Tensor, index: list[int]) -> Tensor:
            return x[:, :, torch.tensor(index, dtype=torch.long, device=x.device)].transpose(1, 2).contiguous()

        def where(p: int) -> tuple[str, int]:  # a position's slot: in the ring, or left it
            return ("ring", p % W) if p >= self.seen - W else ("out", p)

        sink = [where(p) for p in range(min(NS, self.seen))]
        sink_k, sink_v = (torch.cat([rows(r if at == "ring" else s, [i]) for at, i in sink], 1) if sink
                          else r.new_zeros(r.shape[0], 0, r.shape[1], r.shape[3])
                          for r, s in ((self.ring_k, self.sink_k), (self.ring_v, self.sink_v)))  # fmt: skip
        npend, ring = self._pending(), [p % W for p in range(max(first, self.seen - W), self.seen)]
        pairs = ((self.pend_k, self.ring_k), (self.pend_v, self.ring_v), (self.pend_fk, self.ring_fk))
        k, v, fk = (torch.cat((rows(pend, list(range(npend))), rows(r, ring)), 1) for pend, r in pairs)
        g = self.cached
        return GlobalCacheState(seen=self.seen, window=W, sinks=NS, capacity=self.capacity, S=self.S.clone(),
                                z=self.z.clone(), sink_k=sink_k, sink_v=sink_v,
                                cache_k=self.cache_k[:, :, :g].transpose(1, 2).contiguous(),
                                cache_v=self.cache_v[:, :, :g].transpose(1, 2).contiguous(), cache_fk=None,
                                cache_pos=self.cache_pos[:, :, :g].transpose(1, 2).contiguous(), k=k, v=v, fk=fk)


def from_global_state(state: GlobalCacheState) -> GlobalDecodeState:
    """``state`` in the step's layout (new buffers; ``state`` is left as it was). Its cached keys' feature keys, if
    it holds them, are not kept: the step computes them with the key map, which must be the map that gave them."""
    B, _, H, D = state.k.shape
    W, NS, C, seen = state.window, state.sinks, state.capacity, state.seen
    Dv, F = state.v.shape[-1], state.fk.shape[-1]
    dtype, device = state.k.dtype, state.k.device

    def zeros(*shape: int) -> Tensor:
        return torch.zeros(B, H, *shape, dtype=dtype, device=device)

    decode = GlobalDecodeState(
        seen=seen, window=W, sinks=NS, capacity=C, ring_k=zeros(W, D),
        ring_v=zeros(W, Dv), ring_fk=zeros(W, F), S=state.S.detach().clone().contiguous(),
        z=state.z.detach().clone().contiguous(), sink_k=zeros(NS, D), sink_v=zeros(NS, Dv), cache_k=zeros(C, D),
        cache_v=zeros(C, Dv), cache_pos=torch.zeros(B, H, C, dtype=torch.long, device=device), pend_k=zeros(W, D),
        pend_v=zeros(W, Dv), pend_fk=zeros(W, F),
        work=torch.empty(_native.global_work_floats(D, Dv, F, W, NS, C) if _native else 0))  # fmt: skip
    first = decode.first()
    for p in range(max(0, seen - W), seen):  # the ring: sinks, undecided keys (a decided one is never read again)
        if p < NS:
            decode.ring_k[:, :, p % W], decode.ring_v[:, :, p % W] = state.sink_k[:, p], state.sink_v[:, p]
        elif p >= first:
            for buffer, x in ((decode.ring_k, state.k), (decode.ring_v, state.v), (decode.ring_fk, state.fk)):
                buffer[:, :, p % W] = x[:, p - first]
    s, npend, g = state.sink_k.shape[1], decode._pending(), decode.cached
    copies = ((decode.sink_k[:, :, :s], state.sink_k), (decode.sink_v[:, :, :s], state.sink_v),
              (decode.pend_k[:, :, :npend], state.k[:, :npend]), (decode.pend_v[:, :, :npend], state.v[:, :npend]),
              (decode.pend_fk[:, :, :npend], state.fk[:, :npend]), (decode.cache_k[:, :, :g], state.cache_k),
              (decode.cache_v[:, :, :g], state.cache_v), (decode.cache_pos[:, :, :g], state.cache_pos))
    for buffer, x in copies:
        buffer.copy_(x.detach().transpose(1, 2))
    return decode


def global_decode_step(state: GlobalDecodeState, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
                       window_factors: Tensor, **settings) -> Tensor:  # fmt: skip
    """``native.global_decode_step`` (read it): one position with the global cache through the compiled step,
    ``state`` advanced in place; call it where :func:`can_decode` holds and the maps are Hedgehog's."""
    return _native.global_decode_step(state, q, k, v, cos, sin, window_factors, **settings)
