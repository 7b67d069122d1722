"""Sparse attention patterns (`--to sparse`): FlexAttention block masks against the reference masks,
the kernels against masked softmax, and the effattn_sparse model against the original under the mask."""

from __future__ import annotations

import json

import pytest
import torch

from effattn.convert import convert
from effattn.kernels.patterns import Pattern, block_mask, dense_mask, density, flex_attention_pattern, naive_attention

from .test_cli_errors import assert_one_line_error, run_cli

PATTERNS = [Pattern("window", window=40, sinks=4), Pattern("longformer", window=20, dilation=3, global_tokens=5),
            Pattern("bigbird", block=32, window_blocks=3, global_blocks=1, random_blocks=2, seed=1, max_length=4096),
            Pattern("strided", stride=24, local=30)]


def test_each_pattern_is_what_its_paper_describes():
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    w = dense_mask(Pattern("window", window=3, sinks=1), 9)
    assert w[8].nonzero().flatten().tolist() == [0, 6, 7, 8]
    lf = dense_mask(Pattern("longformer", window=3, dilation=2, global_tokens=1), 9)
    assert lf[8].nonzero().flatten().tolist() == [0, 4, 6, 8]  # global 0; 3 keys 2 apart
    assert lf[:, 0].all() and torch.equal(lf[0], causal[0])  # the global token is read by all
    st = dense_mask(Pattern("strided", stride=3, local=2), 9)
    assert st[8].nonzero().flatten().tolist() == [2, 5, 7, 8]
    bb = Pattern("bigbird", block=2, window_blocks=2, global_blocks=1, random_blocks=1, seed=0, max_length=64)
    m = dense_mask(bb, 16)
    table = bb.random_table("cpu")
    for qb in range(8):
        own = {qb, qb - 1} if qb else {0}
        randoms = set(table[qb].nonzero().flatten().tolist())
        assert len(randoms) == (1 if qb >= 3 else 0) and all(1 <= r < qb - 1 for r in randoms)
        keys = {kv // 2 for kv in m[2 * qb + 1].nonzero().flatten().tolist()}
        assert keys == own | {0} | randoms
    for mask in (w, lf, st, m[:9, :9]):
        assert not (mask & ~causal).any()  # causal
    assert Pattern("bigbird", seed=3).random_table("cpu").equal(Pattern("bigbird", seed=3).random_table("cpu"))
    assert not Pattern("bigbird", seed=3).random_table("cpu").equal(Pattern("bigbird", seed=4).random_table("cpu"))


@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: p.name)
def test_block_masks_equal_the_reference_masks(pattern):
    T, B = 512, 128
    bm = block_mask(pattern, T, T)
    dense = dense_mask(pattern, T)
    blocks = dense.view(T // B, B, T // B, B)
    any_, all_ = blocks.any(3).any(1), blocks.all(3).all(1)
    listed = bm.to_dense()[0, 0].bool()  # every block the kernel visits (partial or full)
    assert torch.equal(listed, any_)
    full = torch.zeros_like(listed)  # blocks marked full skip the mask: they must be all True
    if bm.full_kv_num_blocks is not None:
        for qb in range(T // B):
            n = int(bm.full_kv_num_blocks[0, 0, qb])
            full[qb, bm.full_kv_indices[0, 0, qb, :n]] = True
    assert not (full & ~all_).any()


@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: p.name)
def test_flex_attention_agrees_with_masked_softmax(pattern):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 512, 16, generator=g) for h in (4, 2, 2))
    ref = naive_attention(q, k, v, pattern, 0.25)
    torch.testing.assert_close(flex_attention_pattern(q, k, v, pattern, 0.25, compiled=False), ref, rtol=1e-5, atol=1e-5)
    # the reference itself: scores masked densely, queries in chunks or not
    dense = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, 1)) * 0.25
    dense = dense.masked_fill(~dense_mask(pattern, 512), -torch.inf).softmax(-1)
    torch.testing.assert_close(torch.einsum("bhqk,bhkd->bhqd", dense, v.repeat_interleave(2, 1)), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(naive_attention(q, k, v, pattern, 0.25, chunk=100), ref, rtol=0, atol=1e-6)


def test_the_compiled_kernel_agrees_with_masked_softmax():
    pattern = Pattern("strided", stride=64)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 1024, 16, generator=g) for h in (4, 2, 2))
    torch.testing.assert_close(flex_attention_pattern(q, k, v, pattern, 0.25), naive_attention(q, k, v, pattern, 0.25),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stride,local,kv_len,q_len", [(64, None, 1024, 1024), (32, 80, 700, 700), (16, 5, 300, 37)])
def test_strided_runs_as_two_block_sparse_parts_that_cover_the_pattern(stride, local, kv_len, q_len):
    """strided is not block-sparse in text order; its two parts are, each in its own order, and merged
    through the diagonal's copies they give the masked softmax (compiled or not, queries after a cache)."""
    from effattn.kernels.patterns import strided_layout

    pattern = Pattern("strided", stride=stride, local=local)
    q_order, k_order, q_inverse, near, far = strided_layout(pattern, q_len, kv_len)
    near_m = near.to_dense()[0, 0].bool().repeat_interleave(128, 0).repeat_interleave(128, 1)[:q_len, :2 * kv_len]
    assert near_m.shape == (q_len, 2 * kv_len)
    # evaluate both parts pair by pair and map the far part back to text order
    q = torch.arange(q_len)[:, None]
    kv = torch.arange(2 * kv_len)[None]
    near_pairs = near.mask_mod(None, None, q, kv)
    far_pairs = far.mask_mod(None, None, q, kv)
    far_text = torch.zeros(q_len, kv_len, dtype=torch.bool)
    far_text[q_order[:, None], k_order[None]] = far_pairs[:, :kv_len]
    dense = dense_mask(pattern, q_len, kv_len)
    assert not (near_pairs[:, :kv_len] & far_text).any()  # disjoint
    assert torch.equal(near_pairs[:, :kv_len] | far_text, dense)  # together: the pattern
    diagonal = torch.zeros(q_len, kv_len, dtype=torch.bool)
    diagonal[torch.arange(q_len), torch.arange(kv_len - q_len, kv_len)] = True
    assert torch.equal(near_pairs[:, kv_len:], diagonal)  # the copies: each query's own key only
    far_copy = torch.zeros(q_len, kv_len, dtype=torch.bool)
    far_copy[q_order[:, None], k_order[None]] = far_pairs[:, kv_len:]
    assert torch.equal(far_copy, diagonal)
    assert not (near_pairs & ~near_m).any()  # the block mask lists every block the part reads
    # far blocks in residue order are few: at most a few per query block, not all of them
    if q_len == kv_len == 1024:
        assert far.kv_num_blocks.max() <= 3 < 2 * kv_len // 128
    g = torch.Generator().manual_seed(2)
    qq = torch.randn(2, 4, q_len, 16, generator=g)
    k, v = (torch.randn(2, 2, kv_len, 16, generator=g) for _ in range(2))
    ref = naive_attention(qq, k, v, pattern, 0.25)
    for compiled in (False, True):
        torch.testing.assert_close(flex_attention_pattern(qq, k, v, pattern, 0.25, compiled=compiled), ref,
                                   rtol=1e-5, atol=1e-5)


def test_strided_falls_back_to_the_reference_where_the_diagonal_weight_underflows():
    """A query whose own score is thousands below its best gives the diagonal's copy a zero weight in
    float32: the merge would divide by zero, so the reference runs."""
    T, D = 256, 16
    q = torch.zeros(1, 1, T, D)
    q[..., 0] = 100.0
    k = torch.zeros(1, 1, T, D)
    k[..., 1] = 1.0
    k[0, 0, 0, 0] = 100.0  # key 0: score 2,500 for every query; every other key (the diagonal too): 0
    v = torch.randn(1, 1, T, D, generator=torch.Generator().manual_seed(0))
    pattern = Pattern("strided", stride=32)
    out = flex_attention_pattern(q, k, v, pattern, 0.25, compiled=False)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, naive_attention(q, k, v, pattern, 0.25), rtol=1e-5, atol=1e-5)


