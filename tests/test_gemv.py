"""kernels/gemv: the compiled matrix-vector product of decode steps against PyTorch's linear (its reference),
the cases it leaves to PyTorch, and a model decoding through it."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from effattn.kernels import gemv
from effattn.kernels.gemv import native, naive

from .test_cli_errors import run_cli
from .test_eval import corpus  # noqa: F401 - the fixture

pytestmark = pytest.mark.skipif(not native.built(), reason=f"kernels/gemv does not build here: {native._why_not}")


@pytest.fixture(autouse=True)
def _forced_on(monkeypatch):
    """Used whatever this machine's check found (EFFATTN_GEMV=1); the check has its own test."""
    monkeypatch.setenv("EFFATTN_GEMV", "1")


@pytest.mark.parametrize("n,k", [(1, 1), (7, 13), (33, 64), (200, 577), (1536, 576)])
@pytest.mark.parametrize("lead", [(1,), (1, 1), (2, 1), (8,), (3, 2)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_equals_pytorchs_linear_at_odd_sizes(n, k, lead, bias, dtype):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w, x = torch.randn(n, k, generator=g).to(dtype), torch.randn(*lead, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    want = naive.linear(x, w, b)
    # bfloat16: both sum in float32 and round once; the order of the sums may move the rounding by one step
    tol = dict(rtol=1e-5, atol=1e-5 * k ** 0.5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3 * k ** 0.5)
    with torch.no_grad():
        assert native.applies(x, w, b)
        for threads in (1, 2, 3):
            got = native.linear(x, w, b, threads=threads)
            assert got.shape == want.shape and got.dtype == dtype
            torch.testing.assert_close(got, want, **tol)


def test_bfloat16_rounds_to_nearest_even_and_keeps_nan_and_inf():
    w = torch.tensor([[1.0], [1.0], [1.0], [1.0], [1.0]]).bfloat16()
    # 1 + 2^-8 lies halfway between two bfloat16 numbers (ties to even: 1), 1 + 3 * 2^-8 too (to 1 + 2^-6)
    x_values = [1 + 2**-8, 1 + 3 * 2**-8, float("nan"), float("inf"), -float("inf")]
    with torch.no_grad():
        for value in x_values:
            x = torch.tensor([[1.0]]).bfloat16()
            b = torch.full((5,), value - 1.0).bfloat16() if value == value and abs(value) != float("inf") else None
            xs = x if b is not None else torch.tensor([[value]]).bfloat16()
            got = native.linear(xs, w, b)
            want = F.linear(xs.float(), w.float(), None if b is None else b.float()).bfloat16()
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()]), value


def test_what_it_does_not_compute_goes_to_pytorch_bit_for_bit():
    layer = nn.Linear(24, 40)
    layer.__class__ = gemv.DecodeLinear
    x = torch.randn(1, 24)
    cases = {
        "autograd on": (torch.enable_grad, x, layer.weight),
        "more than MAX_ROWS rows": (torch.no_grad, torch.randn(gemv.MAX_ROWS + 1, 24), layer.weight),
        "float16 (no kernel)": (torch.no_grad, x.half(), layer.weight.half()),
        "an input of another dtype than the weight": (torch.no_grad, x.bfloat16(), layer.weight),
        "a weight that is a transposed view": (torch.no_grad, x, torch.randn(24, 40).t()),
    }
    for why, (mode, xs, weight) in cases.items():
        with mode():
            assert not native.applies(xs, weight, layer.bias.to(weight.dtype)), why
    assert gemv.why_unavailable(torch.float16) == "torch.float16 has no kernel (float32 and bfloat16 do)"
    with torch.enable_grad():
        out = layer(x)
        assert out.requires_grad and torch.equal(out, F.linear(x, layer.weight, layer.bias))
    with torch.no_grad():
        many = torch.randn(gemv.MAX_ROWS + 1, 24)
        assert torch.equal(layer(many), F.linear(many, layer.weight, layer.bias))


CONVERSIONS = {
    "original": None,
    "vq": {"codebook_size": 16, "window": 16, "calib_tokens": 1024, "calib_seq_len": 128},
    "linear": {"window": 8, "calib_tokens": 512, "calib_seq_len": 64, "refine_steps": 2},
    "mla": {"kv_size": 16, "calib_tokens": 512},
}


def count_native_calls(monkeypatch) -> list[int]:
    """native.linear, wrapped to record the rows of each call it computes."""
    calls, linear = [], native.linear

    def counted(x, *args, **kwargs):
        calls.append(x.numel() // x.shape[-1])
        return linear(x, *args, **kwargs)

    monkeypatch.setattr(native, "linear", counted)
    return calls


@pytest.mark.parametrize("to", list(CONVERSIONS))
def test_a_model_decodes_the_same_tokens_through_it_and_gets_its_layers_back(tiny, tmp_path, to, monkeypatch):
    """Greedy decoding past the window (VQ's codes, the linear state) through effattn's own decode steps."""
    import effattn  # noqa: F401 - registers effattn's model classes
    from effattn.convert import convert
    from effattn.io.load import load_model

    src = tiny("llama", layers=2)
    if CONVERSIONS[to] is not None:
        src = convert(src, tmp_path / to, to=to, options=CONVERSIONS[to], measure=False).out
    model = load_model(str(src), tokenizer=False)[0].eval()
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    keys = list(model.state_dict())
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))

    def greedy(steps=12):
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True)
            cache, token, tokens, logits = out.cache, out.logits[:, -1:].argmax(-1), [], []
            for _ in range(steps):
                out = model(input_ids=token, cache=cache, use_cache=True)
                cache, token = out.cache, out.logits[:, -1:].argmax(-1)
                tokens.append(token.item())
                logits.append(out.logits)
        return tokens, torch.cat(logits)

    tokens, logits = greedy()
    calls = count_native_calls(monkeypatch)
    with gemv.decoding(model) as switched:
        assert switched == len(linears) > 0 and all(type(m) is gemv.DecodeLinear for m in linears)
        fast_tokens, fast_logits = greedy()
        assert list(model.state_dict()) == keys
    # the 12 steps' products ran through native.c, one row each; the 40-token prefill's did not. Every linear
    # runs once a step, but MLA's absorbed step reads kv_b_proj's weight itself, without calling the layer.
    absorbed = sum(name.endswith("kv_b_proj") for name, m in model.named_modules() if m in linears)
    assert absorbed == (2 if to == "mla" else 0)
    assert calls == [1] * (12 * (len(linears) - absorbed))
    assert all(type(m) is nn.Linear for m in linears)  # restored
    assert fast_tokens == tokens
    torch.testing.assert_close(fast_logits, logits, rtol=1e-4, atol=1e-4)
    assert gemv.use_for_decoding(model) == len(linears) and type(linears[0]) is gemv.DecodeLinear


