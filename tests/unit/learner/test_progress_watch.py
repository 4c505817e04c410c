"""The heartbeat's view of the swarm (p2p_diloco/learner/progress.py): joins and leaves it audits, debounced, and the
number of visible learners it reports."""

import threading
from types import SimpleNamespace

from p2p_diloco.learner.metrics import Metrics
from p2p_diloco.learner.progress import Progress, SwarmWatch
from p2p_diloco.net.progress_records import ProgressRecord

ME = "12D3KooWme"


def _rec(status="training", version=1, reach="direct"):
    return ProgressRecord(version, "a" * 64, 0, status, versions=(version,), shas=("a" * 64,), reach=reach)


def test_a_join_is_reported_once_and_flicker_says_nothing():
    w = SwarmWatch(gone_after=20.0)
    me = {ME: _rec()}
    assert w.update({**me, "p1": _rec()}, ME, now=0.0) == [("p1", "joined", {"version": 1, "reach": "direct",
                                                                             "already_there": True})]
    assert w.update({**me, "p1": _rec()}, ME, now=3.0) == []
    assert w.update(me, ME, now=6.0) == []  # a lookup that missed p1's record
    assert w.update({}, ME, now=40.0) == []  # a failed lookup: no verdict on anyone
    assert w.update({**me, "p1": _rec(version=2)}, ME, now=22.0) == []  # back within 2 × ttl: no new join
    late = w.update({**me, "p1": _rec(), "p2": _rec(reach="client")}, ME, now=25.0)
    assert late == [("p2", "joined", {"version": 1, "reach": "client", "already_there": False})]


def test_gone_after_the_window_and_joined_again_when_back():
    w = SwarmWatch(gone_after=20.0)
    w.update({ME: _rec(), "p1": _rec()}, ME, now=0.0)
    assert w.update({ME: _rec()}, ME, now=15.0) == []
    assert w.update({ME: _rec()}, ME, now=20.5) == [("p1", "gone", {"unseen_seconds": 20.5})]
    assert w.update({ME: _rec()}, ME, now=30.0) == []  # gone once
    back = w.update({ME: _rec(), "p1": _rec(version=5)}, ME, now=31.0)
    assert back == [("p1", "joined", {"version": 5, "reach": "direct", "already_there": False})]


def test_a_left_record_is_one_leave_and_a_restart_is_a_join():
    w = SwarmWatch(gone_after=20.0)
    w.update({ME: _rec(), "p1": _rec()}, ME, now=0.0)
    assert w.update({ME: _rec(), "p1": _rec("left", version=3)}, ME, now=3.0) == [("p1", "left", {"version": 3})]
    assert w.update({ME: _rec(), "p1": _rec("left", version=3)}, ME, now=6.0) == []  # its record lingers: once
    assert w.update({ME: _rec()}, ME, now=60.0) == []  # and it is not "gone" after leaving
    assert w.update({ME: _rec(), "p1": _rec()}, ME, now=61.0)[0][:2] == ("p1", "joined")
    # a learner that left before we ever saw it live is neither a join nor a leave
    assert w.update({ME: _rec(), "p1": _rec(), "p9": _rec("left")}, ME, now=62.0) == []


def test_done_learners_are_still_there():
    w = SwarmWatch(gone_after=20.0)
    w.update({ME: _rec(), "p1": _rec()}, ME, now=0.0)
    assert w.update({ME: _rec(), "p1": _rec("done")}, ME, now=3.0) == []


class _Board:
    def __init__(self, reads):
        self.reads, self.published = list(reads), []

    def publish(self, record):
        self.published.append(record)

    def read(self):
        return self.reads.pop(0) if self.reads else {}


class _Audit:
    def __init__(self):
        self.events, self.done = [], threading.Event()

    def peer_seen(self, peer, event, **fields):
        self.events.append((peer, event))
        if len(self.events) == 2:
            self.done.set()


def test_the_heartbeat_audits_what_it_sees_and_counts_the_visible():
    board = _Board([{ME: _rec(), "p1": _rec(), "p2": _rec("left")}, {ME: _rec(), "p1": _rec("left")}])
    state = SimpleNamespace(peer_id=ME, served=SimpleNamespace(metadata=None))
    progress = Progress(board, state, record_ttl=0.03, audit=_Audit(), metrics=Metrics())  # a heartbeat every 10 ms
    seen = []
    progress.metrics.peers_visible = seen.append
    progress.start()
    try:
        assert progress.audit.done.wait(5.0)
    finally:
        progress.stop()
    assert progress.audit.events == [("p1", "joined"), ("p1", "left")]
    assert seen[:2] == [1, 0]


def test_only_a_claim_to_be_ahead_that_can_be_checked_cancels_a_round():
    """A record claiming a newer version cancels matchmaking (newest_live_version) only from a learner others
    download from, and so check: a client's or relayed learner's claim is never checked, and would stall every
    round (docs/security.md, "Claims to be ahead")."""
    records = {ME: _rec(version=3), "liar": _rec(version=1003, reach="client"),
               "relayed": _rec(version=9, reach="relay"), "old": _rec(version=2, reach=""),
               "left": _rec("left", version=50)}
    progress = Progress(SimpleNamespace(read=lambda: records), SimpleNamespace(peer_id=ME), 15.0)
    assert progress.newest_live_version(0) == 2
    records["server"] = _rec(version=4)
    assert progress.newest_live_version(0) == 4
    progress.distrust("server", 60.0)  # it served less than it claimed (catch_up.py)
    assert progress.newest_live_version(0) == 2
