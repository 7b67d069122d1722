"""The run folder: resumable checkpoints, the metrics log, and where a run starts.

While a run is in progress its output folder OUT holds

    recipe.yaml                  the resolved recipe
    metrics.jsonl                one JSON object per step ("train") and per evaluation ("eval")
    student/, student.json       the converted student, when the recipe converts first
    checkpoints/step-000050/     accelerate state (model, optimizer, scheduler, RNG of every process)
                                 + trainer_state.json (step, data position, tokens, the recipe)

A checkpoint is written into checkpoints/.tmp-step-N and renamed to step-N only after every
process has written its part and trainer_state.json (written last) is in place, so a run killed
at any moment (kill -9) leaves only complete checkpoints; old ones are renamed away before they are
deleted. The data position is the number of micro-batches consumed (see `data.BlockStream`).
At the end the final model replaces OUT atomically and the checkpoints go with the old folder.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EffattnError
from ..io.writer import clean_leftovers, disk_error, output_folder, write_json, write_text
from ..killpoints import kill_point, watching_checkpoint_files
from .config import recipe_diff

STATE_FILE = "trainer_state.json"
RUN_MARKER = ".effattn-finetune"  # in OUT from a run's start until the final model replaces OUT


class RunFolder:
    def __init__(self, out: str | Path):
        # a symbolic link OUT is the folder it leads to: --force replaces that folder and the link stays
        self.out = output_folder(out)
        self.checkpoints = self.out / "checkpoints"
        self.metrics = self.out / "metrics.jsonl"
        self.recipe = self.out / "recipe.yaml"
        self.student = self.out / "student"
        self.student_request = self.out / "student.json"
        self.curves = self.out / "curves.png"
        self.marker = self.out / RUN_MARKER
        # --force keeps the folder it replaces here, beside OUT, until the run has written its model (then it goes) or
        # has failed with an error (then it comes back); an interrupted run leaves it for the next one to finish
        self.replaced = self.out.with_name(f".{self.out.name}.replaced-by-effattn")
        given = Path(out).expanduser().absolute()  # an earlier effattn renamed a link OUT itself aside, to here:
        self.link_replaced = given.with_name(f".{given.name}.replaced-by-effattn") if given != self.out else None

    def started(self) -> bool:
        """OUT is a run of ours that has not finished (its marker, written before anything else)."""
        return self.marker.is_file()

    def complete_checkpoints(self) -> list[Path]:
        """Finished checkpoints, oldest first."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(p for p in self.checkpoints.glob("step-*") if (p / STATE_FILE).is_file())

    def latest(self) -> Path | None:
        done = self.complete_checkpoints()
        return done[-1] if done else None

    def finished(self) -> bool:
        record = self.out / "effattn.json"
        return record.is_file() and "finetune" in json.loads(record.read_text())

    def finished_recipe(self) -> dict[str, Any] | None:
        """The recipe of the finished fine-tune in OUT, or None."""
        return json.loads((self.out / "effattn.json").read_text())["finetune"].get("recipe") if self.finished() else None

    def clean_partial(self) -> None:
        """Remove what a killed run may have left half-written (main process only): temporary
        checkpoints and files in OUT, checkpoints being deleted, and beside OUT the temporary folder of a
        final model whose writing was cut short (finish_interrupted_swap has already used a complete one)."""
        clean_leftovers(self.out)  # beside OUT: a dead run's final model, never a live one's
        for parent, pattern in ((self.out, ".*tmp*"), (self.checkpoints, ".*tmp*"), (self.checkpoints, ".trash-*")):
            if parent.is_dir():
                for p in parent.glob(pattern):
                    if p.is_dir():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        p.unlink(missing_ok=True)


@dataclass
class Start:
    checkpoint: Path | None  # resume from here; None = from the beginning
    wipe: bool  # remove OUT before starting (--force, or a run killed before its first checkpoint)
    notes: list[str]
    done: bool = False  # OUT already holds this very recipe's finished fine-tune: nothing to do


