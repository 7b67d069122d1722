"""LoLA's global cache on the linear hybrid (kernels/linear/global_cache.py): the linear-time kernel, its
one-token steps and a split prefill against the quadratic reference (outputs and gradients), the hybrid itself
at capacity 0, the key the state recalls worst kept exact, a constant state, and the model's cached decoding."""

from __future__ import annotations

import pytest
import torch

from effattn.kernels.linear.global_cache import (
    decided_blocks,
    global_cache_attention,
    global_cache_naive,
    init_global_state,
)
from effattn.kernels.linear.naive import hybrid_attention_naive

from .test_linear_model import IDS, MAPS, decode_in_pieces, logits, make, perturb

B, H, D, F = 2, 3, 8, 6


def inputs(T: int, seed: int = 0, grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    fq, fk = (torch.rand(B, T, H, F, generator=g, dtype=torch.float64) for _ in range(2))
    wf = torch.rand(H, generator=g, dtype=torch.float64)
    xs = [q, k, v, fq, fk, wf]
    for x in xs:
        x.requires_grad_(grad)
    return xs


def settings(wf, window, sinks, capacity):
    return dict(window=window, sinks=sinks, capacity=capacity, window_factor=wf, linear_factor=1 - wf,
                scale=D ** -0.5, eps=1e-6)


CASES = [(5, 0, 3), (5, 2, 3), (4, 1, 7), (1, 0, 2), (7, 3, 4), (3, 0, 40)]  # window, sinks, capacity


@pytest.mark.parametrize("window, sinks, capacity", CASES)
def test_the_kernel_its_steps_and_a_split_prefill_match_the_reference(window, sinks, capacity):
    T = 61
    q, k, v, fq, fk, wf = inputs(T)
    kw = settings(wf, window, sinks, capacity)
    ref = global_cache_naive(q, k, v, fq, fk, **kw)
    torch.testing.assert_close(global_cache_attention(q, k, v, fq, fk, **kw), ref, rtol=1e-12, atol=1e-12)
    state, steps = None, []
    for t in range(T):
        out, state = global_cache_attention(*(x[:, t:t + 1] for x in (q, k, v, fq, fk)), **kw, state=state,
                                            return_state=True)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 1), ref, rtol=1e-12, atol=1e-12)
    assert state.cache_k.shape[1] == min(capacity, decided_blocks(T, window, sinks) * window)
    first, state = global_cache_attention(*(x[:, :23] for x in (q, k, v, fq, fk)), **kw, return_state=True)
    rest = global_cache_attention(*(x[:, 23:] for x in (q, k, v, fq, fk)), **kw, state=state)
    torch.testing.assert_close(torch.cat((first, rest), 1), ref, rtol=1e-12, atol=1e-12)
    # the far keys matter: without the cache the output differs
    assert (hybrid_attention_naive(q, k, v, fq, fk, **{n: x for n, x in kw.items() if n != "capacity"})
            - ref).abs().max() > 1e-3


