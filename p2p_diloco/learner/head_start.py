"""A head start: the work a learner does on its own thread while its DHT joins the swarm.

Joining costs a learner 1-2 s of wall time on a loaded machine (p2pd boots, the DHT dials the
bootstrap node, a peer dials us back to decide our reach, the averager process forks), none of which
needs the model. Meanwhile the learner evaluates its starting point and, when it resumed from its
own checkpoint, takes inner steps from it: a restarted learner trains in that time instead of
waiting (docs/resilience.md, re-integration protocol, step 1). A fresh learner takes no step before
it knows where the swarm stands: steps from Θ₀ on a swarm already past it would be an outer gradient
out of all proportion to the others'.

The work runs one unit at a time (an eval or one inner step) on a worker thread.
:meth:`HeadStart.paused` holds it between two units, for what must not overlap a step: a fork (the
averager's process, the DHT's restart in client mode), so no child process is copied mid-step.
:meth:`HeadStart.finish` ends it after the unit under way and re-raises what the work raised.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class HeadStart:
    """Calls ``work()`` over and over on a worker thread until it returns False or :meth:`finish` is called."""

    def __init__(self, work: Callable[[], bool]):
        self._work = work
        self._cond = threading.Condition()
        self._holds = 0  # paused() callers waiting or inside
        self._busy = False  # a unit of work is under way
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="head-start", daemon=True)

    def start(self) -> HeadStart:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while self._holds and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        return
                    self._busy = True
                try:
                    more = self._work()
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
                if not more:
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the thread that calls finish()
            self._error = e

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No unit of work runs inside this block (one under way is waited for)."""
        with self._cond:
            self._holds += 1
            while self._busy:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._holds -= 1
                self._cond.notify_all()

    def stop(self) -> None:
        """End the work after the unit under way; what it raised is dropped (see :meth:`finish`)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def finish(self) -> None:
        """End the work after the unit under way and raise what it raised, if anything."""
        self.stop()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
