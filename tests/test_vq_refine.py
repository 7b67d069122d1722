"""Local refinement of the Transformer-VQ conversion (`--to vq` / `vq-init` with `--refine-steps`): each
layer's q/k/v/o trained through its VQ attention after the codebooks are fitted, the codebooks kept;
and the refinement options, declared once (RefineOptions) for every conversion that has them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import effattn  # noqa: F401  (registers effattn_vq with transformers)
from effattn.convert import CONVERSIONS, convert
from effattn.convert.options import resolve
from effattn.convert.refine import RefineOptions, RefineSettings
from effattn.errors import EffattnError
from effattn.finetune import validate_recipe
from effattn.testing import byte_tokenizer, make_model

from .conftest import logits_of
from .test_cli_errors import assert_one_line_error, run_cli
from .test_vq_model import _attention_inputs, load

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold jumpers".split()
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
BUFFERS = ("codebook", "ema_counts", "ema_sums", "code_metric")
REFINE = {"refine_steps": 20, "refine_lr": 1e-3}


def word_salad(n: int, seed: int) -> str:
    gen = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (n,), generator=gen).tolist())


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("src") / "llama", "llama", heads=6, kv_heads=3, head_dim=8)


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(word_salad(6000, seed=0))
    return path


def vq(src: Path, out: Path, calib: Path, **options):
    opts = {"codebook_size": 16, "window": 16, "calib": str(calib), "calib_tokens": 1024, "calib_seq_len": 128} | options
    return convert(src, out, to="vq", options=opts, measure=False)


@pytest.fixture(scope="module")
def plain(src, calib, tmp_path_factory) -> Path:
    return vq(src, tmp_path_factory.mktemp("plain") / "vq", calib).out


@pytest.mark.parametrize("target", ["attention", "stream"])
def test_refinement_lowers_every_layers_error_and_the_logit_error(src, calib, plain, tmp_path, target):
    refined = vq(src, tmp_path / "refined", calib, **REFINE, refine_target=target).out
    record = json.loads((refined / "effattn.json").read_text())
    losses = record["conversion_run"]["refine"]
    assert len(losses["before"]) == 2 and all(a < b for a, b in zip(losses["after"], losses["before"])), losses
    assert {"refine_steps": 20, "refine_lr": 1e-3, "refine_target": target}.items() <= record["conversion"].items()
    assert "conversion_run" not in json.loads((plain / "effattn.json").read_text())  # off by default
    assert "refinement: 20 Adam steps per layer at lr 0.001 on q/k/v/o" in (refined / "README.md").read_text()

    new, old = load_file(refined / "model.safetensors"), load_file(plain / "model.safetensors")
    for layer in range(2):
        for proj in PROJECTIONS:
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            assert not torch.equal(new[name], old[name]), name
    # layer 0's codebooks are fitted on the embeddings either way, and refinement (eval mode) neither
    # refits nor moves them by EMA; layer 1's are fitted on what the refined layer 0 feeds it
    for buffer in BUFFERS:
        assert torch.equal(new[f"model.layers.0.self_attn.{buffer}"], old[f"model.layers.0.self_attn.{buffer}"]), buffer
    assert not torch.equal(new["model.layers.1.self_attn.codebook"], old["model.layers.1.self_attn.codebook"])

    # held-out text (never calibrated on), through plain transformers after `import effattn`
    ids = byte_tokenizer()(word_salad(300, seed=1), return_tensors="pt").input_ids[:, :256].reshape(2, 128)
    ref = logits_of(src, ids)
    error = {name: (logits_of(out, ids) - ref).pow(2).mean().item() for name, out in (("plain", plain), ("refined", refined))}
    assert error["refined"] < error["plain"], error


def test_exact_heads_are_scored_on_the_refined_layer(src, calib, tmp_path):
    """--exact-heads scores each head while the activations pass the layer, after refinement (whose own
    passes through the layer, `stream` target, must not count): layer 0's recorded errors are the refined
    model's VQ heads against the same weights' exact attention."""
    out = vq(src, tmp_path / "vq", calib, exact_heads=2, **REFINE, refine_target="stream").out
    errors = json.loads((out / "effattn.json").read_text())["conversion"]["head_errors"]
    from effattn.convert.calibrate import CalibSettings, calibration_tokens

    ids = calibration_tokens(out, CalibSettings(corpus=str(calib), tokens=1024, seq_len=128))
    quantized = _attention_inputs(load(out, vq_exact_heads=[]), 0, ids).view(*ids.shape, 3, 2, 8)
    exact = _attention_inputs(load(out, vq_exact_heads=[[0, g] for g in range(3)]), 0, ids).view_as(quantized)
    relative = ((quantized - exact).pow(2).sum((0, 1, 3, 4)) / exact.pow(2).sum((0, 1, 3, 4))).tolist()
    assert relative == pytest.approx([errors[f"0.{g}"] for g in range(3)], rel=1e-2)


def test_the_plan_says_when_refinement_is_on_and_costs_it(src, calib, tmp_path, monkeypatch):
    import effattn.convert.vq as vq_module

    seen = []  # the memory estimate hears of the refinement (a stream target holds x0 too)
    real = vq_module.calibrated_bytes
    monkeypatch.setattr(vq_module, "calibrated_bytes", lambda *a, **kw: seen.append(a[3]) or real(*a, **kw))
    off = convert(src, tmp_path / "a", to="vq", options={"codebook_size": 16, "window": 16}, dry_run=True, measure=False).plan
    on = convert(src, tmp_path / "b", to="vq", options={"codebook_size": 16, "window": 16, "refine_steps": 30,
                                                           "refine_target": "stream"}, dry_run=True,
                 measure=False).plan
    assert (off.settings["refine_steps"], off.settings["refine_lr"], off.settings["refine_target"]) == (0, None, None)
    assert (on.settings["refine_steps"], on.settings["refine_lr"], on.settings["refine_target"]) == (30, 1e-4, "stream")
    assert "refinement" not in dict(off.summary)
    assert dict(on.summary)["refinement"].startswith("30 Adam steps per layer at lr 0.0001 on q/k/v/o")
    assert "original model's activations after the layer" in dict(on.summary)["refinement"]
    assert on.est_seconds > off.est_seconds and on.est_peak_bytes > off.est_peak_bytes  # the steps, their autograd graph
    assert seen == [RefineSettings(0, 1e-4, "attention"), RefineSettings(30, 1e-4, "stream")]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_refine_flags_are_vqs_and_not_reropes(src, tmp_path, capsys):
    for args in (["convert", "--to", "vq", "--help"], ["vq-init", "--help"]):
        code, stdout, _ = run_cli(capsys, *args)
        assert code in (0, None) and "--refine-steps" in stdout and "--refine-target" in stdout, args
    code, stdout, _ = run_cli(capsys, "convert", "--to", "rerope", "--help")
    assert code in (0, None) and "--window" in stdout and "--refine" not in stdout
    code, _, err = run_cli(capsys, "convert", src, "--to", "rerope", "--refine-steps", "5", "-o", tmp_path / "x")
    assert code == 2
    assert_one_line_error(code, err, "--refine-steps does not apply to rerope")
    assert not (tmp_path / "x").exists()


def test_a_recipe_refines_vq_and_refuses_a_misspelt_refine_option():
    recipe = validate_recipe({"student": {"model": "llama", "convert": {"to": "vq", "refine_steps": 10}},
                              "train": {"max_steps": 1}})
    assert recipe.student.convert.options() == {"refine_steps": 10}
    with pytest.raises(EffattnError, match=r"student.convert.refine_stpes: unknown option of vq \(did you mean 'refine_steps'\?\)"):
        validate_recipe({"student": {"model": "llama", "convert": {"to": "vq", "refine_stpes": 10}}, "train": {"max_steps": 1}})


@pytest.mark.parametrize("name, defaults", [
    ("gqa", RefineSettings(36, 3e-4, "stream")), ("mla", RefineSettings(30, 3e-4, "stream")),
    ("linear", RefineSettings(40, 1e-2, "attention")), ("vq", RefineSettings(0, 1e-4, "attention")),
])
def test_the_refine_options_are_declared_once_and_listed_last(name, defaults):
    options = CONVERSIONS[name].Options
    last = len(RefineOptions.REFINE_FIELDS)
    assert issubclass(options, RefineOptions) and list(options.model_fields)[-last:] == list(RefineOptions.REFINE_FIELDS)
    assert list(options().model_dump())[-last:] == list(RefineOptions.REFINE_FIELDS)  # the recorded command line's order
    assert options().refine_settings() == defaults
    with pytest.raises(EffattnError, match="--refine-steps must be an integer >= 0, got -1"):  # the checks survive a
        resolve(name, {"refine_steps": -1})                                                     # redeclared default
    with pytest.raises(EffattnError, match="--refine-lr must be a number > 0"):
        resolve(name, {"refine_lr": 0})
    with pytest.raises(EffattnError, match="refine.schedule"):
        resolve(name, {"refine_schedule": "linear"})
    with pytest.raises(EffattnError, match="--refine-device = 'gpu': must be auto, cpu, cuda or cuda:N"):
        resolve(name, {"refine_device": "gpu"})
    assert not issubclass(CONVERSIONS["rerope"].Options, RefineOptions)
    assert not set(RefineOptions.REFINE_FIELDS) & set(CONVERSIONS["rerope"].Options.model_fields)
