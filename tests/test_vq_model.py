"""Transformer-VQ conversions on tiny random models: exactness where the maths allows it, the cache,
remote code, training hooks, k-means, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import effattn  # noqa: F401  (registers effattn_vq)
from effattn.attention.vq import EffattnVQForCausalLM, VQCache, nearest_codes
from effattn.kernels.build import cpu_flags
from effattn.convert import convert
from effattn.convert.kmeans import kmeans
from effattn.errors import EffattnError

from .conftest import FAMILY_CONFIGS, logits_of
from .test_cli_errors import assert_one_line_error, run_cli

FAMILIES = list(FAMILY_CONFIGS)
IDS = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold jumpers".split()
    gen = torch.Generator().manual_seed(0)
    path.write_text(" ".join(words[i] for i in torch.randint(len(words), (6000,), generator=gen)))
    return path


def vq_init(src: Path, out: Path, calib: Path, **options) -> Path:
    opts = {"codebook_size": 16, "window": 16, "calib": str(calib), "calib_tokens": 1024, "calib_seq_len": 128,
            "heavy_keys": 0} | options  # plain VQ unless a test asks for heavy hitters (vq-init's default)
    return convert(src, out, to="vq", options=opts, measure=False).out


def load(folder: Path, **overrides):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    for key, value in overrides.items():
        setattr(model.config, key, value)
    return model


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def decode_matches_full_forward(model, ids, prefix: int = 40):
    """Prefill `prefix` tokens, then decode the rest one by one through the VQCache: the logits must be the
    full forward pass's. Returns the cache and its size after each decoded token."""
    full = logits(model, ids)
    with torch.no_grad():
        out = model(input_ids=ids[:, :prefix], use_cache=True)
        cache, steps, sizes = out.cache, [out.logits], []
        assert isinstance(cache, VQCache)
        for t in range(prefix, ids.shape[1]):
            out = model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits)
            sizes.append(cache.nbytes())
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-9, atol=1e-9)
    assert cache.get_seq_length() == ids.shape[1]
    return cache, sizes


@pytest.mark.parametrize("family", FAMILIES)
def test_rerope_with_a_window_covering_the_sequence_is_the_original(tiny, tmp_path, family):
    src = tiny(family, heads=6, kv_heads=3, head_dim=8)
    out = convert(src, tmp_path / "rerope", to="rerope", options={"window": IDS.shape[1]}, measure=False).out
    model = load(out)
    assert isinstance(model, EffattnVQForCausalLM) and not model.config.vq_quantize
    torch.testing.assert_close(logits(model), logits_of(src, IDS, torch.float64), rtol=1e-9, atol=1e-9)
    # and a short window changes the far logits: ReRoPE is not a no-op
    model.config.vq_window = 8
    assert (logits(model) - logits_of(src, IDS, torch.float64)).abs().max() > 1e-3


