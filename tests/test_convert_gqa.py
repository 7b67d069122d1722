"""GQA/MQA conversion on tiny random models of every family: exactness, native output, streaming IO."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from effattn.convert import convert
from effattn.convert.gqa import mean_mixing, mix_heads

from .conftest import FAMILY_CONFIGS, logits_of

FAMILIES = list(FAMILY_CONFIGS)
IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", FAMILIES)
def test_identity_conversion_reproduces_logits_exactly(tiny, tmp_path, family):
    src = tiny(family, heads=6, kv_heads=3)
    out = convert(src, tmp_path / "out", to="gqa", options={"kv_heads": 3}, measure=False).out
    assert torch.equal(logits_of(src, IDS), logits_of(out, IDS))


def _duplicate_heads_within_groups(folder, group: int, head_dim: int):
    """Make K/V heads identical within each block of `group` consecutive heads (an MHA model that is
    secretly GQA), so mean-pooling them loses nothing."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.k_proj, attn.v_proj):
                for tensor in (proj.weight, proj.bias):
                    if tensor is None:
                        continue
                    heads = tensor.view(-1, group, head_dim, *tensor.shape[1:])  # (N, group, d, ...)
                    heads.copy_(heads[:, :1].expand_as(heads))
    model.save_pretrained(folder)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["mean"])
def test_mha_with_duplicated_heads_converts_to_gqa_exactly(tiny, tmp_path, family, method):
    src = tiny(family, heads=6, kv_heads=6, head_dim=8)
    _duplicate_heads_within_groups(src, group=3, head_dim=8)
    out = convert(src, tmp_path / "out", to="gqa", options={"kv_heads": 2, "method": method}, measure=False).out
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2
    torch.testing.assert_close(logits_of(out, IDS, torch.float64), logits_of(src, IDS, torch.float64), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("family", FAMILIES)
def test_gqa_to_mha_expansion_is_exact(tiny, tmp_path, family):
    src = tiny(family, heads=6, kv_heads=2)
    out = convert(src, tmp_path / "out", to="mha", measure=False).out
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 6
    torch.testing.assert_close(logits_of(out, IDS, torch.float64), logits_of(src, IDS, torch.float64), rtol=1e-9, atol=1e-9)


def test_output_is_a_native_checkpoint(tiny, tmp_path):
    src = tiny("llama", heads=6, kv_heads=3, tie=True)
    out = convert(src, tmp_path / "mqa", to="mqa", options={"method": "mean"}, measure=False).out
    model = AutoModelForCausalLM.from_pretrained(out)  # plain transformers, no effattn code
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_key_value_heads == 1
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (8, 48)
    # tied embeddings stay tied: no separate lm_head tensor, and the loaded head shares the embedding
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md", "effattn.json"):
        assert (out / name).exists(), name
    record = json.loads((out / "effattn.json").read_text())
    assert record["conversion"] == {"to": "gqa", "kv_heads": 1, "method": "mean", "kv_heads_before": 3, "dtype": "float32"}
    assert record["source"]["num_key_value_heads"] == 3
    assert "num_key_value_heads" not in record["conversion"]  # sanity: settings only
    card = (out / "README.md").read_text()
    assert "base_model:" not in card and "3 -> 1" in card  # base_model is a hub id; a local folder has none


def test_untied_lm_head_is_kept(tiny, tmp_path):
    src = tiny("llama", tie=False)
    out = convert(src, tmp_path / "out", to="mqa", options={"method": "mean"}, measure=False).out
    with safe_open(str(out / "model.safetensors"), "pt") as f, safe_open(str(src / "model.safetensors"), "pt") as g:
        assert torch.equal(f.get_tensor("lm_head.weight"), g.get_tensor("lm_head.weight"))


def test_sharded_input_and_output(tiny, tmp_path):
    src = tiny("qwen2", layers=3, max_shard_size="40KB")
    assert (src / "model.safetensors.index.json").exists()
    out = convert(src, tmp_path / "out", to="gqa", options={"kv_heads": 3}, max_shard_size="50KB", measure=False).out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).exists() for s in shards)
    assert torch.equal(logits_of(src, IDS), logits_of(out, IDS))


def test_dtype_conversion_to_bfloat16(tiny, tmp_path):
    src = tiny("llama")
    out = convert(src, tmp_path / "out", to="gqa", options={"kv_heads": 3}, dtype="bfloat16", measure=False).out
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())


def test_mean_mixing_matches_the_gqa_paper():
    # 4 KV heads -> 2: each new head is the mean of two consecutive old heads
    assert torch.equal(mean_mixing(8, 4, 2), torch.tensor([[0.5, 0.5, 0, 0], [0, 0, 0.5, 0.5]], dtype=torch.float64))
    # 2 -> 4 copies each head twice
    assert torch.equal(mean_mixing(8, 2, 4), torch.tensor([[1.0, 0], [1, 0], [0, 1], [0, 1]], dtype=torch.float64))
    # 3 -> 2 with 6 query heads: new head 0 serves queries 0-2 (old heads 0,0,1)
    torch.testing.assert_close(mean_mixing(6, 3, 2)[0], torch.tensor([2 / 3, 1 / 3, 0], dtype=torch.float64))
    w = torch.arange(4 * 2 * 3, dtype=torch.float32).view(8, 3)  # 4 heads of head_dim 2
    pooled = mix_heads(w, mean_mixing(8, 4, 1), head_dim=2)
    torch.testing.assert_close(pooled, w.view(4, 2, 3).mean(0))


def test_dry_run_writes_nothing(tiny, tmp_path):
    src = tiny("llama")
    result = convert(src, tmp_path / "never", to="mqa", options={"method": "mean"}, dry_run=True)
    assert not (tmp_path / "never").exists()
    before, after = result.plan.kv_bytes_per_token
    assert after * 3 == before
