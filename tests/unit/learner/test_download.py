"""The served state: one layout for serving, slicing and parsing; a download verified by its hashes;
and deciding from the progress records that the swarm is ahead."""


import pytest
import torch

from p2p_diloco.config import load_learner_config
from p2p_diloco.core.fragments import build_fragments
from p2p_diloco.core.outer import GlobalState
from p2p_diloco.core.state_layout import fragment_slices, parse_download, select_fragments, snapshot
from p2p_diloco.learner.catch_up import CatchUp
from p2p_diloco.learner.progress import Progress
from p2p_diloco.learner.state import LearnerState
from p2p_diloco.net.progress_records import ProgressRecord
from tests.unit.fake_averaging import FakeAveraging


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


def served(ss: list[GlobalState]) -> tuple[dict, list[torch.Tensor]]:
    return snapshot(ss)


def test_subset_download_yields_only_those_fragments_verified():
    theirs, ours = states(), [s.copy() for s in states()]
    meta, whole = served(theirs)
    got, problem = parse_download(meta, select_fragments(whole, [1, 2], [1]), ours, [1])
    assert problem == "" and list(got) == [1]
    assert got[1].sha256() == theirs[1].sha256() and got[1].version == 5 and got[1].history == theirs[1].history


def test_one_layout_for_slices_and_selection():
    assert fragment_slices([1, 2, 3]) == [slice(0, 2), slice(2, 6), slice(6, 12)]
    assert fragment_slices([1, 2, 3], [2, 0]) == [slice(0, 2), slice(2, 8)]
    meta, whole = served(states())
    assert [t.shape for t in select_fragments(whole, [1, 2], [1])] == [t.shape for t in states()[1].tensors()]


def test_whole_download_and_mismatches_are_refused_with_a_reason():
    theirs, ours = states(), states()
    meta, whole = served(theirs)
    got, problem = parse_download(meta, whole, ours)
    assert problem == "" and sorted(got) == [0, 1]
    # The tensors of fragment 0 where fragment 1's were asked for: wrong count.
    _, problem = parse_download(meta, [t.clone() for t in theirs[0].tensors()], ours, [1])
    assert "expected 4 tensors" in problem
    tampered = [t.clone() for t in theirs[1].tensors()]
    tampered[0][0] += 1.0
    _, problem = parse_download(meta, tampered, ours, [1])
    assert "hash of fragment 1" in problem
    _, problem = parse_download("junk", whole, ours)
    assert problem == "metadata does not describe every fragment"
    nan = [t.clone() for t in whole]
    nan[0][0, 0] = float("nan")
    assert parse_download(meta, nan, ours)[1] == "tensor holds NaN or Inf"
    for field, bad in (("version", -1), ("tokens", 2**64 - 1), ("momentum_initialized", 1), ("history", [[1]])):
        entries = [dict(e) for e in meta["fragments"]]
        entries[1][field] = bad
        _, problem = parse_download({**meta, "fragments": entries}, whole, ours)
        assert problem.startswith("fragment 1:"), (field, problem)


def test_global_state_round_trips_through_its_dict():
    s = states()[1]
    s.record_contributors(5, ["b", "a"])
    back = GlobalState.from_dict(s.to_dict())
    assert back.sha256() == s.sha256() and back.history == s.history and back.contributors == s.contributors


class Board:
    def __init__(self, records):
        self.records = records

    def read(self):
        return dict(self.records)


def catch_up_with(records, stop_at=2.5, extra=()) -> CatchUp:
    overrides = ["sync.fragments=2"] + ([f"run.stop_at_eval_loss={stop_at}"] if stop_at else []) + list(extra)
    cfg = load_learner_config(None, overrides)
    fragments = build_fragments([("a", torch.Size([4, 5])), ("b", torch.Size([7]))], 2, 10)
    state = LearnerState(fragments=fragments, states=states(), params=[], peer_id="me")
    progress = Progress(Board(records), state, 15.0)
    return CatchUp(cfg, state, FakeAveraging(), progress, should_stop=lambda: False)


