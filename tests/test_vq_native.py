"""The compiled step loop (kernels/vq/native.c) against the PyTorch step loop of vq_attention_chunk,
and the fallback when it cannot be built."""

import warnings

import pytest
import torch

import effattn.kernels.vq.chunk as vq_chunk
from effattn.kernels.vq import native, vq_attention_chunk, vq_attention_naive
from tests.test_vq_kernels import make_inputs, run_in_pieces


@pytest.fixture
def count_native_calls(monkeypatch):
    calls = []
    real = native.run_segment
    monkeypatch.setattr(native, "run_segment", lambda **kw: (calls.append(kw["n"]), real(**kw))[1])
    return calls


def test_native_loop_is_built_and_used_here(count_native_calls):
    # CI and the development machines have a C compiler and torch's MKL: the fast path must be tested
    assert native.available(), native.why_unavailable()
    inputs = make_inputs(1, 40, 2, 1, 8, 8, 5, 4, dtype=torch.float32)
    with torch.no_grad():
        vq_attention_chunk(**inputs, window=4, block_size=2)
    assert count_native_calls, "vq_attention_chunk did not run the compiled loop on float32 without autograd"


# (B, T, H, G, D, Dv, C, W, L, sinks, tile, segment, threads): odd sizes, several segments, an
# unaligned head, sinks, more threads than steps, W = 1
CASES = [
    (2, 301, 6, 2, 16, 18, 7, 37, 5, 3, 8, 64, 1),
    (1, 513, 4, 4, 8, 8, 5, 64, 16, 0, 16, 128, 2),
    (2, 200, 3, 1, 32, 8, 9, 5, 3, 2, 4, 40, 3),
    (1, 190, 2, 1, 4, 4, 3, 1, 1, 0, 2, 16, 2),
    (1, 130, 9, 3, 64, 64, 32, 48, 64, 4, 64, 4096, 2),
    (1, 150, 4, 2, 8, 8, 1, 16, 4, 1 << 62, 8, 64, 2),  # every key a sink: ReRoPE without quantization
]


