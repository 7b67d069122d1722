"""Sliding-window attention as a conversion (`--to swa`): native Mistral / Ministral / Qwen outputs that
attend exactly as the original model under a window mask, per-layer choices, bounded caches, refusals."""

from __future__ import annotations

import json

import pytest
import torch

from effattn.convert import convert
from effattn.convert.swa import window_mask

from .test_cli_errors import assert_one_line_error, run_cli

T = 48
WINDOW = 12


def reference_logits(src, ids: torch.Tensor, layer_types: list[str], window: int) -> torch.Tensor:
    """The original model (its own architecture, e.g. Llama) with the window applied as an explicit
    attention mask on the layers marked sliding: what the converted model must compute."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64).eval()
    mask = window_mask(ids.shape[1], window)[None, None]
    for layer, kind in zip(model.model.layers, layer_types):
        if kind == "sliding_attention":
            forward = layer.self_attn.forward

            def windowed(*args, _forward=forward, **kwargs):
                kwargs["attention_mask"] = mask
                return _forward(*args, **kwargs)

            layer.self_attn.forward = windowed
    with torch.no_grad():
        return model(input_ids=ids).logits


def converted(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()


@pytest.mark.parametrize("family,full,expected", [
    ("llama", None, "mistral"), ("llama", "1", "ministral"), ("mistral", None, "mistral"),
    ("mistral", "0,2", "ministral"), ("qwen2", "1", "qwen2"), ("qwen3", None, "qwen3")])
def test_the_native_output_attends_as_the_original_under_the_window(tiny, tmp_path, family, full, expected):
    src = tiny(family, layers=3)
    options = {"window": WINDOW} | ({"full_layer_ids": full} if full else {})
    out = convert(src, tmp_path / "swa", to="swa", options=options, measure=False).out
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == expected and config["sliding_window"] == WINDOW
    full_ids = {int(i) for i in full.split(",")} if full else set()
    layer_types = ["full_attention" if i in full_ids else "sliding_attention" for i in range(3)]
    model = converted(out)
    assert type(model).__name__ == f"{config['architectures'][0]}"
    declared = getattr(model.config, "layer_types", None) if expected != "mistral" else None
    assert declared is None or list(declared) == layer_types  # Mistral: one window for every layer
    ids = torch.randint(0, 250, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, reference_logits(src, ids, layer_types, WINDOW), rtol=0, atol=1e-10)
    full_logits = reference_logits(src, ids, ["full_attention"] * 3, WINDOW)
    assert (got[:, :WINDOW] - full_logits[:, :WINDOW]).abs().max() < 1e-10  # within the window: unchanged
    assert (got[:, WINDOW:] - full_logits[:, WINDOW:]).abs().max() > 1e-3  # beyond it: the window matters


def test_decoding_through_the_bounded_cache_matches_a_full_prefill(tiny, tmp_path):
    """Greedy decoding with the cache (which keeps only the window on sliding layers) gives the tokens
    a fresh prefill of the whole sequence gives at every step."""
    out = convert(tiny("llama", layers=2), tmp_path / "swa", to="swa", options={"window": WINDOW}, measure=False).out
    model = converted(out)
    ids = torch.randint(0, 250, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=30, do_sample=False, min_new_tokens=30)
        seq = ids
        for _ in range(30):
            seq = torch.cat([seq, model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(generated, seq)


def test_the_cache_holds_the_window_on_sliding_layers_and_everything_on_full_ones(tiny, tmp_path):
    from effattn.evaluate import kv_cache_bytes

    src = tiny("llama", layers=3, kv_heads=3, head_dim=8)
    out = convert(src, tmp_path / "swa", to="swa", options={"window": WINDOW, "full_layer_ids": "2"}, measure=False).out
    model = converted(out).float()
    ids = torch.randint(0, 250, (1, 100))
    per_token_layer = 2 * 3 * 8 * 4  # keys + values, 3 KV heads of 8, float32
    measured = kv_cache_bytes(model, ids)
    # two sliding layers hold at most the window, the full layer all 100 tokens
    assert 100 * per_token_layer <= measured <= (100 + 2 * WINDOW) * per_token_layer


def test_full_layers_are_the_ones_with_the_largest_measured_error(tiny, tmp_path):
    src = tiny("llama", layers=4)
    out = convert(src, tmp_path / "swa", to="swa", options={"window": 8, "full_layers": 2, "calib_tokens": 2048},
                  measure=False).out
    record = json.loads((out / "effattn.json").read_text())
    errors = record["conversion_run"]["window_error"]["per_layer"]
    assert len(errors) == 4 and all(e > 0 for e in errors)
    top = sorted(sorted(range(4), key=lambda i: -errors[i])[:2])
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "ministral"
    assert [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"] == top
    assert record["conversion"]["full_layer_ids"] == ",".join(map(str, top))
    assert f"--full-layers 2" in record["reproduce"]


def test_dry_run_states_the_cache_saving(tiny, capsys):
    code, out, err = run_cli(capsys, "convert", tiny("llama", layers=2), "--to", "swa", "--window", "512", "--dry-run",
                             "--no-eval")
    assert code == 0, err
    assert "mistral" in out and "bytes/token" in out and "8.0x less" in out  # 4,096 trained positions / 512


@pytest.mark.parametrize("args,needle", [
    ([], "needs --window"),
    (["--window", "4096"], "covers the whole trained context"),
    (["--window", "8", "--full-layers", "1", "--full-layer-ids", "0"], "both choose"),
    (["--window", "8", "--full-layer-ids", "0,7"], "outside 0..1"),
    (["--window", "8", "--full-layer-ids", "a"], "not a comma-separated list"),
    (["--window", "8", "--full-layers", "2"], "leaves no windowed layer"),
    (["--window", "8", "--calib-tokens", "4096"], "not asked for"),
])
def test_bad_options_are_refused_in_one_line(tiny, tmp_path, capsys, args, needle):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", tiny("llama", layers=2), "--to", "swa", *args, "-o", out)
    assert_one_line_error(code, err, needle)
    assert code == 2 and not out.exists()


def test_a_llama_with_biases_has_no_native_window(tiny, tmp_path, capsys):
    code, _, err = run_cli(capsys, "convert", tiny("llama", layers=2, attention_bias=True), "--to", "swa",
                           "--window", "8", "-o", tmp_path / "out")
    assert_one_line_error(code, err, "biases")
