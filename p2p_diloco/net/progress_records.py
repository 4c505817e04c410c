"""Progress records that learners publish to the DHT, encoded with msgpack.

Each learner stores one record under ``{lineage}_progress`` with the version and hash of the global
state it holds. The subkey is the learner's public key and the value is signed with it
(:mod:`p2p_diloco.trust.signed_records`): the peer a record speaks for is computed from that key, and a
record without a valid signature never reaches the reader. Newcomers and learners that fell behind read these records
to learn the swarm's newest version; learners finishing a run read them to know when the others
are done. Records are refreshed while a learner lives and expire ``record_ttl`` seconds after it
dies; a clean exit overwrites its record with status ``left``.

Records from peers are untrusted input: anything malformed is dropped with a log line.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

import msgpack
from hivemind import DHT
from hivemind.utils import get_dht_time, get_logger

from p2p_diloco.core.outer import is_sha256
from p2p_diloco.net.reach import RECORD_VALUES
from p2p_diloco.trust.signed_records import MAX_RECORD_SECONDS, peer_id_of_owner, replica_first

logger = get_logger(__name__)

Status = Literal["training", "done", "left"]
_STATUSES = ("training", "done", "left")
_MAX_RECORD_BYTES = 16 * 1024
_MAX_TEXT = 128  # the longest string field (a device's name)
MAX_ADDRESS = 200  # the longest address (a multiaddr with its /p2p/ suffix is about 100)
_LINEAGE_RE = re.compile(r"[A-Za-z0-9_\-]{1,128}")


class RecordError(ValueError):
    """A progress record from a peer is malformed; the reader drops it."""


@dataclass(frozen=True)
class ProgressRecord:
    """What a learner says about itself: its oldest fragment's version, the hash of its whole global state,
    the tokens merged into it, its status, and per-fragment versions and hashes.
    """
    version: int
    sha256: str
    tokens: int
    status: Status = "training"
    wall_time: float = 0.0
    versions: tuple[int, ...] = ()  # per fragment; `version` is their minimum
    shas: tuple[str, ...] = ()  # per fragment: with the versions, tells sibling lineages apart
    # What the learner contributes (resource transparency); defaults for records of older versions:
    device_kind: str = ""  # cpu, cuda, mps
    device_name: str = ""  # e.g. "cuda:0 (NVIDIA H200)"
    workers: int = 0  # devices of its learner unit
    cpu_cores: int = 0
    tokens_per_second: float = 0.0  # over its training so far
    tokens_contributed: int = 0  # its tokens that entered the global state (mean over fragments)
    bytes_sent: int = 0  # by its rounds
    bytes_received: int = 0  # by its rounds and state downloads
    uptime: float = 0.0  # seconds since it started
    eval_loss: float | None = None  # its last eval of its local model
    reach: str = ""  # how peers reach it: direct, relay or client (p2p_diloco.net.reach); "" unknown
    address: str = ""  # its first visible multiaddr, as it says; "" unknown
    period: float = 0.0  # the round period it proposes (sync.pace = auto, p2p_diloco/core/pace.py); 0 none
    switch_period: float = 0.0  # a change of period it has decided (0: none) ...
    switch_at: float = 0.0  # ... and the DHT time from which it applies
    # What it saw go wrong (detection, shown by `status`): the peers (last 8 characters of their ids) its recent
    # rounds left out, with how often, at most MAX_EXCLUDED of them; and how often its own training diverged.
    excluded: tuple[tuple[str, int], ...] = ()
    heals: int = 0
    loss_rises: int = 0  # its evals that rose more than its run.loss_rise_alert above the previous one

    def encode(self) -> bytes:
        """The msgpack bytes stored in the DHT."""
        return msgpack.packb({**asdict(self), "versions": list(self.versions), "shas": list(self.shas),
                              "excluded": [list(e) for e in self.excluded]},
                             use_bin_type=True)

    def fragment_sha(self, fragment: int) -> str:
        """The hash of ``fragment``, or ``""`` when the record lists none for it."""
        return self.shas[fragment] if fragment < len(self.shas) else ""

    def fragment_version(self, fragment: int) -> int:
        """The version of ``fragment``; :attr:`version` when the record lists none for it."""
        return self.versions[fragment] if fragment < len(self.versions) else self.version

    @classmethod
    def decode(cls, raw: object) -> ProgressRecord:
        """The record in ``raw`` (bytes from a peer); :class:`RecordError` for anything malformed or out of range."""
        if not isinstance(raw, bytes) or len(raw) > _MAX_RECORD_BYTES:
            raise RecordError("not a msgpack byte string of sane size")
        try:
            obj = msgpack.unpackb(raw, raw=False)
        except Exception as e:
            raise RecordError(f"undecodable msgpack: {e}") from None
        if not isinstance(obj, dict):
            raise RecordError("not a map")
        version, sha, tokens = obj.get("version"), obj.get("sha256"), obj.get("tokens")
        status, wall = obj.get("status", "training"), obj.get("wall_time", 0.0)
        if not (isinstance(version, int) and 0 <= version < 2**40):
            raise RecordError(f"bad version {version!r}")
        if not is_sha256(sha):
            raise RecordError("bad sha256")
        if not (isinstance(tokens, int) and tokens >= 0):
            raise RecordError(f"bad tokens {tokens!r}")
        if status not in _STATUSES:
            raise RecordError(f"bad status {status!r}")
        if not isinstance(wall, int | float):
            raise RecordError("bad wall_time")
        versions = obj.get("versions", [])
        if not (
            isinstance(versions, list) and len(versions) <= 1024
            and all(isinstance(v, int) and 0 <= v < 2**40 for v in versions)
        ):
            raise RecordError("bad versions")
        shas = obj.get("shas", [])
        if not (isinstance(shas, list) and len(shas) == len(versions) and all(is_sha256(h) for h in shas)):
            raise RecordError("bad shas")
        assert isinstance(sha, str)  # checked by is_sha256 above
        return cls(version=version, sha256=sha, tokens=tokens, status=status, wall_time=float(wall),
                   versions=tuple(versions), shas=tuple(shas), **_resources(obj))


_REACH = ("", *RECORD_VALUES)  # "": a record of an older version
MAX_EXCLUDED = 8  # peers a record lists as excluded by its learner's recent rounds


def _resources(obj: dict) -> dict:
    """The resource fields of a record's map, checked; absent ones take their defaults."""
    out: dict = {}
    for name, longest in (("device_kind", _MAX_TEXT), ("device_name", _MAX_TEXT), ("address", MAX_ADDRESS)):
        value = obj.get(name, "")
        if not (isinstance(value, str) and len(value) <= longest and value.isprintable()):
            raise RecordError(f"bad {name}")
        out[name] = value
    excluded = obj.get("excluded", [])
    if not (isinstance(excluded, list) and len(excluded) <= MAX_EXCLUDED and all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and 0 < len(e[0]) <= 8 and e[0].isprintable()
            and isinstance(e[1], int) and not isinstance(e[1], bool) and 0 < e[1] < 2**31 for e in excluded)):
        raise RecordError(f"bad excluded {str(excluded)[:80]!r}")
    out["excluded"] = tuple((e[0], e[1]) for e in excluded)
    for name in ("workers", "cpu_cores", "tokens_contributed", "bytes_sent", "bytes_received", "heals",
                 "loss_rises"):
        value = obj.get(name, 0)
        if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**62):
            raise RecordError(f"bad {name} {value!r}")
        out[name] = value
    for name in ("tokens_per_second", "uptime", "period", "switch_period", "switch_at"):
        value = obj.get(name, 0.0)
        if not (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
                and 0 <= value < 1e15):
            raise RecordError(f"bad {name} {value!r}")
        out[name] = float(value)
    loss = obj.get("eval_loss")
    if loss is not None and not (isinstance(loss, int | float) and not isinstance(loss, bool)
                                 and math.isfinite(loss) and 0 <= loss < 1e6):
        raise RecordError(f"bad eval_loss {loss!r}")
    out["eval_loss"] = None if loss is None else float(loss)
    reach = obj.get("reach", "")
    if reach not in _REACH:
        raise RecordError(f"bad reach {reach!r}")
    out["reach"] = reach
    return out


