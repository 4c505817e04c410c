"""Which documents a corpus holds, and which split each one belongs to.

A corpus is one of three kinds:

- **text**: a text file or a directory of text files (the default corpus, the running Python's
  standard library, is one). A file longer than the corpus's piece size is cut into pieces, each a
  document of its own.
- **table**: a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file, or a directory of them, read
  row by row with the ``datasets`` library in streaming mode (large files never load whole). Each
  row is a document; its text is the column ``data.text_field``.
- **hub**: a Hugging Face hub dataset name (``owner/name``, not a local path), read by the same
  streaming code; it needs a machine that is online.

A document goes to a split by a hash of its name (relative file path, plus ``#piece`` or ``#row``),
so machines with the same corpus agree on every assignment without talking, and a learner only
keeps the documents of its own shard and of the eval split.

This module imports neither torch nor ``datasets`` at import time: the default learner reads text
files and must start as fast as before.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from p2p_diloco.config import DataConfig
from p2p_diloco.errors import UserError

BUCKETS = 10_000
MAX_PIECE_BYTES = 64 * 1024
# Below this a split cannot give a learner useful windows; a corpus whose smallest split would hold
# less than twice this is refused before any reading (see `check_corpus_size`).
MIN_SPLIT_BYTES = 1024
# Pieces are sized so the smallest split expects this many of them: enough that no split comes out
# empty by the luck of the hash, few enough that the default corpus keeps its 64 KiB pieces.
_PIECES_PER_SPLIT = 8
_MIN_PIECE_BYTES = 256
_TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".toml", ".json", ".csv", ".html", ".c", ".h", ".cfg", ""}
# suffix -> the `datasets` builder that reads it
TABLE_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# .json and .csv files also occur in text corpora (the stdlib has some); these two never do.
_ONLY_TABLE_SUFFIXES = {".jsonl", ".parquet"}
_SKIPPED_DIRS = {"site-packages", "__pycache__"}
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class DataError(UserError, ValueError):
    """The data source or tokenizer is missing, empty, too small or unreadable; the message is one line."""


def one_line(e: BaseException) -> str:
    """The first line of an exception's message (library errors can span many lines), or its type."""
    lines = str(e).strip().splitlines()
    return lines[0][:300] if lines else type(e).__name__


def default_corpus_root() -> Path:
    """The running Python's standard library directory: the corpus when ``data.path`` is None."""
    return Path(sysconfig.get_paths()["stdlib"])


