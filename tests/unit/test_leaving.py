"""When a stopped learner's matchmaking and downloads give up (``Learner._leaving``), and which
progress records its training loop reads (``Learner._records``)."""

import threading
import time

from p2p_diloco.config import load_learner_config
from p2p_diloco.learner import Learner


def _learner(*overrides):
    return Learner(load_learner_config(None, ["run.drain_seconds=30", *overrides]), threading.Event())


def test_a_stop_during_set_up_leaves_at_once():
    learner = _learner()
    assert not learner._leaving()
    learner.stop.set()
    assert learner._leaving()


def test_once_training_the_stop_leaves_the_drain_budget_then_gives_up():
    learner = _learner()
    learner._training = True
    learner.stop.set()
    assert not learner._leaving()  # the round forming at the signal may still meet the others
    assert learner._parting_until is not None and learner._parting_until > time.monotonic() + 25
    learner._parting_until = time.monotonic() - 0.1
    assert learner._leaving()


def test_a_second_signal_or_no_budget_leaves_at_once():
    learner = _learner()
    learner._training = True
    learner.stop.set()
    learner.leave_now.set()
    assert learner._leaving()
    none = _learner("run.drain_seconds=0")
    none._training = True
    none.stop.set()
    assert none._leaving()


class _Board:
    def __init__(self):
        self.reads = 0

    def read(self):
        self.reads += 1
        return {"peer": self.reads}


def test_the_training_loop_reads_records_as_last_seen_until_a_round_fails():
    learner = _learner()
    learner.board = _Board()
    assert learner._records(fresh=False) == {"peer": 1}  # nothing seen yet: looked up
    assert learner._records(fresh=False) == {"peer": 1}  # as last seen: no lookup
    assert learner._records(fresh=True) == {"peer": 2}
    learner._records_stale = True  # what a failed round sets
    assert learner._records(fresh=False) == {"peer": 3}
    assert learner._records(fresh=False) == {"peer": 3}
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
