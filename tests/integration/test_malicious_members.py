"""A malicious member among three honest learners: it lies about its progress, or serves a poisoned state.

Real learners over real p2pd daemons. The liar is a member of the swarm (it contributes honest outer
gradients to rounds); from round 2 on it either signs progress records claiming 1,000 versions more
than it holds, or serves a state whose Θ is poisoned, 3 versions ahead, with a history that lists the
states its victims hold (``lie at round 2 with ahead|state``, p2p_diloco/sim/faults.py). The honest
learners must keep committing, end on one state, never take the poisoned one, and say why.
"""


import pytest

from p2p_diloco.sim.processes import Proc
from p2p_diloco.trust.admission import peer_id_of

from .harness import audit_events
from .test_swarm import _assert_one_lineage

TARGET = 5


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lie", ["state", "ahead"])
def test_honest_learners_are_not_fooled_by_a_lying_member(swarm, lie):
    swarm.start_bootstrap()
    liar_id = peer_id_of(swarm.tmp / "ckpt-3" / "identity.key")
    honest = [swarm.start_learner(i, max_outer_steps=TARGET) for i in range(3)]
    liar = swarm.start_learner(3, max_outer_steps=TARGET, extra=["--fault", f"lie at round 2 with {lie}"])
    for p in honest:
        assert p.wait(240) == 0, p.text()
    summaries = _assert_one_lineage(swarm, range(3), TARGET)
    for s in summaries:
        assert s["last_eval_loss"] < s["first_eval_loss"] - 0.5, s
    texts = [p.text() for p in honest]
    # Every state an honest learner downloaded or took is one an honest learner committed: the liar may
    # have served its real state before round 2, never the poisoned one.
    logs = [audit_events(p) for p in honest]
    committed = {e[k] for log in logs for e in log if e["event"] == "committed" for k in ("sha_before", "sha_after")}
    taken = [e["sha"] for log in logs for e in log if e["event"] in ("adopted", "merged")]
    taken += [sha for log in logs for e in log if e["event"] == "downloaded" for _, sha in e["fragments"].values()]
    assert committed and set(taken) <= committed, (set(taken) - committed, texts)
    if lie == "state":
        refusals = [e for log in logs for e in log if e["event"] == "download_rejected" and e["peer"] == liar_id
                    and e["reason"].startswith("fragment 0 version")]
    else:
        refusals = [e for log in logs for e in log if e["event"] == "distrusted" and e["peer"] == liar_id
                    and e["reason"].startswith("claimed version")]
    assert refusals, "\n".join(t[-3000:] for t in texts) + liar.text()[-2000:]


@pytest.mark.slow  # a user's option (the default is the mean, the test above); the median's reduce: test_reducer_check
@pytest.mark.timeout(300)
def test_a_robust_aggregator_outvotes_a_sign_flipping_member_that_claims_a_huge_weight(swarm):
    """Sign-flipped outer gradients have an ordinary norm (robust merging's exclusion cannot see them),
    and a weight of 1e15 would make the weighted mean the liar's: the median ignores both. (The direction
    check, on by default, would leave the liar out: off here, to show the aggregator alone.)"""
    robust = ["--set", "averaging.aggregator=median", "--set", "averaging.direction_check=false"]
    swarm.start_bootstrap()
    honest = [swarm.start_learner(i, max_outer_steps=TARGET, extra=robust) for i in range(3)]
    swarm.start_learner(3, max_outer_steps=TARGET,
                        extra=[*robust, "--fault", "poison at round 2 with flip; lie at round 2 with weight"])
    for p in honest:
        assert p.wait(240) == 0, p.text()
    summaries = _assert_one_lineage(swarm, range(3), TARGET)
    for p, s in zip(honest, summaries, strict=True):
        assert s["last_eval_loss"] < s["first_eval_loss"] - 0.5, s
        groups = [e["group_size"] for e in audit_events(p, "committed")]
        assert 4 in groups, groups  # the liar was in the rounds: outvoted, not left out


@pytest.mark.timeout(300)
def test_under_the_mean_a_sign_flipping_member_that_claims_a_huge_weight_counts_as_its_steps_allow(swarm):
    """The default token-weighted mean: the liar's weight of 1e15 is recomputed from its tokens and steps
    (p2p_diloco/core/exclusion.py), so its sign-flipped outer gradient counts like one honest learner's and the
    three honest ones outweigh it. Unbounded, the same run ended at eval loss 32.0 (docs/security.md). (The
    direction check, on by default, would leave the liar out: off here, to show the bound alone.)"""
    liar_id, honest = _three_honest_and_one(swarm, "poison at round 2 with flip; lie at round 2 with weight",
                                            ["--set", "averaging.direction_check=false"])
    texts = [p.text() for p in honest]
    groups = [e["group_size"] for p in honest for e in audit_events(p, "committed")]
    assert 4 in groups, groups  # the liar was in the rounds: bounded, not left out
    bounded = [t for t in texts if f"bounded the weight of {liar_id[-6:]}: it claimed weight 1e+15" in t]
    assert bounded, "\n".join(t[-3000:] for t in texts)


