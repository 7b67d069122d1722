"""Heavy-hitter VQ decoding: one token per call in a fixed layout, as ``decode.py`` does for plain VQ.

(Names here differ from ``decode.py``'s: a model's bundled remote code puts both modules in one namespace.)

``vq_heavy_chunk`` continues a :class:`~effattn.kernels.vq.heavy.HeavyState` with any number of
positions, and for one token it pays for that generality: it concatenates the span, the exact set E and
the codes anew, rebuilds the code columns from the statistics and the state from slices. Here one
decode step touches one key. :class:`HeavyDecodeState` keeps, per sequence and KV head (rows
``bg = b * G + g``), the columns of one softmax in three blocks of ``N = W + P + C`` rows:

* ``keys[:, :W]``: the window, ``rope(k_s)`` at the key's position, in a ring (row ``s % W``), read by the
  query rotated to its position;
* ``keys[:, W:W + P]``: E, the exact far keys (pre-RoPE), oldest first in rows ``W .. W + m``; P =
  budget + update is the most E holds (just before a cut); unused rows are masked;
* ``keys[:, W + P:]``: the codes' keys (the codeword, or with ``key_means`` the mean of the keys the
  code holds); E and the codes are read by the query rotated to the far position F (ReRoPE's), so no key
  is ever rotated twice;
* ``bias`` (BG, 1, N): 0 on the window and on E's live rows, ``MASKED`` on its unused ones, ``log(count)``
  on the codes (``MASKED`` for an empty code); ``values`` (BG, N, Dv) the window's and E's values and
  each code's mean value;
* ``score`` (BG, W + P): the attention each key of the window and of E has received (H2O's score).

The code columns hold means, not sums: a key that joins its code moves the code's mean value (and mean
key) by ``(x - mean) / count``, and ``to_state`` gives the sums back as ``mean * count``. So the layout
holds each code's statistics once, and is about the size of the plain state with E full (``nbytes``).

A step (the maths of ``vq_heavy_chunk`` for one query; read ``heavy.py`` first):

1. at a cut (``t % update == 0`` and E holds more than ``budget`` keys) E keeps its ``budget`` keys of
   highest score (ties to the older) in order, and the rest go into their codes for good;
2. the new key and value take the window's ring row; one softmax over the N columns; the output;
3. every window and E column adds its probability, summed over the KV head's query heads, to its score;
4. the key at ``t - W + 1`` leaves the window: it is appended to E with its score.

The step applies once the window is full (``seen >= W - 1``, :func:`heavy_can_decode`); before that, and for
several positions at once, ``vq_heavy_chunk`` runs (``to_state`` gives it the plain state back,
``heavy_from_state`` builds this one). Float32 on the CPU runs the same step in C (``native.c``'s
``vq_heavy_decode``) when it is built. Inference only: no autograd.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from effattn.kernels.rope import apply_rope
from effattn.kernels.vq.heavy import HeavyState, _keep_order, code_rows, code_sums
from effattn.kernels.vq.decode import MASKED  # native.c's finite stand-in for -inf (it is built with -ffast-math)
from effattn.kernels.vq.naive import compute_dtype

try:  # the compiled step; absent where this file is bundled as a model's remote code
    from effattn.kernels.vq import native as _native
except ImportError:
    _native = None


@dataclass
class HeavyDecodeState:
    """A :class:`HeavyState` in the layout of a decode step (module docstring); constant in size."""

    seen: int
    window: int
    update: int
    budget: int
    batch: int
    m: int  # keys in E, the same for every row (the cuts depend on positions only)
    scale: float
    keys: Tensor  # (BG, N, D): window (rotated), E (pre-RoPE), codes (pre-RoPE)
    bias: Tensor  # (BG, 1, N)
    values: Tensor  # (BG, N, Dv)
    score: Tensor  # (BG, W + P)
    ring_k: Tensor  # (BG, W, D) the window's pre-RoPE keys
    ring_z: Tensor  # (BG, W) their codes
    heavy_z: Tensor  # (BG, P) E's codes
    heavy_pos: Tensor  # (BG, P) E's positions
    counts: Tensor  # (BG, C)
    key_means: bool  # the code rows of ``keys`` are the means of their keys (else the codewords)
    far_cos: Tensor  # (D,) the RoPE row at the far position F
    far_sin: Tensor
    logits: Tensor  # (BG, R, N) the step's logits, reused
    work: Tensor | None = None  # the compiled step's scratch (native.py)
    native_args: tuple | None = None  # the compiled step's pointers to the buffers above

    @property
    def slots(self) -> int:
        """P: rows reserved for E."""
        return self.budget + self.update

    def nbytes(self) -> int:
        """Total size of the tensors held, in bytes."""
        return sum(x.numel() * x.element_size() for x in vars(self).values() if isinstance(x, Tensor))

    def to_state(self) -> HeavyState:
        """The :class:`HeavyState` of the same sequence (``vq_heavy_chunk``'s)."""
        W, P, m, t, B = self.window, self.slots, self.m, self.seen, self.batch
        BG = self.keys.shape[0]
        G = BG // B
        order = torch.arange(t - W + 1, t, device=self.keys.device) % W  # ring rows of the W - 1 recent keys
        per_head = lambda x: x.reshape(B, G, *x.shape[1:]).clone()  # noqa: E731
        heavy = slice(W, W + m)
        return HeavyState(
            seen=t, window=W, update=self.update, budget=self.budget,
            recent_k=per_head(self.ring_k[:, order]), recent_rk=per_head(self.keys[:, order]),
            recent_v=per_head(self.values[:, order]), recent_codes=per_head(self.ring_z[:, order]),
            recent_score=per_head(self.score[:, order]),
            heavy_k=per_head(self.keys[:, heavy]), heavy_v=per_head(self.values[:, heavy]),
            heavy_codes=per_head(self.heavy_z[:, :m]), heavy_score=per_head(self.score[:, heavy]),
            heavy_pos=per_head(self.heavy_pos[:, :m]), counts=per_head(self.counts),
            **dict(zip(("sums", "key_sums"), code_sums(self.keys[:, W + P:], self.values[:, W + P:], self.counts,
                                                       self.key_means, B))),
        )  # fmt: skip


def heavy_can_decode(state: "HeavyState | HeavyDecodeState | None", T: int) -> bool:
    """Whether a call of T positions continuing ``state`` can be a decode step."""
    if T != 1 or state is None:
        return False
    return isinstance(state, HeavyDecodeState) or state.seen >= state.window - 1


def heavy_from_state(state: HeavyState, codebook: Tensor, far_cos: Tensor, far_sin: Tensor, scale: float, heads: int,
               dtype: torch.dtype) -> HeavyDecodeState:  # fmt: skip
    """The decode layout of ``state`` (which must satisfy :func:`heavy_can_decode`): codebook (G, C, D), far_cos,
    far_sin (D,) the RoPE row at the far position, ``heads`` query heads, ``dtype`` the query dtype."""
    dt = compute_dtype(dtype)
    B, G, n, D = state.recent_k.shape
    W, U, budget, t, m = state.window, state.update, state.budget, state.seen, state.heavy_k.shape[2]
    C, Dv, P = codebook.shape[1], state.sums.shape[-1], budget + state.update
    key_means = state.key_sums is not None
    BG, dev = B * G, state.recent_k.device
    if n != W - 1 or m > P:
        raise ValueError(f"the decode layout needs a full window (W - 1 = {W - 1} recent keys, got {n}) and at most "
                         f"{P} keys in E (got {m}); run vq_heavy_chunk until then")
    flat = lambda x: x.reshape(BG, *x.shape[2:]).to(dt)  # noqa: E731
    N = W + P + C
    keys = torch.zeros(BG, N, D, dtype=dt, device=dev)
    values = torch.zeros(BG, N, Dv, dtype=dt, device=dev)
    bias = torch.zeros(BG, 1, N, dtype=dt, device=dev)
    score = torch.zeros(BG, W + P, dtype=dt, device=dev)
    ring_k = torch.zeros(BG, W, D, dtype=dt, device=dev)
    ring_z = torch.zeros(BG, W, dtype=torch.int64, device=dev)
    slots = torch.arange(t - n, t, device=dev) % W
    keys[:, slots], values[:, slots], score[:, slots] = flat(state.recent_rk), flat(state.recent_v), flat(state.recent_score)
    ring_k[:, slots], ring_z[:, slots] = flat(state.recent_k), state.recent_codes.reshape(BG, n)
    keys[:, W:W + m], values[:, W:W + m], score[:, W:W + m] = (flat(state.heavy_k), flat(state.heavy_v),
                                                                  flat(state.heavy_score))
    bias[:, 0, W + m:W + P] = MASKED
    heavy_z = torch.zeros(BG, P, dtype=torch.int64, device=dev)
    heavy_pos = torch.zeros(BG, P, dtype=torch.int64, device=dev)
    heavy_z[:, :m], heavy_pos[:, :m] = state.heavy_codes.reshape(BG, m), state.heavy_pos.reshape(BG, m)
    out = HeavyDecodeState(
        seen=t, window=W, update=U, budget=budget, batch=B, m=m, scale=scale, keys=keys, bias=bias, values=values,
        score=score, ring_k=ring_k, ring_z=ring_z, heavy_z=heavy_z, heavy_pos=heavy_pos,
        counts=flat(state.counts).clone(), key_means=key_means,  # updated in place: the caller's stays
        far_cos=far_cos.to(dt).contiguous(), far_sin=far_sin.to(dt).contiguous(),
        logits=torch.zeros(BG, heads // G, N, dtype=dt, device=dev),
    )  # fmt: skip
    keys[:, W + P:], values[:, W + P:], bias[:, 0, W + P:] = code_rows(state, codebook, dt)
    return out


def _cut(state: HeavyDecodeState) -> None:
    """E keeps its ``budget`` keys of highest score (ties to the older), in order; the rest join their codes."""
    W, m, budget = state.window, state.m, state.budget
    keep, rest = _keep_order(state.score[:, W:W + m], budget)  # (BG, budget), (BG, m - budget)
    rows = torch.arange(state.keys.shape[0], device=keep.device)[:, None]
    z = state.heavy_z[rows, rest]
    P, at = state.slots, (rows.expand_as(z), z)
    # every buffer changes in place: the compiled step keeps pointers to them
    state.counts.index_put_(at, torch.ones_like(z, dtype=state.counts.dtype), accumulate=True)
    count = state.counts.clamp(min=1.0)[..., None]
    for x in (state.values,) + ((state.keys,) if state.key_means else ()):  # a code's mean moves to its new keys
        codes = x[:, W + P:]
        moved = torch.zeros_like(codes).index_put_(at, x[rows, W + rest] - codes[rows, z], accumulate=True)
        codes += moved / count
    state.bias[:, 0, W + P:] = state.counts.log().clamp(min=MASKED)
    for x, off in ((state.keys, W), (state.values, W), (state.score, W), (state.heavy_z, 0), (state.heavy_pos, 0)):
        x[:, off:off + budget] = x[rows, off + keep]
    state.bias[:, 0, W + budget:W + state.slots] = MASKED
    state.m = budget


@torch.no_grad()
def vq_heavy_decode_step(q: Tensor, k: Tensor, v: Tensor, codes: Tensor, cos: Tensor, sin: Tensor,
                         state: HeavyDecodeState) -> tuple[Tensor, HeavyDecodeState]:  # fmt: skip
    """Attention of the one query at position ``state.seen``: q (B, 1, H, D) pre-RoPE, k (B, 1, G, D)
    pre-RoPE, v (B, 1, G, Dv), codes (B, 1, G), cos, sin (1, D) its RoPE row. Returns the output
    (B, 1, H, Dv) in q's dtype and ``state``, advanced in place by one position."""
    B, _, H, D = q.shape
    G = k.shape[2]
    BG, R = B * G, H // G
    W, P, t = state.window, state.slots, state.seen
    if _native is not None and _native.heavy_decode_ready(state, q):  # the same step in C
        out = _native.heavy_decode_step(state, q, k, v, codes, cos, sin)
        state.seen = t + 1
        return out, state
    dt = state.keys.dtype
    if t % state.update == 0 and state.m > state.budget:
        _cut(state)
    slot = t % W
    k_t = k[:, 0].reshape(BG, D).to(dt)
    state.keys[:, slot] = apply_rope(k_t, cos[0].to(dt), sin[0].to(dt))
    state.values[:, slot] = v[:, 0].reshape(BG, -1)
    state.ring_k[:, slot], state.ring_z[:, slot], state.score[:, slot] = k_t, codes[:, 0].reshape(BG), 0.0
    q_t = q[:, 0].to(dt).reshape(BG, R, D) * state.scale
    logits = state.logits
    torch.bmm(apply_rope(q_t, cos[0].to(dt), sin[0].to(dt)), state.keys[:, :W].mT, out=logits[..., :W])
    torch.bmm(apply_rope(q_t, state.far_cos, state.far_sin), state.keys[:, W:].mT, out=logits[..., W:])
    probs = torch.softmax(logits.add_(state.bias), dim=-1)  # (BG, R, N)
    out = torch.bmm(probs, state.values)  # (BG, R, Dv)
    state.score += probs[..., :W + P].sum(1)
    # position t - W + 1 leaves the window before the next query: it joins E
    leaving, j = (t + 1) % W, W + state.m
    state.keys[:, j], state.values[:, j], state.score[:, j] = (state.ring_k[:, leaving], state.values[:, leaving],
                                                               state.score[:, leaving])
    state.heavy_z[:, state.m], state.heavy_pos[:, state.m] = state.ring_z[:, leaving], t - W + 1
    state.bias[:, 0, j] = 0.0
    state.m += 1
    state.seen = t + 1
    return out.view(B, H, -1)[:, None].to(q.dtype), state
