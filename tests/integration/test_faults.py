"""A learner dies or freezes at every stage of its life; the others carry on with one lineage.

Each case is one line of the fault plan (p2p_diloco/sim/faults.py) given to learner 2.
"""

import os
import re
import signal

import psutil
import pytest

from p2p_diloco.sim.processes import processes_in_group, wait_until
from p2p_diloco.train.checkpoint import load_checkpoint

from .harness import SURVIVOR, audit_events, committed_version, eval_losses
from .test_swarm import _assert_one_lineage

TARGET = 4


def _survivors_finish(swarm, learners, victim_index=2):
    for i, p in enumerate(learners):
        if i != victim_index:
            assert p.wait(240) == 0, p.text()
    summaries = _assert_one_lineage(swarm, [i for i in range(len(learners)) if i != victim_index], TARGET)
    for i, s in zip([i for i in range(len(learners)) if i != victim_index], summaries, strict=True):
        losses = eval_losses(learners[i], from_version=2)  # the outer steps since the fault's round
        assert losses and all(loss == loss and loss < 10 for loss in losses), losses  # finite
        assert s["last_eval_loss"] < s["first_eval_loss"] - 0.5
    return summaries


@pytest.mark.timeout(300)
# A kill during inner steps (between rounds) is test_swarm.py's test_sigkill_of_one_learner_does_not_stop_the_others.
# send and receive (killed mid-all-reduce, as in reduce) run in the slow tier.
@pytest.mark.parametrize("stage", ["matchmaking", pytest.param("send", marks=pytest.mark.slow), "reduce",
                                   pytest.param("receive", marks=pytest.mark.slow)])
def test_learner_killed_at_each_stage(swarm, stage):
    swarm.start_bootstrap()
    learners = [swarm.start_learner(i, max_outer_steps=TARGET, extra=SURVIVOR) for i in range(2)]
    victim = swarm.start_learner(2, max_outer_steps=TARGET, extra=["--fault", f"kill at round 2 during {stage}"])
    learners.append(victim)
    assert victim.wait(200) == -signal.SIGKILL, victim.text()
    assert f"fault injection: kill at round 2 during {stage}" in victim.text()
    wait_until(lambda: not processes_in_group(victim.pid), 15, None, "the killed learner's children to exit")
    _survivors_finish(swarm, learners)


@pytest.mark.timeout(150)
def test_a_learner_whose_dht_process_dies_stops_with_one_line_and_keeps_its_steps(swarm):
    """Without its DHT process a learner can never merge again: it stops (exit 2, one line saying so)
    with its steps checkpointed, instead of training on alone."""
    swarm.start_bootstrap()
    lone = swarm.start_learner(0, max_outer_steps=50, extra=["--set", "inner.extra_step_seconds=0.02"])
    wait_until(lambda: "outer step done" in lone.text(), 120, lone, "the first outer step")
    tree = psutil.Process(lone.pid).children(recursive=True)
    dht = {p.ppid() for p in tree if p.name() == "p2pd"}  # p2pd is the DHT process's child
    assert len(dht) == 1 and lone.pid not in dht, [(p.pid, p.ppid(), p.name()) for p in tree]
    os.kill(dht.pop(), signal.SIGKILL)
    assert lone.wait(60) == 2, lone.text()
    assert "DHT process (exit code -9) has exited, so it can no longer reach the swarm" in lone.text()
    payload = load_checkpoint(swarm.tmp / "ckpt-0")
    assert payload is not None and payload["counters"]["inner_steps"] >= 20, lone.text()


