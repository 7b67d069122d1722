"""Bad input is refused before work, by the dry run as by the run; records state what was used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from effattn.errors import EffattnError
from tests.test_cli_errors import assert_one_line_error, leftovers, run_cli


@pytest.mark.parametrize("dry", [[], ["--dry-run"]])
def test_converting_a_model_onto_itself_or_its_parent_is_refused(capsys, tiny, dry):
    src = tiny("llama")
    before = sorted(p.name for p in src.iterdir())
    for out in (src, src.parent):
        code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "--method", "mean", "-o", out, "--force", *dry)
        assert_one_line_error(code, err, "would destroy the input", "another output folder")
        assert sorted(p.name for p in src.iterdir()) == before
    code, _, err = run_cli(capsys, "vq-init", src, "--codebook-size", "8", "--window", "16", "-o", src, "--force", *dry)
    assert_one_line_error(code, err, "would destroy the input")


def test_the_dry_run_refuses_what_the_run_refuses(capsys, tiny, tmp_path):
    src = tiny("llama")
    taken = tmp_path / "taken"
    taken.mkdir()
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    cases = [
        (["--to", "mqa", "--method", "mean", "-o", taken], "already exists"),
        (["--to", "mqa", "--calib", tmp_path / "missing.txt", "-o", tmp_path / "o1"], "missing.txt"),
        (["--to", "mqa", "--calib", empty, "-o", tmp_path / "o2"], "is empty"),
        (["--to", "mqa", "--calib", "shakespeare", "-o", tmp_path / "o3"], "evaluation corpus"),
        (["--to", "vq", "--calib", "britannica", "--codebook-size", "8", "--window", "16", "-o", tmp_path / "o4"],
         "evaluation corpus"),
        (["--to", "mqa", "--calib-tokens", "100000000000", "-o", tmp_path / "o5"], "is more than 'calib' holds"),
        (["--to", "mqa", "--calib", "calib,shakespeare", "-o", tmp_path / "o6"], "--calib shakespeare is an evaluation corpus"),
        (["--to", "mla", "--kv-size", "16", "--calib", f"calib,{tmp_path / 'missing.txt'}", "-o", tmp_path / "o7"], "missing.txt"),
        (["--to", "mqa", "--calib", "calib,,wiki", "-o", tmp_path / "o8"], "empty name between commas"),
        (["--to", "mqa", "--calib", "calib,calib", "-o", tmp_path / "o9"], "names calib more than once"),
    ]
    for args, needle in cases:
        for dry in ([], ["--dry-run"]):
            code, _, err = run_cli(capsys, "convert", src, *args, *dry)
            assert_one_line_error(code, err, needle)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("o")] and not leftovers(tmp_path)


def test_too_many_calibration_tokens_names_the_largest_that_fits(capsys, tiny, tmp_path):
    src = tiny("llama")
    text = tmp_path / "short.txt"
    text.write_text("a few words of calibration text. " * 100)  # 3,300 bytes: 3,300 byte-level tokens
    code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "--calib", text, "--calib-tokens", "8192",
                           "-o", tmp_path / "out", "--dry-run")
    assert_one_line_error(code, err, "3,300 tokens", "use --calib-tokens 3072 or less")
    code, out, err = run_cli(capsys, "convert", src, "--to", "mqa", "--calib", text, "--calib-tokens", "3072",
                             "-o", tmp_path / "out", "--no-eval", "--json")
    assert code in (0, None), err
    assert json.loads(out)["record"]["conversion"]["calib_tokens"] == 3072


def test_the_record_states_the_calibration_tokens_used(capsys, tiny, tmp_path):
    """--calib-tokens is used in whole sequences: the record says how many were used."""
    code, out, err = run_cli(capsys, "convert", tiny("llama"), "--to", "mqa", "--calib-tokens", "1300",
                             "-o", tmp_path / "out", "--no-eval", "--json")
    assert code in (0, None), err
    assert json.loads(out)["record"]["conversion"]["calib_tokens"] == 1024  # two sequences of 512


def test_a_conversion_calibrates_on_several_texts_interleaved(capsys, tiny, tmp_path):
    """--calib a,b: calibration reads the interleaved text (two files of 600 tokens each hold the 1,024
    asked for only together), and the record names both."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first text. " * 50)  # 600 bytes: 600 byte-level tokens
    b.write_text("second text. " * 47)
    src = tiny("llama")
    code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "--calib", a, "--calib-tokens", "1024",
                           "-o", tmp_path / "one", "--dry-run")
    assert_one_line_error(code, err, "is more than")
    code, out, err = run_cli(capsys, "convert", src, "--to", "mqa", "--calib", f"{a},{b}", "--calib-tokens", "1024",
                             "--refine-steps", "0", "-o", tmp_path / "out", "--no-eval", "--json")
    assert code in (0, None), err
    conversion = json.loads(out)["record"]["conversion"]
    assert conversion["calib"] == f"{a},{b}" and conversion["calib_tokens"] == 1024


