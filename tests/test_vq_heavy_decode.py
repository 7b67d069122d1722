"""The heavy-hitter decode step (kernels/vq/heavy_decode.py, and its C twin in native.c) against the blockwise
kernel: one token at a time, across E's cuts, gives what one call over the whole sequence gives, and the
plain state comes back for vq_heavy_chunk to continue."""

import pytest
import torch

from effattn.kernels.vq import heavy_decode, native
from effattn.kernels.vq.heavy import vq_heavy_chunk
from effattn.kernels.vq.heavy_decode import HeavyDecodeState, vq_heavy_decode_step
from effattn.kernels.vq.heavy_decode import heavy_can_decode as can_decode
from effattn.kernels.vq.heavy_decode import heavy_from_state as from_state

from .test_vq_heavy import inputs

# (B, H, G, D, C, window, update, budget): GQA / MQA / MHA, a window of 1, a budget of 1, odd sizes
CASES = [
    (2, 6, 2, 8, 5, 7, 5, 9),
    (1, 4, 1, 6, 3, 1, 4, 2),
    (2, 3, 3, 8, 9, 4, 8, 1),
    (1, 9, 3, 64, 33, 16, 16, 24),
]
T = 157


def piece(args, lo, hi):
    q, k, v, codebook, codes, cos, sin, far_cos, far_sin = args
    return (q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], codebook, codes[:, lo:hi], cos[lo:hi], sin[lo:hi], far_cos, far_sin)


def decode(args, state, lo, hi):
    """Decode positions lo .. hi - 1 one by one from ``state``; halfway, back to the plain state and again."""
    q, k, v, codebook, codes, cos, sin, far_cos, far_sin = args
    layout = lambda s: from_state(s, codebook, far_cos, far_sin, q.shape[-1] ** -0.5, q.shape[2], q.dtype)  # noqa: E731
    state, outs = layout(state), []
    for t in range(lo, hi):
        if t == (lo + hi) // 2:
            state = layout(state.to_state())
        out, state = vq_heavy_decode_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], codes[:, t:t + 1],
                                          cos[t:t + 1], sin[t:t + 1], state)  # fmt: skip
        outs.append(out)
    return torch.cat(outs, 1), state


@pytest.fixture
def native_calls(monkeypatch):
    calls = []
    if native.available():
        step = native.heavy_decode_step
        monkeypatch.setattr(native, "heavy_decode_step", lambda *a: calls.append(1) or step(*a))
    return calls


@pytest.mark.parametrize("compiled", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("key_means", [False, True], ids=["codewords", "key-means"])
@pytest.mark.parametrize("case", CASES)
def test_decode_steps_equal_one_blockwise_call_and_hand_the_state_back(case, key_means, compiled, monkeypatch,
                                                                      native_calls):  # fmt: skip
    B, H, G, D, C, window, update, budget = case
    if compiled and not native.available():
        pytest.skip(f"compiled loop unavailable: {native.why_unavailable()}")
    monkeypatch.setattr(heavy_decode, "_native", native if compiled else None)
    dtype = torch.float32 if compiled else torch.float64
    args = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs(B, T, H, G, D, C, seed=sum(case)))
    settings = dict(window=window, update=update, budget=budget, key_means=key_means)
    full, full_state = vq_heavy_chunk(*args, **settings, return_state=True)

    lo, mid = window - 1 + 3, T - 9  # from the first position the step may take, plus a few; cuts on the way
    _, state = vq_heavy_chunk(*piece(args, 0, lo), **settings, return_state=True)
    assert can_decode(state, 1) and not can_decode(state, 2)
    decoded, layout = decode(args, state, lo, mid)
    assert isinstance(layout, HeavyDecodeState) and layout.seen == mid
    assert bool(native_calls) == compiled  # the C step ran where it was asked for, and only there
    # ... then the blockwise kernel continues from the decode state's plain state (several positions, then one)
    rest, end = vq_heavy_chunk(*piece(args, mid, T - 1), **settings, state=layout.to_state(), return_state=True)
    last, end = vq_heavy_chunk(*piece(args, T - 1, T), **settings, state=end, return_state=True)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(decoded, full[:, lo:mid], **tol)
    torch.testing.assert_close(torch.cat((rest, last), 1), full[:, mid:], **tol)
    # the same keys in E, in the same order, and the same statistics, as one call gives
    plain, ref = layout.to_state(), vq_heavy_chunk(*piece(args, 0, mid), **settings, return_state=True)[1]
    assert torch.equal(plain.heavy_pos, ref.heavy_pos) and torch.equal(plain.heavy_codes, ref.heavy_codes)
    assert plain.heavy_pos.shape[2] > budget  # keys joined E since the last cut, which did happen
    for name in ("heavy_k", "heavy_v", "heavy_score", "recent_k", "recent_rk", "recent_v", "recent_score", "counts",
                 "sums") + (("key_sums",) if key_means else ()):  # fmt: skip
        torch.testing.assert_close(getattr(plain, name), getattr(ref, name), **tol)
    assert torch.equal(plain.recent_codes, ref.recent_codes)
    assert end.seen == full_state.seen == T and int(ref.counts.sum()) > 0


def test_the_decode_layout_waits_for_a_full_window_and_holds_its_size():
    args = inputs(B=1, T=40, H=2, G=1, D=4, C=3)
    settings = dict(window=8, update=4, budget=3)
    _, early = vq_heavy_chunk(*piece(args, 0, 6), **settings, return_state=True)
    assert not can_decode(early, 1)  # 6 of the window's 7 recent keys
    with pytest.raises(ValueError, match="needs a full window"):
        from_state(early, args[3], args[7], args[8], 0.5, 2, torch.float64)
    _, state = vq_heavy_chunk(*piece(args, 0, 7), **settings, return_state=True)
    layout = from_state(state, args[3], args[7], args[8], 0.5, 2, torch.float64)
    size = layout.nbytes()
    _, layout = decode(args, state, 7, 40)
    assert layout.nbytes() == size and layout.m <= 3 + 4  # E's rows are reserved: the layout never grows


def test_with_key_means_the_layout_is_the_size_of_the_state_with_e_full():
    """Each code's statistics are held once (as means in the softmax's columns), so decoding does not hold
    more than the cache `effattn eval` measures after prefill, at SmolLM2's shape (W 64, C 512, B 192)."""
    B, T, H, G, D, C = 1, 320, 9, 3, 64, 512
    args = tuple(x.float() if x.is_floating_point() else x for x in inputs(B, T, H, G, D, C))
    _, state = vq_heavy_chunk(*args, window=64, update=64, budget=192, key_means=True, return_state=True)
    assert state.heavy_k.shape[2] == 192 + 64  # E full: the largest the state gets
    layout = from_state(state, args[3], args[7], args[8], D ** -0.5, H, torch.float32)
    assert layout.nbytes() <= 1.05 * state.nbytes()
