"""Child processes of p2p-diloco: start each in its own process group, watch it, stop it, leave none.

Two kinds of parents share this module. The ``swarm`` and ``regions`` supervisors are asyncio programs
that forward every child's output line by line (:func:`spawn_pumped`, :func:`wait_for_bootstrap`,
:func:`stop_all`). Tests and benchmarks are plain scripts that send each child's output to a log file
and read it back (:class:`Proc`, :func:`start_bootstrap`, :func:`wait_until`, :func:`stop_procs`,
:func:`processes_in_group`).

Every child starts a new session: one ``killpg`` then reaches its p2pd daemon and hivemind's helper
processes too, and a Ctrl+C in the terminal reaches only the parent, which stops the children in order.

This module imports neither torch nor hivemind: the light CLI commands (``swarm``, ``regions``) use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# ``python -m p2p_diloco`` puts the working directory first on sys.path: started from here, a child
# imports the same package as its parent, whichever checkout that is.
SOURCE_ROOT = Path(__file__).resolve().parents[2]
LOOPBACK_ANY_PORT = "/ip4/127.0.0.1/tcp/0"
MADDRS_FILE = "bootstrap.maddrs"
STOP_GRACE = 45.0  # seconds: a learner's parting rounds take up to run.drain_seconds (20 s by default)
_PR_SET_PDEATHSIG = 1


class ChildExited(RuntimeError):
    """A child exited while its parent was still waiting for it to get somewhere."""


class StopRequested(Exception):
    """Ctrl+C or SIGTERM reached the supervisor while it was still waiting for its children to start."""


def cli(*args: str) -> list[str]:
    """The command line that runs ``p2p-diloco ARGS...`` with this interpreter."""
    return [sys.executable, "-m", "p2p_diloco", *args]


def child_env() -> dict[str, str]:
    """This process's environment, with Python output unbuffered so logs show each line as it happens."""
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def bootstrap_args(work: Path, maddr: str = LOOPBACK_ANY_PORT, announce: bool = False) -> list[str]:
    """CLI arguments of a bootstrap node that keeps its identity in ``work`` and writes its address
    to ``work / MADDRS_FILE``; ``announce`` when ``maddr`` is an address others can dial."""
    return ["bootstrap", "--host-maddrs", maddr, *(["--announce-maddrs", maddr] if announce else []),
            "--identity", str(work / "bootstrap.key"), "--maddrs-file", str(work / MADDRS_FILE)]


def first_word(path: Path) -> str | None:
    """The first word of ``path`` (a bootstrap node's first multiaddr); None while it is missing or empty."""
    try:
        words = path.read_text().split()
    except FileNotFoundError:
        return None
    return words[0] if words else None


# ------------------------------------------------------------------ asyncio supervisors (swarm, regions)


def sigterm_when_parent_dies() -> None:
    """``preexec_fn``: the child gets SIGTERM when its supervisor dies (it still leaves cleanly).

    Runs between fork and exec; ``ip netns exec`` execs its command without forking, so the flag
    reaches the p2p-diloco process there too. (``lifecycle.die_with_parent`` is the learner's own
    variant for hivemind's forked helpers: SIGKILL, and it imports hivemind, which a supervisor
    does not need.)"""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


async def pump(name: str, stream: asyncio.StreamReader) -> None:
    """Forward ``stream`` to stdout line by line, each line prefixed with ``name``."""
    while line := await stream.readline():
        sys.stdout.write(f"{name:>10} | {line.decode(errors='replace')}")
        sys.stdout.flush()


