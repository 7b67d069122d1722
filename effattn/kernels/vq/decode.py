"""Transformer-VQ decoding: one token per call at the cost of one small attention, whatever the length.

``vq_attention_chunk`` continues any state with any number of positions, which makes a one-token
call pay for its generality: it re-rotates the W - 1 recent keys, the codebook and the sinks, rebuilds
the code columns from the statistics, pads and concatenates buffers, and rebuilds the state. For a
decode step none of that changes but one key, so :class:`VQDecodeState` keeps the step's operands
ready, in the layout the step reads them:

* ``keys`` (BG, W + C + m, D): the columns of one softmax. The first W rows hold ``rope(k_s) * scale``
  for the W positions of the window, in a ring (row ``s % W``), read by the rotated query; the next C
  rows a code's key rotated by -F and scaled (its codeword, or with ``key_means`` the mean of the far
  keys it holds) and the last m rows ``rope(sink, -F) * scale``, read by the unrotated query: ReRoPE's
  far position.
* ``bias`` (BG, 1, W + C + m): ``log(count)`` on the code columns (``-inf`` for empty codes), 0 elsewhere.
* ``values`` (BG, W + C + m, Dv): the window's values, each code's mean value, the sinks' values.

A step writes the new key and value into the ring, runs ``softmax(q K^T + bias) V`` (three batched
matrix products), and folds the key that leaves the window into its code: its count, and the code's
column (bias, mean value, mean key: moved by ``(x - mean) / count``, so no sums are kept beside the
means and the layout is about the size of the plain state). About twenty small operations per layer,
none of them proportional to the window, the codebook or the length beyond the two products.

The maths is ``vq_attention_chunk``'s for one query: at a state that has seen t positions, the query
at t reads t - W + 1 .. t exactly and everything older through its codes (sinks exact). The step
applies once every sink is older than the window (``seen >= sinks + window - 1``), which
:func:`can_decode` checks; before that, and for several positions at once, the chunk kernel runs
(``to_state`` gives it the plain :class:`VQState` back, ``from_state`` builds this one from it).
Inference only: no autograd, the codebook taken as fixed.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from effattn.kernels.rope import apply_rope
from effattn.kernels.vq.chunk import VQState
from effattn.kernels.vq.naive import compute_dtype

try:  # the compiled decode step; absent where this file is bundled as a model's remote code
    from effattn.kernels.vq import native as _native
except ImportError:
    _native = None

# native.c's finite stand-in for the -inf log count of an empty code (it is built with -ffast-math)
MASKED = -1e30


@dataclass
class VQDecodeState:
    """A :class:`VQState` held in the layout of a decode step (see the module docstring).

    Besides the step's operands it keeps what ``to_state`` needs to give the plain state back: the
    window's pre-RoPE keys, codes and RoPE rows (rings like ``keys``), the per-code counts, and the sinks.
    A code's statistics are held once, as the means in its column: a key that joins the code moves its mean
    value (and with ``key_means`` its turned, scaled mean key) by ``(x - mean) / count``, and ``to_state``
    gives the sums back as ``mean * count`` (the key turned back).
    """

    seen: int
    window: int
    sinks: int
    batch: int
    keys: Tensor  # (BG, W + C + m, D)
    bias: Tensor  # (BG, 1, W + C + m)
    values: Tensor  # (BG, W + C + m, Dv)
    ring_k: Tensor  # (BG, W, D) pre-RoPE keys, in the key dtype
    ring_z: Tensor  # (BG, W) their codes
    ring_cos: Tensor  # (W, D)
    ring_sin: Tensor  # (W, D)
    counts: Tensor  # (BG, C)
    key_means: bool  # the code rows of ``keys`` are their keys' means (else the codewords), turned by -F
    sink_k: Tensor  # (B, G, m, D) pre-RoPE
    sink_v: Tensor  # (B, G, m, Dv)
    far_cos: Tensor  # (D,) the scaled rotation by -F
    far_sin: Tensor
    scale: float
    rows: Tensor  # (BG,) arange, for per-row code indexing
    logits: Tensor  # (BG, R, W + C + m) the step's logits, reused
    work: Tensor | None = None  # the compiled step's scratch (native.py)
    native_args: tuple | None = None  # the compiled step's pointers to the buffers above
    native_sgemm: int | None = None  # and to the BLAS sgemm it calls

    def nbytes(self) -> int:
        """Total size of the tensors held, in bytes (constant in the length, like the plain state's; with
        key means about the same, the window ring's rotated keys and RoPE rows being the difference)."""
        return sum(x.numel() * x.element_size() for x in vars(self).values() if isinstance(x, Tensor))

    def to_state(self) -> VQState:
        """The plain state (``vq_attention_chunk``'s) of the same sequence."""
        W, B, t = self.window, self.batch, self.seen
        BG = self.keys.shape[0]
        G = BG // B
        order = torch.arange(t - W + 1, t, device=self.keys.device) % W  # the ring rows of the W - 1 recent positions

        def per_head(x: Tensor) -> Tensor:
            return x.reshape(B, G, *x.shape[1:])

        C = self.counts.shape[1]
        count = self.counts[..., None]
        key_sums = None
        if self.key_means:  # the code keys turned back by +F and unscaled: far_cos, far_sin turn by -F, scaled
            s2 = self.scale * self.scale
            key_sums = apply_rope(self.keys[:, W:W + C], self.far_cos / s2, -self.far_sin / s2) * count
        return VQState(
            seen=t,
            window=W,
            sinks=self.sinks,
            recent_k=per_head(self.ring_k[:, order]),
            recent_v=per_head(self.values[:, order]).to(self.sink_v.dtype),
            recent_codes=per_head(self.ring_z[:, order]),
            recent_cos=self.ring_cos[order],
            recent_sin=self.ring_sin[order],
            sink_k=self.sink_k,
            sink_v=self.sink_v,
            counts=per_head(self.counts).clone(),
            sums=per_head(self.values[:, W:W + C] * count),
            key_sums=per_head(key_sums) if self.key_means else None,
        )


def can_decode(state: "VQState | VQDecodeState | None", T: int) -> bool:
    """Whether a call of T positions continuing ``state`` can be a decode step."""
    if T != 1 or state is None:
        return False
    return isinstance(state, VQDecodeState) or state.seen >= state.sinks + state.window - 1


def from_state(state: VQState, codebook: Tensor, far_cos: Tensor, far_sin: Tensor, scale: float, heads: int,
               dtype: torch.dtype) -> VQDecodeState:  # fmt: skip
    """The decode layout of ``state`` (which must satisfy :func:`can_decode`): codebook (G, C, D),
    far_cos, far_sin (D,) the RoPE table at the far position, ``heads`` query heads H, ``dtype`` the
    query dtype (the step computes in its accumulation dtype)."""
    dt = compute_dtype(dtype)
    B, G, n, D = state.recent_k.shape
    W, C, m = state.window, codebook.shape[1], state.sink_k.shape[2]
    Dv = state.sums.shape[-1]
    BG, t, dev = B * G, state.seen, state.recent_k.device
    fc, fs = far_cos.to(dt) * scale, far_sin.to(dt) * -scale  # rotation by -F, scaled
    flat = lambda x: x.reshape(BG, *x.shape[2:])  # noqa: E731

    keys = torch.zeros(BG, W + C + m, D, dtype=dt, device=dev)
    values = torch.zeros(BG, W + C + m, Dv, dtype=dt, device=dev)
    bias = torch.zeros(BG, 1, W + C + m, dtype=dt, device=dev)
    slots = torch.arange(t - n, t, device=dev) % W  # ring rows of the recent positions
    ring_k = state.recent_k.new_zeros(BG, W, D)
    ring_z = torch.zeros(BG, W, dtype=torch.int64, device=dev)
    ring_cos, ring_sin = state.recent_cos.new_zeros(W, D), state.recent_sin.new_zeros(W, D)
    ring_k[:, slots], ring_z[:, slots] = flat(state.recent_k), flat(state.recent_codes)
    ring_cos[slots], ring_sin[slots] = state.recent_cos, state.recent_sin
    keys[:, slots] = apply_rope(flat(state.recent_k).to(dt), state.recent_cos.to(dt) * scale,
                                    state.recent_sin.to(dt) * scale)  # fmt: skip
    values[:, slots] = flat(state.recent_v).to(dt)

    counts, sums = flat(state.counts).to(dt).clone(), flat(state.sums).to(dt)
    if state.key_sums is not None:
        keys[:, W : W + C] = apply_rope(flat(state.key_sums).to(dt), fc, fs) / counts.clamp(min=1.0)[..., None]
    else:
        keys[:, W : W + C] = apply_rope(codebook.detach().to(dt), fc, fs).repeat(B, 1, 1)
    bias[:, 0, W : W + C] = counts.log().clamp(min=MASKED)
    values[:, W : W + C] = sums / counts.clamp(min=1.0)[..., None]
    keys[:, W + C :] = apply_rope(flat(state.sink_k).to(dt), fc, fs)
    values[:, W + C :] = flat(state.sink_v).to(dt)
    return VQDecodeState(
        seen=t, window=W, sinks=state.sinks, batch=B, keys=keys, bias=bias, values=values, ring_k=ring_k,
        ring_z=ring_z, ring_cos=ring_cos, ring_sin=ring_sin, counts=counts, key_means=state.key_sums is not None,
        sink_k=state.sink_k, sink_v=state.sink_v, far_cos=fc, far_sin=fs, scale=scale,
        rows=torch.arange(BG, device=dev), logits=torch.zeros(BG, heads // G, W + C + m, dtype=dt, device=dev),
    )  # fmt: skip


@torch.no_grad()
def vq_decode_step(q: Tensor, k: Tensor, v: Tensor, codes: Tensor, cos: Tensor, sin: Tensor,
                   state: VQDecodeState) -> tuple[Tensor, VQDecodeState]:  # fmt: skip
    """Attention of the one query at position ``state.seen``: q (B, 1, H, D) pre-RoPE, k (B, 1, G, D)
    pre-RoPE, v (B, 1, G, Dv), codes (B, 1, G), cos, sin (1, D) its RoPE row. Returns the output
    (B, 1, H, Dv) in q's dtype and ``state``, advanced in place by one position."""
    B, _, H, D = q.shape
    G = k.shape[2]
    W, t = state.window, state.seen
    BG, R = B * G, H // G
    if _native is not None and _native.decode_ready(state, q):  # the same step in C (native.c)
        out = _native.decode_step(state, q, k, v, codes, cos, sin)
        state.seen = t + 1
        return out, state
    dt = state.keys.dtype
    slot = t % W
    cos_t, sin_t = cos[0].to(dt), sin[0].to(dt)

    # the new key and value join the window (its ring row held position t - W, folded a step ago)
    k_t = k[:, 0].reshape(BG, D)
    state.keys[:, slot] = apply_rope(k_t.to(dt), cos_t * state.scale, sin_t * state.scale)
    state.values[:, slot] = v[:, 0].reshape(BG, -1)
    state.ring_k[:, slot] = k_t
    state.ring_z[:, slot] = codes[:, 0].reshape(BG)
    state.ring_cos[slot], state.ring_sin[slot] = cos[0], sin[0]

    q_t = q[:, 0].to(dt).view(B, G, R, D).reshape(BG, R, D)
    logits = state.logits
    torch.bmm(apply_rope(q_t, cos_t, sin_t), state.keys[:, :W].mT, out=logits[..., :W])
    torch.bmm(q_t, state.keys[:, W:].mT, out=logits[..., W:])
    probs = torch.softmax(logits.add_(state.bias), dim=-1)  # (BG, R, N)
    out = torch.bmm(probs, state.values)  # (BG, R, Dv)

    # position t - W + 1 leaves the window before the next query: it joins its code (never a sink here)
    leaving = (t + 1) % W
    rows, z = state.rows, state.ring_z[:, leaving]
    state.counts[rows, z] += 1.0
    count = state.counts[rows, z]
    state.bias[rows, 0, W + z] = count.log()  # a code that gains a key is no longer empty
    state.values[rows, W + z] += (state.values[:, leaving] - state.values[rows, W + z]) / count[:, None]
    if state.key_means:
        turned = apply_rope(state.ring_k[:, leaving].to(dt), state.far_cos, state.far_sin)
        state.keys[rows, W + z] += (turned - state.keys[rows, W + z]) / count[:, None]
    state.seen = t + 1
    return out.view(B, G * R, -1)[:, None].to(q.dtype), state
