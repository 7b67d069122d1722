"""Windows and sinks on the built-in model: perplexity at 2K and 8K, and prefill time at 16K.

    python benchmarks/bench_swa.py --variants original,window,sinks4,sinks4-full6 --contexts 2048,8192
    python benchmarks/bench_swa.py --prefill 16384 --variants original,window --repeats 2

Perplexity: `effattn eval MODEL --context C --max-tokens T --batch-size 1 --no-speed --json` in a fresh
process per (variant, context), both held-out corpora, T = 4 blocks (spread over each corpus).
Prefill: one forward over C tokens of shakespeare, timed in a fresh process after a warm-up forward at
the same length (so FlexAttention's compilation is not counted), median of the other `--repeats` - 1:
the original with SDPA, the windowed models with SDPA (a masked dense kernel) and with
`attn_implementation="flex_attention"`; the sinks model runs its own kernel.
Variants (converted once into benchmarks/results/passkey-models/):
  window        --to swa --window 256
  sinks4        --to swa --window 256 --sinks 4
  sinks4-full6  --to swa --window 256 --sinks 4 --full-layers 6 (ranked on calibration text)
  window-full6  --to swa --window 256 --full-layers 6
Results are appended to benchmarks/results/swa.json with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import ROOT, machine  # noqa: E402
from benchmarks._util import converted, effattn_cmd as effattn  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "swa.json"
RECIPES = {"window": "--window 256", "sinks4": "--window 256 --sinks 4",
           "sinks4-full6": "--window 256 --sinks 4 --full-layers 6", "window-full6": "--window 256 --full-layers 6"}

PREFILL = """
import json, statistics, sys, time, torch
import effattn
from effattn.data.corpora import load_text
from effattn.io.load import load_model
model, tok, _ = load_model(sys.argv[1], tokenizer="llama", attn_implementation=sys.argv[3] if sys.argv[3] != "-" else None)
n = int(sys.argv[2])
ids = tok(load_text("shakespeare")[: n * 8], return_tensors="pt")["input_ids"][:, :n]
times = []
with torch.inference_mode():
    for _ in range(int(sys.argv[4])):
        t0 = time.perf_counter()
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
        times.append(time.perf_counter() - t0)
print(json.dumps({"first_s": times[0], "seconds": statistics.median(times[1:] or times), "tokens": ids.shape[1],
                  "times": times}))
"""


def model_of(variant: str) -> str:
    return converted(variant, None if variant == "original" else f"convert llama --to swa {RECIPES[variant]} --no-eval")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="original,window,sinks4,sinks4-full6")
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--prefill", type=int, default=0, help="time one prefill of this many tokens instead")
    parser.add_argument("--repeats", type=int, default=3, help="prefill passes; the first (compilation) is not counted")
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    for variant in args.variants.split(","):
        model = model_of(variant)
        runs = []
        if args.prefill:
            # the original is full attention: SDPA is its fast path; the windows also run block-sparse
            kernels = ["-"] + (["flex_attention"] if variant in ("window", "window-full6") else [])
            for kernel in kernels:
                load = os.getloadavg()[0]
                proc = subprocess.run([sys.executable, "-c", PREFILL, model, str(args.prefill), kernel,
                                       str(args.repeats)],
                                      capture_output=True, text=True, cwd=ROOT)
                if proc.returncode:
                    raise SystemExit(proc.stderr[-2000:])
                report = json.loads(proc.stdout.strip().splitlines()[-1])
                runs.append({"variant": variant, "kind": "prefill", "attn_implementation": kernel, **report,
                             "load_before": load, "load_after": os.getloadavg()[0], "machine": machine()})
                print(f"{variant} prefill {args.prefill:,} ({kernel}): {report['seconds']:.1f} s "
                      f"(first {report['first_s']:.1f} s), load {load:.2f}", flush=True)
        else:
            for context in (int(c) for c in args.contexts.split(",")):
                load = os.getloadavg()[0]
                proc = subprocess.run(effattn(f"eval {model} --context {context} --max-tokens {4 * context} "
                                              "--batch-size 1 --no-speed --json"), capture_output=True, text=True)
                if proc.returncode:
                    raise SystemExit(proc.stderr[-2000:])
                report = json.loads(proc.stdout)
                ppl = report["model"]["perplexity"]
                runs.append({"variant": variant, "kind": "perplexity", "context": context, "perplexity": ppl,
                             "load_before": load, "load_after": os.getloadavg()[0], "machine": machine()})
                print(f"{variant} @ {context}: " + ", ".join(f"{c} {p:.2f}" for c, p in ppl.items()), flush=True)
        results += runs
        RESULTS.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
