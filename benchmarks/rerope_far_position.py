"""ReRoPE alone at one window and several far positions (`--far-position`), zero-shot, at 2048 tokens.

    python benchmarks/rerope_far_position.py WINDOW TOKENS POSITIONS
    python benchmarks/rerope_far_position.py 64 4096 64,96,128,256

Converts SmolLM2 with `--to rerope --window WINDOW` once (weight-only) and evaluates it with
`vq_far_position` set to each position in turn, on TOKENS tokens per corpus (shakespeare,
britannica) in blocks of 2048 spread over each corpus, like bench_vq_quality.py. Prints the
perplexity ratio to the original per corpus; the numbers are quoted in BENCHMARKS.md (vq-quality).
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from effattn.convert import convert  # noqa: E402
from effattn.data.corpora import load_text, token_blocks  # noqa: E402
from effattn.evaluate import corpus_scores  # noqa: E402
from effattn.io.load import load_model  # noqa: E402


def main() -> None:
    window, tokens = int(sys.argv[1]), int(sys.argv[2])
    positions = [int(x) for x in sys.argv[3].split(",")]
    original, tok, _ = load_model("llama")
    corpora = ["shakespeare", "britannica"]
    blocks = {c: token_blocks(tok, load_text(c), 2048, tokens, spread=True) for c in corpora}
    base = {c: corpus_scores(original, blocks[c])["perplexity"] for c in corpora}
    print("original perplexity", {c: round(v, 2) for c, v in base.items()}, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = convert("llama", Path(tmp) / "rerope", to="rerope", options={"window": window}, measure=False,
                         force=True).out  # fmt: skip
        model, _, _ = load_model(folder)
        for position in positions:
            model.config.vq_far_position = position
            ratios = {c: corpus_scores(model, blocks[c])["perplexity"] / base[c] for c in corpora}
            print(f"W={window} far position {position}: " + ", ".join(f"{c} {r:.3f}x" for c, r in ratios.items()),
                  flush=True)


if __name__ == "__main__":
    main()
