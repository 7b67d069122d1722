"""Encyclopedic prose for training: English Wikipedia articles as plain text.

The articles come from a real (shortened) English Wikipedia dump that gensim ships as test data in
its source distribution on PyPI: about a hundred articles from the start of the alphabet (Anarchism,
Aristotle, Albert Einstein, Alabama, ...), about 2.8 million characters once the markup is gone.
Wikipedia text is licensed CC BY-SA.

The markup goes through `mwparserfromhell`: references, files, categories, tables and templates are
dropped, links keep their text, and the trailing sections that are lists rather than prose (See also,
References, External links, ...) are cut. Any paragraph that shares a run of 13 words with an
evaluation corpus is dropped too (the GPT-3 decontamination rule), so training on `wiki` never shows
the model a passage it is evaluated on.
"""

from __future__ import annotations

import bz2
import hashlib
import re
import tarfile
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from pathlib import Path

GENSIM_SDIST = ("gensim", "4.4.0", "gensim-4.4.0.tar.gz",
                "a3f5b626da5518e79a479140361c663089fe7998df8ba52d56e1ded71ac5bdf5")
DUMP_MEMBER = "gensim-4.4.0/gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"

# Sections that hold lists and citations, not prose: everything from the first of them on is cut.
TAIL_SECTIONS = {"see also", "references", "notes", "external links", "further reading", "bibliography",
                 "sources", "footnotes", "citations", "notes and references", "works cited"}
NGRAM = 13
LEFTOVER_MARKUP = ("[[", "]]", "{{", "}}", "<ref", "</ref")


def cache_key(held_out: Iterable[str]) -> str:
    """A fingerprint of everything the extracted text depends on: this module's code, the parser's
    version and the held-out texts. The cached text is named after it, so a changed extraction (even an
    uncommitted one) or a changed evaluation corpus never reads a stale cache."""
    import mwparserfromhell

    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(mwparserfromhell.__version__.encode())
    for text in held_out:
        digest.update(hashlib.sha256(text.encode("utf-8")).digest())
    return digest.hexdigest()[:12]


def dump_xml(archive: Path) -> bytes:
    """The XML dump inside the gensim sdist, decompressed."""
    with tarfile.open(archive) as tar:
        member = tar.extractfile(DUMP_MEMBER)
        if member is None:
            raise FileNotFoundError(f"{DUMP_MEMBER} is not a file in {archive.name}")
        return bz2.decompress(member.read())


def articles(xml: bytes) -> list[tuple[str, str]]:
    """(title, plain text) of every article of a MediaWiki XML export: no redirects, talk pages or
    disambiguation pages, and nothing left too short to be prose."""
    root = ET.fromstring(xml)
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    out = []
    for page in root.iter(f"{ns}page"):
        title = page.findtext(f"{ns}title") or ""
        if page.findtext(f"{ns}ns", "0") != "0" or page.find(f"{ns}redirect") is not None:
            continue
        if title.endswith("(disambiguation)"):
            continue
        source = page.findtext(f"{ns}revision/{ns}text") or ""
        if source.lstrip().lower().startswith("#redirect"):
            continue
        text = plain_text(source)
        if len(text) >= 1000:
            out.append((title, text))
    return out


def plain_text(wikitext: str) -> str:
    """The prose of one article's wikitext."""
    import mwparserfromhell
    from mwparserfromhell.nodes import Heading

    # references first, by pattern: the parser leaves a malformed <ref> as text, citation and all
    wikitext = re.sub(r"<ref[^>/]*/>|<ref[^>]*>.*?</ref>", "", wikitext, flags=re.DOTALL | re.IGNORECASE)
    code = mwparserfromhell.parse(wikitext)
    for i, node in enumerate(code.nodes):  # sections are top-level nodes: cut from the first list-only one
        if isinstance(node, Heading) and node.title.strip_code().strip().lower() in TAIL_SECTIONS:
            del code.nodes[i:]
            break
    for tag in code.filter_tags(recursive=True, matches=lambda n: str(n.tag).lower() in {"ref", "table", "gallery", "math"}):
        _remove(code, tag)
    for link in code.filter_wikilinks():
        if str(link.title).strip().lower().split(":")[0] in {"file", "image", "category", "media"}:
            _remove(code, link)
    text = code.strip_code(normalize=True, collapse=True, keep_template_params=False)
    lines = [line.strip() for line in text.splitlines()]
    # table rows, and lines with markup the parser left as text (a malformed file link, say)
    lines = [line for line in lines if not line.startswith(("{|", "|", "!")) and not any(m in line for m in LEFTOVER_MARKUP)]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _remove(code, node) -> None:
    try:
        code.remove(node)
    except ValueError:  # already gone with a removed parent
        pass


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _ngrams(words: list[str], n: int = NGRAM) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def held_out_ngrams(texts: Iterable[str], n: int = NGRAM) -> set[tuple[str, ...]]:
    """Every run of `n` words (lower-cased, punctuation ignored) in the held-out texts."""
    banned: set[tuple[str, ...]] = set()
    for text in texts:
        banned |= _ngrams(_words(text), n)
    return banned


def decontaminate(paragraphs: Iterable[str], banned: set[tuple[str, ...]], n: int = NGRAM) -> tuple[list[str], int]:
    """Drop every paragraph sharing a run of `n` words with the held-out n-grams: (kept, dropped count)."""
    kept, dropped = [], 0
    for para in paragraphs:
        if _ngrams(_words(para), n) & banned:
            dropped += 1
        else:
            kept.append(para)
    return kept, dropped


def wiki_text(xml: bytes, held_out: Iterable[str]) -> str:
    """All articles as one text, "Title" then its paragraphs, decontaminated against `held_out`."""
    banned = held_out_ngrams(held_out)
    docs = []
    for title, text in articles(xml):
        paragraphs, _ = decontaminate(text.split("\n\n"), banned)
        if paragraphs:
            docs.append(title + "\n\n" + "\n\n".join(paragraphs))
    return "\n\n\n".join(docs)