def test_eval_refuses_fewer_tokens_than_one_block(capsys, tiny):
    code, _, err = run_cli(capsys, "eval", tiny("llama"), "--context", "4096", "--max-tokens", "1024")
    assert_one_line_error(code, err, "--max-tokens 1024 is less than one block of --context 4096")


def test_messages_keep_square_brackets_and_usage_errors_are_one_line(capsys, tmp_path):
    code, _, err = run_cli(capsys, "convert", tmp_path / "models[old]" / "x", "--to", "mqa", "-o", tmp_path / "out")
    assert_one_line_error(code, err, "models[old]")
    for args, needle in ((["conver", "llama"], "No such command 'conver'"),
                         (["convert", "llama", "--to", "mqa", "--bogus", "3"], "--bogus"),
                         (["eval"], "Missing argument")):
        code, _, err = run_cli(capsys, *args)
        assert_one_line_error(code, err, needle)
        assert code == 2 and "unexpected" not in err
    binary = tmp_path / "recipe.yaml"
    binary.write_bytes(b"student:\n  model: \xd0\xff\n")
    code, _, err = run_cli(capsys, "recipes", "validate", binary)
    assert_one_line_error(code, err, "recipe.yaml is not UTF-8")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_missing_or_misshapen_tensor_is_named_before_work(capsys, tiny, tmp_path, family):
    """transformers would fill a missing tensor with random values (eval would run on a broken model) and
    conversions failed deep inside; every command names the tensor first."""
    import torch
    from safetensors.torch import load_file, save_file

    broken = {}
    for kind in ("missing", "shape"):
        src = tiny(family)
        tensors = load_file(src / "model.safetensors")
        if kind == "missing":
            tensors.pop("model.layers.0.self_attn.k_proj.weight")
        else:
            tensors["model.layers.1.self_attn.v_proj.weight"] = torch.zeros(5, tensors["model.embed_tokens.weight"].shape[1])
        save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
        broken[kind] = src
    needles = {"missing": "lacks tensor model.layers.0.self_attn.k_proj.weight",
               "shape": "tensor model.layers.1.self_attn.v_proj.weight"}
    for kind, src in broken.items():
        for args in (["inspect", src], ["convert", src, "--to", "mqa", "--method", "mean", "-o", tmp_path / "o"],
                     ["convert", src, "--to", "mqa", "-o", tmp_path / "o", "--dry-run"],
                     ["vq-init", src, "--codebook-size", "8", "--window", "16", "-o", tmp_path / "o"],
                     ["eval", src, "--max-tokens", "256", "--context", "64", "--no-speed"]):
            code, _, err = run_cli(capsys, *args)
            assert_one_line_error(code, err, needles[kind])
            assert not (tmp_path / "o").exists()


def test_an_alias_is_echoed_as_the_user_wrote_it(capsys, tiny, tmp_path):
    code, _, err = run_cli(capsys, "convert", tiny("llama"), "--to", "mqa", "--method", "foo", "-o", tmp_path / "o")
    assert_one_line_error(code, err, "--to mqa --help")
    assert "--to gqa" not in err


