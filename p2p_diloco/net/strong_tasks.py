"""Tasks that cannot be garbage-collected while pending, in the event loops of hivemind's DHT and averager processes.

asyncio keeps only weak references to tasks: a task is kept alive by whoever awaits it or by the
future it waits on, and a task nobody awaits any more that waits on a future only it can reach is
garbage. hivemind's averager creates such tasks. When a round is cancelled during matchmaking,
``DecentralizedAverager._step`` cancels its matchmaking task and returns without awaiting it; while
that task cleans up (``PotentialLeaders.begin_search`` cancels its declare task, which un-declares
the averager through the DHT and waits on the DHT's reply, an ``MPFuture`` that hivemind registers
only weakly), nothing outside the cycle holds it, and the cyclic collector destroys it mid-cleanup
("Task was destroyed but it is pending!", then "aclose(): asynchronous generator is already
running"). ``begin_search`` never leaves its ``async with self.lock_search``, and every later search
of that averager waits on the lock for ever: in a 16-learner run one learner missed the
round after its first cancelled one and every round after that, 19 in a row (docs/scale.md).

:func:`keep_tasks_alive` makes a loop create every task with a strong reference held until it is done;
:func:`in_loops_made_by` does it for the loops of hivemind's DHT and averager processes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from types import ModuleType
from typing import Any


def keep_tasks_alive(loop: asyncio.AbstractEventLoop) -> None:
    """From now on, every task ``loop`` creates is referenced until it is done (idempotent).

    A task factory someone installed before is kept and wrapped."""
    previous = loop.get_task_factory()
    if getattr(previous, "keeps_tasks_alive", False):
        return
    pending: set[asyncio.Future[Any]] = set()

    def create(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any) -> asyncio.Future[Any]:
        task = previous(loop, coro, **kwargs) if previous is not None else asyncio.Task(coro, loop=loop, **kwargs)
        pending.add(task)
        task.add_done_callback(pending.discard)
        return task

    create.keeps_tasks_alive = True  # type: ignore[attr-defined]
    loop.set_task_factory(create)  # type: ignore[arg-type]


def in_loops_made_by(module: ModuleType) -> None:
    """In this process, every event loop that ``module`` makes with hivemind's ``switch_to_uvloop`` keeps its
    tasks alive. For hivemind's DHT and averager processes, before their loop starts: both create
    their request tasks without keeping them (``hivemind.dht.dht``, ``hivemind.averaging.averager``)."""
    make = module.switch_to_uvloop
    if getattr(make, "keeps_tasks_alive", False):
        return

    def switch_to_uvloop() -> asyncio.AbstractEventLoop:
        loop = make()
        keep_tasks_alive(loop)
        return loop

    switch_to_uvloop.keeps_tasks_alive = True  # type: ignore[attr-defined]
    module.switch_to_uvloop = switch_to_uvloop  # type: ignore[attr-defined]
