"""SmolLM2-135M to MQA (3 KV heads -> 1), zero-shot: quality of every GQA method on held-out text.

    python benchmarks/bench_gqa_quality.py [--methods mean,align,pca,calibrated] [--tokens 8192]

Converts the built-in model with each method (default settings; calibrated methods use the default
`calib` corpus: poems + technical prose + code, no drama and no encyclopedic text), then evaluates
original and converted on the evaluation corpora, which calibration never sees. Writes the
`gqa-quality` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import machine, write_section  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="mean,align,pca,calibrated")
    ap.add_argument("--corpora", default="shakespeare,britannica,python")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--update", action="store_true",
                    help="re-measure only --methods and replace their rows in the existing section")
    args = ap.parse_args()
    from effattn.convert import convert
    from effattn.evaluate import EvalSettings, corpus_scores
    from effattn.data.corpora import load_text, token_blocks
    from effattn.io.load import load_model

    corpora = args.corpora.split(",")
    original, tok, _ = load_model("llama")
    blocks = {c: token_blocks(tok, load_text(c), 512, args.tokens, spread=True) for c in corpora}
    base = {c: corpus_scores(original, blocks[c])["perplexity"] for c in corpora}
    rows = [("original", "—", *[f"{base[c]:.2f}" for c in corpora], *["100%" for _ in corpora])]
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            t0 = time.perf_counter()
            result = convert("llama", Path(tmp) / method, to="mqa", options={"method": method, "refine_steps": 0}, measure=False)
            seconds = time.perf_counter() - t0
            model, _, _ = load_model(result.out)
            scores = {c: corpus_scores(model, blocks[c], original) for c in corpora}
            rows.append((method, f"{seconds:.0f}",
                         *[f"{scores[c]['perplexity']:.2f} ({scores[c]['perplexity'] / base[c]:.2f}x)" for c in corpora],
                         *[f"{scores[c]['agreement']:.1%}" for c in corpora]))
            print(rows[-1], flush=True)
            del model
    if args.update:
        return update_rows(rows[1:], args)
    header = ["method", "convert s", *[f"ppl {c}" for c in corpora], *[f"top-1 agree {c}" for c in corpora]]
    table = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                      + ["| " + " | ".join(r) + " |" for r in rows])
    write_section("gqa-quality", f"""
## GQA/MQA without retraining: SmolLM2-135M-Instruct, 3 KV heads -> 1

`python benchmarks/bench_gqa_quality.py --methods {args.methods} --tokens {args.tokens}` on {machine()}.

Zero-shot (no fine-tuning). Perplexity on {args.tokens:,} tokens per corpus (blocks of 512, evenly spread
over each corpus); in brackets the ratio to the original. Calibrated methods use the default
calibration corpus `calib` (Shakespeare's poems, Python docstrings and language reference, Python
code from modules not in `python`): `shakespeare` (drama) and `britannica` (encyclopedic prose) are
domains calibration never saw; `python` is held-out code. KV cache: 46,080 -> 15,360 bytes/token
(fp32). Conversion time includes calibration and was measured while other jobs shared the 2 cores.

{table}
""")


def update_rows(rows, args) -> None:
    """Replace the rows of the re-measured methods in the existing section, and say so under the table."""
    from benchmarks._util import BENCHMARKS_MD

    text = BENCHMARKS_MD.read_text()
    start, end = text.index("<!-- bench:gqa-quality -->"), text.index("<!-- /bench:gqa-quality -->")
    section = text[start:end]
    for row in rows:
        line = "| " + " | ".join(row) + " |"
        old = next((ln for ln in section.splitlines() if ln.startswith(f"| {row[0]} |")), None)
        section = section.replace(old, line) if old else section.replace("\n\n", f"\n{line}\n\n", 1)
    section = section.rstrip() + (f"\n\nRows re-measured with `python benchmarks/bench_gqa_quality.py --methods {args.methods} "
                                  f"--tokens {args.tokens} --update` on {machine()}: {args.methods}.\n")
    BENCHMARKS_MD.write_text(text[:start] + section + text[end:])


if __name__ == "__main__":
    main()
