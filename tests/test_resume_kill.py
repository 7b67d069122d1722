"""kill -9 at every named moment of a fine-tune (effattn.killpoints), then the same command again: the
run must end with exactly the weights and the metrics log of an uninterrupted run, to the bit.

The recipe makes every piece of state matter: LoRA with dropout (the RNG), two micro-batches per step
(accelerate's accumulation counter), a warm-up and cosine schedule, evaluations and checkpoints at
steps that do not coincide, and a checkpoint kept at a time (pruning)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from safetensors.torch import load_file

from effattn.finetune import finetune, load_recipe
from effattn.io.writer import atomic_output, finish_interrupted_swap
from effattn.killpoints import ENV, POINTS, matches

from .exact import one_thread, pinned_env
from .test_finetune import write_heal_recipe

REPO = Path(__file__).resolve().parents[1]
STEPS = 8
RECIPE = [f"train.max_steps={STEPS}", "checkpoint.every=2", "checkpoint.keep=1", "eval.every=3", "optimizer.lr=1e-3",
          "train.grad_accum=2", "train.params=lora", "train.lora.dropout=0.1", "loss.ce=0.5"]

# Every point, at a step where it is reached (OUT stands for the output folder's name), and the
# checkpoint the rerun must resume from: the newest one complete at the kill (None: from the start;
# DONE: the final model was complete, nothing is left to do).
DONE = "done"
KILLS = [
    ("train.step@3", 2),  # mid-run: an optimizer step done, not logged
    ("train.logged@3", 2),
    ("eval@3", 2),
    ("checkpoint.open@4", 2),
    ("checkpoint.file:model.safetensors@4", 2),
    ("checkpoint.file:optimizer.bin@4", 2),
    ("checkpoint.file:custom_checkpoint_0.pkl@4", 2),
    ("checkpoint.state@4", 2),
    ("checkpoint.complete@4", 2),
    ("checkpoint.renamed@4", 4),
    ("checkpoint.pruning@4", 4),
    ("eval@8", 6),  # the final evaluation
    ("checkpoint.state@8", 6),  # the final checkpoint
    ("output.written:student", None),  # the student's conversion, before training
    ("output.written:OUT", 8),  # the final model, every file written, not yet in place
    ("output.swap:OUT", DONE),  # OUT renamed away, the final model not yet in its place
    ("output.swapped:OUT", DONE),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny model, a recipe, and the uninterrupted run of it in a process of its own."""
    root = tmp_path_factory.mktemp("kills")
    write_heal_recipe(root)
    reference = root / "reference"
    assert run_cli(root, reference).returncode == 0
    return root, reference


def kill_dir(root: Path, kill_at: str) -> Path:
    return root / kill_at.replace(":", "-").replace("@", "-")


@pytest.fixture(scope="module")
def kill_runs(setup, request) -> dict[str, tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]]:
    """kill_at -> (the run killed there, the same command run again), for the kill points this session
    selected. The processes are pinned to one thread, so two pairs run at a time (one per core)."""
    root, _ = setup
    wanted = [item.callspec.params["kill_at"] for item in request.session.items
              if item.originalname == test_kill_at_a_named_moment_then_rerun_ends_exactly_like_the_uninterrupted_run.__name__]

    def pair(kill_at: str):
        out = kill_dir(root, kill_at)
        return run_cli(root, out, kill_at), run_cli(root, out)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(wanted, pool.map(pair, wanted)))


def run_cli(root: Path, out: Path, kill_at: str | None = None) -> subprocess.CompletedProcess:
    """The fine-tune command in a process of its own, pinned (tests/exact.py), optionally killed at `kill_at`."""
    env = pinned_env(PYTHONPATH=str(REPO))
    env.pop(ENV, None)
    if kill_at:
        env[ENV] = kill_at.replace("OUT", out.name)
    return subprocess.run([sys.executable, "-m", "effattn.cli", "finetune", str(root / "heal.yaml"), "-o", str(out),
                           *RECIPE], env=env, capture_output=True, text=True)


def weights(out: Path) -> dict:
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


