"""Keys of the slow RoPE pairs merged across frequencies (headmerge.PooledKeys, `--key-pool-angle`)."""

from __future__ import annotations

import json

import pytest
import torch

from effattn.attention.functional import apply_rope
from effattn.convert import convert
from effattn.convert.gqa import pooled_pairs
from effattn.convert.headmerge import block_key_merge, merge_keys, merge_pooled_keys, pair_dims
from effattn.attention.layerwise import LayerFactory
from effattn.families import context_positions, family_for

from .conftest import logits_of
from .test_cli_errors import run_cli
from .test_convert_gqa import IDS, _duplicate_heads_within_groups
from .test_gqa_methods import calib_file, rope_tables  # noqa: F401 - the fixture

SMOLLM2 = {"model_type": "llama", "head_dim": 64, "num_attention_heads": 9, "num_key_value_heads": 3,
           "hidden_size": 576, "num_hidden_layers": 30, "max_position_embeddings": 8192,
           "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}


def _keys(copies: bool, N=3000, G=3, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.2, 3, d, dtype=torch.float64)
    if copies:
        return (torch.randn(N, d, dtype=torch.float64, generator=gen) * scale)[:, None].expand(N, G, d).clone()
    return torch.randn(N, G, d, dtype=torch.float64, generator=gen) @ torch.randn(d, d, dtype=torch.float64, generator=gen)


def _merges(keys, pairs, q_cov=None):
    N, G, d = keys.shape
    F = d // 2
    dims = pair_dims(pairs, d)
    n = len(dims)
    block = keys[..., dims].reshape(N, G * n)
    key_cov = block.T @ block / N
    q_cov = torch.stack([torch.eye(n, dtype=torch.float64)] * G) if q_cov is None else q_cov
    z = torch.complex(keys[..., :F], keys[..., F:])
    per_freq = merge_keys(torch.einsum("ngf,nhf->fgh", z, z.conj()) / N, torch.ones(G, F, dtype=torch.float64),
                          list(range(G)))
    pooled = merge_pooled_keys(key_cov, q_cov, list(range(G)), dims, reference=block_key_merge(per_freq, dims, d))
    return dims, block, key_cov, per_freq, pooled


def test_pooled_pairs_are_the_ones_that_barely_turn_over_the_context():
    llama = family_for(SMOLLM2)
    # θ_f = 1e5^(-f/32): pair 26 turns 0.71 rad over 8,192 positions, pair 25 1.02
    assert pooled_pairs(SMOLLM2, llama, 1.0) == ([26, 27, 28, 29, 30, 31], "")
    assert pooled_pairs(SMOLLM2, llama, 0.0)[0] == []
    assert pooled_pairs(SMOLLM2 | {"max_position_embeddings": 2048}, llama, 1.0)[0] == list(range(22, 32))
    inv = LayerFactory(SMOLLM2, llama).inv_freq()
    assert inv[25] * 8192 > 1.0 >= inv[26] * 8192
    # a scaled model: its own rotary embedding's table over the extended context (YaRN x4 of 8,192)
    yarn = SMOLLM2 | {"max_position_embeddings": 32768,
                      "rope_parameters": {"rope_theta": 100000.0, "rope_type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": 8192}}
    assert context_positions(yarn) == 32768
    inv_yarn = LayerFactory(yarn, llama).inv_freq()
    assert inv_yarn[-1] < inv[-1]  # YaRN slows the slowest pairs down by the factor
    pairs, _ = pooled_pairs(yarn, llama, 1.0)
    assert pairs and pairs == [f for f in range(32) if float(inv_yarn[f]) * 32768 <= 1.0]
    qwen3 = SMOLLM2 | {"model_type": "qwen3"}
    assert pooled_pairs(qwen3, family_for(qwen3), 1.0) == ([], "qwen3 norms each key head, so its keys are mean-pooled")


def test_a_rotary_table_shorter_than_the_head_pools_nothing(monkeypatch):
    """No supported family rotates part of a head (transformers' Llama ignores partial_rotary_factor), but a
    rotary embedding whose table covers fewer pairs than the head has must not be read pair by pair."""
    half = LayerFactory(SMOLLM2, family_for(SMOLLM2)).inv_freq()[:16]
    monkeypatch.setattr(LayerFactory, "inv_freq", lambda self: half)
    assert pooled_pairs(SMOLLM2, family_for(SMOLLM2), 1.0) == ([], "partial rotary embeddings (16 of 32 pairs rotate)")


def test_pooled_keys_are_the_weighted_pca_of_the_block():
    """On keys the per-frequency merge cannot keep, the pooled merge reconstructs them with the smallest
    possible query-weighted error (the discarded eigenvalues), below the per-frequency merge's."""
    keys = _keys(copies=False)
    G, d = keys.shape[1], keys.shape[2]
    gen = torch.Generator().manual_seed(5)
    dims = pair_dims([5, 6, 7], d)
    n = len(dims)
    roots = torch.randn(G, n, n, dtype=torch.float64, generator=gen)
    q_cov = roots @ roots.transpose(1, 2) + 0.1 * torch.eye(n, dtype=torch.float64)
    dims, block, key_cov, per_freq, pooled = _merges(keys, [5, 6, 7], q_cov)

    def weighted_error(recon):  # Σ_g E (q·(x_g − x̂_g))² = Σ_g tr Q_g E[e eᵀ]
        total = 0.0
        for g in range(G):
            e = block[:, g * n:(g + 1) * n] - recon(g)
            total += torch.einsum("ni,ij,nj->", e, q_cov[g], e).item() / len(e)
        return total

    y = block @ pooled.A.T
    pooled_err = weighted_error(lambda g: y @ pooled.B[g].T)
    roots_q = [torch.linalg.cholesky(q_cov[g]) for g in range(G)]
    white = torch.cat([block[:, g * n:(g + 1) * n] @ roots_q[g] for g in range(G)], dim=1)
    evals = torch.linalg.eigvalsh(white.T @ white / len(white))
    assert pooled_err == pytest.approx(evals[:-n].sum().item(), rel=1e-8)
    # the per-frequency merge on the same block, with its least-squares reconstruction
    ref = block_key_merge(per_freq, dims, d)
    y_ref = block @ ref.T
    fit = torch.linalg.lstsq(y_ref, block).solution  # (n, G n)
    assert pooled_err < 0.9 * weighted_error(lambda g: y_ref @ fit[:, g * n:(g + 1) * n])


def test_pooled_keys_keep_a_block_the_per_frequency_merge_keeps_exact_under_rope():
    """Copies: the per-frequency merge is exact, and pooling returns it, so every logit at every
    distance is kept (a cross-frequency PCA basis would not commute with RoPE)."""
    keys = _keys(copies=True)
    N, G, d = keys.shape
    dims, block, _, per_freq, pooled = _merges(keys, [5, 6, 7])
    assert torch.equal(pooled.A, block_key_merge(per_freq, dims, d))
    T = 64
    new_key = torch.zeros(T, d, dtype=torch.float64)
    new_key[:, dims] = block[:T] @ pooled.A.T
    q = torch.zeros(T, d, dtype=torch.float64)
    q[:, dims] = torch.randn(T, len(dims), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    q_new = torch.zeros_like(q)
    q_new[:, dims] = q[:, dims] @ pooled.B[1]
    cos, sin = rope_tables(T, d)
    rot = lambda x: apply_rope(x[None, :, None], cos, sin)[0, :, 0]  # noqa: E731
    torch.testing.assert_close(rot(q_new) @ rot(new_key).T, rot(q) @ rot(keys[:T, 1]).T, rtol=1e-9, atol=1e-9)


def _slow_rope():
    return {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}


def test_mqa_pools_the_slow_pairs_and_stays_exact_on_copies(tiny, tmp_path, calib_file):  # noqa: F811
    """A tiny llama with θ 1e6 (its slowest pair turns 0.13 rad over 4,096 positions): the conversion pools
    it, records it, and heads that are copies still merge exactly."""
    src = tiny("llama", heads=6, kv_heads=6, head_dim=8, **_slow_rope())
    _duplicate_heads_within_groups(src, group=3, head_dim=8)
    opts = {"method": "calibrated", "calib": calib_file, "calib_tokens": 1024, "kv_heads": 2}
    out = convert(src, tmp_path / "out", to="gqa", options=opts, measure=False).out
    record = json.loads((out / "effattn.json").read_text())["conversion"]
    assert (record["key_pool_angle"], record["key_pool_pairs"]) == (1.0, 1)
    torch.testing.assert_close(logits_of(out, IDS, torch.float64), logits_of(src, IDS, torch.float64), rtol=1e-4, atol=1e-4)


def test_the_pooled_merge_changes_only_the_slow_pairs(tiny, tmp_path, calib_file):  # noqa: F811
    """Against --key-pool-angle 0 (every pair merged on its own), in the first layer (the layers above are
    calibrated on what it gives them): the same values, the same fast pairs of keys and queries; the slow
    pair's rows differ."""
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8, **_slow_rope())
    base = {"method": "pca", "calib": calib_file, "calib_tokens": 1024, "refine_steps": 0}
    from safetensors.torch import load_file

    pooled = load_file(convert(src, tmp_path / "p", to="mqa", options=base, measure=False).out / "model.safetensors")
    plain = load_file(convert(src, tmp_path / "0", to="mqa", options=base | {"key_pool_angle": 0},
                              measure=False).out / "model.safetensors")
    slow = pair_dims([3], 8)
    fast = [x for x in range(8) if x not in slow]
    for name, t in pooled.items():
        if not name.startswith("model.layers.0."):
            continue
        if name.endswith(("k_proj.weight", "q_proj.weight")):
            rows = t.view(-1, 8, t.shape[-1])
            other = plain[name].view(-1, 8, t.shape[-1])
            assert torch.equal(rows[:, fast], other[:, fast]), name
            assert not torch.allclose(rows[:, slow], other[:, slow], atol=1e-4), name
        else:
            assert torch.equal(t, plain[name]), name


def test_key_pool_angle_is_refused_for_weight_only_methods(tiny, capsys, tmp_path):
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "--method", "mean", "--key-pool-angle", "2",
                           "-o", tmp_path / "out")
    assert code == 2 and "--key-pool-angle applies to the pca and calibrated methods" in err
    assert not (tmp_path / "out").exists()


def test_qwen3_keys_are_not_pooled_and_the_plan_says_why(tiny, tmp_path, calib_file):  # noqa: F811
    src = tiny("qwen3", heads=6, kv_heads=3, head_dim=8, **_slow_rope())
    opts = {"method": "calibrated", "calib": calib_file, "calib_tokens": 1024, "refine_steps": 0}
    out = convert(src, tmp_path / "out", to="mqa", options=opts, measure=False).out
    assert json.loads((out / "effattn.json").read_text())["conversion"]["key_pool_pairs"] == 0
    summary = dict(convert(src, None, to="mqa", options=opts, dry_run=True).plan.summary)
    assert "(none: qwen3 norms each key head, so its keys are mean-pooled)" in summary["keys"]
    llama = convert(tiny("llama", heads=6, kv_heads=3, head_dim=8, **_slow_rope()), tmp_path / "l", to="mqa",
                    options=opts, measure=False).out
    assert json.loads((llama / "effattn.json").read_text())["conversion"]["key_pool_pairs"] == 1
