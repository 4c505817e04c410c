"""The ``[peer step=N round=R]`` prefix on every log line of the project's modules, and JSON lines.

Modules log with plain ``logging.getLogger(__name__)``; :func:`install` puts a filter on the root
logger's handlers that prefixes every record of a ``p2p_diloco.*`` logger with the learner's short
peer id, its inner step and its round (the version of its oldest fragment), read when the line is
written. hivemind forks the DHT and averager processes from the learner; lines written there carry
``[peer child]`` instead, since their copy of the counters stopped at the fork.

With ``--log-format json`` (:class:`JsonLines`) each line is one JSON object with the same fields as
the text line: ``time``, ``level``, ``logger``, ``peer``, ``step``, ``round`` (or ``child``) and
``message`` (without the prefix).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable

_peer = "------"
_position: Callable[[], tuple[int, int]] = lambda: (0, 0)  # noqa: E731 - (inner step, round)
_pid = os.getpid()


def set_peer(short_id: str) -> None:
    """The short peer id shown in every prefix (the learner gives the last 6 characters of its peer ID)."""
    global _peer
    _peer = short_id


def set_position(position: Callable[[], tuple[int, int]]) -> None:
    """``position()`` returns (inner step, round) of this process's learner."""
    global _position, _pid
    _position, _pid = position, os.getpid()


def position() -> dict[str, object]:
    """The prefix's fields now: peer, step and round, or peer and child in a forked process."""
    if os.getpid() != _pid:
        return {"peer": _peer, "child": True}
    step, round_ = _position()
    return {"peer": _peer, "step": step, "round": round_}


def prefix() -> str:
    """``[peer step=N round=R]`` now, or ``[peer child]`` in a process other than the one that set the position."""
    fields = position()
    if fields.get("child"):
        return f"[{_peer} child]"
    return f"[{_peer} step={fields['step']} round={fields['round']}]"


class PeerPrefix(logging.Filter):
    """The filter :func:`install` adds: prefixes each ``p2p_diloco.*`` record once, formatting its message
    (the fields and the bare message stay on the record, for :class:`JsonLines`)."""
    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("p2p_diloco") and not getattr(record, "peer_prefixed", False):
            bare = record.getMessage()
            record.peer_fields, record.bare_message = position(), bare
            record.msg, record.args = f"{prefix()} {bare}", None
            record.peer_prefixed = True
        return True


_LEVELS = {logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARNING", logging.ERROR: "ERROR",
           logging.CRITICAL: "CRITICAL"}


class JsonLines(logging.Formatter):
    """One JSON object per line: time, level, logger, the prefix's fields and the message."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            # The standard names (hivemind renames WARNING to WARN in text lines).
            "level": _LEVELS.get(record.levelno, record.levelname), "logger": record.name,
            **getattr(record, "peer_fields", {}),
            "message": getattr(record, "bare_message", None) or record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def install() -> None:
    """Prefix the project's lines on every handler of the root logger (idempotent)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, PeerPrefix) for f in handler.filters):
            handler.addFilter(PeerPrefix())
