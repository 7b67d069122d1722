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
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import ROOT, effattn_cmd, machine  # noqa: E402
from benchmarks.bench_long_ppl import span_file  # noqa: E402

T0 = time.monotonic()


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
            proc = subprocess.run(effattn_cmd(args), capture_output=True, text=True, timeout=budget, cwd=ROOT)
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

    def finetune(self, name: str, recipe: str, out: Path, overrides: str, *, limit: float, reserve: float) -> bool:
        """`effattn finetune RECIPE -o OUT --force OVERRIDES` within `limit` seconds; one cut short is
        finished from its last checkpoint (`--resume train.max_steps=<its step>` trains nothing more and
        writes the model). Whether OUT holds a model; its metrics are kept in OUT as NAME-metrics.jsonl."""
        from effattn.finetune.state import RunFolder, read_state

        done = self.run(name, f"finetune {recipe} -o {out} --force {overrides}", limit=limit, reserve=reserve,
                        parse_json=False)
        latest = RunFolder(out).latest()
        if done is None and not (out / "config.json").exists() and latest is not None:
            step = read_state(latest)["step"]
            self.run(f"{name}: write the model from its last checkpoint", f"finetune {recipe} -o {out} --resume "
                     f"{overrides} train.max_steps={step} train.max_tokens=null", limit=90, parse_json=False)
        self.copy(out / "metrics.jsonl", f"{name.split()[0]}-metrics.jsonl")
        return (out / "config.json").exists()

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
    steps = f" train.max_steps={args.heal_steps} train.max_tokens=null" if args.heal_steps else ""
    healed = args.work / "yarn2-healed"

    # 0. the built-in model dequantized once and the held-out spans written, outside the heal's time
    from effattn.io.resolve import resolve_model

    t0 = time.monotonic()
    resolve_model("llama")
    texts = [span_file(c, L16, args.work / "texts") for c in ("shakespeare", "britannica")]
    corpora = ",".join(str(t) for t in texts)
    r.say(f"model and texts ready in {time.monotonic() - t0:.1f} s")

    # 1. the heal (the must's model)
    r.finetune("heal yarn2 at 16K", "extend-context-gpu", healed, heal_over + steps, limit=args.heal_limit, reserve=120)

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
