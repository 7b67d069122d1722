"""Bad input is refused before work, by the dry run as by the run; records state what was used."""

from __future__ import annotations

import json

import pytest

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
