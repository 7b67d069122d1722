"""RoPE scaling as a conversion: extend a RoPE model's context by rewriting its positions, weights untouched.

    effattn convert MODEL --to rope-scaling --rope-type yarn --factor 4 -o OUT

The output is the same architecture with transformers' native `rope_parameters` (transformers 5,
`modeling_rope_utils.py`), so plain `transformers` and vLLM load it:

  * `linear` (position interpolation): every position divided by the factor.
  * `dynamic` (NTK-aware, "dynamic NTK"): the RoPE base grows with the sequence once it passes the
    trained length; unchanged within it. `max_position_embeddings` stays the trained length, which is
    where transformers starts scaling.
  * `yarn`: frequencies interpolated by band (`--beta-fast`, `--beta-slow`: the rotations within the
    trained length that mark the bands) plus an attention temperature (`--attention-factor`, default
    0.1 ln(factor) + 1).
  * `llama3`: Llama 3.1's band-wise interpolation (`--low-freq-factor`, `--high-freq-factor`).
  * `longrope`: per-frequency factors beyond the trained length (`--long-factors`, one per frequency;
    default every factor equal to `--factor`, since effattn does not run LongRoPE's search), unchanged
    within it.

Except for `dynamic`, `max_position_embeddings` becomes the trained length times the factor, and the
trained length is kept as `original_max_position_embeddings`. `effattn inspect` shows both.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import Field

from ..errors import EffattnError, clip
from ..families import AttentionShape, Family, rope_settings, trained_length
from ..io.checkpoint import Checkpoint
from ..io.writer import SafetensorsWriter
from .base import Plan, passthrough, read_time, same_specs
from .layers import streaming_bytes
from .options import ConversionOptions

RopeType = Literal["linear", "dynamic", "yarn", "llama3", "longrope"]
# options that only one type reads (the CLI refuses them with another type)
TYPE_OPTIONS = {"beta_fast": "yarn", "beta_slow": "yarn", "attention_factor": ("yarn", "longrope"),
                "low_freq_factor": "llama3", "high_freq_factor": "llama3", "long_factors": "longrope"}


class RopeScalingOptions(ConversionOptions):
    rope_type: RopeType | None = Field(None, description="how positions are rescaled: linear, dynamic (NTK), yarn, "
                                                         "llama3, longrope (required)")
    factor: float | None = Field(None, gt=1, le=1024,
                                 description="context extension: the new length is the trained length "
                                                         "times this (required)")
    original_length: int | None = Field(None, ge=1, description="the trained length (default: the model's "
                                                               "max_position_embeddings, or the original_max_position_"
                                                               "embeddings of an already scaled model)")
    beta_fast: float | None = Field(None, gt=0, description="yarn: rotations within the trained length above which "
                                                            "a frequency is kept (default 32)")
    beta_slow: float | None = Field(None, gt=0, description="yarn: rotations below which a frequency is fully "
                                                            "interpolated (default 1)")
    attention_factor: float | None = Field(None, gt=0, description="yarn/longrope: logit temperature (default: "
                                                                   "0.1 ln(factor) + 1 for yarn)")
    low_freq_factor: float | None = Field(None, gt=0, description="llama3: wavelengths above trained length / this "
                                                                  "are interpolated (default 1)")
    high_freq_factor: float | None = Field(None, gt=0, description="llama3: wavelengths below trained length / this "
                                                                   "are kept (default 4)")
    long_factors: str | None = Field(None, description="longrope: comma-separated factors, one per RoPE frequency "
                                                       "(head_dim / 2; default: --factor for every frequency)")


class RopeScalingConversion:
    name = "rope-scaling"
    source_window = "keeps"  # a source's sliding window (base.check_source_window)
    aliases = {"yarn": {"rope_type": "yarn"}}
    description = "RoPE scaling (linear, dynamic NTK, YaRN, Llama 3, LongRoPE): a longer context, weights untouched"
    model = None  # native: the same architecture with rope_parameters
    Options = RopeScalingOptions

    def targets(self, config: dict[str, Any]) -> str:
        trained = trained_length(config)
        return (f"--rope-type {{linear, dynamic, yarn, llama3, longrope}} --factor F: context {trained:,} -> "
                f"F x {trained:,} (weights untouched)")

    def plan(self, ckpt: Checkpoint, family: Family, opts: RopeScalingOptions, target=None) -> Plan:
        config = ckpt.config
        if family.rope_layout is None:
            raise EffattnError(f"{family.name} has no RoPE to scale", "use a RoPE model (Llama, Mistral, Qwen, ...)")
        if opts.rope_type is None or opts.factor is None:
            raise EffattnError("--to rope-scaling needs --rope-type and --factor",
                               "e.g. --rope-type yarn --factor 4 (4 x the trained context)")
        for key, types in TYPE_OPTIONS.items():
            types = (types,) if isinstance(types, str) else types
            if getattr(opts, key) is not None and opts.rope_type not in types:
                raise EffattnError(f"--{key.replace('_', '-')} applies to --rope-type {' or '.join(types)}, not "
                                   f"{opts.rope_type}", f"drop it, or use --rope-type {types[0]}")
        shape = AttentionShape.of(config)
        trained = opts.original_length or trained_length(config)
        parameters = rope_parameters(opts, config, trained, shape.head_dim)
        new = dict(config)
        new.pop("rope_scaling", None)  # the legacy key: transformers 5 reads rope_parameters
        new["rope_parameters"] = parameters
        extended = trained if opts.rope_type == "dynamic" else int(round(trained * opts.factor))
        new["max_position_embeddings"] = extended
        new.pop("original_max_position_embeddings", None)  # kept inside rope_parameters
        if target is not None:
            new["dtype"] = str(target).replace("torch.", "")
            new.pop("torch_dtype", None)
        check_native(new)
        replaced = _replaced_scaling(config, parameters, new, trained)
        kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * (target or ckpt.dtype).itemsize
        reach = trained * opts.factor
        return Plan(
            conversion=self.name, config=new, specs=same_specs(ckpt, target),
            settings={"rope_type": opts.rope_type, "factor": opts.factor, "original_length": trained,
                      **{k: v for k, v in parameters.items() if k not in ("rope_type", "factor", "rope_theta",
                                                                           "original_max_position_embeddings",
                                                                           "short_factor", "long_factor")}},
            summary=[("model", f"{family.name}, {shape.layers} layers, head_dim {shape.head_dim}"),
                     ("positions", f"{describe(parameters)}"),
                     ("context", f"trained {trained:,} -> {reach:,.0f} tokens" +
                      (" (dynamic: scaling starts beyond the trained length)" if opts.rope_type == "dynamic" else "")),
                     *([("replaces", replaced)] if replaced else []),
                     ("weights", "unchanged"),
                     ("KV cache", f"{kv:,.0f} bytes/token, unchanged")],
            kv_bytes_per_token=(kv, kv), est_seconds=read_time(ckpt), est_peak_bytes=streaming_bytes(ckpt, family),
            state={"target": target},
        )

    def run(self, ckpt: Checkpoint, family: Family, plan: Plan, writer: SafetensorsWriter, progress) -> None:
        passthrough(ckpt, writer, ckpt.names(), plan.state["target"])


def _replaced_scaling(config: dict[str, Any], parameters: dict[str, Any], new: dict[str, Any], trained: int) -> str:
    """What a model that already scales RoPE had, which the new scaling replaces ('' for an unscaled model): the
    factor multiplies the trained length, not the scaled context. A scaling equal to the model's own is refused."""
    from ..families import context_positions

    old = rope_settings(config)
    if old.get("rope_type") in (None, "default"):
        return ""
    if all(old.get(k) == v for k, v in parameters.items()) and \
            new["max_position_embeddings"] == config.get("max_position_embeddings"):
        raise EffattnError(f"this model already scales RoPE the same way ({old['rope_type']} x{old.get('factor')}, "
                           f"trained {trained:,}): nothing would change", f"--factor multiplies the trained length "
                           f"({trained:,}): give a larger one, or another --rope-type")
    return (f"the model's own {old['rope_type']} x{old.get('factor')} (context {context_positions(config):,}); "
            f"--factor multiplies the trained length, {trained:,}")


