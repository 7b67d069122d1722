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
same through FlexAttention's block-sparse kernel (compiled: Inductor on the CPU, Triton on GPUs); the
strided pattern as two parts, each block-sparse in its own order (`strided_layout`).
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
                    chunk: int = 1024, left_pad: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: q (B, H, Tq, D), k, v (B, G, Tk, D), rotated; queries are the last Tq positions.
    Scores, the pattern's mask, softmax (float32 or wider), in query chunks. -> (B, H, Tq, D).
    `left_pad` (B,): each row's padding tokens in front (a batch of prompts of different lengths); the pattern
    then starts at each row's first real token, and no real query reads a padding key. A padding query reads
    itself alone (its output is never used, and a row with no key would be NaN)."""
    B, H, Tq, D = q.shape
    Tk, rep = k.shape[2], H // k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    kk = k.repeat_interleave(rep, 1).to(acc)
    vv = v.repeat_interleave(rep, 1).to(acc)
    out = q.new_empty(B, H, Tq, D)
    kv = torch.arange(Tk, device=q.device)[None]
    mask = pattern.mask_mod(q.device, q_offset=Tk - Tq)
    pad = None if left_pad is None else left_pad.to(q.device).view(B, 1, 1, 1)
    for a in range(0, Tq, chunk):
        rows = torch.arange(a, min(a + chunk, Tq), device=q.device)[:, None]
        scores = torch.einsum("bhqd,bhkd->bhqk", q[:, :, a : a + chunk].to(acc), kk) * scale
        if pad is None:
            keep = mask(None, None, rows, kv)
        else:  # positions counted from each row's first real token
            here = rows + (Tk - Tq)  # the queries' absolute indices
            real_q, real_kv = (here - pad).clamp(min=0), (kv - pad).clamp(min=0)
            keep = mask(None, None, real_q - (Tk - Tq), real_kv) & (kv >= pad) & (here >= pad)
            keep = keep | ((here < pad) & (kv == here))
        scores = scores.masked_fill(~keep, -math.inf)
        out[:, :, a : a + chunk] = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), vv).to(q.dtype)
    return out


def build_block_mask(mask_mod: Callable, q_len: int, kv_len: int, device="cpu", block_size: int = 128,
                     chunk_elements: int = 1 << 23):
    """FlexAttention's BlockMask of `mask_mod`, evaluated a few query blocks at a time.

    `create_block_mask` evaluates the mask on the whole (q_len, kv_len) grid at once (with int64
    temporaries: tens of GB at 32K); this reads at most `chunk_elements` pairs at a time and keeps one
    bit per block. A block is full (the kernel skips the mask) when every pair in it is kept and it is
    not a ragged tail block; partial when some are.
    """
    from torch.nn.attention.flex_attention import BlockMask

    n_q, n_kv = -(-q_len // block_size), -(-kv_len // block_size)
    partial = torch.zeros(n_q, n_kv, dtype=torch.bool, device=device)
    full = torch.zeros_like(partial)
    kv = torch.arange(n_kv * block_size, device=device)
    per_chunk = max(1, chunk_elements // (block_size * n_kv * block_size))
    for qb in range(0, n_q, per_chunk):
        rows = torch.arange(qb * block_size, min(qb + per_chunk, n_q) * block_size, device=device)
        inside = (rows[:, None] < q_len) & (kv[None] < kv_len)  # the tail blocks' padding reads nothing
        kept = mask_mod(None, None, rows.clamp(max=q_len - 1)[:, None], kv.clamp(max=kv_len - 1)[None]) & inside
        blocks = kept.view(-1, block_size, n_kv, block_size)
        any_, all_ = blocks.any(3).any(1), blocks.all(3).all(1)
        full[qb : qb + len(any_)] = all_
        partial[qb : qb + len(any_)] = any_ & ~all_

    def listed(table):  # (1, 1, n_q) counts and (1, 1, n_q, n_kv) block indices, the listed ones first
        order = torch.sort(table.to(torch.int8), dim=-1, descending=True, stable=True).indices
        return table.sum(-1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    return BlockMask.from_kv_blocks(*listed(partial), *listed(full), BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                    seq_lengths=(q_len, kv_len))


@functools.lru_cache(maxsize=32)
def block_mask(pattern: Pattern, q_len: int, kv_len: int, device: str = "cpu", block_size: int = 128):
    """FlexAttention's BlockMask of the pattern for these lengths (cached: building it reads every pair)."""
    return build_block_mask(pattern.mask_mod(device, q_offset=kv_len - q_len), q_len, kv_len, device, block_size)