def training_records(out: Path) -> list[dict]:
    """metrics.jsonl without the timing fields (tokens/s differs from run to run)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records]


def assert_same_run(out: Path, reference: Path) -> None:
    a, b = weights(out), weights(reference)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].equal(b[name]), f"{name} differs by {(a[name] - b[name]).abs().max().item():.3g}"
    assert training_records(out) == training_records(reference)  # every step and evaluation once, same numbers
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")] == []  # nothing left beside


def test_every_point_is_in_the_list():
    named = {k.split("@")[0].split(":")[0] for k, _ in KILLS}
    assert named == set(POINTS)


def test_the_same_run_twice_is_identical_to_the_bit(setup):
    """Floating point is deterministic here: the uninterrupted run in this process equals the one in
    its own process, so any difference after a kill is lost or mixed state, not rounding."""
    root, reference = setup
    with one_thread():
        again = finetune(load_recipe(root / "heal.yaml", RECIPE, output=root / "again"))
    assert again.resumed_from is None
    assert_same_run(root / "again", reference)


def test_deterministic_algorithms_are_on_for_the_run_only_and_change_nothing_on_a_cpu(setup, monkeypatch):
    import torch

    import effattn.finetune.loop as loop

    root, reference = setup
    seen = []
    real = loop.optimizer_step
    monkeypatch.setattr(loop, "optimizer_step", lambda *a, **k: seen.append(torch.are_deterministic_algorithms_enabled())
                        or real(*a, **k))
    with one_thread():
        finetune(load_recipe(root / "heal.yaml", [*RECIPE, "train.deterministic=true"], output=root / "deterministic"))
    assert seen and all(seen) and not torch.are_deterministic_algorithms_enabled()
    a, b = weights(root / "deterministic"), weights(reference)
    assert all(a[k].equal(b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at, resumes_from", KILLS, ids=[k for k, _ in KILLS])
def test_kill_at_a_named_moment_then_rerun_ends_exactly_like_the_uninterrupted_run(setup, kill_runs, kill_at,
                                                                                   resumes_from):
    root, reference = setup
    out = kill_dir(root, kill_at)
    killed, resumed = kill_runs[kill_at]  # killed at kill_at, then the same command again
    assert killed.returncode == -signal.SIGKILL, f"never reached {kill_at}: {killed.stderr[-500:]}"
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    said = resumed.stdout + resumed.stderr
    if resumes_from == DONE:
        assert "nothing to do" in said and "resuming" not in said
    else:  # nothing complete is lost, nothing partial is used
        resumed_from = re.findall(r"resuming from step-\d+ \(step (\d+)\)", said)
        assert resumed_from == ([] if resumes_from is None else [str(resumes_from)])
    assert_same_run(out, reference)
    assert json.loads((out / "effattn.json").read_text())["finetune"]["steps"] == STEPS


def test_a_replacement_cut_short_is_finished_or_undone(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "v").write_text("old")
    # killed between the two renames: the new folder was complete, so it goes into place
    (tmp_path / ".model.old-abc").mkdir()
    (out / "v").rename(tmp_path / ".model.old-abc" / "v")
    out.rmdir()
    (tmp_path / ".model.tmp-abc").mkdir()
    (tmp_path / ".model.tmp-abc" / "v").write_text("new")
    assert "finished" in finish_interrupted_swap(out)
    assert (out / "v").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    # the old folder renamed away and no complete new one: the old one comes back
    out.rename(tmp_path / ".model.old-xyz")
    assert "restored" in finish_interrupted_swap(out)
    assert (out / "v").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    # the new folder in place, the old one not yet deleted
    (tmp_path / ".model.old-q").mkdir()
    assert finish_interrupted_swap(out) is None and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    # atomic_output repairs before it writes
    (out).rename(tmp_path / ".model.old-r")
    with atomic_output(out, force=True) as tmp:
        (tmp / "v").write_text("newer")
    assert (out / "v").read_text() == "newer" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_kill_spec_names_one_point_and_optionally_one_step():
    assert matches("checkpoint.state@4", "checkpoint.state", 4)
    assert not matches("checkpoint.state@4", "checkpoint.state", 5)
    assert not matches("checkpoint.state@4", "checkpoint.state")  # a point reached outside the steps
    assert matches("eval", "eval", 7) and not matches("eval", "train.step", 7)
    assert matches("output.swap:out", "output.swap:out") and not matches("output.swap:out", "output.swap:student")


def test_resume_with_a_changed_learning_rate_trains_at_the_recorded_one(setup):
    """`--resume` after changing optimizer.lr: the steps after the checkpoint run (and are logged) at the new
    rate on the same schedule, not at the rate restored with the optimizer's state."""
    root, reference = setup
    out = root / "relr"
    assert run_cli(root, out, kill_at="train.logged@3").returncode == -9
    env = pinned_env(PYTHONPATH=str(REPO))
    env.pop(ENV, None)
    args = [a if not a.startswith("optimizer.lr=") else "optimizer.lr=2e-3" for a in RECIPE]
    done = subprocess.run([sys.executable, "-m", "effattn.cli", "finetune", str(root / "heal.yaml"), "-o", str(out),
                           *args, "--resume"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "optimizer.lr: 0.001 -> 0.002" in done.stdout + done.stderr
    ref = {r["step"]: r["lr"] for r in training_records(reference) if r["kind"] == "train"}
    new = {r["step"]: r["lr"] for r in training_records(out) if r["kind"] == "train"}
    assert new[1] == ref[1] and new[2] == ref[2]  # before the checkpoint: the first session's rate
    for step in range(3, STEPS + 1):
        assert new[step] == pytest.approx(2 * ref[step], rel=1e-6), step
    assert json.loads((out / "effattn.json").read_text())["finetune"]["recipe"]["optimizer"]["lr"] == 2e-3
