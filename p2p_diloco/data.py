"""Text corpora split into per-learner shards and one held-out eval split.

The default corpus is the Python standard library's own source files: every machine that runs
this package has them, so nothing is downloaded. ``--data PATH`` takes a text file or a directory
of text files instead.

A file goes to a split by a hash of its path relative to the corpus root, so two machines with
the same corpus agree on every assignment without talking to each other, and a learner only ever
reads the files of its own shard (local data stays local). A single file given as ``--data`` is cut
into 64 KiB pieces that are assigned the same way.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from p2p_diloco.config import DataConfig
from p2p_diloco.errors import UserError

_BUCKETS = 10_000
_PIECE_BYTES = 64 * 1024
_TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".toml", ".json", ".csv", ".html", ".c", ".h", ".cfg", ""}


class DataError(UserError, ValueError):
    """The data source is missing, empty or unreadable; the message is one line."""


def default_corpus_root() -> Path:
    """The running Python's standard library directory: the corpus when ``data.path`` is None."""
    return Path(sysconfig.get_paths()["stdlib"])


def _bucket(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % _BUCKETS


def _split_of(name: str, cfg: DataConfig) -> int | None:
    """None for the eval split, otherwise the shard index that owns ``name``."""
    b = _bucket(name)
    if b < cfg.eval_fraction * _BUCKETS:
        return None
    return b % cfg.num_shards


def _list_documents(root: Path) -> list[tuple[str, Path]]:
    if root.is_file():
        return [(root.name, root)]
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in {"site-packages", "__pycache__"})
        for fn in sorted(filenames):
            p = Path(dirpath) / fn
            if p.suffix in _TEXT_SUFFIXES:
                docs.append((str(p.relative_to(root)), p))
    return docs


def _pieces(name: str, raw: bytes) -> Iterator[tuple[str, bytes]]:
    if len(raw) <= _PIECE_BYTES:
        yield name, raw
        return
    for i in range(0, len(raw), _PIECE_BYTES):
        yield f"{name}#{i // _PIECE_BYTES}", raw[i : i + _PIECE_BYTES]


def load_split(cfg: DataConfig, shard_index: int | None) -> torch.Tensor:
    """Bytes of one shard (``shard_index``) or of the eval split (None), as a uint8 tensor."""
    return load_splits(cfg, [shard_index])[shard_index]


def load_splits(cfg: DataConfig, splits: Sequence[int | None]) -> dict[int | None, torch.Tensor]:
    """Several splits in one pass over the corpus (a learner needs its shard and the eval split).

    Each split gets exactly what ``load_split`` alone would give it: whole files in corpus order
    until its own ``data.max_corpus_mb`` is reached. Reading the corpus once instead of twice
    shortens a learner's (re)start.
    """
    root = Path(cfg.path).expanduser() if cfg.path else default_corpus_root()
    if not root.exists():
        raise DataError(f"data path {root} does not exist")
    limit = int(cfg.max_corpus_mb * 1e6)
    chunks: dict[int | None, list[bytes]] = {s: [] for s in splits}
    totals = dict.fromkeys(splits, 0)
    for name, path in _list_documents(root):
        open_splits = {s for s in splits if totals[s] < limit}
        if not open_splits:
            break
        try:
            raw = path.read_bytes()
        except OSError:
            continue  # unreadable files are skipped, like binary junk in a user's directory
        if b"\0" in raw[:4096]:
            continue
        for piece_name, piece in _pieces(name, raw):
            split = _split_of(piece_name, cfg)
            if split in open_splits:
                chunks[split].append(piece)
                totals[split] += len(piece)
    out = {}
    for s in splits:
        data = b"\n".join(chunks[s])
        if len(data) < 4 * 1024:
            what = "eval split" if s is None else f"shard {s}/{cfg.num_shards}"
            raise DataError(
                f"{what} of {root} holds only {len(data)} bytes; give more text or lower data.num_shards"
            )
        out[s] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


@dataclass
class BatchSampler:
    """Random windows of ``seq_len + 1`` bytes from one split, reproducible from (seed, cursor)."""

    data: torch.Tensor
    seq_len: int
    batch_size: int
    seed: int
    cursor: int = 0  # batches drawn so far; saved in checkpoints so a resumed learner continues

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (inputs, targets) pair, each ``(batch_size, seq_len)`` int64, targets one byte ahead.

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
