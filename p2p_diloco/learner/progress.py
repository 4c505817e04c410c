"""A learner's side of the progress records: publishing its own, reading the swarm's, the heartbeat.

The records themselves (format, validation, the DHT key) are in :mod:`p2p_diloco.net.progress_records`. The heartbeat
also tells the audit log which other learners it saw join and leave (:class:`SwarmWatch`) and the metrics
how many are visible.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hivemind.utils import get_dht_time

from p2p_diloco.core.pace import Pace
from p2p_diloco.hooks import NO_FAULTS, FaultHooks
from p2p_diloco.learner.audit import Audit
from p2p_diloco.learner.state import LearnerState
from p2p_diloco.net.progress_records import ProgressBoard, ProgressRecord, Status
from p2p_diloco.net.reach import reduces_and_serves

if TYPE_CHECKING:
    from p2p_diloco.learner.metrics import Metrics

logger = logging.getLogger(__name__)

TRAINING_MEMORY = 180.0  # seconds a learner seen training counts for the majority quorum after reads miss it
WATCH_REUSE_SECONDS = 2.0  # a read of the records this recent answers the matchmaking watch (docs/scale.md)


class Progress:
    """Publishes this learner's record (on demand and every ``record_ttl / 3`` from a heartbeat
    thread) and keeps the swarm's records as last seen, so that the training loop does not wait
    for a DHT lookup, which on a WAN takes round trips to far peers."""

    def __init__(self, board: ProgressBoard, state: LearnerState, record_ttl: float, *, client: bool = False,
                 resources: Callable[[], dict[str, Any]] = dict, audit: Audit | None = None,
                 metrics: Metrics | None = None, traffic: Callable[[], dict[str, dict[str, int]]] = dict,
                 pace: Pace | None = None, faults: FaultHooks = NO_FAULTS,
                 established: Callable[[], frozenset[str] | None] = lambda: None, floor: int = 1):
        """``client``: we average as a client (:mod:`p2p_diloco.net.reach`), so a group needs a reachable member;
        ``resources``: the record's resource fields (:func:`p2p_diloco.learner.metrics.resources`); ``audit``:
        where the joins and leaves the heartbeat sees go; ``metrics``: told how many other learners are
        visible, and ``traffic``'s DHT RPC counts; ``pace`` (``sync.pace = auto``): our proposed period goes
        out, the swarm's comes in; ``faults``: a test's plan (``lie ... with ahead`` forges our record);
        ``established``: the peers that count toward the majority quorum by the standing our state carries (None:
        everyone; :mod:`p2p_diloco.core.standing`); ``floor``: while fewer of them train, everyone counts (K)."""
        self.board, self.state, self.period = board, state, record_ttl / 3
        self.status: Status = "training"
        self.stale = False  # set after a failed round: the swarm may have moved on
        self._seen: dict[str, ProgressRecord] | None = None
        self._latest: tuple[dict[str, ProgressRecord], float] = ({}, float("-inf"))  # the newest read, and when
        self.faults, self.resources = faults, resources
        self._distrusted: dict[str, float] = {}  # peer → monotonic time until which its records are ignored
        # Peer (ours included) → its last record that said training, and when a read showed it (monotonic).
        self._training: dict[str, tuple[ProgressRecord, float]] = {}
        self.client = client
        self._only_clients = False
        self.audit = audit if audit is not None else Audit.disabled()
        self.metrics, self.traffic = metrics, traffic
        self.swarm = SwarmWatch(gone_after=2 * record_ttl)
        self.pace = pace
        self.established, self.floor = established, floor
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
        versions = self.faults.claimed_versions(versions)
        proposal: dict[str, Any] = {}
        if self.pace is not None:
            proposal["period"] = self.pace.proposal()
            pending = self.pace.pending
            if pending is not None:
                proposal["switch_period"], proposal["switch_at"] = pending
        self.board.publish(ProgressRecord(min(versions), meta["sha256"], sum(e["tokens"] for e in entries),
                                          self.status, versions=versions, shas=tuple(e["sha256"] for e in entries),
                                          **self.resources(), **proposal))

    def records(self, fresh: bool) -> dict[str, ProgressRecord]:
        """The swarm's records (ours included): looked up now, or as last seen by the heartbeat."""
        if fresh or self._seen is None or self.stale:
            self.stale = False  # before the lookup: a round failing meanwhile marks it stale again
            self._seen = self._read()
            self._remember(self._seen)
        return self._seen

    def training_learners(self) -> int:
        """How many learners are training, ourselves included (a majority quorum's base: learners done
        or gone join no round): those the records show training, remembered as :meth:`recently_training` says,
        and established (:meth:`counting`): keys that announce themselves raise the quorum only once rounds
        certified their contributions."""
        counted, training = self.counting(self.established()), self._training_now()
        return len(training if counted is None else training & counted)

    def everyone_training(self) -> frozenset[str]:
        """The learners the records show training, ourselves included, established or not: everyone a round can
        hold (a leader that holds them all starts at once, p2p_diloco/net/early_close.py)."""
        return frozenset(self._training_now())

    def counting(self, established: frozenset[str] | None) -> frozenset[str] | None:
        """``established`` (the peers a standing establishes), or None (everyone counts) while fewer than
        :attr:`floor` of them are training as the records show (ourselves included): once a swarm's established
        learners have left, the learners training now count, rather than nobody (a swarm whose founders left
        would never commit again)."""
        if established is None:
            return None
        return established if len(established & self._training_now()) >= self.floor else None

    def established_training(self) -> int:
        """How many established learners are training (0 while everyone counts): gathered to the group, whose
        upper median decides whether its quorum check counts established members only."""
        counted = self.counting(self.established())
        return 0 if counted is None else len(counted & self._training_now())

    def _training_now(self) -> set[str]:
        """The peers training as the records show (:meth:`recently_training`, distrusted ones too), and us."""
        self.records(fresh=False)  # looked up afresh if none was read yet or a round failed since (stale)
        return {*self.recently_training(trusted_only=False), self.state.peer_id}

    def recently_training(self, trusted_only: bool = True) -> dict[str, ProgressRecord]:
        """The learners (ours included) whose last record said training, seen by a read within the last
        :data:`TRAINING_MEMORY` seconds (or 2 · ``record_ttl``); only the trusted ones unless ``trusted_only`` is
        False. A read can miss records: while all-reduces fill a slow link, lookups miss live learners' records for
        up to a minute (WAN benchmark at 2 Mbit/s with ``record_ttl`` = 8 s: gaps of 16–57 s); counting
        only what one read showed let two learners take the swarm for 3 and commit a version as a pair. A learner
        that died counts that much longer: rounds need its share of the majority until then. The majority's count
        takes distrusted learners too: a peer whose state failed our verification still trains and commits with
        others, and leaving it out lowers the count below the swarm's."""
        now, horizon = time.monotonic(), self._memory
        return {p: r for p, (r, seen) in list(self._training.items())
                if now - seen <= horizon and (not trusted_only or self._trusted(p))}

    @property
    def _memory(self) -> float:
        """Seconds a learner seen training stays in :meth:`recently_training`: 2 · record_ttl, at least
        :data:`TRAINING_MEMORY`."""
        return max(6 * self.period, TRAINING_MEMORY)

    def _remember(self, records: dict[str, ProgressRecord]) -> None:
        """Fold a read's records into :meth:`recently_training` (a record saying done or left drops its peer)."""
        now, horizon = time.monotonic(), self._memory
        for peer, r in records.items():
            if r.status == "training":
                self._training[peer] = (r, now)
            else:
                self._training.pop(peer, None)
        for peer, (_, seen) in list(self._training.items()):
            if now - seen > horizon:
                del self._training[peer]  # the memory holds no more than the learners seen within its horizon

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
        """The newest version of ``fragment`` any other live, trusted learner that serves its state holds (a DHT
        lookup, or the newest one if it is at most :data:`WATCH_REUSE_SECONDS` old; called from the round thread
        every second while a round forms, so it leaves the training loop's cached records alone).

        A round's matchmaking is cancelled on it, so only a claim that can be checked counts: a learner that
        serves its state is downloaded from when it claims to be ahead (catch_up.py), and one that serves less
        than it claimed is distrusted. A client's or relayed learner's record is never downloaded from: a claim
        there would cancel every round and never be found out (docs/security.md, "Claims to be ahead")."""
        seen, at = self._latest
        if time.monotonic() - at > WATCH_REUSE_SECONDS:
            seen = self._read()
        return max((r.fragment_version(fragment) for p, r in seen.items()
                    if p != self.state.peer_id and r.status != "left" and self._trusted(p)
                    and reduces_and_serves(r.reach)), default=0)

    def _read(self) -> dict[str, ProgressRecord]:
        """The swarm's records, looked up now (remembered for :meth:`newest_live_version`)."""
        seen = self.board.read()
        self._latest = (seen, time.monotonic())
        return seen

    def start(self) -> None:
        """Start the heartbeat thread; call it once."""
        self._thread.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.period):
            self.publish()
            self._seen = seen = self._read()  # leaves `stale` to the training thread
            self._remember(seen)
            live = self._live_others(seen)
            if self.client:
                self._say_if_only_clients(live)
            self._watch(seen, live)
            if self.pace is not None and seen:
                self._agree_on_pace()

    def _agree_on_pace(self) -> None:
        """The period the training learners' records propose (ours among them; distrusted peers' left out)."""
        assert self.pace is not None
        training = self.recently_training().values()  # a read may miss records: remembered
        proposals = [r.period for r in training]
        announced = [(r.switch_period, r.switch_at) for r in training if r.switch_period > 0]
        change = self.pace.update(proposals, get_dht_time(), announced)
        if change is not None:
            period, at = change
            logger.info(f"round period {self.pace.period:.1f} s → {period:.1f} s from {at - get_dht_time():.0f} s "
                        f"from now (proposed by {len(proposals)} learner(s), this one {self.pace.proposal():.1f} s)")
            self.audit.record("pace", period=round(period, 3), at=round(at, 3), proposals=len(proposals))

    def _live_others(self, records: dict[str, ProgressRecord]) -> list[ProgressRecord]:
        """The records of the other learners that have not left."""
        return [r for p, r in records.items() if p != self.state.peer_id and r.status != "left"]

    def _watch(self, records: dict[str, ProgressRecord], live: list[ProgressRecord]) -> None:
        """Audit the joins and leaves ``records`` show (debounced by :class:`SwarmWatch`); count the ``live``
        other learners among them, and the DHT's traffic, in the metrics."""
        me = self.state.peer_id
        if self.metrics is not None:
            if records:
                self.metrics.peers_visible(len(live))
            try:
                self.metrics.dht_traffic(self.traffic())
            except Exception as e:  # noqa: BLE001 - the DHT process going away mid-read costs one update
                logger.debug(f"could not read the DHT's traffic: {type(e).__name__}: {e}")
        for peer, event, fields in self.swarm.update(records, me, time.monotonic()):
            logger.info(f"learner {peer[-6:]} {event}" + (" (it was there when we started)"
                                                         if fields.get("already_there") else ""))
            self.audit.peer_seen(peer, event, **fields)

    def _say_if_only_clients(self, live: list[ProgressRecord]) -> None:
        """One line when every other ``live`` learner is a client too (no group can form), one when that ends."""
        only = bool(live) and not any(reduces_and_serves(r.reach) for r in live)
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


