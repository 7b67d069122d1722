"""Where two models' perplexities differ: per evaluation block, with and without a BOS token in front.

    python benchmarks/block_spread.py MODEL [MODEL ...] [--corpora shakespeare,britannica,python] [--tokens 8192] [--context 512]

Scores each model on the blocks `effattn eval` uses (8,192 tokens per corpus in blocks of 512, evenly spread
over the corpus): once as `effattn eval` does (a block starts mid-text, no special token), once with the
tokenizer's BOS token put in front of every block (the BOS position itself is not scored, so both runs score
the same 511 next tokens per block). Prints one JSON line per model and corpus: the perplexity both ways and
the mean next-token loss of every block, so a corpus perplexity that one or two blocks carry shows as such.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from effattn.data.corpora import load_text, token_blocks
from effattn.evaluate import log_probs, target_nll
from effattn.io.load import load_model


@torch.no_grad()
def block_losses(model, blocks: torch.Tensor, bos: int | None) -> list[float]:
    """Mean next-token loss of every block [N, T] (effattn eval's log_probs and target_nll); with `bos`, the
    model reads that token first and the BOS position's own prediction is left out (same targets)."""
    out = []
    for block in blocks:
        ids = block[None] if bos is None else torch.cat([torch.tensor([bos]), block])[None]
        skip = ids.shape[1] - len(block)
        out.append(target_nll(log_probs(model, ids)[:, skip:], ids[:, skip:]) / (len(block) - 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--corpora", default="shakespeare,britannica,python")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    for path in args.models:
        model, tok, _ = load_model(path)
        if tok.bos_token_id is None:
            raise SystemExit(f"{path}: its tokenizer has no BOS token, so there is nothing to put in front")
        for corpus in args.corpora.split(","):
            blocks = token_blocks(tok, load_text(corpus), args.context, args.tokens, spread=True)
            plain, bos = block_losses(model, blocks, None), block_losses(model, blocks, tok.bos_token_id)
            print(json.dumps({"model": path, "corpus": corpus, "blocks": len(blocks),
                              "perplexity": round(math.exp(sum(plain) / len(plain)), 3),
                              "perplexity_bos": round(math.exp(sum(bos) / len(bos)), 3),
                              "block_loss": [round(x, 3) for x in plain],
                              "block_loss_bos": [round(x, 3) for x in bos]}), flush=True)


if __name__ == "__main__":
    main()
