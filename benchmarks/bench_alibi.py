"""Why effattn refuses `--to alibi`: what replacing RoPE with ALiBi does to a RoPE-trained model, zero-shot.

    python benchmarks/bench_alibi.py [--tokens 4096] [--context 512]

ALiBi (Press et al., 2022) has no position rotation: every head adds a fixed linear penalty -m_h (i - j)
to its logits (slopes m_h = 2^(-8h/H)). A RoPE model's queries and keys are trained to be rotated; this
script measures the built-in model's perplexity on the held-out corpora with RoPE, with RoPE removed
(NoPE: cos = 1, sin = 0), and with RoPE replaced by ALiBi, all else unchanged. Writes
benchmarks/results/alibi.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import ROOT, machine  # noqa: E402


def alibi_bias(heads: int, length: int) -> torch.Tensor:
    """(1, H, T, T) additive bias: -m_h (i - j) at or below the diagonal, -inf above."""
    slopes = torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)])
    pos = torch.arange(length)
    dist = (pos[:, None] - pos[None, :]).float()
    bias = -slopes[:, None, None] * dist
    return bias.masked_fill(dist < 0, float("-inf"))[None]


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor, bias: torch.Tensor | None) -> float:
    nll, n = 0.0, 0
    for block in blocks:
        ids = block[None]
        kwargs = {"attention_mask": bias} if bias is not None else {}
        logits = model(input_ids=ids, use_cache=False, **kwargs).logits.float()
        logp = torch.log_softmax(logits[0, :-1], -1)
        nll -= logp.gather(-1, ids[0, 1:, None]).sum().item()
        n += ids.shape[1] - 1
    return math.exp(nll / n)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()

    from effattn.data.corpora import DEFAULT_EVAL, load_text, token_blocks
    from effattn.io.load import load_model

    model, tok, _ = load_model("llama")
    rotary = model.model.rotary_emb
    real_forward = rotary.forward

    def no_rotation(x, position_ids, *a, **k):
        cos, sin = real_forward(x, position_ids, *a, **k)
        return torch.ones_like(cos), torch.zeros_like(sin)

    bias = alibi_bias(model.config.num_attention_heads, args.context)
    results = {}
    t0 = time.time()
    for corpus in DEFAULT_EVAL:
        blocks = token_blocks(tok, load_text(corpus), args.context, args.tokens, spread=True)
        row = {"rope": perplexity(model, blocks, None)}
        rotary.forward = no_rotation
        try:
            row["nope"] = perplexity(model, blocks, None)
            row["alibi"] = perplexity(model, blocks, bias)
        finally:
            rotary.forward = real_forward
        results[corpus] = row
        print(corpus, {k: round(v, 2) for k, v in row.items()}, flush=True)
    out = {"machine": machine(), "context": args.context, "tokens_per_corpus": args.tokens,
           "seconds": round(time.time() - t0, 1), "perplexity": results}
    path = ROOT / "benchmarks" / "results" / "alibi.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
