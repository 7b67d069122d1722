"""Softmax -> linear attention as a conversion (`--to linear`, LoLCATs): the original model while the window
covers the sequence, attention transfer lowering every layer's error, an output that loads (effattn or
remote code alone) and decodes from its constant-size cache as the full forward, refusals in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import effattn  # noqa: F401 - registers effattn_linear with transformers
from effattn.attention.linear import INIT_WINDOW_FACTOR, LinearCache, SplitState
from effattn.convert import convert

from .conftest import logits_of
from .test_cli_errors import assert_one_line_error, run_cli
from .test_linear_model import decode_in_pieces

IDS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
# a short attention transfer on the tiny models: blocks of 64 calibration tokens, window 8
FAST = {"window": 8, "calib_tokens": 512, "calib_seq_len": 64, "refine_steps": 10}


def load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def attention_weights(folder) -> dict[str, torch.Tensor]:
    tensors = load_file(folder / "model.safetensors")
    return {n: t for n, t in tensors.items() if any(p in n for p in ("q_proj", "k_proj", "v_proj", "o_proj", "norm"))}


@pytest.mark.parametrize("family,fmap", [("llama", "hedgehog"), ("qwen3", "elu")])
def test_a_window_covering_the_sequence_is_the_original_model(tiny, tmp_path, family, fmap):
    src = tiny(family, heads=6, kv_heads=3, head_dim=8)
    out = convert(src, tmp_path / "lin", to="linear", options={"feature_map": fmap, "refine_steps": 0},
                  measure=False).out  # zero-shot, window 64 > 40 tokens
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "effattn_linear" and config["linear_window"] == 64
    assert config["linear_feature_map"]["name"] == fmap and (out / "modeling_effattn_linear.py").exists()
    model = load(out)
    assert type(model).__name__ == "EffattnLinearForCausalLM"
    original = logits_of(src, IDS, torch.float64)
    # eps in the shared normaliser: a relative change of at most eps / wf per layer (wf = 1/11 at init)
    bound = 10 * 1e-6 * 11 * original.abs().max().item()
    assert (logits(model) - original).abs().max().item() < bound
    source = attention_weights(src)
    assert all(torch.equal(attention_weights(out)[n], t) for n, t in source.items())  # q/k/v/o copied unchanged
    record = json.loads((out / "effattn.json").read_text())
    assert "conversion_run" not in record and record["conversion"]["refine_steps"] == 0


@pytest.mark.parametrize("fmap,extra", [("hedgehog", {"projection_dim": 8}), ("elu", {}), ("taylor", {})])
def test_attention_transfer_lowers_every_layers_error(tiny, tmp_path, fmap, extra):
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    out = convert(src, tmp_path / "lin", to="linear", options=FAST | extra | {"feature_map": fmap}, measure=False).out
    record = json.loads((out / "effattn.json").read_text())
    losses = record["conversion_run"]["refine"]
    assert len(losses["before"]) == len(losses["after"]) == 2
    assert all(a < b for a, b in zip(losses["after"], losses["before"])), losses  # below the untrained maps'
    assert {"to": "linear", "feature_map": fmap, "window": 8, "refine_steps": 10, "refine_lr": 0.01,
            "refine_target": "attention"}.items() <= record["conversion"].items()
    tensors = load_file(out / "model.safetensors")
    # trained: the mix (every map) and the learned maps (hedgehog); the projections are the source's
    for layer in range(2):
        wf = tensors[f"model.layers.{layer}.self_attn.window_factors"]
        assert wf.shape == (6,) and not torch.allclose(wf, torch.full((6,), INIT_WINDOW_FACTOR))
        if fmap == "hedgehog":
            assert tensors[f"model.layers.{layer}.self_attn.feature_map_q.weight"].shape == (6, 8, 8)
    source = attention_weights(src)
    assert all(torch.equal(tensors[n], t) for n, t in source.items())
    # the same folder with the window over the whole sequence is the original again: only the maps changed
    model = load(out)
    model.config.linear_window = IDS.shape[1]
    original = logits_of(src, IDS, torch.float64)
    assert (logits(model) - original).abs().max().item() < 1e-3 * original.abs().max().item()


def test_the_output_loads_with_remote_code_and_decodes_as_the_full_forward(tiny, tmp_path):
    from .remote import remote_logits

    src = tiny("qwen3", heads=6, kv_heads=2, head_dim=8)
    out = convert(src, tmp_path / "lin", to="linear", options=FAST | {"projection_dim": 8, "sinks": 2}, measure=False).out
    model = load(out)
    assert model.config.linear_sinks == 2  # the sinks travel in the config, to the bundled code too
    assert json.loads((out / "effattn.json").read_text())["conversion"]["sinks"] == 2
    full = logits(model)
    torch.testing.assert_close(remote_logits(out, IDS, "EffattnLinearForCausalLM", tmp_path), full, rtol=0, atol=0)
    # cached: a prefill past the window, then one token at a time through the constant-size cache
    got, cache = decode_in_pieces(model, IDS, [13] + [1] * (IDS.shape[1] - 13))
    assert isinstance(cache, LinearCache)
    assert all(state.sink_k.shape[1] == 2 for state in cache.states.values())
    torch.testing.assert_close(got, full, rtol=1e-9, atol=1e-9)
    generated = model.generate(IDS[:1, :8], max_new_tokens=16, min_new_tokens=16, do_sample=False)
    predicted = logits(model, generated)[0, 7:-1]
    predicted[:, model.generation_config.eos_token_id] = float("-inf")  # min_new_tokens suppresses EOS
    assert torch.equal(predicted.argmax(-1), generated[0, 8:])


@pytest.mark.parametrize("args, needles", [
    (["--feature-map", "linformer"], ["Linformer projects keys and values along the sequence axis",
                                      "breaks causal decoding"]),
    (["--feature-map", "cosformer"], ["unknown --feature-map 'cosformer'"]),
    (["--features", "32"], ["--features applies to --feature-map performer, not hedgehog"]),
    (["--feature-map", "elu", "--projection-dim", "8"], ["--projection-dim applies to --feature-map hedgehog, not elu"]),
    (["--window", "-1"], ["--window must be an integer >= 0, got -1"]),
    (["--window", "4096"], ["covers the whole trained context"]),
    (["--sinks", "2", "--window", "0"], ["--sinks 2 needs a window", "--window W"]),
    (["--sinks", "-1"], ["--sinks must be an integer >= 0, got -1"]),
    (["--global-cache", "8", "--window", "0"], ["--global-cache 8 needs a window", "--window W"]),
    (["--global-cache", "-2"], ["--global-cache must be an integer >= 0, got -2"]),
    (["--refine-steps", "0", "--calib-tokens", "1024"], ["--calib-tokens set attention transfer", "--refine-steps 0"]),
    (["--calib-seq-len", "64", "--window", "64"], ["must be longer than the window"]),
    (["--codebook-size", "8"], ["--codebook-size does not apply to linear"]),
    (["--calib-positions", "1000"], ["--calib-positions 1000 is shorter than a calibration sequence",
                                     "--calib-positions 0"]),
    (["--refine-steps", "0", "--calib-positions", "0"], ["--calib-positions set attention transfer"]),
    (["--feature-map", "elu", "--window", "0", "--refine-steps", "5"], ["attention transfer has nothing to train"]),
    (["--refine-device", "gpu"], ["--refine-device = 'gpu': must be auto, cpu, cuda or cuda:N"]),
    (["--refine-steps", "0", "--refine-device", "cpu"], ["--refine-device set attention transfer", "--refine-steps 0"]),
] + ([(["--refine-device", "cuda"], ["--refine-device cuda asked for, but torch sees no CUDA GPU", "pass --refine-device cpu"])]
     if not torch.cuda.is_available() else []))
def test_bad_options_are_one_line_errors_and_write_nothing(tiny, tmp_path, capsys, args, needles):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", tiny("llama"), "--to", "linear", *args, "-o", out, "--no-eval")
    assert code == 2, err
    assert_one_line_error(code, err, *needles)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_dry_run_states_the_constant_cache_and_writes_nothing(tiny, tmp_path, capsys, monkeypatch):
    src = tiny("llama", layers=2)
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "convert", src, "--to", "linear", "--feature-map", "performer", "--features",
                                "16", "--dry-run", "--json", "-o", out, "--no-eval")
    assert code == 0, err
    plan = json.loads(stdout)
    assert plan["output"] is None and not out.exists()
    assert {"feature_map": "performer", "features": 16, "window": 64, "sinks": 4,
            "refine_steps": 40}.items() <= plan["settings"].items()
    line = plan["summary"]["KV cache"]
    # 2 layers x 6 query heads: S [16, 8] and z [16] in float32; the window: k, v (float32) and fk (float32);
    # by default 4 sinks: their keys and values
    sinks = 4 * 2 * 6 * (8 + 8) * 4
    assert "constant after 68 tokens" in line and "the first 4 (sinks)" in plan["summary"]["attention"]
    assert f"state S, z {2 * 6 * (16 * 8 + 16) * 4:,}" in line and f"64 x {2 * 6 * (8 + 8 + 16) * 4:,} bytes/token" in line
    assert f"+ 4 sinks {sinks:,}" in line
    before, after = plan["kv_bytes_per_token"]
    assert before == 2 * 2 * 3 * 8 * 4 and after == pytest.approx((2 * 6 * 144 * 4 + 64 * 2 * 6 * 32 * 4 + sinks) / 4096)
    # --sinks 0: the window and the state alone
    code, stdout, err = run_cli(capsys, "convert", src, "--to", "linear", "--feature-map", "performer", "--features",
                                "16", "--sinks", "0", "--dry-run", "--json", "-o", out, "--no-eval")
    assert code == 0, err
    plan = json.loads(stdout)
    assert plan["settings"]["sinks"] == 0 and "sinks" not in plan["summary"]["KV cache"] + plan["summary"]["attention"]
    assert "constant after 64 tokens" in plan["summary"]["KV cache"]
    assert plan["kv_bytes_per_token"][1] == pytest.approx(after - sinks / 4096)
    # which decode step generation will take here: the compiled one (CI builds it), or why not
    assert plan["summary"]["decode step"] == "compiled, one call per layer and token (kernels/linear/native.c)"
    monkeypatch.setenv("EFFATTN_NATIVE", "0")
    code, stdout, err = run_cli(capsys, "convert", src, "--to", "linear", "--dry-run", "--json", "-o", out, "--no-eval")
    assert code == 0, err
    assert json.loads(stdout)["summary"]["decode step"] == (
        "PyTorch (hybrid_attention_step): the compiled one is unavailable (turned off by EFFATTN_NATIVE=0)")
    monkeypatch.delenv("EFFATTN_NATIVE")
    # taylor without a window: nothing to fit, so no calibration either; the cache is the state alone
    code, stdout, err = run_cli(capsys, "convert", src, "--to", "linear", "--feature-map", "taylor", "--window", "0",
                                "--dry-run", "--json", "--no-eval")
    assert code == 0, err
    plan = json.loads(stdout)
    assert plan["summary"]["attention transfer"].startswith("none") and plan["settings"]["refine_steps"] == 0
    assert plan["settings"]["sinks"] == 0  # the default sinks need a window: none without one
    assert "constant from the first token" in plan["summary"]["KV cache"] and "window" not in plan["summary"]["KV cache"]
    code, stdout, _ = run_cli(capsys, "convert", "--to", "linear", "--help")
    assert code in (0, None) and "--feature-map" in stdout and "hedgehog" in stdout
    code, stdout, _ = run_cli(capsys, "inspect", src)
    assert code in (0, None) and "linear" in stdout


def test_the_cache_line_says_more_where_the_linear_cache_is_larger():
    from effattn.convert.linear import cache_line

    big = cache_line(46080, 292102200, 4632120, 64, 8192)  # SmolLM2 with Taylor features (F 4161)
    assert "larger than the original's up to 12,773 tokens" in big and big.endswith("(1.6x more)")
    small = cache_line(46080, 8985600, 276480, 64, 8192)  # hedgehog, P 64
    assert "smaller than the original's beyond 579 tokens" in small and small.endswith("(14.1x less)")


def test_the_plans_time_counts_the_hybrids_own_work():
    """The transfer's time estimate prices the hybrid attention (maps, window + sinks, the far part in F),
    not a softmax pass: a hand count on SmolLM2's sizes, no far part where the window covers the block, and
    the shared refine cost model unchanged for the conversions that pass no `converted`."""
    from effattn.convert.linear import linear_attention_flops
    from effattn.convert.refine import RefineSettings, refine_flops
    from effattn.resources import Dims

    d = Dims(hidden=576, heads=9, kv_heads=3, head_dim=64, layers=30, intermediate=1536, vocab=49152)
    proj = 2 * 2048 * 576 * (18 + 6) * 64
    per = 2 * (2 * 64 * 128) + 4 * 64 * 68 + (4 * 128 * 64 + 2 * 64 * (128 + 64))
    assert linear_attention_flops(d, 2048, 2048, 64, 4, 128, 2 * 64 * 128) == proj + 2048 * 9 * per
    short = linear_attention_flops(d, 2048, 64, 64, 0, 128, 2 * 64 * 128)  # blocks no longer than the window
    assert short == proj + 2048 * 9 * (2 * 2 * 64 * 128 + 4 * 64 * 64)
    wider = linear_attention_flops(d, 2048, 2048, 64, 4, 256, 2 * 64 * 256)
    assert wider > linear_attention_flops(d, 2048, 2048, 64, 4, 128, 2 * 64 * 128)

    rs = RefineSettings(steps=40, lr=1e-2, target="attention", batch_size=2)
    attention = d.attention_flops
    assert refine_flops(d, rs, 8192, 2048) == 3 * attention(8192, 2048) + 40 * 3 * attention(4096, 2048)
    half = refine_flops(d, rs, 8192, 2048, converted=lambda n, t: attention(n, t) / 2)
    assert half == attention(8192, 2048) + attention(8192, 2048) + 40 * 3 * attention(4096, 2048) / 2


def test_the_plans_time_grows_with_the_features_and_the_steps(tiny, tmp_path, capsys):
    src = tiny("llama", layers=2)

    def seconds(*args: str) -> float:
        code, stdout, err = run_cli(capsys, "convert", src, "--to", "linear", *args, "--dry-run", "--json", "-o",
                                    tmp_path / "x", "--no-eval")
        assert code == 0, err
        return json.loads(stdout)["est_seconds"]

    base = seconds()
    assert seconds("--projection-dim", "128") > base
    assert seconds("--refine-steps", "80") > base
    assert seconds("--refine-steps", "0") < base
    # a map without parameters fits only the mix from the hybrid's sums (mix_predictor): a step costs an o_proj,
    # not a pass of the hybrid, unless the stream target runs the whole layer
    elu = [seconds("--feature-map", "elu", "--refine-steps", str(n)) for n in (40, 400)]
    hedgehog = [seconds("--refine-steps", str(n)) for n in (40, 400)]
    assert elu[1] > elu[0] and (elu[1] - elu[0]) < (hedgehog[1] - hedgehog[0]) / 10
    stream = [seconds("--feature-map", "elu", "--refine-target", "stream", "--refine-steps", str(n)) for n in (40, 400)]
    assert stream[1] - stream[0] > 10 * (elu[1] - elu[0])


def test_the_plans_peak_counts_the_transfers_feature_tensors(tiny, tmp_path, capsys, monkeypatch):
    import effattn.convert.base as base
    from effattn.convert.linear import FEATURE_COPIES

    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    monkeypatch.setattr(base, "held", lambda: 2**30)  # the process's resident set, which moves between two plans

    def peak(fmap: str) -> int:
        code, stdout, err = run_cli(capsys, "convert", src, "--to", "linear", "--feature-map", fmap, "--calib-seq-len",
                                    "1024", "--calib-tokens", "2048", "--window", "8", "--dry-run", "--json", "-o",
                                    tmp_path / "x", "--no-eval")
        assert code == 0, err
        return json.loads(stdout)["est_peak_bytes"]

    # taylor's F 1 + 8 + 36 = 45 against elu's 8: a batch of 2 x 1,024 tokens x 6 heads in float32, FEATURE_COPIES
    # times
    assert peak("taylor") - peak("elu") == pytest.approx(FEATURE_COPIES * 2 * 1024 * 6 * (45 - 8) * 4, rel=0.15)


def test_refinement_on_auto_is_the_cpus_here_and_a_gpu_is_named_in_the_plan(tiny, tmp_path, capsys, monkeypatch):
    """refine_device auto (the default) is the CPU on a machine without a GPU: the same tensors as
    `--refine-device cpu`. Where torch sees a GPU, auto moves the steps there and the plan says so (the
    walk and its time estimate stay the CPU's)."""
    src = tiny("llama", layers=2)
    auto = convert(src, tmp_path / "auto", to="linear", options=FAST, measure=False).out
    cpu = convert(src, tmp_path / "cpu", to="linear", options=FAST | {"refine_device": "cpu"}, measure=False).out
    a, c = load_file(str(auto / "model.safetensors")), load_file(str(cpu / "model.safetensors"))
    assert a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a)
    record = json.loads((auto / "effattn.json").read_text())
    assert "refine_device" not in record["conversion"]  # stated only where it is not the CPU

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code, stdout, _ = run_cli(capsys, "convert", src, "--to", "linear", "--dry-run", "--json", "-o", tmp_path / "x",
                              "--no-eval")
    plan = json.loads(stdout)
    assert code == 0 and "on cuda (not in the time estimate)" in plan["summary"]["attention transfer"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_attention_transfer_on_cuda_fits_as_well_as_on_the_cpu(tiny, tmp_path):
    src = tiny("llama", layers=2)
    losses = {}
    for device in ("cpu", "cuda"):
        out = convert(src, tmp_path / device, to="linear", options=FAST | {"refine_device": device}, measure=False).out
        record = json.loads((out / "effattn.json").read_text())
        losses[device] = record["conversion_run"]["refine"]
        assert record["conversion"].get("refine_device", "cpu") == device
    for before, after in zip(losses["cuda"]["before"], losses["cuda"]["after"]):
        assert after < before
    assert losses["cuda"]["after"] == pytest.approx(losses["cpu"]["after"], rel=0.05)


def test_a_map_without_parameters_starts_from_the_mix_that_fits_best(tiny, tmp_path):
    """elu's phi(q).phi(k) is not on the window's scale: the transfer first sets the mix to the logit of
    INIT_WINDOW_FACTOR and MIX_GRID with the smallest error on a calibration sequence (the lowest of them
    all, checked here one by one), then trains it."""
    import copy

    from transformers import AutoModelForCausalLM

    from effattn.attention.linear import EffattnLinearConfig, LinearAttention, linear_config_from
    from effattn.convert.linear import MIX_GRID, initial_mix
    from effattn.convert.refine import attention_out

    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    cfg = EffattnLinearConfig(**linear_config_from(base.config.to_dict(), linear_window=4, linear_sinks=1,
                                                   linear_feature_map={"name": "elu"}))
    x = torch.randn(1, 24, base.config.hidden_size, generator=torch.Generator().manual_seed(0))
    cos, sin = base.model.rotary_emb(x, torch.arange(24)[None])
    original = base.model.layers[0]
    layer = copy.deepcopy(original)
    layer.self_attn = LinearAttention(layer.self_attn, cfg, 0)
    with torch.no_grad():
        target = attention_out(original, x, cos, sin)
        errors = {}
        for logit in (INIT_WINDOW_FACTOR, *MIX_GRID):
            layer.self_attn.window_factors.fill_(logit)
            errors[logit] = ((attention_out(layer, x, cos, sin) - target).pow(2).sum() / target.pow(2).sum()).item()
    logit, err = initial_mix(layer, original, x, cos, sin)
    assert err == pytest.approx(min(errors.values()), rel=1e-6) and errors[logit] == pytest.approx(err, rel=1e-6)
    assert torch.equal(layer.self_attn.window_factors, torch.full((6,), logit))
    assert len(set(round(e, 6) for e in errors.values())) > 1  # the grid's points differ: a real choice


@pytest.mark.parametrize("fmap,target", [("elu", "attention"), ("taylor", "attention"), ("performer", "stream")])
def test_fitting_only_the_mix_from_the_sums_is_the_steps_through_the_kernel(tiny, fmap, target):
    """A map without parameters trains only the mix: refinement's steps from the hybrid's four sums (computed
    once, `mix_predictor`) follow the same path as steps through the whole attention (same picks, losses,
    Adam): the same mix and errors, in float64. The stream target has no such shortcut: the hook is not used."""
    import copy

    from transformers import AutoModelForCausalLM

    from effattn.attention.linear import EffattnLinearConfig, LinearAttention, linear_config_from
    from effattn.convert.linear import mix_predictor
    from effattn.convert.refine import RefineSettings, refine_layer

    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64)
    cfg = EffattnLinearConfig(**linear_config_from(base.config.to_dict(), linear_window=4, linear_sinks=1,
                                                   linear_feature_map={"name": fmap}))
    x = torch.randn(5, 24, base.config.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    cos, sin = base.model.rotary_emb(x, torch.arange(24)[None])
    original = base.model.layers[0]
    settings = RefineSettings(steps=6, lr=0.3, target=target, schedule="cosine")
    results, mixes, calls = [], [], []

    def counted(*args):
        calls.append(1)
        return mix_predictor(*args)

    for prepare in (None, counted):
        layer = copy.deepcopy(original)
        layer.self_attn = LinearAttention(layer.self_attn, cfg, 0).double()
        results.append(refine_layer(layer, original, x, cos, sin, settings, x0=x if target == "stream" else None,
                                    trainable=["window_factors"], prepare=prepare))
        mixes.append(layer.self_attn.window_factors.detach().clone())
    assert results[0]["ran"] and results[0]["after"] < results[0]["before"]
    assert not torch.allclose(mixes[0], torch.full((6,), INIT_WINDOW_FACTOR, dtype=torch.float64))  # it trained
    assert len(calls) == (target == "attention")  # prepared once per layer, and only for the attention target
    torch.testing.assert_close(mixes[1], mixes[0], rtol=1e-9, atol=1e-9)
    for key in ("before", "after"):
        assert results[1][key] == pytest.approx(results[0][key], rel=1e-9)


def test_the_conversion_of_a_map_without_parameters_reports_its_initial_mix(tiny, tmp_path, capsys, monkeypatch):
    import effattn.convert.linear as linear
    from effattn.convert.linear import MIX_GRID

    calls = []
    real = linear.mix_predictor
    monkeypatch.setattr(linear, "mix_predictor", lambda module, x, *a, **k: calls.append(len(x)) or real(module, x, *a, **k))
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    code, stdout, err = run_cli(capsys, "convert", src, "--to", "linear", "--feature-map", "elu", "--window", "8",
                                "--refine-steps", "2", "--calib-tokens", "256", "--calib-seq-len", "32",
                                "-o", tmp_path / "elu", "--no-eval")
    assert code in (0, None), err
    mixes = json.loads((tmp_path / "elu" / "effattn.json").read_text())["conversion_run"]["initial_mix"]["layers"]
    assert [m["layer"] for m in mixes] == [0, 1] and all(m["logit"] in (INIT_WINDOW_FACTOR, *MIX_GRID) for m in mixes)
    # per layer the sums of one sequence (initial_mix's grid), then of all 8 calibration sequences (the steps)
    assert calls == [1, 8, 1, 8]
    code, stdout, err = run_cli(capsys, "convert", src, "--to", "linear", "--refine-steps", "2", "--calib-tokens", "256",
                                "--calib-seq-len", "32", "--projection-dim", "8", "--window", "8", "-o", tmp_path / "hh", "--no-eval")
    assert code in (0, None), err  # hedgehog's maps train with the mix from LoLCATs' start: no grid
    assert "initial_mix" not in json.loads((tmp_path / "hh" / "effattn.json").read_text())["conversion_run"]


def _attention_inputs(model, ids=IDS) -> list[torch.Tensor]:
    """What each layer's o_proj receives (the attention output per query head, [B, T, H * D])."""
    taken: list[torch.Tensor] = []
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(lambda _, args: taken.append(args[0]))
             for layer in model.model.layers]
    logits(model, ids)
    for hook in hooks:
        hook.remove()
    return taken


