"""Bad input: a one-line error naming the problem and the fix, a non-zero exit, nothing half-written."""

from __future__ import annotations

import errno
import json

import pytest

from effattn.cli import main


def run_cli(capsys, *args):
    """(exit code, stdout, stderr) of `effattn ARGS` run in-process."""
    code = 0
    try:
        main([str(a) for a in args])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code, err, *needles):
    assert code not in (0, None)
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error:") and "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def leftovers(folder):
    return [p.name for p in folder.iterdir() if p.name.startswith(".")]


def test_missing_model_path(capsys, tmp_path):
    code, _, err = run_cli(capsys, "convert", tmp_path / "nope", "--to", "mqa", "-o", tmp_path / "out")
    assert_one_line_error(code, err, "not found", "built-in names")
    assert not (tmp_path / "out").exists()


def test_not_a_causal_lm(capsys, tmp_path):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps(
        {"architectures": ["BertModel"], "model_type": "bert", "num_attention_heads": 2, "hidden_size": 8, "num_hidden_layers": 1}))
    code, _, err = run_cli(capsys, "convert", tmp_path / "bert", "--to", "mqa", "-o", tmp_path / "out")
    assert_one_line_error(code, err, "not a causal LM", "ForCausalLM")


def test_unsupported_family_lists_supported_ones(capsys, tiny, tmp_path):
    src = tiny("llama")
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (src / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "-o", tmp_path / "out")
    assert_one_line_error(code, err, "gpt_neox", "llama", "mistral", "qwen2", "qwen3")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(capsys, tiny, tmp_path, damage):
    src = tiny("llama")
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-100] if damage == "truncate" else b"\x00garbage" * 10)
    code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "-o", tmp_path / "out")
    assert_one_line_error(code, err, "corrupt or truncated", "re-download")
    assert not (tmp_path / "out").exists()


def test_unknown_conversion_suggests_the_closest(capsys, tiny, tmp_path):
    code, _, err = run_cli(capsys, "convert", tiny("llama"), "--to", "gqq", "-o", tmp_path / "out")
    assert_one_line_error(code, err, "unknown conversion 'gqq'", "did you mean 'gqa'")


def test_kv_heads_must_divide_query_heads(capsys, tiny, tmp_path):
    code, _, err = run_cli(capsys, "convert", tiny("llama", heads=6, kv_heads=3), "--to", "gqa", "--kv-heads", "4",
                           "-o", tmp_path / "out")
    assert_one_line_error(code, err, "num_heads (6) must be divisible by kv_heads (4)", "[1, 2, 3, 6]")


def test_unknown_method(capsys, tiny, tmp_path):
    code, _, err = run_cli(capsys, "convert", tiny("llama"), "--to", "mqa", "--method", "meen", "-o", tmp_path / "out")
    assert_one_line_error(code, err, "unknown GQA method 'meen'", "did you mean 'mean'")


def test_existing_output_is_refused_without_force(capsys, tiny, tmp_path):
    src = tiny("llama")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "--method", "mean", "-o", tmp_path / "out", "--no-eval")
    assert_one_line_error(code, err, "already exists", "--force")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    code, out, _ = run_cli(capsys, "convert", src, "--to", "mqa", "--method", "mean", "-o", tmp_path / "out", "--no-eval", "--force")
    assert code == 0 and not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "config.json").exists()
    assert leftovers(tmp_path) == []


