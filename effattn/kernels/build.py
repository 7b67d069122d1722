"""Build and load effattn's small C kernels (``kernels/*/native.c``) on the machine that runs them.

A library is compiled once per source, flags and CPU (``-march=native`` code is only valid on the CPU
that built it) into effattn's cache folder, by ``$CC``, ``cc`` or ``gcc``; an atomic rename lets
several processes build the same file at once. Callers fall back to their PyTorch code when this
raises (no compiler, not Linux).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-shared")


@lru_cache(maxsize=1)
def cpu_flags_line() -> str:
    """The CPU's ``flags`` line of /proc/cpuinfo ('' where there is none)."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``avx512_bf16``, ``amx_bf16``, ...)."""
    return frozenset(cpu_flags_line().partition(":")[2].split())


def machine_tag(source: Path, extra: tuple[str, ...] = ()) -> str:
    """A hash of the source, the flags and the CPU."""
    text = (source.read_bytes() + " ".join(FLAGS + tuple(extra)).encode() + platform.machine().encode()
            + cpu_flags_line().encode())
    return hashlib.sha256(text).hexdigest()[:16]


def build(source: Path, target: Path, extra: tuple[str, ...] = ()) -> None:
    """Compile `source` (with `extra` flags, e.g. ``-fopenmp``) into the shared library `target`;
    RuntimeError when it cannot."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *FLAGS, *extra, str(source), "-o", str(built), "-lm"],
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        if result.returncode:
            raise RuntimeError(f"{compiler} failed to build {source.name}: {result.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: another process may be building the same file


def load_library(source: Path, stem: str, extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The compiled `source`, built on first use as ``<cache>/kernels/<stem>-<machine tag>.so``."""
    if platform.system() != "Linux":
        raise RuntimeError("effattn's compiled kernels are built for Linux only")
    from effattn.io.cache import cache_dir

    target = cache_dir() / "kernels" / f"{stem}-{machine_tag(source, extra)}.so"
    if not target.exists():
        build(source, target, extra)
    return ctypes.CDLL(str(target))
