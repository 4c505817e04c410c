"""Exactly-once contributions: a round's contributors, all-or-nothing reducers, and the rebase that
leaves out an outer gradient the swarm already holds."""

import asyncio
import logging
import threading
from types import SimpleNamespace

import pytest
import torch
from hivemind.averaging.partition import AllreduceException

from p2p_diloco.config import load_learner_config
from p2p_diloco.core.fragments import build_fragments
from p2p_diloco.core.grace import GraceWindow
from p2p_diloco.core.outer import CONTRIBUTOR_VERSIONS, GlobalState, OuterOptimizer, merge_lineages
from p2p_diloco.core.state_layout import parse_download
from p2p_diloco.learner.catch_up import CatchUp
from p2p_diloco.learner.progress import Progress
from p2p_diloco.learner.round import RoundOutcome, Stage
from p2p_diloco.learner.schedule import InFlight, Rounds
from p2p_diloco.learner.state import LearnerState, Unconfirmed
from p2p_diloco.net.allreduce import AllOrNothingReducer
from p2p_diloco.net.progress_records import ProgressRecord
from p2p_diloco.trust.admission import peer_id_of
from p2p_diloco.trust.certificates import Certificate, Commit, Signature, Verifier
from p2p_diloco.trust.signed_records import IdentityKey
from tests.unit.fake_averaging import FakeAveraging
from tests.unit.learner.test_download import served, states


def test_contributors_are_remembered_copied_and_bounded():
    s = GlobalState(params=[torch.zeros(2)], momentum=[torch.zeros(2)])
    s.record_contributors(1, ["b", "a", "a"])
    assert s.contributors == [(1, ("a", "b"))]
    assert s.contributed(1, "a") is True and s.contributed(1, "c") is False and s.contributed(2, "a") is None
    c = s.copy()
    c.record_contributors(2, ["c"])
    assert s.contributed(2, "c") is None and c.contributed(2, "c") is True
    for v in range(3, 3 + CONTRIBUTOR_VERSIONS):
        c.record_contributors(v, ["x"])
    assert len(c.contributors) == CONTRIBUTOR_VERSIONS and c.contributed(1, "a") is None


def test_merged_lineages_keep_both_sides_contributors():
    a = GlobalState(params=[torch.ones(2)], momentum=[torch.zeros(2)], version=3, tokens=10)
    b = GlobalState(params=[torch.zeros(2)], momentum=[torch.zeros(2)], version=3, tokens=30)
    a.record_contributors(3, ["p1", "p2"])
    b.record_contributors(3, ["p3"])
    b.record_contributors(2, ["p1"])
    merged = merge_lineages(a, b)
    assert merged.contributed(3, "p1") and merged.contributed(3, "p3") and merged.contributed(2, "p1")
    assert merge_lineages(b, a).contributors == merged.contributors


def _run(reducer_steps):
    return asyncio.run(reducer_steps())


@pytest.mark.parametrize("parts_before_failing", [0, 1])
def test_a_sender_failing_before_its_last_part_fails_the_shard(parts_before_failing):
    async def scenario():
        reducer = AllOrNothingReducer([torch.Size([3]), torch.Size([3])], num_senders=3)
        waiting = [asyncio.create_task(reducer.accumulate_part(0, 0, torch.ones(3)))]
        if parts_before_failing:
            waiting.append(asyncio.create_task(reducer.accumulate_part(2, 0, torch.ones(3))))
        await asyncio.sleep(0)
        reducer.on_sender_failed(2)
        reducer.on_sender_failed(2)  # hivemind may report it twice
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(r, AllreduceException) for r in results), results
        with pytest.raises(AllreduceException, match="sender 2 failed"):
            await reducer.accumulate_part(1, 0, torch.ones(3))

    _run(scenario)


def test_a_sender_that_delivered_every_part_does_not_fail_the_shard():
    async def scenario():
        reducer = AllOrNothingReducer([torch.Size([2])], num_senders=2)
        first = asyncio.create_task(reducer.accumulate_part(0, 0, torch.full((2,), 1.0)))
        second = asyncio.create_task(reducer.accumulate_part(1, 0, torch.full((2,), 3.0)))
        out = await asyncio.gather(first, second)
        reducer.on_sender_failed(1)  # after the fact: nothing to undo
        assert reducer.failure is None and torch.equal(out[0], torch.full((2,), 2.0))

    _run(scenario)


