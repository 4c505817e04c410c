"""Joining the DHT again while no initial peer answers (p2p_diloco/learner/startup.py, join_dht)."""

import pytest

from p2p_diloco.errors import LearnerError
from p2p_diloco.learner import startup

SWAMPED = LearnerError("could not start or join the DHT (RuntimeError: DHTNode bootstrap failed: none of the "
                       "initial_peers responded to a ping. (set ensure_bootstrap_success=False to ignore))")


class _Dht:
    """A DHT whose join ends in ``outcome`` (None: joined)."""

    def __init__(self, outcome):
        self.outcome, self.shut = outcome, False

    def shutdown(self):
        self.shut = True


@pytest.fixture
def joins(monkeypatch):
    """The DHTs whose joins were waited for, in order."""
    waited = []

    def joined(dht):
        waited.append(dht)
        if dht.outcome is not None:
            raise dht.outcome

    monkeypatch.setattr(startup, "wait_until_joined", joined)
    return waited


def test_a_swamped_bootstrap_node_is_asked_again_after_a_growing_wait(joins):
    outcomes, sleeps = [SWAMPED, None], []
    dhts = [_Dht(SWAMPED)]
    startup.join_dht(dhts, lambda: _Dht(outcomes.pop(0)), backoff=5.0, sleep=sleeps.append)
    assert len(dhts) == 3 and dhts[0].shut and dhts[1].shut and not dhts[2].shut and joins == dhts
    assert len(sleeps) == 2 and 2.5 <= sleeps[0] <= 7.5 and 5.0 <= sleeps[1] <= 15.0


def test_the_last_start_raises_the_one_line_error_and_other_errors_are_not_retried(joins):
    with pytest.raises(LearnerError, match="none of the initial_peers"):
        startup.join_dht([_Dht(SWAMPED)], lambda: _Dht(SWAMPED), attempts=3, sleep=lambda s: None)
    assert len(joins) == 3
    joins.clear()
    with pytest.raises(LearnerError, match="port in use"):  # a mistake of the user's: at once
        startup.join_dht([_Dht(LearnerError("could not start the DHT (port in use)"))], lambda: 1 / 0,
                         sleep=lambda s: 1 / 0)
    assert len(joins) == 1


def test_a_bootstrap_node_not_up_yet_is_dialled_again(joins):
    down = LearnerError("could not start or join the DHT (P2PDaemonError: Daemon failed to start: 2026/12/08 00:36:15 "
                        "failed to connect to bootstrap peers)")
    dhts = [_Dht(down)]
    startup.join_dht(dhts, lambda: _Dht(None), sleep=lambda s: None)
    assert len(dhts) == 2 and dhts[0].shut and joins == dhts
