"""Calibrated GQA methods: RoPE-exact math, exactness where it holds, grouping by similarity."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from effattn.attention.functional import apply_rope
from effattn.convert import convert
from effattn.convert.gqa import METHODS
from effattn.convert.headmerge import KeyMerge, apply_key_merge, choose_groups, merge_keys, to_complex

from .conftest import FAMILY_CONFIGS, logits_of
from .test_convert_gqa import IDS, _duplicate_heads_within_groups

HEAD_MERGE = ["align", "pca", "calibrated"]


WORDS = "the king and queen walk in the garden while a storm gathers over distant hills".split()


def word_salad(n: int, seed: int) -> str:
    gen = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=gen).tolist())


@pytest.fixture
def calib_file(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text(word_salad(4000, seed=0))
    return str(path)


def _opts(method, calib_file, **kw):
    opts = {"method": method, **kw}
    if METHODS[method].needs_calibration:
        opts |= {"calib": calib_file, "calib_tokens": 1024}
    return opts


def rope_tables(T: int, d: int, theta: float = 10000.0):
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos()[None], emb.sin()[None]  # (1, T, d)


def test_key_merge_commutes_with_rope():
    """Rotate-then-merge equals merge-then-rotate, for arbitrary complex per-frequency coefficients."""
    gen = torch.Generator().manual_seed(0)
    r, d, T = 3, 16, 40
    a = torch.randn(r, d // 2, dtype=torch.complex128, generator=gen)
    merge = KeyMerge([0, 1, 2], a, torch.ones_like(a))
    keys = torch.randn(1, T, r, d, dtype=torch.float64, generator=gen)  # (B, T, r, d)
    cos, sin = rope_tables(T, d)
    merged_then_rotated = apply_rope(apply_key_merge(keys, merge)[:, :, None], cos, sin)[:, :, 0]
    rotated_then_merged = apply_key_merge(apply_rope(keys, cos, sin), merge)
    torch.testing.assert_close(merged_then_rotated, rotated_then_merged, rtol=1e-12, atol=1e-12)


def test_a_map_that_mixes_frequencies_does_not_commute_with_rope():
    """The check above has teeth: a generic real linear map on the key dims breaks RoPE."""
    gen = torch.Generator().manual_seed(1)
    d, T = 16, 40
    keys = torch.randn(1, T, 1, d, dtype=torch.float64, generator=gen)
    mix = torch.randn(d, d, dtype=torch.float64, generator=gen)
    cos, sin = rope_tables(T, d)
    assert not torch.allclose(apply_rope(keys @ mix.T, cos, sin), apply_rope(keys, cos, sin) @ mix.T, atol=1e-3)


def test_rank_one_keys_merge_exactly_with_compensated_queries():
    """If the old keys of a group are per-frequency complex multiples of one key, the merged key and
    the compensated queries reproduce every logit at every relative position."""
    gen = torch.Generator().manual_seed(2)
    r, d, T, F = 3, 8, 32, 4
    base = torch.randn(T, d, dtype=torch.float64, generator=gen)
    beta = torch.randn(r, F, dtype=torch.complex128, generator=gen)
    z = beta[None] * to_complex(base)[:, None]  # (T, r, F): z_g = beta_g * z'
    keys = torch.cat([z.real, z.imag], dim=-1)  # (T, r, d)
    cov = torch.einsum("tgf,thf->fgh", z, z.conj()) / T
    merge = merge_keys(cov, torch.ones(r, F, dtype=torch.float64), [0, 1, 2])
    new_key = apply_key_merge(keys, merge)  # (T, d)
    q = torch.randn(T, d, dtype=torch.float64, generator=gen)  # a query that read old head 1
    q_new = torch.cat([(to_complex(q) * merge.b[1].conj()).real, (to_complex(q) * merge.b[1].conj()).imag], -1)
    cos, sin = rope_tables(T, d)
    old_logits = apply_rope(q[None, :, None], cos, sin)[0, :, 0] @ apply_rope(keys[None, :, 1:2], cos, sin)[0, :, 0].T
    new_logits = apply_rope(q_new[None, :, None], cos, sin)[0, :, 0] @ apply_rope(new_key[None, :, None], cos, sin)[0, :, 0].T
    torch.testing.assert_close(new_logits, old_logits, rtol=1e-9, atol=1e-9)


def test_grouping_finds_similar_heads_that_are_not_adjacent():
    gen = torch.Generator().manual_seed(3)
    T, F = 200, 4
    z0, z1 = (torch.randn(T, F, dtype=torch.complex128, generator=gen) for _ in range(2))
    z = torch.stack([z0, z1, 2 * z0, -z1], dim=1)  # heads 0~2 and 1~3 are collinear
    cov = torch.einsum("tgf,thf->fgh", z, z.conj()) / T
    assert choose_groups(cov, torch.ones(4, F, dtype=torch.float64), 2) == [[0, 2], [1, 3]]


def _interleave_duplicates(folder, head_dim: int):
    """4 KV heads where heads 0 and 2 are equal and heads 1 and 3 are equal (K and V)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                for t in (proj.weight, proj.bias):
                    if t is not None:
                        heads = t.view(4, head_dim, *t.shape[1:])
                        heads[2].copy_(heads[0])
                        heads[3].copy_(heads[1])
    model.save_pretrained(folder)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["pca", "calibrated"])
