"""The conversion driver shared by every conversion: resolve, plan, write atomically, measure, record.

A conversion is an object with
  * `Options`: its options model (options.py), the one place where their names, types, defaults
    and help live;
  * `plan(ckpt, family, opts, target_dtype) -> Plan`: check the options against the checkpoint and
    declare the output (new config, every output tensor's shape) without writing anything;
  * `run(ckpt, family, plan, writer, progress)`: write every declared tensor through `writer`.
The driver does everything else, identically for all conversions.
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from .. import __version__
from ..errors import EffattnError, clip
from ..families import Family, family_for
from ..io.checkpoint import Checkpoint
from ..io.verify import verify_checkpoint
from ..io.load import as_ref, parse_dtype, tokenizer_missing
from ..io.resolve import ModelRef
from ..io.writer import SafetensorsWriter, TensorSpec, atomic_output, check_output, copy_side_files, parse_size, write_json
from ..models import model_spec
from ..resources import (FORWARD_EFFICIENCY, MEMORY_MARGIN, MODEL_LOAD_SECONDS, Dims, PeakRSS, check_memory,
                         compute_seconds, disk_seconds, held, memory_budget, read_seconds, side_by_side)
from .options import ConversionOptions, flag, resolve

EVAL_TOKENS = 4096  # tokens per corpus for the quick measurement the card reports (--eval-tokens)


@dataclass
class Plan:
    """What a conversion will do, known before anything is written."""

    conversion: str
    settings: dict[str, Any]  # the conversion's options, as recorded in effattn.json
    config: dict[str, Any]  # the output config.json
    specs: list[TensorSpec]  # every output tensor
    summary: list[tuple[str, str]]  # (what, value) lines for people
    kv_bytes_per_token: tuple[float, float]  # (before, after) from the configs, for the dry run
    est_seconds: float = 0.0
    est_peak_bytes: int = 0
    state: dict[str, Any] = field(default_factory=dict)  # conversion-specific plan details
    # What the run decided or measured: "config" (data-dependent config.json keys) and "settings"
    # (recorded with the options) complete the plan; anything else goes to effattn.json's conversion_run.
    measured: dict[str, Any] = field(default_factory=dict)

    @property
    def output_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


class Conversion(Protocol):
    name: str
    description: str
    Options: type[ConversionOptions]

    def plan(self, ckpt: Checkpoint, family: Family, opts: ConversionOptions, target: torch.dtype | None) -> Plan: ...

    def run(self, ckpt: Checkpoint, family: Family, plan: Plan, writer: SafetensorsWriter, progress) -> None: ...

    # Optional: `memory_options`, the options that shrink the run's peak memory, in the order a refusal
    # names them (e.g. ("calib_tokens", "codebook_size")); `measure_contexts` (see measure_contexts);
    # `check_model(config, family)`, the refusals that depend on the model alone, whatever the options:
    # `convert` runs them before planning and `inspect` shows them (see check_applies).


def check_applies(conversion, config: dict[str, Any], family: Family, name: str) -> None:
    """Refuse a model the conversion cannot take with any options: its sliding window (check_source_window),
    then the conversion's own `check_model`."""
    check_source_window(conversion, config, name)
    if hasattr(conversion, "check_model"):
        conversion.check_model(config, family)


def check_source_window(conversion, config: dict[str, Any], name: str) -> None:
    """A model that attends through a sliding window (Mistral's, Qwen's) keeps it through a native conversion
    (`source_window = "keeps"`, e.g. gqa) or gets the window the conversion sets ("replaces": swa, sparse); a
    conversion whose model has no window of its own ("drops", the default) is refused: its model would attend to
    every earlier key, which the source never did."""
    from ..info import window_of

    window = window_of(config)
    if window is not None and window[0] < (config.get("max_position_embeddings") or float("inf")) and \
            getattr(conversion, "source_window", "drops") == "drops":
        raise EffattnError(f"{name} attends through a sliding window of {window[0]:,} tokens, which --to "
                           f"{conversion.name}'s model does not keep (it would attend to every earlier token)",
                           "convert a model with full attention; --to gqa and --to rope-scaling keep the window, "
                           "--to swa and --to sparse set their own")


@dataclass
class ConvertResult:
    out: Path | None
    plan: Plan
    seconds: float = 0.0
    measurements: dict[str, Any] | None = None
    record: dict[str, Any] | None = None


