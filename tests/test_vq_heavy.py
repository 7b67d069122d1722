"""Heavy-hitter VQ (`vq-init --heavy-keys B`, `effattn/kernels/vq/heavy.py`): the blockwise kernel against
its quadratic reference at odd sizes and any chunking of the sequence, what the set of exact far keys holds,
the model (cached decoding, naive kernel, remote code, the cache's size), and bad input."""

from __future__ import annotations

import pytest
import torch

import effattn  # noqa: F401  (registers effattn_vq)
from effattn.kernels.rope import rope_tables
from effattn.kernels.vq.heavy import vq_heavy_chunk, vq_heavy_naive
from effattn.kernels.vq import native
from effattn.kernels.vq.heavy_decode import HeavyDecodeState
from effattn.kernels.vq.naive import vq_attention_naive

from .test_cli_errors import assert_one_line_error, run_cli
from .test_vq_model import IDS, calib_file, decode_matches_full_forward, load, logits, vq_init  # noqa: F401


def inputs(B=2, T=157, H=6, G=2, D=8, C=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    cos, sin = rope_tables(T, D, dtype=torch.float64)
    far_cos, far_sin = (x[0] for x in rope_tables(torch.tensor([28]), D, dtype=torch.float64))
    return (r(B, T, H, D), r(B, T, G, D), r(B, T, G, D), r(G, C, D), torch.randint(0, C, (B, T, G), generator=g),
            cos, sin, far_cos, far_sin)


def run_in_pieces(args, lengths, **settings):
    q, k, v, codebook, codes, cos, sin, far_cos, far_sin = args
    state, outs, a = None, [], 0
    for n in lengths:
        b = min(q.shape[1], a + n)
        out, state = vq_heavy_chunk(q[:, a:b], k[:, a:b], v[:, a:b], codebook, codes[:, a:b], cos[a:b], sin[a:b],
                                    far_cos, far_sin, **settings, state=state, return_state=True)
        outs.append(out)
        a = b
    assert a == q.shape[1]
    return torch.cat(outs, 1), state


@pytest.mark.parametrize("key_means", [False, True])
@pytest.mark.parametrize("window,update,budget", [(7, 5, 9), (4, 8, 3), (16, 16, 1)])
def test_the_blockwise_kernel_is_the_reference_whole_and_in_pieces(key_means, window, update, budget):
    args = inputs()
    settings = dict(window=window, update=update, budget=budget, key_means=key_means)
    ref = vq_heavy_naive(*args, **settings)
    torch.testing.assert_close(vq_heavy_chunk(*args, **settings), ref, rtol=1e-12, atol=1e-12)
    # any chunking, down to one token per call (a decode), continues the sequence exactly
    out, state = run_in_pieces(args, [1, 3, 11, 1, 1, 20, 50] + [1] * 70, **settings)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    # E after the last cut (at 155) holds `budget` keys, then the 2 that left the window since
    assert state.seen == 157 and state.recent_k.shape[2] == window - 1
    assert state.heavy_k.shape[2] == budget + (157 - 155 // update * update)
    # every far key is exact or counted in its code, once
    assert torch.all(state.counts.sum(-1) + state.heavy_k.shape[2] == 157 - (window - 1))


def test_a_budget_above_the_far_keys_is_rerope_alone_and_a_small_one_is_not():
    args = inputs()
    rerope = vq_attention_naive(*args, window=7, block_size=5, sinks=10**9)  # every key exact
    whole = vq_heavy_naive(*args, window=7, update=5, budget=200, key_means=True)
    torch.testing.assert_close(whole, rerope, rtol=1e-12, atol=1e-12)
    assert (vq_heavy_naive(*args, window=7, update=5, budget=4, key_means=True) - rerope).abs().max() > 1e-2


def test_a_cut_keeps_the_keys_that_drew_the_most_attention_and_codes_the_rest():
    q, k, v, codebook, codes, cos, sin, far_cos, far_sin = inputs(B=2, T=61)
    settings = dict(window=7, update=5, budget=4, key_means=True)
    # 60 positions: the state just before the cut at 60, E holding the 4 kept at 55 plus the 5 that left since
    _, before = vq_heavy_chunk(q[:, :60], k[:, :60], v[:, :60], codebook, codes[:, :60], cos[:60], sin[:60], far_cos,
                               far_sin, **settings, return_state=True)
    assert before.heavy_k.shape[2] == 9
    _, after = vq_heavy_chunk(q[:, 60:], k[:, 60:], v[:, 60:], codebook, codes[:, 60:], cos[60:], sin[60:], far_cos,
                              far_sin, **settings, state=before, return_state=True)
    for b in range(2):
        for g in range(2):
            ranked = before.heavy_pos[b, g][before.heavy_score[b, g].argsort(descending=True)]
            kept = after.heavy_pos[b, g, :4]  # then key 54, which left the window for query 61
            assert sorted(kept.tolist()) == sorted(ranked[:4].tolist()) and after.heavy_pos[b, g, 4] == 54
            # the 5 others are counted in their codes, keys and values summed there
            gone = [p for p in before.heavy_pos[b, g].tolist() if p not in kept.tolist()]
            assert after.counts[b, g].sum() - before.counts[b, g].sum() == 5
            torch.testing.assert_close(after.key_sums[b, g].sum(0) - before.key_sums[b, g].sum(0), k[b, gone, g].sum(0))
    # the state handed in is left as it was
    assert before.heavy_k.shape[2] == 9 and before.seen == 60


def test_gradients_flow_to_queries_keys_and_values():
    q, k, v, *rest = inputs(T=40)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    vq_heavy_chunk(q, k, v, *rest, window=6, update=4, budget=3, key_means=True).square().sum().backward()
    for x in (q, k, v):
        assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_bad_settings_are_explained():
    args = inputs(T=20)
    with pytest.raises(ValueError, match="budget must be an integer >= 1"):
        vq_heavy_chunk(*args, window=4, update=4, budget=0)
    _, state = vq_heavy_chunk(*args, window=4, update=4, budget=2, return_state=True)
    with pytest.raises(ValueError, match="continue a sequence with the settings that started it"):
        vq_heavy_chunk(*args, window=4, update=4, budget=3, state=state)


def test_the_model_decodes_through_a_constant_cache_and_matches_the_reference(tiny, tmp_path, calib_file):
    from effattn.evaluate import kv_cache_bytes

    src = tiny("llama", heads=6, kv_heads=3, head_dim=8, layers=2)
    heavy = load(vq_init(src, tmp_path / "heavy", calib_file, heavy_keys=6, block_size=4, window=8))
    plain = load(vq_init(src, tmp_path / "plain", calib_file, block_size=4, window=8))
    assert heavy.config.vq_heavy_keys == 6
    assert (logits(heavy) - logits(plain)).abs().max() > 1e-4  # exact far keys change the output
    chunk = logits(heavy)
    heavy.config.vq_kernel = "naive"
    torch.testing.assert_close(logits(heavy), chunk, rtol=1e-9, atol=1e-9)
    heavy.config.vq_kernel = "chunk"
    cache, _ = decode_matches_full_forward(heavy, IDS[:1])
    assert all(isinstance(s, HeavyDecodeState) for s in cache.states.values())  # the decode step ran
    # constant in the length: at the same phase of the cuts (E holds budget + 4 keys after 400 and 800
    # positions) the cache is the same size, and larger than the plain VQ cache by the exact far keys
    long = torch.randint(0, 256, (1, 800))
    size = kv_cache_bytes(heavy, long[:, :400])
    assert size == kv_cache_bytes(heavy, long) and size > kv_cache_bytes(plain, long[:, :400])
    # the exact heads split: heavy hitters on the quantized heads, full attention on the others
    split = load(vq_init(src, tmp_path / "split", calib_file, heavy_keys=6, block_size=4, window=8, exact_heads=2))
    cache, _ = decode_matches_full_forward(split, IDS[:1])
    assert all(isinstance(s.quantized, HeavyDecodeState) for s in cache.states.values())


def test_remote_code_runs_heavy_hitters_without_effattn(tiny, tmp_path, calib_file):
    from .remote import remote_logits

    out = vq_init(tiny("qwen3", heads=6, kv_heads=3, head_dim=8), tmp_path / "vq", calib_file, heavy_keys=5)
    got = remote_logits(out, IDS, "EffattnVQForCausalLM", tmp_path)
    torch.testing.assert_close(got, logits(load(out)), rtol=0, atol=0)
    # and it decodes: the bundled decode layout (a cut at 64 on the way) gives the full forward's logits
    decoded = remote_logits(out, IDS, "EffattnVQForCausalLM", tmp_path, prefix=40)
    torch.testing.assert_close(decoded, got, rtol=1e-9, atol=1e-9)


def test_heavy_keys_with_sinks_is_a_one_line_error_and_the_dry_run_says_it(tiny, tmp_path, calib_file, capsys):
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    code, _, err = run_cli(capsys, "vq-init", str(src), "--heavy-keys", "8", "--sinks", "2", "--calib", str(calib_file),
                           "--window", "16", "-o", str(tmp_path / "a"))
    assert_one_line_error(code, err, "drop --sinks")
    code, out, _ = run_cli(capsys, "vq-init", str(src), "--heavy-keys", "8", "--calib", str(calib_file), "--window", "16",
                           "--calib-seq-len", "128", "--dry-run", "-o", str(tmp_path / "b"))
    assert code == 0 and "heavy hitters" in out and "heavy-hitter kernel" in " ".join(out.split())
    assert "(kernels/vq/heavy_decode.py): compiled" in " ".join(out.split()) or not native.available()
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]


def test_a_heavy_hitter_model_trains(tiny, tmp_path, calib_file):
    """heal-vq's step on a heavy-hitter model: a loss, gradients into the projections through exact far keys."""
    from transformers import AutoModelForCausalLM

    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    model = AutoModelForCausalLM.from_pretrained(vq_init(src, tmp_path / "vq", calib_file, heavy_keys=4, block_size=8,
                                                         window=8)).train()
    out = model(input_ids=IDS, labels=IDS, use_cache=False)
    aux = sum(m.effattn_aux_loss for m in model.vq_attention_modules())
    (out.loss + aux).backward()
    attn = model.model.layers[1].self_attn
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert torch.isfinite(proj.weight.grad).all() and proj.weight.grad.abs().sum() > 0


def test_a_config_with_heavy_keys_and_sinks_is_refused_at_load(tiny, tmp_path, calib_file):
    import json

    from transformers import AutoModelForCausalLM

    folder = vq_init(tiny("llama", heads=6, kv_heads=3, head_dim=8), tmp_path / "vq", calib_file, heavy_keys=4)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"vq_sinks": 2}))
    with pytest.raises(ValueError, match="vq_heavy_keys and vq_sinks do not combine"):
        AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("key_means", [False, True])