class SwarmWatch:
    """Which other learners joined and left, from successive reads of the swarm's records; debounced, so that
    a lookup that misses some records (DHT flicker) says nothing.

    A peer *joined* when its live record (any status but ``left``) is seen for the first time in this run, or
    again after it left or was gone; it *left* when its record says ``left``; it is *gone* when no record of
    it was seen for ``gone_after`` seconds (2 × ``record_ttl``: a dead learner's record expires ``record_ttl``
    after its last refresh, and a lookup may miss a live one). An empty read (the lookup failed, or found not
    even our own record) changes nothing. A learner already present at the first read is reported as joined,
    marked ``already_there``.

    Example::

        watch = SwarmWatch(gone_after=60.0)
        watch.update({"12D3KooWa...": record}, me="12D3KooWme...", now=time.monotonic())  # [(peer, "joined", {...})]
    """

    def __init__(self, gone_after: float):
        self.gone_after = gone_after
        self._last_seen: dict[str, float] = {}  # present peers → when their live record was last seen
        self._first = True

    def update(self, records: dict[str, ProgressRecord], me: str,
               now: float) -> list[tuple[str, str, dict[str, Any]]]:
        """The (peer, event, fields) that ``records``, read at ``now`` (monotonic seconds), show since the last read."""
        if not records:
            return []
        first, self._first = self._first, False
        events: list[tuple[str, str, dict[str, Any]]] = []
        for peer, r in sorted(records.items()):
            if peer == me:
                continue
            if r.status == "left":
                if self._last_seen.pop(peer, None) is not None:
                    events.append((peer, "left", {"version": r.version}))
                continue
            if peer not in self._last_seen:
                events.append((peer, "joined", {"version": r.version, "reach": r.reach, "already_there": first}))
            self._last_seen[peer] = now
        for peer, seen in list(self._last_seen.items()):
            if now - seen > self.gone_after:
                del self._last_seen[peer]
                events.append((peer, "gone", {"unseen_seconds": round(now - seen, 1)}))
        return events