def test_far_position_defaults_to_four_windows_and_drives_the_far_logits(tiny, tmp_path):
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    default = load(convert(src, tmp_path / "default", to="rerope", options={"window": 8}, measure=False).out)
    assert default.config.vq_window == 8 and default.config.vq_far_position == 32
    chosen = load(convert(src, tmp_path / "chosen", to="rerope", options={"window": 8, "far_position": 20},
                          measure=False).out)  # fmt: skip
    assert chosen.config.vq_far_position == 20
    assert (logits(chosen) - logits(default)).abs().max() > 1e-3
    chosen.config.vq_far_position = 32  # the config value is what the model uses
    torch.testing.assert_close(logits(chosen), logits(default), rtol=1e-12, atol=1e-12)
    chosen.config.vq_far_position = None  # models written before the option: the window itself
    classic = load(convert(src, tmp_path / "classic", to="rerope", options={"window": 8, "far_position": 8},
                           measure=False).out)  # fmt: skip
    torch.testing.assert_close(logits(chosen), logits(classic), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
def test_vq_with_a_window_covering_the_sequence_is_the_rerope_model(tiny, tmp_path, calib_file, family):
    src = tiny(family, heads=6, kv_heads=3, head_dim=8)
    vq = load(vq_init(src, tmp_path / "vq", calib_file))
    rerope = load(convert(src, tmp_path / "rerope", to="rerope", options={"window": 16}, measure=False).out)
    assert vq.config.vq_quantize and tuple(vq.model.layers[0].self_attn.codebook.shape) == (3, 16, 8)
    for model in (vq, rerope):
        model.config.vq_window = IDS.shape[1]
    torch.testing.assert_close(logits(vq), logits(rerope), rtol=1e-9, atol=1e-9)
    # with the real window, quantization is what separates them; with every key a sink, nothing is quantized
    vq.config.vq_window = rerope.config.vq_window = 16
    assert (logits(vq) - logits(rerope)).abs().max() > 1e-4
    vq.config.vq_sinks = IDS.shape[1]
    torch.testing.assert_close(logits(vq), logits(rerope), rtol=1e-9, atol=1e-9)


def test_blockwise_kernel_equals_the_naive_reference_in_the_model(tiny, tmp_path, calib_file):
    src = tiny("qwen2", heads=6, kv_heads=2, head_dim=8)
    model = load(vq_init(src, tmp_path / "vq", calib_file, sinks=3))
    chunk = logits(model)
    model.config.vq_kernel = "naive"
    torch.testing.assert_close(chunk, logits(model), rtol=1e-9, atol=1e-9)


def test_cached_decoding_matches_the_full_forward_and_the_cache_stops_growing(tiny, tmp_path, calib_file):
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    model = load(vq_init(src, tmp_path / "vq", calib_file, sinks=2))
    ids = IDS[:1]
    cache, sizes = decode_matches_full_forward(model, ids)
    assert len(set(sizes)) == 1  # window + sinks + per-code statistics: constant past the window
    generated = model.generate(ids[:, :8], max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert generated.shape == (1, 32)
    # greedy decoding through the cache picks what the full forward pass over the result predicts
    predicted = logits(model, generated)[0, 7:-1]
    predicted[:, model.generation_config.eos_token_id] = float("-inf")  # min_new_tokens suppresses EOS
    assert torch.equal(predicted.argmax(-1), generated[0, 8:])


def test_key_means_are_the_default_and_decode_through_a_cache_of_key_sums(tiny, tmp_path, calib_file):
    from effattn.evaluate import kv_cache_bytes

    src = tiny("llama", heads=6, kv_heads=3, head_dim=8, layers=2)
    means = load(vq_init(src, tmp_path / "means", calib_file, sinks=2))
    codewords = load(vq_init(src, tmp_path / "codewords", calib_file, sinks=2, key_means=False))
    assert means.config.vq_key_means and not codewords.config.vq_key_means
    # the same codebooks (key means change what a code is scored at, not the partition of the
    # first layer, whose inputs do not depend on attention), different outputs
    a, b = means.model.layers[0].self_attn, codewords.model.layers[0].self_attn
    torch.testing.assert_close(a.codebook, b.codebook, rtol=0, atol=0)
    assert (logits(means) - logits(codewords)).abs().max() > 1e-3
    cache, sizes = decode_matches_full_forward(means, IDS[:1])
    assert len(set(sizes)) == 1  # constant past the window
    long = torch.randint(0, 256, (1, 400))
    # one pre-RoPE key sum per code, KV head and layer (C=16, head_dim 8, float64) on top of the codeword cache
    assert kv_cache_bytes(means, long) - kv_cache_bytes(codewords, long) == 2 * 3 * 16 * 8 * 8
    chunk = logits(means)
    means.config.vq_kernel = "naive"
    torch.testing.assert_close(chunk, logits(means), rtol=1e-9, atol=1e-9)


def test_key_means_refuse_the_code_bias_at_load(tiny, tmp_path, calib_file):
    folder = vq_init(tiny("llama", heads=6, kv_heads=3, head_dim=8), tmp_path / "vq", calib_file)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"vq_code_bias": True}))
    with pytest.raises(ValueError, match="vq_key_means and vq_code_bias do not combine"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_code_bias_is_one_logit_offset_per_code(tiny, tmp_path, calib_file):
    src = tiny("qwen3", heads=6, kv_heads=3, head_dim=8)
    model = load(vq_init(src, tmp_path / "vq", calib_file, code_bias=True, sinks=2))
    assert model.config.vq_code_bias and model.model.layers[0].self_attn.code_bias.abs().sum() > 0
    with_bias = logits(model)
    for attn in model.vq_attention_modules():  # a zero bias: the extra RoPE pair changes nothing
        attn.code_bias.zero_()
    zero = logits(model)
    model.config.vq_code_bias = False
    torch.testing.assert_close(zero, logits(model), rtol=1e-9, atol=1e-9)
    assert (with_bias - zero).abs().max() > 1e-4
    model.config.vq_code_bias, model.config.vq_kernel = True, "naive"  # both kernels agree with it on
    for attn in model.vq_attention_modules():
        attn.code_bias.fill_(0.5)
    naive = logits(model)
    model.config.vq_kernel = "chunk"
    torch.testing.assert_close(naive, logits(model), rtol=1e-9, atol=1e-9)


def test_eval_measures_the_vq_cache(tiny, tmp_path, calib_file):
    from effattn.evaluate import kv_cache_bytes

    src = tiny("llama", heads=6, kv_heads=3, head_dim=8, layers=2)
    model = load(vq_init(src, tmp_path / "vq", calib_file, code_bias=True))
    base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64)
    long = torch.randint(0, 256, (1, 400))
    vq_bytes, base_bytes = kv_cache_bytes(model, long), kv_cache_bytes(base, long)
    # per layer, float64: the window's 15 keys (head_dim 8, +2 for the code-bias pair) and values of 3
    # heads, their codes (int64) and RoPE rows (cos, sin), and per code of each head a count and a value sum
    assert model.config.vq_code_bias
    per_layer = 15 * 3 * (10 + 8) * 8 + 15 * 3 * 8 + 15 * 10 * 2 * 8 + 3 * 16 * 8 + 3 * 16 * 8 * 8
    assert vq_bytes == 2 * per_layer
    assert base_bytes == 2 * 3 * 400 * 2 * 8 * 8
    assert vq_bytes < base_bytes / 5


