"""Attention benchmark: one causal attention layer forward, SDPA against Transformer-VQ.

Every (kind, length) point runs in a fresh Python subprocess, so that its memory is its own:

* time: median wall time of ``repeats`` forward passes (``torch.inference_mode``, batch 1), after a
  warm-up call on a short sequence and the memory pass below; also the median CPU time of the
  process (all threads), which, with one thread, stays meaningful on a machine shared with other jobs;
* memory (CPU): the peak resident set size (RSS) reached during one forward pass minus the RSS just
  before it, inputs already allocated. The kernel's high-water mark is reset right before the pass
  (``/proc/self/clear_refs``, Linux) and read back from ``VmHWM``, so earlier peaks (imports,
  warm-up) cannot hide it; where that is unavailable, ``ru_maxrss`` is used instead. It counts the
  output tensor (reported separately as ``output_bytes``) and everything the kernel allocates.
  On CUDA it is ``torch.cuda.max_memory_allocated`` over the pass, minus the memory before it.

Kinds are a registry (``BENCH_KINDS``, ``register_kind``; ``effattn bench --attention list`` shows it),
all taking pre-RoPE q/k and the RoPE tables as inputs, so that every kind pays its own rotations:

* ``sdpa``: RoPE on q and k, then ``scaled_dot_product_attention(is_causal=True, enable_gqa=True)``;
* ``vq``: nearest-codeword codes for the keys (1024 positions at a time) then ``vq_attention_chunk``;
* ``vq_means``: the same with ``key_means=True`` (codes scored at the mean of their keys, a key sum
  per code in the state);
* ``vq_naive``: the same codes then the quadratic reference ``vq_attention_naive`` (short lengths only);
* ``sparse``: RoPE, then the ``--pattern`` (longformer, bigbird, strided at their default parameters)
  through FlexAttention's block-sparse kernel, compiled (the block mask is built and the kernel compiled
  for the point's length before anything is measured); ``sparse_naive``: the masked-softmax reference;
* ``swa``: the same kernel on a sliding window of ``--window`` keys (and ``--sinks`` first positions);
* ``linear``: RoPE, the KV heads repeated to the query heads, the ``--feature-map`` (hedgehog, P 64, by
  default; two maps, as the model has) on queries and keys, then LoLCATs' hybrid of softmax over the
  last ``--window`` keys (and the ``--sinks`` first positions; 0 by default here, 4 in ``convert --to
  linear``) and linear attention beyond through ``hybrid_attention_chunk``; all of it 4,096
  positions at a time, each segment continuing the state of the one before (as a chunked prefill), so
  the working memory is flat in length; ``linear_naive``: the quadratic reference, whole.
Each point of a pattern reports its density: the fraction of causal (query, key) pairs it reads.
"""

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from effattn.errors import EffattnError, one_of

NAIVE_MAX_LENGTH = 8192  # vq_naive materialises several (heads, T, T) tensors


@dataclass(frozen=True)
class BenchKind:
    """One attention implementation to benchmark. `build(x)` takes the inputs of one point (``x``: q
    [1, T, H, D], k/v [1, T, G, D] pre-RoPE, cos/sin [T, D], the spec's settings, ...) and returns a
    closure running one forward on them."""

    name: str
    description: str
    build: Callable[[dict], Callable[[], torch.Tensor]]
    max_length: int | None = None  # longer lengths are refused (e.g. quadratic-memory references)
    score_copies: int = 0  # (heads, T, T) float32 tensors it holds at once (quadratic references); 0: none
    # queries per chunk of a reference that scores a chunk of queries against every key at once (sparse_naive): it
    # holds ~3 (heads, chunk, T) float32 tensors (scores, masked, softmax) and the mask's temporaries; 0: none
    query_chunk: int = 0


BENCH_KINDS: dict[str, BenchKind] = {}


def register_kind(kind: BenchKind) -> None:
    BENCH_KINDS[kind.name] = kind


def _sdpa(x: dict):
    q, k, v, cos, sin = x["q"], x["k"], x["v"], x["cos"], x["sin"]

    def run():
        from effattn.kernels.rope import apply_rope

        q_rot = apply_rope(q, cos[:, None], sin[:, None]).transpose(1, 2)  # (1, H, T, D)
        k_rot = apply_rope(k, cos[:, None], sin[:, None]).transpose(1, 2)  # (1, G, T, D)
        out = torch.nn.functional.scaled_dot_product_attention(q_rot, k_rot, v.transpose(1, 2), is_causal=True,
                                                               enable_gqa=True)
        return out.transpose(1, 2)

    return run


