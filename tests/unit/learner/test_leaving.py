"""When a stopped learner's matchmaking and downloads give up (``parting.Leaving``), and which
progress records its training loop reads (``Progress.records``)."""

import threading
import time
from types import SimpleNamespace

from p2p_diloco.learner.parting import Leaving, linger
from p2p_diloco.learner.progress import Progress
from p2p_diloco.net.progress_records import ProgressRecord


def _learner(drain_seconds: float = 30.0) -> Leaving:
    return Leaving(drain_seconds, threading.Event())


def test_a_stop_during_set_up_leaves_at_once():
    learner = _learner()
    assert not learner()
    learner.stop.set()
    assert learner()


def test_once_training_the_stop_leaves_the_drain_budget_then_gives_up():
    learner = _learner()
    learner.training = True
    learner.stop.set()
    assert not learner()  # the round forming at the signal may still meet the others
    assert learner.until is not None and learner.until > time.monotonic() + 25
    learner.until = time.monotonic() - 0.1
    assert learner()


def test_a_second_signal_or_no_budget_leaves_at_once():
    learner = _learner()
    learner.training = True
    learner.stop.set()
    learner.leave_now.set()
    assert learner()
    none = _learner(0.0)
    none.training = True
    none.stop.set()
    assert none()


def test_a_finished_learner_serves_while_a_learner_behind_is_remembered(monkeypatch):
    """Reads that miss a learner behind us (its records lost while it downloads over a slow link) do not end the
    lingering; the learner catching up does, and so does the bound."""
    def rec(version, status="training"):
        return ProgressRecord(version, "a" * 64, 0, status)
    reads = [{"me": rec(8, "done"), "behind": rec(6)}, {"me": rec(8, "done")}, {"me": rec(8, "done")},
             {"me": rec(8, "done"), "behind": rec(8)}]
    board = SimpleNamespace(read=lambda: reads.pop(0) if len(reads) > 1 else reads[0])
    progress = Progress(board, SimpleNamespace(peer_id="me"), record_ttl=8.0)
    leaving = _learner()
    waits: list[float] = []
    leaving.stop.wait = lambda seconds: waits.append(seconds) or False  # type: ignore[method-assign]
    linger(leaving, progress, versions=[8], seconds=600.0)
    assert len(waits) == 3 and reads == [{"me": rec(8, "done"), "behind": rec(8)}]  # caught up at the 4th read
    # Bounded: a learner behind that never catches up (or died) holds us for ``seconds`` at most.
    stuck = Progress(SimpleNamespace(read=lambda: {"behind": rec(6)}), SimpleNamespace(peer_id="me"), 8.0)
    clock = [0.0]
    monkeypatch.setattr("p2p_diloco.learner.parting.time.monotonic", lambda: clock[0])
    leaving.stop.wait = lambda seconds: clock.__setitem__(0, clock[0] + seconds) or False  # type: ignore[method-assign]
    linger(leaving, stuck, versions=[8], seconds=30.0)
    assert clock[0] == 30.0


def test_a_learner_behind_on_one_fragment_is_behind():
    """Behind on any fragment, not by the oldest one (``version``, the minimum): at [8, 8] against our [8, 9], a
    learner still needs fragment 1 from us (WAN benchmark, 10 Mbit/s: the last learners left one so)."""
    def rec(versions):
        return ProgressRecord(min(versions), "a" * 64, 0, "training", versions=tuple(versions))
    reads = [{"behind": rec([8, 8])}, {"behind": rec([8, 8])}, {"behind": rec([8, 9])}]
    progress = Progress(SimpleNamespace(read=lambda: reads.pop(0) if len(reads) > 1 else reads[0]),
                        SimpleNamespace(peer_id="me"), record_ttl=8.0)
    leaving = _learner()
    waits: list[float] = []
    leaving.stop.wait = lambda seconds: waits.append(seconds) or False  # type: ignore[method-assign]
    linger(leaving, progress, versions=[8, 9], seconds=600.0)
    assert len(waits) == 2  # left once the record said [8, 9]
    ahead = Progress(SimpleNamespace(read=lambda: {"ahead": rec([9, 9])}), SimpleNamespace(peer_id="me"), 8.0)
    linger(leaving, ahead, versions=[8, 9], seconds=600.0)
    assert len(waits) == 2  # nobody behind: no wait


def _read(n: int) -> ProgressRecord:
    """The record the fake board returns at its n-th read (its tokens say which read it was)."""
    return ProgressRecord(1, "a" * 64, n)


class _Board:
    def __init__(self):
        self.reads = 0

    def read(self):
        self.reads += 1
        return {"peer": _read(self.reads)}


def test_the_training_loop_reads_records_as_last_seen_until_a_round_fails():
    learner = Progress(_Board(), SimpleNamespace(peer_id="me"), 15.0)
    assert learner.records(fresh=False) == {"peer": _read(1)}  # nothing seen yet: looked up
    assert learner.records(fresh=False) == {"peer": _read(1)}  # as last seen: no lookup
    assert learner.records(fresh=True) == {"peer": _read(2)}
    learner.stale = True  # what a failed round sets
    assert learner.records(fresh=False) == {"peer": _read(3)}
    assert learner.records(fresh=False) == {"peer": _read(3)}
    assert learner.board.reads == 3


def test_the_signal_handler_returns_even_while_the_events_lock_is_held():
    """A signal can land while the main thread is inside ``Event.wait`` holding the event's lock.

    The handler must return at once there (``Event.set`` inline would wait for that lock forever, on
    the very thread that holds it); the event is set as soon as the lock is let go.
    """
    import signal

    from p2p_diloco.cli import stop_handler

    stop, leave_now = threading.Event(), threading.Event()
    on_signal = stop_handler(stop, leave_now)
    for event, signum in ((stop, signal.SIGTERM), (leave_now, signal.SIGINT)):  # the second one: leave now
        with event._cond:  # held the way Event.wait holds it between two bytecodes
            handler = threading.Thread(target=on_signal, args=(signum, None))
            handler.start()
            handler.join(2.0)
            assert not handler.is_alive(), "the handler blocked on the event's lock"
        assert event.wait(5.0)
    assert stop.is_set() and leave_now.is_set()