def test_not_enough_disk_is_refused_before_writing(capsys, tiny, tmp_path, monkeypatch):
    import shutil

    src = tiny("llama")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))
    code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "--method", "mean", "-o", tmp_path / "out", "--no-eval")
    assert_one_line_error(code, err, "not enough disk space", "free some space", "1,000 bytes free", "KiB needed")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_disk_full_while_writing_leaves_nothing(capsys, tiny, tmp_path, monkeypatch):
    from effattn.io import writer

    src = tiny("llama")
    calls = {"n": 0}
    real_write = writer.SafetensorsWriter.write

    def write_then_fill_up(self, name, tensor):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(self, name, tensor)

    monkeypatch.setattr(writer.SafetensorsWriter, "write", write_then_fill_up)
    code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "--method", "mean", "-o", tmp_path / "out", "--no-eval")
    assert_one_line_error(code, err, "disk filled up", "free some space")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_pickled_weights_are_refused_without_flag(capsys, tiny, tmp_path):
    import torch
    from safetensors.torch import load_file

    src = tiny("llama")
    torch.save(load_file(src / "model.safetensors"), src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    code, _, err = run_cli(capsys, "inspect", src)
    assert_one_line_error(code, err, "pickled weights", "--allow-pickle")
    code, out, _ = run_cli(capsys, "inspect", src, "--allow-pickle", "--json")
    assert code == 0 and json.loads(out)["kv_heads"] == 3


def test_debug_shows_the_traceback(tmp_path):
    from effattn.errors import EffattnError

    with pytest.raises(EffattnError):
        main(["inspect", str(tmp_path / "nope"), "--debug"])


def test_inspect_json_on_a_tiny_model(capsys, tiny):
    code, out, _ = run_cli(capsys, "inspect", tiny("qwen3", heads=6, kv_heads=2), "--json", "--context", "100")
    info = json.loads(out)
    assert code == 0
    assert (info["family"], info["query_heads"], info["kv_heads"], info["qk_norm"]) == ("qwen3", 6, 2, True)
    # 2 layers x 2 (K and V) x 2 heads x head_dim 8 x 4 bytes
    assert info["kv_bytes_per_token"] == 2 * 2 * 2 * 8 * 4
    assert info["kv_bytes_at_context"] == 100 * info["kv_bytes_per_token"]
    assert "--kv-heads {1, 3, 6}" in info["conversions"]["gqa"]


def test_unreachable_hub_id_is_a_clear_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    code, _, err = run_cli(capsys, "inspect", "some-org/some-model")
    assert_one_line_error(code, err, "could not download 'some-org/some-model'", "local folder")


def test_ctrl_c_exits_130_and_says_so(capsys, monkeypatch):
    """Typer outside standalone mode turns Ctrl-C into a returned 130; a returned code must reach the exit status,
    or `effattn finetune ... && effattn eval ...` would go on after an interrupted run."""
    import effattn.info

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(effattn.info, "inspect_model", interrupted)
    code, out, err = run_cli(capsys, "inspect", "llama")
    assert code == 130 and err.strip() == "interrupted" and out == ""


def test_sigterm_cleans_up_as_ctrl_c_does(tiny, tmp_path):
    """`kill`, `timeout` or a job scheduler stop a run with SIGTERM, which ran no clean-up: a conversion left its
    hidden temporary folder and lock behind (Ctrl-C left nothing). Now SIGTERM cleans up the same, exits 143."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    src = tiny("llama", layers=4)
    out = tmp_path / "out"
    effattn = str(Path(sys.executable).parent / "effattn")
    run = subprocess.Popen([effattn, "convert", str(src), "--to", "mqa", "--calib-tokens", "8192", "--refine-steps",
                            "400", "--no-eval", "-o", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    deadline = time.monotonic() + 120
    while not leftovers(tmp_path) and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftovers(tmp_path), "the conversion never made its temporary folder"
    time.sleep(0.5)  # well inside the layer walk
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 143 and err.strip().splitlines()[-1] == "terminated", err[-2000:]
    assert not out.exists() and leftovers(tmp_path) == []


def test_sizes_read_in_their_own_units():
    """Tiny models have tiny sizes: "0.00 GiB" and "0M parameters" said nothing."""
    from effattn.io.card import count
    from effattn.resources import gib

    assert [gib(n) for n in (3 * 2**30, 5 * 2**20, 3000, 12)] == ["3.0 GiB", "5 MiB", "3 KiB", "12 bytes"]
    assert [count(n) for n in (134_515_008, 1_234_000_000, 54_321)] == ["135M", "1.2B", "54,321"]


def test_a_memory_refusal_names_the_margin_it_holds_back():
    from effattn.errors import EffattnError
    from effattn.resources import check_memory

    with pytest.raises(EffattnError) as exc:  # 95 MiB needed, 100 MiB there: refused at 90%
        check_memory(95 * 2**20, what="the run", budget=100 * 2**20)
    assert "each device has 100 MiB for it" in str(exc.value) and "90% of that (90 MiB)" in str(exc.value)


def test_eval_tokens_without_the_measurement_is_refused(capsys, tiny, tmp_path):
    src = tiny("llama")
    code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "-o", tmp_path / "out", "--no-eval",
                           "--eval-tokens", "100")
    assert_one_line_error(code, err, "--eval-tokens", "--no-eval", "drop one")
    assert not (tmp_path / "out").exists()


def test_an_empty_corpus_is_not_told_to_shorten_the_context(capsys, tiny, tmp_path):
    src = tiny("llama")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("abc")
    code, _, err = run_cli(capsys, "eval", src, "--corpus", tmp_path / "empty.txt", "--no-speed")
    assert_one_line_error(code, err, "has 0 tokens", "use a longer text (at least 2 tokens)")
    assert "--context" not in err.split(". ", 1)[1]
    code, _, err = run_cli(capsys, "eval", src, "--corpus", tmp_path / "short.txt", "--no-speed")
    assert_one_line_error(code, err, "has 3 tokens", "--context 3 or less")


def test_inspect_shows_the_refusals_convert_makes_on_a_biased_llama(capsys, tiny, tmp_path):
    """MLA refuses MLP biases whatever its options; swa's native window refuses them, its sinks model does not."""
    src = tiny("llama", attention_bias=True, mlp_bias=True)
    code, out, _ = run_cli(capsys, "inspect", src, "--json")
    conversions = json.loads(out)["conversions"]
    assert code == 0 and conversions["mla"].startswith("refused: this model's MLP has biases")
    assert "Only with --sinks here: this Llama has attention or MLP biases" in conversions["swa"]
    code, _, err = run_cli(capsys, "convert", src, "--to", "mla", "--kv-size", "8", "-o", tmp_path / "m", "--dry-run")
    assert_one_line_error(code, err, "MLP has biases")
    code, _, err = run_cli(capsys, "convert", src, "--to", "swa", "--window", "16", "-o", tmp_path / "s", "--dry-run")
    assert_one_line_error(code, err, "biases")
    code, _, _ = run_cli(capsys, "convert", src, "--to", "swa", "--window", "16", "--sinks", "2", "-o", tmp_path / "s",
                         "--dry-run")
    assert code == 0
    clean = json.loads(run_cli(capsys, "inspect", tiny("llama"), "--json")[1])["conversions"]
    assert "Only with --sinks" not in clean["swa"] and not clean["mla"].startswith("refused")
    assert "the cache holds W - 1 + S tokens per windowed layer" in clean["swa"]  # it said W + S


@pytest.mark.parametrize("to, flags, needles", [
    ("sparse", ["--pattern", "longformer", "--window", "4095"], ["keeps every causal pair", "smaller --window"]),
    ("sparse", ["--pattern", "bigbird", "--block", "2048", "--window-blocks", "2"], ["every causal pair", "--block"]),
    ("sparse", ["--pattern", "strided", "--local", "4096"], ["every causal pair", "smaller --local"]),
    ("rerope", ["--window", "4096"], ["covers the whole trained context (4,096", "below 4,096"]),
    ("swa", ["--window", "4096"], ["covers the whole trained context (4,096", "below 4,096"]),
])
def test_a_window_that_covers_the_trained_context_is_refused_by_every_windowed_conversion(
        capsys, tiny, tmp_path, to, flags, needles):
    """The tiny model is trained to 4,096 positions: a window or pattern reaching every pair changes nothing."""
    code, _, err = run_cli(capsys, "convert", tiny("llama"), "--to", to, *flags, "-o", tmp_path / "o", "--dry-run")
    assert_one_line_error(code, err, *needles)


def test_rerope_far_position_defaults_inside_the_trained_context(capsys, tiny, tmp_path):
    src = tiny("llama")
    far = {}
    for window in (256, 2000):
        code, out, _ = run_cli(capsys, "convert", src, "--to", "rerope", "--window", window, "-o", tmp_path / "o",
                               "--dry-run", "--json")
        far[window] = json.loads(out)["settings"]["far_position"]
    assert far == {256: 1024, 2000: 4095}


def test_inspect_counts_parameters_not_the_buffers_a_checkpoint_stores(capsys, tiny, tmp_path):
    """A ReRoPE/VQ output stores its codebooks and key means beside the weights: inspect counted them."""
    src = tiny("llama")
    code, _, err = run_cli(capsys, "convert", src, "--to", "rerope", "--window", "8", "--no-eval", "-o", tmp_path / "r")
    assert code == 0, err
    source = json.loads(run_cli(capsys, "inspect", src, "--json")[1])["parameters"]
    converted = json.loads(run_cli(capsys, "inspect", tmp_path / "r", "--json")[1])["parameters"]
    assert converted == source == json.loads((tmp_path / "r" / "effattn.json").read_text())["source"]["num_params"]


def test_inspect_builds_the_meta_model_once(capsys, tiny, monkeypatch):
    """The checkpoint's verification and the parameter count each built the model on the meta device."""
    import effattn.io.verify as verify

    built = []
    real = verify.meta_model
    monkeypatch.setattr(verify, "meta_model", lambda config: built.append(1) or real(config))
    code, out, err = run_cli(capsys, "inspect", tiny("llama"), "--json")
    assert code in (0, None), err
    assert len(built) == 1 and json.loads(out)["parameters"] > 0
