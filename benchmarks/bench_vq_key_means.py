"""Transformer-VQ with codes scored at their keys' mean (`vq-init --key-means`, the default) against
fixed codewords (`--no-key-means`), zero-shot, at 2048 tokens.

    python benchmarks/bench_vq_key_means.py [--window 64] [--tokens 8192] [-o bench-out]

Converts the built-in SmolLM2-135M twice with `effattn vq-init llama --codebook-size 512 --window W`,
once per setting (kept in OUT and reused): the conversion runs its calibration text through the
converted layers, so each setting's later codebooks are fitted on its own outputs. ReRoPE alone
(`vq_quantize: false` on the codeword folder: no codebook) closes the table.

Perplexity and top-1 agreement with the original on --tokens tokens per held-out corpus in blocks of
--context (`effattn eval`'s blocks); the KV cache measured after one block (the bytes the returned cache
holds, divided by its length); prefill and decode speed as `effattn eval` measures them. Writes the
`vq-key-means` section of BENCHMARKS.md.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=64)
    add_zero_shot_args(ap)
    args = ap.parse_args()

    import torch

    from effattn.convert import convert
    from effattn.evaluate import EvalSettings, measure
    from effattn.io.load import load_model

    torch.set_grad_enabled(False)
    base, _, _ = load_model("llama")
    settings = EvalSettings(corpora=CORPORA, context=args.context, max_tokens=args.tokens)
    rows, original, seconds = [], None, {}
    variants = [("codewords (`--no-key-means`)", False, True), ("key means (the default)", True, True),
                ("ReRoPE alone (no codebook)", False, False)]
    for label, key_means, quantize in variants:
        folder = args.out / f"llama-vq-w{args.window}-{'means' if key_means else 'codewords'}"
        if not (folder / "effattn.json").exists():
            t0 = time.perf_counter()
            convert("llama", folder, to="vq", measure=False, force=True,
                    options={"codebook_size": 512, "window": args.window, "key_means": key_means, "heavy_keys": 0})
            seconds[key_means] = time.perf_counter() - t0
        seconds.setdefault(key_means, json.loads((folder / "effattn.json").read_text())["seconds"])
        model, tok, _ = load_model(str(folder))
        model.config.vq_quantize = quantize
        report = measure(model, tok, name=label, settings=settings, baseline=base)
        original = report.baseline
        rows.append({"model": label, "key_means": key_means, "quantize": quantize,
                     "ppl": dict(report.model.perplexity), "agreement": dict(report.agreement),
                     "kv_bytes_per_token": report.model.kv_bytes_per_token,
                     "prefill_tokens_per_s": report.model.prefill_tokens_per_s,
                     "decode_tokens_per_s": report.model.decode_tokens_per_s})
        print(json.dumps(rows[-1]), flush=True)

    plain = rows[0]["ppl"]
    lines = ["| model | KV bytes/token at 2048 tokens (measured) | "
             + " | ".join(f"ppl {c}" for c in CORPORA) + " | "
             + " | ".join(f"gap closed {c}" for c in CORPORA) + " | "
             + " | ".join(f"top-1 agree {c}" for c in CORPORA) + " | prefill tok/s | decode tok/s |"]
    lines.append("|" + "---|" * (4 + 3 * len(CORPORA)))
    lines.append(f"| original | {original.kv_bytes_per_token:,.0f} | "
                 + " | ".join(f"{original.perplexity[c]:.2f}" for c in CORPORA) + " | "
                 + " | ".join("—" for _ in CORPORA) + " | " + " | ".join("100%" for _ in CORPORA)
                 + f" | {original.prefill_tokens_per_s:,.0f} | {original.decode_tokens_per_s:,.1f} |")
    for row in rows:
        cells = [row["model"], f"{row['kv_bytes_per_token']:,.0f}"]
        cells += [f"{row['ppl'][c]:.2f} ({row['ppl'][c] / original.perplexity[c]:.3f}x)" for c in CORPORA]
        cells += [f"{(math.log(plain[c]) - math.log(row['ppl'][c])) / (math.log(plain[c]) - math.log(original.perplexity[c])):.1%}"
                  for c in CORPORA]
        cells += [f"{row['agreement'][c]:.1%}" for c in CORPORA]
        cells += [f"{row['prefill_tokens_per_s']:,.0f}", f"{row['decode_tokens_per_s']:,.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    body = f"""## Transformer-VQ: codes scored at their keys' mean (`vq-init --key-means`), zero-shot, at {args.context} tokens

`python benchmarks/bench_vq_key_means.py --window {args.window} --tokens {args.tokens}`
on {machine()}.

SmolLM2-135M-Instruct, `effattn vq-init llama --codebook-size 512 --window {args.window}` with
`--no-key-means` ({seconds[False]:.0f} s to convert) and with key means ({seconds[True]:.0f} s): C=512 per layer and
KV head, far keys at 4W, the default calibration. With codewords every far key is scored at its code's
fixed centroid; with key means at the mean of the far keys of the sequence that share its code (the
codebook only partitions them). Perplexity on {args.tokens:,} tokens per corpus in blocks of {args.context} (in
brackets the ratio to the original); gap closed = the share of the codeword model's log-perplexity gap
removed. KV bytes/token: the cache one {args.context}-token forward pass returns, measured (fp32), over
{args.context}; a VQ cache is constant in size, so this falls with the context. Speed: `effattn eval`'s
prefill of one block and decoding of 32 tokens after it, float32 on the CPU (the compiled VQ loop).

{chr(10).join(lines)}
"""
    print(body)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "original": original.perplexity}, indent=1))
    if not args.no_write:
        write_section("vq-key-means", body)


if __name__ == "__main__":
    main()
