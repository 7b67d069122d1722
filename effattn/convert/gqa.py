"""Grouped-query attention: change the number of KV heads (GQA, MQA, or back to MHA).

Notation (shapes per layer): H query heads, G KV heads before, N after, head_dim d, hidden size D.
HF lays the k/v projection out head-major: W_k [G*d, D], head g owning rows g*d:(g+1)*d, and query
head i reads KV head i // (H/G). After conversion query head i reads new head i // (H/N); the query
heads served by new head j are Q_j = [j*H/N, (j+1)*H/N).

Methods are registered in METHODS; `mean` is the GQA paper's initialisation (Ainslie et al. 2023,
Sec. 2: "mean-pool the key and value heads of each group"). Calibrated methods live beside it and
take the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import EffattnError, one_of
from ..families import AttentionShape, Family
from ..io.checkpoint import Checkpoint
from ..io.writer import SafetensorsWriter
from .base import Plan, kv_bytes_per_token, out_dtype, passthrough, same_specs

ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")


def query_groups(heads: int, kv_heads: int) -> list[range]:
    """Q_j for every KV head j: the query heads that read it."""
    per = heads // kv_heads
    return [range(j * per, (j + 1) * per) for j in range(kv_heads)]


def mean_mixing(heads: int, old_kv: int, new_kv: int) -> torch.Tensor:
    """M [N, G]: new head j = sum_g M[j, g] * old head g, weighted by how many of j's queries read g.

    For N dividing G this is the plain mean over each group of G/N heads; for N a multiple of G it
    copies each old head to N/G new ones (exact); in general it mean-pools the heads Q_j used.
    """
    mix = torch.zeros(new_kv, old_kv, dtype=torch.float64)
    old_per = heads // old_kv
    for j, queries in enumerate(query_groups(heads, new_kv)):
        for i in queries:
            mix[j, i // old_per] += 1.0 / len(queries)
    return mix


def mix_heads(w: torch.Tensor, mix: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Apply M [N, G] to a head-major tensor w [G*d, ...] -> [N*d, ...] (computed in float64)."""
    g = mix.shape[1]
    blocks = w.double().reshape(g, head_dim, *w.shape[1:])  # (G, d, ...)
    out = torch.einsum("ng,gd...->nd...", mix, blocks)  # (N, d, ...)
    return out.reshape(mix.shape[0] * head_dim, *w.shape[1:]).to(w.dtype)