def out_dtype(src: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    """Floating tensors take the requested dtype; integer tensors and 'auto' keep theirs."""
    return target if (target is not None and src.is_floating_point) else src


def passthrough(ckpt: Checkpoint, writer: SafetensorsWriter, names, target: torch.dtype | None) -> None:
    """Copy tensors unchanged (up to the dtype), one at a time."""
    for i, name in enumerate(names):
        writer.write(name, ckpt.get(name).to(out_dtype(ckpt.meta(name)[1], target)))
        if i % 16 == 15:
            ckpt.release()
    ckpt.release()


def same_specs(ckpt: Checkpoint, target: torch.dtype | None, reshaped: dict[str, tuple[int, ...]] | None = None,
               extra: list[TensorSpec] | None = None) -> list[TensorSpec]:
    """Output specs equal to the input's, except the `reshaped` tensors and `extra` new ones."""
    reshaped = reshaped or {}
    specs = []
    for name in ckpt.names():
        shape, dtype = ckpt.meta(name)
        specs.append(TensorSpec(name, reshaped.get(name, shape), out_dtype(dtype, target)))
    return specs + list(extra or [])


def read_time(ckpt: Checkpoint) -> float:
    """Seconds to read every weight: cached pages at memory speed, the rest at the disk's."""
    files = ckpt.files()
    return read_seconds(files) if files else disk_seconds(ckpt.nbytes)


def layer_bytes(ckpt: Checkpoint, family: Family) -> int:
    """Bytes of decoder layer 0's tensors: the unit of the layer-by-layer memory estimates."""
    prefix = family.prefix(0)
    return sum(ckpt.meta(n)[1].itemsize * torch.Size(ckpt.meta(n)[0]).numel() for n in ckpt.names() if n.startswith(prefix))


def readable(value: float) -> str:
    """A bytes-per-token figure: whole bytes, or two decimals below 100 (a window's cache spread over a long
    context is a fraction of a byte per token, which whole bytes would print as 0)."""
    return f"{value:,.0f}" if value >= 100 or value == int(value) else f"{value:,.2f}"


def kv_bytes_per_token(config: dict[str, Any], dtype: torch.dtype) -> float:
    """KV bytes per token a standard cache needs for this config (keys + values, every layer); an MLA
    config (kv_lora_rank) caches its latent and its shared rotary key."""
    if config.get("kv_lora_rank"):
        return config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * dtype.itemsize
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv * head_dim * dtype.itemsize


def build_native(config: dict[str, Any], what: str, fix: str):
    """The transformers config object for an output config.json, built as loading will; whatever
    transformers rejects is refused here, in one line (`what` names the config, `fix` says what to do)."""
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[config["model_type"]].from_dict(config)
    except Exception as exc:  # noqa: BLE001 - transformers' own checks, said in one line
        raise EffattnError(f"transformers rejects {what} ({clip(exc)})", fix) from None


def convert(
    model: str | Path | ModelRef,
    out: str | Path | None,
    *,
    to: str,
    options: dict[str, Any] | None = None,
    dtype: str | None = "auto",
    force: bool = False,
    dry_run: bool = False,
    max_shard_size: str | int = "2GB",
    measure: bool | None = None,
    eval_tokens: int = EVAL_TOKENS,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    progress=None,
    command: str | None = None,
    memory_check: bool = True,
) -> ConvertResult:
    """Convert MODEL with the conversion `to` and write a native checkpoint folder to `out`.

    `measure=None` evaluates original vs converted briefly (for the model card) when the model has
    at most 3B parameters; True/False force it on/off. A run whose estimated peak memory exceeds what
    the machine can give is refused before any work (`memory_check=False` runs it anyway).
    """
    conversion, opts = resolve(to, dict(options or {}))
    shard_bytes = parse_size(max_shard_size)  # a bad size is refused by the dry run too
    ref = as_ref(model, trust_remote_code=trust_remote_code, plan_only=dry_run)  # a dry run dequantizes no GGUF
    ckpt = Checkpoint(ref.path, allow_pickle=allow_pickle, shapes_only=dry_run)  # a dry run plans from config.json alone too
    made_by_us = model_spec(ckpt.config.get("model_type"))
    if made_by_us:
        raise EffattnError(f"{ref.spec} is already an effattn model ({made_by_us.description})",
                           "convert the model it came from (see its effattn.json), or chain the conversions in another order")
    if ckpt.config.get("kv_lora_rank"):  # as inspect says: DeepseekV3 is no family effattn converts from
        raise EffattnError(f"{ref.spec} is an MLA model (a latent KV cache): effattn converts from GQA/MHA families",
                           "convert the model it came from (see its effattn.json)")
    family = family_for(ckpt.config)  # before the tensors: a family effattn does not convert is refused as such
    verify_checkpoint(ckpt)
    check_applies(conversion, ckpt.config, family, ref.spec)
    target = parse_dtype(dtype)
    plan = conversion.plan(ckpt, family, opts, target)
    plan.settings.setdefault("dtype", str(target or ckpt.dtype).replace("torch.", ""))
    if target is not None and target.is_floating_point and target != ckpt.dtype and plan.kv_bytes_per_token:
        src, new = (str(d).replace("torch.", "") for d in (ckpt.dtype, target))  # the plan prices both caches at new
        plan.summary.append(("dtype", f"{src} -> {new}: the KV cache figures above are at {new} for both models; the "
                                      f"original caches {readable(kv_bytes_per_token(ckpt.config, ckpt.dtype))} "
                                      f"bytes/token at {src}"))
    if out is None and not dry_run:
        raise EffattnError("no output folder given", "pass -o OUT")
    measuring, skipped = _measurement(ckpt, ref, measure)
    conversion_peak = held() + plan.est_peak_bytes
    _add_estimates(plan, ckpt, measure=measuring, eval_tokens=eval_tokens, contexts=measure_contexts(conversion))
    if memory_check:
        _check_memory(conversion, to, ckpt, family, opts, target, plan, conversion_peak, measuring, eval_tokens)
    if out is not None:  # a dry run refuses what the run would
        check_output(out, force=force, needed_bytes=plan.output_bytes, inputs=[ref.path])
    if dry_run:
        if ref.file is not None and not ckpt.has_weights:  # planned from the GGUF's metadata
            plan.summary.append(("weights", f"in {ref.file}: planned from its metadata; the run dequantizes it "
                                            "(once, into the cache)"))
        elif not ckpt.has_weights:  # a plan for another machine: say so, since the run here would refuse
            plan.summary.append(("weights", f"none in {ref.path}: planned from config.json alone; the run needs them"))
        return ConvertResult(None, plan)
    out = Path(out).expanduser().absolute()  # now: `-o .` names the folder the run replaces, cwd included
    peak = PeakRSS().__enter__()
    t0 = time.perf_counter()
    with atomic_output(out, force=force, needed_bytes=plan.output_bytes, inputs=[ref.path]) as tmp:
        writer = SafetensorsWriter(tmp, plan.specs, shard_bytes)
        conversion.run(ckpt, family, plan, writer, progress)
        writer.close()
        # choices the run made from data (e.g. which heads stay exact) complete the planned config
        spec = model_spec(plan.config.get("model_type"))
        config = plan.config | plan.measured.get("config", {})
        if spec is None:  # a native output loads with transformers' own classes: the source's code is not copied
            config.pop("auto_map", None)
        write_json(tmp / "config.json", config)
        copy_side_files(ckpt.side_files(), tmp)
        if spec is not None:  # effattn's own model class: its code goes beside the weights (trust_remote_code)
            spec.write_code(tmp)
        seconds = time.perf_counter() - t0
        measurements = None
        if measuring:
            try:
                measurements = _quick_measure(tmp, out.name, ref, eval_tokens, trust_remote_code,
                                              contexts=measure_contexts(conversion))
            except EffattnError as exc:  # an optional measurement never decides the conversion's outcome
                skipped = f"the measurement failed: {exc.message}"
        peak.read()
        record = {
            "effattn_version": __version__,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": command,
            "reproduce": reproduce_command(ref.display, out, to, opts, plan.settings, dtype=dtype,
                                           max_shard_size=max_shard_size, trust_remote_code=trust_remote_code,
                                           allow_pickle=allow_pickle),
            # a GGUF's path is the file (its cached copy may be pruned; finetune's teacher reads the file again)
            "source": {"model": ref.spec, "kind": ref.kind, "path": str(ref.source), "hub_id": ref.hub_id,
                       **({"cache": str(ref.path)} if ref.file else {}), "model_type": ckpt.config.get("model_type"),
                       "num_key_value_heads": ckpt.config.get("num_key_value_heads"), "num_params": ckpt.num_params},
            "conversion": {"to": plan.conversion, **plan.settings, **plan.measured.get("settings", {})},
            "seconds": round(seconds, 1),
            "measurements": measurements,
            "resources": side_by_side(plan.est_seconds, plan.est_peak_bytes, time.perf_counter() - t0, peak),
        }
        if skipped:
            record["measurement_skipped"] = f"{skipped}; measure later: effattn eval {out} --baseline {ref.display} --tokenizer FOLDER"
        run_record = {k: v for k, v in plan.measured.items() if k not in ("config", "settings")}
        if run_record:  # what the run measured on the way (e.g. per-layer refinement losses)
            record["conversion_run"] = run_record
        write_json(tmp / "effattn.json", record)
        from ..io.card import model_card

        (tmp / "README.md").write_text(model_card(out.name, record, plan))
    return ConvertResult(out.absolute(), plan, seconds, measurements, record)


def _check_memory(conversion, to: str, ckpt: Checkpoint, family, opts: ConversionOptions, target, plan: Plan,
                  conversion_peak: int, measuring: bool, eval_tokens: int) -> None:
    """Refuse a conversion whose estimated peak does not fit, naming the conversion's own option that
    shrinks it (planned again at smaller values: the largest that fits) or the quick measurement."""
    budget = memory_budget()
    if budget is None or plan.est_peak_bytes <= budget * MEMORY_MARGIN:
        return
    also = "pass --no-eval (skip the quick measurement; `effattn eval` measures later)" \
        if measuring and conversion_peak <= budget * MEMORY_MARGIN else ""
    options = []
    for name in getattr(conversion, "memory_options", ()):
        value = getattr(opts, name, None)
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        step = getattr(opts, "calib_seq_len", 512) if name == "calib_tokens" else 1
        low = step if name == "calib_tokens" else 2

        def peak_of(v, name=name) -> int:
            try:
                p = conversion.plan(ckpt, family, opts.model_copy(update={name: v}), target)
            except EffattnError:
                return 2**62  # not a valid setting: never suggested
            _add_estimates(p, ckpt, measure=measuring, eval_tokens=eval_tokens, contexts=measure_contexts(conversion))
            return p.est_peak_bytes

        options.append((flag(name), value, peak_of, low, step))
    what = f"--to {to}" + (" with its quick measurement" if measuring else "")
    check_memory(plan.est_peak_bytes, what=what, options=options, also=also)


def _measurement(ckpt: Checkpoint, ref: ModelRef, measure: bool | None) -> tuple[bool, str | None]:
    """(whether the quick before/after measurement runs, why not when it was wanted but cannot).

    On by default up to 3B parameters. It needs the model's tokenizer: a folder without one (weights
    from a training job) converts, and the record says the measurement was skipped and why; asking for
    it explicitly (`--eval`) is refused before any work instead."""
    wanted = measure if measure is not None else ckpt.num_params <= 3e9
    if not wanted:
        return False, None
    why = tokenizer_missing(ref.path)
    if why is None:
        from ..io.load import check_tokenizer_fits, load_tokenizer

        try:
            check_tokenizer_fits(load_tokenizer(ref), [(ref.display, ckpt.config)])
            return True, None
        except EffattnError as exc:
            why = exc.what
    if measure:
        raise EffattnError(f"--eval needs the model's own tokenizer: {why}",
                           "drop --eval (measure later with `effattn eval OUT --baseline MODEL --tokenizer FOLDER`), "
                           "or copy the tokenizer files into the model's folder")
    return False, why


def _add_estimates(plan: Plan, ckpt: Checkpoint, *, measure: bool, eval_tokens: int, contexts: tuple[int, ...]) -> None:
    """Turn the conversion's own estimate (its work, its memory above the process's) into the run's:
    writing the output, the quick measurement if it runs, and the memory the process already holds."""
    seconds = plan.est_seconds + disk_seconds(plan.output_bytes)
    work = plan.est_peak_bytes
    if measure:
        from ..data.corpora import DEFAULT_EVAL, load_text
        from ..evaluate import measure_peak_bytes

        dims = Dims.of(ckpt.config)
        chars = max(len(load_text(c)) for c in DEFAULT_EVAL)
        seconds += 2 * MODEL_LOAD_SECONDS
        for context in contexts:
            tokens = len(DEFAULT_EVAL) * max(eval_tokens, context)  # each corpus, whole blocks
            span = span_of(plan, context)  # keys each query of the converted model reads
            for keys in (context, span):  # the original, then the converted model
                flops = 2 * tokens * ckpt.num_params + dims.layers * dims.scores_flops(tokens, keys)
                seconds += compute_seconds(flops, FORWARD_EFFICIENCY)
            # both models in float32, batches as _quick_measure runs them
            work = max(work, measure_peak_bytes(ckpt.config, ckpt.num_params, ckpt.num_params, context=context,
                                                batch_size=max(1, 1024 // context), text_chars=chars))
    plan.est_seconds = seconds
    plan.est_peak_bytes = held() + work


def reproduce_command(source: str, out: Path, to: str, opts: ConversionOptions, settings: dict[str, Any], *,
                      dtype, max_shard_size, trust_remote_code: bool = False, allow_pickle: bool = False) -> str:
    """The `effattn convert` command line that makes this output again: every option that mattered
    spelled out (those the user gave, and those the plan recorded as used, at the value used), so a
    later change of a default does not change what it makes."""
    import shlex

    from . import ALIASES
    from .options import flag

    preset = ALIASES.get(to, (to, {}))[1]  # an alias fixes these (mqa: kv_heads 1)
    parts = ["effattn", "convert", shlex.quote(source), "--to", to]
    given = opts.given()
    for name, value in opts.model_dump().items():
        if settings.get(name) is not None:
            value = settings[name]
        elif name not in given:
            continue
        if value is None or name in preset:
            continue
        if isinstance(value, bool):
            parts.append(flag(name) if value else "--no-" + flag(name)[2:])
        else:
            parts += [flag(name), shlex.quote(str(value))]
    parts += ["--trust-remote-code"] * trust_remote_code + ["--allow-pickle"] * allow_pickle
    parts += ["--dtype", str(dtype or "auto"), "--max-shard-size", str(max_shard_size), "-o", shlex.quote(str(out))]
    return " ".join(parts)


def span_of(plan: Plan, context: int) -> int:
    """How many keys a query of the converted model attends to at `context` (the plan's state may say
    `attention_span`, a function of the context: a VQ model reads its window and its codebook)."""
    span = plan.state.get("attention_span")
    return min(context, span(context)) if span else context


def measure_contexts(conversion) -> tuple[int, ...]:
    """The block lengths the card measures at: where the conversion is meant to be used. A conversion
    whose cache only pays off at long context (VQ, windows, linear attention) declares its own."""
    return tuple(getattr(conversion, "measure_contexts", None) or (512,))


def _quick_measure(folder: Path, name: str, ref: ModelRef, eval_tokens: int, trust_remote_code: bool,
                   contexts: tuple[int, ...]) -> dict[str, Any]:
    """A short original-vs-converted evaluation for the model card (`effattn eval` does the full one):
    the report at the first context, and one per longer context in `longer`."""
    from ..evaluate import EvalSettings, decode_break_even, measure
    from ..io.load import load_model

    model, tokenizer, _ = load_model(str(folder), trust_remote_code=trust_remote_code)
    original, _, _ = load_model(ref, trust_remote_code=trust_remote_code, tokenizer=False)
    reports = []
    for context in contexts:  # speed timed once per context, after one block of it (`effattn eval` repeats it)
        settings = EvalSettings(context=context, max_tokens=max(eval_tokens, context), speed=True, speed_repeats=1,
                                decode_tokens=16, batch_size=max(1, 1024 // context))
        reports.append(measure(model, tokenizer, name=name, settings=settings, baseline=original,
                               baseline_name=ref.display).to_dict())
    record = reports[0] | ({"longer": reports[1:]} if len(reports) > 1 else {})
    speeds = [[p for r in reports for p in r[who]["speed"]] for who in ("model", "baseline")]
    record["decode_break_even"] = decode_break_even(*speeds)
    return record


def read_record(folder: Path) -> dict[str, Any] | None:
    path = Path(folder) / "effattn.json"
    return json.loads(path.read_text()) if path.exists() else None
