"""Local refinement: a few optimizer steps on one converted layer, fitting the original layer's output.

After a layer's closed-form initialisation (head merging, o_proj refit, ...), its new attention
parameters are trained on the calibration activations of that layer alone, so that the converted
attention's output matches the original attention's output on the same inputs:

    min_θ  E_x ‖attn_θ(norm(x)) − attn_orig(norm(x))‖² / E_x ‖attn_orig(norm(x))‖²

This is the attention-transfer stage of LoLCATs (Zhang et al. 2024, Sec. 3.1: "train the linear
attention to match the softmax attention's outputs", there with a mean squared error on every layer
at once), done one layer at a time: only the layer being converted is in memory, with its inputs
x [N, T, D], which come from the already-converted layers below (so each layer also absorbs the
error of the layers before it). The targets are computed once per layer; the loss is the relative
squared error, so its value reads as the fraction of the attention output's energy that is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RefineSettings:
    steps: int = 0  # optimizer steps per layer; 0 = off
    lr: float = 1e-4  # Adam's learning rate
    batch_size: int = 2  # calibration sequences per step
    seed: int = 0


def _attention_out(layer: torch.nn.Module, x: torch.Tensor, cos, sin) -> torch.Tensor:
    """A transformers decoder layer's attention output (before the residual) on layer inputs x [B, T, D]."""
    h = layer.input_layernorm(x)
    return layer.self_attn(hidden_states=h, position_embeddings=(cos, sin), attention_mask=None)[0]  # (B, T, D)


def _relative_error(model: torch.nn.Module, x: torch.Tensor, targets: torch.Tensor, cos, sin, batch: int) -> float:
    err = energy = 0.0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            y = targets[i : i + batch]
            err += (_attention_out(model, x[i : i + batch], cos, sin) - y).pow(2).sum().item()
            energy += y.pow(2).sum().item()
    return err / max(energy, 1e-30)


def refine_layer(converted: torch.nn.Module, original: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, settings: RefineSettings, trainable: list[str] | None = None) -> dict[str, float]:
    """Train `converted`'s attention parameters (in place) to reproduce `original`'s attention output
    on inputs x [N, T, D]. Returns the relative squared error over all of x before and after.

    trainable: names of `converted.self_attn`'s parameters to train (default: the q/k/v/o
    projections' weights and biases; norms stay as they are).
    """
    attn = converted.self_attn
    params = dict(attn.named_parameters())
    names = trainable or [n for n in params if n.split(".")[0] in ("q_proj", "k_proj", "v_proj", "o_proj")]
    converted.requires_grad_(False)
    for n in names:
        params[n].requires_grad_(True)
    with torch.no_grad():
        targets = torch.cat([_attention_out(original, x[i : i + settings.batch_size], cos, sin)
                             for i in range(0, len(x), settings.batch_size)])  # (N, T, D)
    before = _relative_error(converted, x, targets, cos, sin, settings.batch_size)
    energy = targets.pow(2).mean()
    optimizer = torch.optim.Adam([params[n] for n in names], lr=settings.lr)
    gen = torch.Generator().manual_seed(settings.seed)
    for _ in range(settings.steps):
        pick = torch.randint(len(x), (settings.batch_size,), generator=gen)
        with torch.enable_grad():
            loss = (_attention_out(converted, x[pick], cos, sin) - targets[pick]).pow(2).mean() / energy
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    converted.requires_grad_(False)
    after = _relative_error(converted, x, targets, cos, sin, settings.batch_size)
    return {"before": before, "after": after}
