"""`effattn bench`: a real (tiny) run with --json and --plot, the human table, and one-line errors.

Speed is checked by benchmarks/bench_vq_attention.py (BENCHMARKS.md), never by timed assertions here.
"""

from __future__ import annotations

import json

import pytest

from effattn.bench import BENCH_KINDS as KINDS

from .test_cli_errors import assert_one_line_error, run_cli

TINY = ("--repeats", "1", "--window", "64", "--codebook-size", "32")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# the compiled FlexAttention kinds compile a kernel per point: measured once, in their own test below
QUICK = [k for k in KINDS if k not in ("sparse", "swa")]


@pytest.mark.slow
def test_bench_json_and_plot(capsys, tmp_path):
    plot = tmp_path / "bench.png"
    code, stdout, _ = run_cli(capsys, "bench", "--attention", ",".join(QUICK), "--lengths", "256", *TINY,
                              "--feature-map", "elu", "--json", "--plot", plot)
    assert code in (0, None)
    report = json.loads(stdout)  # stdout holds the JSON and nothing else
    assert set(report) == {"machine", "settings", "load_average", "results"}
    assert report["settings"]["window"] == 64 and report["settings"]["codebook_size"] == 32
    assert report["settings"]["feature_map"] == "elu"
    assert report["machine"]["cores"] >= 1 and set(report["load_average"]) == {"before", "after"}
    points = {(r["kind"], r["length"]): r for r in report["results"]}
    assert sorted(points) == sorted((kind, 256) for kind in QUICK)
    assert {"linear", "linear_naive", "vq", "sdpa"} <= {kind for kind, _ in points}
    for (kind, n), r in points.items():
        assert r["time_s"] > 0 and r["time_min_s"] > 0 and r["cpu_time_s"] > 0, r
        assert r["peak_mem_bytes"] >= r["output_bytes"] > 0, r  # the output is written in the pass measured
        assert r["output_bytes"] == n * 9 * 64 * 4  # (T, heads, head_dim) float32
    data = plot.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000
    assert [p.name for p in tmp_path.iterdir()] == ["bench.png"]  # no temporary file left


