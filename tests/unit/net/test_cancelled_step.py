"""A step the learner cancelled while its all-reduce finished ends quietly (averager_process.quiet_if_cancelled)."""

import asyncio
import concurrent.futures

import pytest

from p2p_diloco.net.averager_process import quiet_if_cancelled


async def _finish(step: concurrent.futures.Future) -> None:
    step.set_result("averaged")  # what hivemind's _step does once the all-reduce returns


def test_a_cancelled_step_whose_all_reduce_finished_ends_without_an_error():
    step = concurrent.futures.Future()
    assert step.cancel()
    assert asyncio.run(quiet_if_cancelled(step, _finish(step))) is None


def test_the_same_error_for_a_step_that_was_not_cancelled_is_raised():
    step = concurrent.futures.Future()
    step.set_result("earlier")
    with pytest.raises(concurrent.futures.InvalidStateError):
        asyncio.run(quiet_if_cancelled(step, _finish(step)))


def test_a_finished_step_returns_what_hivemind_returns():
    async def run() -> str:
        return "done"

    assert asyncio.run(quiet_if_cancelled(concurrent.futures.Future(), run())) == "done"
