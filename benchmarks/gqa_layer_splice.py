"""Where a GQA/MQA conversion loses: each converted layer's attention spliced alone into the original model,
and the original's attention spliced alone into the converted model.

    python benchmarks/gqa_layer_splice.py CONVERTED [--reference llama] [--corpora wiki,plays]
                                          [--tokens 4096] [--out FILE.json]

CONVERTED is a folder written by `effattn convert MODEL --to gqa/mqa` from the reference. Its KV heads are
expanded to the reference's count as `effattn convert --to gqa` expands heads (`gqa.mix_heads`: each copied to
the heads its queries read, which changes no logit), so either layer's attention fits the other model. For every
layer l, perplexity (blocks of 512 tokens, spread over each corpus) of:
- `only{l}`: the reference with layer l's attention converted: what layer l costs on the original's inputs;
- `allbut{l}`: the converted model with layer l's attention restored: what keeping layer l would give back.
and `none` (the reference) and `all` (the converted model). The sum of the `only` log-ratios against the `all`
log-ratio shows how much the layers' errors compound. Use training-side text (`wiki`, `plays`), never the
evaluation corpora: this is a diagnostic, not a score.

The query heads must be in the reference's order, which holds for MQA (one group) and for a GQA conversion
whose merge kept contiguous groups; the script checks the group sizes only.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from effattn.convert.gqa import mean_mixing, mix_heads
from effattn.data.corpora import load_text, token_blocks
from effattn.evaluate import corpus_scores
from effattn.io.load import load_model

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def attention_weights(model, kv_heads: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Each layer's q/k/v/o weights (copies), the k/v heads expanded to `kv_heads` (a multiple of the model's) the
    way `effattn convert --to gqa` expands them: each head copied to the heads its queries read before."""
    config = model.config
    mix = mean_mixing(config.num_attention_heads, config.num_key_value_heads, kv_heads or config.num_key_value_heads)
    out = []
    for layer in model.model.layers:
        w = {n: getattr(layer.self_attn, n).weight.detach().clone() for n in PROJECTIONS}
        for n in ("k_proj", "v_proj"):
            w[n] = mix_heads(w[n], mix, config.head_dim)
        out.append(w)
    return out


@torch.no_grad()
def splice(model, original: list[dict[str, torch.Tensor]], converted: list[dict[str, torch.Tensor]],
           converted_layers: set[int]) -> None:
    """Give `model` (the reference's shape) the converted attention in `converted_layers`, the original elsewhere."""
    for i, layer in enumerate(model.model.layers):
        src = converted[i] if i in converted_layers else original[i]
        for n in PROJECTIONS:
            getattr(layer.self_attn, n).weight.copy_(src[n])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("converted")
    ap.add_argument("--reference", default="llama")
    ap.add_argument("--corpora", default="wiki,plays")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    ref, tok, _ = load_model(args.reference)
    conv = load_model(args.converted, tokenizer=False)[0]
    old_kv, new_kv = ref.config.num_key_value_heads, conv.config.num_key_value_heads
    if old_kv % new_kv:
        raise SystemExit(f"{args.converted} has {new_kv} KV heads, not a divisor of the reference's {old_kv}")
    original, converted = attention_weights(ref), attention_weights(conv, old_kv)
    del conv
    blocks = {c: token_blocks(tok, load_text(c), 512, args.tokens, spread=True) for c in args.corpora.split(",")}
    layers = len(ref.model.layers)

    def score(converted_layers: set[int]) -> dict[str, float]:
        splice(ref, original, converted, converted_layers)
        return {c: corpus_scores(ref, b)["perplexity"] for c, b in blocks.items()}

    res: dict = {"converted": args.converted, "reference": args.reference, "tokens": args.tokens,
                 "none": score(set()), "all": score(set(range(layers)))}
    for i in range(layers):
        res[f"only{i}"] = score({i})
        res[f"allbut{i}"] = score(set(range(layers)) - {i})
        print(i, res[f"only{i}"], res[f"allbut{i}"], flush=True)
    summary = {}
    for c in blocks:
        total = math.log(res["all"][c] / res["none"][c])
        only = [math.log(res[f"only{i}"][c] / res["none"][c]) for i in range(layers)]
        back = [math.log(res["all"][c] / res[f"allbut{i}"][c]) for i in range(layers)]
        summary[c] = {"ratio": res["all"][c] / res["none"][c], "log_ratio": total, "sum_only": sum(only),
                      "largest_only": max(only), "largest_restore": max(back),
                      "largest_restore_layer": max(range(layers), key=back.__getitem__),
                      "best5_restore_share": sum(sorted(back)[-5:]) / total}
    res["summary"] = summary
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
