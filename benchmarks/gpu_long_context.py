"""Issue 18 on a GPU: heal YaRN x2 at 16K tokens, then passkey and perplexity at long context.

    python benchmarks/gpu_long_context.py --out results-dir --deadline 540

What the CPU cannot run (BENCHMARKS.md, "RoPE scaling at 16K"): the `extend-context-gpu` recipe (YaRN x2,
16,384-token sequences, bf16) and, after it, the passkey grid at 8K and 16K and the perplexity at 16K
against the original's at 8K on the same tokens (the issue's must). Then, as long as the deadline
allows, the rows a CPU grid takes an hour for: zero-shot passkey at 16K for every RoPE-scaling type and
the original, and at 32K for YaRN x4.

Every step is `effattn ...` in a fresh process (`--device cuda` for evals), timed by wall clock; its
record (command, seconds, exit code, parsed JSON) is appended to OUT/gpu-long-context.json as soon as
it ends, so a run cut short still reports what it finished. A heal cut by the deadline is finished from
its last checkpoint (`--resume train.max_steps=<that step>` trains nothing more and writes the model).
`--smoke` runs every step at toy sizes on the CPU (a check of the script, not a measurement).
On a machine without a package index or the Hub, `benchmarks/gpu_bundle.sh` packs what it needs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
T0 = time.monotonic()


def effattn(args: str) -> list[str]:
    return [sys.executable, "-m", "effattn.cli", *shlex.split(args)]


class Runner:
    def __init__(self, out: Path, deadline: float, device: str, name: str = "gpu-long-context.json"):
        self.out, self.deadline, self.device = out, deadline, device
        self.path = out / name
        self.records: list[dict] = []
        self.log = open(out / f"{Path(name).stem}.log", "a")

    def left(self) -> float:
        return self.deadline - (time.monotonic() - T0)

    def run(self, name: str, args: str, *, limit: float | None = None, reserve: float = 0.0,
            parse_json: bool = True) -> dict | None:
        """Run `effattn ARGS` with at most `limit` seconds and never past the deadline minus `reserve`."""
        budget = self.left() - reserve
        if limit is not None:
            budget = min(budget, limit)
        if budget < 10:
            self.say(f"skip {name}: {self.left():.0f} s left")
            return None
        self.say(f"start {name} ({budget:.0f} s at most): effattn {args}")
        t0 = time.monotonic()
        try:
            proc = subprocess.run(effattn(args), capture_output=True, text=True, timeout=budget, cwd=ROOT)
            rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc = "timeout"
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        wall = time.monotonic() - t0
        record = {"name": name, "command": f"effattn {args}", "seconds": round(wall, 1), "rc": rc}
        if rc == 0 and parse_json:
            try:
                record["result"] = json.loads(stdout)
            except json.JSONDecodeError:
                record["stdout_tail"] = stdout[-2000:]
        elif rc != 0:
            record["stderr_tail"] = stderr[-3000:]
        self.records.append(record)
        self.path.write_text(json.dumps({"machine": machine(), "records": self.records}, indent=1))
        self.log.write(f"--- {name} rc={rc} {wall:.1f}s\n{stderr[-4000:]}\n")
        self.log.flush()
        self.say(f"done {name}: rc {rc}, {wall:.1f} s" + (f" · {summary(record)}" if rc == 0 else ""))
        return record if rc == 0 else None

    def copy(self, path: Path, name: str) -> None:
        """Keep `path` (a run's metrics or record) in OUT as `name`, when it exists."""
        if path.is_file():
            (self.out / name).write_bytes(path.read_bytes())

    def say(self, line: str) -> None:
        print(f"[{time.monotonic() - T0:6.1f}s] {line}", flush=True)


def summary(record: dict) -> str:
    r = record.get("result") or {}
    if "accuracy" in r:
        cells = " | ".join(f"{n}: " + " ".join(f"{v:.0%}" for v in row.values()) for n, row in r["accuracy"].items())
        return f"passkey mean {r['mean']:.0%} ({cells})"
    if "model" in r and isinstance(r["model"], dict) and "perplexity" in r["model"]:
        return "ppl " + ", ".join(f"{Path(k).name}: {v:.3f}" for k, v in r["model"]["perplexity"].items())
    return ""


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{gpu}, {os.cpu_count()} cores, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"


def span_file(corpus: str, span: int, folder: Path) -> Path:
    """The first `span` tokens (and a few more) of a held-out corpus as text (bench_long_ppl.py's spans)."""
    from effattn.data.corpora import load_text
    from effattn.io.load import load_tokenizer

    path = folder / f"{corpus}-{span}.txt"
    if not path.exists():
        tokenizer = load_tokenizer("llama")
        ids = tokenizer(load_text(corpus))["input_ids"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(tokenizer.decode(ids[: span + 64]))
    return path


def last_checkpoint(out: Path) -> int | None:
    steps = [int(p.name.split("-")[1]) for p in out.rglob("checkpoints/step-*") if p.is_dir()]
    return max(steps) if steps else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True, help="results folder (JSON record, log, curves)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/effattn-gpu"), help="models and texts")
    parser.add_argument("--deadline", type=float, default=540, help="seconds from start for everything")
    parser.add_argument("--heal-steps", type=int, default=0,
                        help="optimizer steps of extend-context-gpu (0: the recipe's own 10M tokens)")
    parser.add_argument("--heal-limit", type=float, default=330, help="seconds the heal may take at most")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="heal steps between checkpoints")
    parser.add_argument("--samples", type=int, default=4, help="passkey prompts per length and depth (healed)")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: checks the script only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.smoke else "cuda"
    r = Runner(args.out, args.deadline, device)
    dev = f"--device {device}"
    # sizes: (trained length, extended length, 32K, heal overrides)
    L8, L16, L32 = (256, 512, 1024) if args.smoke else (8192, 16384, 32768)
    heal_over = (f"data.seq_len={L16} eval.seq_len={L16} eval.tokens={2 * L16} "
                 f"checkpoint.every={args.checkpoint_every} eval.every=20")
    if args.smoke:
        heal_over += " train.grad_accum=1 train.precision=fp32"
    steps = f"train.max_steps={args.heal_steps} train.max_tokens=null " if args.heal_steps else ""
    healed = args.work / "yarn2-healed"

    # 0. the built-in model dequantized once and the held-out spans written, outside the heal's time
    from effattn.io.resolve import resolve_model

    t0 = time.monotonic()
    resolve_model("llama")
    texts = [span_file(c, L16, args.work / "texts") for c in ("shakespeare", "britannica")]
    corpora = ",".join(str(t) for t in texts)
    r.say(f"model and texts ready in {time.monotonic() - t0:.1f} s")

    # 1. the heal (the must's model)
    rec = r.run("heal yarn2 at 16K", f"finetune extend-context-gpu -o {healed} --force {steps}{heal_over}",
                limit=args.heal_limit, reserve=120, parse_json=False)
    if rec is None and not (healed / "config.json").exists():
        step = last_checkpoint(healed)
        if step:
            r.run("heal yarn2: write the model from its last checkpoint",
                  f"finetune extend-context-gpu -o {healed} --resume train.max_steps={step} train.max_tokens=null "
                  f"{heal_over}", limit=90, parse_json=False)
    r.copy(healed / "metrics.jsonl", "heal-metrics.jsonl")  # the curves and the record are in it and in the JSON

    # 2. the healed model: passkey at 8K and 16K, perplexity at 16K; the original at 8K on the same tokens
    if (healed / "config.json").exists():
        r.run("passkey healed yarn2", f"eval {healed} --task passkey --lengths {L8},{L16} --samples {args.samples} "
              f"--json {dev}")
        r.run("ppl healed yarn2 at 16K", f"eval {healed} --corpus {corpora} --context {L16} --max-tokens {L16} "
              f"--batch-size 1 --no-speed --json {dev}")
    r.run("ppl original at 8K", f"eval llama --corpus {corpora} --context {L8} --max-tokens {L16} --batch-size 1 "
          f"--no-speed --json {dev}")

    # 3. zero-shot rows: the original and every scaling type at 16K, YaRN x4 at 32K
    r.run("passkey original at 16K", f"eval llama --task passkey --lengths {L16} --samples 2 --json {dev}")
    for name, rope in (("yarn2", "yarn --factor 2"), ("dynamic2", "dynamic --factor 2"),
                       ("linear2", "linear --factor 2"), ("llama3-2", "llama3 --factor 2"),
                       ("longrope2", "longrope --factor 2"), ("yarn4", "yarn --factor 4")):
        folder = args.work / name
        made = r.run(f"convert {name}", f"convert llama --to rope-scaling --rope-type {rope} -o {folder} --force "
                     f"--no-eval", limit=60, parse_json=False)
        if made is None:
            continue
        length = L32 if name == "yarn4" else L16
        r.run(f"passkey {name} at {length}", f"eval {folder} --task passkey --lengths {length} --samples 2 --json {dev}")
        if name == "yarn4":  # x4 at 16K: found 8 of 10 at 32K (2026-12-04), more than x2 at 16K
            r.run(f"passkey {name} at {L16}", f"eval {folder} --task passkey --lengths {L16} --samples 2 --json {dev}")
    r.run("passkey healed yarn2 at 32K", f"eval {healed} --task passkey --lengths {L32} --samples 2 --json {dev}")
    r.say(f"finished with {r.left():.0f} s left")


if __name__ == "__main__":
    main()
