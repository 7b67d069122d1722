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

    after = ", each block after BOS" if report.settings.get("bos") else ""
    for corpus, ppl in m.perplexity.items():
        row(f"perplexity · {corpus} ({report.tokens[corpus]:,} tok{after})", ppl, b.perplexity.get(corpus) if b else None)
    for corpus, agree in report.agreement.items():
        table.add_row(escape(f"top-1 agreement · {corpus}"), "", f"{agree:.1%}", "")
    for corpus, kl in report.kl.items():
        table.add_row(escape(f"KL(baseline‖model) · {corpus}"), "", f"{kl:.4f}", "")
    row(f"KV-cache bytes/token (measured, {m.kv_context} tok)", m.kv_bytes_per_token,
        b.kv_bytes_per_token if b else None, ",.0f")
    base_speed = {p["context"]: p for p in (b.speed if b else [])}
    for point in m.speed:
        at, other = point["context"], base_speed.get(point["context"], {})
        row(f"prefill tokens/s ({at:,} tok)", point["prefill_tokens_per_s"], other.get("prefill_tokens_per_s"),
            ",.0f", lower=False)
        row(f"decode tokens/s (after {at:,} tok)", point["decode_tokens_per_s"], other.get("decode_tokens_per_s"),
            ",.1f", lower=False)
    row("parameters", m.params, b.params if b else None, ",.0f")
    caption = [break_even_line(report.decode_break_even)] if report.decode_break_even is not None else []
    if report.decode_linears:  # set where speed was timed
        caption.append(f"decode steps' linear layers: {report.decode_linears}")
    if caption:
        table.caption = escape("\n".join(caption))
    return table


def break_even_line(even: dict) -> str:
    """One sentence on `decode_break_even`'s result."""
    measured = " and ".join(f"{n:,}" for n in even["measured"])
    basis = f"(decode times measured after {measured} tokens, taken as linear in the context)"
    if even["tokens"] is None:
        return f"decode break-even: the model decodes slower than the baseline at every length {basis}"
    if even.get("below"):
        return (f"decode break-even: the model decodes faster than the baseline below about {even['tokens']:,.0f} "
                f"tokens and slower beyond {basis}")
    if even["tokens"] == 0:
        return f"decode break-even: the model decodes faster than the baseline at every length {basis}"
    return f"decode break-even: the model decodes faster than the baseline beyond about {even['tokens']:,.0f} tokens {basis}"
