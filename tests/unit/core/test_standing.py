"""Standing: certified rounds per identity, who is established, weight ramps, and the state that carries it."""

import pytest
import torch

from p2p_diloco.config import OuterConfig
from p2p_diloco.core import standing as standings
from p2p_diloco.core.exclusion import Rules, judge
from p2p_diloco.core.outer import GlobalState, OuterOptimizer, StateFormatError, merge_lineages
from p2p_diloco.core.state_layout import parse_download, snapshot


def test_rounds_credit_their_contributors_and_merges_keep_the_larger_count():
    s: dict[str, int] = {}
    for contributors in (["a", "b", "c"], ["a", "b"], ["a", "a", "b", "d"]):  # a duplicate counts once
        s = standings.credited(s, contributors)
    assert s == {"a": 3, "b": 3, "c": 1, "d": 1}
    assert standings.merged(s, {"c": 5, "e": 1}) == standings.merged({"c": 5, "e": 1}, s) == \
        {"a": 3, "b": 3, "c": 5, "d": 1, "e": 1}


def test_a_standing_forgets_the_lowest_counts_first_the_same_everywhere(monkeypatch):
    monkeypatch.setattr(standings, "MAX_ENTRIES", 3)
    s = standings.credited({"a": 5, "b": 1, "c": 2, "d": 1}, [])
    assert s == {"a": 5, "c": 2, "b": 1}  # of b and d (1 each), the first peer ID stays
    assert list(s) == ["a", "b", "c"]  # sorted: one canonical form


def test_everyone_counts_until_enough_peers_are_established():
    assert standings.established({}, after=4, floor=2) is None  # the swarm's first rounds
    assert standings.established({"a": 4, "b": 3}, after=4, floor=2) is None
    assert standings.established({"a": 4, "b": 4, "c": 3}, after=4, floor=2) == {"a", "b"}
    assert standings.established({"a": 9, "b": 9}, after=0, floor=2) is None  # switched off
    assert standings.counted(["a", "c", "x"], frozenset({"a", "b"})) == 1
    assert standings.counted(["a", "c", "x"], None) == 3


def test_a_fresh_identity_counts_with_a_share_of_its_weight():
    s = {"a": 4, "b": 4, "c": 2}
    assert standings.ramps(s, ["a", "c", "fresh"], after=4, floor=2) == {"a": 1.0, "c": 0.6, "fresh": 0.2}
    assert standings.ramps({"a": 1}, ["a", "fresh"], after=4, floor=2) == {"a": 1.0, "fresh": 1.0}  # founding
    meta = {"norm": 1.0, "finite": True, "weight": 10.0}
    verdict = judge({"a": meta, "fresh": meta}, Rules(8.0), ramp={"a": 1.0, "fresh": 0.2})
    assert verdict.weights == {"a": 10.0, "fresh": 2.0}


@pytest.mark.parametrize("bad", ["x", {"a": -1}, {"a": 0}, {"a": 2**41}, {"a": True}, {"a": 1.5}, {7: 1},
                                 {"": 1}, {"p" * 129: 1}])
def test_a_malformed_standing_is_refused_in_one_line(bad):
    with pytest.raises(ValueError):
        standings.parsed(bad)
    state = GlobalState.from_module(torch.nn.Linear(2, 2))
    with pytest.raises(StateFormatError):
        GlobalState.from_dict({**state.to_dict(), "standing": bad})


def test_the_standing_is_part_of_the_state_and_of_its_hash():
    state = GlobalState.from_module(torch.nn.Linear(3, 2))
    genesis = state.sha256()
    state.credit([])  # an empty standing leaves the hash as it was (states from before the standing)
    assert state.sha256() == genesis
    OuterOptimizer(OuterConfig()).apply(state, [torch.ones_like(p) for p in state.params], tokens=7)
    plain = state.sha256()
    state.credit(["a", "b"])
    assert state.sha256() != plain
    again = GlobalState.from_dict(state.to_dict())
    assert again.standing == {"a": 1, "b": 1} and again.sha256() == state.sha256()
    assert state.copy().standing == state.standing and state.copy().standing is not state.standing

    # A served state whose standing was changed in transit (or by the server) fails the download's hash check.
    meta, tensors = snapshot([state])
    assert parse_download(meta, tensors, [state])[1] == ""
    meta["fragments"][0]["standing"] = {"a": 1, "b": 1, "sybil": 9}
    assert "does not match" in parse_download(meta, tensors, [state])[1]


def test_a_merge_of_lineages_keeps_each_peers_larger_standing():
    a = GlobalState.from_module(torch.nn.Linear(2, 2))
    b = a.copy()
    a.credit(["x", "y"])
    b.credit(["y"])
    b.credit(["y", "z"])
    assert merge_lineages(a, b).standing == merge_lineages(b, a).standing == {"x": 1, "y": 2, "z": 1}



def test_a_committed_round_remembers_the_hash_it_ends_with():
    """The history must hold the state's final hash (standing credited): a descendant's history is how a learner
    tells it from a sibling lineage."""
    from p2p_diloco.learner.round import OuterRound

    class Pair:
        def average(self, deltas, weight, metadata, version, fragment=0, grace=None, search_seconds=None,
                    standing=None):
            from p2p_diloco.core.averaging_api import AverageResult
            from p2p_diloco.core.exclusion import Verdict

            mates = {"me": dict(metadata), "other": dict(metadata)}
            return AverageResult([d.clone() for d in deltas], mates, 0.0, 0, verdict=Verdict())

    state = GlobalState.from_module(torch.nn.Linear(2, 2))
    rnd = OuterRound(state=state, optimizer=OuterOptimizer(OuterConfig()), averaging=Pair(),
                     local_params=[p - 0.1 for p in state.params], tokens=64, inner_steps=2)
    out = rnd.run()
    assert out.committed, out.reason
    assert state.standing == {"me": 1, "other": 1} and state.history[-1] == (1, state.sha256())
