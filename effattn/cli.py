"""The `effattn` command line: parse, validate, call one library function, report.

Every user error is an EffattnError, printed as one line (no traceback unless --debug) with a
non-zero exit. `--json` prints machine-readable results on stdout; tables and progress go to the
terminal.
"""

from __future__ import annotations

import json
import math
import shlex
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from .convert.base import EVAL_TOKENS
from .data.sample import SampleSettings
from .errors import EffattnError
from .evaluate import EvalSettings
from .retrieval import DEFAULT_FILLER, RetrievalSettings

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Attention surgery on pretrained LLMs: convert, measure, heal.")
# a table written to a file or a pipe keeps its columns (rich would cut it at 80); COLUMNS still rules where set
out = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200)
err = Console(stderr=True)
DEBUG = False

ModelArg = typer.Argument(..., help="local folder, .gguf file, hub id org/name, or built-in name (llama, smollm2)")
TrustOpt = typer.Option(False, "--trust-remote-code", help="allow a checkpoint's own Python code to run")
PickleOpt = typer.Option(False, "--allow-pickle", help="allow pickled weights (*.bin), which can run code")
JsonOpt = typer.Option(False, "--json", help="print machine-readable JSON on stdout")
# options every conversion command shares (convert, vq-init)
OutputOpt = typer.Option(None, "-o", "--output", help="output folder")
DtypeOpt = typer.Option("auto", "--dtype", help="auto (keep), float32, bfloat16, float16")
ForceOpt = typer.Option(False, "--force", help="replace an existing output folder")
MemoryCheckOpt = typer.Option(True, "--memory-check/--no-memory-check",
                              help="refuse a run whose estimated peak memory exceeds what the machine has (the "
                                   "default), naming the option that shrinks it; --no-memory-check runs it anyway")
DryRunOpt = typer.Option(False, "--dry-run", help="show what would be done; write nothing")
MeasureOpt = typer.Option(None, "--eval/--no-eval", help="measure original vs converted for the card (default: models up to 3B)")
EvalTokensOpt = typer.Option(None, "--eval-tokens", min=1, help="tokens per corpus for that measurement "
                              f"(default {EVAL_TOKENS})")
ShardOpt = typer.Option("2GB", "--max-shard-size")


def _csv(values) -> str:
    """Numbers as a help string writes them: 0,0.25,1 (not 0.0,0.25,1.0)."""
    return ",".join(f"{v:g}" for v in values)


@contextmanager
def progress_bar(enabled: bool = True):
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TimeRemainingColumn(), console=err, transient=True, disable=not enabled)
    with progress:
        yield progress


