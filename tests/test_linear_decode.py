"""The compiled decode step of the hybrid attention (kernels/linear/native.c, decode.py) against the
readable step (recurrent.py's hybrid_attention_step), and the model decoding through it against its
full forward pass and its PyTorch step; likewise the step with LoLA's global cache against
global_cache_attention. float32 (the compiled step's dtype), odd sizes."""

from __future__ import annotations

import copy

import pytest
import torch

from effattn.attention.linear import LinearCache
from effattn.kernels.linear import decode, native
from effattn.kernels.linear.decode import GlobalDecodeState, LinearDecodeState, can_decode, from_global_state
from effattn.kernels.linear.decode import from_state
from effattn.kernels.linear.features import feature_map
from effattn.kernels.linear.global_cache import decided_blocks, global_cache_attention
from effattn.kernels.linear.recurrent import hybrid_attention_step, state_from_prefill
from effattn.kernels.rope import apply_rope, rope_tables

from .test_linear_model import IDS, MAPS, linear_folder, perturb

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no compiled step here: {native.why_unavailable()}")

B, H, G, D = 2, 6, 3, 8


def maps(name: str, seed: int):
    torch.manual_seed(seed)
    kw = {"projection_dim": 5, "bias": True} if name == "hedgehog" else {}
    fq, fk = feature_map(name, D, H, **kw), feature_map(name, D, H, **kw)
    if name == "hedgehog":  # trained-looking maps: not the identity, a non-zero bias
        with torch.no_grad():
            for m in (fq, fk):
                m.weight.normal_(0, 0.5)
                m.bias.normal_(0, 0.5)
    return fq, fk


