"""Multi-head latent attention (DeepSeek-V2/V3's MLA) from a GQA/MHA model, as a native DeepseekV3 checkpoint.

    effattn convert MODEL --to mla --kv-size 128 -o OUT

The cache of an MLA layer holds, per token, one latent vector c (`kv_lora_rank` numbers) and one
rotary key k_rot shared by every query head (`qk_rope_head_dim` numbers); each head's non-rotary key
and its value are decompressed from c by `kv_b_proj`. `--kv-size N` is that total (latent + rotary
key); the source caches 2 * kv_heads * head_dim.

Notation per layer: H query heads, G KV heads, head_dim d, F = d/2 RoPE frequencies (frequency f
rotates the pair of dims (f, f + d/2), i.e. the complex number z_f = x_f + i x_{f+d/2}; see
headmerge.py), hidden size D.

1. **Rotary key.** R = rope_dim/2 frequencies stay rotary. DeepseekV3 computes its rotary
   frequencies from `rope_theta` and `qk_rope_head_dim`, so the kept frequencies must be
   theta'^(-i/R), i = 0..R-1: a geometric progression that starts at the highest frequency. With
   theta' = theta^(stride*R/F) they are exactly the source's frequencies 0, stride, 2*stride, ...
   (`--rope-stride`, default 1: the R highest). Per kept frequency the G key heads are merged into
   one by the query-energy-weighted rank-1 complex PCA of the GQA head merging (RoPE-exact: a
   complex scale per frequency commutes with the rotation); each query head is compensated by
   conj(b_g). What the rank-1 merge leaves out of the kept frequencies is dropped (it would need its
   own rotation).
2. **Latent.** The other frequencies' key dims of every KV head (used without rotation: they are the
   lowest frequencies, whose rotation over the distances that matter is small) and every value head
   are stacked, x_nr = [k_nope(g) ..., v(g) ...], and compressed jointly to `kv_rank` numbers by PCA
   of calibration activations, layer by layer. `--latent-fit balanced` (default) is TransMLA's plain
   PCA with the K and V parts' energies balanced; `weighted` weighs each part by what its error costs
   downstream -- key dims by the energy of the queries that read them (logit error), value dims by
   o_proj (output error) -- then balances; measured worse on held-out code (BENCHMARKS.md).
3. **The latent RMSNorm.** DeepseekV3 always normalises the latent (`kv_a_layernorm`) before caching
   it. An RMSNorm whose eps dominates the mean square of its input is linear:
   w * x / sqrt(ms(x) + eps) ~ w * x / sqrt(eps). kv_a_proj's latent rows are scaled down by s so
   that ms(s * c) <= 1e-6 * eps for *every* possible input (a bound from the input norm's weight and
   the rows' spectral norm, not from calibration), and the norm's weight is sqrt(eps) / s: the
   cached latent is c, within 5e-7 relative. transformers fixes that norm's eps at 1e-6 while vLLM
   uses `rms_norm_eps`, so the output config sets `rms_norm_eps` to 1e-6 (the other norms change
   from the source's eps to 1e-6: measured in BENCHMARKS.md). float16 is refused: the scaled latent
   is below its normal range; bfloat16 and float32 hold it.
4. **Queries and output.** q_proj per head = [the head's non-rotary dims, its compensated rotary
   dims in DeepSeek's interleaved layout]; qk_head_dim = d, so the softmax scale is the source's.
   o_proj is unchanged (or refitted by least squares, `--refit-o`, default). Biases (Qwen2, Llama with
   attention_bias): value biases fold into an o_proj bias (attention weights sum to one), the key bias's
   non-rotary part is dropped (a constant per query: softmax ignores it), its rotary part is
   kv_a_proj's bias, and the query bias needs DeepseekV3's low-rank query path (the only query
   projection with a bias): q_a_proj carries [h; 1] through q_a_layernorm in its linear regime and
   q_b_proj = [W_q | b_q], exact. vLLM's DeepSeek attention has no biases: such outputs load in
   transformers only.

Qwen3 normalises each query and key head (q_norm, k_norm) before RoPE; no weight composition holds
that, so its q_proj and kv_a_proj are fitted by least squares from the layer's inputs to the new
queries, latent and rotary key computed from the normed activations (`fit_projections`): a measured
approximation.

Exact when nothing is approximated: one KV head (or identical key heads), every frequency rotary and
a full-rank latent reproduce the source's logits (tests/test_mla.py).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import Field

from ..attention.functional import project_qkv
from ..attention.mla import scaled_module
from ..data.corpora import DEFAULT_CALIB
from ..errors import EffattnError
from ..families import AttentionShape, Family, rope_settings
from ..io.checkpoint import Checkpoint
from ..io.writer import SafetensorsWriter, TensorSpec
from ..resources import Dims, compute_seconds
from .base import Plan, build_native, kv_bytes_per_token, out_dtype, read_time
from .calibrate import CALIB_HELP, CalibSettings, batches, ridge_solve
from .gqa import LayerAttention, _Moments
from .headmerge import complex_rows, merge_keys, merged_key_rows
from .layers import LayerInput, LayerOutput, calibrated_bytes, run_layers
from .refine import LearningRate, RefineOptions, Steps, Target, refine_default, refine_flops

LATENT_EPS = 1e-6  # transformers' kv_a_layernorm eps, whatever the config says (transformers #44261)
LINEAR_MARGIN = 1e-6  # ms(latent) <= LINEAR_MARGIN * eps for every input: the norm is linear within 5e-7
ROPE_TYPES = ("default", "linear", "llama3")  # types whose frequencies depend only on each frequency's value
ATTN_NAMES = ("q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")


class MLAOptions(RefineOptions):
    kv_size: int | None = Field(None, ge=2, description="numbers cached per token and layer: latent + rotary key "
                                                        "(required; the source caches 2 x kv_heads x head_dim)")
    kv_rank: int | None = Field(None, ge=1, description="latent size (DeepSeek's kv_lora_rank); default: kv_size "
                                                        "minus the rotary key")
    rope_dim: int | None = Field(None, ge=2, description="rotary key size (qk_rope_head_dim, even, at most head_dim); "
                                                         "default: half of head_dim, or what kv_size leaves")
    rope_stride: int = Field(1, ge=1, description="keep every k-th RoPE frequency rotary, from the highest (1: the "
                                                  "rope_dim/2 highest; DeepseekV3 needs a geometric progression)")
    latent_fit: Literal["balanced", "weighted"] = Field(
        "balanced", description="latent PCA: balanced (TransMLA: K/V norms balanced; measured best) or weighted "
                                "(key dims by query energy, values by o_proj, parts balanced)")
    calib: str = Field(DEFAULT_CALIB, description=CALIB_HELP)
    calib_tokens: int = Field(16384, ge=1, description="calibration tokens")
    refit_o: bool = Field(True, description="refit o_proj by ridge least squares on calibration activations (the "
                                            "original attention's output from the converted heads)")
    # Refinement is on by default: on SmolLM2 at kv_size 128 it takes held-out perplexity from 1.70x / 2.28x /
    # 1.99x to 1.51x / 1.99x / 1.75x (BENCHMARKS.md, MLA), for ~6 minutes of conversion on 2 cores.
    refine_steps: Steps = Field(30, description="local refinement: optimizer steps per layer fitting the original "
                                                "model's activations after the layer (0: off, a faster conversion)")
    refine_lr: LearningRate = refine_default("refine_lr", 3e-4)
    refine_target: Target = refine_default("refine_target", "stream")


def default_split(kv_size: int, head_dim: int, kv_rank: int | None, rope_dim: int | None) -> tuple[int, int]:
    """(kv_rank, rope_dim) for a cache of kv_size numbers: the given ones, else half the head's
    frequencies rotary (on SmolLM2 at kv_size 128, rope_dim 32 beat 16, 24, 40 and 64: BENCHMARKS.md),
    capped so the latent keeps at least half of kv_size."""
    if rope_dim is None:
        rope_dim = kv_size - kv_rank if kv_rank is not None else min(head_dim // 2, 2 * (kv_size // 4))
    if kv_rank is None:
        kv_rank = kv_size - rope_dim
    return kv_rank, rope_dim


def kept_frequencies(head_dim: int, rope_dim: int, stride: int) -> list[int]:
    return [stride * i for i in range(rope_dim // 2)]


def mla_rope_parameters(config: dict[str, Any], head_dim: int, rope_dim: int, stride: int) -> dict[str, Any]:
    """The output's rope_parameters: theta' = theta^(stride*R/F) makes DeepseekV3's R frequencies the
    source's frequencies 0, stride, 2*stride, ...; linear and llama3 scaling transfer unchanged (they
    act on each frequency by its value alone)."""
    params = rope_settings(config)
    kind = params.get("rope_type") or "default"
    if kind not in ROPE_TYPES:
        raise EffattnError(f"RoPE type {kind!r} cannot move to a smaller rotary head exactly (its frequencies depend on "
                           "the head size)", f"convert a model with RoPE type {', '.join(ROPE_TYPES)}")
    if float(params.get("partial_rotary_factor") or 1.0) != 1.0:
        raise EffattnError("this model rotates only part of each head (partial_rotary_factor)",
                           "convert a model whose RoPE covers the whole head")
    F, R = head_dim // 2, rope_dim // 2
    theta = float(params["rope_theta"]) ** (stride * R / F)
    out = {k: v for k, v in params.items() if k not in ("partial_rotary_factor",)}
    out["rope_theta"] = theta
    out["rope_type"] = kind
    return out


def mla_config(config: dict[str, Any], shape: AttentionShape, kv_rank: int, rope_dim: int, rope: dict[str, Any],
               bias: bool, target: torch.dtype | None) -> dict[str, Any]:
    """The output config.json: a dense DeepseekV3 (every field set is listed in the README)."""
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "hidden_act",
            "max_position_embeddings", "initializer_range", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id",
            "dtype", "torch_dtype")
    new = {k: config[k] for k in keep if k in config}
    # vLLM's DeepSeek model has no tied head (its lm_head is always loaded from the checkpoint): a tied
    # source's head is written out as its own tensor (run), so every engine reads the same weights
    new["tie_word_embeddings"] = False
    new |= {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
        "num_key_value_heads": shape.heads,  # DeepseekV3 expands the latent to every query head
        # q_lora_rank: none (a plain q_proj), or hidden + 1 where the source's queries have a bias (see convert_attention)
        "kv_lora_rank": kv_rank, "q_lora_rank": config["hidden_size"] + 1 if bias else None,
        "qk_rope_head_dim": rope_dim, "qk_nope_head_dim": shape.head_dim - rope_dim, "v_head_dim": shape.head_dim,
        "rope_parameters": rope, "rope_interleave": True,
        # dense: every layer's MLP is the source's (n_routed_experts is set so engines take the dense branch
        # through first_k_dense_replace, not through a missing expert count)
        "first_k_dense_replace": shape.layers, "n_routed_experts": 1, "num_experts_per_tok": 1, "n_shared_experts": 1,
        "n_group": 1, "topk_group": 1, "moe_intermediate_size": config["intermediate_size"],
        "num_nextn_predict_layers": 0,  # no multi-token-prediction layers
        "rms_norm_eps": LATENT_EPS,
        "attention_bias": bias, "attention_dropout": 0.0,
    }
    if target is not None:
        new["dtype"] = str(target).replace("torch.", "")
        new.pop("torch_dtype", None)
    return new


def attention_specs(shape: AttentionShape, kv_rank: int, rope_dim: int, bias: bool) -> dict[str, tuple[int, ...]]:
    """Shapes of one MLA layer's attention tensors (suffix after 'self_attn.')."""
    H, d, D = shape.heads, shape.head_dim, shape.hidden
    dn = d - rope_dim
    out = {"kv_a_proj_with_mqa.weight": (kv_rank + rope_dim, D),
           "kv_a_layernorm.weight": (kv_rank,), "kv_b_proj.weight": (H * (dn + d), kv_rank), "o_proj.weight": (D, H * d)}
    if bias:  # the low-rank query path, which holds a bias (see convert_attention)
        out |= {"q_a_proj.weight": (D + 1, D), "q_a_proj.bias": (D + 1,), "q_a_layernorm.weight": (D + 1,),
                "q_b_proj.weight": (H * d, D + 1), "kv_a_proj_with_mqa.bias": (kv_rank + rope_dim,), "o_proj.bias": (D,)}
    else:
        out["q_proj.weight"] = (H * d, D)
    return out


