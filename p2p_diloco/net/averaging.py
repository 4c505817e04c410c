"""Averaging of outer gradients over a hivemind DHT: :class:`HivemindAveraging`.

Matchmaking is keyed by the global version: before each round the averager's group bits are set
to (fragment, binary version number), so only learners that hold the same version of the same
fragment look for each other (hivemind's group key is ``{prefix}.0b{bits}``).

Each round gathers, besides the round's own metadata, the weight the all-reduce uses, this
learner's robust-merging rules and its current bans; the group decides from them whose
contributions it leaves out (:mod:`p2p_diloco.core.exclusion`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind import DHT
from hivemind.averaging.control import AveragingStage
from hivemind.compression import NoCompression
from hivemind.utils import get_dht_time, get_logger

from p2p_diloco.config import AveragingConfig, ContributionLimits
from p2p_diloco.core import directions
from p2p_diloco.core.averaging_api import AverageResult, RoundFailed, RoundSuperseded, Served, StateProvider
from p2p_diloco.core.bans import Bans
from p2p_diloco.core.exclusion import Rules, Verdict
from p2p_diloco.core.merging import global_norm
from p2p_diloco.hooks import NO_FAULTS, FaultHooks
from p2p_diloco.net.averager_process import REFUSED_PARTS, ExcludedFromRound, OuterGradientAverager, RefusedPeers
from p2p_diloco.net.codecs import get_codec
from p2p_diloco.trust import signed_metadata
from p2p_diloco.trust.signed_matchmaking import declared, download_key

logger = get_logger(__name__)

# What a step's or a download's future may raise. A step cancelled inside hivemind's averager process
# comes back as asyncio.CancelledError, a BaseException: it must end the round, not the learner.
_STEP_FAILURES = (Exception, asyncio.CancelledError)
GO_SHARE = 0.25  # a member waits for a leader's go at least this share of its recent all-reduces
ALLREDUCES_KEPT = 5  # ... the upper median of this many latest ones


def search_timeout(round_timeout: float, matchmaking_time: float, grace: float | None,
                   search_seconds: float | None, longer_go: float = 0.0) -> float:
    """hivemind's step timeout for a round: how long its search for a group may last (the deadline ends the
    search, not an all-reduce under way). ``round_timeout``, or the grace window and a second if longer; cut
    to ``search_seconds`` when given, but never before a second past the group's scheduled start. Both seconds
    are ``longer_go`` seconds longer when the wait for a leader's go is (:func:`go_timeout`): the deadline ends
    that wait too.

    >>> search_timeout(30.0, 2.5, 10.0, None), search_timeout(30.0, 2.5, 40.0, None)
    (30.0, 41.0)
    >>> search_timeout(30.0, 2.5, 10.0, 2.5), search_timeout(30.0, 2.5, 1.0, 2.5), search_timeout(30.0, 2.5, None, 0.0)
    (11.0, 3.5, 3.5)
    >>> search_timeout(30.0, 2.5, 1.0, 2.5, longer_go=5.0)
    8.5
    """
    past = 1.0 + max(0.0, longer_go)
    timeout = round_timeout if grace is None else max(round_timeout, grace + past)
    if search_seconds is not None:
        timeout = min(timeout, max(search_seconds, max(grace or 0.0, matchmaking_time) + past))
    return timeout


def go_timeout(configured: float, allreduces: Sequence[float], round_timeout: float) -> float:
    """How long past a group's deadline a member waits for its leader's go (:mod:`.patient_matchmaking`): the
    configured ``request_timeout``, or :data:`GO_SHARE` of the upper median of this learner's recent all-reduces
    if longer, at most half the round timeout. On fast links the all-reduce is short and the configured wait stays.

    >>> go_timeout(1.0, [], 30.0), go_timeout(1.0, [0.5, 2.0], 30.0), go_timeout(1.0, [20, 24, 30], 30.0)
    (1.0, 1.0, 6.0)
    >>> go_timeout(1.0, [200.0], 30.0)
    15.0
    """
    if not allreduces:
        return configured
    return min(max(configured, GO_SHARE * statistics.median_high(allreduces)), round_timeout / 2)


@dataclass
class HivemindAveraging:
    """:class:`Averaging` over a hivemind DHT. Also serves and downloads the global state. Made by
    ``HivemindAveraging(...).start()``: :meth:`start` starts its averager process.

    ``fragments`` lists the tensor indices of each fragment (default: one fragment of everything)
    and ``codecs`` the codec name of each fragment.
    """

    dht: DHT
    template: Sequence[torch.Tensor]
    cfg: AveragingConfig
    prefix: str
    state_provider: StateProvider | None = None
    # Polled while looking for a group: returns the swarm's newest version of a fragment, to stop
    # waiting for a group that has already moved on.
    newest_version: Callable[[int], int] | None = None
    # With ``cfg.quorum == "majority"``: how many learners the swarm's records show training (us included).
    training_learners: Callable[[], int] | None = None
    # The learners the swarm's records show training (peer IDs, us included), established or not: everyone a round
    # can hold; a leader holding them all starts at once (``cfg.early_close``, p2p_diloco/net/early_close.py).
    everyone_training: Callable[[], frozenset[str]] | None = None
    # Seconds after start before a leader closes its group early: the records of learners that started about when
    # we did reach us within the records' lifetime (network.record_ttl); until then the window decides.
    early_close_after: float = 0.0
    # How many established learners are training (0: everyone counts; p2p_diloco/core/standing.py), gathered
    established_training: Callable[[], int] | None = None
    fragments: Sequence[Sequence[int]] | None = None
    codecs: Sequence[str] | None = None
    poll_seconds: float = 1.0
    faults: FaultHooks = NO_FAULTS
    # Set when the learner is asked to stop: matchmaking in progress is abandoned.
    should_stop: Callable[[], bool] = lambda: False
    # Behind NAT (p2p_diloco.net.reach): send parts and receive results, never reduce, lead or serve state.
    client_mode: bool = False
    step_tokens: int | None = None  # tokens one inner step of this learner holds (gathered: weights' bound)
    limits: ContributionLimits | None = None  # what bounds contributions' weights (None: unbounded, in tests)
    # Told what the network brought in (the learner counts it, startup.py): the bytes of each finished all-reduce
    # (parts and averaged shards) and each download, failed ones included; and each finished round's
    # matchmaking seconds (from the step's start to its group forming).
    on_received: Callable[[int], None] = lambda _n: None
    on_matchmaking: Callable[[float], None] = lambda _s: None
    _buffers: list[torch.Tensor] = field(init=False)
    _averager: OuterGradientAverager = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)  # one round at a time
    _superseded_by: int | None = field(init=False, default=None)
    _bans: Bans = field(init=False)
    _last_verdict: Verdict | None = field(init=False, default=None)
    _quorum: int = field(init=False, default=0)  # the quorum the averager process matchmakes with
    _close_at: frozenset[str] = field(init=False, default=frozenset())  # and who its leader starts with at once
    _started: float = field(init=False, default_factory=time.monotonic)
    _allreduces: deque[float] = field(init=False, default_factory=lambda: deque(maxlen=ALLREDUCES_KEPT))
    _go_timeout: float = field(init=False, default=0.0)  # the averager process's wait for a leader's go
    _standing: dict[str, int] | None = field(init=False, default=None)  # what the averager process judges with
    _control: Any = field(init=False, default=None)  # the step control of the round in progress

    def __post_init__(self) -> None:
        if self.faults is None:  # as no faults
            self.faults = NO_FAULTS
        self._buffers = [torch.zeros_like(t, dtype=torch.float32) for t in self.template]
        self._bans = Bans(self.cfg.ban_rounds)
        self._go_timeout = self.cfg.request_timeout
        if self.fragments is None:
            self.fragments = [tuple(range(len(self._buffers)))]

    def start(self) -> HivemindAveraging:
        """Start the averager process (hivemind's ``DecentralizedAverager`` forks here and joins the DHT's
        averaging keys); returns this object, ready to average."""
        # hivemind logs every failed averaging step as an ERROR with its traceback (in the averager's
        # process); for a learner a dropped round is a normal outcome, reported by the rounds in one
        # WARNING line naming the cause. The traceback stays available at DEBUG.
        averager_logger = logging.getLogger("hivemind.averaging.averager")
        if not any(isinstance(f, _FailedStepToDebug) for f in averager_logger.filters):
            averager_logger.addFilter(_FailedStepToDebug())
        assert self.fragments is not None
        names = list(self.codecs) if self.codecs else [self.cfg.compression] * len(self.fragments)
        sigint = signal.getsignal(signal.SIGINT)  # hivemind sets SIGINT to "ignore" in *our* process
        self._averager = OuterGradientAverager(
            self._buffers,
            self.dht,
            fragments=self.fragments,
            codecs=[get_codec(name) for name in names],
            state_provider=self.state_provider,
            faults=self.faults,
            rules=self._rules(),
            start=True,
            prefix=self.prefix,
            min_group_size=self.cfg.min_group_size,
            target_group_size=self.cfg.target_group_size,
            min_matchmaking_time=self.cfg.matchmaking_time,
            request_timeout=self.cfg.request_timeout,
            allreduce_timeout=self.cfg.allreduce_timeout,
            next_chunk_timeout=self.cfg.next_chunk_timeout,
            state_compression=NoCompression(),
            client_mode=self.client_mode,
            allow_state_sharing=not self.client_mode,
            declare_state_period=10.0,
            shutdown_timeout=5.0,
        )
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, sigint)
        return self

    @property
    def peer_id(self) -> str:
        """This learner's peer ID, as groupmates and progress records name it."""
        return str(self.dht.peer_id)

    def set_state_priority(self, version: int) -> None:
        """Peers that download state try the highest priority first: the newest version (a client serves none)."""
        if not self.client_mode:
            self._averager.state_sharing_priority = float(version)

    def average(
        self,
        deltas: Sequence[torch.Tensor],
        weight: float,
        metadata: dict[str, Any],
        version: int,
        fragment: int = 0,
        grace: float | None = None,
        search_seconds: float | None = None,
        standing: Mapping[str, int] | None = None,
    ) -> AverageResult:
        """Average one fragment's ``deltas`` with a group at (fragment, version).

        ``grace``: how long the leader may wait for groupmates beyond the quorum (at least the
        configured matchmaking time, hivemind's own minimum). ``metadata`` without a ``norm`` gathers
        the norm of ``deltas``. ``search_seconds``: how long to look for a group at most (None:
        ``round_timeout``), never less than a second past the group's scheduled start. ``standing``: the fragment
        state's (:mod:`p2p_diloco.core.standing`): who counts toward the group's quorum, and each contribution's
        weight ramp. Every call counts as one round of this learner's :class:`~p2p_diloco.core.bans.Bans`.
        """
        with self._lock:  # one round at a time
            # The previous round's exclusions become bans as this round starts, after that round logged them.
            self._bans.after_round(self._last_verdict, self.peer_id)
            self._last_verdict = None
            self._set_standing(standing or {})
            result = self._average(deltas, weight, metadata, version, fragment, grace, search_seconds)
            self._last_verdict = result.verdict
            return result

    def _accuse_refused(self, peers: Sequence[str], why: str) -> None:
        for peer in peers:
            self.accuse(str(peer), why)

    def accuse(self, peer: str, why: str) -> None:
        """Ban ``peer`` from this learner's next rounds (:meth:`p2p_diloco.core.bans.Bans.accuse`)."""
        self._bans.accuse(peer, self.peer_id, why)  # one dict assignment: no lock against a round in flight

    def round_quorum(self) -> int:
        """This round's quorum: K, and with ``cfg.quorum == "majority"`` more than half of the learners
        training as the swarm's records last showed them."""
        if self.cfg.quorum != "majority" or self.training_learners is None:
            return self.cfg.min_group_size
        return max(self.cfg.min_group_size, majority(self.training_learners()))

    def _set_quorum(self) -> None:
        """Matchmake with this round's quorum (a leader with fewer followers disbands rather than starts) and,
        with ``cfg.early_close``, start once everyone training is in the group."""
        quorum = self.round_quorum()  # K under a fixed quorum, as the averager was started with
        settled = time.monotonic() - self._started >= self.early_close_after
        close_at = (self.everyone_training() if self.cfg.early_close and self.everyone_training is not None
                    and settled else frozenset())
        if (quorum, close_at) != (self._quorum, self._close_at):
            self._averager.set_min_group_size(quorum, close_at)
            self._quorum, self._close_at = quorum, close_at

    def _set_standing(self, standing: Mapping[str, int]) -> None:
        """Judge the next round with ``standing`` (sent to the averager process when it changed)."""
        if standing != self._standing:
            self._averager.set_standing(dict(standing), self.cfg.established_after)
            self._standing = dict(standing)

    def _set_go_timeout(self) -> None:
        """Wait for a leader's go as long as our recent all-reduces say it may queue (:func:`go_timeout`)."""
        wait = go_timeout(self.cfg.request_timeout, self._allreduces, self.cfg.round_timeout)
        if wait > self.cfg.request_timeout:
            wait = float(math.ceil(wait))  # whole seconds: not a message to the averager process every round
        if wait != self._go_timeout:
            self._averager.set_go_timeout(wait)
            # One INFO line when the wait first grows past the configured one; its moves after it at DEBUG.
            first = self._go_timeout == self.cfg.request_timeout
            logger.log(logging.INFO if first else logging.DEBUG,
                       f"waiting up to {wait:.0f} s past a group's deadline for its leader's go (all-reduces took "
                       f"{statistics.median_high(self._allreduces) if self._allreduces else 0:.1f} s)")
            self._go_timeout = wait

    def _rules(self) -> Rules:
        rules = Rules(self.cfg.norm_outlier_factor, self.cfg.max_contribution_norm, self.cfg.aggregator,
                      direction_check=self.cfg.direction_check)
        return rules if self.limits is None else rules.bounded_by(*self.limits)

    def _gathered(self, deltas: Sequence[torch.Tensor], weight: float, metadata: dict[str, Any],
                  fragment: int) -> dict[str, Any]:
        """What this learner gathers to its group for one round."""
        if "norm" not in metadata:
            norm = global_norm(deltas)
            metadata = {**metadata, "norm": norm, "finite": math.isfinite(norm)}
        if self.cfg.direction_check and "direction" not in metadata:  # rule 3 of core/exclusion.py
            seed = f"{metadata.get('sha256', '')}:{fragment}"  # the state the round starts from: known to all
            metadata = {**metadata, "direction": directions.sketch(deltas, seed)}
        if self.step_tokens is not None:
            metadata = {**metadata, "step_tokens": int(self.step_tokens)}
        if self.cfg.quorum == "majority":
            round_ = int(metadata.get("version", 0)) + 1
            metadata = {**metadata, "quorum": self.faults.gathered_quorum(self._quorum, round_)}
        if self.established_training is not None:
            metadata = {**metadata, "established": int(self.established_training())}
        gathered = {**metadata, "fragment": fragment, "weight": float(weight), "rules": self._rules().gathered(),
                    "bans": self._bans.listed(), "reduces": not self.client_mode}
        key = getattr(self.dht, "signing", None)  # with signed records, the metadata is signed too
        return signed_metadata.sign(gathered, key) if key is not None else gathered

    def _average(self, deltas: Sequence[torch.Tensor], weight: float, metadata: dict[str, Any], version: int,
                 fragment: int, grace: float | None, search_seconds: float | None = None) -> AverageResult:
        assert self.fragments is not None  # set in __post_init__
        indices = self.fragments[fragment]
        with self._averager.get_tensors() as buffers:
            for i, d in zip(indices, deltas, strict=True):
                buffers[i].copy_(d)
        scheduled = None if grace is None else get_dht_time() + max(grace, self.cfg.matchmaking_time)
        self._averager.set_group_bits(group_bits(fragment, version))
        self._set_quorum()
        self._set_go_timeout()
        timeout = search_timeout(self.cfg.round_timeout, self.cfg.matchmaking_time, grace, search_seconds,
                                 longer_go=self._go_timeout - self.cfg.request_timeout)
        began = time.time()  # wall clock: the averager process stamps the group's forming with it
        control = self._averager.step(
            weight=float(weight), gather=self._gathered(deltas, weight, metadata, fragment), timeout=timeout,
            scheduled_time=scheduled, wait=False,
            # A retry after a failed all-reduce would re-enter matchmaking with hivemind's randomized
            # group bits and could pair us with learners at other versions: one attempt per round.
            allow_retries=False,
        )
        self._control = control
        self._watch_for_newer_version(control, fragment, version + 1)
        try:
            result = control.result()
        except _STEP_FAILURES as e:  # hivemind raises a zoo of types here; all mean "no average"
            # A cancelled step's future is done at once, but its coroutine in the averager may still
            # be matchmaking; the next round's step would then share the matchmaker with it (seen in
            # a 2 Mbit/s benchmark run: a group of fragment 0 with a member gathering fragment 1).
            # Let it end first.
            _wait_until_finished(control, self._go_timeout + self.cfg.matchmaking_time)
            if control.cancelled() and self._superseded_by is not None:
                raise RoundSuperseded(f"the swarm moved on to version {self._superseded_by}") from None
            if isinstance(e, ExcludedFromRound):
                raise RoundFailed(str(e)) from None
            if isinstance(e, RefusedPeers):
                self._accuse_refused(e.peers, e.why)
            raise RoundFailed(f"{type(e).__name__}: {e}".strip()) from None
        if not result:
            raise RoundFailed("no group formed within the round window")
        with self._averager.get_tensors() as buffers:
            averaged = [buffers[i].clone() for i in indices]
        self.faults.fire("commit", version + 1, group=len(result["gathered"]))
        groupmates = {str(peer): data for peer, data in result["gathered"].items()}
        stats = result.get("stats", {})
        self._accuse_refused(stats.get("refused") or (), REFUSED_PARTS)
        self.on_received(int(stats.get("bytes_received", 0)))
        if "group_formed" in stats:
            self.on_matchmaking(max(0.0, float(stats["group_formed"]) - began))
        if math.isfinite(seconds := float(stats.get("seconds", 0.0))) and seconds > 0:
            self._allreduces.append(seconds)
        return AverageResult(
            deltas=averaged,
            groupmates=groupmates,
            allreduce_seconds=float(stats.get("seconds", 0.0)),
            bytes_sent=int(stats.get("bytes_sent", 0)),
            verdict=result.get("verdict") or Verdict(),
            sketch=stats.get("sketch"),
            sketch_key=str(stats.get("sketch_key") or ""),
        )

    def grouped(self) -> bool:
        """Whether the round in progress has found its group: its all-reduce began (hivemind's step control)."""
        control = self._control
        return control is not None and not control.done() and bool(control.began_allreduce)

    def searching_peers(self, fragment: int, version: int) -> int:
        """How many other peers are looking for a group at (``fragment``, ``version``) right now.

        Read from the DHT entries that hivemind's matchmaking declares under the group key while it
        searches (value True until the group forms or the search expires). Entries are peers' input:
        anything malformed is skipped.
        """
        found = self.dht.get(group_key(self.prefix, fragment, version), latest=True)
        if found is None:
            return 0
        ours, now, count = self.dht.peer_id, get_dht_time(), 0
        for peer, entry in declared(found.value, getattr(self.dht, "owner", b""), getattr(self.dht, "admission", None)):
            looking = getattr(entry, "value", None)
            expiration = getattr(entry, "expiration_time", 0.0)
            if peer != ours and looking is True and isinstance(expiration, int | float) and expiration > now:
                count += 1
        return count

    def _watch_for_newer_version(self, control, fragment: int, next_version: int) -> None:
        """Cancel matchmaking if the swarm already reached ``next_version``; never once all-reduce began."""
        self._superseded_by = None
        version = next_version - 1
        while not control.done():
            if not control.began_allreduce:
                # Before the first wait too: a group that closes once everyone is in forms within a poll.
                self.faults.fire("matchmaking", next_version)
            try:
                control.result(timeout=self.poll_seconds)
            except TimeoutError:
                pass
            except _STEP_FAILURES:  # the failure itself is reported by the caller
                return
            if control.done() or control.began_allreduce:
                return
            if self.should_stop() or self.gone() is not None:  # a matchmaker without its DHT never ends
                control.cancel()
                return
            if self.newest_version is None:
                continue
            newest = self.newest_version(fragment)
            if newest > version and not control.began_allreduce and control.cancel():
                self._superseded_by = newest
                return

    def download_state(self, timeout: float) -> Served | None:
        """Newest global state from the peers that serve it (highest version first), or None."""
        future = self._averager.load_state_from_peers(wait=False, timeout=timeout)
        return self._await_download(future, timeout)

    def download_state_from(
        self, peer: str, timeout: float, fragments: Sequence[int] | None = None
    ) -> Served | None:
        """The global state served by one given peer (only ``fragments``' tensors if given), or None."""
        future = self._averager.load_state_from_peer(peer, timeout, fragments)
        return self._await_download(future, timeout)

    def _await_download(self, future, timeout: float):
        try:
            # hivemind's own timeout is per chunk; bound the whole download here.
            loaded = future.result(timeout=timeout * 4)
        except _STEP_FAILURES as e:  # a slow or broken peer must not end the learner
            logger.warning(f"state download failed: {type(e).__name__}: {e}")
            future.cancel()
            return None
        loaded, received = loaded
        self.on_received(int(received))
        if loaded is None:
            return None
        metadata, tensors = loaded
        return metadata, list(tensors)

    def gone(self) -> str | None:
        """Which of this learner's hivemind processes has exited ("DHT" or "averager", with its exit code),
        or None while both run: without them nothing of this learner reaches the swarm any more."""
        for name, process in (("DHT", self.dht), ("averager", self._averager)):
            if not process.is_alive():
                return f"{name} process (exit code {process.exitcode})"
        return None

    def shutdown(self) -> None:
        """Shut the averager process down; a failure is logged at DEBUG, never raised."""
        try:
            self._averager.shutdown()
        except Exception as e:  # noqa: BLE001 - shutdown must not mask the caller's own exit path
            logger.debug(f"averager shutdown: {e!r}")