# -- class 1: memory is estimated before work, and a run that cannot fit is refused -------------------


def test_runs_that_cannot_fit_name_the_option_and_the_largest_value_that_fits(capsys, tiny, tmp_path, monkeypatch):
    from effattn.resources import held, rss

    src = tiny("llama")
    # the machine's own budget: an absurd context, batch and bench length are refused
    code, _, err = run_cli(capsys, "eval", src, "--context", "100000000", "--max-tokens", "200000000")
    assert_one_line_error(code, err, "evaluating at --context 100,000,000 needs about", "use --batch-size 1 --context",
                          "or less", "--no-memory-check")
    # one block of the corpus: a batch of one, whatever --batch-size says, so the context is what shrinks it
    code, _, err = run_cli(capsys, "eval", src, "--context", "100000000", "--max-tokens", "100000000")
    assert_one_line_error(code, err, "evaluating at --context 100,000,000 needs about", "use --context", "or less")
    assert "--batch-size" not in err
    code, _, err = run_cli(capsys, "bench", "--attention", "sdpa", "--lengths", "1024,300000000")
    assert_one_line_error(code, err, "bench of sdpa at length 300,000,000", "use --lengths values of")
    # a budget set by the user (above what this test process holds already)
    monkeypatch.setenv("EFFATTN_MEMORY_LIMIT", str(rss() + 2**30))
    code, _, err = run_cli(capsys, "eval", src, "--context", "400000", "--max-tokens", "400000", "--batch-size", "1")
    assert_one_line_error(code, err, "use --context ")
    context = int(err.split("use --context ")[1].split()[0])
    assert 1000 < context < 400000
    # a conversion's estimate starts from held() (what the process holds less its free heap), so its room does
    # not depend on how much memory earlier work in this process freed
    monkeypatch.setenv("EFFATTN_MEMORY_LIMIT", str(held() + 400 * 2**20))
    code, _, err = run_cli(capsys, "vq-init", src, "--codebook-size", "8", "--window", "16", "--calib-tokens", "262144",
                           "-o", tmp_path / "o", "--no-eval", "--dry-run")
    assert_one_line_error(code, err, "--to vq needs about", "use --calib-tokens ", "or less")
    best = int(err.split("use --calib-tokens ")[1].split()[0])
    assert best % 1024 == 0 and 16384 <= best < 262144  # whole calibration sequences
    monkeypatch.setenv("EFFATTN_MEMORY_LIMIT", str(held()))  # no room above what the process holds
    for args in (["convert", src, "--to", "mqa", "--method", "mean", "-o", tmp_path / "o"],
                 ["eval", src, "--max-tokens", "256", "--context", "64", "--no-speed"]):
        code, _, err = run_cli(capsys, *args)
        assert_one_line_error(code, err, "run it on a machine with more memory", "--no-memory-check")
    assert not (tmp_path / "o").exists() and not leftovers(tmp_path)
    # forced: the same conversion runs
    code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "--method", "mean", "-o", tmp_path / "o", "--no-eval",
                           "--no-memory-check")
    assert code in (0, None), err
    assert (tmp_path / "o" / "model.safetensors").exists()


def test_held_memory_leaves_out_what_the_heap_keeps_free():
    """After a step that allocates and frees much, the resident set stays at its peak (effattn never trims the
    heap); the memory an estimate starts from must not count that freed memory again."""
    import platform

    from effattn.resources import heap_free_bytes, held, rss

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallinfo2 is glibc's")
    before = held()
    blocks = [bytearray(4096) for _ in range(50_000)]  # ~200 MB from malloc's heap
    assert held() > before + 150 * 2**20
    del blocks
    free = heap_free_bytes()
    assert free > 150 * 2**20  # kept in the heap, still resident
    assert rss() - held() >= 150 * 2**20 and held() < before + 50 * 2**20


