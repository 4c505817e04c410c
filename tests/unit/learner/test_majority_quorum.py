"""The majority quorum (``averaging.quorum = "majority"``, docs/scale.md): a round commits only with more than half
of the learners the swarm's records show training, so two disjoint groups never both commit one version. The
group applies the upper median of the quorums its members gathered, so a lying minority cannot move it far, and a
member that counted too few learners cannot let a pair commit."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from p2p_diloco.config import ConfigError, load_learner_config
from p2p_diloco.learner.progress import TRAINING_MEMORY, Progress
from p2p_diloco.learner.startup import lineage_id
from p2p_diloco.net.averager_process import MAX_QUORUM, group_quorum
from p2p_diloco.net.averaging import HivemindAveraging, majority
from p2p_diloco.net.progress_records import ProgressRecord

ROOT = Path(__file__).resolve().parents[3]
SMALL = ROOT / "peers" / "small-cpu.toml"


def test_a_majority_is_more_than_half():
    assert [majority(m) for m in (1, 2, 3, 4, 5, 8, 16, 1000)] == [1, 2, 2, 3, 3, 5, 9, 501]
    for m in range(1, 200):  # two disjoint groups cannot both reach it
        assert 2 * majority(m) > m


def test_the_round_quorum_follows_the_learners_training():
    cfg = load_learner_config(SMALL, ["averaging.quorum=majority", "averaging.min_group_size=2"]).averaging
    seen = SimpleNamespace(cfg=cfg, training_learners=lambda: 16)
    assert HivemindAveraging.round_quorum(seen) == 9
    seen.training_learners = lambda: 2
    assert HivemindAveraging.round_quorum(seen) == 2  # never below K
    fixed = SimpleNamespace(cfg=load_learner_config(SMALL, ["averaging.quorum=fixed"]).averaging,
                            training_learners=lambda: 16)
    assert HivemindAveraging.round_quorum(fixed) == fixed.cfg.min_group_size


def test_the_group_applies_the_upper_median_of_its_members_claims():
    assert group_quorum([{}, {}, {}], 2) == 2  # a fixed quorum: nobody claims one
    assert group_quorum([{"quorum": 9}] * 9, 2) == 9
    # one member of a fixed-quorum group claims a huge swarm: it cannot fail the rounds it joins
    assert group_quorum([{"quorum": 500}, {}, {}], 2) == 2
    # honest claims differ by a learner or two (each read the records at its own time)
    assert group_quorum([{"quorum": 8}, {"quorum": 9}, {"quorum": 9}, {"quorum": 9}], 2) == 9
    # a minority lying low or high moves it no further than the honest claims around it
    assert group_quorum([{"quorum": 1}, {"quorum": 1}, {"quorum": 9}, {"quorum": 9}, {"quorum": 9}], 2) == 9
    assert group_quorum([{"quorum": 5}, {"quorum": 5}, {"quorum": 5}, {"quorum": 10**5}, {"quorum": 10**5}], 2) == 5
    assert group_quorum([], 3) == 3
    # a pair applies the larger claim: one member whose reads missed learners cannot let the pair commit alone
    assert group_quorum([{"quorum": 2}, {"quorum": 3}], 2) == 3
    assert group_quorum([{"quorum": 2}, {"quorum": 2}, {"quorum": 3}, {"quorum": 3}], 2) == 3


@pytest.mark.parametrize("claim", [True, "9", 9.0, 0, -4, MAX_QUORUM + 1, None, [9]])
def test_a_malformed_claim_counts_as_k(claim):
    assert group_quorum([{"quorum": claim}] * 3, 2) == 2
    assert group_quorum(["not a dict", {"quorum": claim}, 7], 3) == 3


def test_the_base_of_a_majority_is_the_learners_training(monkeypatch):
    def rec(status):
        return ProgressRecord(1, "a" * 64, 0, status, versions=(1,), shas=("a" * 64,))
    me = "me"
    reads = [{me: rec("training"), "p1": rec("training"), "p2": rec("done"), "p3": rec("left"),
              "p4": rec("training"), "p5": rec("training")}]
    board = SimpleNamespace(read=lambda: reads[-1])
    progress = Progress(board, SimpleNamespace(peer_id=me), record_ttl=30.0)
    clock = [1000.0]  # before the distrust: it is stamped with the same clock (not the machine's uptime)
    monkeypatch.setattr("p2p_diloco.learner.progress.time.monotonic", lambda: clock[0])
    progress.distrust("p4", 600)
    progress.records(fresh=True)
    # us, p1, p4 and p5; p2 is done and p3 has left (neither joins a round). p4 is distrusted (it served a state that
    # failed our verification): it still trains and commits with others, so it counts, but its proposals do not.
    assert progress.training_learners() == 4
    assert set(progress.recently_training()) == {me, "p1", "p5"}
    # A read that misses p4's and p5's records (a partial DHT answer) does not lower the count for TRAINING_MEMORY ...
    reads.append({me: rec("training"), "p1": rec("training")})
    clock[0] += 10
    progress.records(fresh=True)
    assert progress.training_learners() == 4
    # ... after which they count as gone; p1 saying it is done counts at once.
    reads.append({me: rec("training"), "p1": rec("done")})
    clock[0] = 1000.0 + TRAINING_MEMORY - 5
    progress.records(fresh=True)
    assert progress.training_learners() == 3  # p1 is done; p4 and p5, missed for almost TRAINING_MEMORY, still count
    clock[0] += 10
    assert progress.training_learners() == 1


def test_the_setting_is_checked_and_joins_the_lineage():
    with pytest.raises(ConfigError, match="quorum"):
        load_learner_config(SMALL, ["averaging.quorum=most"])
    full_steps = ["outer.short_rounds=full", "outer.long_rounds=full", "averaging.established_after=0"]
    fixed, most = (load_learner_config(SMALL, o) for o in (["averaging.quorum=fixed", *full_steps], full_steps))
    assert lineage_id(fixed) == "2543e0b8"  # a fixed quorum keeps the id lineages had before the setting
    assert lineage_id(most) != lineage_id(fixed)  # learners that apply different quorums never meet


def test_a_search_is_cut_to_search_seconds_but_never_before_the_groups_scheduled_start():
    from p2p_diloco.net.averaging import search_timeout

    assert search_timeout(30.0, 2.5, 10.0, None) == 30.0  # round_timeout
    assert search_timeout(30.0, 2.5, 40.0, None) == 41.0  # a grace window longer than it
    assert search_timeout(30.0, 2.5, None, None) == 30.0
    # A latecomer's short search: a second past the scheduled start (the grace window, at least the matchmaking time).
    assert search_timeout(30.0, 2.5, 10.0, 2.5) == 11.0
    assert search_timeout(30.0, 2.5, 1.0, 2.5) == 3.5
    assert search_timeout(30.0, 2.5, None, 0.0) == 3.5
    assert search_timeout(30.0, 2.5, 1.0, 60.0) == 30.0  # never longer than it would have been


def test_fresh_identities_do_not_raise_the_majority_quorum():
    """Four keys that announce themselves training (one attacker's, or newcomers') beside three learners with
    standing: the base of the majority is the three, so their rounds still commit; once everyone counts (a
    swarm's first rounds) the seven count."""
    def rec():
        return ProgressRecord(1, "a" * 64, 0, "training", versions=(1,), shas=("a" * 64,))
    me, honest, fresh = "me", ["h1", "h2"], ["s1", "s2", "s3", "s4"]
    board = SimpleNamespace(read=lambda: {p: rec() for p in [me, *honest, *fresh]})
    established: list = [frozenset({me, *honest})]
    progress = Progress(board, SimpleNamespace(peer_id=me), record_ttl=30.0, established=lambda: established[0])
    assert progress.training_learners() == 3
    established[0] = None
    assert progress.training_learners() == 7


def test_the_matchmaking_watch_reuses_a_read_younger_than_two_seconds(monkeypatch):
    from p2p_diloco.learner import progress as progress_module

    def rec(version):
        return ProgressRecord(version, "a" * 64, 0, "training", versions=(version,), shas=("a" * 64,),
                              reach="direct")
    reads = []

    def read():
        reads.append(1)
        return {"me": rec(3), "p1": rec(3 + len(reads))}
    clock = [500.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])
    progress = Progress(SimpleNamespace(read=read), SimpleNamespace(peer_id="me"), record_ttl=30.0)
    assert progress.newest_live_version() == 4 and len(reads) == 1
    clock[0] += 1.0  # the watch's next poll: the read of a second ago answers it
    assert progress.newest_live_version() == 4 and len(reads) == 1
    clock[0] += 1.5
    assert progress.newest_live_version() == 5 and len(reads) == 2
    progress.records(fresh=True)  # any read counts (the heartbeat's too)
    clock[0] += 1.0
    assert progress.newest_live_version() == 6 and len(reads) == 3


