"""How the heavy-key budget trades cache for quality, on training-side text: one `vq-init` model scored with
`vq_heavy_keys` set at load to each budget (the codebooks stay those of the conversion).

    python benchmarks/vq_heavy_budget.py OUT --budgets 0,64,192,448 --corpus wiki

OUT is a `vq-init` folder. `wiki` (Wikipedia articles) is a training corpus of the fine-tune recipes and
never an evaluation corpus, so a budget can be weighed on it without tuning to the held-out texts. Scored
as `effattn eval --context 2048` scores (8,192 tokens in blocks of 2,048, spread over the text), against
the original model; prints and appends one JSON line per budget to --results.
"""

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a vq-init output folder")
    ap.add_argument("--budgets", default="0,64,192,448", help="comma-separated heavy keys per KV head")
    ap.add_argument("--corpus", default="wiki")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--results", default="benchmarks/results/vq-heavy-budget.jsonl")
    args = ap.parse_args()

    import effattn  # noqa: F401  (registers effattn_vq)
    from effattn.data.corpora import load_text, token_blocks
    from effattn.evaluate import corpus_scores, kv_cache_bytes
    from effattn.io.load import load_model

    original, tok, _ = load_model("llama")
    model = load_model(args.model, tokenizer=False)[0]
    blocks = token_blocks(tok, load_text(args.corpus), args.context, args.tokens, spread=True)
    for budget in (int(b) for b in args.budgets.split(",")):
        model.config.vq_heavy_keys = budget
        t0 = time.perf_counter()
        with torch.inference_mode():
            scores = corpus_scores(model, blocks, original)
            size = kv_cache_bytes(model, blocks[:1])
        row = {"model": args.model, "corpus": args.corpus, "context": args.context, "tokens": int(blocks.numel()),
               "heavy_keys": budget, "perplexity": scores["perplexity"],
               "baseline_perplexity": scores["baseline_perplexity"],
               "ratio": scores["perplexity"] / scores["baseline_perplexity"], "agreement": scores["agreement"],
               "kv_bytes_per_token": size / args.context, "seconds": round(time.perf_counter() - t0, 1)}
        print(json.dumps(row), flush=True)
        with open(args.results, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