def test_releasing_the_free_heap_gives_it_back_to_the_system():
    """The fine-tune trims the heap once, after tokenizing (which frees ~0.6 GiB in small pieces)."""
    import platform

    from effattn.resources import heap_free_bytes, release_free_heap, rss

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    blocks = [bytearray(4096) for _ in range(50_000)]  # ~200 MB from malloc's heap
    del blocks
    assert heap_free_bytes() > 150 * 2**20
    before = rss()
    released = release_free_heap()
    assert released > 150 * 2**20 and rss() <= before - 150 * 2**20


def test_the_largest_value_that_fits_is_found_and_rounded_down(monkeypatch):
    from effattn import resources
    from effattn.errors import EffattnError

    monkeypatch.setattr(resources, "memory_budget", lambda device=None: 10_000_000)
    resources.check_memory(9_000_000, what="x")  # within the 90% margin: runs
    peak = lambda v: 1_000_000 + 37 * v  # noqa: E731
    with pytest.raises(EffattnError) as exc:
        resources.check_memory(peak(500_000), what="the run", options=[("--n", 500_000, peak, 1, 1)])
    best = (9_000_000 - 1_000_000) // 37  # 216,216 fits; 216,217 does not
    assert "use --n 210000 or less" in str(exc.value) and peak(210_000) <= 9_000_000 < peak(best + 1)
    with pytest.raises(EffattnError) as exc:  # step: multiples of 512, rounded down
        resources.check_memory(peak(500_000), what="the run", options=[("--n", 500_000, peak, 512, 512)])
    assert "use --n 209920 or less" in str(exc.value)
    with pytest.raises(EffattnError) as exc:  # nothing fits
        resources.check_memory(peak(500_000), what="the run", options=[("--n", 500_000, lambda v: 10**9, 1, 1)])
    assert "run it on a machine with more memory, or pass --no-memory-check" in str(exc.value)
    resources.check_memory(peak(500_000), what="the run", check=False)  # forced


def test_a_conversion_that_fits_without_its_measurement_suggests_no_eval(capsys, tiny, tmp_path, monkeypatch):
    from effattn.convert import convert

    src = tiny("llama")
    plain = convert(src, None, to="mqa", options={"method": "mean"}, dry_run=True, measure=False).plan.est_peak_bytes
    measured = convert(src, None, to="mqa", options={"method": "mean"}, dry_run=True, measure=True).plan.est_peak_bytes
    assert measured > plain
    monkeypatch.setenv("EFFATTN_MEMORY_LIMIT", str(int((plain + measured) / 2 / 0.9)))
    code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "--method", "mean", "-o", tmp_path / "o", "--dry-run")
    assert_one_line_error(code, err, "with its quick measurement", "pass --no-eval")


def test_a_fine_tune_that_cannot_fit_names_the_batch_size(capsys, tiny, tmp_path):
    import yaml

    src = tiny("llama")
    (tmp_path / "train.txt").write_text("some words to train on. " * 400)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"student": {"model": str(src), "convert": {"to": "mqa", "method": "mean"}},
                                      "data": {"sources": [str(tmp_path / "train.txt")], "seq_len": 4096},
                                      "train": {"batch_size": 100000, "max_steps": 1}}))
    for dry in (["--dry-run"], []):
        code, _, err = run_cli(capsys, "finetune", recipe, "-o", tmp_path / "out", *dry)
        assert_one_line_error(code, err, "the fine-tune (per process", "use train.batch_size=", "train.grad_accum")
    assert not (tmp_path / "out").exists()


# -- class 4: internal errors become messages ---------------------------------------------------------


def test_a_codebook_larger_than_the_calibration_keys_is_refused_first(capsys, tiny, tmp_path):
    src = tiny("llama")
    for dry in ([], ["--dry-run"]):
        code, _, err = run_cli(capsys, "vq-init", src, "--codebook-size", "5000", "--window", "16", "--calib-tokens", "2048",
                               "-o", tmp_path / "o", *dry)
        assert_one_line_error(code, err, "--codebook-size 5,000 is more than the 2,048 calibration keys",
                              "use --codebook-size 2048 or less, or --calib-tokens 5120 or more")
    code, _, err = run_cli(capsys, "vq-init", src, "--codebook-size", "2000", "--window", "16", "--calib-tokens", "2048",
                           "--sinks", "100", "-o", tmp_path / "o", "--dry-run")
    assert_one_line_error(code, err, "less 100 sinks a sequence", "use --codebook-size 1848 or less")
    assert not (tmp_path / "o").exists()


