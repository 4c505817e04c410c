"""Robust aggregators, alone and inside a reducer that receives parts from several senders."""

import asyncio

import pytest
import torch

from p2p_diloco.core.aggregators import aggregate, trimmed
from p2p_diloco.net.allreduce import AllOrNothingReducer, RobustReducer


def test_median_and_trimmed_mean_ignore_a_bad_minority_and_its_weight():
    g = torch.Generator().manual_seed(0)
    honest = [torch.randn(1000, generator=g) * 0.01 + 1.0 for _ in range(4)]
    for bad in (-1e6 * torch.ones(1000), torch.full((1000,), 3e38), -honest[0] * 50):
        parts, weights = [*honest, bad], [1.0] * 4 + [1e15]
        for kind in ("median", "trimmed_mean"):
            out = aggregate(parts, weights, kind)
            assert out.min() >= min(float(h.min()) for h in honest) and out.max() <= max(float(h.max()) for h in honest)
        assert aggregate(parts, weights, "mean").abs().max() > 10  # what the mean does with it


@pytest.mark.parametrize("n, expect", [(1, 0), (2, 0), (3, 1), (7, 1), (8, 2), (16, 4)])
def test_trim_counts(n, expect):
    assert trimmed(n) == expect


def test_even_median_is_the_mean_of_the_middle_two_and_unknown_kinds_are_refused():
    parts = [torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([4.0]), torch.tensor([100.0])]
    assert aggregate(parts, [1] * 4, "median").item() == 3.0
    assert aggregate(parts[:2], [1, 1], "trimmed_mean").item() == 1.5  # nothing trimmed below 3
    with pytest.raises(ValueError, match="unknown aggregator"):
        aggregate(parts, [1] * 4, "mode")


def _reduce(make_reducer, parts_by_sender, weights):
    """Every sender's parts go through a reducer (made in the event loop) concurrently; each sender's view."""
    async def sender(reducer, i):
        mine = parts_by_sender[i]
        return [await reducer.accumulate_part(i, k, part, weight=weights[i]) for k, part in enumerate(mine)]

    async def run():
        reducer = make_reducer()
        return await asyncio.gather(*(sender(reducer, i) for i in range(len(parts_by_sender))))

    return asyncio.run(run())


def test_a_robust_reducer_gives_every_sender_the_aggregate_of_each_part():
    shapes = (torch.Size([3]), torch.Size([2]))
    parts = [[torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 1.0])],
             [torch.tensor([2.0, 2.0, 2.0]), torch.tensor([2.0, 2.0])],
             [torch.tensor([-9e9, 9e9, 0.0]), torch.tensor([9.0, -9.0])]]
    weights = [1.0, 1.0, 1e15]
    robust = _reduce(lambda: RobustReducer(shapes, 3, "median"), parts, weights)
    for view in robust:
        assert view[0].tolist() == [1.0, 2.0, 2.0] and view[1].tolist() == [2.0, 1.0]
    mean = _reduce(lambda: AllOrNothingReducer(shapes, 3), parts, weights)
    assert mean[0][0][0] < -1e9  # the weighted mean is the liar's