def test_once_the_established_learners_left_the_learners_training_count():
    """Founders a and b are established; b has left and c and d joined: with fewer than K = 2 established learners
    training, counting established ones only would never let a round commit (nor credit c and d): everyone
    counts, and the group's check says so (the gathered count, 0)."""
    def rec(status):
        return ProgressRecord(9, "a" * 64, 0, status, versions=(9,), shas=("a" * 64,))
    reads = [{"a": rec("training"), "b": rec("left"), "c": rec("training"), "d": rec("training")}]
    progress = Progress(SimpleNamespace(read=lambda: reads[-1]), SimpleNamespace(peer_id="c"), record_ttl=30.0,
                        established=lambda: frozenset({"a", "b"}), floor=2)
    assert progress.counting(frozenset({"a", "b"})) is None
    assert progress.training_learners() == 3 and progress.established_training() == 0
    reads.append({"a": rec("training"), "b": rec("training"), "c": rec("training"), "d": rec("training")})
    progress.records(fresh=True)  # b is back: 2 established learners train, the others do not count
    assert progress.counting(frozenset({"a", "b"})) == {"a", "b"}
    assert progress.training_learners() == 2 and progress.established_training() == 2


def test_a_learners_quorum_counts_peers_established_in_every_fragment():
    import torch

    from p2p_diloco.core.fragments import Fragment
    from p2p_diloco.core.outer import GlobalState
    from p2p_diloco.learner.state import LearnerState

    states = [GlobalState.from_module(torch.nn.Linear(2, 2)) for _ in range(2)]
    states[0].standing, states[1].standing = {"a": 4, "b": 4, "n": 4}, {"a": 4, "b": 4, "n": 3}
    state = LearnerState([Fragment(0, (0,), 6, 0, False), Fragment(1, (1,), 6, 0, False)], states, [])
    assert state.established(4, 2) == {"a", "b"}  # n is not yet established in fragment 1
    assert state.established(4, 2, 0) == {"a", "b", "n"} and state.established(4, 2, 7) == frozenset()
    states[1].standing = {"a": 4}
    assert state.established(4, 2) is None  # fragment 1 is still at its founding


def test_the_established_rule_is_part_of_the_lineage():
    base = load_learner_config(None, overrides=["averaging.established_after=0"])
    other = load_learner_config(None)  # 4, the default
    assert lineage_id(base) != lineage_id(other)
    assert lineage_id(other) != lineage_id(load_learner_config(None, overrides=["averaging.established_after=5"]))