def test_remote_code_loads_without_effattn(tiny, tmp_path, calib_file):
    src = tiny("qwen3", heads=6, kv_heads=3, head_dim=8)
    out = vq_init(src, tmp_path / "vq", calib_file, sinks=1, exact_heads=2)  # split layers too
    assert "auto_map" in json.loads((out / "config.json").read_text())
    assert "import effattn" in (out / "README.md").read_text()  # the card's Load section says how
    from .remote import remote_logits

    got = remote_logits(out, IDS, "EffattnVQForCausalLM", tmp_path)
    torch.testing.assert_close(got, logits(load(out)), rtol=0, atol=0)
    # and it decodes through the bundled decode layout (plain VQ's; heavy hitters' in test_vq_heavy.py)
    decoded = remote_logits(out, IDS, "EffattnVQForCausalLM", tmp_path, prefix=40)
    torch.testing.assert_close(decoded, got, rtol=1e-9, atol=1e-9)


def test_training_exposes_the_commitment_loss_and_moves_the_codebook_by_ema(tiny, tmp_path, calib_file):
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    model = AutoModelForCausalLM.from_pretrained(vq_init(src, tmp_path / "vq", calib_file)).train()
    attn = model.model.layers[0].self_attn
    before = attn.codebook.clone()
    out = model(input_ids=IDS, labels=IDS, use_cache=False)
    aux = [m.effattn_aux_loss for m in model.vq_attention_modules()]
    assert all(a is not None and a.item() > 0 for a in aux)
    (out.loss + sum(aux)).backward()
    assert not attn.codebook.requires_grad and attn.codebook.grad is None
    assert attn.k_proj.weight.grad.abs().sum() > 0
    moved = (attn.codebook - before).norm(dim=-1)
    assert moved.max() > 0  # used codes moved towards their keys
    unused = attn.ema_counts < 1e-6
    assert torch.equal(attn.codebook[unused], before[unused])


def test_kmeans_torch_and_sklearn_find_separated_clusters():
    gen = torch.Generator().manual_seed(0)
    centers = torch.randn(2, 8, 4, generator=gen) * 10
    labels = torch.randint(8, (2, 800), generator=gen)
    x = centers[torch.arange(2)[:, None], labels] + 0.1 * torch.randn(2, 800, 4, generator=gen)
    for method in ("torch", "sklearn"):
        result = kmeans(x, 8, method=method)
        assert result.centroids.shape == (2, 8, 4)
        assert result.error < 0.1  # ~ noise variance x dims (0.04): every cluster found
        assert int(result.counts.sum()) == 2 * 800