@pytest.mark.parametrize("fmap,extra", [("hedgehog", {"projection_dim": 8}), ("elu", {})])
def test_exact_heads_keep_the_original_attention_and_decode_as_the_full_forward(tiny, tmp_path, fmap, extra):
    """`--exact-heads K`: the K KV heads the transfer left furthest from the original (their recorded errors)
    get the original attention back, the others keep the hybrid; generation through the split cache (the
    exact heads' keys growing, the rest constant) equals the full forward, in float64 and through the
    compiled float32 step; training reaches only the hybrid heads' maps."""
    from .remote import remote_logits

    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    out = convert(src, tmp_path / "lin", to="linear", measure=False,
                  options=FAST | extra | {"feature_map": fmap, "sinks": 2, "exact_heads": 2}).out
    pairs = json.loads((out / "config.json").read_text())["linear_exact_heads"]
    record = json.loads((out / "effattn.json").read_text())
    errors = record["conversion"]["head_errors"]
    assert record["conversion"]["exact_heads"] == 2 and len(errors) == 2 * 3 and len(set(errors.values())) == 6
    top = sorted(errors, key=errors.get, reverse=True)[:2]
    assert pairs == sorted([int(x) for x in name.split(".")] for name in top)
    assert record["conversion"]["exact_heads_chosen"] == pairs
    model = load(out)
    assert model.config.linear_exact_heads == pairs
    # per head: layer 0's exact heads give the original's output, its other heads the all-hybrid model's
    split = _attention_inputs(model)[0].view(*IDS.shape, 6, 8)
    model.config.linear_exact_heads = []
    hybrid = _attention_inputs(model)[0].view(*IDS.shape, 6, 8)
    model.config.linear_exact_heads = [[layer, g] for layer in range(2) for g in range(3)]
    exact = _attention_inputs(model)[0].view(*IDS.shape, 6, 8)
    torch.testing.assert_close(logits(model), logits_of(src, IDS, torch.float64), rtol=1e-9, atol=1e-9)  # all exact
    model.config.linear_exact_heads = pairs
    layer0 = {g for layer, g in pairs if layer == 0}
    for g in range(3):
        rows = slice(2 * g, 2 * g + 2)
        torch.testing.assert_close(split[:, :, rows], (exact if g in layer0 else hybrid)[:, :, rows], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(hybrid, exact)
    full = logits(model)
    torch.testing.assert_close(remote_logits(out, IDS, "EffattnLinearForCausalLM", tmp_path), full, rtol=0, atol=0)
    # cached: a prefill past the window, two tokens, then one token at a time; the cache grows by the exact
    # heads' keys and values only (2 KV heads x (k, v) x 8 dims x 8 bytes per token and sequence)
    for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 2e-4)):
        model = model.to(dtype)
        full = logits(model)
        pieces, cache, start, got, sizes = [13, 2] + [1] * (IDS.shape[1] - 15), None, 0, [], []
        with torch.no_grad():
            for n in pieces:
                step = model(input_ids=IDS[:, start:start + n], cache=cache, use_cache=True)
                cache, start = step.cache, start + n
                got.append(step.logits)
                states = cache.states.values()
                hybrid = sum(st.linear.nbytes() if isinstance(st, SplitState) else st.nbytes() for st in states)
                kept = sum(2 * st.exact.k.numel() * dtype.itemsize for st in states if isinstance(st, SplitState))
                assert cache.nbytes() >= hybrid + kept  # the exact buffers hold their keys plus room to grow
                sizes.append((start, hybrid, kept))
        torch.testing.assert_close(torch.cat(got, 1), full, rtol=tol, atol=tol)
        (t0, h0, k0), (t1, h1, k1) = sizes[-6], sizes[-1]
        assert h1 == h0 and k1 - k0 == (t1 - t0) * IDS.shape[0] * 2 * 2 * 8 * dtype.itemsize
    # training: the hybrid heads' maps and mix get gradients, the exact heads' do not
    model = model.double().train()
    model(input_ids=IDS, labels=IDS, use_cache=False).loss.backward()
    attn = model.model.layers[0].self_attn
    for g in range(3):
        grad = attn.window_factors.grad[2 * g:2 * g + 2]
        assert (grad.abs().sum() == 0) == (g in layer0), (g, grad)
    if fmap == "hedgehog":
        grad = attn.feature_map_q.weight.grad.abs().sum((1, 2))
        assert all((grad[2 * g:2 * g + 2].sum() == 0) == (g in layer0) for g in range(3)), grad


