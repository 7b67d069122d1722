"""Passkey retrieval of the built-in model and its conversions: `effattn eval --task passkey` per variant.

    python benchmarks/bench_passkey.py --variants original,mqa,rerope --lengths 2048,4096,8192 --samples 2
    python benchmarks/bench_passkey.py --variants original,yarn2,dynamic2,linear2 --lengths 16384 --depths 0,0.5,1 --samples 1
    python benchmarks/bench_passkey.py --variants "t120=/tmp/lin/t120"   # an already made model: NAME=PATH

Each variant is converted once into benchmarks/results/passkey-models/ (`--no-eval`), then evaluated in a
fresh process under `/usr/bin/time` (wall seconds, peak resident set). Results are appended to
benchmarks/results/passkey[-TAG].json, one entry per (variant, lengths) run, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import ROOT, converted, effattn_cmd, machine, timed_effattn  # noqa: E402

VARIANTS = {  # name: effattn arguments making it from the built-in model (None: the model itself)
    "original": None,
    "mqa": "convert llama --to mqa --no-eval",
    "rerope": "convert llama --to rerope --window 256 --no-eval",
    "vq64": "vq-init llama --window 64 --heavy-keys 0 --no-eval",  # key means alone (plain VQ; heavy keys are the default)
    "vq64-plain": "vq-init llama --window 64 --no-key-means --heavy-keys 0 --no-eval",
    "vq64-exact18": "vq-init llama --window 64 --exact-heads 18 --heavy-keys 0 --no-eval",
    "vq64-heavy192": "vq-init llama --window 64 --heavy-keys 192 --no-eval",
    "linear2": "convert llama --to rope-scaling --rope-type linear --factor 2 --no-eval",
    "dynamic2": "convert llama --to rope-scaling --rope-type dynamic --factor 2 --no-eval",
    "yarn2": "convert llama --to rope-scaling --rope-type yarn --factor 2 --no-eval",
    "llama3-2": "convert llama --to rope-scaling --rope-type llama3 --factor 2 --no-eval",
    "yarn4": "convert llama --to rope-scaling --rope-type yarn --factor 4 --no-eval",
    "window": "convert llama --to swa --window 256 --no-eval",
    "sinks4": "convert llama --to swa --window 256 --sinks 4 --no-eval",
    "sinks4-full6": "convert llama --to swa --window 256 --sinks 4 --full-layers 6 --no-eval",
    "window-full6": "convert llama --to swa --window 256 --full-layers 6 --no-eval",
    "linear64": "convert llama --to linear --no-eval",  # hedgehog, window 64, the default attention transfer
}


effattn = effattn_cmd


def model_of(variant: str) -> str:
    """A variant's folder: made from VARIANTS on first use, or given as NAME=PATH (an already made model)."""
    name, _, path = variant.partition("=")
    return path if path else converted(name, VARIANTS[name])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="original")
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--task", default="passkey")
    parser.add_argument("--tag", default="")
    parser.add_argument("--seed", type=int, default=0, help="effattn eval --seed: another draw of keys and positions")
    args = parser.parse_args()
    path = ROOT / "benchmarks" / "results" / f"passkey{'-' + args.tag if args.tag else ''}.json"
    results = json.loads(path.read_text()) if path.exists() else []
    for variant in args.variants.split(","):
        model = model_of(variant)
        load = os.getloadavg()[0]
        stdout, wall, peak = timed_effattn(
            f"eval {model} --task {args.task} --lengths {args.lengths} --depths {args.depths} "
            f"--samples {args.samples} --seed {args.seed} --json", variant)
        report = json.loads(stdout)
        entry = {"variant": variant.partition("=")[0], "model": model, "task": args.task, "lengths": args.lengths, "depths": args.depths,
                 "samples": args.samples, "seed": args.seed, "accuracy": report["accuracy"], "mean": report["mean"],
                 "wall_s": wall, "peak_rss_mib": peak, "load_before": load,
                 "load_after": os.getloadavg()[0], "machine": machine(), "outputs": report["samples"]}
        results.append(entry)
        path.write_text(json.dumps(results, indent=1))
        row = " | ".join(f"{L}: " + " ".join(f"{v:.0%}" for v in cells.values()) for L, cells in report["accuracy"].items())
        print(f"{variant.partition('=')[0]}: mean {report['mean']:.0%} | {row} | {wall:.0f} s, {peak:,.0f} MiB, "
              f"load {load:.2f}", flush=True)


if __name__ == "__main__":
    main()
