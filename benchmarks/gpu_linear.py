"""Issue 17 on a GPU: attention transfer at GPU scale, then `heal-linear-gpu`, each scored on the linear
quality table's blocks.

    python benchmarks/gpu_linear.py --out results-dir --deadline 420

What the CPU could not run (BENCHMARKS.md, linear attention): the LoLCATs-sized attention transfer
(hedgehog maps, window 64, 65,536 calibration tokens in 2,048-token sequences, 100 steps per layer, the
steps on the GPU through `--refine-device cuda`), then the GPU heal recipe (LoRA r=8 on q/k/v/o plus the
maps and the mix, distilled from the original) for as long as the deadline allows. After each stage:
`effattn eval MODEL --baseline llama --context 2048 --max-tokens 8192 --device cuda`, the same blocks
as the quality table (`bench_linear.py quality`). The musts: <= 1.5x the original's perplexity after
transfer, <= 1.3x after the heal, on both held-out corpora.

The heal trains on `mix` alone: `wiki`'s cached text is keyed by the held-out texts, and the GPU image's
Python has other standard-library sources, so it would be rebuilt from the gensim sdist, which an offline
machine lacks. Records go to OUT/gpu-linear.json as each step ends (gpu_long_context.py's runner);
`--smoke` runs every step at toy sizes on the CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu_long_context import Runner  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/effattn-gpu"))
    parser.add_argument("--deadline", type=float, default=420)
    parser.add_argument("--calib-tokens", type=int, default=65536)
    parser.add_argument("--refine-steps", type=int, default=100)
    parser.add_argument("--heal-tokens", type=int, default=4_000_000, help="train.max_tokens of the heal")
    parser.add_argument("--heal-limit", type=float, default=180)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.smoke else "cuda"
    r = Runner(args.out, args.deadline, device, name="gpu-linear.json")
    lin, healed = args.work / "linear-h64-gpu", args.work / "linear-h64-gpu-healed"
    seq = 128 if args.smoke else 2048
    calib = f"--calib-tokens {args.calib_tokens} --calib-seq-len {seq} --refine-steps {args.refine_steps}"
    score = f"--baseline llama --context {seq} --max-tokens {4 * seq} --no-speed --json --device {device}"

    made = r.run("transfer: hedgehog, window 64", f"convert llama --to linear {calib} --refine-device {device} "
                 f"-o {lin} --no-eval --force", limit=240, reserve=60, parse_json=False)
    if made is None:
        return
    r.copy(lin / "effattn.json", "transfer-effattn.json")
    r.run("eval after transfer", f"eval {lin} {score}")

    over = (f"student.model={lin} student.convert=null data.sources=[mix] data.seq_len={seq} eval.seq_len={seq} "
            f"eval.tokens={4 * seq} train.max_tokens={args.heal_tokens} checkpoint.every=50 eval.every=100")
    if args.smoke:
        over += " train.batch_size=1 train.precision=fp32"
    r.finetune("heal-linear-gpu", "heal-linear-gpu", healed, over, limit=args.heal_limit, reserve=40)
    if (healed / "config.json").exists():
        r.run("eval after heal", f"eval {healed} {score}")
    r.say(f"finished with {r.left():.0f} s left")


if __name__ == "__main__":
    main()
