"""Text data: built-in corpora (calibration, training, evaluation) and user text files."""

from .corpora import CORPORA, corpus_names, load_text, token_blocks

__all__ = ["CORPORA", "corpus_names", "load_text", "token_blocks"]