def _vq(naive: bool = False, key_means: bool = False, bf16: bool = False, heavy: bool = False):
    def build(x: dict):
        from effattn.kernels.vq import nearest_codes, vq_attention_chunk, vq_attention_naive
        from effattn.kernels.vq.heavy import vq_heavy_chunk

        spec = x["spec"]
        codebook = x["randn"](spec["kv_heads"], spec["codebook_size"], spec["head_dim"])
        if heavy:  # the far keys that drew the most attention kept exact, cut every block
            kernel = vq_heavy_chunk
            settings = dict(window=spec["window"], update=spec["block_size"], budget=spec["heavy_keys"],
                            key_means=key_means)
        else:
            kernel = vq_attention_naive if naive else vq_attention_chunk
            settings = dict(window=spec["window"], block_size=spec["block_size"], sinks=spec["sinks"],
                            key_means=key_means, **({"bf16_products": True} if bf16 else {}))

        def run():
            codes = nearest_codes(x["k"], codebook)
            return kernel(x["q"], x["k"], x["v"], codebook, codes, x["cos"], x["sin"], x["far_cos"], x["far_sin"],
                          **settings)

        return run

    return build


def pattern_for(kind: str, spec: dict):
    """The Pattern a sparse kind runs: `--pattern` at its conversion defaults, or the window (swa)."""
    from effattn.kernels.patterns import Pattern

    if kind == "swa":
        return Pattern("window", window=spec["window"], sinks=spec["sinks"])
    from effattn.convert.sparse import DEFAULTS, PATTERN_OPTIONS

    name = spec.get("pattern") or "strided"
    return Pattern(name, **{k: DEFAULTS[k] for k in PATTERN_OPTIONS[name]}, **(
        {"max_length": max(spec["length"], 1 << 17)} if name == "bigbird" else {}))


def _pattern(kind: str, naive: bool = False):
    def build(x: dict):
        from effattn.kernels.patterns import block_mask, flex_attention_pattern, naive_attention
        from effattn.kernels.rope import apply_rope

        q, k, v, cos, sin = x["q"], x["k"], x["v"], x["cos"], x["sin"]
        pattern = pattern_for(kind, x["spec"] | {"length": q.shape[1]})
        scale = q.shape[-1] ** -0.5

        def run():
            q_rot = apply_rope(q, cos[:, None], sin[:, None]).transpose(1, 2)
            k_rot = apply_rope(k, cos[:, None], sin[:, None]).transpose(1, 2)
            if naive:
                return naive_attention(q_rot, k_rot, v.transpose(1, 2), pattern, scale).transpose(1, 2)
            return flex_attention_pattern(q_rot, k_rot, v.transpose(1, 2), pattern, scale).transpose(1, 2)

        if not naive:  # the block mask and the compiled kernel for this length, before any measurement
            block_mask(pattern, q.shape[1], q.shape[1], str(q.device))
            run()
        return run

    return build


def _linear(naive: bool = False):
    def build(x: dict):
        from effattn.attention.linear import build_feature_map, repeat_heads
        from effattn.kernels.linear import hybrid_attention_chunk, hybrid_attention_naive
        from effattn.kernels.linear.chunk import SEGMENT_SIZE
        from effattn.kernels.rope import apply_rope

        spec, q, k, v, cos, sin = x["spec"], x["q"], x["k"], x["v"], x["cos"], x["sin"]
        H, D = spec["heads"], spec["head_dim"]
        rep = H // spec["kv_heads"]
        name = spec.get("feature_map") or "hedgehog"
        fmap_q, fmap_k = (build_feature_map({"name": name, **LINEAR_MAP_ARGS.get(name, {})}, D, H).to(x["device"],
                                                                                                     x["dtype"])
                          for _ in range(2))
        mix = torch.full((H,), 0.5, device=x["device"], dtype=torch.float32)  # wf = lf (the value does not matter)

        settings = dict(window=spec["window"], window_factor=mix, linear_factor=mix, scale=D**-0.5,
                        sinks=spec["sinks"])

        def inputs(part: slice):  # RoPE, the KV heads repeated (as the model), the feature maps
            q_rot = apply_rope(q[:, part], cos[part, None], sin[part, None])  # [1, n, H, D]
            k_rot = repeat_heads(apply_rope(k[:, part], cos[part, None], sin[part, None]), rep)  # [1, n, H, D]
            return q_rot, k_rot, repeat_heads(v[:, part], rep), fmap_q(q_rot), fmap_k(k_rot)

        def run():
            if naive:
                return hybrid_attention_naive(*inputs(slice(None)), **settings)
            # segment by segment, each continuing the state (as a chunked prefill): flat working memory
            out, state = q.new_empty(q.shape[:3] + v.shape[3:]), None
            for start in range(0, q.shape[1], SEGMENT_SIZE):
                part = slice(start, start + SEGMENT_SIZE)
                out[:, part], state = hybrid_attention_chunk(*inputs(part), **settings, state=state, return_state=True)
            return out

        return run

    return build


