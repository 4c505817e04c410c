"""A hostile peer on the wire: every malformed part and reply of the trust issue's list, over real p2pd.

Three hivemind averagers in one process; member 2 sends each outer-gradient part and returns each
averaged shard malformed, one kind per round (``malform at round R with KIND``, p2p_diloco/sim/malformed.py).
The honest members refuse every one: the round fails (an all-reduce with a refused part cannot
complete) and names the hostile peer, never an honest one, so that learners ban it from their next
rounds; no member takes a non-finite or unbounded value, their averager processes neither die nor
grow, and afterwards they average exactly.
"""

import threading

import hivemind
import psutil
import pytest
import torch

from p2p_diloco.config import AveragingConfig
from p2p_diloco.core.averaging_api import RoundFailed
from p2p_diloco.net.averaging import HivemindAveraging
from p2p_diloco.sim.faults import FaultPlan
from p2p_diloco.sim.malformed import KINDS


def _round(members, deltas, weights, version):
    results: list = [None] * len(members)

    def go(i):
        norm = float(torch.cat([t.flatten() for t in deltas[i]]).norm())
        meta = {"version": version, "norm": norm, "finite": True, "weight": weights[i]}
        try:
            results[i] = members[i].average(deltas[i], weights[i], meta, version=version)
        except RoundFailed as e:
            results[i] = str(e)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(members))]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    return results


@pytest.mark.timeout(400)
def test_every_malformed_part_and_reply_is_refused_and_the_honest_members_average_on():
    cfg = AveragingConfig(min_group_size=2, target_group_size=3, matchmaking_time=1.5, request_timeout=1.0,
                          round_timeout=20.0, allreduce_timeout=10.0, next_chunk_timeout=5.0, ban_rounds=0)
    template = [torch.zeros(600_000), torch.zeros(7)]  # two of hivemind's 512 KiB parts per shard
    plan = FaultPlan.parse("; ".join(f"malform at round {v + 1} with {kind}" for v, kind in enumerate(KINDS)))
    dhts = [hivemind.DHT(start=True)]
    dhts += [hivemind.DHT(initial_peers=dhts[0].get_visible_maddrs(), start=True) for _ in range(2)]
    members = [HivemindAveraging(d, template, cfg, prefix="hostile", codecs=["none"], faults=p).start()
               for d, p in zip(dhts, [FaultPlan(), FaultPlan(), plan], strict=True)]
    g = torch.Generator().manual_seed(5)
    deltas = [[torch.randn(*t.shape, generator=g) * (i + 1) for t in template] for i in range(3)]
    weights = [1.0, 3.0, 2.0]
    honest_pids = [m._averager.pid for m in members[:2]]
    rss = [psutil.Process(pid).memory_info().rss for pid in honest_pids]
    hostile, honest = members[2].peer_id[-6:], [m.peer_id[-6:] for m in members[:2]]
    try:
        for version, kind in enumerate(KINDS):
            results = _round(members, deltas, weights, version)
            named = False
            for r in results[:2]:
                assert r is not None, (kind, results)  # every honest call ended: failed or averaged
                if isinstance(r, str):
                    refused = r.partition("(refused what ")[2]
                    assert not any(p in refused for p in honest), (kind, r)  # nobody honest is blamed
                    named = named or hostile in refused
                else:  # averaged without the hostile peer's parts, or with them checked
                    assert all(torch.isfinite(t).all() for t in r.deltas), kind
            # The hostile peer is named, and so banned by a learner with averaging.ban_rounds > 0. Parts
            # that stop early are not always told from a sender whose round failed first: not required.
            assert named or kind == "missing-part", (kind, results[:2])
            assert all(psutil.pid_exists(pid) for pid in honest_pids), kind
        grown = [psutil.Process(pid).memory_info().rss - before for pid, before in zip(honest_pids, rss, strict=True)]
        assert max(grown) < 512 * 2**20, grown  # nothing sized by what a message claimed (block-huge: 64 GiB)

        # The honest members go on: exactly their weighted mean.
        results = _round(members[:2], deltas[:2], weights[:2], len(KINDS))
        want = [(deltas[0][j] * weights[0] + deltas[1][j] * weights[1]) / sum(weights[:2]) for j in range(2)]
        for r in results:
            assert not isinstance(r, str), results
            assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(r.deltas, want, strict=True))
    finally:
        for m in members:
            m.shutdown()
        for d in dhts:
            d.shutdown()