def _parts(p: int = 2, *overrides: str) -> tuple[LearnerState, CatchUp, Rounds]:
    """Just what rebasing and late rounds need: two fragments of one tensor each, no network."""
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(3)) for _ in range(p)])
    fragments = build_fragments([(f"w{i}", (3,)) for i in range(p)], p, 10)
    state = LearnerState(fragments=fragments, states=[_state(0.0, 4) for _ in range(p)], params=list(model),
                         peer_id="me")
    state.counters.resize(p)
    cfg = load_learner_config("peers/small-cpu.toml", ["sync.overlap_steps=2", "sync.max_wait_seconds=0.05",
                                                       *overrides])
    averaging = FakeAveraging()
    progress = Progress(SimpleNamespace(read=dict), state, 15.0)
    catch_up = CatchUp(cfg, state, averaging, progress, should_stop=lambda: False)
    grace = GraceWindow(2, 0.5, 3.0, 6.0)
    rounds = Rounds(cfg, state, averaging, OuterOptimizer(cfg.outer), grace, None, catch_up, progress, lambda: None)
    return state, catch_up, rounds


def _state(value: float, version: int, contributors=None) -> GlobalState:
    s = GlobalState(params=[torch.full((3,), value)], momentum=[torch.zeros(3)], version=version)
    s.remember()
    if contributors is not None:
        s.record_contributors(version, contributors)
    return s


@pytest.mark.parametrize("included", [True, False])
def test_rebase_leaves_out_an_outer_gradient_the_swarm_already_holds(included, caplog):
    state, catch_up, _ = _parts()
    frag = state.fragments[0]
    p = state.local(frag)[0]
    ours = _state(0.0, 4)
    # We sent our progress at θ = 1 (10 steps, 640 tokens), then trained on to θ = 1.5 (5 more steps).
    state.unconfirmed[frag.index] = Unconfirmed(4, [torch.full((3,), 1.0)], 640, 10, lr_steps=4.5)
    with torch.no_grad():
        p.fill_(1.5)
    state.counters.tokens_since_merge[frag.index], state.counters.steps_since_merge[frag.index] = 960, 15
    state.counters.lr_steps_since_merge[frag.index] = 6.0
    new = _state(10.0, 5, ["me", "other"] if included else ["other"])
    with caplog.at_level(logging.INFO, logger="p2p_diloco.learner.catch_up"):
        catch_up._rebase_onto(frag, ours, new)
    c = state.counters
    if included:  # only the 5 steps after the round are ours to contribute still
        assert torch.allclose(p.detach(), torch.full((3,), 10.5))
        assert (c.tokens_since_merge[0], c.steps_since_merge[0], c.contributions_confirmed) == (320, 5, 1)
        assert c.steps_merged == 10 / 2 and "not contributing it again" in caplog.text
        assert c.lr_steps_since_merge[0] == pytest.approx(1.5)  # what the round sent counted as 4.5 of the 6
    else:  # the round did not use it: all 15 steps are kept
        assert torch.allclose(p.detach(), torch.full((3,), 11.5))
        assert (c.tokens_since_merge[0], c.steps_since_merge[0], c.contributions_confirmed) == (960, 15, 0)
        assert c.lr_steps_since_merge[0] == 6.0
    assert frag.index not in state.unconfirmed


def test_rebase_without_known_contributors_keeps_the_progress_and_says_so(caplog):
    state, catch_up, _ = _parts()
    frag = state.fragments[1]
    state.unconfirmed[frag.index] = Unconfirmed(2, [torch.full((3,), 1.0)], 64, 1)
    with torch.no_grad():
        state.local(frag)[0].fill_(1.0)
    with caplog.at_level(logging.INFO, logger="p2p_diloco.learner.catch_up"):
        catch_up._rebase_onto(frag, _state(0.0, 2), _state(5.0, 3))  # no contributors recorded
    assert torch.allclose(state.local(frag)[0].detach(), torch.full((3,), 6.0))
    assert "cannot tell" in caplog.text


def test_an_unconfirmed_gradient_from_an_older_version_is_dropped():
    state, catch_up, _ = _parts()
    frag = state.fragments[0]
    state.unconfirmed[frag.index] = Unconfirmed(1, [torch.full((3,), 1.0)], 64, 1)
    catch_up._rebase_onto(frag, _state(0.0, 2), _state(5.0, 3, ["me"]))  # from version 1, not 2
    assert torch.allclose(state.local(frag)[0].detach(), torch.full((3,), 5.0))
    assert state.counters.contributions_confirmed == 0 and not state.unconfirmed


