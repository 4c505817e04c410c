"""Checking the reducers with real hivemind averagers: honest shards pass, a lying reducer is caught,
under the mean (projections) and the median (spot values and the norm bound).

Three averagers in one process run two rounds; from the second on, member 2 returns the shard it
reduces scaled by −50 (``lie at round 5 with shard``, p2p_diloco/sim/faults.py). Every member's sketch
(p2p_diloco/core/shard_sketches.py) is checked against the others', as the commit board does before signing.
"""

import threading

import hivemind
import pytest
import torch

from p2p_diloco.config import AveragingConfig
from p2p_diloco.core import shard_sketches
from p2p_diloco.core.averaging_api import RoundFailed
from p2p_diloco.net.averaging import HivemindAveraging
from p2p_diloco.sim.faults import FaultPlan


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("codec", "aggregator"), [("none", "mean"), ("int8", "mean"), ("int8", "median")])
def test_honest_shards_pass_and_a_lying_reducer_is_named_by_every_member(codec, aggregator):
    cfg = AveragingConfig(min_group_size=3, target_group_size=3, matchmaking_time=2.0, request_timeout=1.0,
                          round_timeout=30.0, ban_rounds=0, aggregator=aggregator)
    template = [torch.zeros(1500, 1000), torch.zeros(9)]  # int8: three parts of hivemind's 512 KiB, one per member
    dhts = [hivemind.DHT(start=True)]
    dhts += [hivemind.DHT(initial_peers=dhts[0].get_visible_maddrs(), start=True) for _ in range(2)]
    plans = [FaultPlan(), FaultPlan(), FaultPlan.parse("lie at round 5 with shard")]
    members = [HivemindAveraging(d, template, cfg, prefix="sketch", codecs=[codec], faults=plan).start()
               for d, plan in zip(dhts, plans, strict=True)]
    g = torch.Generator().manual_seed(11)
    deltas = [[torch.randn(*t.shape, generator=g) * (i + 1) for t in template] for i in range(3)]
    weights = [1.0, 2.0, 3.0]
    norms = [float(torch.cat([t.flatten() for t in d]).norm()) for d in deltas]
    try:
        for version, liar in ((3, None), (4, members[2].peer_id)):
            results: list = [None] * 3

            def go(i, results=results, version=version):
                meta = {"version": version, "norm": norms[i], "finite": True, "weight": weights[i]}
                try:
                    results[i] = members[i].average(deltas[i], weights[i], meta, version=version)
                except RoundFailed as e:
                    results[i] = str(e)

            threads = [threading.Thread(target=go, args=(i,)) for i in range(3)]
            [t.start() for t in threads]
            [t.join(60) for t in threads]
            assert all(not isinstance(r, str) and r is not None for r in results), results
            assert all(r.sketch is not None and len(r.sketch["shards"]) == 3 for r in results), \
                [r.sketch["shards"] for r in results]
            peers = [m.peer_id for m in members]
            sketches = {p: r.sketch for p, r in zip(peers, results, strict=True)}
            verdict = results[0].verdict
            counted = {p: verdict.weights.get(p, w) for p, w in zip(peers, weights, strict=True)}
            bounds = {p: 1.1 * n for p, n in zip(peers, norms, strict=True)}
            for r in results:
                why, reducer = shard_sketches.first_mismatch(r.sketch, sketches, counted, bounds)
                if liar is None:
                    assert why == "" and reducer is None, (codec, why)
                else:
                    assert reducer == liar and f"the shard reduced by {liar[-6:]} does not match" in why, (codec, why)
            # The lie reached everyone alike: the same (wrong) bytes at every member.
            for r in results[1:]:
                assert all(torch.equal(a, b) for a, b in zip(r.deltas, results[0].deltas, strict=True))
    finally:
        for m in members:
            m.shutdown()
        for d in dhts:
            d.shutdown()