def test_exact_heads_in_the_plan_and_its_refusals(tiny, tmp_path, capsys):
    src = tiny("llama", layers=2)  # 2 layers x 3 KV heads, head_dim 8, float32
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "convert", src, "--to", "linear", "--exact-heads", "2", "--dry-run", "--json",
                                "-o", out, "--no-eval")
    assert code == 0, err
    plan = json.loads(stdout)
    assert plan["settings"]["exact_heads"] == 2 and "keep their original attention" in plan["summary"]["exact heads"]
    line = plan["summary"]["KV cache"]
    exact = 2 * 2 * 8 * 4  # per token: 2 KV heads' keys and values in float32
    assert f"+ {exact:,} bytes/token for the 2 exact heads' keys and values" in line and "the hybrid heads' part constant after 68 tokens" in line
    code, stdout, err = run_cli(capsys, "convert", src, "--to", "linear", "--dry-run", "--json", "-o", out, "--no-eval")
    plain = json.loads(stdout)["kv_bytes_per_token"][1]
    # the exact heads' share of the constant part (2 of 6 KV heads) goes, their growing cache comes
    assert plan["kv_bytes_per_token"][1] == pytest.approx(plain * 4 / 6 + exact)
    # scoring the heads costs a share of one attention pass per layer on the calibration tokens
    from effattn.convert.linear import EXACT_SCORING_SHARE, LinearOptions
    from effattn.resources import Dims, compute_seconds

    config = json.loads((src / "config.json").read_text())
    defaults = LinearOptions()
    extra = 2 * EXACT_SCORING_SHARE * Dims.of(config).attention_flops(defaults.calib_tokens, defaults.calib_seq_len)
    assert plan["est_seconds"] - json.loads(stdout)["est_seconds"] == pytest.approx(compute_seconds(extra), rel=1e-6)
    for args, needles in ((["--exact-heads", "7"], ["--exact-heads 7 is more than the model's 6 KV heads"]),
                          (["--exact-heads", "1", "--refine-steps", "0"], ["--refine-steps 0 turns it off"]),
                          (["--exact-heads", "1", "--feature-map", "elu", "--window", "0"], ["nothing to transfer"])):
        code, _, err = run_cli(capsys, "convert", src, "--to", "linear", *args, "-o", out, "--no-eval")
        assert_one_line_error(code, err, *needles)
        assert not out.exists()


