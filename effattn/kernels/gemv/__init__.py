"""Matrix-vector products for decoding on the CPU (native.c), and the switch that puts them in a model.

``use_for_decoding(model)`` turns every ``nn.Linear`` of a model into a ``DecodeLinear``: the same
module, state dict and output, whose forward takes native.c's product for inputs of at most
``MAX_ROWS`` rows (a decode step) of float32 or bfloat16 CPU tensors outside autograd, and ``F.linear``
otherwise (prefill, training, other dtypes); layers on a GPU are not switched. `effattn eval` puts it in both models it times, so their
speeds stay comparable. It is used only where it measured faster than PyTorch's linear (native.py);
``EFFATTN_GEMV=0`` leaves PyTorch's linear everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import native
from .native import MAX_ROWS, available, why_unavailable

__all__ = ["DecodeLinear", "MAX_ROWS", "available", "decoding", "describe", "use_for_decoding", "why_unavailable"]


class DecodeLinear(nn.Linear):
    """An ``nn.Linear`` whose few-row products, outside autograd, run through native.c."""

    def forward(self, x: Tensor) -> Tensor:
        if native.applies(x, self.weight, self.bias):
            return native.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def _switchable(model: nn.Module) -> list[nn.Linear]:
    """The plain ``nn.Linear``s of `model` on the CPU whose weight dtype the compiled product is used for
    here (``available``: decided now, for as long as they stay switched)."""
    used: dict[torch.dtype, bool] = {}
    found = []
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu":
            dtype = module.weight.dtype
            if dtype not in used:
                used[dtype] = available(dtype)
            if used[dtype]:
                found.append(module)
    return found


def use_for_decoding(model: nn.Module) -> int:
    """Switch every plain ``nn.Linear`` in `model` to ``DecodeLinear`` (in place); returns how many were
    switched: 0 where the compiled product is not used for the model's dtype (``why_unavailable`` says
    why) or the model holds none. Subclasses of ``nn.Linear`` (quantized or adapter layers) are left as
    they are."""
    switched = _switchable(model)
    for module in switched:
        module.__class__ = DecodeLinear
    return len(switched)


@contextmanager
def decoding(model: nn.Module) -> Iterator[int]:
    """``use_for_decoding`` for the duration of a block, then the model's plain ``nn.Linear``s back;
    yields how many were switched."""
    switched = _switchable(model)
    for module in switched:
        module.__class__ = DecodeLinear
    try:
        yield len(switched)
    finally:
        for module in switched:
            module.__class__ = nn.Linear


def describe(switched: int, dtype: torch.dtype = torch.float32) -> str:
    """One line for a record: what ran a decode step's linear layers (`switched`: how many ``decoding``
    switched in a model of `dtype`)."""
    if switched:
        return f"effattn's matrix-vector product (kernels/gemv, {torch.get_num_threads()} threads)"
    why = why_unavailable(dtype)
    return "PyTorch's linear" + (f" ({why})" if why else "")
