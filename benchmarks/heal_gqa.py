"""Benchmark: how much of the MQA conversion's quality loss does the CPU `heal-gqa` recipe recover?

    python benchmarks/heal_gqa.py --method mean [-o bench-out] [KEY=VALUE recipe overrides ...]

1. convert the built-in SmolLM2-135M (`llama`) to MQA with --method (the "before" model);
2. heal it with the recipe (default: the built-in `heal-gqa`), the converted folder as the student
   and the original as the teacher, timing the whole `finetune` call (load, tokenize, train,
   evaluate, checkpoint, save);
3. evaluate original, converted and healed on held-out `shakespeare` and `britannica` (8,192 tokens
   per corpus in blocks of 512, as `effattn eval`);
4. write OUT/results-METHOD.json, the curve to benchmarks/results/heal-gqa-METHOD.png, and print a
   Markdown table for BENCHMARKS.md.

Gap recovered = (log ppl(converted) - log ppl(healed)) / (log ppl(converted) - log ppl(original)).
Rerunning after an interruption resumes the fine-tune from its last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from pathlib import Path

from effattn.convert import convert
from effattn.evaluate import EvalSettings, evaluate
from effattn.finetune import finetune, load_recipe

CORPORA = ("shakespeare", "britannica")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default=None, help="GQA method for the conversion (default: the conversion's default)")
    parser.add_argument("--recipe", default="heal-gqa")
    parser.add_argument("-o", "--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--tag", default="", help="suffix for the result files of a variant (e.g. attn-lr1e-3)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. train.max_steps=50")
    args = parser.parse_args()
    name = (args.method or "default") + (f"-{args.tag}" if args.tag else "")
    converted = args.out / f"llama-mqa-{args.method or 'default'}"
    healed = args.out / f"llama-mqa-{name}-healed"
    if not (converted / "effattn.json").exists():
        options = {"method": args.method} if args.method else {}
        convert("llama", converted, to="mqa", options=options, measure=False, force=True)

    recipe = load_recipe(args.recipe, [f"student.model={converted}", "student.convert=null", *args.overrides], output=healed)
    timing = args.out / f"finetune-{name}.json"
    if not timing.exists():  # a rerun after the fine-tune finished only re-evaluates
        t0 = time.perf_counter()
        result = finetune(recipe, log=lambda line: print(line, flush=True))
        timing.write_text(json.dumps({"wall_seconds": time.perf_counter() - t0, "steps": result.steps,
                                      "tokens": result.tokens, "train_seconds": result.seconds,
                                      "resumed_from": result.resumed_from, "load_average": os.getloadavg()}))
    run = json.loads(timing.read_text())

    settings = EvalSettings(corpora=CORPORA, context=512, max_tokens=8192, speed=False)
    before = evaluate(str(converted), "llama", settings)
    after = evaluate(str(healed), "llama", settings)
    rows = {}
    for corpus in CORPORA:
        orig, conv, heal = (before.baseline.perplexity[corpus], before.model.perplexity[corpus],
                            after.model.perplexity[corpus])
        rows[corpus] = {
            "original": orig, "converted": conv, "healed": heal,
            "gap_recovered": (math.log(conv) - math.log(heal)) / (math.log(conv) - math.log(orig)),
            "agreement_converted": before.agreement[corpus], "agreement_healed": after.agreement[corpus],
            "kl_converted": before.kl[corpus], "kl_healed": after.kl[corpus],
        }
    report = {"method": args.method or "default", "tag": args.tag, "recipe": args.recipe, "overrides": args.overrides, **run, "cpus": os.cpu_count(),
              "eval": {"tokens_per_corpus": 8192, "context": 512}, "results": rows}
    (args.out / f"results-{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    plot = Path(__file__).parent / "results" / f"heal-gqa-{name}.png"
    plot.parent.mkdir(exist_ok=True)
    shutil.copyfile(healed / "curves.png", plot)

    print(f"\n{run['steps']} steps, {run['tokens']:,} tokens, fine-tune wall time {run['wall_seconds'] / 60:.1f} min "
          f"(load average at the end {run['load_average'][1]:.1f} on {os.cpu_count()} CPUs)\n")
    print(f"| held-out | original | MQA ({args.method or 'default'}) | healed | gap recovered "
          "| top-1 agreement before → after |")
    print("|---|---|---|---|---|---|")
    for corpus, r in rows.items():
        print(f"| {corpus} | {r['original']:.2f} | {r['converted']:,.2f} | {r['healed']:.2f} | "
              f"{r['gap_recovered']:.1%} | {r['agreement_converted']:.1%} → {r['agreement_healed']:.1%} |")


if __name__ == "__main__":
    main()
