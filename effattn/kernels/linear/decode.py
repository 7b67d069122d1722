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
"""

from dataclasses import dataclass, fields

import torch
from torch import Tensor

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
