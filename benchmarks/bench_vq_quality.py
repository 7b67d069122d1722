"""SmolLM2-135M to ReRoPE and Transformer-VQ, zero-shot, evaluated at 2048 tokens.

    python benchmarks/bench_vq_quality.py [--windows 64,256] [--tokens 8192] [--variants plain,query,attention]

For each window W: ReRoPE alone (`--to rerope`), then one `vq-init` conversion (C=512) per variant:
  plain      k-means on 8K tokens of one domain (`plays`), plain key distance
  query      the default calibration mix `calib` (16K tokens: poems, technical prose, code) and the
             query-aware metric (codebooks fitted to the logit error; codes assigned the same way)
  attention  `calib` and attention-weighted k-means (`--metric attention`): every key weighted by the
             attention it receives from the queries that see it as far, under the ReRoPE model, and
             the metric the attention-weighted covariance of those queries
plain and query are evaluated without and with the per-code logit correction (code bias), query and
attention also with 4 sink positions never quantized (set at load time; the codebooks are the same).
Evaluation corpora (`shakespeare`: held-out plays, `britannica`: encyclopedic prose) are never used for
calibration. Also compares torch and scikit-learn k-means on the keys of one layer (time and error).
Writes the `vq-quality` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import machine, write_section  # noqa: E402

# conversions (vq-init options) and, for each, the settings evaluated on it (config flags at load time)
CONVERSIONS = {
    "plain": {"calib": "plays", "calib_tokens": 8192, "metric": "key", "code_bias": True},
    "query": {"metric": "query", "code_bias": True},  # the bias is fitted so both settings can be evaluated
    "attention": {"metric": "attention"},
}
EVALS = {
    "plain": [("VQ: 8K tokens of plays, key distance", {"vq_code_bias": False}),
              ("VQ: 8K tokens of plays, key distance, code bias", {"vq_code_bias": True})],
    "query": [("VQ: 16K tokens of `calib`, query metric", {"vq_code_bias": False}),
              ("VQ: `calib`, query metric, code bias", {"vq_code_bias": True}),
              ("VQ: `calib`, query metric, code bias, 4 sinks", {"vq_code_bias": True, "vq_sinks": 4})],
    "attention": [("VQ: 16K tokens of `calib`, attention-weighted k-means, far keys at 4W (the default)", {}),
                  ("VQ: `calib`, attention-weighted k-means, 4 sinks", {"vq_sinks": 4})],
}


def kmeans_comparison(layer: int = 10, tokens: int = 16384) -> list[tuple[str, str, str]]:
    """torch vs sklearn k-means (C=512) on the pre-RoPE keys of one SmolLM2 layer, 3 KV heads."""
    import torch

    from effattn.convert.kmeans import kmeans
    from effattn.data.corpora import load_text, token_blocks
    from effattn.io.load import load_model

    model, tok, _ = load_model("llama")
    ids = token_blocks(tok, load_text("calib"), 1024, tokens)
    keys = []
    attn = model.model.layers[layer].self_attn
    hook = attn.k_proj.register_forward_hook(lambda m, i, o: keys.append(o.detach()))
    with torch.no_grad():
        for i in range(0, len(ids), 4):
            model(input_ids=ids[i:i + 4], use_cache=False)
    hook.remove()
    k = torch.cat([x.reshape(-1, model.config.num_key_value_heads, attn.head_dim) for x in keys]).transpose(0, 1)
    rows = []
    for method in ("torch", "sklearn"):
        r = kmeans(k.contiguous(), 512, method=method)
        rows.append((method, f"{r.seconds:.1f}", f"{r.error:.3f}"))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", default="64,256")
    ap.add_argument("--variants", default="plain,query,attention", help="vq-init settings: " + ", ".join(CONVERSIONS))
    ap.add_argument("--corpora", default="shakespeare,britannica")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--no-kmeans", action="store_true", help="skip the torch/sklearn k-means comparison")
    args = ap.parse_args()
    from effattn.convert import convert
    from effattn.data.corpora import load_text, token_blocks
    from effattn.evaluate import corpus_scores
    from effattn.io.load import load_model

    corpora = args.corpora.split(",")
    original, tok, _ = load_model("llama")
    blocks = {c: token_blocks(tok, load_text(c), args.context, args.tokens, spread=True) for c in corpora}
    base = {c: corpus_scores(original, blocks[c])["perplexity"] for c in corpora}
    rows = [("original", "—", "—", *[f"{base[c]:.2f}" for c in corpora], *["100%" for _ in corpora])]
    print(rows[-1], flush=True)

    def measure(label, window, seconds, folder, flags=None):
        model, _, _ = load_model(folder)
        for key, value in (flags or {}).items():
            setattr(model.config, key, value)
        scores = {c: corpus_scores(model, blocks[c], original) for c in corpora}
        rows.append((label, str(window), seconds,
                     *[f"{scores[c]['perplexity']:.2f} ({scores[c]['perplexity'] / base[c]:.3f}x)" for c in corpora],
                     *[f"{scores[c]['agreement']:.1%}" for c in corpora]))
        print(rows[-1], flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        for window in [int(w) for w in args.windows.split(",")]:
            t0 = time.perf_counter()
            folder = convert("llama", Path(tmp) / f"rerope{window}", to="rerope", options={"window": window},
                             measure=False, force=True).out
            seconds = f"{time.perf_counter() - t0:.0f}"
            measure("ReRoPE only, far keys at W (classic ReRoPE)", window, seconds, folder, {"vq_far_position": window})
            measure("ReRoPE only, far keys at 4W (the default)", window, seconds, folder)
            for name in args.variants.split(","):
                t0 = time.perf_counter()
                options = {"codebook_size": 512, "window": window, "heavy_keys": 0} | CONVERSIONS[name]  # plain VQ
                folder = convert("llama", Path(tmp) / f"{name}{window}", to="vq", options=options, measure=False,
                                 force=True).out
                seconds = f"{time.perf_counter() - t0:.0f}"
                for label, flags in EVALS[name]:
                    measure(label, window, seconds, folder, flags)
    header = ["model", "W", "convert s", *[f"ppl {c}" for c in corpora], *[f"top-1 agree {c}" for c in corpora]]
    table = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                      + ["| " + " | ".join(r) + " |" for r in rows])
    km = ""
    if not args.no_kmeans:
        km_rows = kmeans_comparison()
        km = ("\nk-means implementations on the pre-RoPE keys of layer 10 (16,384 tokens of `calib`, 3 KV heads, "
              "C=512, key distance): seconds for the 3 heads and mean squared quantization error per key.\n\n"
              "| k-means | seconds | error |\n|---|---|---|\n" + "\n".join(f"| {a} | {b} | {c} |" for a, b, c in km_rows)
              + "\n")
    write_section("vq-quality", f"""
## Transformer-VQ from SmolLM2-135M-Instruct, zero-shot, at {args.context} tokens

`python benchmarks/bench_vq_quality.py --windows {args.windows} --variants {args.variants} --tokens {args.tokens}{' --no-kmeans' if args.no_kmeans else ''}`
on {machine()}.

Perplexity on {args.tokens:,} tokens per corpus in blocks of {args.context} (evenly spread over each
corpus; in brackets the ratio to the original) and top-1 agreement with the original. Codebooks:
C=512 per layer and KV head, fitted layer by layer (`effattn vq-init`); ReRoPE alone is weight-only.
Every VQ row here sees its far keys at relative position 4W (`--far-position`, the default).
"code bias" is the per-code logit correction b_c = E_q[log mean_(i in c) exp(q·(k_i − c))]: a code's keys
weigh more in the softmax than its centroid alone (Jensen), so each code logit gains b_c.
Calibration never sees the evaluation corpora. Conversion time was measured while other jobs shared
the 2 cores.

{table}
{km}""")


if __name__ == "__main__":
    main()
