"""Load an effattn model folder the way a user without effattn does: transformers with
trust_remote_code=True, in a fresh interpreter where importing effattn fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = """
import builtins, sys, torch
real = builtins.__import__
def guarded(name, *args, **kwargs):
    if name == "effattn" or name.startswith("effattn."):
        raise ImportError("effattn must not be needed")
    return real(name, *args, **kwargs)
builtins.__import__ = guarded
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({folder!r}, trust_remote_code=True, dtype=torch.float64).eval()
assert "effattn" not in sys.modules and type(model).__name__ == {cls!r}, type(model).__name__
with torch.no_grad():
    torch.save(model(input_ids=torch.tensor({ids!r}), use_cache=False).logits, {out!r})
"""


def remote_logits(folder: Path, ids: torch.Tensor, cls: str, tmp_path: Path) -> torch.Tensor:
    """float64 logits of `folder` for `ids`, loaded through its bundled code alone (asserting the class)."""
    out = Path(tmp_path) / "remote.pt"
    script = SCRIPT.format(folder=str(folder), cls=cls, ids=ids.tolist(), out=str(out))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.load(out)