def test_eval_records_what_ran_the_decode_steps_and_the_switch_turns_it_off(capsys, tiny, corpus, monkeypatch):  # noqa: F811
    src = tiny("llama", layers=2)
    args = ["eval", src, "--baseline", src, "--corpus", str(corpus), "--context", "64", "--max-tokens", "128", "--json"]
    code, out, _ = run_cli(capsys, *args)
    assert code == 0 and json.loads(out)["decode_linears"].startswith("effattn's matrix-vector product")
    monkeypatch.setenv("EFFATTN_GEMV", "0")
    assert not gemv.available() and gemv.why_unavailable() == "turned off by EFFATTN_GEMV=0"
    code, out, _ = run_cli(capsys, *args)
    assert code == 0 and json.loads(out)["decode_linears"] == "PyTorch's linear (turned off by EFFATTN_GEMV=0)"
    code, out, _ = run_cli(capsys, *args[:-1])
    assert code == 0 and "PyTorch's linear" in out
    code, out, _ = run_cli(capsys, *args[:-1], "--no-speed", "--json")
    assert json.loads(out)["decode_linears"] is None


def test_it_is_used_only_where_it_measured_faster_and_the_measurement_is_kept(tmp_path, monkeypatch):
    monkeypatch.delenv("EFFATTN_GEMV")
    monkeypatch.setenv("EFFATTN_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_checks", {})
    calls = []

    def measured(speeds):
        def measure(threads, dtype):
            calls.append((threads, dtype))
            return speeds
        return measure

    monkeypatch.setattr(native, "measure", measured({"gemv_gb_s": 10.0, "torch_gb_s": 10.5}))
    assert not gemv.available() and "no faster than PyTorch's float32 linear on this machine (10.0 against 10.5 GB/s" \
        in gemv.why_unavailable()
    model = nn.Sequential(nn.Linear(4, 4))
    assert gemv.use_for_decoding(model) == 0 and type(model[0]) is nn.Linear
    assert len(calls) == 1 and len(json.loads((tmp_path / "gemv-check.json").read_text())) == 1
    monkeypatch.setattr(native, "_checks", {})  # a new process reads the kept result instead of measuring
    assert not gemv.available() and len(calls) == 1
    monkeypatch.setenv("EFFATTN_GEMV", "1")
    assert gemv.available()
    monkeypatch.delenv("EFFATTN_GEMV")
    (tmp_path / "gemv-check.json").unlink()
    monkeypatch.setattr(native, "_checks", {})
    monkeypatch.setattr(native, "measure", measured({"gemv_gb_s": 25.7, "torch_gb_s": 10.7}))
    assert gemv.available() and gemv.why_unavailable() == "" and len(calls) == 2


def test_the_check_measures_both_products():
    for dtype in native.DTYPES:
        speeds = native.measure(1, dtype, rows=4096, cols=64, repeats=1)
        assert set(speeds) == {"gemv_gb_s", "torch_gb_s"} and all(v > 0 for v in speeds.values())


def test_a_bfloat16_model_decodes_through_it_within_bfloat16s_rounding(tiny, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny("llama", layers=2), dtype=torch.bfloat16).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        prefix = model(input_ids=ids[:, :-1], use_cache=True)
        step = lambda: model(input_ids=ids[:, -1:], cache=copy.deepcopy(prefix.cache), use_cache=True).logits  # noqa: E731
        plain = step()
        calls = count_native_calls(monkeypatch)
        with gemv.decoding(model) as switched:
            assert switched > 0
            fast = step()
        assert calls == [1] * switched
    assert fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), plain.float(), rtol=3e-2, atol=3e-2)


def test_without_a_compiler_every_product_is_pytorchs_and_the_record_says_why(monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("cc failed to build native.c: fatal error: omp.h: No such file\ncompilation terminated.")

    monkeypatch.setattr(native, "load_library", no_compiler)
    monkeypatch.setattr(native, "_lib", None)  # both restored after the test: the library loads as before
    monkeypatch.setattr(native, "_why_not", "")
    assert not native.built() and not gemv.available(torch.float32) and not gemv.available(torch.bfloat16)
    assert gemv.why_unavailable() == "cc failed to build native.c: fatal error: omp.h: No such file"
    model = nn.Sequential(nn.Linear(4, 4))
    with gemv.decoding(model) as switched:
        assert switched == 0 and type(model[0]) is nn.Linear
    assert gemv.describe(switched) == "PyTorch's linear (cc failed to build native.c: fatal error: omp.h: No such file)"