REJECTION_LOG_SECONDS = 300.0  # a peer's malformed record is logged at WARNING at most this often (the same reason)
MAX_REJECTED_LOGGED = 1024  # peers whose last rejection is remembered


class ProgressBoard:
    """Publish this learner's record and read everyone's."""

    def __init__(self, dht: DHT, lineage: str, ttl: float, owner: bytes, index: LineageIndex | None = None,
                 members: Callable[[str], bool] | None = None):
        """``owner``: this learner's subkey, its public key marker (``signed_records.owner_marker``).
        ``index``: the run's lineage index, where ``lineage`` is refreshed with each record. ``members``: whose
        records count (a private swarm's allow-list, ``Admission.lists``); the others are rejected."""
        self.dht, self.key, self.ttl = dht, progress_key(lineage), ttl
        self._peer_key, self._index, self._lineage = owner, index, lineage
        self._rejected: dict[str, tuple[str, float]] = {}  # peer → the last rejection logged at WARNING, and when
        self._members = members

    def publish(self, record: ProgressRecord) -> bool:
        """Store ``record``, stamped with the wall time, under our subkey for ``ttl`` seconds.

        Best effort: returns False (with a warning for an error) instead of raising.
        """
        record = ProgressRecord(**{**asdict(record), "wall_time": time.time()})
        if self._index is not None:
            self._index.publish(self._lineage)
        try:
            return bool(
                self.dht.store(
                    self.key, record.encode(), get_dht_time() + self.ttl, subkey=self._peer_key
                )
            )
        except Exception as e:  # noqa: BLE001 - publishing is best effort; training goes on
            logger.warning(f"could not publish progress record: {e!r}")
            return False

    def read(self) -> dict[str, ProgressRecord]:
        """Live records by peer ID (our own included); malformed ones are logged and dropped."""
        try:
            # Every record is stored again each record_ttl / 3: this node's replica, where it holds one, misses
            # a store that failed to reach it for that long at most (p2p_diloco/net/replica_reads.py).
            found = self.dht.get(self.key, latest=True, **replica_first(self.dht))
        except Exception as e:  # noqa: BLE001
            logger.warning(f"could not read progress records: {e!r}")
            return {}
        if found is None or not isinstance(found.value, dict):
            return {}
        records = {}
        for subkey, item in found.value.items():
            owner = peer_id_of_owner(subkey)
            if owner is None:  # the DHT's validators drop these; a record stored by an older version has one
                logger.debug(f"ignored a progress record without an owner's key: subkey {repr(subkey)[:40]}")
                continue
            peer = str(owner)
            if self._members is not None and not self._members(peer):
                self._reject(peer, "its key is not on the allow-list")  # a member's record under a fresh key
                continue
            try:
                records[peer] = ProgressRecord.decode(item.value)
            except (RecordError, AttributeError) as e:
                self._reject(peer, str(e))
        return records

    def _reject(self, peer: str, why: str) -> None:
        """Log a rejected record: at WARNING once per peer and reason each :data:`REJECTION_LOG_SECONDS` (records are
        read every second while a round forms: a peer that keeps a malformed record must not flood the log)."""
        last = self._rejected.get(peer)
        now = time.monotonic()
        if last is not None and last[0] == why and now - last[1] < REJECTION_LOG_SECONDS:
            logger.debug(f"rejected progress record from {peer}: {why}")
            return
        if len(self._rejected) >= MAX_REJECTED_LOGGED and peer not in self._rejected:
            self._rejected.pop(next(iter(self._rejected)))
        self._rejected[peer] = (why, now)
        logger.warning(f"rejected progress record from {peer}: {why}")


