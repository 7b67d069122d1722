"""Save a loaded (e.g. fine-tuned) model as an effattn output folder, atomically.

The folder is what every effattn output is: `save_pretrained` weights and config, the tokenizer,
side files, a README.md model card and `effattn.json`, the machine-readable record. Conversions
that stream tensors use `convert.base` instead; this is for models that live in memory.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from .writer import atomic_output, write_json


def save_model(
    model: torch.nn.Module,
    tokenizer,
    out: str | Path,
    record: dict[str, Any],
    *,
    card: str | None = None,
    dtype: torch.dtype | None = None,
    force: bool = False,
    side_files: Iterable[Path] = (),
    extra_files: dict[str, Path] | None = None,
    export_code: Callable[[torch.nn.Module, Path], None] | None = None,
    max_shard_size: str = "2GB",
) -> Path:
    """Write `model` (+ tokenizer, card, record) to `out` through a temporary folder renamed at the end.

    dtype:       cast floating weights to this dtype first (e.g. back to the checkpoint's own).
    side_files:  files copied from the source folder unless save_pretrained already wrote that name
                 (chat templates, generation config, ...).
    extra_files: name -> file to place in the output too (logs, plots); hard-linked when possible.
    export_code: hook for effattn's own model classes (e.g. the VQ conversion): called as
                 export_code(model, folder) to write their modeling code and `auto_map` into config.json,
                 so the folder loads elsewhere. Native transformers models need none.
    """
    out = Path(out)
    with atomic_output(out, force=force) as tmp:
        if dtype is not None:
            model.to(dtype)
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for f in side_files:
            if not (tmp / f.name).exists():
                shutil.copy2(f, tmp / f.name)
        if export_code is not None:
            export_code(model, tmp)
        for name, src in (extra_files or {}).items():
            _link_or_copy(Path(src), tmp / name)
        if card is not None:
            (tmp / "README.md").write_text(card)
        write_json(tmp / "effattn.json", record)
        _usual_permissions(tmp)
    return out.absolute()


def _usual_permissions(folder: Path) -> None:
    """Some writers create private (0600) files; an output folder gets the user's usual file mode."""
    umask = os.umask(0)
    os.umask(umask)
    for f in folder.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link (instant, and the source stays intact until the rename), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