@dataclass
class LayerAttention:
    """One layer's attention tensors by role; missing optional parts are None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None

    ROLES = {"q": ("q_proj", "weight"), "k": ("k_proj", "weight"), "v": ("v_proj", "weight"), "o": ("o_proj", "weight"),
             "q_bias": ("q_proj", "bias"), "k_bias": ("k_proj", "bias"), "v_bias": ("v_proj", "bias"),
             "o_bias": ("o_proj", "bias"), "q_norm": ("q_norm", "weight"), "k_norm": ("k_norm", "weight")}

    @classmethod
    def names(cls, family: Family, layer: int, present) -> dict[str, str]:
        """role -> tensor name, for the roles this checkpoint has."""
        out = {}
        for role, (part, kind) in cls.ROLES.items():
            if getattr(family, part) is None:
                continue
            name = family.attn(layer, part, kind)
            if name in present:
                out[role] = name
        return out

    @classmethod
    def read(cls, ckpt: Checkpoint, family: Family, layer: int) -> LayerAttention:
        return cls(**{role: ckpt.get(name) for role, name in cls.names(family, layer, ckpt).items()})


class GQAMethod(Protocol):
    name: str
    description: str
    needs_calibration: bool

    def convert_layer(self, attn: LayerAttention, shape: AttentionShape, new_kv: int, **kw) -> LayerAttention: ...


class MeanMethod:
    name = "mean"
    description = "mean-pool the K/V heads each new head serves (GQA paper); weight-only, streams"
    needs_calibration = False

    def convert_layer(self, attn: LayerAttention, shape: AttentionShape, new_kv: int, **_: Any) -> LayerAttention:
        mix = mean_mixing(shape.heads, shape.kv_heads, new_kv)
        d = shape.head_dim
        return LayerAttention(
            q=attn.q, o=attn.o, q_bias=attn.q_bias, o_bias=attn.o_bias, q_norm=attn.q_norm,
            k=mix_heads(attn.k, mix, d), v=mix_heads(attn.v, mix, d),
            k_bias=None if attn.k_bias is None else mix_heads(attn.k_bias, mix, d),
            v_bias=None if attn.v_bias is None else mix_heads(attn.v_bias, mix, d),
            # Qwen3's k_norm is one [d] vector shared by all heads: nothing to pool.
            k_norm=attn.k_norm,
        )


METHODS: dict[str, GQAMethod] = {m.name: m for m in [MeanMethod()]}
DEFAULT_METHOD = "mean"


def valid_kv_heads(heads: int) -> list[int]:
    return [n for n in range(1, heads + 1) if heads % n == 0]


class GQAConversion:
    name = "gqa"
    description = "change the number of KV heads: GQA, MQA (kv_heads=1) or MHA (kv_heads=heads)"

    def targets(self, config: dict[str, Any]) -> str:
        shape = AttentionShape.of(config)
        options = [n for n in valid_kv_heads(shape.heads) if n != shape.kv_heads]
        return f"--kv-heads {{{', '.join(map(str, options))}}} (now {shape.kv_heads}); methods: {', '.join(METHODS)}"

    def plan(self, ckpt: Checkpoint, family: Family, options: dict[str, Any]) -> Plan:
        shape = AttentionShape.of(ckpt.config)
        new_kv = options.get("kv_heads")
        if new_kv == "heads":  # --to mha
            new_kv = shape.heads
        if new_kv is None:
            raise EffattnError("--kv-heads is required for --to gqa", f"choose one of {valid_kv_heads(shape.heads)}")
        if new_kv < 1 or shape.heads % new_kv:
            raise EffattnError(f"num_heads ({shape.heads}) must be divisible by kv_heads ({new_kv})",
                               f"choose one of {valid_kv_heads(shape.heads)}")
        method_name = options.get("method") or DEFAULT_METHOD
        if method_name not in METHODS:
            raise EffattnError(f"unknown GQA method {method_name!r}", one_of(method_name, METHODS))
        method = METHODS[method_name]
        target = options.get("dtype")
        reshaped = {}
        for layer in range(shape.layers):
            names = LayerAttention.names(family, layer, ckpt)
            for role in ("k", "v", "k_bias", "v_bias"):
                if role in names:
                    old_shape = ckpt.meta(names[role])[0]
                    reshaped[names[role]] = (new_kv * shape.head_dim, *old_shape[1:])
            if "q" not in names:
                raise EffattnError(f"layer {layer} has no {family.attn(layer, 'q_proj')}",
                                   f"the checkpoint does not follow the {family.name} layout")
        config = dict(ckpt.config)
        config["num_key_value_heads"] = new_kv
        if target is not None:
            config["dtype"] = str(target).replace("torch.", "")
            config.pop("torch_dtype", None)
        dtype = target or ckpt.dtype
        before, after = kv_bytes_per_token(ckpt.config, dtype), kv_bytes_per_token(config, dtype)
        summary = [
            ("model", f"{family.name}, {shape.layers} layers, {shape.heads} query heads, head_dim {shape.head_dim}"),
            ("KV heads", f"{shape.kv_heads} -> {new_kv}" + (" (identity: exact copy)" if new_kv == shape.kv_heads else "")),
            ("method", f"{method.name}: {method.description}"),
            ("KV cache", f"{before:,.0f} -> {after:,.0f} bytes/token ({after / before:.1%} of the original)"),
        ]
        return Plan(
            conversion=self.name,
            settings={"kv_heads": new_kv, "method": method.name, "kv_heads_before": shape.kv_heads},
            config=config,
            specs=same_specs(ckpt, target, reshaped),
            summary=summary,
            kv_bytes_per_token=(before, after),
            est_seconds=ckpt.nbytes / 200e6,  # streaming copy at ~200 MB/s
            est_peak_bytes=_largest_layer_bytes(ckpt, family, shape) * 3,
            state={"method": method, "shape": shape, "new_kv": new_kv, "target": target},
        )

    def run(self, ckpt: Checkpoint, family: Family, plan: Plan, writer: SafetensorsWriter, progress) -> None:
        method, shape, new_kv, target = (plan.state[k] for k in ("method", "shape", "new_kv", "target"))
        if method.needs_calibration:
            from .calibrate import run_calibrated

            run_calibrated(ckpt, family, plan, writer, progress)
            return
        done = set()
        task = progress.add_task("converting layers", total=shape.layers) if progress else None
        for layer in range(shape.layers):
            names = LayerAttention.names(family, layer, ckpt)
            new = method.convert_layer(LayerAttention.read(ckpt, family, layer), shape, new_kv)
            for role, name in names.items():
                writer.write(name, getattr(new, role).to(out_dtype(ckpt.meta(name)[1], target)))
                done.add(name)
            if progress:
                progress.advance(task)
        passthrough(ckpt, writer, [n for n in ckpt.names() if n not in done], target)


def _largest_layer_bytes(ckpt: Checkpoint, family: Family, shape: AttentionShape) -> int:
    prefix = family.prefix(0)
    return sum(ckpt.meta(n)[1].itemsize * torch.Size(ckpt.meta(n)[0]).numel() for n in ckpt.names() if n.startswith(prefix))
