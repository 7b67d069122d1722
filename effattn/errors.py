"""User-facing errors.

Every problem a user can cause (a missing path, a bad flag, a corrupt file) is raised as an
:class:`EffattnError` whose message says what is wrong and how to fix it, in one line. The CLI
prints that line and exits non-zero; library users catch the exception.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class EffattnError(Exception):
    """A problem with the user's input or environment, explained in one line."""

    exit_code = 2

    def __init__(self, what: str, fix: str | None = None):
        self.what = " ".join(what.split()).rstrip(".")  # one line, whatever a library put in it
        self.fix = fix
        super().__init__(self.message)

    @property
    def message(self) -> str:
        return f"{self.what}. {self.fix}" if self.fix else f"{self.what}."


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest valid choice, or '' when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def one_of(word: str, choices: Iterable[str]) -> str:
    """'valid: a, b, c (did you mean b?)' — the tail of an unknown-name message."""
    choices = sorted(choices)
    return f"valid: {', '.join(choices)}{did_you_mean(word, choices)}"


def clip(text: str, limit: int = 200) -> str:
    """`text` (a library's message) on one line and at most about `limit` characters, never cut inside a word:
    its whole sentences where enough fit, else its words up to the limit and '...'."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    end = text.rfind(". ", 0, limit)
    if end >= limit // 3:  # whole sentences, enough of them
        return text[:end + 1]
    words = text[:limit + 1].rsplit(" ", 1)[0] if " " in text[:limit + 1] else text[:limit]
    return words.rstrip(" ,;:(") + " ..."
