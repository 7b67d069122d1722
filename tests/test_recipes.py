"""Recipes: schema errors that name the key, dotted overrides, and every built-in recipe validating."""

from __future__ import annotations

import json

import pytest
import yaml

from effattn.errors import EffattnError
from effattn.finetune import apply_overrides, builtin_recipes, load_recipe, validate_recipe

from .test_cli_errors import assert_one_line_error, run_cli

MINIMAL = {"student": {"model": "some/folder"}, "train": {"max_steps": 10}}


def write(tmp_path, data, name="recipe.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_typo_names_the_key_path_and_suggests_the_closest(capsys, tmp_path):
    path = write(tmp_path, {"student": {"model": "x"}, "train": {"max_step": 10}})
    code, _, err = run_cli(capsys, "recipes", "validate", path)
    assert_one_line_error(code, err, "train.max_step: unknown key (did you mean 'max_steps'?)")


def test_unknown_section_lists_the_closest_section(capsys, tmp_path):
    path = write(tmp_path, MINIMAL | {"optimiser": {"lr": 1e-3}})
    code, _, err = run_cli(capsys, "recipes", "validate", path)
    assert_one_line_error(code, err, "optimiser: unknown key (did you mean 'optimizer'?)")


def test_wrong_type_shows_the_key_and_the_value(capsys, tmp_path):
    path = write(tmp_path, {"student": {"model": "x"}, "train": {"max_steps": "many"}})
    code, _, err = run_cli(capsys, "recipes", "validate", path)
    assert_one_line_error(code, err, "train.max_steps = 'many'", "valid integer")


def test_missing_fields_are_named(capsys, tmp_path):
    code, _, err = run_cli(capsys, "recipes", "validate", write(tmp_path, {"train": {"max_steps": 5}}))
    assert_one_line_error(code, err, "student: required key is missing")
    code, _, err = run_cli(capsys, "recipes", "validate", write(tmp_path, {"student": {}, "train": {"max_steps": 5}}))
    assert_one_line_error(code, err, "student.model: required key is missing")


def test_several_problems_are_reported_together():
    with pytest.raises(EffattnError) as exc:
        validate_recipe({"student": {"modle": "x"}, "train": {"max_steps": 0}, "loss": {"temprature": 2}})
    msg = exc.value.message
    assert "student.modle: unknown key (did you mean 'model'?)" in msg
    assert "train.max_steps = 0: Input should be greater than or equal to 1" in msg
    assert "loss.temprature: unknown key (did you mean 'temperature'?)" in msg


def test_choice_typo_suggests_the_closest_choice():
    with pytest.raises(EffattnError, match=r"train.params = 'lroa'.*did you mean 'lora'"):
        validate_recipe(MINIMAL | {"train": {"max_steps": 5, "params": "lroa"}})


def test_steps_or_tokens_exactly_one():
    with pytest.raises(EffattnError, match="set exactly one of train.max_steps and train.max_tokens"):
        validate_recipe({"student": {"model": "x"}, "train": {"max_steps": 5, "max_tokens": 1000}})
    with pytest.raises(EffattnError, match="set exactly one of train.max_steps and train.max_tokens"):
        validate_recipe({"student": {"model": "x"}, "train": {}})


def test_a_loss_with_nothing_to_learn_is_refused():
    with pytest.raises(EffattnError, match="loss.kl, loss.ce and loss.attn_out are all 0"):
        validate_recipe(MINIMAL | {"loss": {"kl": 0}})


def test_overrides_coerce_types_and_create_sections():
    data = apply_overrides(MINIMAL, ["train.max_steps=50", "optimizer.lr=1e-4", "data.sources=[a.txt, mix]",
                                     "teacher.model=null", "student.convert.to=mqa", "student.convert.kv_heads=1",
                                     "train.precision=bf16"])
    recipe = validate_recipe(data)
    assert recipe.train.max_steps == 50 and isinstance(recipe.train.max_steps, int)
    assert recipe.optimizer.lr == 1e-4  # YAML reads 1e-4 as a string; the schema coerces it
    assert recipe.data.sources == ["a.txt", "mix"]
    assert recipe.teacher.model is None and recipe.train.precision == "bf16"
    assert recipe.student.convert.to == "mqa" and recipe.student.convert.options() == {"kv_heads": 1}
    assert MINIMAL["train"] == {"max_steps": 10}  # the input is not modified


def test_override_of_an_unknown_key_is_an_error_with_its_path():
    with pytest.raises(EffattnError, match=r"train.max_stepz: unknown key \(did you mean 'max_steps'\?\)"):
        validate_recipe(apply_overrides(MINIMAL, ["train.max_stepz=5"]))


@pytest.mark.parametrize("item, needle", [("train.max_steps", "is not KEY=VALUE"), ("=5", "is not KEY=VALUE"),
                                          ("train.max_steps.x=1", "train.max_steps is a value (10), not a section")])
def test_malformed_overrides(item, needle):
    with pytest.raises(EffattnError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        apply_overrides(MINIMAL, [item])


def test_output_option_overrides_the_recipe(tmp_path):
    path = write(tmp_path, MINIMAL | {"output": "from-recipe"})
    assert load_recipe(path).output == "from-recipe"
    assert load_recipe(path, output=tmp_path / "cli").output == str(tmp_path / "cli")


def test_conversion_options_pass_through_unchanged():
    recipe = validate_recipe(MINIMAL | {"student": {"model": "llama", "convert": {
        "to": "gqa", "kv_heads": 1, "method": "pca", "calib": "mix", "calib_tokens": 4096}}})
    assert recipe.student.convert.options() == {"kv_heads": 1, "method": "pca", "calib": "mix", "calib_tokens": 4096}


@pytest.mark.parametrize("convert, needle", [
    ({"to": "mqa", "kv_hedas": 1}, "student.convert.kv_hedas: unknown option of mqa (did you mean 'kv_heads'?)"),
    ({"to": "mqa", "window": 64}, "student.convert.window does not apply to mqa. drop it (student.convert.window is for rerope, vq, swa, sparse, linear)"),
    ({"to": "mqa", "kv_heads": 2}, "student.convert.to mqa fixes student.convert.kv_heads to 1, but 2 was given"),
    ({"to": "gqa", "method": "meen"}, "student.convert.method = 'meen': unknown GQA method 'meen'"),
    ({"to": "vq", "codebook_size": 0}, "student.convert.codebook_size must be an integer >= 1, got 0"),
    ({"to": "vq", "metric": "cosine"}, "unknown student.convert.metric 'cosine'"),
    ({"to": "gqq"}, "unknown conversion 'gqq'"),
    ({"to": "linear", "refine_device": "gpu"}, "student.convert.refine_device"),
])
def test_conversion_options_are_checked_by_the_conversions_own_model(capsys, tmp_path, convert, needle):
    """A recipe's student.convert fails at `recipes validate`, with the key's path, not at run time."""
    path = write(tmp_path, MINIMAL | {"student": {"model": "llama", "convert": convert}})
    code, _, err = run_cli(capsys, "recipes", "validate", str(path))
    assert_one_line_error(code, err, needle)


def test_builtin_recipes_exist_for_gqa_on_cpu_and_gpu():
    recipes = builtin_recipes()
    assert {"heal-gqa", "heal-gqa-gpu"} <= set(recipes)
    cpu, gpu = load_recipe("heal-gqa"), load_recipe("heal-gqa-gpu")
    assert cpu.train.precision == "fp32" and gpu.train.precision == "bf16"
    # no method pinned: the conversion's default method is used
    assert "method" not in cpu.student.convert.options() and "method" not in gpu.student.convert.options()


@pytest.mark.parametrize("name", sorted(builtin_recipes()))
def test_every_builtin_recipe_validates(capsys, name):
    code, out, err = run_cli(capsys, "recipes", "validate", name, "--json")
    assert code == 0, err
    assert json.loads(out)["student"]["model"]
    code, out, _ = run_cli(capsys, "recipes", "validate", builtin_recipes()[name])  # by path, human output
    assert code == 0 and "valid:" in out


def test_recipes_ls_and_cp(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "recipes", "ls", "--json")
    names = {r["name"]: r["description"] for r in json.loads(out)}
    assert code == 0 and "heal-gqa" in names and "CPU" in names["heal-gqa"] and "GPU" in names["heal-gqa-gpu"]
    code, out, _ = run_cli(capsys, "recipes", "cp", "heal-gqa", tmp_path / "mine.yaml")
    assert code == 0 and (tmp_path / "mine.yaml").read_text() == builtin_recipes()["heal-gqa"].read_text()
    code, _, err = run_cli(capsys, "recipes", "cp", "heal-gqa", tmp_path / "mine.yaml")
    assert_one_line_error(code, err, "already exists", "--force")
    code, _, err = run_cli(capsys, "recipes", "cp", "heal-gq", tmp_path / "x.yaml")
    assert_one_line_error(code, err, "unknown built-in recipe 'heal-gq'", "did you mean 'heal-gqa'")
    code, _, err = run_cli(capsys, "recipes", "cp", "heal-gqa", "")  # wrote ./heal-gqa.yaml
    assert_one_line_error(code, err, "the destination is empty", "heal-gqa.yaml")


def test_bad_yaml_names_the_line(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("student:\n  model: x\ntrain: [unclosed\n")
    code, _, err = run_cli(capsys, "recipes", "validate", path)
    assert_one_line_error(code, err, "is not valid YAML at line")


def test_recipes_cp_into_a_new_folder_and_onto_paths_it_cannot_write(capsys, tmp_path):
    from tests.test_cli_errors import assert_one_line_error, run_cli

    code, out, err = run_cli(capsys, "recipes", "cp", "heal-vq", f"{tmp_path}/new/sub/")
    assert code in (0, None) and (tmp_path / "new" / "sub" / "heal-vq.yaml").is_file(), err
    (tmp_path / "afile").write_text("x")
    code, _, err = run_cli(capsys, "recipes", "cp", "heal-vq", tmp_path / "afile" / "x.yaml")
    assert_one_line_error(code, err, "afile is a file, not a folder")
    code, _, err = run_cli(capsys, "recipes", "cp", "heal-vq", "/proc/effattn-test/x.yaml")
    assert_one_line_error(code, err, "cannot write /proc/effattn-test/x.yaml")
    assert code == 2
