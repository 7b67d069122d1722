"""Count exit aborts of resumed FSDP runs: the recipe of tests/test_distributed.py, killed at a step, then resumed.

    python benchmarks/stress_fsdp_exit.py /tmp/stress 80     # 80 kill + resume pairs, ~25 s each on 2 cores

Each pair runs tests/finetune_worker.py under `torchrun --nproc_per_node 2` twice on one output folder:
killed at train.step@4 (must fail), then resumed (must succeed). A resumed run that fails is counted and its
stderr kept in ROOT/fail-I.log; worker processes may write a core file into ROOT (the core size limit is
lifted), for `gdb -batch -ex "thread apply all bt" PYTHON ROOT/core`. Before exit_without_finalizing (loop.py)
2 of 64 resumed runs aborted at exit on 2 loaded cores; run it with other work on the cores to load them.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import test_distributed  # noqa: E402
from tests.test_finetune import write_heal_recipe  # noqa: E402

RECIPE = [*test_distributed.RECIPE, "distributed.strategy=fsdp"]


def cores() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def main() -> None:
    root, pairs = Path(sys.argv[1]), int(sys.argv[2])
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "heal.yaml").exists():
        write_heal_recipe(root, train={"max_steps": 12, "batch_size": 2}, optimizer={"lr": 3e-3},
                          eval={"every": 4, "corpora": [str(root / "held.txt")], "seq_len": 64, "tokens": 256})
    port, fails = 31000 + os.getpid() % 100 * 20, 0
    for i in range(pairs):
        for kill in ("train.step@4", None):
            env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TMPDIR=str(root), PYTHONFAULTHANDLER="1")
            env.pop("EFFATTN_KILL_AT", None)
            if kill:
                env["EFFATTN_KILL_AT"] = kill
            port += 1
            cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node", "2", "--master_port", str(port),
                   str(REPO / "tests" / "finetune_worker.py"), str(root / "heal.yaml"), str(root / f"ranks-{i}"),
                   *RECIPE, f"output={root / f'run-{i}'}"]
            start = time.time()
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=root, preexec_fn=cores)
            bad = (done.returncode != 0) != bool(kill)
            if bad:
                fails += 1
                (root / f"fail-{i}.log").write_text(done.stderr)
            print(i, kill or "resume", done.returncode, f"{time.time() - start:.1f}s", "FAIL" if bad else "ok",
                  flush=True)
        shutil.rmtree(root / f"run-{i}", ignore_errors=True)
    print(f"{fails} failed of {pairs} resumed runs")


if __name__ == "__main__":
    main()