@functools.cache
def _compiled_flex():
    """flex_attention compiled for static shapes: one kernel per length (Inductor's CPU code for dynamic
    shapes fails to build in torch 2.13), and room for many lengths before dynamo gives up."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(q, k, v, mask, scale: float, compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    kwargs = dict(block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if not compiled:
        return flex_attention(q, k, v, **kwargs)
    with torch._dynamo.config.patch(recompile_limit=256, accumulated_recompile_limit=4096):
        return _compiled_flex()(q, k, v, **kwargs)


@functools.lru_cache(maxsize=32)
def strided_layout(pattern: Pattern, q_len: int, kv_len: int, device: str = "cpu", block_size: int = 128):
    """The strided pattern as two disjoint parts, each block-sparse in its own order (Child et al.'s
    factorization), each with a copy of the diagonal to weigh one against the other.

    In text order the "every stride-th key" part touches every key block, so a block mask over it is
    dense. Its pairs share a residue (q = kv mod stride): with queries and keys reordered by (residue,
    position), each residue class is one contiguous run and the part is near block-diagonal. So:
      near: q - kv < local, in text order (a window);
      far:  q - kv >= local and (q - kv) % stride == 0, in residue order.
    Each part's keys are followed by a copy of every key that only its own position's query reads (the
    diagonal again): the part's softmax then weighs the copy by w0 / (Z + w0), with w0 the diagonal's
    weight and Z the part's normaliser, which is what merging two softmaxes needs (CPU FlexAttention
    returns no log-sum-exp when compiled).
    -> (q_order, k_order, q_inverse, near BlockMask, far BlockMask), over kv_len * 2 keys each.
    Queries are the last q_len positions.
    """
    stride, local = pattern.stride, pattern.local or pattern.stride
    offset = kv_len - q_len
    q_pos = torch.arange(offset, kv_len, device=device)
    k_pos = torch.arange(kv_len, device=device)
    q_order = torch.argsort(q_pos % stride * kv_len + q_pos)
    k_order = torch.argsort(k_pos % stride * kv_len + k_pos)
    qp, kp = q_pos[q_order], k_pos[k_order]

    def near(b, h, qi, ki):
        d = qi + offset - ki
        copy = ki - kv_len == qi + offset  # the diagonal's copy
        return torch.where(ki < kv_len, (d >= 0) & (d < local), copy)

    def far(b, h, qi, ki):
        qi = torch.clamp(qi, max=q_len - 1)
        real = torch.clamp(ki, max=kv_len - 1)
        d = qp[qi] - kp[real]
        copy = kp[torch.clamp(ki - kv_len, min=0, max=kv_len - 1)] == qp[qi]
        return torch.where(ki < kv_len, (d >= local) & (d % stride == 0), (ki >= kv_len) & copy)

    masks = [build_block_mask(m, q_len, 2 * kv_len, device, block_size) for m in (near, far)]
    return q_order, k_order, torch.argsort(q_order), *masks


def _strided(q, k, v, pattern: Pattern, scale: float, compiled: bool) -> torch.Tensor:
    """Both parts of `strided_layout` through FlexAttention, merged exactly by their weights relative to
    the diagonal. Float32 inside. Where a part gives the diagonal a weight below float32's range (a
    query whose own score is ~87 below its best), the reference runs instead."""
    q_order, k_order, q_inverse, near, far = strided_layout(pattern, q.shape[2], k.shape[2], str(q.device))
    acc = torch.promote_types(q.dtype, torch.float32)
    q32, k32, v32 = q.to(acc), k.to(acc), v.to(acc)
    zeros, ones = v32.new_zeros(*v32.shape[:-1], 1), v32.new_ones(*v32.shape[:-1], 1)
    values = torch.cat((torch.cat((v32, zeros), -1), torch.cat((torch.zeros_like(v32), ones), -1)), 2)

    def part(qq, kk, vv, mask):  # o = [A, w0] / (Z + w0) -> (A / w0, Z / w0, w0 / (Z + w0)) of the part
        o = _flex(qq, torch.cat((kk, kk), 2), vv, mask, scale, compiled)
        w = o[..., -1:]
        return o[..., :-1] / w, 1 / w - 1, w

    a_near, z_near, w_near = part(q32, k32, values, near)
    vo = torch.cat((values[:, :, : k.shape[2]][:, :, k_order], values[:, :, k.shape[2]:][:, :, k_order]), 2)
    a_far, z_far, w_far = part(q32[:, :, q_order], k32[:, :, k_order], vo, far)
    a_far, z_far, w_far = a_far[:, :, q_inverse], z_far[:, :, q_inverse], w_far[:, :, q_inverse]
    tiny = torch.finfo(acc).tiny
    if bool((w_near < 1e3 * tiny).any() or (w_far < 1e3 * tiny).any()):
        return naive_attention(q, k, v, pattern, scale)
    # the near part holds the diagonal itself (z_near counts it); the copies are not counted
    out = (a_near + a_far) / (z_near + z_far)
    return out.to(q.dtype)


def flex_attention_pattern(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: Pattern, scale: float,
                           compiled: bool = True) -> torch.Tensor:
    """The pattern through FlexAttention's block-sparse kernel: q (B, H, Tq, D), k, v (B, G, Tk, D).
    `strided` runs as its two block-sparse parts (`strided_layout`)."""
    if pattern.name == "strided":
        return _strided(q, k, v, pattern, scale, compiled)
    mask = block_mask(pattern, q.shape[2], k.shape[2], str(q.device))
    return _flex(q, k, v, mask, scale, compiled)