def _print_json(data) -> None:
    """JSON on stdout, valid: a number that is not finite (a float16 overflow's NaN perplexity, a broken model's
    infinite one) is written as null, with a warning; json.dumps wrote bare NaN and Infinity."""
    found: list[str] = []

    def finite(value, where: str):
        if isinstance(value, float) and not math.isfinite(value):
            found.append(f"{where}: {value}")
            return None
        if isinstance(value, dict):
            return {k: finite(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return value

    text = json.dumps(finite(data, ""), indent=2, default=str, allow_nan=False)
    if found:
        err.print(f"[yellow]warning[/]: {len(found)} measurement(s) not a finite number, written as null: "
                  + escape(", ".join(found[:4]) + (" ..." if len(found) > 4 else "")), highlight=False)
    print(text)


def _write_plot(plot: Path | None, write, as_json: bool) -> None:
    """The plot, written after the results are printed (a plot that fails to write loses none of them)."""
    if plot is None:
        return
    write(plot)
    if not as_json:
        out.print(f"[green]wrote[/] {escape(str(plot))}")


def _kv_table(rows, title=None) -> Table:
    table = Table(show_header=False, title=title, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for k, v in rows:
        table.add_row(escape(str(k)), escape(str(v)))
    return table


@app.command()
def inspect(
    model: str = ModelArg,
    context: Optional[int] = typer.Option(None, "--context", min=1,
                                          help="also show KV-cache bytes at this many tokens"),
    as_json: bool = JsonOpt,
    trust_remote_code: bool = TrustOpt,
    allow_pickle: bool = PickleOpt,
):
    """Family, sizes, heads, RoPE, KV-cache cost and the conversions that apply."""
    from .info import inspect_model

    info = inspect_model(model, context=context, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
    if as_json:
        return _print_json(info)
    rows = [(k, v) for k, v in info.items() if k not in ("conversions", "rope", "path")]
    rows.insert(1, ("path", info["path"]))
    rows.append(("rope", ", ".join(f"{k}={v}" for k, v in info["rope"].items())))
    shown = [(k, f"{v:,}" if isinstance(v, (int, float)) and not isinstance(v, bool) else ("—" if v is None else v))
             for k, v in rows]
    out.print(_kv_table(shown, title=f"effattn inspect · {escape(str(info['model']))}"))
    out.print(_kv_table(list(info["conversions"].items()), title="conversions"))


def _conversion_flags(func, conversions: list[str]):
    """Give `func` (which takes **options) one flag per option of these conversions, built from their
    options models: the flags, their types, defaults and help all come from there."""
    import inspect as _inspect

    from .convert import CONVERSIONS
    from .convert.options import cli_type, flag

    users: dict[str, list] = {}
    for name in conversions:
        for key, field in CONVERSIONS[name].Options.model_fields.items():
            users.setdefault(key, []).append((name, field))
    flags = []
    for key, uses in users.items():
        field = uses[0][1]
        kind = cli_type(field.annotation)
        decls = [f"{flag(key)}/--no-{flag(key)[2:]}"] if kind is bool else [flag(key)]
        defaults = sorted({repr(f.default) for _, f in uses if f.default is not None})
        where = ", ".join(n for n, _ in uses) if len(conversions) > 1 else ""
        tail = "; ".join(x for x in (where, f"default {', '.join(defaults)}" if defaults else "") if x)
        meanings = {f.description for _, f in uses}
        text = field.description if len(meanings) == 1 else \
            "means something of its own in each conversion: `effattn convert --to NAME --help`"
        help_ = escape(text + (f" ({tail})" if tail else ""))  # square brackets would be read as rich markup
        flags.append(_inspect.Parameter(key, _inspect.Parameter.KEYWORD_ONLY, annotation=Optional[kind],
                                        default=typer.Option(None, *decls, help=help_, show_default=False)))
    sig = _inspect.signature(func, eval_str=True)
    fixed = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    if "to" in sig.parameters:  # every conversion registered now, and the aliases
        from .convert import ALIASES

        names = list(CONVERSIONS) + [f"{a} (= {t}" + "".join(f" {flag(k)} {v}" for k, v in preset.items()) + ")"
                                     for a, (t, preset) in ALIASES.items()]
        to = typer.Option(..., "--to", help=escape("conversion: " + ", ".join(names) + "; `effattn convert --to NAME "
                                                   "--help` lists NAME's options"))
        fixed = [p.replace(default=to) if p.name == "to" else p for p in fixed]

    def command(**kwargs):
        return func(**kwargs)

    command.__name__, command.__doc__ = func.__name__, func.__doc__
    command.__signature__ = sig.replace(parameters=fixed + flags)
    return command


def convert(
    model: str = ModelArg,
    to: str = typer.Option(..., "--to", help="conversion: gqa, mqa (= gqa --kv-heads 1), mha, rerope, vq (= vq-init); "
                                             "`effattn convert --to NAME --help` lists NAME's options"),
    output: Optional[Path] = OutputOpt,
    dtype: str = DtypeOpt,
    force: bool = ForceOpt,
    dry_run: bool = DryRunOpt,
    measure: Optional[bool] = MeasureOpt,
    eval_tokens: Optional[int] = EvalTokensOpt,
    max_shard_size: str = ShardOpt,
    as_json: bool = JsonOpt,
    trust_remote_code: bool = TrustOpt,
    allow_pickle: bool = PickleOpt,
    memory_check: bool = MemoryCheckOpt,
    **options,
):
    """Convert MODEL's attention and write a native transformers checkpoint to -o OUT."""
    _run_conversion(model, output, to, options, dtype=dtype, force=force, dry_run=dry_run, max_shard_size=max_shard_size,
                    measure=measure, eval_tokens=eval_tokens, as_json=as_json, trust_remote_code=trust_remote_code,
                    allow_pickle=allow_pickle, memory_check=memory_check)


def vq_init(
    model: str = ModelArg,
    output: Optional[Path] = OutputOpt,
    dtype: str = DtypeOpt,
    force: bool = ForceOpt,
    dry_run: bool = DryRunOpt,
    measure: Optional[bool] = MeasureOpt,
    eval_tokens: Optional[int] = EvalTokensOpt,
    max_shard_size: str = ShardOpt,
    as_json: bool = JsonOpt,
    trust_remote_code: bool = TrustOpt,
    allow_pickle: bool = PickleOpt,
    memory_check: bool = MemoryCheckOpt,
    **options,
):
    """Transformer-VQ from a pretrained model: ReRoPE window + k-means codebooks (= convert --to vq)."""
    _run_conversion(model, output, "vq", options, dtype=dtype, force=force, dry_run=dry_run,
                    max_shard_size=max_shard_size, measure=measure, eval_tokens=eval_tokens, as_json=as_json,
                    trust_remote_code=trust_remote_code, allow_pickle=allow_pickle, memory_check=memory_check)


def _register_conversion_commands() -> None:
    """(Re)build `convert` and `vq-init` from the conversions registered now (a plugin or a test may
    have added one since import), keeping their place in `effattn --help`."""
    from typer.models import CommandInfo

    from .convert import CONVERSIONS

    for name, func, convs in (("convert", convert, list(CONVERSIONS)), ("vq-init", vq_init, ["vq"])):
        info = CommandInfo(name=name, callback=_conversion_flags(func, convs))
        places = [i for i, c in enumerate(app.registered_commands) if c.name == name]
        if places:
            app.registered_commands[places[0]] = info
        else:
            app.registered_commands.insert(1 if name == "convert" else 2, info)


app.command("convert")(convert)  # placeholders, in their place in `effattn --help`; main() builds their flags
app.command("vq-init")(vq_init)


def conversion_help(to: str) -> None:
    """`effattn convert --to NAME --help`: NAME's own options, with their defaults."""
    from .convert import ALIASES, get_conversion
    from .convert.options import describe, flag

    name, preset = ALIASES.get(to, (to, {}))
    conversion = get_conversion(name)
    title = f"effattn convert --to {to}" + (f" (= --to {name} " + " ".join(f"{flag(k)} {v}" for k, v in preset.items()) + ")"
                                           if preset else "")
    out.print(f"[bold]{title}[/]: {conversion.description}", highlight=False)
    table = Table(title_justify="left")
    for col in ("option", "type", "default", "help"):
        table.add_column(col)
    for row in describe(conversion.Options):
        if row["name"] in preset:
            continue
        table.add_row(*map(escape, (row["flag"], row["type"], "—" if row["default"] is None else str(row["default"]), row["help"])))
    out.print(table)
    out.print("In a recipe: student.convert: {to: " + to + ", <option>: <value>} with the names above in snake_case.",
              highlight=False)


def _run_conversion(model, output, to, options, *, dtype, force, dry_run, max_shard_size, measure, eval_tokens,
                    as_json, trust_remote_code, allow_pickle, memory_check=True) -> None:
    from .convert import convert as run_convert

    options = {k: v for k, v in options.items() if v is not None}
    if measure is False and eval_tokens is not None:
        raise EffattnError("--eval-tokens sizes the measurement that --no-eval turns off", "drop one of the two")
    eval_tokens = EVAL_TOKENS if eval_tokens is None else eval_tokens
    command = "effattn " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    with progress_bar(not as_json) as progress:
        result = run_convert(model, output, to=to, options=options, dtype=dtype, force=force, dry_run=dry_run,
                             max_shard_size=max_shard_size, measure=measure, eval_tokens=eval_tokens,
                             trust_remote_code=trust_remote_code, allow_pickle=allow_pickle, progress=progress,
                             command=command, memory_check=memory_check)
    plan = result.plan
    if as_json:
        return _print_json({"dry_run": dry_run, "output": result.out, "summary": dict(plan.summary),
                            "settings": plan.settings, "output_bytes": plan.output_bytes,
                            "kv_bytes_per_token": plan.kv_bytes_per_token, "est_seconds": plan.est_seconds,
                            "est_peak_bytes": plan.est_peak_bytes, "record": result.record})
    rows = list(plan.summary) + [("output size", f"{plan.output_bytes / 2**20:,.0f} MiB")]
    if dry_run:
        from .resources import process_age

        rows += [("estimated time", f"~{plan.est_seconds:,.0f} s (+ ~{process_age():,.0f} s to start, as this dry run did)"),
                 ("estimated peak memory", f"~{plan.est_peak_bytes / 2**20:,.0f} MiB (the process's resident set)"),
                 ("written", "nothing (dry run)")]
        out.print(_kv_table(rows, title="effattn convert --dry-run"))
        return
    rows.append(("time", f"{result.seconds:.1f} s"))
    out.print(_kv_table(rows, title=f"effattn convert · {escape(str(result.out))}"))
    if result.measurements:
        from .io.card import measurement_rows

        table = Table(title="measured (quick; `effattn eval` for the full comparison)", title_justify="left")
        for col in ("metric", "original", "converted"):
            table.add_column(col, justify="left" if col == "metric" else "right")
        for r in measurement_rows(result.measurements):
            table.add_row(*map(escape, r))
        out.print(table)
    elif result.record and result.record.get("measurement_skipped"):
        out.print(f"[yellow]measurement skipped[/]: {escape(result.record['measurement_skipped'])}", highlight=False)
    out.print(f"[green]wrote[/] {escape(str(result.out))}")


@app.command("eval")
def eval_(
    model: str = ModelArg,
    baseline: Optional[str] = typer.Option(None, "--baseline", help="compare with this model (e.g. the original)"),
    corpus: list[str] = typer.Option(None, "--corpus", help="built-in corpus or text file; repeat or comma-separate (default: shakespeare,britannica)"),
    context: int = typer.Option(EvalSettings.context, "--context", help="tokens per evaluation block"),
    max_tokens: int = typer.Option(EvalSettings.max_tokens, "--max-tokens", help="tokens per corpus"),
    bos: bool = typer.Option(False, "--bos/--no-bos", help="read every block after the tokenizer's BOS token (EOS "
                                                           "where it has none), as lm-evaluation-harness does; the "
                                                           "same next tokens are scored. Default: blocks start "
                                                           "mid-text with nothing in front"),
    batch_size: int = typer.Option(EvalSettings.batch_size, "--batch-size"),
    speed: bool = typer.Option(EvalSettings.speed, "--speed/--no-speed", help="time prefill and decode"),
    speed_context: Optional[int] = typer.Option(None, "--speed-context", help="also time prefill and decode after "
                                                "this many tokens (e.g. 16384), for both models; with --baseline, "
                                                "the context beyond which MODEL decodes faster (break-even)"),
    dtype: str = typer.Option("float32", "--dtype"),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="tokenize with this folder's or model's tokenizer "
                                                                      "(for a MODEL folder that has none)"),
    as_json: bool = JsonOpt,
    trust_remote_code: bool = TrustOpt,
    allow_pickle: bool = PickleOpt,
    memory_check: bool = MemoryCheckOpt,
    task: str = typer.Option("perplexity", "--task", help="perplexity (with agreement, KL, KV bytes, speed), or a "
                                                          "long-context retrieval grid: passkey, needle"),
    lengths: Optional[str] = typer.Option(None, "--lengths", help="passkey/needle: prompt lengths in tokens "
                                                                  f"(default {_csv(RetrievalSettings.lengths)})"),
    depths: Optional[str] = typer.Option(None, "--depths", help="passkey/needle: where the fact sits (0 = start, "
                                                                "1 = just before the question; default "
                                                                f"{_csv(RetrievalSettings.depths)})"),
    samples: Optional[int] = typer.Option(None, "--samples", help="passkey/needle: prompts per length and depth "
                                                                   f"(default {RetrievalSettings.samples})"),
    seed: Optional[int] = typer.Option(None, "--seed", help="passkey/needle: seed of keys and filler positions "
                                                            f"(default {RetrievalSettings.seed})"),
    filler: Optional[str] = typer.Option(None, "--filler", help="passkey/needle: what the fact hides in: repeat (the "
                                                                "passkey papers' repeated sentences; passkey's "
                                                                "default), a corpus or text file (needle: "
                                                                f"{DEFAULT_FILLER['needle']})"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="passkey/needle: save the accuracy heatmap here (PNG)"),
    attn_implementation: Optional[str] = typer.Option(None, "--attn-implementation",
                                                      help="MODEL's attention kernel in transformers: sdpa (default), "
                                                           "flex_attention (block-sparse: a sliding window skips the "
                                                           "blocks outside it), eager; native models only. An MLA "
                                                           "model runs effattn's absorbed latent attention unless "
                                                           "one is named (sdpa: transformers' path)"),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or cuda:N: where the models run"),
    dry_run: bool = typer.Option(False, "--dry-run", help="check the models, corpora or prompts and the memory, "
                                                          "show the time and memory estimate; load no weights"),
):
    """Perplexity, agreement and KL against a baseline, measured KV bytes/token, prefill/decode speed;
    or (--task passkey|needle) long-context retrieval accuracy over lengths x depths."""
    from .data.corpora import DEFAULT_EVAL
    from .evaluate import evaluate
    from .report import eval_table

    if bos and task != "perplexity":
        raise EffattnError("--bos applies to perplexity blocks", "drop --bos (passkey and needle prompts are "
                                                                 "built with the tokenizer's own special tokens)")
    if task != "perplexity":
        if corpus:
            raise EffattnError(f"--corpus applies to perplexity; --task {task} reads its prompts' filler from --filler",
                               "drop --corpus, or pass --filler FILE")
        # set away from their defaults, the perplexity options were read by nothing (even --batch-size 0 ran)
        for flag, value, default in (("--context", context, EvalSettings.context),
                                     ("--max-tokens", max_tokens, EvalSettings.max_tokens),
                                     ("--batch-size", batch_size, EvalSettings.batch_size),
                                     ("--no-speed", speed, EvalSettings.speed),
                                     ("--speed-context", speed_context, EvalSettings.speed_context)):
            if value != default:
                raise EffattnError(f"{flag} applies to perplexity, not to --task {task}", f"drop {flag}")
        return _eval_retrieval(model, baseline, task=task, lengths=lengths, depths=depths, samples=samples, seed=seed,
                               filler=filler, plot=plot, dtype=dtype, tokenizer=tokenizer, as_json=as_json,
                               trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
                               memory_check=memory_check,
                               attn_implementation=attn_implementation, device=device, dry_run=dry_run)
    for flag, value in (("--plot", plot), ("--lengths", lengths), ("--depths", depths), ("--samples", samples),
                        ("--seed", seed), ("--filler", filler)):
        if value is not None:
            raise EffattnError(f"{flag} applies to --task passkey and needle", f"add --task passkey, or drop {flag}")
    # comma-separated names; a file whose own name holds a comma is one corpus (as --calib reads it)
    corpora = tuple(dict.fromkeys(c.strip() for item in (corpus or DEFAULT_EVAL)
                                  for c in ([item] if Path(item).expanduser().is_file() else item.split(","))
                                  if c.strip()))
    if not corpora:
        raise EffattnError(f"--corpus {','.join(corpus or [])!r} names no corpus",
                           "name a built-in corpus or a text file, e.g. --corpus shakespeare")
    if batch_size < 1:
        raise EffattnError(f"--batch-size must be at least 1, got {batch_size}", "use e.g. --batch-size 2")
    if context < 2:
        raise EffattnError(f"--context must be at least 2 tokens, got {context}", "use e.g. --context 512")
    if max_tokens < context:
        raise EffattnError(f"--max-tokens {max_tokens} is less than one block of --context {context}",
                           f"use --max-tokens {context} or more"
                           + (f", or --context {max_tokens} or less" if max_tokens >= 2 else ""))
    if speed_context is not None and not speed:
        raise EffattnError("--speed-context times prefill and decode, which --no-speed turns off",
                           "drop --no-speed, or drop --speed-context")
    if speed_context is not None and speed_context < 2:
        raise EffattnError(f"--speed-context must be at least 2 tokens, got {speed_context}",
                           "use e.g. --speed-context 16384")
    settings = EvalSettings(corpora=corpora, context=context, max_tokens=max_tokens, batch_size=batch_size, speed=speed,
                            speed_context=speed_context, bos=bos)
    if dry_run:
        return _print_eval_plan(evaluate(model, baseline, settings, dtype=dtype, trust_remote_code=trust_remote_code,
                                         allow_pickle=allow_pickle,
                                         tokenizer=tokenizer, memory_check=memory_check, device=device,
                                         attn_implementation=attn_implementation, dry_run=True), as_json)
    with err.status("evaluating ...", spinner="dots") if not as_json else _null():
        report = evaluate(model, baseline, settings, dtype=dtype, trust_remote_code=trust_remote_code,
                          allow_pickle=allow_pickle,
                          tokenizer=tokenizer, memory_check=memory_check, attn_implementation=attn_implementation,
                          device=device,
                          warn=lambda note: err.print(f"[yellow]warning[/]: {escape(note)}", highlight=False),
                          say=lambda line: err.print(escape(line), highlight=False))
    if as_json:
        return _print_json(report.to_dict() | {"device": device})
    out.print(eval_table(report))


def _print_eval_plan(plan, as_json: bool) -> None:
    """`effattn eval --dry-run`'s output: what the run would measure, its estimates, its warnings."""
    if as_json:
        return _print_json({"dry_run": True, **plan.to_dict()})
    from .resources import process_age

    rows = [("task", plan.task), ("model", plan.model)] + ([("baseline", plan.baseline)] if plan.baseline else [])
    rows += [("dtype", plan.dtype), ("device", plan.device)]
    if "tokens" in plan.work:
        rows += [(f"tokens read · {corpus}", f"{n:,}") for corpus, n in plan.work["tokens"].items()]
    else:
        lengths = ", ".join(f"{n:,}" for n in plan.work["lengths"])
        rows.append(("prompts", f"{plan.work['prompts']:,} (lengths {lengths})"))
    rows.append(("estimated time", "no estimate on a GPU" if plan.est_seconds is None else
                 f"~{plan.est_seconds:,.0f} s (+ ~{process_age():,.0f} s to start, as this dry run did)"))
    rows.append(("estimated peak memory", f"~{plan.est_peak_bytes / 2**20:,.0f} MiB"
                 + (" of the GPU" if plan.device.startswith("cuda") else " (the process's resident set)")))
    rows += [("warning", note) for note in plan.notes]
    rows.append(("measured", "nothing (dry run)"))
    out.print(_kv_table(rows, title="effattn eval --dry-run"))


def _number_list(text: str, option: str, kind=int) -> tuple:
    example = f"e.g. {option} 2048,4096" if kind is int else f"e.g. {option} 0,0.5,1"
    try:
        values = tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise EffattnError(f"{option} {text!r} is not a comma-separated list of numbers", example) from None
    if any(v != v or v in (float("inf"), float("-inf")) for v in values):
        raise EffattnError(f"{option} {text!r} holds a value that is not a finite number", example)
    return tuple(dict.fromkeys(values))  # each once, in the order given


def _eval_retrieval(model, baseline, *, task, lengths, depths, samples, seed, filler, plot, dtype, tokenizer,
                    as_json, trust_remote_code, memory_check, allow_pickle=False, attn_implementation=None,
                    device="cpu",
                    dry_run=False) -> None:
    from .bench import check_plot_path
    from .retrieval import RetrievalSettings, evaluate_retrieval, plot_heatmap

    given = {"lengths": None if lengths is None else _number_list(lengths, "--lengths"),
             "depths": None if depths is None else _number_list(depths, "--depths", float),
             "samples": samples, "seed": seed}
    settings = RetrievalSettings(task=task, filler=filler,  # the options not given keep RetrievalSettings' defaults
                                 **{k: v for k, v in given.items() if v is not None}).validate()
    if plot is not None:
        check_plot_path(plot)
    if dry_run:
        return _print_eval_plan(evaluate_retrieval(model, baseline, settings, dtype=dtype, tokenizer=tokenizer,
                                                   trust_remote_code=trust_remote_code,
                                                   allow_pickle=allow_pickle, memory_check=memory_check,
                                                   attn_implementation=attn_implementation, device=device,
                                                   dry_run=True), as_json)
    with progress_bar(not as_json) as progress:
        tasks: dict[str, object] = {}

        def advance(name: str, done: int, total: int) -> None:
            if name not in tasks:
                tasks[name] = progress.add_task(f"{task} · {name}", total=total)
            progress.update(tasks[name], completed=done)

        report = evaluate_retrieval(model, baseline, settings, dtype=dtype, trust_remote_code=trust_remote_code,
                                    allow_pickle=allow_pickle,
                                    tokenizer=tokenizer, memory_check=memory_check, progress=advance,
                                    attn_implementation=attn_implementation, device=device,
                                    warn=lambda note: err.print(f"[yellow]warning[/]: {escape(note)}", highlight=False),
                                    say=lambda line: err.print(escape(line), highlight=False))
    if as_json:
        _print_json(report.to_dict() | {"device": device})
    else:
        _print_retrieval(report, settings, task)
    _write_plot(plot, lambda path: plot_heatmap(report, path), as_json)


def _print_retrieval(report, settings, task: str) -> None:
    """The retrieval grid as a table: accuracy by depth (rows) and length (columns), and its mean."""
    table = Table(title=f"effattn eval --task {task} · exact-match accuracy by depth (rows) and length (columns)"
                        + (f" · {escape(report.model)} (baseline {escape(report.baseline)})" if report.baseline else ""),
                  title_justify="left")
    table.add_column("depth")
    for n in settings.lengths:
        table.add_column(f"{n:,}", justify="right")
    for d in settings.depths:
        cells = []
        for n in settings.lengths:
            cell = f"{report.accuracy[n][d]:.0%}"
            if report.baseline_accuracy is not None:
                cell += f" ({report.baseline_accuracy[n][d]:.0%})"
            cells.append(cell)
        table.add_row(f"{d:g}", *cells)
    out.print(table)
    mean = f"mean {report.mean:.0%}" + (f" (baseline {report.baseline_mean:.0%})" if report.baseline_mean is not None else "")
    out.print(f"{mean} over {len(report.samples)} prompts, {settings.samples} per cell, seed {settings.seed}", highlight=False)


@app.command()
def sample(
    model: str = ModelArg,
    output: Path = typer.Option(..., "-o", "--output", help="the text file to write (UTF-8; sequences joined by blank "
                                                            "lines)"),
    tokens: int = typer.Option(SampleSettings.tokens, "--tokens", help="tokens in all, each sequence's start token "
                                                                      "included, rounded up to whole sequences"),
    seq_len: int = typer.Option(SampleSettings.seq_len, "--seq-len", help="tokens per sequence, the start token "
                                                                         "included"),
    batch_size: int = typer.Option(SampleSettings.batch_size, "--batch-size", help="sequences sampled side by side"),
    seed: int = typer.Option(SampleSettings.seed, "--seed", help="the same model, settings and seed give the same "
                                                                "text"),
    temperature: float = typer.Option(SampleSettings.temperature, "--temperature",
                                      help="1.0 samples the model's own distribution"),
    dtype: str = typer.Option("float32", "--dtype"),
    force: bool = typer.Option(False, "--force", help="replace an existing output file"),
    as_json: bool = JsonOpt,
    trust_remote_code: bool = TrustOpt,
    allow_pickle: bool = PickleOpt,
    memory_check: bool = MemoryCheckOpt,
    dry_run: bool = typer.Option(False, "--dry-run", help="check the model, its tokenizer, the output file and the "
                                                          "memory, show the estimate; load no weights"),
):
    """Text sampled from MODEL itself, for calibration where the text it will read is not at hand:
    `effattn convert MODEL ... --calib calib,FILE` (data-free calibration, as LLM-QAT's)."""
    from .data.sample import sample as run_sample
    from .resources import gib, process_age

    settings = SampleSettings(tokens=tokens, seq_len=seq_len, batch_size=batch_size, seed=seed, temperature=temperature)
    if dry_run:
        plan = run_sample(model, output, settings, dtype=dtype, trust_remote_code=trust_remote_code,
                          allow_pickle=allow_pickle, memory_check=memory_check, force=force, dry_run=True)
        if as_json:
            return _print_json({"dry_run": True, **plan.to_dict()})
        rows = [("model", plan.model), ("output", plan.output), ("dtype", plan.dtype),
                ("sequences", f"{plan.sequences:,} of {plan.seq_len:,} tokens ({plan.tokens:,} in all)"),
                ("estimated time", f"~{plan.est_seconds:,.0f} s (+ ~{process_age():,.0f} s to start, as this dry run "
                                   "did)"),
                ("estimated peak memory", f"~{gib(plan.est_peak_bytes)} (the process's resident set)")]
        rows += [("warning", note) for note in plan.notes] + [("written", "nothing (dry run)")]
        return out.print(_kv_table(rows, title="effattn sample --dry-run"))
    with progress_bar(not as_json) as progress:
        task = progress.add_task("sampling", total=settings.validate().sequences)
        report = run_sample(model, output, settings, dtype=dtype, trust_remote_code=trust_remote_code,
                            allow_pickle=allow_pickle, memory_check=memory_check, force=force,
                            progress=lambda done: progress.advance(task, done))
    for note in report.notes:
        err.print(f"[yellow]warning[/]: {escape(note)}", highlight=False)
    if as_json:
        return _print_json(report.to_dict())
    out.print(f"[green]wrote[/] {escape(report.output)}: {report.sequences:,} sequences, {report.sampled_tokens:,} "
              f"sampled tokens, {report.characters:,} characters in {report.seconds:,.1f} s", highlight=False)


@app.command()
def bench(
    attention: str = typer.Option("sdpa,vq", "--attention", help="comma list of registered kinds; `--attention list` "
                                                                 "shows them (sdpa, vq, vq_means, vq_naive, ...)"),
    lengths: str = typer.Option("1024,4096,16384,32768", "--lengths", help="comma list of sequence lengths"),
    heads: int = typer.Option(9, "--heads", help="query heads (SmolLM2's by default)"),
    kv_heads: int = typer.Option(3, "--kv-heads", help="key/value heads, dividing --heads"),
    head_dim: int = typer.Option(64, "--head-dim"),
    window: int = typer.Option(256, "--window", help="VQ, swa, linear: exact keys per query"),
    codebook_size: int = typer.Option(512, "--codebook-size", help="VQ: codewords per key/value head"),
    block_size: int = typer.Option(64, "--block-size", help="VQ: block length of the stop-gradient rule"),
    sinks: int = typer.Option(0, "--sinks", help="VQ: first positions never quantized; swa: sink tokens; "
                                                     "linear: first positions under exact softmax"),
    heavy_keys: int = typer.Option(192, "--heavy-keys", help="vq_heavy: exact far keys per KV head"),
    pattern: str = typer.Option("strided", "--pattern", help="sparse kinds: longformer, bigbird or strided (their "
                                                             "`convert --to sparse` defaults)"),
    feature_map: str = typer.Option("hedgehog", "--feature-map", help="linear kinds: hedgehog, elu, performer or "
                                                                      "taylor (their `convert --to linear` defaults)"),
    dtype: str = typer.Option("float32", "--dtype"),
    repeats: int = typer.Option(3, "--repeats", help="timed passes per point (median reported)"),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch threads (default: torch's, all cores)"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
    omp_wait_policy: Optional[str] = typer.Option(None, "--omp-wait-policy",
                                                  help="active or passive: OMP_WAIT_POLICY of the measurements "
                                                       "(passive on machines shared with other jobs)"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="also save time and memory curves of each kind here (PNG)"),
    as_json: bool = JsonOpt,
    memory_check: bool = MemoryCheckOpt,
    dry_run: bool = typer.Option(False, "--dry-run", help="check the settings, the plot path and each point's "
                                                          "memory; list the points with their estimated peak; "
                                                          "measure nothing"),
):
    """Time and peak memory of one causal attention layer forward at each length: SDPA vs Transformer-VQ,
    sparse patterns and sliding windows (FlexAttention), linear attention.

    Every point runs in a fresh process. Results: BENCHMARKS.md, written by benchmarks/bench_vq_attention.py.
    """
    from .bench import (BENCH_KINDS, TABLE_COLUMNS, check_plot_path, describe, parse_kinds, parse_lengths, plot_bench,
                        run_report, table_rows)

    if attention.strip() == "list":
        if as_json:
            return _print_json({k.name: {"description": k.description, "max_length": k.max_length}
                                for k in BENCH_KINDS.values()})
        return out.print(_kv_table([(k.name, k.description + (f" (lengths <= {k.max_length:,})" if k.max_length else ""))
                                    for k in BENCH_KINDS.values()], title="effattn bench · attention kinds"))
    kinds, sizes = parse_kinds(attention), parse_lengths(lengths)
    settings = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, window=window, codebook_size=codebook_size,
                    block_size=block_size, sinks=sinks, heavy_keys=heavy_keys, pattern=pattern, feature_map=feature_map, dtype=dtype,
                    repeats=repeats, threads=threads,
                    device=device, omp_wait_policy=omp_wait_policy, memory_check=memory_check)
    if plot is not None:
        check_plot_path(plot)  # before minutes of measurements
    if dry_run:
        from .bench import bench_attention

        points = bench_attention(kinds, sizes, dry_run=True, **settings)
        if as_json:
            return _print_json({"dry_run": True, "points": points})
        rows = [(f"{p['kind']} at {p['length']:,}", f"~{p['est_peak_bytes'] / 2**20:,.0f} MiB peak (its own process)")
                for p in points]
        out.print(_kv_table(rows + [("measured", "nothing (dry run)")], title="effattn bench --dry-run"))
        return
    with err.status("benchmarking ...", spinner="dots") if not as_json else _null() as status:
        progress = None if status is None else (lambda text: status.update(f"benchmarking {text} ..."))
        report = run_report(kinds, sizes, progress=progress, **settings)
    if as_json:
        _print_json(report)
    else:
        table = Table(title="effattn bench · one attention layer forward, causal, batch 1", title_justify="left")
        for col in TABLE_COLUMNS:
            table.add_column(col, justify="left" if col == "kind" else "right", min_width=max(map(len, col.split())))
        for row in table_rows(report["results"]):
            table.add_row(*row)
        out.print(table)
        out.print(describe(report), highlight=False)
    _write_plot(plot, lambda path: plot_bench(report["results"], path), as_json)


recipes_app = typer.Typer(no_args_is_help=True, help="Built-in fine-tuning recipes: list, copy, validate.")
app.add_typer(recipes_app, name="recipes")
RecipeArg = typer.Argument(..., help="recipe YAML file or built-in recipe name (`effattn recipes ls`)")
OverridesArg = typer.Argument(None, help="KEY=VALUE overrides with dotted keys, e.g. train.max_steps=50")


@recipes_app.command("ls")
def recipes_ls(as_json: bool = JsonOpt):
    """List the built-in recipes."""
    from .finetune.config import read_yaml
    from .finetune.recipes import builtin_recipes

    rows = [{"name": name, "description": read_yaml(path).get("description", ""), "path": str(path)}
            for name, path in builtin_recipes().items()]
    if as_json:
        return _print_json(rows)
    table = Table(title="built-in recipes (`effattn recipes cp NAME FILE` to edit one)", title_justify="left")
    table.add_column("name", style="bold")
    table.add_column("description")
    for row in rows:
        table.add_row(escape(row["name"]), escape(row["description"]))
    out.print(table)


@recipes_app.command("cp")
def recipes_cp(
    name: str = typer.Argument(..., help="built-in recipe name"),
    file: str = typer.Argument(..., help="destination file, or folder (an existing one, or one ending in /)"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing file"),
):
    """Copy built-in recipe NAME to FILE, to edit it."""
    from .finetune.recipes import copy_recipe

    out.print(f"[green]wrote[/] {escape(str(copy_recipe(name, file, force=force)))}")


@recipes_app.command("validate")
def recipes_validate(recipe: str = RecipeArg, overrides: Optional[list[str]] = OverridesArg, as_json: bool = JsonOpt):
    """Check a recipe (with overrides) against the schema and print it with every default filled in."""
    from .finetune.config import load_recipe

    resolved = load_recipe(recipe, overrides)
    if as_json:
        return _print_json(resolved.to_dict())
    out.print(resolved.to_yaml(), highlight=False, markup=False)
    out.print(f"[green]valid:[/] {escape(str(recipe))}")


@app.command()
def finetune(
    recipe: str = RecipeArg,
    overrides: Optional[list[str]] = OverridesArg,
    output: Optional[str] = typer.Option(None, "-o", "--output",
                                         help="output folder (overrides `output:` in the recipe)"),
    resume: bool = typer.Option(False, "--resume", help="continue from OUT's last checkpoint, even with a changed recipe"),
    force: bool = typer.Option(False, "--force", help="start over, replacing OUT"),
    dry_run: bool = typer.Option(False, "--dry-run", help="show the resolved run, sizes and estimates; train nothing"),
    processes: Optional[int] = typer.Option(None, "--processes", min=1,
                                            help="--dry-run: plan for this many processes (default: this launch's)"),
    device_memory: Optional[str] = typer.Option(None, "--device-memory",
                                                help="--dry-run: check the plan against devices of this much memory "
                                                     "each (e.g. 80GB) instead of this machine's"),
    as_json: bool = JsonOpt,
    memory_check: bool = MemoryCheckOpt,
):
    """Heal (fine-tune) a converted model with a recipe; resumes from OUT's checkpoints by itself.

    Several processes: `torchrun --nproc_per_node N -m effattn.cli finetune RECIPE ...` (CPUs or GPUs), or
    `accelerate launch --multi_gpu --num_processes N -m effattn.cli finetune RECIPE ...` on GPUs.
    """
    from .finetune import finetune as run_finetune
    from .finetune import load_recipe, plan_finetune

    from .io.writer import parse_size

    for flag, value in (("--processes", processes), ("--device-memory", device_memory)):
        if value is not None and not dry_run:
            raise EffattnError(f"{flag} plans a run and needs --dry-run",
                               "add --dry-run, or launch the processes with torchrun --nproc_per_node N")
    budget = parse_size(device_memory) if device_memory is not None else None
    resolved = load_recipe(recipe, overrides, output=output)
    if dry_run:
        from .finetune.preflight import check_run, in_finetune_terms

        with in_finetune_terms():
            start = check_run(resolved, resume=resume, force=force, dry_run=True)  # the run's checks, before OUT
            plan = plan_finetune(resolved, processes, memory_check=memory_check, device_memory=budget)
        plan["start"] = _start_phrase(start)
        if as_json:
            return _print_json(plan)
        out.print(resolved.to_yaml(), highlight=False, markup=False)
        out.print(_kv_table(_plan_rows(plan), title="effattn finetune --dry-run"))
        return
    command = "effattn " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    with _training_progress(enabled=not as_json) as progress:
        result = run_finetune(resolved, resume=resume, force=force, progress=progress, command=command,
                              memory_check=memory_check,
                              log=lambda line: err.print(line, highlight=False))
    if result.out is None:  # not the main process
        return
    teacher = result.record["finetune"]["teacher_eval"]
    if as_json:
        return _print_json({"output": result.out, "steps": result.steps, "tokens": result.tokens,
                            "seconds": result.seconds, "final_loss": result.final_loss, "resumed_from": result.resumed_from,
                            "start_eval": result.start_eval, "final_eval": result.final_eval, "teacher_eval": teacher,
                            "written": result.written})
    table = Table(title=f"effattn finetune · {escape(str(result.out))}", title_justify="left")
    for col in ("held-out", "teacher", "before", "after"):
        table.add_column(col, justify="left" if col == "held-out" else "right")
    for corpus, after in result.final_eval.items():
        before = result.start_eval[corpus]
        table.add_row(f"perplexity · {corpus}", f"{teacher[corpus]:,.2f}" if corpus in teacher else "—",
                      f"{before['perplexity']:,.2f}", f"{after['perplexity']:,.2f}")
        if "agreement" in after:
            table.add_row(f"agreement · {corpus}", "100%", f"{before['agreement']:.1%}", f"{after['agreement']:.1%}")
    out.print(table)
    out.print(f"{result.steps} steps, {result.tokens:,} tokens, {result.seconds / 60:.1f} min of training; "
              f"final loss {result.final_loss:.4f}")
    out.print(f"[green]wrote[/] {escape(str(result.out))}" if result.written else
              f"already there, unchanged: {escape(str(result.out))}")


def _training_progress(enabled: bool) -> Progress:
    """step, loss, tokens/s, elapsed and ETA (the fine-tune fills in the `loss` and `tok_s` fields)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tok_s]:,.0f} tok/s"),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=err, disable=not enabled)


def _start_phrase(start) -> str:
    """Where a run would start, in words (finetune --dry-run)."""
    return "; ".join(start.notes) or "from the beginning, in a new folder"


def _plan_rows(plan) -> list[tuple[str, str]]:
    student, teacher, mem, est = plan["student"], plan["teacher"], plan["memory_bytes_per_process"], plan["est_seconds"]
    rows = [("output", f"{plan['recipe']['output'] or '-'} ({plan['start']})")] if plan.get("start") else []
    rows += [("student", student["model"])]
    rows += [(f"  {k}", v) for k, v in (student["conversion"] or {}).items()]
    rows += [
        ("trains", f"{student['trains']}: {student['trainable']:,} of {student['params']:,} parameters "
                   f"({student['trainable'] / student['params']:.1%})"),
        ("teacher", f"{teacher['model']} ({teacher['params']:,} parameters)" if teacher["model"] else "none"),
        ("processes", f"{plan['processes']}: {plan['distributed']}"),
        ("steps", f"{plan['steps']:,}"),
        ("tokens per step", f"{plan['tokens_per_step']:,}"),
        ("tokens", f"{plan['tokens']:,}"),
        ("estimated memory / process", f"~{mem['total'] / 2**30:,.1f} GiB ("
         + ", ".join(f"{k.replace('_', ' ')} {v / 2**30:,.2f}" for k, v in mem.items() if k != "total") + ")"),
        ("estimated time", f"~{est['training'] / 60:,.1f} min training + ~{est['evaluation'] / 60:,.1f} min evaluation "
                           f"({plan['est_basis']})"),
        ("written", "nothing (dry run)"),
    ]
    return rows


@contextmanager
def _null():
    yield


def _quiet_libraries() -> None:
    """transformers' own progress bars and advice would drown ours; errors still surface."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning, module="transformers")


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, a job scheduler), raised where the run is, as Ctrl-C's KeyboardInterrupt is: the
    same clean-up runs (temporary folders and locks removed), and the exit is 143. `entry` installs it."""


def _terminate(signum, frame) -> None:
    _TERMINATED[0] = True
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM while cleaning up ends the process
    raise Terminated()


def _writing_stdout(exc: BaseException) -> bool:
    """Whether `exc` came from printing the results to stdout (a full disk it is redirected to)."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return any(f.name == "_print_json" or f.filename.replace("\\", "/").endswith("rich/console.py") for f in frames)


_TERMINATED = [False]  # set by `_terminate`: typer may turn the exception into an Abort or an exit code of 130


def _stopped() -> None:
    """Ctrl-C (exit 130) or SIGTERM (143, `_TERMINATED`): one word, no traceback."""
    err.print("terminated" if _TERMINATED[0] else "interrupted")
    sys.exit(143 if _TERMINATED[0] else 130)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: `--debug` anywhere shows tracebacks instead of one-line errors."""
    global DEBUG
    argv = list(sys.argv[1:] if argv is None else argv)
    DEBUG = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    _quiet_libraries()
    try:
        if argv[:1] == ["convert"] and {"--help", "-h"} & set(argv) and "--to" in argv[:-1]:
            return conversion_help(argv[argv.index("--to") + 1])
        _register_conversion_commands()
        code = app(args=argv, prog_name="effattn", standalone_mode=False)
        # outside standalone mode typer returns the code of an Exit it caught, Ctrl-C's (130) included; the
        # commands themselves return None
        if isinstance(code, int) and not isinstance(code, bool) and code != 0:
            if code == 130:
                _stopped()
            sys.exit(code)
    except EffattnError as exc:
        if DEBUG:
            raise
        err.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except (typer.Exit, SystemExit) as exc:
        sys.exit(getattr(exc, "exit_code", getattr(exc, "code", 0)))
    except typer.Abort as exc:
        if isinstance(exc.__context__, KeyboardInterrupt):  # click's Ctrl-C (or SIGTERM)
            _stopped()
        err.print("aborted")
        sys.exit(130)
    except KeyboardInterrupt:
        _stopped()
    except Exception as exc:  # noqa: BLE001
        if isinstance(exc, OSError) and _writing_stdout(exc) and not DEBUG:
            err.print(f"[bold red]error:[/] cannot write the output to stdout: {escape(exc.strerror or str(exc))}. "
                      "free space where stdout is redirected, or redirect it elsewhere", highlight=False, soft_wrap=True)
            sys.exit(2)
        if callable(getattr(exc, "format_message", None)) and hasattr(exc, "exit_code"):  # click's (typer's copy too)
            if DEBUG:
                raise
            err.print(f"[bold red]error:[/] {escape(' '.join(exc.format_message().split()))}", highlight=False, soft_wrap=True)
            sys.exit(2)
        if DEBUG:
            raise
        err.print(f"[bold red]error:[/] unexpected {type(exc).__name__}: {escape(str(exc))} (run again with --debug for the traceback)",
                  highlight=False, soft_wrap=True)
        sys.exit(1)


def entry() -> None:
    """The console script and `python -m effattn.cli` (torchrun's way in): main(), then, in a process that
    ran a process group, an exit that skips the interpreter's finalization (see `exit_without_finalizing`)."""
    signal.signal(signal.SIGTERM, _terminate)
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code
    if isinstance(code, int):
        from .finetune.loop import exit_without_finalizing

        exit_without_finalizing(code)  # returns where no process group ran
    sys.exit(code)


if __name__ == "__main__":
    entry()
