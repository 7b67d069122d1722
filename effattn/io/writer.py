"""Write outputs so that nothing half-written is ever left behind.

`atomic_output` yields a temporary folder beside the target and renames it into place only when the
block finishes; on any error the temporary folder is removed. `SafetensorsWriter` writes a
checkpoint whose tensor shapes are declared up front: each shard's header is written first and
every tensor is then written straight to its offset, so no shard is ever buffered in memory.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
import shutil
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import EffattnError
from ..resources import gib
from ..killpoints import kill_point
from .checkpoint import SAFETENSORS_DTYPE


def output_folder(out: Path | str) -> Path:
    """The folder an output path names: its absolute path, or where it leads when it is a symbolic link (a
    link to a folder, or a dangling one). Outputs are written there, so a link OUT keeps pointing at the new
    output, and nothing that replaces OUT ever renames or deletes the link itself."""
    out = Path(out).expanduser().absolute()
    return out.resolve() if out.is_symlink() else out


def remove_path(path: Path) -> None:
    """Delete a folder, or a file or symbolic link (shutil.rmtree refuses a link, silently with ignore_errors)."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def check_output(out: Path | str, *, force: bool = False, needed_bytes: int = 0, inputs=()) -> Path:
    """Everything `atomic_output` refuses, checked without writing (a dry run calls it too): an existing
    OUT without force, OUT not a folder, too little disk, and OUT being (or holding) one of the run's
    `inputs`, which replacing it would destroy. A symbolic link OUT is checked as the folder it leads to."""
    out = output_folder(out)
    for source in inputs:
        source = Path(source).expanduser().absolute()
        if out.resolve() == source.resolve() or source.resolve().is_relative_to(out.resolve()):
            raise EffattnError(f"-o {out} is (or holds) the input {source}: writing it would destroy the input",
                               "choose another output folder")
    if out.exists() and not out.is_dir():  # --force replaces folders, never a file
        raise EffattnError(f"output path {out} exists and is not a folder", "choose another -o")
    if out.exists() and not force:
        raise EffattnError(f"output folder {out} already exists", "pass --force to replace it, or choose another -o")
    parent = next((p for p in [out.parent, *out.parents] if p.exists()), None)
    if parent is not None:
        check_writable(parent, out)
    free = shutil.disk_usage(parent).free if parent is not None else 0
    if needed_bytes and free < needed_bytes * 1.05:
        raise EffattnError(
            f"not enough disk space for {out}: {gib(needed_bytes * 1.05)} needed (the output and 5% to spare), "
            f"{gib(free)} free",
            "free some space or write to another disk with -o",
        )
    return out


def unwritable(folder: Path) -> str | None:
    """Why nothing can be created in `folder` (permissions, a read-only disk, /proc), or None: a probe folder is
    made and removed at once."""
    try:
        Path(tempfile.mkdtemp(prefix=".effattn-probe-", dir=folder)).rmdir()
    except OSError as exc:
        return str(exc.strerror or exc)
    return None


def check_writable(folder: Path, out: Path, option: str = "-o") -> None:
    """Refuse before work when nothing can be created in `folder`, the (nearest existing) folder of `out`."""
    why = unwritable(folder)
    if why:
        raise EffattnError(f"cannot write in {folder} (for {option} {out}): {why}",
                           f"choose a writable {option}, or fix the folder's permissions")


def disk_error(exc: BaseException, target: Path) -> EffattnError | None:
    """The one-line error for an OSError (or torch's RuntimeError around one) met while writing `target`:
    a full disk or quota, a read-only disk, missing permission; None for anything else."""
    code = getattr(exc, "errno", None)
    text = str(exc)
    if code in (errno.ENOSPC, errno.EDQUOT) or "unexpected pos" in text or "file write failed" in text \
            or (isinstance(exc, RuntimeError) and _nearly_full(target)):
        return EffattnError(f"the disk filled up while writing {target}", "free some space and run the same command again")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        where = getattr(exc, "filename", None) or target
        return EffattnError(f"{exc.strerror}: {where} (while writing {target})",
                            f"check the permissions of {where}, or choose a writable -o")
    return None


def _nearly_full(path: Path) -> bool:
    parent = next((p for p in [Path(path), *Path(path).parents] if p.exists()), None)
    return parent is not None and shutil.disk_usage(parent).free < 64 * 2**20


