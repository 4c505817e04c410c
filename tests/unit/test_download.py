"""Parsing a peer's state download: whole state or a subset of fragments, each verified by its hash."""

import torch

from p2p_diloco.learner import _parse_downloaded
from p2p_diloco.outer import GlobalState


def states() -> list[GlobalState]:
    g = torch.Generator().manual_seed(0)
    out = []
    for v, shapes in ((3, [(4, 5)]), (5, [(7,), (2, 3)])):
        s = GlobalState(params=[torch.randn(*sh, generator=g) for sh in shapes],
                        momentum=[torch.randn(*sh, generator=g) for sh in shapes], version=v,
                        momentum_initialized=True, tokens=100 * v)
        s.remember()
        out.append(s)
    return out


def served(ss: list[GlobalState]) -> dict:
    return {"versions": [s.version for s in ss], "shas": [s.sha256() for s in ss],
            "momentum_initialized": [s.momentum_initialized for s in ss], "tokens": [s.tokens for s in ss],
            "histories": [[list(h) for h in s.history] for s in ss]}


def test_subset_download_yields_only_those_fragments_verified():
    theirs, ours = states(), [s.copy() for s in states()]
    got, problem = _parse_downloaded(served(theirs), [t.clone() for t in theirs[1].tensors()], ours, [1])
    assert problem == "" and list(got) == [1]
    assert got[1].sha256() == theirs[1].sha256() and got[1].version == 5


def test_whole_download_and_mismatches_are_refused_with_a_reason():
    theirs, ours = states(), states()
    whole = [t.clone() for s in theirs for t in s.tensors()]
    got, problem = _parse_downloaded(served(theirs), whole, ours)
    assert problem == "" and sorted(got) == [0, 1]
    # The tensors of fragment 0 where fragment 1's were asked for: wrong count.
    _, problem = _parse_downloaded(served(theirs), [t.clone() for t in theirs[0].tensors()], ours, [1])
    assert "expected 4 tensors" in problem
    tampered = [t.clone() for t in theirs[1].tensors()]
    tampered[0][0] += 1.0
    _, problem = _parse_downloaded(served(theirs), tampered, ours, [1])
    assert "hash of fragment 1" in problem
    _, problem = _parse_downloaded("junk", whole, ours)
    assert problem == "metadata is not a map"


class Board:
    def __init__(self, records):
        self.records = records

    def read(self):
        return dict(self.records)


def learner_behind(records, stop_at=2.5):
    from p2p_diloco.config import load_learner_config
    from p2p_diloco.fragments import build_fragments
    from p2p_diloco.learner import Learner

    overrides = ["sync.fragments=2"] + ([f"run.stop_at_eval_loss={stop_at}"] if stop_at else [])
    learner = Learner(load_learner_config(None, overrides))
    learner.peer_id, learner.board, learner.states = "me", Board(records), states()
    learner.fragments = build_fragments([("a", torch.Size([4, 5])), ("b", torch.Size([7]))], 2, 10)
    return learner


def test_a_learner_behind_peers_that_reached_the_target_and_left_stops_too():
    from p2p_diloco.records import ProgressRecord

    ahead = ProgressRecord(9, "0" * 64, 10, "done", versions=(9, 9), shas=("a" * 64, "b" * 64))
    learner = learner_behind({"me": ahead, "peer": ahead})
    peers, fragments, _ = learner._behind()
    assert peers == ["peer"] and fragments == [0, 1] and not learner._finished()
    learner.board.records = {"peer": ProgressRecord(9, "0" * 64, 10, "left")}
    assert learner._behind() == ([], [], "") and learner._finished()
    # Without a target loss, a learner left alone trains on (the others may have been interrupted).
    alone = learner_behind({"peer": ahead}, stop_at=None)
    alone._behind()
    alone.board.records = {}
    alone._behind()
    assert not alone._finished()
