"""Training text as token blocks in a seeded order that any process can resume at any position.

Sources (recipe `data.sources`):
  * a built-in training corpus (`mix`, `plays`, `poems`, `docs`, `code`, `wiki`);
  * a UTF-8 text file, or a folder of `.txt` files;
  * a `.jsonl` file, one JSON object per line, the text under `data.text_key`;
  * `hf:ORG/NAME[/CONFIG][:SPLIT]`, a Hugging Face Hub dataset (needs the optional `datasets` library),
    e.g. hf:Salesforce/wikitext/wikitext-103-raw-v1:train.

Everything is tokenized once at the start; documents are joined with the EOS token and cut into
blocks of `seq_len` tokens. The order is an endless stream: sample k is block `perm_e[k mod N]` of
epoch e = k // N, where perm_e is a permutation drawn from (seed, e). Micro-batches are slices of
that stream, so the data position is one number, the samples consumed so far, and process r of W
takes the r-th of W consecutive slices (every process sees different data). With `data.positions`, each
micro-batch is read at positions from `block_start(first sample)` on instead of from 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..data.corpora import CORPORA, corpus_names, load_text
from ..errors import EffattnError, clip


def _source_key(source: str) -> str:
    """What two spellings of one source have in common (built-in name, absolute path, hub id)."""
    if source in CORPORA or source.startswith("hf:"):
        return source
    return str(Path(source).expanduser().absolute())


def check_disjoint(train_sources: list[str], eval_corpora: list[str]) -> None:
    """Training and evaluation text must not overlap: held-out corpora stay held out."""
    for source in train_sources:
        if source in CORPORA and CORPORA[source].role == "eval":
            raise EffattnError(f"data.sources: {source!r} is an evaluation corpus, held out from training",
                               f"train on {', '.join(corpus_names('train'))} or your own text")
    for corpus in eval_corpora:
        if corpus in CORPORA and CORPORA[corpus].role != "eval":
            raise EffattnError(f"eval.corpora: {corpus!r} is a training corpus, not held-out text",
                               f"evaluate on {', '.join(corpus_names('eval'))} or your own held-out file")
    shared = {_source_key(s) for s in train_sources} & {_source_key(c) for c in eval_corpora}
    if shared:
        raise EffattnError(f"{', '.join(sorted(shared))} is both in data.sources and eval.corpora",
                           "evaluate on text the model is not trained on")


def check_source(source: str) -> None:
    """Fail early (before loading any model) on a source that cannot be read."""
    if source.startswith("hf:"):
        _need_datasets(source)
    elif source not in CORPORA and not Path(source).expanduser().exists():
        raise EffattnError(f"data source {source!r} is neither a built-in corpus nor an existing file",
                           f"built-in training corpora: {', '.join(corpus_names('train'))}; or a .txt/.jsonl file, "
                           "a folder of .txt files, or hf:ORG/NAME")


def _need_datasets(source: str):
    try:
        import datasets
    except ImportError:
        raise EffattnError(f"data source {source!r} needs the `datasets` library, which is not installed",
                           "pip install datasets, or export the text to a .jsonl file") from None
    return datasets


def _jsonl_texts(path: Path, key: str) -> list[str]:
    texts = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise EffattnError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                           "convert it to UTF-8 (JSON Lines files are UTF-8)") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EffattnError(f"{path} line {n} is not JSON ({exc.msg})", "write one JSON object per line") from None
        if not isinstance(row, dict) or key not in row:
            found = ", ".join(row) if isinstance(row, dict) else type(row).__name__
            raise EffattnError(f"{path} line {n} has no text field {key!r} (found: {found})",
                               "set data.text_key to the field that holds the text")
        if not isinstance(row[key], str):
            raise EffattnError(f"{path} line {n}: field {key!r} holds {type(row[key]).__name__}, not text",
                               "write the text as a JSON string, or set data.text_key to the field that holds it")
        texts.append(row[key])
    if not texts:
        raise EffattnError(f"{path} holds no records", "write one JSON object per line")
    return texts


def _hub_texts(source: str, key: str) -> list[str]:
    datasets = _need_datasets(source)
    path, _, split = source.removeprefix("hf:").partition(":")
    parts = path.split("/")  # ORG/NAME[/CONFIG]
    name, config = "/".join(parts[:2]), "/".join(parts[2:]) or None
    try:
        ds = datasets.load_dataset(name, config, split=split or "train")
    except Exception as exc:  # noqa: BLE001 - network, missing dataset, bad split: one line
        raise EffattnError(f"could not load the hub dataset {name!r} ({type(exc).__name__}: {clip(exc, 160)})",
                           "check the name, split and network, or export the text to a .jsonl file") from None
    if key not in ds.column_names:
        raise EffattnError(f"hub dataset {name!r} has no column {key!r} (columns: {', '.join(ds.column_names)})",
                           "set data.text_key to the column that holds the text")
    return [t for t in ds[key] if t]


def source_texts(source: str, text_key: str = "text") -> list[str]:
    """The documents of one source."""
    check_source(source)
    if source.startswith("hf:"):
        return _hub_texts(source, text_key)
    path = Path(source).expanduser()
    if source not in CORPORA and path.suffix == ".jsonl":
        documents = _jsonl_texts(path, text_key)
    else:
        documents = [load_text(source)]
    documents = [d for d in documents if d.strip()]  # an empty document would add an EOS token and no text
    if not documents:
        raise EffattnError(f"data source {source!r} holds no text (empty, or whitespace only)",
                           "point data.sources at a file with text")
    return documents


def read_sources(sources: list[str], text_key: str = "text") -> dict[str, list[str]]:
    """source -> its documents; read before any model is loaded, so bad data fails fast."""
    return {source: source_texts(source, text_key) for source in sources}


def training_blocks(tokenizer, texts: dict[str, list[str]], seq_len: int, bos: float = 0.0) -> torch.Tensor:
    """All training text as blocks: LongTensor [N, seq_len] (each source cut separately, then stacked). With
    `bos` > 0, that share of the blocks, spread evenly (block i where floor((i + 1) * bos) > floor(i * bos)),
    starts with the prefix token of `effattn eval --bos` followed by the block's first seq_len - 1 tokens."""
    eos = tokenizer.eos_token_id
    blocks = []
    for source, documents in texts.items():
        ids: list[int] = []
        docs = tokenizer(documents, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        for doc in docs:
            ids.extend(doc)
            if eos is not None:
                ids.append(eos)
        n = len(ids) // seq_len
        if n == 0:
            raise EffattnError(f"data source {source!r} has {len(ids)} tokens, fewer than one block of {seq_len}",
                               "add text or lower data.seq_len")
        blocks.append(torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len))  # (n, T)
    out = torch.cat(blocks)
    if bos > 0:
        from ..evaluate import prefix_token, with_prefix

        i = torch.arange(len(out), dtype=torch.float64)
        marked = torch.floor((i + 1) * bos) > torch.floor(i * bos)
        out[marked] = with_prefix(out[marked][:, :-1], prefix_token(tokenizer))
    return out


