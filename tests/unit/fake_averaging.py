"""An in-process stand-in for the network (the whole :class:`~p2p_diloco.core.averaging_api.Averaging` interface):
members of one group meet at a barrier; searches and served states are what the test sets. The group
leaves out contributions as the real one does (:func:`p2p_diloco.core.exclusion.judge` of what its members gathered)."""

from __future__ import annotations

import threading

import torch

from p2p_diloco.core.aggregators import aggregate
from p2p_diloco.core.averaging_api import AverageResult, RoundFailed, Served
from p2p_diloco.core.exclusion import Rules, Verdict, judge
from p2p_diloco.core.outer import weighted_mean


class FakeGroup:
    """``size`` members that call average() concurrently get the exact weighted mean of the contributions
    that ``rules`` do not exclude; an excluded member's round fails."""

    def __init__(self, size: int, rules: Rules | None = None):
        self.size = size
        self.rules = rules or Rules()
        self._barrier = threading.Barrier(size, timeout=10)
        self._lock = threading.Lock()
        self._inputs: dict[str, tuple] = {}
        self._result: list[torch.Tensor] | None = None
        self._verdict = Verdict()

    def member(self, name: str) -> FakeAveraging:
        return FakeAveraging(self, name)


class FakeAveraging:
    def __init__(self, group: FakeGroup | None = None, name: str = "me", fail: bool = False,
                 searching: dict[tuple[int, int], int] | None = None, serves: dict[str | None, Served] | None = None):
        self.group, self.name, self.fail = group, name, fail
        self.searching = searching or {}  # (fragment, version) → peers searching for a group there
        self.serves = serves or {}  # peer → what it serves (None: the answer to "any peer")
        self.priority: int | None = None
        self.looks = 0
        self.in_group = True  # what grouped() answers: a round in flight has found its group

    def set_state_priority(self, version: int) -> None:
        self.priority = version

    def grouped(self) -> bool:
        return self.in_group

    def searching_peers(self, fragment: int, version: int) -> int:
        self.looks += 1
        return self.searching.get((fragment, version), 0)

    def download_state(self, timeout: float) -> Served | None:
        return self.serves.get(None)

    def download_state_from(self, peer: str, timeout: float, fragments=None) -> Served | None:
        return self.serves.get(peer)

    def shutdown(self) -> None:
        pass

    def average(self, deltas, weight, metadata, version, fragment=0, grace=None, search_seconds=None, standing=None):
        if self.fail or self.group is None:
            raise RoundFailed("no group formed within the round window")
        g = self.group
        with g._lock:
            g._inputs[self.name] = ([d.clone() for d in deltas], weight, {**metadata, "weight": float(weight)})
        g._barrier.wait()
        with g._lock:
            if g._result is None:
                gathered = {n: v[2] for n, v in g._inputs.items()}
                g._verdict = verdict = judge(gathered, g.rules)
                names = verdict.contributors(gathered)
                clipped = [[d * verdict.part_scale(n) for d in g._inputs[n][0]] for n in names]
                weights = [verdict.weights[n] for n in names]
                if not names:
                    g._result = []
                elif verdict.aggregator == "mean":
                    g._result = weighted_mean(clipped, weights)
                else:
                    g._result = [aggregate([c[i] for c in clipped], weights, verdict.aggregator)
                                 for i in range(len(clipped[0]))]
        g._barrier.wait()
        result = AverageResult(
            deltas=[t.clone() for t in g._result],
            groupmates={n: v[2] for n, v in g._inputs.items()},
            allreduce_seconds=0.0,
            bytes_sent=0,
            verdict=g._verdict,
        )
        if g._barrier.wait() == 0:
            g._inputs, g._result = {}, None
        g._barrier.wait()
        if self.name in result.verdict.excluded:
            raise RoundFailed(f"excluded {self.name} from fragment {fragment} version {version}: "
                              f"{result.verdict.excluded[self.name].why}")
        return result
