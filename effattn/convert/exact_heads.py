"""Exact heads, the conversion's side (`--exact-heads K` of `vq-init` and `--to linear`): while the
calibration activations go through each converted layer, score every KV head by how much the new
attention changes its output; after the walk the K heads with the largest relative error keep the
original attention (attention/exact.py), recorded as the config's `<prefix>_exact_heads`.

Every head is converted and fitted as if none were exact (the ranking needs each head's error, and
exact heads are a choice made after the walk): the layers above were fitted on activations of a
model without exact heads, whose attention was further from the original than the final model's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def head_errors(attn, h: torch.Tensor, converted: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """What the converted attention does to each KV head's output on hidden states h (B, T, hidden), given
    that output (`converted`, (B, T, H * D), what o_proj receives): [2, G] float64, Σ‖out_new − out_original‖²
    and Σ‖out_original‖² over the positions and the head's query heads (out_original: the model's own
    attention, full RoPE, through the same q/k/v projections). Their ratio ranks the heads."""
    from ..attention.exact import full_attention

    q, k, v = attn.project(h)
    exact, _ = full_attention(q, k, v, cos.to(q.dtype), sin.to(q.dtype), attn.scaling)
    G = k.shape[2]
    per_query_head = lambda t: t.double().pow(2).sum((0, 1, 3))  # noqa: E731  (H,)
    err = per_query_head(converted.reshape(exact.shape) - exact).view(G, -1).sum(1)
    norm = per_query_head(exact).view(G, -1).sum(1)
    return torch.stack((err, norm))


def scoring_hooks(module: torch.nn.Module, attn, errors: torch.Tensor) -> tuple[Callable[[], None], Callable[[], None]]:
    """(before, after) for a LayerOutput: while the activations go through the decoder layer `module` (after
    refinement, which runs it too), add each KV head's `head_errors` to `errors` [2, G], at the RoPE tables
    each batch passes through (its `position_embeddings`)."""
    taken: dict[str, torch.Tensor] = {}
    hooks: list = []

    def take_input(_, args, kwargs):
        taken["x"] = args[0] if args else kwargs["hidden_states"]
        taken["rope"] = kwargs["position_embeddings"]

    def take_output(_, args):
        taken["converted"] = args[0]

    def score(*_):
        h = module.input_layernorm(taken["x"])
        errors.add_(head_errors(attn, h, taken.pop("converted"), *taken["rope"]))

    def before():
        hooks.extend([module.register_forward_pre_hook(take_input, with_kwargs=True),
                      attn.o_proj.register_forward_pre_hook(take_output), module.register_forward_hook(score)])

    def after():
        for hook in hooks:
            hook.remove()
        hooks.clear()

    return before, after


def choose(errors: torch.Tensor, k: int) -> tuple[list[list[int]], dict[str, Any]]:
    """The K (layer, KV head) pairs of largest relative error from `errors` [layers, 2, G], sorted, and
    what the record keeps: the pairs and every head's relative error."""
    relative = errors[:, 0] / errors[:, 1].clamp_min(1e-30)  # (layers, G)
    G = relative.shape[1]
    top = relative.flatten().argsort(descending=True)[:k]
    pairs = sorted([int(i) // G, int(i) % G] for i in top)
    return pairs, {"exact_heads_chosen": pairs, "head_errors": {
        f"{l}.{g}": round(float(relative[l, g]), 5) for l in range(relative.shape[0]) for g in range(G)}}
