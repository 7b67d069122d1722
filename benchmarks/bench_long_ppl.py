"""Perplexity at long context: `effattn eval --context N` per variant, every variant scoring the same tokens.

    python benchmarks/bench_long_ppl.py --variants original --contexts 8192
    python benchmarks/bench_long_ppl.py --variants original,yarn2,dynamic2,linear2,llama3-2 --contexts 16384

The first `--span` tokens (32,768 by default) of each held-out corpus are written to a text file once
and evaluated with `--corpus FILE --max-tokens SPAN`: at 8K that is four blocks, at 16K two, at 32K one,
so the perplexities of different contexts are over the same tokens (each block starts cold, so longer
blocks also give each token more context). The variants are those of bench_passkey.py, or NAME=PATH for a
model already made. Each run is a fresh process under `/usr/bin/time` (wall seconds, peak resident set);
results are appended to benchmarks/results/long-ppl.json with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import CONVERTED as MODELS, ROOT, machine, timed_effattn  # noqa: E402
from benchmarks.bench_passkey import model_of  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "long-ppl.json"


def span_file(corpus: str, span: int, folder: Path = MODELS / "texts") -> Path:
    """The first `span` tokens (and a few more, so re-tokenizing never falls short) of `corpus` as text."""
    path = folder / f"{corpus}-{span}.txt"
    if not path.exists():
        from effattn.data.corpora import load_text
        from effattn.io.load import load_tokenizer

        tokenizer = load_tokenizer("llama")
        ids = tokenizer(load_text(corpus))["input_ids"]
        if len(ids) < span + 64:
            raise SystemExit(f"{corpus} has {len(ids)} tokens, fewer than --span {span}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(tokenizer.decode(ids[: span + 64]))
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="original")
    parser.add_argument("--contexts", default="8192")
    parser.add_argument("--corpora", default="shakespeare,britannica")
    parser.add_argument("--span", type=int, default=32768)
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    for variant in args.variants.split(","):
        model, name = model_of(variant), variant.partition("=")[0]
        for context in [int(c) for c in args.contexts.split(",")]:
            for corpus in args.corpora.split(","):
                text = span_file(corpus, args.span)
                load = os.getloadavg()[0]
                stdout, wall, peak = timed_effattn(
                    f"eval {model} --corpus {text} --context {context} --max-tokens {args.span} "
                    f"--batch-size 1 --no-speed --json", f"{variant} at {context}")
                report = json.loads(stdout)
                ppl = next(iter(report["model"]["perplexity"].values()))
                entry = {"variant": name, "model": model, "corpus": corpus, "context": context,
                         "span": args.span, "perplexity": ppl, "tokens": next(iter(report["tokens"].values())),
                         "wall_s": wall, "peak_rss_mib": peak,
                         "load_before": load, "load_after": os.getloadavg()[0], "machine": machine()}
                results.append(entry)
                RESULTS.write_text(json.dumps(results, indent=1))
                print(f"{name} {corpus} @ {context}: ppl {ppl:.3f} | {wall:.0f} s, "
                      f"{peak:,.0f} MiB, load {load:.2f}", flush=True)


if __name__ == "__main__":
    main()
