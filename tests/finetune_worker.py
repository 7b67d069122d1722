"""Run under torchrun by test_finetune: fine-tune a recipe, then write this process's view of the result.

    torchrun --nproc_per_node 2 tests/finetune_worker.py RECIPE REPORT_DIR [KEY=VALUE ...]

Each process writes REPORT_DIR/rank{N}.json with a hash of its final state dict (weights and
buffers), so the test can check that every process ends with the same model (under fsdp only the
main process holds the whole final model: the others report none).
At exit, after the run's own exit hooks, it writes REPORT_DIR/rank{N}-exit.json: whether the process
group was still alive then. It ends as the CLI does, without the interpreter's finalization.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from aux_model import register  # noqa: E402

from effattn.finetune import finetune, load_recipe  # noqa: E402
from effattn.finetune.loop import exit_without_finalizing  # noqa: E402


def state_hash(model) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


if __name__ == "__main__":
    register()
    recipe, report = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ.get("RANK", "0"))
    report.mkdir(parents=True, exist_ok=True)
    # registered before the run, so it runs after every exit hook the run registers (last in, first out)
    atexit.register(lambda: (report / f"rank{rank}-exit.json").write_text(
        json.dumps({"group_alive": torch.distributed.is_initialized()})))
    result = finetune(load_recipe(recipe, sys.argv[3:]))
    (report / f"rank{rank}.json").write_text(json.dumps({
        "hash": state_hash(result.model) if result.model is not None else None, "wrote": result.out is not None, "steps": result.steps}))
    exit_without_finalizing(0)  # as the CLI does: a gloo thread can abort a finalizing interpreter
