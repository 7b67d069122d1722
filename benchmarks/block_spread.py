"""Where two models' perplexities differ: per evaluation block, with and without a BOS token in front.

    python benchmarks/block_spread.py MODEL [MODEL ...] [--corpora shakespeare,britannica,python] [--tokens 8192] [--context 512]

Scores each model on the blocks `effattn eval` uses (8,192 tokens per corpus in blocks of 512, evenly spread
over the corpus): once as `effattn eval` does (a block starts mid-text, no special token), once as
`effattn eval --bos` does, with the tokenizer's BOS token (EOS where it has none) in front of every block (the
BOS position itself is not scored, so both runs score the same 511 next tokens per block). Prints one JSON line per model and corpus: the perplexity both ways and
the mean next-token loss of every block, so a corpus perplexity that one or two blocks carry shows as such.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from effattn.data.corpora import load_text, token_blocks
from effattn.evaluate import corpus_scores, prefix_token
from effattn.io.load import load_model


def block_losses(model, blocks: torch.Tensor, bos: int | None) -> list[float]:
    """Mean next-token loss of every block [N, T], scored one block at a time by `effattn eval`'s
    corpus_scores; with `bos`, as `effattn eval --bos` scores it (the same targets, one token in front)."""
    return [math.log(corpus_scores(model, block[None], prefix=bos)["perplexity"]) for block in blocks]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--corpora", default="shakespeare,britannica,python")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    for path in args.models:
        model, tok, _ = load_model(path)
        for corpus in args.corpora.split(","):
            blocks = token_blocks(tok, load_text(corpus), args.context, args.tokens, spread=True)
            plain, bos = block_losses(model, blocks, None), block_losses(model, blocks, prefix_token(tok))
            print(json.dumps({"model": path, "corpus": corpus, "blocks": len(blocks),
                              "perplexity": round(math.exp(sum(plain) / len(plain)), 3),
                              "perplexity_bos": round(math.exp(sum(bos) / len(bos)), 3),
                              "block_loss": [round(x, 3) for x in plain],
                              "block_loss_bos": [round(x, 3) for x in bos]}), flush=True)


if __name__ == "__main__":
    main()
