"""Fresh identities of one attacker, from one address, beside three honest learners (docs/security.md,
"Identities that cost something").

Real learners over real p2pd daemons, and a test-only peer (``p2p_diloco.sim.sybils``): one DHT node that
announces 4 fresh keys as learners training at the swarm's version and never joins a round. Counted as
identities, the 7 need groups of 4 and the 3 honest learners stall (``benchmarks/sybil_stall.py`` measures
both sides); counted by standing (certified rounds contributed to), the keys are nobody.
"""

import sys
import time

import pytest

from p2p_diloco.sim.processes import Proc
from p2p_diloco.trust.admission import peer_id_of

from .harness import audit_events, committed_version
from .test_swarm import _assert_one_lineage

TARGET = 10
ESTABLISHED = ["--set", "averaging.established_after=2"]  # two certified rounds: fast enough for a test


@pytest.mark.timeout(300)
def test_fresh_identities_from_one_address_do_not_stall_the_swarm(swarm):
    swarm.start_bootstrap()
    honest = [swarm.start_learner(i, max_outer_steps=TARGET, extra=ESTABLISHED) for i in range(3)]
    honest_ids = {peer_id_of(swarm.tmp / f"ckpt-{i}" / "identity.key") for i in range(3)}
    deadline = time.monotonic() + 150
    while min(committed_version(p) for p in honest) < 3:  # each honest learner holds 2+ certified rounds
        assert time.monotonic() < deadline and all(p.popen.poll() is None for p in honest), swarm.describe()
        time.sleep(1)
    sybils = Proc("sybils", [sys.executable, "-m", "p2p_diloco.sim.sybils", "--initial-peers",
                             str(swarm.bootstrap_addr), "--identities", "4", "--seconds", "200", "--ttl", "8"],
                  swarm.tmp / "sybils.log")
    swarm.procs.append(sybils)
    for p in honest:
        assert p.wait(240) == 0, p.text()
    _assert_one_lineage(swarm, range(3), TARGET)
    # The honest learners saw the four keys as learners (their records), and committed past them.
    seen = {e["peer"] for p in honest for e in audit_events(p, "peer_joined")} - honest_ids
    assert len(seen) >= 4, sybils.text()
    after = [e for p in honest for e in audit_events(p, "committed") if e["version_after"] > 4]
    assert after, [committed_version(p) for p in honest]
    assert not any(set(e["contributors"]) & seen for e in after), (after, seen)
    sybils.kill_group()
