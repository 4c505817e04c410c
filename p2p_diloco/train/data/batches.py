"""Per-learner shards and one held-out eval split of a corpus, as 1-D tensors of token ids.

The default corpus is the Python standard library's own source files: every machine that runs
this package has them, so nothing is downloaded. ``data.path`` takes a text file or a directory of
text files, a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` table or a directory of them, or a
hub dataset name (see :mod:`p2p_diloco.train.data.corpus`); ``data.tokenizer`` a tokenizer (see
:mod:`p2p_diloco.train.data.tokenizer`; default bytes).

A document goes to a split by a hash of its name, so two machines with the same corpus agree on
every assignment without talking to each other, and a learner only ever reads the text of its own
shard and the eval split (local data stays local). With the default byte tokenizer a text corpus is
read straight into memory as before; anything else is tokenised once per split into a
memory-mapped file under ``data.cache_dir`` (:mod:`p2p_diloco.train.data.token_cache`) that later starts reuse.

Example::

    >>> cfg = DataConfig(num_shards=16, max_corpus_mb=1)
    >>> splits = load_splits(cfg, [3, None], load_tokenizer("peers/tokenizers/bpe-4k"))
    >>> x, y = BatchSampler(splits[3], seq_len=64, batch_size=8, seed=0).next_batch()
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from p2p_diloco.config import DataConfig
from p2p_diloco.train.data.corpus import (
    MIN_SPLIT_BYTES,
    Corpus,
    DataError,
    check_corpus_size,
    corpus_bytes_needed,
    default_corpus_root,
    open_corpus,
    split_of,
)
from p2p_diloco.train.data.token_cache import (
    TokenFile,
    TokenWriter,
    cache_key,
    default_cache_dir,
    split_label,
    token_dtype,
)
from p2p_diloco.train.data.tokenizer import BYTES, ByteTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "BatchSampler", "DataError", "default_corpus_root", "fixed_eval_batches", "load_split", "load_splits",
    "load_tokenizer", "shard_for_peer",
]

logger = logging.getLogger(__name__)
_PROGRESS_EVERY_S = 10.0

Split = int | None


def load_split(cfg: DataConfig, shard_index: int | None, tokenizer: Tokenizer | None = None) -> torch.Tensor:
    """Token ids of one shard (``shard_index``) or of the eval split (None); bytes (uint8) by default."""
    return load_splits(cfg, [shard_index], tokenizer)[shard_index]


def load_splits(
    cfg: DataConfig, splits: Sequence[int | None], tokenizer: Tokenizer | None = None, *, min_tokens: int = 0
) -> dict[int | None, torch.Tensor]:
    """Several splits in one pass over the corpus (a learner needs its shard and the eval split).

    Each split gets exactly what ``load_split`` alone would give it: documents in corpus order,
    joined by the tokenizer's separator (a newline for bytes, the end-of-text token otherwise),
    until its own ``data.max_corpus_mb`` of text is reached. Reading the
    corpus once instead of twice shortens a learner's (re)start. ``tokenizer`` None means bytes.
    DataError when the corpus is unusable, or a split holds under 1 KiB of text or under
    ``min_tokens`` tokens (pass ``model.seq_len + 2`` to get the error before training).
    """
    tok = tokenizer or ByteTokenizer()
    corpus = open_corpus(cfg)
    check_corpus_size(corpus, cfg)
    if corpus.kind == "text" and tok.kind == BYTES:
        out = _byte_splits(corpus, cfg, splits)  # the default: in memory, no cache, identical to before
    else:
        out = _token_splits(corpus, cfg, splits, tok)
    for s, ids in out.items():
        if len(ids) < min_tokens:
            raise _too_few_tokens(corpus, cfg, s, len(ids), min_tokens)
    return out


class _ByteSink:
    """The raw bytes of one split's documents, kept in memory."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.text_bytes = 0

    @property
    def tokens(self) -> int:
        return self.text_bytes

    def add(self, payload: bytes | str) -> None:
        raw = payload if isinstance(payload, bytes) else payload.encode()
        self.chunks.append(raw)
        self.text_bytes += len(raw)


