"""Linear attention (`effattn convert llama --to linear`, issue 17) on the built-in model: quality per
feature map, window and stage, and decode speed at long context.

    python benchmarks/bench_linear.py quality --variants hedgehog-w64,hedgehog-w0 --stages zero,transfer
    python benchmarks/bench_linear.py quality --models "healed=/tmp/heal-linear"   # already made models
    python benchmarks/bench_linear.py quality --models "x=/tmp/lin-x18" --exact-heads 0,3,9,18
    python benchmarks/bench_linear.py decode --contexts 16384 --tokens 16

quality: each variant MAP-wW (feature map MAP, window W) is converted once per stage into
benchmarks/results/passkey-models/linear-MAP-wW-STAGE (git-ignored), `zero`: `--refine-steps 0` (the maps
at their initial values), `transfer`: the conversion's attention transfer (its defaults, or the options
given after a colon: `hedgehog-w64:--refine-steps 40 --calib-seq-len 2048`). Every model is evaluated
in this process on the VQ table's corpora and blocks (shakespeare, britannica; `--tokens` per corpus,
evenly spread, in blocks of `--context` = 2048): perplexity and top-1 agreement with the original,
whose predictions are computed once. Rows go to benchmarks/results/linear.json with the commit, the
conversion time (effattn.json's measured seconds) and the load average. `--exact-heads K1,K2,...` scores
each given model (converted with `--exact-heads`, whose record ranks every KV head) once per K, with the
top K of its ranking exact: one conversion serves every K, as its maps do not depend on K.

decode: as `bench_mla.py decode` (the same script: the context prefilled once in 4,096-token chunks
through the cache, then `--tokens` greedy steps, the median step after the first), for the original
and a linear model (`--variant`, or `--model PATH`); the cache's bytes are measured after the prefill.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import CONVERTED, ROOT, effattn_cmd, machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "linear.json"


def record(row: dict) -> None:
    rows = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    rows.append(row)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1))


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()


def parse_variant(text: str) -> tuple[str, str, int, str]:
    """'hedgehog-w64[:extra options]' -> (name, feature map, window, extra options)."""
    name, _, extra = text.partition(":")
    fmap, _, window = name.rpartition("-w")
    if not fmap or not window.isdigit():
        raise SystemExit(f"variant {text!r}: write MAP-wW, e.g. hedgehog-w64 (optionally :OPTIONS)")
    return name, fmap, int(window), extra.strip()


def make(name: str, fmap: str, window: int, stage: str, extra: str) -> tuple[Path, float | None]:
    """The converted model (made once) and its conversion's measured seconds."""
    tag = f"linear-{name}-{stage}" + (f"-{hashlib.sha1(extra.encode()).hexdigest()[:8]}" if extra else "")
    out = CONVERTED / tag
    if not (out / "effattn.json").exists():
        options = f"--feature-map {fmap} --window {window} " + ("--refine-steps 0" if stage == "zero" else extra)
        subprocess.run(effattn_cmd(f"convert llama --to linear {options} -o {out} --no-eval --force"), check=True)
    info = json.loads((out / "effattn.json").read_text())
    seconds = (info.get("resources") or {}).get("measured", {}).get("seconds")
    return out, seconds


def scores(model, blocks, base_top=None) -> dict:
    """Perplexity, top-1 predictions and agreement with the original's predictions `base_top` (when
    given) on blocks [N, T]."""
    import torch

    from effattn.evaluate import logp_chunks

    nll, n_pred, tops = 0.0, 0, []
    for i in range(len(blocks)):
        ids = blocks[i : i + 1]
        row = []
        for start, logp in logp_chunks(model, ids):
            nxt = ids[:, start + 1 : start + logp.shape[1] + 1, None]
            nll -= logp[:, : nxt.shape[1]].gather(-1, nxt).sum().item()
            row.append(logp.argmax(-1))
        tops.append(torch.cat(row, 1))
        n_pred += ids[:, 1:].numel()
    top = torch.cat(tops)
    out = {"perplexity": math.exp(nll / n_pred), "top": top}
    if base_top is not None:
        out["agreement"] = (top == base_top).float().mean().item()
    return out


def top_heads(folder: Path, k: int) -> list[list[int]]:
    """The K (layer, KV head) pairs of largest error in a conversion's ranking (effattn.json's head_errors)."""
    errors = json.loads((Path(folder) / "effattn.json").read_text())["conversion"].get("head_errors")
    if errors is None:
        raise SystemExit(f"{folder}: no head_errors in effattn.json; convert with --exact-heads to rank the heads")
    top = sorted(errors, key=errors.get, reverse=True)[:k]
    return sorted([int(x) for x in name.split(".")] for name in top)


