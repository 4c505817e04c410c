"""Child processes that die with their parent.

hivemind runs the DHT and each averager in a child process (fork), and the DHT process runs p2pd.
If the learner is killed with SIGKILL, those children would live on as orphans: still holding the
learner's identity (so it cannot restart under the same peer ID), still answering peers with stale
state. Linux's PR_SET_PDEATHSIG makes the kernel kill a child when its parent dies; p2pd already
exits when the process that started it goes away.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import hivemind

_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux only; no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != expected_parent:  # the parent died before prctl took effect
        os._exit(1)


class LinkedDHT(hivemind.DHT):
    """hivemind.DHT whose background process (and thus its p2pd) ends when the learner dies."""

    def run(self) -> None:
        die_with_parent(self._parent_pid)
        super().run()
