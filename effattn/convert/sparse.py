"""Sparse attention patterns as a conversion: Longformer, BigBird, Sparse Transformer (strided).

    effattn convert MODEL --to sparse --pattern longformer --window 256 --global-tokens 4 -o OUT
    effattn convert MODEL --to sparse --pattern bigbird --block 64 --random-blocks 2 --seed 0 -o OUT
    effattn convert MODEL --to sparse --pattern strided --stride 128 -o OUT

Weights are untouched; the output is effattn's `effattn_sparse` model (no transformers architecture
expresses these patterns), whose attention runs the pattern through FlexAttention block masks
(kernels/patterns.py). `import effattn` registers it; `trust_remote_code=True` loads the bundled copy.
Each query reads only the pattern's keys: compute falls with the density the summary reports; the
cache still holds every key (global and random blocks read any earlier position).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ..errors import EffattnError
from ..families import AttentionShape, Family, trained_length
from ..io.checkpoint import Checkpoint
from ..io.writer import SafetensorsWriter
from ..kernels.patterns import Pattern, density
from ..models import ModelSpec
from .base import Plan, kv_bytes_per_token, passthrough, read_time, same_specs
from .layers import streaming_bytes
from .options import ConversionOptions

# the parameters each pattern reads (the others are refused with it)
PATTERN_OPTIONS = {"longformer": ("window", "dilation", "global_tokens"),
                   "bigbird": ("block", "window_blocks", "global_blocks", "random_blocks", "seed"),
                   "strided": ("stride", "local")}


class SparseOptions(ConversionOptions):
    pattern: Literal["longformer", "bigbird", "strided"] | None = Field(
        None, description="longformer (dilated window + global tokens), bigbird (window, global and random blocks), "
                          "strided (Sparse Transformer: local + every stride-th key) (required)")
    window: int | None = Field(None, ge=1, description="longformer: keys in the sliding window (default 256)")
    dilation: int | None = Field(None, ge=1, description="longformer: spacing of the window's keys (default 1)")
    global_tokens: int | None = Field(None, ge=0, description="longformer: first positions that read and are read by "
                                                              "all (default 4)")
    block: int | None = Field(None, ge=1, description="bigbird: block length in positions (default 64)")
    window_blocks: int | None = Field(None, ge=1, description="bigbird: the query's block and the ones before it (default 3)")
    global_blocks: int | None = Field(None, ge=0, description="bigbird: first blocks read by and reading all (default 1)")
    random_blocks: int | None = Field(None, ge=0, description="bigbird: random earlier blocks per query block (default 2)")
    seed: int | None = Field(None, ge=0, description="bigbird: seed of the random blocks (default 0)")
    stride: int | None = Field(None, ge=1, description="strided: every stride-th earlier key (default 128)")
    local: int | None = Field(None, ge=1, description="strided: the last keys every query reads (default: the stride)")
    kernel: Literal["flex", "naive"] = Field("flex", description="flex (FlexAttention block masks, compiled) or naive "
                                                                 "(the masked-softmax reference)")


DEFAULTS = {"window": 256, "dilation": 1, "global_tokens": 4, "block": 64, "window_blocks": 3, "global_blocks": 1,
            "random_blocks": 2, "seed": 0, "stride": 128, "local": None}

SHRINK = {"longformer": "--window (or --dilation)", "bigbird": "--block or --window-blocks", "strided": "--local"}


def _sparse_classes():
    from ..attention.sparse import EffattnSparseConfig, EffattnSparseForCausalLM

    return EffattnSparseConfig, EffattnSparseForCausalLM


def pattern_from(opts: SparseOptions, max_length: int) -> Pattern:
    values = {k: getattr(opts, k) if getattr(opts, k) is not None else DEFAULTS[k] for k in PATTERN_OPTIONS[opts.pattern]}
    if opts.pattern == "bigbird":
        values["max_length"] = max_length
    return Pattern(opts.pattern, **values)


class SparseConversion:
    name = "sparse"
    source_window = "replaces"  # a source's sliding window (base.check_source_window)
    aliases = {"longformer": {"pattern": "longformer"}, "bigbird": {"pattern": "bigbird"},
               "strided": {"pattern": "strided"}}
    description = "sparse attention patterns (Longformer, BigBird, strided) on FlexAttention block masks: less compute"
    Options = SparseOptions
    model = ModelSpec(
        model_type="effattn_sparse", description="sparse attention patterns (effattn_sparse, FlexAttention)",
        config_class=lambda: _sparse_classes()[0], model_class=lambda: _sparse_classes()[1],
        modeling_file="modeling_effattn_sparse.py", modules=("kernels/patterns.py", "attention/wrapped.py",
                                                                    "attention/sparse.py"),
        padding="batched")
    measure_contexts = (512, 2048)

    def targets(self, config: dict[str, Any]) -> str:
        return "--pattern {longformer, bigbird, strided} and its parameters: each query reads the pattern's keys only"

    def plan(self, ckpt: Checkpoint, family: Family, opts: SparseOptions, target=None) -> Plan:
        from ..attention.sparse import sparse_config_from

        config = ckpt.config
        if opts.pattern is None:
            raise EffattnError("--to sparse needs --pattern", "one of longformer, bigbird, strided")
        for key in DEFAULTS:
            if getattr(opts, key) is not None and key not in PATTERN_OPTIONS[opts.pattern]:
                users = [p for p, keys in PATTERN_OPTIONS.items() if key in keys]
                raise EffattnError(f"--{key.replace('_', '-')} applies to --pattern {' or '.join(users)}, not "
                                   f"{opts.pattern}", f"drop it, or use --pattern {users[0]}")
        shape = AttentionShape.of(config)
        longest = int(config.get("max_position_embeddings") or trained_length(config))
        pattern = pattern_from(opts, max_length=max(longest, 1 << 17))
        try:
            pattern.check()
        except ValueError as exc:
            raise EffattnError(str(exc), "see `effattn convert --to sparse --help`") from None
        base = dict(config)
        for key in ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types"):
            base.pop(key, None)
        if base.get("model_type") == "mistral":
            base["sliding_window"] = None
        settings = pattern.settings()
        settings.pop("name")
        new = sparse_config_from(base, sparse_pattern={"name": opts.pattern, **settings}, sparse_kernel=opts.kernel)
        if target is not None:
            new["dtype"] = str(target).replace("torch.", "")
            new.pop("torch_dtype", None)
        trained = trained_length(config)
        dens = {n: density(pattern, n) for n in (2048, trained)}
        if dens[trained] == 1.0:
            raise EffattnError(f"--pattern {opts.pattern} with these settings keeps every causal pair up to the trained "
                               f"context ({trained:,} tokens): nothing would change", "use a smaller " + SHRINK[opts.pattern])
        kv = kv_bytes_per_token(config, target or ckpt.dtype)
        return Plan(
            conversion=self.name, config=new, specs=same_specs(ckpt, target),
            settings={"pattern": opts.pattern, **settings, "kernel": opts.kernel},
            summary=[("model", f"{family.name} -> effattn_sparse, {shape.layers} layers, weights unchanged"),
                     ("pattern", f"{opts.pattern} " + ", ".join(f"{k} {v}" for k, v in settings.items() if v is not None)),
                     ("density", ", ".join(f"{d:.1%} of causal pairs at {n:,} tokens" for n, d in dens.items())),
                     ("KV cache", f"{kv:,.0f} bytes/token, unchanged (global and random keys can be read at any time)")],
            kv_bytes_per_token=(kv, kv), est_seconds=read_time(ckpt), est_peak_bytes=streaming_bytes(ckpt, family),
            state={"target": target},
        )

    def run(self, ckpt: Checkpoint, family: Family, plan: Plan, writer: SafetensorsWriter, progress) -> None:
        passthrough(ckpt, writer, ckpt.names(), plan.state["target"])
