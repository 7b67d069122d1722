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


def tiny_moe(folder, model_type):
    """A tiny random Mixtral or Qwen2-MoE checkpoint, saved by transformers (complete and valid)."""
    import transformers

    from effattn.testing import byte_tokenizer

    sizes = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                 num_key_value_heads=3, vocab_size=258, max_position_embeddings=512)
    if model_type == "mixtral":
        config = transformers.MixtralConfig(**sizes, head_dim=8, num_local_experts=4, num_experts_per_tok=2)
    else:
        config = transformers.Qwen2MoeConfig(**sizes, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=32)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


FINETUNE = ["train.max_steps=1", "data.seq_len=32", "train.batch_size=2", "eval.tokens=256", "eval.seq_len=32",
            "eval.every=0", "checkpoint.every=0"]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_a_moe_checkpoint_is_an_unsupported_family_not_an_incomplete_export(capsys, tmp_path, model_type):
    """The tensors were checked against the config before the family: a complete Mixtral was told it lacked
    model.layers.0.mlp.gate.weight (transformers renames its block_sparse_moe.* tensors on load) and to export it
    again."""
    src = tiny_moe(tmp_path / "moe", model_type)
    out = tmp_path / "out"
    commands = [["inspect", src], ["convert", src, "--to", "mqa", "--method", "mean", "-o", out, "--dry-run"],
                ["convert", src, "--to", "mqa", "--method", "mean", "-o", out],
                ["finetune", "heal-gqa", "-o", out, "--dry-run", f"student.model={src}", "student.convert.method=mean",
                 *FINETUNE],
                ["finetune", "heal-gqa", "-o", out, f"student.model={src}", "student.convert.method=mean", *FINETUNE]]
    for args in commands:
        code, _, err = run_cli(capsys, *args)
        assert_one_line_error(code, err, f"model_type '{model_type}' is not a supported family", "llama, ministral")
        assert "lacks tensor" not in err and not out.exists()
    # eval measures any causal LM transformers loads (as it does phi): the checkpoint is not called incomplete
    code, stdout, err = run_cli(capsys, "eval", src, "--no-speed", "--dry-run")
    assert code in (0, None) and "lacks tensor" not in err, err