@pytest.mark.slow
def test_bench_prints_a_table(capsys):
    code, stdout, _ = run_cli(capsys, "bench", "--attention", "sdpa,vq", "--lengths", "256", *TINY)
    assert code in (0, None)
    rows = [line for line in stdout.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["sdpa", "vq"]
    assert "1.0x" in rows[0]  # sdpa against itself
    for header in ("speed-up", "peak mem", "CPU time"):
        assert header in stdout
    assert "9 query heads, 3 key/value heads" in stdout and "load average" in stdout


@pytest.mark.slow
def test_bench_sparse_patterns_report_their_density(capsys):
    from effattn.kernels.patterns import Pattern, density

    code, stdout, _ = run_cli(capsys, "bench", "--attention", "sdpa,sparse,swa", "--pattern", "longformer",
                              "--lengths", "512", "--window", "64", "--sinks", "4", "--repeats", "1", "--json")
    assert code in (0, None)
    report = json.loads(stdout)
    points = {r["kind"]: r for r in report["results"]}
    assert points["sdpa"].get("density") is None
    assert points["sparse"]["density"] == pytest.approx(density(Pattern("longformer", window=256, global_tokens=4), 512))
    assert points["swa"]["density"] == pytest.approx(density(Pattern("window", window=64, sinks=4), 512))
    assert all(r["time_s"] > 0 and r["output_bytes"] == 512 * 9 * 64 * 4 for r in points.values())


@pytest.mark.parametrize("args, needles", [
    (["--attention", "sparse", "--pattern", "dense"], ["Unknown pattern 'dense'", "longformer"]),
    (["--attention", "sdpa,flash"], ["Unknown attention kind(s) ['flash']", "valid: linear, linear_naive, sdpa, sparse, sparse_naive, swa, vq, vq_bf16, vq_heavy, vq_means, vq_means_bf16, vq_naive"]),
    (["--attention", "linear", "--feature-map", "cosformer"], ["Unknown feature map 'cosformer'", "hedgehog"]),
    (["--attention", "vqq"], ["did you mean 'vq'?"]),
    (["--lengths", "1k,abc"], ["'1k'", "pass e.g. 1024,4096"]),
    (["--lengths", ","], ["not a comma-separated list", "pass e.g."]),
    (["--lengths", "0"], ["length 0 must be at least 1"]),
    (["--heads", "9", "--kv-heads", "2"], ["heads=9 is not a multiple of kv_heads=2", "[1, 3, 9]"]),
    (["--attention", "vq_naive", "--lengths", "16384"], ["vq_naive is limited to lengths <= 8192", "<= 8192"]),
    (["--dtype", "float33"], ["Unknown dtype 'float33'", "bfloat16"]),
    (["--repeats", "0"], ["repeats must be at least 1"]),
    (["--sinks", "-1"], ["sinks must be 0 or more"]),
    (["--device", "tpu"], ["--device 'tpu' is not a device effattn runs on", "pass --device cpu, cuda or cuda:N"]),
    (["--omp-wait-policy", "lazy"], ["omp_wait_policy must be 'active' or 'passive'"]),
    (["--dtype", "int8"], ["Unknown dtype 'int8'", "float32, bfloat16 or float16"]),
    (["--head-dim", "7"], ["head_dim must be even"]),
    (["--threads", "0"], ["threads must be at least 1, got 0"]),
    (["--heavy-keys", "-1"], ["heavy_keys must be 0 or more"]),
    (["--attention", "vq_heavy", "--heavy-keys", "0"], ["heavy_keys must be at least 1 for vq_heavy"]),
    (["--plot", "."], ["the plot . is a folder"]),
    # the second bug bash of 2026-12-07: both passed the dry run and failed after measuring
    (["--plot", "/proc/effattn-bench.png"], ["cannot write the plot /proc/effattn-bench.png"]),
    (["--threads", "100000"], ["threads 100000 is more than this machine's", "cores"]),
])
def test_bench_bad_input_is_one_line(capsys, args, needles):
    for dry in ([], ["--dry-run"]):
        code, stdout, err = run_cli(capsys, "bench", *args, *dry)
        assert_one_line_error(code, err, *needles)
        assert stdout == ""


def test_the_bench_dry_run_lists_the_points_and_measures_nothing(capsys, monkeypatch, tmp_path):
    import effattn.bench as bench

    monkeypatch.setattr(bench, "_run_point", lambda *a, **k: pytest.fail("a dry run measured a point"))
    code, stdout, _ = run_cli(capsys, "bench", "--attention", "sdpa,vq", "--lengths", "1024,32768", "--dry-run",
                              "--json", "--plot", tmp_path / "b.png")
    points = json.loads(stdout)["points"]
    assert code in (0, None) and [(p["kind"], p["length"]) for p in points] == [
        ("sdpa", 1024), ("sdpa", 32768), ("vq", 1024), ("vq", 32768)]
    settings = dict(heads=9, kv_heads=3, head_dim=64, codebook_size=512, dtype="float32")
    assert all(p["est_peak_bytes"] == bench.point_peak_bytes(p["kind"], p["length"], **settings) for p in points)
    assert list(tmp_path.iterdir()) == []  # the plot is checked, not drawn
    monkeypatch.setenv("EFFATTN_MEMORY_LIMIT", "2GB")  # each point's memory is checked as the run checks it
    code, stdout, err = run_cli(capsys, "bench", "--attention", "sdpa", "--lengths", "1000000", "--dry-run")
    assert_one_line_error(code, err, "bench of sdpa at length 1,000,000", "use --lengths values of")
    code, stdout, _ = run_cli(capsys, "bench", "--attention", "sdpa", "--lengths", "1024", "--dry-run")
    assert code in (0, None) and "effattn bench --dry-run" in stdout and "nothing (dry run)" in stdout


def test_bench_plot_folder_must_exist(capsys, tmp_path):
    code, _, err = run_cli(capsys, "bench", "--plot", tmp_path / "missing" / "bench.png")
    assert_one_line_error(code, err, "missing", "does not exist", "create it first")
    code, _, err = run_cli(capsys, "bench", "--plot", tmp_path / "bench.xyz")
    assert_one_line_error(code, err, "image format", ".png")
    assert list(tmp_path.iterdir()) == []


def test_attention_list_shows_every_registered_kind(capsys):
    from effattn.bench import BenchKind, register_kind, BENCH_KINDS

    code, stdout, _ = run_cli(capsys, "bench", "--attention", "list", "--json")
    assert code == 0 and set(json.loads(stdout)) == set(BENCH_KINDS) >= {"sdpa", "vq", "vq_means", "vq_naive"}
    register_kind(BenchKind("sdpa_copy", "a kind registered from outside", BENCH_KINDS["sdpa"].build))
    try:
        code, stdout, _ = run_cli(capsys, "bench", "--attention", "list")
        assert code == 0 and "sdpa_copy" in stdout and "registered from outside" in stdout
    finally:
        BENCH_KINDS.pop("sdpa_copy")


def test_the_linear_kind_runs_in_segments_and_equals_the_reference():
    """`linear` runs 4,096 positions at a time, each segment continuing the state (flat memory); across a
    segment boundary it computes what the quadratic reference does on the whole sequence."""
    import torch

    from effattn.bench import _layer

    spec = dict(heads=2, kv_heads=1, head_dim=8, window=16, sinks=0, dtype="float32", seed=0, feature_map="hedgehog")
    with torch.inference_mode():
        chunked, naive = (_layer(kind, spec, 4096 + 37, "cpu")() for kind in ("linear", "linear_naive"))
        assert chunked.shape == naive.shape == (1, 4133, 2, 8)
        torch.testing.assert_close(chunked, naive, rtol=1e-4, atol=1e-5)
        spec["sinks"] = 4  # --sinks: the first positions under exact softmax, in both kinds
        with_sinks, naive_sinks = (_layer(kind, spec, 4096 + 37, "cpu")() for kind in ("linear", "linear_naive"))
    torch.testing.assert_close(with_sinks, naive_sinks, rtol=1e-4, atol=1e-5)
    assert (with_sinks - chunked).abs().max() > 1e-3


def test_bench_takes_evals_dtype_names_and_ignores_heavy_keys_without_vq_heavy(capsys):
    code, out, err = run_cli(capsys, "bench", "--attention", "sdpa", "--lengths", "256", "--heads", "2",
                             "--kv-heads", "1", "--head-dim", "16", "--dtype", "fp16", "--heavy-keys", "0",
                             "--repeats", "1", "--threads", "1", "--json")
    assert code in (0, None), err
    report = json.loads(out)
    assert report["settings"]["dtype"] == "float16", report["settings"]


def test_sparse_naive_is_priced_for_its_chunk_of_scores():
    """The reference scores 1,024 queries against every key at once: priced at 0.52 GiB at 8,192 tokens it peaked
    at 1.47 GiB; the chunk's three float32 score tensors and mask temporaries are now counted."""
    from effattn.bench import point_peak_bytes

    settings = dict(heads=9, kv_heads=3, head_dim=64, codebook_size=512)
    for n in (512, 8192):
        extra = point_peak_bytes("sparse_naive", n, **settings) - point_peak_bytes("sparse", n, **settings)
        assert extra == min(1024, n) * n * (3 * 9 * 4 + 24)


def test_a_kind_or_length_given_twice_is_measured_once():
    from effattn.bench import parse_kinds, parse_lengths

    assert parse_lengths("4096,1024,4096") == [4096, 1024] and parse_kinds("sdpa, vq,sdpa") == ["sdpa", "vq"]
