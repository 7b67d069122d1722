"""MLA (`effattn convert llama --to mla`) on the built-in model: quality at a given cache, and decode speed.

    python benchmarks/bench_mla.py quality --variants k128,k192 --tokens 8192
    python benchmarks/bench_mla.py decode --contexts 4096,16384 --tokens 16

quality: each variant is converted once (benchmarks/results/passkey-models/mla-VARIANT) and measured
with `effattn eval MODEL --baseline llama --corpus shakespeare,britannica,python --max-tokens T
--no-speed --json` (the GQA table's corpora and 512-token blocks) in a fresh process. Variants:
  k128         --kv-size 128 --refine-steps 0 (the default split: latent 96 + rotary 32), MQA's cache
  k192         --kv-size 192 --refine-steps 0 (latent 160 + rotary 32), half the cache
  k128-rN      --kv-size 128 --rope-dim N --refine-steps 0 (other splits)
  k128-s2      --kv-size 128 --rope-stride 2 --refine-steps 0
  k128-weighted --kv-size 128 --latent-fit weighted --refine-steps 0 (instead of the default, balanced)
  k128-norefit --kv-size 128 --no-refit-o --refine-steps 0
  k128-ref30   --kv-size 128 --refine-steps 30 --refine-lr 3e-4 --refine-target stream (the defaults now)
  ... or any "name=convert options" given as NAME=--kv-size 128 --rope-dim 24
decode: the context (shakespeare, repeated as needed) is prefilled once per model; then `--tokens`
greedy steps are timed, one token each through the model's cache: the original (SDPA), the MLA model
through transformers' DeepseekV3 path (re-expands the whole latent cache through kv_b_proj every
step) and through effattn's absorbed attention (attention/mla.py). Both MLA paths decode from the same
prefilled cache. Median seconds per token over the steps after the first.
Results are appended to benchmarks/results/mla.json with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import ROOT, converted, effattn_cmd, machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "mla.json"
VARIANTS = {"k128": "--kv-size 128 --refine-steps 0", "k192": "--kv-size 192 --refine-steps 0", 
            "k128-s2": "--kv-size 128 --rope-stride 2 --refine-steps 0",
            "k128-weighted": "--kv-size 128 --latent-fit weighted --refine-steps 0",
            "k128-norefit": "--kv-size 128 --no-refit-o --refine-steps 0",
            "k128-ref30": "--kv-size 128 --refine-steps 30 --refine-lr 3e-4 --refine-target stream",
            "k192-ref30": "--kv-size 192 --refine-steps 30 --refine-lr 3e-4 --refine-target stream"}


def options_of(variant: str) -> str:
    if "=" in variant:
        return variant.split("=", 1)[1]
    if variant in VARIANTS:
        return VARIANTS[variant]
    if variant.startswith("k128-r"):
        return f"--kv-size 128 --rope-dim {int(variant[6:])} --refine-steps 0"
    raise SystemExit(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}, k128-rN, or NAME=OPTIONS")


def model_of(variant: str) -> tuple[str, float]:
    name = variant.split("=", 1)[0]
    t0 = time.time()
    path = converted(f"mla-{name}", f"convert llama --to mla {options_of(variant)} --no-eval")
    return path, time.time() - t0


def record(row: dict) -> None:
    rows = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    rows.append(row)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1))


def quality(args) -> None:
    for variant in args.variants.split(","):
        path, seconds = model_of(variant)
        load = os.getloadavg()[0]
        proc = subprocess.run(effattn_cmd(f"eval {path} --baseline llama --corpus shakespeare,britannica,python "
                                          f"--max-tokens {args.tokens} --no-speed --json"),
                              capture_output=True, text=True, check=True)
        report = json.loads(proc.stdout)
        row = {"kind": "quality", "variant": variant, "options": options_of(variant), "tokens": args.tokens,
               "convert_s_if_made_now": round(seconds, 1), "load_before": load, "machine": machine(),
               "commit": _commit(), "report": report}
        record(row)
        m, b = report["model"]["perplexity"], report["baseline"]["perplexity"]
        print(variant, {c: f"{m[c]:.2f} ({m[c] / b[c]:.2f}x)" for c in m}, flush=True)


DECODE = r"""
import json, os, statistics, sys, time, torch
from effattn.data.corpora import load_text
from effattn.io.load import load_model
path, context, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model, tok, _ = load_model(path, tokenizer="llama")  # an MLA model loads with the absorbed attention
text = load_text("shakespeare")
ids = tok(text[: context * 6], return_tensors="pt")["input_ids"]
while ids.shape[1] < context:
    ids = torch.cat([ids, ids], dim=1)
