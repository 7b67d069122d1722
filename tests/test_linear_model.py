"""The linearized model (effattn_linear, LoLCATs' hybrid attention) on tiny random models: the original
model when the window covers the sequence, cached decoding against the full forward pass, a cache that
stops growing, remote code, and gradients for the new parameters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from effattn.attention.linear import (
    INIT_WINDOW_FACTOR,
    EffattnLinearConfig,
    EffattnLinearForCausalLM,
    LinearAttention,
    LinearCache,
    linear_config_from,
)
from effattn.convert.linear import LinearConversion

from .conftest import logits_of

SPEC = LinearConversion.model  # the conversion's own spec: the bundle it writes

IDS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
MAPS = {"hedgehog": {"name": "hedgehog", "projection_dim": 12}, "elu": {"name": "elu"}}
NEW_TENSORS = {"window_factors", "feature_map_q.weight", "feature_map_k.weight"}  # hedgehog's, per layer


def linear_folder(src: Path, out: Path, **settings) -> Path:
    """The base checkpoint's files under a linear config: what a conversion without training writes."""
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "config.json":
            shutil.copy(f, out / f.name)
    config = linear_config_from(json.loads((src / "config.json").read_text()), **settings)
    (out / "config.json").write_text(json.dumps(config))
    return out


def load(folder: Path) -> EffattnLinearForCausalLM:
    return EffattnLinearForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()


def make(tiny, tmp_path, name: str, family="llama", heads=6, kv_heads=3, **settings) -> EffattnLinearForCausalLM:
    src = tiny(family, heads=heads, kv_heads=kv_heads, head_dim=8)
    return load(linear_folder(src, tmp_path / name, **settings))


