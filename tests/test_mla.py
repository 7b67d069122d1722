"""GQA/MHA -> MLA (native DeepseekV3) on tiny random models: exactness where nothing is approximated,
the latent cache, cached generation, and the options' checks."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from effattn.convert import convert
from effattn.errors import EffattnError

from .conftest import logits_of

IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
CALIB = {"calib_tokens": 1024, "refit_o": False, "refine_steps": 0}


def _same_keys_in_every_group(folder, kv_heads: int, head_dim: int):
    """Make every KV head's key projection identical (values stay distinct): the keys then have rank
    one across heads, so merging them into one rotary key loses nothing."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            for tensor in (layer.self_attn.k_proj.weight, layer.self_attn.k_proj.bias):
                if tensor is not None:
                    heads = tensor.view(kv_heads, head_dim, *tensor.shape[1:])
                    heads.copy_(heads[:1].expand_as(heads))
    model.save_pretrained(folder)


def _close(out, src):
    """The latent RMSNorm is linear within 5e-7 relative (mla.py): logits agree to ~1e-6 of their scale."""
    a, b = logits_of(out, IDS, torch.float64), logits_of(src, IDS, torch.float64)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * b.abs().max().item())


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_one_kv_head_full_rank_every_frequency_rotary_is_exact(tiny, tmp_path, family):
    src = tiny(family, heads=6, kv_heads=1, head_dim=8, rms_norm_eps=1e-6)
    out = convert(src, tmp_path / "out", to="mla", options={"kv_size": 16, "rope_dim": 8} | CALIB, measure=False).out
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["qk_nope_head_dim"]) == (8, 8, 0)
    assert config["first_k_dense_replace"] == 2 and config["num_nextn_predict_layers"] == 0
    assert config["rope_interleave"] is True and config["rms_norm_eps"] == 1e-6
    assert config["attention_bias"] is (family == "qwen2")  # Qwen2's q/k/v biases are held exactly
    # the tied source's head is written out (vLLM's DeepSeek model loads lm_head, it never ties)
    assert config["tie_word_embeddings"] is False
    from safetensors import safe_open

    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        assert torch.equal(f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight"))
    _close(out, src)


def test_gqa_source_with_rank_one_keys_is_exact(tiny, tmp_path):
    """Three KV heads (distinct values, identical keys): one rotary key holds all keys, the latent (3 x 8)
    every value head; kv_b expands it to each query head's group."""
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8, rms_norm_eps=1e-6)
    _same_keys_in_every_group(src, 3, 8)
    out = convert(src, tmp_path / "out", to="mla", options={"kv_size": 32, "rope_dim": 8} | CALIB, measure=False).out
    _close(out, src)


def test_refit_o_keeps_an_exact_conversion_exact(tiny, tmp_path):
    src = tiny("llama", heads=6, kv_heads=1, head_dim=8, rms_norm_eps=1e-6)
    out = convert(src, tmp_path / "out", to="mla", options={"kv_size": 16, "rope_dim": 8, "calib_tokens": 1024,
                                                              "refine_steps": 0}, measure=False).out
    a, b = logits_of(out, IDS, torch.float64), logits_of(src, IDS, torch.float64)
    # the ridge pulls towards the exact o_proj, and least squares on exact heads finds it again
    torch.testing.assert_close(a, b, rtol=0, atol=1e-3 * b.abs().max().item())
    o_new = AutoModelForCausalLM.from_pretrained(out).model.layers[0].self_attn.o_proj.weight
    o_src = AutoModelForCausalLM.from_pretrained(src).model.layers[0].self_attn.o_proj.weight
    assert not torch.equal(o_new, o_src)  # refitted, not copied
    torch.testing.assert_close(o_new, o_src, rtol=0, atol=1e-3 * o_src.abs().max().item())