def quality(args) -> None:
    import torch

    from effattn.data.corpora import load_text, token_blocks
    from effattn.io.load import load_model

    corpora = args.corpora.split(",")
    original, tok, _ = load_model("llama")
    blocks = {c: token_blocks(tok, load_text(c), args.context, args.tokens, spread=True) for c in corpora}
    with torch.inference_mode():
        measured = {c: scores(original, blocks[c]) for c in corpora}
    base, top = {c: m["perplexity"] for c, m in measured.items()}, {c: m["top"] for c, m in measured.items()}
    print("original", {c: f"{base[c]:.2f}" for c in corpora}, flush=True)
    todo = [(f"{v.partition(':')[0]} {stage}", *make(*parse_variant(v)[:3], stage, parse_variant(v)[3]), v, stage)
            for v in filter(None, args.variants.split(",")) for stage in args.stages.split(",")]
    todo += [(name, Path(path), None, path, "given") for name, _, path in
             (item.partition("=") for item in filter(None, args.models.split(",")))]
    # one row per model, K exact heads and G cached keys asked for (None: as the model's config says)
    todo = [(label, *rest, None, None) for label, *rest in todo]
    if args.exact_heads:
        todo = [(f"{row[0]} exact {k}", *row[1:5], k, None) for row in todo
                for k in map(int, args.exact_heads.split(","))]
    if args.global_cache:
        todo = [(f"{row[0]} global {g}", *row[1:6], g) for row in todo
                for g in map(int, args.global_cache.split(","))]
    model = loaded = None
    for label, path, seconds, spec, stage, exact, glob in todo:
        load = os.getloadavg()[0]
        if loaded != path:  # the rows of one model differ only in its config: loaded once
            del model
            model, _, _ = load_model(str(path), tokenizer=False)
            loaded, saved = path, (model.config.linear_exact_heads, model.config.linear_global_cache)
        model.config.linear_exact_heads = top_heads(path, exact) if exact is not None else saved[0]
        model.config.linear_global_cache = glob if glob is not None else saved[1]
        t0 = time.perf_counter()
        with torch.inference_mode():
            result = {c: {k: v for k, v in scores(model, blocks[c], top[c]).items() if k != "top"} for c in corpora}
        row = {"label": label, "spec": spec, "stage": stage, "path": str(path), "convert_s": seconds,
               "tokens": args.tokens, "context": args.context, "original": base, "scores": result,
               **({"exact_heads": model.config.linear_exact_heads} if exact is not None else {}),
               **({"global_cache": glob} if glob is not None else {}),
               "eval_s": round(time.perf_counter() - t0, 1), "load_before": load, "load_after": os.getloadavg()[0],
               "machine": machine(), "commit": commit()}
        record(row)
        print(label, {c: f"{r['perplexity']:.2f} ({r['perplexity'] / base[c]:.3f}x, agree {r['agreement']:.1%})"
                      for c, r in result.items()}, f"convert {seconds}s" if seconds else "", f"load {load:.2f}",
              flush=True)


def decode(args) -> None:
    from benchmarks.bench_mla import decode_rows

    if args.model and "=" in args.model:  # several already made models, NAME=PATH,...
        linear = [tuple(item.split("=", 1)) for item in args.model.split(",")]
    else:
        linear = [("linear", args.model or str(make(*parse_variant(args.variant)[:3], "transfer",
                                                     parse_variant(args.variant)[3])[0]))]
    decode_rows([("original", "llama"), *linear], args.contexts, args.tokens, record, mode="native", gemv=args.gemv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["quality", "decode"])
    parser.add_argument("--variants", default="hedgehog-w64", help="MAP-wW[:convert options], comma-separated")
    parser.add_argument("--stages", default="zero,transfer")
    parser.add_argument("--models", default="", help="NAME=PATH of already made models, comma-separated")
    parser.add_argument("--exact-heads", default="", help="quality: K1,K2,...: score each model once per K with the "
                        "top K heads of its conversion's ranking exact")
    parser.add_argument("--global-cache", default="", help="quality: G1,G2,...: score each model once per G with G far "
                        "keys per head kept exact by self-recall error (`linear_global_cache`, LoLA)")
    parser.add_argument("--corpora", default="shakespeare,britannica")
    parser.add_argument("--tokens", type=int, default=None, help="quality: tokens per corpus (8192); decode: steps (16)")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--contexts", default="16384")
    parser.add_argument("--variant", default="hedgehog-w64", help="decode: the linear model (converted if needed)")
    parser.add_argument("--model", default=None, help="decode: an already converted linear model instead (PATH, or "
                        "NAME=PATH,... for several)")
    parser.add_argument("--gemv", action="store_true", help="decode: both models' linear layers through effattn's "
                        "kernels/gemv")
    args = parser.parse_args()
    if args.tokens is None:
        args.tokens = 8192 if args.mode == "quality" else 16
    quality(args) if args.mode == "quality" else decode(args)


if __name__ == "__main__":
    main()
