"""What a run costs on this machine: its speed, the process's memory, and estimates held against both.

Estimates are built from counts (floating-point operations, bytes read and written, bytes held) and
two things measured here, once per process:

  * `matmul_flops()`: float32 (or bfloat16) matrix-multiply throughput of torch on this machine's threads (a
    ~0.3 s probe, or the best earlier probe on this machine: estimates are for an idle machine, as
    the BENCHMARKS table measures them; a loaded one is slower). Model work runs at a fraction of it; the fractions below were measured on the built-in model
    (BENCHMARKS.md, "estimates") and are used for every model.
  * `rss()` at planning time: the process's resident memory before the run (the interpreter, torch and
    transformers already imported): every peak starts from it.

Peak memory is the process's peak resident set (what `/usr/bin/time -f %M` reports), including
mapped checkpoint pages. `PeakRSS` measures it for one run: on Linux it resets the kernel's
high-water mark first (`/proc/self/clear_refs`), so the peak is the run's, not the process's
lifetime's; elsewhere it falls back to the lifetime peak.
"""

from __future__ import annotations

import functools
import os
import re
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .families import AttentionShape

# Fractions of the matmul probe's rate that real work reaches on the CPU (measured; see module doc).
FORWARD_EFFICIENCY = 0.45  # a transformers forward pass, float32, batches of 512-token blocks
LAYERWISE_EFFICIENCY = 0.55  # the layer-wise runner: one decoder layer at a time, plus statistics
# 16-bit work on the CPU reaches this share of the float32 fraction, of the 16-bit probe (`cpu_flops`). Measured on
# 2 idle cores (AMD EPYC, avx512_bf16; bf16 probe 932-1,008 GFLOP/s, fp32 233-238): a bf16 fine-tune at 16K tokens
# reached 0.31 of the bf16 probe where float32 fine-tunes reach 0.60 of theirs (0.52). Checked on bfloat16 passkey
# grids of the built-in model: 2 prompts at 8,192 tokens took 44.8 s of work, priced 54 s; 2 at 2,048 and 2 at 4,096
# took 16.8 s, priced 23 s (with the prefill's pricing below; BENCHMARKS.md, "Dry-run estimates against
# measurements").
HALF_EFFICIENCY = 0.52
# A long prompt's prefill (the retrieval grids: chunks of 2,048 tokens, batch 1, logits at the last position only) is
# priced in two parts, fitted to single prefills of the built-in model on 2 idle cores (probes 233 and 932 GFLOP/s;
# 1.7, 3.6, 10.1 and 30.0 s at 1K, 2K, 4K and 8K tokens in float32, 0.7, 2.0, 6.6 and 22.4 s in bfloat16): the
# decoder layers' matmuls reach 0.8 of the probe (16-bit: times HALF_EFFICIENCY of its own probe), and the attention
# (SDPA's scores and weighted sum against the cache) 0.48 of the float32 probe in either dtype (the fit gives 112
# and 121 GFLOP/s). Checked on passkey grids measured before the fit (BENCHMARKS.md, "Dry-run estimates against
# measurements"): priced 0.89-1.11x their work in float32, 1.20-1.38x in bfloat16.
PREFILL_EFFICIENCY = 0.8
ATTENTION_EFFICIENCY = 0.48
# One decode step (batch 1, one new token) reads every weight and the whole cache for a few FLOPs each: bound by
# memory, not by the matmul probe. Priced as its FLOPs (the weights', and the attention's over the cache) at 0.045 of
# the float32 probe (`decode_seconds`): the built-in model in float32 on 2 idle cores (probe 233 GFLOP/s) decodes
# 36-44 tokens/s after 512 tokens with effattn's matrix-vector product (priced 34.5), and 23-26 after 2,048 (25.8
# with it, 22.9-24.5 with torch's; priced 25.6). bfloat16 weights decode about as fast (28.8 tokens/s after 512), so
# decode steps are priced at the float32 probe in any dtype.
DECODE_EFFICIENCY = 0.045
DISK_BYTES_PER_S = 2e9  # reading a cached checkpoint and writing through the page cache (measured ~2 GB/s)
TOKENIZE_BYTES_PER_CHAR = 350  # peak memory of tokenizing a whole corpus at once (a byte-level tokenizer, the worst)
MODEL_LOAD_SECONDS = 1.0  # transformers building a model from a local safetensors folder  # reading a checkpoint and writing safetensors (page cache, mmap)


