"""The audit log: what a learner did, one JSON line per event, hash-chained and signed.

``audit.jsonl`` in the learner's checkpoint directory holds one line per event (a round committed or
failed, a state downloaded, rejected or adopted, lineages merged, a peer distrusted, the learner
started, resumed or left, an outer step's losses and counters, and other learners it saw join or leave the
swarm: ``peer_joined``, ``peer_left``, ``peer_gone``, from :class:`p2p_diloco.learner.progress.SwarmWatch`)::

    {"seq": 7, "time": 1764650000.1, "event": "committed", "fragment": 0, ..., "prev": "<sha256 of line 6>"}

``seq`` is the line's index in the file (0 for the first) and ``prev`` the SHA-256 (hex) of the previous
line's bytes (:data:`GENESIS` for the first line), so that an edited, deleted or reordered line breaks the
chain. After every ``run.audit_sign_every`` lines and at exit a ``head`` line signs the chain head (``prev``
and ``seq``) with the learner's identity key and carries its public key: whoever holds the log can check
that it was written by the peer ID its first line declares, up to that line (``p2p-diloco audit verify``,
:mod:`p2p_diloco.ops.audit_verify`).

Durability: every line is flushed (a killed process loses nothing the kernel has), and heads and the
last lines at exit are fsynced; fsyncing every line would put a disk flush on the training thread at
every event. A power loss can therefore cost the lines after the last head, and may leave a torn last
line. A resumed learner continues its chain; a torn last line is kept in place (terminated) and named by
a ``torn`` event that starts the new segment, so no history is silently dropped.

The log must never stop training: a write that fails is one ERROR line, and the log stays off from then on.

Example::

    audit = Audit.open(Path("checkpoints/learner-0"), key, peer_id, sign_every=20)
    audit.record("started", lineage="run-1a2b3c4d")
    audit.close()  # a signed head, fsynced
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from p2p_diloco.errors import LearnerError

if TYPE_CHECKING:
    from hivemind.utils.crypto import RSAPrivateKey

    from p2p_diloco.core.outer import GlobalState
    from p2p_diloco.learner.round import RoundOutcome
    from p2p_diloco.learner.state import LearnerState

logger = logging.getLogger(__name__)

FILENAME = "audit.jsonl"
GENESIS = "p2p-diloco audit 1"  # the "prev" of a log's first line
PEER_EVENTS = ("joined", "left", "gone")  # what a learner saw another learner do (Audit.peer_seen)


def line_hash(raw: bytes) -> str:
    """The hash the next line holds as ``prev``: SHA-256 of a line's bytes, without its newline."""
    return hashlib.sha256(raw).hexdigest()


def head_body(peer_id: str, seq: int, prev: str) -> bytes:
    """The bytes a head line signs: its peer ID, its seq and the hash of the line before it."""
    return f"p2p-diloco audit head 1\n{peer_id}\n{seq}\n{prev}".encode()


def _encode(entry: dict[str, Any]) -> bytes:
    return json.dumps(entry, separators=(",", ":"), default=str).encode()