ids = ids[:, :context]
paths = {"native": model}
if path != "llama" and sys.argv[4:] != ["native"]:  # an MLA model: effattn's absorbed path and transformers' 
    paths = {"absorbed": model, "transformers": load_model(path, tokenizer=False, attn_implementation="sdpa")[0]}
if os.environ.get("EFFATTN_BENCH_GEMV") == "1":  # --gemv: every model's linear layers through kernels/gemv
    from effattn.kernels.gemv import use_for_decoding
    for m in paths.values():
        assert use_for_decoding(m), "kernels/gemv is unavailable"
out = {}
with torch.inference_mode():
    t0 = time.perf_counter()
    cache = None
    for start in range(0, context, 4096):  # chunked prefill through the cache, as generation prefills
        res = model(input_ids=ids[:, start:start + 4096], cache=cache, use_cache=True, logits_to_keep=1)
        cache = res.cache
    out["prefill_s"] = time.perf_counter() - t0
    import copy
    for name, m in paths.items():
        c = copy.deepcopy(cache)
        token = res.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step = m(input_ids=token, cache=c, use_cache=True)
            times.append(time.perf_counter() - t0)
            c, token = step.cache, step.logits[:, -1:].argmax(-1)
        out[name] = {"s_per_token": statistics.median(times[1:]), "times": times}
    from effattn.evaluate import tensor_bytes
    out["cache_bytes_per_token"] = tensor_bytes(cache) / context
print(json.dumps(out))
"""


def decode(args) -> None:
    models = [("original", "llama")] + [(v, model_of(v)[0]) for v in args.variants.split(",")]
    decode_rows(models, args.contexts, args.tokens, record, gemv=args.gemv)


def decode_rows(models, contexts: str, tokens: int, record, mode: str = "mla", gemv: bool = False) -> None:
    """Run DECODE for each (name, path) of `models` at each of the comma-separated `contexts`, recording
    and printing a row each. mode "mla": an MLA model decodes through both paths; "native": one path.
    `gemv`: every model's linear layers through effattn's matrix-vector product (kernels/gemv)."""
    for context in map(int, contexts.split(",")):
        for name, path in models:
            load = os.getloadavg()[0]
            proc = subprocess.run([sys.executable, "-c", DECODE, path, str(context), str(tokens), mode],
                                  capture_output=True, text=True, env={**os.environ, "EFFATTN_BENCH_GEMV": str(int(gemv))})
            if proc.returncode:
                raise SystemExit(proc.stderr[-3000:])
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            row = {"kind": "decode", "variant": name, "context": context, "tokens": tokens, "load_before": load,
                   "linears": "gemv" if gemv else "torch",
                   "load_after": os.getloadavg()[0], "machine": machine(), "commit": _commit(), **result}
            record(row)
            speeds = {k: f"{1 / v['s_per_token']:.2f} tok/s" for k, v in result.items() if isinstance(v, dict)}
            print(context, name, speeds, f"prefill {result['prefill_s']:.1f}s",
                  f"cache {result['cache_bytes_per_token']:,.0f} B/token", f"load {load:.2f}", flush=True)


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["quality", "decode"])
    parser.add_argument("--variants", default="k128,k192")
    parser.add_argument("--tokens", type=int, default=None, help="quality: tokens per corpus (8192); decode: steps (16)")
    parser.add_argument("--contexts", default="4096,16384")
    parser.add_argument("--gemv", action="store_true", help="decode: linear layers through effattn's kernels/gemv")
    args = parser.parse_args()
    if args.tokens is None:
        args.tokens = 8192 if args.mode == "quality" else 16
    if args.mode == "quality":
        quality(args)
    else:
        args.variants = args.variants if args.variants != "k128,k192" else "k128"
        decode(args)


if __name__ == "__main__":
    main()
