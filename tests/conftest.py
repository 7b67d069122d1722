"""Fixtures: tiny random models of every family (built here, no downloads) and the real SmolLM2."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("MKL_DYNAMIC", "FALSE")  # as effattn sets it, before torch loads MKL (subprocesses inherit it)
# MKL's reproducibility mode for every test process; the exact cross-process comparisons also run
# pinned to one thread (tests/exact.py), which this alone did not make reliable on an Intel CI machine.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import pytest  # noqa: E402
import torch  # noqa: E402

from effattn.testing import FAMILY_CONFIGS, byte_tokenizer, make_model

__all__ = ["FAMILY_CONFIGS", "byte_tokenizer", "make_model", "logits_of"]

@pytest.fixture
def tiny(tmp_path):
    """Factory: tiny(family="llama", **kw) -> folder of a tiny random model."""
    counter = iter(range(1000))

    def factory(family: str = "llama", **kw) -> Path:
        return make_model(tmp_path / f"{family}-{next(counter)}", family, **kw)

    return factory


def logits_of(folder: Path, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits of a saved model. Exactness checks pass float64: the maths is exact there, while fp32
    results depend on how the attention kernel groups its sums (GQA vs MHA layouts differ)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="session")
def smollm2_path():
    """The real SmolLM2-135M-Instruct, fetched and converted once (cached in EFFATTN_CACHE)."""
    from effattn.io.resolve import resolve_model

    return resolve_model("llama").path


@pytest.fixture(autouse=True)
def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
