"""The end of the run as the records show it (p2p_diloco/learner/swarm_end.py)."""

import pytest

from p2p_diloco.config import load_learner_config
from p2p_diloco.errors import LearnerError
from p2p_diloco.learner.swarm_end import SwarmEnd
from p2p_diloco.net.progress_records import ProgressRecord

TTL = 15.0


def _end() -> SwarmEnd:
    return SwarmEnd(load_learner_config(None, ["run.max_outer_steps=4", f"network.record_ttl={TTL}"]), 1)


def _record(version: int, status: str) -> ProgressRecord:
    return ProgressRecord(version, "a" * 64, 0, status)  # type: ignore[arg-type]


def _observe(end: SwarmEnd, records: dict, now: float, versions=(3,)) -> None:
    live = {p: r for p, r in records.items() if r.status != "left"}
    behind = any(r.version > min(versions) for r in live.values())  # what CatchUp._behind says of these records
    end.observe(records, live, list(versions), behind, set, now=now)


def test_a_swarm_that_left_at_the_target_is_an_error_for_a_learner_behind_it():
    with pytest.raises(LearnerError, match="already finished at version 4"):
        _observe(_end(), {"a": _record(4, "left"), "b": _record(4, "left")}, now=0.0)


def test_the_finish_is_remembered_after_the_records_expire_and_nobody_is_live_for_two_ttls():
    """Seen while the others were done at the target and we were behind them (our download from them then failed),
    then reads without anyone: their 'left' records expired between two reads (scale_swarm.py at 16 learners:
    trained alone until the benchmark's timeout)."""
    end = _end()
    _observe(end, {"a": _record(4, "done"), "b": _record(4, "done")}, now=0.0)  # behind them: not yet
    assert end.finished_at == 4
    _observe(end, {}, now=20.0)  # one read showing nobody may have missed them
    _observe(end, {}, now=20.0 + 2 * TTL - 1)
    with pytest.raises(LearnerError, match="already finished at version 4"):
        _observe(end, {}, now=20.0 + 2 * TTL)


def test_a_live_peer_resets_the_wait_and_the_target_reached_or_an_early_leaver_is_no_end():
    end = _end()
    _observe(end, {"a": _record(4, "left"), "b": _record(3, "training")}, now=0.0)  # someone trains with us
    _observe(end, {}, now=10.0)
    _observe(end, {"b": _record(3, "training")}, now=20.0)  # seen again: the wait starts over
    _observe(end, {}, now=30.0)
    _observe(end, {}, now=30.0 + 2 * TTL - 1)
    _observe(end, {}, now=1000.0, versions=(4,))  # we reached the target ourselves
    fresh = _end()
    _observe(fresh, {}, now=0.0)  # nobody ever finished: a learner alone at the start waits for others
    _observe(fresh, {"a": _record(2, "left")}, now=1.0)  # left before the target: not the run's end
    _observe(fresh, {}, now=1000.0)
    assert fresh.finished_at == 0
