"""What a fine-tune refuses before it touches OUT, converts the student or loads a model, in the dry run and in the
run alike; what it never deletes; what its record and card say after a resume with a changed recipe."""

from __future__ import annotations

import json

import pytest

import effattn.finetune.loop as loop
from effattn.errors import EffattnError
from effattn.finetune import finetune, load_recipe

from .test_cli_errors import assert_one_line_error, run_cli
from .test_finetune import Stop, heal, stopped_run  # noqa: F401 - heal is a fixture


def tree(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else None


@pytest.fixture
def no_heavy_work(monkeypatch):
    """The run must refuse before it converts or loads a model: both raise if reached."""
    def reached(*args, **kwargs):
        raise AssertionError("the run converted or loaded a model before refusing")

    monkeypatch.setattr(loop, "convert", reached)
    monkeypatch.setattr(loop, "load_model", reached)


# name -> (overrides, the one-line error's needles); `{root}` is the fixture's folder
REFUSED = {
    "eval-corpus-missing": (["eval.corpora=[{root}/nope.txt]"], ["nope.txt", "neither a built-in corpus"]),
    "eval-block-too-long": (["eval.seq_len=5000"], ["held.txt has 3320 tokens", "eval.seq_len=3320 or less"]),
    "data-block-too-long": (["data.seq_len=100000"], ["train.txt", "fewer than one block of data.seq_len 100000"]),
    "teacher-vocabulary": (["teacher.model={root}/other"], ["different vocabularies (300 vs 258)"]),
    # an eval bug bash (2026-12-08): a baseline of the same size with another tokenizer was scored on the model's ids
    "teacher-tokenizer": (["teacher.model={root}/reversed"], ["teacher.model {root}/reversed has another tokenizer "
                                                              "than the one that reads the text", "256 tokens differ"]),
    "positions": (["data.positions=100000"], ["data.positions (100,000) is past the student's 4,096 positions"]),
    "lora-tied-head": (["train.params=lora", "train.lora.target_modules=[q_proj,lm_head]"],
                       ["lm_head", "tie_word_embeddings", "would not be the one trained"]),
    "lora-tied-embedding": (["train.params=lora", "train.lora.target_modules=[embed_tokens]"], ["embed_tokens"]),
    "mla-latent": (["train.mla_latent=scaled"], ["train.mla_latent=scaled applies to MLA students only"]),
    "mla-fp16": (["student.convert.to=mla", "student.convert.kv_size=16", "train.precision=fp16"],
                 ["train.precision=fp16 on an MLA student", "below float16's range"]),
    "recipe-keys": (["student.convert.to=gqa"], ["student.convert.kv_heads is required for student.convert.to gqa"]),
    "betas": (["optimizer.betas=[0.9,1.5]"], ["optimizer.betas", "[0, 1)"]),
    "infinite-lr": (["optimizer.lr=.inf"], ["optimizer.lr = inf", "finite"]),
    "boolean-steps": (["train.max_steps=true"], ["train.max_steps = True", "not a boolean"]),
    # the second bug bash (2026-12-07): each passed the dry run, or failed with a traceback, or was ignored
    "lora-misspelt-target": (["train.params=lora", "train.lora.target_modules=[q_proj,qproj]"],
                             ["'qproj' names no module of this model", "did you mean 'q_proj'?"]),
    "lora-rank": (["train.params=lora", "train.lora.r=1000"], ["train.lora.r=1000 is more than the rank of every "
                                                                "layer it adapts (at most 48)"]),
    "jsonl-not-utf8": (["data.sources=[{root}/latin1.jsonl]"], ["latin1.jsonl is not UTF-8", "convert it to UTF-8"]),
    "jsonl-number": (["data.sources=[{root}/number.jsonl]"], ["number.jsonl line 1: field 'text' holds int"]),
    "empty-source": (["data.sources=[{root}/empty.txt]"], ["empty.txt' holds no text"]),
    "empty-documents": (["data.sources=[{root}/blank.jsonl]"], ["blank.jsonl' holds no text"]),
    "student-no-tokenizer": (["student.model={root}/notok"], ["student.model: notok has no tokenizer files",
                                                              "copy the tokenizer files"]),
    "student-vocabulary": (["student.model={root}/small"], ["the tokenizer has 258 tokens, more than "
                                                            "student.model {root}/small's vocabulary of 200"]),
    "student-pickled": (["student.model={root}/pickled"], ["holds only pickled weights", "save a safetensors copy",
                                                           "finetune reads no pickled weights"]),
    "sgd-betas": (["optimizer.name=sgd", "optimizer.betas=[0.5,0.6]"],
                  ["optimizer.betas = (0.5, 0.6): optimizer.name sgd does not read it"]),
    "constant-ratio": (["schedule.name=constant", "schedule.min_lr_ratio=0.5"],
                       ["schedule.min_lr_ratio = 0.5: a constant schedule does not read it"]),
    "temperature-without-kl": (["loss.kl=0", "loss.ce=1", "loss.temperature=4"],
                               ["loss.temperature = 4.0: it scales the KL term, whose weight loss.kl is 0"]),
    "lora-without-lora": (["train.lora.r=2"], ["train.lora.r = 2: train.params is all, not lora"]),
    "source-twice": (["data.sources=[{root}/train.txt,{root}/train.txt]"], ["train.txt' twice"]),
    "fsdp-option-under-ddp": (["distributed.strategy=ddp", "distributed.cpu_offload=true"],
                              ["distributed.cpu_offload = True: distributed.strategy is ddp, and only fsdp reads it"]),
    "boolean-conversion-option": (["student.convert.to=gqa", "student.convert.kv_heads=true"],
                                  ["student.convert.kv_heads = True: a number is expected, not a boolean"]),
    "boolean-alias-preset": (["student.convert.kv_heads=true"],
                             ["student.convert.kv_heads = True: a number is expected, not a boolean"]),
    "boolean-refine-steps": (["student.convert.refine_steps=false"], ["student.convert.refine_steps = False"]),
    "auto-option-under-fsdp": (["distributed.strategy=fsdp", "distributed.fsdp_min_params=5"],
                               ["distributed.fsdp_min_params = 5: only strategy auto reads it (it is fsdp)"]),
}


def bad_inputs(root, tiny):
    """The files and models REFUSED's cases name."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    (root / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9 ' + b"a" * 3000 + b'"}\n')
    (root / "number.jsonl").write_text('{"text": 5}\n')
    (root / "empty.txt").write_text("")
    (root / "blank.jsonl").write_text('{"text": ""}\n' * 5)
    notok = shutil.copytree(tiny("llama"), root / "notok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (notok / name).unlink(missing_ok=True)
    tiny("llama", vocab_size=200).rename(root / "small")
    pickled = shutil.copytree(tiny("llama"), root / "pickled")
    torch.save(AutoModelForCausalLM.from_pretrained(pickled).state_dict(), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()


@pytest.mark.parametrize("dry", [True, False], ids=["dry-run", "run"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_the_dry_run_refuses_what_the_run_refuses_before_converting(heal, capsys, no_heavy_work, tiny, case, dry):
    """Each of these passed the dry run before, and the run refused it only after converting the student (or
    wrote a model other than the one it trained: LoRA on a tied embedding)."""
    if case == "teacher-vocabulary":
        tiny("llama", vocab_size=300).rename(heal.root / "other")
    if case == "teacher-tokenizer":
        from .test_eval import _reversed_byte_tokenizer

        _reversed_byte_tokenizer(tiny("llama").rename(heal.root / "reversed"))
    bad_inputs(heal.root, tiny)
    overrides, needles = REFUSED[case]
    out = heal.root / "out"
    code, _, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", out,
                           *[o.format(root=heal.root) for o in overrides], *(["--dry-run"] if dry else []))
    assert_one_line_error(code, err, *[n.format(root=heal.root) for n in needles])
    assert code == 2 and not out.exists()


def test_defaults_spelt_out_do_not_stop_a_switch(heal, capsys):
    """The built-in recipes spell out defaults (min_lr_ratio 0.1, temperature 1.0): switching the option that reads
    them must stay possible from the command line."""
    spelt = ["optimizer.betas=[0.9,0.95]", "optimizer.eps=1e-8", "schedule.min_lr_ratio=0.1", "loss.temperature=1.0",
             "train.lora.r=16"]
    for switch in (["optimizer.name=sgd"], ["schedule.name=constant"], ["loss.kl=0", "loss.ce=1"]):
        code, _, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", heal.root / "out", "--dry-run", *spelt,
                               *switch)
        assert code == 0, err


def test_fsdp_options_auto_may_not_read_are_named_by_the_plan(heal, capsys):
    """With strategy auto, the fsdp-only options are read only if fsdp runs; when ddp (or one process) runs, the plan
    says they are not read rather than dropping them without a word."""
    import json

    base = ["finetune", heal.recipe_file, "-o", heal.root / "out", "--dry-run", "--json",
            "distributed.cpu_offload=true", "distributed.wrap=[LlamaDecoderLayer]"]
    for processes in ([], ["--processes", "2"]):  # one process; two, a tiny student below fsdp_min_params: ddp
        code, out, err = run_cli(capsys, *base, *processes)
        assert code in (0, None), err
        line = json.loads(out)["distributed"]
        assert "distributed.cpu_offload, distributed.wrap not read (fsdp only)" in line, line
    code, out, err = run_cli(capsys, *base, "--processes", "2", "distributed.fsdp_min_params=0",
                             "distributed.cpu_offload=false")
    assert code in (0, None), err
    assert "not read" not in json.loads(out)["distributed"]  # fsdp runs: it reads them


def test_a_wrap_class_the_models_lack_is_refused_by_the_plan(heal, capsys):
    """distributed.wrap was checked only by the processes, after loading the models and marking OUT."""
    for wrap, needles in (("[FooLayer]", ["distributed.wrap: the student", "no modules of the class(es) FooLayer",
                                          "name its decoder layer class (LlamaDecoderLayer)"]),
                          ("[LlamaDecoderLayer,FooLayer]", ["FooLayer"])):
        code, _, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", heal.root / "out", "--dry-run",
                               "--processes", "2", "distributed.strategy=fsdp", f"distributed.wrap={wrap}")
        assert_one_line_error(code, err, *needles)
    code, _, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", heal.root / "out", "--dry-run",
                           "--processes", "2", "distributed.strategy=fsdp", "distributed.wrap=[LlamaDecoderLayer]")
    assert code == 0, err


def test_the_recipe_a_refusal_names_runs_from_the_output_folder(heal, monkeypatch, capsys):
    """A changed recipe is refused with "... or run OUT/recipe.yaml again"; that file, inside OUT, was then refused
    as an input the run could delete. It is OUT's own recipe, safe while OUT is not replaced."""
    out = stopped_run(heal, monkeypatch)
    code, _, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", out, "optimizer.lr=1e-3")
    assert_one_line_error(code, err, "of a different recipe", f"or run {out / 'recipe.yaml'} again")
    code, stdout, err = run_cli(capsys, "finetune", out / "recipe.yaml", "--dry-run")
    assert code == 0 and "resuming from" in " ".join(stdout.split()), err
    code, _, err = run_cli(capsys, "finetune", out / "recipe.yaml", "--force", "--dry-run")
    assert_one_line_error(code, err, "holds the recipe file")


def test_a_folder_with_a_recipe_yaml_of_its_own_is_not_taken_for_a_killed_run(heal, capsys):
    """A folder holding a file named recipe.yaml was taken for a run killed before its first checkpoint and
    deleted; only a folder with the run's marker is."""
    out = heal.root / "project"
    out.mkdir()
    (out / "recipe.yaml").write_text("description: mine\n")
    (out / "notes.md").write_text("precious\n")
    for dry in (["--dry-run"], []):
        code, _, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", out, *dry)
        assert_one_line_error(code, err, "already exists and is not an effattn finetune run", "--force")
    assert tree(out) == ["notes.md", "recipe.yaml"]


def test_a_run_killed_before_its_first_checkpoint_starts_over(heal, monkeypatch, capsys):
    def killed(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(loop, "held_out_sets", killed)  # after the student's conversion, before any checkpoint
    with pytest.raises(Stop):
        finetune(heal(output="run"))
    monkeypatch.undo()
    out = heal.root / "run"
    assert (out / ".effattn-finetune").is_file() and not (out / "checkpoints").exists()
    code, stdout, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", out, "--dry-run")
    assert code == 0 and "no checkpoint in" in " ".join(stdout.split()), err
    code, _, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", out, "train.max_steps=2", "eval.every=0")
    assert code == 0, err
    assert (out / "model.safetensors").is_file() and not (out / ".effattn-finetune").exists()


@pytest.mark.parametrize("where", ["student", "data", "eval", "recipe"])
def test_force_never_deletes_the_runs_inputs(heal, capsys, where):
    """--force replaced OUT before converting: with the run's inputs inside it, they were deleted."""
    import shutil

    root = heal.root / "sandbox"
    root.mkdir()
    text, recipe = heal.recipe_file.read_text(), heal.root / "elsewhere.yaml"
    if where == "student":
        shutil.copytree(heal.src, root / "tiny")
        text = text.replace(str(heal.src), str(root / "tiny"))
    elif where in ("data", "eval"):
        name = {"data": "train.txt", "eval": "held.txt"}[where]
        shutil.copy(heal.root / name, root / name)
        text = text.replace(str(heal.root / name), str(root / name))
    else:
        recipe = root / "heal.yaml"
    recipe.write_text(text)
    before = tree(root)
    role = {"student": "student.model", "data": "data.sources", "eval": "eval.corpora", "recipe": "the recipe file"}
    for dry in (["--dry-run"], []):
        code, _, err = run_cli(capsys, "finetune", recipe, "-o", root, "--force", *dry)
        assert_one_line_error(code, err, f"the output folder {root} holds {role[where]}", "another -o")
    assert tree(root) == before


def test_output_cannot_be_the_student(heal):
    from .test_finetune import converted_student

    student = converted_student(heal)
    with pytest.raises(EffattnError, match="is student.model"):
        finetune(heal(f"student.model={student}", "student.convert=null", output="mqa"), force=True)
    assert (student / "model.safetensors").exists()


@pytest.mark.parametrize("args,needles", [
    (["-o", ""], ["output = ''", "the output folder is empty"]),
    (["-o", "{root}/out", "--force", "--resume"], ["--resume and --force contradict each other"]),
], ids=["empty-output", "force-and-resume"])
def test_an_empty_output_and_contradicting_flags_are_refused(heal, capsys, args, needles):
    for dry in (["--dry-run"], []):
        code, _, err = run_cli(capsys, "finetune", heal.recipe_file, *[a.format(root=heal.root) for a in args], *dry)
        assert_one_line_error(code, err, *needles)
    assert not (heal.root / "out").exists()


def test_a_section_given_twice_in_a_recipe_file_is_refused(heal, capsys):
    """PyYAML keeps the second of two equal keys: `train: {params: lora}` then `train: {max_steps: 7}` trained
    every parameter."""
    path = heal.root / "twice.yaml"
    path.write_text(heal.recipe_file.read_text() + "train:\n  max_steps: 7\n")
    code, _, err = run_cli(capsys, "recipes", "validate", path)
    assert_one_line_error(code, err, "key 'train' appears twice", "merge")


def test_a_diverging_run_stops_with_the_step_and_the_learning_rate(heal):
    with pytest.raises(EffattnError, match=r"the training loss is nan at step \d+: the training diverged. "
                                           r"lower optimizer.lr \(now 1e\+06\)"):
        finetune(heal("optimizer.lr=1e6", "train.max_grad_norm=null", "train.max_steps=40", "eval.every=0",
                      "checkpoint.every=0", output="nan"))
    assert not (heal.root / "nan" / "model.safetensors").exists()


def test_a_resume_with_a_changed_recipe_is_recorded_in_the_record_and_the_card(heal, monkeypatch, capsys):
    out = stopped_run(heal, monkeypatch)
    code, _, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", out, "optimizer.lr=1e-3", "--resume")
    assert code == 0, err
    ft = json.loads((out / "effattn.json").read_text())["finetune"]
    assert ft["resumes"] == [{"step": 4, "changes": ["optimizer.lr: 0.003 -> 0.001"]}]
    card = " ".join((out / "README.md").read_text().split())
    assert "resumed at step 4 with a changed recipe: optimizer.lr: 0.003 -> 0.001" in card
    assert "neither it nor `recipe.yaml` alone repeats the run" in card
    code, stdout, err = run_cli(capsys, "finetune", heal.recipe_file, "-o", out, "optimizer.lr=1e-3")
    assert code == 0 and "already there, unchanged" in stdout and "wrote" not in stdout, err


def test_the_card_states_the_held_out_tokens_read_not_the_ones_asked_for(heal):
    """eval.tokens is a ceiling (whole blocks of eval.seq_len, at least one, at most the corpus)."""
    result = finetune(heal("eval.tokens=1000000", "eval.every=0", "train.max_steps=2", output="big"))
    held = str(heal.root / "held.txt")
    assert result.record["finetune"]["eval_tokens"] == {held: 51 * 64}  # 3,320 tokens: 51 blocks of 64
    card = " ".join((result.out / "README.md").read_text().split())
    assert "Held-out text (3,264 tokens per corpus in blocks of 64;" in card and "1,000,000" not in card
    result = finetune(heal("eval.tokens=2", "eval.every=0", "train.max_steps=2", "eval.bos=true", output="small"))
    assert result.record["finetune"]["eval_tokens"] == {held: 64}
    assert "(64 tokens per corpus in blocks of 64, each read after the BOS token;" in \
        " ".join((result.out / "README.md").read_text().split())


def test_load_recipe_keeps_the_file_it_read(heal):
    assert load_recipe(heal.recipe_file)._source == heal.recipe_file.resolve()


def test_a_run_without_held_out_corpora_logs_no_empty_evaluations(heal):
    notes = []
    result = finetune(heal("eval.corpora=[]", "train.max_steps=4", output="noeval"), log=notes.append)
    assert result.final_eval == {} and not any(n.startswith("eval @ step") for n in notes)


def test_a_failed_force_run_gives_the_replaced_folder_back(heal, monkeypatch):
    """--force deleted OUT before converting: a run that then failed (a bad value found mid-run, a full disk) left
    the user without the model OUT held. The folder is kept beside OUT until the new model is written; an error
    puts it back, an interrupt keeps it for the run that finishes."""
    from effattn.finetune.state import RunFolder

    out = finetune(heal("train.max_steps=2", "eval.every=0", output="model")).out
    before = (out / "model.safetensors").read_bytes()
    replaced = RunFolder(out).replaced

    def fails(*args, **kwargs):
        raise EffattnError("a failure mid-run")

    monkeypatch.setattr(loop, "held_out_sets", fails)  # after the student's conversion, inside OUT
    notes = []
    with pytest.raises(EffattnError, match="a failure mid-run"):
        finetune(heal("train.max_steps=3", "eval.every=0", output="model"), force=True, log=notes.append)
    assert (out / "model.safetensors").read_bytes() == before and not replaced.exists()
    assert any("holds the folder --force was replacing again" in n for n in notes)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "held_out_sets", interrupted)
    with pytest.raises(KeyboardInterrupt):
        finetune(heal("train.max_steps=3", "eval.every=0", output="model"), force=True)
    assert (replaced / "model.safetensors").read_bytes() == before and (out / ".effattn-finetune").is_file()
    monkeypatch.undo()
    result = finetune(heal("train.max_steps=3", "eval.every=0", output="model"))  # the interrupted run, finished
    assert result.steps == 3 and not replaced.exists()