def test_similarity_grouping_makes_interleaved_duplicates_exact(tiny, tmp_path, calib_file, family, method):
    src = tiny(family, heads=8, kv_heads=4, head_dim=8, hidden=64)
    _interleave_duplicates(src, 8)
    out = convert(src, tmp_path / "out", to="gqa", options=_opts(method, calib_file, kv_heads=2), measure=False).out
    torch.testing.assert_close(logits_of(out, IDS, torch.float64), logits_of(src, IDS, torch.float64), rtol=1e-4, atol=1e-4)
    mean = convert(src, tmp_path / "mean", to="gqa", options={"kv_heads": 2, "method": "mean"}, measure=False).out
    assert (logits_of(mean, IDS) - logits_of(src, IDS)).abs().max() > 1e-2  # contiguous pooling is not exact here


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
@pytest.mark.parametrize("method", HEAD_MERGE)
def test_duplicated_heads_merge_exactly(tiny, tmp_path, calib_file, family, method):
    src = tiny(family, heads=6, kv_heads=6, head_dim=8)
    _duplicate_heads_within_groups(src, group=3, head_dim=8)
    out = convert(src, tmp_path / "out", to="gqa", options=_opts(method, calib_file, kv_heads=2), measure=False).out
    torch.testing.assert_close(logits_of(out, IDS, torch.float64), logits_of(src, IDS, torch.float64), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["mean", *HEAD_MERGE])