def test_an_unwritable_output_is_named_before_work(capsys, tiny, tmp_path, monkeypatch):
    """As root a folder's mode bits do not stop writing: the probe is made to fail the way a read-only
    disk fails it; as another user a real read-only folder is used too."""
    import errno
    import os
    import tempfile

    src = tiny("llama")
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "--method", "mean", "-o", ro / "out")
        assert_one_line_error(code, err, f"cannot write in {ro}", "choose a writable -o")
        ro.chmod(0o755)
    real = tempfile.mkdtemp

    def read_only(*args, dir=None, **kw):
        if dir is not None and Path(dir) == ro:
            raise OSError(errno.EROFS, "Read-only file system", str(dir))
        return real(*args, dir=dir, **kw)

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    for dry in ([], ["--dry-run"]):
        code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "--method", "mean", "-o", ro / "out", *dry)
        assert_one_line_error(code, err, f"cannot write in {ro}", "Read-only file system", "choose a writable -o")
    assert list(ro.iterdir()) == []


def test_a_disk_that_fills_up_while_writing_is_one_line_and_leaves_nothing(capsys, tiny, tmp_path, monkeypatch):
    import errno

    from effattn.io import writer

    src = tiny("llama")
    real_write = writer.SafetensorsWriter.write

    def full(self, name, tensor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer.SafetensorsWriter, "write", full)
    code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "--method", "mean", "-o", tmp_path / "out")
    assert_one_line_error(code, err, "the disk filled up while writing", "free some space")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)
    monkeypatch.setattr(writer.SafetensorsWriter, "write", real_write)


def test_a_full_disk_at_a_fine_tune_checkpoint_names_it_and_removes_the_partial_checkpoint(capsys, tiny, tmp_path,
                                                                                           monkeypatch):
    import yaml
    from accelerate import Accelerator

    src = tiny("llama")
    (tmp_path / "train.txt").write_text("some words to train on. " * 400)
    (tmp_path / "held.txt").write_text("other words held out. " * 100)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "student": {"model": str(src), "convert": {"to": "mqa", "method": "mean"}},
        "data": {"sources": [str(tmp_path / "train.txt")], "seq_len": 32},
        "train": {"batch_size": 2, "max_steps": 4},
        "eval": {"every": 0, "corpora": [str(tmp_path / "held.txt")], "seq_len": 32, "tokens": 64},
        "checkpoint": {"every": 2}}))
    real = Accelerator.save_state
    calls = []

    def fills_up(self, output_dir=None, **kw):
        calls.append(output_dir)
        if len(calls) == 2:  # the second checkpoint: torch's message for a write that ran out of disk
            (Path(output_dir) / "model.safetensors").write_bytes(b"partial")
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 5184 vs 5072")
        return real(self, output_dir, **kw)

    monkeypatch.setattr(Accelerator, "save_state", fills_up)
    code, _, err = run_cli(capsys, "finetune", recipe, "-o", tmp_path / "out")
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]  # after the run's progress lines
    assert code == 2 and "Traceback" not in err and len(errors) == 1 and err.strip().endswith(errors[0]), err
    assert "the disk filled up while writing" in errors[0] and "step-000004" in errors[0]
    assert "resumes from step-000002" in errors[0]
    checkpoints = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000002"]  # no temporary checkpoint left
    monkeypatch.setattr(Accelerator, "save_state", real)
    code, _, err = run_cli(capsys, "finetune", recipe, "-o", tmp_path / "out")
    assert code in (0, None), err
    assert "resum" in err.lower()


# -- class 5: what a killed run left is cleaned up by the next, a live run's is not ---------------------