def test_density_counts_the_causal_pairs_kept():
    assert density(Pattern("window", window=1), 100) == pytest.approx(100 / 5050)
    assert density(Pattern("strided", stride=1), 64) == 1.0
    w = Pattern("window", window=256)
    assert density(w, 16384) < density(w, 4096) < density(w, 1024)


def _sparse(tiny, tmp_path, kernel="naive", **options):
    src = tiny("llama", layers=2)
    options = {"pattern": "longformer", "window": 20, "dilation": 2, "global_tokens": 3, "kernel": kernel} | options
    return src, convert(src, tmp_path / f"sparse-{kernel}", to="sparse", options=options, measure=False).out


@pytest.mark.parametrize("kernel", ["naive", "flex"])
def test_the_sparse_model_is_the_original_under_the_patterns_mask(tiny, tmp_path, kernel, monkeypatch):
    from transformers import AutoModelForCausalLM

    import effattn.attention.sparse as sparse

    monkeypatch.setattr(sparse, "FLEX_MIN_LENGTH", 64)
    src, out = _sparse(tiny, tmp_path, kernel)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "effattn_sparse" and config["sparse_kernel"] == kernel
    pattern = Pattern(**config["sparse_pattern"])
    dtype = torch.float32 if kernel == "flex" else torch.float64  # FlexAttention on the CPU: float32 at most
    model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()
    original = AutoModelForCausalLM.from_pretrained(src, dtype=dtype).eval()
    ids = torch.randint(0, 250, (2, 256), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model(input_ids=ids).logits
        ref = original(input_ids=ids, attention_mask=dense_mask(pattern, 256)[None, None]).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4 if kernel == "flex" else 1e-10)


