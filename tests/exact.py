"""Runs that a test compares bit for bit across processes (a resumed fine-tune against an
uninterrupted one, a conversion against its reproduce line) run pinned: one thread and a fixed hash
seed, in every process of the comparison.

Why: clean-clone runs failed such a comparison in three of four (two on an Intel Xeon, one in CI),
with MKL's reproducibility mode (MKL_CBWR) off and on. Each time one comparison of about twenty differed, by
5e-7 to 2e-6: a resumed fine-tune, or the reproduce line's rerun of an MQA conversion (two processes,
neither of them pytest). On an AMD EPYC, 26 fine-tunes and 6 conversions in processes of their own
were bit-identical. Whatever splits the work between threads, one thread removes it. What these tests
check is that no state is lost or mixed, and rounding from another thread split would hide or fake
that. effattn itself keeps the threads torch picks."""

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
