"""ReRoPE and Transformer-VQ conversions (`--to rerope`, `--to vq`, and `effattn vq-init`).

`rerope` is weight-only: the same weights under `EffattnVQForCausalLM` with `vq_quantize: false`
(exact RoPE inside the window, one constant relative position beyond it: `--far-position`, by default
4 x the window, which measured far better than the window itself).

`vq` adds a codebook per layer and KV head, fitted by k-means on pre-RoPE keys collected layer by
layer (sequentially, like the calibrated GQA methods): layer i's keys come from the inputs the
already-converted layers 0..i-1 produce, with their own VQ attention in place, so each codebook is
fitted to the keys it will really quantize. Only one decoder layer's weights and the calibration
activations are held at a time.

Levers (all measured in BENCHMARKS.md): the far position (`--far-position`), the calibration text (`--calib`), the k-means metric
(`--metric attention`, the default: the logit error weighted by the attention each far (query, key)
pair really has under the ReRoPE model, Σ p_ts (q_tᵀ(k_s − c))², fitted as weighted k-means, see `attention_statistics`;
`query`: the unweighted logit error E[(qᵀ(k − c))²] under the queries that read the keys; `key`: plain
distance), sink positions never quantized (`--sinks`), the k-means implementation
(`--kmeans torch|sklearn`), and exact heads (`--exact-heads K`): the K (layer, KV head) pairs whose
ReRoPE + VQ costs most, ranked by the relative error it causes in their attention output on the
calibration text, keep their original attention (full RoPE over every key: a cache that grows on those
heads only; DuoAttention's and RazorAttention's retrieval heads). With `--refine-steps N` each layer's
q/k/v/o are then refined through its VQ attention (refine.py, run by run_layers), the codebooks kept.

The output loads with `AutoModelForCausalLM.from_pretrained(OUT)` after `import effattn`, and with
`trust_remote_code=True` without effattn: the modeling code is bundled into the folder.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

import torch
from pydantic import Field

from ..data.corpora import DEFAULT_CALIB
from ..errors import EffattnError
from ..families import AttentionShape, Family, trained_length
from ..io.checkpoint import Checkpoint
from ..io.writer import SafetensorsWriter, TensorSpec
from ..kernels.rope import apply_rope
from ..resources import Dims, compute_seconds
from .base import Plan, read_time, same_specs
from .kmeans import KMeansMethod, kmeans
from ..models import ModelSpec
from .calibrate import CALIB_HELP, batches
from .layers import LayerInput, LayerOutput, calibrated_bytes, run_layers, streaming_bytes
from .options import ConversionOptions
from .refine import RefineOptions, Steps, refine_flops
from .exact_heads import choose, scoring_hooks

# Default far position (`--far-position`) as a multiple of the window. ReRoPE classically sees far keys
# at the window's own distance; on SmolLM2 a larger constant costs much less (BENCHMARKS.md, vq-quality:
# ReRoPE alone at W=64 went from 1.21x/1.16x with the far keys at 64 to 1.06x/1.05x at 256).
FAR_MULTIPLE = 4
Metric = Literal["attention", "query", "key"]
METRICS = get_args(Metric)
METRIC_WORDS = {"query": "k-means under the query metric (logit error)",
                "attention": "attention-weighted k-means (keys weighted by their far attention, logit error)",
                "key": "k-means under plain key distance"}
# far keys per KV head kept exact by default (vq-init --heavy-keys): BENCHMARKS.md, "Transformer-VQ with heavy
# hitters". 192 came from an oracle screen (64 and 192 tried on the python corpus); quality grows with the
# budget and so does the cache: benchmarks/vq_heavy_budget.py weighs it on training-side text
DEFAULT_HEAVY_KEYS = 192
BIAS_QUERIES = 2048  # calibration queries (per KV head) that the per-code logit corrections average over
# ema_counts start as the expected number of keys per code in a batch of this many tokens
EMA_NOMINAL_TOKENS = 1024


def vq_buffer_specs(family: Family, shape: AttentionShape, size: int) -> list[TensorSpec]:
    specs = []
    for layer in range(shape.layers):
        base = f"{family.prefix(layer)}self_attn."
        specs += [TensorSpec(base + "codebook", (shape.kv_heads, size, shape.head_dim), torch.float32),
                  TensorSpec(base + "ema_counts", (shape.kv_heads, size), torch.float32),
                  TensorSpec(base + "ema_sums", (shape.kv_heads, size, shape.head_dim), torch.float32),
                  TensorSpec(base + "code_metric", (shape.kv_heads, shape.head_dim, shape.head_dim), torch.float32),
                  TensorSpec(base + "code_bias", (shape.kv_heads, size), torch.float32)]
    return specs


class ReRoPEOptions(ConversionOptions):
    window: int = Field(256, ge=1, description="W: keys this close keep exact RoPE; older keys are quantized (vq)")
    far_position: int | None = Field(None, ge=1, description="relative position ReRoPE gives every key beyond the "
                                     f"window (default {FAR_MULTIPLE} x window, at most the trained context - 1)")
    block_size: int = Field(64, ge=1, description="query/key tile of the attention kernel")


class VQOptions(ReRoPEOptions, RefineOptions):  # ReRoPE's options, VQ's own, then refinement's (rerope has none)
    codebook_size: int = Field(512, ge=1, description="codewords per layer and KV head")
    sinks: int = Field(0, ge=0, description="first positions of a sequence that are never quantized")
    heavy_keys: int | None = Field(None, ge=0, description="B: per KV head, the B far keys that have drawn the most "
                                   "attention keep their own logit and value (H2O's heavy hitters; the cache holds up "
                                   f"to B + block size of them); 0: every far key is coded (default {DEFAULT_HEAVY_KEYS}, "
                                   "or 0 with --sinks)")
    calib: str = Field(DEFAULT_CALIB, description=CALIB_HELP)
    calib_tokens: int = Field(16384, ge=1, description="calibration tokens")
    calib_seq_len: int = Field(1024, ge=1, description="calibration sequence length (longer than the window)")
    metric: Metric = Field(
        "attention", description="k-means fit: attention (keys weighted by the attention they get when far), "
                                 "query (logit error under the model's queries) or key (plain distance)")
    kmeans: KMeansMethod = Field("torch", description="k-means implementation (sklearn: MiniBatchKMeans)")
    code_bias: bool = Field(False, description="per-code logit correction for the keys each code stands for "
                                               "(measured: worse)")
    exact_heads: int = Field(0, ge=0, description="K: the K KV heads whose attention output ReRoPE + VQ changes most "
                                                  "on the calibration text keep their original attention")
    key_means: bool | None = Field(None, description="score each code at the mean of the sequence's far keys it holds "
                                                     "(default, unless code_bias) rather than at its codeword")
    seed: int = Field(0, ge=0, description="seed of k-means (layer i uses seed + i) and of local refinement's batches")
    # Off: measured on SmolLM2, 30 steps gained 0.3-1.6% (BENCHMARKS, vq-refine). Rate and target: RefineOptions' (1e-4, attention).
    refine_steps: Steps = Field(0, description="local refinement: Adam steps per layer on q/k/v/o through the VQ "
                                               "attention, fitting the original attention (or model, with "
                                               "--refine-target stream) on the calibration activations; the "
                                               "codebooks stay as fitted (0: off)")


@dataclass(frozen=True)
class _Common:
    """What the ReRoPE and VQ plans share: validated settings, the model config and the tensors to write."""

    shape: AttentionShape
    window: int
    far: int  # the relative position of every key beyond the window
    sinks: int
    block: int
    size: int  # codewords per KV head (1 without quantization)
    config: dict[str, Any]
    kv_before: float  # KV-cache bytes per token of the source model
    specs: list
    target: Any  # the output dtype, or None to keep the checkpoint's


def _kernel_line() -> str:
    """Which VQ step loop runs here (said once, at planning; the kernel also warns when it falls back)."""
    from ..kernels.vq import native

    why = native.why_unavailable()
    if why:
        return f"PyTorch step loop: the compiled one is unavailable ({why})"
    return f"compiled step loop (native.c); with vq_bf16_products: {native.BF16_KERNELS[native.bf16_kernel()]}"


def _heavy_kernel_line() -> str:
    """Which heavy-hitter kernels run here: compiled prefill periods and decode steps where native.c builds."""
    from ..kernels.vq import native

    why = native.why_unavailable()
    how = f"PyTorch (the compiled ones are unavailable: {why})" if why else "compiled (native.c)"
    return (f"heavy-hitter kernel (kernels/vq/heavy.py) for prefill and decode step (kernels/vq/heavy_decode.py): "
            f"{how}")


def _vq_classes():
    from ..attention.vq import EffattnVQConfig, EffattnVQForCausalLM

    return EffattnVQConfig, EffattnVQForCausalLM


class _ReRoPEBase:
    quantize = False

    def _common(self, ckpt: Checkpoint, family: Family, opts: ReRoPEOptions, target) -> _Common:
        from ..attention.vq import vq_config_from

        if family.rope_layout != "rotate_half":
            raise EffattnError(f"{family.name} does not use rotate-half RoPE", "ReRoPE needs a RoPE model")
        shape = AttentionShape.of(ckpt.config)
        window = opts.window
        trained = trained_length(ckpt.config)
        if window >= trained:
            raise EffattnError(f"--window {window:,} covers the whole trained context ({trained:,} tokens): no key "
                               "would be past it there, and past it the model would read distances it never trained on",
                               f"use a window below {trained:,}")
        # the default far position stays inside the trained context (a larger one was never seen in training)
        far = opts.far_position or min(FAR_MULTIPLE * window, trained - 1)
        if far < window:
            raise EffattnError(f"--far-position {far} is inside the window ({window}): far keys would be seen closer "
                               "than near ones", f"use --far-position {window} or more (default {FAR_MULTIPLE} x window)")
        sinks = getattr(opts, "sinks", 0)
        heavy = getattr(opts, "heavy_keys", 0)
        if heavy is None:  # on by default (measured better on every held-out corpus), off with sinks
            heavy = 0 if sinks or not self.quantize else DEFAULT_HEAVY_KEYS
        if heavy and sinks:
            raise EffattnError(f"--heavy-keys {heavy} and --sinks {sinks} both keep far keys exact",
                               "drop --sinks: heavy hitters keep the first positions exact when they draw attention")
        block = opts.block_size
        size = opts.codebook_size if self.quantize else 1
        use_bias = self.quantize and opts.code_bias  # off by default: measured to hurt
        # on by default: measured better on every held-out corpus (BENCHMARKS.md, vq-key-means)
        key_means = self.quantize and (not use_bias if opts.key_means is None else opts.key_means)
        if key_means and use_bias:
            raise EffattnError("--code-bias corrects a fixed codeword, which --key-means replaces",
                               "pass --no-key-means with --code-bias, or drop --code-bias")
        config = vq_config_from(ckpt.config, vq_quantize=self.quantize, codebook_size=size if self.quantize else 0,
                                vq_window=window, vq_far_position=far, vq_sinks=sinks, vq_block_size=block,
                                vq_code_bias=use_bias, vq_key_means=key_means, vq_heavy_keys=heavy)
        if target is not None:
            config["dtype"] = str(target).replace("torch.", "")
            config.pop("torch_dtype", None)
        dtype = target or ckpt.dtype
        kv_before = 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype.itemsize
        specs = same_specs(ckpt, target) + vq_buffer_specs(family, shape, size)
        return _Common(shape, window, far, sinks, block, size, config, kv_before, specs, target)

    model = ModelSpec(
        model_type="effattn_vq", description="Transformer-VQ / ReRoPE attention (effattn_vq)",
        config_class=lambda: _vq_classes()[0], model_class=lambda: _vq_classes()[1],
        modeling_file="modeling_effattn_vq.py",
        modules=("kernels/rope.py", "kernels/vq/naive.py", "kernels/vq/chunk.py", "kernels/vq/codes.py", "kernels/vq/decode.py",
                 "kernels/vq/heavy.py", "kernels/vq/heavy_decode.py", "attention/wrapped.py", "attention/exact.py",
                 "attention/vq.py"))


class ReRoPEConversion(_ReRoPEBase):
    name = "rerope"
    description = "ReRoPE: exact RoPE within --window tokens, one constant relative position beyond (weight-only)"

    Options = ReRoPEOptions

    def targets(self, config: dict[str, Any]) -> str:
        return "--window W: exact RoPE within W tokens, one relative position beyond (weight-only)"

    def plan(self, ckpt: Checkpoint, family: Family, opts: ReRoPEOptions, target=None) -> Plan:
        c = self._common(ckpt, family, opts, target)
        shape, kv = c.shape, c.kv_before
        return Plan(
            conversion=self.name, settings={"window": c.window, "far_position": c.far}, config=c.config, specs=c.specs,
            summary=[("model", f"{family.name}, {shape.layers} layers, {shape.heads} query / {shape.kv_heads} KV heads"),
                     ("attention", f"ReRoPE, window {c.window}: exact inside, relative position {c.far} beyond"),
                     ("KV cache", f"{kv:,.0f} bytes/token, unchanged (every key is kept)")],
            kv_bytes_per_token=(kv, kv), est_seconds=read_time(ckpt),
            est_peak_bytes=streaming_bytes(ckpt, family), state={"shape": shape, "target": c.target, "size": c.size},
        )

    def run(self, ckpt: Checkpoint, family: Family, plan: Plan, writer: SafetensorsWriter, progress) -> None:
        shape = plan.state["shape"]
        G, d = shape.kv_heads, shape.head_dim

        def neutral_buffers(layer: LayerInput) -> LayerOutput:  # weights unchanged; no codebook
            base = f"{layer.prefix}self_attn."
            buffers = {"codebook": torch.zeros(G, 1, d), "ema_counts": torch.zeros(G, 1), "ema_sums": torch.zeros(G, 1, d),
                       "code_metric": torch.eye(d).repeat(G, 1, 1), "code_bias": torch.zeros(G, 1)}
            return LayerOutput(dict(layer.tensors) | {base + name: t for name, t in buffers.items()})

        run_layers(ckpt, family, writer, neutral_buffers, layers=shape.layers, target=plan.state["target"],
                   progress=progress, description="writing layers")


def break_even_tokens(kv_per_token: float, state_bytes: float, exact_per_token: float) -> float | None:
    """The sequence length beyond which a VQ cache (constant state + the exact heads' growing part) is
    smaller than the original's KV cache; None when it never is."""
    saving = kv_per_token - exact_per_token
    return state_bytes / saving if saving > 0 else None


def _vq_cache_line(kv: float, state: float, exact: float, exact_heads: int) -> str:
    grows = f" + {exact:,.0f} bytes/token for the {exact_heads} exact heads' keys and values" if exact_heads else ""
    even = break_even_tokens(kv, state, exact)
    tail = (f"; smaller than the original's beyond {even:,.0f} tokens (break-even), larger below" if even
            else "; never smaller than the original's")
    return f"original {kv:,.0f} bytes/token (grows with length); VQ {state:,.0f} bytes per sequence{grows}{tail}"


# Measured on the built-in model (BENCHMARKS.md, "estimates"): the VQ attention's forward in the runner
# costs about this many extra attention passes, and Lloyd's rounds (distances, argmin, scatter) run at
# about a third of matmul speed.
VQ_FORWARD_EXTRA = 5.0
KMEANS_SLOWDOWN = 3.0
# Refinement (refine.py) runs the VQ attention forward and backward through the PyTorch step loop. Measured
# on one layer of SmolLM2's shape (random weights, T 1024, W 256, C 512, batch 2, 2 shared cores): a step
# took 0.24 s fitting the attention output and 0.39 s fitting the stream, where refine_flops alone says
# 0.16 s and 0.46 s; so its passes cost about this many of refine_flops' (the plan's time only).
VQ_REFINE_EXTRA = 1.5
# The autograd graph of one refinement batch through that loop, per (token, query head): about this many
# bytes per column a step scores (window, step, codes) plus a fixed part. Fitted to the peak RSS the same
# layer added: +175 MiB at W = C = 128, +230-255 MiB at W 256, C 512.
REFINE_GRAPH_BYTES_PER_COLUMN, REFINE_GRAPH_BYTES_FIXED = 8, 7680
class VQConversion(_ReRoPEBase):
    name = "vq"
    # the VQ cache pays off at long context: the card measures there (break-even in the KV line)
    measure_contexts = (2048, 8192)
    memory_options = ("calib_tokens", "codebook_size")
    description = "Transformer-VQ: ReRoPE window + keys beyond it quantized to k-means codebooks (linear time)"
    quantize = True
    Options = VQOptions

    def targets(self, config: dict[str, Any]) -> str:
        return ("effattn vq-init MODEL --codebook-size C --window W [--sinks S] [--exact-heads K] [--calib ...]: ReRoPE window + "
                "k-means codebooks, linear-time attention, constant-size cache")

    def plan(self, ckpt: Checkpoint, family: Family, opts: VQOptions, target=None) -> Plan:
        from .calibrate import CalibSettings

        c = self._common(ckpt, family, opts, target)
        shape, window, sinks, size, kv = c.shape, c.window, c.sinks, c.size, c.kv_before
        metric, method, exact_heads = opts.metric, opts.kmeans, opts.exact_heads
        calib = CalibSettings(corpus=opts.calib, tokens=opts.calib_tokens, seq_len=opts.calib_seq_len).validate(ckpt.folder)
        if exact_heads > shape.layers * shape.kv_heads:
            raise EffattnError(f"--exact-heads {exact_heads} is more than the model's {shape.layers * shape.kv_heads} "
                               f"KV heads ({shape.layers} layers x {shape.kv_heads})",
                               f"use at most {shape.layers * shape.kv_heads} (all of them is the original model)")
        if calib.seq_len <= window:
            raise EffattnError(f"calibration sequences ({calib.seq_len} tokens) must be longer than the window "
                               f"({window}) for keys to be quantized", f"use --window below {calib.seq_len}")
        per_seq = max(calib.seq_len - sinks, 0)  # keys k-means fits on, per sequence and KV head
        if size > calib.tokens // calib.seq_len * per_seq:
            keys = calib.tokens // calib.seq_len * per_seq
            need = -(-size // max(per_seq, 1)) * calib.seq_len
            raise EffattnError(f"--codebook-size {size:,} is more than the {keys:,} calibration keys per KV head that "
                               f"k-means fits it on ({calib.tokens:,} --calib-tokens" + (f", less {sinks} sinks a sequence)" if sinks else ")"),
                               f"use --codebook-size {keys} or less, or --calib-tokens {need} or more")
        # the cache after T tokens, every tensor the state holds (float32 statistics, int64 codes and positions),
        # per quantized KV head: the window's W - 1 keys and values with their codes, the sinks, and per code a
        # count and a value sum (and a key sum with key means); exact heads' keys are in exact_bytes below.
        # With heavy hitters (HeavyState) the window's keys are kept rotated too, with the attention each received,
        # and up to B + block size far keys (E just before a cut) with their values, codes, scores and positions;
        # without, each layer keeps the window's RoPE rows (VQState). The tiny model of tests/test_vq_model.py
        # measures these to the byte (142,008 and 11,664 bytes, with and without heavy hitters).
        key_means = c.config["vq_key_means"]
        D, per_code = shape.head_dim, shape.head_dim * (2 if key_means else 1) + 1
        heavy = c.config["vq_heavy_keys"]
        exact_far = heavy + c.block if heavy else 0  # heavy hitters' far keys, at most, per quantized KV head
        quantized = shape.layers * shape.kv_heads - exact_heads
        if heavy:
            per_head = (window - 1) * (3 * D * 4 + 8 + 4) + exact_far * (2 * D * 4 + 8 + 4 + 8)
            rope_rows = 0
        else:
            per_head = (window - 1) * (2 * D * 4 + 8) + sinks * 2 * D * 4
            rope_rows = shape.layers * (window - 1) * 2 * D * 4
        state_bytes = quantized * (per_head + size * per_code * 4) + rope_rows
        exact_bytes = exact_heads * 2 * shape.head_dim * (c.target or ckpt.dtype).itemsize  # per token, growing
        # per layer: keys and far-attention statistics (an attention pass), Lloyd's k-means (15 rounds of
        # assigning every key to a codeword and averaging), the layer's VQ forward to propagate the
        # activations, and for --exact-heads each head's exact attention to score it
        dims, N, T = Dims.of(ckpt.config), calib.tokens, calib.seq_len
        kmeans_flops = KMEANS_SLOWDOWN * 15 * shape.kv_heads * 4 * N * size * shape.head_dim
        per_layer = (dims.attention_flops(N, T) * (2 if exact_heads else 1) + kmeans_flops
                     + dims.layer_flops(N, T) + VQ_FORWARD_EXTRA * dims.attention_flops(N, T))
        refine = replace(opts.refine_settings(), seed=opts.seed)
        # refinement's passes run the VQ attention (and its backward: the PyTorch step loop)
        per_layer += VQ_REFINE_EXTRA * refine_flops(dims, refine, N, T, hooks=bool(exact_heads))
        est = read_time(ckpt) + compute_seconds(shape.layers * per_layer)
        est_peak = calibrated_bytes(ckpt, family, calib, refine) + 3 * shape.kv_heads * N * shape.head_dim * 4
        if refine.steps:
            from ..kernels.vq.chunk import TILE

            est_peak += refine.batch_size * T * shape.heads * (
                REFINE_GRAPH_BYTES_PER_COLUMN * (window + sinks + TILE + size) + REFINE_GRAPH_BYTES_FIXED)
        return Plan(
            conversion=self.name,
            settings={"codebook_size": size, "window": window, "far_position": c.far, "sinks": sinks,
                      "block_size": c.block, "heavy_keys": heavy, "metric": metric, "code_bias": c.config["vq_code_bias"], "key_means": key_means,
                      "kmeans": method, "calib": calib.corpus, "calib_tokens": calib.tokens,
                      "calib_seq_len": calib.seq_len, "exact_heads": exact_heads, "seed": opts.seed, **refine.record()},
            config=c.config, specs=c.specs,
            summary=[("model", f"{family.name}, {shape.layers} layers, {shape.heads} query / {shape.kv_heads} KV heads"),
                     ("attention", f"ReRoPE window {window} (exact; relative position {c.far} beyond) + VQ beyond it, "
                                   f"codebook {size} per KV head"
                                   + (", each code scored at the mean of the sequence's keys it holds" if key_means
                                      else ", each code scored at its codeword")
                                   + (f", {sinks} sink positions never quantized" if sinks else "")
                                   + (f", the {heavy} far keys per KV head that drew the most attention kept exact "
                                      f"(heavy hitters, cut every {c.block} positions)" if heavy else "")),
                     ("codebooks", f"{METRIC_WORDS[metric]} ({method}) on {calib.tokens:,} tokens of "
                                   f"{calib.corpus!r} in blocks of {calib.seq_len}, layer by layer"),
                     *([("refinement", refine.summary("q/k/v/o through the VQ attention", "; codebooks kept"))]
                       if refine.steps else []),
                     ("KV cache", _vq_cache_line(kv, state_bytes, exact_bytes, exact_heads)),
                     ("VQ kernel", _heavy_kernel_line() if heavy else _kernel_line()),
                     *([("exact heads", f"the {exact_heads} of {shape.layers * shape.kv_heads} KV heads whose attention output "
                                        "ReRoPE + VQ most changes on the calibration text keep their original attention")]
                       if exact_heads else [])],
            kv_bytes_per_token=(kv, state_bytes / (4 * window) + exact_bytes),
            est_seconds=est, est_peak_bytes=est_peak,
            state={"shape": shape, "target": c.target, "size": size, "calib": calib, "metric": metric,
                   "kmeans": method, "seed": opts.seed, "exact_heads": exact_heads, "refine": refine,
                   # a query reads its window's keys, the sinks and one summary per code
                   "attention_span": lambda context: window + sinks + exact_far + size},
        )

    def run(self, ckpt: Checkpoint, family: Family, plan: Plan, writer: SafetensorsWriter, progress) -> None:
        from ..attention.vq import EffattnVQConfig, far_position

        st = plan.state
        shape = st["shape"]
        cfg = EffattnVQConfig(**plan.config)
        far_at = far_position(cfg)
        errors = torch.zeros(shape.layers, 2, shape.kv_heads, dtype=torch.float64)  # per head: Σ|Δout|², Σ|out|²
        far: list = []  # the RoPE row of the far position, computed once

        def fit(layer: LayerInput) -> LayerOutput:
            if not far:
                cos, sin = layer.factory.rope(far_at + 1)
                far.append((cos[0, far_at], sin[0, far_at]))
            return self.fit_layer(plan, cfg, layer, far[0], errors)

        plan.measured |= run_layers(ckpt, family, writer, fit, layers=shape.layers, target=st["target"],
                                    calib=st["calib"], refine=st["refine"], progress=progress,
                                    description="fitting codebooks" + (" and refining" if st["refine"].steps else ""))
        if st["exact_heads"]:
            pairs, record = choose(errors, st["exact_heads"])
            plan.measured["config"] = {"vq_exact_heads": pairs}  # chosen by the run: the driver writes it
            plan.measured["settings"] = record

    @staticmethod
    def fit_layer(plan: Plan, cfg, layer: LayerInput, far, errors: torch.Tensor) -> LayerOutput:
        """One layer: k-means codebooks of its keys on the calibration activations; the layer with VQ
        attention, to propagate them (and, for --exact-heads, to score each KV head on the way)."""
        from ..attention.vq import VQAttention

        st = plan.state
        shape, calib, x, cos, sin = st["shape"], st["calib"], layer.x, layer.cos, layer.sin
        T = x.shape[1]
        keep = torch.arange(T) >= cfg.vq_sinks  # sink positions are never quantized: not fitted either
        module = layer.factory.layer(layer.index, layer.tensors, shape.kv_heads)
        attn = VQAttention(module.self_attn, cfg, layer.index).eval()  # eval: no EMA step while propagating
        keys, metric = [], torch.zeros(shape.kv_heads, shape.head_dim, shape.head_dim, dtype=torch.float64)
        group, seen, sampled, weights = shape.heads // shape.kv_heads, 0, [], []
        gen = torch.Generator().manual_seed(st["seed"] + layer.index)
        for sl in batches(x, calib.batch_size):
            h = module.input_layernorm(x[sl])
            q, k, _ = attn.project(h)
            keys.append(k[:, keep].reshape(-1, shape.kv_heads, shape.head_dim))
            if st["metric"] == "attention":
                mass, m = attention_statistics(q, k, cos[0], sin[0], far, attn.scaling, cfg.vq_window, cfg.vq_sinks)
                weights.append(mass[:, keep].reshape(-1, shape.kv_heads))
                metric += m
            if st["metric"] != "query" and not cfg.vq_code_bias:
                continue  # neither the metric nor the code bias needs the queries
            # far logits are <rope(q, F) * scale, k>: the metric weighs key errors by these queries
            qw = (apply_rope(q, far[0], far[1]) * attn.scaling).reshape(-1, shape.kv_heads, group, shape.head_dim)
            qw = qw.float()
            if st["metric"] == "query":
                metric += torch.einsum("ngai,ngaj->gij", qw, qw).double()
                seen += qw.shape[0] * group
            per_batch = -(-BIAS_QUERIES // -(-x.shape[0] // calib.batch_size))
            pick = torch.randperm(qw.shape[0] * group, generator=gen)[:per_batch]
            sampled.append(qw.transpose(1, 2).reshape(-1, shape.kv_heads, shape.head_dim)[pick].transpose(0, 1))
        keys = torch.cat(keys).transpose(0, 1).contiguous()  # (G, N, D)
        sample_weights = None
        if st["metric"] == "attention":
            sample_weights = torch.cat(weights).T.contiguous()  # (G, N): a key's weight, its far attention mass
            metric = metric / sample_weights.sum(1).double().clamp_min(1e-30)[:, None, None]  # weighted mean of q̃ q̃ᵀ
        elif st["metric"] == "query":
            metric = metric / max(seen, 1)
        result = kmeans(keys, st["size"], metric=metric.float() if st["metric"] != "key" else None,
                        weights=sample_weights, method=st["kmeans"], seed=st["seed"] + layer.index)
        counts = result.counts * (EMA_NOMINAL_TOKENS / keys.shape[1])
        attn.codebook.copy_(result.centroids)
        attn.ema_counts.copy_(counts)
        attn.ema_sums.copy_(result.centroids * counts[..., None])
        attn.code_metric.copy_(result.whitener)
        bias = code_bias(keys, torch.cat(sampled, 1), result.centroids, result.whitener) if cfg.vq_code_bias \
            else torch.zeros(shape.kv_heads, st["size"])
        attn.code_bias.copy_(bias)
        module.self_attn = attn
        base = f"{layer.prefix}self_attn."
        tensors = dict(layer.tensors) | {base + name: buf.float() for name, buf in attn.named_buffers()}
        before = after = None
        if st["exact_heads"]:  # score each head's VQ output (what o_proj receives) while the activations pass
            before, after = scoring_hooks(module, attn, errors[layer.index])
        # Refinement (--refine-steps, run_layers) trains q/k/v/o through this module in eval mode (no EMA
        # step) and keeps the codebook fitted above on the unrefined keys. With key means (the default)
        # the codebook only partitions the far keys and each code is scored at the mean of the keys it
        # holds, so it stays a valid partition of the refined keys; refitting it would also change the
        # partition the refinement was fitted through. With codewords as scores (--no-key-means) the
        # refinement fits the layer to this codebook as it is (and --code-bias's corrections, fitted on the
        # unrefined keys above, stay as they are).
        return LayerOutput(tensors, module=module, forward_kwargs={"vq_far": far}, note=f"error {result.error:.3g}",
                           before=before, after=after)


def attention_statistics(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, far, scale: float,
                         window: int, sinks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What `--metric attention` fits codebooks to: how much attention each key gets where it is quantized.

    q (B, T, H, D) and k (B, T, G, D) pre-RoPE, cos/sin (T, D), far the RoPE row of the far position F.
    The dense ReRoPE softmax p (exact RoPE within W, rotation F beyond, unquantized keys, one
    normalisation) is computed per query head; a pair (t, s) is far when t − s >= W and s >= sinks.
    Returns
      mass [B, T, G]: Σ over far queries t and the group's query heads of p_ts (the key's weight),
      metric [G, D, D] (float64): Σ_t,s far p_ts q̃_t q̃_tᵀ with q̃ = rope(q, F) · scale, the queries as
        the far logits see them, so Σ_s w_s (k_s − c)ᵀ M (k_s − c) / Σ w approximates the attention-
        weighted logit error Σ p_ts (q̃_tᵀ(k_s − c))² (exact when one query reads the key).
    """
    B, T, H, D = q.shape
    G = k.shape[2]
    group = H // G
    qn = apply_rope(q.float(), cos[:, None], sin[:, None]) * scale  # (B, T, H, D)
    kn = apply_rope(k.float(), cos[:, None], sin[:, None])
    qf = apply_rope(q.float(), far[0], far[1]) * scale
    t = torch.arange(T)[:, None]
    s = torch.arange(T)[None, :]
    near_pair, future = (t - s) < window, s > t
    far_pair = ~near_pair & (s >= sinks)
    mass = torch.zeros(B, T, G)
    metric = torch.zeros(G, D, D, dtype=torch.float64)
    for h in range(H):
        g = h // group
        logits = torch.where(near_pair, qn[:, :, h] @ kn[:, :, g].transpose(1, 2), qf[:, :, h] @ k[:, :, g].float().transpose(1, 2))
        p = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1) * far_pair  # (B, T, T), far part
        mass[:, :, g] += p.sum(1)
        per_query = p.sum(-1)  # (B, T): far mass of each query
        metric[g] += torch.einsum("bt,bti,btj->ij", per_query, qf[:, :, h], qf[:, :, h]).double()
    return mass, metric


def code_bias(keys: torch.Tensor, queries: torch.Tensor, centroids: torch.Tensor, whitener: torch.Tensor) -> torch.Tensor:
    """Per-code logit correction b_c = E_q[log mean_{i in c} exp(q·(k_i − c))], [G, C].

    A code's keys k_i stand in the softmax as n_c·exp(q·c); their true weight is Σ_i exp(q·k_i), larger
    by Jensen's inequality (the errors k_i − c average to zero but their exponentials do not). The
    correction is averaged over calibration queries `queries` [G, Nq, D] (rotated by W and scaled, as
    the far logits see them); keys [G, N, D] are assigned to codes exactly as the model assigns them.
    """
    from ..kernels.vq.codes import nearest_codes

    G, C = centroids.shape[:2]
    codes = nearest_codes(keys.transpose(0, 1)[None], centroids, whitener)[0].T  # (G, N)
    bias = torch.zeros(G, C)
    for g in range(G):
        err = keys[g] - centroids[g][codes[g]]  # (N, D)
        count = torch.bincount(codes[g], minlength=C).double()
        total = torch.zeros(C, dtype=torch.float64)
        for chunk in queries[g].split(256):
            s = (chunk @ err.T).double()  # (q, N) logit errors
            top = s.max(-1, keepdim=True).values
            per_code = torch.zeros(len(chunk), C, dtype=torch.float64).index_add_(1, codes[g], (s - top).exp())
            total += (per_code.clamp_min(1e-300).log() + top - count.clamp_min(1).log()).sum(0)
        bias[g] = torch.where(count > 0, total / len(queries[g]), 0.0).float()
    return bias
