"""Rank 0 of a learner unit: the hooks its training loop (:class:`p2p_diloco.learner.loop.Learner`) calls to
keep the unit's other workers (:mod:`.follower`) in step; :mod:`.group` has the
protocol. A learner of one worker gets :class:`Solo`, whose hooks do nothing.

The hooks, in the order the learner calls them::

    attach(trainer, data, state)   after set-up: the start, DDP or FSDP, the optimizer's moments; rank 0's data part
    sync(go) before each step      a control word and the fragments changed since the last one; False ends the loop
    with stepping(): step          DDP's all-reduce (FSDP's gathers) runs inside; a failure there breaks the unit
    refresh(optimizer)             before rank 0 reads all of θ (eval, checkpoint): a sharded unit's gather
    finish()                       after the parting rounds: the last word, with the final θ changes
    close()                        on the way out, whatever happened: the others leave too, if they still can

With ``run.sharding=fsdp`` rank 0's θ (``LearnerState.params``) is the host copy of the sharded model
(:mod:`p2p_diloco.train.sharding`). It is stale after each inner step; the first read of a fragment's θ
between two steps (``LearnerState.local``: a round's snapshot, applying a result, a rebase) gathers
that fragment first, :meth:`Leader.refresh` gathers them all (and the optimizer's moments for a
checkpoint). What rank 0 then changes in it goes to every shard with the next word, as in DDP.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

from p2p_diloco.learner.state import LearnerState
from p2p_diloco.learner.unit.group import (
    END,
    GATHER,
    GATHER_ALL,
    STEP,
    Start,
    UnitBroken,
    UnitGroup,
    Word,
    fragment_indices,
    part_of_shard,
    unit_broken,
)
from p2p_diloco.train.trainer import Trainer

if TYPE_CHECKING:
    from p2p_diloco.learner.startup import LocalData

logger = logging.getLogger(__name__)


class UnitHooks(Protocol):
    """What the training loop of rank 0 (:class:`p2p_diloco.learner.loop.Learner`) calls on its unit."""

    def attach(self, trainer: Trainer, data: LocalData, state: LearnerState) -> None:
        """After set-up: start the others; ``data.sampler`` becomes this worker's part of the shard."""
        ...

    def sync(self, go: bool) -> bool:
        """Before each inner step: tell the others whether there is one (``go``); returns ``go``."""
        ...

    def stepping(self) -> contextlib.AbstractContextManager[None]:
        """Around each inner step (DDP's collectives run inside it)."""
        ...

    def refresh(self, optimizer: bool = False) -> None:
        """Before rank 0 reads all of θ (an eval of the local model; with ``optimizer``, a checkpoint)."""
        ...

    def finish(self) -> None:
        """After the parting rounds: the others take the final θ and leave."""
        ...

    def close(self) -> None:
        """On the way out, whatever happened: the others leave too, if they still can."""
        ...


