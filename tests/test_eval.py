"""`effattn eval` on tiny models: the numbers mean what they say."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from effattn.convert import convert
from effattn.evaluate import EvalSettings, evaluate, tensor_bytes

from .test_cli_errors import assert_one_line_error, run_cli

SETTINGS = EvalSettings(corpora=("corpus.txt",), context=64, max_tokens=512, speed=True, decode_tokens=4, speed_repeats=1)


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = " ".join(f"the {w} sat on the mat number {i}." for i, w in enumerate(["cat", "dog", "bird"] * 80))
    (tmp_path / "corpus.txt").write_text(text)
    return tmp_path / "corpus.txt"


def test_model_against_itself_agrees_fully(tiny, corpus):
    src = tiny("llama")
    report = evaluate(str(src), str(src), SETTINGS)
    assert report.agreement["corpus.txt"] == 1.0
    assert abs(report.kl["corpus.txt"]) < 1e-6
    assert report.model.perplexity == report.baseline.perplexity
    assert report.tokens["corpus.txt"] == 8 * 63  # 512 tokens in blocks of 64, each predicting 63


def test_perplexity_matches_the_loss_transformers_computes(tiny, corpus):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tiny("qwen2")
    report = evaluate(str(src), None, SETTINGS)
    model = AutoModelForCausalLM.from_pretrained(src).eval()
    from effattn.data.corpora import load_text, token_blocks

    blocks = token_blocks(AutoTokenizer.from_pretrained(src), load_text(str(corpus)), 64, 512, spread=True)
    with torch.no_grad():
        losses = [model(input_ids=b[None], labels=b[None]).loss for b in blocks]
    assert report.model.perplexity["corpus.txt"] == pytest.approx(math.exp(torch.stack(losses).mean().item()), rel=1e-4)


def test_kv_bytes_are_measured_from_the_real_cache(tiny, corpus, tmp_path):
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8, layers=2)
    mqa = convert(src, tmp_path / "mqa", to="mqa", options={"method": "mean"}, measure=False).out
    report = evaluate(str(mqa), str(src), SETTINGS)
    # K and V, 2 layers, head_dim 8, float32: 3 KV heads before, 1 after
    assert report.baseline.kv_bytes_per_token == 2 * 2 * 3 * 8 * 4
    assert report.model.kv_bytes_per_token == 2 * 2 * 1 * 8 * 4
    assert report.model.prefill_tokens_per_s > 0 and report.model.decode_tokens_per_s > 0
    assert 0 <= report.agreement["corpus.txt"] <= 1 and report.kl["corpus.txt"] > 0


def test_tensor_bytes_counts_shared_storage_once():
    t = torch.zeros(10)
    assert tensor_bytes({"a": t, "b": [t, t[:5]], "c": torch.ones(3, dtype=torch.float16)}) == 40 + 6


def test_eval_cli_json(capsys, tiny, corpus):
    src = tiny("mistral")
    code, out, _ = run_cli(capsys, "eval", src, "--baseline", src, "--corpus", str(corpus), "--context", "64",
                           "--max-tokens", "256", "--no-speed", "--json")
    data = json.loads(out)
    assert code == 0 and data["agreement"][str(corpus)] == 1.0 and data["model"]["prefill_tokens_per_s"] is None


def test_eval_rejects_a_corpus_that_does_not_exist(capsys, tiny, corpus):
    code, _, err = run_cli(capsys, "eval", tiny("llama"), "--corpus", "shakespear", "--no-speed")
    assert code != 0 and "did you mean 'shakespeare'" in err


def test_decode_break_even_is_where_the_decode_time_lines_cross():
    from effattn.evaluate import decode_break_even

    def points(a, b):  # a decode step of a + b * n seconds after n tokens
        return [{"context": n, "decode_tokens_per_s": 1 / (a + b * n)} for n in (512, 16384)]

    # a constant-size cache (slope 0, 40 ms) against the original (30 ms + 5 us per cached token): 2,000 tokens
    even = decode_break_even(points(0.040, 0.0), points(0.030, 5e-6))
    assert even["tokens"] == pytest.approx(2000) and even["measured"] == [512, 16384]
    assert decode_break_even(points(0.020, 0.0), points(0.030, 5e-6))["tokens"] == 0  # faster everywhere
    assert decode_break_even(points(0.040, 6e-6), points(0.030, 5e-6))["tokens"] is None  # never faster
    assert decode_break_even(points(0.040, 0.0)[:1], points(0.030, 5e-6)) is None  # one shared context
    # a model slower at both contexts whose step grows faster was read as faster everywhere (its line's intercept,
    # extrapolated below the shortest context, was the smaller): slower at every length
    assert decode_break_even(points(0.060, 1e-5), points(0.030, 5e-6))["tokens"] is None
    assert decode_break_even(points(0.030, 1e-5), points(0.015, 5e-6))["tokens"] is None  # twice as slow everywhere
    # faster at the shortest context but growing faster: faster only below the crossing (20 ms + 10 us/token
    # against 30 ms + 5 us/token: 2,000 tokens)
    even = decode_break_even(points(0.020, 1e-5), points(0.030, 5e-6))
    assert even["below"] and even["tokens"] == pytest.approx(2000)
    from effattn.report import break_even_line

    assert "faster than the baseline below about 2,000 tokens and slower beyond" in break_even_line(even)
    assert not decode_break_even(points(0.040, 0.0), points(0.030, 5e-6))["below"]


def test_speed_warms_the_decode_path_before_timing(monkeypatch):
    """A process's first decode steps cost more than later ones, and the model timed first, the converted one, paid for
    them (up to 40% slower decoding on an idle machine). The warm-up now decodes too; a first step's cost (100 s of a
    fake clock here) is not timed."""
    from types import SimpleNamespace

    from effattn import evaluate

    clock = [0.0]
    monkeypatch.setattr(evaluate.time, "perf_counter", lambda: clock[0])

    class Fake(torch.nn.Module):
        decodes = 0

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep=0):
            if input_ids.shape[1] == 1:
                self.decodes += 1
                clock[0] += 100.0 if self.decodes == 1 else 0.01
            else:
                clock[0] += 0.001 * input_ids.shape[1]
            return SimpleNamespace(cache=None, logits=torch.zeros(1, input_ids.shape[1], 5))

    prefill, decode = evaluate.speed(Fake(), torch.zeros(1, 64, dtype=torch.long), decode_tokens=8, repeats=1)
    assert decode == pytest.approx(100.0) and prefill == pytest.approx(1000.0)  # 10 ms a step, 1 ms a token


def test_speed_context_times_both_models_after_a_long_prompt(capsys, tiny, corpus, tmp_path):
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8, layers=2)
    mqa = convert(src, tmp_path / "mqa", to="mqa", options={"method": "mean"}, measure=False).out
    code, out, _ = run_cli(capsys, "eval", mqa, "--baseline", src, "--corpus", str(corpus), "--context", "64",
                           "--max-tokens", "128", "--speed-context", "700", "--json")
    data = json.loads(out)
    assert code == 0
    for who in ("model", "baseline"):
        assert [p["context"] for p in data[who]["speed"]] == [64, 700]
        assert all(p["prefill_tokens_per_s"] > 0 and p["decode_tokens_per_s"] > 0 for p in data[who]["speed"])
    assert data["decode_break_even"]["measured"] == [64, 700]
    code, out, _ = run_cli(capsys, "eval", mqa, "--baseline", src, "--corpus", str(corpus), "--context", "64",
                           "--max-tokens", "128", "--speed-context", "300")
    assert code == 0 and "decode tokens/s" in out and "(after 300" in out and "decode break-even" in out


def test_speed_context_needs_speed(capsys, tiny, corpus):
    code, _, err = run_cli(capsys, "eval", tiny("llama"), "--corpus", str(corpus), "--no-speed", "--speed-context", "512")
    assert code == 2 and "--speed-context" in err and "--no-speed" in err


@pytest.mark.parametrize("task", ["perplexity", "passkey"])
@pytest.mark.parametrize("device, says", [("gpu", "is not a device effattn runs on"),
                                          ("cuda:x", "is not a device effattn runs on")]
                         + ([("cuda", "torch sees no CUDA GPU")] if not torch.cuda.is_available() else []))
def test_eval_refuses_a_device_it_cannot_run_on_before_loading(capsys, tiny, corpus, task, device, says, monkeypatch):
    import effattn.io.load as load

    monkeypatch.setattr(load, "load_model", lambda *a, **k: pytest.fail("loaded a model for a bad --device"))
    args = ["--corpus", str(corpus), "--no-speed"] if task == "perplexity" else ["--task", task, "--lengths", "300"]
    code, out, err = run_cli(capsys, "eval", tiny("llama"), *args, "--device", device)
    assert code == 2 and says in err and "--device" in err and len(err.strip().splitlines()) == 1 and not out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_eval_on_cuda_measures_what_the_cpu_measures(capsys, tiny, corpus):
    src = tiny("llama", heads=6, kv_heads=3, head_dim=8, layers=2)
    runs = {}
    for device in ("cpu", "cuda"):
        code, out, _ = run_cli(capsys, "eval", src, "--baseline", src, "--corpus", str(corpus), "--context", "64",
                               "--max-tokens", "256", "--json", "--device", device)
        assert code == 0
        runs[device] = json.loads(out)
    cpu, gpu = runs["cpu"], runs["cuda"]
    assert gpu["model"]["perplexity"][str(corpus)] == pytest.approx(cpu["model"]["perplexity"][str(corpus)], rel=1e-3)
    assert gpu["model"]["kv_bytes_per_token"] == cpu["model"]["kv_bytes_per_token"]
    assert gpu["model"]["decode_tokens_per_s"] > 0


@pytest.mark.parametrize("context", [64, 200])  # 200: the log-probabilities come in chunks of 128 positions
def test_bos_reads_each_block_after_the_prefix_and_scores_the_same_targets(tiny, corpus, tmp_path, context):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from effattn.data.corpora import load_text, token_blocks

    src = tiny("llama", heads=6, kv_heads=3, head_dim=8, layers=2)
    other = convert(src, tmp_path / "mqa", to="mqa", options={"method": "mean"}, measure=False).out
    settings = EvalSettings(corpora=("corpus.txt",), context=context, max_tokens=4 * context, speed=False)
    plain = evaluate(str(other), str(src), settings)
    report = evaluate(str(other), str(src), EvalSettings(**{**settings.__dict__, "bos": True}))
    tok = AutoTokenizer.from_pretrained(src)
    blocks = token_blocks(tok, load_text(str(corpus)), context, 4 * context, spread=True)
    ids = torch.cat([torch.full((len(blocks), 1), tok.bos_token_id), blocks], dim=1)
    with torch.no_grad():
        logp = [AutoModelForCausalLM.from_pretrained(p).eval()(input_ids=ids).logits.log_softmax(-1)[:, 1:]
                for p in (other, src)]  # positions 1..T: the block's own tokens
    nll = [-lp[:, :-1].gather(-1, blocks[:, 1:, None]).mean().item() for lp in logp]
    assert report.tokens == plain.tokens == {"corpus.txt": len(blocks) * (context - 1)}
    assert report.model.perplexity["corpus.txt"] == pytest.approx(math.exp(nll[0]), rel=1e-5)
    assert report.baseline.perplexity["corpus.txt"] == pytest.approx(math.exp(nll[1]), rel=1e-5)
    agree = (logp[0].argmax(-1) == logp[1].argmax(-1)).float().mean().item()
    kl = (logp[1].exp() * (logp[1] - logp[0])).sum(-1).mean().item()
    assert report.agreement["corpus.txt"] == pytest.approx(agree, abs=1e-9)
    assert report.kl["corpus.txt"] == pytest.approx(kl, rel=1e-4)
    assert report.model.perplexity != plain.model.perplexity  # the prefix changes what the model reads
    assert report.settings["bos"] is True and plain.settings["bos"] is False


def test_the_prefix_is_bos_or_else_eos_as_lm_evaluation_harness_picks_it():
    from types import SimpleNamespace

    from effattn.errors import EffattnError
    from effattn.evaluate import prefix_token

    assert prefix_token(SimpleNamespace(bos_token_id=1, eos_token_id=2)) == 1
    assert prefix_token(SimpleNamespace(bos_token_id=None, eos_token_id=2)) == 2
    with pytest.raises(EffattnError, match="neither a BOS nor an EOS"):
        prefix_token(SimpleNamespace(bos_token_id=None, eos_token_id=None))


def test_eval_table_says_the_blocks_were_read_after_bos(capsys, tiny, corpus):
    src = tiny("llama")
    code, out, _ = run_cli(capsys, "eval", src, "--corpus", str(corpus), "--context", "64", "--max-tokens", "128",
                           "--no-speed", "--bos")
    assert code == 0 and "each block after BOS" in out
    code, out, _ = run_cli(capsys, "eval", src, "--corpus", str(corpus), "--context", "64", "--max-tokens", "128",
                           "--no-speed")
    assert code == 0 and "perplexity" in out and "after BOS" not in out


def test_bos_is_refused_for_retrieval_tasks(capsys, tiny, corpus):
    code, out, err = run_cli(capsys, "eval", tiny("llama"), "--task", "passkey", "--bos")
    assert code == 2 and "--bos applies to perplexity blocks" in err and not out


def test_a_fine_tunes_held_out_scores_with_bos_are_effattn_evals(tiny, corpus):
    from effattn.finetune.config import Eval
    from effattn.finetune.heldout import evaluate_student, held_out_sets, score_teacher
    from effattn.io.load import load_model

    src = tiny("llama")
    model, tok, _ = load_model(str(src))
    sets = held_out_sets(tok, Eval(corpora=["corpus.txt"], tokens=512, seq_len=64, bos=True))
    assert sets[0].skip == 1 and (sets[0].blocks[:, 0] == tok.bos_token_id).all() and sets[0].blocks.shape[1] == 65
    score_teacher(model, sets, batch_size=2)
    mine = evaluate_student(model, sets, batch_size=2)["corpus.txt"]
    report = evaluate(str(src), None, EvalSettings(corpora=("corpus.txt",), context=64, max_tokens=512, speed=False,
                                                   bos=True))
    assert mine["perplexity"] == pytest.approx(report.model.perplexity["corpus.txt"], rel=1e-6)
    assert mine["agreement"] == 1.0


# -- the dry run: every check the run makes, before any weights load -------------------------------------------------

def _no_weights(monkeypatch):
    import effattn.io.load as load

    monkeypatch.setattr(load, "load_model", lambda *a, **k: pytest.fail("a dry run loaded a model's weights"))


@pytest.mark.parametrize("dry", [[], ["--dry-run"]], ids=["run", "dry-run"])
def test_the_eval_dry_run_refuses_what_the_run_refuses_before_loading(capsys, tiny, corpus, tmp_path, monkeypatch, dry):
    from tests.test_cli_errors import assert_one_line_error

    src = tiny("llama")
    short = tmp_path / "short.txt"
    short.write_text("a few words")  # 11 byte-level tokens
    _no_weights(monkeypatch)
    cases = [
        (["--corpus", "shakespear"], "did you mean 'shakespeare'"),
        (["--corpus", f"{corpus},{short}"], f"corpus {short} has 11 tokens, fewer than one block of --context 64"),
        (["--corpus", str(corpus), "--attn-implementation", "flash"], "--attn-implementation 'flash'"),
        (["--corpus", str(corpus), "--baseline", tmp_path / "nowhere"], "nowhere"),
        (["--corpus", str(corpus), "--baseline", tiny("llama", vocab_size=300)], "different vocabularies (258 vs 300)"),
        (["--task", "passkey", "--lengths", "300", "--filler", "nothing-here"], "nothing-here"),
        (["--task", "passkey", "--lengths", "300", "--attn-implementation", "flash"], "--attn-implementation 'flash'"),
        (["--task", "passkey", "--lengths", "300", "--baseline", tiny("llama", vocab_size=300)],
         "different vocabularies (258 vs 300)"),
        (["--corpus", str(corpus), "--baseline", tiny("llama", vocab_size=200), "--tokenizer",
          tiny("llama", vocab_size=200)], "different vocabularies (258 vs 200)"),
        (["--corpus", ","], "--corpus ',' names no corpus"),
        (["--corpus", str(corpus), "--batch-size", "0"], "--batch-size must be at least 1, got 0"),
        (["--task", "passkey", "--lengths", "300", "--depths", "nan"], "--depths 'nan' holds a value that is not"),
    ]
    def perplexity_only(args):  # the perplexity options (a task refuses them)
        return [] if "--task" in args else ["--context", "64", "--no-speed"]

    for args, needle in cases:
        code, out, err = run_cli(capsys, "eval", src, *perplexity_only(args), *args, *dry)
        assert_one_line_error(code, err, needle)
        assert code == 2 and not out
    # a model smaller than its tokenizer (another model's, or a vocabulary cut short): ids past its embedding
    for task in (["--corpus", str(corpus)], ["--task", "passkey", "--lengths", "300"]):
        code, out, err = run_cli(capsys, "eval", tiny("llama", vocab_size=200), *perplexity_only(task), *task, *dry)
        assert_one_line_error(code, err, "the tokenizer has 258 tokens, more than", "vocabulary of 200")
    monkeypatch.setenv("EFFATTN_MEMORY_LIMIT", "1MB")  # the memory check refuses too, naming the option that shrinks it
    code, out, err = run_cli(capsys, "eval", src, "--corpus", str(corpus), "--context", "64", "--no-speed", *dry)
    assert_one_line_error(code, err, "needs about", "--no-memory-check")


def test_the_eval_dry_run_states_what_the_run_reads_and_loads_no_weights(capsys, tiny, corpus, monkeypatch):
    src = tiny("llama", max_position_embeddings=128)
    args = ["eval", src, "--baseline", src, "--corpus", str(corpus), "--context", "64", "--max-tokens", "200",
            "--no-speed", "--json"]
    code, out, err = run_cli(capsys, *args)
    assert code in (0, None), err
    report = json.loads(out)
    assert (report["dtype"], report["device"]) == ("float32", "cpu")  # what the numbers were measured in
    with monkeypatch.context() as patch:
        _no_weights(patch)
        code, out, err = run_cli(capsys, *args, "--dry-run")
        plan = json.loads(out)
        assert code in (0, None) and plan["dry_run"] and plan["task"] == "perplexity"
        # the blocks the run scores: 3 of 64 tokens, each predicting 63
        assert plan["work"]["tokens"] == {str(corpus): 192} and report["tokens"] == {str(corpus): 3 * 63}
        assert plan["baseline"] == plan["model"] and plan["est_seconds"] > 0 and plan["est_peak_bytes"] > 0
        assert plan["notes"] == []
        code, out, _ = run_cli(capsys, "eval", src, "--corpus", str(corpus), "--context", "256", "--dry-run")
        assert code in (0, None) and "effattn eval --dry-run" in out and "beyond" in out and "nothing (dry run)" in out
        code, out, _ = run_cli(capsys, "eval", src, "--task", "passkey", "--lengths", "512,1024", "--depths", "0,1",
                               "--samples", "2", "--baseline", src, "--dry-run", "--json")
        plan = json.loads(out)
        assert code in (0, None) and plan["task"] == "passkey"
        assert plan["work"] == {"prompts": 16, "lengths": [512, 1024]}
        assert plan["est_seconds"] > 0 and len(plan["notes"]) == 2  # beyond both models' 128 positions
    assert "tokens of 1 corpus" not in err  # the dry run says nothing of a run; the run says its estimate:
    code, _, err = run_cli(capsys, *args[:-1])
    assert code in (0, None) and "192 tokens of 1 corpus, 2 models: estimated ~" in err


def test_the_eval_estimate_prices_each_models_forwards_and_decode_steps(monkeypatch):
    """eval_seconds is the FLOPs of what `measure` runs, at the forward's and the decode step's efficiencies."""
    import effattn.resources as resources
    from effattn.evaluate import eval_seconds

    monkeypatch.setattr(resources, "matmul_flops", lambda dtype=torch.float32: 1e9)
    config = {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 6,
              "num_key_value_heads": 3, "head_dim": 8, "vocab_size": 258, "tie_word_embeddings": True}
    dims = resources.Dims.of(config)
    p = 100_000
    quiet = EvalSettings(corpora=("a",), context=64, speed=False)

    def fwd(n, seq):
        return (2 * p * n + 2 * dims.scores_flops(n, seq)) / (1e9 * resources.FORWARD_EFFICIENCY)

    assert eval_seconds([config], [p], quiet, {"a": 640}) == pytest.approx(
        resources.MODEL_LOAD_SECONDS + fwd(640, 64) + fwd(64, 64))
    assert eval_seconds([config] * 2, [p] * 2, quiet, {"a": 640}) == pytest.approx(
        2 * eval_seconds([config], [p], quiet, {"a": 640}))
    timed = EvalSettings(corpora=("a",), context=64, speed=True, speed_repeats=3, decode_tokens=32)
    step = (2 * p + 2 * dims.scores_flops(1, 128)) / (1e9 * resources.DECODE_EFFICIENCY)
    assert eval_seconds([config], [p], timed, {"a": 640}) - eval_seconds([config], [p], quiet, {"a": 640}) == \
        pytest.approx(3 * (fwd(64, 64) + 32 * step))
    # an untied input embedding is a lookup: its parameters cost a decode step nothing
    untied = config | {"tie_word_embeddings": False}
    table_step = 2 * 258 * 48 / (1e9 * resources.DECODE_EFFICIENCY)
    assert eval_seconds([config], [p], timed, {"a": 640}) - eval_seconds([untied], [p], timed, {"a": 640}) == \
        pytest.approx(3 * 32 * table_step)
    # bfloat16 forwards at the bfloat16 probe's share; decode steps (bound by memory) at the float32 price
    half = eval_seconds([config], [p], quiet, {"a": 640}, dtype=torch.bfloat16) - resources.MODEL_LOAD_SECONDS
    assert half == pytest.approx((fwd(640, 64) + fwd(64, 64)) / resources.HALF_EFFICIENCY)


def test_a_model_loaded_in_another_dtype_is_priced_with_its_checkpoint_read_whole(tiny, corpus, capsys, monkeypatch):
    """transformers reads a checkpoint stored in another dtype whole while it casts it: the memory estimate
    counts those bytes beside the loaded weights (a bfloat16 eval of the float32 built-in model peaked at
    1,480 MiB loading the baseline; 1,211 MiB estimated without them, 1,468 with)."""
    from effattn.evaluate import load_cast_bytes, measure_peak_bytes
    from effattn.io.checkpoint import Checkpoint

    fp32, half = Checkpoint(tiny("llama")), Checkpoint(tiny("llama", dtype=torch.bfloat16))
    assert fp32.dtype == torch.float32 and half.dtype == torch.bfloat16
    assert load_cast_bytes([fp32], torch.bfloat16) == fp32.nbytes
    assert load_cast_bytes([fp32, half], torch.bfloat16) == fp32.nbytes  # the bfloat16 one is mapped as it is
    assert load_cast_bytes([fp32, half], torch.float32) == half.nbytes
    assert load_cast_bytes([fp32], torch.float32) == load_cast_bytes([fp32], None) == 0
    kw = dict(context=64, batch_size=1, text_chars=10, weight_bytes=2)
    plain = measure_peak_bytes(fp32.config, fp32.num_params, fp32.num_params, **kw)
    big = 10 * plain
    assert measure_peak_bytes(fp32.config, fp32.num_params, fp32.num_params, **kw, cast_bytes=big) == \
        2 * fp32.num_params * 2 + big
    # both estimates that run it count it: perplexity and the retrieval grid (a huge cast shows through the max)
    import effattn.evaluate as evaluate_module

    seen = []
    monkeypatch.setattr(evaluate_module, "load_cast_bytes", lambda ckpts, dtype: seen.append(dtype) or 2**40)
    for task in (["--corpus", str(corpus), "--context", "64"], ["--task", "passkey", "--lengths", "512"]):
        code, out, _ = run_cli(capsys, "eval", tiny("llama"), *task, "--dtype", "bfloat16", "--no-memory-check",
                               "--dry-run", "--json")
        assert code in (0, None) and json.loads(out)["est_peak_bytes"] > 2**40
    assert seen == [torch.bfloat16, torch.bfloat16]


def test_a_block_just_past_one_chunk_is_priced_by_its_small_second_chunk(tiny):
    """Blocks longer than PREFILL_CHUNK run in chunks; the estimate priced each chunk's scores as heads x
    PREFILL_CHUNK x context, so one token past 32,768 jumped from ~0.5 to ~25 GiB (a tiny model measured 0.5 GiB).
    SDPA forms no scores: the mask's (queries x keys) pairs of the largest later chunk are what grows."""
    from effattn.evaluate import MASK_BYTES, PREFILL_CHUNK, chunk_mask_pairs, measure_peak_bytes
    from effattn.io.checkpoint import Checkpoint

    P = PREFILL_CHUNK
    assert chunk_mask_pairs(P) == 0 and chunk_mask_pairs(P + 1) == 1 * (P + 1)
    assert chunk_mask_pairs(40_000) == (40_000 - P) * 40_000
    assert chunk_mask_pairs(3 * P) == P * 3 * P  # the last chunk against the whole block
    ckpt = Checkpoint(tiny("llama"))
    at = lambda c: measure_peak_bytes(ckpt.config, ckpt.num_params, 0, context=c, batch_size=1,  # noqa: E731
                                      text_chars=1000)
    assert at(P + 1) < 1.1 * at(P)  # the block's cache (now kept apart from the chunk) and a one-row mask
    assert at(40_000) - at(39_999) < 2**20 + MASK_BYTES * 40_000 * 2


