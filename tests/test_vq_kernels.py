"""Transformer-VQ attention kernels: the blockwise kernel against the naive reference (outputs and
gradients), and both against independent references (causal SDPA, direct ReRoPE)."""

import pytest
import torch
import torch.nn.functional as F

import effattn.kernels.vq.chunk as vq_chunk
from effattn.kernels.rope import apply_rope, rope_tables
from effattn.kernels.vq import VQState, nearest_codes, vq_attention_chunk, vq_attention_naive

TOL = {torch.float64: 1e-12, torch.float32: 2e-6}


def make_inputs(B, T, H, G, D, Dv, C, W, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    cos, sin = rope_tables(T, D, dtype=dtype)
    far_cos, far_sin = rope_tables(torch.tensor([W]), D, dtype=dtype)
    return dict(
        q=torch.randn(B, T, H, D, generator=g, dtype=dtype),
        k=torch.randn(B, T, G, D, generator=g, dtype=dtype),
        v=torch.randn(B, T, G, Dv, generator=g, dtype=dtype),
        codebook=torch.randn(G, C, D, generator=g, dtype=dtype),
        codes=torch.randint(0, C, (B, T, G), generator=g),
        cos=cos,
        sin=sin,
        far_cos=far_cos[0],
        far_sin=far_sin[0],
    )


def assert_close(name, ref, out, ratio):
    """Relative RMS error of ``out`` against ``ref``; fails on any NaN or inf."""
    assert torch.isfinite(out).all(), f"{name} has non-finite values"
    ref, out = ref.double(), out.double()
    err = ((ref - out).square().mean().sqrt() / ref.square().mean().sqrt().clamp_min(1e-30)).item()
    assert err <= ratio, f"{name}: relative error {err:.3e} > {ratio:.0e}"


def run_with_grads(fn, inputs, grad_out, **kwargs):
    """Output and gradients of (q, k, v, codebook) for the loss ``<fn(...), grad_out>``."""
    leaves = {name: inputs[name].clone().requires_grad_(True) for name in ("q", "k", "v", "codebook")}
    out = fn(**{**inputs, **leaves}, **kwargs)
    (out * grad_out).sum().backward()
    return out, {name: x.grad for name, x in leaves.items()}


def run_in_pieces(inputs, sizes, **kwargs):
    """Feed the sequence to the chunk kernel piece by piece, carrying the state."""
    state, outs, i = None, [], 0
    for n in sizes:
        piece = dict(inputs, cos=inputs["cos"][i : i + n], sin=inputs["sin"][i : i + n])
        piece.update({name: inputs[name][:, i : i + n] for name in ("q", "k", "v", "codes")})
        out, state = vq_attention_chunk(**piece, **kwargs, state=state, return_state=True)
        outs.append(out)
        i += n
    return torch.cat(outs, dim=1), state


# (B, T, H, G, D, Dv, C, W, L, sinks): odd sizes, GQA / MQA / MHA, W = 1, L = 1, L > W.
CONFIGS = [
    (2, 63, 6, 2, 62, 34, 11, 7, 5, 0),
    (2, 63, 6, 3, 62, 34, 11, 7, 5, 3),
    (1, 63, 6, 1, 62, 34, 11, 7, 5, 0),
    (1, 37, 4, 2, 8, 6, 5, 1, 1, 2),
    (2, 50, 4, 4, 10, 12, 7, 4, 9, 0),
    (1, 70, 3, 1, 16, 8, 5, 20, 3, 30),
]


@pytest.mark.parametrize("key_means", [False, True], ids=["codewords", "key-means"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "B{}-T{}-H{}-G{}-D{}-Dv{}-C{}-W{}-L{}-sinks{}".format(*c))
@pytest.mark.parametrize("tile, segment", [(4, 16), (64, 1024)], ids=["small-steps", "default-steps"])
def test_chunk_matches_naive(monkeypatch, config, dtype, tile, segment, key_means):
    monkeypatch.setattr(vq_chunk, "TILE", tile)  # steps of one block and of many blocks
    monkeypatch.setattr(vq_chunk, "SEGMENT", segment)  # several segments and one
    B, T, H, G, D, Dv, C, W, L, sinks = config
    inputs = make_inputs(B, T, H, G, D, Dv, C, W, dtype)
    grad_out = torch.randn(B, T, H, Dv, dtype=dtype, generator=torch.Generator().manual_seed(1))
    kwargs = dict(window=W, block_size=L, sinks=sinks, key_means=key_means)
    ref, ref_grads = run_with_grads(vq_attention_naive, inputs, grad_out, **kwargs)
    out, grads = run_with_grads(vq_attention_chunk, inputs, grad_out, **kwargs)
    assert out.dtype == dtype
    assert_close("output", ref, out, TOL[dtype])
    for name in ("q", "k", "v"):
        assert_close(f"d{name}", ref_grads[name], grads[name], TOL[dtype])
    # The codebook is reached only through .detach() (straight-through keys, aggregated summaries).
    assert ref_grads["codebook"] is None and grads["codebook"] is None
    with torch.no_grad():  # the inference path writes the output in place
        assert_close("no-grad output", ref, vq_attention_chunk(**inputs, **kwargs), TOL[dtype])


@pytest.mark.parametrize("kernel", [vq_attention_naive, vq_attention_chunk])
def test_window_covering_sequence_is_causal_rope_attention(kernel):
    B, T, H, G, D, Dv = 2, 29, 6, 2, 16, 10
    inputs = make_inputs(B, T, H, G, D, Dv, C=5, W=T)
    grad_out = torch.randn(B, T, H, Dv, dtype=torch.float64)
    out, grads = run_with_grads(kernel, inputs, grad_out, window=T, block_size=4)

    leaves = {name: inputs[name].clone().requires_grad_(True) for name in ("q", "k", "v")}
    cos, sin = inputs["cos"][:, None], inputs["sin"][:, None]
    q = apply_rope(leaves["q"], cos, sin).transpose(1, 2)  # (B, H, T, D)
    k = apply_rope(leaves["k"], cos, sin).repeat_interleave(H // G, dim=2).transpose(1, 2)
    v = leaves["v"].repeat_interleave(H // G, dim=2).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    (ref * grad_out).sum().backward()

    assert_close("output", ref, out, 1e-12)
    for name in ("q", "k", "v"):
        assert_close(f"d{name}", leaves[name].grad, grads[name], 1e-12)


def rerope_reference(q, k, v, cos, sin, window, far=None):
    """Causal attention whose relative positions beyond ``window`` are all replaced by ``far`` (ReRoPE;
    ``far = window`` clips them), with per-pair rotations: a far key s seen from query t is rotated to
    position ``t - far`` instead of s."""
    far = window if far is None else far
    B, T, H, D = q.shape
    k, v = (x.repeat_interleave(H // k.shape[2], dim=2) for x in (k, v))
    t = torch.arange(T)
    q_rot = apply_rope(q, cos[:, None], sin[:, None])  # (B, T, H, D)
    k_near = apply_rope(k, cos[:, None], sin[:, None])
    far_cos, far_sin = rope_tables(t - far, D, dtype=q.dtype)  # position of the far keys, per query (may be < 0)
    k_far = apply_rope(k[:, None], far_cos[:, None, None], far_sin[:, None, None])  # (B, Tq, Tk, H, D)
    near = torch.einsum("bthd,bshd->bhts", q_rot, k_near)
    far = torch.einsum("bthd,btshd->bhts", q_rot, k_far)
    delta = t[:, None] - t[None, :]
    logits = torch.where(delta < window, near, far).masked_fill(delta < 0, float("-inf")) * D**-0.5
    return (logits.softmax(-1) @ v.transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("kernel", [vq_attention_naive, vq_attention_chunk])
def test_lossless_codebook_is_rerope(kernel):
    """A codebook holding every key exactly makes quantization lossless: plain ReRoPE remains."""
    B, T, H, G, D, Dv, W = 2, 41, 4, 2, 12, 6, 6
    inputs = make_inputs(B, T, H, G, D, Dv, C=1, W=W)
    inputs["codebook"] = inputs["k"].permute(2, 0, 1, 3).reshape(G, B * T, D)  # entry b*T + t is k[b, t]
    inputs["codes"] = (torch.arange(B)[:, None, None] * T + torch.arange(T)[None, :, None]).expand(B, T, G)
    out = kernel(**inputs, window=W, block_size=5)
    ref = rerope_reference(inputs["q"], inputs["k"], inputs["v"], inputs["cos"], inputs["sin"], W)
    assert_close("output", ref, out, 1e-12)
    # far keys at another constant relative position F: the kernels take its RoPE row
    F = 4 * W
    far_cos, far_sin = rope_tables(torch.tensor([F]), D, dtype=torch.float64)
    out = kernel(**{**inputs, "far_cos": far_cos[0], "far_sin": far_sin[0]}, window=W, block_size=5)
    ref_far = rerope_reference(inputs["q"], inputs["k"], inputs["v"], inputs["cos"], inputs["sin"], W, far=F)
    assert_close("output, far position 4W", ref_far, out, 1e-12)
    assert (ref_far - ref).abs().max() > 1e-3  # the far position matters


def key_means_reference(q, k, v, codes, cos, sin, far_cos, far_sin, window, sinks=0):
    """Key means written out query by query: near keys exact, far sinks exact, and per code of the
    query's far keys one term ``count * exp(<rope(q, F), mean key>)`` carrying the mean value."""
    B, T, H, D = q.shape
    G = k.shape[2]
    out = torch.zeros(B, T, H, v.shape[3], dtype=q.dtype)
    q_near = apply_rope(q, cos[:, None], sin[:, None]) * D**-0.5
    k_near = apply_rope(k, cos[:, None], sin[:, None])
    q_far = apply_rope(q, far_cos, far_sin) * D**-0.5
    for b in range(B):
        for h in range(H):
            g = h // (H // G)
            for t in range(T):
                logits, values = [], []
                for s in range(max(0, t - window + 1), t + 1):
                    logits.append(q_near[b, t, h] @ k_near[b, s, g])
                    values.append(v[b, s, g])
                far = [s for s in range(0, t - window + 1)]
                for s in (s for s in far if s < sinks):
                    logits.append(q_far[b, t, h] @ k[b, s, g])
                    values.append(v[b, s, g])
                for c in sorted({int(codes[b, s, g]) for s in far if s >= sinks}):
                    members = [s for s in far if s >= sinks and int(codes[b, s, g]) == c]
                    logits.append(q_far[b, t, h] @ k[b, members, g].mean(0) + torch.log(torch.tensor(len(members), dtype=q.dtype)))
                    values.append(v[b, members, g].mean(0))
                p = torch.softmax(torch.stack(logits), 0)
                out[b, t, h] = (p[:, None] * torch.stack(values)).sum(0)
    return out


@pytest.mark.parametrize("kernel", [vq_attention_naive, vq_attention_chunk])
@pytest.mark.parametrize("sinks", [0, 3])
def test_key_means_score_each_code_at_the_mean_of_its_far_keys(kernel, sinks):
    B, T, H, G, D, Dv, C, W = 2, 30, 4, 2, 8, 6, 4, 5
    inputs = make_inputs(B, T, H, G, D, Dv, C, W)
    ref = key_means_reference(inputs["q"], inputs["k"], inputs["v"], inputs["codes"], inputs["cos"], inputs["sin"],
                              inputs["far_cos"], inputs["far_sin"], W, sinks)  # fmt: skip
    out = kernel(**inputs, window=W, block_size=4, sinks=sinks, key_means=True)
    assert_close("output", ref, out, 1e-12)
    codewords = kernel(**inputs, window=W, block_size=4, sinks=sinks)
    assert (codewords - out).abs().max() > 1e-2  # the codewords themselves no longer matter
    moved = kernel(**{**inputs, "codebook": inputs["codebook"] + 1.0}, window=W, block_size=4, sinks=sinks, key_means=True)
    assert_close("output with moved codewords", out, moved, 1e-12)


@pytest.mark.parametrize("kernel", [vq_attention_naive, vq_attention_chunk])
def test_key_means_with_one_key_per_code_is_rerope(kernel):
    """Each code holding one key of the sequence: its mean is that key, and plain ReRoPE remains."""
    B, T, H, G, D, Dv, W = 2, 41, 4, 2, 12, 6, 6
    inputs = make_inputs(B, T, H, G, D, Dv, C=T, W=W)
    inputs["codes"] = torch.arange(T)[None, :, None].expand(B, T, G)
    out = kernel(**inputs, window=W, block_size=5, key_means=True)
    ref = rerope_reference(inputs["q"], inputs["k"], inputs["v"], inputs["cos"], inputs["sin"], W)
    assert_close("output", ref, out, 1e-12)


def test_rope_rotations_compose():
    q, k = torch.randn(2, 10, dtype=torch.float64), torch.randn(2, 10, dtype=torch.float64)
    cos, sin = rope_tables(torch.tensor([3, 11, 8]), 10, dtype=torch.float64)
    lhs = (apply_rope(q, cos[1], sin[1]) * apply_rope(k, cos[2], sin[2])).sum(-1)  # <R_11 q, R_8 k>
    rhs = (apply_rope(q, cos[0], sin[0]) * k).sum(-1)  # <R_3 q, k>
    torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("key_means", [False, True], ids=["codewords", "key-means"])
@pytest.mark.parametrize("sinks", [0, 4])
@pytest.mark.parametrize(
    "sizes", [[1] * 45, [3, 1, 10, 2, 20, 9], [45], [7, 38]], ids=["tokens", "ragged", "whole", "two"]
)
def test_state_continues_the_sequence(sizes, sinks, key_means):
    W, L = 6, 4
    inputs = make_inputs(2, 45, 6, 3, 10, 8, 7, W)
    kwargs = dict(window=W, block_size=L, sinks=sinks, key_means=key_means)
    whole = vq_attention_naive(**inputs, **kwargs)
    pieces, state = run_in_pieces(inputs, sizes, **kwargs)
    assert_close("chunked output", whole, pieces, 1e-12)
    assert state.seen == 45 and state.recent_k.shape[2] == W - 1 and state.sink_k.shape[2] == sinks
    assert state.counts.sum().item() == 2 * 3 * (45 - (W - 1) - sinks)  # every older non-sink key, once
    if key_means:  # and its key, in its code's sum
        older = slice(sinks, 45 - (W - 1))
        onehot = F.one_hot(inputs["codes"][:, older], 7).double()  # (B, n, G, C)
        expected = torch.einsum("bngc,bngd->bgcd", onehot, inputs["k"][:, older])
        torch.testing.assert_close(state.key_sums, expected, rtol=0, atol=1e-12)
    else:
        assert state.key_sums is None


@pytest.mark.parametrize("key_means", [False, True], ids=["codewords", "key-means"])
def test_state_size_does_not_grow(key_means):
    W, sinks = 5, 2
    inputs = make_inputs(1, 90, 4, 2, 8, 8, 6, W)
    kwargs = dict(window=W, block_size=3, sinks=sinks, key_means=key_means)
    sizes = [run_in_pieces(inputs, [n], **kwargs)[1].nbytes() for n in (W + sinks, 30, 90)]
    assert sizes[0] == sizes[1] == sizes[2] > 0
    # the key sums: one key per code and head (G=2, C=6, D=8, float64) on top of the codeword state
    without = run_in_pieces(inputs, [90], window=W, block_size=3, sinks=sinks)[1].nbytes()
    assert sizes[2] - without == (2 * 6 * 8 * 8 if key_means else 0)
    _, state = run_in_pieces(inputs, [2], **kwargs)  # before the window fills, the state is smaller
    assert isinstance(state, VQState) and state.nbytes() < sizes[0]


@pytest.mark.parametrize("kernel", [vq_attention_naive, vq_attention_chunk])
def test_sinks_keep_exact_keys(kernel):
    """Sinks behave as if each had a private codeword equal to its key."""
    T, G, D, C, W, sinks = 40, 2, 8, 6, 5, 3
    inputs = make_inputs(1, T, 4, G, D, 8, C, W)
    out = kernel(**inputs, window=W, block_size=4, sinks=sinks)

    exact = dict(inputs)
    sink_keys = inputs["k"][0, :sinks].transpose(0, 1)  # (G, sinks, D)
    exact["codebook"] = torch.cat((inputs["codebook"], sink_keys), dim=1)  # (G, C + sinks, D)
    exact["codes"] = inputs["codes"].clone()
    exact["codes"][0, :sinks] = C + torch.arange(sinks)[:, None]
    assert_close("output", kernel(**exact, window=W, block_size=4), out, 1e-12)
    quantized = kernel(**inputs, window=W, block_size=4)
    assert (quantized - out).abs().max() > 1e-3  # the sink keys' own codewords would change the output


@pytest.mark.parametrize("key_means", [False, True], ids=["codewords", "key-means"])
@pytest.mark.parametrize("tile", [4, 64])
@pytest.mark.parametrize("kernel", ["naive", "chunk"])
def test_stop_gradient_follows_the_block_rule(monkeypatch, kernel, tile, key_means):
    """Query t=15 with L=4, W=3: keys s <= floor(15/4)*4 - 3 = 9 are aggregated and get no gradient."""
    monkeypatch.setattr(vq_chunk, "TILE", tile)
    fn = vq_attention_naive if kernel == "naive" else vq_attention_chunk
    inputs = make_inputs(1, 20, 1, 1, 8, 4, 3, 3)
    leaves = {name: inputs[name].clone().requires_grad_(True) for name in ("q", "k", "v")}
    out = fn(**{**inputs, **leaves}, window=3, block_size=4, key_means=key_means)
    out[0, 15].sum().backward()
    for name in ("k", "v"):
        norms = leaves[name].grad[0, :, 0].norm(dim=-1)  # (T,)
        assert (norms[:10] == 0).all(), f"aggregated keys got a {name} gradient"
        assert (norms[10:16] > 0).all(), f"far but not aggregated keys lost their {name} gradient"
        assert (norms[16:] == 0).all(), "future keys got a gradient"
    assert leaves["q"].grad[0, 15].norm() > 0


@pytest.mark.parametrize("kernel", [vq_attention_naive, vq_attention_chunk])
def test_low_precision_inputs_accumulate_in_float32(kernel):
    inputs = make_inputs(1, 30, 4, 2, 16, 8, 5, 4, dtype=torch.bfloat16)
    out = kernel(**inputs, window=4, block_size=3)
    ref = kernel(**{n: x.float() if x.is_floating_point() else x for n, x in inputs.items()}, window=4, block_size=3)
    assert out.dtype == torch.bfloat16
    assert_close("bfloat16 output", ref, out, 4e-3)  # bf16 rounding of the result only


def bad(**changes):
    inputs = make_inputs(1, 8, 6, 2, 8, 4, 5, 3)
    return {**inputs, **changes}


INVALID = [
    (
        bad(
            k=torch.randn(1, 8, 4, 8),
            v=torch.randn(1, 8, 4, 4),
            codebook=torch.randn(4, 5, 8),
            codes=torch.zeros(1, 8, 4, dtype=torch.long),
        ),
        {},
        "6 heads, which is not a multiple of the 4 key/value heads",
    ),
    (bad(q=torch.randn(8, 6, 8)), {}, r"q must have 4 dimensions .* got shape \(8, 6, 8\)"),
    (bad(k=torch.randn(1, 7, 2, 8)), {}, "must share batch and time sizes"),
    (bad(codebook=torch.randn(2, 5, 6)), {}, r"codebook must have shape .* got \(2, 5, 6\)"),
    (bad(codes=torch.full((1, 8, 2), 5)), {}, r"codes must lie in \[0, 5\) .* \[5, 5\]"),
    (bad(codes=torch.zeros(1, 8, 2)), {}, "codes must be an integer tensor"),
    (bad(cos=torch.randn(9, 8)), {}, r"cos must have shape \[T, head_dim\] = \[8, 8\], got \(9, 8\)"),
    (bad(far_sin=torch.randn(1, 8)), {}, "far_sin must have shape"),
    (bad(), {"window": 0}, "window must be an integer >= 1, got 0"),
    (bad(), {"block_size": 2.5}, "block_size must be an integer >= 1, got 2.5"),
    (bad(), {"sinks": -1}, "sinks must be an integer >= 0, got -1"),
]


@pytest.mark.parametrize("kernel", [vq_attention_naive, vq_attention_chunk])
@pytest.mark.parametrize("inputs, overrides, message", INVALID)
def test_invalid_inputs_raise_explanations(kernel, inputs, overrides, message):
    kwargs = {"window": 3, "block_size": 2, **overrides}
    with pytest.raises(ValueError, match=message) as error:
        kernel(**inputs, **kwargs)
    assert str(error.value).endswith(".") and ";" in str(error.value)  # a sentence saying what to do


def test_odd_head_dim_is_rejected():
    inputs = make_inputs(1, 8, 2, 1, 8, 4, 5, 3)
    inputs.update(q=torch.randn(1, 8, 2, 7), k=torch.randn(1, 8, 1, 7), codebook=torch.randn(1, 5, 7))
    inputs.update(cos=torch.randn(8, 7), sin=torch.randn(8, 7), far_cos=torch.randn(7), far_sin=torch.randn(7))
    with pytest.raises(ValueError, match="head_dim must be even for rotate-half RoPE, got 7"):
        vq_attention_chunk(**inputs, window=3, block_size=2)


def test_state_from_other_settings_is_rejected():
    inputs = make_inputs(1, 8, 2, 1, 8, 4, 5, 3)
    _, state = vq_attention_chunk(**inputs, window=3, block_size=2, return_state=True)
    with pytest.raises(ValueError, match="built with window=3, sinks=0, key_means=False but this call uses window=4"):
        vq_attention_chunk(**inputs, window=4, block_size=2, state=state)
    with pytest.raises(ValueError, match="key_means=False but this call uses window=3, sinks=0, key_means=True"):
        vq_attention_chunk(**inputs, window=3, block_size=2, state=state, key_means=True)
    other_batch = make_inputs(2, 8, 2, 1, 8, 4, 5, 3)
    with pytest.raises(ValueError, match=r"state.counts has shape \(1, 1, 5\) but these inputs need \(2, 1, 5\)"):
        vq_attention_chunk(**other_batch, window=3, block_size=2, state=state)


@pytest.mark.slow
def test_bench_attention_measures_every_point(tmp_path):
    from effattn.bench import bench_attention, format_table, plot_bench

    kwargs = dict(heads=2, kv_heads=1, head_dim=8, window=8, codebook_size=4, block_size=4, repeats=1)
    results = bench_attention(["sdpa", "vq", "vq_naive"], [96], **kwargs)  # one subprocess per point
    assert [(r["kind"], r["length"]) for r in results] == [("sdpa", 96), ("vq", 96), ("vq_naive", 96)]
    for r in results:
        assert r["time_s"] > 0 and r["cpu_time_s"] > 0 and r["peak_mem_bytes"] >= 0
        assert r["output_bytes"] == 96 * 2 * 8 * 4  # (T, heads, head_dim) float32
    table = format_table(results)
    assert table.count("\n") == 1 + len(results) and "| vq | 96 | " in table
    assert plot_bench(results, tmp_path / "bench.png").stat().st_size > 0


def test_bench_attention_rejects_bad_settings():
    from effattn.bench import bench_attention

    with pytest.raises(ValueError, match=r"Unknown attention kind\(s\) \['flash'\]"):
        bench_attention(["flash"], [64])
    with pytest.raises(ValueError, match="vq_naive is limited to lengths <= 8192"):
        bench_attention(["vq_naive"], [16384])
    with pytest.raises(ValueError, match="heads=9 is not a multiple of kv_heads=2"):
        bench_attention(["vq"], [64], kv_heads=2)


@pytest.mark.parametrize("compiled", ["1", "0"], ids=["compiled", "torch"])
@pytest.mark.parametrize("C", [5, 64, 96, 512])
def test_nearest_codes_is_the_nearest_codeword_first_on_ties(monkeypatch, C, compiled):
    """Both scorers: native.c's vq_nearest (float32 on the CPU, rows split over threads) and the
    batched products of codes.py (EFFATTN_NATIVE=0)."""
    monkeypatch.setenv("EFFATTN_NATIVE", compiled)
    from effattn.kernels.vq import native

    calls = []
    real = native.nearest_codes
    monkeypatch.setattr(native, "nearest_codes", lambda *a: (calls.append(1), real(*a))[1])
    g = torch.Generator().manual_seed(C)
    k = torch.randn(2, 1500, 3, 8, generator=g)  # more positions than one pass of CHUNK
    codebook = torch.randn(3, C, 8, generator=g)
    k[0, :10] = codebook[:, C - 1]  # exactly on a codeword (distance 0, in the last run of scores)
    codebook[:, C // 2] = codebook[:, C - 1]  # ... that has an identical twin earlier: ties go to it
    metric = torch.randn(3, 8, 8, generator=g)
    for w in (None, metric):
        kw = k if w is None else torch.einsum("btgd,gde->btge", k, w)
        cw = codebook if w is None else torch.einsum("gcd,gde->gce", codebook, w)
        distances = (kw[..., None, :] - cw[None, None]).square().sum(-1)  # (B, T, G, C)
        previous = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            codes = nearest_codes(k, codebook, w)
        finally:
            torch.set_num_threads(previous)
        chosen = distances.gather(-1, codes[..., None])[..., 0]
        assert torch.allclose(chosen, distances.amin(-1), rtol=1e-5, atol=1e-5)
        assert (codes[0, :10] == C // 2).all()
    assert len(calls) == (2 if compiled == "1" else 0)  # the scorer asked for ran, for both metrics
