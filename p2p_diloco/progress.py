"""A learner's side of the progress records: publishing its own, reading the swarm's, the heartbeat.

The records themselves (format, validation, the DHT key) are in :mod:`p2p_diloco.records`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from p2p_diloco.faults import LIE_VERSIONS, FaultPlan
from p2p_diloco.learner_state import LearnerState
from p2p_diloco.records import ProgressBoard, ProgressRecord, Status

logger = logging.getLogger(__name__)


class Progress:
    """Publishes this learner's record (on demand and every ``record_ttl / 3`` from a heartbeat
    thread) and keeps the swarm's records as last seen, so that the training loop does not wait
    for a DHT lookup, which on a WAN takes round trips to far peers."""

    def __init__(self, board: ProgressBoard, state: LearnerState, record_ttl: float):
        self.board, self.state, self.period = board, state, record_ttl / 3
        self.status: Status = "training"
        self.stale = False  # set after a failed round: the swarm may have moved on
        self._seen: dict[str, ProgressRecord] | None = None
        self.faults: FaultPlan | None = None  # a test's plan: "lie ... with ahead" forges our record
        self.resources: Callable[[], dict[str, Any]] = dict  # the record's resource fields (metrics.resources)
        self._distrusted: dict[str, float] = {}  # peer → monotonic time until which its records are ignored
        self.client = False  # we average as a client (p2p_diloco.reach): a group needs a reachable member
        self._only_clients = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, daemon=True, name="progress-heartbeat")

    def announce(self, version: int) -> None:
        """A record before we hold any state to serve: learners finishing the run then see a
        newcomer behind them and keep serving until it has caught up."""
        self.board.publish(ProgressRecord(version, "0" * 64, 0, "training"))

    def publish(self, status: Status | None = None) -> None:
        """Our record, from the served snapshot (what a peer downloading from us would get)."""
        if status is not None:
            self.status = status
        meta = self.state.served.metadata
        if meta is None:
            return
        entries = meta["fragments"]
        versions = tuple(e["version"] for e in entries)
        if self.faults and self.faults.lying("ahead", min(versions) + 1):
            versions = tuple(v + LIE_VERSIONS["ahead"] for v in versions)
        self.board.publish(ProgressRecord(min(versions), meta["sha256"], sum(e["tokens"] for e in entries),
                                          self.status, versions=versions, shas=tuple(e["sha256"] for e in entries),
                                          **self.resources()))

    def records(self, fresh: bool) -> dict[str, ProgressRecord]:
        """The swarm's records (ours included): looked up now, or as last seen by the heartbeat."""
        if fresh or self._seen is None or self.stale:
            self.stale = False  # before the lookup: a round failing meanwhile marks it stale again
            self._seen = self.board.read()
        return self._seen

    def distrust(self, peer: str, seconds: float) -> None:
        """Ignore ``peer``'s records for ``seconds`` (it served a state that failed verification)."""
        self._distrusted[peer] = time.monotonic() + seconds

    def _trusted(self, peer: str) -> bool:
        until = self._distrusted.get(peer)
        return until is None or until < time.monotonic()

    def others(self, fresh: bool) -> dict[str, ProgressRecord]:
        """The other learners' records (ours and distrusted peers' left out); ``fresh`` as in :meth:`records`."""
        return {p: r for p, r in self.records(fresh).items() if p != self.state.peer_id and self._trusted(p)}

    def newest_live_version(self, fragment: int = 0) -> int:
        """The newest version of ``fragment`` any other live, trusted learner holds (a fresh DHT lookup;
        called from the round thread, so it leaves the training loop's cached records alone)."""
        return max((r.fragment_version(fragment) for p, r in self.board.read().items()
                    if p != self.state.peer_id and r.status != "left" and self._trusted(p)), default=0)

    def start(self) -> None:
        """Start the heartbeat thread; call it once."""
        self._thread.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.period):
            self.publish()
            self._seen = self.board.read()  # leaves `stale` to the training thread
            if self.client:
                self._say_if_only_clients(self._seen)

    def _say_if_only_clients(self, records: dict[str, ProgressRecord]) -> None:
        """One line when every other live learner is a client too (no group can form), one when that ends."""
        live = [r for p, r in records.items() if p != self.state.peer_id and r.status != "left"]
        only = bool(live) and all(r.reach == "client" for r in live)
        if only and not self._only_clients:
            logger.warning(f"only client-mode learners are visible ({len(live)}): a group needs a reachable member "
                           "to lead and reduce; no round can form until one joins")
        elif self._only_clients and not only:
            logger.info("a reachable learner is visible again")
        self._only_clients = only

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the heartbeat and wait up to ``timeout`` seconds for its thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
