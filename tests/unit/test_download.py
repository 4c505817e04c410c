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
