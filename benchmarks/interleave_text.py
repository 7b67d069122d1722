"""Write a calibration text that interleaves built-in corpora (or text files) piece by piece.

    python benchmarks/interleave_text.py calib,wiki /tmp/calib-wiki.txt [--chars 4000]

Calibration reads the first `--calib-tokens` tokens of its text, so a text made by concatenation would
calibrate on its first corpus only. This one alternates pieces of about `--chars` characters (each cut at
the next newline) from every source in turn, until the shortest runs out. Used for the MQA calibration-
domain rows in BENCHMARKS.md (`--calib` on a mix of `calib` and `wiki`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from effattn.data.corpora import load_text


def pieces(text: str, chars: int) -> list[str]:
    """`text` in consecutive pieces of at least `chars` characters, each ending at a newline (the last at the end)."""
    out, i = [], 0
    while i < len(text):
        j = text.find("\n", i + chars)
        j = len(text) if j < 0 else j + 1
        out.append(text[i:j])
        i = j
    return out


def interleave(texts: list[str], chars: int) -> str:
    split = [pieces(t, chars) for t in texts]
    return "".join(p for group in zip(*split) for p in group)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sources", help="comma-separated corpus names or text files")
    ap.add_argument("out", type=Path)
    ap.add_argument("--chars", type=int, default=4000)
    args = ap.parse_args()
    text = interleave([load_text(s) for s in args.sources.split(",")], args.chars)
    args.out.write_text(text, encoding="utf-8")
    print(f"{args.out}: {len(text):,} characters")


if __name__ == "__main__":
    main()
