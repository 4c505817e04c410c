"""A round cancelled during matchmaking must not leave hivemind's search locked (p2p_diloco/net/strong_tasks.py).

hivemind's own ``PotentialLeaders.begin_search`` and ``_declare_averager_periodically`` run here against a
key manager whose replies, like the DHT's ``MPFuture``, are held only weakly by whoever answers them. The
search is cancelled and not awaited (as ``DecentralizedAverager._step`` does), and the collector runs
while its clean-up waits for the un-declare's reply."""

import asyncio
import gc
import weakref
from types import SimpleNamespace

import pytest
import uvloop
from hivemind.averaging.matchmaking import PotentialLeaders
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from p2p_diloco.net.strong_tasks import in_loops_made_by, keep_tasks_alive


class _WeaklyAnsweringKeys:
    """A group key manager whose DHT answers each request on a later turn of the loop, holding the reply weakly.
    The un-declare's reply waits for :meth:`release`, so the test decides when it arrives, not a clock."""

    current_key = "run_outer.0b0"

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.replies, self.undeclared = loop, weakref.WeakSet(), 0
        self.declared, self.undeclaring = asyncio.Event(), asyncio.Event()
        self._held: list = []

    async def _reply(self, value, hold: bool = False):
        reply = self.loop.create_future()
        self.replies.add(reply)
        if hold:
            self._held.append(value)
        else:
            self.loop.call_soon(self._answer, value)
        return await reply

    def _answer(self, value):
        for reply in list(self.replies):
            if not reply.done():
                reply.set_result(value)

    def release(self):
        """Answer the held un-declare (if anyone still waits for it)."""
        for value in self._held:
            self._answer(value)

    async def declare_averager(self, key, peer_id, expiration_time, looking_for_group=True):
        if looking_for_group:
            await self._reply(True)
            self.declared.set()
            return
        self.undeclaring.set()
        await self._reply(True, hold=True)
        self.undeclared += 1

    async def get_averagers(self, key, only_active=True):
        return await self._reply([])

    async def update_key_on_not_enough_peers(self):
        pass


async def _cancel_a_search(keep: bool) -> tuple[bool, int]:
    """Whether the search's lock is still held once the DHT has answered, and how many un-declares ended."""
    loop = asyncio.get_running_loop()
    if keep:
        keep_tasks_alive(loop)
    leaders = PotentialLeaders(PeerID(b"\x00\x24" + b"\x01" * 36), min_matchmaking_time=5.0, target_group_size=4)
    keys = _WeaklyAnsweringKeys(loop)
    step = SimpleNamespace(deadline=get_dht_time() + 60, scheduled_time=get_dht_time() + 5)

    async def search():
        async with leaders.begin_search(step, keys, declare=True):
            await asyncio.sleep(3600)

    task = asyncio.create_task(search())
    await asyncio.wait_for(keys.declared.wait(), 30)
    task.cancel()  # and return without awaiting it
    del task
    await asyncio.wait_for(keys.undeclaring.wait(), 30)  # its clean-up now waits for the un-declare's reply
    gc.collect()
    keys.release()
    for _ in range(200):  # turns of the loop, not seconds: the clean-up, if alive, ends within a few
        await asyncio.sleep(0)
    return leaders.lock_search.locked(), keys.undeclared


def _run(loop: asyncio.AbstractEventLoop, keep: bool) -> tuple[bool, int]:
    """Run the scenario, then cancel what hivemind left waiting (its Event.wait tasks) and close the loop."""
    try:
        return loop.run_until_complete(_cancel_a_search(keep))
    finally:
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.close()


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_cancelled_search_un_declares_and_releases_its_lock(loop_kind):
    loop = uvloop.new_event_loop() if loop_kind == "uvloop" else asyncio.new_event_loop()
    assert _run(loop, keep=True) == (False, 1)


def test_without_strong_references_the_collector_leaves_the_search_locked_for_ever():
    """What happened to a learner in a 16-learner run; if this stops holding, hivemind or asyncio changed."""
    assert _run(asyncio.new_event_loop(), keep=False) == (True, 0)


def test_keep_tasks_alive_is_idempotent_and_keeps_a_previous_factory():
    loop = asyncio.new_event_loop()
    made = []

    def factory(loop, coro, **kwargs):
        made.append(coro)
        return asyncio.Task(coro, loop=loop, **kwargs)

    try:
        loop.set_task_factory(factory)
        keep_tasks_alive(loop)
        installed = loop.get_task_factory()
        keep_tasks_alive(loop)
        assert loop.get_task_factory() is installed
        assert loop.run_until_complete(loop.create_task(asyncio.sleep(0, result=7))) == 7
        assert len(made) == 1
    finally:
        loop.close()


def test_the_loops_a_module_makes_keep_their_tasks():
    module = SimpleNamespace(switch_to_uvloop=asyncio.new_event_loop)
    in_loops_made_by(module)
    patched = module.switch_to_uvloop
    in_loops_made_by(module)
    assert module.switch_to_uvloop is patched
    loop = module.switch_to_uvloop()
    assert getattr(loop.get_task_factory(), "keeps_tasks_alive", False)
    assert _run(loop, keep=False) == (False, 1)
