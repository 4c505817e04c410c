"""Learners peers cannot dial (behind NAT, or told to be clients) still train with the swarm.

On loopback a learner that announces an address which is not its own stands for one behind NAT: its
questions come from 127.0.0.1, so peers answering the reachability check (p2p_diloco/net/reach.py) refuse
to dial the announced address, and with ``network.client_mode=auto`` it runs as a client. The namespace
simulator's NAT'd region (test_regions.py) checks the same behind a real masquerading gateway.
"""

import re
import signal

import pytest

from p2p_diloco.sim.processes import wait_until

from .harness import committed_version
from .test_swarm import _assert_one_lineage

TARGET = 4


def _committed_rounds(text: str) -> int:
    return len(re.findall(r"outer round committed \| version \d+", text))


@pytest.mark.timeout(300)
def test_clients_train_with_the_swarm_and_auto_finds_an_unreachable_learner(swarm):
    swarm.start_bootstrap()
    told = swarm.start_learner(2, max_outer_steps=TARGET, extra=["--set", "network.client_mode=true"])
    # Announces a documentation address (TEST-NET-3) instead of its own: unreachable there.
    natted = swarm.start_learner(3, max_outer_steps=TARGET,
                                 extra=["--announce-maddrs", "/ip4/203.0.113.9/tcp/41999"])
    # The clients start first: a client's start (the reachability check, a DHT restarted in client
    # mode) takes longer, and on a loaded machine a client that starts last can stay a round behind
    # until the swarm reaches TARGET (CI on d664453: 0 rounds committed). Early, its first round finds
    # no leader and it re-phases into the direct learners' rounds.
    for p in (told, natted):
        wait_until(lambda p=p: "reachable:" in p.text(), 120, p, f"{p.name}'s reachability verdict")
    direct = [swarm.start_learner(i, max_outer_steps=TARGET) for i in range(2)]
    for p in [*direct, told, natted]:
        assert p.wait(240) == 0, p.text()
    summaries = _assert_one_lineage(swarm, range(4), TARGET)
    for s in summaries:
        assert s["last_eval_loss"] < s["first_eval_loss"] - 0.5, s
    for p in direct:
        assert "reachable: direct (dialled back by 1 of 1 peer(s))" in p.text(), p.text()[-3000:]
    assert "reachable: client only (network.client_mode = true)" in told.text(), told.text()[-3000:]
    assert "reachable: client only (1 peer(s) could not dial us)" in natted.text(), natted.text()[-3000:]
    for p in (told, natted):
        # Its outer gradients were merged: it was a member of committed rounds, as a sender only.
        assert _committed_rounds(p.text()) >= 1, p.text()[-3000:]
        assert "a client serves no state" in p.text(), p.text()[-3000:]


@pytest.mark.timeout(300)
def test_clients_download_fragments_and_leave_with_a_parting_round(swarm):
    """Two fragments: a client that joins late downloads them from reachable learners; a client that
    is told to stop hands its steps over in a parting round, as a sender."""
    settings = ["--set", "sync.fragments=2", "--set", "sync.overlap_steps=2"]
    client = [*settings, "--set", "network.client_mode=true"]
    target = 10
    swarm.start_bootstrap()
    direct = [swarm.start_learner(i, max_outer_steps=target, extra=settings) for i in range(2)]
    leaver = swarm.start_learner(2, max_outer_steps=100, extra=client)
    wait_until(lambda: committed_version(direct[0]) >= 1, 150, direct[0], "version 1")
    late = swarm.start_learner(3, max_outer_steps=target, extra=client)
    wait_until(lambda: committed_version(leaver) >= 3, 150, leaver, "the client at version 3")
    leaver.popen.send_signal(signal.SIGTERM)
    assert leaver.wait(90) == 0, leaver.text()
    for p in [*direct, late]:
        assert p.wait(240) == 0, p.text()
    summaries = [swarm.summary(i) for i in (0, 1, 3)]
    assert len({s["global_state_sha256"] for s in summaries}) == 1, summaries
    assert all(s["versions"] == [target, target] for s in summaries), summaries
    assert swarm.summary(3)["syncs"] >= 1 and "synced global state" in late.text(), late.text()[-3000:]
    assert _committed_rounds(late.text()) >= 1, late.text()[-3000:]
    gone = swarm.summary(2)
    assert gone["outer_steps"] >= 2, gone
