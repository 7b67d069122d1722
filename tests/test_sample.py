"""`effattn sample`: text sampled from a model itself, for calibration without a corpus (data/sample.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from effattn.errors import EffattnError
from tests.test_cli_errors import assert_one_line_error, leftovers, run_cli


def sample_args(model, out, *extra):
    return ["sample", model, "-o", out, "--tokens", "96", "--seq-len", "32", "--batch-size", "2", *extra]


def test_samples_are_whole_sequences_the_seed_repeats(capsys, tiny, tmp_path):
    from transformers import AutoTokenizer

    src = tiny("llama")
    out = tmp_path / "a.txt"
    rng = torch.random.get_rng_state()
    code, stdout, err = run_cli(capsys, *sample_args(src, out, "--json"))
    assert code in (0, None), err
    assert torch.equal(rng, torch.random.get_rng_state())  # the caller's random stream is left as it was
    report = json.loads(stdout)
    assert report["sequences"] == 3 and report["tokens"] == 96  # 3 sequences of 32, each start token included
    assert report["sampled_tokens"] == 3 * 31  # what the text holds
    text = out.read_text(encoding="utf-8")
    assert report["characters"] == len(text) and text.strip()
    assert not leftovers(tmp_path)  # no partial file left beside it
    tok = AutoTokenizer.from_pretrained(src)
    # the tiny tokenizer is byte-level: the text re-tokenizes to about the tokens sampled (special tokens dropped)
    assert 0.5 * report["sampled_tokens"] < len(tok(text, add_special_tokens=False)["input_ids"]) \
        <= 2 * report["sampled_tokens"]
    again = tmp_path / "b.txt"
    run_cli(capsys, *sample_args(src, again))
    assert again.read_text(encoding="utf-8") == text  # same model, settings and seed: the same text
    other = tmp_path / "c.txt"
    run_cli(capsys, *sample_args(src, other, "--seed", "1"))
    assert other.read_text(encoding="utf-8") != text
    # the batch size does not decide how many sequences, nor their length
    code, stdout, err = run_cli(capsys, *sample_args(src, tmp_path / "d.txt", "--batch-size", "3", "--json"))
    assert json.loads(stdout)["sequences"] == 3


def test_a_sample_calibrates_a_conversion(capsys, tiny, tmp_path):
    """The text is what --calib reads: enough tokens for the calibration it was sampled for, and the conversion it
    calibrates differs from one calibrated on a corpus (the record named the file either way)."""
    from safetensors.torch import load_file

    src = tiny("llama", heads=4, kv_heads=2)
    text = tmp_path / "self.txt"
    code, _, err = run_cli(capsys, "sample", src, "-o", text, "--tokens", "1024", "--seq-len", "128")
    assert code in (0, None), err
    weights = {}
    for calib in (str(text), "calib"):
        out = tmp_path / f"mqa-{len(weights)}"
        code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "--calib", calib, "--calib-tokens", "512",
                               "--refine-steps", "0", "-o", out, "--no-eval")
        assert code in (0, None), err
        assert json.loads((out / "effattn.json").read_text())["conversion"]["calib"] == calib
        weights[calib] = load_file(out / "model.safetensors")["model.layers.0.self_attn.k_proj.weight"]
    assert not torch.allclose(weights[str(text)], weights["calib"])


def test_the_dry_run_plans_and_writes_nothing(capsys, tiny, tmp_path):
    out = tmp_path / "s.txt"
    code, stdout, err = run_cli(capsys, *sample_args(tiny("llama"), out, "--dry-run", "--json"))
    assert code in (0, None), err
    plan = json.loads(stdout)
    assert plan["dry_run"] and plan["sequences"] == 3 and plan["tokens"] == 96
    assert plan["est_seconds"] > 0 and plan["est_peak_bytes"] > 0
    assert not out.exists()
    code, stdout, err = run_cli(capsys, *sample_args(tiny("llama"), out, "--dry-run"))
    assert code in (0, None) and "nothing (dry run)" in stdout and not out.exists()


def test_bad_input_is_one_line_and_writes_nothing(capsys, tiny, tmp_path, monkeypatch):
    src = tiny("llama")
    (tmp_path / "there.txt").write_text("keep me")
    notok = shutil.copytree(src, tmp_path / "notok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (notok / name).unlink(missing_ok=True)
    cases = [
        (sample_args(src, tmp_path / "there.txt"), ["there.txt exists", "--force"]),
        (sample_args(src, tmp_path), ["is a folder; sample writes one text file"]),
        (sample_args(src, tmp_path / "there.txt" / "s.txt"), ["there.txt is a file, so", "cannot be written"]),
        (sample_args(src, tmp_path / "s.txt", "--tokens", "0"), ["--tokens must be at least 1"]),
        (sample_args(src, tmp_path / "s.txt", "--seq-len", "1"), ["--seq-len must be at least 2"]),
        (sample_args(src, tmp_path / "s.txt", "--batch-size", "0"), ["--batch-size must be at least 1"]),
        (sample_args(src, tmp_path / "s.txt", "--temperature", "0"), ["--temperature must be from 0.01 to 100"]),
        (sample_args(src, tmp_path / "s.txt", "--temperature", "nan"), ["--temperature must be from 0.01 to 100"]),
        (sample_args(notok, tmp_path / "s.txt"), ["notok has no tokenizer files", "copy the tokenizer files"]),
        # the second bug bash of 2026-12-07: each failed after sampling, crashed, or destroyed something
        (sample_args(src, "/proc/effattn-sample.txt"), ["cannot write in /proc"]),
        (sample_args(src, tmp_path / ("n" * 250 + ".txt")), ["is too long (254 characters)"]),
        (sample_args(src, tmp_path / "s.txt", "--seed", str(2**64)), ["outside torch's seeds"]),
        (sample_args(src, tmp_path / "s.txt", "--temperature", "1e-300"), ["--temperature must be from 0.01 to 100"]),
        (sample_args(src, tmp_path / "s.txt", "--temperature", "1e308"), ["--temperature must be from 0.01 to 100"]),
        (sample_args(src, src / "config.json", "--force"), ["one of the model's own files", "outside the model's"]),
        (sample_args(src, tmp_path / "dangling.txt"), ["exists (a symbolic link)", "--force"]),
    ]
    (tmp_path / "dangling.txt").symlink_to(tmp_path / "nowhere.txt")
    for dry in ([], ["--dry-run"]):
        for args, needles in cases:
            code, _, err = run_cli(capsys, *args, *dry)
            assert_one_line_error(code, err, *needles)
            assert code == 2
    assert (tmp_path / "there.txt").read_text() == "keep me" and not (tmp_path / "s.txt").exists()
    assert (src / "config.json").read_text().startswith("{")  # the model's own file is intact
    code, _, err = run_cli(capsys, *sample_args(src, tmp_path / "dangling.txt", "--force"))  # writes where it leads
    assert code in (0, None), err
    assert (tmp_path / "dangling.txt").is_symlink() and (tmp_path / "nowhere.txt").read_text().strip()
    code, _, err = run_cli(capsys, *sample_args(src, tmp_path / "there.txt", "--force"))
    assert code in (0, None), err
    assert (tmp_path / "there.txt").read_text() != "keep me"
    code, _, err = run_cli(capsys, *sample_args(src, tmp_path / "new" / "s.txt"))  # missing folders are made
    assert code in (0, None) and (tmp_path / "new" / "s.txt").is_file(), err
    monkeypatch.setenv("EFFATTN_MEMORY_LIMIT", "1MB")  # refused before loading, naming what shrinks it
    code, _, err = run_cli(capsys, *sample_args(src, tmp_path / "s.txt"))
    assert_one_line_error(code, err, "sampling 2 sequences of 32 tokens at once", "--no-memory-check")
    assert not (tmp_path / "s.txt").exists()


def test_samples_start_from_bos_else_eos():
    from types import SimpleNamespace

    from effattn.data.sample import start_token

    assert start_token(SimpleNamespace(bos_token_id=1, eos_token_id=2)) == 1
    assert start_token(SimpleNamespace(bos_token_id=None, eos_token_id=2)) == 2
    with pytest.raises(EffattnError, match="neither a BOS nor an EOS"):
        start_token(SimpleNamespace(bos_token_id=None, eos_token_id=None))


def test_the_estimates_grow_with_the_work(tiny):
    from effattn.data.sample import SampleSettings, sample_peak_bytes, sample_seconds
    from effattn.io.checkpoint import read_config

    config = read_config(tiny("llama"))
    one, more = SampleSettings(tokens=512, seq_len=64, batch_size=4), SampleSettings(tokens=1024, seq_len=64,
                                                                                       batch_size=4)
    assert sample_seconds(config, 10**6, more) > sample_seconds(config, 10**6, one)
    wide = SampleSettings(tokens=512, seq_len=64, batch_size=8)
    assert sample_peak_bytes(config, 10**6, wide, weight_bytes=4) > \
        sample_peak_bytes(config, 10**6, one, weight_bytes=4)


def test_a_huge_token_count_is_priced_at_once(tiny):
    """The estimate looped once per batch: --tokens 1e12 --batch-size 1 never finished its dry run."""
    from effattn.data.sample import SampleSettings, sample_seconds
    from effattn.io.checkpoint import read_config

    settings = SampleSettings(tokens=10**12, seq_len=2, batch_size=1)
    assert sample_seconds(read_config(tiny("llama")), 10**6, settings) > 0


def test_the_run_warns_as_its_dry_run_does(capsys, tiny, tmp_path):
    src = tiny("llama", max_position_embeddings=16)
    code, _, err = run_cli(capsys, *sample_args(src, tmp_path / "s.txt"))
    assert code in (0, None)
    assert "warning" in err and "--seq-len 32 is beyond" in " ".join(err.split())


def test_a_failed_write_leaves_no_folder_it_made(capsys, tiny, tmp_path, monkeypatch):
    import pathlib

    def full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    code, _, err = run_cli(capsys, *sample_args(tiny("llama"), tmp_path / "a" / "b" / "s.txt"))
    assert_one_line_error(code, err, "the disk filled up while writing")
    assert code == 2 and not (tmp_path / "a").exists()