def test_a_killed_conversion_leaves_nothing_a_later_run_does_not_remove(tiny, tmp_path):
    import fcntl
    import os
    import subprocess
    import sys

    src = tiny("llama")
    out = tmp_path / "out"
    env = {**os.environ, "EFFATTN_KILL_AT": "output.written:out"}
    cmd = [sys.executable, "-m", "effattn.cli", "convert", str(src), "--to", "mqa", "--method", "mean", "-o", str(out),
           "--no-eval"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    dead = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert dead and not out.exists()
    # a live writer's temporary folder (its lock held) beside the same OUT
    live = tmp_path / ".out.tmp-live"
    live.mkdir()
    fd = os.open(tmp_path / ".out.tmp-live.lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        proc = subprocess.run(cmd[:-1] + ["--no-eval"], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [".out.tmp-live",
                                                                                      ".out.tmp-live.lock"]
        assert (out / "model.safetensors").exists() and not (out / ".out.tmp-live.lock").exists()
    finally:
        os.close(fd)


@pytest.mark.skipif(not Path("/proc/self/status").exists() or __import__("platform").libc_ver()[0] != "glibc",
                    reason="the heap setting is glibc's")
def test_effattn_keeps_freed_memory_in_the_heap_unless_told_not_to():
    """`import effattn` serves a 20 MB buffer from the heap and keeps it after it is freed (no page faults
    the next time); EFFATTN_KEEP_HEAP=0 leaves glibc's adaptive defaults, which hand it back."""
    import os
    import subprocess
    import sys

    script = ("import effattn, torch\n"
              "def rss():\n"
              "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS')) << 10\n"
              "x = torch.ones(5 << 20)\n"  # 20 MB, every page touched
              "held = rss()\n"
              "del x\n"
              "print(held - rss())\n")

    def returned(**env) -> int:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                              env={k: v for k, v in os.environ.items() if k != "EFFATTN_KEEP_HEAP"} | env)
        return int(done.stdout.split()[-1])

    assert returned() < 1 << 20  # kept
    assert returned(EFFATTN_KEEP_HEAP="0") > 16 << 20  # handed back


@pytest.mark.parametrize("kernels_installed", [True, False])
def test_models_load_without_hub_kernels_unless_asked(tiny, monkeypatch, kernels_installed):
    """transformers 5 kernelizes each model it loads with code fetched from the Hub (on a GPU; the
    device run of 2026-12-04 failed on `kernels-community/rotary`), and refuses to load at all
    without the `kernels` package. effattn loads with them off; EFFATTN_HUB_KERNELS=1 asks for them."""
    import transformers.modeling_utils as mu

    from effattn.io.load import load_model

    monkeypatch.delenv("EFFATTN_HUB_KERNELS", raising=False)
    if not kernels_installed:
        monkeypatch.setattr(mu, "is_kernels_available", lambda: False)
    src = tiny("llama")
    lm, _, _ = load_model(src, tokenizer=False)
    assert not lm.use_kernels
    lm.train()  # turning to training re-kernelizes a kernelized model
    assert not lm.use_kernels and lm.kernels_mode is None
    monkeypatch.setenv("EFFATTN_HUB_KERNELS", "1")
    if kernels_installed:
        assert load_model(src, tokenizer=False)[0].use_kernels
    else:
        from effattn.errors import EffattnError

        with pytest.raises(EffattnError, match="Kernels are not available"):
            load_model(src, tokenizer=False)


