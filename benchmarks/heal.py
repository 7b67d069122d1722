"""Benchmark: how much of a conversion's quality loss does a CPU healing recipe recover?

    python benchmarks/heal.py --to mqa --method mean [-o bench-out] [KEY=VALUE recipe overrides ...]
    python benchmarks/heal.py --to vq --window 64 --context 2048 [-o bench-out]
    python benchmarks/heal.py --to vq --window 64 --context 2048 --exact-heads 9 --baseline-vq PLAIN_VQ [-o bench-out]

1. convert the built-in SmolLM2-135M (`llama`): `--to mqa` with --method, or `--to vq` (vq-init,
   C=512, --window, --exact-heads) (the "before" model);
2. heal it with the recipe (default: the built-in `heal-gqa` / `heal-vq`), the converted folder as
   the student and the original as the teacher, timing the whole `finetune` call (load, tokenize,
   train, evaluate, checkpoint, save);
3. evaluate original, converted and healed on held-out `shakespeare` and `britannica` (8,192 tokens
   per corpus in blocks of --context, as `effattn eval`);
4. write OUT/results-NAME.json, the curve to benchmarks/results/heal-NAME.png, and print a
   Markdown table for BENCHMARKS.md.

Gap recovered = (log ppl(converted) - log ppl(healed)) / (log ppl(converted) - log ppl(original)); with
--baseline-vq, also against that plain VQ model's perplexity in place of the converted one's.
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
    parser.add_argument("--to", choices=["mqa", "vq"], default="mqa")
    parser.add_argument("--method", default=None, help="GQA method for the conversion (default: the conversion's default)")
    parser.add_argument("--window", type=int, default=64, help="vq: the ReRoPE window")
    parser.add_argument("--exact-heads", type=int, default=0, help="vq: KV heads that keep their original attention (vq-init --exact-heads)")
    parser.add_argument("--baseline-vq", type=Path, default=None,
                        help="vq: also report the gap recovered against this plain VQ folder's perplexities (e.g. the "
                             "--exact-heads 0 conversion), so a heal from an exact-heads start compares with the plain one")
    parser.add_argument("--context", type=int, default=512, help="evaluation block length")
    parser.add_argument("--recipe", default=None, help="default: heal-gqa for mqa, heal-vq for vq")
    parser.add_argument("-o", "--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--tag", default="", help="suffix for the result files of a variant (e.g. attn-lr1e-3)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. train.max_steps=50")
    args = parser.parse_args()
    recipe_name = args.recipe or ("heal-gqa" if args.to == "mqa" else "heal-vq")
    if args.to == "mqa":
        base = f"mqa-{args.method or 'default'}"
        options = {"method": args.method} if args.method else {}
    else:
        base = f"vq-w{args.window}" + (f"-x{args.exact_heads}" if args.exact_heads else "")
        options = {"codebook_size": 512, "window": args.window} | ({"exact_heads": args.exact_heads} if args.exact_heads else {})
    name = base + (f"-{args.tag}" if args.tag else "")
    converted = args.out / f"llama-{base}"
    healed = args.out / f"llama-{name}-healed"
    if not (converted / "effattn.json").exists():
        convert("llama", converted, to=args.to, options=options, measure=False, force=True)

    recipe = load_recipe(recipe_name, [f"student.model={converted}", "student.convert=null", *args.overrides], output=healed)
    timing = args.out / f"finetune-{name}.json"
    if not timing.exists():  # a rerun after the fine-tune finished only re-evaluates
        t0 = time.perf_counter()
        result = finetune(recipe, log=lambda line: print(line, flush=True))
        timing.write_text(json.dumps({"wall_seconds": time.perf_counter() - t0, "steps": result.steps,
                                      "tokens": result.tokens, "train_seconds": result.seconds,
                                      "resumed_from": result.resumed_from, "load_average": os.getloadavg()}))
    run = json.loads(timing.read_text())

    settings = EvalSettings(corpora=CORPORA, context=args.context, max_tokens=8192, speed=False)
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
    if args.baseline_vq is not None:
        plain = evaluate(str(args.baseline_vq), None, settings)
        for corpus, r in rows.items():
            p = plain.model.perplexity[corpus]
            r["plain_vq"] = p
            r["gap_recovered_vs_plain_vq"] = (math.log(p) - math.log(r["healed"])) / (math.log(p) - math.log(r["original"]))
    report = {"to": args.to, "method": args.method or "default", "window": args.window if args.to == "vq" else None,
              "exact_heads": args.exact_heads if args.to == "vq" else None,
              "tag": args.tag, "recipe": recipe_name, "overrides": args.overrides, **run, "cpus": os.cpu_count(),
              "eval": {"tokens_per_corpus": 8192, "context": args.context}, "results": rows}
    (args.out / f"results-{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    plot = Path(__file__).parent / "results" / f"heal-{name}.png"
    plot.parent.mkdir(exist_ok=True)
    shutil.copyfile(healed / "curves.png", plot)

    print(f"\n{run['steps']} steps, {run['tokens']:,} tokens, fine-tune wall time {run['wall_seconds'] / 60:.1f} min "
          f"(load average at the end {run['load_average'][1]:.1f} on {os.cpu_count()} CPUs)\n")
    print(f"| held-out | original | {base} | healed | gap recovered "
          "| top-1 agreement before → after |")
    print("|---|---|---|---|---|---|")
    for corpus, r in rows.items():
        print(f"| {corpus} | {r['original']:.2f} | {r['converted']:,.2f} | {r['healed']:.2f} | "
              f"{r['gap_recovered']:.1%} | {r['agreement_converted']:.1%} → {r['agreement_healed']:.1%} |")
        if "plain_vq" in r:
            print(f"  {corpus}: against the plain VQ model ({r['plain_vq']:.2f}): {r['gap_recovered_vs_plain_vq']:.1%} of its gap")


if __name__ == "__main__":
    main()
