"""One attention layer forward: causal SDPA vs Transformer-VQ; writes the `vq-attention` section of BENCHMARKS.md.

    python benchmarks/bench_vq_attention.py --lengths 1024,4096,16384,32768 --threads 1,2 --rounds 2 \
        --plot benchmarks/results/vq-attention.png --json benchmarks/results/vq-attention.json

The quadratic reference (vq_naive) is timed separately at --naive-lengths for comparison. The same
measurement, without the markdown, is `effattn bench`.
"""

import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's effattn

from benchmarks._util import ROOT, write_section  # noqa: E402
from effattn.bench import (  # noqa: E402
    MEASURED, check_plot_path, describe, format_table, parse_kinds, parse_lengths, plot_bench, run_report,
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", type=parse_kinds, default=["sdpa", "vq"], help="comma-separated: sdpa, vq, vq_naive")
    parser.add_argument("--lengths", type=parse_lengths, default=[1024, 4096, 16384, 32768])
    parser.add_argument("--naive-lengths", type=lambda s: parse_lengths(s) if s else [], default=[1024],
                        help="lengths for vq_naive; empty to skip")  # fmt: skip
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--codebook-size", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", default=None,
                        help="torch threads, or a comma list to measure each (e.g. 1,2); default: torch's (all cores)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--omp-wait-policy", choices=["active", "passive"], help="OMP_WAIT_POLICY of the measurements")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the whole benchmark this many times in a row (other jobs on the machine vary)")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--plot", type=Path, help="also save a time/memory plot here (PNG)")
    parser.add_argument("--no-write", action="store_true", help="print the section but leave BENCHMARKS.md alone")
    args = parser.parse_args()
    if args.plot:
        check_plot_path(args.plot)

    thread_counts = [int(t) for t in args.threads.split(",")] if args.threads else [None]
    progress = lambda text: print(f"  {text}", file=sys.stderr, flush=True)  # noqa: E731
    reports = []
    for threads in thread_counts:
        settings = dict(
            heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, window=args.window,
            codebook_size=args.codebook_size, block_size=args.block_size, sinks=args.sinks,
            dtype=args.dtype, repeats=args.repeats, threads=threads, device=args.device,
            omp_wait_policy=args.omp_wait_policy,
        )  # fmt: skip
        rounds = []
        for i in range(args.rounds):
            print(f"threads {threads or 'default'}: round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)
            report = run_report(args.kinds, args.lengths, progress=progress, **settings)
            if args.naive_lengths:
                naive = run_report(["vq_naive"], args.naive_lengths, progress=progress, **settings)
                report["results"] += naive["results"]
                report["load_average"]["after"] = naive["load_average"]["after"]
            rounds.append(report)
        reports.append(combine(rounds))

    command = f"python {shlex.join(sys.argv)}"
    section = ["## One attention layer: Transformer-VQ vs SDPA (`effattn bench`)", f"`{command}`"]
    for threads, report in zip(thread_counts, reports):
        if len(thread_counts) > 1:
            section.append(f"### {threads} torch thread{'s' if threads != 1 else ''}")
        section += [
            describe(report)
            + (f" Whole benchmark run {args.rounds} times in a row; the table shows each point's median over the "
               f"rounds." if args.rounds > 1 else ""),
            format_table(report["results"]),
            *verdict(report["results"], report["rounds"]),
        ]  # fmt: skip
    section.append(
        "Speed-up is sdpa's time over the kind's at the same length; CPU speed-up compares process CPU time "
        "(all threads), less sensitive than wall time to other jobs on the machine. Peak memory includes the "
        "output tensor (last column)."
    )
    if args.json:
        runs = [{"threads": t, **r} for t, r in zip(thread_counts, reports)]
        args.json.write_text(json.dumps({"command": command, "runs": runs}, indent=2))
        section.append(f"Raw results: `{_relative(args.json)}`.")
    if args.plot:
        plot_bench(reports[-1]["results"], args.plot)
        threads = thread_counts[-1]
        section.append(f"![time and peak memory against sequence length, {threads or 'default'} thread(s)]"
                       f"({_relative(args.plot)})")  # fmt: skip
    text = "\n\n".join(section)
    print(text)
    if not args.no_write:
        write_section("vq-attention", text)


def combine(rounds: list[dict]) -> dict:
    """One report from several rounds: each point's measurements are medians over the rounds; the raw
    results of every round are kept under ``rounds``."""
    results = []
    measured = [key for key in MEASURED if key != "threads"]
    for points in zip(*(r["results"] for r in rounds)):
        results.append({**points[0], **{key: statistics.median(p[key] for p in points) for key in measured
                                         if key in points[0]}})  # e.g. density: sparse kinds only
    load = dict(before=rounds[0]["load_average"]["before"], after=rounds[-1]["load_average"]["after"])
    return {**rounds[0], "load_average": load, "results": results, "rounds": [r["results"] for r in rounds]}


def verdict(results: list[dict], rounds: list[list[dict]]) -> list[str]:
    """The issue's targets, checked against these numbers: vq >= 10x faster than sdpa at the longest length
    (goal 20x), and vq's working memory (peak less the output) flat in sequence length."""
    by = {(r["kind"], r["length"]): r for r in results}
    lengths = sorted(n for kind, n in by if kind == "vq" and ("sdpa", n) in by)
    if not lengths:
        return []
    n = lengths[-1]

    def speedups(points: list[dict]) -> tuple[float, float]:
        at = {(r["kind"], r["length"]): r for r in points}
        return tuple(at["sdpa", n][key] / at["vq", n][key] for key in ("time_s", "cpu_time_s"))

    wall, cpu = speedups(results)
    met = "met" if min(wall, cpu) >= 10 else "NOT met"
    speed = (
        f"**Speed target {met}**: at {n:,} tokens vq is {wall:.1f}x faster than sdpa in wall time and {cpu:.1f}x "
        f"in CPU time (target at least 10x, goal 20x)."
    )
    if len(rounds) > 1:
        per_round = [speedups(points) for points in rounds]
        speed += (
            f" Round by round: {', '.join(f'{w:.1f}x' for w, _ in per_round)} in wall time, "
            f"{', '.join(f'{c:.1f}x' for _, c in per_round)} in CPU time; "
            f"{sum(min(w, c) >= 10 for w, c in per_round)} of {len(rounds)} rounds reach 10x in both."
        )
    working = {kind: ", ".join(f"{(by[kind, m]['peak_mem_bytes'] - by[kind, m]['output_bytes']) / 2**20:.0f}"
                               for m in lengths) for kind in ("sdpa", "vq")}  # fmt: skip
    memory = (
        f"Working memory (peak less the output, MiB) at {', '.join(f'{m:,}' for m in lengths)} tokens: "
        f"vq {working['vq']}; sdpa {working['sdpa']}. The output itself, (T, heads, head_dim), grows with T "
        f"for every kind."
    )
    settings = by["vq", n]
    columns = settings["window"] + settings["codebook_size"] + settings["sinks"]
    work = (
        f"Work per query: sdpa scores (T + 1) / 2 keys on average ({(n + 1) / 2:,.0f} at {n:,} tokens), vq about "
        f"window + codebook + sinks = {columns} columns, so at equal arithmetic efficiency vq would be about "
        f"{(n + 1) / 2 / columns:.0f}x faster at {n:,} tokens."
    )
    return [speed, memory, work]


def _relative(path: Path) -> str:
    """The path relative to the repository root where possible (links in BENCHMARKS.md)."""
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


if __name__ == "__main__":
    main()