def decide_start(run: RunFolder, recipe: dict[str, Any], *, resume: bool, force: bool) -> Start:
    """Where this run starts, read-only (every process decides the same; the main process acts)."""
    out = run.out
    if not out.exists():
        if resume:
            raise EffattnError(f"--resume: {out} does not exist, so there is nothing to resume", "drop --resume")
        return Start(None, False, [])
    if not out.is_dir():
        raise EffattnError(f"output path {out} exists and is not a folder", "choose another -o")
    if force:
        return Start(None, True, [f"--force: replacing {out}"])
    latest = run.latest()
    if latest is None:
        if run.finished():
            finished = run.finished_recipe() or {}
            if finished == json.loads(json.dumps(recipe, default=str)) and not resume:  # e.g. a kill after the final
                return Start(None, False, [f"{out} already holds this recipe's finished fine-tune; nothing to do"],
                             done=True)  # model was in place
            diffs = recipe_diff(finished, recipe)
            raise EffattnError(f"{out} already holds a finished fine-tune"
                               + (f" of a different recipe: {'; '.join(diffs)}" if diffs else "")
                               + (", which has no checkpoint left to resume" if resume else ""),
                               "pass --force to run again, or choose another -o")
        if resume:
            raise EffattnError(f"--resume: {out} holds no complete checkpoint",
                               "drop --resume to start from the beginning")
        if run.started():  # an earlier run of ours, killed before its first checkpoint
            return Start(None, True, [f"no checkpoint in {out} yet; starting from the beginning"])
        if any(out.iterdir()):
            raise EffattnError(f"output folder {out} already exists and is not an effattn finetune run",
                               "pass --force to replace it, or choose another -o")
        return Start(None, False, [])
    state = read_state(latest)
    diffs = recipe_diff(state["recipe"], recipe)
    if diffs and not resume:
        raise EffattnError(f"{out} holds a checkpoint (step {state['step']}) of a different recipe: {'; '.join(diffs)}",
                           "pass --resume to continue from it with this recipe, --force to start over, "
                           f"or run {run.recipe} again")
    if state["recipe"].get("optimizer", {}).get("name") != recipe.get("optimizer", {}).get("name"):
        raise EffattnError(f"{out}'s checkpoint was trained with optimizer.name "
                           f"{state['recipe'].get('optimizer', {}).get('name')!r}: its state cannot continue another optimizer",
                           "keep optimizer.name, or pass --force to start over")
    notes = [f"resuming from {latest.name} (step {state['step']})"]
    if diffs:
        notes.append(f"--resume with a changed recipe: {'; '.join(diffs)}")
    return Start(latest, False, notes)


def read_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE_FILE).read_text())


def save_checkpoint(accelerator, run: RunFolder, state: dict[str, Any], keep: int) -> Path:
    """Write a complete checkpoint of every process, atomically; keep the newest `keep`. Call on all processes."""
    step = state["step"]
    tmp = run.checkpoints / f".tmp-step-{step:06d}"
    final = run.checkpoints / f"step-{step:06d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        kill_point("checkpoint.open", step)
    accelerator.wait_for_everyone()
    quiet = logging.getLogger("accelerate.utils.other")  # "Removed shared tensor": tied weights, reloaded fine
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with watching_checkpoint_files(step):
            accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            kill_point("checkpoint.state", step)
            write_json(tmp / STATE_FILE, state)  # last: its presence marks the checkpoint complete
    except (OSError, RuntimeError) as exc:  # e.g. a full disk: torch reports "unexpected pos N vs M"
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        known = disk_error(exc, final)
        if known is None:
            raise
        last = run.complete_checkpoints()
        raise EffattnError(known.what, known.fix + (f" (it resumes from {last[-1].name})" if last else "")) from None
    finally:
        quiet.setLevel(level)
    if accelerator.is_main_process:
        kill_point("checkpoint.complete", step)
        if final.exists():
            _remove(final, step)
        tmp.rename(final)
        kill_point("checkpoint.renamed", step)
        for old in run.complete_checkpoints()[:-keep]:
            _remove(old, step)
    accelerator.wait_for_everyone()
    return final


def _remove(folder: Path, step: int | None = None) -> None:
    """Rename first, then delete: a kill mid-delete never leaves a half checkpoint named step-N."""
    trash = folder.with_name(f".trash-{folder.name}")
    shutil.rmtree(trash, ignore_errors=True)
    folder.rename(trash)
    kill_point("checkpoint.pruning", step)
    shutil.rmtree(trash, ignore_errors=True)


class MetricsLog:
    """metrics.jsonl, appended by the main process; a resumed run first drops what came after its checkpoint."""

    def __init__(self, path: Path):
        self.path = path

    def records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
        return out

    def keep_until(self, step: int) -> list[dict[str, Any]]:
        kept = [r for r in self.records() if r.get("step", 0) <= step]
        write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        return kept

    def append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
