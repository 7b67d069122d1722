"""The README model card written into every output folder."""

from __future__ import annotations

import shlex

from typing import Any


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def count(n: int) -> str:
    """A parameter count as model cards write it: 135M, 1.2B; exact below a million (tiny test models)."""
    if n >= 10**9:
        return f"{n / 1e9:.1f}B"
    return f"{n / 1e6:.0f}M" if n >= 10**6 else f"{n:,}"


def measurement_rows(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(metric, original, converted) rows from an EvalReport dict; a measurement at several block
    lengths (its `longer` reports) labels every row with its length."""
    reports = [m, *m.get("longer", [])]
    rows = []
    for r in reports:
        at = f" @ {r['settings']['context']:,}" if len(reports) > 1 else ""
        base, mine = r.get("baseline") or {}, r["model"]
        for corpus, ppl in mine["perplexity"].items():
            rows.append((f"perplexity · {corpus}{at}", _fmt((base.get("perplexity") or {}).get(corpus)), _fmt(ppl)))
        for corpus, agree in (r.get("agreement") or {}).items():
            rows.append((f"top-1 agreement · {corpus}{at}", "100%", f"{agree:.1%}"))
        for corpus, kl in (r.get("kl") or {}).items():
            rows.append((f"KL(original‖converted) · {corpus}{at}", "0", f"{kl:.3f}"))
        rows.append((f"KV-cache bytes/token (measured{', after ' + format(mine.get('kv_context') or 0, ',') + ' tokens' if at else ''})",
                     _fmt(base.get("kv_bytes_per_token"), ",.0f"), _fmt(mine.get("kv_bytes_per_token"), ",.0f")))
        base_speed = {p["context"]: p for p in base.get("speed") or []}
        for p in mine.get("speed") or []:
            other = base_speed.get(p["context"], {})
            rows.append((f"prefill tokens/s ({p['context']:,} tokens)", _fmt(other.get("prefill_tokens_per_s"), ",.0f"),
                         _fmt(p["prefill_tokens_per_s"], ",.0f")))
            rows.append((f"decode tokens/s (after {p['context']:,} tokens)", _fmt(other.get("decode_tokens_per_s"), ",.1f"),
                         _fmt(p["decode_tokens_per_s"], ",.1f")))
    return rows


def model_card(name: str, record: dict[str, Any], plan) -> str:
    src = record["source"]
    conv = record["conversion"]
    settings = "\n".join(f"| {k} | " + ("in `effattn.json`" if isinstance(v, dict) else f"`{v}`") + " |"
                         for k, v in conv.items())  # tables (e.g. per-head errors) stay in the record
    lines = [
        "---",
        *([f"base_model: {src['hub_id']}"] if src.get("hub_id") else []),  # Hub metadata: a hub id, not a path
        "library_name: transformers",
        f"tags: [effattn, {conv['to']}]",
        "---",
        "",
        f"# {name}",
        "",
        f"Converted by effattn {record['effattn_version']} from `{src['model']}` "
        f"({src['model_type']}, {count(src['num_params'])} parameters) on {record['created'][:10]}.",
        "",
        "## Conversion",
        "",
        *[f"- {what}: {value}" for what, value in plan.summary],
        "",
        "| setting | value |",
        "|---|---|",
        settings,
        "",
    ]
    m = record.get("measurements")
    if m:
        reports = [m, *m.get("longer", [])]
        blocks = " and ".join(f"{r['settings']['max_tokens']:,} tokens per corpus in blocks of {r['settings']['context']:,}"
                              for r in reports)
        lines += [
            "## Measured",
            "",
            f"`effattn eval`, {blocks}; held-out corpora not used for calibration.",
            "",
            "| metric | original | converted |",
            "|---|---|---|",
            *[f"| {a} | {b} | {c} |" for a, b, c in measurement_rows(m)],
            "",
        ]
        if m.get("decode_break_even"):
            from ..report import break_even_line

            line = break_even_line(m["decode_break_even"]).replace("the model", "the converted model", 1)
            line = line.replace("the baseline", "the original", 1)
            lines += [line[0].upper() + line[1:] + "; batch 1, on the machine that converted it.", ""]
        if m.get("decode_linears"):  # set where speed was timed
            lines += [f"Decode speeds: batch 1, both models' linear layers run by {m['decode_linears']}.", ""]
    elif record.get("measurement_skipped"):
        lines += ["## Measured", "", f"Not measured at conversion time: {record['measurement_skipped']}.", ""]
    else:
        from .resolve import display_name

        # the source as the reproduce line names it (a relative path as typed resolves only where the conversion ran)
        baseline = display_name(src["model"], src["kind"], src["path"])
        lines += ["## Measured", "", "Not measured at conversion time; from this folder's parent, run "
                  f"`effattn eval {name} --baseline {shlex.quote(baseline)}`.", ""]
    if record.get("reproduce") or record.get("command"):
        lines += ["## Reproduce", "", f"With effattn {record['effattn_version']}:", "", "```",
                  record.get("reproduce") or record["command"], "```", ""]
    lines += load_section(name, plan.config.get("model_type"))
    return "\n".join(lines)


def load_section(name: str, model_type: str | None) -> list[str]:
    """The card's "Load" lines: plain transformers, plus the registration for effattn's own classes."""
    from ..models import model_spec

    lines = ["## Load", "", "```python"]
    spec = model_spec(model_type)
    custom = spec is not None
    if custom:
        lines.append(f"import effattn  # registers {model_type}; without it, pass trust_remote_code=True to both "
                     "calls below (the code is bundled here)")
    lines += ["from transformers import AutoModelForCausalLM, AutoTokenizer",
              f'model = AutoModelForCausalLM.from_pretrained("{name}")',
              f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
              "```", ""]
    if custom and spec.padding == "batched":  # README, Outputs
        lines += ["A batch may pad its sequences in front (as `generate` pads prompts of different lengths); "
                  "padding between tokens is refused.", ""]
    elif custom:  # each row alone, with its own cache (README, Outputs)
        lines += ["A padded batch (as `generate` pads prompts of different lengths) runs row by row, each row with its "
                  "own cache: each reads as its prompt alone, at the speed of the prompts one at a time.", ""]
    return lines