def perturb(model, seed: int = 0) -> None:
    """As after training: per-head mixes and query/key feature maps that differ from each other."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for attn in model.linear_attention_modules():
            attn.window_factors.copy_(torch.randn(attn.window_factors.shape, generator=g, dtype=torch.float64))
            for fmap in (attn.feature_map_q, attn.feature_map_k):
                for p in fmap.parameters():
                    p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("fmap", list(MAPS))
def test_a_window_covering_the_sequence_is_the_original_model(tiny, tmp_path, fmap):
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)  # GQA
    model = load(linear_folder(src, tmp_path / "lin", linear_window=IDS.shape[1], linear_eps=0.0,
                               linear_feature_map=MAPS[fmap], linear_chunk_size=16))
    original = logits_of(src, IDS, torch.float64)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn, LinearAttention)
    torch.testing.assert_close(attn.window_factors, torch.full((6,), INIT_WINDOW_FACTOR, dtype=torch.float64))
    torch.testing.assert_close(logits(model), original, rtol=1e-10, atol=1e-10)
    perturb(model)  # the window factor cancels in the normaliser (eps = 0), whatever the feature maps
    torch.testing.assert_close(logits(model), original, rtol=1e-10, atol=1e-10)
    model.config.linear_kernel = "naive"
    torch.testing.assert_close(logits(model), original, rtol=1e-10, atol=1e-10)
    # with eps, each attention output is scaled by a / (a + eps / wf), a >= 1 (the query's own key):
    # a relative change of at most eps / wf per layer, wf = sigmoid(window_factors) >= 0.1 here
    model.config.linear_kernel = "chunk"
    model.config.linear_eps = 1e-6
    with torch.no_grad():
        for attn in model.linear_attention_modules():
            attn.window_factors.clamp_(min=-2.19)
    diff = (logits(model) - original).abs().max().item()
    assert 0 < diff < 10 * 1e-6 / 0.1 * original.abs().max().item()  # (seen: about 1x, over 2 layers)
    # and a short window changes the logits: the far keys go through the feature maps
    model.config.linear_window = 8
    assert (logits(model) - original).abs().max() > 1e-3


def decode_in_pieces(model, ids, pieces):
    """Logits of `ids` fed in consecutive pieces of these lengths through one LinearCache."""
    out, cache = [], None
    with torch.no_grad():
        start = 0
        for n in pieces:
            step = model(input_ids=ids[:, start:start + n], cache=cache, use_cache=True)
            cache = step.cache
            assert isinstance(cache, LinearCache) and cache.get_seq_length() == start + n
            out.append(step.logits)
            start += n
    assert start == ids.shape[1]
    return torch.cat(out, 1), cache


@pytest.mark.parametrize("window, sinks", [(0, 0), (8, 0), (8, 3)])
@pytest.mark.parametrize("fmap", list(MAPS))
def test_cached_decoding_and_generate_match_the_full_forward(tiny, tmp_path, fmap, window, sinks):
    model = make(tiny, tmp_path, "lin", linear_window=window, linear_sinks=sinks, linear_feature_map=MAPS[fmap],
                  linear_chunk_size=16)
    perturb(model)
    full = logits(model)
    T = IDS.shape[1]
    cases = {"token by token": [1] * T, "prefill + decode": [13] + [1] * (T - 13),
             "prefill + chunk + decode": [13, 5] + [1] * (T - 18), "chunked prefill": [5, 30, 4, 1]}
    for name, pieces in cases.items():
        got, _ = decode_in_pieces(model, IDS, pieces)
        torch.testing.assert_close(got, full, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
    model.config.linear_kernel = "naive"  # the reference continues a cached prefix token by token
    got, _ = decode_in_pieces(model, IDS, cases["chunked prefill"])
    torch.testing.assert_close(got, full, rtol=1e-9, atol=1e-9)
    model.config.linear_kernel = "chunk"
    generated = model.generate(IDS[:1, :8], max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert generated.shape == (1, 24)
    predicted = logits(model, generated)[0, 7:-1]
    predicted[:, model.generation_config.eos_token_id] = float("-inf")  # min_new_tokens suppresses EOS
    assert torch.equal(predicted.argmax(-1), generated[0, 8:])


@pytest.mark.parametrize("sinks", [0, 3])
def test_the_cache_stops_growing_after_the_window(tiny, tmp_path, sinks):
    window = 8
    model = make(tiny, tmp_path, "lin", linear_window=window, linear_sinks=sinks, linear_feature_map=MAPS["hedgehog"])
    ids = torch.randint(0, 256, (1, 4 * window), generator=torch.Generator().manual_seed(2))
    sizes = {}
    with torch.no_grad():
        cache = None
        for t in range(ids.shape[1]):
            cache = model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).cache
            sizes[t + 1] = cache.nbytes()
    full = window + sinks
    assert sizes[window // 2] < sizes[full - 1] < sizes[full] == sizes[2 * window] == sizes[4 * window]
    # per layer, float64: S [H, F, Dv] and z [H, F], the window's keys, values and feature keys of H heads,
    # and the sinks' keys and values
    H, D, Fd = 6, 8, 24
    assert sizes[4 * window] == 2 * 8 * (H * Fd * D + H * Fd + window * H * (D + D + Fd) + sinks * H * (D + D))
    # a prefill leaves the same state as the steps
    for n in (2 * window, 4 * window):
        with torch.no_grad():
            assert model(input_ids=ids[:, :n], use_cache=True).cache.nbytes() == sizes[4 * window]


def test_the_model_loads_with_remote_code_alone(tiny, tmp_path):
    from .remote import remote_logits

    model = make(tiny, tmp_path, "lin", family="qwen3", linear_window=8, linear_feature_map=MAPS["hedgehog"])
    perturb(model)
    out = tmp_path / "saved"
    model.save_pretrained(out)
    SPEC.write_code(out)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "effattn_linear" and config["auto_map"]["AutoModelForCausalLM"] == \
        "modeling_effattn_linear.EffattnLinearForCausalLM"
    expected = logits(model)
    # the trained tensors come back from the checkpoint (not re-initialized), here and without effattn
    torch.testing.assert_close(logits(load(out)), expected, rtol=0, atol=0)
    torch.testing.assert_close(remote_logits(out, IDS, "EffattnLinearForCausalLM", tmp_path), expected, rtol=0, atol=0)


def test_the_bundled_code_decodes_where_effattn_is_installed_but_not_imported(tiny, tmp_path):
    """With effattn importable the bundled code takes its compiled decode step, which it imported under another name
    (`decode_step as native_decode_step`): the bundle dropped that import, and the first decoded token raised
    NameError."""
    from .remote import remote_logits

    model = make(tiny, tmp_path, "lin", family="llama", linear_window=8, linear_feature_map=MAPS["hedgehog"])
    perturb(model)
    out = tmp_path / "saved"
    model.to(torch.float32).save_pretrained(out)
    SPEC.write_code(out)
    assert "native_decode_step = decode_step" in (out / SPEC.modeling_file).read_text()
    expected = logits(load(out).to(torch.float32))
    decoded = remote_logits(out, IDS, "EffattnLinearForCausalLM", tmp_path, prefix=IDS.shape[1] - 4, guarded=False,
                            dtype="float32")
    torch.testing.assert_close(decoded, expected.to(torch.float32), rtol=1e-4, atol=1e-4)


def test_new_parameters_get_gradients_and_the_projections_keep_their_names(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny("llama", heads=6, kv_heads=2, head_dim=8)
    model = load(linear_folder(src, tmp_path / "lin", linear_window=8, linear_feature_map=MAPS["hedgehog"])).train()
    base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64).state_dict()
    ours = model.state_dict()
    assert set(base) <= set(ours)
    for key, value in base.items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=0)
    new = {key.split("self_attn.", 1)[1] for key in set(ours) - set(base)}
    assert new == NEW_TENSORS and len(set(ours) - set(base)) == len(NEW_TENSORS) * len(model.model.layers)

    loss = model(input_ids=IDS, labels=IDS, use_cache=False).loss
    loss.backward()
    for attn in model.linear_attention_modules():
        for name in ("window_factors", "feature_map_q.weight", "feature_map_k.weight"):
            grad = attn.get_parameter(name).grad
            assert grad is not None and torch.isfinite(grad).all() and grad.abs().max() > 0, name
        assert attn.q_proj.weight.grad is not None  # the projections train too (LoRA or not is the recipe's choice)


def test_the_cache_owns_its_window_and_does_not_keep_the_prefill_alive(tiny, tmp_path):
    """After a prefill the window is a copy (a slice would hold the prefill's whole keys); a decoding step's
    window, a slice of its own small window, is kept without a copy."""
    model = make(tiny, tmp_path, "lin", linear_window=8, linear_feature_map=MAPS["hedgehog"])
    with torch.no_grad():
        cache = model(input_ids=IDS[:1], use_cache=True).cache
        for state in cache.states.values():
            for x in (state.k, state.v, state.fk):
                assert x.shape[1] == 8 and x.untyped_storage().nbytes() == x.nbytes, "the prefill is kept alive"
        step = model(input_ids=IDS[:1, :1], cache=cache, use_cache=True).cache
        assert all(s.k.shape[1] == 8 for s in step.states.values())
