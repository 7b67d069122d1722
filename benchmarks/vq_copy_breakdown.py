"""Which tokens a VQ model loses on: far repeats (copies from beyond the window) against the rest.

    python benchmarks/vq_copy_breakdown.py ZERO_SHOT [HEALED ...] [--baseline llama] [--window 64]
        [--corpora shakespeare,britannica] [--tokens 8192] [--context 2048] [--json OUT.json]

Scores every model and the baseline token by token on the evaluation blocks (the VQ tables' blocks:
`--tokens` per corpus in blocks of `--context`, spread over the corpus). A predicted token is a *far
repeat* when the pair (previous token, token) already occurred at least `--window` tokens earlier in
its block: predicting it well means retrieving a key that a VQ model quantizes (an induction-style
copy). For each model and corpus it reports the extra loss over the baseline (nats per token) on far
repeats and on all other tokens, and the share of the model's whole extra loss that the far repeats
carry.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from effattn.data.corpora import load_text, token_blocks
from effattn.io.load import load_model


def token_losses(model, blocks: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of every predicted token: [N, T-1]."""
    model.eval()
    rows = []
    with torch.no_grad():
        for ids in blocks.split(2):
            logp = F.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), dim=-1)
            rows.append(-logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0])
    return torch.cat(rows)


def far_repeats(blocks: torch.Tensor, window: int) -> torch.Tensor:
    """[N, T-1] bool: the token predicted at position t+1 continues a bigram last seen >= window back."""
    out = torch.zeros(blocks.shape[0], blocks.shape[1] - 1, dtype=torch.bool)
    for b, row in enumerate(blocks.tolist()):
        last: dict[tuple[int, int], int] = {}
        for t in range(1, len(row)):
            pair = (row[t - 1], row[t])
            if pair in last and t - last[pair] >= window:
                out[b, t - 1] = True
            last[pair] = t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--baseline", default="llama")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--corpora", default="shakespeare,britannica")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    baseline, tok, _ = load_model(args.baseline)
    corpora = args.corpora.split(",")
    blocks = {c: token_blocks(tok, load_text(c), args.context, args.tokens, spread=True) for c in corpora}
    base = {c: token_losses(baseline, blocks[c]) for c in corpora}
    repeats = {c: far_repeats(blocks[c], args.window) for c in corpora}
    del baseline
    rows = []
    for path in args.models:
        model, _, _ = load_model(path)
        for c in corpora:
            extra = token_losses(model, blocks[c]) - base[c]
            rep = repeats[c]
            rows.append({
                "model": path, "corpus": c, "far_repeat_share": rep.float().mean().item(),
                "extra_nats_far_repeats": extra[rep].mean().item(), "extra_nats_other": extra[~rep].mean().item(),
                "extra_nats_all": extra.mean().item(), "far_repeats_share_of_extra": (extra[rep].sum() / extra.sum()).item(),
            })
    print("| model | corpus | far repeats (share of tokens) | extra nats: far repeats | extra nats: other | extra nats: all | far repeats' share of the extra |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['corpus']} | {r['far_repeat_share']:.1%} | {r['extra_nats_far_repeats']:.3f} | "
              f"{r['extra_nats_other']:.3f} | {r['extra_nats_all']:.3f} | {r['far_repeats_share_of_extra']:.0%} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
