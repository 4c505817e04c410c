"""The end of the run as the records show it (p2p_diloco/learner/swarm_end.py)."""

import pytest

from p2p_diloco.config import load_learner_config
from p2p_diloco.errors import LearnerError
from p2p_diloco.learner.swarm_end import SwarmEnd
from p2p_diloco.net.progress_records import ProgressRecord


def _end() -> SwarmEnd:
    return SwarmEnd(load_learner_config(None, ["run.max_outer_steps=4"]), 1)


def _record(version: int, status: str) -> ProgressRecord:
    return ProgressRecord(version, "a" * 64, 0, status)  # type: ignore[arg-type]


def _observe(end: SwarmEnd, records: dict, versions=(3,), whole: bool = True) -> None:
    live = {p: r for p, r in records.items() if r.status != "left"}
    end.observe(records, live, list(versions), False, set, whole)


def test_a_swarm_that_left_at_the_target_is_an_error_for_a_learner_behind_it():
    end = _end()
    with pytest.raises(LearnerError, match="already finished at version 4"):
        _observe(end, {"a": _record(4, "left"), "b": _record(4, "left")})


def test_the_finish_is_remembered_after_the_left_records_expire():
    """Seen while a peer still served (its download then failed), then a read without anyone: the records saying
    'left' expired between two reads (scale_swarm.py at 16 learners: trained alone until the timeout)."""
    end = _end()
    _observe(end, {"a": _record(4, "left"), "b": _record(4, "done")})  # b still lingers: not yet
    assert end.finished_at == 4
    with pytest.raises(LearnerError, match="already finished at version 4"):
        _observe(end, {})  # a whole read (ours in it) showing nobody


def test_an_empty_read_or_a_live_peer_or_the_target_reached_is_no_end():
    end = _end()
    _observe(end, {"a": _record(4, "left"), "b": _record(3, "training")})
    _observe(end, {}, whole=False)  # the lookup failed: nobody seen is not nobody there
    _observe(end, {"b": _record(3, "training")})  # someone is still training with us
    _observe(end, {}, versions=(4,))  # we reached the target ourselves
    fresh = _end()
    _observe(fresh, {})  # nobody ever finished: a learner alone at the start waits for others
    _observe(fresh, {"a": _record(2, "left")})  # left before the target: not the run's end
    assert fresh.finished_at == 0