@pytest.mark.parametrize("key_means", [False, True], ids=["codewords", "key-means"])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_native_matches_torch_loop_and_naive(monkeypatch, count_native_calls, case, key_means):
    B, T, H, G, D, Dv, C, W, L, sinks, tile, segment, threads = case
    monkeypatch.setattr(vq_chunk, "TILE", tile)
    monkeypatch.setattr(vq_chunk, "SEGMENT", segment)
    inputs = make_inputs(B, T, H, G, D, Dv, C, W, dtype=torch.float32, seed=3)
    kwargs = dict(window=W, block_size=L, sinks=sinks, key_means=key_means)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            fast, fast_state = vq_attention_chunk(**inputs, **kwargs, return_state=True)
            pieces, pieces_state = run_in_pieces(inputs, [T // 3, 1, T - T // 3 - 1], **kwargs)
            monkeypatch.setenv("EFFATTN_NATIVE", "0")
            n_native = len(count_native_calls)
            slow, slow_state = vq_attention_chunk(**inputs, **kwargs, return_state=True)
            assert len(count_native_calls) == n_native, "EFFATTN_NATIVE=0 did not turn the compiled loop off"
            assert native.why_unavailable() == "turned off by EFFATTN_NATIVE=0"
            ref = vq_attention_naive(**inputs, **kwargs)
    finally:
        torch.set_num_threads(previous)
    assert n_native > 0
    torch.testing.assert_close(fast, slow, rtol=0, atol=2e-6)
    torch.testing.assert_close(fast, ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(pieces, ref, rtol=0, atol=2e-6)
    for state in (fast_state, pieces_state):
        assert torch.equal(state.counts, slow_state.counts)
        torch.testing.assert_close(state.sums, slow_state.sums, rtol=0, atol=1e-5)
        assert state.seen == slow_state.seen == T
        if key_means:
            torch.testing.assert_close(state.key_sums, slow_state.key_sums, rtol=0, atol=1e-5)


def test_autograd_and_other_dtypes_keep_the_torch_loop(count_native_calls):
    inputs = make_inputs(1, 30, 2, 1, 8, 8, 5, 4, dtype=torch.float32)
    q = inputs.pop("q").requires_grad_(True)
    vq_attention_chunk(q=q, **inputs, window=4, block_size=2).sum().backward()
    with torch.no_grad():
        vq_attention_chunk(**make_inputs(1, 30, 2, 1, 8, 8, 5, 4), window=4, block_size=2)  # float64
    assert count_native_calls == [] and q.grad is not None


def test_a_failed_build_falls_back_with_its_reason(monkeypatch, tmp_path, count_native_calls):
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_why_not", "")  # restored after, as _lib is: later tests read the reason
    monkeypatch.setenv("EFFATTN_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    with pytest.warns(RuntimeWarning, match="compiled VQ step loop is unavailable .*failed to build native.c"):
        assert not native.available()  # said once, with the reason
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        assert not native.available()
    assert again == []  # once, not at every call
    assert "failed to build native.c" in native.why_unavailable()
    assert not list(tmp_path.rglob("*.so")), "a failed build left a library behind"
    inputs = make_inputs(1, 30, 2, 1, 8, 8, 5, 4, dtype=torch.float32)
    with torch.no_grad():
        out = vq_attention_chunk(**inputs, window=4, block_size=2)
    torch.testing.assert_close(out, vq_attention_naive(**inputs, window=4, block_size=2), rtol=0, atol=2e-6)
    assert count_native_calls == []


def _bf16_kernel_or_skip(monkeypatch, kernel):
    monkeypatch.setenv("EFFATTN_BF16_KERNEL", kernel)
    if native.bf16_kernel() != kernel:
        pytest.skip(f"the {kernel!r} bfloat16 products cannot run on this CPU (amx_bf16 / avx512_bf16)")


@pytest.mark.parametrize("kernel", ["own", "mkl"])
@pytest.mark.parametrize("key_means", [False, True], ids=["codewords", "key-means"])
def test_bf16_products_stay_within_bfloat16_rounding_of_the_float32_kernel(monkeypatch, key_means, kernel):
    """bf16_products: the compiled loop's products with the span and the code columns take bfloat16
    inputs (native.c's own AVX-512 BF16 kernels, or MKL's cblas_gemm_bf16bf16f32); the output stays within
    bfloat16's rounding of the float32 kernel's (3e-3 relative here), and the state (statistics, kept in
    float32) is the same."""
    _bf16_kernel_or_skip(monkeypatch, kernel)
    from .test_vq_kernels import assert_close

    inputs = make_inputs(2, 700, 9, 3, 64, 64, 64, 64, dtype=torch.float32, seed=3)
    settings = dict(window=64, block_size=64, sinks=2, key_means=key_means, return_state=True)
    ref, ref_state = vq_attention_chunk(**inputs, **settings)
    out, state = vq_attention_chunk(**inputs, **settings, bf16_products=True)
    assert_close("bf16 products", ref, out, 1e-2)
    assert (ref - out).abs().max() > 0  # the products did run in bfloat16
    assert torch.allclose(ref_state.sums, state.sums, rtol=1e-6, atol=1e-5)


# (B, T, H, G, D, Dv, C, W, L, sinks, tile, segment, threads): the own kernels' edges: odd span (W even)
# and odd codebook (padding), Dv = 48 (a 3-vector tail) and 128 (two column blocks), D = 128, more rows
# than a tile of 8 and fewer, sinks inside the far span, several segments split over threads, and an odd step
# length (Q = 5: steps of a segment start on odd rows, so those segments run in float32)
OWN_CASES = [
    (2, 301, 6, 2, 16, 16, 7, 38, 4, 3, 8, 64, 1),
    (1, 513, 4, 4, 32, 48, 5, 64, 16, 0, 16, 128, 2),
    (1, 300, 3, 1, 128, 128, 33, 20, 8, 70, 8, 64, 2),
    (1, 260, 9, 3, 64, 64, 32, 48, 64, 4, 64, 4096, 2),
    (2, 150, 2, 1, 8, 16, 9, 11, 5, 2, 8, 64, 1),
    (1, 200, 2, 2, 16, 32, 9, 13, 6, 1, 8, 64, 2),  # 6 rows a step: below one 8-row tile
]


@pytest.mark.parametrize("key_means", [False, True], ids=["codewords", "key-means"])
@pytest.mark.parametrize("case", OWN_CASES, ids=[f"case{i}" for i in range(len(OWN_CASES))])
def test_own_bf16_kernels_match_mkls_bf16_products(monkeypatch, case, key_means):
    """The own AVX-512 BF16 products (packed operands, a far span key's share merged into its span column)
    against MKL's bfloat16 products on the same bf16-rounded inputs: the same up to float32 summation
    order, and both within bfloat16's rounding of the float32 kernel."""
    _bf16_kernel_or_skip(monkeypatch, "own")
    if not hasattr(native._blas, "cblas_gemm_bf16bf16f32"):
        pytest.skip("torch's MKL has no cblas_gemm_bf16bf16f32")
    from .test_vq_kernels import assert_close

    B, T, H, G, D, Dv, C, W, L, sinks, tile, segment, threads = case
    monkeypatch.setattr(vq_chunk, "TILE", tile)
    monkeypatch.setattr(vq_chunk, "SEGMENT", segment)
    inputs = make_inputs(B, T, H, G, D, Dv, C, W, dtype=torch.float32, seed=5)
    settings = dict(window=W, block_size=L, sinks=sinks, key_means=key_means, return_state=True)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            ref, ref_state = vq_attention_chunk(**inputs, **settings)
            own, own_state = vq_attention_chunk(**inputs, **settings, bf16_products=True)
            monkeypatch.setenv("EFFATTN_BF16_KERNEL", "mkl")
            mkl, _ = vq_attention_chunk(**inputs, **settings, bf16_products=True)
    finally:
        torch.set_num_threads(previous)
    if (L * max(1, tile // L)) % 2:  # odd steps: multi-step segments keep float32 (here every segment)
        assert torch.equal(own, ref)
        return
    assert (own - ref).abs().max() > 0, "the own bfloat16 products did not run"
    assert_close("own bf16 products", ref, own, 1e-2)
    assert_close("own against MKL's bf16 products", mkl, own, 2e-5)
    assert torch.equal(own_state.counts, ref_state.counts)
    torch.testing.assert_close(own_state.sums, ref_state.sums, rtol=0, atol=1e-5)
