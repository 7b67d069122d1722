"""What a fine-tune leaves for people: the loss/eval curves (PNG) and the model card."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_curves(records: list[dict[str, Any]], path: Path, teacher: dict[str, float] | None = None,
                title: str = "") -> Path:
    """Training loss per step (left) and held-out perplexity per evaluation (right, log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig, (ax_loss, ax_ppl) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=90)
    steps = [r["step"] for r in train]
    terms = [k for k in ("kl", "ce", "attn_out", "aux") if train and k in train[0]]
    for key in ["loss"] + (terms if len(terms) > 1 else []):  # the terms only when the total mixes several
        ax_loss.plot(steps, [r[key] for r in train], label=key, lw=1)
    ax_loss.set(xlabel="step", ylabel="training loss", title="training loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    corpora = sorted({c for r in evals for c in r["eval"]})
    for i, corpus in enumerate(corpora):
        points = [(r["step"], r["eval"][corpus]["perplexity"]) for r in evals if corpus in r["eval"]]
        label = Path(corpus).name  # a file corpus by its name, not its whole path
        line, = ax_ppl.plot(*zip(*points), marker="o", ms=3, label=label, color=f"C{i}")
        if teacher and corpus in teacher:
            ax_ppl.axhline(teacher[corpus], ls="--", lw=1, color=line.get_color(), label=f"{label} (teacher)")
    ax_ppl.set(xlabel="step", ylabel="perplexity", yscale="log", title="held-out perplexity")
    ax_ppl.grid(alpha=0.3, which="both")
    if corpora:
        ax_ppl.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def finetune_card(name: str, record: dict[str, Any], model_type: str | None = None) -> str:
    """README.md of a fine-tuned (healed) model."""
    ft = record["finetune"]
    src = record.get("source") or {}
    conv = record.get("conversion")
    start, final, teacher = ft["start_eval"], ft["final_eval"], ft.get("teacher_eval") or {}
    rows = []
    for corpus in final:
        base = teacher.get(corpus)
        rows.append(f"| perplexity · {corpus} | {_fmt(base)} | {_fmt(start[corpus]['perplexity'])} | "
                    f"{_fmt(final[corpus]['perplexity'])} |")
        if "agreement" in final[corpus]:
            rows.append(f"| top-1 agreement with the teacher · {corpus} | 100% | "
                        f"{start[corpus]['agreement']:.1%} | {final[corpus]['agreement']:.1%} |")
    what = (f"converted from `{src['model']}` ({conv['to']}: "
            + ", ".join(f"{k}={v}" for k, v in conv.items() if k != "to") + ") and healed"
            if conv else f"fine-tuned from `{ft['student']}`")
    lines = [
        "---",
        *([f"base_model: {src['hub_id']}"] if src.get("hub_id") else []),  # Hub metadata: a hub id, not a path
        "library_name: transformers",
        f"tags: [effattn, finetune{', ' + conv['to'] if conv else ''}]",
        "---",
        "",
        f"# {name}",
        "",
        f"By effattn {record['effattn_version']}: {what} with `effattn finetune` "
        f"on {record['created'][:10]}.",
        "",
        "## Fine-tune",
        "",
        f"- teacher: `{ft['teacher']}`" if ft.get("teacher") else "- teacher: none (cross-entropy only)",
        f"- trained: {ft['params']} ({ft['trainable_params']:,} of {ft['total_params']:,} parameters)",
        f"- {ft['steps']} steps, {ft['tokens']:,} tokens on {', '.join(ft['recipe']['data']['sources'])}, "
        f"{ft['processes']} process(es), {ft['seconds'] / 60:.1f} min",
        f"- loss: {_loss_terms(ft['recipe']['loss'], ft['final_terms'])}; final training loss "
        f"{ft['final_loss']:.4f} (the mean of the last {min(10, ft['steps'])} steps)",
        *[f"- resumed at step {r['step']} with a changed recipe: {'; '.join(r['changes'])} (the steps before it ran "
          "with the earlier values)" for r in ft.get("resumes", []) if r.get("changes")],
        "",
        "## Measured",
        "",
        f"Held-out text ({_eval_tokens(ft)} in blocks of {ft['recipe']['eval']['seq_len']}"
        f"{', each read after the BOS token' if ft['recipe']['eval'].get('bos') else ''}; never trained on).",
        "",
        "| metric | teacher | before fine-tune | after |",
        "|---|---|---|---|",
        *rows,
        "",
    ]
    if ft.get("command"):
        lines += ["## Reproduce", "", "```", ft["command"], "```", "",
                  "The resolved recipe is `recipe.yaml` in this folder; `metrics.jsonl` and `curves.png` hold the run.", ""]
        if any(r.get("changes") for r in ft.get("resumes", [])):
            lines += ["This is the command that finished the run. It was resumed with a changed recipe (above), so "
                      "neither it nor `recipe.yaml` alone repeats the run.", ""]
    from ..io.card import load_section

    lines += load_section(name, model_type)
    return "\n".join(lines)


def _eval_tokens(ft: dict[str, Any]) -> str:
    """The tokens each held-out corpus was read for (whole blocks, at most the corpus); the recipe's
    eval.tokens for records written before they were recorded."""
    read = ft.get("eval_tokens")
    if not read:
        return f"{ft['recipe']['eval']['tokens']:,} tokens per corpus"
    counts = sorted(set(read.values()))
    if len(counts) == 1:
        return f"{counts[0]:,} tokens per corpus"
    return ", ".join(f"{n:,} tokens of {corpus}" for corpus, n in read.items())


def _loss_terms(loss: dict[str, Any], present: list[str]) -> str:
    terms = []
    if loss["kl"]:
        terms.append(f"{loss['kl']} x KL(teacher‖student) at T={loss['temperature']}")
    if loss["ce"]:
        terms.append(f"{loss['ce']} x cross-entropy")
    if loss.get("attn_out"):
        terms.append(f"{loss['attn_out']} x the attention-output error against the teacher, per layer")
    if "aux" in present:
        terms.append(f"{loss['aux_weight']} x the conversion's own terms")
    return " + ".join(terms)


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:,.2f}"