def test_gqa_to_mha_to_gqa_round_trip_is_exact(tiny, tmp_path, calib_file, method):
    src = tiny("llama", heads=6, kv_heads=2, head_dim=8)
    mha = convert(src, tmp_path / "mha", to="mha", options={"method": method} if method == "mean" else _opts(method, calib_file),
                  measure=False).out
    back = convert(mha, tmp_path / "back", to="gqa", options=_opts(method, calib_file, kv_heads=2), measure=False).out
    assert json.loads((back / "config.json").read_text())["num_key_value_heads"] == 2
    torch.testing.assert_close(logits_of(back, IDS, torch.float64), logits_of(src, IDS, torch.float64), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", HEAD_MERGE)
def test_identity_is_an_exact_copy_for_every_method(tiny, tmp_path, calib_file, method):
    src = tiny("qwen3", heads=6, kv_heads=3)
    out = convert(src, tmp_path / "out", to="gqa", options=_opts(method, calib_file, kv_heads=3), measure=False).out
    assert torch.equal(logits_of(out, IDS), logits_of(src, IDS))


def test_calibrated_beats_mean_on_a_random_model(tiny, tmp_path, calib_file):
    """Without structure to exploit, merging still loses less with calibration than with mean-pooling
    on held-out text of the calibration distribution."""
    from effattn.testing import byte_tokenizer

    src = tiny("llama", heads=8, kv_heads=4, head_dim=8, hidden=64, layers=3)
    ids = byte_tokenizer()(word_salad(600, seed=1), return_tensors="pt").input_ids[:, :512]
    ref = logits_of(src, ids)
    errors = {}
    for method in ("mean", "calibrated"):
        out = convert(src, tmp_path / method, to="gqa", options=_opts(method, calib_file, kv_heads=1), measure=False).out
        errors[method] = (logits_of(out, ids) - ref).pow(2).mean().item()
    assert errors["calibrated"] < 0.7 * errors["mean"], errors


def test_calibration_options_are_recorded_and_checked(tiny, tmp_path, calib_file):
    src = tiny("llama")
    out = convert(src, tmp_path / "out", to="mqa", options=_opts("calibrated", calib_file), measure=False).out
    conv = json.loads((out / "effattn.json").read_text())["conversion"]
    assert (conv["method"], conv["calib"], conv["calib_tokens"]) == ("calibrated", calib_file, 1024)
    from effattn.errors import EffattnError

    with pytest.raises(EffattnError, match="apply to calibrated methods"):
        convert(src, tmp_path / "x", to="mqa", options={"method": "mean", "calib": calib_file})
    with pytest.raises(EffattnError, match="at least one sequence"):
        convert(src, tmp_path / "x", to="mqa", options={"method": "calibrated", "calib_tokens": 10})


@pytest.mark.parametrize("target", ["attention", "stream"])
def test_local_refinement_lowers_every_layers_error_and_the_logit_error(tiny, tmp_path, calib_file, target):
    """--refine-steps: each layer's fitted error falls (recorded per layer), and so does the end-to-end logit error."""
    from effattn.testing import byte_tokenizer

    src = tiny("llama", layers=3)
    ids = byte_tokenizer()(word_salad(600, seed=1), return_tensors="pt").input_ids[:, :512]
    ref = logits_of(src, ids)
    plain = convert(src, tmp_path / "plain", to="mqa", options=_opts("calibrated", calib_file, refine_steps=0),
                    measure=False).out
    options = _opts("calibrated", calib_file, refine_steps=60, refine_lr=1e-3, refine_target=target)
    refined = convert(src, tmp_path / "refined", to="mqa", options=options, measure=False).out
    record = json.loads((refined / "effattn.json").read_text())
    losses = record["conversion_run"]["refine"]
    assert len(losses["before"]) == 3 and all(a < b for a, b in zip(losses["after"], losses["before"])), losses
    assert (record["conversion"]["refine_steps"], record["conversion"]["refine_target"]) == (60, target)
    error = {name: (logits_of(out, ids) - ref).pow(2).mean().item() for name, out in (("plain", plain), ("refined", refined))}
    assert error["refined"] < error["plain"], error
    assert losses["skipped"] == []
    assert "conversion_run" not in json.loads((plain / "effattn.json").read_text())  # off: nothing measured


def test_the_stream_walk_carries_each_refined_layers_output(tiny, tmp_path, calib_file):
    """With the stream target, refinement's last error pass is the converted layer's output and its targets the
    original's: the walk carries both on instead of running the layers again (layers.run_layers). The record
    must then describe the model written: every layer's error after its steps, recomputed from the saved
    model's own hidden states on the calibration tokens against the original's, is the recorded one; and each
    layer's error before its steps is taken on the refined layers' outputs below it."""
    from effattn.convert.calibrate import CalibSettings, calibration_tokens

    src = tiny("llama", layers=3)
    options = _opts("calibrated", calib_file, refine_steps=8, refine_lr=1e-3, refine_target="stream")
    out = convert(src, tmp_path / "out", to="mqa", options=options, measure=False).out
    losses = json.loads((out / "effattn.json").read_text())["conversion_run"]["refine"]
    ids = calibration_tokens(src, CalibSettings(corpus=calib_file, tokens=1024))

    def states(folder):  # the residual stream before and after every decoder layer
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        seen = [model.model.embed_tokens(ids)]
        for layer in model.model.layers:
            layer.register_forward_hook(lambda mod, args, output: seen.append(output[0] if isinstance(output, tuple) else output))
        with torch.no_grad():
            model(ids)
        return seen

    new, old = states(out), states(src)
    for i in range(3):
        after = (new[i + 1] - old[i + 1]).pow(2).sum() / (old[i + 1] - old[i]).pow(2).sum()
        assert after.item() == pytest.approx(losses["after"][i], rel=1e-3, abs=1e-6), (i, losses)
    assert all(a < b for a, b in zip(losses["after"], losses["before"])), losses


def test_calibrated_methods_refine_by_default_and_weight_only_methods_do_not(tiny, tmp_path, calib_file):
    src = tiny("llama", layers=2)
    out = convert(src, tmp_path / "default", to="mqa", options=_opts("calibrated", calib_file), measure=False).out
    record = json.loads((out / "effattn.json").read_text())
    settings = record["conversion"]
    assert (settings["refine_steps"], settings["refine_lr"], settings["refine_target"]) == (36, 3e-4, "stream")
    assert len(record["conversion_run"]["refine"]["before"]) == 2
    mean = convert(src, tmp_path / "mean", to="mqa", options={"method": "mean"}, measure=False).out  # no error
    assert "conversion_run" not in json.loads((mean / "effattn.json").read_text())


def test_refinement_leaves_an_exact_merge_alone(tiny, tmp_path, calib_file):
    """An exact merge (duplicated KV heads) has nothing to fit; Adam would still take full-size steps on the
    rounding noise of its zero gradient. So no layer is refined, and the model stays exact."""
    src = tiny("llama", heads=8, kv_heads=4, head_dim=8, hidden=64)
    _interleave_duplicates(src, 8)
    out = convert(src, tmp_path / "out", to="gqa", options=_opts("calibrated", calib_file, kv_heads=2, refine_steps=5,
                                                                 refine_lr=1e-2), measure=False).out
    losses = json.loads((out / "effattn.json").read_text())["conversion_run"]["refine"]
    assert losses["skipped"] == list(range(len(losses["before"]))) and max(losses["before"]) <= 1e-9
    assert losses["after"] == losses["before"]
    torch.testing.assert_close(logits_of(out, IDS, torch.float64), logits_of(src, IDS, torch.float64), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_refinement_schedule_sets_every_steps_learning_rate(tiny, tmp_path, calib_file, monkeypatch, schedule):
    """--refine-schedule cosine: step i of n runs at lr (1 + cos(pi i / n)) / 2, per layer; constant keeps lr."""
    import math

    seen = []
    step = torch.optim.Adam.step

    def spy(self, *args, **kwargs):
        seen.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", spy)
    options = _opts("calibrated", calib_file, refine_steps=4, refine_lr=1e-3, refine_schedule=schedule)
    out = convert(tiny("llama", layers=2), tmp_path / "out", to="mqa", options=options, measure=False).out
    one = [1e-3 * ((1 + math.cos(math.pi * i / 4)) / 2 if schedule == "cosine" else 1) for i in range(4)]
    assert seen == pytest.approx(one * 2)
    record = json.loads((out / "effattn.json").read_text())["conversion"]
    assert (record["refine_schedule"], record["refine_lr"]) == (schedule, 1e-3)


def test_refinement_needs_a_calibrated_method(tiny, tmp_path):
    from effattn.errors import EffattnError

    with pytest.raises(EffattnError, match="--refine-steps needs calibration activations"):
        convert(tiny("llama"), tmp_path / "x", to="mqa", options={"method": "mean", "refine_steps": 10})