def rope_theta(config: dict[str, Any]) -> float:
    return float(rope_settings(config).get("rope_theta") or 10000.0)


def rope_parameters(opts: RopeScalingOptions, config: dict[str, Any], trained: int, head_dim: int) -> dict[str, Any]:
    """transformers' rope_parameters for the options (only the keys each type reads)."""
    params: dict[str, Any] = {"rope_type": opts.rope_type, "factor": float(opts.factor), "rope_theta": rope_theta(config)}
    kind = opts.rope_type
    if kind in ("yarn", "llama3", "longrope"):
        params["original_max_position_embeddings"] = trained
    if kind == "yarn":
        params |= {"beta_fast": float(opts.beta_fast or 32.0), "beta_slow": float(opts.beta_slow or 1.0)}
        if (opts.beta_fast or 32.0) <= (opts.beta_slow or 1.0):
            raise EffattnError(f"--beta-fast {opts.beta_fast or 32.0} must be above --beta-slow {opts.beta_slow or 1.0}",
                               "yarn keeps frequencies above beta-fast rotations and interpolates those below beta-slow")
        if opts.attention_factor is not None:
            params["attention_factor"] = float(opts.attention_factor)
    elif kind == "llama3":
        low, high = float(opts.low_freq_factor or 1.0), float(opts.high_freq_factor or 4.0)
        if high <= low:
            raise EffattnError(f"--high-freq-factor {high} must be above --low-freq-factor {low}",
                               "e.g. the Llama 3.1 values, 4 and 1")
        params |= {"low_freq_factor": low, "high_freq_factor": high}
    elif kind == "longrope":
        n = head_dim // 2
        if opts.long_factors:
            try:
                long = [float(x) for x in opts.long_factors.split(",")]
            except ValueError:
                raise EffattnError(f"--long-factors {opts.long_factors!r} is not a comma-separated list of numbers",
                                   f"give {n} numbers, e.g. {','.join(['1.0'] * 3)},...") from None
            if len(long) != n or min(long) < 1:
                raise EffattnError(f"--long-factors has {len(long)} values (smallest {min(long)}); this model has {n} "
                                   "RoPE frequencies", f"give {n} numbers of at least 1, or leave it out for --factor on each")
        else:
            long = [float(opts.factor)] * n
        params |= {"short_factor": [1.0] * n, "long_factor": long}
        if opts.attention_factor is not None:
            params["attention_factor"] = float(opts.attention_factor)
    return params


