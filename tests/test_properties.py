"""Property-based hardening: random option values and random corruptions of a tiny checkpoint thrown at
`convert --dry-run`, `convert`, `inspect` and `eval`. The contract: success, or a one-line error with exit
code 2; never a traceback, an "unexpected" error, or a half-written output.

The examples are derandomized (the same on every run, so CI judges the code, not the draw);
EFFATTN_HYPOTHESIS_EXAMPLES=N draws more of them, with a random seed.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from effattn.testing import make_model

from .test_cli_errors import run_cli

EXAMPLES = int(os.environ.get("EFFATTN_HYPOTHESIS_EXAMPLES", "0"))
PROFILE = settings(max_examples=EXAMPLES or 40, deadline=None, derandomize=not EXAMPLES, database=None,
                   suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("pristine") / "llama", "llama")


def assert_contract(code, out, err, output: Path | None = None):
    """Success, or one error line (exit 2) that is no internal error; an output complete or absent."""
    text = out + err
    assert "Traceback" not in text, text
    if code in (0, None):
        if output is not None:
            names = {p.name for p in output.iterdir()}
            assert {"config.json", "effattn.json"} <= names, names
            assert "model.safetensors" in names or "model.safetensors.index.json" in names, names
    else:
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        assert code == 2, (code, err)
        assert len(lines) == 1 and lines[0].startswith("error:"), err
        assert "unexpected" not in lines[0], lines[0]
        if output is not None:
            assert not output.exists(), f"{output} was left behind by a failed run"
    if output is not None:
        leftovers = [p.name for p in output.parent.iterdir() if p.name.startswith(f".{output.name}.")]
        assert not leftovers, leftovers


# -- random option values ---------------------------------------------------------------------------

ints = st.one_of(st.integers(-3, 12), st.integers(13, 10**12), st.sampled_from(["x", "1.5", "", "heads"]))
option_values = st.fixed_dictionaries({}, optional={
    "--kv-heads": ints,
    "--method": st.sampled_from(["mean", "pca", "calibrated", "replicate", "foo", ""]),
    "--calib-tokens": ints,
    "--calib": st.sampled_from(["calib", "shakespeare", "nope.txt", "britannica"]),
    "--window": ints,
    "--codebook-size": ints,
    "--block-size": ints,
    "--sinks": ints,
    "--refine-steps": st.integers(-1, 3),
    "--dtype": st.sampled_from(["auto", "float32", "bfloat16", "float16", "int8", "fp99"]),
    "--eval-tokens": ints,
})


def _args(values: dict) -> list[str]:
    return [str(a) for key, value in values.items() for a in (key, value)]


@PROFILE
@given(to=st.sampled_from(["mqa", "gqa", "mha", "rerope", "vq", "nope"]), values=option_values)
def test_random_options_on_a_dry_run(capsys, pristine, tmp_path_factory, to, values):
    out = tmp_path_factory.mktemp("dry") / "out"
    code, stdout, err = run_cli(capsys, "convert", pristine, "--to", to, *_args(values), "-o", out, "--dry-run")
    assert_contract(code, stdout, err)
    assert not out.exists()


cheap_values = st.fixed_dictionaries({}, optional={
    "--kv-heads": st.one_of(st.integers(-1, 7), st.just("heads")),
    "--method": st.sampled_from(["mean", "pca", "replicate", "foo"]),
    "--dtype": st.sampled_from(["auto", "float32", "bfloat16", "int8"]),
    "--max-shard-size": st.sampled_from(["2GB", "1KB", "10", "lots"]),
})


@PROFILE
@given(to=st.sampled_from(["mqa", "gqa", "mha", "rerope"]), values=cheap_values)
def test_random_options_on_a_conversion(capsys, pristine, tmp_path_factory, to, values):
    out = tmp_path_factory.mktemp("run") / "out"
    code, stdout, err = run_cli(capsys, "convert", pristine, "--to", to, *_args(values), "-o", out, "--no-eval")
    assert_contract(code, stdout, err, out)


# -- random corruptions of the checkpoint ------------------------------------------------------------

CONFIG_EDITS = {
    "num_attention_heads": st.one_of(st.integers(-2, 13), st.just("six")),
    "num_key_value_heads": st.one_of(st.integers(-1, 7), st.none()),
    "hidden_size": st.integers(-1, 64),
    "head_dim": st.integers(0, 40),
    "num_hidden_layers": st.integers(-1, 5),
    "vocab_size": st.one_of(st.integers(-1, 1000), st.just("big")),
    "intermediate_size": st.integers(0, 200),
    "rope_theta": st.one_of(st.integers(-1, 10**6), st.just("abc")),
    "max_position_embeddings": st.integers(-1, 4096),
    "model_type": st.sampled_from(["llama", "qwen2", "mistral", "bert", "effattn_vq", ""]),
    "torch_dtype": st.sampled_from(["float32", "bfloat16", "complex64", "nope"]),
}

corruption = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, 999)),  # per mille kept (no floats: torch sets flush-to-zero)
    st.tuples(st.just("drop"), st.integers(0, 10**6)),
    st.tuples(st.just("reshape"), st.integers(0, 10**6), st.integers(1, 9)),
    st.tuples(st.just("header"), st.binary(min_size=1, max_size=12)),
    st.tuples(st.just("config"), st.dictionaries(st.sampled_from(sorted(CONFIG_EDITS)), st.none(), min_size=1, max_size=3)
              .flatmap(lambda keys: st.fixed_dictionaries({k: CONFIG_EDITS[k] for k in keys}))),
    st.tuples(st.just("config_delete"), st.sampled_from(sorted(CONFIG_EDITS))),
    st.tuples(st.just("config_text"), st.sampled_from(["", "{", "[]", "null", '{"model_type": 3}'])),
)


def corrupt(src: Path, dest: Path, how: tuple) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    weights, config = dest / "model.safetensors", dest / "config.json"
    kind = how[0]
    if kind == "truncate":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) * how[1] // 1000])
    elif kind in ("drop", "reshape"):
        tensors = load_file(weights)
        name = sorted(tensors)[how[1] % len(tensors)]
        if kind == "drop":
            tensors.pop(name)
        else:
            tensors[name] = torch.zeros(how[2], *tensors[name].shape[1:])
        save_file(tensors, weights, metadata={"format": "pt"})
    elif kind == "header":
        data = weights.read_bytes()
        n = struct.unpack("<Q", data[:8])[0]
        header = data[8 : 8 + n]
        at = len(how[1]) * 7 % max(1, n - len(how[1]))
        weights.write_bytes(data[:8] + header[:at] + how[1] + header[at + len(how[1]) :] + data[8 + n :])
    elif kind == "config":
        config.write_text(json.dumps(json.loads(config.read_text()) | how[1]))
    elif kind == "config_delete":
        data = json.loads(config.read_text())
        data.pop(how[1], None)
        config.write_text(json.dumps(data))
    elif kind == "config_text":
        config.write_text(how[1])
    return dest


COMMANDS = {
    "inspect": lambda m, o: ["inspect", m],
    "dry-run": lambda m, o: ["convert", m, "--to", "mqa", "-o", o, "--dry-run"],
    "convert": lambda m, o: ["convert", m, "--to", "mqa", "--method", "mean", "-o", o, "--no-eval"],
    "vq-dry-run": lambda m, o: ["vq-init", m, "--codebook-size", "8", "--window", "16", "-o", o, "--dry-run"],
    "eval": lambda m, o: ["eval", m, "--max-tokens", "128", "--context", "64", "--no-speed", "--corpus", "shakespeare"],
}


@PROFILE
@given(how=corruption, command=st.sampled_from(sorted(COMMANDS)))
def test_random_corruptions_of_a_checkpoint(capsys, pristine, tmp_path_factory, how, command):
    root = tmp_path_factory.mktemp("corrupt")
    model = corrupt(pristine, root / "model", how)
    out = root / "out"
    code, stdout, err = run_cli(capsys, *COMMANDS[command](model, out))
    writes = command == "convert"
    assert_contract(code, stdout, err, out if writes else None)
    if not writes:
        assert not out.exists()