def test_the_exact_heads_cache_appends_in_place_with_room_to_grow():
    """FullState: appends without autograd write into buffers that grow by an eighth (at least 256
    positions), so decoding copies the keys a few times, not at every token; the kept keys are every
    append's, in order; under autograd a step leaves the state it continued unchanged."""
    from effattn.attention.exact import FullState, full_attention

    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 5, 4, generator=gen), torch.randn(1, 2, 5, 4, generator=gen)
    state, keys, values, buffers = FullState(k, v), [k], [v], set()
    for _ in range(600):
        k, v = torch.randn(1, 2, 1, 4, generator=gen), torch.randn(1, 2, 1, 4, generator=gen)
        assert state.append(k, v) is state
        keys.append(k), values.append(v), buffers.add(state._k.data_ptr())
    assert state.seen == 605 and torch.equal(state.k, torch.cat(keys, 2)) and torch.equal(state.v, torch.cat(values, 2))
    assert len(buffers) == 3  # 5 -> 262 (6 + 256) -> 519 (263 + 256) -> 776 (520 + 256); not one per token
    assert state.nbytes() == 2 * 776 * 2 * 4 * 4
    # attention through it is the full causal attention over the keys so far
    q = torch.randn(1, 1, 4, 4, generator=gen)
    cos, sin = torch.ones(1, 4), torch.zeros(1, 4)  # position's rotation: the identity, so k is its rotated key
    with torch.no_grad():
        out, same = full_attention(q, k.transpose(1, 2), v.transpose(1, 2), cos, sin, 0.5, state)
    expected = torch.softmax(0.5 * q.transpose(1, 2) @ torch.cat(keys + [k], 2).repeat_interleave(2, 1).transpose(2, 3), -1) \
        @ torch.cat(values + [v], 2).repeat_interleave(2, 1)
    assert same is state and state.seen == 606
    torch.testing.assert_close(out, expected.transpose(1, 2))
    with torch.enable_grad():  # (pytest runs with autograd on: the no_grad above is what inference sees)
        kq = k.clone().requires_grad_()
        _, new = full_attention(q, kq.transpose(1, 2), v.transpose(1, 2), cos, sin, 0.5, state)
    assert new is not state and state.seen == 606 and new.seen == 607


