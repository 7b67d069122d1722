"""Sparse attention patterns as mask functions, a naive masked-softmax reference, and FlexAttention.

A pattern is a FlexAttention `mask_mod`, `mask(b, h, q, kv) -> bool` on position tensors: True where
query q may read key kv. Every pattern here is causal (kv <= q) and is the union of its parts:

  * window    (Mistral; StreamingLLM with sinks): q - kv < window, or kv < sinks.
  * longformer (Beltagy et al. 2020): a dilated sliding window of `window` keys spaced `dilation`
               apart ((q - kv) % dilation == 0 and q - kv < window * dilation), plus `global_tokens`
               first positions that read and are read by every position.
  * bigbird   (Zaheer et al. 2020), on blocks of `block` positions: the query's block and the
               `window_blocks - 1` before it, `global_blocks` first blocks (read by all, reading all),
               and `random_blocks` earlier blocks per query block drawn with `seed`.
  * strided   (Child et al. 2019, "Sparse Transformer"): the last `local` positions (default: the
               stride), and every position a multiple of `stride` back.

`dense_mask` evaluates a pattern on index grids: the reference every block mask is checked against.
`naive_attention` is the readable reference (scores, mask, softmax); `flex_attention_pattern` runs the
same through FlexAttention's block-sparse kernel (compiled: Inductor on the CPU, Triton on GPUs).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

PATTERNS = ("window", "longformer", "bigbird", "strided")


@dataclass(frozen=True)
class Pattern:
    """A named sparse pattern and its parameters (only those of `name` are read)."""

    name: str
    window: int = 256  # window, longformer: keys in the (dilated) window
    sinks: int = 0  # window: first positions every query reads
    dilation: int = 1  # longformer
    global_tokens: int = 0  # longformer
    block: int = 64  # bigbird
    window_blocks: int = 3  # bigbird: the query's block and the ones before it
    global_blocks: int = 1  # bigbird
    random_blocks: int = 2  # bigbird
    seed: int = 0  # bigbird
    stride: int = 128  # strided
    local: int | None = None  # strided: the local window (default: the stride)
    max_length: int = 1 << 17  # bigbird: the random-block table covers this many positions
    _tables: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self):
        if self.name not in PATTERNS:
            raise ValueError(f"unknown pattern {self.name!r}: one of {', '.join(PATTERNS)}")

    def settings(self) -> dict:
        """The parameters `name` reads, as recorded in config.json."""
        keys = {"window": ("window", "sinks"), "longformer": ("window", "dilation", "global_tokens"),
                "bigbird": ("block", "window_blocks", "global_blocks", "random_blocks", "seed"),
                "strided": ("stride", "local")}[self.name]
        values = asdict(self)
        return {"name": self.name, **{k: values[k] for k in keys}}

    def random_table(self, device) -> torch.Tensor:
        """bigbird: [blocks, blocks] bool, True where a query block reads a key block at random. Each
        query block draws `random_blocks` distinct earlier blocks outside its window and the global ones
        (all of them when fewer are left), from a generator seeded with `seed`: the same for every run."""
        key = str(device)
        if key not in self._tables:
            n = -(-self.max_length // self.block)
            table = torch.zeros(n, n, dtype=torch.bool)
            g = torch.Generator().manual_seed(self.seed)
            for qb in range(n):
                pool = torch.arange(self.global_blocks, max(self.global_blocks, qb - self.window_blocks + 1))
                if len(pool):
                    pick = pool[torch.randperm(len(pool), generator=g)[: self.random_blocks]]
                    table[qb, pick] = True
            self._tables[key] = table.to(device)
        return self._tables[key]

    def mask_mod(self, device="cpu", q_offset: int = 0) -> Callable:
        """FlexAttention's mask_mod for this pattern; query indices are shifted by `q_offset` (a chunk
        of queries after `q_offset` cached positions)."""
        name = self.name
        if name == "window":
            window, sinks = self.window, self.sinks

            def mask(b, h, q, kv):
                q = q + q_offset
                return (kv <= q) & ((q - kv < window) | (kv < sinks))
        elif name == "longformer":
            window, dilation, globals_ = self.window, self.dilation, self.global_tokens

            def mask(b, h, q, kv):
                q = q + q_offset
                d = q - kv
                local = (d < window * dilation) & (d % dilation == 0)
                return (kv <= q) & (local | (kv < globals_) | (q < globals_))
        elif name == "bigbird":
            block, wb, gb = self.block, self.window_blocks, self.global_blocks
            table = self.random_table(device)

            def mask(b, h, q, kv):
                q = q + q_offset
                qb, kb = q // block, kv // block
                return (kv <= q) & ((qb - kb < wb) | (kb < gb) | (qb < gb) | table[qb, kb])
        else:  # strided
            stride, local = self.stride, self.local or self.stride

            def mask(b, h, q, kv):
                q = q + q_offset
                d = q - kv
                return (kv <= q) & ((d < local) | (d % stride == 0))
        return mask

    def check(self, length: int | None = None) -> None:
        """Refuse parameters the pattern cannot use (ValueError naming the parameter)."""
        positive = {"window": ("window",), "longformer": ("window", "dilation"),
                    "bigbird": ("block", "window_blocks"), "strided": ("stride",)}[self.name]
        for key in positive:
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be at least 1 for {self.name}, got {getattr(self, key)}")
        if self.name == "strided" and self.local is not None and self.local < 1:
            raise ValueError(f"local must be at least 1, got {self.local}")
        if self.name == "bigbird" and length is not None and length > self.max_length:
            raise ValueError(f"bigbird's random blocks cover {self.max_length:,} positions, fewer than {length:,}")


def dense_mask(pattern: Pattern, q_len: int, kv_len: int | None = None, device="cpu") -> torch.Tensor:
    """[q_len, kv_len] bool: the pattern evaluated on index grids (queries are the last q_len positions)."""
    kv_len = q_len if kv_len is None else kv_len
    q = torch.arange(q_len, device=device)[:, None]
    kv = torch.arange(kv_len, device=device)[None]
    return pattern.mask_mod(device, q_offset=kv_len - q_len)(None, None, q, kv)


def density(pattern: Pattern, length: int, chunk: int = 2048) -> float:
    """Fraction of the causal (query, key) pairs the pattern keeps at `length` positions."""
    kept = 0
    kv = torch.arange(length)[None]
    mask = pattern.mask_mod()
    for a in range(0, length, chunk):
        q = torch.arange(a, min(a + chunk, length))[:, None]
        kept += int(mask(None, None, q, kv).sum())
    return kept / (length * (length + 1) / 2)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: Pattern, scale: float,
                    chunk: int = 1024) -> torch.Tensor:
    """The reference: q (B, H, Tq, D), k, v (B, G, Tk, D), rotated; queries are the last Tq positions.
    Scores, the pattern's mask, softmax (float32 or wider), in query chunks. -> (B, H, Tq, D)."""
    B, H, Tq, D = q.shape
    Tk, rep = k.shape[2], H // k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    kk = k.repeat_interleave(rep, 1).to(acc)
    vv = v.repeat_interleave(rep, 1).to(acc)
    out = q.new_empty(B, H, Tq, D)
    kv = torch.arange(Tk, device=q.device)[None]
    mask = pattern.mask_mod(q.device, q_offset=Tk - Tq)
    for a in range(0, Tq, chunk):
        rows = torch.arange(a, min(a + chunk, Tq), device=q.device)[:, None]
        scores = torch.einsum("bhqd,bhkd->bhqk", q[:, :, a : a + chunk].to(acc), kk) * scale
        scores = scores.masked_fill(~mask(None, None, rows, kv), -math.inf)
        out[:, :, a : a + chunk] = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), vv).to(q.dtype)
    return out


@functools.lru_cache(maxsize=32)
def block_mask(pattern: Pattern, q_len: int, kv_len: int, device: str = "cpu", block_size: int = 128):
    """FlexAttention's BlockMask of the pattern for these lengths (cached: building it reads every block)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(pattern.mask_mod(device, q_offset=kv_len - q_len), None, None, q_len, kv_len,
                             device=device, BLOCK_SIZE=block_size)


@functools.cache
def _compiled_flex():
    """flex_attention compiled for static shapes: one kernel per length (Inductor's CPU code for dynamic
    shapes fails to build in torch 2.13), and room for many lengths before dynamo gives up."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attention_pattern(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: Pattern, scale: float,
                           compiled: bool = True) -> torch.Tensor:
    """The pattern through FlexAttention's block-sparse kernel: q (B, H, Tq, D), k, v (B, G, Tk, D)."""
    from torch.nn.attention.flex_attention import flex_attention

    mask = block_mask(pattern, q.shape[2], k.shape[2], str(q.device))
    if not compiled:
        return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    with torch._dynamo.config.patch(recompile_limit=256, accumulated_recompile_limit=4096):
        return _compiled_flex()(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
