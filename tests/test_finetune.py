"""Healing fine-tunes on tiny models: the loss falls, runs resume exactly after a kill, every
process of a torchrun ends with the same model, and what trains is what the recipe says."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import effattn.finetune.loop as loop
from effattn.convert import convert
from effattn.errors import EffattnError
from effattn.finetune import finetune, load_recipe
from effattn.finetune.data import BlockStream, check_disjoint
from effattn.finetune.loop import lr_multiplier, teacher_forward
from effattn.finetune.losses import AttentionOutputs, attention_output_error, distillation_kl, heal_loss
from effattn.finetune.config import Loss, Schedule

from .aux_model import make_aux_model, register
from .exact import one_thread, pinned_env
from .test_cli_errors import assert_one_line_error, run_cli

REPO = Path(__file__).resolve().parents[1]
TRAIN_TEXT = "".join(f"{w} the quick brown fox jumps over the lazy dog {i % 7}. pack my box with five dozen jugs.\n"
                     for i, w in enumerate(["alpha", "beta", "gamma", "delta"] * 150))
HELD_OUT = "how vexingly quick daft zebras jump! the five boxing wizards jump quickly at dawn.\n" * 40


def write_heal_recipe(root: Path, **sections) -> Path:
    """Under `root`: a tiny llama (6 query / 3 KV heads), training and held-out text, and heal.yaml, a recipe
    converting the llama to MQA and healing it on them (`sections` replace its sections). Returns the llama."""
    from effattn.testing import make_model

    src = make_model(root / "tiny", "llama", heads=6, kv_heads=3)
    (root / "train.txt").write_text(TRAIN_TEXT)
    (root / "held.txt").write_text(HELD_OUT)
    recipe = {"student": {"model": str(src), "convert": {"to": "mqa", "refine_steps": 0}},  # the merge alone: quick
              "data": {"sources": [str(root / "train.txt")], "seq_len": 32},
              "train": {"batch_size": 2}, "schedule": {"warmup_steps": 2},
              "eval": {"corpora": [str(root / "held.txt")], "seq_len": 64, "tokens": 256}} | sections
    (root / "heal.yaml").write_text(yaml.safe_dump(recipe))
    return src


@pytest.fixture
def heal(tiny, tmp_path):
    """Factory: heal(*overrides) -> path of a recipe that converts a tiny llama to MQA and heals it."""
    src = tiny("llama", heads=6, kv_heads=3)
    (tmp_path / "train.txt").write_text(TRAIN_TEXT)
    (tmp_path / "held.txt").write_text(HELD_OUT)
    base = {
        "student": {"model": str(src), "convert": {"to": "mqa", "refine_steps": 0}},
        "data": {"sources": [str(tmp_path / "train.txt")], "seq_len": 32},
        "train": {"max_steps": 12, "batch_size": 2},
        "optimizer": {"lr": 3e-3},
        "schedule": {"warmup_steps": 2},
        "eval": {"every": 4, "corpora": [str(tmp_path / "held.txt")], "seq_len": 64, "tokens": 256},
        "checkpoint": {"every": 4},
    }
    (tmp_path / "heal.yaml").write_text(yaml.safe_dump(base))

    def factory(*overrides, output="out"):
        return load_recipe(tmp_path / "heal.yaml", list(overrides), output=tmp_path / output)

    factory.recipe_file = tmp_path / "heal.yaml"
    factory.src = src
    factory.root = tmp_path
    return factory


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train_losses(out: Path) -> list[float]:
    return [r["loss"] for r in metrics(out) if r["kind"] == "train"]


def assert_same_weights(a: dict, b: dict, atol: float = 0.0):
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= atol, worst


# -- the loss and the schedule ----------------------------------------------------------------------

def test_distillation_kl_matches_the_definition_and_vanishes_for_equal_logits():
    torch.manual_seed(0)
    s, t = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    for temp in (1.0, 2.0):
        p = torch.softmax(t / temp, -1)
        expected = (p * (p.log() - torch.log_softmax(s / temp, -1))).sum(-1).mean() * temp**2
        torch.testing.assert_close(distillation_kl(s, t, temp), expected, rtol=1e-5, atol=1e-6)
    assert distillation_kl(t, t, 3.0).abs().item() < 1e-6


def test_heal_loss_adds_weighted_terms_and_consumes_aux_losses():
    module = torch.nn.Linear(2, 2)
    module.effattn_aux_loss = torch.tensor(0.5)
    s, t = torch.randn(1, 4, 7), torch.randn(1, 4, 7)
    ids = torch.randint(0, 7, (1, 4))
    terms = heal_loss(Loss(kl=2.0, ce=0.5, aux_weight=3.0), s, t, ids, module)
    torch.testing.assert_close(terms["loss"], 2.0 * terms["kl"] + 0.5 * terms["ce"] + 3.0 * 0.5)
    assert module.effattn_aux_loss is None  # consumed: never counted twice
    assert "aux" not in heal_loss(Loss(), s, t, ids, module)


def test_attention_output_error_is_the_mean_relative_error_over_layers():
    torch.manual_seed(0)
    t = [torch.randn(2, 5, 8) for _ in range(3)]
    s = [x + 0.1 * torch.randn_like(x) for x in t]
    expected = sum(((a - b) ** 2).sum() / (b**2).sum() for a, b in zip(s, t)) / 3
    torch.testing.assert_close(attention_output_error(s, t), expected)
    assert attention_output_error(t, t).item() == 0.0
    with pytest.raises(EffattnError, match="3 attention layers and the teacher 2"):
        attention_output_error(s, t[:2])
    terms = heal_loss(Loss(kl=1.0, attn_out=2.0), torch.randn(1, 4, 7), torch.randn(1, 4, 7),
                      torch.randint(0, 7, (1, 4)), torch.nn.Linear(2, 2), (s, t))
    torch.testing.assert_close(terms["loss"], terms["kl"] + 2.0 * terms["attn_out"])


def test_attention_hooks_keep_each_layers_attention_output(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny("llama", heads=6, kv_heads=3))
    hooks = AttentionOutputs(model, "student")
    seen = []
    for layer in model.model.layers:  # what the attention returned, as the decoder layer received it
        layer.self_attn.register_forward_hook(lambda m, a, out: seen.append(out[0]))
    model(input_ids=torch.randint(0, 100, (1, 9)), use_cache=False)
    outputs = hooks.take()
    assert len(outputs) == len(model.model.layers) > 1
    assert all(o is s for o, s in zip(outputs, seen)) and outputs[0].shape == (1, 9, model.config.hidden_size)
    with pytest.raises(RuntimeError):  # taken: nothing is kept twice
        hooks.take()
    hooks.remove()
    model(input_ids=torch.randint(0, 100, (1, 9)), use_cache=False)
    assert hooks.outputs == [None] * len(outputs)


def test_teacher_forward_skips_the_vocabulary_projection_when_only_attention_outputs_are_needed(tiny):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(tiny("llama", heads=6, kv_heads=3)).eval()
    calls = []
    teacher.lm_head.register_forward_hook(lambda m, a, out: calls.append(out))
    hooks = AttentionOutputs(teacher, "teacher")
    ids = torch.randint(0, 100, (2, 9))
    assert teacher_forward(teacher, ids, logits=False) is None and calls == []
    decoder_only = hooks.take()
    logits = teacher_forward(teacher, ids, logits=True)
    with torch.no_grad():
        assert torch.equal(logits, teacher(input_ids=ids, use_cache=False).logits)
    assert all(torch.equal(a, b) for a, b in zip(decoder_only, hooks.take())) and len(calls) == 2
    assert teacher_forward(None, ids, logits=True) is None


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    f = lr_multiplier(Schedule(name="cosine", warmup_steps=4, min_lr_ratio=0.1), steps=20)
    assert [f(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0) and f(12) == pytest.approx(0.55) and f(20) == pytest.approx(0.1)
    g = lr_multiplier(Schedule(name="linear", min_lr_ratio=0.0), steps=10)
    assert g(0) == 1.0 and g(5) == pytest.approx(0.5) and g(10) == 0.0


# -- data --------------------------------------------------------------------------------------------

def test_block_stream_is_seeded_and_processes_take_disjoint_samples():
    blocks = torch.arange(10 * 3).view(10, 3)
    a, b = BlockStream(blocks, seed=1), BlockStream(blocks, seed=1)
    assert torch.equal(a.take(0, 25), b.take(0, 25))
    assert not torch.equal(a.take(0, 10), BlockStream(blocks, seed=2).take(0, 10))
    epoch = a.take(0, 10)[:, 0].tolist()
    assert sorted(epoch) == list(range(0, 30, 3))  # an epoch is a permutation of every block
    world, B = 2, 2  # micro-batch 0: process r takes samples [(0*W + r)*B, ...)
    rank0, rank1 = a.take(0 * B, B), a.take(1 * B, B)
    assert not set(rank0[:, 0].tolist()) & set(rank1[:, 0].tolist())
    assert torch.equal(torch.cat([rank0, rank1]), a.take(0, world * B))  # = one process with batch W*B


def test_training_and_evaluation_text_stay_disjoint(tmp_path):
    with pytest.raises(EffattnError, match="'shakespeare' is an evaluation corpus, held out from training"):
        check_disjoint(["mix", "shakespeare"], ["britannica"])
    with pytest.raises(EffattnError, match="'plays' is a training corpus"):
        check_disjoint(["mix"], ["plays"])
    text = tmp_path / "t.txt"
    with pytest.raises(EffattnError, match="both in data.sources and eval.corpora"):
        check_disjoint([str(text)], [str(tmp_path / "." / "t.txt")])


def test_jsonl_source_reads_the_configured_text_field(heal, capsys):
    rows = [{"body": line, "id": i} for i, line in enumerate(TRAIN_TEXT.splitlines())]
    jsonl = heal.root / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = finetune(heal(f"data.sources=[{jsonl}]", "data.text_key=body", "train.max_steps=2", "eval.every=0",
                           "checkpoint.every=0"))
    assert result.steps == 2 and math.isfinite(result.final_loss)
    code, _, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", heal.root / "bad", f"data.sources=[{jsonl}]")
    assert_one_line_error(code, err, "line 1 has no text field 'text' (found: body, id)", "data.text_key")


def test_hub_source_without_datasets_is_a_clear_error(heal, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if it were not installed
    code, _, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", heal.root / "o", "data.sources=[hf:org/name]")
    assert_one_line_error(code, err, "needs the `datasets` library", "pip install datasets")


# -- a run ---------------------------------------------------------------------------------------------

def test_tiny_heal_lowers_the_loss_and_writes_a_native_checkpoint(heal, capsys):
    out = heal.root / "healed"
    code, stdout, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", out, "--json")
    assert code == 0, err
    report = json.loads(stdout)
    losses = train_losses(out)
    assert len(losses) == 12 and sum(losses[-3:]) < 0.85 * sum(losses[:3])
    held = str(heal.root / "held.txt")
    assert report["final_eval"][held]["perplexity"] < report["start_eval"][held]["perplexity"]
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", "README.md",
                                               "effattn.json", "recipe.yaml", "metrics.jsonl", "curves.png"}
    assert not (out / "checkpoints").exists() and not (out / "student").exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary folders left
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((out / "effattn.json").read_text())
    assert record["source"]["model"] == str(heal.src) and record["conversion"]["kv_heads"] == 1
    ft = record["finetune"]
    assert (ft["steps"], ft["tokens"], ft["teacher"], ft["processes"]) == (12, 12 * 2 * 32, str(heal.src), 1)
    assert [r["step"] for r in metrics(out) if r["kind"] == "eval"] == [0, 4, 8, 12]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_key_value_heads == 1
    assert "healed with `effattn finetune`" in (out / "README.md").read_text()


def test_a_bf16_fine_tune_on_the_cpu_is_priced_at_the_bf16_matmul_probe(heal, monkeypatch):
    """Under bf16 autocast the CPU multiplies in bfloat16 (~4x float32 where it has the instructions, slower where
    it has not): the plan prices it at the bfloat16 probe times EFFICIENCY x HALF_EFFICIENCY (resources.cpu_flops,
    which the conversions' and the retrieval grid's estimates use too), fp32 at the float32 probe."""
    import effattn.finetune.plan as finetune_plan
    import effattn.resources as resources

    rates = {torch.float32: 2e11, torch.bfloat16: 1e12}
    monkeypatch.setattr(resources, "matmul_flops", lambda dtype=torch.float32: rates[dtype])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fp32 = finetune_plan.plan_finetune(heal(), 1)
    bf16 = finetune_plan.plan_finetune(heal("train.precision=bf16"), 1)
    assert fp32["est_basis"] == f"{2e11 * finetune_plan.EFFICIENCY / 1e9:,.0f} GFLOP/s effective (60% of measured " \
        "matmul speed)"
    half = finetune_plan.EFFICIENCY * resources.HALF_EFFICIENCY
    assert bf16["est_basis"] == f"{1e12 * half / 1e9:,.0f} GFLOP/s effective ({half:.0%} of measured bf16 matmul speed)"
    ratio = (2e11 * finetune_plan.EFFICIENCY) / (1e12 * half)
    for part in ("training", "evaluation"):  # the same work, priced at the two rates
        assert bf16["est_seconds"][part] == pytest.approx(fp32["est_seconds"][part] * ratio, rel=1e-9)


def test_dry_run_reports_sizes_and_estimates_and_writes_nothing(heal, capsys):
    out = heal.root / "dry"
    code, stdout, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", out, "--dry-run", "--json",
                                "train.params=attention")
    assert code == 0, err
    plan = json.loads(stdout)
    student = plan["student"]
    assert student["trainable"] < student["params"] and student["trains"] == "attention"
    assert student["conversion"]["KV heads"] == "3 -> 1"
    assert plan["teacher"]["model"] == str(heal.src) and plan["teacher"]["params"] > student["params"]
    assert (plan["steps"], plan["tokens_per_step"], plan["tokens"]) == (12, 64, 12 * 64)
    assert plan["memory_bytes_per_process"]["total"] > 0 and plan["est_seconds"]["training"] > 0
    assert plan["recipe"]["output"] == str(out) and not out.exists()
    code, stdout, _ = run_cli(capsys, "finetune", heal.recipe_file, "-o", out, "--dry-run")
    assert code == 0 and "tokens per step" in stdout and "nothing (dry run)" in stdout
    # logits formed 8 tokens at a time: the estimate drops the [64 - 8, vocab] logits it no longer holds
    code, stdout, _ = run_cli(capsys, "finetune", heal.recipe_file, "-o", out, "--dry-run", "--json",
                              "train.params=attention", "loss.chunk_tokens=8")
    chunked = json.loads(stdout)["memory_bytes_per_process"]["activations"]
    assert chunked < plan["memory_bytes_per_process"]["activations"]


def test_dry_run_refuses_eval_bos_when_the_tokenizer_has_no_prefix_token(heal, capsys, monkeypatch):
    from types import SimpleNamespace

    import effattn.finetune.plan as plan

    out = heal.root / "dry-bos"
    code, _, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", out, "--dry-run", "eval.bos=true")
    assert code == 0, err
    monkeypatch.setattr(plan, "load_tokenizer", lambda ref: SimpleNamespace(bos_token_id=None, eos_token_id=None))
    for option in ("eval.bos=true", "data.bos=0.5"):
        code, stdout, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", out, "--dry-run", option)
        assert code == 2 and "neither a BOS nor an EOS" in err and not out.exists()


def test_a_share_of_training_blocks_starts_with_bos_spread_evenly(tiny):
    from effattn.finetune.data import training_blocks
    from effattn.io.load import load_tokenizer

    tok = load_tokenizer(tiny("llama"))
    texts = {"t": [TRAIN_TEXT]}
    plain = training_blocks(tok, texts, 16)
    half, every = training_blocks(tok, texts, 16, bos=0.5), training_blocks(tok, texts, 16, bos=1.0)
    assert half.shape == every.shape == plain.shape and len(plain) >= 8
    assert (every[:, 0] == tok.bos_token_id).all() and torch.equal(every[:, 1:], plain[:, :-1])
    marked = half[:, 0] == tok.bos_token_id
    assert marked.tolist()[:4] == [False, True, False, True] and abs(marked.sum().item() - len(plain) / 2) <= 1
    assert torch.equal(half[~marked], plain[~marked]) and torch.equal(half[marked][:, 1:], plain[marked][:, :-1])


def test_the_run_trains_on_the_blocks_data_bos_asks_for(heal, monkeypatch):
    import effattn.finetune.loop as loop
    from effattn.io.load import load_tokenizer

    seen, released = [], []
    real = loop.training_blocks
    monkeypatch.setattr(loop, "training_blocks", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    # the tokenizer's freed heap goes back to the system once, after the text is tokenized
    monkeypatch.setattr(loop, "release_free_heap", lambda: released.append(len(seen)) or 0)
    finetune(heal("data.bos=1.0", "train.max_steps=1", "eval.every=0", "checkpoint.every=0"))
    assert len(seen) == 1 and (seen[0][:, 0] == load_tokenizer(heal.src).bos_token_id).all()
    assert released == [1]


def test_max_tokens_rounds_up_to_whole_steps(heal):
    result = finetune(heal("train.max_steps=null", "train.max_tokens=300", "eval.every=0", "checkpoint.every=0"))
    assert result.steps == 5 and result.tokens == 5 * 64  # ceil(300 / (32 tokens x 2 sequences))


# -- resuming ------------------------------------------------------------------------------------------

class Stop(Exception):
    pass


def stop_after_checkpoint(monkeypatch, at_step: int):
    real = loop.save_checkpoint

    def save_then_stop(accelerator, run, state, keep):
        path = real(accelerator, run, state, keep)
        if state["step"] == at_step:
            raise Stop
        return path

    monkeypatch.setattr(loop, "save_checkpoint", save_then_stop)


def stopped_run(heal, monkeypatch, at_step: int = 4, output: str = "run") -> Path:
    """heal.root / output: the heal stopped just after its checkpoint at `at_step`, as a kill would leave it."""
    stop_after_checkpoint(monkeypatch, at_step=at_step)
    with pytest.raises(Stop):
        finetune(heal(output=output))
    monkeypatch.undo()
    return heal.root / output


MLA_STUDENT = ["student.convert.to=mla", "student.convert.kv_size=32", "student.convert.calib_tokens=1024",
               "student.convert.refine_steps=0", "train.mla_latent=scaled"]  # latent rows through a row-scale parametrization


@pytest.mark.parametrize("params,student", [("all", []), ("lora", []), ("all", MLA_STUDENT)], ids=["all", "lora", "mla"])
def test_stopped_run_resumes_to_exactly_the_uninterrupted_result(heal, monkeypatch, params, student):
    dropout = ["train.lora.dropout=0.1"] if params == "lora" else []  # the adapters' dropout draws random numbers
    recipe = ["train.grad_accum=2", "loss.ce=0.5", f"train.params={params}", *dropout, *student]
    reference = finetune(heal(*recipe, output="reference"))
    stop_after_checkpoint(monkeypatch, at_step=8)
    with pytest.raises(Stop):
        finetune(heal(*recipe, output="stopped"))
    monkeypatch.undo()
    out = heal.root / "stopped"
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000004", "step-000008"]
    resumed = finetune(heal(*recipe, output="stopped"))  # no flag: same recipe, resumes by itself
    assert resumed.resumed_from == 8
    assert_same_weights(reference.model.state_dict(), resumed.model.state_dict())
    assert train_losses(out) == train_losses(heal.root / "reference")
    assert [r["step"] for r in metrics(out)] == [r["step"] for r in metrics(heal.root / "reference")]


def test_a_changed_recipe_needs_resume_or_force(heal, monkeypatch, capsys):
    out = stopped_run(heal, monkeypatch)
    code, _, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", out, "optimizer.lr=1e-3")
    assert_one_line_error(code, err, "holds a checkpoint (step 4) of a different recipe: optimizer.lr: 0.003 -> 0.001",
                          "--resume", "--force")
    code, _, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", out, "eval.every=6")  # eval does not count
    assert code == 0, err
    code, _, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", out, "eval.every=6")  # the same again
    assert code == 0 and "already holds this recipe's finished fine-tune; nothing to do" in " ".join(err.split())
    code, _, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", out)
    assert_one_line_error(code, err, "already holds a finished fine-tune", "--force")
    code, _, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", out, "--force", "train.max_steps=3")
    assert code == 0 and json.loads((out / "effattn.json").read_text())["finetune"]["steps"] == 3


def test_resume_flag_continues_with_a_changed_recipe(heal, monkeypatch):
    stopped_run(heal, monkeypatch)
    notes = []
    result = finetune(heal("train.max_steps=16", output="run"), resume=True, log=notes.append)
    assert result.resumed_from == 4 and result.steps == 16 and len(train_losses(heal.root / "run")) == 16
    assert any("train.max_steps: 12 -> 16" in n for n in notes)
    with pytest.raises(EffattnError, match="nothing to resume"):
        finetune(heal(output="never-ran"), resume=True)


@pytest.mark.slow
def test_sigkill_at_a_random_moment_then_resume_matches_the_uninterrupted_run(heal):
    """kill -9 a real run at a random moment after its first checkpoint; the rerun resumes and ends
    where an uninterrupted run ends, to the bit (test_resume_kill.py kills at each named moment)."""
    recipe = ["train.max_steps=60", "checkpoint.every=2", "checkpoint.keep=1", "eval.every=0", "optimizer.lr=1e-3"]
    out = heal.root / "killed"
    env = pinned_env(PYTHONPATH=str(REPO))  # pinned, as the runs below (tests/exact.py)
    proc = subprocess.Popen([sys.executable, "-m", "effattn.cli", "finetune", str(heal.recipe_file), "-o", str(out), *recipe],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while not list((out / "checkpoints").glob("step-*/trainer_state.json")) and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(random.Random().uniform(0, 0.5))
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "effattn.json").exists()
    with one_thread():
        resumed = finetune(heal(*recipe, output="killed"))
        assert resumed.resumed_from is not None and 0 < resumed.resumed_from <= 60
        reference = finetune(heal(*recipe, "checkpoint.every=0", output="reference"))  # checkpoints change no weights
    assert_same_weights(reference.model.state_dict(), resumed.model.state_dict())
    assert resumed.final_loss == reference.final_loss
    steps = [r["step"] for r in metrics(out) if r["kind"] == "train"]
    assert steps == list(range(1, 61))  # every step logged exactly once across the kill


# -- what trains ---------------------------------------------------------------------------------------

def converted_student(heal) -> Path:
    return convert(heal.src, heal.root / "mqa", to="mqa", measure=False).out


def test_attention_only_leaves_everything_else_untouched(heal):
    student = converted_student(heal)
    result = finetune(heal(f"student.model={student}", "student.convert=null", "train.params=attention",
                           "eval.every=0", "checkpoint.every=0", "train.max_steps=4"))
    before, after = load_file(student / "model.safetensors"), load_file(result.out / "model.safetensors")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".self_attn." in k for k in changed)
    assert any("k_proj" in k for k in changed)


def test_teacher_defaults_to_the_model_the_student_was_converted_from(heal, tiny):
    student = converted_student(heal)
    result = finetune(heal(f"student.model={student}", "student.convert=null", "eval.every=0", "checkpoint.every=0",
                           "train.max_steps=2"))
    assert result.record["finetune"]["teacher"] == str(heal.src)
    plain = tiny("llama")  # no effattn.json: nobody knows its original
    with pytest.raises(EffattnError, match="no teacher: .* has no effattn.json"):
        finetune(heal(f"student.model={plain}", "student.convert=null", output="plain"))
    result = finetune(heal(f"student.model={plain}", "student.convert=null", "loss.kl=0", "loss.ce=1",
                           "train.max_steps=2", "eval.every=0", output="ce-only"))
    assert result.record["finetune"]["teacher"] is None and "agreement" not in result.final_eval[str(heal.root / "held.txt")]


def test_lora_adapters_are_merged_into_a_native_checkpoint(heal):
    student = converted_student(heal)
    result = finetune(heal(f"student.model={student}", "student.convert=null", "train.params=lora", "train.lora.r=4",
                           "train.lora.target_modules=[q_proj, v_proj]", "optimizer.lr=1e-2", "eval.every=0",
                           "checkpoint.every=0", "train.max_steps=4"))
    assert type(result.model).__name__ == "LlamaForCausalLM"
    assert not (result.out / "adapter_config.json").exists()
    before, after = load_file(student / "model.safetensors"), load_file(result.out / "model.safetensors")
    assert before.keys() == after.keys()  # no lora_A / lora_B left: the adapters are in the weights
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed)
    assert json.loads((result.out / "effattn.json").read_text())["finetune"]["trainable_params"] == 2 * 4 * (
        (48 + 48) + (48 + 8))  # 2 layers x r x (in + out) for q [48->48] and v [48->8]


def test_lora_on_a_linear_attention_student_also_trains_its_feature_maps(heal):
    """LoLCATs' stage 2: LoRA on q/k/v/o plus the feature maps and the window/linear mix (which the
    linear-attention layers name in `effattn_trainable`); the adapters merge, the maps keep their training."""
    student = convert(heal.src, heal.root / "lin", to="linear", measure=False,
                      options={"window": 4, "projection_dim": 8, "refine_steps": 0}).out
    result = finetune(heal(f"student.model={student}", "student.convert=null", "train.params=lora", "train.lora.r=4",
                           "optimizer.lr=1e-2", "eval.every=0", "checkpoint.every=0", "train.max_steps=3"))
    assert type(result.model).__name__ == "EffattnLinearForCausalLM"
    before, after = load_file(student / "model.safetensors"), load_file(result.out / "model.safetensors")
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    kinds = {k.split("self_attn.")[-1] for k in changed}
    assert kinds == {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "feature_map_q.weight",
                     "feature_map_k.weight", "window_factors"}, kinds
    assert all(".self_attn." in k for k in changed)


def test_bad_lora_targets_name_the_linear_layers(heal):
    student = converted_student(heal)
    with pytest.raises(EffattnError, match="its linear layers are named .*k_proj"):
        finetune(heal(f"student.model={student}", "student.convert=null", "train.params=lora",
                      "train.lora.target_modules=[qproj]"))


def test_conversion_aux_losses_and_ema_buffers_take_part(heal):
    """A converted model whose modules expose `effattn_aux_loss` and update EMA buffers in forward
    (the interface the VQ conversion uses): the term is in the loss, the buffers move, it saves."""
    register()
    student = make_aux_model(heal.root / "aux-student", heal.src)
    result = finetune(heal(f"student.model={student}", "student.convert=null", f"teacher.model={heal.src}",
                           "loss.aux_weight=0.5", "eval.every=0", "checkpoint.every=0", "train.max_steps=4"))
    records = [r for r in metrics(result.out) if r["kind"] == "train"]
    for r in records:
        assert r["aux"] > 0 and r["loss"] == pytest.approx(r["kl"] + 0.5 * r["aux"], rel=1e-5)
    saved = load_file(result.out / "model.safetensors")
    assert saved["model.layers.0.self_attn.probe.ema"].abs().sum() > 0
    assert not torch.equal(saved["model.layers.1.self_attn.probe.scale"], torch.ones(48))


def test_attention_output_distillation_alone_heals(heal):
    """loss.attn_out with no KL: the per-layer term is logged, is the whole loss and falls."""
    result = finetune(heal("loss.kl=0", "loss.attn_out=1.0", "eval.every=0", "checkpoint.every=0"))
    records = [r for r in metrics(result.out) if r["kind"] == "train"]
    assert all("kl" not in r and r["loss"] == pytest.approx(r["attn_out"], rel=1e-6) for r in records)
    assert sum(r["attn_out"] for r in records[-3:]) < 0.9 * sum(r["attn_out"] for r in records[:3])
    assert result.record["finetune"]["teacher"] == str(heal.src)


@pytest.mark.slow
def test_torchrun_two_processes_end_with_the_same_model(heal, tmp_path):
    """2 CPU processes (gloo): different data per process, identical weights and EMA buffers on both,
    one output written; equal to one process taking both processes' samples in one batch."""
    register()
    student = make_aux_model(heal.root / "aux-student", heal.src)
    recipe = [f"student.model={student}", "student.convert=null", f"teacher.model={heal.src}", "train.max_steps=6",
              "eval.every=3", "checkpoint.every=3", "loss.ce=0.5"]
    out, report = heal.root / "ddp", heal.root / "ranks"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))  # torchrun's log folder
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_port", str(29500 + os.getpid() % 1000),
                           str(REPO / "tests" / "finetune_worker.py"), str(heal.recipe_file), str(report),
                           *recipe, f"output={out}"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((report / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["hash"] == ranks[1]["hash"]
    assert [r["wrote"] for r in ranks] == [True, False]
    # both processes destroyed their gloo group before the interpreter was torn down
    assert [json.loads((report / f"rank{r}-exit.json").read_text()) for r in (0, 1)] == [{"group_alive": False}] * 2
    assert json.loads((out / "effattn.json").read_text())["finetune"]["processes"] == 2
    single = finetune(heal(*recipe, "train.batch_size=4", output="single"))
    assert_same_weights(load_file(out / "model.safetensors"), load_file(single.out / "model.safetensors"), atol=1e-5)


def test_a_finished_run_destroys_its_process_group_before_the_interpreter_is_torn_down(tmp_path):
    """A gloo group left alive at exit can abort a finished torchrun process during finalization
    (SIGABRT, "terminate called without an active exception"): after a successful run the group is
    destroyed by an atexit hook, while the interpreter is whole. A hook registered before it runs
    after it (atexit is last in, first out) and sees the group gone."""
    script = f"""
import atexit, torch, torch.distributed as dist
from effattn.finetune.loop import release_process_group_at_exit
dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
atexit.register(lambda: print("group alive at exit:", dist.is_initialized(), flush=True))
dist.all_reduce(torch.ones(4))
release_process_group_at_exit()
release_process_group_at_exit()  # once only
print("group alive after the run:", dist.is_initialized(), flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["group alive after the run: True", "group alive at exit: False"]


EXIT_SCRIPT = """
import atexit, sys, threading, time, torch, torch.distributed as dist
from effattn.finetune.loop import exit_without_finalizing, release_process_group_at_exit


class Finalized:
    def __del__(self):
        print("finalized", flush=True)


alive = Finalized()  # its __del__ runs when the interpreter tears the module down
atexit.register(lambda: print("hook, group alive:", dist.is_initialized(), flush=True))  # runs after the run's
if sys.argv[1] == "group":
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
    dist.barrier()
    release_process_group_at_exit()
threading.Thread(target=lambda: (time.sleep(0.5), print("thread done", flush=True))).start()  # waited for
print("run done", end="")  # unflushed: the exit must flush it
exit_without_finalizing(3)
sys.exit(4)
"""


@pytest.mark.parametrize("group", [True, False], ids=["process-group", "no-group"])
def test_an_entry_point_that_ran_a_process_group_exits_without_finalizing(tmp_path, group):
    """A gloo worker thread can hold the last reference to a finished collective while the interpreter
    finalizes; freeing its tensors then aborts the process (SIGABRT). So the CLI and the torchrun worker end
    a process that ran a group with exit_without_finalizing: exit hooks run (the group is destroyed before
    the later hooks), a non-daemon thread is waited for, output is flushed, finalization (the module's
    __del__) never runs, the code is kept.
    In a process that ran no group it does nothing and the program goes on."""
    args = ["group", str(tmp_path / "store")] if group else ["none"]
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, *args], env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=120)
    assert done.stderr == "" or "Warning" in done.stderr, done.stderr[-2000:]
    if group:
        assert done.returncode == 3
        assert done.stdout.splitlines() == ["run donethread done", "hook, group alive: False"]
    else:
        assert done.returncode == 4
        assert done.stdout.splitlines() == ["run donethread done", "hook, group alive: False", "finalized"]


def test_the_cli_entry_keeps_exit_codes_where_no_process_group_ran(tmp_path):
    """`python -m effattn.cli` goes through entry(): a bad argument still exits 2 with one line, a good one 0."""
    bad = subprocess.run([sys.executable, "-m", "effattn.cli", "inspect", str(tmp_path / "missing")],
                         env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error:"), bad.stderr[-2000:]
    good = subprocess.run([sys.executable, "-m", "effattn.cli", "--help"], env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=300)
    assert good.returncode == 0 and good.stdout.strip(), good.stderr[-2000:]


def test_chunked_logit_terms_equal_the_whole_batch_loss_and_gradients(tiny):
    """loss.chunk_tokens: KL and CE formed a few tokens at a time from the final hidden states give the
    same values and the same gradients as from the whole micro-batch's logits."""
    from transformers import AutoModelForCausalLM

    from effattn.finetune.losses import FinalHidden

    student = AutoModelForCausalLM.from_pretrained(tiny("llama", heads=6, kv_heads=3), dtype=torch.float64)
    teacher = AutoModelForCausalLM.from_pretrained(tiny("llama", heads=6, kv_heads=3, seed=1), dtype=torch.float64).eval()
    ids = torch.randint(0, 250, (3, 17), generator=torch.Generator().manual_seed(0))
    cfg = Loss(kl=1.0, ce=0.5, temperature=2.0)
    whole = heal_loss(cfg, student(input_ids=ids).logits, teacher(input_ids=ids).logits.detach(), ids, student)
    whole["loss"].backward()
    expected = {n: p.grad.clone() for n, p in student.named_parameters()}
    student.zero_grad()
    finals = FinalHidden(student, "student"), FinalHidden(teacher, "teacher")
    student(input_ids=ids, logits_to_keep=1)
    with torch.no_grad():
        teacher(input_ids=ids, logits_to_keep=1)
    for chunk in (7, 51, 1000):  # chunks crossing sequences, exactly the batch, larger than it
        if chunk != 7:
            student.zero_grad()
            student(input_ids=ids, logits_to_keep=1)
            with torch.no_grad():
                teacher(input_ids=ids, logits_to_keep=1)
        cfg_c = Loss(kl=1.0, ce=0.5, temperature=2.0, chunk_tokens=chunk)
        chunked = (finals[0].take(), finals[0].head, finals[1].take(), finals[1].head)
        terms = heal_loss(cfg_c, None, None, ids, student, chunked=chunked)
        for key in ("kl", "ce", "loss"):
            torch.testing.assert_close(terms[key], whole[key].float(), rtol=1e-6, atol=1e-9)
        terms["loss"].backward()
        for name, p in student.named_parameters():
            torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_a_run_with_chunked_logits_matches_one_without(capsys, tiny, tmp_path):
    """The same recipe with loss.chunk_tokens trains to the same losses (the logits are formed in
    pieces, the arithmetic is the same)."""
    (tmp_path / "train.txt").write_text("chunks of logits add up to the same loss. " * 400)
    (tmp_path / "held.txt").write_text("held out words for the evaluation. " * 100)
    runs = []
    for chunk in (0, 40):
        out = tmp_path / f"out{chunk}"
        code, _, err = run_cli(capsys, "finetune", "heal-gqa", "-o", out, f"student.model={tiny('llama')}",
                               f"data.sources=[{tmp_path / 'train.txt'}]", "data.seq_len=32", "train.batch_size=2",
                               "train.max_steps=2", f"eval.corpora=[{tmp_path / 'held.txt'}]", "eval.seq_len=32",
                               "eval.tokens=64", "checkpoint.every=2", "loss.ce=0.5", f"loss.chunk_tokens={chunk}")
        assert code in (0, None), err
        runs.append([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                     if json.loads(line)["kind"] == "train"])
    for a, b in zip(*runs):
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-4) and a["ce"] == pytest.approx(b["ce"], rel=1e-4)


@pytest.mark.parametrize("to,options", [("swa", {"window": 8, "sinks": 2}),
                                        ("vq", {"window": 8, "codebook_size": 16, "calib_tokens": 1024}),
                                        ("sparse", {"pattern": "longformer", "window": 8, "kernel": "naive"})],
                         ids=["sinks", "vq", "sparse"])
def test_effattn_models_give_their_final_states_for_chunked_logits(tiny, tmp_path, to, options):
    """loss.chunk_tokens on effattn's own models: the final norm's output, projected by the output
    embeddings, is exactly the logits of a full forward, while the forward itself projects one position."""
    from effattn.finetune.losses import FinalHidden
    from effattn.io.load import load_model

    out = convert(tiny("llama"), tmp_path / to, to=to, options=options, measure=False).out
    model, _, _ = load_model(out)
    finals = FinalHidden(model, "student")
    ids = torch.randint(0, 200, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        last = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
        hidden = finals.take()
        full = model(input_ids=ids, use_cache=False).logits
    assert last.shape[1] == 1 and hidden.shape[:2] == ids.shape
    torch.testing.assert_close(finals.head(hidden), full, rtol=0, atol=0)


# -- data.positions: blocks read at positions spread over a context ------------------------------------------------

def test_block_starts_cover_the_room_evenly_and_depend_on_the_sample_alone():
    from effattn.finetune.data import block_start

    starts = [block_start(k, 6144, seed=0) for k in range(64)]
    assert all(0 <= s <= 6144 for s in starts) and len(set(starts)) == 64
    # any 16 consecutive micro-batches leave no gap wider than a quarter of the room (low discrepancy)
    for first in (0, 17, 40):
        window = sorted(block_start(k, 6144, seed=0) for k in range(first, first + 16))
        assert max(b - a for a, b in zip([0] + window, window + [6144])) < 6144 / 4
    assert [block_start(k, 6144, seed=0) for k in range(64)] == starts  # a function of the sample's number
    assert block_start(5, 6144, seed=1) == block_start(6, 6144, seed=0) and block_start(3, 0, seed=0) == 0


def test_a_heal_with_data_positions_reads_teacher_and_student_at_the_same_spread_positions(heal, monkeypatch):
    """Every micro-batch of a linear-attention student's heal goes through both models at positions from
    `block_start(its first sample)`: the student at positions its maps were fitted for, the teacher alike."""
    from effattn.finetune.data import block_start

    student = convert(heal.src, heal.root / "lin", to="linear", measure=False,
                      options={"window": 4, "projection_dim": 8, "refine_steps": 0}).out
    seen: dict[str, list[int]] = {"student": [], "teacher": []}
    real_step = loop.optimizer_step

    def spy(accelerator, model, teacher, *args, **kwargs):
        def take(who, kw):  # no position_ids: from 0
            seen[who].append(int(kw["position_ids"][0, 0]) if kw.get("position_ids") is not None else 0)

        hooks = [m.register_forward_pre_hook(lambda _, a, kw, who=who: take(who, kw), with_kwargs=True)
                 for who, m in (("student", model), ("teacher", teacher))]
        try:
            return real_step(accelerator, model, teacher, *args, **kwargs)
        finally:
            for h in hooks:
                h.remove()

    monkeypatch.setattr(loop, "optimizer_step", spy)
    said: list[str] = []
    result = finetune(heal(f"student.model={student}", "student.convert=null", "train.params=lora",
                           "data.positions=4096", "train.grad_accum=2", "eval.every=0", "checkpoint.every=0",
                           "train.max_steps=3"), log=said.append)
    assert any("blocks at positions spread over 4,096" in line for line in said), said
    # micro-batches of 2 samples, 2 per step: first samples 0, 2, 4, ...; room 4096 - 32
    want = [block_start(k, 4096 - 32, seed=0) for k in range(0, 12, 2)]
    assert seen["student"] == seen["teacher"] == want and len(set(want)) == 6 and want[0] == 0
    assert all(math.isfinite(x) for x in train_losses(result.out))


def test_data_positions_shorter_than_a_block_is_refused(heal, capsys):
    with pytest.raises(EffattnError, match=r"data.positions \(16\) is shorter than a block"):
        heal("data.positions=16")
