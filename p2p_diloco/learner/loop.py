"""A learner unit: local data, inner AdamW steps, fragment rounds with whoever is in the swarm.

The loop (:meth:`Learner.run`), top to bottom::

    set up (startup.py; meanwhile a head start: the first eval, and inner steps from a checkpoint)
    download the newest global state if the swarm is ahead (catch_up.py)
    repeat until every fragment's global version reaches --max-outer-steps (or Ctrl+C / SIGTERM):
        one inner step on the local shard, on run.device (trainer.py); in a torchrun unit, every worker
        takes it on its own part of the shard, in step with this one, rank 0 (unit.py)
        rounds.tick(): apply a round's result that is due, adopt downloads, start due fragments (rounds.py)
        every H steps: eval (every run.eval_every-th), log, publish progress (progress.py), checkpoint
    drain the rounds; on a signal, hand the unmerged steps over in parting rounds (parting.py)
    keep serving the global state until the others have finished too (bounded), leave cleanly

A checkpoint is a copy handed to a writer thread: the loop never waits for the disk. With P = 1
fragment and τ = 0 this is plain synchronous DiLoCo. What a learner does with its local copy of a
fragment when the averaged result arrives (``sync.apply_policy``) is :func:`p2p_diloco.core.outer.apply_result`.

Example (what ``p2p-diloco learner`` does)::

    learner = Learner(load_learner_config("peers/small-cpu.toml", ["run.max_outer_steps=3"]))
    summary = learner.run()      # trains with the swarm until version 3, then leaves
    print(summary["global_state_sha256"], summary["last_eval_loss"])
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from p2p_diloco import peer_log
from p2p_diloco.config import LearnerConfig
from p2p_diloco.core.fragments import due_fragments
from p2p_diloco.errors import LearnerError
from p2p_diloco.hooks import NO_FAULTS, FaultHooks
from p2p_diloco.learner.head_start import HeadStart
from p2p_diloco.learner.healing import Healing
from p2p_diloco.learner.parting import Leaving, hand_over, linger
from p2p_diloco.learner.startup import LocalData, Parts, set_up
from p2p_diloco.learner.state import LearnerState
from p2p_diloco.learner.unit.rank0 import Solo, UnitHooks
from p2p_diloco.net.traffic import read_key_traffic, read_traffic
from p2p_diloco.train.checkpoint import FORMAT
from p2p_diloco.train.trainer import Trainer

logger = logging.getLogger(__name__)


class Learner:
    """One learner unit of the swarm. ``stop`` is set on the first Ctrl+C / SIGTERM (leave after the
    parting rounds), :attr:`leave_now` on the second (leave at once). ``faults`` injects failures
    for tests (:mod:`p2p_diloco.hooks`). ``unit``: the other workers of a torchrun unit, when this is its
    rank 0 (:mod:`p2p_diloco.learner.unit.group`). Nothing starts before :meth:`run`."""

    def __init__(self, cfg: LearnerConfig, stop: threading.Event | None = None, faults: FaultHooks | None = None,
                 unit: UnitHooks | None = None):
        self.cfg = cfg
        self.faults = NO_FAULTS if faults is None else faults
        self.unit: UnitHooks = unit or Solo()
        self.leaving = Leaving(cfg.run.drain_seconds, stop)
        self.stop, self.leave_now = self.leaving.stop, self.leaving.leave_now
        self.target_loss_reached = False
        self._parts: Parts | None = None
        self._checkpointed: tuple[int, ...] | None = None  # counters at the last checkpoint
        self._checkpoint_time = time.monotonic()  # when the last one was handed to the writer
        self._loop_started = time.perf_counter()  # this run's training loop (train_seconds counts earlier runs)
        self._head_losses: list[float] = []  # losses of the inner steps taken during the set-up
        self._head_seconds = 0.0  # the set-up's time spent on them
        self._healing = Healing(cfg.inner.steps_per_outer)  # a step whose loss is not finite: θ ← Θ (healing.py)

    @property
    def parts(self) -> Parts:
        """The learner's running parts; RuntimeError before :meth:`run` has set them up."""
        if self._parts is None:
            raise RuntimeError("the learner is not set up yet: call run()")
        return self._parts

    def run(self) -> dict[str, Any]:
        """Set up, train until the target version (or a stop signal), leave; returns :meth:`summary`."""
        peer_log.install()
        try:
            p = self._parts = set_up(self.cfg, self.faults, self.leaving, on_commit=self.checkpoint,
                                     head_start=self._head_start)
            self.unit.attach(p.trainer, p.data, p.state)
            p.progress.publish()
            p.progress.start()
            p.catch_up.start()
            c = p.state.counters
            if c.first_eval_loss is None:
                c.first_eval_loss = self.evaluate()
                logger.info(f"eval_loss {c.first_eval_loss:.4f} before training")
            train_started = time.perf_counter()
            self._train()
            c.train_seconds += time.perf_counter() - train_started + self._head_seconds
            p.metrics.update(p.state)
            if self.finished():
                p.progress.publish("done")
                if p.averaging.client_mode:
                    logger.info(f"reached version {p.state.version}; a client serves no state: leaving")
                else:
                    logger.info(f"reached version {p.state.version}; serving state to learners still behind")
                    linger(self.leaving, p.progress, p.state.versions, self.cfg.run.linger_seconds)
            return self.summary()
        finally:
            self._shutdown()

    def _train(self) -> None:
        p, cfg = self.parts, self.cfg
        c, h, t = p.state.counters, cfg.inner.steps_per_outer, p.trainer
        every = cfg.run.checkpoint_every_seconds
        self.leaving.training = True
        self._loop_started = time.perf_counter()
        losses, self._head_losses = self._head_losses, []
        t.meter.reset()
        while self.unit.sync(go=not self.stop.is_set() and not self.finished()):
            losses.append(self._inner_step())
            p.rounds.tick()
            if every is not None and time.monotonic() - self._checkpoint_time >= every:
                self.checkpoint()  # a kill loses at most `every` seconds of steps, not a whole period's
            if c.inner_steps % cfg.run.log_every == 0:
                recent = self._log_inner(t, c.inner_steps, losses)
                p.metrics.update(p.state, train_loss=recent, lr=t.inner_opt.lr)
            if c.inner_steps % h == 0:
                self._end_of_outer_step(losses)
                losses = []
                t.meter.reset()
        p.rounds.drain()
        self.checkpoint()  # keeps inner steps taken since the last round
        if self.stop.is_set() and not self.finished():
            try:
                hand_over(self.leaving, p.rounds, p.catch_up, p.progress)
            finally:
                self.leaving.end_budget()
            self.checkpoint()  # what the parting rounds merged or adopted
        self.unit.finish()
        p.writer.flush()

    def _log_inner(self, t: Trainer, steps: int, losses: list[float]) -> float:
        """Log the mean loss of the last run.log_every inner steps (returned), the step rate and the lr."""
        mean, h = _finite_mean(losses[-self.cfg.run.log_every:]), self.cfg.inner.steps_per_outer
        logger.info(f"inner {steps % h or h}/{h} loss {mean:.4f} ({t.meter.rates()}, lr {t.inner_opt.lr:.2e} "
                    f"at schedule step {t.lr_at})")
        return mean

    def _head_start(self, trainer: Trainer, state: LearnerState, data: LocalData, resumed: bool) -> HeadStart | None:
        """What the learner does while its DHT joins (:mod:`p2p_diloco.learner.head_start`): the eval before training,
        if it has none yet, then, if it ``resumed`` from its checkpoint with an optimizer that has stepped,
        inner steps up to its next round or the end of the outer step. Not in a unit of several workers,
        whose steps go in step with the others. A checkpoint whose AdamW never stepped (a learner stopped
        before its first step) is no better than none: its first step decides the lr ramp of a fresh
        optimizer (trainer.py), which must see the swarm's version, not the checkpoint's."""
        if not isinstance(self.unit, Solo):
            return None
        c, h = state.counters, self.cfg.inner.steps_per_outer
        target = self.cfg.run.max_outer_steps
        resumed = resumed and trainer.inner_opt.steps_taken() > 0 and (target is None or state.version < target)
        steps_schedule = self.cfg.sync.schedule != "clock"
        trainer.meter.reset()

        def work() -> bool:
            if c.first_eval_loss is None:
                c.first_eval_loss = trainer.evaluate(data.eval_batches)
                logger.info(f"eval_loss {c.first_eval_loss:.4f} before training")
                return resumed
            step = c.inner_steps + 1
            if (self.stop.is_set() or not resumed or step % h == 0 or self.faults.due("inner", state.version + 1)
                    or (steps_schedule and due_fragments(state.fragments, step, h))):
                return False  # the outer step's end, a fragment's round, an injected fault: the training loop's
            loss, elapsed = self._take_step(trainer, data, state)
            self._head_losses.append(loss)
            self._head_seconds += elapsed
            if c.inner_steps % self.cfg.run.log_every == 0:
                self._log_inner(trainer, c.inner_steps, self._head_losses)
            return True

        return HeadStart(work)

    def _inner_step(self) -> float:
        """One inner step of the training loop (:meth:`_take_step`); the rounds measure its time."""
        p = self.parts
        if self.faults.due("inner", p.state.version + 1):
            p.writer.flush()  # the fault hits the inner steps, not a checkpoint write still under way
        loss, elapsed = self._take_step(p.trainer, p.data, p.state)
        p.rounds.observe_step(elapsed)
        return loss

    def _take_step(self, trainer: Trainer, data: LocalData, state: LearnerState) -> tuple[float, float]:
        """One inner step on the next local batch (:meth:`Trainer.step <p2p_diloco.train.trainer.Trainer.step>`) and
        its bookkeeping: injected faults, compute time, the tokens and steps each fragment has not merged.
        Returns the loss and the step's seconds."""
        c = state.counters
        self.faults.fire("inner", state.version + 1)
        started = time.perf_counter()
        x, y = data.sampler.next_batch()
        with self.unit.stepping():
            loss = trainer.step(x, y, state.version, on_gradients=self._gradients_hook(state.version + 1))
        if self.cfg.inner.extra_step_seconds:
            time.sleep(self.cfg.inner.extra_step_seconds)
        elapsed = time.perf_counter() - started
        c.compute_seconds += elapsed
        if self._healing.after_step(loss, state, trainer):
            c.heals += 1
            self.parts.audit.record("healed", step=c.inner_steps, loss=str(loss),
                                    versions=[st.version for st in state.states])
            return loss, elapsed  # its tokens are gone with the poisoned θ
        # Each worker of a unit took this step on its own batch.
        c.count_step(x.numel() * trainer.workers, trainer.lr_share())
        return loss, elapsed

    def _gradients_hook(self, round_: int) -> Callable[[Sequence[torch.Tensor]], None] | None:
        """What an inner step toward ``round_`` does to its gradients before clipping: nothing without faults."""
        if self.faults is NO_FAULTS or not self.faults:
            return None
        return lambda params: self.faults.inner_gradients(params, round_)

    def _end_of_outer_step(self, losses: list[float]) -> None:
        p, cfg = self.parts, self.cfg
        c = p.state.counters
        eval_due = (c.inner_steps // cfg.inner.steps_per_outer) % cfg.run.eval_every == 0
        busy = c.compute_seconds / max(1e-9, c.compute_seconds + c.wait_seconds)
        train_loss = _finite_mean(losses)
        eval_loss = self.evaluate() if eval_due else None
        self._watch_loss(eval_loss)
        logger.info(f"outer step done | version {p.state.version} tokens {c.tokens} train_loss {train_loss:.4f} "
                    f"{'' if eval_loss is None else f'eval_loss {eval_loss:.4f} '}compute {busy:.1%} sent "
                    f"{c.bytes_sent / 1e6:.3f} MB total global_tokens {min(s.tokens for s in p.state.states)} "
                    f"steps_merged {c.steps_merged:.0f}")
        target, alone = cfg.run.stop_at_eval_loss, p.catch_up.end.left_alone
        if target is not None and (eval_due or alone):
            global_loss = self.evaluate(self.global_params())
            self.target_loss_reached = global_loss <= target
            logger.info(f"global model eval_loss {global_loss:.4f} at version {p.state.version} (target {target:g}"
                        f"{': reached' if self.target_loss_reached else ''})")
            if alone and not self.target_loss_reached:
                p.catch_up.end.give_up()  # no round can commit alone: the global model stays where it is
                logger.warning(f"the others reached the target and left, and nobody else trains; alone, with a quorum "
                               f"of {cfg.averaging.min_group_size}, no round commits: stopping at version "
                               f"{p.state.version} (local progress is in the checkpoint)")
        p.metrics.update(p.state, train_loss=train_loss, eval_loss=eval_loss)
        p.audit.outer_step(p.state, train_loss, eval_loss,
                           c.train_seconds + self._head_seconds + time.perf_counter() - self._loop_started)
        p.progress.publish()
        self.checkpoint()
        self._stop_if_cut_off()

    def _watch_loss(self, eval_loss: float | None) -> None:
        """An eval loss far above the previous one (``run.loss_rise_alert``): one WARNING line, an audit event and
        a count in the progress record (`status` shows it), so a round that made the model worse is seen."""
        p, rise = self.parts, self.cfg.run.loss_rise_alert
        before = p.metrics.last_eval_loss
        if eval_loss is None or before is None or rise is None or not eval_loss > before * (1 + rise):
            return
        c = p.state.counters
        c.loss_rises += 1
        versions = [s.version for s in p.state.states]
        logger.warning(f"eval loss rose from {before:.4f} to {eval_loss:.4f} (more than {rise:.0%}) at versions "
                       f"{versions}: a committed round or a state taken from a peer made the model worse")
        p.audit.record("loss_rose", before=before, after=eval_loss, versions=versions, step=c.inner_steps)

    def _stop_if_cut_off(self) -> None:
        """Stop with one line if the learner's DHT or averager process has exited: it would train on alone,
        never to merge again (seen when a torn request killed a DHT process). Its steps are in
        the checkpoint; a restart rejoins the swarm and hands them over."""
        gone = self.parts.averaging.gone()
        if gone is not None and not self.stop.is_set():  # a signal to the whole process group ends them too
            self.parts.writer.flush()
            raise LearnerError(f"this learner's {gone} has exited, so it can no longer reach the swarm; its "
                               f"training is checkpointed in {self.parts.ckpt_dir}: restart the learner to rejoin")

    def finished(self) -> bool:
        """Whether training is over: target version or loss reached, or the swarm left without us."""
        target = self.cfg.run.max_outer_steps
        p = self.parts
        return (self.target_loss_reached or p.catch_up.end.gone
                or (target is not None and p.state.version >= target))

    def evaluate(self, params: list[torch.Tensor] | None = None) -> float:
        """Mean loss on the fixed eval batches, on the device: of the local model, or of ``params`` (e.g. Θ)."""
        if params is None:
            self.unit.refresh()  # a sharded unit's rank 0 evaluates its host copy of θ
        return self.parts.trainer.evaluate(self.parts.data.eval_batches, params)

    def global_params(self) -> list[torch.Tensor]:
        """The global parameters Θ, in the model's parameter order."""
        return self.parts.state.global_params()

    def checkpoint(self) -> None:
        """Hand a snapshot to the checkpoint writer (skipped if nothing changed since the last one)."""
        p = self.parts
        c = p.state.counters
        mark = (c.inner_steps, c.outer_steps, c.syncs, c.merges)
        if mark == self._checkpointed:
            return  # nothing new since the last one (a commit at the end of an outer step)
        self._checkpointed, self._checkpoint_time = mark, time.monotonic()
        self.unit.refresh(optimizer=True)  # a sharded unit's rank 0 saves its host copies
        payload = {
            "format": FORMAT,
            "config": self.cfg.model_dump(),
            "global": [s.to_dict() for s in p.state.states],
            "unconfirmed": p.state.pending_for_checkpoint(p.rounds.in_limbo()),
            **p.trainer.checkpoint_state(),  # model, inner_opt, lr_position
            "counters": vars(c).copy(),
            "sampler_cursor": p.data.sampler.cursor,
        }
        version = p.state.version
        p.writer.submit(payload, before_rename=lambda: self.faults.fire("checkpoint", version))

    def summary(self) -> dict[str, Any]:
        """What this learner did and holds: counters, versions, eval losses and the global state's hashes."""
        p = self.parts
        c, states = p.state.counters, p.state.states
        return {
            "peer_id": p.state.peer_id, "shard": p.data.shard, "outer_steps": c.outer_steps,
            "rounds_failed": c.rounds_failed, "heals": c.heals, "loss_rises": c.loss_rises, "syncs": c.syncs,
            "merges": c.merges,
            "inner_steps": c.inner_steps,
            "steps_merged": c.steps_merged, "tokens": c.tokens, "bytes_sent": c.bytes_sent,
            "bytes_received": c.bytes_received,
            "compute_seconds": c.compute_seconds, "train_seconds": c.train_seconds,
            "wait_seconds": c.wait_seconds, "download_seconds": c.download_seconds,
            "contributions_confirmed": c.contributions_confirmed, "first_eval_loss": c.first_eval_loss,
            "last_eval_loss": self.evaluate(self.global_params()), "version": p.state.version,
            "versions": [s.version for s in states], "global_tokens": min(s.tokens for s in states),
            "fragment_sha256": [s.sha256() for s in states], "global_state_sha256": p.state.whole_sha256(),
            **p.trainer.report(c.tokens, c.train_seconds),  # device, precision, parameters, tokens/s, MFU
            "dht_traffic": self._dht_traffic(read_traffic),
            "dht_traffic_by_key": self._dht_traffic(read_key_traffic),  # finds and stores by kind of key
        }

    def _dht_traffic(self, read: Callable[[Any], dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
        """The DHT process's RPC counts, by RPC or by kind of key (p2p_diloco/net/traffic.py); ``{}`` if it
        cannot answer."""
        try:
            return read(self.parts.dht)
        except Exception as e:  # noqa: BLE001 - a summary without them beats no summary
            logger.warning(f"could not read the DHT's traffic for the summary: {type(e).__name__}: {e}")
            return {}

    def _shutdown(self) -> None:
        self.unit.close()  # a unit's other workers leave with us
        p = self._parts
        if p is None:
            return  # set_up shut down whatever it had started
        p.progress.stop()
        p.rounds.join_threads()
        p.audit.left(p.state.states, finished=self.finished(), signalled=self.stop.is_set())
        p.close()  # publishes our "left" record, then stops the averager, the DHT, the writer


def write_summary(path: str | Path, summary: dict[str, Any]) -> None:
    """Write ``summary`` as JSON atomically (temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(path)


def _finite_mean(losses: Sequence[float]) -> float:
    """The mean of the finite ``losses`` (a step that diverged was healed, healing.py: its loss is no part of
    the training's); NaN when none is finite, 0.0 when there are none."""
    finite = [v for v in losses if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else (math.nan if losses else 0.0)
