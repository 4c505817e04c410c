"""Robust aggregators: how a reducer combines the contributions to its shard (pure math).

``mean`` is DiLoCo's token-weighted average. The robust ones look at every contribution to each
coordinate of the shard and ignore the weights, which contributors report themselves (a weight of
1e15 would otherwise make the average the liar's):

- ``median``: the coordinate-wise median (for an even count, the mean of the two middle values).
  With n contributions it stays within the honest values' range while fewer than n/2 are bad.
- ``trimmed_mean``: per coordinate, drop the ⌊n/4⌋ (at least 1 from n = 3 on) smallest and largest
  values and average the rest. Closer to the mean when everyone is honest; tolerates that many bad
  contributions on each side.

In the butterfly all-reduce each reducer sees every contribution to its shard, so the robust
aggregate of the whole vector is exactly the concatenation of the reducers' shards.

>>> import torch
>>> parts = [torch.tensor([1.0, 10.0]), torch.tensor([2.0, 20.0]), torch.tensor([-300.0, 1e9])]
>>> aggregate(parts, [1.0, 1.0, 1e15], "median").tolist()
[1.0, 20.0]
>>> aggregate(parts, [1.0, 1.0, 1e15], "trimmed_mean").tolist()
[1.0, 20.0]
>>> aggregate(parts, [1.0, 1.0, 2.0], "mean").tolist()
[-149.25, 500000000.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

Aggregator = Literal["mean", "median", "trimmed_mean"]
AGGREGATORS: tuple[str, ...] = ("mean", "median", "trimmed_mean")


def trimmed(n: int) -> int:
    """How many values ``trimmed_mean`` drops on each side of n."""
    return max(1, n // 4) if n >= 3 else 0


def aggregate(parts: Sequence[torch.Tensor], weights: Sequence[float], kind: str) -> torch.Tensor:
    """The aggregate of equally shaped ``parts`` (fp32); ``weights`` count only for ``mean``."""
    if not parts:
        raise ValueError("nothing to aggregate")
    if kind == "mean":
        total = float(sum(weights))
        out = torch.zeros_like(parts[0], dtype=torch.float32)
        for p, w in zip(parts, weights, strict=True):
            out.add_(p.float(), alpha=float(w))
        return out.div_(total)
    stacked = torch.stack([p.float() for p in parts]).sort(dim=0).values
    n = len(parts)
    if kind == "median":
        if n % 2:
            return stacked[n // 2].clone()
        return (stacked[n // 2 - 1] + stacked[n // 2]) / 2
    if kind == "trimmed_mean":
        t = trimmed(n)
        return stacked[t:n - t].mean(dim=0)
    raise ValueError(f"unknown aggregator {kind!r}; one of {', '.join(AGGREGATORS)}")