GOLDEN = 0.6180339887498949  # the golden ratio's fraction: k * GOLDEN mod 1 covers [0, 1) evenly for k = 0, 1, 2, ...


def block_start(sample: int, room: int, seed: int) -> int:
    """The first position of the micro-batch whose first sample is `sample` (BlockStream's numbering), for blocks
    placed anywhere in [0, room] (`data.positions` - seq_len): a low-discrepancy sequence over the samples, so that
    any stretch of steps covers the positions evenly, and a resumed run reads the same positions (a function of
    the sample's number alone)."""
    if room <= 0:
        return 0
    return int(((sample + seed) * GOLDEN) % 1.0 * (room + 1))


class BlockStream:
    """The training order: an endless seeded stream of block indices, sliced into micro-batches."""

    def __init__(self, blocks: torch.Tensor, seed: int):
        self.blocks = blocks  # (N, T)
        self.seed = seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) > 2:  # a batch spans at most two epochs
                self._perms.clear()
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(len(self.blocks), generator=g)
        return self._perms[epoch]

    def take(self, start: int, count: int) -> torch.Tensor:
        """Samples [start, start + count) of the stream: [count, T].

        The loop gives micro-batch i of process r of W the samples starting at
        position + (i*W + r)*B, so processes never share a sample within a step.
        """
        n = len(self.blocks)
        rows = [self._perm(k // n)[k % n] for k in range(start, start + count)]
        return self.blocks[torch.stack(rows)]