_FAILED_STEP_FUNCTIONS = ("_step", "_aggregate_with_group")  # hivemind's, where a failed step is logged


class _FailedStepToDebug(logging.Filter):
    """Demote hivemind's tracebacks of a failed averaging step to DEBUG: the step's
    (``DecentralizedAverager._step``) and its all-reduce's (``_aggregate_with_group``, logged before it is
    re-raised to the step); "could not find a group" is dropped altogether. Other errors get through as
    they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "could not find a group" in record.getMessage():
            return False
        if record.levelno >= logging.ERROR and record.exc_info and record.funcName in _FAILED_STEP_FUNCTIONS:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def _wait_until_finished(control, limit: float) -> None:
    deadline = time.monotonic() + limit
    while control.stage != AveragingStage.FINISHED and time.monotonic() < deadline:
        time.sleep(0.05)


def majority(learners: int) -> int:
    """The fewest learners that are more than half of ``learners``: two disjoint groups cannot both have it."""
    return learners // 2 + 1


def group_bits(fragment: int, version: int) -> str:
    """Group-key bits naming (fragment, version): a 16-bit fragment field, then the version."""
    return format(fragment, "016b") + format(version, "b")


def averaging_prefix(lineage: str) -> str:
    """The prefix of a lineage's averaging keys (matchmaking, download priority) and RPCs."""
    return f"{lineage}_outer"


def download_priority_key(lineage: str) -> str:
    """hivemind's "who serves state, with what priority" key of a lineage (signed: protected like progress)."""
    return download_key(averaging_prefix(lineage))


def group_key(prefix: str, fragment: int, version: int) -> str:
    """The DHT key under which hivemind's matchmaking declares searches at (fragment, version)."""
    return f"{prefix}.0b{group_bits(fragment, version)}"
