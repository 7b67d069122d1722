"""Peak memory of conversions on synthetic models of two depths: it should follow one layer, not the model.

    python benchmarks/bench_convert_memory.py [--layers 8,32] [--hidden 1024]

Builds random Llama-style models (byte tokenizer) with the given depths, converts each to MQA with
the streaming `mean` method and with the sequential `calibrated` method, each in a fresh process,
and records wall time and peak memory. Writes the `convert-memory` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import machine, mib, run_with_peak_memory, write_section  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="8,32")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--calib-tokens", type=int, default=4096)
    args = ap.parse_args()
    from effattn.testing import make_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        calib = tmp / "calib.txt"
        from effattn.data.corpora import load_text

        calib.write_text(load_text("calib")[: args.calib_tokens * 2])
        for layers in map(int, args.layers.split(",")):
            src = make_model(tmp / f"synthetic-{layers}", "llama", layers=layers, hidden=args.hidden, heads=16,
                             kv_heads=4, head_dim=args.hidden // 16, intermediate=int(2.75 * args.hidden), init_std=0.02)
            size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
            for method in ("mean", "calibrated"):
                cmd = [sys.executable, "-m", "effattn.cli", "convert", str(src), "--to", "mqa", "--method", method,
                       "-o", str(tmp / f"out-{layers}-{method}"), "--no-eval"]
                if method == "calibrated":
                    cmd += ["--calib", str(calib), "--calib-tokens", str(args.calib_tokens)]
                m = run_with_peak_memory(cmd, env=os.environ | {"PYTHONUNBUFFERED": "1"})
                rows.append((layers, mib(size), method, f"{m['seconds']:.1f}", mib(m["RssAnon"]), mib(m["RssFile"]), mib(m["VmRSS"])))
                print(rows[-1], flush=True)
    table = "\n".join(f"| {' | '.join(map(str, r))} |" for r in rows)
    write_section("convert-memory", f"""
## Conversion memory grows with a layer, not with the model

`python benchmarks/bench_convert_memory.py --layers {args.layers} --hidden {args.hidden} --calib-tokens {args.calib_tokens}`
on {machine()}.

Random Llama-style models (hidden {args.hidden}, 16 query / 4 KV heads, fp32) of two depths, converted
to MQA in a fresh process each. `mean` streams tensor by tensor; `calibrated` runs the calibration
text through one decoder layer at a time. RssAnon is what the process allocated; RssFile is mmapped
safetensors pages (reclaimable page cache that happens to be mapped); VmRSS is their sum.

| layers | weights (MiB) | method | seconds | peak RssAnon (MiB) | peak RssFile (MiB) | peak VmRSS (MiB) |
|---|---|---|---|---|---|---|
{table}
""")


if __name__ == "__main__":
    main()