class _TokenSink:
    """Tokenises one split's documents in batches (the Rust tokenizers use both cores) into a cache file."""

    _BATCH_CHARS = 1 << 20

    def __init__(self, tok: Tokenizer, writer: TokenWriter) -> None:
        self.text_bytes = 0
        self._tok, self._writer, self._sep = tok, writer, tok.separator
        self._pending: list[str] = []
        self._pending_chars = 0
        self._docs = 0

    @property
    def tokens(self) -> int:
        return self._writer.count

    def add(self, payload: bytes | str) -> None:
        if isinstance(payload, bytes):
            self.text_bytes += len(payload)
            payload = payload.decode(errors="replace")  # a piece may end inside a UTF-8 character
        else:
            self.text_bytes += len(payload.encode())
        self._pending.append(payload)
        self._pending_chars += len(payload)
        if self._pending_chars >= self._BATCH_CHARS:
            self.flush()

    def flush(self) -> None:
        """Tokenise the pending documents; ids join with the separator, like bytes joined with a newline."""
        for ids in self._tok.encode_batch(self._pending) if self._pending else []:
            if self._docs:
                self._writer.extend(self._sep)
            self._writer.extend(ids)
            self._docs += 1
        self._pending, self._pending_chars = [], 0


_Sink = _ByteSink | _TokenSink


def _one_pass(corpus: Corpus, cfg: DataConfig, sinks: dict[Split, _Sink]) -> None:
    """Feed each document of the corpus to the sink of its split until every sink is full."""
    limit = int(cfg.max_corpus_mb * 1e6)
    began = last = time.monotonic()
    seen = 0
    for group in corpus.documents():
        # Checked per group (all pieces of one file), as before pieces were sized: same bytes as before.
        open_splits = {s for s, sink in sinks.items() if sink.text_bytes < limit}
        if not open_splits:
            break
        for name, payload in group:
            seen += len(payload)
            split = split_of(name, cfg.num_shards, cfg.eval_fraction)
            if split in open_splits:
                sinks[split].add(payload)
            if time.monotonic() - last >= _PROGRESS_EVERY_S:  # per piece: one huge file is one group
                last = time.monotonic()
                kept = ", ".join(f"{split_label(s, cfg.num_shards)} {k.tokens:,} tokens" for s, k in sinks.items())
                logger.info(f"reading {corpus.source}: {seen / 1e6:.1f} MB read in {last - began:.0f} s; {kept}")


def _byte_splits(corpus: Corpus, cfg: DataConfig, splits: Sequence[Split]) -> dict[Split, torch.Tensor]:
    sinks = {s: _ByteSink() for s in splits}
    _one_pass(corpus, cfg, dict(sinks))  # a copy, typed as the dict of either sink that _one_pass takes
    _check_text(corpus, cfg, {s: k.text_bytes for s, k in sinks.items()})
    return {s: torch.frombuffer(bytearray(b"\n".join(k.chunks)), dtype=torch.uint8) for s, k in sinks.items()}


def _token_splits(
    corpus: Corpus, cfg: DataConfig, splits: Sequence[Split], tok: Tokenizer
) -> dict[Split, torch.Tensor]:
    """Each split from its cache file, tokenising (in one pass) those not cached yet."""
    directory, dtype = default_cache_dir(cfg), token_dtype(tok.vocab_size)
    files = {s: TokenFile(directory, split_label(s, cfg.num_shards), _key(corpus, cfg, tok, s), dtype) for s in splits}
    out: dict[Split, torch.Tensor] = {}
    for s, f in files.items():
        cached = f.load()
        if cached is not None:
            logger.info(f"tokenised {split_label(s, cfg.num_shards)} from cache {f.path} ({len(cached):,} tokens)")
            out[s] = cached
    missing = {s: f for s, f in files.items() if s not in out}
    if missing:
        _tokenise(corpus, cfg, tok, missing)
        for s, f in missing.items():
            loaded = f.load()
            assert loaded is not None, f"{f.path} vanished right after it was written"
            out[s] = loaded
    return {s: out[s] for s in splits}


