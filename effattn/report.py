"""Rich tables for people (the CLI prints these; `--json` prints the dicts instead)."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from .evaluate import EvalReport


def _num(x, spec=",.2f"):
    return "—" if x is None else format(x, spec)


def _change(before, after, lower_is_better=True):
    if before is None or after is None or before == 0:
        return ""
    ratio = after / before
    good = (ratio <= 1) == lower_is_better
    color = "green" if good else "red"
    return f"[{color}]{ratio:.2f}x[/]"


def eval_table(report: EvalReport) -> Table:
    m, b = report.model, report.baseline
    table = Table(title=f"effattn eval · {escape(m.name)}", title_justify="left")
    table.add_column("metric")
    if b is not None:
        table.add_column(escape(b.name), justify="right")
    table.add_column(escape(m.name) if b is None else "model", justify="right")
    if b is not None:
        table.add_column("change", justify="right")

    def row(label, mine, base=None, spec=",.2f", lower=True):
        cells = [escape(label)]
        if b is not None:
            cells.append(_num(base, spec))
        cells.append(_num(mine, spec))
        if b is not None:
            cells.append(_change(base, mine, lower))
        table.add_row(*cells)

    for corpus, ppl in m.perplexity.items():
        row(f"perplexity · {corpus} ({report.tokens[corpus]:,} tok)", ppl, b.perplexity.get(corpus) if b else None)
    for corpus, agree in report.agreement.items():
        table.add_row(escape(f"top-1 agreement · {corpus}"), "", f"{agree:.1%}", "")
    for corpus, kl in report.kl.items():
        table.add_row(escape(f"KL(baseline‖model) · {corpus}"), "", f"{kl:.4f}", "")
    row(f"KV-cache bytes/token (measured, {m.kv_context} tok)", m.kv_bytes_per_token,
        b.kv_bytes_per_token if b else None, ",.0f")
    if m.prefill_tokens_per_s is not None:
        row("prefill tokens/s", m.prefill_tokens_per_s, b.prefill_tokens_per_s if b else None, ",.0f", lower=False)
        row("decode tokens/s", m.decode_tokens_per_s, b.decode_tokens_per_s if b else None, ",.1f", lower=False)
    row("parameters", m.params, b.params if b else None, ",.0f")
    return table