def reference_inputs(q, k, v, cos, sin, fmq, fmk):
    """What LinearAttention hands hybrid_attention_step: rotated q, k, the KV heads repeated, the maps."""
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v = (x.repeat_interleave(H // G, dim=2) for x in (k, v))
    return q, k, v, fmq(q), fmk(k)


@pytest.mark.parametrize("window, sinks", [(0, 0), (1, 0), (5, 0), (16, 0), (1, 2), (5, 4), (16, 1)])
@pytest.mark.parametrize("name", ["hedgehog", "elu"])
def test_the_compiled_step_equals_the_readable_step(name, window, sinks):
    """Prefill shorter and longer than the window, then 2 * window + sinks + 3 steps: outputs and the state
    (given back in the plain layout) agree with hybrid_attention_step's at every step; with sinks, the
    sinks leave the window during the steps (prefill 3 < window + sinks)."""
    fmq, fmk = maps(name, seed=window)
    g = torch.Generator().manual_seed(7)
    steps, prefill = 2 * window + sinks + 3, 3
    T = prefill + steps
    q, k, v = (torch.randn(B, T, n, D, generator=g) for n in (H, G, G))
    wfac = torch.randn(H, generator=g)
    wf = torch.sigmoid(wfac)
    cos, sin = rope_tables(T, D)
    settings = dict(window=window, window_factor=wf, linear_factor=1 - wf, scale=D**-0.5, eps=1e-6, sinks=sinks)
    with torch.no_grad():
        rq, rk, rv, rfq, rfk = reference_inputs(q, k, v, cos[:, None], sin[:, None], fmq, fmk)
        ref = state_from_prefill(rk[:, :prefill], rv[:, :prefill], rfk[:, :prefill], window, sinks)
        fast = from_state(ref)
        assert isinstance(fast, LinearDecodeState) and fast.nbytes() == ref.nbytes()
        for t in range(prefill, T):
            pick = slice(t, t + 1)
            want, ref = hybrid_attention_step(rq[:, pick], rk[:, pick], rv[:, pick], rfq[:, pick], rfk[:, pick],
                                              ref, **settings)  # fmt: skip
            if name == "hedgehog":  # RoPE and the maps in C
                got = decode.decode_step(fast, q[:, pick], k[:, pick], v[:, pick], cos[t], sin[t], wfac,
                                         scale=D**-0.5, eps=1e-6,
                                         hedgehog=(fmq.weight, fmq.bias, fmk.weight, fmk.bias))  # fmt: skip
            else:  # rotated inputs and the caller's features
                kr = apply_rope(k[:, pick], cos[t], sin[t])
                got = decode.decode_step(fast, rq[:, pick], kr, v[:, pick], cos[t], sin[t], wfac, scale=D**-0.5,
                                         eps=1e-6, fq=rfq[:, pick], fk=rfk[:, pick], rope=False)  # fmt: skip
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {t}: {m}")
            assert fast.seen == ref.seen == t + 1 and fast.nbytes() == ref.nbytes()
        back = fast.to_state()
        assert back.sink_k.shape[1] == min(sinks, T - window) if window else back.sink_k.shape[1] == 0
        for field in ("k", "v", "fk", "S", "z", "sink_k", "sink_v"):
            torch.testing.assert_close(getattr(back, field), getattr(ref, field), rtol=1e-5, atol=1e-5)


def test_the_ring_layout_round_trips_exactly():
    g = torch.Generator().manual_seed(0)
    for seen, window, sinks in [(3, 8, 0), (8, 8, 0), (13, 8, 0), (5, 0, 0), (10, 8, 4), (13, 8, 4), (20, 8, 4)]:
        n = min(seen, window)
        k, v, fk = (torch.randn(B, seen, H, d, generator=g) for d in (D, D, 10))
        state = state_from_prefill(k, v, fk, window, sinks)
        back = from_state(state).to_state()
        assert back.seen == seen and back.k.shape == (B, n, H, D)
        assert back.sink_k.shape == (B, min(sinks, seen - n), H, D)
        for field in ("k", "v", "fk", "S", "z", "sink_k", "sink_v"):
            assert torch.equal(getattr(back, field), getattr(state, field)), (seen, window, field)


def test_only_inference_in_float32_takes_the_compiled_step():
    state = state_from_prefill(*(torch.randn(1, 4, H, D) for _ in range(3)), window=2)
    q = torch.randn(1, 1, H, D)
    with torch.no_grad():
        assert can_decode(state, q)
        assert not can_decode(state, q.double())
        assert not can_decode(None, q)
        assert not can_decode(state, torch.randn(1, 2, H, D))  # several tokens: the chunked kernel
    assert not can_decode(state, q)  # autograd on: the readable step, which backpropagates


def load32(tiny, tmp_path, name, **settings):
    from effattn.attention.linear import EffattnLinearForCausalLM

    src = tiny("llama", heads=H, kv_heads=G, head_dim=D)
    model = EffattnLinearForCausalLM.from_pretrained(linear_folder(src, tmp_path / name, **settings),
                                                     dtype=torch.float32).eval()  # fmt: skip
    perturb(model)
    return model


def pieces_logits(model, pieces):
    out, cache, start = [], None, 0
    with torch.no_grad():
        for n in pieces:
            step = model(input_ids=IDS[:, start:start + n], cache=cache, use_cache=True)
            cache, start = step.cache, start + n
            assert isinstance(cache, LinearCache) and cache.get_seq_length() == start
            out.append(step.logits)
    return torch.cat(out, 1), cache


@pytest.mark.parametrize("window, sinks", [(0, 0), (8, 0), (8, 3)])
@pytest.mark.parametrize("fmap", list(MAPS))
def test_the_model_decodes_through_the_compiled_step(tiny, tmp_path, monkeypatch, fmap, window, sinks):
    """Token by token, prefill + decode, and a chunk after decoded tokens (the ring given back to the
    chunked kernel): the full forward's logits, and the PyTorch step's (EFFATTN_NATIVE=0)."""
    model = load32(tiny, tmp_path, "lin", linear_window=window, linear_sinks=sinks, linear_feature_map=MAPS[fmap],
                  linear_chunk_size=16)
    decodes_as_its_forward_and_pytorch(model, monkeypatch, LinearDecodeState)


def decodes_as_its_forward_and_pytorch(model, monkeypatch, compiled: type) -> None:
    """Token by token, prefill + decode, and a chunk after decoded tokens: the compiled step's states (of type
    `compiled`; a layer with exact heads holds one as its SplitState's `linear`) give the full forward's logits and
    the PyTorch path's (EFFATTN_NATIVE=0), whose cache counts the same bytes."""
    unwrap = lambda state: getattr(state, "linear", state)  # noqa: E731
    with torch.no_grad():
        full = model(input_ids=IDS).logits
    cases = {"token by token": [1] * 40, "prefill + decode": [13] + [1] * 27,
             "decode, then a chunk, then decode": [9] + [1] * 12 + [7] + [1] * 12}  # fmt: skip
    for name, pieces in cases.items():
        fast, cache = pieces_logits(model, pieces)
        assert all(isinstance(unwrap(s), compiled) for s in cache.states.values()), name
        torch.testing.assert_close(fast, full, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
        monkeypatch.setenv("EFFATTN_NATIVE", "0")
        slow, slow_cache = pieces_logits(model, pieces)
        monkeypatch.delenv("EFFATTN_NATIVE")
        assert not any(isinstance(unwrap(s), compiled) for s in slow_cache.states.values())
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        assert cache.nbytes() == slow_cache.nbytes()  # the same state, counted alike


def test_a_copied_cache_decodes_on_its_own(tiny, tmp_path):
    """Generation and the benchmarks copy a cache (deepcopy) and decode each copy: the ring is updated
    in place, so a copy must own its buffers."""
    model = load32(tiny, tmp_path, "lin", linear_window=4, linear_feature_map=MAPS["hedgehog"])
    with torch.no_grad():
        cache = model(input_ids=IDS[:, :10], use_cache=True).cache
        cache = model(input_ids=IDS[:, 10:11], cache=cache, use_cache=True).cache  # now in the ring layout
        twin = copy.deepcopy(cache)
        a = model(input_ids=IDS[:, 11:12], cache=cache, use_cache=True).logits
        b = model(input_ids=IDS[:, 11:12], cache=twin, use_cache=True).logits
        assert torch.equal(a, b) and cache.get_seq_length() == twin.get_seq_length() == 12
        generated = model.generate(IDS[:1, :6], max_new_tokens=10, min_new_tokens=10, do_sample=False)
        full = model(input_ids=generated).logits[0, 5:-1].argmax(-1)
    assert torch.equal(full, generated[0, 6:])


GLOBAL_CASES = [(1, 0, 2), (5, 0, 3), (5, 2, 7), (4, 3, 40), (16, 1, 5)]  # window, sinks, capacity


@pytest.mark.parametrize("window, sinks, capacity", GLOBAL_CASES)
@pytest.mark.parametrize("prefill", [3, 29])
def test_the_compiled_global_step_equals_the_kernel(window, sinks, capacity, prefill):
    """LoLA's global cache: after a prefill shorter and longer than the window, steps across several decisions give
    global_cache_attention's outputs one position at a time; the state, given back in the plain layout, holds the
    same cache (the same positions), pending keys and S, z, and counts the same bytes."""
    fmq, fmk = maps("hedgehog", seed=window + capacity)
    g = torch.Generator().manual_seed(11)
    T = prefill + 4 * window + sinks + 9
    q, k, v = (torch.randn(B, T, n, D, generator=g) for n in (H, G, G))
    wfac = torch.randn(H, generator=g)
    wf = torch.sigmoid(wfac)
    cos, sin = rope_tables(T, D)
    kw = dict(window=window, sinks=sinks, capacity=capacity, window_factor=wf, linear_factor=1 - wf, scale=D**-0.5,
              eps=1e-6, key_map=fmk)
    maps_ = (fmq.weight, fmq.bias, fmk.weight, fmk.bias)
    with torch.no_grad():
        rq, rk, rv, rfq, rfk = reference_inputs(q, k, v, cos[:, None], sin[:, None], fmq, fmk)
        _, ref = global_cache_attention(*(x[:, :prefill] for x in (rq, rk, rv, rfq, rfk)), **kw, return_state=True)
        fast = from_global_state(ref)
        assert isinstance(fast, GlobalDecodeState) and fast.nbytes() == ref.nbytes()
        for t in range(prefill, T):
            pick = slice(t, t + 1)
            want, ref = global_cache_attention(*(x[:, pick] for x in (rq, rk, rv, rfq, rfk)), **kw, state=ref,
                                               return_state=True)  # fmt: skip
            got = decode.global_decode_step(fast, q[:, pick], k[:, pick], v[:, pick], cos[t], sin[t], wfac,
                                            scale=D**-0.5, eps=1e-6, hedgehog=maps_)  # fmt: skip
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {t}: {m}")
            assert fast.seen == ref.seen == t + 1 and fast.cached == ref.cache_k.shape[1]
            assert fast.nbytes() == ref.nbytes()
        assert fast.cached == min(capacity, decided_blocks(T, window, sinks) * window) > 0
        back = fast.to_state()
        assert torch.equal(back.cache_pos, ref.cache_pos)
        for field in ("k", "v", "fk", "S", "z", "sink_k", "sink_v", "cache_k", "cache_v"):
            torch.testing.assert_close(getattr(back, field), getattr(ref, field), rtol=1e-5, atol=1e-5)


def test_the_global_layout_round_trips_exactly():
    g = torch.Generator().manual_seed(1)
    fm = feature_map("hedgehog", D, H, projection_dim=5)
    for seen, window, sinks, capacity in [(2, 4, 0, 3), (4, 4, 0, 3), (11, 4, 0, 3), (12, 4, 0, 3), (13, 4, 0, 9),
                                          (3, 5, 2, 4), (16, 5, 2, 4), (17, 5, 2, 4), (40, 1, 3, 2)]:
        q, k, v = (torch.randn(B, seen, H, D, generator=g) for _ in range(3))
        wf = torch.full((H,), 0.3)
        with torch.no_grad():
            _, state = global_cache_attention(q, k, v, fm(q), fm(k), window=window, sinks=sinks, capacity=capacity,
                                              window_factor=wf, linear_factor=1 - wf, scale=1.0, key_map=fm,
                                              return_state=True)  # fmt: skip
        fast = from_global_state(state)
        back = fast.to_state()
        assert back.seen == seen and fast.nbytes() == state.nbytes() == back.nbytes()
        for field in ("k", "v", "fk", "S", "z", "sink_k", "sink_v", "cache_k", "cache_v", "cache_pos"):
            assert torch.equal(getattr(back, field), getattr(state, field)), (seen, window, sinks, field)


@pytest.mark.parametrize("sinks, exact", [(0, []), (3, []), (2, [[0, 1], [1, 0]])])
def test_the_model_decodes_with_its_global_cache_through_the_compiled_step(tiny, tmp_path, monkeypatch, sinks, exact):
    """The global cache's decisions inside the compiled step: token by token, prefill + decode and a chunk after
    decoded tokens give the full forward's logits and the PyTorch kernel's (EFFATTN_NATIVE=0), with exact heads
    too; the states count the same bytes."""
    model = load32(tiny, tmp_path, "lin", linear_window=4, linear_sinks=sinks, linear_global_cache=3,
                   linear_feature_map=MAPS["hedgehog"], linear_exact_heads=exact, linear_chunk_size=16)
    decodes_as_its_forward_and_pytorch(model, monkeypatch, GlobalDecodeState)
