"""One attention layer forward: causal SDPA vs Transformer-VQ, printed as a markdown table for BENCHMARKS.md.

    python benchmarks/bench_vq_attention.py --lengths 1024,4096,16384,32768 --plot vq_bench.png

The quadratic reference (vq_naive) is timed separately at --naive-lengths for comparison.
"""

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's effattn

from effattn.bench import bench_attention, format_table, machine_info, plot_bench  # noqa: E402


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="sdpa,vq", help="comma-separated, among sdpa, vq, vq_naive")
    parser.add_argument("--lengths", type=int_list, default=[1024, 4096, 16384, 32768])
    parser.add_argument("--naive-lengths", type=int_list, default=[1024], help="lengths for vq_naive; empty to skip")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--codebook-size", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--omp-wait-policy", choices=["active", "passive"], help="OMP_WAIT_POLICY of the measurements")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--plot", type=Path, help="also save a time/memory plot here (PNG)")
    args = parser.parse_args()

    settings = dict(
        heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, window=args.window,
        codebook_size=args.codebook_size, block_size=args.block_size, sinks=args.sinks,
        dtype=args.dtype, repeats=args.repeats, threads=args.threads, device=args.device,
        omp_wait_policy=args.omp_wait_policy,
    )  # fmt: skip
    load_before = os.getloadavg()[0]
    results = bench_attention(args.kinds.split(","), args.lengths, **settings)
    if args.naive_lengths:
        results += bench_attention(["vq_naive"], args.naive_lengths, **settings)
    load_after = os.getloadavg()[0]

    info = machine_info()
    threads = "/".join(str(n) for n in sorted({r["threads"] for r in results}))  # as used by the measurements
    print(f"Command: `python {shlex.join(sys.argv)}`\n")
    print(
        f"Machine: {info['cpu']}, {info['cores']} cores, {threads} torch threads, torch {info['torch']}, "
        f"Python {info['python']}{', GPU ' + info['gpu'] if 'gpu' in info else ''}; "
        f"1-minute load average {load_before:.2f} before, {load_after:.2f} after; "
        f"OMP_WAIT_POLICY {args.omp_wait_policy or os.environ.get('OMP_WAIT_POLICY', 'unset')}.\n"
    )
    print(
        f"One causal attention layer forward, batch 1, {args.heads} query heads, {args.kv_heads} key/value heads, "
        f"head_dim {args.head_dim}, {args.dtype}; VQ: window {args.window}, codebook {args.codebook_size}, "
        f"block_size {args.block_size}, sinks {args.sinks}. Median wall and process CPU time of {args.repeats} runs; "
        f"peak memory is the peak RSS growth during one forward pass over the inputs (fresh process per point), "
        f"output included.\n"
    )
    print(format_table(results))
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "results": results}, indent=2))
    if args.plot:
        plot_bench(results, args.plot)


if __name__ == "__main__":
    main()
