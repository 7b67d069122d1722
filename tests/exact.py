"""Runs that a test compares bit for bit across processes (a resumed fine-tune against an
uninterrupted one, a conversion against its reproduce line) run pinned: one thread and a fixed hash
seed, in every process of the comparison.

Why: on the CPUs CI draws, a run's floating point is not always the same from process to process
with two threads. Clean-clone runs on an Intel Xeon saw the same MQA conversion of a tiny model (the
student of the kill tests, the reproduce line's rerun) differ by 5e-7-2e-6 in about one comparison in
a hundred, MKL's reproducibility mode (MKL_CBWR) on or off, while hundreds of the same comparisons on
an AMD EPYC never differed. Whatever splits the work between threads, one thread removes it; what
these tests check is that no state is lost or mixed, which rounding on another thread count would hide
or fake. (effattn itself keeps the threads torch picks: MKL_DYNAMIC=FALSE only.)"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

PINNED = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def pinned_env(**extra: str) -> dict[str, str]:
    """os.environ for a subprocess of an exact comparison: PINNED, plus `extra`."""
    return dict(os.environ, **PINNED, **extra)


@contextmanager
def one_thread():
    """The in-process side of an exact comparison: torch (and MKL through it) on one thread, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