def describe(params: dict[str, Any]) -> str:
    kind, factor = params["rope_type"], params["factor"]
    extra = {"yarn": f", bands beta_fast {params.get('beta_fast')} / beta_slow {params.get('beta_slow')}, attention factor "
                     f"{params.get('attention_factor', round(0.1 * math.log(factor) + 1, 4))}",
             "llama3": f", low/high frequency factors {params.get('low_freq_factor')}/{params.get('high_freq_factor')}",
             "longrope": ", per-frequency factors beyond the trained length" + (
                 "" if len(set(params.get("long_factor", []))) > 1 else f" (all {factor})")}.get(kind, "")
    return f"RoPE {kind} x{factor:g} (theta {params['rope_theta']:g}){extra}"


def check_native(config: dict[str, Any]) -> None:
    """Build the config and its RoPE tables with transformers, as loading will: whatever it rejects or
    warns about is refused here, in one line."""
    import logging

    from transformers import CONFIG_MAPPING
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise EffattnError(f"model type {model_type!r} is not one transformers knows", "scale a native transformers model")
    records: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING and "rope" in record.getMessage().lower():
                records.append(record.getMessage())

    handler = Catch()
    loggers = [logging.getLogger("transformers.modeling_rope_utils"), logging.getLogger("transformers.configuration_utils")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        cfg = CONFIG_MAPPING[model_type].from_dict(config)
        ROPE_INIT_FUNCTIONS[config["rope_parameters"]["rope_type"]](cfg, torch.device("cpu"))
    except Exception as exc:  # noqa: BLE001 - transformers' own checks, said in one line
        raise EffattnError(f"transformers rejects these RoPE parameters ({clip(exc)})",
                           "see `effattn convert --to rope-scaling --help`") from None
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    if records:
        raise EffattnError(f"transformers warns about these RoPE parameters: {clip(records[0], 240)}",
                           "adjust the options it names")