# the `linear` kinds' feature maps at `convert --to linear`'s defaults
LINEAR_MAP_ARGS = {"hedgehog": {"projection_dim": 64}, "performer": {"num_features": 128}}

for _kind in (
    BenchKind("sdpa", "RoPE on q and k, then scaled_dot_product_attention (causal, GQA)", _sdpa),
    BenchKind("vq", "Transformer-VQ: nearest-codeword codes, then the chunked kernel (vq_attention_chunk)", _vq()),
    BenchKind("vq_means", "vq with key means (codes scored at the mean of their keys)", _vq(key_means=True)),
    BenchKind("vq_bf16", "vq with the code products in bfloat16 (bf16_products; AMX / AVX-512 BF16 CPUs)",
              _vq(bf16=True)),
    BenchKind("vq_means_bf16", "vq_means with the code products in bfloat16", _vq(key_means=True, bf16=True)),
    BenchKind("vq_heavy", "vq_means with the --heavy-keys far keys per KV head that drew the most attention kept "
                          "exact, cut every --block-size positions (vq_heavy_chunk; compiled for float32 on the CPU)", _vq(key_means=True, heavy=True)),
    BenchKind("vq_naive", "vq through the quadratic reference vq_attention_naive", _vq(naive=True), NAIVE_MAX_LENGTH,
              score_copies=4),
    BenchKind("sparse", "--pattern (longformer, bigbird, strided) on FlexAttention block masks, compiled",
              _pattern("sparse")),
    BenchKind("sparse_naive", "--pattern through the masked-softmax reference (queries in chunks of 1024)",
              _pattern("sparse", naive=True), query_chunk=1024),
    BenchKind("swa", "a sliding window of --window keys (+ --sinks) on FlexAttention block masks, compiled",
              _pattern("swa")),
    BenchKind("linear", "LoLCATs hybrid: softmax over the last --window keys (+ --sinks) + linear attention beyond (--feature-map, "
                        "hedgehog by default), chunked kernel (hybrid_attention_chunk), KV heads repeated", _linear()),
    BenchKind("linear_naive", "linear through the quadratic reference hybrid_attention_naive", _linear(naive=True),
              NAIVE_MAX_LENGTH, score_copies=4),
):
    register_kind(_kind)
PATTERN_KINDS = ("sparse", "sparse_naive", "swa")
MEASURED = ("density", "time_s", "time_min_s", "cpu_time_s", "peak_mem_bytes", "output_bytes", "threads")


class BenchSettingsError(EffattnError, ValueError):
    """A bad benchmark setting: a ValueError for library callers, a one-line error for the CLI."""


