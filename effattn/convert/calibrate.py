"""Calibration shared by every calibrated conversion: the text, its token blocks, batching, and the
o_proj least-squares refit of the calibrated GQA method.

Calibration text runs through the model one decoder layer at a time (layers.py): a layer is fitted
on the activations the already-converted layers below produce. The calibration corpus is kept apart
from every evaluation corpus (data/corpora.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..attention.functional import attention_heads, output_projection
from ..data.corpora import CORPORA, DEFAULT_CALIB, corpus_names, leading_tokens, load_texts, text_sources, token_blocks
from ..errors import EffattnError
from ..families import AttentionShape

if TYPE_CHECKING:
    from .gqa import LayerAttention


@dataclass(frozen=True)
class CalibSettings:
    corpus: str = DEFAULT_CALIB
    tokens: int = 16384
    seq_len: int = 512
    batch_size: int = 4
    # o_proj refit: λ relative to the mean diagonal of OᵀO, pulling towards the PCA solution. Chosen on
    # held-out text: 0.1 generalises better than 0.01 or 0.001 (less overfitting of the calibration set).
    ridge: float = 0.1
    text_chars: int = 0  # the calibration text's length, once validated (memory estimate of tokenizing it)
    # The context the sequences' positions spread over (`starts`): 0 (or at most seq_len) reads every sequence
    # at positions 0..seq_len-1. The original attention does not depend on where a sequence starts (RoPE is
    # relative); a conversion whose new parameters see rotated queries and keys (linear attention's feature
    # maps) does, and learns only the rotations of the positions it is fitted at.
    positions: int = 0

    def validate(self, folder=None, without: str = "") -> CalibSettings:
        """Check everything the calibration will need before any work: the text (not an evaluation
        corpus, not empty) and, given the model's folder, its tokenizer and that the text holds the
        tokens asked for. Returns the settings as they will be used: `tokens` rounded down to whole
        sequences, `text_chars` for the memory estimate. `without`: how the conversion runs without
        calibration, where it can (named in the refusal of a folder with no tokenizer)."""
        for source in text_sources(self.corpus):
            if source in CORPORA and CORPORA[source].role == "eval":
                raise EffattnError(f"--calib {source} is an evaluation corpus, held out from calibration and training",
                                   f"calibrate on {', '.join(corpus_names('train'))} or your own text")
        if self.tokens < self.seq_len:
            raise EffattnError(f"--calib-tokens ({self.tokens}) must be at least one sequence ({self.seq_len} tokens)",
                               f"use --calib-tokens {self.seq_len} or more")
        text = load_texts(self.corpus)
        if not text.strip():
            raise EffattnError(f"calibration text {self.corpus} is empty", "point --calib to a text with content")
        used = self.tokens // self.seq_len * self.seq_len
        if folder is not None:
            from ..io.checkpoint import read_config
            from ..io.load import check_tokenizer_fits, tokenizer_missing

            why = tokenizer_missing(folder)
            if why:
                raise EffattnError(f"calibration needs the model's tokenizer: {why}",
                                   "copy the tokenizer files of the model it came from into it" +
                                   (f", or {without}" if without else ""))
            tokenizer = _tokenizer(folder)
            check_tokenizer_fits(tokenizer, [("the model", read_config(Path(folder)))],
                                 "copy the tokenizer files of the model it came from into its folder")
            held = len(leading_tokens(tokenizer, text, used))
            whole = held // self.seq_len * self.seq_len
            if whole < used:
                raise EffattnError(f"--calib-tokens {self.tokens:,} is more than {self.corpus!r} holds ({held:,} tokens, "
                                   f"{whole:,} in whole sequences of {self.seq_len})",
                                   f"use --calib-tokens {whole} or less, or a longer --calib text" if whole else
                                   f"use a --calib text of at least {self.seq_len} tokens (one calibration sequence)")
        return replace(self, tokens=used, text_chars=len(text))

    def tokenize_bytes(self) -> int:
        """Peak memory of tokenizing the calibration text (a prefix of ~6 characters per token is read)."""
        from ..resources import TOKENIZE_BYTES_PER_CHAR

        return min(self.text_chars, 12 * self.tokens) * TOKENIZE_BYTES_PER_CHAR


# The `--calib` option's help, shared by every calibrated conversion (each may add what it calibrates).
CALIB_HELP = "calibration text: a corpus name or a text file, or several joined by commas (interleaved block by block)"


def _tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def calibration_tokens(folder, settings: CalibSettings) -> torch.Tensor:
    return token_blocks(_tokenizer(folder), load_texts(settings.corpus), settings.seq_len, settings.tokens)


def starts(settings: CalibSettings, rows: int) -> torch.Tensor:
    """The first position of each of `rows` calibration sequences: evenly spread so that the first starts at 0
    and the last ends at `settings.positions` (all 0 when that is no longer than a sequence, or for one row)."""
    room = settings.positions - settings.seq_len
    if room <= 0 or rows == 1:
        return torch.zeros(rows, dtype=torch.long)
    return torch.linspace(0, room, rows).round().long()


def rows_of(rope: tuple[torch.Tensor, torch.Tensor], rows) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables (cos, sin) of the sequences `rows` (a slice or an index): tables of one row [1, T, d] serve
    every sequence; per-sequence tables [N, T, d] (`CalibSettings.positions`) are indexed."""
    cos, sin = rope
    return (cos, sin) if cos.shape[0] == 1 else (cos[rows], sin[rows])


def batches(x: torch.Tensor, size: int):
    """Slices of size `size` over the first dimension of x."""
    for i in range(0, x.shape[0], size):
        yield slice(i, i + size)


def refit_o_proj(new: LayerAttention, old: LayerAttention, h: torch.Tensor, cos, sin,
                 shape: AttentionShape, eps: float, settings: CalibSettings) -> torch.Tensor:
    """Ridge least squares for o_proj: argmin_W Σ_t ‖y_t − W o'_t‖² + λ‖W − W₀‖².

    o'_t are the converted attention's per-head outputs (all heads concatenated), y_t the original
    attention's output (o_proj applied, bias removed) on the same inputs h, W₀ the PCA solution.
    """
    d, D = shape.head_dim, new.o.shape[0]
    gram = torch.zeros(shape.heads * d, shape.heads * d, dtype=torch.float64)
    cross = torch.zeros(shape.heads * d, D, dtype=torch.float64)
    for sl in batches(h, settings.batch_size):
        o_new = attention_heads(h[sl], new, cos, sin, d, eps).flatten(2).flatten(0, 1)  # (S, H*d)
        heads = attention_heads(h[sl], old, cos, sin, d, eps)
        y = (output_projection(heads, old) - (0 if old.o_bias is None else old.o_bias)).flatten(0, 1)  # (S, D)
        gram += (o_new.T @ o_new).double()  # per-batch products in float32, accumulated in float64
        cross += (o_new.T @ y).double()
    return ridge_solve(gram, cross, new.o.double().T, settings.ridge).T.to(new.o.dtype)  # (D, H*d)


def ridge_solve(gram: torch.Tensor, cross: torch.Tensor, w0: torch.Tensor, ridge: float) -> torch.Tensor:
    """argmin_W ‖Y − X W‖² + λ‖W − W₀‖² from XᵀX (`gram`) and XᵀY (`cross`), λ = `ridge` times the mean
    diagonal of XᵀX (float64)."""
    lam = ridge * gram.diagonal().mean().clamp_min(1e-12)
    eye = torch.eye(gram.shape[0], dtype=torch.float64)
    return torch.linalg.solve(gram + lam * eye, cross + lam * w0)
