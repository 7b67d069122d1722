"""A conversion is one module: the one below is defined in this file alone, registered, and then runs
through every entry point that reads the conversion declarations (the CLI and its generated flags,
`--help`, `--dry-run`, the model card, `inspect`, a recipe's student.convert and the fine-tune) with no
change under effattn/."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from pydantic import Field
from safetensors.torch import load_file

from effattn.convert import ALIASES, CONVERSIONS, register_conversion
from effattn.convert.base import Plan, kv_bytes_per_token, same_specs
from effattn.convert.layers import LayerInput, LayerOutput, run_layers
from effattn.convert.options import ConversionOptions
from effattn.families import AttentionShape

from .conftest import logits_of
from .test_cli_errors import assert_one_line_error, run_cli
from .test_finetune import HELD_OUT, TRAIN_TEXT


class ValueScale:
    """v_proj × s and o_proj ÷ s in every layer: the same function. With s a power of two every
    product is exact, so the converted model's logits equal the original's bit for bit."""

    name = "vscale"
    description = "scale the value heads by s and o_proj by 1/s (an exact identity)"
    aliases = {"vdouble": {"scale": 2.0}}
    model = None  # native output

    class Options(ConversionOptions):
        scale: float = Field(4.0, gt=0, description="the factor s")

    def targets(self, config) -> str:
        return "--scale S: the same model, values scaled"

    def plan(self, ckpt, family, opts, target) -> Plan:
        shape = AttentionShape.of(ckpt.config)
        kv = kv_bytes_per_token(ckpt.config, target or ckpt.dtype)
        return Plan(conversion=self.name, settings={"scale": opts.scale}, config=dict(ckpt.config),
                    specs=same_specs(ckpt, target), summary=[("values", f"x {opts.scale}, o_proj / {opts.scale}")],
                    kv_bytes_per_token=(kv, kv), state={"layers": shape.layers, "target": target, "scale": opts.scale})

    def run(self, ckpt, family, plan, writer, progress) -> None:
        s = plan.state["scale"]

        def scale(layer: LayerInput) -> LayerOutput:
            tensors = dict(layer.tensors)
            v, o = family.attn(layer.index, "v_proj"), family.attn(layer.index, "o_proj")
            tensors[v], tensors[o] = tensors[v] * s, tensors[o] / s
            return LayerOutput(tensors)

        run_layers(ckpt, family, writer, scale, layers=plan.state["layers"], target=plan.state["target"], progress=progress)


@pytest.fixture
def vscale():
    register_conversion(ValueScale())
    yield
    CONVERSIONS.pop("vscale")
    ALIASES.pop("vdouble")


def test_a_conversion_defined_outside_effattn_runs_through_the_cli(vscale, tiny, tmp_path, capsys):
    src = tiny("llama")
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "convert", src, "--to", "vscale", "--scale", "8", "-o", out, "--no-eval")
    assert code == 0, err
    ids = torch.randint(0, 256, (2, 24))
    assert torch.equal(logits_of(out, ids), logits_of(src, ids))
    assert json.loads((out / "effattn.json").read_text())["conversion"] == {"to": "vscale", "scale": 8.0, "dtype": "float32"}
    card = (out / "README.md").read_text()
    assert "tags: [effattn, vscale]" in card and "| scale | `8.0` |" in card and "values: x 8.0, o_proj / 8.0" in card
    v = "model.layers.1.self_attn.v_proj.weight"
    assert torch.equal(load_file(out / "model.safetensors")[v], 8 * load_file(src / "model.safetensors")[v])

    code, stdout, err = run_cli(capsys, "convert", src, "--to", "vdouble", "--dry-run", "--json")  # the alias
    assert code == 0, err
    plan = json.loads(stdout)
    assert plan["settings"]["scale"] == 2.0 and plan["output"] is None and not (tmp_path / "never").exists()

    code, stdout, _ = run_cli(capsys, "convert", "--to", "vscale", "--help")
    assert code in (0, None) and "--scale" in stdout and "the factor s" in stdout and "4.0" in stdout
    code, stdout, _ = run_cli(capsys, "inspect", src)
    assert code in (0, None) and "vscale" in stdout and "values scaled" in stdout


@pytest.mark.parametrize("args, needle", [
    (["--scale", "0"], "--scale must be a number > 0.0, got 0.0"),
    (["--kv-heads", "1"], "--kv-heads does not apply to vscale"),
    (["--to", "vdouble", "--scale", "3"], "--to vdouble fixes --scale to 2.0, but 3.0 was given"),
])
def test_its_options_are_checked_from_its_own_model(vscale, tiny, tmp_path, capsys, args, needle):
    to = [] if "--to" in args else ["--to", "vscale"]
    code, _, err = run_cli(capsys, "convert", tiny("llama"), *to, *args, "-o", tmp_path / "x")
    assert_one_line_error(code, err, needle)
    assert not (tmp_path / "x").exists()


def test_a_recipe_converts_with_it_and_heals(vscale, tiny, tmp_path, capsys):
    src = tiny("llama")
    (tmp_path / "train.txt").write_text(TRAIN_TEXT)
    (tmp_path / "held.txt").write_text(HELD_OUT)
    recipe = {"student": {"model": str(src), "convert": {"to": "vscale", "scale": 2.0}},
              "data": {"sources": [str(tmp_path / "train.txt")], "seq_len": 32},
              "train": {"max_steps": 2, "batch_size": 2}, "checkpoint": {"every": 0},
              "eval": {"corpora": [str(tmp_path / "held.txt")], "seq_len": 64, "tokens": 128}}
    path = tmp_path / "heal.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code, _, err = run_cli(capsys, "recipes", "validate", path, "student.convert.scael=2")
    assert_one_line_error(code, err, "student.convert.scael: unknown option of vscale (did you mean 'scale'?)")
    code, _, err = run_cli(capsys, "finetune", path, "-o", tmp_path / "healed")
    assert code == 0, err
    record = json.loads((tmp_path / "healed" / "effattn.json").read_text())
    assert record["conversion"]["to"] == "vscale" and record["finetune"]["steps"] == 2
    assert "import effattn" not in (tmp_path / "healed" / "README.md").read_text()  # native: plain transformers loads it


def test_every_bundled_model_defines_each_top_level_name_once():
    """A model's remote code is its modules pasted into one namespace (models.ModelSpec.bundle): a name defined
    in two of them would silently replace the first (heavy_decode.py's decode helpers once shadowed decode.py's)."""
    import ast
    from collections import defaultdict

    import effattn  # noqa: F401  (registers every model)
    from effattn.models import MODEL_SPECS, ROOT

    assert len(MODEL_SPECS) >= 4
    for spec in MODEL_SPECS.values():
        where = defaultdict(list)
        for rel in spec.modules:
            for node in ast.parse((ROOT / rel).read_text()).body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    where[node.name].append(rel)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                        if isinstance(target, ast.Name):
                            where[target.id].append(rel)
        twice = {name: files for name, files in where.items() if len(files) > 1}
        assert not twice, f"{spec.model_type}: {twice}"
        compile(spec.bundle(), spec.modeling_file, "exec")  # and the bundle is valid Python