def test_an_effattn_mla_model_is_refused_in_float16(capsys, tiny, tmp_path, corpus):
    """Its latent rows sit near 1e-9, below float16's smallest number: a tiny MLA model measured 3,012 perplexity in
    float16 against 3,370 in float32, without a word."""
    from effattn.convert import convert
    from tests.test_cli_errors import assert_one_line_error

    out = convert(tiny("llama"), tmp_path / "mla", to="mla", options={"kv_size": 16}, measure=False).out
    for dry in ([], ["--dry-run"]):
        code, _, err = run_cli(capsys, "eval", out, "--corpus", str(corpus), "--context", "64", "--no-speed",
                               "--dtype", "fp16", *dry)
        assert_one_line_error(code, err, "MLA model from effattn", "below float16's range", "--dtype bfloat16")
    code, _, err = run_cli(capsys, "eval", out, "--corpus", str(corpus), "--context", "64", "--no-speed", "--dtype",
                           "bf16", "--dry-run")
    assert code in (0, None), err


# -- a bug bash of eval (2026-12-08): results that were lost or written as invalid JSON -----------------------------

def test_a_plot_linked_into_a_missing_folder_is_refused_before_the_grid(capsys, tiny, tmp_path):
    """The dry run checked the link's own folder, which exists; the run measured the whole grid, then failed writing the
    plot through the link with an unexpected FileNotFoundError, exit 1, and printed no results."""
    link = tmp_path / "plot.png"
    link.symlink_to(tmp_path / "missing" / "x.png")
    for dry in (["--dry-run"], []):
        code, out, err = run_cli(capsys, "eval", tiny("llama"), "--task", "passkey", "--lengths", "300", "--depths", "0",
                                 "--samples", "1", "--plot", link, *dry)
        assert_one_line_error(code, err, "is a link into a folder that does not exist", "create that folder")
        assert code == 2 and out == ""