def bucket(name: str) -> int:
    """The hash bucket (0 .. BUCKETS-1) of a document name; equal on every machine."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % BUCKETS


def split_of(name: str, num_shards: int, eval_fraction: float) -> int | None:
    """None for the eval split, otherwise the shard index that owns the document ``name``."""
    b = bucket(name)
    if b < eval_fraction * BUCKETS:
        return None
    return b % num_shards


def smallest_split_fraction(num_shards: int, eval_fraction: float) -> float:
    """The expected share of the corpus that the smallest split (a shard or the eval split) gets."""
    return min(eval_fraction, (1 - eval_fraction) / num_shards)


def piece_bytes_for(total_bytes: int, num_shards: int, eval_fraction: float) -> int:
    """The piece size of a text corpus of ``total_bytes``: 64 KiB unless the corpus is small.

    Small corpora get smaller pieces so that every split gets text; the default corpus (tens of
    MB, 16 shards) keeps 64 KiB pieces, so its splits are the same as before pieces were sized.
    """
    share = total_bytes * smallest_split_fraction(num_shards, eval_fraction) / _PIECES_PER_SPLIT
    return max(_MIN_PIECE_BYTES, min(MAX_PIECE_BYTES, int(share)))


@dataclass(frozen=True)
class CorpusFile:
    """One file of a corpus: its name relative to the corpus root (the hash key) and its stat."""

    name: str
    path: Path
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Corpus:
    """A data source resolved from a :class:`DataConfig`; see :func:`open_corpus`."""

    source: str  # what the user gave (a path or a hub name), for messages
    kind: Literal["text", "table", "hub"]
    files: list[CorpusFile] = field(default_factory=list)
    text_field: str = "text"
    piece_bytes: int = MAX_PIECE_BYTES

    @property
    def total_bytes(self) -> int:
        """Bytes of all files (0 for a hub dataset, whose size is unknown before reading it)."""
        return sum(f.size for f in self.files)

    def fingerprint(self) -> str:
        """A hash of the corpus's file names, sizes and modification times (or of the hub name).

        Any edit to the corpus changes it, which is what invalidates tokenised-shard caches.
        """
        h = hashlib.sha256(f"{self.kind}\n{self.source}\n{self.text_field}\n".encode())
        for f in self.files:
            h.update(f"{f.name}\t{f.size}\t{f.mtime_ns}\n".encode())
        return h.hexdigest()

    def documents(self) -> Iterator[list[tuple[str, bytes | str]]]:
        """Groups of (document name, text) in corpus order: all pieces of one text file, or one row.

        Text files yield raw bytes (the byte tokenizer uses them unchanged); rows yield str.
        Callers stop early by breaking out of the loop: nothing is read ahead.
        """
        if self.kind == "text":
            for f in self.files:
                pieces = _text_pieces(f, self.piece_bytes)
                if pieces:
                    yield pieces
        else:
            for name, text in _table_rows(self):
                yield [(name, text)]


def open_corpus(cfg: DataConfig) -> Corpus:
    """The corpus that ``cfg.path`` names (the default corpus when None); DataError if there is none."""
    if cfg.path is None:
        root = default_corpus_root()
    else:
        root = Path(cfg.path).expanduser()
        if not root.exists():
            if _HUB_NAME.match(cfg.path):
                return Corpus(cfg.path, "hub", text_field=cfg.text_field)
            raise DataError(f"data path {root} does not exist")
    files, tables = _list_files(root)
    if tables:
        return Corpus(str(root), "table", tables, text_field=cfg.text_field)
    if not files:
        raise DataError(f"data path {root} holds no text files (or .jsonl/.json/.parquet/.csv tables)")
    total = sum(f.size for f in files)
    return Corpus(str(root), "text", files, piece_bytes=piece_bytes_for(total, cfg.num_shards, cfg.eval_fraction))


def check_corpus_size(corpus: Corpus, cfg: DataConfig) -> None:
    """DataError, before any reading, when a text corpus is too small for ``cfg``'s splits.

    "Too small" means the smallest split would expect under twice MIN_SPLIT_BYTES. Tables and hub
    datasets are checked per split after reading, since their file sizes are not text sizes.
    """
    if corpus.kind != "text":
        return
    share = smallest_split_fraction(cfg.num_shards, cfg.eval_fraction)
    needed = math.ceil(2 * MIN_SPLIT_BYTES / share)
    if corpus.total_bytes < needed:
        hint = "raise data.eval_fraction" if share == cfg.eval_fraction else "lower data.num_shards"
        raise DataError(
            f"data at {corpus.source} holds only {corpus.total_bytes} bytes; {cfg.num_shards} shard(s) and an eval "
            f"split of {cfg.eval_fraction} need at least {needed} bytes: give more text or {hint}"
        )


def corpus_bytes_needed(corpus: Corpus, cfg: DataConfig, have: int, want: int) -> int | None:
    """Roughly how many corpus bytes would give the split that holds ``have`` tokens ``want`` of them."""
    if corpus.kind == "hub" or have <= 0:
        return None
    return math.ceil(corpus.total_bytes * want / have)


def _list_files(root: Path) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """(text files, table files) under ``root``; tables are empty unless ``root`` is a table corpus.

    A directory is a table corpus when it holds a .jsonl or .parquet file, or when all its files
    are .json / .csv; then only its table files are read.
    """
    if root.is_file():
        one = [_stat(root.name, root)]
        return ([], one) if root.suffix in TABLE_SUFFIXES else (one, [])
    text: list[CorpusFile] = []
    tables: list[CorpusFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for fn in sorted(filenames):
            p = Path(dirpath) / fn
            if p.suffix in TABLE_SUFFIXES:
                tables.append(_stat(str(p.relative_to(root)), p))
            if p.suffix in _TEXT_SUFFIXES:
                text.append(_stat(str(p.relative_to(root)), p))
    # .json/.csv files sit in text corpora too, so only they alone, or any .jsonl/.parquet, make a table corpus
    if tables and ({f.path.suffix for f in tables} & _ONLY_TABLE_SUFFIXES or len(tables) == len(text)):
        return [], tables
    return text, []


def _stat(name: str, path: Path) -> CorpusFile:
    try:
        st = path.stat()
    except OSError:  # a dangling link or a file removed meanwhile: skipped when read, like today
        return CorpusFile(name, path, 0, 0)
    return CorpusFile(name, path, st.st_size, st.st_mtime_ns)


def _text_pieces(f: CorpusFile, piece_bytes: int) -> list[tuple[str, bytes | str]]:
    """The pieces of one text file; none for unreadable or binary files, which are skipped."""
    try:
        raw = f.path.read_bytes()
    except OSError:
        return []  # unreadable files are skipped, like binary junk in a user's directory
    if b"\0" in raw[:4096]:
        return []
    if len(raw) <= piece_bytes:
        return [(f.name, raw)]
    return [(f"{f.name}#{i // piece_bytes}", raw[i : i + piece_bytes]) for i in range(0, len(raw), piece_bytes)]


def _table_rows(corpus: Corpus) -> Iterator[tuple[str, str]]:
    """(``file#row``, text) for each row with text; one streaming dataset per file keeps row names stable."""
    if corpus.kind == "hub":
        where = f"{corpus.source} (no such local path, so read as a Hugging Face hub dataset)"
        yield from _rows(corpus.source, where, corpus.text_field, {"path": corpus.source})
        return
    for f in corpus.files:
        builder = TABLE_SUFFIXES[f.path.suffix]
        kwargs: dict[str, Any] = {"path": builder, "data_files": str(f.path)}
        if builder == "parquet":  # read only the text column of a wide table
            _check_parquet_column(f.path, corpus.text_field)
            kwargs["columns"] = [corpus.text_field]
        yield from _rows(f.name, str(f.path), corpus.text_field, kwargs)


def _missing_column(where: str, text_field: str, columns: list[str]) -> DataError:
    return DataError(f"{where} has no column {text_field!r} (data.text_field); its columns: {sorted(columns)}")


def _check_parquet_column(path: Path, text_field: str) -> None:
    import pyarrow.parquet as pq  # comes with datasets

    try:
        names = pq.read_schema(path).names
    except Exception as e:  # arrow raises its own types for a corrupt or non-parquet file
        raise DataError(f"could not read {path}: {one_line(e)}") from None
    if text_field not in names:
        raise _missing_column(str(path), text_field, names)


def _rows(name: str, where: str, text_field: str, kwargs: dict[str, Any]) -> Iterator[tuple[str, str]]:
    import datasets  # lazily: a second of imports, and only table corpora need it

    try:
        stream = datasets.load_dataset(**kwargs, split="train", streaming=True)
        for i, row in enumerate(stream):
            if text_field not in row:
                raise _missing_column(where, text_field, list(row))
            text = row[text_field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise DataError(f"{where} row {i}: column {text_field!r} holds {type(text).__name__}, not text")
            yield f"{name}#{i}", text
    except DataError:
        raise
    except Exception as e:  # datasets raises many types (arrow, json, connection): all mean "cannot read this"
        raise DataError(f"could not read {where}: {one_line(e)}") from None