def device_flops(dtype: torch.dtype = torch.float32, windows: int = 3, seconds: float = 0.1, device: str | None = None) -> float:
    """Matmul FLOP/s of `device` (default: CUDA when present, else the CPU): the best of a few short
    windows of 1024³ products (steadier on a shared machine)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    n = 1024
    gen = torch.Generator().manual_seed(0)  # a probe must not move the global random state a run depends on
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    a @ b  # warm-up
    best = 0.0
    for _ in range(windows):
        runs, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            runs += 1
        if device == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * n**3 * runs / (time.perf_counter() - t0))
    return best


@functools.lru_cache(maxsize=4)
def matmul_flops(dtype: torch.dtype = torch.float32) -> float:
    """This CPU's matmul throughput (FLOP/s) in `dtype` when idle: the best of this process's probe and the
    best earlier probe on this machine (same CPU, thread count and dtype, kept in the cache folder), so that a
    probe that happened to share the cores with another job does not halve every estimate. bfloat16 is probed
    apart: a CPU with bf16 instructions multiplies ~4x faster in it (AMD EPYC, avx512_bf16: 1,008 against 238
    GFLOP/s on 2 cores), one without them slower than in float32."""
    from .io.cache import read_machine_record, write_machine_record

    live = device_flops(dtype, device="cpu")
    key = f"{_cpu_model()} x{torch.get_num_threads()} threads, torch {torch.__version__}"
    key += "" if dtype == torch.float32 else f", {str(dtype).removeprefix('torch.')}"
    known = read_machine_record("matmul-flops.json")
    best = max(live, float(known.get(key, 0.0)))
    if best > float(known.get(key, 0.0)):
        write_machine_record("matmul-flops.json", known | {key: best})
    return best


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _status(field_name: str) -> int | None:
    """A memory field of /proc/self/status in bytes (Linux), or None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _lifetime_peak() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def rss() -> int:
    """The process's resident memory now (bytes)."""
    return _status("VmRSS") or _lifetime_peak()


def heap_free_bytes() -> int:
    """Bytes glibc's malloc holds free in its heaps (`mallinfo2().fordblks`): resident, since effattn never
    trims the heap (`effattn._keep_freed_memory`), and reused by the next allocations. 0 where malloc is not
    glibc's (or older than 2.33)."""
    import ctypes

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                         "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return 0
    mallinfo2.restype = Mallinfo2
    return int(mallinfo2().fordblks)


def release_free_heap() -> int:
    """Give the free memory of glibc's heap back to the system (`malloc_trim`), once, after a step that
    allocated and freed much that later work will not reuse in place (tokenizing a long text leaves ~0.6 GiB
    free in small pieces). effattn otherwise never trims (`effattn._keep_freed_memory`). Returns the bytes
    the resident set shrank by; 0 where malloc is not glibc's."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return 0
    before = rss()
    trim(0)
    return max(0, before - rss())


def held() -> int:
    """The memory this process holds that new work cannot reuse: its resident memory less the free memory in
    its heap. After a step that allocated and freed much (tokenizing a long text), `rss()` stays at that
    step's peak; an estimate of what a run adds on top must start from this instead, or it counts the freed
    memory twice."""
    return max(0, rss() - heap_free_bytes())


def process_age() -> float:
    """Seconds since this process started (its interpreter start-up and imports, which the same command
    pays again): from /proc on Linux, else 0."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
        return max(0.0, float(Path("/proc/uptime").read_text().split()[0]) - start)
    except (OSError, ValueError, IndexError):
        return 0.0


