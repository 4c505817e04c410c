"""The workers of a learner unit other than rank 0: the same inner steps on their own part of the
shard, in lockstep with rank 0, and nothing else (no DHT, averager, records or checkpoints).

Each step mirrors one of rank 0's (:mod:`p2p_diloco.learner.unit.group` has the protocol)::

    receive the start (shard, cursor, schedule position), rank 0's θ and the optimizer moments; DDP or FSDP
    repeat: receive a control word
            a gather (sharded)? take part in gathering θ into rank 0's host copy, then the next word
            receive the fragments rank 0 changed since the last one
            the end? leave. Otherwise one inner step at the version and lr position rank 0 gave

Ctrl+C and SIGTERM are ignored here: torchrun sends them to every worker, and leaving is rank 0's
decision, which arrives as its last control word.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time

import torch

from p2p_diloco import peer_log
from p2p_diloco.config import LearnerConfig
from p2p_diloco.learner.startup import build, load_data
from p2p_diloco.learner.state import LearnerState
from p2p_diloco.learner.unit.group import GATHER_ALL, UnitGroup, fragment_indices, part_of_shard, unit_broken
from p2p_diloco.train.data.batches import BatchSampler
from p2p_diloco.train.data.tokenizer import load_tokenizer
from p2p_diloco.train.trainer import Trainer

logger = logging.getLogger(__name__)


class _Position:
    """The step count and version shown in this worker's log prefix."""

    def __init__(self) -> None:
        self.steps, self.version = 0, 0

    def __call__(self) -> tuple[int, int]:
        return self.steps, self.version


def follow(cfg: LearnerConfig, group: UnitGroup) -> int:
    """Train as worker ``group.rank`` (> 0) of a learner unit until rank 0 ends it; returns the exit code.

    A failed collective (rank 0 or another worker gone) raises :class:`p2p_diloco.learner.unit.group.UnitBroken`.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    at = _Position()
    peer_log.install()
    peer_log.set_peer(f"rank{group.rank}")
    peer_log.set_position(at)
    torch.set_num_threads(cfg.run.threads)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    # While rank 0 sets up: the model (its θ arrives with DDP) and, when the config names it, the shard.
    trainer, state = build(cfg, tokenizer)
    shard = cfg.data.shard_index
    data = load_data(cfg, shard, tokenizer) if shard is not None else None
    try:
        start = group.start()
        if start is None:
            group.part()
    except RuntimeError as e:
        raise unit_broken("waiting for rank 0's start", e) from e
    if start is None:
        logger.info("rank 0 ended before training (its log says why); leaving")
        return 0
    at.steps, at.version = start.inner_steps, start.version
    if data is None or data.shard != start.shard:  # rank 0 took its shard from its peer id
        data = load_data(cfg, start.shard, tokenizer)
    sampler = part_of_shard(dataclasses.replace(data.sampler, cursor=start.cursor), group.rank, group.workers)
    try:
        group.train_together(trainer, start.optimizer_steps)
        trainer.lr_position.load(start.lr_position)
        group.record(at.steps, at.version, trainer)
        logger.info(f"training as worker {group.rank} of a learner unit of {group.describe()} on its part of "
                    f"shard {start.shard}; rank 0 decides when to stop")
        _steps(cfg, group, trainer, state, sampler, at)
    except RuntimeError as e:
        raise unit_broken(f"following rank 0 at step {at.steps}", e) from e
    logger.info(f"rank 0 ended the unit after {at.steps} inner steps; leaving")
    return 0


def _steps(cfg: LearnerConfig, group: UnitGroup, trainer: Trainer, state: LearnerState, sampler: BatchSampler,
           at: _Position) -> None:
    """Rank 0's step sequence: a control word (and changed fragments) before each inner step."""
    losses: list[float] = []
    began = time.perf_counter()
    while True:
        word = group.word(None, len(state.fragments))
        if word.gathers:
            assert trainer.sharded is not None, "a gather word in a unit without sharding"
            trainer.sharded.gather(fragment_indices(state, word.fragments), optimizer=word.kind == GATHER_ALL)
            continue
        at.version = word.version
        group.share(trainer, state, word.fragments)
        if word.fragments:
            group.record(at.steps, at.version, trainer)
        if not word.go:
            group.part()
            return
        trainer.lr_position.load(list(word.lr_position))
        x, y = sampler.next_batch()
        losses.append(trainer.step(x, y, word.version))
        at.steps += 1
        if at.steps % cfg.run.log_every == 0:
            recent = losses[-cfg.run.log_every:]
            logger.info(f"inner loss {sum(recent) / len(recent):.4f} on this worker's batches "
                        f"({len(losses) / (time.perf_counter() - began):.1f} steps/s)")