def test_json_output_stays_valid_when_a_measurement_is_not_finite(capsys):
    """A float16 overflow's NaN perplexity was written as bare NaN (invalid JSON), and a mean loss above ~709 nats
    raised an OverflowError after the whole evaluation: now null with a warning, and an infinite perplexity."""
    from effattn.cli import _print_json
    from effattn.evaluate import perplexity

    assert perplexity(800.0) == math.inf and perplexity(0.0) == 1.0
    _print_json({"model": {"perplexity": {"a": float("nan"), "b": perplexity(800.0), "c": 2.5}}, "grid": [1.0, -math.inf]})
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data == {"model": {"perplexity": {"a": None, "b": None, "c": 2.5}}, "grid": [1.0, None]}
    assert "3 measurement(s) not a finite number, written as null" in captured.err
    assert "model.perplexity.a: nan" in captured.err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_stdout_is_a_one_line_error(tiny, corpus):
    """Results printed into a full disk (`> /dev/full`) ended in an unexpected OSError, exit 1."""
    import subprocess
    import sys

    effattn = str(Path(sys.executable).parent / "effattn")
    with open("/dev/full", "w") as full:
        done = subprocess.run([effattn, "eval", str(tiny("llama")), "--corpus", str(corpus), "--context", "32",
                               "--max-tokens", "64", "--no-speed", "--json"], stdout=full, stderr=subprocess.PIPE,
                              text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: cannot write the output to stdout: No space left")


def _reversed_byte_tokenizer(folder):
    """The test byte tokenizer with its 256 byte ids reversed: the same size, other ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())[::-1])}
    vocab["<s>"], vocab["</s>"] = 256, 257
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    for f in folder.iterdir():
        if "token" in f.name:
            f.unlink()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(folder)


@pytest.mark.parametrize("task", [[], ["--task", "passkey", "--lengths", "300", "--depths", "0", "--samples", "1"]],
                         ids=["perplexity", "passkey"])
def test_a_baseline_with_another_tokenizer_is_refused(capsys, tiny, corpus, task):
    """A baseline of the same vocabulary size with another tokenizer was scored on the model's token ids: 100%
    agreement and KL 0 against a model that tokenizes the text differently."""
    src, other = tiny("llama"), tiny("llama")
    _reversed_byte_tokenizer(other)
    text = [] if task else ["--corpus", str(corpus), "--context", "32", "--max-tokens", "64", "--no-speed"]
    for dry in (["--dry-run"], []):
        code, _, err = run_cli(capsys, "eval", src, "--baseline", other, *text, *task, *dry)
        assert_one_line_error(code, err, "has another tokenizer than the one that reads the text", "256 tokens differ")
    code, _, err = run_cli(capsys, "eval", src, "--baseline", tiny("llama"), *text, *task, "--dry-run")
    assert code in (0, None), err  # the same tokenizer (another model's copy of it)


def test_tokenizers_that_do_not_load_are_one_line_errors(capsys, tiny, corpus):
    """A tokenizer that needs its own code, incomplete tokenizer files and a corrupt tokenizer.json gave multi-line
    "unexpected" errors, exit 1. A folder holding a tokenizer alone was refused as --tokenizer (no config.json)."""
    import json as _json

    needs_code = tiny("llama")
    config = _json.loads((needs_code / "tokenizer_config.json").read_text())
    config |= {"auto_map": {"AutoTokenizer": ["tok.Custom", None]}, "tokenizer_class": "Custom"}
    (needs_code / "tokenizer_config.json").write_text(_json.dumps(config))
    (needs_code / "tok.py").write_text("raise SystemExit('tokenizer code ran')\n")
    corrupt = tiny("llama")
    (corrupt / "tokenizer.json").write_text("{broken")
    incomplete = tiny("llama")
    (incomplete / "tokenizer.json").unlink()
    text = ["--corpus", str(corpus), "--context", "32", "--max-tokens", "64", "--no-speed", "--dry-run"]
    for folder, needle in ((needs_code, "needs its own code"), (corrupt, "not valid JSON"),
                           (incomplete, "cannot load the tokenizer")):
        code, _, err = run_cli(capsys, "eval", folder, *text)
        assert_one_line_error(code, err, needle)
        assert code == 2
    alone = corpus.parent / "tokenizer-only"
    alone.mkdir()
    for f in tiny("llama").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (alone / f.name).write_bytes(f.read_bytes())
    notok = tiny("llama")
    for f in notok.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            f.unlink()
    code, _, err = run_cli(capsys, "eval", notok, "--tokenizer", alone, *text)
    assert code in (0, None), err


def test_the_retrieval_refusal_names_a_length_that_fits(capsys, tiny, monkeypatch):
    """With several --lengths, the memory refusal dropped the lengths above each candidate instead of capping them,
    and named a length just below the largest, which was refused again."""
    monkeypatch.setenv("EFFATTN_MEMORY_LIMIT", "1GB")
    src = tiny("llama")
    code, _, err = run_cli(capsys, "eval", src, "--task", "needle", "--lengths", "8192,16384", "--depths", "0.5",
                           "--samples", "1", "--dry-run")
    assert code == 2, err
    named = int(err.split("use --lengths values of ")[1].split()[0])
    assert named < 16000
    code, _, err = run_cli(capsys, "eval", src, "--task", "needle", "--lengths", f"{min(8192, named)},{named}",
                           "--depths", "0.5", "--samples", "1", "--dry-run")
    assert code in (0, None), err


def test_the_dry_run_refuses_a_model_type_transformers_does_not_know(capsys, tiny, corpus):
    """The dry run planned a checkpoint whose model_type transformers does not know; the run then refused it."""
    import json as _json

    src = tiny("llama")
    config = _json.loads((src / "config.json").read_text()) | {"model_type": "frobnicator"}
    (src / "config.json").write_text(_json.dumps(config))
    code, _, err = run_cli(capsys, "eval", src, "--corpus", str(corpus), "--context", "32", "--max-tokens", "64",
                           "--no-speed", "--dry-run")
    assert_one_line_error(code, err, "model_type 'frobnicator', which transformers", "does not know")


def test_the_memory_plan_holds_a_batch_to_the_blocks_a_corpus_gives(capsys, tiny, corpus, monkeypatch):
    """--batch-size 64 over 2 blocks runs the batches --batch-size 2 runs, but was priced (and refused) at 64; a
    --context of 10^23 tokens hung the dry run in a loop over 32,768-token chunks."""
    import effattn.resources

    monkeypatch.setattr(effattn.resources, "rss", lambda: 400 * 2**20)  # the process's own memory held still
    src = tiny("llama")
    plans = []
    for batch in ("2", "64"):
        code, out, err = run_cli(capsys, "eval", src, "--corpus", str(corpus), "--context", "32", "--max-tokens", "64",
                                 "--batch-size", batch, "--no-speed", "--dry-run", "--json")
        assert code in (0, None), err
        plans.append(json.loads(out)["est_peak_bytes"])
    assert plans[1] == plans[0]
    from effattn.evaluate import chunk_mask_pairs

    def loop(context, chunk):  # the largest chunk's pairs, chunk by chunk
        return max((min(chunk, context - s) * (s + min(chunk, context - s)) for s in range(chunk, context, chunk)),
                   default=0)

    for context in (1, 7, 8, 9, 15, 16, 17, 23, 24, 25, 100, 1001):
        assert chunk_mask_pairs(context, 8) == loop(context, 8), context
    assert chunk_mask_pairs(10**23) > 0  # at once


@pytest.mark.parametrize("flag", [["--batch-size", "0"], ["--context", "64"], ["--max-tokens", "1024"], ["--no-speed"],
                                  ["--speed-context", "999"]])
def test_perplexity_options_are_refused_with_a_task(capsys, tiny, flag):
    """With --task passkey the perplexity options were read by nothing, --batch-size 0 and --context -7 included."""
    code, _, err = run_cli(capsys, "eval", tiny("llama"), "--task", "passkey", "--lengths", "300", "--depths", "0",
                           "--samples", "1", *flag, "--dry-run")
    assert_one_line_error(code, err, f"{flag[0]} applies to perplexity, not to --task passkey")


def test_eval_json_names_the_dtype_that_ran_and_reads_a_file_named_with_a_comma(capsys, tiny, corpus):
    """The JSON's dtype was the option as typed ("auto", "bf16"); a corpus file whose name holds a comma was split."""
    named = corpus.parent / "a,b.txt"
    named.write_text(corpus.read_text())
    code, out, err = run_cli(capsys, "eval", tiny("llama"), "--corpus", str(named), "--context", "32", "--max-tokens",
                             "64", "--no-speed", "--dtype", "bf16", "--json")
    assert code in (0, None), err
    data = json.loads(out)
    assert data["dtype"] == "bfloat16" and list(data["model"]["perplexity"]) == [str(named)]
    code, _, err = run_cli(capsys, "eval", tiny("llama"), "--max-tokens", "0")
    assert_one_line_error(code, err, "use --max-tokens 512 or more")
    assert "--context" not in err.split(". use")[1]  # no shorter block reads a text of 0 tokens
