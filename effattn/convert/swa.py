"""Sliding-window attention as a conversion: each query attends to the last W keys, itself included.

    effattn convert MODEL --to swa --window 1024 -o OUT
    effattn convert MODEL --to swa --window 1024 --full-layers 6 -o OUT

The weights are untouched; the output is a native transformers architecture whose attention applies
the window, so plain `transformers` and vLLM load it, and its cache holds W tokens per windowed layer:

  * a Llama without biases, or a Mistral, with every layer windowed -> `MistralForCausalLM` with
    `sliding_window` (Mistral's attention is Llama's plus the window);
  * the same with some layers keeping full attention -> `MinistralForCausalLM`, whose `layer_types`
    say, per layer, `sliding_attention` or `full_attention` (Ministral is Mistral with that list);
  * Qwen2 / Qwen3 -> the same architecture with `use_sliding_window`, `sliding_window`, `layer_types`.

`--full-layers N` keeps N layers on full attention (as Gemma and Qwen interleave): the N layers where
the window changes the attention output most, measured on calibration text (each layer's relative
error of its attention output, windowed against full, on the original model's activations), or the
layers `--full-layer-ids` lists. Transformers' window counts the query itself: key j is seen by query i
when i - W < j <= i.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from ..data.corpora import DEFAULT_CALIB
from ..errors import EffattnError
from ..families import AttentionShape, Family, family_for, rope_settings, trained_length
from ..models import ModelSpec
from ..io.checkpoint import Checkpoint
from ..io.writer import SafetensorsWriter
from .base import Plan, build_native, passthrough, read_time, readable, same_specs
from .calibrate import CALIB_HELP, CalibSettings, batches
from .layers import LayerInput, LayerOutput, calibrated_bytes, run_layers, streaming_bytes
from ..kernels.sinks import sink_attention
from .options import ConversionOptions

# keys a Llama config carries that Mistral/Ministral do not read (dropped from the native config)
LLAMA_ONLY = ("attention_bias", "mlp_bias", "pretraining_tp")


class SWAOptions(ConversionOptions):
    window: int | None = Field(None, ge=1, description="keys each query attends to, itself included (required)")
    sinks: int = Field(0, ge=0, description="first tokens every query also attends to (StreamingLLM's attention "
                                            "sinks; effattn's own model, loaded by `import effattn` or "
                                            "trust_remote_code)")
    full_layers: int = Field(0, ge=0, description="layers that keep full attention: those where the window changes the "
                                                  "attention output most on calibration text")
    full_layer_ids: str | None = Field(None, description="comma-separated layer indices that keep full attention "
                                                         "(instead of ranking them)")
    calib: str = Field(DEFAULT_CALIB, description=CALIB_HELP + " (ranking for --full-layers)")
    calib_tokens: int = Field(16384, ge=1, description="calibration tokens (ranking for --full-layers)")


def native_config(config: dict[str, Any], family: Family, window: int, layer_types: list[str]) -> dict[str, Any]:
    """The output config.json: the native architecture that applies `window` on the layers marked
    `sliding_attention` and full attention on the others. Refuses a model no native one expresses."""
    new = {k: v for k, v in config.items() if k not in ("sliding_window", "use_sliding_window", "max_window_layers",
                                                        "layer_types")}
    mixed = "full_attention" in layer_types
    if family.name in ("qwen2", "qwen3"):
        new |= {"use_sliding_window": True, "sliding_window": window, "layer_types": layer_types,
                "max_window_layers": config["num_hidden_layers"]}
        return new
    if family.name == "llama" and (config.get("attention_bias") or config.get("mlp_bias")):
        raise EffattnError("this Llama has attention or MLP biases, which no native windowed architecture has "
                           "(Mistral and Ministral have none)", "convert a Llama without biases, a Mistral or a Qwen2/Qwen3")
    if family.name not in ("llama", "mistral"):
        raise EffattnError(f"no native windowed architecture for {family.name}", "use a Llama, Mistral or Qwen2/Qwen3 model")
    for key in LLAMA_ONLY:
        new.pop(key, None)
    kind = "ministral" if mixed else "mistral"
    new |= {"model_type": kind, "architectures": [f"{kind.capitalize()}ForCausalLM"], "sliding_window": window}
    if mixed:
        new["layer_types"] = layer_types
    return new


def parse_layer_ids(text: str, layers: int) -> list[int]:
    try:
        ids = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise EffattnError(f"--full-layer-ids {text!r} is not a comma-separated list of layer indices",
                           "e.g. --full-layer-ids " + ",".join(map(str, sorted({0, layers // 2, layers - 1})))
                           ) from None
    if not ids or ids[0] < 0 or ids[-1] >= layers:
        raise EffattnError(f"--full-layer-ids {text!r} names layers outside 0..{layers - 1}",
                           f"this model has {layers} layers, numbered 0 to {layers - 1}")
    return ids


def kv_bytes(config: dict[str, Any], layer_types: list[str], cached: int, context: int, dtype: torch.dtype) -> float:
    """Cache bytes per token at `context` tokens: windowed layers hold `cached` tokens, full ones all. (A window
    of W keys caches W - 1 of them, and the sinks: each query reads them and itself.)"""
    shape = AttentionShape.of(config)
    per_layer = 2 * shape.kv_heads * shape.head_dim * dtype.itemsize
    held = sum(min(cached, context) if t == "sliding_attention" else context for t in layer_types)
    return per_layer * held / context


def window_mask(length: int, window: int) -> torch.Tensor:
    """[T, T] bool: query i sees key j when i - window < j <= i (transformers' sliding window)."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None]
    return (j <= i) & (j > i - window)


def _sinks_classes():
    from ..attention.sinks import EffattnSinksConfig, EffattnSinksForCausalLM

    return EffattnSinksConfig, EffattnSinksForCausalLM


def sinks_config(config: dict[str, Any], window: int, sinks: int, layer_types: list[str]) -> dict[str, Any]:
    """The effattn_sinks config: the base config (its own window switched off) plus the sink settings."""
    from ..attention.sinks import sinks_config_from

    base = {k: v for k, v in config.items() if k not in ("sliding_window", "use_sliding_window", "max_window_layers",
                                                         "layer_types")}
    if base.get("model_type") == "mistral":
        base["sliding_window"] = None
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    return sinks_config_from(base, sink_tokens=sinks, attention_window=window, sink_full_layers=full)


class SWAConversion:
    name = "swa"
    source_window = "replaces"  # a source's sliding window (base.check_source_window)
    aliases = {"sliding-window": {}, "sinks": {"sinks": 4}}
    description = ("sliding-window attention (Mistral's window; some layers may keep full attention), optionally "
                   "with attention sinks: a bounded KV cache")
    # native without sinks (Mistral, Ministral, Qwen2/Qwen3 with a window); with sinks, effattn's own model
    model = ModelSpec(
        model_type="effattn_sinks", description="attention sinks + sliding window (effattn_sinks, StreamingLLM)",
        config_class=lambda: _sinks_classes()[0], model_class=lambda: _sinks_classes()[1],
        modeling_file="modeling_effattn_sinks.py",
        modules=("kernels/rope.py", "kernels/sinks.py", "attention/wrapped.py", "attention/sinks.py"))
    Options = SWAOptions
    memory_options = ("calib_tokens",)
    measure_contexts = (512, 2048)

    def targets(self, config: dict[str, Any]) -> str:
        trained = trained_length(config)
        text = (f"--window W [--sinks S] [--full-layers N]: each query attends to its last W keys (W < {trained:,}, "
                f"the trained context) and the first S; the cache holds W - 1 + S tokens per windowed layer")
        try:
            native_config(config, family_for(config), 1, ["sliding_attention"])
        except EffattnError as exc:
            text += f". Only with --sinks here: {exc.what}"
        return text

    def plan(self, ckpt: Checkpoint, family: Family, opts: SWAOptions, target=None) -> Plan:
        config = ckpt.config
        shape = AttentionShape.of(config)
        trained = trained_length(config)
        if opts.window is None:
            raise EffattnError("--to swa needs --window", f"e.g. --window {min(1024, trained // 4)} (keys each query sees)")
        if opts.window >= trained:
            raise EffattnError(f"--window {opts.window:,} covers the whole trained context ({trained:,} tokens): "
                               "nothing would change", f"use a window below {trained:,}")
        given = opts.given()
        if "full_layer_ids" in given and "full_layers" in given:
            raise EffattnError("--full-layers and --full-layer-ids both choose the full-attention layers",
                               "give one: a count (ranked by measured error) or the indices")
        fixed = parse_layer_ids(opts.full_layer_ids, shape.layers) if opts.full_layer_ids else None
        if opts.full_layers >= shape.layers:
            raise EffattnError(f"--full-layers {opts.full_layers} leaves no windowed layer (the model has "
                               f"{shape.layers})", f"use --full-layers {shape.layers - 1} or fewer")
        if fixed is not None and len(fixed) >= shape.layers:
            raise EffattnError("--full-layer-ids names every layer: nothing would be windowed",
                               "leave at least one layer out")
        ranking = fixed is None and opts.full_layers > 0
        if not ranking and given & {"calib", "calib_tokens"}:
            raise EffattnError("--calib/--calib-tokens rank layers for --full-layers, which is not asked for",
                               "drop them, or add --full-layers N")
        full = fixed or []
        layer_types = ["full_attention" if i in full else "sliding_attention" for i in range(shape.layers)]
        # with ranking, which layers stay full is measured by the run; the plan's config is provisional
        # (layer_types is replaced by the run's choice) but its architecture is already decided
        provisional = ["full_attention"] * opts.full_layers + ["sliding_attention"] * (shape.layers - opts.full_layers) \
            if ranking else layer_types
        if opts.sinks:
            if rope_settings(config).get("rope_type") == "dynamic":
                raise EffattnError("--sinks rotates keys at their distance in the cache, which dynamic NTK scaling "
                                   "(positions that depend on the sequence length) does not allow",
                                   "convert the model without dynamic RoPE scaling, or drop --sinks")
            new = sinks_config(config, opts.window, opts.sinks, provisional)
        else:
            new = native_config(config, family, opts.window, provisional)
        if target is not None:
            new["dtype"] = str(target).replace("torch.", "")
            new.pop("torch_dtype", None)
        if not opts.sinks:
            check_native(new)
        dtype = target or ckpt.dtype
        before = kv_bytes(config, ["full_attention"] * shape.layers, opts.window, trained, dtype)
        cached = opts.window - 1 + opts.sinks  # what transformers' sliding cache and the sinks cache hold
        after = kv_bytes(config, provisional, cached, trained, dtype)
        n_full = opts.full_layers if ranking else len(full)
        settings: dict[str, Any] = {"window": opts.window, "sinks": opts.sinks, "full_layers": n_full,
                                    "full_layer_ids": ",".join(map(str, full)) if fixed else None}
        summary = [("model", f"{family.name} -> {new['model_type']}, {shape.layers} layers, weights unchanged"),
                   ("attention", f"window {opts.window:,}" + (f" + {opts.sinks} sinks" if opts.sinks else "") +
                    f" on {shape.layers - n_full} layers" +
                    (f", full on {n_full}" + (f" ({settings['full_layer_ids']})" if fixed else
                                              " (the largest measured errors)") if n_full else ""))]
        state: dict[str, Any] = {"target": target, "layer_types": layer_types, "ranking": ranking}
        est_seconds, est_peak = read_time(ckpt), streaming_bytes(ckpt, family)
        if ranking:
            seq_len = min(max(4 * opts.window, 1024), trained)
            if opts.calib_tokens < seq_len:  # the ranking reads whole sequences: it would take more than asked
                raise EffattnError(f"--calib-tokens {opts.calib_tokens:,} is less than one ranking sequence of "
                                   f"{seq_len:,} tokens (4 x --window, at least 1,024, at most the trained length)",
                                   f"use --calib-tokens {seq_len} or more")
            calib = CalibSettings(corpus=opts.calib, tokens=opts.calib_tokens, seq_len=seq_len,
                                  batch_size=1).validate(ckpt.folder, without="name the full layers with --full-layer-ids")
            state["calib"] = calib
            settings |= {"calib": calib.corpus, "calib_tokens": calib.tokens, "calib_seq_len": calib.seq_len}
            from ..resources import FORWARD_EFFICIENCY, Dims, compute_seconds

            dims = Dims.of(config)
            flops = 2 * calib.tokens * ckpt.num_params + 2 * dims.layers * dims.scores_flops(calib.tokens, calib.seq_len)
            est_seconds += compute_seconds(flops, FORWARD_EFFICIENCY)
            est_peak = calibrated_bytes(ckpt, family, calib)
            summary.append(("ranking", f"{calib.tokens:,} tokens of {calib.corpus!r} in blocks of {calib.seq_len:,}: "
                                       "each layer's attention error, windowed against full"))
        summary.append(("KV cache", f"{readable(before)} -> {readable(after)} bytes/token at {trained:,} tokens "
                                    f"({before / after:.1f}x less; a windowed layer caches {cached:,} tokens)"))
        return Plan(conversion=self.name, config=new, specs=same_specs(ckpt, target), settings=settings,
                    summary=summary, kv_bytes_per_token=(before, after), est_seconds=est_seconds,
                    est_peak_bytes=est_peak, state=state)

    def run(self, ckpt: Checkpoint, family: Family, plan: Plan, writer: SafetensorsWriter, progress) -> None:
        if not plan.state["ranking"]:
            passthrough(ckpt, writer, ckpt.names(), plan.state["target"])
            return
        window, calib = plan.settings["window"], plan.state["calib"]
        errors: list[float] = []

        sinks = plan.settings["sinks"]

        def measure_layer(layer: LayerInput) -> LayerOutput:
            attn, norm = layer.original.self_attn, layer.original.input_layernorm
            cos, sin = layer.cos[0], layer.sin[0]
            rope = lambda positions: (cos[positions], sin[positions])  # noqa: E731
            positions = torch.arange(layer.x.shape[1])
            num = den = 0.0
            for sl in batches(layer.x, calib.batch_size):
                h = norm(layer.x[sl])
                full = attn(h, position_embeddings=(layer.cos, layer.sin), attention_mask=None)[0]
                B, T, _ = h.shape
                q, k, v = (getattr(attn, f"{n}_proj")(h).view(B, T, -1, attn.head_dim) for n in "qkv")
                if getattr(attn, "q_norm", None) is not None:
                    q, k = attn.q_norm(q), attn.k_norm(k)
                out = sink_attention(q, k, v, positions, positions, rope, window=window, sinks=sinks, scale=attn.scaling,
                                     chunk=ranking_chunk(window))
                windowed = attn.o_proj(out.reshape(B, T, -1))
                num += float((windowed - full).double().pow(2).sum())
                den += float(full.double().pow(2).sum())
            errors.append(num / max(den, 1e-30))
            # the original layer carries the activations on: every layer is measured on the original
            # model's inputs at its depth, so the ranking does not depend on an order of choosing
            return LayerOutput(tensors=dict(layer.tensors), module=layer.original, refinable=False,
                               note=f"window error {errors[-1]:.4f}")

        run_layers(ckpt, family, writer, measure_layer, layers=AttentionShape.of(ckpt.config).layers,
                   target=plan.state["target"], calib=calib, progress=progress, description="ranking layers")
        n_full = plan.settings["full_layers"]
        full = sorted(sorted(range(len(errors)), key=lambda i: -errors[i])[:n_full])
        layer_types = ["full_attention" if i in full else "sliding_attention" for i in range(len(errors))]
        plan.measured["config"] = {"sink_full_layers": full} if plan.settings["sinks"] else {"layer_types": layer_types}
        plan.measured["settings"] = {"full_layer_ids": ",".join(map(str, full))}
        plan.measured["window_error"] = {"loss": "relative squared error of each layer's attention output, windowed "
                                                 "against full, on the original model's calibration activations",
                                         "per_layer": [round(e, 6) for e in errors]}


def ranking_chunk(window: int) -> int:
    """Queries per chunk of the ranking's windowed attention: about the window. Each chunk holds a few copies of its
    scores (heads x queries x keys, the keys its queries' windows span): with the kernel's default 1,024 a tiny
    model's ranking peaked 1.54x above its plan (the plan counts one batch's scores, heads x seq_len^2), the
    chunk's scores, their masked copy, the softmax and allocator growth beyond it."""
    return min(max(window, 64), 1024)


def check_native(config: dict[str, Any]) -> None:
    """Build the output config with transformers, as loading will; whatever it rejects is refused here."""
    cfg = build_native(config, "the windowed config", "see `effattn convert --to swa --help`")
    if getattr(cfg, "sliding_window", None) != config["sliding_window"]:
        raise EffattnError(f"transformers drops the window from a {config['model_type']} config",
                           "report this: effattn expected the architecture to keep sliding_window")
