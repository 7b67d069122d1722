"""Named moments at which a run can be made to kill itself with SIGKILL, to test exact resume.

    EFFATTN_KILL_AT=POINT          kill -9 this process the first time it reaches POINT
    EFFATTN_KILL_AT=POINT@STEP     ... when it reaches POINT at training step STEP

A SIGKILL runs no handler and flushes nothing, so what a run leaves behind is exactly what a real
`kill -9` (or a lost machine) at that moment leaves. Unset, every point costs one dictionary lookup.
The points, in the order a fine-tune passes them:

    train.step          an optimizer step is done, nothing of it is logged or saved
    train.logged        its metrics line is written
    eval                an evaluation is computed, not yet logged
    checkpoint.open     the temporary checkpoint folder exists, empty
    checkpoint.file:F   accelerate wrote file F of the checkpoint (model.safetensors, optimizer.bin,
                        scheduler.bin, random_states_0.pkl, custom_checkpoint_0.pkl)
    checkpoint.state    every process's state is written, trainer_state.json not yet
    checkpoint.complete trainer_state.json is written, the folder is not yet renamed to step-N
    checkpoint.renamed  step-N is in place, older checkpoints not yet pruned
    checkpoint.pruning  an older checkpoint is renamed to .trash-*, not yet deleted
    output.written:D    output folder D (its name: OUT's, or `student` for the converted student) is
                        complete in its temporary folder
    output.swap:D       the old folder D is renamed away, the new one not yet in place
    output.swapped:D    the new folder D is in place, the old one not yet deleted
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from pathlib import Path

ENV = "EFFATTN_KILL_AT"

POINTS = ("train.step", "train.logged", "eval", "checkpoint.open", "checkpoint.file", "checkpoint.state",
          "checkpoint.complete", "checkpoint.renamed", "checkpoint.pruning", "output.written", "output.swap",
          "output.swapped")


def armed() -> bool:
    return bool(os.environ.get(ENV))


def kill_point(name: str, step: int | None = None) -> None:
    """SIGKILL this process if EFFATTN_KILL_AT names this point (and this step, when it names one)."""
    spec = os.environ.get(ENV)
    if spec and matches(spec, name, step):
        os.kill(os.getpid(), signal.SIGKILL)


def matches(spec: str, name: str, step: int | None = None) -> bool:
    """Whether EFFATTN_KILL_AT=spec names point `name` reached at training step `step`."""
    point, _, at = spec.partition("@")
    return point == name and (not at or (step is not None and step == int(at)))


@contextmanager
def watching_checkpoint_files(step: int):
    """While armed, reach `checkpoint.file:NAME` after accelerate writes each checkpoint file NAME."""
    if not armed():
        yield
        return
    import accelerate.checkpointing as checkpointing

    real = checkpointing.save

    def save(obj, f, *args, **kwargs):
        result = real(obj, f, *args, **kwargs)
        kill_point(f"checkpoint.file:{Path(f).name}", step)
        return result

    checkpointing.save = save
    try:
        yield
    finally:
        checkpointing.save = real
