"""What a learner measures about itself: Prometheus metrics, and the resource fields of its progress record.

:class:`Metrics` mirrors the learner's :class:`~p2p_diloco.learner.state.Counters` and its rounds' outcomes
into a private ``CollectorRegistry``, served over HTTP when ``run.metrics_port`` is set (``--metrics-port``),
on all interfaces. Every name starts with ``p2p_diloco_``. The learner updates it after each progress
line, each outer step and each round; the averaging reports each round's matchmaking time, the audit log
the refusals it records and the progress heartbeat the learners it sees (startup.py wires them); a scrape
never waits for the training loop.

Example::

    m = Metrics()
    m.round(0, outcome)                  # after a round ends
    m.update(state, train_loss=3.2)      # after a progress line
    m.registry.get_sample_value("p2p_diloco_inner_steps_total")
"""

from __future__ import annotations

import collections
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

from p2p_diloco.errors import LearnerError
from p2p_diloco.net.progress_records import MAX_ADDRESS, MAX_EXCLUDED

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from p2p_diloco.learner.round import RoundOutcome
    from p2p_diloco.learner.state import Counters, LearnerState
    from p2p_diloco.train.trainer import Trainer

# Counters fields exported as Prometheus counters (name without the prefix and _total, help).
_TOTALS = {
    "inner_steps": "inner steps taken",
    "tokens": "tokens trained on (all workers of the unit)",
    "bytes_sent": "bytes sent by outer rounds",
    "bytes_received": "bytes received by outer rounds and state downloads",
    "compute_seconds": "wall time inside inner steps",
    "wait_seconds": "wall time blocked on a round",
    "download_seconds": "wall time of background state downloads",
    "syncs": "global states downloaded from peers",
    "merges": "sibling lineages merged (split brain)",
    "heals": "inner steps whose loss was not finite: the learner took the global state back",
    "loss_rises": "evals more than run.loss_rise_alert above the previous one",
}
EXCLUSION_ROUNDS = 20  # the rounds a progress record's ``excluded`` looks back on
_ROUND_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
# Audit events that are refusals of what a peer sent or said, counted by kind (besides the round's exclusions).
REFUSALS = ("download_rejected", "distrusted")