def test_downloaded_contributors_are_parsed_and_malformed_ones_refused():
    theirs, ours = states(), [s.copy() for s in states()]
    theirs[1].record_contributors(5, ["peer-a", "peer-b"])
    meta, whole = served(theirs)
    got, problem = parse_download(meta, whole, ours)
    assert problem == "" and got[1].contributed(5, "peer-b") and got[0].contributed(5, "peer-b") is None
    for bad in ([[5, "peer-a"]], [["5", ["a"]]], "x", [[5, [1]]]):
        entries = [dict(e) for e in meta["fragments"]]
        entries[0]["contributors"] = bad
        _, problem = parse_download({**meta, "fragments": entries}, whole, ours)
        assert "contributors" in problem, bad


@pytest.mark.parametrize("policy", ["overwrite", "mix"])
def test_a_round_outliving_the_wait_at_tau_is_detached_and_applied_when_it_commits(policy, caplog):
    state, _, rounds = _parts(2, f"sync.apply_policy={policy}")
    frag = state.fragments[0]
    p = state.local(frag)[0]
    release = threading.Event()
    task = InFlight(fragment=frag, apply_at=0, snapshot=[torch.full((3,), 1.0)], tokens=640, steps=10, window=1.0,
                    state=state.states[0].copy())

    def slow_round():
        release.wait(5)
        task.state.params[0].fill_(10.0)
        task.state.version = 5
        task.state.record_contributors(5, ["me", "other"])
        task.state.remember()
        task.outcome = RoundOutcome(stage=Stage.APPLIED, group_size=2)

    task.thread = threading.Thread(target=slow_round, daemon=True)
    task.thread.start()
    rounds.inflight = task
    measured = []  # the pace (sync.pace = auto), the grace window and the metrics see a late round like one on time
    rounds.pace = SimpleNamespace(observe_round=lambda seconds, size: measured.append((seconds, size)))
    rounds.grace = SimpleNamespace(observe_round=lambda seconds, allreduce, window: measured.append(("grace", window)),
                                   overlap_steps=0)
    rounds.metrics = SimpleNamespace(round=lambda f, out: measured.append(("metrics", f, out.committed)))
    with torch.no_grad():
        p.fill_(1.5)  # 5 steps of progress after the round started
    state.counters.tokens_since_merge[0], state.counters.steps_since_merge[0] = 960, 15
    with caplog.at_level(logging.INFO, logger="p2p_diloco.learner.schedule"):
        assert rounds.finish() is None  # did not wait for it
        assert rounds.inflight is None and rounds.detached is task and 0 in state.unconfirmed
        rounds.poll_detached()  # still running: nothing happens
        assert state.states[0].version == 4
        release.set()
        task.thread.join(5)
        rounds.poll_detached()
    assert rounds.detached is None and state.states[0].version == 5 and 0 not in state.unconfirmed
    # The late result goes through the same door as one on time: the apply policy holds for it too.
    expected = 10.5 if policy == "mix" else 10.0  # mix: Θ_new + the 5 steps after the round started
    assert torch.allclose(p.detach(), torch.full((3,), expected))
    c = state.counters
    assert (c.tokens_since_merge[0], c.steps_since_merge[0], c.missed_versions[0], c.outer_steps) == (320, 5, 0, 1)
    assert "training on" in caplog.text and "committed version 5" in caplog.text
    assert measured == [("grace", 1.0), (task.outcome.round_seconds, 2), ("metrics", 0, True)]


def test_a_round_that_raises_is_a_failed_outcome_not_an_exception(caplog):
    from p2p_diloco.learner.round import OuterRound

    class Broken:
        def average(self, *args, **kwargs):
            raise KeyError("surprise")

    s = _state(0.0, 4)
    rnd = OuterRound(state=s, optimizer=OuterOptimizer(load_learner_config(None).outer), averaging=Broken(),
                     local_params=[torch.ones(3)], tokens=64, inner_steps=1)
    with caplog.at_level(logging.DEBUG, logger="p2p_diloco.learner.round"):
        out = rnd.run()
    assert not out.committed and "KeyError" in out.reason and s.version == 4
    assert [r.levelno for r in caplog.records if "failed unexpectedly" in r.getMessage()] == [logging.WARNING]
    assert any(r.exc_info for r in caplog.records if r.levelno == logging.DEBUG)


