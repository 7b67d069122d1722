"""Exact heads: KV heads of an effattn model that keep the original model's attention (full RoPE softmax
over every key, a cache that grows with the sequence) while the layer's other heads use the cheaper
attention. Shared by the VQ model (`vq_exact_heads`) and the linear model (`linear_exact_heads`), whose
conversions choose the heads their attention changes most on calibration text.

This module imports nothing from effattn but the RoPE kernel, so it is bundled into those models'
`modeling_*.py` for `trust_remote_code=True`.
"""

import torch
import torch.nn.functional as F

from effattn.kernels.rope import apply_rope


def exact_heads_of(pairs, layer_idx: int, kv_heads: int, key: str) -> list[int]:
    """Layer `layer_idx`'s KV heads among `pairs` ([layer, KV head] pairs, the config's `key`), sorted."""
    exact = sorted({int(g) for layer, g in (pairs or []) if int(layer) == layer_idx})
    if any(not 0 <= g < kv_heads for g in exact):
        raise ValueError(f"{key} names KV head {exact[-1]} of layer {layer_idx}, which has {kv_heads}")
    return exact


def head_rows(heads, groups: int, device=None) -> torch.Tensor:
    """The query heads that read the KV heads `heads` (query head h reads KV head h // groups)."""
    return torch.tensor([g * groups + r for g in heads for r in range(groups)], dtype=torch.long, device=device)


# Room a FullState reserves when an append outgrows it: this share of the keys it then holds (at least
# FULL_RESERVE_MIN positions), so a decode copies its keys once per ~1/8 more tokens, not at every token.
FULL_RESERVE_SHARE, FULL_RESERVE_MIN = 8, 256


class FullState:
    """The cache of the exact heads' full attention: every rotated key and value so far, `k` and `v`
    (B, G, seen, D), views of buffers with room to grow. An inference step appends in place (the state
    advances, as the decode states of the kernels do); a step under autograd makes a new state."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self._k, self._v, self.seen = k, v, k.shape[2]

    @property
    def k(self) -> torch.Tensor:
        return self._k[:, :, : self.seen]

    @property
    def v(self) -> torch.Tensor:
        return self._v[:, :, : self.seen]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> "FullState":
        """Add T rotated keys and values (B, G, T, D) in place, growing the buffers when full; returns self."""
        need = self.seen + k.shape[2]
        if need > self._k.shape[2]:
            room = max(FULL_RESERVE_MIN, need // FULL_RESERVE_SHARE)
            grow = lambda buf: torch.cat((buf[:, :, : self.seen], buf.new_empty(*buf.shape[:2], need - self.seen + room,
                                                                                  buf.shape[3])), 2)  # noqa: E731
            self._k, self._v = grow(self._k), grow(self._v)
        self._k[:, :, self.seen : need] = k
        self._v[:, :, self.seen : need] = v
        self.seen = need
        return self

    def nbytes(self) -> int:
        """The bytes the buffers hold, the room to grow included."""
        return self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size()


def full_attention(q, k, v, cos, sin, scale: float, state: FullState | None = None):
    """The original attention of a RoPE model: q (B, T, H, D), pre-RoPE k, v (B, T, G, D) at absolute
    positions state.seen .. (cos, sin (T, D), or (B, T, D) for sequences at their own positions), causal
    over the cached keys and these. Returns the output (B, T, H, D) and the state holding every key and
    value (detached, like `VQState`; without autograd `state` itself, advanced in place).
    `effattn.attention.functional.causal_attention` with a cache; written here because this module is bundled
    as remote code with the kernels only (functional.py is not)."""
    B, T, H, D = q.shape
    G = k.shape[2]
    cos, sin = (t[:, None] if t.dim() == 2 else t[:, :, None] for t in (cos, sin))  # (T, 1, D) or (B, T, 1, D)
    qr = apply_rope(q, cos, sin).transpose(1, 2)  # (B, H, T, D)
    kr = apply_rope(k, cos, sin).transpose(1, 2)  # (B, G, T, D)
    vt = v.transpose(1, 2)
    past = 0 if state is None else state.seen
    if state is None:
        state = FullState(kr.detach(), vt.detach())
    elif torch.is_grad_enabled():  # gradients reach this call's keys: a new state, the old one unchanged
        kr, vt = torch.cat((state.k, kr), 2), torch.cat((state.v, vt), 2)
        state = FullState(kr.detach(), vt.detach())
    else:
        state = state.append(kr, vt)
        kr, vt = state.k, state.v
    # query t (absolute past + t) reads keys 0 .. past + t (every key when T is 1)
    mask = None if T == 1 else \
        torch.arange(past + T, device=q.device)[None, :] <= torch.arange(past, past + T, device=q.device)[:, None]
    out = F.scaled_dot_product_attention(qr, kr, vt, attn_mask=mask, scale=scale, enable_gqa=H != G)
    return out.transpose(1, 2), state