def bench_attention(
    kinds: tuple[str, ...] | list[str] = ("sdpa", "vq"),
    lengths: tuple[int, ...] | list[int] = (1024, 4096, 16384, 32768),
    *,
    heads: int = 9,
    kv_heads: int = 3,
    head_dim: int = 64,
    window: int = 256,
    codebook_size: int = 512,
    block_size: int = 64,
    sinks: int = 0,
    heavy_keys: int = 192,
    pattern: str = "strided",
    feature_map: str = "hedgehog",
    dtype: str | torch.dtype = "float32",
    repeats: int = 3,
    threads: int | None = None,
    device: str = "cpu",
    seed: int = 0,
    omp_wait_policy: str | None = None,
    timeout_s: float = 3600.0,
    progress: Callable[[str], None] | None = None,
    memory_check: bool = True,
    dry_run: bool = False,
) -> list[dict]:
    """Time one attention layer forward and measure its peak memory, per kind and length.

    Args:
        kinds: names in ``BENCH_KINDS``.
        lengths: sequence lengths T (batch 1, causal).
        heads, kv_heads, head_dim: query heads, key/value heads (``heads % kv_heads == 0``), head size.
        window, codebook_size, block_size, sinks: Transformer-VQ settings (W, C, L, sinks); window and
            sinks are also the `swa` kind's.
        heavy_keys: the `vq_heavy` kind's budget of exact far keys per KV head.
        pattern: the `sparse` kinds' pattern: longformer, bigbird or strided.
        feature_map: the `linear` kinds' feature map: hedgehog, elu, performer or taylor.
        dtype: input dtype, e.g. ``"float32"`` or ``"bfloat16"``.
        repeats: timed passes per point (the median is reported).
        threads: torch intra-op threads in the subprocess (default: torch's default, all cores).
        device: ``"cpu"`` or ``"cuda"``.
        seed: random seed of the inputs.
        omp_wait_policy: ``OMP_WAIT_POLICY`` of the subprocesses. ``"passive"`` keeps idle OpenMP threads
            from spinning: on a machine shared with other jobs, spinning threads that lose their core
            make every parallel region wait for a time slice, which slows kernels made of many small
            operations (``vq``) far more than one large fused one (``sdpa``). Default: inherited.
        timeout_s: limit per point.
        progress: called with a short description before each point.
        memory_check: refuse lengths whose estimated peak memory exceeds the machine's (default).
        dry_run: check everything and return the points without measuring them: one dict per (kind, length)
            with ``kind, length, est_peak_bytes`` (the point's process, ``point_peak_bytes``).

    Returns:
        One dict per (kind, length) with ``kind, length, time_s, time_min_s, cpu_time_s,
        peak_mem_bytes, output_bytes`` and the settings used.

    Raises:
        BenchSettingsError: (a ValueError) for a bad setting, before anything is measured.
    """
    from effattn.io.load import DTYPES

    dtype_name = str(DTYPES.get(dtype, dtype)).removeprefix("torch.")  # eval's names too: fp32, bf16, fp16
    check_settings(
        kinds, lengths, heads=heads, kv_heads=kv_heads, head_dim=head_dim, window=window,
        codebook_size=codebook_size, block_size=block_size, sinks=sinks, dtype=dtype_name, repeats=repeats,
        threads=threads, device=device, omp_wait_policy=omp_wait_policy, pattern=pattern, feature_map=feature_map,
        heavy_keys=heavy_keys,
    )  # fmt: skip
    if memory_check:
        check_bench_memory(kinds, lengths, device=device, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                           codebook_size=codebook_size, dtype=dtype_name)
    settings = dict(
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        window=window,
        codebook_size=codebook_size,
        block_size=block_size,
        sinks=sinks,
        heavy_keys=heavy_keys,
        pattern=pattern,
        feature_map=feature_map,
        dtype=dtype_name,
        repeats=repeats,
        threads=threads,
        device=device,
        seed=seed,
        omp_wait_policy=omp_wait_policy,
    )
    points = [(kind, n) for kind in kinds for n in lengths]
    if dry_run:
        return [{"kind": kind, "length": n, "est_peak_bytes": point_peak_bytes(kind, n, **settings)}
                for kind, n in points]
    results = []
    for i, (kind, n) in enumerate(points):
        if progress is not None:
            progress(f"{kind} at {n} tokens ({i + 1}/{len(points)})")
        results.append(_run_point({**settings, "kind": kind, "length": n}, timeout_s))
    return results


