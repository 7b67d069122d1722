"""Softmax -> linear attention (`--to linear`): LoLCATs' hybrid of sliding-window softmax and linear
attention, its feature maps fitted by attention transfer, layer by layer.

    effattn convert MODEL --to linear -o OUT                                  # hedgehog maps, window 64
    effattn convert MODEL --to linear --feature-map performer --features 128 --window 0 -o OUT
    effattn convert MODEL --to linear --refine-steps 0 -o OUT                 # zero-shot: maps at their initial values

The output is effattn's `effattn_linear` model (attention/linear.py): the same weights (q/k/v/o copied
unchanged) plus per layer two feature maps (`self_attn.feature_map_q`, `self_attn.feature_map_k`) and a
per-head mix of the window and the linear part (`self_attn.window_factors`). `import effattn` registers
it; `trust_remote_code=True` loads the bundled copy without effattn.

The conversion *is* LoLCATs' stage 1, attention transfer (Zhang et al. 2024, Sec. 3.1): on calibration
text, one decoder layer at a time (layers.py), only the maps' and the mix's parameters train (Adam)
so that the hybrid attention's output matches the original softmax attention's on the same inputs
(refine.py, target `attention`); each layer is fitted on the activations the already-converted layers
below produce. The per-layer relative errors before (maps at their initial values; the mix too, but where
`initial_mix` chose it) and after are recorded in effattn.json (`conversion_run.refine`). Maps without parameters (elu, taylor, performer)
still train the mix, from the start `initial_mix` picks per layer on one calibration sequence (their
phi(q).phi(k) is not on the window's scale; `conversion_run.initial_mix`). The mix only weighs the hybrid's four
sums (kernels/linear's `HybridParts`), which do not depend on it: `mix_predictor` computes them once per layer, and
the grid's points and refinement's steps each cost an o_proj (refine.refine_layer's `prepare`; elu on SmolLM2:
94 s against 218 s through the kernel at every step, the same model). `--refine-steps 0` skips
calibration: the maps and the mix keep their initial values.

Defaults (SmolLM2-135M, 30 layers, on 2 CPU cores): Adam at lr 1e-2 as LoLCATs' attention transfer,
40 steps per layer of 2 x 2,048 calibration tokens drawn from 16,384 tokens of `calib` (also the targets
and the recorded losses), its eight sequences at positions spread over the model's trained length
(`--calib-positions`: the maps read rotated queries and keys, and a model fitted at positions 0-2,047 alone
broke down beyond them, 146 against the original's 20.0 on wiki at 8,192 tokens). The sequence length is
the lever measured (BENCHMARKS.md, "Linear attention"): fitted on 512-token sequences (20 steps) the maps
gave 3.01x / 3.22x the original's perplexity at 2,048 tokens, on 2,048-token sequences (40 steps) 1.90x /
2.05x (both without sinks): the far part must learn the weight of thousands of keys, not hundreds. With
the sinks the default conversion took 330 s on 2 idle cores (321 s without them; the plan said 603 s).

Attention sinks (`--sinks`, default 4 with a window): the first positions of a sequence stay under exact
softmax for every later query (StreamingLLM, Xiao et al. 2023). The heads of a pretrained LLM put much of
their weight on the first token, a spike that bounded feature maps cannot give one key among thousands;
kept exact, it costs 4 keys and values per head. On SmolLM2 the default transfer's mean per-layer error
fell from 0.155 to 0.072 with them, and perplexity at 2,048 tokens from 1.90x / 2.05x to 1.36x / 1.45x
(shakespeare / britannica; BENCHMARKS.md).

Exact heads (`--exact-heads K`, default 0): while the calibration activations go through each transferred layer,
every KV head is scored by the relative error of its attention output against the original's (exact_heads.py);
after the walk the K worst keep the original attention (full RoPE softmax over every key, a cache that grows on
those heads; `linear_exact_heads` in config.json, every head's error in effattn.json), as `vq-init --exact-heads`
does for VQ. The transfer itself is the same: every head's map is fitted, and one conversion serves every K
(bench_linear.py's `--exact-heads` scores several).

The cache stops growing after the window and the sinks: per layer the window's keys, values and feature keys of the
H query heads (the KV heads are repeated before the key map, as LoLCATs does) plus the linear state
S [H, F, Dv] and z [H, F]. The plan states both parts; its `kv_bytes_per_token` is the cache at the
trained context divided by that context (as `--to swa` reports a window's cache).

Linformer (also a "linear attention") projects the keys and values along the *sequence* axis with a
matrix fixed to a maximal length: position t's output then depends on later tokens, which breaks
causal decoding, so it is refused (`--feature-map linformer` says why).
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import torch
from pydantic import Field, field_validator

from ..data.corpora import DEFAULT_CALIB
from ..errors import EffattnError
from ..families import AttentionShape, Family, trained_length
from ..io.checkpoint import Checkpoint
from ..io.writer import SafetensorsWriter, TensorSpec
from ..models import ModelSpec
from ..resources import Dims, compute_seconds
from .base import Plan, kv_bytes_per_token, out_dtype, read_time, same_specs
from .calibrate import CALIB_HELP, CalibSettings, batches, rows_of, starts
from .layers import LayerInput, LayerOutput, calibrated_bytes, run_layers, streaming_bytes
from .exact_heads import choose, scoring_hooks
from .refine import LearningRate, RefineOptions, Steps, Target, attention_out, refine_flops, relative_error

FeatureMapName = Literal["hedgehog", "elu", "performer", "taylor"]
# the options each feature map reads (refused with the others)
MAP_OPTIONS = {"hedgehog": ("projection_dim",), "performer": ("features",), "elu": (), "taylor": ()}
MAP_DEFAULTS = {"projection_dim": 64, "features": 128}
LINFORMER = ("Linformer projects keys and values along the sequence axis (a fixed [k, max_length] matrix), so each "
             "position's output depends on later tokens, which breaks causal decoding; effattn refuses it for causal "
             "LMs. Use --feature-map hedgehog (or elu, performer, taylor)")
# The plan's time for attention transfer: `linear_attention_flops` (below) times this, for the CPU's kernels of
# the hybrid (many small products: the chunks, the maps, the state's scan) against the matmul rate
# `compute_seconds` assumes. Fitted on SmolLM2, 2 idle cores, hedgehog P 64 (F 128), window 64: the default
# conversion (4 sinks, 40 steps on 8,192 tokens in blocks of 2,048) took 330 s and wants 0.80; without sinks 321 s
# (0.78); 120 steps on 24,576 tokens 1,002 s (0.81). The model is linear in F and the kernels are not: P 128
# (F 256) took 673 s where this says 410 s (dry run) (it would want 1.36). The earlier model (a softmax pass per step,
# whatever F) said 603 s for all of these.
LINEAR_FORWARD_EXTRA = 0.8
# The plan's time for scoring the heads (--exact-heads): this share of one attention block's forward (`attention_flops`,
# at the layer-wise rate) per layer. The scoring is one SDPA pass and the q/k/v projections per calibration block, far
# faster than the layer-wise rate assumes: on SmolLM2 (2 cores) the default conversion with --exact-heads 18 took 341 s
# against 330 s without, where the full `attention_flops` said 135 s more.
EXACT_SCORING_SHARE = 0.1
# Feature tensors of one calibration batch the transfer holds at once (the plan's peak memory): measured on SmolLM2
# with taylor (F 2,145): 2.25 GB at the peak where the walk alone is estimated at 1.08 GB, 3.7 batches' [2, 2048, 9,
# F] float32 tensors more (elu, F 64: 1.10 GB against 1.08).
FEATURE_COPIES = 4
# Attention sinks kept exact by default (StreamingLLM's name and count). Measured on SmolLM2 (BENCHMARKS, "Linear
# attention"): with the default transfer, 4 sinks took the mean per-layer error on the calibration text from 0.155
# to 0.072; in a one-layer screen on calibration text (layer 5, 40 steps) 1 sink and 4 gave the same held-out error
# (0.198, 0.200 against 0.323 without).
SINKS = 4


# Logits of the window/linear mix `initial_mix` tries, besides the initial one, for maps without parameters.
# elu + 1 and Performer's features give phi(q).phi(k) of another scale than the window's exp(q.k - max) <= 1
# (elu's is about head_dim), so LoLCATs' 1:10 start lets the linear part drown the window, and 40 Adam steps at
# lr 1e-2 move a logit by 0.4 at most: on SmolLM2, elu at window 64 left the mean per-layer error at 0.892
# (0.892 before the steps), the mix going from 0.091 to 0.13. Hedgehog's features are two distributions, of
# the window's scale, and its maps train with the mix: it starts at 1:10 as LoLCATs does (on SmolLM2 this grid
# for hedgehog too chose logits 2-8, and after the same steps the mean per-layer error was 0.173 against 0.072).
# Up to 12 the grid's top was elu's choice in 29 of 30 layers, with the far keys' weight still felt (elu at
# 1.95x / 1.82x / 2.23x perplexity, a window of 64 + 4 sinks alone 1.41x / 1.48x / 1.68x): it reaches 20, and
# elu then chose 10-16 (14 in 22 layers) and gave 1.50x / 1.54x / 1.74x (BENCHMARKS, "Every map and window").
MIX_GRID = tuple(float(x) for x in range(-8, 21, 2))


def mix_predictor(module: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  batch: int = 2) -> Callable[[torch.Tensor], torch.Tensor]:
    """For a decoder layer `module` whose LinearAttention has only its mix to fit (a feature map without
    parameters): `predict(rows)`, the attention's output on x[rows] for the current mix, from the hybrid's
    four sums on x, computed here once (`LinearAttention.parts`, `batch` sequences at a time). The same
    function as `attention_out(module, x[rows], ...)`, without the kernel: refinement's steps and
    `initial_mix`'s grid then cost an o_proj each (refine.refine_layer's `prepare`)."""
    attn = module.self_attn
    with torch.no_grad():
        chunks = [attn.parts(module.input_layernorm(x[sl]), rows_of((cos, sin), sl)) for sl in batches(x, batch)]
        parts = type(chunks[0])(*(torch.cat(p) for p in zip(*chunks)))

    def predict(rows: torch.Tensor) -> torch.Tensor:
        return attn.from_parts(type(parts)(*(p[rows] for p in parts)))

    return predict


@torch.no_grad()
def initial_mix(module: torch.nn.Module, original: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[float, float]:
    """Set every head's mix logit (`window_factors`) of `module` (a decoder layer with a LinearAttention whose
    map has no parameters) to the one of `INIT_WINDOW_FACTOR` and `MIX_GRID` whose attention output on x
    [N, T, D] is closest to `original`'s (relative squared error, as refinement measures it); returns (logit,
    error). The hybrid's sums on x are computed once (`mix_predictor`): each grid point costs an o_proj."""
    from ..attention.linear import INIT_WINDOW_FACTOR

    target = attention_out(original, x, cos, sin)
    predict, rows = mix_predictor(module, x, cos, sin), torch.arange(len(x))
    factors = module.self_attn.window_factors
    best: tuple[float, float] | None = None
    for logit in (INIT_WINDOW_FACTOR, *MIX_GRID):
        factors.fill_(logit)
        err = relative_error(predict(rows), target)
        if best is None or err < best[1]:
            best = (logit, err)
    factors.fill_(best[0])
    return best