class LineageIndex:
    """Which lineages a run has: each learner stores its lineage under ``{run_id}_lineages`` (signed, its
    owner marker as subkey, like its progress record), so that a reader who knows only the run id (``p2p-diloco
    status``) finds the lineages' progress keys without knowing the settings hashed into them."""

    def __init__(self, dht: DHT, run_id: str, ttl: float, owner: bytes = b""):
        self.dht, self.key, self.ttl, self._owner = dht, lineages_key(run_id), ttl, owner
        self._stored: tuple[str, float] | None = None  # the lineage last stored, and when (monotonic)

    def publish(self, lineage: str) -> bool:
        """Store our lineage for twice ``ttl`` seconds, once per ``ttl`` (every progress record would store it
        three times as often, each store a search of the key); best effort, like :meth:`ProgressBoard.publish`."""
        now = time.monotonic()
        if self._stored is not None and self._stored[0] == lineage and now - self._stored[1] < self.ttl:
            return True
        try:
            stored = bool(self.dht.store(self.key, lineage.encode(),
                                         get_dht_time() + min(2 * self.ttl, MAX_RECORD_SECONDS - 60),
                                         subkey=self._owner))
        except Exception as e:  # noqa: BLE001 - best effort
            logger.warning(f"could not publish lineage index record: {e!r}")
            return False
        if stored:
            self._stored = (lineage, now)
        return stored

    def read(self) -> dict[str, str]:
        """Live lineages by peer ID; malformed entries are dropped."""
        found = self.dht.get(self.key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        out = {}
        for subkey, item in found.value.items():
            owner = peer_id_of_owner(subkey)
            lineage = decode_lineage(getattr(item, "value", None))
            if owner is not None and lineage is not None:
                out[str(owner)] = lineage
        return out


def decode_lineage(raw: object) -> str | None:
    """The lineage in an index record's value; None if it is not one (untrusted input)."""
    if not isinstance(raw, bytes) or len(raw) > _MAX_TEXT:
        return None
    text = raw.decode("ascii", errors="replace")
    return text if _LINEAGE_RE.fullmatch(text) else None


def lineages_key(run_id: str) -> str:
    """The DHT key of a run's lineage index (protected like the progress keys)."""
    return f"{run_id}_lineages"


def progress_key(lineage: str) -> str:
    """The DHT key of a lineage's progress records (protected: see :mod:`p2p_diloco.trust.signed_records`)."""
    return f"{lineage}_progress"
