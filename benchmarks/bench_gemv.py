"""Memory bandwidth of decode-step linear layers: PyTorch's linear against effattn's kernels/gemv.

    python benchmarks/bench_gemv.py [--dtypes float32,bfloat16] [--repeats 20] [--json benchmarks/results/gemv.json]

One decode step of SmolLM2-135M as its matrix-vector products alone: per layer q, k, v, o (576x576,
192x576, 192x576, 576x576) and the MLP (1536x576 twice, 576x1536), 30 layers, then the 49,152-word head:
537 MB of float32 weights (269 MB in bfloat16), more than any cache, so each step streams them from
memory, as a model's decode step does. Times the whole chain (median of --repeats) with torch's F.linear
and with kernels/gemv, each at 1 and 2 threads, and reports GB/s of weights read. The two agree within
1e-4 (float32) or 2e-2 (bfloat16, one rounding step), relative to each output's largest value.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from effattn.kernels.gemv import native

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    if not native.built():
        raise SystemExit(f"kernels/gemv does not build here: {native._why_not}")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    rows = []
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        torch.manual_seed(0)
        weights = [torch.randn(n, k).to(dtype) for _ in range(30) for n, k in SHAPES] + [torch.randn(49152, 576).to(dtype)]
        total = sum(w.numel() * w.element_size() for w in weights)
        xs = {k: torch.randn(1, k).to(dtype) for k in (576, 1536)}

        def chain(fn):
            return [fn(xs[w.shape[1]], w) for w in weights]  # noqa: B023 - run inside this iteration

        bound = 1e-4 if dtype == torch.float32 else 2e-2
        with torch.inference_mode():
            ref = chain(F.linear)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for name, fn in (("torch F.linear", F.linear),
                                 ("effattn gemv", lambda x, w: native.linear(x, w, None, threads))):  # noqa: B023
                    out = chain(fn)
                    worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(out, ref))
                    assert worst < bound, (name, dtype, worst)
                    times = []
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        chain(fn)
                        times.append(time.perf_counter() - t0)
                    s = statistics.median(times)
                    rows.append({"kind": name, "dtype": str(dtype), "threads": threads, "ms_per_step": 1e3 * s,
                                 "gb_per_s": total / s / 1e9, "max_rel_diff": worst, "weights_mb": total / 1e6})
                    print(f"{str(dtype):>14} {name:>15}, {threads} thread(s): {1e3 * s:6.1f} ms per step, "
                          f"{total / s / 1e9:5.1f} GB/s", flush=True)
    result = {"machine": f"{cpu}, {os.cpu_count()} cores", "torch": torch.__version__, "load_before": load, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