def linear_attention_flops(dims: Dims, tokens: int, seq_len: int, window: int, sinks: int, features: int,
                           map_flops: int, chunk: int = 64) -> float:
    """One hybrid attention block's forward over `tokens` in blocks of `seq_len` (the cost model of the plan's
    time): the projections; per query head and token the two feature maps (`map_flops` each), the window's
    and the sinks' scores and weighted sum, and beyond the window the state's read and update (F x head_dim
    each) and the chunked kernel's products inside a chunk (chunk x (F + head_dim))."""
    proj = 2 * tokens * dims.hidden * (2 * dims.heads + 2 * dims.kv_heads) * dims.head_dim
    D, F = dims.head_dim, features
    exact = 4 * D * min(window + sinks, seq_len)
    far = 4 * F * D + 2 * chunk * (F + D) if seq_len > window else 0
    return proj + tokens * dims.heads * (2 * map_flops + exact + far)


class LinearOptions(RefineOptions):
    feature_map: FeatureMapName = Field(
        "hedgehog", description="phi: hedgehog (LoLCATs' learned map [softmax(xW), softmax(-xW)]), elu (elu + 1), "
                                "performer (FAVOR+ random features) or taylor (2nd-order Taylor of exp, as in Based)")
    window: int = Field(64, ge=0, description="keys under exact softmax (the query's own included); older keys go "
                                              "through the feature maps (0: pure linear attention)")
    sinks: int | None = Field(None, ge=0, description="first positions kept under exact softmax for every later "
                                                      "query (attention sinks: the feature maps cannot reproduce the "
                                                      f"weight heads put on the first token; default {SINKS}, 0 with "
                                                      "--window 0); needs --window > 0")
    projection_dim: int | None = Field(None, ge=1, description="hedgehog: P, the per-half size of the learned map "
                                                               f"(F = 2P features; default {MAP_DEFAULTS['projection_dim']})")
    features: int | None = Field(None, ge=1, description="performer: number of random features F "
                                                         f"(default {MAP_DEFAULTS['features']})")
    global_cache: int = Field(0, ge=0, description="G: far keys per query head kept under exact softmax, those whose "
                              "values the linear state recalls worst (LoLA's sparse global cache, chosen as keys leave "
                              "the window); the cache stays bounded; needs --window > 0; the maps are fitted without "
                              "it (LoLA needs no training) (0: none)")
    exact_heads: int = Field(0, ge=0, description="K: the K KV heads whose attention output the hybrid changes most on "
                                                  "the calibration text (after attention transfer) keep their original "
                                                  "attention, with a cache that grows on those heads (0: none)")
    calib: str = Field(DEFAULT_CALIB, description=CALIB_HELP + " (attention transfer)")
    # 16,384 since the sequences spread over the trained length (2026-12-06): the maps then see each stretch of
    # positions twice; on wiki (a training corpus, for diagnosis) 28.91 at 2,048 and 38.05 at 8,192 tokens against
    # 30.39 and 41.05 with 8,192 tokens (and 27.13 and 146.27 with every sequence at 0), in the same time
    calib_tokens: int = Field(16384, ge=1, description="calibration tokens (attention transfer)")
    calib_seq_len: int = Field(2048, ge=2, description="calibration sequence length: the length the maps learn to "
                                                       "weigh far keys at (longer than the window)")
    calib_positions: int | None = Field(None, ge=0, description="the context the calibration sequences' positions "
                                        "spread over, evenly from 0 to its end: the maps read rotated queries and keys, "
                                        "and learn only the positions they are fitted at (default: the model's trained "
                                        "length, max_position_embeddings; 0: every sequence at positions from 0)")
    # LoLCATs' attention transfer uses lr 1e-2 (Adam). Measured on SmolLM2 layer 5 (hedgehog, window 64,
    # 4,096 calibration tokens in 512-token sequences, 2 busy cores): relative error 0.99 untrained -> 0.26
    # after 20 steps, 0.17 after 40, 0.16 after 40 at lr 3e-2. With 2,048-token sequences and 40 steps the
    # mean error over the 30 layers is 0.155 (0.183 with 512 and 20). 0: no attention transfer.
    refine_steps: Steps = Field(40, description="attention transfer: optimizer steps per layer training the "
                                                "feature maps and the window/linear mix (0: off, zero-shot maps)")
    refine_lr: LearningRate = Field(1e-2, description="learning rate of attention transfer (Adam; LoLCATs' 1e-2)")
    refine_target: Target = Field("attention", description="what attention transfer fits: attention (the original "
                                  "attention's output on the same inputs, LoLCATs) or stream (the original model's "
                                  "activations after the layer)")

    @field_validator("feature_map", mode="before")
    @classmethod
    def _refuse_linformer(cls, v):
        if isinstance(v, str) and v.lower() == "linformer":
            raise ValueError(LINFORMER)
        return v


