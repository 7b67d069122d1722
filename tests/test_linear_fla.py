"""The far part of the hybrid attention through flash-linear-attention (fla-core), effattn's path on CUDA.

Without a GPU, fla's Triton kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, in a process of
its own: the flag must be set before triton is imported). There fla's `fused_recurrent_linear_attn`, which
has the signature and the maths of the `chunk_linear_attn` that CUDA runs, stands in for it, so the test
holds effattn's side (delayed keys, the column of ones, the state as fla's initial and final state) to
the naive reference: outputs, gradients, and a sequence continued across two calls; and that fla
runs only on CUDA, unless EFFATTN_FLA=0. On a machine with
CUDA, the chunked kernel itself is compared too.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from effattn.kernels.linear import chunk, hybrid_attention_chunk, hybrid_attention_naive

# `make setup` installs fla-core and triton apart from the venv (Makefile: FLA_SITE), and only the test's
# own processes import them: with triton importable, torch.compile's CPU path in the same process slows
# down threefold. An environment with `pip install effattn[fla]` has them importable anyway.
FLA_SITE = Path(os.environ.get("EFFATTN_FLA_SITE", Path(sys.prefix) / "fla-site"))
SEARCH = [str(FLA_SITE), *sys.path]
if not all(importlib.machinery.PathFinder.find_spec(name, SEARCH) for name in ("fla", "triton")):
    pytest.skip("fla-core or triton is not installed (make setup, or pip install effattn[fla])", allow_module_level=True)

SCRIPT = r"""
import json, os, warnings
warnings.filterwarnings("ignore")
import torch
import triton.runtime.autotuner as autotuner
# the interpreter has no device to time configurations on: take the first of each autotuned kernel
autotuner.Autotuner.do_bench = property(lambda self: lambda fn, quantiles=None: [1.0] * 3 if quantiles else 1.0)
from fla.ops.linear_attn import chunk_linear_attn, fused_recurrent_linear_attn
from effattn.kernels.linear import chunk, hybrid_attention_chunk, hybrid_attention_naive

# where fla runs: CUDA only, and EFFATTN_FLA=0 turns it off
assert chunk.fla_kernel(torch.device("cpu")) is None
assert chunk.fla_kernel(torch.device("cuda")) is chunk_linear_attn
os.environ["EFFATTN_FLA"] = "0"
assert chunk.fla_kernel(torch.device("cuda")) is None
del os.environ["EFFATTN_FLA"]

calls = []
def kernel(*args, **kwargs):
    calls.append(1)
    return fused_recurrent_linear_attn(*args, **kwargs)
chunk.fla_kernel = lambda device: kernel

g = torch.Generator().manual_seed(0)
B, T, H, D, Dv, F = 2, 23, 3, 8, 5, 6
rows = []
for window, sinks in ((0, 0), (1, 0), (7, 0), (30, 0), (7, 3)):
    leaves = [torch.randn(B, T, H, d, generator=g, requires_grad=True) for d in (D, D, Dv)]
    leaves += [torch.rand(B, T, H, F, generator=g, requires_grad=True) for _ in range(2)]
    kw = dict(window=window, window_factor=torch.rand(H, generator=g) + 0.5,
              linear_factor=torch.rand(H, generator=g) + 0.5, scale=D ** -0.5, sinks=sinks)
    ref = hybrid_attention_naive(*leaves, **kw)
    n = len(calls)
    out = hybrid_attention_chunk(*leaves, **kw, chunk_size=5)
    used = len(calls) > n
    go = torch.randn(ref.shape, generator=g)
    grads = [torch.autograd.grad((x * go).sum(), leaves, allow_unused=True) for x in (ref, out)]
    grad_err = max(0.0 if a is None and b is None else
                   ((a if a is not None else 0) - (b if b is not None else 0)).abs().max().item()
                   for a, b in zip(*grads))
    with torch.no_grad():
        first, state = hybrid_attention_chunk(*(x[:, :9] for x in leaves), **kw, return_state=True)
        rest = hybrid_attention_chunk(*(x[:, 9:] for x in leaves), **kw, state=state)
    rows.append(dict(window=window, sinks=sinks, used=used, out=(out - ref).abs().max().item(), grad=grad_err,
                     pieces=(torch.cat((first, rest), 1) - ref).abs().max().item()))
print(json.dumps(rows))
"""


def test_the_far_part_through_fla_equals_the_reference_in_the_interpreter():
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(FLA_SITE) if FLA_SITE.is_dir() else None) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    for row in rows:
        # window 30 covers all 23 positions: no key is far, and fla is not called
        assert row["used"] == (row["window"] < 23), row
        assert row["out"] < 1e-5 and row["grad"] < 1e-5 and row["pieces"] < 1e-5, row


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: fla's chunked kernel itself")
@pytest.mark.parametrize("window, sinks", [(0, 0), (64, 0), (64, 4)])
def test_the_chunked_fla_kernel_on_cuda_equals_the_reference(window, sinks, monkeypatch):
    monkeypatch.syspath_prepend(str(FLA_SITE))
    assert chunk.fla_kernel(torch.device("cuda")) is not None
    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, D, F = 2, 300, 4, 64, 128
    leaves = [torch.randn(B, T, H, D, generator=g, device="cuda", requires_grad=True) for _ in range(3)]
    leaves += [torch.rand(B, T, H, F, generator=g, device="cuda", requires_grad=True) / F for _ in range(2)]
    kw = dict(window=window, window_factor=0.3, linear_factor=0.7, scale=D**-0.5, sinks=sinks)
    ref = hybrid_attention_naive(*leaves, **kw)
    out = hybrid_attention_chunk(*leaves, **kw)
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
    go = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad((ref * go).sum(), leaves, allow_unused=True),
                    torch.autograd.grad((out * go).sum(), leaves, allow_unused=True)):  # fmt: skip
        if a is not None and b is not None:
            torch.testing.assert_close(b, a, rtol=5e-3, atol=5e-3)
