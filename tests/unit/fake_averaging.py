"""An in-process stand-in for the network: members of one group meet at a barrier."""

from __future__ import annotations

import threading

import torch

from p2p_diloco.averaging import AverageResult, RoundFailed
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
    def __init__(self, group: FakeGroup, name: str, fail: bool = False):
        self.group, self.name, self.fail = group, name, fail

    def average(self, deltas, weight, metadata, version, fragment=0, grace=None):
        if self.fail:
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