def test_partial_rope_approximation_and_the_latent_cache(tiny, tmp_path):
    """The lossy default split: the cache really is the latent (measured from transformers' cache), and
    cached decoding equals the full forward."""
    src = tiny("llama", heads=6, kv_heads=3, head_dim=16, rms_norm_eps=1e-5, layers=2)
    out = convert(src, tmp_path / "out", to="mla", options={"kv_size": 32, "calib_tokens": 1024, "refine_steps": 4},
                  measure=False)
    refine = out.record["conversion_run"]["refine"]  # the default refinement (stream) ran and lowered every error
    assert len(refine["before"]) == 2 and all(a <= b for a, b in zip(refine["after"], refine["before"]))
    out = out.out
    config = json.loads((out / "config.json").read_text())
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 32
    assert config["qk_rope_head_dim"] == 8  # half the head's frequencies stay rotary
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    from effattn.evaluate import tensor_bytes

    with torch.no_grad():
        full = model(input_ids=IDS[:1]).logits
        cache_out = model(input_ids=IDS[:1, :16], use_cache=True)
        assert tensor_bytes(cache_out.cache) == 2 * 16 * 32 * 4  # layers x tokens x (latent + rotary) x fp32
        cache, steps = cache_out.cache, [cache_out.logits]
        for t in range(16, IDS.shape[1]):
            step = model(input_ids=IDS[:1, t:t + 1], cache=cache, use_cache=True)
            cache = step.cache
            steps.append(step.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)
    from effattn.info import inspect_model

    info = inspect_model(str(out))  # inspect reads the latent cache from the config
    assert info["kv_bytes_per_token"] == 2 * 32 * 4 and info["attention"].startswith("MLA: latent 24 + shared rotary key 8")


