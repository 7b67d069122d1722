"""native.c's matrix-vector product (``gemv_rows``), float32 on the CPU, on torch's thread count.

Built on first use by a C compiler with OpenMP (``kernels/build.py``; cached per source and machine).
Where it cannot be built, or with ``EFFATTN_NATIVE=0`` or ``EFFATTN_GEMV=0``, ``available`` is False and
callers use PyTorch's linear; ``why_unavailable`` says why.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import torch
from torch import Tensor

from effattn.kernels.build import load_library

SOURCE = Path(__file__).with_name("native.c")
MAX_ROWS = 8  # more rows than this are a GEMM, where MKL's blocking wins

_lib = None  # the loaded library, False once it failed
_why_not = ""
_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


def _turned_off() -> str:
    for name in ("EFFATTN_NATIVE", "EFFATTN_GEMV"):
        if os.environ.get(name, "1") == "0":
            return f"turned off by {name}=0"
    return ""


def available() -> bool:
    """Whether the compiled product can run here (built and loaded on the first call)."""
    global _lib, _why_not
    if _turned_off():
        return False
    if _lib is None:
        try:
            import torch  # noqa: F401 - its OpenMP runtime is loaded first, so the library shares it

            _lib = load_library(SOURCE, "gemv_native", extra=("-fopenmp",))
            _lib.gemv_rows.argtypes, _lib.gemv_rows.restype = [_P, _P, _P, _P, _L, _L, _L, _I], None
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            _lib, _why_not = False, str(error)
    return bool(_lib)


def why_unavailable() -> str:
    """Why the compiled product is not used ('' when it is)."""
    return "" if available() else (_turned_off() or _why_not)


def applies(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether `linear` computes this product: float32 CPU tensors, at most MAX_ROWS rows, no autograd."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.device.type == "cpu" and weight.is_contiguous() and not torch.is_grad_enabled()
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
            and x.numel() <= MAX_ROWS * weight.shape[1] and x.shape[-1] == weight.shape[1] and available())


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, threads: int | None = None) -> Tensor:
    """x Wᵀ + b for x [..., k] with at most MAX_ROWS rows (check ``applies`` first)."""
    x = x.contiguous()
    n, k = weight.shape
    rows = x.numel() // k
    y = x.new_empty(*x.shape[:-1], n)
    _lib.gemv_rows(weight.data_ptr(), x.data_ptr(),
                   None if bias is None else bias.data_ptr(), y.data_ptr(), rows, n, k,
                   threads or torch.get_num_threads())
    return y
