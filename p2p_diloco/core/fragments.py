"""Parameter fragments and their staggered sync schedule (Streaming / Decoupled DiLoCo).

The parameters are split into P fragments of balanced size by **greedy bin-packing over
tensors**: tensors sorted by size (largest first, ties by position) each go to the fragment with
the fewest elements so far. We chose it over strided transformer blocks because it balances any
model, including ones whose embedding dwarfs a block (a byte-level model's embedding is small, a
word-level one's is not), and needs no knowledge of the architecture. The assignment depends only
on tensor shapes and P, so every learner computes the same fragments.

Fragment f syncs at local inner steps s with ``s % H == offset_f`` (s > 0), with offsets spread
evenly over H: one fragment every H/P steps, so about 1/P of the model is in flight at a time.
P = 1 gives plain DiLoCo (everything syncs every H steps).

The alternative ``clock`` schedule (:class:`ClockSchedule`) puts fragment f's rounds at wall-clock
times ``k·T + f·T/P`` (DHT time, i.e. the machines' synchronized clocks). Every learner, fast or
slow, then meets the others at each fragment's round and contributes whatever progress it made
since its last merge, weighted by its tokens: faster learners never wait for slower ones and the
slower ones' tokens still reach the global model in every round.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fragment:
    """One fragment: the parameter tensors it owns (indices in module order), their element count, and its
    sync offset within H. ``has_embedding``: one of its parameter names contains ``emb``.
    """
    index: int
    tensor_indices: tuple[int, ...]
    numel: int
    offset: int  # sync when step % H == offset
    has_embedding: bool  # embeddings always use plain averaging (not RDA)


def partition(shapes: Sequence[torch.Size], num_fragments: int) -> list[list[int]]:
    """Greedy balanced assignment of tensor indices to ``num_fragments`` bins (each bin sorted)."""
    if num_fragments < 1:
        raise ValueError("num_fragments must be >= 1")
    if num_fragments > len(shapes):
        raise ValueError(f"cannot split {len(shapes)} tensors into {num_fragments} non-empty fragments")
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    bins: list[list[int]] = [[] for _ in range(num_fragments)]
    load = [0] * num_fragments
    for i in order:
        target = min(range(num_fragments), key=lambda b: (load[b], b))
        bins[target].append(i)
        load[target] += sizes[i]
    return [sorted(b) for b in bins]


def build_fragments(
    named_shapes: Sequence[tuple[str, torch.Size]], num_fragments: int, steps_per_outer: int,
    embeddings: Collection[str] | None = None,
) -> list[Fragment]:
    """Split named parameter shapes into ``num_fragments`` balanced fragments (:func:`partition`), offsets spread
    evenly over ``steps_per_outer``. The same shapes give the same fragments on every learner.

    ``embeddings``: the names of the embedding tables (they are averaged plainly, never with RDA); None
    takes every name holding "emb", which fits the built-in model but not, say, GPT-2's ``wte``.

    >>> shapes = [("tok_emb.weight", torch.Size([256, 64])), ("ln.weight", torch.Size([64])),
    ...           ("head.weight", torch.Size([256, 64]))]
    >>> [(f.tensor_indices, f.numel, f.offset, f.has_embedding) for f in build_fragments(shapes, 2, 50)]
    [((0, 1), 16448, 0, True), ((2,), 16384, 25, False)]
    """
    bins = partition([s for _, s in named_shapes], num_fragments)
    fragments = []
    for f, indices in enumerate(bins):
        offset = (f * steps_per_outer) // num_fragments
        fragments.append(
            Fragment(
                index=f,
                tensor_indices=tuple(indices),
                numel=sum(int(torch.Size(named_shapes[i][1]).numel()) for i in indices),
                offset=offset,
                has_embedding=any(_is_embedding(named_shapes[i][0], embeddings) for i in indices),
            )
        )
    return fragments


def _is_embedding(name: str, embeddings: Collection[str] | None) -> bool:
    return "emb" in name if embeddings is None else name in embeddings


def due_fragments(fragments: Sequence[Fragment], step: int, steps_per_outer: int) -> list[Fragment]:
    """Fragments whose sync falls on local inner step ``step`` (counted from 1)."""
    if step <= 0:
        return []
    return [f for f in fragments if step % steps_per_outer == f.offset]


class ClockSchedule:
    """Fragment rounds at wall-clock slots shared by every learner: ``k·period + f·period/P``."""

    def __init__(self, fragments: Sequence[Fragment], period: float, now: float):
        self.fragments, self.period = list(fragments), period
        # Start with the next slot of each fragment: a learner joining mid-slot waits for the next one.
        self._last = [self._slot(f, now) for f in self.fragments]

    def _slot(self, fragment: Fragment, now: float) -> int:
        return int((now - fragment.index * self.period / len(self.fragments)) // self.period)

    def next_slot(self, fragment: Fragment, now: float) -> float:
        """When the fragment's first slot after ``now`` opens."""
        return (self._slot(fragment, now) + 1) * self.period + fragment.index * self.period / len(self.fragments)

    def retime(self, period: float, at: float) -> None:
        """From DHT time ``at`` on, slots every ``period``: each fragment's first is its first on the new grid
        strictly after ``at``. (A slot at ``at`` itself could come just after the fragment's last slot on the
        old grid, while that round still runs.)"""
        self.period = period
        self._last = [self._slot(f, at) for f in self.fragments]

    def due(self, now: float) -> list[Fragment]:
        """The fragments whose next slot has opened by ``now`` (DHT time); each slot is returned once."""
        out = []
        for f in self.fragments:
            slot = self._slot(f, now)
            if slot > self._last[f.index]:
                self._last[f.index] = slot
                out.append(f)
        return out