def check_settings(
    kinds, lengths, *, heads, kv_heads, head_dim, window, codebook_size, block_size, sinks, dtype, repeats,
    threads=None, device="cpu", omp_wait_policy=None, pattern="strided", feature_map="hedgehog", heavy_keys=192,
) -> None:  # fmt: skip
    """Raise :class:`BenchSettingsError` (a ValueError) on the first bad setting of ``bench_attention``."""
    unknown = [kind for kind in kinds if kind not in BENCH_KINDS]
    if unknown:
        raise BenchSettingsError(f"Unknown attention kind(s) {unknown}", one_of(unknown[0], BENCH_KINDS))
    if not kinds or not lengths:
        raise BenchSettingsError("No attention kind or no length to measure", "pass at least one of each")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise BenchSettingsError(f"Unknown dtype {dtype!r}: attention runs in float32, bfloat16 or float16",
                                 "pass one of them (or fp32, bf16, fp16)")
    if head_dim % 2:
        raise BenchSettingsError(f"head_dim must be even (RoPE rotates pairs of dimensions), got {head_dim}",
                                 f"pass e.g. {head_dim + 1}")
    positive = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, window=window, codebook_size=codebook_size,
                    block_size=block_size, repeats=repeats, threads=1 if threads is None else threads)  # fmt: skip
    for name, value in {**positive, **{f"length {n}": n for n in lengths}}.items():
        if value < 1:
            raise BenchSettingsError(f"{name} must be at least 1, got {value}", "pass a positive value")
    cores = os.cpu_count() or 1
    if threads is not None and threads > cores:  # more threads than cores measures contention (and 1e5 crashes torch)
        raise BenchSettingsError(f"threads {threads} is more than this machine's {cores} cores",
                                 f"pass {cores} or fewer (1 gives timings that hold on a shared machine)")
    if sinks < 0:
        raise BenchSettingsError(f"sinks must be 0 or more, got {sinks}", "pass 0 for no sinks")
    if "vq_heavy" in kinds and heavy_keys < 1:
        raise BenchSettingsError(f"heavy_keys must be at least 1 for vq_heavy, got {heavy_keys}",
                                 "pass the far keys kept exact per KV head; vq measures VQ without them")
    if heavy_keys < 0:
        raise BenchSettingsError(f"heavy_keys must be 0 or more, got {heavy_keys}", "leave it out: only vq_heavy reads it")
    if heads % kv_heads:
        divisors = [g for g in range(1, heads + 1) if heads % g == 0]
        raise BenchSettingsError(f"heads={heads} is not a multiple of kv_heads={kv_heads}",
                                 f"pick kv_heads dividing heads: one of {divisors}")  # fmt: skip
    if omp_wait_policy is not None and omp_wait_policy.lower() not in ("active", "passive"):
        raise BenchSettingsError(f"omp_wait_policy must be 'active' or 'passive', got {omp_wait_policy!r}",
                                 "pass one of them, or leave it unset")  # fmt: skip
    from effattn.convert.sparse import PATTERN_OPTIONS

    if pattern not in PATTERN_OPTIONS:
        raise BenchSettingsError(f"Unknown pattern {pattern!r}", one_of(pattern, PATTERN_OPTIONS))
    from effattn.kernels.linear import FEATURE_MAPS

    if feature_map not in FEATURE_MAPS:
        raise BenchSettingsError(f"Unknown feature map {feature_map!r}", one_of(feature_map, FEATURE_MAPS))
    from effattn.resources import check_device

    check_device(device, error=BenchSettingsError)
    for name in kinds:
        limit = BENCH_KINDS[name].max_length
        if limit is not None and max(lengths) > limit:
            raise BenchSettingsError(f"{name} is limited to lengths <= {limit}, got {max(lengths)} "
                                     f"({BENCH_KINDS[name].description})",
                                     "benchmark it on shorter sequences, or leave it out")