@dataclass(frozen=True)
class Dims(AttentionShape):
    """A config's attention geometry plus the other sizes cost models need."""

    intermediate: int = 0
    vocab: int = 0

    @classmethod
    def of(cls, config: dict) -> Dims:
        shape = AttentionShape.of(config)
        return cls(**vars(shape), intermediate=config.get("intermediate_size") or 4 * shape.hidden,
                   vocab=config.get("vocab_size") or 32000)

    def scores_flops(self, tokens: int, seq_len: int) -> float:
        """One attention block's scores and weighted sum over `tokens` in causal blocks of `seq_len`."""
        return 2 * tokens * seq_len * self.heads * self.head_dim  # causal: half of 4·T·H·d per token

    def attention_flops(self, tokens: int, seq_len: int) -> float:
        """One attention block's forward over `tokens` in causal blocks of `seq_len`: projections and scores."""
        proj = 2 * tokens * self.hidden * (2 * self.heads + 2 * self.kv_heads) * self.head_dim
        return proj + self.scores_flops(tokens, seq_len)

    def layer_flops(self, tokens: int, seq_len: int) -> float:
        """One decoder layer's forward (attention + gated MLP)."""
        return self.attention_flops(tokens, seq_len) + 6 * tokens * self.hidden * self.intermediate


HALF_DTYPES = (torch.bfloat16, torch.float16)


def cpu_efficiency(efficiency: float, dtype: torch.dtype = torch.float32) -> float:
    """The fraction of this CPU's matmul probe in `dtype` (float32's for other dtypes) that work reaching
    `efficiency` of the float32 probe in float32 (one of the fractions above) reaches in `dtype`. 16-bit work (bf16
    autocast, a bfloat16 model) reaches HALF_EFFICIENCY as large a fraction of its own probe: what is not a matmul
    (norms, softmax, casts) does not speed up."""
    return efficiency * HALF_EFFICIENCY if dtype in HALF_DTYPES else efficiency


