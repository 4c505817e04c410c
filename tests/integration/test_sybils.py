"""Fresh identities of one attacker, from one address, beside three honest learners (docs/security.md,
"Identities that cost something").

Real learners over real p2pd daemons, and a test-only peer (``p2p_diloco.sim.sybils``): one DHT node that
announces 4 fresh keys as learners training at the swarm's version and never joins a round. Counted as
identities, the 7 need groups of 4 and the 3 honest learners stall (``benchmarks/sybil_stall.py`` measures
both sides); counted by standing (certified rounds contributed to), the keys are nobody.
"""

import sys

import pytest

from p2p_diloco.sim.processes import Proc
from p2p_diloco.trust.admission import peer_id_of

from .harness import audit_events
from .test_swarm import _assert_one_lineage

TARGET = 7
# Two certified rounds establish a learner (fast enough for a test); the keys' records say "training", so the
# honest learners linger for the whole linger time once done: a shorter one than the harness's.
SETTINGS = ["--set", "averaging.established_after=2", "--set", "run.linger_seconds=15.0"]


@pytest.mark.timeout(300)
def test_fresh_identities_from_one_address_do_not_stall_the_swarm(swarm):
    swarm.start_bootstrap()
    honest = [swarm.start_learner(i, max_outer_steps=TARGET, extra=SETTINGS) for i in range(3)]
    # Started with the learners (its start takes as long as theirs); it announces the keys from version 3 on,
    # once each honest learner holds 2 certified rounds or is about to.
    sybils = Proc("sybils", [sys.executable, "-m", "p2p_diloco.sim.sybils", "--initial-peers",
                             str(swarm.bootstrap_addr), "--identities", "4", "--seconds", "200", "--ttl", "8",
                             "--from-version", "3"], swarm.tmp / "sybils.log")
    swarm.procs.append(sybils)
    for p in honest:
        assert p.wait(240) == 0, p.text()
    _assert_one_lineage(swarm, range(3), TARGET)
    honest_ids = {peer_id_of(swarm.tmp / f"ckpt-{i}" / "identity.key", create=False) for i in range(3)}
    # The honest learners saw the four keys as learners (their records), and committed past them.
    seen = {e["peer"] for p in honest for e in audit_events(p, "peer_joined")} - honest_ids
    assert len(seen) >= 4, sybils.text()
    joined = {p.name: min((e["time"] for e in audit_events(p, "peer_joined") if e["peer"] in seen), default=None)
              for p in honest}
    after = {p.name: [e for e in audit_events(p, "committed") if e["time"] > (joined[p.name] or 1e18)]
             for p in honest}
    assert all(len(commits) >= 2 for commits in after.values()), (joined, after)  # not stalled by the keys
    assert not any(set(e["contributors"]) & seen for commits in after.values() for e in commits), (after, seen)
    sybils.kill_group()