def _sqrtm(m: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Symmetric (pseudo-inverse) square root of a PSD matrix, eigenvalues floored at 1e-10 of the largest."""
    evals, evecs = torch.linalg.eigh(m)
    evals = evals.clamp_min(evals.max().clamp_min(1e-300) * 1e-10)
    power = -0.5 if inverse else 0.5
    return (evecs * evals.pow(power)) @ evecs.T


def linear_regime(A: torch.Tensor, input_gain: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(s * A, the RMSNorm weight sqrt(eps) / s) for latent rows A [r, D]: s makes ms(s A h) <= LINEAR_MARGIN
    * eps for every input h of the layer (|h| <= max|input norm gain| * sqrt(D)), so the latent norm is
    linear and its weight gives back A h."""
    r = A.shape[0]
    bound = (torch.linalg.matrix_norm(A, ord=2) * input_gain.double().abs().max()) ** 2 * hidden / max(r, 1)
    s = math.sqrt(LINEAR_MARGIN * LATENT_EPS / max(float(bound), 1e-300))
    return s * A, torch.full((r,), math.sqrt(LATENT_EPS) / s, dtype=torch.float64)


def interleave(z: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Complex [..., R, ...] -> real [..., 2R, ...] along `dim`, in DeepSeek's interleaved layout (Re_0, Im_0,
    Re_1, ...): rows of a weight (dim 0) or the last axis of activations (dim -1)."""
    dim = dim % z.dim()
    return torch.stack([z.real, z.imag], dim=dim + 1).flatten(dim, dim + 1)


class _LatentMoments(_Moments):
    """The GQA moments plus what the latent fit needs: E[x_nr x_nrᵀ] and the queries' non-rotary metric."""

    def __init__(self, nope_dims: torch.Tensor, group: int):
        super().__init__()
        self.nope_dims, self.group = nope_dims, group
        self.x_cov = self.q_metric = 0

    def add(self, q, k, v):
        super().add(q, k, v)
        kn = k[..., self.nope_dims].flatten(2)  # (B, T, G*dn)
        x = torch.cat([kn, v.flatten(2)], dim=-1).flatten(0, 1).float()  # (S, n)
        self.x_cov = self.x_cov + (x.T @ x).double()
        qn = q[..., self.nope_dims].float()  # (B, T, H, dn)
        B, T, H, dn = qn.shape
        qg = qn.reshape(B * T, H // self.group, self.group, dn)  # heads grouped by the KV head they read
        self.q_metric = self.q_metric + torch.einsum("sgid,sgie->gde", qg, qg).double()  # (G, dn, dn)


def convert_attention(attn: LayerAttention, shape: AttentionShape, *, kv_rank: int, rope_dim: int, stride: int,
                      latent_fit: str, stats, input_gain: torch.Tensor, bias: bool) -> tuple[dict[str, torch.Tensor], dict]:
    """One layer's MLA tensors (names after 'self_attn.') from the source attention and its calibration
    statistics (`stats`: _LatentMoments over the layer's calibration inputs), and the maps from source
    activations to the new ones (for `fit_projections`). Float64 throughout."""
    H, G, d, D = shape.heads, shape.kv_heads, shape.head_dim, shape.hidden
    per = H // G
    kept = torch.tensor(kept_frequencies(d, rope_dim, stride))
    nope = stats.nope_dims
    dn = len(nope)
    n = stats.n
    key_cov, q_energy = stats.key_cov / n, stats.q_energy / n  # (F, G, G), (H, F)
    # -- 1. the shared rotary key: per kept frequency, the query-weighted rank-1 complex PCA of the G key heads
    weight = torch.stack([q_energy[g * per:(g + 1) * per].sum(0) for g in range(G)])  # (G, F)
    km = merge_keys(key_cov[kept], weight[:, kept], list(range(G)))  # a, b: (G, R)
    k_rows = complex_rows(attn.k, G, d)[:, kept]  # (G, R, D)
    rot_key = interleave(merged_key_rows(k_rows, km))  # (2R, D)
    rot_key_bias = None
    if attn.k_bias is not None:
        rot_key_bias = interleave(merged_key_rows(complex_rows(attn.k_bias, G, d)[:, kept], km))
    q_rows = complex_rows(attn.q, H, d)[:, kept]  # (H, R, D)
    q_rot = q_rows * km.b.conj()[torch.arange(H) // per][:, :, None]  # w' = w conj(b_g)
    # -- 2. the latent: joint PCA of [non-rotary key dims of every KV head, every value head]
    wk = attn.k.double().reshape(G, d, D)[:, nope].reshape(G * dn, D)
    wv = attn.v.double()
    w_nr = torch.cat([wk, wv])  # (n, D)
    cov = stats.x_cov / n
    nk = G * dn
    if latent_fit == "weighted":
        scale2 = 1.0 / d  # logits are scaled by d^-1/2
        lk = torch.block_diag(*[_sqrtm(scale2 * stats.q_metric[g] / n) for g in range(G)]) if dn else torch.zeros(0, 0)
        wo = attn.o.double().reshape(D, H, d).permute(1, 0, 2)  # (H, D, d)
        metric = wo.transpose(1, 2) @ wo  # (H, d, d)
        lv = torch.block_diag(*[_sqrtm(metric[g * per:(g + 1) * per].sum(0)) for g in range(G)])
    else:
        lk, lv = torch.eye(nk, dtype=torch.float64), torch.eye(G * d, dtype=torch.float64)
    if dn:  # balance: equal energy E||L x||^2 in the key and value parts
        ek = torch.trace(lk @ cov[:nk, :nk] @ lk).clamp_min(1e-300)
        ev = torch.trace(lv @ cov[nk:, nk:] @ lv)
        lk = lk * (ev / ek).sqrt()
    L = torch.block_diag(lk, lv)  # (n, n)
    evals, evecs = torch.linalg.eigh(L @ cov @ L)
    P = evecs[:, -kv_rank:].flip(-1)  # top kv_rank principal directions (the plan caps kv_rank at n)
    A = P.T @ L @ w_nr  # (r, D): latent c = A h
    recon = torch.linalg.pinv(L, hermitian=True, rtol=1e-10) @ P  # (n, r): x_nr ~ recon c
    # -- 3. the latent RMSNorm in its linear regime, for every input
    latent, norm_weight = linear_regime(A, input_gain, D)
    kv_a = torch.cat([latent, rot_key])  # (r + 2R, D)
    # -- kv_b: per query head [its group's non-rotary key dims ; its group's value]
    rk, rv = recon[:nk].reshape(G, dn, kv_rank), recon[nk:].reshape(G, d, kv_rank)
    kv_b = torch.cat([torch.cat([rk[i // per], rv[i // per]]) for i in range(H)])  # (H*(dn+d), r)
    # -- 4. queries: [non-rotary dims, compensated rotary dims interleaved]; qk_head_dim = d keeps the scale
    wq = attn.q.double().reshape(H, d, D)
    q = torch.cat([torch.cat([wq[i, nope], interleave(q_rot[i])]) for i in range(H)])  # (H*d, D)
    out = {"kv_a_proj_with_mqa.weight": kv_a, "kv_a_layernorm.weight": norm_weight,
           "kv_b_proj.weight": kv_b, "o_proj.weight": attn.o.double()}
    if not bias:
        out["q_proj.weight"] = q
    else:
        # DeepseekV3's q_proj has no bias; its low-rank query path has one (q_a_proj, with attention_bias).
        # q_a carries [h; 1] (rank D+1) through q_a_layernorm in its linear regime, q_b = [W_q | b_q]: exact.
        qb = torch.zeros(H * d, dtype=torch.float64) if attn.q_bias is None else attn.q_bias.double()
        qbc = complex_rows(qb, H, d)[:, kept] * km.b.conj()[torch.arange(H) // per]  # (H, R)
        qb = qb.reshape(H, d)
        q_bias = torch.cat([torch.cat([qb[i, nope], interleave(qbc[i])]) for i in range(H)])
        bound_q = (input_gain.double().abs().max() ** 2 * D + 1) / (D + 1)
        sq = math.sqrt(LINEAR_MARGIN * LATENT_EPS / float(bound_q))
        qa = torch.zeros(D + 1, D, dtype=torch.float64)
        qa[:D] = sq * torch.eye(D, dtype=torch.float64)
        qa_bias = torch.zeros(D + 1, dtype=torch.float64)
        qa_bias[D] = sq
        out |= {"q_a_proj.weight": qa, "q_a_proj.bias": qa_bias,
                "q_a_layernorm.weight": torch.full((D + 1,), math.sqrt(LATENT_EPS) / sq, dtype=torch.float64),
                "q_b_proj.weight": torch.cat([q, q_bias[:, None]], dim=1)}
    if bias:
        kv_bias = torch.zeros(kv_rank + rope_dim, dtype=torch.float64)
        if rot_key_bias is not None:
            kv_bias[kv_rank:] = rot_key_bias
        o_bias = torch.zeros(D, dtype=torch.float64) if attn.o_bias is None else attn.o_bias.double()
        if attn.v_bias is not None:  # attention weights sum to one: a value bias is a constant output
            vb = attn.v_bias.double().reshape(G, d)
            o_bias = o_bias + attn.o.double() @ torch.cat([vb[i // per] for i in range(H)])
        out |= {"kv_a_proj_with_mqa.bias": kv_bias, "o_proj.bias": o_bias}
    return out, {"merge": km, "latent": P.T @ L, "kept": kept, "nope": nope, "per": per}


@torch.no_grad()
def fit_projections(out: dict[str, torch.Tensor], maps: dict, attn: LayerAttention, shape: AttentionShape, hs,
                    eps: float, input_gain: torch.Tensor, ridge: float = 1e-6) -> dict[str, torch.Tensor]:
    """For a source whose queries and keys pass through per-head RMSNorms (Qwen3's q_norm/k_norm),
    no composition of weights gives the new projections: fit q_proj and kv_a_proj by ridge least
    squares from the attention inputs h to the new queries, latent and rotary key computed from the
    source's normed q/k (the same maps `convert_attention` applies to the weights). A measured
    approximation: a per-head norm is not linear."""
    from .headmerge import to_complex

    H, d, D = shape.heads, shape.head_dim, shape.hidden
    kept, nope, per, km = maps["kept"], maps["nope"], maps["per"], maps["merge"]
    gram = torch.zeros(D, D, dtype=torch.float64)
    cross_q = torch.zeros(D, H * d, dtype=torch.float64)
    r = maps["latent"].shape[0]
    cross_kv = torch.zeros(D, r + 2 * len(kept), dtype=torch.float64)
    conj_b = km.b.conj()[torch.arange(H) // per]  # (H, R)
    for h in hs:
        q, k, v = project_qkv(h, attn, d, eps)  # (B, T, ., d), after the per-head norms
        x = h.flatten(0, 1).double()
        x_nr = torch.cat([k[..., nope].flatten(2), v.flatten(2)], dim=-1).flatten(0, 1).double()
        rot = (km.a * to_complex(k)[..., kept]).sum(-2)  # (B, T, R): z' = sum_g a_g z_g
        q_rot = to_complex(q)[..., kept] * conj_b  # (B, T, H, R)
        q_new = torch.cat([q[..., nope].double(), interleave(q_rot, -1)], dim=-1).flatten(2).flatten(0, 1)
        kv_new = torch.cat([x_nr @ maps["latent"].T, interleave(rot, -1).flatten(0, 1)], dim=-1)
        gram += x.T @ x
        cross_q += x.T @ q_new
        cross_kv += x.T @ kv_new
    q_w = ridge_solve(gram, cross_q, torch.zeros_like(cross_q), ridge).T  # (H*d, D)
    kv_w = ridge_solve(gram, cross_kv, torch.zeros_like(cross_kv), ridge).T  # (r + 2R, D)
    latent, norm_weight = linear_regime(kv_w[:r], input_gain, D)
    return out | {"q_proj.weight": q_w, "kv_a_proj_with_mqa.weight": torch.cat([latent, kv_w[r:]]),
                  "kv_a_layernorm.weight": norm_weight}


@torch.no_grad()
def refit_o(module, original, x: torch.Tensor, cos, sin, rope, calib: CalibSettings) -> torch.Tensor:
    """Ridge least squares for the MLA layer's o_proj: argmin_W Σ‖y − W o'‖² + λ‖W − W₀‖², o' the
    converted heads' outputs (o_proj's input), y the original attention's output (bias removed) on the
    same inputs; λ as the calibrated GQA refit (calibrate.py)."""
    from .refine import attention_out

    attn = module.self_attn
    seen: list[torch.Tensor] = []
    hook = attn.o_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0].flatten(0, 1)))
    n = attn.o_proj.in_features
    gram = torch.zeros(n, n, dtype=torch.float64)
    cross = torch.zeros(n, attn.o_proj.out_features, dtype=torch.float64)
    o_bias = original.self_attn.o_proj.bias
    try:
        for sl in batches(x, calib.batch_size):
            seen.clear()
            attention_out(module, x[sl], *rope)
            heads = seen[0]  # (S, H*d)
            y = attention_out(original, x[sl], cos, sin).flatten(0, 1)
            if o_bias is not None:
                y = y - o_bias
            if attn.o_proj.bias is not None:
                y = y - (attn.o_proj.bias - (0 if o_bias is None else o_bias))
            gram += (heads.T @ heads).double()
            cross += (heads.T @ y).double()
    finally:
        hook.remove()
    return ridge_solve(gram, cross, attn.o_proj.weight.double().T, calib.ridge).T.float()


class MLAConversion:
    Options = MLAOptions
    aliases: dict[str, dict] = {}
    model = None  # native: transformers' DeepseekV3ForCausalLM
    name = "mla"
    memory_options = ("calib_tokens",)
    description = "multi-head latent attention (DeepSeek MLA): a latent KV cache, native DeepseekV3"

    def targets(self, config: dict[str, Any]) -> str:
        shape = AttentionShape.of(config)
        return (f"--kv-size N (numbers cached per token and layer; now {2 * shape.kv_heads * shape.head_dim}), "
                f"optionally --kv-rank / --rope-dim")

    def check_model(self, config: dict[str, Any], family: Family) -> None:
        if config.get("mlp_bias"):
            raise EffattnError("this model's MLP has biases, which DeepseekV3's MLP has not",
                               "convert a model without MLP biases")
        if (family.qkv_bias == "always" or config.get("attention_bias")) and family.has_qk_norm:
            raise EffattnError(f"this {family.name} model has both attention biases and per-head q/k norms, which "
                               "the fitted projections do not hold together", "convert a model without attention biases")

    def plan(self, ckpt: Checkpoint, family: Family, opts: MLAOptions, target=None) -> Plan:
        config = ckpt.config
        shape = AttentionShape.of(config)
        d = shape.head_dim
        before_size = 2 * shape.kv_heads * d
        if opts.kv_size is None:
            raise EffattnError("--kv-size is required for --to mla",
                               f"e.g. --kv-size {before_size // 3} (the source caches {before_size} numbers per token "
                               "and layer)")
        kv_rank, rope_dim = default_split(opts.kv_size, d, opts.kv_rank, opts.rope_dim)
        if kv_rank + rope_dim != opts.kv_size:
            raise EffattnError(f"--kv-rank {kv_rank} + --rope-dim {rope_dim} = {kv_rank + rope_dim}, not --kv-size "
                               f"{opts.kv_size}", "give two of the three, or three that add up")
        if rope_dim % 2 or not 2 <= rope_dim <= d:
            raise EffattnError(f"--rope-dim {rope_dim} must be even and between 2 and head_dim ({d})",
                               f"e.g. --rope-dim {d // 2}")
        if kv_rank < 1:
            raise EffattnError(f"--kv-size {opts.kv_size} leaves no latent after a rotary key of {rope_dim}",
                               f"use --kv-size {rope_dim + 1} or more, or a smaller --rope-dim")
        if opts.rope_stride * (rope_dim // 2 - 1) > d // 2 - 1:
            raise EffattnError(f"--rope-stride {opts.rope_stride} with --rope-dim {rope_dim} needs frequency "
                               f"{opts.rope_stride * (rope_dim // 2 - 1)}, but the head has {d // 2}",
                               f"use --rope-stride {max(1, (d // 2 - 1) // max(rope_dim // 2 - 1, 1))} or less")
        if target == torch.float16 or (target is None and ckpt.dtype == torch.float16):
            raise EffattnError("float16 cannot hold the latent at the scale that keeps DeepseekV3's latent RMSNorm "
                               "linear (below float16's normal range)", "pass --dtype bfloat16 or --dtype float32")
        nope = d - rope_dim
        n_nr = shape.kv_heads * (nope + d)
        if kv_rank > n_nr:
            raise EffattnError(f"--kv-rank {kv_rank} is more than the non-rotary keys and values hold ({n_nr} numbers)",
                               f"use --kv-rank {n_nr} or less")
        bias = family.qkv_bias == "always" or bool(config.get("attention_bias"))
        rope = mla_rope_parameters(config, d, rope_dim, opts.rope_stride)
        new = mla_config(config, shape, kv_rank, rope_dim, rope, bias, target)
        build_native(new, "the DeepseekV3 config", "report this with the command you ran")
        dtype = target or ckpt.dtype
        before = kv_bytes_per_token(config, dtype)
        after = float(shape.layers * opts.kv_size * dtype.itemsize)
        parts = ("q_proj", "k_proj", "v_proj", "o_proj") + (("q_norm", "k_norm") if family.has_qk_norm else ())
        source_attn = {family.attn(i, p, k) for i in range(shape.layers) for p in parts for k in ("weight", "bias")}
        specs = [TensorSpec(name, ckpt.meta(name)[0], out_dtype(ckpt.meta(name)[1], target))
                 for name in ckpt.names() if name not in source_attn]
        untie = family.lm_head not in set(ckpt.names())  # tied: the head is the embedding, written as lm_head
        if untie:
            shape_, dt = ckpt.meta(family.embed)
            specs.append(TensorSpec(family.lm_head, shape_, out_dtype(dt, target)))
        float_dtype = out_dtype(ckpt.meta(family.attn(0, "q_proj"))[1], target)
        for i in range(shape.layers):
            for suffix, shp in attention_specs(shape, kv_rank, rope_dim, bias).items():
                name = f"{family.prefix(i)}self_attn.{suffix}"
                specs.append(TensorSpec(name, shp, float_dtype))
        calib = CalibSettings(corpus=opts.calib, tokens=opts.calib_tokens).validate(ckpt.folder)
        refine = opts.refine_settings()
        dims = Dims.of(config)
        N, T = calib.tokens, calib.seq_len
        per_layer = dims.attention_flops(N, T) + dims.layer_flops(N, T) + refine_flops(dims, refine, N, T)
        summary = [
            ("model", f"{family.name}, {shape.layers} layers, {shape.heads} query heads, {shape.kv_heads} KV heads, "
                      f"head_dim {d}"),
            ("cache", f"{before_size} -> {opts.kv_size} numbers per token and layer: latent {kv_rank} + rotary key "
                      f"{rope_dim} (frequencies {', '.join(map(str, kept_frequencies(d, rope_dim, opts.rope_stride)[:4]))}"
                      f"{', ...' if rope_dim > 8 else ''} of {d // 2})"),
            ("latent", f"{opts.latent_fit} PCA of calibration activations, layer by layer"),
            ("KV cache", f"{before:,.0f} -> {after:,.0f} bytes/token ({after / before:.1%} of the original)"),
            ("output", "DeepseekV3ForCausalLM (dense, no MTP, interleaved RoPE, rms_norm_eps 1e-6)"),
            ("calibration", f"{calib.tokens:,} tokens of {calib.corpus!r} in blocks of {calib.seq_len}, layer by layer"),
            ("refinement", refine.summary("the attention's projections (those at the latent norm's linear-regime "
                                          "scale kept)") if refine.steps
             else "none (--refine-steps 0): the closed-form fit alone"),
        ]
        settings = {"kv_size": opts.kv_size, "kv_rank": kv_rank, "rope_dim": rope_dim, "rope_stride": opts.rope_stride,
                    "latent_fit": opts.latent_fit, "refit_o": opts.refit_o, "calib": calib.corpus, "calib_tokens": calib.tokens,
                    "calib_seq_len": calib.seq_len, **refine.record()}
        state = {"shape": shape, "kv_rank": kv_rank, "rope_dim": rope_dim, "stride": opts.rope_stride,
                 "latent_fit": opts.latent_fit, "refit_o": opts.refit_o, "untie": untie, "bias": bias, "target": target, "calib": calib, "refine": refine}
        return Plan(conversion=self.name, settings=settings, config=new, specs=specs, summary=summary,
                    kv_bytes_per_token=(before, after), est_seconds=read_time(ckpt) + compute_seconds(shape.layers * per_layer),
                    est_peak_bytes=calibrated_bytes(ckpt, family, calib, refine), state=state)

    def run(self, ckpt: Checkpoint, family: Family, plan: Plan, writer: SafetensorsWriter, progress) -> None:
        from ..attention.layerwise import LayerFactory

        target = LayerFactory(plan.config, family)
        length = plan.state["calib"].seq_len
        plan.state["target_rope"] = target.rope(length)
        plan.state["target_factory"] = target
        plan.measured |= run_layers(
            ckpt, family, writer, lambda layer: self.convert_layer(plan, family, layer), layers=plan.state["shape"].layers,
            target=plan.state["target"], calib=plan.state["calib"], refine=plan.state["refine"], progress=progress,
            description="calibrating layers")
        if plan.state.get("untie"):
            writer.write(family.lm_head, ckpt.get(family.embed))
            ckpt.release()

    @staticmethod
    def convert_layer(plan: Plan, family: Family, layer: LayerInput) -> LayerOutput:
        shape, kv_rank, rope_dim = (plan.state[k] for k in ("shape", "kv_rank", "rope_dim"))
        calib: CalibSettings = plan.state["calib"]
        eps = float(layer.factory.config.rms_norm_eps)
        names = LayerAttention.names(family, layer.index, layer.tensors)
        old = LayerAttention(**{role: layer.tensors[name].float() for role, name in names.items()})
        norm = layer.original.input_layernorm
        d = shape.head_dim
        F = d // 2
        kept = set(kept_frequencies(d, rope_dim, plan.state["stride"]))
        nope_f = [f for f in range(F) if f not in kept]
        nope_dims = torch.tensor(nope_f + [f + F for f in nope_f], dtype=torch.long)
        moments = _LatentMoments(nope_dims, shape.heads // shape.kv_heads)
        for sl in batches(layer.x, calib.batch_size):
            moments.add(*project_qkv(norm(layer.x[sl]), old, d, eps))
        gain = layer.tensors[f"{layer.prefix}{family.input_norm}.weight"]
        new, maps = convert_attention(old, shape, kv_rank=kv_rank, rope_dim=rope_dim, stride=plan.state["stride"],
                                      latent_fit=plan.state["latent_fit"], stats=moments, input_gain=gain,
                                      bias=plan.state["bias"])
        if family.has_qk_norm:
            hs = (norm(layer.x[sl]) for sl in batches(layer.x, calib.batch_size))
            new = fit_projections(new, maps, old, shape, hs, eps, gain)
        source_attn = set(names.values())
        tensors = {n: t for n, t in layer.tensors.items() if n not in source_attn}
        tensors |= {f"{layer.prefix}self_attn.{k}": v.float() for k, v in new.items()}
        factory = plan.state["target_factory"]
        module = factory.layer(layer.index, tensors, shape.heads)
        if plan.state["refit_o"]:
            name = f"{layer.prefix}self_attn.o_proj.weight"
            tensors[name] = refit_o(module, layer.original, layer.x, layer.cos, layer.sin, plan.state["target_rope"], calib)
            module.self_attn.o_proj.weight.data = tensors[name]
        return LayerOutput(tensors, module=module, rope=plan.state["target_rope"],
                           # the projections, except those kept at the latent norm's linear-regime scale
                           trainable=[n for n, _ in module.self_attn.named_parameters()
                                      if n.endswith("proj.weight") and not scaled_module(n)],
                           note=f"latent {kv_rank} + rotary {rope_dim}")
