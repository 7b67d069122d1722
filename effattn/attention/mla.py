"""Absorbed MLA decoding for transformers' DeepseekV3: scores and values in latent space.

transformers' DeepseekV3Attention caches the latent c (after kv_a_layernorm) and the rotated shared
key k_rot, then at every step re-expands the whole cache through kv_b_proj into per-head keys and
values: S x kv_lora_rank x H x (nope + v) multiply-adds per layer and step, growing with the context.
Absorbing the up-projections removes that:

    score_h(t, s) = q_nope_h(t) . (W_uk_h c_s) + q_rot_h(t) . k_rot_s
                  = (W_uk_hᵀ q_nope_h(t)) . c_s + q_rot_h(t) . k_rot_s      (query absorbs W_uk)
    out_h(t)      = sum_s p_h(t, s) W_uv_h c_s = W_uv_h sum_s p_h(t, s) c_s   (o_proj side absorbs W_uv)

so decoding runs as multi-query attention with one shared key [c, k_rot] (kv_lora_rank +
qk_rope_head_dim numbers) and one shared value c, exactly the cache, and each head's latent output is
expanded once per query token. A prefill (more than one new token) keeps transformers' path: there,
expanding the latent once costs less than attention at the latent's width. The cache object and its
contents are transformers' own (same layout), so `generate`, cache reuse and `effattn eval`'s
measured cache bytes are unchanged.

`absorb(model)` switches every DeepseekV3 attention module of a loaded model to this forward; the
maths is transformers' up to the order of the sums (tests/test_mla.py compares them).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def _absorbed_forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention, apply_rotary_pos_emb,
                                                                      apply_rotary_pos_emb_interleave)

    if "past_key_values" in kwargs and cache is None:  # the deprecated name
        cache = kwargs.pop("past_key_values")
    B, T = hidden_states.shape[:-1]
    if T > 1:
        # Prefill: expanding the latent once is cheaper than attention at the latent's width (per-head
        # score dims qk_head_dim vs kv_lora_rank + qk_rope_head_dim): transformers' own path.
        return DeepseekV3Attention.forward(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
    H, dn, dr, dv, r = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, self.kv_lora_rank
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q = q.view(B, T, H, dn + dr).transpose(1, 2)  # (B, H, 1, dn + dr)
    q_pass, q_rot = torch.split(q, [dn, dr], dim=-1)
    kv_nope, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [r, dr], dim=-1)
    kv_nope = self.kv_a_layernorm(kv_nope).view(B, 1, T, r)
    k_rot = k_rot.view(B, 1, T, dr)
    cos, sin = position_embeddings
    rope = apply_rotary_pos_emb_interleave if self.config.rope_interleave else apply_rotary_pos_emb
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin)
    if cache is not None:
        kv_nope, k_rot = cache.update(kv_nope, k_rot, self.layer_idx, kwargs=kwargs)
    w = self.kv_b_proj.weight.view(H, dn + dv, r)
    w_uk, w_uv = w[:, :dn], w[:, dn:]  # (H, dn, r), (H, dv, r)
    q_lat = torch.einsum("bhtd,hdr->bhtr", q_pass, w_uk)  # the query absorbs the key up-projection
    # The H heads fold into the query axis against the one shared key head [c, k_rot]: multi-query
    # attention as one product. The value is the key itself, its first r numbers the latent (the rotary
    # tail of the output is dropped): equal q/k/v sizes keep SDPA on its fused CPU kernel (a 96-wide
    # value beside 128-wide keys fell back to the unfused one, ~6x slower).
    query = torch.cat([q_lat, q_rot], dim=-1).reshape(B, 1, H, r + dr)
    key = torch.cat([kv_nope, k_rot], dim=-1)  # (B, 1, S, r + dr): the cache itself
    mask = None
    if attention_mask is not None and attention_mask.dim() == 4:
        mask = attention_mask[:, :, -1:, : key.shape[2]]  # (B, 1, 1, S): padding only, one query position
        if mask.dtype != torch.bool and mask.dtype != query.dtype:
            mask = mask.to(query.dtype)
    ctx = F.scaled_dot_product_attention(query, key, key, attn_mask=mask, scale=self.scaling)[..., :r]  # (B, 1, H, r)
    out = torch.einsum("bhr,hvr->bhv", ctx[:, 0], w_uv).reshape(B, 1, H * dv)  # o_proj side absorbs W_uv
    return self.o_proj(out), None


# What training does with an effattn MLA model's latent path (convert/mla.py). kv_a_proj's latent rows are
# scaled down ~1e9 so that kv_a_layernorm stays linear: an optimizer step of any usual learning rate is
# orders of magnitude larger than those weights. Training leaves them as converted, or (recipe
# `train.mla_latent: scaled`) moves them through a row-scale parametrization (scale_latent_rows: the optimizer
# sees the rows at the rotary rows' scale, the forward is unchanged); the norm's weight and the low-rank
# query path's q_a (qwen2 biases, scaled the same way) always stay, and LoRA adapters are refused on all of
# them (an adapter's product is not scaled).
SCALED_MODULES = ("kv_a_proj_with_mqa", "kv_a_layernorm", "q_a_proj", "q_a_layernorm")  # never trained directly
FROZEN_IN_TRAINING = SCALED_MODULES[1:]
SCALED_BELOW = 1e-3  # latent rows this much smaller than the rotary rows are effattn's linear-regime scaling


def frozen_in_training(name: str) -> bool:
    return any(f".{part}." in f".{name}" for part in FROZEN_IN_TRAINING)


def scaled_module(name: str) -> bool:
    """Whether parameter `name` belongs to a module kept at the linear-regime scale (no direct training)."""
    return any(f".{part}." in f".{name}" for part in SCALED_MODULES)


class RowScale(torch.nn.Module):
    """weight = original * scale (per output row): the optimizer moves `original`, whose rows all have the
    scale of ordinary weights, so each step changes the scaled rows by the same relative amount as the rest."""

    def __init__(self, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("scale", scale)  # (rows,)

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        return original * self.scale[:, None].to(original.dtype)

    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        return weight / self.scale[:, None].to(weight.dtype)


def latent_row_scale(weight: torch.Tensor, kv_rank: int) -> float:
    """rms(latent rows) / rms(rotary rows) of kv_a_proj_with_mqa.weight [kv_rank + rope, hidden]."""
    latent, rotary = weight[:kv_rank].double(), weight[kv_rank:].double()
    ref = rotary.pow(2).mean().sqrt().item() if rotary.numel() else 1.0
    return latent.pow(2).mean().sqrt().item() / ref if ref > 0 else 1.0


def scale_latent_rows(model) -> int:
    """Give every DeepseekV3 attention whose latent rows are in effattn's scaled form a RowScale
    parametrization on kv_a_proj_with_mqa.weight; returns how many. Undone by `unscale_latent_rows`."""
    from torch.nn.utils import parametrize
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    count = 0
    for module in model.modules():
        if not isinstance(module, DeepseekV3Attention) or parametrize.is_parametrized(module.kv_a_proj_with_mqa):
            continue
        weight = module.kv_a_proj_with_mqa.weight
        if weight.is_meta:  # a plan's model: no values to scale (it trains the same parameters)
            continue
        kv_rank = module.config.kv_lora_rank
        c = latent_row_scale(weight.detach(), kv_rank)
        if not 0 < c < SCALED_BELOW:
            continue
        scale = torch.ones(weight.shape[0], dtype=weight.dtype, device=weight.device)
        scale[:kv_rank] = c
        parametrize.register_parametrization(module.kv_a_proj_with_mqa, "weight", RowScale(scale))
        count += 1
    return count


def unscale_latent_rows(model) -> int:
    """Remove scale_latent_rows' parametrizations, keeping the weights they produce; returns how many."""
    from torch.nn.utils import parametrize

    count = 0
    for module in model.modules():
        if parametrize.is_parametrized(module, "weight") and isinstance(module.parametrizations.weight[0], RowScale):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
            count += 1
    return count


def is_mla(model) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) in ("deepseek_v3", "deepseek_v2") and bool(getattr(config, "kv_lora_rank", None))


def absorb(model) -> int:
    """Switch every DeepseekV3 attention module of `model` to the absorbed forward; returns how many."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    count = 0
    for module in model.modules():
        if isinstance(module, DeepseekV3Attention):
            module.forward = types.MethodType(_absorbed_forward, module)
            count += 1
    return count
