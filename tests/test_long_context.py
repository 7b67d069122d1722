"""Long context: the retrieval grid (`eval --task passkey|needle`) and RoPE scaling as a conversion."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from effattn.io.load import load_model, load_tokenizer
from effattn.retrieval import PromptBuilder, RetrievalSettings, greedy_answer, is_correct

from .test_cli_errors import assert_one_line_error, run_cli


# -- retrieval --------------------------------------------------------------------------------------


def test_the_grid_estimate_prices_a_bfloat16_model_at_the_bfloat16_probe(tiny, monkeypatch):
    """Each prompt is a prefill through the decoder layers with logits at its last position (their matmuls priced
    at PREFILL_EFFICIENCY: a bfloat16 grid's at the bfloat16 probe times resources.HALF_EFFICIENCY; the attention
    at ATTENTION_EFFICIENCY of the float32 probe in either dtype) and one decode step per further answer token
    (bound by memory: DECODE_EFFICIENCY of the float32 probe in either dtype), after the model loads.
    bfloat16 weights count 2 bytes a parameter."""
    import effattn.resources as resources
    from effattn.io.checkpoint import Checkpoint
    from effattn.retrieval import estimate

    rates = {torch.float32: 2e11, torch.bfloat16: 1e12}
    monkeypatch.setattr(resources, "matmul_flops", lambda dtype=torch.float32: rates[dtype])
    ckpt = Checkpoint(tiny("llama"))  # tied embeddings
    dims, n = resources.Dims.of(ckpt.config), ckpt.num_params
    table = dims.vocab * dims.hidden
    settings = RetrievalSettings(lengths=(2048, 4096), depths=(0.5,), samples=2).validate()
    fp32, fp32_bytes = estimate(ckpt.config, n, settings)
    bf16, bf16_bytes = estimate(ckpt.config, n, settings, dtype=torch.bfloat16)

    def priced(matmul_rate: float) -> float:
        seconds = resources.MODEL_LOAD_SECONDS
        for length in (2048, 4096):
            matmuls = 2 * (n - table) * length + 2 * table
            attention = dims.layers * dims.scores_flops(length, length)
            step = 2 * n + dims.layers * dims.scores_flops(1, 2 * length)
            seconds += 2 * (matmuls / matmul_rate + attention / (2e11 * resources.ATTENTION_EFFICIENCY)
                            + 9 * step / (2e11 * resources.DECODE_EFFICIENCY))
        return seconds

    assert fp32 == pytest.approx(priced(2e11 * resources.PREFILL_EFFICIENCY), rel=1e-9)
    assert bf16 == pytest.approx(priced(1e12 * resources.PREFILL_EFFICIENCY * resources.HALF_EFFICIENCY), rel=1e-9)
    assert fp32_bytes - bf16_bytes == 2 * n

@pytest.mark.parametrize("task,filler", [("passkey", None), ("needle", None), ("passkey", "britannica")])
def test_prompts_have_the_cells_length_and_the_fact_at_its_depth(tiny, task, filler):
    tok = load_tokenizer(tiny("llama"))
    settings = RetrievalSettings(task=task, lengths=(600, 900), depths=(0.0, 0.5, 1.0), samples=2, filler=filler).validate()
    prompts = PromptBuilder(tok, settings).prompts()
    assert len(prompts) == 2 * 3 * 2
    for p in prompts:
        assert len(p.ids) == p.length
        text = tok.decode(p.ids)
        assert text.count(p.answer) == (2 if task == "passkey" else 1)  # the key is in the text, once per mention
        fact = tok.decode(p.ids[p.position :])
        assert fact.lstrip().startswith("The pass key is" if task == "passkey" else "One of the special magic numbers")
    head = [p.position for p in prompts if p.depth == 0.0]
    tail = [p.position for p in prompts if p.depth == 1.0]
    assert max(head) < min(p.position for p in prompts if p.depth == 0.5) < min(tail)
    again = PromptBuilder(tok, settings).prompts()  # deterministic for a seed
    assert [p.ids for p in again] == [p.ids for p in prompts]
    other = PromptBuilder(tok, RetrievalSettings(task=task, lengths=(600,), depths=(0.5,), samples=2, seed=1,
                                                 filler=filler).validate()).prompts()
    assert [p.answer for p in other] != [p.answer for p in prompts[:2]]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "vq"])
def test_chunked_prefill_answers_as_one_forward_does(tiny, tmp_path, kind):
    """Greedy decoding after a prefill in 64-token chunks through the cache equals the one-pass prefill
    (ReRoPE+VQ's own cache too)."""
    src = tiny("qwen2" if kind == "qwen2" else "llama")
    if kind == "vq":
        from effattn.convert import convert

        src = convert(src, tmp_path / "vq", to="vq", options={"codebook_size": 8, "window": 16, "calib_tokens": 2048},
                      measure=False).out
    model, _, _ = load_model(src)
    ids = torch.randint(0, 250, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    assert greedy_answer(model, ids, 8, chunk=64) == greedy_answer(model, ids, 8, chunk=10**6)


def test_an_answer_is_right_when_its_first_number_is_the_key():
    assert is_correct(" 40231. Remember it.", "40231")
    assert not is_correct(" 4023 1", "40231")
    assert not is_correct(" the pass key is 402311", "40231")
    assert not is_correct(" no number", "40231")


def test_retrieval_cli_writes_the_grid_the_heatmap_and_the_baseline(capsys, tiny, tmp_path):
    src = tiny("llama")
    code, out, err = run_cli(capsys, "eval", src, "--task", "passkey", "--lengths", "300,400", "--depths", "0,1",
                             "--samples", "2", "--baseline", src, "--plot", tmp_path / "grid.png", "--json")
    assert code in (0, None), err
    report = json.loads(out)
    assert set(report["accuracy"]) == {"300", "400"} and set(report["accuracy"]["300"]) == {"0.0", "1.0"}
    assert report["baseline_accuracy"] == report["accuracy"]  # the same model on the same prompts
    assert len(report["samples"]) == 8 and all(s["output"] == s["baseline_output"] for s in report["samples"])
    assert (tmp_path / "grid.png").read_bytes()[:4] == b"\x89PNG"
    assert "16 prompts: estimated ~" in err  # 2 lengths x 2 depths x 2 samples, two models, before the work
    code, out, err = run_cli(capsys, "eval", src, "--task", "needle", "--lengths", "1000", "--depths", "0.5",
                             "--samples", "1", "--plot", tmp_path / "table.png")  # the table, then the plot
    assert code in (0, None), err
    flat = "".join(out.split())  # the console wraps long lines at any width
    assert "exact-matchaccuracy" in flat and f"wrote{tmp_path / 'table.png'}" in flat
    assert (tmp_path / "table.png").read_bytes()[:4] == b"\x89PNG"
    assert "beyond" not in err  # 1,000 fits the tiny model's 4,096 positions: no warning
    code, out, err = run_cli(capsys, "eval", src, "--task", "passkey", "--lengths", "5000", "--depths", "1",
                             "--samples", "1", "--json")
    assert code in (0, None), err
    assert "--lengths up to 5,000 is beyond" in err and "max_position_embeddings (4,096" in err
    code, _, err = run_cli(capsys, "eval", src, "--context", "5000", "--max-tokens", "5000", "--no-speed",
                           "--corpus", "shakespeare")
    assert code in (0, None), err
    assert "--context 5,000 is beyond" in err and "max_position_embeddings (4,096" in err


@pytest.mark.parametrize("args,needle", [
    (["--task", "passkey", "--lengths", "100"], "at least 128 tokens"),
    (["--task", "passkey", "--lengths", "200"], "leaves no room for filler"),
    (["--task", "passkey", "--lengths", "2k"], "not a comma-separated list"),
    (["--task", "passkey", "--depths", "0,2"], "depths are fractions from 0 to 1"),
    (["--task", "recall"], "unknown task 'recall'"),
    (["--task", "needle", "--filler", "nope.txt"], "nope.txt"),
    (["--task", "passkey", "--lengths", "300000000"], "use --lengths values of"),
    (["--plot", "x.png"], "--plot applies to --task passkey and needle"),
    (["--lengths", "512"], "--lengths applies to --task passkey and needle"),
    (["--samples", "2"], "--samples applies to --task passkey and needle"),
    (["--task", "passkey", "--corpus", "britannica"], "--corpus applies to perplexity"),
])
def test_bad_retrieval_settings_are_refused_before_work(capsys, tiny, args, needle):
    code, _, err = run_cli(capsys, "eval", tiny("llama"), *args)
    assert_one_line_error(code, err, needle)


# -- RoPE scaling ------------------------------------------------------------------------------------


def _rope(folder):
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("args,expect", [
    (["--rope-type", "linear", "--factor", "4"], {"rope_type": "linear", "factor": 4.0}),
    (["--rope-type", "dynamic", "--factor", "2"], {"rope_type": "dynamic", "factor": 2.0}),
    (["--rope-type", "yarn", "--factor", "4", "--beta-fast", "16"],
     {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096}),
    (["--rope-type", "llama3", "--factor", "8"],
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
    (["--rope-type", "longrope", "--factor", "2"], {"rope_type": "longrope", "factor": 2.0}),
])
def test_rope_scaling_writes_native_rope_parameters_and_keeps_the_weights(capsys, tiny, tmp_path, family, args, expect):
    from transformers import AutoModelForCausalLM

    src = tiny(family)
    out = tmp_path / "scaled"
    code, _, err = run_cli(capsys, "convert", src, "--to", "rope-scaling", *args, "-o", out, "--no-eval")
    assert code in (0, None), err
    config = _rope(out)
    params = config["rope_parameters"]
    assert expect.items() <= params.items()
    assert "rope_scaling" not in config
    factor = expect["factor"]
    assert config["max_position_embeddings"] == (4096 if expect["rope_type"] == "dynamic" else int(4096 * factor))
    a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model = AutoModelForCausalLM.from_pretrained(out)  # plain transformers
    assert model.config.rope_parameters["rope_type"] == expect["rope_type"]
    code, out_text, _ = run_cli(capsys, "inspect", out, "--json")
    info = json.loads(out_text)
    assert info["trained_length"] == 4096 and f"x{factor:g} of the trained 4,096" in info["context_length"]


def test_linear_scaling_divides_every_frequency_and_dynamic_is_exact_within_the_trained_length(tiny, tmp_path):
    from effattn.convert import convert

    src = tiny("llama")
    ids = torch.randint(0, 250, (1, 96), generator=torch.Generator().manual_seed(0))
    original, _, _ = load_model(src)
    linear, _, _ = load_model(convert(src, tmp_path / "lin", to="rope-scaling",
                                      options={"rope_type": "linear", "factor": 4}, measure=False).out)
    assert torch.allclose(linear.model.rotary_emb.inv_freq, original.model.rotary_emb.inv_freq / 4)
    dynamic, _, _ = load_model(convert(src, tmp_path / "dyn", to="rope-scaling",
                                       options={"rope_type": "dynamic", "factor": 4}, measure=False).out)
    with torch.no_grad():
        assert torch.equal(dynamic(input_ids=ids).logits, original(input_ids=ids).logits)
    yarn, _, _ = load_model(convert(src, tmp_path / "yarn", to="yarn", options={"factor": 4}, measure=False).out)
    with torch.no_grad():  # yarn changes positions inside the trained length too (interpolated bands)
        assert not torch.allclose(yarn(input_ids=ids).logits, original(input_ids=ids).logits)


@pytest.mark.parametrize("args,needle", [
    ([], "needs --rope-type and --factor"),
    (["--rope-type", "yarn"], "needs --rope-type and --factor"),
    (["--rope-type", "yarn", "--factor", "1"], "--factor"),
    (["--rope-type", "ntk", "--factor", "2"], "--rope-type"),
    (["--rope-type", "linear", "--factor", "2", "--beta-fast", "8"], "--beta-fast applies to --rope-type yarn, not linear"),
    (["--rope-type", "yarn", "--factor", "2", "--beta-fast", "1", "--beta-slow", "2"], "must be above --beta-slow"),
    (["--rope-type", "llama3", "--factor", "2", "--high-freq-factor", "0.5"], "must be above --low-freq-factor"),
    (["--rope-type", "longrope", "--factor", "2", "--long-factors", "1,2"], "this model has 4 RoPE frequencies"),
    (["--rope-type", "longrope", "--factor", "2", "--long-factors", "a,b"], "not a comma-separated list"),
])
def test_bad_rope_scaling_options_are_refused_before_work(capsys, tiny, tmp_path, args, needle):
    for dry in ([], ["--dry-run"]):
        code, _, err = run_cli(capsys, "convert", tiny("llama"), "--to", "rope-scaling", *args, "-o", tmp_path / "o", *dry)
        assert_one_line_error(code, err, needle)
    assert not (tmp_path / "o").exists()


def test_rescaling_a_scaled_model_starts_from_its_trained_length(tiny, tmp_path):
    from effattn.convert import convert

    once = convert(tiny("llama"), tmp_path / "a", to="yarn", options={"factor": 2}, measure=False).out
    twice = convert(once, tmp_path / "b", to="yarn", options={"factor": 8}, measure=False).out
    config = _rope(twice)
    assert config["rope_parameters"]["original_max_position_embeddings"] == 4096
    assert config["max_position_embeddings"] == 4096 * 8


def test_a_scaling_that_replaces_the_models_own_says_so_and_the_same_one_is_refused(capsys, tiny, tmp_path):
    """The factor multiplies the trained length: yarn x2 on a linear x2 model gave the context it had, and yarn x2
    on yarn x2 wrote the same config, without a word."""
    from effattn.convert import convert

    linear = tiny("llama", rope_scaling={"rope_type": "linear", "factor": 2.0}, max_position_embeddings=4096)
    plan = convert(linear, None, to="yarn", options={"factor": 2}, dry_run=True, measure=False).plan
    assert dict(plan.summary)["replaces"] == ("the model's own linear x2.0 (context 4,096); --factor multiplies the "
                                              "trained length, 2,048")
    assert "replaces" not in dict(convert(tiny("llama"), None, to="yarn", options={"factor": 2}, dry_run=True,
                                          measure=False).plan.summary)
    once = convert(tiny("llama"), tmp_path / "a", to="yarn", options={"factor": 2}, measure=False).out
    for dry in (["--dry-run"], []):
        code, _, err = run_cli(capsys, "convert", once, "--to", "yarn", "--factor", "2", "-o", tmp_path / "b", *dry)
        assert_one_line_error(code, err, "already scales RoPE the same way (yarn x2.0, trained 4,096)",
                              "--factor multiplies the trained length (4,096)")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "vq"])
def test_long_blocks_are_scored_through_the_cache_in_chunks_as_in_one_forward(tiny, tmp_path, kind):
    from effattn.evaluate import final_hidden

    src = tiny("qwen2" if kind == "qwen2" else "llama")
    if kind == "vq":
        from effattn.convert import convert

        src = convert(src, tmp_path / "vq", to="vq", options={"codebook_size": 8, "window": 16, "calib_tokens": 2048},
                      measure=False).out
    model, _, _ = load_model(src)
    ids = torch.randint(0, 250, (2, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole, chunked = final_hidden(model, ids, chunk=10**6), final_hidden(model, ids, chunk=48)
    assert chunked.shape == whole.shape
    assert torch.allclose(chunked, whole, atol=1e-4, rtol=1e-4), (chunked - whole).abs().max()


def test_the_context_extension_recipe_trains_a_scaled_student_on_cross_entropy(capsys, tiny, tmp_path):
    (tmp_path / "train.txt").write_text("long documents teach long context. " * 600)
    (tmp_path / "held.txt").write_text("held out words for the evaluation. " * 100)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "finetune", "extend-context", "-o", out, f"student.model={tiny('llama')}",
                           f"data.sources=[{tmp_path / 'train.txt'}]", "data.seq_len=128", "train.max_steps=2",
                           f"eval.corpora=[{tmp_path / 'held.txt'}]", "eval.seq_len=128", "eval.tokens=256",
                           "eval.every=2", "checkpoint.every=2")
    assert code in (0, None), err
    config = _rope(out)
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["max_position_embeddings"] == 2 * 4096
    record = json.loads((out / "effattn.json").read_text())
    assert record["finetune"]["recipe"]["loss"]["ce"] == 1.0 and record["finetune"]["recipe"]["loss"]["kl"] == 0.0


def test_alibi_is_refused_with_the_measured_reason(capsys, tiny, tmp_path):
    code, _, err = run_cli(capsys, "convert", tiny("llama"), "--to", "alibi", "-o", tmp_path / "o")
    assert_one_line_error(code, err, "--to alibi is refused", "perplexity 32.1 -> 417", "--to rope-scaling")


def test_a_dynamic_ntk_model_is_prefilled_in_one_forward(tiny):
    """Dynamic NTK rescales RoPE to each forward's longest position: chunks through the cache would mix
    keys rotated at different frequencies, so retrieval and long evaluation run it in one forward."""
    import json as _json

    from effattn.evaluate import final_hidden, one_pass_only

    src = tiny("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    config = _json.loads((src / "config.json").read_text())
    config["max_position_embeddings"] = 64  # scaling starts beyond 64 positions
    config["rope_parameters"]["original_max_position_embeddings"] = 64
    (src / "config.json").write_text(_json.dumps(config))
    model, _, _ = load_model(src)
    assert one_pass_only(model) and not one_pass_only(load_model(tiny("llama"))[0])
    ids = torch.randint(0, 250, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # chunks through the cache on a fresh model: each chunk rescales RoPE to its own last position
        cache, parts = None, []
        for start in range(0, 300, 64):
            out = model(input_ids=ids[:, start : start + 64], cache=cache, use_cache=True)
            cache = out.cache
            parts.append(out.logits)
        whole = model(input_ids=ids, use_cache=False).logits
        assert (torch.cat(parts, 1) - whole).abs().max() > 1e-3  # what the one-forward rule avoids
        torch.testing.assert_close(final_hidden(model, ids, chunk=64), whole)
        assert greedy_answer(model, ids[0].tolist(), 1, chunk=64)[0] == int(whole[0, -1].argmax())
