"""An in-process stand-in for the network (the whole :class:`~p2p_diloco.averaging.Averaging` interface):
members of one group meet at a barrier; searches and served states are what the test sets."""

from __future__ import annotations

import threading

import torch

from p2p_diloco.averaging import AverageResult, RoundFailed, Served
from p2p_diloco.outer import weighted_mean


class FakeGroup:
    """``size`` members that call average() concurrently get the exact weighted mean."""

    def __init__(self, size: int):
        self.size = size
        self._barrier = threading.Barrier(size, timeout=10)
        self._lock = threading.Lock()
        self._inputs: dict[str, tuple] = {}
        self._result: list[torch.Tensor] | None = None

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

    def set_state_priority(self, version: int) -> None:
        self.priority = version

    def searching_peers(self, fragment: int, version: int) -> int:
        self.looks += 1
        return self.searching.get((fragment, version), 0)

    def download_state(self, timeout: float) -> Served | None:
        return self.serves.get(None)

    def download_state_from(self, peer: str, timeout: float, fragments=None) -> Served | None:
        return self.serves.get(peer)

    def shutdown(self) -> None:
        pass

    def average(self, deltas, weight, metadata, version, fragment=0, grace=None):
        if self.fail or self.group is None:
            raise RoundFailed("no group formed within the round window")
        g = self.group
        with g._lock:
            g._inputs[self.name] = ([d.clone() for d in deltas], weight, dict(metadata))
        g._barrier.wait()
        with g._lock:
            if g._result is None:
                names = sorted(g._inputs)
                g._result = weighted_mean([g._inputs[n][0] for n in names], [g._inputs[n][1] for n in names])
        g._barrier.wait()
        result = AverageResult(
            deltas=[t.clone() for t in g._result],
            groupmates={n: v[2] for n, v in g._inputs.items()},
            allreduce_seconds=0.0,
            bytes_sent=0,
        )
        if g._barrier.wait() == 0:
            g._inputs, g._result = {}, None
        g._barrier.wait()
        return result