def test_the_fine_tunes_plan_counts_the_hybrids_activations_and_the_cpus_best_rate(tiny, tmp_path, monkeypatch):
    """A linear student keeps its feature maps' outputs for the backward: the fine-tune's memory plan adds
    ModelSpec.layer_activation_bytes per layer (taylor's F 1 + D + D (D + 1) / 2 keeps more than elu's F = D), once
    under activation checkpointing, and suggests checkpointing where that fits. On the CPU the time is priced at the
    machine's best matmul probe (resources.matmul_flops), not a live probe that may share the cores."""
    import yaml

    import effattn.finetune.plan as finetune_plan
    import effattn.resources as resources
    from effattn.convert.linear import layer_activation_bytes
    from effattn.errors import EffattnError
    from effattn.finetune.config import load_recipe

    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    (tmp_path / "train.txt").write_text("one two three four five six seven eight nine ten. " * 200)
    recipe = {"student": {"model": str(src), "convert": {"to": "linear", "window": 8, "refine_steps": 0}},
              "data": {"sources": [str(tmp_path / "train.txt")], "seq_len": 64},
              "train": {"max_steps": 2, "batch_size": 2, "params": "lora"}, "eval": {"every": 0, "corpora": []}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    monkeypatch.setattr(resources, "matmul_flops", lambda dtype=torch.float32: 7e9)
    monkeypatch.setattr(finetune_plan, "device_flops", lambda *a, **k: pytest.fail("a live probe on the CPU"))

    def plan(*overrides, **kw):
        return finetune_plan.plan_finetune(load_recipe(tmp_path / "r.yaml", list(overrides), output=tmp_path / "o"), 1, **kw)

    elu = plan("student.convert.feature_map=elu")
    taylor = plan("student.convert.feature_map=taylor")
    assert elu["est_basis"].startswith(f"{7e9 * finetune_plan.EFFICIENCY / 1e9:,.0f} GFLOP/s")
    config = {"num_attention_heads": 6, "hidden_size": 48, "head_dim": 8}
    extra = {m: layer_activation_bytes(config | {"linear_feature_map": {"name": m}}, 2, 64) for m in ("elu", "taylor")}
    slack = 17 * 8  # the heap's slack without the global cache (ACTIVATION_SLACK_HEAD_DIMS head_dims)
    assert extra["elu"] == 4 * 2 * 64 * 6 * (3 * 8 + 18 * 8 + slack)
    assert extra["taylor"] == 4 * 2 * 64 * 6 * (3 * 45 + 18 * 8 + slack)
    layers = 2
    activations = {m: p["memory_bytes_per_process"]["activations"] for m, p in (("elu", elu), ("taylor", taylor))}
    assert activations["taylor"] - activations["elu"] == layers * (extra["taylor"] - extra["elu"])
    # a global cache's kernel keeps every exactly read key's logit and weight per query: the cache, window and sinks
    from effattn.convert.linear import GLOBAL_ACTIVATION_COLUMNS

    cached = plan("student.convert.feature_map=elu", "student.convert.global_cache=5")
    assert cached["memory_bytes_per_process"]["activations"] - activations["elu"] == \
        layers * 4 * 2 * 64 * 6 * (GLOBAL_ACTIVATION_COLUMNS * (5 + 8 + 4) - slack)  # the cache absorbs the slack
    # and trains slower than the plan counts a layer: its time adds layer_train_flops per token and layer
    from effattn.convert.linear import GLOBAL_TRAIN_FLOPS, GLOBAL_TRAIN_FLOPS_PER_KEY

    added = cached["est_seconds"]["training"] - elu["est_seconds"]["training"]
    per_token = layers * 6 * (GLOBAL_TRAIN_FLOPS + GLOBAL_TRAIN_FLOPS_PER_KEY * 5)
    assert added == pytest.approx(2 * 2 * 64 * per_token / (7e9 * finetune_plan.EFFICIENCY))
    assert cached["est_seconds"]["evaluation"] == elu["est_seconds"]["evaluation"]
    checkpointed = plan("student.convert.feature_map=taylor", "distributed.activation_checkpointing=true")
    assert activations["taylor"] - checkpointed["memory_bytes_per_process"]["activations"] > extra["taylor"] / 2
    # a budget the plain run exceeds and the checkpointed one fits: the refusal names the setting
    budget = (taylor["memory_bytes_per_process"]["total"] + checkpointed["memory_bytes_per_process"]["total"]) // 2
    with pytest.raises(EffattnError, match="distributed.activation_checkpointing=true"):
        plan("student.convert.feature_map=taylor", device_memory=int(budget / finetune_plan.MEMORY_MARGIN))


def test_a_global_cache_is_planned_fitted_without_it_and_decodes_as_the_full_forward(tiny, tmp_path, capsys):
    """`--global-cache G` (LoLA): the plan counts G keys, values, feature keys and positions per query head and the
    undecided block; the maps are fitted as without it (same tensors); the output decodes as its full forward."""
    src = tiny("llama", heads=6, kv_heads=2, head_dim=8, layers=2)
    code, stdout, err = run_cli(capsys, "convert", src, "--to", "linear", "--feature-map", "performer", "--features",
                                "16", "--sinks", "0", "--global-cache", "5", "--dry-run", "--json", "--no-eval")
    assert code == 0, err
    plan = json.loads(stdout)
    assert plan["settings"]["global_cache"] == 5
    assert "a global cache of 5 far keys per head" in plan["summary"]["attention"]
    # cached: key, value (float32) and position; waiting for a decision (63): key, value and feature key
    extra = 2 * 6 * (5 * (8 * 4 + 8 * 4 + 8) + 63 * (8 * 4 + 8 * 4 + 16 * 4))
    assert f"global cache 5 keys/head and the undecided block {extra:,}" in plan["summary"]["KV cache"]
    # the compiled step computes Hedgehog's maps only: with performer the plan says generation runs PyTorch's kernel
    assert plan["summary"]["decode step"].startswith("PyTorch (global_cache_attention)")
    code, stdout, err = run_cli(capsys, "convert", src, "--to", "linear", "--global-cache", "5", "--dry-run", "--json",
                                "--no-eval")
    assert json.loads(stdout)["summary"]["decode step"] == ("compiled, one call per layer and token "
                                                            "(kernels/linear/native.c, the cache's decisions included)")
    code, stdout, err = run_cli(capsys, "convert", src, "--to", "linear", "--feature-map", "performer", "--features",
                                "16", "--sinks", "0", "--dry-run", "--json", "--no-eval")
    assert json.loads(stdout)["kv_bytes_per_token"][1] == pytest.approx(plan["kv_bytes_per_token"][1] - extra / 4096)

    opts = FAST | {"projection_dim": 8, "sinks": 2}
    with_cache = convert(src, tmp_path / "g", to="linear", options=opts | {"global_cache": 3}, measure=False).out
    without = convert(src, tmp_path / "plain", to="linear", options=opts, measure=False).out
    assert load_file(with_cache / "model.safetensors").keys() == load_file(without / "model.safetensors").keys()
    for name, tensor in load_file(with_cache / "model.safetensors").items():
        torch.testing.assert_close(tensor, load_file(without / "model.safetensors")[name], rtol=0, atol=0)
    model = load(with_cache)
    assert model.config.linear_global_cache == 3
    full = logits(model)
    assert (full - logits(load(without))).abs().max() > 1e-6  # the far keys it keeps change the output
    got, cache = decode_in_pieces(model, IDS, [13] + [1] * (IDS.shape[1] - 13))
    assert all(state.cache_k.shape[1] == 3 and state.cache_fk is None for state in cache.states.values())
    torch.testing.assert_close(got, full, rtol=1e-9, atol=1e-9)


# --- calibration sequences at positions spread over the trained length (`--calib-positions`) ---------------------


def test_calibration_sequences_start_evenly_over_the_positions_asked_for():
    from effattn.attention.layerwise import LayerFactory
    from effattn.convert.calibrate import CalibSettings, rows_of, starts
    from effattn.families import family_for

    assert starts(CalibSettings(seq_len=64, positions=4096), 8).tolist() == [0, 576, 1152, 1728, 2304, 2880, 3456, 4032]
    assert starts(CalibSettings(seq_len=64, positions=100), 3).tolist() == [0, 18, 36]  # the last ends at 100
    for positions, rows in ((0, 4), (64, 4), (4096, 1)):  # no room, or one sequence: all from position 0
        assert starts(CalibSettings(seq_len=64, positions=positions), rows).tolist() == [0] * rows
    config = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 8, "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 64,
              "max_position_embeddings": 4096, "rope_theta": 10000.0}
    factory = LayerFactory(config, family_for(config))
    first = torch.tensor([0, 7, 1000])
    cos, sin = factory.rope(16, first)
    whole_cos, whole_sin = factory.rope(1016)
    assert cos.shape == (3, 16, 8)
    for i, s in enumerate(first.tolist()):  # each row: the model's own table at its positions
        torch.testing.assert_close(cos[i], whole_cos[0, s:s + 16], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin[i], whole_sin[0, s:s + 16], rtol=0, atol=1e-6)
    assert factory.rope(16, torch.zeros(3, dtype=torch.long))[0].shape == (1, 16, 8)  # all at 0: one table
    assert rows_of((cos, sin), slice(1, 3))[0].shape == (2, 16, 8)
    one = factory.rope(16)
    assert rows_of(one, slice(1, 3))[0] is one[0]  # one table serves every sequence


