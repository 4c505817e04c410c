"""How many records, and how many bytes of them, one identity may keep on this DHT node.

Every record a swarm stores is owner-marked and signed (:class:`~p2p_diloco.trust.signed_records.OwnedRecords`)
and at most 128 KiB, but nothing bounded how many one owner stores: a peer could fill another node's memory
with valid records under keys nobody reads. The cap cannot be a record validator: hivemind validates the
records a search returns with the same validator and drops a whole dictionary value when one record fails
(``DHTProtocol.call_find``), so a count that depends on what this node already holds would hide other
owners' records from searches. It sits where records are kept instead, in the node's storage
(:class:`QuotaStorage`), which refuses a new (key, subkey) of an owner that already holds ``records`` live
records or ``total_bytes`` bytes here; the storing peer sees ``store_ok`` false, and one line per owner
every 5 minutes names it. A refresh of a record the owner already holds is always taken, and so is
everything this node stores for its own identity.

An honest learner's live records on one node: its progress record, its lineage index entry, a commit
signature and a reducer sketch per round and fragment (kept 300 s), a matchmaking and a download
declaration (seconds to a minute): a learner that commits one round a second keeps about 600, a few KiB
each, on a node that holds all its keys (a swarm smaller than hivemind's replication count).
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage
from hivemind.utils import get_dht_time

from p2p_diloco.trust.signed_records import peer_id_of_owner

log = logging.getLogger(__name__)

MAX_RECORDS_PER_OWNER = 4096
MAX_BYTES_PER_OWNER = 16 * 1024 * 1024
_LOG_EVERY_SECONDS = 300.0
_SWEEP_EVERY_STORES = 4096  # how often every owner's expired entries are forgotten (owners who stopped storing)
_OWNER_RE = re.compile(rb"\[owner:.+?\]", re.DOTALL)


class _Held:
    """One owner's records on this node: (key, subkey) -> (expiration, value bytes), and their byte total."""

    def __init__(self) -> None:
        self.entries: dict[tuple[DHTID, bytes], tuple[float, int]] = {}
        self.bytes = 0

    def put(self, entry: tuple[DHTID, bytes], expiration: float, size: int) -> None:
        self.bytes += size - self.entries.get(entry, (0.0, 0))[1]
        self.entries[entry] = (expiration, size)

    def forget_expired(self, now: float) -> None:
        for entry in [e for e, (expiration, _) in self.entries.items() if expiration <= now]:
            self.bytes -= self.entries.pop(entry)[1]


class QuotaStorage(DHTLocalStorage):
    """hivemind's local storage with a per-owner budget on new subkey records (see the module docstring).

    ``exempt``: this node's own owner marker, whose records it always keeps.
    """

    def __init__(self, maxsize: int | None = None, *, records: int = MAX_RECORDS_PER_OWNER,
                 total_bytes: int = MAX_BYTES_PER_OWNER, exempt: bytes = b""):
        super().__init__(maxsize)
        self.records, self.total_bytes, self.exempt = records, total_bytes, exempt
        self._held: dict[bytes, _Held] = {}
        self._stores = 0
        self._logged: dict[bytes, float] = {}
        self.refused = 0

    def store_subkey(self, key: DHTID, subkey: Any, value: bytes, expiration_time: float) -> bool:
        owner = _owner(subkey)
        if owner is None or owner == self.exempt:
            return super().store_subkey(key, subkey, value, expiration_time)
        self._stores += 1
        if self._stores % _SWEEP_EVERY_STORES == 0:
            self._sweep()
        held = self._held.setdefault(owner, _Held())
        entry = (key, subkey)
        if entry not in held.entries and not self._room(held, len(value)):
            self.refused += 1
            self._log_refusal(owner, held)
            return False
        stored = super().store_subkey(key, subkey, value, expiration_time)
        if stored:
            held.put(entry, expiration_time, len(value))
        return stored

    def held_by(self, owner: bytes) -> tuple[int, int]:
        """How many live records, and how many bytes of values, ``owner`` holds here as counted."""
        held = self._held.get(owner, _Held())
        held.forget_expired(get_dht_time())
        return len(held.entries), held.bytes

    def _room(self, held: _Held, size: int) -> bool:
        def fits() -> bool:
            return len(held.entries) < self.records and held.bytes + size <= self.total_bytes
        if fits():
            return True
        held.forget_expired(get_dht_time())
        return fits()

    def _sweep(self) -> None:
        now = get_dht_time()
        for owner in list(self._held):
            self._held[owner].forget_expired(now)
            if not self._held[owner].entries:
                del self._held[owner]

    def _log_refusal(self, owner: bytes, held: _Held) -> None:
        now = time.monotonic()
        if now - self._logged.get(owner, -_LOG_EVERY_SECONDS) < _LOG_EVERY_SECONDS:
            return
        self._logged[owner] = now
        if len(self._logged) > 1024:  # owners refused long ago
            self._logged = {o: t for o, t in self._logged.items() if now - t < _LOG_EVERY_SECONDS}
        peer = peer_id_of_owner(owner)
        log.warning("refused DHT records from %s: it holds %d records (%d bytes) on this node, the most one "
                    "identity may (%d records, %d bytes); %d refused here so far", peer or "an unnamed owner",
                    len(held.entries), held.bytes, self.records, self.total_bytes, self.refused)


def _owner(subkey: Any) -> bytes | None:
    if not isinstance(subkey, bytes):
        return None
    found = _OWNER_RE.search(subkey)
    return found.group(0) if found else None


def install(protocol: Any, exempt: bytes, records: int = MAX_RECORDS_PER_OWNER) -> None:
    """Give a freshly created hivemind ``DHTProtocol`` quota storages (its storage and its cache), empty."""
    maxsize = protocol.cache.maxsize
    protocol.storage = QuotaStorage(records=records, exempt=exempt)
    protocol.cache = QuotaStorage(None if maxsize == float("inf") else maxsize, records=records, exempt=exempt)
