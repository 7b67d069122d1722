"""Where effattn keeps what it downloads and converts once (built-in models and corpora)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$EFFATTN_CACHE`, else `$XDG_CACHE_HOME/effattn`, else `~/.cache/effattn`."""
    if os.environ.get("EFFATTN_CACHE"):
        root = Path(os.environ["EFFATTN_CACHE"]).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "effattn"
    root.mkdir(parents=True, exist_ok=True)
    return root