def test_the_gguf_cache_keeps_one_entry_per_gguf_that_still_exists(tmp_path, monkeypatch):
    """A dequantized GGUF is cached under a key of the file's path, size and mtime; an entry whose file is
    gone or changed is deleted when the next GGUF is converted, so the cache does not grow with every
    path a GGUF was read from."""
    import os

    from effattn.io.resolve import _gguf_entry_name, prune_gguf_cache

    monkeypatch.setenv("EFFATTN_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "gguf"

    def entry(source: Path, name: str | None = None, complete: bool = True) -> Path:
        folder = root / (name or _gguf_entry_name(source))
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"0" * 64)
        (folder / "effattn-source.txt").write_text(f"{source.absolute()}\n")
        if complete:
            (folder / ".complete").touch()
        return folder

    files = {name: tmp_path / f"{name}.gguf" for name in ("live", "gone", "changed", "writing", "partial")}
    for path in files.values():
        path.write_bytes(b"GGUF")
    live, gone, changed = entry(files["live"]), entry(files["gone"]), entry(files["changed"])
    writing = entry(files["writing"], name=".writing.tmp-1")  # atomic_output's temporary: another run's
    partial = entry(files["partial"], complete=False)
    files["gone"].unlink()
    files["changed"].write_bytes(b"GGUF v2")
    os.utime(files["changed"], ns=(1, 1))
    files["writing"].unlink()
    files["partial"].unlink()
    assert sorted(prune_gguf_cache()) == sorted([gone, changed])
    assert sorted(p.name for p in root.iterdir()) == sorted([live.name, writing.name, partial.name])
    assert prune_gguf_cache() == []


@pytest.mark.parametrize("to,options", [("rerope", {"window": 16}), ("vq", {"window": 16, "codebook_size": 8}),
                                        ("linear", {"window": 8}), ("mla", {"kv_size": 16})])
def test_a_source_window_is_never_dropped_silently(tiny, tmp_path, to, options):
    """A Mistral attending through a 64-token window converted to ReRoPE, VQ or linear attention gave the same
    model as one without the window: their models attend to every earlier key. Refused (convert and its dry run),
    and `inspect` says so; gqa keeps the window."""
    from effattn.convert import convert
    from effattn.info import inspect_model

    src = tiny("mistral", sliding_window=64)
    for dry in (True, False):
        with pytest.raises(EffattnError, match=rf"attends through a sliding window of 64 tokens, which --to {to}'s "
                                               "model does not keep"):
            convert(src, tmp_path / "out", to=to, options=options, measure=False, dry_run=dry)
    assert not (tmp_path / "out").exists()
    assert inspect_model(str(src))["conversions"][to].startswith("refused: this model attends through a sliding")
    out = convert(src, tmp_path / "gqa", to="mqa", options={"method": "mean"}, measure=False).out
    assert json.loads((out / "config.json").read_text())["sliding_window"] == 64
    # a window as long as the context is no window: converted as before
    convert(tiny("mistral", sliding_window=4096), tmp_path / "full", to=to, options=options, measure=False,
            dry_run=True)


def test_convert_help_lists_every_conversion_and_where_each_flag_applies(capsys):
    from effattn.convert import ALIASES, CONVERSIONS

    code, out, _ = run_cli(capsys, "convert", "--help")
    text = " ".join(out.replace("│", " ").split())
    assert code in (0, None)
    for name in [*CONVERSIONS, *ALIASES]:
        assert f" {name}" in text, name
    # the tails in brackets were read as rich markup and vanished
    assert "(rerope, vq, swa, sparse, linear; default 256, 64)" in text
    assert "means something of its own in each conversion" in text  # --window is not VQ's alone


@pytest.mark.parametrize("factor,needle", [("inf", "--factor = inf: Input should be a finite number"),
                                           ("1e300", "--factor must be a number <= 1024")])
def test_a_non_finite_or_absurd_factor_is_refused(capsys, tiny, tmp_path, factor, needle):
    code, _, err = run_cli(capsys, "convert", tiny("llama"), "--to", "yarn", "--factor", factor, "-o", tmp_path / "o",
                           "--no-eval")
    assert_one_line_error(code, err, needle)
    assert code == 2 and not (tmp_path / "o").exists()


def test_dot_as_the_output_folder_and_a_sources_auto_map(capsys, tiny, tmp_path, monkeypatch):
    """`-o . --force` wrote the model, then failed (exit 1) reading the replaced working directory, and its card
    named a folder ''. A native output kept the source's auto_map without its code: transformers could not load it
    with trust_remote_code."""
    src = tiny("llama")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}))
    here = tmp_path / "here"
    here.mkdir()
    (here / "old.txt").write_text("replaced")
    monkeypatch.chdir(here)
    code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "--method", "mean", "-o", ".", "--no-eval", "--force",
                           "--trust-remote-code")
    assert code in (0, None), err
    assert not (here / "old.txt").exists() and "# here" in (here / "README.md").read_text()
    assert "auto_map" not in json.loads((here / "config.json").read_text())