def test_decoding_reads_the_pattern_rows_through_the_cache(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    _, out = _sparse(tiny, tmp_path, "naive", pattern="bigbird", window=None, dilation=None, global_tokens=None,
                     block=8, random_blocks=2, seed=3)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    ids = torch.randint(0, 250, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False)
        seq = ids
        for _ in range(40):
            logits = model(input_ids=seq, use_cache=False).logits[:, -1]
            logits[:, 257] = -torch.inf  # min_new_tokens keeps generate() from ending (the byte tokenizer's eos)
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(generated, seq)


def test_the_sparse_model_loads_with_remote_code_alone(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from .remote import remote_logits

    _, out = _sparse(tiny, tmp_path, "naive", pattern="strided", window=None, dilation=None, global_tokens=None,
                     stride=8)
    ids = torch.randint(0, 250, (1, 40), generator=torch.Generator().manual_seed(5))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    torch.testing.assert_close(remote_logits(out, ids, "EffattnSparseForCausalLM", tmp_path), expected, rtol=0, atol=0)


def test_dry_run_reports_the_density(tiny, capsys):
    code, out, err = run_cli(capsys, "convert", tiny("llama", layers=2), "--to", "bigbird", "--dry-run", "--no-eval")
    assert code == 0, err
    assert "effattn_sparse" in out and "of causal pairs" in out


@pytest.mark.parametrize("args,needle", [
    ([], "needs --pattern"),
    (["--pattern", "longformer", "--stride", "4"], "--stride applies to --pattern strided"),
    (["--pattern", "bigbird", "--window", "4"], "--window applies to --pattern longformer"),
    (["--pattern", "dense"], "pattern"),
    (["--pattern", "strided", "--stride", "0"], "stride"),
])
def test_bad_pattern_options_are_refused_in_one_line(tiny, tmp_path, capsys, args, needle):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", tiny("llama", layers=2), "--to", "sparse", *args, "-o", out)
    assert_one_line_error(code, err, needle)
    assert code == 2 and not out.exists()


@pytest.mark.parametrize("args", [["--pattern", "strided", "--stride", "3", "--local", "2"],
                                  ["--pattern", "longformer", "--window", "3", "--global-tokens", "2"],
                                  ["--pattern", "bigbird", "--block", "2", "--window-blocks", "2"]],
                         ids=["strided", "longformer", "bigbird"])
def test_a_left_padded_batch_reads_as_each_prompt_alone(tiny, tmp_path, capsys, args):
    """The sparse model refused padding: a batch of prompts of different lengths (generate() pads them in front)
    could not run. Each row's pattern now starts at its first real token, and no real query reads padding."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "sparse"
    code, _, err = run_cli(capsys, "convert", tiny("llama", layers=2), "--to", "sparse", *args, "-o", out, "--no-eval")
    assert code in (0, None), err
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    from .test_padded_batches import assert_rows_read_alone, prompts_of

    prompts = prompts_of()
    ids, mask, _ = assert_rows_read_alone(model, prompts)
    width = ids.shape[1]
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        for row, p in enumerate(prompts):
            alone = model.generate(p[None], max_new_tokens=5, do_sample=False, pad_token_id=0)
            assert torch.equal(generated[row, width:], alone[0, len(p):])
        holes = mask.clone()
        holes[0, 5] = 0
        with pytest.raises(ValueError, match="not between them"):
            model(input_ids=ids, attention_mask=holes)