def test_low_frequencies_without_rotation_is_the_only_loss_at_full_rank(tiny, tmp_path):
    """One KV head, a full-rank latent, half the frequencies rotary: what is left is the lowest
    frequencies' rotation: with theta 1e8 the kept ones turn up to 1 rad per position, the others less
    than 1e-4 rad per position, so over 24 positions their rotation is negligible."""
    src = tiny("llama", heads=6, kv_heads=1, head_dim=16, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": 1e8})
    out = convert(src, tmp_path / "out", to="mla", options={"kv_size": 32, "rope_dim": 8} | CALIB, measure=False).out
    a, b = logits_of(out, IDS), logits_of(src, IDS)
    assert (a - b).abs().max() < 0.01 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.95


def test_rope_frequencies_are_the_sources(tiny, tmp_path):
    """theta' = theta^(stride*R/F) makes DeepseekV3's rotary frequencies the kept source frequencies, for
    default and llama3-scaled RoPE."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from effattn.convert.mla import kept_frequencies, mla_rope_parameters

    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    for params, stride in (({"rope_type": "default", "rope_theta": 10000.0}, 1), (llama3, 2)):
        src_cfg = {"rope_parameters": params, "head_dim": 32}
        rope = mla_rope_parameters(src_cfg, 32, 8, stride)
        source = AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=2, head_dim=32, rope_parameters=params,
                                      max_position_embeddings=2048)
        target = AutoConfig.for_model("deepseek_v3", hidden_size=64, num_attention_heads=2, qk_rope_head_dim=8,
                                      rope_parameters=rope, max_position_embeddings=2048)
        kind = params["rope_type"]
        src_freq = (ROPE_INIT_FUNCTIONS[kind](source, "cpu")[0] if kind != "default"
                    else 1.0 / (params["rope_theta"] ** (torch.arange(0, 32, 2).float() / 32)))
        if kind == "default":
            tgt_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 8, 2).double() / 8))
        else:
            tgt_freq = ROPE_INIT_FUNCTIONS[kind](target, "cpu")[0]
        torch.testing.assert_close(tgt_freq.double(), src_freq[kept_frequencies(32, 8, stride)].double(), rtol=1e-5, atol=0)


def test_bad_options_are_one_line_errors(tiny, tmp_path):
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    bad = [({}, "--kv-size is required"),
           ({"kv_size": 16, "kv_rank": 4, "rope_dim": 8}, "not --kv-size"),
           ({"kv_size": 16, "rope_dim": 7}, "must be even"),
           ({"kv_size": 8, "rope_dim": 8}, "leaves no latent"),
           ({"kv_size": 200}, "more than the non-rotary keys and values hold"),
           ({"kv_size": 12, "rope_dim": 8, "rope_stride": 2}, "--rope-stride 2"),
           ({"kv_size": 16, "calib": "shakespeare"}, "evaluation corpus")]
    for options, message in bad:
        with pytest.raises(EffattnError, match=message):
            convert(src, tmp_path / "out", to="mla", options=options, measure=False, dry_run=True)
    with pytest.raises(EffattnError, match="float16"):
        convert(src, tmp_path / "out", to="mla", options={"kv_size": 16}, dtype="float16", measure=False, dry_run=True)
    assert not (tmp_path / "out").exists()


def test_qwen3_per_head_norms_are_fitted_by_least_squares(tiny, tmp_path):
    """Qwen3's q_norm/k_norm are not linear: q_proj and kv_a_proj are fitted from the layer inputs. With
    one KV head, every frequency rotary and a full-rank latent, the fit is the only approximation."""
    src = tiny("qwen3", heads=6, kv_heads=1, head_dim=8, rms_norm_eps=1e-6)
    out = convert(src, tmp_path / "out", to="mla", options={"kv_size": 16, "rope_dim": 8, "calib_tokens": 8192,
                                                              "refit_o": False, "refine_steps": 0}, measure=False).out
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["q_lora_rank"] is None
    a, b = logits_of(out, IDS, torch.float64), logits_of(src, IDS, torch.float64)
    # random 8-dim heads are far from linear under their norms, so the fit is far from exact; it must beat
    # composing the projections as if the norms were not there
    from transformers import LlamaConfig, LlamaForCausalLM

    qwen = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    fields = LlamaConfig().to_dict().keys() - {"model_type", "architectures", "transformers_version"}
    llama = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in qwen.config.to_dict().items() if k in fields}))
    unexpected = llama.load_state_dict(qwen.state_dict(), strict=False).unexpected_keys
    assert unexpected and all("_norm." in k for k in unexpected)  # the same model without its q/k norms
    llama.save_pretrained(tmp_path / "no-norms")
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, tmp_path / "no-norms" / f.name)
    ignored = convert(tmp_path / "no-norms", tmp_path / "ignored", to="mla", options={"kv_size": 16, "rope_dim": 8, "calib_tokens": 8192,
                                                                      "refit_o": False, "refine_steps": 0}, measure=False).out
    c = logits_of(ignored, IDS, torch.float64)
    assert (a - b).pow(2).mean() < 0.75 * (c - b).pow(2).mean()  # measured: 2.57 against 4.00


def test_least_squares_fit_reproduces_the_composition_without_norms(tiny, tmp_path, monkeypatch):
    """The fitting path on a family without per-head norms must find the weights the composition gives."""
    from effattn.families import Family

    src = tiny("llama", heads=6, kv_heads=1, head_dim=8, rms_norm_eps=1e-6)
    monkeypatch.setattr(Family, "has_qk_norm", property(lambda self: True))
    out = convert(src, tmp_path / "out", to="mla", options={"kv_size": 16, "rope_dim": 8, "calib_tokens": 8192,
                                                              "refit_o": False, "refine_steps": 0}, measure=False).out
    a, b = logits_of(out, IDS, torch.float64), logits_of(src, IDS, torch.float64)
    assert (a - b).abs().max() < 2e-3 * b.abs().max()


def test_absorbed_decode_equals_transformers_path(tiny, tmp_path):
    """effattn's absorbed attention (scores in latent space) against transformers' DeepseekV3 path:
    one forward, a chunked prefill after a cached prefix, token-by-token decoding and generate()."""
    from effattn.attention.mla import absorb
    from effattn.io.load import load_model

    src = tiny("llama", heads=6, kv_heads=3, head_dim=16, rms_norm_eps=1e-5)
    out = convert(src, tmp_path / "out", to="mla", options={"kv_size": 40, "calib_tokens": 1024, "refine_steps": 0},
                  measure=False).out
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        expected = model.generate(ids[:, :10], attention_mask=torch.ones(2, 10, dtype=torch.long), max_new_tokens=12,
                                  do_sample=False)
        assert absorb(model) == 2
        torch.testing.assert_close(model(input_ids=ids).logits, reference, rtol=1e-10, atol=1e-10)
        first = model(input_ids=ids[:, :20], use_cache=True)
        chunk = model(input_ids=ids[:, 20:30], cache=first.cache, use_cache=True)
        cache, parts = chunk.cache, [first.logits, chunk.logits]
        for t in range(30, 40):
            step = model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
            cache = step.cache
            parts.append(step.logits)
        torch.testing.assert_close(torch.cat(parts, dim=1), reference, rtol=1e-10, atol=1e-10)
        assert torch.equal(model.generate(ids[:, :10], attention_mask=torch.ones(2, 10, dtype=torch.long),
                                          max_new_tokens=12, do_sample=False), expected)
    loaded, _, _ = load_model(out)  # effattn loads MLA models with the absorbed attention
    assert loaded.model.layers[0].self_attn.forward.__func__.__name__ == "_absorbed_forward"
    native, _, _ = load_model(out, attn_implementation="sdpa")
    assert not hasattr(native.model.layers[0].self_attn.forward, "__func__") or \
        native.model.layers[0].self_attn.forward.__func__.__name__ != "_absorbed_forward"


def test_the_heal_mla_recipe_trains_the_scaled_latent_rows_at_their_scale(capsys, tiny, tmp_path):
    """`effattn finetune heal-mla train.mla_latent=scaled`: convert, distil, write a native DeepseekV3 (no
    parametrization left in its tensors) whose latent rows moved by the same relative amount as ordinary
    weights (a row-scale parametrization; a plain step would be ~1e9 times their size) while the latent
    norm stayed as converted."""
    from safetensors.torch import load_file

    from effattn.attention.mla import latent_row_scale

    from .test_cli_errors import run_cli

    (tmp_path / "train.txt").write_text("a latent cache learns what the heads need to keep. " * 400)
    (tmp_path / "held.txt").write_text("held out words for the evaluation. " * 100)
    src = tiny("llama", heads=6, kv_heads=3, head_dim=16, layers=2)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "finetune", "heal-mla", "-o", out, f"student.model={src}",
                           "student.convert.kv_size=32", "student.convert.calib_tokens=1024",
                           f"data.sources=[{tmp_path / 'train.txt'}]", "data.seq_len=64", "train.max_steps=2",
                           f"eval.corpora=[{tmp_path / 'held.txt'}]", "eval.seq_len=64", "eval.tokens=128",
                           "eval.every=2", "checkpoint.every=2", "optimizer.lr=1e-3", "schedule.warmup_steps=0",
                           "train.mla_latent=scaled")
    assert code in (0, None), err
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["kv_lora_rank"] + config["qk_rope_head_dim"] == 32
    r = config["kv_lora_rank"]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if s["kind"] == "train"] == [1, 2]
    student = convert(src, tmp_path / "student", to="mla", options={"kv_size": 32, "calib_tokens": 1024,
                                                                     "refine_steps": 0}, measure=False).out  # the conversion is deterministic: the student as it started
    before = {k: v for f in student.glob("*.safetensors") for k, v in load_file(f).items()}
    after = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert before.keys() == after.keys()  # the parametrization is folded back: plain DeepseekV3 tensors
    for name in before:
        if "kv_a_layernorm" in name:
            assert torch.equal(before[name], after[name]), name
        if "kv_a_proj_with_mqa" in name:
            w0, w1 = before[name].double(), after[name].double()
            assert latent_row_scale(w0, r) < 1e-6  # the linear-regime scaling (convert/mla.py)
            moved = ((w1[:r] - w0[:r]).norm() / w0[:r].norm()).item()
            moved_rot = ((w1[r:] - w0[r:]).norm() / w0[r:].norm()).item()
            # two Adam steps at lr 1e-3: a relative change of the rotary rows' order, not 1e9 times it
            assert 0.1 * moved_rot < moved < 10 * moved_rot and 0 < moved < 0.1, (name, moved, moved_rot)
    assert any(not torch.equal(before[n], after[n]) for n in before if "kv_b_proj" in n)
    native = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)  # plain transformers reads it
    assert torch.isfinite(native(IDS).logits).all()


def test_row_scale_parametrization_is_exact_and_folds_back(tiny, tmp_path):
    """scale_latent_rows changes nothing in the forward; unscale_latent_rows leaves plain weights; LoRA on the
    scaled modules is refused with the modules to target instead."""
    from effattn.attention.mla import scale_latent_rows, unscale_latent_rows
    from effattn.finetune.config import Train
    from effattn.finetune.params import select_trainable

    src = tiny("llama", heads=4, kv_heads=2, head_dim=16, layers=2)
    out = convert(src, tmp_path / "mla", to="mla", options={"kv_size": 24, **CALIB}, measure=False).out
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    ref = model(IDS).logits
    weights = [layer.self_attn.kv_a_proj_with_mqa.weight.detach().clone() for layer in model.model.layers]
    assert scale_latent_rows(model) == 2
    torch.testing.assert_close(model(IDS).logits, ref, rtol=1e-12, atol=1e-12)
    assert unscale_latent_rows(model) == 2
    assert sorted(dict(model.named_parameters()).keys()) == sorted(
        dict(AutoModelForCausalLM.from_pretrained(out).named_parameters()).keys())
    for layer, w in zip(model.model.layers, weights):
        torch.testing.assert_close(layer.self_attn.kv_a_proj_with_mqa.weight, w, rtol=1e-15, atol=0)
    frozen = select_trainable(model, Train(max_steps=1))  # the default: the latent projection stays
    assert not frozen.model.layers[0].self_attn.kv_a_proj_with_mqa.weight.requires_grad
    assert frozen.model.layers[0].self_attn.kv_b_proj.weight.requires_grad
    scaled = select_trainable(model, Train(max_steps=1, mla_latent="scaled"))
    kv_a = scaled.model.layers[0].self_attn.kv_a_proj_with_mqa
    assert kv_a.parametrizations.weight.original.requires_grad
    assert not scaled.model.layers[0].self_attn.kv_a_layernorm.weight.requires_grad
    assert unscale_latent_rows(model) == 2
    with pytest.raises(EffattnError, match="kv_a_proj_with_mqa.*target q_proj"):
        select_trainable(model, Train(max_steps=1, params="lora", lora={"target_modules": ["q_proj", "kv_a_proj_with_mqa"]}))


def test_the_plan_names_the_refinement_it_runs(tiny, tmp_path):
    """MLA refines 30 steps by default, and its dry run said nothing of it (GQA's and VQ's plans do)."""
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    plan = convert(src, tmp_path / "out", to="mla", options={"kv_size": 16}, measure=False, dry_run=True).plan
    row = dict(plan.summary)["refinement"]
    assert row.startswith("30 Adam steps per layer") and "activations after the layer" in row
    plan = convert(src, tmp_path / "out", to="mla", options={"kv_size": 16, "refine_steps": 0}, measure=False,
                   dry_run=True).plan
    assert dict(plan.summary)["refinement"].startswith("none")
