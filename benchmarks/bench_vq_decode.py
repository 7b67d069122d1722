"""End-to-end prefill and decode of a Transformer-VQ model against the original (issue 23).

    python benchmarks/bench_vq_decode.py --vq out/vq64,out/vq64-bf16 --contexts 8192,16384,32768 \
        --original-contexts 512,8192,16384 --old-path 8192

For each model and context, in a fresh process: plain `transformers` after `import effattn`, batch 1,
float32; a prompt of Shakespeare tokens (repeated to length) prefilled in chunks of 4,096 through the
cache, then `--tokens` cached greedy steps. Reports prefill seconds, decode tokens/s (median step after
the first) and the mean time of one attention module per layer and step (its forward, timed around
it), which shows what a layer's attention costs beside the rest of the model. `--old-path` adds rows
for the VQ model with EFFATTN_VQ_DECODE=0 (the chunk kernel for every step, as before the decode step).
`--gemv` runs every model's linear layers through effattn's matrix-vector product (kernels/gemv).
Results go to benchmarks/results/vq-decode.json (or --results).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "vq-decode.json"

RUN = r"""
import json, os, statistics, sys, time, torch
import effattn  # registers effattn_vq
from effattn.data.corpora import load_text
from effattn.evaluate import speed_prompt
from effattn.io.load import load_model
path, context, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model, tok, _ = load_model(path, tokenizer="llama")
if os.environ.get("EFFATTN_BENCH_GEMV") == "1":  # --gemv: the linear layers through kernels/gemv
    from effattn.kernels.gemv import use_for_decoding
    assert use_for_decoding(model), "kernels/gemv is unavailable"
ids = speed_prompt(tok, load_text("shakespeare"), context)
attn_time = [0.0, 0]
def timed(module):
    forward = module.forward
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        attn_time[0] += time.perf_counter() - t0
        attn_time[1] += 1
        return out
    module.forward = wrapper
with torch.inference_mode():
    t0 = time.perf_counter()
    cache = None
    for start in range(0, context, 4096):
        res = model(input_ids=ids[:, start:start + 4096], cache=cache, use_cache=True, logits_to_keep=1)
        cache = res.cache
    prefill = time.perf_counter() - t0
    for layer in model.model.layers:
        timed(layer.self_attn)
    token, times = res.logits[:, -1:].argmax(-1), []
    for i in range(steps):
        if i == 1:
            attn_time[:] = [0.0, 0]  # the first step may build the decode state: not counted
        t0 = time.perf_counter()
        step = model(input_ids=token, cache=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        cache, token = step.cache, step.logits[:, -1:].argmax(-1)
from effattn.evaluate import tensor_bytes
print(json.dumps({"prefill_s": prefill, "s_per_token": statistics.median(times[1:]), "times": times,
                  "attention_ms_per_layer": 1e3 * attn_time[0] / max(attn_time[1], 1),
                  "cache_bytes": tensor_bytes(cache)}))
"""


def machine() -> str:
    import platform

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} cores"


def run(name: str, path: str, context: int, steps: int, env: dict | None = None) -> dict:
    load = os.getloadavg()[0]
    proc = subprocess.run([sys.executable, "-c", RUN, path, str(context), str(steps)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    row = {"model": name, "context": context, "steps": steps, "load_before": load, "load_after": os.getloadavg()[0],
           **result}
    print(f"{name:>22} {context:>6}: prefill {result['prefill_s']:6.1f} s, decode {1 / result['s_per_token']:5.1f} tok/s, "
          f"attention {result['attention_ms_per_layer']:.3f} ms/layer/step, load {load:.2f}->{row['load_after']:.2f}",
          flush=True)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | context | prefill (s) | decode (tok/s) | attention per layer and step (ms) | cache (MiB) | load before -> after |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['context']:,} | {r['prefill_s']:.1f} | {1 / r['s_per_token']:.1f} | "
                     f"{r['attention_ms_per_layer']:.3f} | {r['cache_bytes'] / 2**20:,.1f} | "
                     f"{r['load_before']:.2f} -> {r['load_after']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vq", required=True, help="VQ model folders (effattn vq-init llama ...), comma-separated")
    parser.add_argument("--contexts", default="8192,16384,32768")
    parser.add_argument("--original-contexts", default="512,8192,16384")
    parser.add_argument("--tokens", type=int, default=16, help="cached greedy steps per run")
    parser.add_argument("--old-path", default="", help="contexts for EFFATTN_VQ_DECODE=0 rows (e.g. 8192)")
    parser.add_argument("--gemv", action="store_true", help="every model's linear layers through effattn's "
                        "kernels/gemv (EFFATTN_BENCH_GEMV=1 in each process)")
    parser.add_argument("--results", default=str(RESULTS), help="where the JSON goes")
    args = parser.parse_args()
    os.environ["EFFATTN_BENCH_GEMV"] = str(int(args.gemv))  # the runs inherit it
    rows = []
    for context in (int(c) for c in args.original_contexts.split(",") if c):
        rows.append(run("original", "llama", context, args.tokens))
    folders = args.vq.split(",")
    for folder in folders:
        for context in (int(c) for c in args.contexts.split(",") if c):
            rows.append(run(f"vq ({Path(folder).name})", folder, context, args.tokens))
    for context in (int(c) for c in args.old_path.split(",") if c):
        rows.append(run(f"vq ({Path(folders[0]).name}), chunk kernel per step", folders[0], context, args.tokens,
                        {"EFFATTN_VQ_DECODE": "0"}))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    Path(args.results).write_text(json.dumps({"machine": machine(), "commit": commit, "vq": args.vq,
                                              "linears": "gemv" if args.gemv else "torch", "rows": rows}, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
