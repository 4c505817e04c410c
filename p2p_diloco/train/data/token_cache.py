"""Tokenised splits cached on disk as flat arrays of token ids, memory-mapped when read back.

Tokenising a shard of a real corpus takes minutes; a restarted learner must not pay that again.
Each split is one file of native-endian ids (uint8 for bytes, uint16 when the vocabulary fits,
int32 otherwise) whose name holds a hash of everything the ids depend on (:func:`cache_key`). A
file is written under a temporary name and renamed when complete, so a learner killed mid-write
leaves no file that a later start could mistake for a finished one; learners sharing a cache
directory that build the same split at once each write their own temporary file, and the last
rename wins with identical content.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import torch

from p2p_diloco.config import DataConfig

# Bump when the layout of cached files or the way splits are tokenised changes.
FORMAT_VERSION = 2  # 2: documents joined by the tokenizer's end-of-text token when it has one
# dtype name -> (torch dtype, array typecode); 'i' is 4 bytes on every platform torch supports.
_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "uint8": (torch.uint8, "B"),
    "uint16": (torch.uint16, "H"),
    "int32": (torch.int32, "i"),
}


def default_cache_dir(cfg: DataConfig) -> Path:
    """``data.cache_dir``, or ``.cache/p2p-diloco`` under the working directory."""
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else Path.cwd() / ".cache" / "p2p-diloco"


def token_dtype(vocab_size: int) -> str:
    """The narrowest dtype that holds every id below ``vocab_size``."""
    if vocab_size <= 1 << 8:
        return "uint8"
    return "uint16" if vocab_size <= 1 << 16 else "int32"


def cache_key(**parts: object) -> str:
    """A hash of everything a cached split depends on; any change gives another file."""
    text = json.dumps({"format": FORMAT_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def split_label(split: int | None, num_shards: int) -> str:
    """``eval`` or ``shard3of16``: the readable part of a cache file's name and of log lines."""
    return "eval" if split is None else f"shard{split}of{num_shards}"


class TokenFile:
    """One cached split: ``<label>-<key>.<dtype>`` in the cache directory."""

    def __init__(self, directory: Path, label: str, key: str, dtype: str) -> None:
        self.path = directory / f"{label}-{key[:24]}.{dtype}"
        self.dtype = dtype
        self.torch_dtype, self.typecode = _DTYPES[dtype]
        assert array(self.typecode).itemsize == torch.empty(0, dtype=self.torch_dtype).element_size()

    def load(self) -> torch.Tensor | None:
        """The cached ids, memory-mapped (pages load on use), or None when the file is not there."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return None
        n = size // torch.empty(0, dtype=self.torch_dtype).element_size()
        if n == 0:
            return torch.empty(0, dtype=self.torch_dtype)
        # shared=False maps the file copy-on-write: nothing a caller does to the tensor reaches the disk.
        return torch.from_file(str(self.path), shared=False, size=n, dtype=self.torch_dtype)

    @contextlib.contextmanager
    def writer(self) -> Iterator[TokenWriter]:
        """A writer to a temporary file that becomes :attr:`path` only if the block ends without error."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temporaries()
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                w = TokenWriter(f, self.typecode)
                yield w
                w.flush()
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)

    def _remove_stale_temporaries(self) -> None:
        """Delete temporary files of this split left by killed writers (their pid no longer runs)."""
        for tmp in self.path.parent.glob(f"{self.path.name}.*.tmp"):
            pid = tmp.name.removeprefix(f"{self.path.name}.").removesuffix(".tmp")
            if pid.isdigit() and not _running(int(pid)):
                tmp.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: running
        return True
    return True


class TokenWriter:
    """Appends ids to an open file, in blocks so memory stays small however large the split."""

    _BLOCK = 1 << 20

    def __init__(self, f: BinaryIO, typecode: str) -> None:
        self._f = f
        self._buf = array(typecode)
        self.count = 0  # ids written so far

    def extend(self, ids: Sequence[int]) -> None:
        """Append ``ids``."""
        self._buf.extend(ids)
        self.count += len(ids)
        if len(self._buf) >= self._BLOCK:
            self.flush()

    def flush(self) -> None:
        """Write buffered ids to the file."""
        self._buf.tofile(self._f)
        del self._buf[:]