def spread_words(calib: CalibSettings) -> str:
    """' at positions spread over 8,192 (starting at 0, 2,048, ...)' for the plan's attention transfer line, or
    '' where every sequence starts at 0."""
    first = starts(calib, calib.tokens // calib.seq_len).tolist()
    if not any(first):
        return ""
    shown = ", ".join(f"{p:,}" for p in first[:4]) + (", ..." if len(first) > 4 else "")
    return f" at positions spread over {calib.positions:,} (starting at {shown})"


def _decode_line(feature_map: str, global_cache: int) -> str:
    """Which decode step runs here (said once, at planning; the step also warns when it falls back)."""
    from ..kernels.linear import native

    why = native.why_unavailable()
    step = "global_cache_attention" if global_cache else "hybrid_attention_step"
    if global_cache and feature_map != "hedgehog":
        return f"PyTorch ({step}): the compiled step with a global cache computes Hedgehog's maps only"
    if why:
        return f"PyTorch ({step}): the compiled one is unavailable ({why})"
    return "compiled, one call per layer and token (kernels/linear/native.c" + (
        ", the cache's decisions included)" if global_cache else ")")


# What a hybrid decoder layer keeps for the backward pass beyond the fine-tune plan's generic count (12 hidden + 4
# intermediate floats per token), per token and query head, in float32: ACTIVATION_FEATURES x F (the maps' outputs, the
# far part's delayed keys) + ACTIVATION_HEAD_DIMS x head_dim (the window's blocks of logits, the rotated and repeated q,
# k, v). Counted with torch's saved-tensor hooks on one SmolLM2-sized layer (9 heads, head_dim 64, window 64, 4 sinks)
# at T = 2,048: hedgehog (F 128) 218 MB, elu (F 64) 204 MB, taylor (F 2,145) 657 MB, against 107 MB for the generic
# count; this model gives 220, 206 and 666.
ACTIVATION_FEATURES, ACTIVATION_HEAD_DIMS = 3, 18
# The global cache's kernel (linear_global_cache = G > 0) keeps, per token and query head, about
# GLOBAL_ACTIVATION_COLUMNS floats per key its queries read exactly (the cache, the window and the sinks) beyond the
# hybrid's count: its runs' logits, weights and gathered keys. Counted the same way on SmolLM2's layer 5 at T = 2,048
# (window 64, 4 sinks): the attention saved 143 MB without the cache, 227 MB with G 64, 349 MB with G 256; this
# count adds 88 MB and 215 MB.
GLOBAL_ACTIVATION_COLUMNS = 9
# The resident memory grows by more than the saved tensors without the cache: in 3-step heal-linear runs of the default
# SmolLM2 transfer (2,048 tokens, hedgehog, window 64) the forward added 287 MiB a layer in two runs of three (186 in the
# third; peaks 12.1-12.8 GiB, and 9.6) where the tensors saved are 210 MiB: the heap's slack between the kernel's
# chunks. With the cache the plan already matched (G 64: 12.7 GiB measured and planned; G 256: its forward grew 420 MiB
# a layer against 415 counted), so this slack, ACTIVATION_SLACK_HEAD_DIMS x head_dim floats per token and query head,
# is counted without the cache only.
ACTIVATION_SLACK_HEAD_DIMS = 17
# The global cache's kernel trains in runs of queries (the window's length) of small PyTorch operations, slower than
# the fine-tune's time plan counts a layer: per token, layer and query head it adds about GLOBAL_TRAIN_FLOPS +
# GLOBAL_TRAIN_FLOPS_PER_KEY x G at the plan's rate. Fitted on heal-linear steps (2,048-token sequences) of SmolLM2
# (9 heads, head_dim 64, window 64, 4 sinks) on 2 cores at 122 GFLOP/s effective: medians of steps 3-6 22.65 s
# without the cache, 34.65 s with G 64, 37.45 s with G 256 (BENCHMARKS, "A global cache").
GLOBAL_TRAIN_FLOPS, GLOBAL_TRAIN_FLOPS_PER_KEY = 2.44e6, 3.2e3


def layer_activation_bytes(config: dict, batch: int, seq_len: int) -> int:
    """Bytes one effattn_linear decoder layer keeps for the backward pass beyond a softmax layer's generic count
    (ModelSpec.layer_activation_bytes: the fine-tune's memory plan), for `batch` sequences of `seq_len` tokens."""
    from ..attention.linear import LINEAR_DEFAULTS, build_feature_map

    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    spec = config.get("linear_feature_map") or LINEAR_DEFAULTS["linear_feature_map"]
    features = build_feature_map(spec, head_dim, heads).feature_dim
    per_head = ACTIVATION_FEATURES * features + ACTIVATION_HEAD_DIMS * head_dim
    capacity = int(config.get("linear_global_cache") or 0)
    if capacity:  # the global cache's runs: every exactly read key's logit and weight, per query
        window = config.get("linear_window", LINEAR_DEFAULTS["linear_window"])
        sinks = config.get("linear_sinks", LINEAR_DEFAULTS["linear_sinks"])
        per_head += GLOBAL_ACTIVATION_COLUMNS * (capacity + window + sinks)
    else:
        per_head += ACTIVATION_SLACK_HEAD_DIMS * head_dim
    return 4 * batch * seq_len * heads * per_head


def layer_train_flops(config: dict, seq_len: int) -> float:
    """FLOPs per token one effattn_linear decoder layer's training step costs beyond a softmax layer's count
    (ModelSpec.layer_train_flops: the fine-tune's time plan): the global cache's kernel; 0 without the cache."""
    capacity = int(config.get("linear_global_cache") or 0)
    return config["num_attention_heads"] * (GLOBAL_TRAIN_FLOPS + GLOBAL_TRAIN_FLOPS_PER_KEY * capacity) if capacity \
        else 0.0


def _linear_classes():
    from ..attention.linear import EffattnLinearConfig, EffattnLinearForCausalLM

    return EffattnLinearConfig, EffattnLinearForCausalLM


def feature_map_spec(opts: LinearOptions) -> dict[str, Any]:
    """The config's `linear_feature_map`: the map's name and the keyword arguments its class reads."""
    given = {k: getattr(opts, k) for k in MAP_DEFAULTS if getattr(opts, k) is not None}
    for key in given:
        if key not in MAP_OPTIONS[opts.feature_map]:
            users = [m for m, keys in MAP_OPTIONS.items() if key in keys]
            flag = "--" + key.replace("_", "-")
            raise EffattnError(f"{flag} applies to --feature-map {' or '.join(users)}, not {opts.feature_map}",
                               f"drop it, or use --feature-map {users[0]}")
    if opts.feature_map == "hedgehog":
        return {"name": "hedgehog", "projection_dim": given.get("projection_dim", MAP_DEFAULTS["projection_dim"])}
    if opts.feature_map == "performer":
        return {"name": "performer", "num_features": given.get("features", MAP_DEFAULTS["features"])}
    return {"name": opts.feature_map}


def new_attention_tensors(fmap: torch.nn.Module, heads: int) -> dict[str, torch.Tensor]:
    """The tensors one LinearAttention adds, by name under `self_attn.`, at their initial values (`fmap`:
    attention/linear.py's build_feature_map)."""
    from ..attention.linear import INIT_WINDOW_FACTOR

    tensors = {"window_factors": torch.full((heads,), INIT_WINDOW_FACTOR)}
    for side in ("q", "k"):
        tensors |= {f"feature_map_{side}.{n}": t for n, t in fmap.state_dict().items()}
    return tensors


def cache_parts(shape: AttentionShape, feature_dim: int, window: int, dtype: torch.dtype,
                fk_dtype: torch.dtype) -> tuple[float, float]:
    """(bytes of the linear state, bytes per token of the window) of a whole model's LinearCache: per
    layer and query head S [F, Dv] and z [F] in the accumulation dtype (float32 at least), and per
    windowed token a key, a value and a feature key."""
    acc = max(dtype.itemsize, 4)
    state = shape.layers * shape.heads * (feature_dim * shape.head_dim + feature_dim) * acc
    per_token = shape.layers * shape.heads * (2 * shape.head_dim * dtype.itemsize + feature_dim * fk_dtype.itemsize)
    return float(state), float(per_token if window else 0)


def sink_bytes(shape: AttentionShape, sinks: int, dtype: torch.dtype) -> float:
    """Bytes of a whole model's sink store: per layer, query head and sink a key and a value."""
    return float(sinks * shape.layers * shape.heads * 2 * shape.head_dim * dtype.itemsize)


def global_cache_bytes(shape: AttentionShape, capacity: int, feature_dim: int, window: int, dtype: torch.dtype,
                       fk_dtype: torch.dtype) -> float:
    """Bytes a whole model's global cache adds to the LinearCache: per layer and query head, `capacity` keys, values
    and positions (int64; the model computes the cached keys' features again at each decision), and the block of up
    to window - 1 keys that have left the window and wait for their decision, with their feature keys
    (kernels/linear/global_cache.py)."""
    cached = 2 * shape.head_dim * dtype.itemsize + 8
    waiting = 2 * shape.head_dim * dtype.itemsize + feature_dim * fk_dtype.itemsize
    return float(shape.layers * shape.heads * (capacity * cached + (window - 1) * waiting)) if capacity else 0.0


def cache_line(before: float, state: float, window_bytes: float, window: int, trained: int, sinks: int = 0,
               sink_total: float = 0.0, exact_bytes: float = 0.0, exact_heads: int = 0, global_total: float = 0.0,
               capacity: int = 0) -> str:
    fixed = state + window * window_bytes + sink_total + global_total
    even = fixed / (before - exact_bytes)
    at = fixed / trained + exact_bytes
    start = f"after {window + sinks} tokens" if window else "from the first token"
    if capacity:  # the undecided block comes and goes between 1 and window - 1 keys: a bound, not a constant
        start = f"full after about {sinks + capacity + 2 * window} tokens"
    return (f"original {before:,.0f} bytes/token (grows with length); linear: "
            + ("the hybrid heads' part " if exact_heads else "")
            + ("bounded, " if capacity else "constant ") + f"{start}, " + ("at most " if capacity else "")
            + f"{fixed:,.0f} bytes per sequence (state S, z {state:,.0f}"
            + (f" + window {window} x {window_bytes:,.0f} bytes/token" if window else "")
            + (f" + {sinks} sinks {sink_total:,.0f}" if sinks else "")
            + (f" + global cache {capacity} keys/head and the undecided block {global_total:,.0f}" if capacity else "")
            + ")"
            + (f" + {exact_bytes:,.0f} bytes/token for the {exact_heads} exact heads' keys and values" if exact_heads
               else "")
            + (f"; smaller than the original's beyond {even:,.0f} tokens" if even < trained else
               f"; larger than the original's up to {even:,.0f} tokens")
            + f"; {at:,.0f} bytes/token at {trained:,} tokens "
            + (f"({before / at:.1f}x less)" if at <= before else f"({at / before:.1f}x more)"))


class LinearConversion:
    name = "linear"
    description = ("linear attention (LoLCATs): softmax over the last --window keys + linear attention with learned "
                   "feature maps beyond, fitted by attention transfer; a constant-size cache")
    model = ModelSpec(
        model_type="effattn_linear", description="LoLCATs hybrid sliding-window + linear attention (effattn_linear)",
        config_class=lambda: _linear_classes()[0], model_class=lambda: _linear_classes()[1],
        modeling_file="modeling_effattn_linear.py",
        modules=("kernels/rope.py", "attention/exact.py", "kernels/linear/naive.py", "kernels/linear/recurrent.py",
                 "kernels/linear/chunk.py", "kernels/linear/global_cache.py", "kernels/linear/decode.py",
                 "kernels/linear/features.py", "attention/wrapped.py", "attention/linear.py"),
        layer_activation_bytes=layer_activation_bytes, layer_train_flops=layer_train_flops)
    Options = LinearOptions
    memory_options = ("calib_tokens",)
    # the constant cache pays off at long context
    measure_contexts = (512, 2048)

    def targets(self, config: dict[str, Any]) -> str:
        return ("--feature-map {hedgehog, elu, performer, taylor} --window W: softmax over the last W keys, linear "
                "attention beyond (maps fitted by attention transfer); the cache stops growing after W tokens")

    def plan(self, ckpt: Checkpoint, family: Family, opts: LinearOptions, target=None) -> Plan:
        from ..attention.linear import build_feature_map, linear_config_from

        config = ckpt.config
        if family.rope_layout != "rotate_half":
            raise EffattnError(f"{family.name} does not use rotate-half RoPE", "--to linear needs a RoPE model "
                               "(Llama, Mistral, Qwen2/Qwen3 layouts)")
        shape = AttentionShape.of(config)
        trained = trained_length(config)
        sinks = opts.sinks if opts.sinks is not None else SINKS if opts.window else 0
        if sinks and not opts.window:
            raise EffattnError(f"--sinks {opts.sinks} needs a window: sinks join the window's softmax, and --window 0 "
                               "has none", "give --window W (default 64), or --sinks 0")
        if opts.window >= trained:
            raise EffattnError(f"--window {opts.window:,} covers the whole trained context ({trained:,} tokens): "
                               "no key would reach the linear attention", f"use a window below {trained:,} (default 64)")
        if opts.global_cache and not opts.window:
            raise EffattnError(f"--global-cache {opts.global_cache} needs a window: far keys leave the window in blocks "
                               "of its size, and --window 0 has none",
                               "give --window W (default 64), or --global-cache 0")
        exact_heads = opts.exact_heads
        if exact_heads > shape.layers * shape.kv_heads:
            raise EffattnError(f"--exact-heads {exact_heads} is more than the model's {shape.layers * shape.kv_heads} "
                               f"KV heads ({shape.layers} layers x {shape.kv_heads})",
                               f"use at most {shape.layers * shape.kv_heads}")
        spec = feature_map_spec(opts)
        try:
            fmap = build_feature_map(spec, shape.head_dim, shape.heads)
            tensors = new_attention_tensors(fmap, shape.heads)
        except ValueError as exc:
            raise EffattnError(str(exc), "see `effattn convert --to linear --help`") from None
        base = {k: v for k, v in config.items() if k not in ("sliding_window", "use_sliding_window",
                                                              "max_window_layers", "layer_types")}
        if base.get("model_type") == "mistral":
            base["sliding_window"] = None
        new = linear_config_from(base, linear_feature_map=spec, linear_window=opts.window, linear_sinks=sinks,
                                 linear_global_cache=opts.global_cache)
        if target is not None:
            new["dtype"] = str(target).replace("torch.", "")
            new.pop("torch_dtype", None)
        dtype = target or ckpt.dtype
        new_dtype = out_dtype(torch.float32, target)
        extra = [TensorSpec(f"{family.prefix(i)}self_attn.{n}", tuple(t.shape), new_dtype)
                 for i in range(shape.layers) for n, t in tensors.items()]
        fdim = fmap.feature_dim
        before = kv_bytes_per_token(config, dtype)
        fk_dtype = torch.promote_types(dtype, torch.float32) if spec["name"] == "performer" else dtype
        state_bytes, window_bytes = cache_parts(shape, fdim, opts.window, dtype, fk_dtype)
        sink_total = sink_bytes(shape, sinks, dtype)
        global_total = global_cache_bytes(shape, opts.global_cache, fdim, opts.window, dtype, fk_dtype)
        # the exact heads' keys and values, per token (growing), as the original caches them
        exact_bytes = exact_heads * 2 * shape.head_dim * dtype.itemsize
        linear_share = 1 - exact_heads / (shape.layers * shape.kv_heads)  # of the state, window and sinks
        state_bytes, window_bytes, sink_total, global_total = (x * linear_share for x in (state_bytes, window_bytes,
                                                                                          sink_total, global_total))
        fixed = state_bytes + min(opts.window, trained) * window_bytes + sink_total + global_total
        after = fixed / trained + exact_bytes
        trainable = sum(t.numel() for n, t in tensors.items() if n == "window_factors" or n.endswith("weight")
                        or n.endswith("bias"))
        map_words = {"hedgehog": f"hedgehog, P {spec.get('projection_dim')} (F {fdim}, learned)",
                     "performer": f"performer, {fdim} random features (fixed)", "elu": f"elu + 1 (F {fdim})",
                     "taylor": f"2nd-order Taylor (F {fdim})"}[spec["name"]]
        summary = [("model", f"{family.name} -> effattn_linear, {shape.layers} layers, {shape.heads} query / "
                             f"{shape.kv_heads} KV heads, q/k/v/o unchanged"),
                   ("attention", (f"softmax over the last {opts.window} keys + " if opts.window else "")
                    + (f"the first {sinks} (sinks) + " if sinks else "")
                    + (f"a global cache of {opts.global_cache} far keys per head (LoLA) + " if opts.global_cache else "")
                    + f"linear attention beyond, feature map {map_words}")]
        settings: dict[str, Any] = {"feature_map": spec["name"], "window": opts.window, "sinks": sinks,
                                    "exact_heads": exact_heads, "global_cache": opts.global_cache}
        if "projection_dim" in spec:
            settings["projection_dim"] = spec["projection_dim"]
        if "num_features" in spec:
            settings["features"] = spec["num_features"]
        state: dict[str, Any] = {"shape": shape, "target": target, "spec": spec, "exact_heads": exact_heads}
        est_seconds, est_peak = read_time(ckpt), streaming_bytes(ckpt, family)
        learned = any(n != "window_factors" and n.endswith(("weight", "bias")) for n in tensors)
        steps = opts.refine_steps
        if not learned and not opts.window:  # nothing to fit: no map parameters, and no window to mix with
            given = opts.given() & {"calib", "calib_tokens", "calib_seq_len", "calib_positions",
                                    *RefineOptions.REFINE_FIELDS}
            if given and steps:
                flags = ", ".join("--" + k.replace("_", "-") for k in sorted(given))
                raise EffattnError(f"{flags}: --feature-map {spec['name']} has no parameters and --window 0 no "
                                   "window/linear mix, so attention transfer has nothing to train",
                                   "drop them, or use --feature-map hedgehog or a --window above 0")
            steps = 0
        if exact_heads and not steps:
            why = ("--refine-steps 0 turns it off" if not opts.refine_steps else
                   f"--feature-map {spec['name']} with --window 0 has nothing to transfer")
            raise EffattnError(f"--exact-heads {exact_heads} ranks the heads by their error after attention transfer, "
                               f"and {why}", "drop --exact-heads, or run attention transfer (--refine-steps N, "
                               "a map with parameters or a window)")
        if steps:
            positions = opts.calib_positions if opts.calib_positions is not None else trained
            if 0 < positions < opts.calib_seq_len:
                raise EffattnError(f"--calib-positions {positions} is shorter than a calibration sequence "
                                   f"(--calib-seq-len {opts.calib_seq_len})",
                                   "use --calib-positions 0 (every sequence from position 0) or at least "
                                   f"{opts.calib_seq_len}")
            calib = CalibSettings(corpus=opts.calib, tokens=opts.calib_tokens, seq_len=opts.calib_seq_len,
                                  batch_size=2, positions=positions).validate(ckpt.folder)
            if calib.seq_len <= opts.window:
                raise EffattnError(f"calibration sequences ({calib.seq_len} tokens) must be longer than the window "
                                   f"({opts.window}) for attention transfer to see far keys",
                                   f"use --calib-seq-len {max(4 * opts.window, 512)} or a smaller --window")
            refine = opts.refine_settings()
            state |= {"calib": calib, "refine": refine}
            settings |= {"calib": calib.corpus, "calib_tokens": calib.tokens, "calib_seq_len": calib.seq_len,
                         "calib_positions": calib.positions, **refine.record()}
            dims, N, T = Dims.of(config), calib.tokens, calib.seq_len
            map_flops = (2 * shape.head_dim * fdim if spec["name"] in ("hedgehog", "performer") else fdim)

            def converted(n: int, t: int) -> float:
                return LINEAR_FORWARD_EXTRA * linear_attention_flops(dims, n, t, opts.window, sinks, fdim, map_flops)

            def o_proj(n: int) -> float:
                return 2 * n * dims.heads * dims.head_dim * dims.hidden

            # the layer's inputs (its propagation)
            per_layer = dims.layer_flops(N, T)
            if not learned:  # initial_mix: the original and the hybrid's sums on one sequence, an o_proj per logit
                per_layer += dims.attention_flops(T, T) + converted(T, T) + (1 + len(MIX_GRID)) * o_proj(T)
            if not learned and refine.target == "attention":  # only the mix trains: the hybrid's sums once
                # (mix_predictor), the targets, then every error and step an o_proj
                fit = (dims.attention_flops(N, T) + converted(N, T) + 2 * o_proj(N)
                       + 3 * refine.steps * o_proj(refine.batch_size * T))
                per_layer += fit if refine.device == "cpu" else 0.0
            else:  # the original attention's targets, the hybrid's passes
                per_layer += refine_flops(dims, refine, N, T, converted=converted, hooks=bool(exact_heads))
            if exact_heads:  # scoring the heads: the original attention beside the propagation
                per_layer += EXACT_SCORING_SHARE * dims.attention_flops(N, T)
            est_seconds += compute_seconds(shape.layers * per_layer)
            # the hybrid's feature tensors of one batch: the queries' and keys' maps, the keys with the sinks zeroed,
            # and the far part's delayed keys ([batch, T, H, F] in float32 each)
            est_peak = calibrated_bytes(ckpt, family, calib, refine) + FEATURE_COPIES * calib.batch_size * T * shape.heads * fdim * 4
            summary.append(("attention transfer", f"{refine.steps_words} on "
                                                  f"{calib.tokens:,} tokens of {calib.corpus!r} in blocks of {calib.seq_len}"
                                                  f"{spread_words(calib)}"
                                                  f", fitting the {refine.target} output; trains "
                                                  f"{trainable:,} parameters per layer " + ("(maps + mix)" if learned else "(the mix: the map has none)")))
        elif opts.refine_steps:
            settings["refine_steps"] = 0
            summary.append(("attention transfer", f"none: {spec['name']} has no parameters and window 0 no mix to fit"))
        else:
            given = opts.given() & ({"calib", "calib_tokens", "calib_seq_len", "calib_positions",
                                     *RefineOptions.REFINE_FIELDS} - {"refine_steps"})
            if given:
                flags = ", ".join("--" + k.replace("_", "-") for k in sorted(given))
                raise EffattnError(f"{flags} set attention transfer, which --refine-steps 0 turns off",
                                   "drop them, or give --refine-steps N (default 40)")
            settings["refine_steps"] = 0
            summary.append(("attention transfer", "none (--refine-steps 0): the feature maps keep their initial values"))
        summary.append(("KV cache", cache_line(before, state_bytes, window_bytes, opts.window, trained, sinks,
                                               sink_total, exact_bytes, exact_heads, global_total, opts.global_cache)))
        if exact_heads:
            summary.append(("exact heads", f"the {exact_heads} of {shape.layers * shape.kv_heads} KV heads whose attention "
                                           "output the hybrid changes most on the calibration text (after attention "
                                           "transfer) keep their original attention"))
        summary.append(("decode step", _decode_line(spec["name"], opts.global_cache)))
        return Plan(conversion=self.name, config=new, specs=same_specs(ckpt, target, extra=extra), settings=settings,
                    summary=summary, kv_bytes_per_token=(before, after), est_seconds=est_seconds,
                    est_peak_bytes=est_peak,
                    # a query reads its window's keys and one F-dimensional state
                    state=state | {"attention_span": lambda context: opts.window + sinks + opts.global_cache + fdim
                                   + round((1 - linear_share) * context)})

    def run(self, ckpt: Checkpoint, family: Family, plan: Plan, writer: SafetensorsWriter, progress) -> None:
        from ..attention.linear import EffattnLinearConfig, LinearAttention, build_feature_map

        st = plan.state
        shape = st["shape"]
        # attention transfer fits the hybrid without the global cache (LoLA adds it to a fitted model, untrained)
        cfg = EffattnLinearConfig(**(plan.config | {"linear_global_cache": 0}))
        calib = st.get("calib")
        mixes: list[dict[str, float]] = []  # per layer, where `initial_mix` chose the mix's start
        errors = torch.zeros(shape.layers, 2, shape.kv_heads, dtype=torch.float64)  # per head: Σ|Δout|², Σ|out|²

        def linearize(layer: LayerInput) -> LayerOutput:
            base = f"{layer.prefix}self_attn."
            if calib is None:  # zero-shot: the weights and the new tensors' initial values, no module needed
                fresh = new_attention_tensors(build_feature_map(st["spec"], shape.head_dim, shape.heads), shape.heads)
                return LayerOutput(dict(layer.tensors) | {base + n: t for n, t in fresh.items()})
            module = layer.factory.layer(layer.index, layer.tensors, shape.kv_heads)
            attn = LinearAttention(module.self_attn, cfg, layer.index).float()
            module.self_attn = attn
            own = {n: t for n, t in attn.state_dict().items() if n == "window_factors" or n.startswith("feature_map_")}
            trainable = [n for n, _ in attn.named_parameters() if n == "window_factors" or n.startswith("feature_map_")]
            note = f"{len(trainable)} trained tensors"
            prepare = None
            if cfg.linear_window and trainable == ["window_factors"]:  # a map without parameters: the mix's scale
                # sets window_factors in place: `own` (the state dict's views) and what is written see it
                first = rows_of((layer.cos, layer.sin), slice(0, 1))  # one calibration sequence
                logit, err = initial_mix(module.float(), layer.original, layer.x[:1], *first)
                mixes.append({"layer": layer.index, "logit": logit, "error": round(err, 6)})
                note += f", mix from logit {logit:g} (error {err:.3f})"
                prepare = mix_predictor  # only the mix trains: the kernel runs once per sequence, not per step
            before = after = None
            if st["exact_heads"]:  # score each head's hybrid output (what o_proj receives) while the activations pass
                before, after = scoring_hooks(module, attn, errors[layer.index])
            return LayerOutput(dict(layer.tensors) | {base + n: t.detach().clone() for n, t in own.items()},
                               module=module.requires_grad_(False).eval(), trainable=trainable, note=note,
                               before=before, after=after, prepare=prepare)

        plan.measured |= run_layers(ckpt, family, writer, linearize, layers=shape.layers, target=st["target"],
                                    calib=calib, refine=st.get("refine"), progress=progress,
                                    description="attention transfer" if calib else "writing layers")
        if st["exact_heads"]:
            pairs, record = choose(errors, st["exact_heads"])
            plan.measured["config"] = {"linear_exact_heads": pairs}  # chosen by the run: the driver writes it
            plan.measured["settings"] = record
        if mixes:
            plan.measured["initial_mix"] = {"what": "the mix's logit (window_factors, every head) the steps started "
                                                    "from, and its error on one calibration sequence", "layers": mixes}