STALE_UNLOCKED_SECONDS = 60  # a temporary folder without a lock file this old is a dead run's


def _lock_of(tmp: Path) -> Path:
    """The lock file of temporary output folder `tmp` (beside it): held with flock while its writer lives."""
    return tmp.with_name(tmp.name + ".lock")


def clean_leftovers(out: Path) -> list[Path]:
    """Remove the temporary folders beside `out` (.NAME.tmp-X) that a killed run left; returns them.
    One whose writer is alive holds a lock on its lock file and is left alone."""
    out = Path(out).expanduser().absolute()
    removed = []
    for tmp in sorted(out.parent.glob(f".{out.name}.tmp-*")) if out.parent.is_dir() else []:
        if tmp.suffix == ".lock":
            if not tmp.with_suffix("").exists() and not _locked(tmp):
                tmp.unlink(missing_ok=True)  # its folder became OUT; the kill came before the lock went
            continue
        lock = _lock_of(tmp)
        if not tmp.is_dir() or (_locked(lock) if lock.exists() else _young(tmp)):
            continue
        shutil.rmtree(tmp, ignore_errors=True)
        lock.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def _young(path: Path) -> bool:
    """Made moments ago (a writer between making its folder and locking it)."""
    try:
        return time.time() - path.stat().st_mtime < STALE_UNLOCKED_SECONDS
    except FileNotFoundError:
        return True


