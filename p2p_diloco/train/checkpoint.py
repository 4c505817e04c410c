"""Atomic checkpoints of a learner: global state, local model and inner optimizer, counters, config.

A checkpoint is written to a temporary file in the same directory, flushed to disk, then renamed
over ``latest.pt``: a crash mid-write leaves the previous checkpoint intact. Files are loaded with
``weights_only=True`` so a checkpoint cannot execute code.

The directory is locked (``flock``) for the lifetime of the learner that uses it, so two learners
on one machine never write into the same place; without ``--checkpoint-dir`` a learner takes the
first free ``checkpoints/learner-N``.

The learner does not wait for the disk: :class:`CheckpointWriter` takes a copy of its tensors and
writes it on a background thread (0.22 s and 99 MB for ``peers/default.toml``'s model with its
optimizer state, against a copy of a few tens of milliseconds). A newer snapshot replaces one that
is still waiting, since only the newest checkpoint is ever resumed from.

Beside ``latest.pt`` a directory holds copies of the small files that rebuilding the model needs
besides Θ (:func:`save_model_files`): a Hugging Face model's ``model/config.json`` and the
tokenizer's ``tokenizer/tokenizer.json`` (or ``.model``). With them ``p2p-diloco export`` works from
anywhere, whatever became of the directories the learner was started with.
"""

from __future__ import annotations

import copy
import fcntl
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from p2p_diloco.errors import UserError

logger = logging.getLogger("p2p_diloco.train.checkpoint")

LATEST = "latest.pt"
FORMAT = 2  # bumped when the payload layout changes
MODEL_DIR = "model"  # copies of a Hugging Face model's config files (never its weights: Θ is in latest.pt)
MODEL_FILES = ("config.json", "generation_config.json")
TOKENIZER_DIR = "tokenizer"  # a copy of the tokenizer file, as tokenizer.json or tokenizer.model


class CheckpointError(UserError, RuntimeError):
    """A checkpoint directory or file cannot be used, or a write failed; the message is one line."""


class DirectoryLock:
    """An exclusive ``flock`` on ``path/.lock``, held until :meth:`release` or until this process exits."""
    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        """Create ``path`` if needed and take the lock; False, without waiting, if it is already held."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / ".lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        """Let go of the lock; a no-op when it is not held."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _remove_stale_temporaries(path: Path) -> None:
    """Half-written checkpoints of a learner that crashed mid-write (we hold the lock now)."""
    for stale in path.glob(f".{LATEST}.tmp-*"):
        stale.unlink(missing_ok=True)


def claim_checkpoint_dir(explicit: str | None, root: str = "checkpoints") -> tuple[Path, DirectoryLock]:
    """Lock ``explicit``, or the first free ``{root}/learner-N``; error if ``explicit`` is in use."""
    if explicit is not None:
        path = Path(explicit)
        lock = DirectoryLock(path)
        if not lock.try_acquire():
            raise CheckpointError(f"checkpoint dir {path} is in use by another running learner")
        _remove_stale_temporaries(path)
        return path, lock
    for n in range(10_000):
        path = Path(root) / f"learner-{n}"
        lock = DirectoryLock(path)
        if lock.try_acquire():
            _remove_stale_temporaries(path)
            return path, lock
    raise CheckpointError(f"no free checkpoint directory under {root}")


def tokenizer_copy_name(tokenizer_file: str | Path) -> str:
    """The name of a tokenizer file's copy in ``TOKENIZER_DIR``: ``tokenizer.model`` for SentencePiece, else
    ``tokenizer.json`` (the names transformers looks for)."""
    return "tokenizer.model" if Path(tokenizer_file).suffix == ".model" else "tokenizer.json"


