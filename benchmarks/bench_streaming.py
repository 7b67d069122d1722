"""Streaming through a bounded cache: memory and perplexity over 20K+ tokens (StreamingLLM's test).

    python benchmarks/bench_streaming.py --mode generate --tokens 20480 --variants sinks4
    python benchmarks/bench_streaming.py --mode text --tokens 20480 --step 16 --variants window,sinks4

`generate`: greedy generation of `--tokens` new tokens, one at a time, after a short prompt, through the
model's cache (`model.generate` would do the same; the loop samples memory on the way): the cache's
bytes and the process's resident set every 256 tokens.
`text`: the first `--tokens` tokens of a held-out corpus fed `--step` tokens at a time through the cache
(teacher forcing), the negative log-likelihood of every token: perplexity per 1,024-token segment,
the memory as above. A window alone loses the first tokens once they leave it; sinks keep them.

Variants are converted once from the built-in model into benchmarks/results/passkey-models/:
  window  `--to swa --window 256` (MistralForCausalLM, transformers' sliding-window cache)
  sinks4  `--to swa --window 256 --sinks 4` (effattn_sinks)
  original (the model itself: its cache grows)
Results: benchmarks/results/streaming.json (appended) and streaming.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import ROOT, converted, machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "streaming.json"
RECIPES = {"window": "convert llama --to swa --window 256 --no-eval",
           "sinks4": "convert llama --to swa --window 256 --sinks 4 --no-eval",
           "window1024": "convert llama --to swa --window 1024 --no-eval",
           "sinks4-1024": "convert llama --to swa --window 1024 --sinks 4 --no-eval"}


def model_of(variant: str) -> str:
    return converted(variant, None if variant == "original" else RECIPES[variant])


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024
    return 0


def run(variant: str, mode: str, tokens: int, step: int, corpus: str) -> dict:
    import torch

    import effattn  # noqa: F401 - registers effattn's models
    from effattn.data.corpora import load_text
    from effattn.evaluate import tensor_bytes
    from effattn.io.load import load_model

    model, tokenizer, _ = load_model(model_of(variant))
    model.eval()
    points, nll, seg = [], [], []
    t0 = time.perf_counter()
    with torch.inference_mode():
        if mode == "generate":
            ids = tokenizer(load_text(corpus)[:2000], return_tensors="pt")["input_ids"][:, :64]
            out = model(input_ids=ids, use_cache=True)
            cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)
            for n in range(tokens):
                out = model(input_ids=nxt, cache=cache, use_cache=True)
                cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)
                if (n + 1) % 256 == 0:
                    points.append({"tokens": ids.shape[1] + n + 1, "cache_bytes": tensor_bytes(cache), "rss": rss(),
                                   "seconds": time.perf_counter() - t0})
        else:
            ids = tokenizer(load_text(corpus)[: tokens * 8], return_tensors="pt")["input_ids"][:, : tokens + 1]
            if ids.shape[1] < tokens + 1:
                raise SystemExit(f"{corpus} has fewer than {tokens + 1} tokens")
            cache = None
            for a in range(0, tokens, step):
                chunk = ids[:, a : a + step]
                out = model(input_ids=chunk, cache=cache, use_cache=True)
                cache = out.cache
                logp = out.logits.float().log_softmax(-1)
                target = ids[:, a + 1 : a + 1 + chunk.shape[1]]
                nll += (-logp[0, : target.shape[1]].gather(-1, target[0, :, None])[:, 0]).tolist()
                if (a + step) % 256 < step:
                    points.append({"tokens": a + chunk.shape[1], "cache_bytes": tensor_bytes(cache), "rss": rss(),
                                   "seconds": time.perf_counter() - t0})
            seg = [math.exp(sum(nll[i : i + 1024]) / len(nll[i : i + 1024])) for i in range(0, len(nll), 1024)]
    return {"variant": variant, "mode": mode, "tokens": tokens, "step": step, "corpus": corpus, "points": points,
            "segment_ppl": seg, "seconds": time.perf_counter() - t0}


def plot(entries: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, ppl) = plt.subplots(1, 2, figsize=(11, 4))
    for e in entries:
        xs = [p["tokens"] for p in e["points"]]
        label = f"{e['variant']} ({e['mode']})"
        mem.plot(xs, [p["cache_bytes"] / 2**20 for p in e["points"]], label=label + " cache")
        mem.plot(xs, [p["rss"] / 2**20 for p in e["points"]], "--", label=label + " RSS", alpha=0.6)
        if e["segment_ppl"]:
            ppl.plot([1024 * (i + 1) for i in range(len(e["segment_ppl"]))], e["segment_ppl"], marker="o", label=label)
    mem.set_xlabel("tokens streamed")
    mem.set_ylabel("MiB")
    mem.set_yscale("log")
    mem.set_title("memory")
    mem.legend(fontsize=7)
    ppl.set_xlabel("tokens streamed")
    ppl.set_ylabel("perplexity per 1,024 tokens")
    ppl.set_yscale("log")
    ppl.set_title("perplexity (teacher-forced)")
    ppl.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="sinks4")
    parser.add_argument("--mode", choices=("generate", "text"), default="generate")
    parser.add_argument("--tokens", type=int, default=20480)
    parser.add_argument("--step", type=int, default=1)
    parser.add_argument("--corpus", default="shakespeare")
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    for variant in args.variants.split(","):
        load = os.getloadavg()[0]
        entry = run(variant, args.mode, args.tokens, args.step, args.corpus)
        entry |= {"load_before": load, "load_after": os.getloadavg()[0], "machine": machine()}
        results = [r for r in results if (r["variant"], r["mode"]) != (variant, args.mode)] + [entry]
        RESULTS.write_text(json.dumps(results, indent=1))
        p = entry["points"]
        print(f"{variant} {args.mode}: {args.tokens:,} tokens in {entry['seconds']:.0f} s; cache "
              f"{p[0]['cache_bytes'] / 2**20:.1f} -> {p[-1]['cache_bytes'] / 2**20:.1f} MiB, RSS "
              f"{p[0]['rss'] / 2**20:,.0f} -> {p[-1]['rss'] / 2**20:,.0f} MiB"
              + (f"; ppl per 1K: {' '.join(f'{x:.1f}' for x in entry['segment_ppl'])}" if entry["segment_ppl"] else ""),
              flush=True)
    plot(results, RESULTS.with_suffix(".png"))


if __name__ == "__main__":
    main()