def cpu_flops(efficiency: float, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s that work reaching `efficiency` in float32 reaches on this CPU in `dtype` (`cpu_efficiency`)."""
    return matmul_flops(dtype if dtype in HALF_DTYPES else torch.float32) * cpu_efficiency(efficiency, dtype)


def compute_seconds(flops: float, efficiency: float = LAYERWISE_EFFICIENCY,
                    dtype: torch.dtype = torch.float32) -> float:
    """Seconds of `flops` of work on this CPU (idle) in `dtype`: see `cpu_flops`."""
    return flops / cpu_flops(efficiency, dtype)


def input_embedding_params(config: dict) -> int:
    """Parameters of the input embedding that no FLOP touches (a lookup): the whole table, unless it is tied to
    the output layer, which runs."""
    dims = Dims.of(config)
    return 0 if config.get("tie_word_embeddings") else dims.vocab * dims.hidden


def decode_seconds(config: dict, params: int, after: int, steps: int = 1) -> float:
    """Seconds of `steps` greedy decode steps (batch 1) after `after` tokens on this CPU: every weight but the input
    embedding, and the attention over the cache, at DECODE_EFFICIENCY of the float32 probe in any dtype."""
    dims = Dims.of(config)
    step = 2 * max(params - input_embedding_params(config), 0) + dims.layers * dims.scores_flops(1, 2 * after)
    return steps * compute_seconds(step, DECODE_EFFICIENCY)


COLD_READ_BYTES_PER_S = 1e9  # pages not in the page cache: this machine read an evicted 538 MB checkpoint in 0.5-1 s


def cached_bytes(path: Path) -> int | None:
    """Bytes of `path` resident in the page cache (Linux `mincore`), or None where that cannot be asked."""
    import ctypes
    import mmap

    try:
        size = os.path.getsize(path)
        if size == 0:
            return 0
        libc = ctypes.CDLL(None, use_errno=True)
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:  # private: never written
            anchor = ctypes.c_char.from_buffer(m)  # the mapping's address (released before the map closes)
            ok = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec) == 0
            del anchor
        return min(size, sum(v & 1 for v in vec) * mmap.PAGESIZE) if ok else None
    except (OSError, AttributeError, ValueError, TypeError, BufferError):
        return None


def read_seconds(paths) -> float:
    """Seconds to read files: what the page cache holds at memory speed, the rest at the disk's."""
    total = 0.0
    for path in set(paths):
        size = os.path.getsize(path)
        cached = cached_bytes(path)
        cached = size if cached is None else cached
        total += cached / DISK_BYTES_PER_S + (size - cached) / COLD_READ_BYTES_PER_S
    return total


def disk_seconds(nbytes: int) -> float:
    return nbytes / DISK_BYTES_PER_S


@dataclass
class PeakRSS:
    """`with PeakRSS() as peak: ...` then `peak.bytes`: the process's peak resident set during the block
    (`peak.exact` says whether the kernel's high-water mark could be reset at its start)."""

    bytes: int = 0
    exact: bool = False

    def __enter__(self) -> PeakRSS:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak resident set size (Linux >= 4.0)
            self.exact = True
        except OSError:
            self.exact = False
        return self

    def __exit__(self, *exc) -> None:
        self.read()

    def read(self) -> int:
        self.bytes = (_status("VmHWM") if self.exact else None) or _lifetime_peak()
        return self.bytes


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def side_by_side(est_seconds: float, est_peak: int, seconds: float, peak: PeakRSS) -> dict:
    """The record's `resources` entry: the plan's estimate beside what this run measured."""
    return {
        "estimated": {"seconds": round(est_seconds, 1), "peak_rss_bytes": int(est_peak)},
        "measured": {"seconds": round(seconds, 1), "peak_rss_bytes": int(peak.bytes),
                     "peak_is_this_run": peak.exact, "load_average": load_average(),
                     "threads": torch.get_num_threads()},
        "ratio": {"seconds": round(seconds / max(est_seconds, 1e-9), 2),
                  "peak_rss": round(peak.bytes / max(est_peak, 1), 2)},
    }


# ---------------------------------------------------------------------------------------------------
# Memory checks: a command estimates its peak before heavy work and refuses one that cannot fit.

MEMORY_LIMIT_ENV = "EFFATTN_MEMORY_LIMIT"  # e.g. 8GB: the budget checks use this instead of what the machine has
NO_MEMORY_CHECK = "--no-memory-check"
MEMORY_MARGIN = 0.9  # an estimate may be ~10% low (BENCHMARKS.md, "estimates"): runs are held to 90% of the budget


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_free() -> int | None:
    """What this process's cgroup (a container's memory limit) still allows, or None without a limit."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            if limit == "max" or int(limit) >= 2**60:
                return None
            return max(0, int(limit) - int(Path(usage_file).read_text().strip()))
        except (OSError, ValueError):
            continue
    return None


DEVICE_NAME = re.compile(r"cpu|cuda(:\d+)?")  # the devices effattn runs on


def check_device(device: str, flag: str = "--device", error=None) -> str:
    """`device` checked before any work: cpu, cuda or cuda:N, the GPU visible to torch. Returns it.
    `error`: the EffattnError subclass to raise (bench's is also a ValueError)."""
    from .errors import EffattnError

    error = error or EffattnError
    if not DEVICE_NAME.fullmatch(device):
        raise error(f"{flag} {device!r} is not a device effattn runs on", f"pass {flag} cpu, cuda or cuda:N")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise error(f"{flag} {device} asked for, but torch sees no CUDA GPU", f"pass {flag} cpu")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise error(f"{flag} {device}: torch sees {torch.cuda.device_count()} CUDA GPU(s)",
                        f"pass {flag} cuda:0" + (f" to cuda:{torch.cuda.device_count() - 1}"
                                                  if torch.cuda.device_count() > 1 else ""))
    return device


def memory_budget(device: str | torch.device | None = None) -> int | None:
    """The most this process's peak may reach: what it holds now plus what the machine (or its cgroup's
    limit, where lower) can still give it. On a CUDA device: the device's free memory plus what torch
    holds there. `EFFATTN_MEMORY_LIMIT` (e.g. 8GB) replaces it. None where nothing can be asked."""
    limit = os.environ.get(MEMORY_LIMIT_ENV)
    if limit:
        from .io.writer import parse_size

        return parse_size(limit)
    if device is not None and str(device).startswith("cuda") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free + torch.cuda.memory_reserved(torch.device(device))
    free = [x for x in (_meminfo_available(), _cgroup_free()) if x is not None]
    return rss() + min(free) if free else None


def gib(nbytes: float) -> str:
    """A size for people: GiB, MiB, KiB or bytes, whichever keeps it readable (tiny models have tiny sizes)."""
    for unit, shift, fmt in (("GiB", 30, ",.1f"), ("MiB", 20, ",.0f"), ("KiB", 10, ",.0f")):
        if nbytes >= 2**shift:
            return f"{nbytes / 2**shift:{fmt}} {unit}"
    return f"{nbytes:,.0f} bytes"


def largest_fitting(peak_of, lowest: int, highest: int, budget: int, step: int = 1) -> int | None:
    """The largest multiple of `step` in [lowest, highest] whose `peak_of(value)` fits `budget` (peak_of
    grows with the value), or None when not even `lowest` fits."""
    lo, hi = -(-lowest // step), highest // step  # in units of step
    if lo > hi or peak_of(lo * step) > budget:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if peak_of(mid * step) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def _round_down(value: int, step: int) -> int:
    """`value` to two significant digits, down, and a multiple of `step` (243,557 -> 240,000)."""
    if value < 100:
        return value
    unit = 10 ** (len(str(value)) - 2)
    nice = value // unit * unit // step * step
    return nice if nice > 0 else value


def check_memory(peak: int, *, what: str, options=(), check: bool = True, device=None, also: str = "",
                 budget: int | None = None) -> None:
    """Refuse a run whose estimated `peak` (bytes, the process's resident set, or the device's memory)
    exceeds the budget, before its heavy work. `options` are (flag, value, peak_of, lowest, step): the
    knobs that shrink the run, tried in order; the first with a value that fits is named with the
    largest such value ("use FLAG N or less", or FLAG's own wording when it holds "{}"). `also` adds a
    fix (e.g. dropping an optional measurement). `check=False` (the user's --no-memory-check) turns
    the check off. `budget` (bytes) replaces what this machine has (planning for another one)."""
    from .errors import EffattnError

    planned = budget is not None
    budget = budget if planned else memory_budget(device)
    if not check or budget is None or peak <= budget * MEMORY_MARGIN:
        return
    room = int(budget * MEMORY_MARGIN)
    where = "each device" if planned else "the GPU" if device is not None and str(device).startswith("cuda") else "this machine"
    head = (f"{what} needs about {gib(peak)} of memory at its peak; {where} has {gib(budget)} for it, and the check "
            f"holds runs to {MEMORY_MARGIN:.0%} of that ({gib(room)}) since estimates can be ~10% low")
    fixes = []
    for flag, value, peak_of, lowest, step in options:
        best = largest_fitting(peak_of, lowest, value - 1, room, step) if value > lowest else None
        if best is not None:
            best = _round_down(best, step)
            fixes.append("use " + (flag.format(best) if "{}" in flag else f"{flag} {best} or less"))
            break
    fixes += [also] if also else []
    fixes += [] if fixes else ["run it on a machine with more memory"]
    fixes.append(f"pass {NO_MEMORY_CHECK} to run anyway")
    raise EffattnError(head, ", ".join(fixes[:-1]) + ", or " + fixes[-1])