def test_query_metric_lowers_the_logit_error():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4000, 6, generator=gen) * torch.tensor([5.0, 5, 5, 0.3, 0.3, 0.3])  # wide dims
    q = torch.randn(4000, 6, generator=gen) * torch.tensor([0.1, 0.1, 0.1, 10, 10, 10])  # queries read narrow dims
    metric = (q.T @ q / len(q))[None]

    def logit_error(result):
        codes = nearest_codes(x[0][None, :, None], result.centroids, result.whitener)[0, :, 0]  # as the model does
        err = x[0] - result.centroids[0][codes]
        return ((err @ q.T) ** 2).mean()

    key, query = kmeans(x, 16, method="torch"), kmeans(x, 16, metric=metric, method="torch")
    assert torch.allclose(key.whitener, torch.eye(6)[None])
    assert logit_error(query) < 0.5 * logit_error(key)


def test_weighted_kmeans_centroids_are_weighted_means():
    gen = torch.Generator().manual_seed(0)
    centers = torch.randn(1, 4, 3, generator=gen) * 20
    labels = torch.arange(400) % 4
    x = centers[0][labels][None] + torch.randn(1, 400, 3, generator=gen)
    w = torch.rand(1, 400, generator=gen) ** 3
    for method in ("torch", "sklearn"):
        result = kmeans(x, 4, weights=w, method=method)
        # each found cluster is one of the 4 blobs; its centroid is the weighted mean of the blob
        codes = nearest_codes(x[0][None, :, None], result.centroids)[0, :, 0]
        for c in range(4):
            members = codes == c
            expected = (x[0][members] * w[0][members, None]).sum(0) / w[0][members].sum()
            torch.testing.assert_close(result.centroids[0, c], expected, rtol=1e-4, atol=1e-4)
        assert int(result.counts.sum()) == 400  # counts stay point counts


def test_a_heavily_weighted_point_gets_its_own_centroid():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2000, 4, generator=gen)
    x[0, 7] = torch.tensor([3.0, -3.0, 3.0, -3.0])  # an outlier, like an attention sink's key
    w = torch.full((1, 2000), 1e-3)
    w[0, 7] = 100.0
    for method in ("torch", "sklearn"):
        weighted, plain = kmeans(x, 8, weights=w, method=method), kmeans(x, 8, method=method)
        assert (weighted.centroids[0] - x[0, 7]).norm(dim=-1).min() < 1e-5  # exactly on it
        assert (plain.centroids[0] - x[0, 7]).norm(dim=-1).min() > 0.1  # unweighted: merged with others
    # zero weights everywhere but a few points still place every centroid on a weighted point
    w0 = torch.zeros(1, 2000)
    w0[0, :8] = 1.0
    result = kmeans(x, 8, weights=w0, method="torch")
    torch.testing.assert_close(result.centroids[0].sort(0).values, x[0, :8].sort(0).values)
    with pytest.raises(ValueError, match="nonnegative"):
        kmeans(x, 8, weights=-w)


