"""Attention written out as plain tensor functions, matching transformers' modules exactly.

The calibrated conversions need what the library modules hide: per-head queries, keys, values and
attention outputs of one layer. These functions compute them from a layer's weights (in the
`LayerAttention` roles) for every supported family (biases, Qwen3's per-head q/k RMSNorm); tests
check them against transformers' own attention modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import rope


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, h, d]; cos, sin: [B or 1, T, d] (one table for every head) -> RoPE'd x (HF rotate-half layout)."""
    return rope.apply_rope(x, cos[:, :, None], sin[:, :, None])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 like transformers' RMSNorm modules."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _linear(x, w, b):
    return F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))


def project_qkv(h: torch.Tensor, attn, head_dim: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h: [B, T, D] (after the input norm) -> q [B, T, H, d], k [B, T, G, d], v [B, T, G, d], before RoPE
    (after the per-head q/k norms where the family has them)."""
    B, T, _ = h.shape
    q = _linear(h, attn.q, attn.q_bias).view(B, T, -1, head_dim)  # (B, T, H, d)
    k = _linear(h, attn.k, attn.k_bias).view(B, T, -1, head_dim)  # (B, T, G, d)
    v = _linear(h, attn.v, attn.v_bias).view(B, T, -1, head_dim)  # (B, T, G, d)
    if attn.q_norm is not None:
        q = rms_norm(q, attn.q_norm, eps)
    if attn.k_norm is not None:
        k = rms_norm(k, attn.k_norm, eps)
    return q, k, v


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention, causal, grouped: q [B, T, H, d] (RoPE'd), k/v [B, T, G, d] -> [B, T, H, d]."""
    H, G = q.shape[2], k.shape[2]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
        enable_gqa=H != G,
    )  # (B, H, T, d)
    return out.transpose(1, 2)


def attention_heads(h: torch.Tensor, attn, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, eps: float,
                    scale: float | None = None) -> torch.Tensor:
    """Per-head attention outputs [B, T, H, d] (before o_proj) of one layer for input h [B, T, D]."""
    q, k, v = project_qkv(h, attn, head_dim, eps)
    scale = head_dim**-0.5 if scale is None else scale
    return causal_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, scale)


def output_projection(heads: torch.Tensor, attn) -> torch.Tensor:
    """[B, T, H, d] -> [B, T, D] through o_proj."""
    return _linear(heads.flatten(2), attn.o, attn.o_bias)
