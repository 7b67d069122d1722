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
from typing import Any, Literal, Protocol

import torch
from pydantic import Field, field_validator

from ..errors import EffattnError, one_of
from ..families import AttentionShape, Family, context_positions
from ..io.checkpoint import Checkpoint
from ..io.writer import SafetensorsWriter
from ..resources import Dims, compute_seconds
from ..attention.functional import project_qkv
from ..data.corpora import DEFAULT_CALIB
from .base import Plan, kv_bytes_per_token, passthrough, read_time, same_specs
from .calibrate import CALIB_HELP, CalibSettings, batches, refit_o_proj
from .layers import LayerInput, LayerOutput, calibrated_bytes, run_layers, streaming_bytes
from .refine import LearningRate, RefineOptions, Steps, Target, refine_default, refine_flops
from .headmerge import (KeyMerge, align_keys, align_values, block_key_merge, choose_groups, complex_rows, merge_keys,
                        merge_pooled_keys, merge_values, merged_key_rows, pair_dims, real_rows)

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


class _Expansion(MeanMethod):
    """More KV heads than before, each a multiple of the old: replication, exact for every method."""

    name = "replicate"
    description = "copy each old K/V head to the new heads its queries read (exact expansion)"


@dataclass
class LayerStats:
    """Second moments of one layer's attention, from calibration activations or from the weights.

    key_cov   [F, G, G] complex: E[z_g conj(z_h)] per RoPE frequency, keys as complex pairs (pre-RoPE)
    q_energy  [H, F]    real:    E|w_{i,f}|², query energy per head and frequency
    value_cov [G*d, G*d] real:   E[v vᵀ] of all value heads stacked
    pool_*    the slow RoPE pairs merged across frequencies (headmerge.PooledKeys), where asked for:
              pool_dims their n dims, pool_key_cov [G*n, G*n] E[x xᵀ] of the keys on them (head-major),
              pool_q_cov [H, n, n] E[q qᵀ] of every query head on them
    """

    key_cov: torch.Tensor
    q_energy: torch.Tensor
    value_cov: torch.Tensor
    pool_dims: list[int] | None = None
    pool_key_cov: torch.Tensor | None = None
    pool_q_cov: torch.Tensor | None = None

    @classmethod
    def from_weights(cls, attn: LayerAttention, shape: AttentionShape, input_gain: torch.Tensor | None) -> LayerStats:
        """Weight-only estimate: the layer input is taken as uncorrelated with per-dim variance
        `input_gain`² (the input RMSNorm's weight; the normalised activations have unit RMS)."""
        H, G, d = shape.heads, shape.kv_heads, shape.head_dim
        gain = torch.ones(attn.q.shape[1], dtype=torch.float64) if input_gain is None else input_gain.double()
        qc = complex_rows(attn.q * gain.to(attn.q.dtype), H, d)  # (H, F, D)
        kc = complex_rows(attn.k * gain.to(attn.k.dtype), G, d)  # (G, F, D)
        key_cov = torch.einsum("gfD,hfD->fgh", kc, kc.conj())
        q_energy = (qc.abs() ** 2).sum(-1)
        if attn.k_bias is not None:
            kb = complex_rows(attn.k_bias, G, d)  # (G, F)
            key_cov = key_cov + torch.einsum("gf,hf->fgh", kb, kb.conj())
        if attn.q_bias is not None:
            q_energy = q_energy + complex_rows(attn.q_bias, H, d).abs() ** 2
        vw = attn.v.double() * gain
        value_cov = vw @ vw.T
        if attn.v_bias is not None:
            value_cov = value_cov + torch.outer(attn.v_bias.double(), attn.v_bias.double())
        return cls(key_cov, q_energy, value_cov)