def test_a_learner_behind_peers_that_reached_the_target_and_left_stops_too():
    ahead = ProgressRecord(9, "0" * 64, 10, "done", versions=(9, 9), shas=("a" * 64, "b" * 64))
    catch_up = catch_up_with({"me": ahead, "peer": ahead})
    behind = catch_up.look()
    assert behind.peers == ["peer"] and behind.fragments == [0, 1] and not catch_up.end.gone
    catch_up.progress.board.records = {"peer": ProgressRecord(9, "0" * 64, 10, "left")}
    assert catch_up.look().fragments == [] and catch_up.end.gone
    # Behind on one fragment only (the oldest fragment's version the same: 8): stops too.
    done_8_9 = ProgressRecord(8, "0" * 64, 10, "done", versions=(8, 9), shas=("a" * 64, "b" * 64))
    ours_8_8 = catch_up_with({"peer": done_8_9})
    ours_8_8.state.states[0].version = ours_8_8.state.states[1].version = 8
    ours_8_8.look()
    ours_8_8.progress.board.records = {"peer": ProgressRecord(8, "0" * 64, 10, "left", versions=(8, 9))}
    ours_8_8.look()
    assert ours_8_8.end.done_at == [8, 9] and ours_8_8.end.gone
    # Level with the finished peers on every fragment: nothing to download. Nobody else trains, and alone no
    # round can commit (quorum 2): left alone, the learner evaluates its global model once more and stops.
    level = catch_up_with({"peer": done_8_9})
    level.state.states[0].version, level.state.states[1].version = 8, 9
    level.look()
    assert not level.end.left_alone  # the finished peer is still there (serving, lingering)
    level.progress.board.records = {"peer": ProgressRecord(8, "0" * 64, 10, "left", versions=(8, 9))}
    level.look()
    assert level.end.done_at == [8, 9] and not level.end.gone and level.end.left_alone
    # Not alone while another learner was seen training (a read that misses its record does not count) ...
    training = ProgressRecord(8, "0" * 64, 10, "training", versions=(8, 9))
    level.progress._remember({"other": training})
    level.look()
    assert not level.end.left_alone
    # ... nor when a learner may commit alone (quorum 1), nor without a target loss.
    for solo in (catch_up_with({"peer": done_8_9}, extra=["averaging.min_group_size=1"]),
                 catch_up_with({"peer": done_8_9}, stop_at=None)):
        solo.look()
        solo.progress.board.records = {"peer": ProgressRecord(8, "0" * 64, 10, "left", versions=(8, 9))}
        solo.look()
        assert solo.end.saw_finished and not solo.end.left_alone
    # Without a target loss, a learner left alone trains on (the others may have been interrupted).
    alone = catch_up_with({"peer": ahead}, stop_at=None)
    alone.look()
    alone.progress.board.records = {}
    alone.look()
    assert not alone.end.gone


def test_a_download_is_taken_from_the_first_peer_that_serves_a_newer_verified_state():
    theirs = states()
    for s in theirs:
        s.version += 1
        s.remember()
    catch_up = catch_up_with({}, stop_at=None)
    ours = [s.copy() for s in catch_up.state.states]
    bad_meta, bad_tensors = served(theirs)
    bad_tensors = [t + 1 for t in bad_tensors]  # does not match its advertised hashes
    catch_up.averaging = FakeAveraging(serves={"liar": (bad_meta, bad_tensors), None: served(theirs)})
    got = catch_up.fetch(["liar"], [0, 1])
    assert sorted(got) == [0, 1] and got[0].sha256() == theirs[0].sha256()
    assert [s.sha256() for s in catch_up.state.states] == [s.sha256() for s in ours]  # fetch changes nothing


def test_clients_and_relayed_learners_are_not_taken_as_download_sources():
    ahead = {reach: ProgressRecord(9, "0" * 64, 10, "running", versions=(9, 9), shas=("a" * 64, "b" * 64), reach=reach)
             for reach in ("client", "relay", "direct", "")}
    only_clients = catch_up_with({"c": ahead["client"], "r": ahead["relay"]}, stop_at=None)
    assert only_clients.look().fragments == []  # what they show is held by a reachable peer, or by nobody
    mixed = catch_up_with({"c": ahead["client"], "d": ahead["direct"], "old": ahead[""]}, stop_at=None)
    behind = mixed.look()
    assert sorted(behind.peers) == ["d", "old"] and behind.fragments == [0, 1]


def test_a_download_cut_inside_a_tensor_is_a_broken_stream_not_a_malformed_state():
    # hivemind ends a stream quietly when the connection closes: a tensor can arrive missing its last chunks
    # (WAN benchmark at 2 Mbit/s: "shape '[448, 1792]' is invalid for input of size 49152").
    from hivemind.compression import serialize_torch_tensor
    from hivemind.utils.streaming import split_for_streaming

    from p2p_diloco.net.downloads import whole_tensor

    t = torch.arange(448 * 1792, dtype=torch.float32).reshape(448, 1792)
    parts = list(split_for_streaming(serialize_torch_tensor(t)))
    assert len(parts) == 49
    assert torch.equal(whole_tensor(parts, 0), t)
    with pytest.raises(ConnectionError, match="after 3 of 49 chunks of tensor 5"):
        whole_tensor(parts[:3], 5)
    empty = list(split_for_streaming(serialize_torch_tensor(torch.zeros(0))))
    assert whole_tensor(empty, 0).numel() == 0