class Metrics:
    """The learner's Prometheus metrics, in a registry of its own (:attr:`registry`)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self._totals = {k: Counter(f"p2p_diloco_{k}", h, registry=r) for k, h in _TOTALS.items()}
        self._seen: dict[str, float] = dict.fromkeys(_TOTALS, 0.0)
        self._rounds = Counter("p2p_diloco_rounds", "outer rounds ended, by fragment and outcome",
                               ["fragment", "outcome"], registry=r)
        self._version = Gauge("p2p_diloco_version", "global version held, by fragment", ["fragment"], registry=r)
        self._group = Gauge("p2p_diloco_group_size", "contributors of the last round", registry=r)
        self._train_loss = Gauge("p2p_diloco_train_loss", "mean train loss of the last progress line", registry=r)
        self._eval_loss = Gauge("p2p_diloco_eval_loss", "last eval loss of the local model", registry=r)
        self._lr = Gauge("p2p_diloco_inner_lr", "inner learning rate", registry=r)
        self._round_time = Histogram("p2p_diloco_round_seconds", "outer round wall time", registry=r,
                                     buckets=_ROUND_BUCKETS)
        self._allreduce_time = Histogram("p2p_diloco_allreduce_seconds", "all-reduce wall time", registry=r,
                                         buckets=_ROUND_BUCKETS)
        self._matchmaking_time = Histogram("p2p_diloco_matchmaking_seconds",
                                           "from a round's start to its group forming (rounds that averaged)",
                                           registry=r, buckets=_ROUND_BUCKETS)
        self._refusals = Counter("p2p_diloco_refusals", "peers' contributions, states or claims refused, by kind",
                                 ["kind"], registry=r)
        for kind in (*REFUSALS, "excluded"):  # present at 0 from the first scrape
            self._refusals.labels(kind=kind)
        self._peers = Gauge("p2p_diloco_peers_visible", "other live learners in the last records read", registry=r)
        self._dht_calls = Counter("p2p_diloco_dht_calls", "unary RPCs of the DHT process (p2p_diloco/net/traffic.py), "
                                  "by RPC and kind (made, failed, served)", ["rpc", "kind"], registry=r)
        self._dht_bytes = Counter("p2p_diloco_dht_bytes", "protobuf bytes of those RPCs, by RPC and direction",
                                  ["rpc", "direction"], registry=r)
        self._dht_seen: dict[tuple[str, str], int] = {}
        self._info = Info("p2p_diloco_learner", "who this learner is", registry=r)
        self.last_eval_loss: float | None = None
        # The peers each of this learner's last EXCLUSION_ROUNDS rounds left out (ids' last 8 characters).
        self._excluded_recent: collections.deque[frozenset[str]] = collections.deque(maxlen=EXCLUSION_ROUNDS)

    def serve(self, port: int, addr: str = "0.0.0.0") -> Callable[[], None]:
        """Serve the metrics on ``addr:port`` from a daemon thread; returns the function that stops it.
        A port in use is one :class:`LearnerError` line."""
        try:
            server, _thread = start_http_server(port, addr, registry=self.registry)
        except OSError as e:
            raise LearnerError(f"run.metrics_port {port}: cannot serve metrics there ({e.strerror or e}); "
                               "pick a free port") from None

        def stop() -> None:
            server.shutdown()
            server.server_close()

        return stop

    def describe(self, **labels: str) -> None:
        """Set the info metric (run id, lineage, peer id, codec, package version)."""
        self._info.info(labels)

    def update(self, state: LearnerState, train_loss: float | None = None, eval_loss: float | None = None,
               lr: float | None = None) -> None:
        """Bring the counters and versions up to ``state``'s; set the losses and lr given."""
        c = state.counters
        for name, counter in self._totals.items():
            now = float(getattr(c, name))
            if now > self._seen[name]:
                counter.inc(now - self._seen[name])
                self._seen[name] = now
        for f, s in enumerate(state.states):
            self._version.labels(fragment=str(f)).set(s.version)
        if train_loss is not None:
            self._train_loss.set(train_loss)
        if eval_loss is not None:
            self._eval_loss.set(eval_loss)
            self.last_eval_loss = eval_loss
        if lr is not None:
            self._lr.set(lr)

    def round(self, fragment: int, out: RoundOutcome) -> None:
        """Count a round that ended (committed or not) and observe its times and group."""
        self._rounds.labels(fragment=str(fragment), outcome="committed" if out.committed else "failed").inc()
        self._round_time.observe(out.round_seconds)
        if out.allreduce_seconds > 0:
            self._allreduce_time.observe(out.allreduce_seconds)
        self._group.set(out.group_size)
        if out.excluded:
            self._refusals.labels(kind="excluded").inc(len(out.excluded))
        self._excluded_recent.append(frozenset(p[-8:] for p in out.excluded))

    def recent_exclusions(self) -> tuple[tuple[str, int], ...]:
        """The peers this learner's last rounds left out and in how many of them, most often first (at most
        :data:`~p2p_diloco.net.progress_records.MAX_EXCLUDED`): its progress record shows them to `status`."""
        counts = collections.Counter(p for peers in self._excluded_recent for p in peers)
        return tuple(sorted(counts.items(), key=lambda pc: (-pc[1], pc[0]))[:MAX_EXCLUDED])

    def matchmaking(self, seconds: float) -> None:
        """A round's group formed ``seconds`` after it started looking (the averaging's ``on_matchmaking``)."""
        self._matchmaking_time.observe(seconds)

    def audited(self, event: str, fields: dict[str, Any]) -> None:
        """An audit event (the audit log's ``on_record``): the refusals among them are counted by kind."""
        if event in REFUSALS:
            self._refusals.labels(kind=event).inc()

    def dht_traffic(self, snapshot: dict[str, dict[str, int]]) -> None:
        """Bring the DHT RPC counters up to ``snapshot`` (:func:`~p2p_diloco.net.traffic.read_traffic`). Counts
        that went down come from a DHT started again (a client's): they count from zero."""
        for rpc, fields in snapshot.items():
            for field, value in fields.items():
                kind = field.removeprefix("calls_").removeprefix("bytes_")
                counter = (self._dht_calls.labels(rpc=rpc, kind=kind) if field.startswith("calls_")
                           else self._dht_bytes.labels(rpc=rpc, direction=kind))
                before = self._dht_seen.get((rpc, field), 0)
                if value != before:
                    counter.inc(value - before if value > before else value)
                    self._dht_seen[(rpc, field)] = value

    def peers_visible(self, count: int) -> None:
        """How many other live learners the last read of the swarm's records showed."""
        self._peers.set(count)


def first_address(dht: Any) -> str:
    """The first of the DHT's visible multiaddrs that a progress record can carry (printable, at most
    :data:`~.progress_records.MAX_ADDRESS` characters); "" if none is (hivemind raises when it has none)."""
    try:
        maddrs: Iterable[object] = dht.get_visible_maddrs()
    except Exception as e:  # noqa: BLE001 - an address is shown by `status`, never needed to train
        logger.debug(f"no visible address for the progress record: {e!r}")
        return ""
    return next((a for a in map(str, maddrs) if len(a) <= MAX_ADDRESS and a.isprintable()), "")


def resources(trainer: Trainer, counters: Counters, started: float, metrics: Metrics,
              reach: str = "", address: str = "") -> dict[str, Any]:
    """The resource fields of this learner's progress record (:class:`~p2p_diloco.net.progress_records.ProgressRecord`):
    its hardware, throughput, contribution, traffic and uptime (``started``: its ``time.monotonic()`` at start),
    how peers reach it (``reach``: a :class:`~p2p_diloco.net.reach.Reach`'s ``record_value``) and where
    (``address``: :func:`first_address`)."""
    c, placement = counters, trainer.placement
    fragments = max(1, len(c.tokens_since_merge))
    busy = c.compute_seconds + c.wait_seconds
    loss = metrics.last_eval_loss  # a diverged loss is left out: readers refuse a record that holds one
    loss = loss if loss is not None and math.isfinite(loss) and 0 <= loss < 1e6 else None
    return {
        "device_kind": placement.device.type, "device_name": placement.name[:128], "workers": trainer.workers,
        "cpu_cores": os.cpu_count() or 0, "tokens_per_second": c.tokens / busy if busy > 0 else 0.0,
        "tokens_contributed": max(0, round(c.tokens - sum(c.tokens_since_merge) / fragments)),
        "bytes_sent": c.bytes_sent, "bytes_received": c.bytes_received, "uptime": time.monotonic() - started,
        "eval_loss": loss, "reach": reach, "address": address, "excluded": metrics.recent_exclusions(),
        "heals": counters.heals, "loss_rises": counters.loss_rises,
    }
