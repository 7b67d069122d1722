"""Transformer-VQ with a few exact heads (`vq-init --exact-heads K`), zero-shot, at 2048 tokens.

    python benchmarks/bench_vq_exact_heads.py [--window 64] [--ks 0,3,9,18] [--tokens 8192] [-o bench-out]

Converts the built-in SmolLM2-135M once with `effattn vq-init llama --codebook-size 512 --window W
--exact-heads max(K)` (kept in OUT and reused), which ranks the 90 (layer, KV head) pairs by the
relative error ReRoPE + VQ causes in their attention output (against the original attention) on the
calibration text; the top K keep their original attention. A conversion
with `--exact-heads K` writes the same codebooks and keeps the top K of that ranking, so each K is
evaluated on the one folder by setting `vq_exact_heads` to the top K (K = 0 is the plain VQ model);
ReRoPE alone (`vq_quantize: false`, no codebook) closes the table.

Perplexity and top-1 agreement with the original on 8,192 tokens per held-out corpus in blocks of
2048 (`effattn eval`'s blocks), and the KV cache measured after one 2048-token block (the bytes the
returned cache holds, divided by 2048). Writes the `vq-exact-heads` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import add_zero_shot_args, machine, write_section  # noqa: E402

CORPORA = ("shakespeare", "britannica")


def top_heads(record: dict, k: int) -> list[list[int]]:
    errors = record["conversion"]["head_errors"]
    return sorted([int(x) for x in key.split(".")] for key in sorted(errors, key=errors.get, reverse=True)[:k])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--ks", default="0,3,9,18", help="numbers of exact KV heads to evaluate")
    add_zero_shot_args(ap)
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]

    import torch

    from effattn.convert import convert
    from effattn.evaluate import EvalSettings, measure
    from effattn.io.load import load_model

    torch.set_grad_enabled(False)
    folder = args.out / f"llama-vq-w{args.window}-x{max(ks)}"
    seconds = None
    if not (folder / "effattn.json").exists():
        t0 = time.perf_counter()
        convert("llama", folder, to="vq", options={"codebook_size": 512, "window": args.window, "exact_heads": max(ks), "heavy_keys": 0},
                measure=False, force=True)
        seconds = time.perf_counter() - t0
    record = json.loads((folder / "effattn.json").read_text())
    seconds = seconds or record["seconds"]
    model, tok, _ = load_model(str(folder))
    base, _, _ = load_model("llama")
    settings = EvalSettings(corpora=CORPORA, context=args.context, max_tokens=args.tokens, speed=False)

    rows, original = [], None
    variants = [(f"{k} exact" if k else "0 exact (plain VQ)", {"vq_quantize": True, "vq_exact_heads": top_heads(record, k)})
                for k in ks]
    variants.append(("ReRoPE alone (no codebook)", {"vq_quantize": False, "vq_exact_heads": []}))
    for label, overrides in variants:
        for key, value in overrides.items():
            setattr(model.config, key, value)
        report = measure(model, tok, name=label, settings=settings, baseline=base)
        original = report.baseline
        rows.append({"model": label, "exact_heads": overrides["vq_exact_heads"],
                     "ppl": dict(report.model.perplexity), "agreement": dict(report.agreement),
                     "kv_bytes_per_token": report.model.kv_bytes_per_token})
        print(json.dumps(rows[-1]), flush=True)

    plain = rows[0]["ppl"] if ks[0] == 0 else None
    lines = ["| model | KV bytes/token at 2048 tokens (measured) | " + " | ".join(f"ppl {c}" for c in CORPORA)
             + (" | " + " | ".join(f"gap closed {c}" for c in CORPORA) if plain else "")
             + " | " + " | ".join(f"top-1 agree {c}" for c in CORPORA) + " |"]
    lines.append("|" + "---|" * (2 + len(CORPORA) * (3 if plain else 2)))
    lines.append(f"| original | {original.kv_bytes_per_token:,.0f} | "
                 + " | ".join(f"{original.perplexity[c]:.2f}" for c in CORPORA)
                 + (" | " + " | ".join("100%" for _ in CORPORA) if plain else "") + " | " + " | ".join("100%" for _ in CORPORA) + " |")
    for row in rows:
        cells = [row["model"], f"{row['kv_bytes_per_token']:,.0f}"]
        cells += [f"{row['ppl'][c]:.2f} ({row['ppl'][c] / original.perplexity[c]:.3f}x)" for c in CORPORA]
        if plain:
            cells += [f"{(math.log(plain[c]) - math.log(row['ppl'][c])) / (math.log(plain[c]) - math.log(original.perplexity[c])):.1%}"
                      for c in CORPORA]
        cells += [f"{row['agreement'][c]:.1%}" for c in CORPORA]
        lines.append("| " + " | ".join(cells) + " |")
    chosen = ", ".join(f"({l}, {g})" for l, g in sorted(top_heads(record, max(ks)),
                                                         key=lambda p: -record["conversion"]["head_errors"][f"{p[0]}.{p[1]}"]))
    body = f"""## Transformer-VQ with exact heads (`vq-init --exact-heads K`), zero-shot, at 2048 tokens

`python benchmarks/bench_vq_exact_heads.py --window {args.window} --ks {args.ks} --tokens {args.tokens}`
on {machine()}.

SmolLM2-135M-Instruct, `effattn vq-init llama --codebook-size 512 --window {args.window} --exact-heads {max(ks)}`
({seconds:.0f} s to convert, ranking included): C=512 per layer and KV head, far keys at 4W. The K
KV heads whose attention output ReRoPE + VQ changes most on the calibration text keep their original
attention (full RoPE over every key); the rest are ReRoPE + VQ. One folder serves every K: `vq_exact_heads` set
to the top K of the conversion's ranking (what `--exact-heads K` writes; the codebooks do not depend on
K). Perplexity on {args.tokens:,} tokens per corpus in blocks of {args.context} (in brackets the ratio to the
original); gap closed = the share of the plain VQ model's log-perplexity gap that the exact heads
remove. KV bytes/token: the cache a forward pass over one {args.context}-token block returns, measured
(fp32), over {args.context}; the exact heads' part grows with the context, the rest does not.

{chr(10).join(lines)}

The heads in ranking order, as (layer, KV head): {chosen}.
"""
    print(body)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "original": original.perplexity, "record": record["conversion"]}, indent=1))
    if not args.no_write:
        write_section("vq-exact-heads", body)


if __name__ == "__main__":
    main()