@pytest.mark.parametrize("fmap,extra", [("hedgehog", {}), ("elu", {"linear_exact_heads": [[0, 1]]}),
                                        ("performer", {"linear_global_cache": 3})])
def test_a_batch_read_at_its_own_positions_is_each_sequence_alone(tiny, fmap, extra):
    """Per-sequence RoPE tables [B, T, d] through LinearAttention (the hybrid, exact heads, a global cache), the
    hybrid's sums (`mix_predictor`) and the exact heads' scores: each sequence as if it ran alone at its positions."""
    import copy

    from transformers import AutoModelForCausalLM

    from effattn.attention.linear import EffattnLinearConfig, LinearAttention, linear_config_from
    from effattn.convert.exact_heads import head_errors
    from effattn.convert.linear import mix_predictor
    from effattn.convert.refine import attention_out

    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64)
    cfg = EffattnLinearConfig(**linear_config_from(base.config.to_dict(), linear_window=4, linear_sinks=1,
                                                   linear_feature_map={"name": fmap}) | extra)
    x = torch.randn(3, 24, base.config.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    positions = torch.tensor([0, 500, 3000])[:, None] + torch.arange(24)
    cos, sin = base.model.rotary_emb(x, positions)  # [3, 24, 8]
    layer = copy.deepcopy(base.model.layers[0])
    layer.self_attn = LinearAttention(layer.self_attn, cfg, 0).double()
    with torch.no_grad():
        batch = attention_out(layer, x, cos, sin)
        alone = torch.cat([attention_out(layer, x[i:i + 1], cos[i:i + 1], sin[i:i + 1]) for i in range(3)])
        torch.testing.assert_close(batch, alone, rtol=1e-12, atol=1e-12)
        at_zero = attention_out(layer, x, cos[:1], sin[:1])
        assert (batch[1:] - at_zero[1:]).abs().max() > 1e-6  # the positions matter to the maps
        torch.testing.assert_close(batch[0], at_zero[0], rtol=0, atol=0)
        if not extra:  # the hybrid's four sums, a batch at a time
            predict = mix_predictor(layer, x, cos, sin, batch=2)
            torch.testing.assert_close(predict(torch.arange(3)), batch, rtol=1e-12, atol=1e-12)
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        taken: list[torch.Tensor] = []
        hook = attn.o_proj.register_forward_pre_hook(lambda _, a: taken.append(a[0]))
        attn(h, position_embeddings=(cos, sin))
        hook.remove()
        scores = head_errors(attn, h, taken[0], cos, sin)
        each = sum(head_errors(attn, h[i:i + 1], taken[0][i:i + 1], cos[i:i + 1], sin[i:i + 1]) for i in range(3))
        torch.testing.assert_close(scores, each, rtol=1e-12, atol=1e-12)


def test_the_transfer_reads_each_calibration_sequence_at_its_spread_positions(tiny, tmp_path, capsys, monkeypatch):
    """By default the calibration sequences start evenly over the model's trained length (max_position_embeddings,
    4,096 here): refinement gets one RoPE table per sequence, at its positions, and the activations reach the next
    layer through the fitted layer at the same positions; --calib-positions 0 reads all from 0."""
    import effattn.convert.layers as layers
    from effattn.convert.calibrate import CalibSettings, starts

    src = tiny("llama", heads=6, kv_heads=3, head_dim=8)
    seen: list[dict] = []
    real = layers.refine_layer

    def spy(converted, original, x, cos, sin, settings, **kw):
        result = real(converted, original, x, cos, sin, settings, **kw)
        with torch.no_grad():  # what the next layer should receive: each sequence alone through the fitted layer
            nxt = torch.cat([converted(x[i:i + 1], position_embeddings=(cos[i:i + 1] if len(cos) > 1 else cos,
                                                                        sin[i:i + 1] if len(sin) > 1 else sin))
                             for i in range(len(x))])
        seen.append({"x": x.clone(), "cos": cos.clone(), "next": nxt})
        return result

    monkeypatch.setattr(layers, "refine_layer", spy)
    out = convert(src, tmp_path / "lin", to="linear", options=FAST, measure=False).out
    first = starts(CalibSettings(seq_len=64, positions=4096), 8)
    assert first.tolist() == [0, 576, 1152, 1728, 2304, 2880, 3456, 4032]
    from transformers import AutoModelForCausalLM

    rotary = AutoModelForCausalLM.from_pretrained(src).model.rotary_emb
    want, _ = rotary(torch.zeros(1), first[:, None] + torch.arange(64))
    assert len(seen) == 2 and seen[0]["cos"].shape == (8, 64, 8)
    torch.testing.assert_close(seen[0]["cos"], want, rtol=0, atol=1e-6)
    torch.testing.assert_close(seen[1]["x"], seen[0]["next"], rtol=1e-5, atol=1e-5)
    assert json.loads((out / "effattn.json").read_text())["conversion"]["calib_positions"] == 4096

    seen.clear()
    out = convert(src, tmp_path / "zero", to="linear", options=FAST | {"calib_positions": 0}, measure=False).out
    assert seen[0]["cos"].shape == (1, 64, 8)
    assert json.loads((out / "effattn.json").read_text())["conversion"]["calib_positions"] == 0

    code, stdout, err = run_cli(capsys, "convert", src, "--to", "linear", "--window", "8", "--calib-tokens", "512",
                                "--calib-seq-len", "64", "--dry-run", "--json", "--no-eval")
    assert code == 0, err
    line = json.loads(stdout)["summary"]["attention transfer"]
    assert "in blocks of 64 at positions spread over 4,096 (starting at 0, 576, 1,152, 1,728, ...)" in line
    code, stdout, err = run_cli(capsys, "convert", src, "--to", "linear", "--calib-positions", "0", "--dry-run",
                                "--json", "--no-eval")
    assert "spread" not in json.loads(stdout)["summary"]["attention transfer"]
