"""What a learner measures about itself: Prometheus metrics, and the resource fields of its progress record.

:class:`Metrics` mirrors the learner's :class:`~p2p_diloco.learner_state.Counters` and its rounds' outcomes
into a private ``CollectorRegistry``, served over HTTP when ``run.metrics_port`` is set (``--metrics-port``),
on all interfaces. Every name starts with ``p2p_diloco_``. The learner updates it after each progress
line, each outer step and each round; a scrape never waits for the training loop.

Example::

    m = Metrics()
    m.round(0, outcome)                  # after a round ends
    m.update(state, train_loss=3.2)      # after a progress line
    m.registry.get_sample_value("p2p_diloco_inner_steps_total")
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

from p2p_diloco.errors import LearnerError

if TYPE_CHECKING:
    from p2p_diloco.learner_state import Counters, LearnerState
    from p2p_diloco.round import RoundOutcome
    from p2p_diloco.trainer import Trainer

# Counters fields exported as Prometheus counters (name without the prefix and _total, help).
_TOTALS = {
    "inner_steps": "inner steps taken",
    "tokens": "tokens trained on (all workers of the unit)",
    "bytes_sent": "bytes sent by outer rounds",
    "compute_seconds": "wall time inside inner steps",
    "wait_seconds": "wall time blocked on a round",
    "download_seconds": "wall time of background state downloads",
    "syncs": "global states downloaded from peers",
    "merges": "sibling lineages merged (split brain)",
}
_ROUND_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


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
        self._info = Info("p2p_diloco_learner", "who this learner is", registry=r)
        self.last_eval_loss: float | None = None

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


def resources(trainer: Trainer, counters: Counters, started: float, metrics: Metrics,
              reach: str = "") -> dict[str, Any]:
    """The resource fields of this learner's progress record (:class:`~p2p_diloco.records.ProgressRecord`):
    its hardware, throughput, contribution, traffic and uptime (``started``: its ``time.monotonic()`` at start),
    and how peers reach it (``reach``: a :class:`~p2p_diloco.reach.Reach`'s ``record_value``)."""
    c, placement = counters, trainer.placement
    fragments = max(1, len(c.tokens_since_merge))
    busy = c.compute_seconds + c.wait_seconds
    loss = metrics.last_eval_loss  # a diverged loss is left out: readers refuse a record that holds one
    loss = loss if loss is not None and math.isfinite(loss) and 0 <= loss < 1e6 else None
    return {
        "device_kind": placement.device.type, "device_name": placement.name[:128], "workers": trainer.workers,
        "cpu_cores": os.cpu_count() or 0, "tokens_per_second": c.tokens / busy if busy > 0 else 0.0,
        "tokens_contributed": max(0, round(c.tokens - sum(c.tokens_since_merge) / fragments)),
        "bytes_sent": c.bytes_sent, "uptime": time.monotonic() - started, "eval_loss": loss, "reach": reach,
    }