@pytest.mark.parametrize("window, sinks, capacity", [(5, 2, 3), (4, 0, 6)])
def test_gradients_match_the_reference(window, sinks, capacity):
    xs = inputs(37, seed=1, grad=True)
    ys = [x.detach().clone().requires_grad_() for x in xs]
    w = torch.randn(B, 37, H, D, dtype=torch.float64)
    (global_cache_naive(*xs[:5], **settings(xs[5], window, sinks, capacity)) * w).sum().backward()
    (global_cache_attention(*ys[:5], **settings(ys[5], window, sinks, capacity)) * w).sum().backward()
    for x, y in zip(xs, ys):
        assert x.grad.abs().max() > 0
        torch.testing.assert_close(y.grad, x.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("window, sinks", [(5, 0), (4, 3)])
def test_capacity_zero_is_the_hybrid(window, sinks):
    q, k, v, fq, fk, wf = inputs(29)
    kw = settings(wf, window, sinks, 0)
    expected = hybrid_attention_naive(q, k, v, fq, fk, **{n: x for n, x in kw.items() if n != "capacity"})
    torch.testing.assert_close(global_cache_naive(q, k, v, fq, fk, **kw), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(global_cache_attention(q, k, v, fq, fk, **kw), expected, rtol=1e-12, atol=1e-12)


def test_the_key_the_state_recalls_worst_stays_exact():
    """Every far key shares one feature vector and one value but position 9, whose value differs: the state
    predicts the shared value for it, so its recall error is the largest and it keeps its place in a cache of one."""
    T, W = 60, 4
    q, k, v, fq, fk, wf = inputs(T, seed=2)
    fk = torch.ones_like(fk)
    v = torch.ones_like(v)
    v[:, 9] = -3.0
    _, state = global_cache_attention(q, k, v, fq, fk, **settings(wf, W, 0, 1), return_state=True)
    assert decided_blocks(T, W, 0) > 9 // W + 1  # decided well after position 9's block
    assert (state.cache_pos == 9).all()
    torch.testing.assert_close(state.cache_v, v[:, 9:10])


def test_a_key_map_recomputes_the_cached_features_instead_of_storing_them():
    T, W, G = 70, 5, 6
    q, k, v, fq, _, wf = inputs(T, seed=3)
    M = torch.randn(H, D, F, dtype=torch.float64, generator=torch.Generator().manual_seed(4))

    def key_map(keys):  # [B, n, H, D] -> [B, n, H, F], non-negative
        return torch.softmax(torch.einsum("bnhd,hdf->bnhf", keys, M), dim=-1)

    kw = settings(wf, W, 2, G)
    ref, stored = global_cache_attention(q, k, v, fq, key_map(k), **kw, return_state=True)
    first, state = global_cache_attention(*(x[:, :31] for x in (q, k, v, fq, key_map(k))), **kw, return_state=True,
                                          key_map=key_map)
    assert state.cache_fk is None and stored.cache_fk.shape[1] == G
    rest, state = global_cache_attention(*(x[:, 31:] for x in (q, k, v, fq, key_map(k))), **kw, state=state,
                                         return_state=True, key_map=key_map)
    torch.testing.assert_close(torch.cat((first, rest), 1), ref, rtol=1e-12, atol=1e-12)
    assert stored.nbytes() - state.nbytes() == B * G * H * F * 8
    with pytest.raises(ValueError, match="pass the same key_map"):
        global_cache_attention(q[:, :1], k[:, :1], v[:, :1], fq[:, :1], key_map(k[:, :1]), **kw, state=state)


def test_the_state_is_constant_in_size():
    sizes = []
    for T in (50, 90, 170):
        q, k, v, fq, fk, wf = inputs(T)
        _, state = global_cache_attention(q, k, v, fq, fk, **settings(wf, 5, 2, 4), return_state=True)
        sizes.append(state.nbytes() - state.k.numel() * 8 - state.v.numel() * 8 - state.fk.numel() * 8)
        assert state.k.shape[1] < 2 * 5  # fewer than two windows of keys wait for a decision
    assert sizes[0] == sizes[1] == sizes[2]
    empty = init_global_state(B, H, D, D, F, window=5, sinks=2, capacity=4, dtype=torch.float64)
    assert empty.nbytes() < sizes[0]


def test_bad_settings_are_refused():
    q, k, v, fq, fk, wf = inputs(8)
    with pytest.raises(ValueError, match="needs a window"):
        global_cache_attention(q, k, v, fq, fk, **settings(wf, 0, 0, 3))
    with pytest.raises(ValueError, match="capacity must be an integer"):
        global_cache_naive(q, k, v, fq, fk, **settings(wf, 4, 0, -1))
    _, state = global_cache_attention(q, k, v, fq, fk, **settings(wf, 4, 0, 3), return_state=True)
    with pytest.raises(ValueError, match="capacity=3 but this call uses capacity=2"):
        global_cache_attention(q, k, v, fq, fk, **settings(wf, 4, 0, 2), state=state)


@pytest.mark.parametrize("fmap, exact", [("hedgehog", []), ("elu", []), ("hedgehog", [[0, 1], [1, 0]])])
def test_the_model_decodes_as_its_full_forward(tiny, tmp_path, fmap, exact):
    """With exact heads too: their original attention beside the other heads' hybrid and global cache."""
    model = make(tiny, tmp_path, "lin", linear_window=4, linear_sinks=2, linear_global_cache=3,
                 linear_feature_map=MAPS[fmap], linear_exact_heads=exact)
    perturb(model)
    full = logits(model)
    T = IDS.shape[1]
    for pieces in ([1] * T, [13] + [1] * (T - 13), [5, 30, 4, 1]):
        got, cache = decode_in_pieces(model, IDS, pieces)
        torch.testing.assert_close(got, full, rtol=1e-9, atol=1e-9)
    model.config.linear_kernel = "naive"  # the quadratic reference
    torch.testing.assert_close(logits(model), full, rtol=1e-9, atol=1e-9)
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 5, model.config.hidden_size, dtype=torch.float64)
    if not exact:  # the sums a map without parameters fits its mix from have no global-cache version
        with pytest.raises(ValueError, match="has a global cache"):
            attn.parts(x, model.model.rotary_emb(x, torch.arange(5)[None]))
    model.config.linear_global_cache = 0  # the cache changes the model
    assert (logits(model) - full).abs().max() > 1e-6
