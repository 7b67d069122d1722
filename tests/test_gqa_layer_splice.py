"""benchmarks/gqa_layer_splice.py: a converted model's attention, its KV heads expanded, fits the original's shape
and gives the converted model's logits; the original's weights come back exactly."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from effattn.convert import convert

_spec = importlib.util.spec_from_file_location("gqa_layer_splice",
                                               Path(__file__).parents[1] / "benchmarks" / "gqa_layer_splice.py")
gqa_layer_splice = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gqa_layer_splice)

IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("heads,old_kv,new_kv", [(6, 3, 1), (8, 4, 2)])
def test_spliced_layers_give_the_converted_and_the_original_logits(tiny, tmp_path, heads, old_kv, new_kv):
    src = tiny("llama", heads=heads, kv_heads=old_kv)
    out = convert(src, tmp_path / "gqa", to="gqa", options={"kv_heads": new_kv, "method": "mean"}, measure=False).out
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64).eval()
    conv = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    original = gqa_layer_splice.attention_weights(ref)
    converted = gqa_layer_splice.attention_weights(conv, old_kv)
    want_ref, want_conv = _logits(ref), _logits(conv)
    layers = set(range(len(ref.model.layers)))
    gqa_layer_splice.splice(ref, original, converted, layers)
    assert torch.allclose(_logits(ref), want_conv, atol=1e-10, rtol=0)
    gqa_layer_splice.splice(ref, original, converted, {0})
    one = _logits(ref)
    gqa_layer_splice.splice(ref, original, converted, set())
    assert (one - want_ref).abs().max() > 1e-3 and (one - want_conv).abs().max() > 1e-3
    assert torch.equal(_logits(ref), want_ref)