@pytest.mark.timeout(360)
def test_killed_while_checkpointing_then_restarted_reintegrates(swarm):
    swarm.start_bootstrap()
    learners = [swarm.start_learner(i, max_outer_steps=TARGET + 2) for i in range(2)]
    victim = swarm.start_learner(2, max_outer_steps=TARGET + 2, extra=["--fault", "kill at round 2 during checkpoint"])
    assert victim.wait(200) == -signal.SIGKILL, victim.text()
    ckpt = swarm.tmp / "ckpt-2"
    assert list(ckpt.glob(".latest.pt.tmp-*")), "the crash should have left a half-written temporary file"
    # It comes back from its last complete checkpoint (version 1), catches up, and trains on.
    back = swarm.start_learner(2, max_outer_steps=TARGET + 2, extra=["--resume"])
    for p in [*learners, back]:
        assert p.wait(240) == 0, p.text()
    assert audit_events(back, "resumed") and audit_events(back, "adopted"), back.text()
    assert not list(ckpt.glob(".latest.pt.tmp-*"))
    _assert_one_lineage(swarm, range(3), TARGET + 2)


@pytest.mark.timeout(150)
def test_a_timed_checkpoint_keeps_the_steps_of_a_long_outer_step(swarm):
    """Alone (so no merge ever checkpoints it) in an outer step of 400 inner steps, a learner killed after
    100 of them has checkpointed most of them (run.checkpoint_every_seconds), not none."""
    swarm.start_bootstrap()
    lone = swarm.start_learner(0, max_outer_steps=2, extra=[
        "--set", "inner.steps_per_outer=400", "--set", "inner.extra_step_seconds=0.02",
        "--set", "run.checkpoint_every_seconds=1.0", "--set", "run.log_every=20"])
    wait_until(lambda: re.search(r"inner (1[0-9][0-9]|[2-3][0-9][0-9])/400", lone.text()), 120, lone,
               "100 inner steps")
    lone.kill_group()
    payload = load_checkpoint(swarm.tmp / "ckpt-0")
    assert payload is not None, lone.text()
    assert 50 <= payload["counters"]["inner_steps"] < 400, payload["counters"]
    assert payload["counters"]["outer_steps"] == 0


@pytest.mark.timeout(360)
def test_learner_frozen_during_reduce_comes_back(swarm):
    swarm.start_bootstrap()
    learners = [swarm.start_learner(i, max_outer_steps=TARGET + 1) for i in range(2)]
    frozen = swarm.start_learner(2, max_outer_steps=TARGET + 1,
                                 extra=["--fault", "hang for 20 s at round 2 during reduce"])
    for p in [*learners, frozen]:
        assert p.wait(300) == 0, p.text()
    assert "fault injection: hang" in frozen.text()
    _assert_one_lineage(swarm, range(3), TARGET + 1)


@pytest.mark.timeout(300)
def test_server_killed_while_a_joiner_downloads(swarm):
    swarm.start_bootstrap()
    first = [swarm.start_learner(i, max_outer_steps=TARGET + 2) for i in range(2)]
    server = swarm.start_learner(2, max_outer_steps=TARGET + 2, extra=["--fault", "kill at round 2 during serve"])
    wait_until(lambda: committed_version(first[0]) >= 2, 150, first[0], "version 2")
    joiner = swarm.start_learner(3, max_outer_steps=TARGET + 2)
    for p in [*first, joiner]:
        assert p.wait(240) == 0, p.text()
    # Whichever peer served the joiner, it caught up and trained on with the others.
    assert audit_events(joiner, "adopted"), joiner.text()
    _assert_one_lineage(swarm, [0, 1, 3], TARGET + 2)
    server.kill_group()


@pytest.mark.timeout(300)
def test_bootstrap_loss_does_not_stop_training_and_newcomers_join_through_a_learner(swarm):
    swarm.start_bootstrap()
    learners = [swarm.start_learner(i, max_outer_steps=TARGET + 2) for i in range(2)]
    wait_until(lambda: committed_version(learners[0]) >= 1, 150, learners[0], "version 1")
    swarm.bootstrap.kill_group()
    addr = re.search(r"visible at \['([^']+)'", learners[0].text()).group(1)
    newcomer = swarm.start_learner(2, max_outer_steps=TARGET + 2, peers=addr)
    for p in [*learners, newcomer]:
        assert p.wait(240) == 0, p.text()
    _assert_one_lineage(swarm, range(3), TARGET + 2)