def parse_lengths(text: str) -> list[int]:
    """``"1024,4096"`` -> ``[1024, 4096]``; raises :class:`BenchSettingsError` on anything else."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    bad = [item for item in items if not (item.isascii() and item.isdigit())]
    if bad or not items:
        raise BenchSettingsError(f"lengths {text!r} are not a comma-separated list of whole numbers"
                                 + (f" ({bad[0]!r})" if bad else ""), "pass e.g. 1024,4096,16384,32768")  # fmt: skip
    return list(dict.fromkeys(int(item) for item in items))  # each once, in the order given


def parse_kinds(text: str) -> list[str]:
    """``"sdpa, vq"`` -> ``["sdpa", "vq"]`` (checked by ``bench_attention``)."""
    return list(dict.fromkeys(item.strip() for item in text.split(",") if item.strip()))  # each once


def check_plot_path(path: str | Path) -> Path:
    """The plot's path, if its folder exists and its suffix names an image format matplotlib writes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    path = Path(path)
    if path.is_symlink() and not path.resolve().parent.is_dir():  # the plot is written where the link points
        raise BenchSettingsError(f"the plot {path} is a link into a folder that does not exist ({path.resolve().parent})",
                                 "create that folder, or pick another path")
    if not path.parent.is_dir():
        raise BenchSettingsError(f"the folder of the plot {path} does not exist", "create it first, or pick another path")
    if path.is_dir():
        raise BenchSettingsError(f"the plot {path} is a folder", "name a file in it, e.g. plot.png")
    formats = FigureCanvasAgg.get_supported_filetypes()
    if path.suffix.lstrip(".").lower() not in formats:
        raise BenchSettingsError(f"cannot tell the image format of the plot {path} from its suffix",
                                 f"end the file name with .png ({one_of(path.suffix.lstrip('.'), formats)})")  # fmt: skip
    from effattn.io.writer import unwritable

    why = unwritable(path.resolve().parent)  # before any measurement: permissions, /proc, a read-only disk
    if why:
        raise BenchSettingsError(f"cannot write the plot {path}: {why}", "pick a path in a writable folder")
    return path


def run_report(kinds, lengths, **settings) -> dict:
    """``bench_attention`` plus what is needed to read its numbers: machine, settings, load average."""
    load_before = os.getloadavg()[0]
    results = bench_attention(kinds, lengths, **settings)
    load_after = os.getloadavg()[0]
    return dict(
        machine=machine_info(),
        settings={k: v for k, v in results[0].items() if k not in ("kind", "length") and k not in MEASURED},
        load_average=dict(before=load_before, after=load_after),
        results=results,
    )


def describe(report: dict) -> str:
    """One paragraph: what was measured, with which settings, on which machine and under which load."""
    s, info, load = report["settings"], report["machine"], report["load_average"]
    threads = "/".join(str(n) for n in sorted({r["threads"] for r in report["results"]}))
    policy = s["omp_wait_policy"] or os.environ.get("OMP_WAIT_POLICY", "unset")
    return (
        f"One causal attention layer forward, batch 1, {s['heads']} query heads, {s['kv_heads']} key/value heads, "
        f"head_dim {s['head_dim']}, {s['dtype']}, on {s['device']}; VQ: window {s['window']}, codebook "
        f"{s['codebook_size']}, block_size {s['block_size']}, sinks {s['sinks']}"
        + (f"; vq_heavy: {s.get('heavy_keys')} exact far keys per KV head"
           if any(r["kind"] == "vq_heavy" for r in report["results"]) else "")
        + (f"; sparse: {s.get('pattern')}" if any(r["kind"] in ("sparse", "sparse_naive") for r in report["results"]) else "")
        + (f"; linear: {s.get('feature_map')} map, window {s['window']}, sinks {s['sinks']}"
           if any(r["kind"].startswith("linear") for r in report["results"]) else "")
        + f". Median wall and process CPU time "
        f"of {s['repeats']} run(s); peak memory is the peak RSS growth during one forward pass over the inputs "
        f"(fresh process per point), output included. Machine: {info['cpu']}, {info['cores']} cores, {threads} torch "
        f"threads, torch {info['torch']}, Python {info['python']}{', GPU ' + info['gpu'] if 'gpu' in info else ''}; "
        f"1-minute load average {load['before']:.2f} before, {load['after']:.2f} after; OMP_WAIT_POLICY {policy}."
    )


POINT_BASE_BYTES = 400 * 2**20  # a point's fresh process before its inputs: Python, torch, effattn (~0.35 GiB measured)


def point_peak_bytes(kind: str, length: int, *, heads: int, kv_heads: int, head_dim: int, codebook_size: int,
                     dtype: str = "float32", **_) -> int:
    """Estimated peak resident set of one point's process: its start, the inputs (q, k, v, RoPE tables),
    their rotated and transposed copies and the output (~4x the inputs: BENCHMARKS.md measures SDPA's
    working memory at ~2x the output), the codebook, and any (heads, T, T) tensors the kind holds."""
    itemsize = getattr(torch, dtype).itemsize
    inputs = length * ((heads + 2 * kv_heads) * head_dim * itemsize + 2 * head_dim * 4)
    scores = BENCH_KINDS[kind].score_copies * heads * length * length * 4
    # a chunk of queries against every key: 3 float32 score tensors and ~24 bytes of mask temporaries per pair;
    # sparse_naive at 8,192 / 16,384 (9 heads) peaked at 1.47 / 2.54 GiB, estimated 0.52 / 0.66 GiB without this term
    rows = min(BENCH_KINDS[kind].query_chunk, length)
    chunk = rows * length * (3 * heads * 4 + 24)
    return POINT_BASE_BYTES + 4 * inputs + kv_heads * codebook_size * head_dim * itemsize + scores + chunk