def test_a_moe_checkpoint_missing_an_attention_tensor_is_still_named(capsys, tmp_path):
    """Only the names transformers maps from other stored names go unchecked."""
    from safetensors.torch import load_file, save_file

    src = tiny_moe(tmp_path / "moe", "mixtral")
    weights = load_file(src / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    code, _, err = run_cli(capsys, "eval", src, "--no-speed", "--dry-run")
    assert_one_line_error(code, err, "lacks tensor model.layers.1.self_attn.k_proj.weight")


def write_gguf(src, path):
    """A GGUF file (float32, llama) holding the tiny llama checkpoint in folder `src`."""
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    config = json.loads((src / "config.json").read_text())
    vocab = json.loads((src / "tokenizer.json").read_text())
    ids = {**vocab["model"]["vocab"], **{t["content"]: t["id"] for t in vocab["added_tokens"]}}
    tokens = [t for t, _ in sorted(ids.items(), key=lambda item: item[1])]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_token_merges([])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    parts = [("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
             ("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
             ("mlp.down_proj", "ffn_down"), ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm")]
    for layer in range(config["num_hidden_layers"]):
        for ours, theirs in parts:
            names[f"model.layers.{layer}.{ours}.weight"] = f"blk.{layer}.{theirs}.weight"
    for name, tensor in load_file(src / "model.safetensors").items():
        writer.add_tensor(names[name], tensor.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def gguf_model(tiny, tmp_path, monkeypatch):
    """A tiny llama as a .gguf file, with a cache of its own."""
    monkeypatch.setenv("EFFATTN_CACHE", str(tmp_path / "cache"))
    return write_gguf(tiny("llama"), tmp_path / "tiny.gguf")


def test_a_model_converted_from_a_gguf_names_the_file_and_finetune_reads_it_again(capsys, gguf_model, tmp_path):
    """The record named the GGUF's cached copy as the source; finetune took it as the teacher and failed with a
    "not found" for a cache path once the cache was pruned."""
    import json
    import shutil

    out = tmp_path / "gg"
    code, _, err = run_cli(capsys, "convert", gguf_model, "--to", "mqa", "--method", "mean", "-o", out, "--no-eval")
    assert code in (0, None), err
    source = json.loads((out / "effattn.json").read_text())["source"]
    assert source["kind"] == "gguf" and source["path"] == str(gguf_model)
    shutil.rmtree(source["cache"])  # pruned
    args = ["finetune", "heal-gqa", "-o", tmp_path / "ft", "--dry-run", f"student.model={out}", "student.convert=null",
            *FINETUNE]
    code, _, err = run_cli(capsys, *args)
    assert code in (0, None), err
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.safetensors"))  # metadata only
    gguf_model.unlink()
    code, _, err = run_cli(capsys, *args)
    assert_one_line_error(code, err, f"converted from the GGUF file {gguf_model}, which is no longer there",
                          "set teacher.model=")


def llama_config_as(src, **changes):
    import json

    config = json.loads((src / "config.json").read_text()) | changes
    (src / "config.json").write_text(json.dumps(config))
    return src


def test_an_unsupported_family_gets_one_plain_list_and_a_remote_code_note(capsys, tiny, tmp_path):
    """It said "supported model types: valid: llama, ... (did you mean 'llama'?)": the list twice introduced and a
    guess no option can act on."""
    src = llama_config_as(tiny("llama"), model_type="myllama", architectures=["MyLlamaForCausalLM"],
                          auto_map={"AutoModelForCausalLM": "modeling_myllama.MyLlamaForCausalLM"})
    code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "-o", tmp_path / "out")
    assert_one_line_error(code, err, "model_type 'myllama' is not a supported family",
                          "auto_map", "converts these model types only: llama, ministral, mistral, qwen2, qwen3")
    assert "valid:" not in err and "did you mean" not in err


def test_a_remote_code_model_that_is_not_a_causal_lm_says_its_code_is_remote(capsys, tiny, tmp_path):
    src = llama_config_as(tiny("llama"), architectures=["EvilModel"], auto_map={"AutoModel": "evil.EvilModel"})
    code, _, err = run_cli(capsys, "inspect", src)
    assert_one_line_error(code, err, "is not a causal LM (architectures: EvilModel; its modeling code is remote",
                          "--trust-remote-code does not change that", "llama, ministral")


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_file_of_a_model_folder_as_model_suggests_the_folder(capsys, tiny, name):
    src = tiny("llama")
    code, _, err = run_cli(capsys, "inspect", src / name)
    assert_one_line_error(code, err, f"{name} is a file, not a model folder", f"pass the folder that holds it: {src}")


def test_library_messages_are_shortened_between_words():
    from effattn.errors import clip

    sentence = "Cannot find an appropriate cached snapshot folder for the specified revision on the local disk."
    more = " To enable look-ups, set HF_HUB_OFFLINE=0."
    assert clip(sentence + more * 3, 160) == sentence + more  # the whole sentences that fit
    long_words = "word " * 60
    assert clip(long_words, 100) == ("word " * 20).strip() + " ..."
    assert clip("short  text\n", 100) == "short text"


def test_a_hub_error_is_not_cut_inside_a_word(capsys, monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError(
            "Cannot find an appropriate cached snapshot folder for the specified revision on the local disk and "
            "outgoing traffic has been disabled. To enable repo look-ups and downloads online, pass "
            "'local_files_only=False' as input.")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    code, _, err = run_cli(capsys, "inspect", "some-org/some-model")
    assert_one_line_error(code, err, "outgoing traffic has been disabled.)", "pass a local folder")
    assert "To enable" not in err


def test_a_dry_run_on_a_gguf_plans_from_its_metadata_without_dequantizing(capsys, gguf_model, tmp_path):
    """The dry run wrote a full float32 copy of the model into the cache."""
    from effattn.io.resolve import prune_gguf_cache

    cache = tmp_path / "cache"
    args = ["convert", gguf_model, "--to", "mqa", "--method", "mean", "-o", tmp_path / "out"]
    code, out, err = run_cli(capsys, *args, "--dry-run")
    assert code in (0, None), err
    assert "planned from its metadata" in " ".join(out.split()) and not list(cache.rglob("*.safetensors"))
    assert not (tmp_path / "out").exists()
    plan_entry = next((cache / "gguf").glob("*-plan"))
    assert (plan_entry / "config.json").is_file() and (plan_entry / "tokenizer.json").is_file()
    gguf_model.unlink()  # an entry of a GGUF that is gone is pruned, the metadata one too
    assert plan_entry in prune_gguf_cache()


def test_evals_dry_runs_on_a_gguf_dequantize_nothing_and_plan_what_the_run_measures(capsys, gguf_model, tmp_path):
    """eval's and passkey's dry runs dequantized the file into the cache, as convert's did."""
    import json

    cache = tmp_path / "cache"
    for task in (["--corpus", "shakespeare", "--max-tokens", "128", "--context", "64", "--no-speed"],
                 ["--task", "passkey", "--lengths", "300", "--depths", "0.5", "--samples", "1"]):
        code, out, err = run_cli(capsys, "eval", gguf_model, *task, "--dry-run", "--json")
        assert code in (0, None), err
        assert not list(cache.rglob("*.safetensors"))
    planned = json.loads(out)
    code, out, err = run_cli(capsys, "eval", gguf_model, "--task", "passkey", "--lengths", "300", "--depths", "0.5",
                             "--samples", "1", "--json")
    assert code in (0, None), err
    assert list(cache.rglob("*.safetensors"))  # the run dequantizes it
    code, out, err = run_cli(capsys, "eval", gguf_model, "--task", "passkey", "--lengths", "300", "--depths", "0.5",
                             "--samples", "1", "--dry-run", "--json")
    again = json.loads(out)  # the same plan from the metadata as from the dequantized copy, named by the file
    assert again["model"] == planned["model"] == str(gguf_model)
    assert {k: v for k, v in again.items() if k != "est_peak_bytes"} == \
        {k: v for k, v in planned.items() if k != "est_peak_bytes"}  # (the estimate counts the process's own memory)


def test_a_gguf_tokenizer_is_read_from_its_metadata_by_a_dry_run(capsys, gguf_model, tiny, tmp_path):
    """`--tokenizer FILE.gguf` was dequantized by eval's and passkey's dry runs (the models were not)."""
    cache = tmp_path / "cache"
    for task in (["--corpus", "shakespeare", "--max-tokens", "128", "--context", "64", "--no-speed"],
                 ["--task", "passkey", "--lengths", "300", "--depths", "0.5", "--samples", "1"]):
        code, out, err = run_cli(capsys, "eval", tiny("llama"), "--tokenizer", gguf_model, *task, "--dry-run")
        assert code in (0, None), err
        assert "dry run" in out and not list(cache.rglob("*.safetensors"))
    code, out, err = run_cli(capsys, "eval", tiny("llama"), "--tokenizer", gguf_model, "--task", "passkey",
                             "--lengths", "300", "--depths", "0.5", "--samples", "1")
    assert code in (0, None), err
    assert list(cache.rglob("*.safetensors"))  # the run reads the tokenizer of the dequantized copy


def test_a_missing_relative_folder_read_as_a_hub_id_says_no_folder_exists(capsys, monkeypatch, tmp_path):
    """`out/x` before it was written read as a failed hub download, with no word of the folder the user meant."""
    import huggingface_hub

    def offline(*args, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("outgoing traffic has been disabled.")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "inspect", "out/llama-mqa")
    assert_one_line_error(code, err, "could not download 'out/llama-mqa'",
                          "no local folder out/llama-mqa exists either")
