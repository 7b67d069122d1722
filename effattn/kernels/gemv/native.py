"""native.c's matrix-vector products (``gemv_rows``, ``gemv_rows_bf16``), float32 and bfloat16 on the
CPU, on torch's thread count.

Built on first use by a C compiler with OpenMP (``kernels/build.py``; cached per source and machine).
It is used where it streams weights faster than PyTorch's linear on this machine: the first use at a
thread count and dtype times both on a matrix larger than any cache (a few tenths of a second) and
keeps the result in effattn's cache folder (``gemv-check.json``). ``EFFATTN_GEMV=1`` uses it without that check,
``EFFATTN_GEMV=0`` (or ``EFFATTN_NATIVE=0``) never; ``why_unavailable`` says why it is not used.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import time
from pathlib import Path

import torch
from torch import Tensor

from effattn.kernels.build import load_library, machine_tag

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ("-fopenmp",)  # beside kernels/build.py's own
MAX_ROWS = 8  # more rows than this are a GEMM, where MKL's blocking wins
MIN_GAIN = 1.1  # the check's bar: this much faster than PyTorch's linear, or not used

_lib = None  # the loaded library, False once it failed
_why_not = ""
_checks: dict[tuple[int, torch.dtype], tuple[bool, str]] = {}  # (threads, dtype) -> (faster here, why not)
DTYPES = {torch.float32: "gemv_rows", torch.bfloat16: "gemv_rows_bf16"}  # dtype -> native.c's function
_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


def _turned_off() -> str:
    for name in ("EFFATTN_NATIVE", "EFFATTN_GEMV"):
        if os.environ.get(name, "") == "0":
            return f"turned off by {name}=0"
    return ""


def built() -> bool:
    """Whether the library is built and loaded here (on the first call)."""
    global _lib, _why_not
    if _lib is None:
        try:
            _lib = load_library(SOURCE, "gemv_native", extra=FLAGS)  # torch's OpenMP runtime is loaded: shared
            _lib.gemv_rows.argtypes, _lib.gemv_rows.restype = [_P, _P, _P, _P, _L, _L, _L, _I], None
            _lib.gemv_rows_bf16.argtypes, _lib.gemv_rows_bf16.restype = [_P, _P, _P, _P, _L, _L, _L, _I], _I
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            _lib, _why_not = False, (str(error).strip().splitlines() or [type(error).__name__])[0]  # one line for a record
    return bool(_lib)


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``linear`` is used here for `dtype` (float32 or bfloat16): built, not turned off, and faster
    than PyTorch's (or forced on)."""
    if _turned_off() or not built() or dtype not in DTYPES:
        return False
    return os.environ.get("EFFATTN_GEMV", "") == "1" or _faster_here(dtype)[0]


def why_unavailable(dtype: torch.dtype = torch.float32) -> str:
    """Why the compiled product is not used for `dtype` ('' when it is)."""
    if available(dtype):
        return ""
    if dtype not in DTYPES:
        return f"{dtype} has no kernel (float32 and bfloat16 do)"
    if _turned_off() or not built():
        return _turned_off() or _why_not
    return _faster_here(dtype)[1]


def _faster_here(dtype: torch.dtype) -> tuple[bool, str]:
    key = (torch.get_num_threads(), dtype)
    if key not in _checks:
        _checks[key] = _check(*key)
    return _checks[key]


def _check(threads: int, dtype: torch.dtype) -> tuple[bool, str]:
    """(kernels/gemv is at least MIN_GAIN times PyTorch's speed here, why not), from this machine's record
    in the cache folder, measured and recorded there on first use."""
    from effattn.io.cache import read_machine_record, write_machine_record
    from effattn.resources import _cpu_model

    key = (f"{_cpu_model()} x{threads} threads, {str(dtype).removeprefix('torch.')}, torch {torch.__version__}, "
           f"kernel {machine_tag(SOURCE, FLAGS)}")
    known = read_machine_record("gemv-check.json")
    if key not in known:
        known[key] = measure(threads, dtype)
        write_machine_record("gemv-check.json", known)
    gemv, plain = known[key]["gemv_gb_s"], known[key]["torch_gb_s"]
    if gemv >= MIN_GAIN * plain:
        return True, ""
    return False, (f"no faster than PyTorch's {str(dtype).removeprefix('torch.')} linear on this machine ({gemv:.1f} "
                   f"against {plain:.1f} GB/s; EFFATTN_GEMV=1 uses it anyway)")


def measure(threads: int, dtype: torch.dtype = torch.float32, rows: int = 49152, cols: int = 576,
            repeats: int = 5) -> dict[str, float]:
    """GB/s of one-row products with a [rows, cols] matrix of `dtype` (113 MB in float32 by default: the
    size of SmolLM2's head, larger than a CPU's caches), PyTorch's and this kernel's, best of `repeats`."""
    weight = torch.empty(rows, cols).uniform_(-1, 1).to(dtype)
    x = torch.empty(1, cols).uniform_(-1, 1).to(dtype)
    best = {"torch": float("inf"), "gemv": float("inf")}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # PyTorch's side at the same thread count
    try:
        with torch.inference_mode():
            for _ in range(repeats + 1):  # the first round warms both up
                for name in best:
                    t0 = time.perf_counter()
                    torch.nn.functional.linear(x, weight) if name == "torch" else linear(x, weight, None, threads)
                    best[name] = min(best[name], time.perf_counter() - t0)
    finally:
        torch.set_num_threads(previous)
    return {f"{name}_gb_s": weight.numel() * weight.element_size() / seconds / 1e9 for name, seconds in best.items()}


def applies(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether `linear` can compute this product: float32 or bfloat16 CPU tensors of one dtype, at most
    MAX_ROWS rows, no autograd. Whether it *should* here (``available``) is decided once, when a layer is
    switched (gemv.use_for_decoding), not at every call: this runs once per layer and token."""
    dtype = weight.dtype
    return (x.dtype == dtype and dtype in DTYPES and x.device.type == "cpu" and weight.device.type == "cpu"
            and weight.is_contiguous() and not torch.is_grad_enabled()
            and (bias is None or (bias.dtype == dtype and bias.is_contiguous()))
            and x.numel() <= MAX_ROWS * weight.shape[1] and x.shape[-1] == weight.shape[1])


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, threads: int | None = None) -> Tensor:
    """x Wᵀ + b for x [..., k] with at most MAX_ROWS rows, float32 or bfloat16 (the library must be
    ``built``)."""
    x = x.contiguous()
    n, k = weight.shape
    rows = x.numel() // k
    y = x.new_empty(*x.shape[:-1], n)
    args = (weight.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), rows, n, k,
            threads or torch.get_num_threads())
    if getattr(_lib, DTYPES[weight.dtype])(*args):  # only the bfloat16 product allocates (x in float32)
        raise MemoryError(f"kernels/gemv could not allocate {rows * k * 4} bytes")
    return y
