"""What `--dry-run` estimates against what the same run measures: time and the process's peak memory.

    python benchmarks/bench_estimates.py [--cases NAME,...] [--tag NAME]

Each case runs twice in fresh processes: `--dry-run --json` for the estimate, then the real command
under `/usr/bin/time -f "%e %M"` (wall seconds, peak resident set of the process). Conversions also
record both sides in `effattn.json` (`resources`: the estimate, and the seconds and peak RSS of the
conversion call itself, without the interpreter's start-up). The issue's bar: every estimate within
2x of the measurement on an idle machine. Results: benchmarks/results/estimates[-TAG].json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import ROOT, machine  # noqa: E402

CASES = {
    # name: (model, effattn arguments after the model; OUT is replaced by a fresh folder)
    "mqa-mean": ("llama", "convert {model} --to mqa --method mean --no-eval -o OUT"),
    "mqa-mean-cold": ("llama", "convert {model} --to mqa --method mean --no-eval -o OUT"),  # weights not in the page cache
    "mqa-default": ("llama", "convert {model} --to mqa --refine-steps 0 --no-eval -o OUT"),  # the default until 2026-12-05
    "mqa-default+eval": ("llama", "convert {model} --to mqa --refine-steps 0 -o OUT"),
    "mqa-pca": ("llama", "convert {model} --to mqa --method pca --refine-steps 0 --no-eval -o OUT"),
    "rerope": ("llama", "convert {model} --to rerope --window 256 --no-eval -o OUT"),
    "vq-default": ("llama", "vq-init {model} --no-eval -o OUT"),
    "vq-default+eval": ("llama", "vq-init {model} -o OUT"),
    "vq-exact18": ("llama", "vq-init {model} --exact-heads 18 --calib-tokens 8192 --no-eval -o OUT"),
    "mqa-refine": ("llama", "convert {model} --to mqa --refine-steps 10 --refine-lr 1e-4 --refine-target attention "
                           "--calib-tokens 8192 --no-eval -o OUT"),
    "big8-mean": ("big8", "convert {model} --to mqa --method mean --no-eval -o OUT"),
    "big8-calibrated": ("big8", "convert {model} --to mqa --calib-tokens 4096 --refine-steps 0 --no-eval -o OUT"),
    "big8-vq": ("big8", "vq-init {model} --codebook-size 256 --calib-tokens 4096 --no-eval -o OUT"),
    "finetune-heal": ("llama", "finetune {recipe}"),
    "mqa-refined": ("llama", "convert {model} --to mqa --no-eval -o OUT"),  # the default since 2026-12-05 (stream steps)
    # `effattn eval --dry-run` (since 2026-12-07): no effattn.json, so the ratio is against the wall time
    "eval-default": ("llama", "eval {model} --baseline {model}"),
    "eval-3-corpora": ("llama", "eval {model} --corpus shakespeare,britannica,python --no-speed"),
    "eval-2048": ("llama", "eval {model} --baseline {model} --context 2048 --no-speed"),
    "eval-speed-16k": ("llama", "eval {model} --corpus shakespeare --max-tokens 1024 --speed-context 16384"),
    "eval-bf16": ("llama", "eval {model} --baseline {model} --no-speed --dtype bfloat16"),
    "passkey-4k": ("llama", "eval {model} --task passkey --lengths 4096 --depths 0.5 --samples 2"),
}

RECIPE = """\
student: {{model: llama, convert: {{to: mqa, method: mean}}}}
data: {{sources: [mix], seq_len: 256}}
train: {{max_steps: 6, batch_size: 4}}
eval: {{every: 3, corpora: [shakespeare], tokens: 2048}}
checkpoint: {{every: 3}}
output: {out}
"""


def big_model(folder: Path) -> Path:
    """A random Llama of 8 layers, hidden 1024 (16 query / 4 KV heads of 64), 90M parameters, byte tokenizer."""
    from effattn.testing import make_model

    if (folder / "config.json").exists():
        return folder
    return make_model(folder, "llama", hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=4, head_dim=64,
                      init_std=0.02)


def evict(model: str) -> None:
    """Drop a model's weight files from the page cache (POSIX_FADV_DONTNEED), so the next read is cold."""
    from effattn.io.resolve import resolve_model

    for path in resolve_model(model).path.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run(argv: list[str], env: dict) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, stdout) of `effattn ARGV` in a fresh process."""
    with tempfile.NamedTemporaryFile("r") as timing:
        cmd = ["/usr/bin/time", "-o", timing.name, "-f", "%e %M", str(Path(sys.executable).parent / "effattn"), *argv]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode:
            raise SystemExit(f"failed: {shlex.join(argv)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        wall, peak_kib = timing.read().split()[-2:]
    return float(wall), int(peak_kib) * 1024, proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    env = dict(os.environ, NO_COLOR="1", COLUMNS="200")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name in args.cases.split(","):
            model, template = CASES[name]
            model = str(big_model(tmp / "big8")) if model == "big8" else model
            out = tmp / name
            if template.startswith("finetune"):
                recipe = tmp / f"{name}.yaml"
                recipe.write_text(textwrap.dedent(RECIPE.format(out=out)))
                argv = shlex.split(template.format(recipe=recipe))
                plan = json.loads(run(argv + ["--dry-run", "--json"], env)[2])
                est_s = sum(plan["est_seconds"].values())
                est_peak = plan["memory_bytes_per_process"]["total"]
            else:
                if name.endswith("-cold"):
                    evict(model)
                argv = [a if a != "OUT" else str(out) for a in shlex.split(template.format(model=model))]
                plan = json.loads(run(argv + ["--dry-run", "--json"], env)[2])
                est_s, est_peak = plan["est_seconds"], plan["est_peak_bytes"]
            load = os.getloadavg()[0]
            wall, peak, _ = run(argv, env)
            inner = None
            record = out / "effattn.json"
            if record.exists():
                inner = json.loads(record.read_text()).get("resources")
            row = {"case": name, "command": "effattn " + shlex.join(argv), "load_before": round(load, 2),
                   "est_seconds": round(est_s, 1), "wall_seconds": wall, "est_peak_bytes": est_peak, "peak_rss_bytes": peak,
                   "run_seconds": inner and inner["measured"]["seconds"], "run_peak_rss_bytes": inner and inner["measured"]["peak_rss_bytes"],
                   # conversions: the run's own seconds (effattn.json; the dry run's estimate excludes the start-up
                   # both pay); a fine-tune: the process's wall time
                   "time_ratio": round((inner["measured"]["seconds"] if inner and "finetune" not in name else wall)
                                       / max(est_s, 1e-9), 2),
                   "memory_ratio": round(peak / max(est_peak, 1), 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            subprocess.run(["rm", "-rf", str(out)])
    table = ["| case | est. s | run s (effattn.json) | wall s (process) | est. peak MiB | peak RSS MiB (process) | time x | memory x | load |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        run_s = "—" if r["run_seconds"] is None or "finetune" in r["case"] else format(r["run_seconds"], ",.1f")
        table.append(f"| {r['case']} | {r['est_seconds']:,.1f} | {run_s} | {r['wall_seconds']:,.1f} | "
                     f"{r['est_peak_bytes'] / 2**20:,.0f} | {r['peak_rss_bytes'] / 2**20:,.0f} | "
                     f"{r['time_ratio']:.2f} | {r['memory_ratio']:.2f} | {r['load_before']} |")
    print("\n".join(table))
    out_json = ROOT / "benchmarks" / "results" / f"estimates{'-' + args.tag if args.tag else ''}.json"
    out_json.write_text(json.dumps({"machine": machine(), "command": "python benchmarks/bench_estimates.py " + " ".join(sys.argv[1:]),
                                    "rows": rows, "table": table}, indent=1))


if __name__ == "__main__":
    main()
