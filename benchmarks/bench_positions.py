"""Does a converted model hold at the positions and lengths its conversion did not see?

Two measurements on one corpus (a training corpus such as `wiki`, for diagnosis; never tune on evaluation corpora):
  * perplexity of 2,048-token blocks read at positions starting at each of --offsets (an uncached forward accepts
    any positions): the original attention does not depend on where a block starts (RoPE is relative), so a
    change with the offset is what the conversion's new parameters (linear attention's feature maps, which read
    rotated queries and keys) make of positions they were not fitted at;
  * perplexity of one --length block, per quarter of it: what a longer context adds (a longer linear state).

    python benchmarks/bench_positions.py --model /tmp/lin/spread16 --offsets 0,2048,6144 --length 8192
"""

from __future__ import annotations

import argparse
import math
import os

import torch


def nll(model, ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """−log p of every next token of ids [1, T], the block read at positions offset..offset+T-1: [T - 1]."""
    from effattn.evaluate import log_probs

    logp = log_probs(model, ids, positions=torch.arange(offset, offset + ids.shape[1])[None])
    return -logp[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]


def main() -> None:
    from effattn.data.corpora import load_text, token_blocks
    from effattn.io.load import load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--corpus", default="wiki")
    parser.add_argument("--block", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=4, help="blocks per offset (the corpus's first)")
    parser.add_argument("--offsets", default="0,2048,6144")
    parser.add_argument("--length", type=int, default=8192, help="the long block (0: none)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    print(f"load {os.getloadavg()[0]:.2f}", flush=True)
    model, tok, _ = load_model(args.model)
    text = load_text(args.corpus)
    blocks = token_blocks(tok, text, args.block, args.blocks * args.block)
    for offset in map(int, args.offsets.split(",")):
        losses = torch.cat([nll(model, b[None], offset) for b in blocks])
        print(f"{args.blocks} x {args.block} tokens at positions from {offset}: ppl {math.exp(losses.mean()):.2f}",
              flush=True)
    if args.length:
        losses = nll(model, token_blocks(tok, text, args.length, args.length))
        quarter = args.length // 4
        parts = [math.exp(losses[i * quarter:(i + 1) * quarter].mean()) for i in range(4)]
        print(f"one {args.length}-token block: ppl {math.exp(losses.mean()):.2f}; per quarter "
              + " / ".join(f"{p:.2f}" for p in parts), flush=True)


if __name__ == "__main__":
    main()
