"""Where a VQ model's perplexity cost comes from: quantize only some layers, keep the rest ReRoPE-exact.

    python benchmarks/vq_layer_breakdown.py OUT_FROM_VQ_INIT [--corpus britannica] [--groups 0-9,10-19,20-29]

Evaluates the converted model on 4,096 tokens (blocks of 2,048) with quantization switched on only in
each group of layers (the other layers keep every key exact, i.e. ReRoPE alone), and with none.
"""

from __future__ import annotations

import argparse
import copy
import math

import torch

from effattn.data.corpora import load_text, token_blocks
from effattn.io.load import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--corpus", default="britannica")
    ap.add_argument("--groups", default="0-9,10-19,20-29")
    args = ap.parse_args()
    model, tok, _ = load_model(args.model)
    ids = token_blocks(tok, load_text(args.corpus), 2048, 4096, spread=True)
    attns = model.vq_attention_modules()
    exact = copy.deepcopy(model.config)
    exact.vq_quantize = False

    def ppl() -> float:
        nll, n = 0.0, 0
        with torch.no_grad():
            for row in ids:
                logits = model(input_ids=row[None], use_cache=False).logits[0, :-1]
                nll += torch.nn.functional.cross_entropy(logits.float(), row[1:], reduction="sum").item()
                n += len(row) - 1
        return math.exp(nll / n)

    groups = [("none", range(0))] + [(g, range(int(g.split("-")[0]), int(g.split("-")[1]) + 1))
                                     for g in args.groups.split(",")]
    for name, layers in groups:
        for i, attn in enumerate(attns):
            attn.config = model.config if i in layers else exact
        print(f"quantized layers {name}: {args.corpus} ppl {ppl():.2f}", flush=True)


if __name__ == "__main__":
    main()