class Audit:
    """Appends events to one learner's ``audit.jsonl``: :meth:`record` from any thread, :meth:`close` at exit.

    :meth:`disabled` gives one that records nothing (the parts' default, for tests without a learner).
    """

    def __init__(self, path: Path | None, key: RSAPrivateKey | None, peer_id: str, sign_every: int = 20,
                 on_record: Callable[[str, dict[str, Any]], None] | None = None):
        self.path, self.key, self.peer_id, self.sign_every = path, key, peer_id, sign_every
        self._lock = threading.Lock()
        self._file: BinaryIO | None = None
        self._seq = 0
        self._prev = GENESIS
        self._unsigned = 0  # lines since the last head
        # Told of every recorded event (heads aside), written or not: the learner's metrics count refusals
        # from it (startup.py).
        self.on_record: Callable[[str, dict[str, Any]], None] = on_record or (lambda _event, _fields: None)

    @classmethod
    def disabled(cls) -> Audit:
        """An audit log that records nothing."""
        return cls(None, None, "")

    @classmethod
    def open(cls, directory: Path, key: RSAPrivateKey, peer_id: str, sign_every: int = 20,
             on_record: Callable[[str, dict[str, Any]], None] | None = None, **fields: Any) -> Audit:
        """The log in ``directory``: a new chain ("started"), or the existing one continued ("resumed"; a torn
        last line first gets a "torn" event). ``fields`` go into that first event. LearnerError if the
        existing log belongs to another peer ID (the checkpoint directory's identity was replaced)."""
        audit = cls(directory / FILENAME, key, peer_id, sign_every, on_record)
        assert audit.path is not None
        if audit.path.exists() and audit.path.stat().st_size > 0:
            audit._continue(fields)
        else:
            audit._file = audit.path.open("ab")
            audit.record("started", peer_id=peer_id, **fields)
        return audit

    def _continue(self, fields: dict[str, Any]) -> None:
        assert self.path is not None
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        tail = lines.pop()  # b"" when the file ends with its newline
        if tail:
            lines.append(tail)
        first, last = parse_line(lines[0]), parse_line(lines[-1])
        declared = first.get("peer_id") if first else None
        if declared is not None and declared != self.peer_id:
            raise LearnerError(f"{self.path} is the audit log of peer {declared}, not of this learner's identity "
                               f"({self.peer_id}): move it away to start a new log")
        self._file = self.path.open("ab")
        self._seq, self._prev = len(lines), line_hash(lines[-1])
        if tail or last is None:  # the learner died while writing it (or the disk lost it)
            if tail:
                self._write_raw(b"\n")  # terminated and kept in place: its bytes stay in the chain
            self.record("torn", line=len(lines), bytes=len(lines[-1]))
            logger.warning(f"{self.path}: line {len(lines)} is torn; kept, and a new segment starts after it")
        clean = last is not None and last.get("event") == "head" and last.get("exit") is True
        self.record("resumed", peer_id=self.peer_id, clean=clean, **fields)

    def record(self, event: str, **fields: Any) -> None:
        """Append one event (and a signed head every ``sign_every`` lines). Never raises."""
        try:
            self.on_record(event, fields)
        except Exception as e:  # noqa: BLE001 - an observer must not stop the log, nor training
            logger.debug(f"audit observer failed on {event}: {e!r}")
        if self.path is None:
            return
        with self._lock:
            try:
                self._append({"seq": self._seq, "time": round(time.time(), 3), "event": event, **fields,
                              "prev": self._prev})
                if self._unsigned >= self.sign_every:
                    self._head(exit=False)
            except OSError as e:
                self._fail(e)

    def round(self, fragment: int, outcome: RoundOutcome, codec: str, tokens: int, late: bool = False) -> None:
        """A round of ours ended: "committed" (with its group, result and costs) or "failed" (with its cause)."""
        o = outcome
        common: dict[str, Any] = {"fragment": fragment, "codec": codec, "tokens": int(tokens), "late": late,
                                  "bytes_sent": o.bytes_sent, "round_seconds": round(o.round_seconds, 3),
                                  "allreduce_seconds": round(o.allreduce_seconds, 3), "excluded": o.excluded}
        if o.committed:
            self.record("committed", version_before=o.version - 1, version_after=o.version, sha_before=o.parent,
                        sha_after=o.sha256, contributors=sorted(o.members), members=o.members,
                        group_size=o.group_size, group_tokens=o.group_tokens,
                        certify_seconds=round(o.certify_seconds, 3), **common)
        else:
            self.record("failed", version=o.version, cause=o.reason, superseded=o.superseded,
                        group_size=o.group_size, **common)

    def downloaded(self, peer: str, theirs: dict[int, GlobalState], certificate: str) -> None:
        """A state download from ``peer`` passed its checks (``certificate``: "verified" or "not checked")."""
        fragments = {str(f): [s.version, s.sha256()] for f, s in sorted(theirs.items())}
        self.record("downloaded", peer=peer, fragments=fragments, certificate=certificate)

    def adopted(self, fragment: int, ours: GlobalState, theirs: GlobalState, new: GlobalState,
                certificate: str) -> None:
        """A peer's state of ``fragment`` became ours: "adopted" when ``new`` is ``theirs`` (a descendant of
        ours), "merged" when it is the merge of ``theirs`` and ``ours`` (sibling lineages)."""
        self.record("adopted" if new is theirs else "merged", fragment=fragment,
                    version_before=ours.version, sha_before=ours.sha256(), version=theirs.version,
                    sha=theirs.sha256(), version_after=new.version, sha_after=new.sha256(), certificate=certificate)

    def outer_step(self, state: LearnerState, train_loss: float, eval_loss: float | None, train_seconds: float) -> None:
        """An outer step's end: the version, the losses (``eval_loss`` None when not evaluated) and the counters
        (``train_seconds``: the training loops' wall time so far, this run's included)."""
        c = state.counters
        self.record("outer_step", version=state.version, tokens=c.tokens, train_loss=train_loss, eval_loss=eval_loss,
                    compute_seconds=round(c.compute_seconds, 3), wait_seconds=round(c.wait_seconds, 3),
                    train_seconds=round(train_seconds, 3), bytes_sent=c.bytes_sent,
                    bytes_received=c.bytes_received)

    def peer_seen(self, peer: str, event: str, **fields: Any) -> None:
        """Another learner ``joined`` (its record seen for the first time, or again after it had gone), ``left``
        (its record says so) or is ``gone`` (no record for a while): a ``peer_joined``, ``peer_left`` or
        ``peer_gone`` event."""
        if event not in PEER_EVENTS:
            raise ValueError(f"peer event {event!r} is not one of {PEER_EVENTS}")
        self.record(f"peer_{event}", peer=peer, **fields)

    def left(self, states: Sequence[GlobalState], **fields: Any) -> None:
        """The learner leaves: its versions and hashes."""
        self.record("left", versions=[s.version for s in states], sha256=[s.sha256() for s in states], **fields)

    def close(self) -> None:
        """Sign the chain head, fsync and close (at exit). Safe to call twice."""
        if self.path is None:
            return
        with self._lock:
            try:
                if self._file is not None:
                    self._head(exit=True)
            except OSError as e:
                self._fail(e)
            finally:
                if self._file is not None:
                    self._file.close()
                    self._file = None
                self.path = None  # a late event (a download thread still ending) is dropped, not an error

    def _head(self, exit: bool) -> None:
        assert self.key is not None
        signature = self.key.sign(head_body(self.peer_id, self._seq, self._prev))
        self._append({"seq": self._seq, "time": round(time.time(), 3), "event": "head", "peer_id": self.peer_id,
                      "exit": exit, "public_key": self.key.get_public_key().to_bytes().decode(),
                      "signature": signature.decode(), "prev": self._prev})
        self._unsigned = 0
        assert self._file is not None
        os.fsync(self._file.fileno())  # a signed head (and what it signs) survives a power loss

    def _append(self, entry: dict[str, Any]) -> None:
        raw = _encode(entry)
        self._write_raw(raw + b"\n")
        self._seq += 1
        self._prev = line_hash(raw)
        self._unsigned += 1

    def _write_raw(self, raw: bytes) -> None:
        if self._file is None:
            raise OSError("the audit log is closed")
        self._file.write(raw)
        self._file.flush()  # in the kernel: a SIGKILL loses nothing

    def _fail(self, e: OSError) -> None:
        logger.error(f"audit log {self.path}: cannot write ({e}); auditing is off for the rest of this run")
        self.path = None


def parse_line(raw: bytes) -> dict[str, Any] | None:
    """One line of a log as a dict; None if it is not a JSON object (a torn or edited line)."""
    try:
        entry = json.loads(raw)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None