def test_inspect_gives_no_per_token_cache_for_a_model_without_one(capsys, tiny, tmp_path):
    """A VQ model's cache is codebooks and a window, not keys and values per token: inspect multiplied the
    per-token formula out to 38 MB at 100,000 tokens for a tiny model whose cache stays ~100 KB."""
    from effattn.convert import convert
    from effattn.info import inspect_model

    out = convert(tiny("llama"), tmp_path / "vq", to="vq", options={"window": 16, "codebook_size": 8,
                                                                    "calib_tokens": 512, "calib_seq_len": 64},
                  measure=False).out
    info = inspect_model(str(out), context=100_000)
    assert info["kv_bytes_per_token"] is None and info["kv_bytes_at_context"] is None
    assert "not keys and values per token" in info["kv_cache"]
    code, _, err = run_cli(capsys, "inspect", tiny("llama"), "--context", "-5")
    assert code == 2 and "--context" in err and "greater than or equal to 1" in err


@pytest.mark.parametrize("args,needle", [
    (["--max-shard-size", "0"], "the size '0' is not positive"),
    (["--max-shard-size", "lots"], "cannot read the size 'lots'"),
    (["--eval-tokens", "0"], "--eval-tokens"),
])
def test_sizes_that_cannot_work_are_refused_by_the_dry_run_too(capsys, tiny, tmp_path, args, needle):
    for dry in (["--dry-run"], []):
        code, _, err = run_cli(capsys, "convert", tiny("llama"), "--to", "mqa", "--method", "mean", "-o",
                               tmp_path / "o", *args, *dry)
        assert code == 2 and needle in err, err
    assert not (tmp_path / "o").exists()


def test_an_output_path_that_is_a_file_is_refused_without_advising_force(capsys, tiny, tmp_path):
    (tmp_path / "afile").write_text("x")
    for force in ([], ["--force"]):
        code, _, err = run_cli(capsys, "convert", tiny("llama"), "--to", "mqa", "--method", "mean", "-o",
                               tmp_path / "afile", *force)
        assert_one_line_error(code, err, "exists and is not a folder", "choose another -o")


def test_a_dry_run_on_a_config_alone_says_the_run_needs_the_weights(capsys, tiny, tmp_path):
    src = tiny("llama")
    (src / "model.safetensors").unlink()
    code, out, err = run_cli(capsys, "convert", src, "--to", "mqa", "--method", "mean", "-o", tmp_path / "o",
                             "--dry-run")
    assert code in (0, None) and "planned from config.json alone; the run needs them" in " ".join(out.split()), err
    code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "--method", "mean", "-o", tmp_path / "o")
    assert code == 2 and "no weights" in err


def test_help_states_the_defaults_the_settings_hold(capsys):
    """eval's passkey/needle help and convert's --eval-tokens help wrote the defaults out as text beside the values
    the code uses; they are read from RetrievalSettings and EVAL_TOKENS now."""
    from effattn.convert.base import EVAL_TOKENS
    from effattn.retrieval import DEFAULT_FILLER, RetrievalSettings

    code, out, _ = run_cli(capsys, "eval", "--help")
    text = "".join(out.replace("│", " ").split())  # rich wraps lines anywhere: compare without spaces
    assert code in (0, None)
    defaults = RetrievalSettings()
    depths = ",".join(f"{d:g}" for d in defaults.depths)
    for shown in (",".join(map(str, defaults.lengths)), depths, f"(default{defaults.samples})",
                  f"(default{defaults.seed})", f"(needle:{DEFAULT_FILLER['needle']})"):
        assert shown in text, shown
    code, out, _ = run_cli(capsys, "convert", "--help")
    assert f"(default{EVAL_TOKENS})" in "".join(out.replace("│", " ").split())