def test_attention_statistics_match_the_rerope_softmax():
    from effattn.convert.vq import attention_statistics
    from effattn.kernels.rope import apply_rope, rope_tables

    gen = torch.Generator().manual_seed(0)
    B, T, H, G, D, W = 2, 40, 6, 3, 8, 8
    q, k = torch.randn(B, T, H, D, generator=gen), torch.randn(B, T, G, D, generator=gen)
    cos, sin = rope_tables(T + W, D)
    mass, metric = attention_statistics(q, k, cos[:T], sin[:T], (cos[W], sin[W]), 0.5, W, sinks=2)
    # brute force, pair by pair
    want_mass, want_metric = torch.zeros(B, T, G), torch.zeros(G, D, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            g = h // (H // G)
            for t in range(T):
                logit = torch.stack([0.5 * (apply_rope(q[b, t, h], cos[t - s], sin[t - s]) @ k[b, s, g]) if t - s < W
                                     else 0.5 * (apply_rope(q[b, t, h], cos[W], sin[W]) @ k[b, s, g]) for s in range(t + 1)])
                p = torch.softmax(logit, 0)
                qf = apply_rope(q[b, t, h], cos[W], sin[W]) * 0.5
                for s in range(2, t - W + 1):  # far and not a sink
                    want_mass[b, s, g] += p[s]
                    want_metric[g] += p[s].double() * torch.outer(qf, qf).double()
    torch.testing.assert_close(mass, want_mass, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(metric, want_metric, rtol=1e-4, atol=1e-5)
    assert float(mass[:, T - W + 1:].abs().max()) == 0 and float(mass[:, :2].abs().max()) == 0


@pytest.mark.parametrize("metric", ["attention", "query", "key"])
def test_every_metric_converts_and_stores_its_code_metric(tiny, tmp_path, calib_file, metric):
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    out = vq_init(src, tmp_path / "vq", calib_file, metric=metric)
    model = load(out)
    attn = model.model.layers[1].self_attn
    identity = torch.equal(attn.code_metric, torch.eye(8, dtype=attn.code_metric.dtype).repeat(3, 1, 1))
    assert identity == (metric == "key")
    assert torch.isfinite(attn.codebook).all() and attn.ema_counts.sum() > 0
    assert json.loads((out / "effattn.json").read_text())["conversion"]["metric"] == metric
    assert torch.isfinite(logits(model)).all()


def test_the_seed_picks_the_codebooks_and_is_recorded(tiny, tmp_path, calib_file):
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    books = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 5)):
        out = vq_init(src, tmp_path / name, calib_file, seed=seed)
        books[name] = torch.stack([layer.self_attn.codebook for layer in load(out).model.layers])
        assert json.loads((out / "effattn.json").read_text())["conversion"]["seed"] == seed
    assert torch.equal(books["a"], books["b"])  # deterministic for a seed
    assert not torch.allclose(books["a"], books["c"])  # another seed, other k-means starts


def test_bad_vq_options_are_one_line_errors(tiny, tmp_path, calib_file, capsys):
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    cases = [
        (["vq-init", str(src), "--window", "1024", "--calib", str(calib_file), "-o", str(tmp_path / "a")], "longer than the window"),
        (["vq-init", str(src), "--metric", "cosine", "-o", str(tmp_path / "b")], "unknown --metric"),
        (["vq-init", str(src), "--kmeans", "faiss", "-o", str(tmp_path / "c")], "unknown --kmeans"),
        (["vq-init", str(src), "--codebook-size", "0", "-o", str(tmp_path / "d")], "--codebook-size must be"),
        (["vq-init", str(src), "--seed", "-1", "-o", str(tmp_path / "s")], "--seed must be"),
        (["convert", str(src), "--to", "vq", "--kv-heads", "1", "-o", str(tmp_path / "e")], "--kv-heads does not apply"),
        (["convert", str(src), "--to", "gqa", "--kv-heads", "1", "--window", "8", "-o", str(tmp_path / "f")],
         "--window does not apply"),
        (["convert", str(src), "--to", "rerope", "--window", "16", "--far-position", "4", "-o", str(tmp_path / "g")],
         "inside the window"),
        (["vq-init", str(src), "--exact-heads", "7", "-o", str(tmp_path / "h")], "more than the model's 6 KV heads"),
        (["convert", str(src), "--to", "rerope", "--exact-heads", "1", "-o", str(tmp_path / "i")],
         "--exact-heads does not apply"),
        (["vq-init", str(src), "--code-bias", "--key-means", "-o", str(tmp_path / "j")], "which --key-means replaces"),
        (["convert", str(src), "--to", "gqa", "--kv-heads", "1", "--no-key-means", "-o", str(tmp_path / "k")],
         "--key-means does not apply"),
    ]
    for args, message in cases:
        code, _, err = run_cli(capsys, *args)
        assert_one_line_error(code, err, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]  # nothing written, not even temporaries


