"""The compiled step loop of ``vq_attention_chunk`` (``native.c``), for float32 inference on the CPU.

``vq_attention_chunk`` runs the steps of a segment here instead of in Python when autograd is off,
the inputs are float32 on the CPU, and this module is available: a C compiler built ``native.c``
(once per source and machine, cached under ``effattn``'s cache folder) and torch's BLAS is MKL, whose
``sgemm`` and per-thread thread count the C code uses. Otherwise, or with ``EFFATTN_NATIVE=0``, the
kernel keeps its PyTorch step loop, which computes the same thing.

With ``torch.get_num_threads()`` = n > 1, the steps of a segment are split into n ranges, one per
thread, each with its own copy of the per-code statistics (brought up to its first step from the
keys alone), so the threads never wait for each other.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from effattn.kernels.build import cpu_flags, load_library

SOURCE = Path(__file__).with_name("native.c")
MASKED = -1e30  # native.c's finite stand-in for -inf (it is built with -ffast-math)

_lib = None  # the loaded library, False once it failed
_blas = None
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_why_not = ""


def why_unavailable() -> str:
    """Why the compiled loop is not used ('' when it is available)."""
    if available():
        return ""
    return _why_not or "turned off by EFFATTN_NATIVE=0"


def available() -> bool:
    """Whether the compiled step loop can run here (built and loaded on first call)."""
    global _lib, _blas, _why_not
    if _lib is None:
        try:
            _lib, _blas = _load()
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            _lib, _why_not = False, str(error)
            warnings.warn(f"effattn: the compiled VQ step loop is unavailable ({_why_not}); VQ attention uses its "
                          "PyTorch step loop, which computes the same thing more slowly", RuntimeWarning, stacklevel=2)
    return bool(_lib) and os.environ.get("EFFATTN_NATIVE", "1") != "0"


def _load():
    blas = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    for name in ("sgemm_", "MKL_Set_Num_Threads_Local"):
        if not hasattr(blas, name):
            raise RuntimeError(f"torch's BLAS does not export {name} (not MKL)")
    lib = load_library(SOURCE, "vq_native")
    lib.vq_segment.restype = None
    lib.vq_segment_work_floats.restype = ctypes.c_long
    lib.vq_segment_work16.restype = ctypes.c_long
    lib.vq_dpbf16_compiled.restype = ctypes.c_int
    lib.vq_nearest_work_floats.restype = ctypes.c_long
    lib.vq_nearest.restype = None
    lib.vq_nearest.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    blas.MKL_Set_Num_Threads_Local.restype = ctypes.c_int
    blas.MKL_Set_Num_Threads_Local.argtypes = [ctypes.c_int]
    return lib, blas


# bf16_kernel's answers, in words (the conversion plan's "VQ kernel" line)
BF16_KERNELS = {"own": "native.c's AVX-512 BF16 products", "mkl": "MKL's bf16 products (AMX / AVX-512 BF16)",
                "": "none on this CPU (float32)"}


def bf16_kernel() -> str:
    """Which bfloat16 products the compiled loop runs with ``bf16=True``: ``"own"`` (native.c's AVX-512 BF16
    kernels on packed operands), ``"mkl"`` (MKL's cblas_gemm_bf16bf16f32) or ``""`` (none: float32).

    MKL where the CPU has AMX (its tile units beat VDPBF16PS), the own kernels on other AVX-512 BF16 CPUs
    (on AMD Zen 4 MKL's bf16 products run no faster than its float32 ones: ~93 GFLOP/s per core, the own
    ones ~200). ``EFFATTN_BF16_KERNEL=own|mkl`` chooses, where that one can run.
    """
    if not available():
        return ""
    flags = cpu_flags()
    own = bool(_lib.vq_dpbf16_compiled()) and "avx512_bf16" in flags
    mkl = hasattr(_blas, "cblas_gemm_bf16bf16f32") and bool({"amx_bf16", "avx512_bf16"} & flags)
    wanted = os.environ.get("EFFATTN_BF16_KERNEL", "")
    if wanted == "own" and own or wanted == "mkl" and mkl:
        return wanted
    if mkl and ("amx_bf16" in flags or not own):
        return "mkl"
    return "own" if own else ""


def _single_threaded_blas() -> None:
    _blas.MKL_Set_Num_Threads_Local(1)  # this worker thread's sgemm calls stay on this thread


def _workers(n: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    if _pool is None or _pool_size != n:
        if _pool is not None:
            _pool.shutdown()
        _pool, _pool_size = ThreadPoolExecutor(n, initializer=_single_threaded_blas), n
    return _pool


def _ptr(x: Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(x.data_ptr())


def run_segment(
    *, q: Tensor, cos: Tensor, sin: Tensor, rk: Tensor, kq: Tensor, v: Tensor, z: Tensor, codebook: Tensor,
    sink_k: Tensor, sink_v: Tensor, stats: tuple[Tensor, Tensor, Tensor, Tensor], out: Tensor,
    R: int, W: int, Q: int, n: int, seg_t0: int, start: int, sinks: int, code_k: Tensor | None = None,
    bf16: bool = False,
) -> None:  # fmt: skip
    """Run the ``n`` steps of ``Q`` queries of one segment; arguments as in ``native.c``'s ``vq_segment``.

    ``stats`` = (counts, sums, log_counts, means) are updated in place and ``out`` receives the rows:
    these must be contiguous, and so must ``code_k`` (key means: the per-code key sums rotated by -F
    and scaled, updated in place like the statistics; ``kq`` then holds exact keys). Every tensor is
    float32 (``z`` int64) on the CPU. ``-inf`` log counts (empty codes) become ``MASKED``, which the C
    code treats alike. ``bf16``: the step's products with the span and the code columns (all its
    arithmetic but the sinks') take bfloat16 inputs and accumulate in float32, where ``bf16_kernel`` names
    products that run here (float32 otherwise).
    """
    B, T, H, D = q.shape
    G, Dv, C, m_max = H // R, v.shape[-1], codebook.shape[1], sink_k.shape[1]
    key_means = code_k is not None
    stats = (*stats, code_k) if key_means else tuple(stats)
    if not all(x.is_contiguous() for x in (*stats, out)):
        raise ValueError("run_segment updates stats and out in place: they must be contiguous")
    inputs = [x.contiguous() for x in (q, cos, sin, rk, kq, v, z, codebook, sink_k, sink_v)]
    stats[2].clamp_(min=MASKED)  # native.c is built with -ffast-math: its maths must stay finite
    kernel = bf16_kernel() if bf16 else ""
    threads = max(1, min(torch.get_num_threads(), n))
    bounds = [n * i // threads for i in range(threads + 1)]

    def call(i: int, own_stats) -> None:
        lo, hi = bounds[i], bounds[i + 1]
        work = torch.empty(_lib.vq_segment_work_floats(R, Q, W - 1, C, m_max, D, Dv), dtype=torch.float32)
        work16 = torch.empty(_lib.vq_segment_work16(R, Q, W - 1, C, D, Dv, ctypes.c_long(rk.shape[1])) if kernel else 0,
                             dtype=torch.int16)  # fmt: skip
        _lib.vq_segment(
            ctypes.cast(_blas.sgemm_, ctypes.c_void_p), *(ctypes.c_int(x) for x in (B, T, G, R, D, Dv, C, W, Q, n)),
            ctypes.c_long(seg_t0), ctypes.c_long(start), ctypes.c_long(sinks), ctypes.c_int(m_max),
            ctypes.c_int(lo), ctypes.c_int(hi), ctypes.c_int(key_means), *(_ptr(x) for x in inputs),
            *(_ptr(x) for x in own_stats[:4]), _ptr(own_stats[4]) if key_means else ctypes.c_void_p(0),
            _ptr(out), _ptr(work), ctypes.cast(_blas.cblas_gemm_bf16bf16f32, ctypes.c_void_p) if kernel == "mkl" else None,
            _ptr(work16) if kernel else None, ctypes.c_int(kernel == "own"),
        )  # fmt: skip

    # the others work on copies; the last thread runs to the segment's end, so it updates the caller's
    own = [tuple(x.clone() for x in stats) for _ in range(threads - 1)] + [stats]
    _run([partial(call, i, own[i]) for i in range(threads)], threads)


def _run(tasks: list, threads: int) -> None:
    """Run the tasks here (one thread) or on ``threads`` workers, whose sgemm calls stay on their thread."""
    if threads == 1:
        for task in tasks:
            task()
        return
    for future in [_workers(threads).submit(task) for task in tasks]:
        future.result()


def nearest_codes(k: Tensor, codebook: Tensor, bias: Tensor) -> Tensor:
    """codes.py's ``nearest_codes`` in C: for k (B, T, G, D) and, per head, codebook (G, C, D) and bias (G, C),
    the first code maximising ``<k, c> + bias`` (B, T, G) int64. float32 on the CPU, ``available()``; rows
    are split over ``torch.get_num_threads()`` threads, each scoring 128 rows at a time in its cache."""
    B, T, G, D = k.shape
    C = codebook.shape[1]
    k, codebook, bias = k.contiguous(), codebook.contiguous(), bias.contiguous()
    codes = torch.empty(B, T, G, dtype=torch.int64)
    n = B * T
    threads = max(1, min(torch.get_num_threads(), n // 256))
    bounds = [n * i // threads for i in range(threads + 1)]
    sgemm = ctypes.cast(_blas.sgemm_, ctypes.c_void_p)

    def call(g: int, i: int) -> None:
        lo, hi = bounds[i], bounds[i + 1]
        work = torch.empty(_lib.vq_nearest_work_floats(C), dtype=torch.float32)
        _lib.vq_nearest(sgemm, hi - lo, D, C, k.data_ptr() + 4 * (lo * G + g) * D, G * D, codebook[g].data_ptr(),
                        bias[g].data_ptr(), codes.data_ptr() + 8 * (lo * G + g), G, work.data_ptr())  # fmt: skip

    _run([partial(call, g, i) for g in range(G) for i in range(threads)], threads)
    return codes


_DECODE_ARGTYPES = [ctypes.c_void_p] + [ctypes.c_int] * 7 + [ctypes.c_long, ctypes.c_float, ctypes.c_int] + [ctypes.c_void_p] * 18


def decode_ready(state, q: Tensor) -> bool:
    """Whether ``decode_step`` can run the decode step of ``state`` (decode.py's VQDecodeState) for ``q``."""
    return (q.dtype == state.keys.dtype == state.ring_k.dtype == torch.float32 and q.device.type == "cpu"
            and available())  # fmt: skip


def decode_step(state, q: Tensor, k: Tensor, v: Tensor, codes: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """One decode step in C (``native.c``'s ``vq_decode``): the same as decode.py's ``vq_decode_step``,
    whose state this advances in place (but for ``seen``, which the caller moves). Returns (B, 1, H, Dv)."""
    B, _, H, D = q.shape
    BG, N, _ = state.keys.shape
    W, C = state.window, state.counts.shape[1]
    Dv = state.values.shape[2]
    if state.native_args is None:  # the state's own buffers: the same pointers every step
        if _lib.vq_decode.argtypes is None:
            _lib.vq_decode.argtypes, _lib.vq_decode.restype = _DECODE_ARGTYPES, None
        buffers = (state.keys, state.bias, state.values, state.ring_k, state.ring_z, state.ring_cos, state.ring_sin,
                   state.counts, state.far_cos, state.far_sin)  # fmt: skip
        if not all(x.is_contiguous() for x in buffers):
            raise ValueError("the decode state's buffers must be contiguous")
        state.work = torch.empty(H // (BG // B) * (N + D), dtype=torch.float32)
        state.native_sgemm = ctypes.cast(_blas.sgemm_, ctypes.c_void_p).value
        state.native_args = tuple(x.data_ptr() for x in buffers)
    out = q.new_empty(B, 1, H, Dv)
    inputs = [x.contiguous() for x in (q, k, v, codes, cos, sin)]
    _lib.vq_decode(state.native_sgemm, BG, H // (BG // B), D, Dv, W, C, N - W - C, state.seen,
                   state.scale, int(state.key_means), *(x.data_ptr() for x in inputs),
                   *state.native_args, out.data_ptr(), state.work.data_ptr())  # fmt: skip
    return out


_HEAVY_DECODE_ARGTYPES = ([ctypes.c_void_p] + [ctypes.c_int] * 10 + [ctypes.c_long, ctypes.c_float, ctypes.c_int]
                          + [ctypes.c_void_p] * 19)


def heavy_decode_ready(state, q: Tensor) -> bool:
    """Whether ``heavy_decode_step`` can run the step of ``state`` (heavy_decode.py's HeavyDecodeState) for ``q``."""
    return q.dtype == state.keys.dtype == torch.float32 and q.device.type == "cpu" and available()


def heavy_decode_step(state, q: Tensor, k: Tensor, v: Tensor, codes: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """One heavy-hitter decode step in C (``native.c``'s ``vq_heavy_decode``): the same as heavy_decode.py's
    ``vq_heavy_decode_step``, whose state this advances in place (but for ``seen``, which the caller moves).
    Returns (B, 1, H, Dv)."""
    B, _, H, D = q.shape
    BG, N, _ = state.keys.shape
    W, P, C, R, Dv = state.window, state.slots, state.counts.shape[1], H // (BG // B), state.values.shape[2]
    if _lib.vq_heavy_decode.argtypes is None:
        _lib.vq_heavy_decode.argtypes, _lib.vq_heavy_decode.restype = _HEAVY_DECODE_ARGTYPES, ctypes.c_int
        _lib.vq_heavy_decode_work_floats.restype = ctypes.c_long
    if state.native_args is None:  # the state's own buffers (changed in place only): the same pointers every step
        buffers = (state.far_cos, state.far_sin, state.keys, state.bias, state.values, state.score, state.ring_k,
                   state.ring_z, state.heavy_z, state.heavy_pos, state.counts)  # fmt: skip
        if not all(x.is_contiguous() for x in buffers):
            raise ValueError("the heavy decode state's buffers must be contiguous")
        state.work = torch.empty(_lib.vq_heavy_decode_work_floats(R, D, W, P, C), dtype=torch.float32)
        state.native_args = (ctypes.cast(_blas.sgemm_, ctypes.c_void_p), tuple(x.data_ptr() for x in buffers))
    sgemm, pointers = state.native_args
    out = q.new_empty(B, 1, H, Dv)
    inputs = [x.contiguous() for x in (q, k, v, codes, cos, sin)]
    state.m = _lib.vq_heavy_decode(
        sgemm, BG, R, D, Dv, W, P, C, state.m, state.budget, state.update, state.seen, state.scale,
        int(state.key_means), *(x.data_ptr() for x in inputs), *pointers, out.data_ptr(), state.work.data_ptr())  # fmt: skip
    return out


_HEAVY_SEGMENT_ARGTYPES = ([ctypes.c_void_p] + [ctypes.c_int] * 11 + [ctypes.c_long, ctypes.c_int, ctypes.c_int,
                           ctypes.c_float] + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 22)


def heavy_segment(*, q: Tensor, k: Tensor, v: Tensor, z: Tensor, cos: Tensor, sin: Tensor, far_cos: Tensor,
                  far_sin: Tensor, span: tuple, far: tuple, heavy: tuple, counts: Tensor, out: Tensor, t0: int, m0: int,
                  n0: int, window: int, update: int, budget: int, scale: float, key_means: bool) -> int:  # fmt: skip
    """Heavy-hitter prefill of q's T positions in C (``native.c``'s ``vq_heavy_segment``; heavy.py's
    ``vq_heavy_chunk`` builds the buffers and reads the state back). ``span`` = (SK, SRK, SV, SZ, SS),
    ``far`` = (FK, FV, FB), ``heavy`` = (HZ, HP, HS) and ``counts`` are updated in place, ``out`` (B, T, H, Dv)
    receives the output; all contiguous, float32 (int64 codes and positions) on the CPU. The KV heads
    are independent (a head's E depends on its own queries only), so workers take a share of them each;
    the periods of one head cannot be split, as the plain loop's steps are. Returns E's size after."""
    B, T, H, D = q.shape
    G, Dv, C = k.shape[2], v.shape[-1], counts.shape[-1]
    R, P, BG = H // G, budget + update, B * G
    buffers = (*span, *far, *heavy, counts, out)
    if not all(x.is_contiguous() for x in buffers):
        raise ValueError("heavy_segment updates its buffers in place: they must be contiguous")
    if _lib.vq_heavy_segment.argtypes is None:
        _lib.vq_heavy_segment.argtypes, _lib.vq_heavy_segment.restype = _HEAVY_SEGMENT_ARGTYPES, ctypes.c_int
        _lib.vq_heavy_segment_work_floats.restype = ctypes.c_long
    inputs = [x.contiguous() for x in (q, k, v, z, cos, sin, far_cos, far_sin)]
    # one worker per KV head up to twice the threads (3 heads on 2 cores: the system shares them out, where
    # two workers would leave one core idle a third of the time); beyond that, one per thread
    n = torch.get_num_threads()
    threads = BG if BG <= 2 * n else n
    bounds = [BG * i // threads for i in range(threads + 1)]
    sizes = []

    def call(i: int) -> None:
        work = torch.empty(_lib.vq_heavy_segment_work_floats(R, D, Dv, window, update, P, C), dtype=torch.float32)
        sizes.append(_lib.vq_heavy_segment(
            ctypes.cast(_blas.sgemm_, ctypes.c_void_p), B, T, G, R, D, Dv, window, update, P, C, budget, t0, m0, n0,
            scale, int(key_means), bounds[i], bounds[i + 1], *(x.data_ptr() for x in inputs),
            *(x.data_ptr() for x in buffers), work.data_ptr()))  # fmt: skip

    _run([partial(call, i) for i in range(threads)], threads)
    return sizes[0]
