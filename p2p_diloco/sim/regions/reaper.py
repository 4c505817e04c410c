"""A detached watchdog that tears a run's namespaces down if its supervisor dies without doing so.

``python -m p2p_diloco.sim.regions.reaper <supervisor pid> <prefix>`` runs in its own session (Ctrl+C
in the terminal does not reach it). When the supervisor exits for any reason, SIGKILL included,
it kills every process left in the run's namespaces and deletes them. A supervisor that tears down
by itself stops its reaper with SIGTERM, which ends it without doing anything.
"""

from __future__ import annotations

import os
import select
import signal
import sys

from p2p_diloco.sim.regions.netns import FAMILY, delete_namespaces


def wait_for_exit(pid: int) -> None:
    """Block until process ``pid`` has exited (pidfd: no polling, no pid-reuse race)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    """``argv`` = [supervisor pid, prefix]: wait for the supervisor to exit, then delete the prefix's namespaces.

    Returns 2, doing nothing, when the prefix is not one of ours.
    """
    pid, prefix = int(argv[0]), argv[1]
    if not prefix.startswith(FAMILY):  # never delete namespaces that are not ours
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wait_for_exit(pid)
    removed = delete_namespaces(prefix)
    if removed:
        print(f"reaper: supervisor {pid} is gone; removed {len(removed)} namespaces and their processes", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
