"""The compiled decode step of the hybrid attention (``native.c``'s ``linear_decode``), float32 on the CPU.

Built on first use by a C compiler (``kernels/build.py``; once per source and machine, cached under
effattn's cache folder). Where it cannot be built, or with ``EFFATTN_NATIVE=0``, the model decodes
with ``hybrid_attention_step``, which computes the same thing more slowly; ``why_unavailable`` says why,
and ``effattn inspect`` shows it.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import warnings
from pathlib import Path

from torch import Tensor

from effattn.kernels.build import load_library

SOURCE = Path(__file__).with_name("native.c")

_lib = None  # the loaded library, False once it failed
_why_not = ""
_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_ARGTYPES = [_I] * 8 + [_L, _F, _F, _I] + [_P] * 21
_GLOBAL_ARGTYPES = [_I] * 9 + [_L, _F, _F] + [_P] * 25


def why_unavailable() -> str:
    """Why the compiled step is not used ('' when it is)."""
    if available():
        return ""
    return _why_not or "turned off by EFFATTN_NATIVE=0"


def available() -> bool:
    """Whether the compiled step can run here (built and loaded on the first call)."""
    global _lib, _why_not
    if _lib is None:
        try:
            _lib = load_library(SOURCE, "linear_native")
            _lib.linear_decode.argtypes, _lib.linear_decode.restype = _ARGTYPES, None
            _lib.linear_decode_work_floats.argtypes, _lib.linear_decode_work_floats.restype = [_I] * 3, _L
            _lib.global_decode.argtypes, _lib.global_decode.restype = _GLOBAL_ARGTYPES, None
            _lib.global_decode_work_floats.argtypes, _lib.global_decode_work_floats.restype = [_I] * 6, _L
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            _lib, _why_not = False, str(error)
            warnings.warn(f"effattn: the compiled linear-attention decode step is unavailable ({_why_not}); "
                          "decoding uses hybrid_attention_step, which computes the same thing more slowly",
                          RuntimeWarning, stacklevel=2)  # fmt: skip
    return bool(_lib) and os.environ.get("EFFATTN_NATIVE", "1") != "0"


def work_floats(D: int, F: int, W: int, sinks: int = 0) -> int:
    """Floats of scratch a step needs."""
    return _lib.linear_decode_work_floats(D, F, W + sinks) if available() else 0


def global_work_floats(D: int, Dv: int, F: int, W: int, sinks: int, capacity: int) -> int:
    """Floats of scratch a step with a global cache of ``capacity`` keys per head needs."""
    return _lib.global_decode_work_floats(D, Dv, F, W, sinks, capacity) if available() else 0


def _ptr(x: Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


def decode_step(state, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, window_factors: Tensor, *,
                scale: float, eps: float, hedgehog: tuple | None = None, fq: Tensor | None = None,
                fk: Tensor | None = None, rope: bool = True) -> Tensor:  # fmt: skip
    """Advance ``state`` (decode.py's LinearDecodeState, in place, ``seen`` included) by one position.

    q [B, 1, H, D], k and v [B, 1, G, D]: this position's query, key and value, before RoPE when
    ``rope`` (cos, sin [D]: its RoPE row), else rotated. ``hedgehog`` = (Wq, bq, Wk, bk): the maps'
    weights [H, D, P] and biases [H, P] or None; without it, ``fq`` and ``fk`` [B, 1, H, F] are the
    features. Returns out [B, 1, H, Dv].
    """
    B, _, H, D = q.shape
    G, Dv = k.shape[2], v.shape[3]
    F, W, NS = state.S.shape[2], state.window, state.sinks
    q, k, v, cos, sin, window_factors = (x.contiguous() for x in (q, k, v, cos, sin, window_factors))
    wq, bq, wk, bk = (None if x is None else x.detach().contiguous() for x in (hedgehog or (None,) * 4))
    fq, fk = (None if x is None else x.contiguous() for x in (fq, fk))
    if hedgehog is None and (fq is None or fk is None):
        raise ValueError("decode_step needs the Hedgehog weights or both feature tensors fq and fk")
    out = q.new_empty(B, 1, H, Dv)
    _lib.linear_decode(B, H, G, D, Dv, F, W, NS, state.seen, scale, eps, int(rope), *map(_ptr, (
        q, k, v, cos, sin, wq, bq, wk, bk, fq, fk, window_factors.detach(), state.ring_k, state.ring_v,
        state.ring_fk, state.S, state.z, state.sink_k, state.sink_v, out, state.work)))  # fmt: skip
    state.seen += 1
    return out


def global_decode_step(state, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, window_factors: Tensor, *,
                       scale: float, eps: float, hedgehog: tuple) -> Tensor:  # fmt: skip
    """Advance ``state`` (decode.py's GlobalDecodeState, in place, ``seen`` included) by one position
    through ``native.c``'s ``global_decode``: q [B, 1, H, D], k and v [B, 1, G, D] before RoPE (cos, sin [D]: its
    RoPE row), ``hedgehog`` = (Wq, bq, Wk, bk) the maps' weights [H, D, P] and biases [H, P] or None. Returns
    out [B, 1, H, Dv]."""
    B, _, H, D = q.shape
    G, Dv = k.shape[2], v.shape[3]
    F, W, NS, C = state.S.shape[2], state.window, state.sinks, state.capacity
    q, k, v, cos, sin, window_factors = (x.contiguous() for x in (q, k, v, cos, sin, window_factors))
    wq, bq, wk, bk = (None if x is None else x.detach().contiguous() for x in hedgehog)
    out = q.new_empty(B, 1, H, Dv)
    _lib.global_decode(B, H, G, D, Dv, F, W, NS, C, state.seen, scale, eps, *map(_ptr, (
        q, k, v, cos, sin, wq, bq, wk, bk, window_factors.detach(), state.ring_k, state.ring_v, state.ring_fk, state.S,
        state.z, state.sink_k, state.sink_v, state.cache_k, state.cache_v, state.cache_pos, state.pend_k, state.pend_v,
        state.pend_fk, out, state.work)))  # fmt: skip
    state.seen += 1
    return out
