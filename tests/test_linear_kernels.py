"""Hybrid sliding-window softmax + linear attention kernels (issue 17): the chunked kernel and the
recurrent step against the naive reference (outputs and gradients), all of them against independent
references (causal linear attention, causal softmax attention), and the feature maps."""

import pytest
import torch
import torch.nn.functional as F

from effattn.kernels.linear import (
    FEATURE_MAPS,
    HybridParts,
    HybridState,
    combine_parts,
    feature_map,
    hybrid_attention_chunk,
    hybrid_attention_naive,
    hybrid_attention_parts,
    hybrid_attention_step,
    hybrid_parts_naive,
    init_state,
    state_from_prefill,
)


def make_inputs(B, T, H, D, Dv, Fd, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(B, T, H, D, generator=g, dtype=dtype),
        k=torch.randn(B, T, H, D, generator=g, dtype=dtype),
        v=torch.randn(B, T, H, Dv, generator=g, dtype=dtype),
        fq=torch.rand(B, T, H, Fd, generator=g, dtype=dtype),  # non-negative features
        fk=torch.rand(B, T, H, Fd, generator=g, dtype=dtype),
    )


def factors(H, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(
        window_factor=torch.rand(H, generator=g, dtype=dtype) + 0.5,
        linear_factor=torch.rand(H, generator=g, dtype=dtype) + 0.5,
    )


def assert_close(name, ref, out, ratio):
    """Relative RMS error of ``out`` against ``ref``; fails on any NaN or inf."""
    assert torch.isfinite(out).all(), f"{name} has non-finite values"
    ref, out = ref.double(), out.double()
    err = ((ref - out).square().mean().sqrt() / ref.square().mean().sqrt().clamp_min(1e-30)).item()
    assert err <= ratio, f"{name}: relative error {err:.3e} > {ratio:.0e}"


LEAVES = ("q", "k", "v", "fq", "fk", "window_factor", "linear_factor")


def run_with_grads(fn, inputs, grad_out, **kwargs):
    """Output and gradients of every input (factors included) for the loss ``<fn(...), grad_out>``."""
    leaves = {name: inputs[name].clone().requires_grad_(True) for name in LEAVES}
    out = fn(**{**inputs, **leaves}, **kwargs)
    (out * grad_out).sum().backward()
    # an input the result does not depend on (q, k, window_factor at window 0) may get no gradient at all
    return out, {name: torch.zeros_like(x) if x.grad is None else x.grad for name, x in leaves.items()}


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("window", [0, 1, 7, 64, 100])
def test_chunk_matches_naive_outputs_and_gradients(window, chunk_size):
    B, T, H, D, Dv, Fd = 2, 63, 3, 12, 10, 20
    inputs = {**make_inputs(B, T, H, D, Dv, Fd), **factors(H)}
    grad_out = torch.randn(B, T, H, Dv, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    kwargs = dict(window=window, scale=D**-0.5)
    ref, ref_grads = run_with_grads(hybrid_attention_naive, inputs, grad_out, **kwargs)
    out, grads = run_with_grads(hybrid_attention_chunk, inputs, grad_out, **kwargs, chunk_size=chunk_size)
    assert_close("output", ref, out, 1e-12)
    # with one kind of term absent (window 0: no softmax, window >= T: no linear), the other kind's factor
    # cancels between numerator and denominator: its gradient is O(eps), a difference of O(1) terms
    lone = {"linear_factor"} if window == 0 else {"window_factor"} if window >= T else set()
    for name in LEAVES:
        if name in lone:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=1e-13)
            assert ref_grads[name].abs().max() < 1e-4
        else:
            assert_close(f"grad of {name}", ref_grads[name], grads[name], 1e-11)


@pytest.mark.parametrize(
    "T, window, chunk_size", [(1, 0, 64), (1, 3, 64), (5, 3, 1), (9, 2, 4), (9, 9, 4), (17, 5, 3)]
)
def test_chunk_matches_naive_at_edge_sizes(T, window, chunk_size):
    """One position, chunks of one position, T a multiple of the chunk, window == T."""
    inputs = {**make_inputs(1, T, 2, 4, 3, 5, seed=T), **factors(2)}
    kwargs = dict(window=window, scale=0.5)
    assert_close("output", hybrid_attention_naive(**inputs, **kwargs),
                 hybrid_attention_chunk(**inputs, **kwargs, chunk_size=chunk_size), 1e-12)  # fmt: skip


@pytest.mark.parametrize("kernel", [hybrid_attention_naive, hybrid_attention_chunk])
def test_window_zero_is_causal_linear_attention(kernel):
    T, H = 20, 2
    inputs = make_inputs(2, T, H, 4, 3, 5)
    lf = torch.tensor([0.5, 2.0], dtype=torch.float64)
    out = kernel(**inputs, window=0, window_factor=7.0, linear_factor=lf, scale=1.0, eps=1e-6)
    fq, fk, v = inputs["fq"], inputs["fk"], inputs["v"]
    ref = torch.empty_like(out)
    for t in range(T):  # out_t = lf sum_{s<=t} (fq_t.fk_s) v_s / (lf sum_{s<=t} fq_t.fk_s + eps)
        w = torch.einsum("bhf,bshf->bsh", fq[:, t], fk[:, : t + 1])  # [B, t+1, H]
        num = lf[:, None] * torch.einsum("bsh,bshe->bhe", w, v[:, : t + 1])
        ref[:, t] = num / (lf * w.sum(1) + 1e-6)[..., None]
    assert_close("output", ref, out, 1e-13)


@pytest.mark.parametrize("kernel", [hybrid_attention_naive, hybrid_attention_chunk])
@pytest.mark.parametrize("window", [30, 31, 1000])
def test_window_covering_the_sequence_is_causal_softmax_attention(kernel, window):
    B, T, H, D = 2, 30, 3, 8
    inputs = make_inputs(B, T, H, D, 6, 5)
    out = kernel(**inputs, window=window, window_factor=torch.full((H,), 0.3, dtype=torch.float64),
                 linear_factor=5.0, scale=D**-0.5, eps=0.0)  # fmt: skip
    q, k, v = (inputs[n].transpose(1, 2) for n in ("q", "k", "v"))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    assert_close("output", ref, out, 1e-13)


def run_steps(inputs, state, start, **kwargs):
    """Feed positions ``start ..`` one by one through the recurrent step; returns outputs and states."""
    outs, states = [], []
    for t in range(start, inputs["q"].shape[1]):
        token = {name: inputs[name][:, t : t + 1] for name in ("q", "k", "v", "fq", "fk")}
        out, state = hybrid_attention_step(**token, state=state, **kwargs)
        outs.append(out)
        states.append(state)
    return torch.cat(outs, dim=1), states


@pytest.mark.parametrize("window", [0, 1, 7, 100])
def test_steps_token_by_token_match_naive(window):
    B, T, H, D = 2, 30, 3, 6
    inputs = make_inputs(B, T, H, D, 5, 7)
    kwargs = dict(window=window, scale=D**-0.5, **factors(H))
    ref = hybrid_attention_naive(**inputs, **kwargs)
    out, states = run_steps(inputs, None, 0, **kwargs)
    assert out.shape == ref.shape
    assert_close("token-by-token output", ref, out, 1e-13)
    assert states[-1].seen == T


@pytest.mark.parametrize("window", [0, 1, 7, 100])
def test_steps_token_by_token_give_the_reference_gradients(window):
    """Gradients flow through the recurrent step's state (S, z and the window cache) as through the reference."""
    B, T, H, D = 2, 20, 3, 4
    inputs = {**make_inputs(B, T, H, D, 6, 5, seed=6), **factors(H)}
    grad_out = torch.randn(B, T, H, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref, ref_grads = run_with_grads(hybrid_attention_naive, inputs, grad_out, window=window, scale=D**-0.5)

    def steps(window_factor, linear_factor, **x):
        return run_steps(x, None, 0, window=window, window_factor=window_factor, linear_factor=linear_factor,
                         scale=D**-0.5)[0]

    out, grads = run_with_grads(steps, inputs, grad_out)
    assert_close("steps", ref, out, 1e-12)
    for name in LEAVES:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("window, prefill", [(7, 1), (7, 3), (7, 20), (0, 10), (100, 20), (1, 29)])
def test_prefill_state_then_steps_match_naive(window, prefill):
    B, T, H, D = 2, 30, 3, 6
    inputs = make_inputs(B, T, H, D, 5, 7, seed=3)
    kwargs = dict(window=window, scale=D**-0.5, **factors(H))
    ref = hybrid_attention_naive(**inputs, **kwargs)
    state = state_from_prefill(inputs["k"][:, :prefill], inputs["v"][:, :prefill], inputs["fk"][:, :prefill], window)
    assert isinstance(state, HybridState) and state.seen == prefill
    out, _ = run_steps(inputs, state, prefill, **kwargs)
    assert_close("output after the prefill", ref[:, prefill:], out, 1e-13)
    # the prefill's own outputs come from the chunk kernel, which agrees with the step on the same positions
    head = hybrid_attention_chunk(**{n: x[:, :prefill] for n, x in inputs.items()}, **kwargs, chunk_size=4)
    assert_close("prefill output", ref[:, :prefill], head, 1e-12)


@pytest.mark.parametrize("window, cuts, segment", [(7, (1, 9, 30), 64), (7, (3, 4, 30), 5), (0, (10, 30), 4),
                                                  (100, (20, 30), 3), (1, (29, 30), 64), (7, (30,), 4)])
def test_chunks_continuing_a_state_match_naive(window, cuts, segment):
    """A sequence cut into calls (each continuing the state the previous one returned) and into segments
    inside a call gives the one-call outputs and gradients; the returned state is the prefill's."""
    B, T, H, D = 2, 30, 3, 6
    inputs = {**make_inputs(B, T, H, D, 5, 7, seed=4), **factors(H)}
    grad_out = torch.randn(B, T, H, 5, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ref, ref_grads = run_with_grads(hybrid_attention_naive, inputs, grad_out, window=window, scale=D**-0.5)

    def pieces(window_factor, linear_factor, **x):
        outs, state, start = [], None, 0
        for end in cuts:
            out, state = hybrid_attention_chunk(**{n: t[:, start:end] for n, t in x.items()}, window=window,
                                                scale=D**-0.5, window_factor=window_factor, linear_factor=linear_factor,
                                                chunk_size=4, state=state, segment_size=segment, return_state=True)
            outs.append(out)
            assert state.seen == end
            start = end
        pieces.state = state
        return torch.cat(outs, dim=1)

    out, grads = run_with_grads(pieces, inputs, grad_out)
    assert_close("output in pieces", ref, out, 1e-12)
    lone = {"linear_factor"} if window == 0 else {"window_factor"} if window >= T else set()  # cancels: O(eps)
    for name in LEAVES:
        if name in lone:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=1e-13)
        else:
            assert_close(f"grad {name} in pieces", ref_grads[name], grads[name], 1e-11)
    prefilled = state_from_prefill(inputs["k"], inputs["v"], inputs["fk"], window)
    for name in ("S", "z", "k", "v", "fk"):
        torch.testing.assert_close(getattr(pieces.state, name).detach(), getattr(prefilled, name), rtol=1e-12,
                                   atol=1e-12)


@pytest.mark.parametrize("window, cuts, segment", [(16, (1, 40, 90), 64), (17, (5, 90), 33), (64, (90,), 4096),
                                                  (64, (63, 64, 90), 20), (100, (30, 90), 4096), (16, (90,), 7),
                                                  (16, (16, 80, 90), 32)])
@pytest.mark.parametrize("head_major", [False, True])
def test_the_no_grad_fast_path_matches_naive_and_the_general_path(window, cuts, segment, head_major, monkeypatch):
    """Without autograd, windows of 16-256 run `_fast_segment` (blocks of `window`): outputs and the
    returned state equal the reference's, in pieces continuing a state and in segments, in whole blocks
    and not, with feature maps batch-major or lying head-major (as hedgehog returns them, read in place);
    EFFATTN_LINEAR_FAST=0 runs the general path to the same results."""
    import effattn.kernels.linear.chunk as chunk

    B, T, H, D = 2, 90, 3, 6
    inputs = {**make_inputs(B, T, H, D, 5, 7, seed=5), **factors(H)}
    if head_major:  # [B, T, H, F] views of [B, H, T, F] memory
        inputs |= {n: inputs[n].transpose(1, 2).contiguous().transpose(1, 2) for n in ("fq", "fk")}
    ref = hybrid_attention_naive(**inputs, window=window, scale=D**-0.5)
    calls, fast = [], chunk._fast_segment
    monkeypatch.setattr(chunk, "_fast_segment", lambda *a, **k: calls.append(1) or fast(*a, **k))

    def pieces():
        outs, state, start = [], None, 0
        for end in cuts:
            x = {n: t[:, start:end] for n, t in inputs.items() if n not in ("window_factor", "linear_factor")}
            out, state = hybrid_attention_chunk(**x, window=window, scale=D**-0.5, window_factor=inputs["window_factor"],
                                                linear_factor=inputs["linear_factor"], state=state,
                                                segment_size=segment, return_state=True)
            outs.append(out)
            start = end
        return torch.cat(outs, dim=1), state

    with torch.no_grad():
        out, state = pieces()
        assert calls, "the fast path did not run"
        monkeypatch.setenv("EFFATTN_LINEAR_FAST", "0")
        calls.clear()
        general, general_state = pieces()
        assert not calls
    assert_close("fast path", ref, out, 1e-12)
    assert_close("general path", ref, general, 1e-12)
    prefilled = state_from_prefill(inputs["k"], inputs["v"], inputs["fk"], window)
    for name in ("S", "z", "k", "v", "fk"):
        torch.testing.assert_close(getattr(state, name), getattr(prefilled, name), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(getattr(general_state, name), getattr(prefilled, name), rtol=1e-12, atol=1e-12)


def test_the_fast_path_is_not_taken_with_autograd(monkeypatch):
    import effattn.kernels.linear.chunk as chunk

    monkeypatch.setattr(chunk, "_fast_segment", lambda *a, **k: pytest.fail("fast path under autograd"))
    inputs = {**make_inputs(1, 40, 2, 4, 3, 5), **factors(2)}
    inputs["q"].requires_grad_(True)
    hybrid_attention_chunk(**inputs, window=16, scale=0.5).sum().backward()
    assert inputs["q"].grad is not None


def test_state_size_stops_growing_after_the_window():
    window, T = 5, 16
    inputs = make_inputs(1, T, 2, 4, 3, 6)
    kwargs = dict(window=window, scale=0.5, window_factor=1.0, linear_factor=1.0)
    _, states = run_steps(inputs, None, 0, **kwargs)
    sizes = [s.nbytes() for s in states]  # after 1, 2, ..., T positions
    assert all(a < b for a, b in zip(sizes[:window], sizes[1:window])), "the window cache fills one key a step"
    assert len(set(sizes[window - 1 :])) == 1, f"state grew after the window: {sizes}"
    assert states[-1].k.shape[1] == window and states[-1].S.shape == (1, 2, 6, 3)
    prefilled = state_from_prefill(inputs["k"], inputs["v"], inputs["fk"], window)
    assert prefilled.nbytes() == sizes[-1]
    torch.testing.assert_close(prefilled.S, states[-1].S, rtol=1e-13, atol=1e-13)
    # window 0: no key is ever cached, the state is S and z only
    empty = init_state(1, 2, 4, 3, 6, window=0, dtype=torch.float64)
    _, states = run_steps(inputs, empty, 0, **{**kwargs, "window": 0})
    assert {s.nbytes() for s in states} == {empty.nbytes()} and states[-1].k.shape[1] == 0


def test_low_precision_inputs_accumulate_in_float32():
    inputs = make_inputs(1, 40, 2, 8, 4, 6, dtype=torch.bfloat16)
    kwargs = dict(window=5, scale=8**-0.5, window_factor=1.0, linear_factor=1.0)
    ref = hybrid_attention_naive(**{n: x.float() for n, x in inputs.items()}, **kwargs)
    for kernel in (hybrid_attention_naive, hybrid_attention_chunk):
        out = kernel(**inputs, **kwargs)
        assert out.dtype == torch.bfloat16
        assert_close(f"{kernel.__name__} bfloat16 output", ref, out, 4e-3)  # bf16 rounding of the result only


def test_taylor_features_give_the_second_order_expansion_exactly():
    D = 6
    phi = feature_map("taylor", D, 2)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, 5, 2, D, generator=g, dtype=torch.float64)  # [B, T, H, D] each
    fq, fk = phi(q), phi(k)
    # the quadratic block's upper triangle: 1 + D + D (D + 1) / 2 features, not Based's 1 + D + D^2
    assert fq.shape == (2, 5, 2, 1 + D + D * (D + 1) // 2) and phi.feature_dim == 1 + D + 21
    s = torch.einsum("bthd,bshd->bhts", q, k) / D**0.5
    torch.testing.assert_close(torch.einsum("bthf,bshf->bhts", fq, fk), 1 + s + s**2 / 2, rtol=1e-12, atol=1e-12)
    # with autograd (the cat path) the same features, and gradients reach q
    qg = q.clone().requires_grad_(True)
    fg = phi(qg)
    torch.testing.assert_close(fg, fq, rtol=0, atol=0)
    fg.sum().backward()
    assert qg.grad is not None and qg.grad.abs().sum() > 0
    torch.testing.assert_close(qg.grad, torch.func.grad(lambda t: phi(t).sum())(q), rtol=1e-12, atol=1e-12)


def test_performer_features_estimate_the_softmax_kernel():
    D, H, m = 16, 2, 4096
    phi = feature_map("performer", D, H, num_features=m, seed=7)
    g = torch.Generator().manual_seed(1)
    q, k = 0.5 * torch.randn(2, 1, 64, H, D, generator=g, dtype=torch.float64)
    estimate = torch.einsum("bthf,bshf->bhts", phi(q), phi(k))  # [1, H, 64, 64]
    exact = torch.exp(torch.einsum("bthd,bshd->bhts", q, k) / D**0.5)
    ratio = estimate / exact
    assert (estimate > 0).all()
    assert abs(ratio.mean().item() - 1) < 0.02, f"mean ratio {ratio.mean().item():.4f}"
    assert (ratio - 1).abs().median() < 0.05, f"median relative error {(ratio - 1).abs().median().item():.4f}"
    # seeded: the same seed gives the same projections, another seed others
    same = feature_map("performer", D, H, num_features=m, seed=7)
    assert torch.equal(phi.projection, same.projection)
    assert not torch.equal(phi.projection, feature_map("performer", D, H, num_features=m, seed=8).projection)
    # each block of D projections is orthogonal
    block = phi.projection[0, :, :D].double()
    gram = block.T @ block
    assert (gram - torch.diag(gram.diagonal())).abs().max() < 1e-4


def test_performer_stabilize_bounds_features_by_a_per_token_factor():
    D, H, m = 8, 2, 64
    x = 3 * torch.randn(2, 5, H, D, generator=torch.Generator().manual_seed(0))
    plain = feature_map("performer", D, H, num_features=m)(x.double())
    stable = feature_map("performer", D, H, num_features=m, stabilize=True)(x.double())
    assert stable.max() <= m**-0.5 + 1e-12 and stable.amax(-1).sub(m**-0.5).abs().max() < 1e-12
    factor = plain / stable  # one constant per token
    torch.testing.assert_close(factor, factor[..., :1].expand_as(factor), rtol=1e-10, atol=0)


def test_hedgehog_features_are_two_distributions_per_head():
    D, H = 8, 3
    x = torch.randn(2, 5, H, D, generator=torch.Generator().manual_seed(0))
    for projection_dim, bias in ((64, False), (D, True)):
        phi = feature_map("hedgehog", D, H, projection_dim=projection_dim, bias=bias)
        out = phi(x)
        assert out.shape == (2, 5, H, 2 * projection_dim) == (*x.shape[:3], phi.feature_dim)
        assert (out >= 0).all()
        torch.testing.assert_close(out.sum(-1), torch.full((2, 5, H), 2.0))
        torch.testing.assert_close(out[..., :projection_dim].sum(-1), torch.ones(2, 5, H))
    # P == D starts at the identity: the first half is softmax(x) itself
    torch.testing.assert_close(out[..., :D], x.softmax(-1))
    torch.testing.assert_close(out[..., D:], (-x).softmax(-1))
    out.sum().backward()
    assert phi.weight.grad is not None and phi.weight.grad.shape == (H, D, D)


def test_elu_features_are_elu_plus_one():
    x = torch.linspace(-3, 3, 24).reshape(1, 2, 3, 4)
    torch.testing.assert_close(feature_map("elu", 4, 3)(x), torch.where(x > 0, x + 1, torch.exp(x)))


@pytest.mark.parametrize("name", sorted(FEATURE_MAPS))
def test_every_feature_map_gives_positive_weights_and_its_feature_dim(name):
    D, H = 4, 2
    phi = feature_map(name, D, H)
    out = phi(torch.randn(1, 3, H, D))
    assert out.shape == (1, 3, H, phi.feature_dim)
    if name == "taylor":  # its linear block takes both signs; its dot products 1 + s + s^2/2 >= 1/2 do not
        assert (torch.einsum("bthf,bshf->bhts", out, out) >= 0.5 - 1e-6).all()
    else:
        assert (out >= 0).all()
    with pytest.raises(ValueError, match=r"expects \[batch, time, heads=2, head_dim=4\], got \(1, 3, 2, 5\)"):
        phi(torch.randn(1, 3, H, 5))


def test_unknown_feature_map_is_rejected():
    with pytest.raises(ValueError, match=r"Unknown feature map 'cosformer'; use one of \['elu', 'hedgehog'"):
        feature_map("cosformer", 8, 2)


def bad(**changes):
    return {**make_inputs(1, 8, 2, 4, 3, 5), **changes}


INVALID = [
    (bad(), {"window": -1}, "window must be an integer >= 0, got -1"),
    (bad(), {"window": 2.0}, "window must be an integer >= 0, got 2.0"),
    (bad(q=torch.randn(8, 2, 4)), {}, r"q must be a 4-dimensional tensor .* got \(8, 2, 4\)"),
    (bad(k=torch.randn(1, 8, 2, 5)), {}, r"k must have the shape of q \(1, 8, 2, 4\), got \(1, 8, 2, 5\)"),
    (bad(v=torch.randn(1, 7, 2, 3)), {}, r"v must share batch, time and heads with q \(1, 8, 2\), got \(1, 7, 2, 3\)"),
    (bad(fk=torch.rand(1, 8, 2, 6)), {}, r"fk must have the shape of fq \(1, 8, 2, 5\), got \(1, 8, 2, 6\)"),
    (bad(fq=torch.rand(1, 8, 3, 5), fk=torch.rand(1, 8, 3, 5)), {}, "fq and fk must share batch, time and heads"),
    (bad(), {"window_factor": torch.ones(3)}, r"window_factor must be .* shape \[heads\] = \[2\], got torch.float32 \(3,\)"),
    (bad(), {"scale": None}, "scale must be a real number, got None"),
    (bad(), {"eps": -1.0}, "eps must be a number >= 0, got -1.0"),
    (bad(q=torch.randn(1, 0, 2, 4), k=torch.randn(1, 0, 2, 4), v=torch.randn(1, 0, 2, 3),
         fq=torch.rand(1, 0, 2, 5), fk=torch.rand(1, 0, 2, 5)), {}, r"The sequence is empty \(T=0\)"),  # fmt: skip
]


@pytest.mark.parametrize("kernel", [hybrid_attention_naive, hybrid_attention_chunk])
@pytest.mark.parametrize("inputs, overrides, message", INVALID)
def test_invalid_inputs_raise_explanations(kernel, inputs, overrides, message):
    kwargs = {"window": 3, "window_factor": 1.0, "linear_factor": 1.0, "scale": 0.5, **overrides}
    with pytest.raises(ValueError, match=message) as error:
        kernel(**inputs, **kwargs)
    assert str(error.value).endswith(".") and ";" in str(error.value)  # a sentence saying what to do


def test_invalid_step_and_state_arguments_raise_explanations():
    inputs = make_inputs(1, 8, 2, 4, 3, 5)
    kwargs = dict(window=3, window_factor=1.0, linear_factor=1.0, scale=0.5)
    with pytest.raises(ValueError, match="chunk_size must be an integer >= 1, got 0"):
        hybrid_attention_chunk(**inputs, **kwargs, chunk_size=0)
    with pytest.raises(ValueError, match="takes one position \\(T=1\\), got T=8"):
        hybrid_attention_step(**inputs, state=None, **kwargs)
    token = {n: x[:, :1] for n, x in inputs.items()}
    state = state_from_prefill(inputs["k"], inputs["v"], inputs["fk"], window=3)
    with pytest.raises(ValueError, match="built with window=3 but this call uses window=4"):
        hybrid_attention_step(**token, state=state, **{**kwargs, "window": 4})
    with pytest.raises(ValueError, match=r"state.S has shape \(1, 2, 5, 3\) but these inputs need \(2, 2, 5, 3\)"):
        hybrid_attention_step(**{n: x.expand(2, -1, -1, -1) for n, x in token.items()}, state=state, **kwargs)
    with pytest.raises(ValueError, match="window must be an integer >= 0, got -2"):
        state_from_prefill(inputs["k"], inputs["v"], inputs["fk"], window=-2)
    with pytest.raises(ValueError, match="k, v and fk must share batch, time and heads"):
        state_from_prefill(inputs["k"], inputs["v"][:, :5], inputs["fk"], window=3)


def test_hedgehog_keeps_its_signed_weights_only_while_the_parameters_are_unchanged():
    """Without autograd hedgehog keeps [W, -W] between calls: a change of W in place is seen at once, and
    maps made in inference mode (no version counter) work too."""
    fmap = feature_map("hedgehog", 4, 2, projection_dim=3, bias=True)
    x = torch.randn(1, 5, 2, 4)

    def reference(m):
        proj = torch.einsum("bthd,hdp->bthp", x, m.weight) + (0 if m.bias is None else m.bias)
        return torch.cat((proj.softmax(-1), (-proj).softmax(-1)), dim=-1)

    with torch.no_grad():
        torch.testing.assert_close(fmap(x), reference(fmap))
        fmap.weight.mul_(3.0)
        fmap.bias.add_(0.5)
        torch.testing.assert_close(fmap(x), reference(fmap))
    with torch.inference_mode():
        made_here = feature_map("hedgehog", 4, 2, projection_dim=3)
        torch.testing.assert_close(made_here(x), reference(made_here))
        made_here.weight.mul_(2.0)  # in place in inference mode: no version counter, nothing kept
        torch.testing.assert_close(made_here(x), reference(made_here))


# Attention sinks (`sinks`): the first positions stay under exact softmax for every later query.

SINK_CASES = [(1, 1), (7, 1), (7, 4), (7, 40), (16, 3), (100, 2)]  # (window, sinks): sinks past T, a window past T


def test_sinks_are_a_softmax_over_the_window_and_the_first_positions():
    """Independent reference: with the linear factor 0, the output is softmax attention with the mask
    "in the window, or one of the first `sinks` positions" (scaled_dot_product_attention)."""
    B, T, H, D, window, sinks = 2, 40, 3, 8, 6, 3
    inputs = make_inputs(B, T, H, D, 5, 7, seed=11)
    t, s = torch.arange(T)[:, None], torch.arange(T)[None, :]
    mask = (s <= t) & ((s > t - window) | (s < sinks))
    q, k, v = (inputs[n].transpose(1, 2) for n in ("q", "k", "v"))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    for kernel in (hybrid_attention_naive, hybrid_attention_chunk):
        out = kernel(**inputs, window=window, sinks=sinks, window_factor=0.7, linear_factor=0.0, scale=D**-0.5, eps=0.0)
        assert_close(kernel.__name__, ref, out, 1e-13)
    # and the linear part no longer sees the sinks: with the window factor 0, outputs past the sinks' reach
    # are linear attention over positions sinks .. t - window
    out = hybrid_attention_naive(**inputs, window=window, sinks=sinks, window_factor=0.0, linear_factor=1.0,
                                 scale=D**-0.5, eps=0.0)  # fmt: skip
    fq, fk, v = inputs["fq"], inputs["fk"], inputs["v"]
    for t in (sinks + window, T - 1):
        w = torch.einsum("bhf,bshf->bsh", fq[:, t], fk[:, sinks : t - window + 1])
        want = torch.einsum("bsh,bshe->bhe", w, v[:, sinks : t - window + 1]) / w.sum(1)[..., None]
        assert_close(f"linear part at {t}", want, out[:, t], 1e-13)


@pytest.mark.parametrize("window, sinks", SINK_CASES)
def test_chunk_and_steps_with_sinks_match_naive_outputs_and_gradients(window, sinks):
    B, T, H, D = 2, 30, 3, 6
    inputs = {**make_inputs(B, T, H, D, 5, 7, seed=12), **factors(H)}
    grad_out = torch.randn(B, T, H, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    kwargs = dict(window=window, scale=D**-0.5, sinks=sinks)
    ref, ref_grads = run_with_grads(hybrid_attention_naive, inputs, grad_out, **kwargs)
    plain = hybrid_attention_naive(**inputs, window=window, scale=D**-0.5)
    assert (ref - plain).abs().max() > 1e-3 or window >= T  # the sinks change the outputs
    out, grads = run_with_grads(hybrid_attention_chunk, inputs, grad_out, **kwargs, chunk_size=4)

    def steps(window_factor, linear_factor, **x):
        return run_steps(x, None, 0, window=window, sinks=sinks, window_factor=window_factor,
                         linear_factor=linear_factor, scale=D**-0.5)[0]

    stepped, step_grads = run_with_grads(steps, inputs, grad_out)
    no_far = window >= T or sinks >= T - window  # every key in the softmax: the window factor cancels, O(eps)
    lone = {"window_factor"} if no_far else set()
    for name, o, g in (("chunk", out, grads), ("steps", stepped, step_grads)):
        assert_close(name, ref, o, 1e-12)
        for leaf in LEAVES:
            if leaf in lone:
                torch.testing.assert_close(g[leaf], ref_grads[leaf], rtol=0, atol=1e-13)
            else:
                assert_close(f"{name}: grad of {leaf}", ref_grads[leaf], g[leaf], 1e-11)


@pytest.mark.parametrize("window, sinks", SINK_CASES)
def test_states_with_sinks_continue_in_pieces_and_from_a_prefill(window, sinks):
    """Calls continuing a state (general and no-grad fast path, several segments), steps after a
    prefill's state: the one-call outputs, and states equal to state_from_prefill's (the sink store
    holds exactly the sinks that left the window; their feature keys never reach S)."""
    B, T, H, D = 2, 45, 3, 6
    inputs = {**make_inputs(B, T, H, D, 5, 7, seed=13), **factors(H)}
    kwargs = dict(window=window, scale=D**-0.5, sinks=sinks, window_factor=inputs["window_factor"],
                  linear_factor=inputs["linear_factor"])
    x = {n: inputs[n] for n in ("q", "k", "v", "fq", "fk")}
    ref = hybrid_attention_naive(**x, **kwargs)
    prefilled = state_from_prefill(x["k"], x["v"], x["fk"], window, sinks)
    assert prefilled.sink_k.shape[1] == min(sinks, max(T - window, 0))

    def pieces(cuts, **extra):
        outs, state, start = [], None, 0
        for end in cuts:
            out, state = hybrid_attention_chunk(**{n: t[:, start:end] for n, t in x.items()}, **kwargs, state=state,
                                                return_state=True, **extra)
            outs.append(out)
            start = end
        return torch.cat(outs, dim=1), state

    runs = {"general": pieces((1, 3, 20, T), chunk_size=4, segment_size=6)}
    with torch.no_grad():
        runs["fast"] = pieces((2, 19, 33, T), segment_size=16)
    for name, (out, state) in runs.items():
        assert_close(name, ref, out, 1e-12)
        for field in ("S", "z", "k", "v", "fk", "sink_k", "sink_v"):
            torch.testing.assert_close(getattr(state, field).detach(), getattr(prefilled, field), rtol=1e-12,
                                       atol=1e-12, msg=lambda m: f"{name} {field}: {m}")
    for prefill in sorted({1, min(sinks, T - 1), min(window + sinks + 1, T - 1)}):
        head = state_from_prefill(x["k"][:, :prefill], x["v"][:, :prefill], x["fk"][:, :prefill], window, sinks)
        out, state = run_steps(x, head, prefill, **kwargs)
        assert_close(f"steps after a prefill of {prefill}", ref[:, prefill:], out, 1e-12)
        for field in ("S", "z", "fk", "sink_k", "sink_v"):
            torch.testing.assert_close(getattr(state[-1], field), getattr(prefilled, field), rtol=1e-12, atol=1e-12)


def test_the_fast_path_runs_with_sinks(monkeypatch):
    import effattn.kernels.linear.chunk as chunk

    calls, fast = [], chunk._fast_segment
    # the state it gets holds the sinks its queries read (positions 0 and 1: both leave the window in the call)
    monkeypatch.setattr(chunk, "_fast_segment", lambda *a, **k: calls.append(a[5][6].shape[1]) or fast(*a, **k))
    inputs = {**make_inputs(1, 50, 2, 4, 3, 5, seed=14), **factors(2)}
    with torch.no_grad():
        out = hybrid_attention_chunk(**inputs, window=16, sinks=2, scale=0.5)
    assert calls == [2]
    assert_close("fast path", hybrid_attention_naive(**inputs, window=16, sinks=2, scale=0.5), out, 1e-12)


def test_sink_state_size_stops_growing_after_window_plus_sinks():
    B, H, D, Dv, Fd, window, sinks = 1, 2, 4, 3, 5, 6, 3
    inputs = make_inputs(B, 30, H, D, Dv, Fd)
    state, sizes = None, []
    for t in range(30):
        _, state = hybrid_attention_step(**{n: x[:, t : t + 1] for n, x in inputs.items()}, state=state,
                                         window=window, sinks=sinks, window_factor=1.0, linear_factor=1.0, scale=0.5)
        sizes.append(state.nbytes())
    full = window + sinks
    assert sizes[full - 2] < sizes[full - 1] == sizes[-1]
    assert sizes[-1] - init_state(B, H, D, Dv, Fd, window=window, sinks=sinks, dtype=torch.float64).nbytes() == (
        8 * B * H * (window * (D + Dv + Fd) + sinks * (D + Dv)))


def test_invalid_sinks_raise_explanations():
    inputs = make_inputs(1, 5, 2, 4, 3, 5)
    settings = dict(window_factor=1.0, linear_factor=1.0, scale=0.5)
    for kernel in (hybrid_attention_naive, hybrid_attention_chunk):
        with pytest.raises(ValueError, match="sinks=2 needs a window > 0"):
            kernel(**inputs, window=0, sinks=2, **settings)
        with pytest.raises(ValueError, match="sinks must be an integer >= 0"):
            kernel(**inputs, window=3, sinks=-1, **settings)
    _, state = hybrid_attention_chunk(**inputs, window=3, sinks=1, return_state=True, **settings)
    with pytest.raises(ValueError, match="built with sinks=1 but this call uses sinks=2"):
        hybrid_attention_chunk(**inputs, window=3, sinks=2, state=state, **settings)


@pytest.mark.parametrize("window,sinks,segment", [(0, 0, 4096), (5, 0, 4096), (5, 2, 4096), (7, 3, 11), (64, 4, 4096)])
def test_the_parts_combine_into_the_kernels_output_and_gradients(window, sinks, segment):
    """hybrid_attention_parts (chunked, in segments) gives the reference's four sums at odd sizes, with and
    without sinks; combined with any factors they are both kernels' output, and the factors' gradients
    through `combine_parts` are the reference's."""
    inputs = make_inputs(2, 37, 3, 8, 5, 6)
    kwargs = dict(window=window, scale=8**-0.5, sinks=sinks)
    ref = hybrid_parts_naive(**inputs, **kwargs)
    parts = hybrid_attention_parts(**inputs, **kwargs, chunk_size=4, segment_size=segment)
    assert isinstance(parts, HybridParts)
    for name, a, b in zip(HybridParts._fields, ref, parts):
        assert a.shape == b.shape, name
        assert_close(f"parts {name}", a, b, 1e-12) if a.abs().sum() else torch.testing.assert_close(b, a)
    if window == 0:  # pure linear attention: no window terms
        assert not parts.window_num.any() and not parts.window_den.any()
    if window >= 37:  # nothing leaves the window
        assert not parts.far_num.any()
    f = {n: t.requires_grad_(True) for n, t in factors(3).items()}
    out = combine_parts(parts, f["window_factor"], f["linear_factor"], 1e-6)
    for kernel in (hybrid_attention_naive, hybrid_attention_chunk):
        assert_close(kernel.__name__, kernel(**inputs, **kwargs, **{n: t.detach() for n, t in f.items()}), out, 1e-12)
    grads = torch.autograd.grad(out.pow(2).sum(), list(f.values()))
    g = {n: t.detach().clone().requires_grad_(True) for n, t in f.items()}
    expect = torch.autograd.grad(hybrid_attention_naive(**inputs, **kwargs, **g).pow(2).sum(), list(g.values()))
    for name, a, b in zip(f, expect, grads):
        assert_close(f"d/d {name}", a, b, 1e-8)  # window 0: d/d lf is of the order of eps
    # autograd reaches the inputs through the parts too
    for name in ("q", "v", "fk"):
        if (name == "q" and not window) or (name == "fk" and window >= 37):  # q only through fq; no far keys
            continue
        x = inputs[name].clone().requires_grad_(True)
        (dx,) = torch.autograd.grad(combine_parts(hybrid_attention_parts(**(inputs | {name: x}), **kwargs, chunk_size=4),
                                                  1.0, 2.0).sum(), [x])
        x2 = inputs[name].clone().requires_grad_(True)
        (dx2,) = torch.autograd.grad(hybrid_attention_naive(**(inputs | {name: x2}), **kwargs, window_factor=1.0,
                                                            linear_factor=2.0).sum(), [x2])
        assert_close(f"d/d{name}", dx2, dx, 1e-10)
