"""SmolLM2-135M to MQA with local refinement: held-out quality against refinement steps and
calibration tokens.

    python benchmarks/bench_gqa_refine.py --configs 0:0:16384,100:1e-4:16384 [--tokens 8192] [--tag NAME]

Each config is STEPS:LR:CALIB_TOKENS[:TARGET[:SCHEDULE]] for `effattn convert llama --to mqa --refine-steps STEPS
--refine-lr LR --calib-tokens CALIB_TOKENS --refine-target TARGET --refine-schedule SCHEDULE` (the default calibrated method; STEPS=0 is no
refinement; TARGET defaults to attention and SCHEDULE to constant, the conversion's defaults when the script was
written, so its earlier commands still mean what they measured). Every conversion runs in this process one after another; the original is evaluated once.
Perplexity on --tokens tokens per corpus (blocks of 512, evenly spread), the same blocks for every
model. Results: benchmarks/results/gqa-refine[-TAG].json; the table is printed and written there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import ROOT, machine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="0:0:16384,100:1e-4:16384")
    ap.add_argument("--corpora", default="shakespeare,britannica,python")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    from effattn.convert import convert
    from effattn.data.corpora import load_text, token_blocks
    from effattn.evaluate import corpus_scores
    from effattn.io.load import load_model

    corpora = args.corpora.split(",")
    original, tok, _ = load_model("llama")
    blocks = {c: token_blocks(tok, load_text(c), 512, args.tokens, spread=True) for c in corpora}
    base = {c: corpus_scores(original, blocks[c])["perplexity"] for c in corpora}
    print("original", base, flush=True)
    results = {"machine": machine(), "command": "python benchmarks/bench_gqa_refine.py " + " ".join(sys.argv[1:]),
               "tokens": args.tokens, "original": base, "runs": []}
    out_json = ROOT / "benchmarks" / "results" / f"gqa-refine{'-' + args.tag if args.tag else ''}.json"
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in args.configs.split(","):
            steps, lr, calib_tokens, *rest = cfg.split(":")
            options = {"refine_steps": int(steps), "calib_tokens": int(calib_tokens)}
            if int(steps):
                options["refine_lr"] = float(lr)
                # what a config leaves out keeps the script's first meaning: attention target, constant rate
                given = [*rest, *("attention", "constant")[len(rest):]]
                options |= dict(zip(("refine_target", "refine_schedule"), given))
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            result = convert("llama", Path(tmp) / cfg.replace(":", "_"), to="mqa", options=options, measure=False)
            seconds = time.perf_counter() - t0
            model, _, _ = load_model(result.out)
            scores = {c: corpus_scores(model, blocks[c], original) for c in corpora}
            run = {"config": cfg, "options": options, "convert_seconds": round(seconds, 1), "load_before": round(load, 2),
                   "load_after": round(os.getloadavg()[0], 2),
                   "perplexity": {c: scores[c]["perplexity"] for c in corpora},
                   "ratio": {c: scores[c]["perplexity"] / base[c] for c in corpora},
                   "agreement": {c: scores[c]["agreement"] for c in corpora},
                   "refine": (result.record or {}).get("conversion_run", {}).get("refine")}
            results["runs"].append(run)
            print(json.dumps({k: run[k] for k in ("config", "convert_seconds", "load_before", "ratio")}), flush=True)
            out_json.write_text(json.dumps(results, indent=1))
            del model
    header = ["steps", "lr", "target", "schedule", "calib tokens", "convert s (load)", *[f"ppl {c}" for c in corpora]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results["runs"]:
        steps, lr, calib, *rest = r["config"].split(":")
        target, schedule = (rest + ["attention", "constant"][len(rest):])[:2]
        lines.append("| " + " | ".join([steps, lr if int(steps) else "—", target if int(steps) else "—",
                                        schedule if int(steps) else "—",
                                        f"{int(calib):,}",
                                        f"{r['convert_seconds']:.0f} ({r['load_before']:.1f})",
                                        *[f"{r['perplexity'][c]:.2f} ({r['ratio'][c]:.2f}x)" for c in corpora]]) + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