def save_model_files(directory: Path, model_path: str | Path | None, tokenizer_file: Path | None) -> None:
    """Copy the config files of the Hugging Face model in ``model_path`` into ``directory/model/``, and the
    tokenizer file into ``directory/tokenizer/``; None (the built-in model, bytes) copies nothing.

    Weights are never copied (Θ is the checkpoint). Each file is written atomically and only when its
    content changed, so a resume rewrites nothing; a write that fails is one CheckpointError line.
    """
    copies: list[tuple[Path, Path]] = []
    stale: list[Path] = []  # another model's or tokenizer's copies, left by an earlier run in this directory
    if model_path is not None:
        for name in MODEL_FILES:  # config.json always (the learner has read it), the others where they exist
            source, target = Path(model_path) / name, directory / MODEL_DIR / name
            if name == MODEL_FILES[0] or source.is_file():
                copies.append((source, target))
            else:
                stale.append(target)
    if tokenizer_file is not None:
        name = tokenizer_copy_name(tokenizer_file)
        copies.append((Path(tokenizer_file), directory / TOKENIZER_DIR / name))
        stale.append(directory / TOKENIZER_DIR / ("tokenizer.json" if name == "tokenizer.model" else "tokenizer.model"))
    try:
        for source, target in copies:
            _write_if_changed(target, source.read_bytes())
        for path in stale:
            path.unlink(missing_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot copy the model's files into {directory}: {e.strerror or e}") from None


def _write_if_changed(target: Path, data: bytes) -> None:
    if target.is_file() and target.read_bytes() == data:
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def save_checkpoint(directory: Path, payload: dict[str, Any], before_rename=None) -> Path:
    """Write ``payload`` to a temporary file, fsync it, rename it over ``latest.pt``.

    ``before_rename`` is a hook for fault injection (a crash between writing and renaming).
    """
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / LATEST
    tmp = directory / f".{LATEST}.tmp-{os.getpid()}"
    with tmp.open("wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    if before_rename is not None:
        before_rename()
    os.replace(tmp, final)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def load_checkpoint(directory: Path) -> dict[str, Any] | None:
    """The checkpoint in ``directory``, None if there is none; CheckpointError if it is unreadable."""
    path = directory / LATEST
    if not path.exists():
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure here means a corrupt file
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({type(e).__name__}); "
                              "move it away to start fresh") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not a p2p-diloco checkpoint")
    bad = _non_finite(payload)
    if bad:
        raise CheckpointError(f"checkpoint {path} holds NaN or Inf in {bad}; move it away to start fresh "
                              "(or resume from a peer's state)")
    return payload


def _non_finite(payload: dict[str, Any]) -> str:
    """Where the checkpoint's model or global state holds a value that is not finite ("" if nowhere)."""
    model = payload.get("model")
    for name, t in (model.items() if isinstance(model, dict) else ()):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"the local model ({name})"
    for f, g in enumerate(payload.get("global") or ()):
        tensors = [*g.get("params", []), *g.get("momentum", [])] if isinstance(g, dict) else []
        if any(isinstance(t, torch.Tensor) and not bool(torch.isfinite(t).all()) for t in tensors):
            return f"the global state of fragment {f}"
    return ""


class CheckpointWriter:
    """Writes checkpoints on one background thread; :meth:`submit` only copies the payload.

    At most one snapshot waits while another is written; a newer one replaces it. A failed write is
    logged and training goes on (the state is still in memory); :meth:`flush` raises it.
    """

    def __init__(self, directory: Path):
        self.directory = directory
        self._cond = threading.Condition()
        self._pending: tuple[dict[str, Any], Callable[[], None] | None] | None = None
        self._busy = False
        self._closed = False
        self._error: CheckpointError | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="checkpoint-writer")
        self._thread.start()

    def submit(self, payload: dict[str, Any], before_rename: Callable[[], None] | None = None) -> None:
        """Hand over a snapshot: its tensors are copied now, so the caller may keep changing them."""
        snapshot = copy.deepcopy(payload)
        with self._cond:
            if self._closed:
                raise CheckpointError("the checkpoint writer is closed")
            self._pending = (snapshot, before_rename)
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                (payload, hook), self._pending = self._pending, None
                self._busy = True
            error = None
            try:
                save_checkpoint(self.directory, payload, before_rename=hook)
            except Exception as e:  # noqa: BLE001 - disk full, permissions: report, keep training
                error = CheckpointError(f"writing a checkpoint to {self.directory} failed: {e}")
                logger.error(str(error))
            with self._cond:
                self._error, self._busy = error, False
                self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every snapshot handed over is on disk; raise if the last write failed."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout):
                raise CheckpointError(f"a checkpoint write to {self.directory} did not finish in {timeout} s")
            if self._error is not None:
                raise self._error

    def close(self, timeout: float | None = None) -> None:
        """Write what is waiting, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