def test_vq_dry_run_writes_nothing(tiny, tmp_path, calib_file, monkeypatch):
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    result = convert(src, tmp_path / "vq", to="vq", options={"codebook_size": 16, "window": 16}, dry_run=True)
    assert result.out is None and not (tmp_path / "vq").exists()
    assert result.plan.settings["codebook_size"] == 16 and result.plan.est_seconds > 0
    # the plan says which step loop and which bfloat16 products (vq_bf16_products) run on this machine,
    # following EFFATTN_BF16_KERNEL where that choice can run
    from effattn.kernels.vq import native

    def kernel_line() -> str:
        plan = convert(src, tmp_path / "vq", to="vq", options={"codebook_size": 16, "window": 16, "heavy_keys": 0}, dry_run=True).plan
        return dict(plan.summary)["VQ kernel"]

    seen = set()
    for choice in ("own", "mkl"):
        monkeypatch.setenv("EFFATTN_BF16_KERNEL", choice)
        kernel = native.bf16_kernel()
        seen.add(kernel)
        assert kernel_line() == f"compiled step loop (native.c); with vq_bf16_products: {native.BF16_KERNELS[kernel]}"
    if {"avx512_bf16"} <= cpu_flags() and native._lib.vq_dpbf16_compiled():  # both can run here: both were said
        assert seen == {"own", "mkl"}
    monkeypatch.setenv("EFFATTN_NATIVE", "0")
    assert kernel_line() == "PyTorch step loop: the compiled one is unavailable (turned off by EFFATTN_NATIVE=0)"
    with pytest.raises(EffattnError, match="does not apply"):
        convert(src, tmp_path / "x", to="rerope", options={"codebook_size": 16}, dry_run=True)
    from effattn.info import inspect_model

    assert {"gqa", "rerope", "vq"} <= set(inspect_model(str(src))["conversions"])


