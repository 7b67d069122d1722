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


class FullState:
    """The cache of the exact heads' full attention: every rotated key and value so far, (B, G, seen, D)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    @property
    def seen(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


def full_attention(q, k, v, cos, sin, scale: float, state: FullState | None = None):
    """The original attention of a RoPE model: q (B, T, H, D), pre-RoPE k, v (B, T, G, D) at absolute
    positions state.seen .. (cos, sin (T, D)), causal over the cached keys and these. Returns the
    output (B, T, H, D) and the state holding every key and value (detached, like `VQState`).
    `effattn.attention.functional.causal_attention` with a cache; written here because this module
    is bundled as remote code with the kernels only (functional.py is not)."""
    B, T, H, D = q.shape
    G = k.shape[2]
    qr = apply_rope(q, cos[:, None], sin[:, None]).transpose(1, 2)  # (B, H, T, D)
    kr = apply_rope(k, cos[:, None], sin[:, None]).transpose(1, 2)  # (B, G, T, D)
    vt = v.transpose(1, 2)
    past = 0 if state is None else state.seen
    if state is not None:
        kr, vt = torch.cat((state.k, kr), 2), torch.cat((state.v, vt), 2)
    # query t (absolute past + t) reads keys 0 .. past + t
    mask = torch.arange(past + T, device=q.device)[None, :] <= torch.arange(past, past + T, device=q.device)[:, None]
    out = F.scaled_dot_product_attention(qr, kr, vt, attn_mask=mask, scale=scale, enable_gqa=H != G)
    return out.transpose(1, 2), FullState(kr.detach(), vt.detach())