class Solo:
    """The unit of one worker (a plain ``p2p-diloco learner``): every hook does nothing."""

    def attach(self, trainer: Trainer, data: LocalData, state: LearnerState) -> None:
        pass

    def sync(self, go: bool) -> bool:
        return go

    def stepping(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def refresh(self, optimizer: bool = False) -> None:
        pass

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


class Leader:
    """Rank 0's side of a unit of several workers: :class:`UnitHooks` over a :class:`UnitGroup`."""

    def __init__(self, group: UnitGroup):
        self.group = group
        self.phase = "new"  # → "starting" → "training" → "ended"; "broken" after a failed collective
        self._trainer: Trainer | None = None
        self._state: LearnerState | None = None
        # Sharded: the fragments whose host θ equals the shards since the last step, and the moments'.
        self._fresh: set[int] = set()
        self._moments_fresh = False

    def attach(self, trainer: Trainer, data: LocalData, state: LearnerState) -> None:
        g = self.group
        opt = trainer.inner_opt
        start = Start(shard=data.shard, cursor=data.sampler.cursor, lr_position=trainer.lr_position.state(),
                      version=state.version, inner_steps=state.counters.inner_steps,
                      optimizer_steps={i: float(s["step"]) for i, s in sorted(opt.state.items())})
        part = part_of_shard(data.sampler, g.rank, g.workers)  # a shard too small: the others leave at close()
        self.phase = "starting"
        with self._collective("starting the other workers"):
            g.start(start)
            g.train_together(trainer, start.optimizer_steps)
        data.sampler = part
        self._trainer, self._state, self.phase = trainer, state, "training"
        if trainer.sharded is not None:  # θ is the host copy from now on: up to date until the first step
            state.params = trainer.sharded.host_params
            state.before_local = lambda fragment: self._gather([fragment.index])
            self._fresh, self._moments_fresh = set(range(len(state.fragments))), True
        state.changed.clear()
        g.record(state.counters.inner_steps, state.version, trainer)
        logger.info(f"learner unit of {g.describe()}: this worker (rank 0) is the swarm peer; each worker trains "
                    f"on its own part of shard {data.shard}, the unit's tokens are the sum over its workers")

    def sync(self, go: bool) -> bool:
        if go:
            self._send(go=True)
        return go

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        with self._collective("taking an inner step"):
            yield

    def refresh(self, optimizer: bool = False) -> None:
        if self._state is not None:
            self._gather(range(len(self._state.fragments)), optimizer)

    def finish(self) -> None:
        if self.phase == "training":
            self.refresh(optimizer=True)  # the last chance: the host copy serves the summary and later checkpoints
            self._send(go=False)

    def close(self) -> None:
        try:
            if self.phase == "new":
                with self._collective("ending the unit"):
                    self.group.start(None)  # the others wait for the start: they leave now
                    self.group.part()
            elif self.phase == "training":
                self._send(go=False)
        except UnitBroken as e:
            logger.warning(str(e))
        finally:
            self.group.close()

    def _send(self, go: bool) -> None:
        assert self._state is not None and self._trainer is not None, "attach() first"
        s, t = self._state, self._trainer
        if s.changed and self.group.hashes is not None:
            self.refresh()  # sharded, for the test's hashes: the whole host copy compares with the shards
        changed = tuple(sorted(s.changed))
        s.changed.clear()
        lr_v, lr_s = t.lr_position.state()
        with self._collective("sending a control word"):
            self.group.word(Word(STEP if go else END, s.version, (lr_v, lr_s), changed), len(s.fragments))
            self.group.share(t, s, changed)
            if not go:
                self.group.part()
        if changed:
            self.group.record(s.counters.inner_steps, s.version, t)
        if go:
            self._fresh, self._moments_fresh = set(), False  # the step changes every shard
        else:
            self.phase = "ended"

    def _gather(self, fragments: Iterable[int], optimizer: bool = False) -> None:
        """Sharded: the fragments' θ (and the moments) from the shards into the host copy, where stale. Not
        the fragments rank 0 changed since the last word (the host copy is ahead of the shards there)."""
        s, t = self._state, self._trainer
        if s is None or t is None or t.sharded is None or self.phase != "training":
            return  # after the end the host copy is final (finish())
        stale = tuple(f for f in fragments if f not in self._fresh and f not in s.changed)
        optimizer = optimizer and not self._moments_fresh
        if not stale and not optimizer:
            return
        lr_v, lr_s = t.lr_position.state()
        with self._collective("gathering θ into rank 0's host copy"):
            self.group.word(Word(GATHER_ALL if optimizer else GATHER, s.version, (lr_v, lr_s), stale),
                            len(s.fragments))
            t.sharded.gather(fragment_indices(s, stale), optimizer)
        self._fresh.update(stale)
        self._moments_fresh = self._moments_fresh or optimizer

    @contextlib.contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """Anything failing in here leaves the workers out of step: the unit is broken."""
        try:
            yield
        except RuntimeError as e:
            self.phase = "broken"
            raise unit_broken(what, e) from e
        except BaseException:
            self.phase = "broken"
            raise