@pytest.mark.parametrize("window,update,budget", [(7, 5, 9), (4, 8, 3), (16, 16, 1), (1, 4, 2)])
def test_the_compiled_periods_are_the_pytorch_loop_whole_and_in_pieces(monkeypatch, key_means, window, update, budget):
    """float32 inference runs vq_heavy_chunk's periods in C (native.c's vq_heavy_segment): the same outputs and
    state as the PyTorch loop, whole and in pieces down to one token; autograd keeps the PyTorch loop."""
    from effattn.kernels.vq import heavy

    if not native.available():
        pytest.skip(f"compiled loop unavailable: {native.why_unavailable()}")
    calls, segment = [], native.heavy_segment
    monkeypatch.setattr(native, "heavy_segment", lambda **kw: calls.append(1) or segment(**kw))
    args = tuple(x.float() if x.is_floating_point() else x for x in inputs())
    settings = dict(window=window, update=update, budget=budget, key_means=key_means)
    pieces = [1, 3, 11, 1, 1, 20, 50] + [1] * 70
    with monkeypatch.context() as patch:
        patch.setattr(heavy, "_native", None)
        ref, ref_state = vq_heavy_chunk(*args, **settings, return_state=True)
        assert not calls
    for out, state in (vq_heavy_chunk(*args, **settings, return_state=True), run_in_pieces(args, pieces, **settings)):
        torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
        for name in ("heavy_pos", "heavy_codes", "recent_codes"):
            assert torch.equal(getattr(state, name), getattr(ref_state, name)), name
        for name in ("heavy_k", "heavy_v", "heavy_score", "recent_k", "recent_rk", "recent_v", "recent_score", "counts",
                     "sums") + (("key_sums",) if key_means else ()):  # fmt: skip
            torch.testing.assert_close(getattr(state, name), getattr(ref_state, name), rtol=2e-5, atol=2e-5)
        assert state.seen == 157
    assert len(calls) == 1 + len(pieces)  # every call compiled (the pieces add up to the 157 tokens)
    q = args[0].clone().requires_grad_()
    calls.clear()
    vq_heavy_chunk(q, *args[1:], **settings).sum().backward()
    assert not calls and q.grad is not None


def test_vq_init_keeps_192_heavy_keys_by_default_and_none_with_sinks(tiny, tmp_path, calib_file):
    """The default conversion keeps heavy hitters; `--sinks` (which they do not combine with) and `--heavy-keys 0`
    turn them off, and ReRoPE alone has none."""
    from effattn.convert import convert

    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)

    def heavy(to="vq", **options):
        opts = {"window": 16} | ({"codebook_size": 16, "calib": str(calib_file)} if to == "vq" else {}) | options
        return convert(src, tmp_path / "x", to=to, options=opts, dry_run=True).plan.settings.get("heavy_keys")

    assert heavy() == 192
    assert heavy(sinks=2) == 0 and heavy(heavy_keys=0) == 0 and heavy(heavy_keys=5) == 5
    assert not heavy(to="rerope")