def test_a_step_cancelled_in_the_averager_is_a_failed_round_not_a_crash():
    """hivemind hands a step cancelled in its process back as asyncio.CancelledError, a BaseException."""
    import asyncio

    from p2p_diloco.learner.round import OuterRound

    class Cancelled:
        def average(self, *args, **kwargs):
            raise asyncio.CancelledError()

    rnd = OuterRound(state=_state(0.0, 4), optimizer=OuterOptimizer(load_learner_config(None).outer),
                     averaging=Cancelled(), local_params=[torch.ones(3)], tokens=64, inner_steps=1)
    out = rnd.run()
    assert not out.committed and "CancelledError" in out.reason


class _Certifier:
    """Stands in for the commit board: the certificate (or the reason there is none) a merge gets."""

    lineage = "run-lin"

    def __init__(self, signers):
        self.signers = signers

    def certify(self, commit, patience=0.0):
        if len(self.signers) < 2:
            return "commit not certified: 1 of the quorum 2 signatures within 10 s"
        return SimpleNamespace(signers=lambda admitted=None: set(self.signers),
                               to_dict=lambda: {"commit": {"version": commit.version}, "signatures": []})


@pytest.mark.parametrize(("client", "signers", "kept"), [
    (False, ["me", "other"], True),  # a quorum computed the same merge
    (False, ["me"], False),  # nobody else did: peers would refuse it
    (True, ["me", "server"], True),  # a learner that serves state holds it too
    (True, ["me", "client-2"], False),  # only clients hold it: nobody could serve it
])
def test_a_merge_of_sibling_lineages_is_kept_only_if_others_hold_it(client, signers, kept, caplog):
    """Otherwise it would be a third lineage: the learner takes the sibling instead (keeping its local
    progress) and adopts the merge the others make."""
    state, catch_up, _ = _parts()
    catch_up.progress.client = client
    reach = {"other": "direct", "server": "direct", "client-2": "client"}
    catch_up.progress.board = SimpleNamespace(read=lambda: {
        p: ProgressRecord(4, "0" * 64, 10, "running", reach=r) for p, r in reach.items()})
    catch_up.certifier = _Certifier(signers)
    frag = state.fragments[0]
    state.states[0] = _state(1.0, 4)
    state.states[0].tokens = 100
    with torch.no_grad():
        state.local(frag)[0].fill_(1.5)  # half a unit of local progress on top of Θ = 1
    theirs = GlobalState(params=[torch.full((3,), 3.0)], momentum=[torch.zeros(3)], version=4, tokens=100)
    theirs.remember()  # a sibling: same version, another history
    with caplog.at_level(logging.INFO, logger="p2p_diloco.learner.catch_up"):
        assert catch_up._reconcile(frag, theirs)
    new = state.states[0]
    if kept:
        assert new.version == 5 and torch.allclose(new.params[0], torch.full((3,), 2.0))  # token-weighted mean
        assert state.counters.merges == 1 and new.descends_from(4, theirs.sha256()) and new.certificates
    else:
        assert new.sha256() == theirs.sha256() and state.counters.merges == 0
        assert "so we take theirs" in caplog.text
    assert torch.allclose(state.local(frag)[0].detach(), new.params[0] + 0.5)  # local progress kept


@pytest.mark.parametrize("honest_history", [True, False])
def test_a_served_history_is_checked_against_the_certificates_it_comes_with(tmp_path, honest_history, caplog):
    """A certified state at version 6 whose history lists our version 4: believed when its certificates
    link 6 -> 5 -> our 4, overruled (a sibling, so a merge) when they link to another state at 4."""
    keys = [(peer_id_of(tmp_path / f"{i}.key"), IdentityKey.load(tmp_path / f"{i}.key")) for i in range(2)]
    state, catch_up, _ = _parts()
    catch_up.verifier = Verifier("run-lin", quorum=2)
    ours = state.states[0]
    real_4 = ours.sha256() if honest_history else "e" * 64  # the state the swarm's version 5 was applied to
    theirs = _state(7.0, 6)
    theirs.history = [(4, ours.sha256()), (5, "5" * 64), (6, theirs.sha256())]  # what the server says
    for version, sha, parent in ((5, "5" * 64, real_4), (6, theirs.sha256(), "5" * 64)):
        commit = Commit("run-lin", 0, version, sha, parent, tuple(sorted(p for p, _ in keys)))
        signatures = tuple(Signature.make(k, commit) for _, k in keys)
        theirs.add_certificate(version, Certificate(commit, signatures).to_dict())
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.learner.catch_up"):
        assert catch_up._descends(0, theirs, ours) is honest_history
    assert ("certificates link it to another state" in caplog.text) is not honest_history