@pytest.mark.timeout(360)
def test_network_outage_of_one_learner(swarm):
    swarm.start_bootstrap()
    learners = [swarm.start_learner(i, max_outer_steps=TARGET + 1) for i in range(2)]
    cut = swarm.start_learner(2, max_outer_steps=TARGET + 1, extra=["--fault", "drop for 15 s at round 2 during inner"])
    for p in [*learners, cut]:
        assert p.wait(300) == 0, p.text()
    assert "fault injection: drop" in cut.text()
    _assert_one_lineage(swarm, range(3), TARGET + 1)


@pytest.mark.timeout(360)
def test_killed_after_its_round_averaged_comes_back_without_contributing_it_twice(swarm):
    """Killed between the all-reduce and its own commit: the others commit that round with its outer
    gradient in it. The learner restarts from a checkpoint older than the round (fragment 1's progress
    since its last merge is in it), finds itself among the round's contributors and leaves that
    progress out of what it contributes next."""
    two = ["--set", "sync.fragments=2"]
    swarm.start_bootstrap()
    # In a group of 3: the two others can then commit without the victim's signature (a pair cannot), whatever
    # the phases the learners start in (on a loaded machine the victim's first round at version 2 was a pair).
    fault = ["--fault", "kill at round 2 during commit in a group of 3"]
    # The victim starts first, so that it is in the rounds to version 1 (and checkpoints) even when a
    # loaded machine is slow to start it; a victim that joins at version 1 has nothing to resume from.
    victim = swarm.start_learner(2, max_outer_steps=TARGET + 2, extra=[*two, *fault])
    wait_until(lambda: "joined DHT" in victim.text(), 120, victim, "the victim joining the DHT")
    learners = [swarm.start_learner(i, max_outer_steps=TARGET + 2, extra=two) for i in range(2)]
    assert victim.wait(200) == -signal.SIGKILL, victim.text()
    back = swarm.start_learner(2, max_outer_steps=TARGET + 2, extra=[*two, "--resume"], append=True)
    for p in [*learners, back]:
        assert p.wait(240) == 0, p.text()
    assert audit_events(back, "resumed"), back.text()
    found = re.search(r"our outer gradient from version (\d+) \(\d+ steps\) is in version (\d+)", back.text())
    assert found and int(found[2]) == int(found[1]) + 1 >= 2, back.text()
    summaries = _assert_one_lineage(swarm, range(3), TARGET + 2)
    assert summaries[2]["contributions_confirmed"] >= 1


@pytest.mark.timeout(360)
def test_with_overlap_a_round_stuck_on_a_frozen_groupmate_does_not_stop_the_others(swarm):
    """τ > 0: a groupmate freezes in the middle of reducing; the others stop waiting for that round
    after sync.max_wait_seconds past τ and train on; the round's outcome is taken when it ends."""
    overlap = ["--set", "sync.fragments=2", "--set", "sync.overlap_steps=2", "--set", "sync.max_wait_seconds=1"]
    swarm.start_bootstrap()
    learners = [swarm.start_learner(i, max_outer_steps=TARGET + 1, extra=overlap) for i in range(2)]
    frozen = swarm.start_learner(2, max_outer_steps=TARGET + 1,
                                 extra=[*overlap, "--fault", "hang for 20 s at round 2 during reduce"])
    for p in [*learners, frozen]:
        assert p.wait(300) == 0, p.text()
    assert "fault injection: hang" in frozen.text()
    assert any("training on (its result is applied if it commits)" in p.text() for p in learners), \
        "\n".join(p.text() for p in learners)
    _assert_one_lineage(swarm, range(3), TARGET + 1)