async def spawn_pumped(name: str, argv: Sequence[str]) -> tuple[asyncio.subprocess.Process, asyncio.Task[None]]:
    """Start ``argv`` in its own session, its output forwarded by :func:`pump`; the process and the pump."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=child_env(),
        start_new_session=True, preexec_fn=sigterm_when_parent_dies,
    )
    assert proc.stdout is not None  # stdout=PIPE
    return proc, asyncio.create_task(pump(name, proc.stdout))


async def wait_for_bootstrap(path: Path, proc: asyncio.subprocess.Process, timeout: float,
                             stop: asyncio.Event | None = None,
                             error: Callable[[str], Exception] = RuntimeError) -> str:
    """The address the bootstrap node ``proc`` writes to ``path``.

    Raises StopRequested if ``stop`` is set first, and ``error(message)`` when the node exits first or
    writes nothing within ``timeout`` seconds.
    """
    stop = stop or asyncio.Event()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.is_set():
        if addr := first_word(path):
            return addr
        if proc.returncode is not None:
            raise error(f"the bootstrap node exited with code {proc.returncode} (its output is above)")
        await asyncio.sleep(0.2)
    if stop.is_set():
        raise StopRequested
    raise error(f"the bootstrap node did not publish its address within {timeout:.0f}s")


async def stop_all(procs: Sequence[asyncio.subprocess.Process], grace: float = STOP_GRACE) -> None:
    """SIGTERM every process, wait up to ``grace`` seconds, then SIGKILL the rest."""
    for p in procs:
        if p.returncode is None:
            p.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), grace)
    except TimeoutError:
        for p in procs:
            if p.returncode is None:
                p.kill()
        await asyncio.gather(*(p.wait() for p in procs))


# ------------------------------------------------------------------ scripts with log files (tests, benchmarks)


class Proc:
    """One child in its own session / process group (its p2pd daemon and helpers included), its
    output in a log file. ``append`` keeps an earlier process's log (a restart of the same learner)."""

    def __init__(self, name: str, argv: Sequence[str], log: Path, append: bool = False,
                 cwd: Path = SOURCE_ROOT) -> None:
        self.name, self.log_path = name, log
        self._log = log.open("ab" if append else "wb")
        self.popen = subprocess.Popen(list(argv), stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd,
                                      start_new_session=True, env=child_env())

    @property
    def pid(self) -> int:
        """The child's pid, which is also its process group id."""
        return self.popen.pid

    def text(self) -> str:
        """Everything in the log so far."""
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        """Whether the child itself is still running."""
        return self.popen.poll() is None

    def wait(self, timeout: float | None = None) -> int:
        """The child's exit code; raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        return self.popen.wait(timeout)

    def terminate(self) -> None:
        """SIGTERM the child (not its group): a learner then leaves with its parting rounds."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)

    def kill_group(self) -> None:
        """SIGKILL the whole process group, reap the child and close the log; safe to call again."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        self._log.close()


def wait_until(cond: Callable[[], T], timeout: float, proc: Proc | None = None, what: str = "condition",
               poll: float = 0.2) -> T:
    """Poll ``cond`` until it returns something true and return that.

    Raises ChildExited (with ``proc``'s log) if ``proc`` exits first, TimeoutError after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := cond():
            return result
        if proc is not None and not proc.alive():
            raise ChildExited(f"{proc.name} exited (rc={proc.popen.returncode}) before {what}:\n{proc.text()}")
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")


def start_bootstrap(work: Path, timeout: float = 90.0, extra: Sequence[str] = ()) -> tuple[Proc, str]:
    """A bootstrap node on loopback (with ``extra`` CLI arguments), logging to ``work/bootstrap.log``,
    and its address once it has one.

    If it does not get one, the node is killed before the error propagates.
    """
    boot = Proc("bootstrap", cli(*bootstrap_args(work), *extra), work / "bootstrap.log")
    try:
        maddr = wait_until(lambda: first_word(work / MADDRS_FILE), timeout, boot, "the bootstrap address")
    except BaseException:
        boot.kill_group()
        raise
    assert maddr is not None  # wait_until returns only a true value
    return boot, maddr


def stop_procs(procs: Sequence[Proc], grace: float) -> None:
    """SIGTERM every child at once (learners stop training at the same moment, then hand their unmerged
    steps to each other in their parting rounds), then kill each group, whatever is left after ``grace``."""
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, deadline - time.monotonic()))
        p.kill_group()


def processes_in_group(*pgids: int) -> list[str]:
    """``pgid pid stat args`` of every live (not zombie) process in these process groups."""
    out = subprocess.run(["ps", "-eo", "pgid=,pid=,stat=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 3) for line in out.splitlines()]
    return [" ".join(r) for r in rows if len(r) >= 3 and int(r[0]) in pgids and not r[2].startswith("Z")]