def _tiny_heal_recipe(tmp_path: Path, src: Path, calib_file: Path) -> dict:
    """A heal-vq-shaped recipe for a tiny model: vq-init first, then 10 steps on half the calibration text."""
    text = calib_file.read_text()
    (tmp_path / "train.txt").write_text(text[: len(text) // 2])
    (tmp_path / "held.txt").write_text(text[len(text) // 2:])
    return {
        "student": {"model": str(src), "convert": {"to": "vq", "codebook_size": 16, "window": 8, "calib": str(calib_file),
                                                   "calib_tokens": 1024, "calib_seq_len": 128,
                                                   "heavy_keys": 0}},  # as heal-vq pins it
        "data": {"sources": [str(tmp_path / "train.txt")], "seq_len": 64},
        "train": {"max_steps": 10, "batch_size": 2, "params": "attention"},
        "optimizer": {"lr": 3e-3},
        "schedule": {"warmup_steps": 2},
        "eval": {"every": 5, "corpora": [str(tmp_path / "held.txt")], "seq_len": 64, "tokens": 256},
        "checkpoint": {"every": 5},
    }


def test_heal_vq_with_exact_heads_from_a_command_line_override(tiny, tmp_path, calib_file, capsys):
    import yaml

    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    (tmp_path / "heal.yaml").write_text(yaml.safe_dump(_tiny_heal_recipe(tmp_path, src, calib_file)))
    out = tmp_path / "healed"
    code, stdout, err = run_cli(capsys, "finetune", tmp_path / "heal.yaml", "-o", out, "--json",
                                "student.convert.exact_heads=2", "train.max_steps=4")
    assert code == 0, err
    held = str(tmp_path / "held.txt")
    report = json.loads(stdout)
    assert report["final_eval"][held]["perplexity"] < report["start_eval"][held]["perplexity"]
    pairs = json.loads((out / "config.json").read_text())["vq_exact_heads"]
    assert len(pairs) == 2 and load(out).config.vq_exact_heads == pairs


def test_heal_vq_trains_codebooks_and_writes_a_loadable_vq_model(tiny, tmp_path, calib_file, capsys):
    import yaml
    from safetensors.torch import load_file

    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    (tmp_path / "heal.yaml").write_text(yaml.safe_dump(_tiny_heal_recipe(tmp_path, src, calib_file)))
    out = tmp_path / "healed"
    code, stdout, err = run_cli(capsys, "finetune", tmp_path / "heal.yaml", "-o", out, "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 10 and all(r["aux"] > 0 for r in train)  # the commitment loss is on
    report = json.loads(stdout)
    held = str(tmp_path / "held.txt")
    assert report["final_eval"][held]["perplexity"] < report["start_eval"][held]["perplexity"]
    assert (out / "modeling_effattn_vq.py").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "effattn_vq" and "auto_map" in config
    healed = load_file(str(out / "model.safetensors"))
    start = load_file(str(vq_init(src, tmp_path / "start", calib_file, window=8) / "model.safetensors"))
    for name in ("codebook", "ema_counts"):  # the conversion is deterministic: the EMA moved the codebooks
        key = f"model.layers.1.self_attn.{name}"
        assert healed[key].shape == start[key].shape and not torch.equal(healed[key], start[key])
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model, EffattnVQForCausalLM) and model.config.vq_window == 8


def test_codes_are_assigned_under_the_stored_metric(tiny, tmp_path, calib_file):
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    model = load(vq_init(src, tmp_path / "vq", calib_file, metric="key"))
    attn = model.model.layers[0].self_attn
    assert torch.equal(attn.code_metric, torch.eye(8, dtype=attn.code_metric.dtype).repeat(3, 1, 1))
    q, k, _ = attn.project(model.model.embed_tokens(IDS))
    plain = nearest_codes(k, attn.codebook)
    before = logits(model)
    with torch.no_grad():  # a metric that weighs one pair of dimensions heavily changes the nearest codes
        attn.code_metric.copy_(torch.diag(torch.tensor([30.0, 1, 1, 1, 30, 1, 1, 1], dtype=attn.code_metric.dtype)))
    assert not torch.equal(nearest_codes(k, attn.codebook, attn.code_metric), plain)
    assert (logits(model) - before).abs().max() > 1e-6  # and the model uses them


# -- exact heads (`--exact-heads K`): the original attention on K KV heads, ReRoPE + VQ on the others --------

def _attention_inputs(model, layer: int, ids=IDS):
    """What layer `layer`'s o_proj receives (B, T, H * D): the per-head attention outputs."""
    seen = []
    hook = model.model.layers[layer].self_attn.o_proj.register_forward_hook(lambda m, a, o: seen.append(a[0]))
    logits(model, ids)
    hook.remove()
    return seen[0]


def test_exact_heads_are_chosen_by_quantization_error_and_recorded(tiny, tmp_path, calib_file):
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8, layers=3)
    out = vq_init(src, tmp_path / "vq", calib_file, exact_heads=2)
    pairs = json.loads((out / "config.json").read_text())["vq_exact_heads"]
    conversion = json.loads((out / "effattn.json").read_text())["conversion"]
    errors = conversion["head_errors"]
    assert len(errors) == 9 and all(e > 0 for e in errors.values())
    top = sorted(errors, key=errors.get, reverse=True)[:2]
    assert sorted(pairs) == sorted([int(x) for x in key.split(".")] for key in top) == conversion["exact_heads_chosen"]
    assert conversion["exact_heads"] == 2 and load(out).config.vq_exact_heads == pairs
    card = (out / "README.md").read_text()
    assert "| head_errors | in `effattn.json` |" in card and f"| exact_heads_chosen | `{pairs}` |" in card
    # layer 0 sees the embeddings whatever the other layers do, so its recorded errors can be recomputed:
    # the VQ model's per-head attention outputs against the source model's own (transformers' attention)
    from effattn.convert.calibrate import CalibSettings, calibration_tokens

    ids = calibration_tokens(out, CalibSettings(corpus=str(calib_file), tokens=1024, seq_len=128))
    vq_heads = _attention_inputs(load(out, vq_exact_heads=[]), 0, ids).view(*ids.shape, 3, 2, 8)  # (N, T, KV head, query, d)
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64).eval()
    orig_heads = _attention_inputs(original, 0, ids).view_as(vq_heads)
    relative = ((vq_heads - orig_heads).pow(2).sum((0, 1, 3, 4)) / orig_heads.pow(2).sum((0, 1, 3, 4))).tolist()
    assert relative == pytest.approx([errors[f"0.{g}"] for g in range(3)], rel=1e-2)
    # the same codebooks as a conversion without exact heads: only the config differs
    plain = vq_init(src, tmp_path / "plain", calib_file)
    assert "vq_exact_heads" in json.loads((plain / "config.json").read_text())
    a, b = load(out), load(plain)
    for x, y in zip(a.vq_attention_modules(), b.vq_attention_modules()):
        assert torch.equal(x.codebook, y.codebook)


@pytest.mark.parametrize("kernel", ["chunk", "naive"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_an_exact_head_keeps_its_original_attention_and_the_others_read_codes(tiny, tmp_path, calib_file, kernel, family):
    src = tiny(family, heads=6, kv_heads=3, head_dim=8)
    model = load(vq_init(src, tmp_path / "vq", calib_file, sinks=2), vq_kernel=kernel)
    every = [[layer, g] for layer in range(2) for g in range(3)]
    model.config.vq_exact_heads = every  # every head exact: the original model
    torch.testing.assert_close(logits(model), logits_of(src, IDS, torch.float64), rtol=1e-9, atol=1e-9)
    model.config.vq_exact_heads = []
    quantized = _attention_inputs(model, 0).view(2, -1, 6, 8)
    model.config.vq_exact_heads = every
    exact = _attention_inputs(model, 0).view(2, -1, 6, 8)
    assert (quantized - exact).abs().max() > 1e-4
    model.config.vq_exact_heads = [[0, 1]]  # KV head 1 of layer 0 = query heads 2 and 3
    mixed = _attention_inputs(model, 0).view(2, -1, 6, 8)
    torch.testing.assert_close(mixed[:, :, 2:4], exact[:, :, 2:4], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(mixed[:, :, [0, 1, 4, 5]], quantized[:, :, [0, 1, 4, 5]], rtol=1e-9, atol=1e-9)
    model.config.vq_exact_heads = [[0, 3]]
    with pytest.raises(ValueError, match="KV head 3 of layer 0"):
        logits(model)


def test_exact_heads_decode_through_the_cache_which_grows_on_those_heads_only(tiny, tmp_path, calib_file):
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    model = load(vq_init(src, tmp_path / "vq", calib_file, sinks=1), vq_exact_heads=[[0, 2], [1, 0], [1, 1]])
    ids = IDS[:1]
    cache, sizes = decode_matches_full_forward(model, ids)
    # the 3 exact heads hold a key and a value (head_dim 8, float64) per token, the quantized heads a constant state
    exact = [state.exact for state in cache.states.values()]
    assert sum(2 * state.k.numel() * 8 for state in exact) == ids.shape[1] * 3 * 2 * 8 * 8
    # the exact heads' buffers grew once, at the first decoded token, with room for 256 more: the cache's
    # bytes then stay put while the keys go in
    assert len(set(sizes)) == 1 and all(state._k.shape[2] == 40 + 1 + 256 for state in exact)


def test_training_leaves_the_exact_heads_codebooks_alone(tiny, tmp_path, calib_file):
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    model = AutoModelForCausalLM.from_pretrained(vq_init(src, tmp_path / "vq", calib_file)).train()
    model.config.vq_exact_heads = [[0, 1], [1, 0], [1, 1], [1, 2]]  # layer 1 has no quantized head left
    attn0, attn1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    before0, before1 = attn0.codebook.clone(), attn1.codebook.clone()
    out = model(input_ids=IDS, labels=IDS, use_cache=False)
    assert attn0.effattn_aux_loss is not None and attn0.effattn_aux_loss.item() > 0
    assert attn1.effattn_aux_loss is None
    (out.loss + attn0.effattn_aux_loss).backward()
    assert torch.equal(attn0.codebook[1], before0[1]) and torch.equal(attn1.codebook, before1)
    assert (attn0.codebook[[0, 2]] - before0[[0, 2]]).abs().max() > 0
    assert attn1.k_proj.weight.grad.abs().sum() > 0  # exact heads still learn through their exact keys


@pytest.mark.parametrize("heavy", [192, 0], ids=["heavy-hitters", "plain"])
def test_the_planned_cache_is_the_cache_the_model_holds(tiny, tmp_path, heavy):
    """The plan's "bytes per sequence" counted the window's keys and values and the per-code sums only: 107,328 and
    9,024 bytes for a cache of 142,008 and 11,664 (the codes, scores and positions, the rotated keys, the RoPE
    rows). Now every tensor of the state, at its largest (the far keys just before a cut): equal to the byte."""
    import re

    from effattn.convert import convert

    options = {"window": 16, "codebook_size": 8, "calib_tokens": 512, "calib_seq_len": 64, "heavy_keys": heavy}
    result = convert(tiny("llama"), tmp_path / "vq", to="vq", options=options, measure=False)
    planned = int(re.search(r"VQ ([\d,]+) bytes per sequence", dict(result.plan.summary)["KV cache"])[1]
                  .replace(",", ""))
    model = AutoModelForCausalLM.from_pretrained(result.out, dtype=torch.float32).eval()
    with torch.no_grad():
        cache = model(input_ids=torch.randint(0, 256, (1, 2048)), use_cache=True).past_key_values  # as the card
    assert cache.nbytes() == planned