def _key(corpus: Corpus, cfg: DataConfig, tok: Tokenizer, split: Split) -> str:
    """The cache key of a split: the corpus (where it is and its files' names, sizes and mtimes), the
    tokenizer, the split and every setting that changes which documents the split holds."""
    where = corpus.source if corpus.kind == "hub" else str(Path(corpus.source).resolve())
    return cache_key(
        corpus=where, corpus_files=corpus.fingerprint(), tokenizer=tok.fingerprint, split=split,
        num_shards=cfg.num_shards, eval_fraction=cfg.eval_fraction, max_corpus_mb=cfg.max_corpus_mb,
        text_field=cfg.text_field, piece_bytes=corpus.piece_bytes,
    )


def _tokenise(corpus: Corpus, cfg: DataConfig, tok: Tokenizer, files: dict[Split, TokenFile]) -> None:
    """Tokenise the splits of ``files`` in one pass; each file appears only if its split is complete."""
    labels = " and ".join(split_label(s, cfg.num_shards) for s in files)
    logger.info(f"tokenising {labels} of {corpus.source} ({tok.kind}, vocab {tok.vocab_size}) into "
                f"{next(iter(files.values())).path.parent}; later starts reuse it")
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        sinks = {s: _TokenSink(tok, stack.enter_context(f.writer())) for s, f in files.items()}
        _one_pass(corpus, cfg, dict(sinks))
        for sink in sinks.values():
            sink.flush()
        _check_text(corpus, cfg, {s: k.text_bytes for s, k in sinks.items()})  # raising discards the files
    done = ", ".join(f"{split_label(s, cfg.num_shards)} {k.tokens:,} tokens" for s, k in sinks.items())
    logger.info(f"tokenised {done} in {time.monotonic() - began:.1f} s")


def _what(cfg: DataConfig, split: Split) -> str:
    return "eval split" if split is None else f"shard {split}/{cfg.num_shards}"


def _hint(split: Split) -> str:
    return "give more text or raise data.eval_fraction" if split is None else "give more text or lower data.num_shards"


def _check_text(corpus: Corpus, cfg: DataConfig, text_bytes: dict[Split, int]) -> None:
    """DataError if a split got under MIN_SPLIT_BYTES of text."""
    for s, n in text_bytes.items():
        if n < MIN_SPLIT_BYTES:
            raise DataError(f"{_what(cfg, s)} of {corpus.source} holds only {n} bytes of text (at least "
                            f"{MIN_SPLIT_BYTES} needed): {_hint(s)}")


def _too_few_tokens(corpus: Corpus, cfg: DataConfig, split: Split, have: int, want: int) -> DataError:
    needed = corpus_bytes_needed(corpus, cfg, have, want)
    size = f"; the corpus needs about {needed / 1e6:.2f} MB for {cfg.num_shards} shards" if needed else ""
    return DataError(f"{_what(cfg, split)} of {corpus.source} holds only {have} tokens, fewer than the {want} "
                     f"needed{size}: {_hint(split)}")


@dataclass
class BatchSampler:
    """Random windows of ``seq_len + 1`` tokens from one split, reproducible from (seed, cursor)."""

    data: torch.Tensor
    seq_len: int
    batch_size: int
    seed: int
    cursor: int = 0  # batches drawn so far; saved in checkpoints so a resumed learner continues

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (inputs, targets) pair, each ``(batch_size, seq_len)`` int64, targets one token ahead.

        Advances :attr:`cursor`: the batch depends only on (seed, cursor).
        """
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.cursor)
        self.cursor += 1
        return _windows(self.data, self.seq_len, self.batch_size, g)


def _windows(
    data: torch.Tensor, seq_len: int, batch_size: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=g)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    window = data[idx].long()
    return window[:, :-1], window[:, 1:]


def fixed_eval_batches(
    data: torch.Tensor, seq_len: int, batch_size: int, n: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same eval batches on every learner, so eval losses compare across the swarm."""
    g = torch.Generator().manual_seed(12345)
    return [_windows(data, seq_len, batch_size, g) for _ in range(n)]


def shard_for_peer(peer_id_bytes: bytes, num_shards: int) -> int:
    """The default shard of a peer: a hash of its peer ID bytes modulo ``num_shards``."""
    return int.from_bytes(hashlib.sha256(peer_id_bytes).digest()[:8], "big") % num_shards
