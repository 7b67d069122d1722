"""Rotary position embeddings in Hugging Face's rotate-half layout.

A RoPE table pair ``cos, sin`` of shape ``[T, D]`` holds, for every absolute position ``p`` and
frequency ``theta_i``, ``cos(p * theta_i)`` and ``sin(p * theta_i)`` with the ``D/2`` frequencies
repeated once (``[theta_0 .. theta_{D/2-1}, theta_0 .. theta_{D/2-1}]``), exactly what HF rotary
embedding modules return. Rotating by position ``p`` is then ``x * cos[p] + rotate_half(x) * sin[p]``,
and rotations compose: ``<rope(q, t), rope(k, s)> = <rope(q, t - s), k>``.
"""

import torch
from torch import Tensor


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` along the last dimension (the 90-degree turn of every pair)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (..., D) by the angles in ``cos, sin``, which must broadcast against ``x``."""
    return x * cos + rotate_half(x) * sin


def rope_tables(
    positions: Tensor | int,
    head_dim: int,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Default (unscaled) RoPE tables ``cos, sin`` of shape ``[len(positions), head_dim]``.

    ``positions`` is a 1-D tensor of absolute positions, or an int ``T`` for ``0 .. T-1``.
    Matches ``LlamaRotaryEmbedding`` with ``rope_type="default"``; models with scaled RoPE
    should pass their own tables to the kernels instead.
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dimension, got head_dim={head_dim}; use an even size.")
    if isinstance(positions, int):
        positions = torch.arange(positions)
    inv_freq = base ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (D/2,)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # (T, D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, D)
    return angles.cos().to(dtype), angles.sin().to(dtype)
