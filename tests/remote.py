"""Load an effattn model folder the way a user without effattn does: transformers with
trust_remote_code=True, in a fresh interpreter where importing effattn fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

GUARD = """
real = builtins.__import__
def guarded(name, *args, **kwargs):
    if name == "effattn" or name.startswith("effattn."):
        raise ImportError("effattn must not be needed")
    return real(name, *args, **kwargs)
builtins.__import__ = guarded
"""

SCRIPT = """
import builtins, sys, torch
{guard}
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({folder!r}, trust_remote_code=True, dtype=torch.{dtype}).eval()
assert type(model).__name__ == {cls!r} and type(model).__module__.startswith("transformers_modules"), type(model)
assert {guarded} == ("effattn" not in sys.modules)
ids, prefix = torch.tensor({ids!r}), {prefix!r}
with torch.no_grad():
    if prefix is None:
        torch.save(model(input_ids=ids, use_cache=False).logits, {out!r})
    else:  # prefill `prefix` tokens through the model's cache, then decode the rest one token per call
        step = model(input_ids=ids[:, :prefix], use_cache=True)
        own = lambda out: out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        steps, cache = [step.logits], own(step)
        for t in range(prefix, ids.shape[1]):
            step = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(step.logits)
            cache = own(step)
        torch.save(torch.cat(steps, 1), {out!r})
"""


def remote_logits(folder: Path, ids: torch.Tensor, cls: str, tmp_path: Path, prefix: int | None = None, *,
                  guarded: bool = True, dtype: str = "float64") -> torch.Tensor:
    """Logits of `folder` for `ids`, loaded through its bundled code alone (asserting the class); with
    `prefix`, the first `prefix` tokens are prefilled through the cache and the rest decoded one per call.
    guarded: importing effattn fails, as where it is not installed (else the bundled code may import it, as it
    does where it is, for its compiled kernels)."""
    out = Path(tmp_path) / "remote.pt"
    script = SCRIPT.format(folder=str(folder), cls=cls, ids=ids.tolist(), out=str(out), prefix=prefix,
                           guard=GUARD if guarded else "", guarded=guarded, dtype=dtype)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.load(out)
