"""Sequential (layer-by-layer) calibration for the calibrated GQA methods.

Calibration text runs through the model one decoder layer at a time. For layer i we
  1. collect the second moments of its queries, keys and values on the layer's inputs
     (which come from the already-converted layers 0..i-1),
  2. merge the heads (headmerge.py) from those statistics,
  3. for `calibrated`, refit o_proj by ridge least squares so the converted attention's output
     matches the original attention's output on the same inputs,
  4. with `refine_steps` > 0, train the layer's new q/k/v/o for that many steps to reproduce the
     original attention's output on the same inputs (refine.py),
  5. write the layer and run the converted layer to produce the inputs of layer i+1.
Only one layer's weights and the calibration hidden states are in memory at any time, so peak
memory is bounded by a layer plus the activations, not by the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.functional import attention_heads, output_projection, project_qkv
from ..attention.layerwise import LayerFactory
from ..data.corpora import DEFAULT_CALIB, load_text, token_blocks
from ..errors import EffattnError
from ..families import AttentionShape, Family
from ..io.checkpoint import Checkpoint
from ..io.writer import SafetensorsWriter
from .base import Plan, out_dtype, passthrough
from .gqa import LayerAttention, LayerStats
from .refine import RefineSettings, refine_layer


@dataclass(frozen=True)
class CalibSettings:
    corpus: str = DEFAULT_CALIB
    tokens: int = 16384
    seq_len: int = 512
    batch_size: int = 4
    # o_proj refit: λ relative to the mean diagonal of OᵀO, pulling towards the PCA solution. Chosen on
    # held-out text: 0.1 generalises better than 0.01 or 0.001 (less overfitting of the calibration set).
    ridge: float = 0.1

    def validate(self) -> CalibSettings:
        if self.tokens < self.seq_len:
            raise EffattnError(f"--calib-tokens ({self.tokens}) must be at least one sequence ({self.seq_len} tokens)",
                               f"use --calib-tokens {self.seq_len} or more")
        return self


def calibration_tokens(folder, settings: CalibSettings) -> torch.Tensor:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return token_blocks(tokenizer, load_text(settings.corpus), settings.seq_len, settings.tokens)


class _Moments:
    """Running second moments of q/k/v (the LayerStats) over calibration batches."""

    def __init__(self):
        self.n = 0
        self.key_cov = self.q_energy = self.value_cov = 0

    def add(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # per-batch products in single precision, running sums in double
        half = q.shape[-1] // 2
        self.q_energy = self.q_energy + (q.float() ** 2).sum(dim=(0, 1)).view(-1, 2, half).sum(1).double()  # (H, F)
        zk = torch.complex(k[..., :half].float(), k[..., half:].float())  # (B, T, G, F)
        self.key_cov = self.key_cov + torch.einsum("btgf,bthf->fgh", zk, zk.conj()).to(torch.complex128)
        vf = v.flatten(2).flatten(0, 1).float()  # (B*T, G*d)
        self.value_cov = self.value_cov + (vf.T @ vf).double()
        self.n += q.shape[0] * q.shape[1]

    def stats(self) -> LayerStats:
        return LayerStats(self.key_cov / self.n, self.q_energy / self.n, self.value_cov / self.n)


def _batches(x: torch.Tensor, size: int):
    for i in range(0, x.shape[0], size):
        yield slice(i, i + size)


def refit_o_proj(new: LayerAttention, old: LayerAttention, h: torch.Tensor, cos, sin,
                 shape: AttentionShape, eps: float, settings: CalibSettings) -> torch.Tensor:
    """Ridge least squares for o_proj: argmin_W Σ_t ‖y_t − W o'_t‖² + λ‖W − W₀‖².

    o'_t are the converted attention's per-head outputs (all heads concatenated), y_t the original
    attention's output (o_proj applied, bias removed) on the same inputs h, W₀ the PCA solution.
    """
    d, D = shape.head_dim, new.o.shape[0]
    gram = torch.zeros(shape.heads * d, shape.heads * d, dtype=torch.float64)
    cross = torch.zeros(shape.heads * d, D, dtype=torch.float64)
    for sl in _batches(h, settings.batch_size):
        o_new = attention_heads(h[sl], new, cos, sin, d, eps).flatten(2).flatten(0, 1)  # (S, H*d)
        heads = attention_heads(h[sl], old, cos, sin, d, eps)
        y = (output_projection(heads, old) - (0 if old.o_bias is None else old.o_bias)).flatten(0, 1)  # (S, D)
        gram += (o_new.T @ o_new).double()  # per-batch products in float32, accumulated in float64
        cross += (o_new.T @ y).double()
    lam = settings.ridge * gram.diagonal().mean().clamp_min(1e-12)
    w0 = new.o.double().T  # (H*d, D)
    eye = torch.eye(gram.shape[0], dtype=torch.float64)
    return torch.linalg.solve(gram + lam * eye, cross + lam * w0).T.to(new.o.dtype)  # (D, H*d)


@torch.no_grad()
def run_calibrated(ckpt: Checkpoint, family: Family, plan: Plan, writer: SafetensorsWriter, progress) -> None:
    method, shape, new_kv, target = (plan.state[k] for k in ("method", "shape", "new_kv", "target"))
    settings: CalibSettings = plan.state["calib"]
    refine: RefineSettings = plan.state.get("refine") or RefineSettings()
    losses: list[dict[str, float]] = []
    eps = float(ckpt.config.get("rms_norm_eps", 1e-6))
    factory = LayerFactory(ckpt.config, family)
    ids = calibration_tokens(ckpt.folder, settings)  # (N, T)
    cos, sin = factory.rope(ids.shape[1])
    x = ckpt.get(family.embed).float()[ids]  # (N, T, D): the converted model's hidden states
    written = set()
    task = progress.add_task(f"calibrating layers ({ids.numel():,} tokens)", total=shape.layers) if progress else None
    for layer in range(shape.layers):
        prefix = family.prefix(layer)
        tensors = {n: ckpt.get(n) for n in ckpt.names() if n.startswith(prefix)}
        names = LayerAttention.names(family, layer, tensors)
        old = LayerAttention(**{role: tensors[name].float() for role, name in names.items()})
        original = factory.layer(layer, tensors, shape.kv_heads)
        norm = original.input_layernorm
        h = torch.cat([norm(x[sl]) for sl in _batches(x, settings.batch_size)])  # (N, T, D) attention inputs
        moments = _Moments()
        for sl in _batches(h, settings.batch_size):
            moments.add(*project_qkv(h[sl], old, shape.head_dim, eps))
        new = method.convert_layer(old, shape, new_kv, stats=moments.stats())
        if method.refit_o:
            new.o = refit_o_proj(new, old, h, cos, sin, shape, eps, settings)
        del h
        for role, name in names.items():
            tensors[name] = getattr(new, role)
        converted = factory.layer(layer, tensors, new_kv)
        if refine.steps:
            losses.append(refine_layer(converted, original, x, cos, sin, refine))
            weights = converted.state_dict()
            for name in names.values():
                tensors[name] = weights[name[len(prefix):]].detach().clone()
        for name, tensor in tensors.items():
            writer.write(name, tensor.to(out_dtype(ckpt.meta(name)[1], target)))
            written.add(name)
        ckpt.release()
        x = torch.cat([converted(x[sl], position_embeddings=(cos, sin)) for sl in _batches(x, settings.batch_size)])
        if progress:
            progress.advance(task)
    passthrough(ckpt, writer, [n for n in ckpt.names() if n not in written], target)
    if losses:
        plan.measured["refine"] = {"loss": "relative squared error of the attention output, per layer",
                                   "before": [round(r["before"], 6) for r in losses],
                                   "after": [round(r["after"], 6) for r in losses]}