@pytest.mark.timeout(300)
def test_a_reducer_that_returns_a_chosen_shard_is_caught_and_left_out(swarm):
    """From round 2 on the liar returns the shard it reduces scaled by −50, to everyone alike: every member
    would commit the same poisoned state, and the commit certificate would hold. The members' sketches
    (p2p_diloco/core/shard_sketches.py) catch it before anyone signs; they ban the reducer and commit without it.
    (Under the median, tests/integration/test_reducer_check.py; a swarm: benchmarks/poisoning.py.)"""
    liar_id, honest = _three_honest_and_one(swarm, "lie at round 2 with shard")
    texts = [p.text() for p in honest]
    caught = [t for t in texts if f"not signing the round: the shard reduced by {liar_id[-6:]} does not match" in t]
    assert caught, "\n".join(t[-3000:] for t in texts)
    assert any(f"{liar_id[-6:]} is banned from this learner's next" in t for t in texts)
    # Rounds after the lie committed without the liar: groups of the three honest learners.
    late = [e["group_size"] for p in honest for e in audit_events(p, "committed") if e["version_after"] >= 3]
    assert late and 3 in late, late


@pytest.mark.timeout(300)
def test_a_member_that_climbs_the_loss_is_left_out_under_the_defaults(swarm):
    """From round 2 on the liar negates the loss gradient of every inner step. Its outer gradients have an
    ordinary norm; under the default mean they were committed round after round (eval loss 1.24-1.59x a clean
    run's, benchmarks/poisoning.py). The direction check (p2p_diloco/core/directions.py) leaves it out and bans
    it. (Its first climbing outer gradient still carries honest steps and may pass; ``climb 2``, which
    alternates, can pass every time here, where a round's outer gradient straddles two periods.)"""
    liar_id, honest = _three_honest_and_one(swarm, "poison at round 2 with climb")
    texts = [p.text() for p in honest]
    excluded = [e["excluded"][liar_id] for p in honest for e in audit_events(p, "committed", "failed")
                if liar_id in (e.get("excluded") or {})]
    assert any("points away from the others'" in why for why in excluded), "\n".join(t[-3000:] for t in texts)
    assert any(f"{liar_id[-6:]} is banned from this learner's next" in t for t in texts)
    # Nobody left out an honest learner.
    honest_ids = {s for p in honest for e in audit_events(p, "committed") for s in e["contributors"]} - {liar_id}
    assert not [why for p in honest for e in audit_events(p, "committed", "failed")
                for peer, why in (e.get("excluded") or {}).items() if peer in honest_ids]


def _three_honest_and_one(swarm, fault: str, settings: list[str] | None = None) -> tuple[str, list[Proc]]:
    """Three honest learners and one with ``fault`` to version TARGET (``settings`` on all four): the honest ones
    end on one state with a falling eval loss. The liar's peer id and the honest learners."""
    swarm.start_bootstrap()
    liar_id = peer_id_of(swarm.tmp / "ckpt-3" / "identity.key")
    honest = [swarm.start_learner(i, max_outer_steps=TARGET, extra=settings or []) for i in range(3)]
    swarm.start_learner(3, max_outer_steps=TARGET, extra=[*(settings or []), "--fault", fault])
    for p in honest:
        assert p.wait(240) == 0, p.text()
    summaries = _assert_one_lineage(swarm, range(3), TARGET)
    for p, s in zip(honest, summaries, strict=True):
        assert s["last_eval_loss"] < s["first_eval_loss"] - 0.5, (s, p.text()[-3000:])
    return liar_id, honest


@pytest.mark.timeout(300)
def test_a_member_that_fails_the_rounds_it_joins_is_named_and_left_out(swarm):
    """Two honest learners and a member that, from round 2 on, never publishes its reducer sketch, signs each
    commit with another hash and claims a majority quorum of 1,000,000: each fails the round it joins (the
    sketch in a group of 3, the claim and the hash in a pair). Every such failure names it; the honest learners
    ban it, leave it out of their next rounds and commit without it; neither honest learner is ever left out."""
    swarm.start_bootstrap()
    liar_id = peer_id_of(swarm.tmp / "ckpt-2" / "identity.key")
    honest = [swarm.start_learner(i, max_outer_steps=TARGET) for i in range(2)]
    swarm.start_learner(2, max_outer_steps=TARGET, extra=[
        "--fault", "lie at round 2 with sketch; lie at round 2 with hash; lie at round 2 with quorum"])
    for p in honest:
        assert p.wait(240) == 0, p.text()
    _assert_one_lineage(swarm, range(2), TARGET)
    honest_ids = {peer_id_of(swarm.tmp / f"ckpt-{i}" / "identity.key", create=False) for i in range(2)}
    rounds = [e for p in honest for e in audit_events(p) if e["event"] in ("committed", "failed")]
    texts = "\n".join(p.text()[-3000:] for p in honest)
    named = [e for e in rounds if e["event"] == "failed" and (liar_id in e["excluded"] or liar_id[-6:] in e["cause"])]
    left_out = [e for e in rounds if e["event"] == "committed" and "banned by" in e["excluded"].get(liar_id, "")]
    assert named and left_out, texts
    assert not any(set(e["excluded"]) & honest_ids for e in rounds), texts
