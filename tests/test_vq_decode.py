"""The Transformer-VQ decode step (kernels/vq/decode.py, and its C twin in native.c) against the chunk
kernel: one token at a time from any state gives what one call over the whole sequence gives, and the
plain state comes back intact for the chunk kernel to continue."""

import pytest
import torch

from effattn.kernels.vq import native, vq_attention_chunk
from effattn.kernels.vq.decode import VQDecodeState, can_decode, from_state, vq_decode_step

from .test_vq_kernels import assert_close, make_inputs

# (B, T, H, G, D, Dv, C, W, L, sinks): GQA / MQA / MHA, W = 1, sinks, odd sizes
CASES = [
    (2, 61, 6, 3, 8, 8, 7, 5, 2, 0),
    (1, 50, 4, 1, 6, 10, 5, 1, 1, 0),
    (2, 70, 3, 3, 8, 4, 9, 6, 4, 3),
    (1, 90, 9, 3, 64, 64, 33, 17, 16, 2),
]


def piece(inputs, lo, hi):
    out = dict(inputs, cos=inputs["cos"][lo:hi], sin=inputs["sin"][lo:hi])
    out.update({name: inputs[name][:, lo:hi] for name in ("q", "k", "v", "codes")})
    return out


def decode_from(inputs, state, lo, hi, codebook):
    """Decode positions lo .. hi - 1 one by one from `state` (the chunk kernel's, at lo)."""
    q = inputs["q"]
    decode = from_state(state, codebook, inputs["far_cos"], inputs["far_sin"], inputs["q"].shape[-1] ** -0.5,
                        q.shape[2], q.dtype)
    outs = []
    for t in range(lo, hi):
        step = piece(inputs, t, t + 1)
        out, decode = vq_decode_step(step["q"], step["k"], step["v"], step["codes"], step["cos"], step["sin"], decode)
        outs.append(out)
    return torch.cat(outs, dim=1), decode


@pytest.mark.parametrize("compiled", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("key_means", [False, True], ids=["codewords", "key-means"])
@pytest.mark.parametrize("case", CASES)
def test_decode_steps_equal_one_chunk_call_and_hand_the_state_back(case, key_means, compiled, monkeypatch):
    B, T, H, G, D, Dv, C, W, L, sinks = case
    if compiled and not native.available():
        pytest.skip(f"compiled loop unavailable: {native.why_unavailable()}")
    monkeypatch.setattr("effattn.kernels.vq.decode._native", native if compiled else None)
    dtype = torch.float32 if compiled else torch.float64
    inputs = make_inputs(B, T, H, G, D, Dv, C, W, dtype=dtype, seed=sum(case))
    settings = dict(window=W, block_size=L, sinks=sinks, key_means=key_means)
    full, full_state = vq_attention_chunk(**inputs, **settings, return_state=True)

    lo, mid = sinks + W - 1 + 3, T - 9  # decode from the first position the step may take, plus a few
    _, state = vq_attention_chunk(**piece(inputs, 0, lo), **settings, return_state=True)
    assert can_decode(state, 1) and not can_decode(state, 2)
    decoded, decode = decode_from(inputs, state, lo, mid, inputs["codebook"])
    assert isinstance(decode, VQDecodeState) and decode.seen == mid
    # ... then the chunk kernel continues from the decode state (several positions, then one)
    rest, end = vq_attention_chunk(**piece(inputs, mid, T - 1), **settings, state=decode, return_state=True)
    last, end = vq_attention_chunk(**piece(inputs, T - 1, T), **settings, state=end, return_state=True)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert_close("decoded", full[:, lo:mid], decoded, tol)
    assert_close("continued", full[:, mid:], torch.cat((rest, last), 1), tol)
    plain = decode.to_state()
    for name in ("recent_k", "recent_v", "recent_codes", "recent_cos", "recent_sin", "sink_k", "sink_v"):
        assert torch.equal(getattr(plain, name), getattr(_chunk_state(inputs, settings, mid), name)), name
    for name in ("counts", "sums") + (("key_sums",) if key_means else ()):
        assert_close(name, getattr(_chunk_state(inputs, settings, mid), name), getattr(plain, name), tol)
    assert end.seen == full_state.seen == T


def _chunk_state(inputs, settings, upto):
    return vq_attention_chunk(**piece(inputs, 0, upto), **settings, return_state=True)[1]


def test_the_decode_state_is_refused_before_every_sink_left_the_window():
    inputs = make_inputs(1, 12, 2, 1, 4, 4, 3, 4)
    _, state = vq_attention_chunk(**piece(inputs, 0, 4), window=4, block_size=2, sinks=2, return_state=True)
    assert not can_decode(state, 1)  # the sink at position 1 is still in the window (1 .. 4) of position 4
    _, state = vq_attention_chunk(**piece(inputs, 4, 5), window=4, block_size=2, sinks=2, state=state,
                                  return_state=True)  # fmt: skip
    assert can_decode(state, 1)  # position 5 reads 2 .. 5 exactly and both sinks in their own columns
    assert not can_decode(None, 1)


def test_with_key_means_the_decode_layout_is_about_the_size_of_the_plain_state():
    """Each code's statistics are held once (as the means in its column), so a generating model holds about
    what `effattn eval` measures after prefill, at SmolLM2's shape (W 64, C 512); it held twice as much."""
    inputs = make_inputs(1, 200, 9, 3, 64, 64, 512, 64, dtype=torch.float32)
    _, state = vq_attention_chunk(**inputs, window=64, block_size=64, sinks=0, key_means=True, return_state=True)
    decode = from_state(state, inputs["codebook"], inputs["far_cos"], inputs["far_sin"], 0.125, 9, torch.float32)
    assert decode.nbytes() <= 1.25 * state.nbytes()
