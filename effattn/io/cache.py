"""Where effattn keeps what it downloads and converts once (built-in models and corpora), and the lock
that lets several processes fill it at once."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_dir() -> Path:
    """`$EFFATTN_CACHE`, else `$XDG_CACHE_HOME/effattn`, else `~/.cache/effattn`."""
    if os.environ.get("EFFATTN_CACHE"):
        root = Path(os.environ["EFFATTN_CACHE"]).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "effattn"
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Hold an exclusive lock on cache entry `name` while one process fills it.

    Several processes (the ranks of a `torchrun` job, parallel test workers) may ask for the same
    download or conversion on a fresh machine; the first fills the entry, the others wait and then
    find it done. The kernel releases the flock of a process that dies, so a killed fill never
    leaves the entry locked."""
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name.replace('/', '_')}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def read_machine_record(name: str) -> dict:
    """The JSON object a measurement of this machine keeps in the cache folder as `name` ({} when it is
    missing or unreadable: the caller measures again)."""
    import json

    path = cache_dir() / name
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return {}


def write_machine_record(name: str, data: dict) -> None:
    """Keep `data` as the cache folder's `name`; a read-only cache only costs measuring again."""
    from .writer import write_json

    try:
        write_json(cache_dir() / name, data)
    except OSError:
        pass