def _locked(lock: Path) -> bool:
    """Whether a live process holds `lock` (the kernel drops a dead one's flock)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


@contextmanager
def atomic_output(out: Path | str, *, force: bool = False, needed_bytes: int = 0, inputs=()) -> Iterator[Path]:
    """Yield a fresh temporary folder that becomes `out` when the block completes without error.

    An existing `out` (with force) is replaced by two renames, out -> .NAME.old-X and
    .NAME.tmp-X -> out, and the old folder is deleted last; `finish_interrupted_swap` completes a
    replacement that a kill cut short, so no moment leaves `out` missing for good. A symbolic link `out` is
    written through: the folder it leads to is replaced and the link stays (`output_folder`).
    """
    given = Path(out).expanduser().absolute()
    out = output_folder(given)
    if out != given:  # what an earlier effattn, which swapped the link itself, left beside it
        finish_interrupted_swap(given)
    finish_interrupted_swap(out)
    clean_leftovers(out)
    check_output(out, force=force, needed_bytes=needed_bytes, inputs=inputs)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as exc:
        raise disk_error(exc, out) or exc from None
    lock_file = _lock_of(tmp)
    lock = os.open(lock_file, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies: a later run then removes tmp
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the output gets the usual permissions
    try:
        yield tmp
    except (OSError, RuntimeError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        _unlock(lock, lock_file)
        known = disk_error(exc, out)
        if known is not None:
            raise known from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _unlock(lock, lock_file)
        raise
    kill_point(f"output.written:{out.name}")
    old = None
    if out.exists():
        old = _old_name(tmp)
        out.rename(old)
        kill_point(f"output.swap:{out.name}")
    tmp.rename(out)
    _unlock(lock, lock_file)
    if old is not None:
        kill_point(f"output.swapped:{out.name}")
        remove_path(old)


def _unlock(fd: int, lock_file: Path) -> None:
    lock_file.unlink(missing_ok=True)
    os.close(fd)


def _old_name(tmp: Path) -> Path:
    """Where atomic_output puts the folder that temporary folder `tmp` replaces (same random tag)."""
    name, _, tag = tmp.name.rpartition(".tmp-")
    return tmp.with_name(f"{name}.old-{tag}")


def finish_interrupted_swap(out: Path) -> str | None:
    """Complete a replacement of `out` that a kill cut short; returns what was done, or None.

    Only a temporary folder whose old counterpart exists was complete when the swap began, so:
    `out` missing, .NAME.old-X and .NAME.tmp-X present -> the new folder is renamed into place;
    `out` missing and only .NAME.old-X -> the old folder goes back; `out` present -> the old one is
    deleted (the swap had finished). An old entry may be a symbolic link (an earlier effattn renamed a link
    OUT aside): the link is removed, never what it leads to.
    """
    out = Path(out).expanduser().absolute()
    done = None
    for old in sorted(out.parent.glob(f".{out.name}.old-*")):
        if out.exists():
            remove_path(old)
            continue
        tag = old.name.rpartition(".old-")[2]
        new = out.with_name(f".{out.name}.tmp-{tag}")
        if new.is_dir():
            new.rename(out)
            remove_path(old)
            done = f"finished writing {out}, which a kill interrupted while it replaced the old folder"
        else:
            old.rename(out)
            done = f"restored {out}, which a kill interrupted while it was being replaced"
    return done


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def parse_size(text: str | int) -> int:
    """'2GB' / '500MB' / '1.5GiB' / 12345 -> bytes."""
    if isinstance(text, int):
        return text
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    unit = t[len(num):]
    try:
        size = int(float(num) * units[unit])
    except (ValueError, KeyError, OverflowError):
        raise EffattnError(f"cannot read the size {text!r}", "write it like 2GB, 500MB or 1.5GiB") from None
    if size < 1:
        raise EffattnError(f"the size {text!r} is not positive", "write it like 2GB, 500MB or 1.5GiB")
    return size


class SafetensorsWriter:
    """Stream tensors into (possibly sharded) safetensors files in any order.

    The full list of output tensors is known before any data is written, so shards are planned up
    front (at most `max_shard_bytes` each, in declaration order), every header is written first and
    each tensor goes straight to its final offset. Memory use is one tensor.
    """

    def __init__(self, folder: Path, specs: list[TensorSpec], max_shard_bytes: int = 2 * 10**9,
                 metadata: dict[str, str] | None = None):
        self.folder = Path(folder)
        self.specs = {s.name: s for s in specs}
        shards: list[list[TensorSpec]] = [[]]
        size = 0
        for spec in specs:
            if shards[-1] and size + spec.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(spec)
            size += spec.nbytes
        n = len(shards)
        self.filenames = (["model.safetensors"] if n == 1 else
                          [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
        self._where: dict[str, tuple[Path, int]] = {}
        self._written: set[str] = set()
        for filename, shard in zip(self.filenames, shards):
            self._start_shard(self.folder / filename, shard, metadata or {"format": "pt"})
        self.weight_map = {s.name: fn for fn, shard in zip(self.filenames, shards) for s in shard}
        self.total_bytes = sum(s.nbytes for s in specs)

    def _start_shard(self, path: Path, shard: list[TensorSpec], metadata: dict[str, str]) -> None:
        header: dict[str, object] = {"__metadata__": metadata}
        offset = 0
        for spec in shard:
            header[spec.name] = {"dtype": SAFETENSORS_DTYPE[spec.dtype], "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format pads the header to 8-byte alignment
        data_start = 8 + len(raw)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            f.truncate(data_start + offset)
        for spec in shard:
            self._where[spec.name] = (path, data_start + header[spec.name]["data_offsets"][0])

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self.specs.get(name)
        if spec is None:
            raise KeyError(f"tensor {name!r} was not declared to the writer")
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, declared {spec.shape}")
        if name in self._written:
            raise ValueError(f"tensor {name} was written twice")
        path, offset = self._where[name]
        data = tensor.detach().to(device="cpu", dtype=spec.dtype).contiguous().reshape(-1)
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(data.view(torch.uint8).numpy() if data.numel() else b"")
        self._written.add(name)

    def close(self) -> None:
        """Check every declared tensor was written and write the shard index when sharded."""
        missing = [n for n in self.specs if n not in self._written]
        if missing:
            raise RuntimeError(f"{len(missing)} declared tensors were never written, e.g. {missing[0]}")
        if len(self.filenames) > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": self.weight_map}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def copy_side_files(files: list[Path], dest: Path) -> list[str]:
    copied = []
    for f in files:
        shutil.copy2(f, dest / f.name)
        copied.append(f.name)
    return copied


def write_json(path: Path, data: dict) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def temporary_file(path: Path) -> Path:
    """Where `write_text` writes `path`'s new contents before renaming them into place."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_text(path: Path, text: str) -> None:
    """Replace a file's contents atomically (UTF-8): a kill leaves the old file or the new one, never a part, and a
    failed write (a full disk) leaves no temporary file."""
    path = Path(path)
    tmp = temporary_file(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