class _Moments:
    """Running second moments of q/k/v (the LayerStats) over calibration batches."""

    def __init__(self, pool_dims: list[int] | None = None):
        self.n = 0
        self.key_cov = self.q_energy = self.value_cov = 0
        self.pool_dims = pool_dims or None
        self.pool_key_cov = self.pool_q_cov = 0

    def add(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # per-batch products in single precision, running sums in double
        half = q.shape[-1] // 2
        self.q_energy = self.q_energy + (q.float() ** 2).sum(dim=(0, 1)).view(-1, 2, half).sum(1).double()  # (H, F)
        zk = torch.complex(k[..., :half].float(), k[..., half:].float())  # (B, T, G, F)
        self.key_cov = self.key_cov + torch.einsum("btgf,bthf->fgh", zk, zk.conj()).to(torch.complex128)
        vf = v.flatten(2).flatten(0, 1).float()  # (B*T, G*d)
        self.value_cov = self.value_cov + (vf.T @ vf).double()
        if self.pool_dims:
            kp = k[..., self.pool_dims].flatten(2).flatten(0, 1).float()  # (B*T, G*n), head-major
            self.pool_key_cov = self.pool_key_cov + (kp.T @ kp).double()
            qp = q[..., self.pool_dims].float()  # (B, T, H, n)
            self.pool_q_cov = self.pool_q_cov + torch.einsum("bthi,bthj->hij", qp, qp).double()
        self.n += q.shape[0] * q.shape[1]

    def stats(self) -> LayerStats:
        pool = {}
        if self.pool_dims:
            pool = {"pool_dims": self.pool_dims, "pool_key_cov": self.pool_key_cov / self.n,
                    "pool_q_cov": self.pool_q_cov / self.n}
        return LayerStats(self.key_cov / self.n, self.q_energy / self.n, self.value_cov / self.n, **pool)


def output_metric(o: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """W_o,iᵀ W_o,i for every query head: [H, d, d]; W_o [D, H*d] split into per-head column blocks."""
    w = o.double().reshape(o.shape[0], heads, head_dim).permute(1, 0, 2)  # (H, D, d)
    return w.transpose(1, 2) @ w


def complex_scale_rows(w: torch.Tensor, scale: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Multiply one head's rows [d, ...] (rotate-half layout) by a complex number per frequency [F]."""
    z = complex_rows(w, 1, head_dim)[0]  # (F, ...)
    z = z * scale.reshape(-1, *([1] * (z.dim() - 1)))
    return real_rows(z[None]).to(w.dtype)


@dataclass
class HeadAssignment:
    """Which old heads feed which new KV head, and the new order of the query heads."""

    query_order: list[int]  # new query position -> old query head
    groups: list[list[int]]  # new KV head j -> old KV heads S_j it merges

    @classmethod
    def plan(cls, shape: AttentionShape, new_kv: int, stats: LayerStats | None, by_similarity: bool) -> HeadAssignment:
        H, G = shape.heads, shape.kv_heads
        old_per = H // G
        if by_similarity and stats is not None and G % new_kv == 0 and 1 < G // new_kv and new_kv > 1:
            weight = torch.stack([stats.q_energy[g * old_per:(g + 1) * old_per].sum(0) for g in range(G)])  # (G, F)
            groups = choose_groups(stats.key_cov, weight, new_kv)
            order = [i for group in groups for g in group for i in range(g * old_per, (g + 1) * old_per)]
            return cls(order, groups)
        order = list(range(H))
        groups = [sorted({i // old_per for i in q}) for q in query_groups(H, new_kv)]
        return cls(order, groups)


class HeadMergeMethod:
    """RoPE-exact head merging (see headmerge.py): keys by weighted complex PCA per frequency with
    the queries compensated (with calibration statistics, the slowest pairs by one PCA across their
    frequencies: headmerge.PooledKeys), values by weighted PCA absorbed into o_proj, heads grouped by key
    similarity. `stats` come from the weights (`align`) or from calibration activations (`pca`,
    `calibrated`); `calibrated` then refits o_proj by least squares (calibrate.py)."""

    def __init__(self, name: str, description: str, *, needs_calibration: bool, refit_o: bool, merge: str):
        self.name, self.description = name, description
        self.needs_calibration, self.refit_o = needs_calibration, refit_o
        self.merge = merge  # "pca": weighted principal components; "align": rotate onto one head, then mean

    def convert_layer(self, attn: LayerAttention, shape: AttentionShape, new_kv: int, *,
                      stats: LayerStats | None = None, input_gain: torch.Tensor | None = None,
                      **_: Any) -> LayerAttention:
        if new_kv == shape.kv_heads:
            return attn  # the identity: nothing to merge
        H, G, d = shape.heads, shape.kv_heads, shape.head_dim
        stats = stats or LayerStats.from_weights(attn, shape, input_gain)
        plan = HeadAssignment.plan(shape, new_kv, stats, by_similarity=True)
        old_per, new_per = H // G, H // new_kv
        order = torch.tensor(plan.query_order)
        reads = [i // old_per for i in plan.query_order]  # old KV head read by new query position p
        q_blocks = attn.q.reshape(H, d, -1)[order]  # (H, d, D), new order
        qb_blocks = None if attn.q_bias is None else attn.q_bias.reshape(H, d)[order]
        o_blocks = attn.o.reshape(attn.o.shape[0], H, d)[:, order]  # (D, H, d)
        metric = output_metric(attn.o, H, d)[order]  # (H, d, d)
        q_energy = stats.q_energy[order]  # (H, F)
        k_rows = complex_rows(attn.k, G, d)  # (G, F, D)
        kb_rows = None if attn.k_bias is None else complex_rows(attn.k_bias, G, d)  # (G, F)
        v_rows = attn.v.double().reshape(G, d, -1)
        vb_rows = None if attn.v_bias is None else attn.v_bias.double().reshape(G, d)
        new_k, new_kb, new_v, new_vb = [], [], [], []
        new_q, new_qb, new_o = [], [], []
        for j, members in enumerate(plan.groups):
            positions = range(j * new_per, (j + 1) * new_per)
            weight = torch.zeros(G, q_energy.shape[1], dtype=torch.float64)
            out_metric = torch.zeros(G, d, d, dtype=torch.float64)
            for p in positions:
                weight[reads[p]] += q_energy[p]
                out_metric[reads[p]] += metric[p]
            # -- keys: one complex coefficient per (old head, frequency); RoPE-exact by construction
            if attn.k_norm is None:
                km = merge_keys(stats.key_cov, weight, members) if self.merge == "pca" else align_keys(stats.key_cov, members)
            else:
                # Qwen3 normalises each key head after the projection: a per-frequency complex
                # combination does not survive that norm, and the queries cannot be compensated
                # behind q_norm. The keys of a group are mean-pooled instead (values still merge).
                r = len(members)
                ones = torch.full((r, k_rows.shape[1]), 1.0 / r, dtype=torch.complex128)
                km = KeyMerge(members, ones, torch.ones_like(ones))
            key = real_rows(merged_key_rows(k_rows, km)[None])  # (d, D)
            key_b = None if kb_rows is None else real_rows(merged_key_rows(kb_rows, km)[None])
            b_of = {g: km.b[members.index(g)] for g in members}
            qs, qbs = [], []  # the group's query heads, in new order
            for p in positions:
                scale = b_of[reads[p]].conj()  # w' = conj(b_g)·w
                qs.append(q_blocks[p] if attn.k_norm is not None else complex_scale_rows(q_blocks[p], scale, d))
                if qb_blocks is not None:
                    qbs.append(qb_blocks[p] if attn.k_norm is not None else complex_scale_rows(qb_blocks[p], scale, d))
            if stats.pool_dims and self.merge == "pca" and attn.k_norm is None:
                # the slow pairs: one PCA across their frequencies (PooledKeys) replaces their per-frequency merge
                self._pool_keys(stats, attn, km, [(p, reads[p], int(order[p])) for p in positions], q_blocks, qb_blocks,
                                key, key_b, qs, qbs, G, d)
            new_k.append(key)
            new_kb += [] if key_b is None else [key_b]
            new_q += qs
            new_qb += qbs
            # -- values: top-d subspace of the group's stacked values, undone in o_proj
            vm = (merge_values(stats.value_cov, out_metric, members, d) if self.merge == "pca"
                  else align_values(stats.value_cov, members, d))
            new_v.append(sum(vm.P[i] @ v_rows[g] for i, g in enumerate(members)))
            if vb_rows is not None:
                new_vb.append(sum(vm.P[i] @ vb_rows[g] for i, g in enumerate(members)))
            B_of = {g: vm.B[members.index(g)] for g in members}
            for p in positions:
                new_o.append(o_blocks[:, p].double() @ B_of[reads[p]])  # (D, d)
        cat = lambda xs, like: None if not xs else torch.cat(xs).to(like.dtype)  # noqa: E731
        return LayerAttention(
            q=torch.cat(new_q).to(attn.q.dtype), q_bias=cat(new_qb, attn.q),
            k=cat(new_k, attn.k), k_bias=cat(new_kb, attn.k),
            v=cat(new_v, attn.v), v_bias=cat(new_vb, attn.v),
            o=torch.cat(new_o, dim=1).to(attn.o.dtype), o_bias=attn.o_bias,
            q_norm=attn.q_norm, k_norm=attn.k_norm,
        )

    @staticmethod
    def _pool_keys(stats: LayerStats, attn: LayerAttention, km: KeyMerge, heads: list[tuple[int, int, int]],
                   q_blocks, qb_blocks, key, key_b, qs, qbs, G: int, d: int) -> None:
        """Write the cross-frequency merge of the slow pairs (PooledKeys; `km`, the per-frequency merge, is
        kept where it is exact) into the group's new key rows `key` / `key_b` and its query heads `qs` /
        `qbs`, in place. heads: (new position, old KV head read, old query head) of each of the group's
        query heads, in the order of qs; G old KV heads of head_dim d."""
        members = km.members
        dims = torch.tensor(stats.pool_dims)
        n = len(dims)
        q_cov = torch.zeros(G, n, n, dtype=torch.float64)
        for _, g, old in heads:
            q_cov[g] += stats.pool_q_cov[old]
        pk = merge_pooled_keys(stats.pool_key_cov, q_cov, members, stats.pool_dims,
                               reference=block_key_merge(km, stats.pool_dims, d))

        def block(w):  # the members' rows on the block's dims, stacked head-major: (r*n, ...)
            rows = w.double().reshape(G, d, *w.shape[1:])
            return torch.cat([rows[g][dims] for g in members])

        key[dims] = (pk.A @ block(attn.k)).to(key.dtype)
        if key_b is not None:
            key_b[dims] = (pk.A @ block(attn.k_bias)).to(key_b.dtype)
        for slot, (p, g, _) in enumerate(heads):
            B = pk.B[members.index(g)]  # x_g ≈ B y  =>  q·x_g ≈ (Bᵀ q)·y
            qs[slot][dims] = (B.T @ q_blocks[p].double()[dims]).to(qs[slot].dtype)
            if qbs:
                qbs[slot][dims] = (B.T @ qb_blocks[p].double()[dims]).to(qbs[slot].dtype)


METHODS: dict[str, GQAMethod] = {m.name: m for m in [
    MeanMethod(),
    HeadMergeMethod("align", "rotate each head's keys (per RoPE frequency) and values onto a reference head, "
                    "then mean-pool; from the weights alone, streams", needs_calibration=False, refit_o=False, merge="align"),
    HeadMergeMethod("pca", "weighted PCA of keys (RoPE-exact per frequency, the slowest pairs pooled; queries "
                    "compensated) and values, from calibration "
                    "activations, layer by layer", needs_calibration=True, refit_o=False, merge="pca"),
    HeadMergeMethod("calibrated", "pca + o_proj refitted by least squares on calibration activations, layer by layer",
                    needs_calibration=True, refit_o=True, merge="pca"),
]}
DEFAULT_METHOD = "calibrated"


class GQAOptions(RefineOptions):
    kv_heads: int | Literal["heads"] | None = Field(None, description="KV heads after conversion (required; mqa sets 1, "
                                                                     "mha the number of query heads)")
    method: str = Field(DEFAULT_METHOD, description=f"how heads are merged: {', '.join(METHODS)}")
    calib: str = Field(DEFAULT_CALIB, description=CALIB_HELP + " (calibrated methods)")
    calib_tokens: int = Field(16384, ge=1, description="calibration tokens (calibrated methods)")
    # On by default since 2026-12-05: on SmolLM2's MQA, steps towards the original model's activations at 3e-4
    # lower held-out perplexity by 11-25% (20 steps). 36 since 2026-12-06, when the walk stopped running the stream
    # target's passes twice: as many as fit the 5 minutes with a margin, chosen on training text (BENCHMARKS, gqa-refine).
    refine_steps: Steps = Field(36, description="local refinement: optimizer steps per layer fitting the original "
                                                "model (calibrated methods; 0: off, the closed-form merge alone)")
    refine_lr: LearningRate = refine_default("refine_lr", 3e-4)
    refine_target: Target = refine_default("refine_target", "stream")
    # 1 radian since 2026-12-06: on SmolLM2 (θ 1e5, 8,192 positions) that is its 6 slowest of 32 pairs. Chosen on
    # training text (wiki, plays) at 512, 2,048 and 8,192 tokens: 8 pairs (1.46 rad) lost at 8,192 (BENCHMARKS).
    key_pool_angle: float = Field(1.0, ge=0, description="keys: RoPE pairs that turn by at most this many radians "
                                                         "over the model's context are merged across frequencies "
                                                         "(one PCA; pca/calibrated; 0: every frequency on its own, "
                                                         "RoPE-exact)")

    @field_validator("method")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in METHODS:
            raise ValueError(f"unknown GQA method {v!r} ({one_of(v, METHODS)})")
        return v


def pooled_pairs(config: dict[str, Any], family: Family, angle: float) -> tuple[list[int], str]:
    """The RoPE pairs whose angle over the model's whole context is at most `angle` radians (the slowest
    ones; headmerge.PooledKeys), and "" — or ([], why) where none may be pooled."""
    if angle <= 0:
        return [], "--key-pool-angle 0"
    if family.k_norm is not None:  # HeadMergeMethod mean-pools keys that are normed per head
        return [], f"{family.name} norms each key head, so its keys are mean-pooled"
    from ..attention.layerwise import LayerFactory

    inv_freq = LayerFactory(config, family).inv_freq()
    head_dim = AttentionShape.of(config).head_dim
    if 2 * len(inv_freq) != head_dim:
        return [], f"partial rotary embeddings ({len(inv_freq)} of {head_dim // 2} pairs rotate)"
    turn = inv_freq * context_positions(config)
    return [f for f in range(len(turn)) if turn[f] <= angle], ""


def valid_kv_heads(heads: int) -> list[int]:
    return [n for n in range(1, heads + 1) if heads % n == 0]


class GQAConversion:
    Options = GQAOptions
    aliases = {"mqa": {"kv_heads": 1}, "mha": {"kv_heads": "heads"}}
    model = None  # native: the same architecture with fewer KV heads
    name = "gqa"
    source_window = "keeps"  # a source's sliding window (base.check_source_window)
    memory_options = ("calib_tokens",)
    description = "change the number of KV heads: GQA, MQA (kv_heads=1) or MHA (kv_heads=heads)"

    def targets(self, config: dict[str, Any]) -> str:
        shape = AttentionShape.of(config)
        options = [n for n in valid_kv_heads(shape.heads) if n != shape.kv_heads]
        return f"--kv-heads {{{', '.join(map(str, options))}}} (now {shape.kv_heads}); methods: {', '.join(METHODS)}"

    def plan(self, ckpt: Checkpoint, family: Family, opts: GQAOptions, target=None) -> Plan:
        shape = AttentionShape.of(ckpt.config)
        new_kv = opts.kv_heads
        if new_kv == "heads":  # --to mha
            new_kv = shape.heads
        if new_kv is None:
            raise EffattnError("--kv-heads is required for --to gqa", f"choose one of {valid_kv_heads(shape.heads)}")
        if new_kv < 1 or shape.heads % new_kv:
            raise EffattnError(f"num_heads ({shape.heads}) must be divisible by kv_heads ({new_kv})",
                               f"choose one of {valid_kv_heads(shape.heads)}")
        method = METHODS[opts.method]
        if new_kv > shape.kv_heads and new_kv % shape.kv_heads == 0 and method.name != "mean":
            # Expanding: every new KV head is a copy of the one old head its queries read. Exact, so
            # every method reduces to replication and there is nothing to calibrate.
            method = _Expansion()
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
        # the method asked for (what the record's reproduce command passes); an expansion replicates whatever it is
        settings = {"kv_heads": new_kv, "method": opts.method, "kv_heads_before": shape.kv_heads}
        if isinstance(method, _Expansion):
            settings["expansion"] = f"{method.name}: {method.description}"
        state = {"method": method, "shape": shape, "new_kv": new_kv, "target": target}
        est_seconds = read_time(ckpt)  # reading every tensor
        est_peak = streaming_bytes(ckpt, family)
        if method.needs_calibration and new_kv == shape.kv_heads:
            pass  # the identity is an exact copy: no calibration to run
        elif method.needs_calibration:
            calib = CalibSettings(corpus=opts.calib, tokens=opts.calib_tokens).validate(
                ckpt.folder, without="choose a weight-only method (e.g. --method mean)")
            state["calib"] = calib
            settings |= {"calib": calib.corpus, "calib_tokens": calib.tokens, "calib_seq_len": calib.seq_len,
                         "ridge": calib.ridge if method.refit_o else None}
            refine = opts.refine_settings()
            state["refine"] = refine
            settings |= refine.record()
            if getattr(method, "merge", None) == "pca":
                pairs, why = pooled_pairs(ckpt.config, family, opts.key_pool_angle)
                state["pool_dims"] = pair_dims(pairs, shape.head_dim)
                settings |= {"key_pool_angle": opts.key_pool_angle, "key_pool_pairs": len(pairs)}
                summary.append(("keys", f"the {len(pairs)} RoPE pairs of {shape.head_dim // 2} that turn by at most "
                                        f"{opts.key_pool_angle:g} rad over {context_positions(ckpt.config):,} positions "
                                        "merged across frequencies" + (f" (none: {why})" if why else "")))
            dims = Dims.of(ckpt.config)
            N, T = calib.tokens, calib.seq_len
            # per layer: q/k/v statistics, the o_proj refit (old and new attention, Gram matrix), the
            # converted layer's forward to propagate the activations
            hd = shape.heads * shape.head_dim
            per_layer = (dims.attention_flops(N, T) / 2 + (2 * dims.attention_flops(N, T) + 2 * N * hd * (hd + shape.hidden)
                                                            if method.refit_o else 0) + dims.layer_flops(N, T))
            per_layer += refine_flops(dims, refine, N, T)
            est_seconds += compute_seconds(shape.layers * per_layer)
            est_peak = calibrated_bytes(ckpt, family, calib, refine)
            summary.append(("calibration", f"{calib.tokens:,} tokens of {calib.corpus!r} in blocks of {calib.seq_len}, "
                                           "layer by layer"))
            if refine.steps:
                summary.append(("refinement", refine.summary("q/k/v/o")))
        elif opts.given() & {"calib", "calib_tokens"} and not isinstance(method, _Expansion):
            raise EffattnError(f"--calib/--calib-tokens apply to calibrated methods, not {method.name!r}",
                               "drop them or use --method calibrated")
        elif "key_pool_angle" in opts.given() and not isinstance(method, _Expansion):
            raise EffattnError(f"--key-pool-angle applies to the pca and calibrated methods, not {method.name!r}",
                               "drop it or use --method calibrated")
        elif "refine_steps" in opts.given() and opts.refine_steps and not isinstance(method, _Expansion):
            raise EffattnError(f"--refine-steps needs calibration activations, which method {method.name!r} does not run",
                               "drop it or use --method calibrated")
        return Plan(
            conversion=self.name,
            settings=settings,
            config=config,
            specs=same_specs(ckpt, target, reshaped),
            summary=summary,
            kv_bytes_per_token=(before, after),
            est_seconds=est_seconds,
            est_peak_bytes=est_peak,
            state=state,
        )

    def run(self, ckpt: Checkpoint, family: Family, plan: Plan, writer: SafetensorsWriter, progress) -> None:
        shape, new_kv, target, calib = (plan.state.get(k) for k in ("shape", "new_kv", "target", "calib"))
        if new_kv == shape.kv_heads:  # the identity: every method reduces to an exact copy
            passthrough(ckpt, writer, ckpt.names(), target)
            return
        plan.measured |= run_layers(
            ckpt, family, writer, lambda layer: self.convert_layer(plan, family, layer), layers=shape.layers,
            target=target, calib=calib, refine=plan.state.get("refine"), progress=progress,
            description="calibrating layers" if calib else "converting layers")

    @staticmethod
    def convert_layer(plan: Plan, family: Family, layer: LayerInput) -> LayerOutput:
        """One layer: merge the K/V heads (from the weights, or from calibration statistics), refit o_proj."""
        method, shape, new_kv = (plan.state[k] for k in ("method", "shape", "new_kv"))
        tensors = dict(layer.tensors)
        names = LayerAttention.names(family, layer.index, tensors)
        if layer.x is None:  # weight-only: the input RMSNorm's gain stands for the activations' scale
            gain = tensors.get(f"{layer.prefix}{family.input_norm}.weight")
            old = LayerAttention(**{role: tensors[name] for role, name in names.items()})
            new = method.convert_layer(old, shape, new_kv, input_gain=gain)
            return LayerOutput(tensors | {name: getattr(new, role) for role, name in names.items()})
        calib: CalibSettings = plan.state["calib"]
        eps = float(plan.config.get("rms_norm_eps", 1e-6))
        old = LayerAttention(**{role: tensors[name].float() for role, name in names.items()})
        norm = layer.original.input_layernorm
        h = torch.cat([norm(layer.x[sl]) for sl in batches(layer.x, calib.batch_size)])  # (N, T, D) attention inputs
        moments = _Moments(plan.state.get("pool_dims"))
        for sl in batches(h, calib.batch_size):
            moments.add(*project_qkv(h[sl], old, shape.head_dim, eps))
        new = method.convert_layer(old, shape, new_kv, stats=moments.stats())
        if method.refit_o:
            new.o = refit_o_proj(new, old, h, layer.cos, layer.sin, shape, eps, calib)
        for role, name in names.items():
            tensors[name] = getattr(new, role)
        return LayerOutput(tensors, module=layer.factory.layer(layer.index, tensors, new_kv))