def check_bench_memory(kinds, lengths, *, device: str = "cpu", **settings) -> None:
    """Refuse lengths whose point would not fit (each point is a fresh process: it gets what the machine
    has free), naming the longest length that fits."""
    from .resources import check_memory, memory_budget, rss

    cuda = device.startswith("cuda")
    held = 0 if cuda else rss() - POINT_BASE_BYTES  # this process's own memory is not the point's
    longest = max(lengths)
    for kind in kinds:
        def peak_of(n: int, kind=kind) -> int:
            return point_peak_bytes(kind, n, **settings) - (POINT_BASE_BYTES if cuda else 0) + held

        if memory_budget(device if cuda else None) is None:
            return
        check_memory(peak_of(longest), what=f"bench of {kind} at length {longest:,}", device=device if cuda else None,
                     options=[("--lengths values of", longest, peak_of, 1, 1)])


def _run_point(spec: dict, timeout_s: float) -> dict:
    """Measure one point in a fresh interpreter that imports this very copy of effattn."""
    package_root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH"))))}
    if spec["omp_wait_policy"]:
        env["OMP_WAIT_POLICY"] = spec["omp_wait_policy"].upper()
    proc = subprocess.run(
        [sys.executable, "-c", "from effattn.bench import _child_main; _child_main()"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"Benchmark point {spec['kind']} at length {spec['length']} failed (exit code {proc.returncode}); "
            f"its error output ends with:\n{proc.stderr[-2000:]}"
        )
    return {**spec, **json.loads(proc.stdout.strip().splitlines()[-1])}


def _child_main() -> None:
    spec = json.loads(sys.stdin.read())
    print(json.dumps(_measure(spec)))


def _rss_bytes(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (peak) of this process from /proc, in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{field} not found in /proc/self/status")


def _reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark to its current RSS (Linux >= 4.0). Memory freed earlier (the
    warm-up's, the inputs' temporaries) goes back to the system first (glibc's malloc_trim): the allocator would
    otherwise hand it to the forward pass without the RSS growing (effattn keeps freed heap: `effattn/__init__.py`),
    and the peak could read below the output."""
    from effattn.resources import release_free_heap

    release_free_heap()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _max_rss_bytes() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def _layer(kind: str, spec: dict, T: int, device: str):
    """Inputs and a closure running one attention forward on them."""
    from effattn.kernels.rope import rope_tables

    H, G, D, W = spec["heads"], spec["kv_heads"], spec["head_dim"], spec["window"]
    dtype = getattr(torch, spec["dtype"])
    gen = torch.Generator(device=device).manual_seed(spec["seed"])

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q, k, v = randn(1, T, H, D), randn(1, T, G, D), randn(1, T, G, D)
    cos, sin = (x.to(device, dtype) for x in rope_tables(T, D))
    far_cos, far_sin = (x[0].to(device, dtype) for x in rope_tables(torch.tensor([W]), D))
    inputs = {"q": q, "k": k, "v": v, "cos": cos, "sin": sin, "far_cos": far_cos, "far_sin": far_sin, "spec": spec,
              "randn": randn, "device": device, "dtype": dtype}
    return BENCH_KINDS[kind].build(inputs)


def _measure(spec: dict) -> dict:
    device = spec["device"]
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    cuda = device.startswith("cuda")

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    with torch.inference_mode():
        _layer(spec["kind"], spec, min(spec["length"], 2 * spec["window"] + 64), device)()  # warm-up: library init
        run = _layer(spec["kind"], spec, spec["length"], device)

        # memory: one pass, high-water mark reset just before it
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        else:
            peak_was_reset = _reset_peak_rss()
            before = _rss_bytes("VmRSS") if peak_was_reset else _max_rss_bytes()
        out = run()
        sync()
        if cuda:
            peak = torch.cuda.max_memory_allocated(device)
        else:
            peak = _rss_bytes("VmHWM") if peak_was_reset else _max_rss_bytes()
        output_bytes = out.numel() * out.element_size()
        del out

        times, cpu_times = [], []
        for _ in range(spec["repeats"]):
            sync()
            start, cpu_start = time.perf_counter(), time.process_time()
            run()
            sync()
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)

    extra = {}
    if spec["kind"] in PATTERN_KINDS:
        from effattn.kernels.patterns import density

        pattern = pattern_for(spec["kind"], spec)
        extra = {"density": density(pattern, spec["length"])}
    return dict(
        **extra,
        time_s=statistics.median(times),
        time_min_s=min(times),
        cpu_time_s=statistics.median(cpu_times),
        peak_mem_bytes=max(0, peak - before),
        output_bytes=output_bytes,
        threads=torch.get_num_threads(),
    )


def machine_info() -> dict:
    """A short description of the machine the benchmark runs on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = dict(
        cpu=cpu,
        cores=os.cpu_count(),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        python=platform.python_version(),
    )
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


# speed-ups are over sdpa at the same length; the peak memory includes the output
TABLE_COLUMNS = ("kind", "length", "time (s)", "speed-up", "CPU time (s)", "CPU speed-up", "peak mem (MiB)",
                 "output (MiB)")  # fmt: skip


def table_rows(results: list[dict]) -> list[tuple[str, ...]]:
    """Rows of ``TABLE_COLUMNS`` as text, by length then kind, with speed-ups over SDPA at each length."""
    sdpa = {r["length"]: r for r in results if r["kind"] == "sdpa"}
    rows = []
    order = list(BENCH_KINDS)
    for r in sorted(results, key=lambda r: (r["length"], order.index(r["kind"]) if r["kind"] in order else len(order))):
        ref = sdpa.get(r["length"])
        name = "window" if r["kind"] == "swa" else r.get("pattern")
        kind = f"{r['kind']} ({name}, {r['density']:.1%})" if r.get("density") is not None else r["kind"]
        rows.append((
            kind, str(r["length"]), f"{r['time_s']:.3f}",
            f"{ref['time_s'] / r['time_s']:.1f}x" if ref else "-",
            f"{r['cpu_time_s']:.3f}",
            f"{ref['cpu_time_s'] / r['cpu_time_s']:.1f}x" if ref else "-",
            f"{r['peak_mem_bytes'] / 2**20:.1f}", f"{r['output_bytes'] / 2**20:.1f}",
        ))  # fmt: skip
    return rows


def format_table(results: list[dict]) -> str:
    """Markdown table of ``bench_attention`` results, with speed-ups over SDPA at each length."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|---|" + "---:|" * (len(TABLE_COLUMNS) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results)]
    return "\n".join(lines)


def plot_bench(results: list[dict], path: str | Path) -> Path:
    """Save time and working memory (peak memory less the output) against sequence length, one line per
    kind, log-log axes.

    The image goes to a temporary file next to ``path``, renamed over it once complete."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FormatStrFormatter

    fig = Figure(figsize=(10, 4), layout="constrained")
    FigureCanvasAgg(fig)
    time_ax, mem_ax = fig.subplots(1, 2)
    for kind in dict.fromkeys(r["kind"] for r in results):
        points = sorted((r for r in results if r["kind"] == kind), key=lambda r: r["length"])
        lengths = [r["length"] for r in points]
        time_ax.plot(lengths, [r["time_s"] for r in points], marker="o", label=kind)
        working = [max(r["peak_mem_bytes"] - r["output_bytes"], 2**17) / 2**20 for r in points]  # floor: log axis
        mem_ax.plot(lengths, working, marker="o", label=kind)
    for ax, label in ((time_ax, "forward time (s)"), (mem_ax, "peak memory over inputs and output (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.set_xlabel("sequence length")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    first = results[0]
    fig.suptitle(
        f"one attention layer, batch 1, {first['heads']} heads / {first['kv_heads']} kv heads x {first['head_dim']}, "
        f"W={first['window']}, C={first['codebook_size']}, {first['dtype']}"
    )
    path = check_plot_path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, dpi=120, format=path.suffix.lstrip(".").lower())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
