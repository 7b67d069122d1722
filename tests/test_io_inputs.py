"""Inputs and outputs that are not plain folders: a symbolic link as OUT, MoE checkpoints, models from a GGUF file,
a weight file or config.json given as MODEL, remote-code configs, messages cut short."""

from __future__ import annotations

import os

import pytest

from effattn.finetune import finetune

from .test_cli_errors import assert_one_line_error, run_cli
from .test_finetune import heal  # noqa: F401 - a fixture


def beside(folder):
    """The hidden entries beside the output folders in `folder` (what a replacement leaves behind)."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_force_onto_a_link_replaces_the_folder_it_leads_to_and_keeps_the_link(capsys, tiny, tmp_path):
    """--force renamed the link aside (.OUT.old-X), failed to delete it (shutil.rmtree refuses links, silently with
    ignore_errors) and put a real folder where the link was: links piled up beside OUT, one a run."""
    src = tiny("llama")
    target, link = tmp_path / "target", tmp_path / "link"
    args = ["convert", src, "--to", "mqa", "--method", "mean", "--no-eval"]
    assert run_cli(capsys, *args, "-o", target)[0] in (0, None)
    link.symlink_to(target)
    for _ in range(2):
        code, _, err = run_cli(capsys, *args, "-o", link, "--force")
        assert code in (0, None), err
        assert link.is_symlink() and os.readlink(link) == str(target)
        assert (target / "model.safetensors").is_file() and beside(tmp_path) == []


def test_links_an_earlier_version_left_beside_out_are_removed_not_followed(capsys, tiny, tmp_path):
    """What the earlier --force left (.link.old-X -> the output) is unlinked by the next run; the folder it leads to
    stays."""
    src = tiny("llama")
    target, link = tmp_path / "target", tmp_path / "link"
    args = ["convert", src, "--to", "mqa", "--method", "mean", "--no-eval"]
    assert run_cli(capsys, *args, "-o", target)[0] in (0, None)
    link.symlink_to(target)
    (tmp_path / ".link.old-abc123").symlink_to(target)  # an earlier version's leftovers
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "file").write_text("x")
    (tmp_path / ".link.old-def456").symlink_to(keep)
    code, _, err = run_cli(capsys, *args, "-o", link, "--force")
    assert code in (0, None), err
    assert beside(tmp_path) == [] and (keep / "file").read_text() == "x" and link.is_symlink()


def test_finetune_force_onto_a_link_replaces_the_folder_it_leads_to(heal):  # noqa: F811 - the fixture
    """finetune --force renamed the link itself aside (.OUT.replaced-by-effattn), put a real folder in its place,
    and could not delete the renamed link."""
    first = finetune(heal("train.max_steps=1", "eval.every=0", "checkpoint.every=0", output="model")).out
    link = heal.root / "link"
    link.symlink_to(first)
    (heal.root / ".link.replaced-by-effattn").symlink_to(first)  # an earlier version's leftover
    result = finetune(heal("train.max_steps=1", "eval.every=0", "checkpoint.every=0", output="link"), force=True)
    assert link.is_symlink() and os.readlink(link) == str(first) and result.out == first
    assert (first / "model.safetensors").is_file() and not (first / ".effattn-finetune").exists()
    assert beside(heal.root) == []
