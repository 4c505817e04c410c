"""Logs a user can read: the ``[peer step=N round=R]`` prefix on every project module's lines, and a
dropped round's hivemind traceback kept at DEBUG."""

import logging
import sys

import pytest

from p2p_diloco import peer_log


@pytest.fixture
def handler():
    h = logging.Handler()
    h.records = []
    h.emit = h.records.append
    root = logging.getLogger()
    root.addHandler(h)
    yield h
    root.removeHandler(h)
    for other in root.handlers:  # install() reaches every root handler, pytest's own capture ones too
        for f in [f for f in other.filters if isinstance(f, peer_log.PeerPrefix)]:
            other.removeFilter(f)
    peer_log.set_peer("------")
    peer_log.set_position(lambda: (0, 0))


def test_every_project_module_gets_the_peer_prefix(handler):
    peer_log.install()
    peer_log.install()  # idempotent
    assert sum(isinstance(f, peer_log.PeerPrefix) for f in handler.filters) == 1
    peer_log.set_peer("abc123")
    peer_log.set_position(lambda: (42, 7))
    for name in ("p2p_diloco.learner.schedule", "p2p_diloco.net.progress_records", "p2p_diloco.net.allreduce"):
        logging.getLogger(name).warning("value %d", 5)
    logging.getLogger("elsewhere").warning("untouched")
    messages = [r.getMessage() for r in handler.records]
    assert messages[:3] == ["[abc123 step=42 round=7] value 5"] * 3 and messages[3] == "untouched"


def test_a_failed_averaging_step_traceback_goes_to_debug():
    from p2p_diloco.net.averaging import _FailedStepToDebug

    def record(msg, level=logging.ERROR, func="_step", exc=True):
        try:
            raise RuntimeError(msg)
        except RuntimeError:
            info = sys.exc_info() if exc else None
        return logging.LogRecord("hivemind.averaging.averager", level, __file__, 1, msg, None, info, func)

    f = _FailedStepToDebug()
    assert not f.filter(record("Averaging step failed: could not find a group"))
    step = record("Unable to run All-Reduce: sender 2 failed")
    f.filter(step)
    assert step.levelno == logging.DEBUG
    allreduce = record("sender 2 failed", func="_aggregate_with_group")  # logged, then re-raised to _step
    f.filter(allreduce)
    assert allreduce.levelno == logging.DEBUG
    other = record("something else", func="rpc_join_group")
    assert f.filter(other) and other.levelno == logging.ERROR


def test_json_lines_carry_the_prefix_fields_and_the_bare_message(handler):
    import json

    peer_log.install()
    peer_log.set_peer("aB3xYz")
    peer_log.set_position(lambda: (120, 4))
    logging.getLogger("p2p_diloco.learner.schedule").warning("outer round committed | version %d", 5)
    logging.getLogger("elsewhere").warning("not ours")
    lines = [json.loads(peer_log.JsonLines().format(r)) for r in handler.records]
    assert lines[0]["peer"] == "aB3xYz" and (lines[0]["step"], lines[0]["round"]) == (120, 4)
    assert lines[0]["message"] == "outer round committed | version 5" and lines[0]["level"] == "WARNING"
    assert lines[0]["logger"] == "p2p_diloco.learner.schedule" and lines[0]["time"].endswith("Z")
    assert lines[1]["message"] == "not ours" and "peer" not in lines[1]
