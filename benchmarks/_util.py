"""Shared helpers for the benchmark scripts: machine description, peak memory of a subprocess,
and writing a result section into BENCHMARKS.md (each script owns its own section)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{os.cpu_count()} cores ({cpu}){gpu}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"


def run_with_peak_memory(cmd: list[str], env: dict[str, str] | None = None, interval: float = 0.05) -> dict:
    """Run `cmd`, sampling /proc/PID/status; return wall time and the peaks of VmRSS (all resident
    memory), RssAnon (memory the process allocated) and RssFile (mapped file pages, e.g. mmapped
    safetensors, which the kernel can drop at will), in bytes."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    t0 = time.perf_counter()
    while proc.poll() is None:
        try:
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                key = line.split(":")[0]
                if key in peaks:
                    peaks[key] = max(peaks[key], int(line.split()[1]) * 1024)
        except OSError:
            pass
        time.sleep(interval)
    output = proc.stdout.read()
    if proc.returncode:
        sys.stderr.write(output)
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}")
    return {"seconds": time.perf_counter() - t0, **peaks}


def write_section(name: str, body: str) -> None:
    """Replace (or append) the section `name` of BENCHMARKS.md."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else "# Benchmarks\n\nEvery number below comes from the command shown with it, run on the machine named.\n"
    if start in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    BENCHMARKS_MD.write_text(text)


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def add_zero_shot_args(parser) -> None:
    """The evaluation, output and writing options the zero-shot VQ benchmarks share."""
    parser.add_argument("--tokens", type=int, default=8192, help="evaluation tokens per corpus")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("-o", "--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--no-write", action="store_true", help="print the table, leave BENCHMARKS.md alone")


CONVERTED = ROOT / "benchmarks" / "results" / "passkey-models"  # converted variants (git-ignored), made once


def effattn_cmd(args: str) -> list[str]:
    import shlex

    return [sys.executable, "-m", "effattn.cli", *shlex.split(args)]


def converted(name: str, recipe: str | None) -> str:
    """The built-in model converted by `recipe` (effattn arguments, e.g. "convert llama --to mqa --no-eval")
    into CONVERTED/name, made on first use; recipe None: the built-in model itself."""
    if recipe is None:
        return "llama"
    out = CONVERTED / name
    if not (out / "config.json").exists():
        CONVERTED.mkdir(parents=True, exist_ok=True)
        subprocess.run(effattn_cmd(f"{recipe} -o {out} --force"), check=True)
    return str(out)


def timed_effattn(args: str, what: str) -> tuple[str, float, float]:
    """Run `effattn ARGS` in a fresh process under /usr/bin/time: (stdout, wall seconds, peak RSS MiB)."""
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".txt") as timing:
        proc = subprocess.run(["/usr/bin/time", "-f", "%e %M", "-o", timing.name, *effattn_cmd(args)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{what} failed:\n{proc.stderr[-2000:]}")
        wall, peak_kb = timing.read().split()[-2:]
    return proc.stdout, float(wall), int(peak_kb) / 1024
