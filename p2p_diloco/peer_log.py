"""The ``[peer step=N round=R]`` prefix on every log line of the project's modules.

Modules log with plain ``logging.getLogger(__name__)``; :func:`install` puts a filter on the root
logger's handlers that prefixes every record of a ``p2p_diloco.*`` logger with the learner's short
peer id, its inner step and its round (the version of its oldest fragment), read when the line is
written. hivemind forks the DHT and averager processes from the learner; lines written there carry
``[peer child]`` instead, since their copy of the counters stopped at the fork.
"""

from __future__ import annotations

import logging
import os
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


def prefix() -> str:
    """``[peer step=N round=R]`` now, or ``[peer child]`` in a process other than the one that set the position."""
    if os.getpid() != _pid:
        return f"[{_peer} child]"
    step, round_ = _position()
    return f"[{_peer} step={step} round={round_}]"


class PeerPrefix(logging.Filter):
    """The filter :func:`install` adds: prefixes each ``p2p_diloco.*`` record once, formatting its message."""
    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("p2p_diloco") and not getattr(record, "peer_prefixed", False):
            record.msg, record.args = f"{prefix()} {record.getMessage()}", None
            record.peer_prefixed = True
        return True


def install() -> None:
    """Prefix the project's lines on every handler of the root logger (idempotent)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, PeerPrefix) for f in handler.filters):
            handler.addFilter(PeerPrefix())
