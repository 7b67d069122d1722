"""Per-process memory of a heal under DDP and under FSDP, 2 CPU processes (gloo), beside the dry run's estimate.

    python benchmarks/bench_fsdp_memory.py [--steps 3] [--json benchmarks/results/fsdp-memory.json] [--no-write]

The built-in model is converted to MQA once (mean pooling, weight-only) and healed from the original
with `torchrun --nproc_per_node 2` for a few steps under each strategy. Each process reports:

  * what it holds when the first checkpoint is written (after an optimizer step): the bytes of its own
    part of the student's parameters, of the AdamW state and of the teacher's parameters, read off the
    tensors themselves (a DTensor's local shard under fsdp);
  * its resident set then (VmRSS) and its lifetime peak (VmHWM).

The dry run (`plan_finetune(recipe, 2)`) estimates the same run per process. Then the paper-scale
plans: a 7B and a 70B Llama shape given as a config.json alone, on 8 processes of 80 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import ROOT, machine, write_section  # noqa: E402

RECIPE = """\
student: {{model: {student}}}
teacher: {{model: llama}}
data: {{sources: [mix], seq_len: 256}}
train: {{max_steps: {steps}, batch_size: 2}}
eval: {{every: 0, corpora: [shakespeare], tokens: 512, seq_len: 256}}
checkpoint: {{every: {checkpoint}}}
distributed: {{strategy: {strategy}}}
output: {out}
"""


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def worker(recipe: str, report: Path) -> None:
    """Under torchrun: run the recipe, measuring at its first checkpoint."""
    import torch

    import effattn.finetune.loop as loop
    from effattn.finetune import finetune, load_recipe

    seen: dict = {}
    models = []
    real_load, real_empty, real_save = loop.load_model, loop.load_empty, loop.save_checkpoint

    def load(*args, **kwargs):
        result = real_load(*args, **kwargs)
        models.append(result[0])  # the student, then the teacher
        return result

    def empty(*args, **kwargs):  # under fsdp, the processes after the first
        models.append(real_empty(*args, **kwargs))
        return models[-1]

    def save(accelerator, run, state, keep):
        if not seen:
            student, optimizer = accelerator._models[0], accelerator._optimizers[0]
            teacher = models[1]
            seen.update(
                student_params=local_bytes(student.parameters()),
                optimizer_state=local_bytes(v for s in optimizer.state.values() for v in s.values()
                                            if isinstance(v, torch.Tensor) and v.dim() > 0),
                teacher_params=local_bytes(teacher.parameters()),
                rss_at_checkpoint=status("VmRSS"))
        return real_save(accelerator, run, state, keep)

    loop.load_model, loop.load_empty, loop.save_checkpoint = load, empty, save
    finetune(load_recipe(recipe))
    rank = int(os.environ.get("RANK", "0"))
    seen["peak_rss"] = status("VmHWM")
    (report / f"rank{rank}.json").write_text(json.dumps(seen))


def measure(strategy: str, student: Path, steps: int, work: Path) -> dict:
    from effattn.finetune import load_recipe, plan_finetune

    out = work / f"heal-{strategy}"
    recipe = work / f"{strategy}.yaml"
    recipe.write_text(RECIPE.format(student=student, steps=steps, checkpoint=max(1, steps - 1), strategy=strategy, out=out))
    report = work / f"ranks-{strategy}"
    report.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_port", "29671", __file__, "--worker",
                           str(recipe), str(report)], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{strategy} run failed:\n{done.stderr[-3000:]}")
    ranks = [json.loads((report / f"rank{r}.json").read_text()) for r in (0, 1)]
    plan = plan_finetune(load_recipe(recipe), 2, memory_check=False)
    return {"strategy": strategy, "ranks": ranks, "estimate": plan["memory_bytes_per_process"],
            "plan_strategy": plan["strategy"]}


def paper_plans(work: Path) -> list[dict]:
    from transformers import LlamaConfig

    from effattn.finetune import load_recipe, plan_finetune

    shapes = {"7B": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=32),
              "70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8)}
    rows = []
    base = ["data.seq_len=2048", "train.batch_size=1", "train.precision=bf16", "loss.chunk_tokens=1024",
            "distributed.activation_checkpointing=true"]
    cases = [("7B", "all", ["student.convert.to=gqa", "student.convert.kv_heads=8"]),
             ("7B", "lora", ["student.convert.to=gqa", "student.convert.kv_heads=8"]),
             ("70B", "all", ["student.convert.to=mqa"]), ("70B", "lora", ["student.convert.to=mqa"])]
    for name, params, convert in cases:
        folder = work / name
        if not (folder / "config.json").exists():
            LlamaConfig(vocab_size=32000, max_position_embeddings=4096, **shapes[name]).save_pretrained(folder)
        recipe = load_recipe("heal-gqa-gpu", [f"student.model={folder}", *convert, "student.convert.method=mean",
                                              f"train.params={params}", *base])
        plan = plan_finetune(recipe, 8, memory_check=False)
        rows.append({"model": name, "params": params, "student_params": plan["student"]["params"],
                     "teacher_params": plan["teacher"]["params"], "strategy": plan["strategy"],
                     "memory": plan["memory_bytes_per_process"]})
    return rows


def gib(n: float) -> str:
    return f"{n / 2**30:,.2f}"


def report(rows: list[dict], plans: list[dict], steps: int, load: str) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=ROOT).stdout.strip()
    lines = [f"`python benchmarks/bench_fsdp_memory.py --steps {steps}` at commit {commit}{' (+ uncommitted changes)' if dirty else ''} "
             f"· {machine()} · load average before: {load}",
             "",
             "SmolLM2 (MQA, mean pooling) healed from the original, fp32, 2 processes on gloo, batch 2 x 256 per process. "
             "Held: each process's own tensors at the first checkpoint (after an optimizer step). GiB per process.",
             "",
             "| strategy | process | student params held | AdamW state held | teacher params held | sum | dry run: weights + gradients + optimizer + teacher | RSS at checkpoint | peak RSS | dry run: total |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        est = row["estimate"]
        est_held = est["student_weights"] + est["gradients_and_optimizer"] + est["teacher_weights"]
        for rank, r in enumerate(row["ranks"]):
            held = r["student_params"] + r["optimizer_state"] + r["teacher_params"]
            lines.append(f"| {row['strategy']} | {rank} | {gib(r['student_params'])} | {gib(r['optimizer_state'])} | "
                         f"{gib(r['teacher_params'])} | {gib(held)} | {gib(est_held)} | "
                         f"{gib(r['rss_at_checkpoint'])} | {gib(r['peak_rss'])} | {gib(est['total'])} |")
    lines += ["", "Dry-run plans for 8 processes (`--processes 8`), bf16, 1 x 2048 tokens per micro-batch, activation "
                  "checkpointing, chunked KL, the teacher included (GiB per process):", "",
              "| model | trains | strategy | student weights | gradients + optimizer | teacher | gathered units | activations | total |",
              "|---|---|---|---|---|---|---|---|---|"]
    for p in plans:
        m = p["memory"]
        lines.append(f"| {p['model']} ({p['student_params'] / 1e9:.2f}B student, {p['teacher_params'] / 1e9:.2f}B teacher) "
                     f"| {p['params']} | {p['strategy']} | {gib(m['student_weights'])} | {gib(m['gradients_and_optimizer'])} "
                     f"| {gib(m['teacher_weights'])} | {gib(m.get('gathered_units', 0))} | {gib(m['activations'])} | "
                     f"**{gib(m['total'])}** |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "fsdp-memory.json")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], Path(args.worker[1]))
    load = f"{os.getloadavg()[0]:.2f}"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        student = work / "mqa"
        subprocess.run([sys.executable, "-m", "effattn.cli", "convert", "llama", "--to", "mqa", "--method", "mean",
                        "--no-eval", "-o", str(student)], check=True, capture_output=True)
        rows = [measure(s, student, args.steps, work) for s in ("ddp", "fsdp")]
        plans = paper_plans(work)
    body = report(rows, plans, args.steps, load)
    print(body)
    args.json.write_text(json.dumps({"machine": machine(), "load_before": load, "runs": rows, "plans": plans}, indent=2))
    if not args.no_write:
        write_section("fsdp-memory", "## Sharded healing: memory per process (DDP vs FSDP)\n\n" + body)


if __name__ == "__main__":
    main()
