"""What a conversion prints, estimates and records is true, and an optional measurement never decides
its outcome: tokenizer-less folders, estimates against measured peaks, cards that reproduce."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from effattn.io.load import TOKENIZER_FILES
from effattn.io.card import measurement_rows
from effattn.testing import make_model
from tests.exact import pinned_env
from tests.test_cli_errors import assert_one_line_error, run_cli

EFFATTN = str(Path(sys.executable).parent / "effattn")


def without_tokenizer(folder: Path) -> Path:
    for name in TOKENIZER_FILES:
        (folder / name).unlink(missing_ok=True)
    return folder


def record(folder: Path) -> dict:
    return json.loads((folder / "effattn.json").read_text())


# -- 1. a folder without a tokenizer converts; the measurement is skipped, and says why -----------

@pytest.mark.parametrize("family,args", [
    ("qwen2", ["--to", "gqa", "--kv-heads", "1", "--method", "mean"]),
    ("llama", ["--to", "mqa", "--method", "align"]),
    ("llama", ["--to", "rerope", "--window", "16"]),
])
def test_a_folder_without_tokenizer_converts_and_the_record_says_why(capsys, tiny, tmp_path, family, args):
    src = without_tokenizer(tiny(family))
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "convert", src, *args, "-o", out)
    assert code in (0, None), err
    assert "measurement skipped" in stdout and "no tokenizer" in stdout
    rec = record(out)
    assert rec["measurements"] is None
    assert "no tokenizer files" in rec["measurement_skipped"] and "--tokenizer" in rec["measurement_skipped"]
    card = (out / "README.md").read_text()
    assert "Not measured at conversion time" in card and "no tokenizer files" in card
    # measuring later with the tokenizer of another folder works
    tok = tiny(family)
    code, stdout, err = run_cli(capsys, "eval", out, "--baseline", src, "--tokenizer", tok, "--max-tokens", "256",
                                "--context", "64", "--no-speed", "--json")
    assert code in (0, None), err
    report = json.loads(stdout)
    assert report["model"]["perplexity"]["shakespeare"] > 1 and report["baseline"]["perplexity"]["shakespeare"] > 1


def test_without_tokenizer_calibration_and_an_explicit_eval_are_refused_before_work(capsys, tiny, tmp_path):
    src = without_tokenizer(tiny("llama"))
    for args in (["--to", "mqa"], ["--to", "vq", "--codebook-size", "8", "--window", "16", "--calib-seq-len", "64"],
                 ["--to", "mqa", "--method", "mean", "--eval"]):
        out = tmp_path / "out"
        for dry in ([], ["--dry-run"]):
            code, _, err = run_cli(capsys, "convert", src, *args, *dry, "-o", out)
            assert_one_line_error(code, err, "tokenizer")
            assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    code, _, err = run_cli(capsys, "eval", src, "--max-tokens", "256", "--context", "64")
    assert_one_line_error(code, err, "no tokenizer files", "--tokenizer")
    # each refusal names fixes of its own command: vq-init has no --method (it was advised)
    code, _, err = run_cli(capsys, "vq-init", src, "--codebook-size", "8", "--window", "16", "--calib-seq-len", "64",
                           "-o", tmp_path / "vq")
    assert_one_line_error(code, err, "calibration needs the model's tokenizer")
    assert "--method" not in err
    code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "-o", tmp_path / "gqa")
    assert_one_line_error(code, err, "calibration needs the model's tokenizer", "--method mean")


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_or_skips_the_measurement(capsys, tiny, tmp_path):
    """A tokenizer whose ids reach past the embedding crashed calibration and the quick measurement (IndexError)."""
    src = tiny("llama", vocab_size=200)  # the byte tokenizer has 258 tokens
    for args in (["--to", "mqa"], ["--to", "vq", "--codebook-size", "8", "--window", "16", "--calib-seq-len", "64"]):
        for dry in ([], ["--dry-run"]):
            code, _, err = run_cli(capsys, "convert", src, *args, *dry, "-o", tmp_path / "out")
            assert_one_line_error(code, err, "the tokenizer has 258 tokens, more than the model's vocabulary of 200")
    code, _, err = run_cli(capsys, "convert", src, "--to", "mqa", "--method", "mean", "-o", tmp_path / "out")
    assert code == 0, err
    record = json.loads((tmp_path / "out" / "effattn.json").read_text())
    assert record["measurement_skipped"].startswith(f"the tokenizer has 258 tokens, more than {src}'s vocabulary")


def test_eval_reads_pickled_weights_only_when_asked(capsys, tiny, tmp_path):
    """eval's pickle refusal advised --allow-pickle, which eval did not have."""
    from transformers import AutoModelForCausalLM

    src = tiny("llama")
    torch.save(AutoModelForCausalLM.from_pretrained(src).state_dict(), src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    args = ["eval", src, "--corpus", "shakespeare", "--max-tokens", "128", "--context", "64", "--no-speed", "--json"]
    code, _, err = run_cli(capsys, *args)
    assert_one_line_error(code, err, "holds only pickled weights", "--allow-pickle")
    code, out, err = run_cli(capsys, *args, "--allow-pickle")
    assert code == 0 and json.loads(out)["model"]["perplexity"]["shakespeare"] > 1, err


def test_a_cast_conversion_states_the_originals_cache_at_its_own_dtype(tiny):
    from effattn.convert import convert

    plan = convert(tiny("llama"), None, to="mqa", options={"method": "mean"}, dtype="bfloat16", dry_run=True,
                   measure=False).plan
    rows = dict(plan.summary)
    assert rows["KV cache"].startswith("192 -> 64 bytes/token")  # both at bfloat16
    assert rows["dtype"] == ("float32 -> bfloat16: the KV cache figures above are at bfloat16 for both models; the "
                             "original caches 384 bytes/token at float32")
    assert "dtype" not in dict(convert(tiny("llama"), None, to="mqa", options={"method": "mean"}, dry_run=True,
                                       measure=False).plan.summary)


def test_the_cards_load_lines_name_trust_remote_code_for_both_calls_and_how_padding_runs():
    from effattn.io.card import load_section

    import effattn  # noqa: F401 - registers the model types

    custom = "\n".join(load_section("OUT", "effattn_sinks"))  # a padded batch runs row by row (test_padded_batches)
    assert "pass trust_remote_code=True to both calls below" in custom and "runs row by row" in custom
    native = "\n".join(load_section("OUT", "llama"))
    assert "trust_remote_code" not in native and "row by row" not in native
    sparse = "\n".join(load_section("OUT", "effattn_sparse"))  # takes a batch padded in front
    assert "pad its sequences in front" in sparse and "row by row" not in sparse


def test_a_failing_measurement_does_not_fail_the_conversion(tiny, tmp_path, monkeypatch):
    from effattn.convert import base, convert
    from effattn.errors import EffattnError

    def broken(*_, **__):
        raise EffattnError("the text has 0 tokens", "use a longer text")

    monkeypatch.setattr(base, "_quick_measure", broken)
    result = convert(tiny("llama"), tmp_path / "out", to="mqa", options={"method": "mean"})
    assert result.record["measurements"] is None
    assert "the measurement failed: the text has 0 tokens" in result.record["measurement_skipped"]
    assert (tmp_path / "out" / "model.safetensors").exists()


# -- 2. estimates beside measurements -------------------------------------------------------------

def sized_model(folder: Path) -> Path:
    """Big enough that the conversion's own memory shows beside the interpreter's (~0.4 GB): 6 layers,
    hidden 768, 52M parameters (210 MB in float32)."""
    return make_model(folder, "llama", hidden=768, intermediate=3072, layers=6, heads=12, kv_heads=4, head_dim=64,
                      init_std=0.02)


@pytest.mark.parametrize("args", [
    "--to mqa --method mean",
    "--to mqa --calib-tokens 2048 --refine-steps 2 --eval --eval-tokens 1024",  # the default's refinement, 2 steps
    "--to vq --codebook-size 32 --window 64 --calib-tokens 2048 --calib-seq-len 256 --no-eval",
])
def test_the_memory_estimate_is_within_2x_of_the_measured_peak(tmp_path_factory, args):
    """The dry run's estimate of the process's peak resident set against the peak the same conversion
    measured (effattn.json `resources`, the kernel's high-water mark reset at the start), in a fresh
    process as a user runs it."""
    models = tmp_path_factory.getbasetemp() / "sized"
    src = models if (models / "config.json").exists() else sized_model(models)
    out = tmp_path_factory.mktemp("est") / "out"
    argv = [EFFATTN, "convert", str(src), *shlex.split(args), "-o", str(out)]
    dry = subprocess.run(argv + ["--dry-run", "--json"], capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    estimate = json.loads(dry.stdout)["est_peak_bytes"]
    run = subprocess.run(argv + ["--json"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    res = record(out)["resources"]
    measured = res["measured"]["peak_rss_bytes"]
    assert res["estimated"]["peak_rss_bytes"] > 0 and res["measured"]["seconds"] > 0
    assert 0.5 <= measured / estimate <= 2.0, (args, estimate / 2**20, measured / 2**20)
    # the record keeps the run's own estimate beside the measurement
    assert 0.5 <= res["estimated"]["peak_rss_bytes"] / estimate <= 2.0
    shutil.rmtree(out)  # a module-scoped folder: removed here, not at the session's end


# -- 3. the card ------------------------------------------------------------------------------------

def test_the_reproduce_line_reproduces_the_output(tiny, tmp_path):
    src = tiny("llama")
    out = tmp_path / "first"
    code = subprocess.run([EFFATTN, "convert", str(src), "--to", "mqa", "--calib-tokens", "1024", "--no-eval",
                           "-o", str(out)], capture_output=True, text=True, env=pinned_env())
    assert code.returncode == 0, code.stderr
    line = record(out)["reproduce"]
    card = (out / "README.md").read_text()
    assert line in card and "https://github.com/)" not in card
    argv = shlex.split(line)
    assert argv[:2] == ["effattn", "convert"] and "--calib-tokens" in argv and "--method" in argv  # defaults spelled out
    again = tmp_path / "again"
    argv[argv.index("-o") + 1] = str(again)
    rerun = subprocess.run([EFFATTN, *argv[1:], "--no-eval"], capture_output=True, text=True, env=pinned_env())
    assert rerun.returncode == 0, rerun.stderr
    a, b = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert record(again)["reproduce"].replace(str(again), str(out)) == line


@pytest.mark.parametrize("to", [["--to", "mha"], ["--to", "gqa", "--kv-heads", "6"]], ids=["mha", "gqa-expand"])
def test_an_expansions_reproduce_line_runs(capsys, tiny, tmp_path, to):
    """An expansion (more KV heads) replicates whatever method is asked; the record named the method `replicate`,
    and the reproduce line passed `--method replicate`, which --method refuses (a bug bash)."""
    from .test_cli_errors import run_cli

    src = tiny("llama", heads=6, kv_heads=3)
    out = tmp_path / "first"
    code, _, err = run_cli(capsys, "convert", src, *to, "--no-eval", "-o", out)
    assert code in (0, None), err
    rec = record(out)
    assert rec["conversion"]["method"] == "calibrated" and rec["conversion"]["expansion"].startswith("replicate")
    argv = shlex.split(rec["reproduce"])
    again = tmp_path / "again"
    argv[argv.index("-o") + 1] = str(again)
    code, _, err = run_cli(capsys, *argv[1:], "--no-eval")
    assert code in (0, None), err
    a, b = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_cards_eval_hint_runs_from_the_folders_parent(capsys, tiny, tmp_path, monkeypatch):
    """Converted with relative paths and --no-eval, the card said `effattn eval OUT --baseline SRC` with OUT's name
    (found from the folder's parent) and SRC as typed (found from where the conversion ran): it ran from neither."""
    src = tiny("llama")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "convert", src.relative_to(tmp_path), "--to", "mqa", "--method", "mean",
                           "--no-eval", "-o", "work/out")
    assert code in (0, None), err
    card = (tmp_path / "work" / "out" / "README.md").read_text()
    hint = card.split("from this folder's parent, run `")[1].split("`")[0]
    argv = shlex.split(hint)
    assert argv[:2] == ["effattn", "eval"] and argv[2] == "out"
    monkeypatch.chdir(tmp_path / "work")
    (tmp_path / "text.txt").write_text("A short text to score, said twice. " * 8)
    code, _, err = run_cli(capsys, *argv[1:], "--corpus", str(tmp_path / "text.txt"), "--max-tokens", "64",
                           "--context", "32", "--no-speed")
    assert code in (0, None), err


def test_the_reproduce_line_works_from_any_folder_and_keeps_allow_pickle(capsys, tiny, tmp_path, monkeypatch):
    """The line kept the model as typed (a path relative to where it ran) and dropped --allow-pickle, so it was
    refused when run; base_model named a local path where Hub metadata expects a hub id."""
    from transformers import AutoModelForCausalLM

    src = tiny("llama")
    torch.save(AutoModelForCausalLM.from_pretrained(src).state_dict(), src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    monkeypatch.chdir(src.parent)
    code, _, err = run_cli(capsys, "convert", src.name, "--to", "mqa", "--method", "mean", "--no-eval",
                           "--allow-pickle", "-o", tmp_path / "out")
    assert code == 0, err
    argv = shlex.split(record(tmp_path / "out")["reproduce"])
    assert argv[2] == str(src) and "--allow-pickle" in argv
    assert "base_model" not in (tmp_path / "out" / "README.md").read_text()
    monkeypatch.chdir(tmp_path)
    argv[argv.index("-o") + 1] = str(tmp_path / "again")
    code, _, err = run_cli(capsys, *argv[1:], "--no-eval")
    assert code == 0, err


def test_a_cards_base_model_is_a_hub_id():
    from effattn.io.resolve import ModelRef

    assert ModelRef("llama", Path("/x"), "builtin").hub_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert ModelRef("org/name", Path("/x"), "hub").hub_id == "org/name"
    assert ModelRef("m", Path("/x/m"), "folder").hub_id is None


def test_an_mla_output_is_refused_as_such(capsys, tiny, tmp_path):
    code, _, err = run_cli(capsys, "convert", tiny("llama"), "--to", "mla", "--kv-size", "16", "--refine-steps", "0",
                           "--calib-tokens", "1024", "--no-eval", "-o", tmp_path / "mla")
    assert code == 0, err
    code, _, err = run_cli(capsys, "convert", tmp_path / "mla", "--to", "gqa", "--kv-heads", "1", "-o", tmp_path / "x")
    assert_one_line_error(code, err, "is an MLA model (a latent KV cache)", "convert the model it came from")


def test_a_vq_card_measures_at_long_context_and_states_the_break_even(tiny, tmp_path):
    from effattn.convert import convert

    result = convert(tiny("llama"), tmp_path / "vq", to="vq",
                     options={"codebook_size": 8, "window": 64, "calib_tokens": 1024, "calib_seq_len": 256},
                     measure=True, eval_tokens=2048)
    m = result.measurements
    contexts = [m["settings"]["context"]] + [r["settings"]["context"] for r in m["longer"]]
    assert contexts == [2048, 8192]
    rows = {name: (orig, conv) for name, orig, conv in measurement_rows(m)}
    kv_long = next(v for k, v in rows.items() if k.startswith("KV-cache") and "8,192" in k)
    kv_short = next(v for k, v in rows.items() if k.startswith("KV-cache") and "2,048" in k)
    per_token = lambda s: float(s.replace(",", ""))  # noqa: E731
    # the VQ state is constant: per token it shrinks with length, the original's stays
    assert per_token(kv_long[1]) < per_token(kv_short[1]) / 3
    assert per_token(kv_long[0]) == pytest.approx(per_token(kv_short[0]))
    card = (tmp_path / "vq" / "README.md").read_text()
    assert "break-even" in card and "bytes/token now" not in card
    assert "blocks of 2,048" in card and "blocks of 8,192" in card
    assert "perplexity · shakespeare @ 8,192" in card
    # speed at both lengths for both models, and where the VQ model starts decoding faster
    assert "| decode tokens/s (after 8,192 tokens) |" in card and "| prefill tokens/s (2,048 tokens) |" in card
    assert m["decode_break_even"]["measured"] == [2048, 8192]
    # and what ran the decode steps' linear layers (kernels/gemv where it builds), the same for both models
    assert f"both models' linear layers run by {m['decode_linears']}." in card
    assert "Decode break-even: the converted model decodes" in card and "than the original" in card


def test_chunked_log_probabilities_equal_the_full_ones(tiny):
    from transformers import AutoModelForCausalLM

    from effattn.evaluate import corpus_scores, logp_chunks

    model = AutoModelForCausalLM.from_pretrained(tiny("llama")).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny("llama", seed=1)).eval()
    blocks = torch.randint(0, 258, (3, 300))
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=blocks).logits.float(), -1)
        pieces = torch.cat([lp for _, lp in logp_chunks(model, blocks, chunk=64)], dim=1)
    torch.testing.assert_close(pieces, full, rtol=1e-5, atol=1e-5)
    small = corpus_scores(model, blocks, base)
    assert small["tokens"] == 3 * 299
    assert small["perplexity"] == pytest.approx(torch.exp(-full[:, :-1].gather(-1, blocks[:, 1:, None]).mean()).item(), rel=1e-5)


def test_the_read_estimate_asks_the_page_cache(tmp_path):
    import os

    from effattn.resources import COLD_READ_BYTES_PER_S, DISK_BYTES_PER_S, cached_bytes, read_seconds

    f = tmp_path / "weights.bin"
    f.write_bytes(os.urandom(1 << 20))
    f.read_bytes()
    cached = cached_bytes(f)
    if cached is None:
        pytest.skip("this platform cannot say which pages are cached (mincore)")
    assert cached == 1 << 20
    assert read_seconds([f]) == pytest.approx((1 << 20) / DISK_BYTES_PER_S)
    fd = os.open(f, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    left = cached_bytes(f)
    expected = left / DISK_BYTES_PER_S + ((1 << 20) - left) / COLD_READ_BYTES_PER_S
    assert read_seconds([f]) == pytest.approx(expected)  # whatever the file system let go counts as cold
