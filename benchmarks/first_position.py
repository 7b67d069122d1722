"""The first position of a sequence in converted models: does it still become the attention sink, and how much
of the residual stream's error sits there?

    python benchmarks/first_position.py MODEL [MODEL ...] [--tokens 2000] [--blocks 6]

In SmolLM2, as in most LLMs, the first position of every sequence takes a massive activation (a hidden-state
norm ~100x the other positions') in the middle layers, and later layers' attention rests on it. A first token
attends only to itself, so its hidden state is a function of the token alone. Two measurements per model:

- `massive`: `--tokens` random token ids (seed 0), each a one-token sequence; the share whose hidden state
  reaches the massive activation: a norm of at least a quarter of the original model's median, at the layer
  where that median peaks (`peak_layer`: an index of hidden_states, 0 the embeddings, i the output of
  decoder layer i - 1). A first token that does not reach it leaves its whole sequence without a sink.
- `massive_in_text`: the same test for every distinct token of the first `--text-chars` characters of `calib`
  (training-side text, never an evaluation corpus), weighted by how often each occurs there: the share of
  positions of real text that would leave a sequence without a sink if a sequence began there; with
  `failing_in_text`, the most frequent such tokens.
- `stream_share_pos0`: on `--blocks` blocks of 512 tokens of `calib`, per layer, the share of
  Σ ‖h_model − h_original‖² (over positions, after that layer) that sits at position 0: what the `stream`
  refinement target's energy-weighted loss spends its fit on.

Prints one JSON line per model (the original first, as the reference).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch

from effattn.data.corpora import load_text, token_blocks
from effattn.io.load import load_model


def hidden(model, ids: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(model(ids, output_hidden_states=True).hidden_states)  # L + 1 of (B, T, D)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--reference", default="llama")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--text-chars", type=int, default=400_000)
    args = ap.parse_args()
    ref, tok, _ = load_model(args.reference)
    vocab = ref.config.vocab_size
    single = torch.randint(100, vocab - 100, (args.tokens, 1), generator=torch.Generator().manual_seed(0))
    calib = load_text("calib")
    blocks = token_blocks(tok, calib, 512, 512 * args.blocks)[: args.blocks]
    text_ids = tok(calib[: args.text_chars], add_special_tokens=False)["input_ids"]
    counts = Counter(text_ids)
    distinct = torch.tensor(sorted(counts))[:, None]  # (V', 1)

    def norms(model, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.stack([h[:, 0].norm(dim=-1) for h in hidden(model, ids[i : i + 2000])], 1)
                          for i in range(0, len(ids), 2000)])  # (tokens, L + 1)

    ref_norms = norms(ref, single)
    median = ref_norms.median(0).values
    peak = int(median.argmax())
    threshold = median[peak].item() / 4
    ref_states = hidden(ref, blocks)
    for path in [args.reference, *args.models]:
        model = ref if path == args.reference else load_model(path)[0]
        n = ref_norms if path == args.reference else norms(model, single)
        reached = norms(model, distinct)[:, peak] >= threshold
        failing = sorted(((counts[int(t)], int(t)) for t, ok in zip(distinct[:, 0], reached) if not ok), reverse=True)
        states = ref_states if path == args.reference else hidden(model, blocks)
        share = []
        for h, h0 in zip(states[1:], ref_states[1:]):
            err = (h - h0).pow(2).sum(-1)  # (B, T)
            share.append(round((err[:, 0].sum() / err.sum().clamp_min(1e-30)).item(), 4))
        print(json.dumps({"model": path, "tokens": args.tokens, "peak_layer": peak, "threshold_norm": round(threshold, 1),
                          "massive": round((n[:, peak] >= threshold).float().mean().item(), 4),
                          "massive_in_text": round(1 - sum(c for c, _ in failing) / len(text_ids), 4),
                          "failing_in_text": [[tok.decode([t]), c] for c, t in failing[:12]],
                          "median_norm_pos0": [round(v) for v in n.median(0).values.tolist()],
                          # the other positions of the `calib` blocks, for comparison
                          "median_norm_other": [round(h[:, 1:].norm(dim=-1).median().item()) for h in states],
                          "stream_share_pos0": share if path != args.reference else None}), flush=True)
        if model is not ref:
            del model


if __name__ == "__main__":
    main()
