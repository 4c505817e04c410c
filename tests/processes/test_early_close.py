"""A leader starts its group's all-reduce once everyone training has joined (p2p_diloco/net/early_close.py):
three real averagers (DHT and averager processes, p2pd) form their group long before a 20 s window ends, and
with a fourth learner counted that never comes they wait the window out, as hivemind alone does."""

import threading

import hivemind
import pytest
import torch

from p2p_diloco.config import AveragingConfig
from p2p_diloco.net.averaging import HivemindAveraging


def _round(dhts, window: float, everyone: frozenset[str], prefix: str) -> list[float]:
    """One round of three averagers told that ``everyone`` (peer IDs) train; each one's matchmaking seconds."""
    cfg = AveragingConfig(min_group_size=2, target_group_size=16, matchmaking_time=window, request_timeout=1.0,
                          round_timeout=window + 20.0)
    seconds: list[list[float]] = [[] for _ in dhts]
    template = [torch.zeros(64)]
    members = [HivemindAveraging(d, template, cfg, prefix=prefix, everyone_training=lambda: everyone,
                                 on_matchmaking=seconds[i].append).start() for i, d in enumerate(dhts)]
    results: list = [None] * len(members)
    try:
        def go(i: int) -> None:
            results[i] = members[i].average([torch.full((64,), float(i))], 1.0, {"version": 0}, version=0)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(members))]
        [t.start() for t in threads]
        [t.join(window + 40) for t in threads]
    finally:
        for m in members:
            m.shutdown()
    assert all(r is not None and len(r.groupmates) == len(members) for r in results), results
    assert all(len(s) == 1 for s in seconds), seconds
    return [s[0] for s in seconds]


@pytest.mark.timeout(120)
def test_a_group_of_everyone_starts_before_its_window_ends():
    dhts = [hivemind.DHT(start=True)]
    dhts += [hivemind.DHT(initial_peers=dhts[0].get_visible_maddrs(), start=True) for _ in range(2)]
    try:
        ours = frozenset(str(d.peer_id) for d in dhts)
        early = _round(dhts, window=20.0, everyone=ours, prefix="early")
        assert max(early) < 10.0, early  # everyone was in: nobody waited the 20 s window
        absent = ours | {"QmAbsentLearnerThatTheRecordsStillShowTraining"}  # counted, and never comes
        waited = _round(dhts, window=4.0, everyone=absent, prefix="waited")
        assert min(waited) >= 3.0, waited  # the leader's window (4 s, from the step's start), as hivemind has it
    finally:
        for d in dhts:
            d.shutdown()
