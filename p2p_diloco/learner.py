"""A learner unit: local data, inner AdamW steps, outer rounds with whoever is in the swarm.

The loop, top to bottom::

    join the DHT → download the newest global state if the swarm is ahead
    repeat until the global version reaches --max-outer-steps (or Ctrl+C / SIGTERM):
        H inner steps on the local shard
        catch up if the swarm moved ahead (rebase local progress onto the newer Θ)
        one OuterRound: average Δ with a group at our version, apply Nesterov, version + 1
        eval, log, publish progress, checkpoint
    keep serving the global state until the others have finished too (bounded), leave cleanly

A round that finds no group commits nothing: θ is kept and the next round contributes all the
inner steps since the last merge, weighted by their tokens. Nothing is thrown away.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hivemind  # noqa: F401 - LinkedDHT subclasses hivemind.DHT
import torch

from p2p_diloco.averaging import HivemindAveraging
from p2p_diloco.checkpoint import claim_checkpoint_dir, load_checkpoint, save_checkpoint
from p2p_diloco.config import LearnerConfig
from p2p_diloco.data import BatchSampler, fixed_eval_batches, load_split, shard_for_peer
from p2p_diloco.lifecycle import LinkedDHT
from p2p_diloco.model import build_model
from p2p_diloco.outer import GlobalState, OuterOptimizer, load_into_module, rebase, state_sha256
from p2p_diloco.records import ProgressBoard, ProgressRecord
from p2p_diloco.round import OuterRound, RoundOutcome

logger = logging.getLogger("p2p_diloco.learner")


class LearnerError(RuntimeError):
    """A problem the user can fix (bad address, busy checkpoint dir, incompatible checkpoint)."""


@dataclass
class Counters:
    inner_steps: int = 0
    tokens: int = 0
    outer_steps: int = 0  # rounds this learner committed
    rounds_failed: int = 0
    syncs: int = 0
    tokens_since_merge: int = 0
    steps_since_merge: int = 0
    bytes_sent: int = 0
    first_eval_loss: float | None = None


def start_dht(cfg: LearnerConfig, identity_path: Path | None) -> hivemind.DHT:
    net = cfg.network
    try:
        return LinkedDHT(
            initial_peers=net.initial_peers or None,
            host_maddrs=net.host_maddrs,
            announce_maddrs=net.announce_maddrs or None,
            identity_path=str(identity_path) if identity_path else None,
            startup_timeout=net.startup_timeout,
            start=True,
        )
    except Exception as e:  # noqa: BLE001 - hivemind raises many types for the same user mistake
        raise LearnerError(f"could not start or join the DHT ({type(e).__name__}: {e})".strip()) from None


class Learner:
    def __init__(self, cfg: LearnerConfig, stop: threading.Event | None = None):
        self.cfg = cfg
        self.stop = stop or threading.Event()
        self.counters = Counters()
        self._served: tuple[dict[str, Any], list[torch.Tensor]] | None = None

    # ---- logging -------------------------------------------------------------------------
    def log(self, msg: str, level: int = logging.INFO) -> None:
        version = self.state.version if hasattr(self, "state") else 0
        logger.log(level, f"[{self.short_id} step={self.counters.inner_steps} round={version}] {msg}")

    # ---- setup ---------------------------------------------------------------------------
    def _setup(self) -> None:
        cfg = self.cfg
        torch.set_num_threads(cfg.run.threads)
        self.ckpt_dir, self._dir_lock = claim_checkpoint_dir(cfg.run.checkpoint_dir)
        payload = load_checkpoint(self.ckpt_dir) if cfg.run.resume else None
        if payload is not None and payload["config"]["model"] != cfg.model.model_dump():
            raise LearnerError(f"checkpoint in {self.ckpt_dir} was made with a different model config")

        self.dht = start_dht(cfg, self.ckpt_dir / "identity.key")
        self.peer_id = str(self.dht.peer_id)
        self.short_id = self.peer_id[-6:]
        shard = cfg.data.shard_index
        if shard is None:
            shard = shard_for_peer(self.dht.peer_id.to_bytes(), cfg.data.num_shards)
        self.shard = shard
        self.log(f"joined DHT; visible at {[str(a) for a in self.dht.get_visible_maddrs()]}")
        # Announce ourselves at once, before the slow part of the start-up, so that learners finishing
        # the run see a newcomer behind them and keep serving state until it has caught up.
        self.board = ProgressBoard(self.dht, cfg.network.run_id, cfg.network.record_ttl)
        version0 = payload["global"]["version"] if payload is not None else 0
        self.board.publish(ProgressRecord(version0, "0" * 64, 0, "training"))
        self.log(f"checkpoints in {self.ckpt_dir}; data shard {shard}/{cfg.data.num_shards}")

        train = load_split(cfg.data, shard)
        evaluation = load_split(cfg.data, None)
        self.sampler = BatchSampler(train, cfg.model.seq_len, cfg.inner.batch_size, seed=cfg.run.seed * 7919 + shard)
        self.eval_batches = fixed_eval_batches(evaluation, cfg.model.seq_len, cfg.inner.batch_size,
                                               cfg.data.eval_batches)
        self.log(f"shard holds {len(train) / 1e6:.2f} MB, eval split {len(evaluation) / 1e6:.2f} MB")

        self.model = build_model(cfg.model, cfg.run.seed)
        self.state = GlobalState.from_module(self.model)
        self.inner_opt = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.inner.lr, weight_decay=cfg.inner.weight_decay,
            betas=(cfg.inner.beta1, cfg.inner.beta2),
        )
        self.outer_opt = OuterOptimizer(cfg.outer)
        if payload is not None:
            self._restore(payload)
        self._refresh_served()

        self.averaging = HivemindAveraging(
            self.dht, self.state.params, cfg.averaging, prefix=f"{cfg.network.run_id}_outer",
            state_provider=self._serve_state, newest_version=self._newest_live_version,
        )
        self.averaging.set_state_priority(self.state.version)

    def _restore(self, payload: dict[str, Any]) -> None:
        g = payload["global"]
        self.state = GlobalState(
            params=g["params"], momentum=g["momentum"], version=g["version"],
            momentum_initialized=g["momentum_initialized"], tokens=g["tokens"],
        )
        self.model.load_state_dict(payload["model"])
        self.inner_opt.load_state_dict(payload["inner_opt"])
        self.counters = Counters(**payload["counters"])
        self.sampler.cursor = payload["sampler_cursor"]
        self.log(f"resumed from {self.ckpt_dir} at version {self.state.version}")

    # ---- state served to peers -----------------------------------------------------------
    def _refresh_served(self) -> None:
        meta = {
            "version": self.state.version,
            "sha256": self.state.sha256(),
            "momentum_initialized": self.state.momentum_initialized,
            "tokens": self.state.tokens,
        }
        self._served = (meta, [t.clone() for t in self.state.tensors()])

    def _serve_state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        served = self._served  # replaced atomically after each commit; never mutated in place
        assert served is not None
        return served

    def _download_newer_state(self) -> bool:
        """Replace Θ with a newer, hash-verified one from peers; rebase local progress onto it."""
        n = len(self.state.params)
        for attempt in range(3):
            loaded = self.averaging.download_state(timeout=self.cfg.averaging.next_chunk_timeout)
            if loaded is None:
                self.log(f"state download attempt {attempt + 1}: no peer served a state", logging.WARNING)
                continue
            meta, tensors = loaded
            problem = _check_downloaded(meta, tensors, self.state)
            if problem:
                self.log(f"rejected downloaded state: {problem}", logging.WARNING)
                continue
            if meta["version"] <= self.state.version:
                return False
            old_params = [p.clone() for p in self.state.params]
            self.state = GlobalState(
                params=[t.float().clone() for t in tensors[:n]],
                momentum=[t.float().clone() for t in tensors[n:]],
                version=meta["version"], momentum_initialized=meta["momentum_initialized"],
                tokens=meta["tokens"],
            )
            rebase(list(self.model.parameters()), old_params, self.state.params)
            self.counters.syncs += 1
            self._refresh_served()
            self.averaging.set_state_priority(self.state.version)
            self.log(f"synced global state v{self.state.version} sha {self.state.sha256()[:12]} from peers "
                     f"(kept {self.counters.steps_since_merge} local steps as progress)")
            return True
        return False

    def _newest_live_version(self) -> int:
        records = self.board.read()
        return max((r.version for p, r in records.items() if p != self.peer_id and r.status != "left"), default=0)

    def _catch_up(self) -> None:
        records = {p: r for p, r in self.board.read().items() if p != self.peer_id}
        newest = max((r.version for r in records.values() if r.status != "left"), default=0)
        if newest > self.state.version:
            self.log(f"swarm is at version {newest}, we hold {self.state.version}: downloading")
            self._download_newer_state()
            return
        target = self.cfg.run.max_outer_steps
        finished = [r.version for r in records.values() if r.status == "left" and target and r.version >= target]
        if finished and self.state.version < target:
            raise LearnerError(
                f"the swarm already finished at version {max(finished)} and no running peer serves that "
                f"state; start this learner with a higher --max-outer-steps or with other learners"
            )

    # ---- training ------------------------------------------------------------------------
    def _inner_steps(self, n: int) -> float:
        cfg, model = self.cfg, self.model
        model.train()
        started, losses = time.perf_counter(), []
        for i in range(n):
            if self.stop.is_set():
                break
            x, y = self.sampler.next_batch()
            _, loss = model(x, y)
            self.inner_opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.inner.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
            self.inner_opt.step()
            if cfg.inner.extra_step_seconds:
                time.sleep(cfg.inner.extra_step_seconds)
            losses.append(loss.item())
            c = self.counters
            c.inner_steps += 1
            c.steps_since_merge += 1
            c.tokens += x.numel()
            c.tokens_since_merge += x.numel()
            if (i + 1) % cfg.run.log_every == 0 or i + 1 == n:
                rate = (i + 1) / (time.perf_counter() - started)
                recent = sum(losses[-cfg.run.log_every:]) / len(losses[-cfg.run.log_every:])
                self.log(f"inner {i + 1}/{n} loss {recent:.4f} ({rate:.1f} steps/s)")
        return sum(losses) / len(losses) if losses else float("nan")

    @torch.no_grad()
    def evaluate(self, params: list[torch.Tensor] | None = None) -> float:
        model = self.model
        if params is not None:
            model = build_model(self.cfg.model, self.cfg.run.seed)
            load_into_module(model, params)
        model.eval()
        losses = [float(model(x, y)[1]) for x, y in self.eval_batches]
        return sum(losses) / len(losses)

    def _outer_round(self, train_loss: float) -> RoundOutcome:
        c = self.counters
        rnd = OuterRound(
            state=self.state, optimizer=self.outer_opt, averaging=self.averaging,
            local_params=list(self.model.parameters()), tokens=c.tokens_since_merge,
            inner_steps=c.steps_since_merge, max_delta_norm=self.cfg.averaging.max_delta_norm,
        )
        out = rnd.run()
        c.bytes_sent += out.bytes_sent
        if out.committed:
            load_into_module(self.model, self.state.params)
            c.outer_steps += 1
            c.tokens_since_merge = c.steps_since_merge = 0
            self._refresh_served()
            self.averaging.set_state_priority(self.state.version)
        else:
            c.rounds_failed += 1
        eval_loss = self.evaluate()
        status = "committed" if out.committed else f"not committed ({out.reason}); local progress kept"
        self.log(
            f"outer round {status} | version {self.state.version} group {out.group_size} "
            f"tokens {c.tokens} train_loss {train_loss:.4f} eval_loss {eval_loss:.4f} "
            f"allreduce {out.allreduce_seconds:.2f}s round {out.round_seconds:.2f}s "
            f"sent {out.bytes_sent / 1e6:.3f} MB"
        )
        return out

    def _publish(self, status: str = "training") -> None:
        self.board.publish(ProgressRecord(self.state.version, self.state.sha256(), self.state.tokens, status))

    def _heartbeat(self) -> None:
        period = self.cfg.network.record_ttl / 3
        while not self._heartbeat_stop.wait(period):
            self._publish(self._status)

    def _checkpoint(self) -> None:
        payload = {
            "format": 1,
            "config": self.cfg.model_dump(),
            "global": {
                "params": self.state.params, "momentum": self.state.momentum, "version": self.state.version,
                "momentum_initialized": self.state.momentum_initialized, "tokens": self.state.tokens,
            },
            "model": self.model.state_dict(),
            "inner_opt": self.inner_opt.state_dict(),
            "counters": vars(self.counters).copy(),
            "sampler_cursor": self.sampler.cursor,
        }
        save_checkpoint(self.ckpt_dir, payload)

    def _finished(self) -> bool:
        target = self.cfg.run.max_outer_steps
        return target is not None and self.state.version >= target

    def _linger(self) -> None:
        """Serve the final state while learners still training are behind us (bounded)."""
        deadline = time.monotonic() + self.cfg.run.linger_seconds
        while time.monotonic() < deadline and not self.stop.is_set():
            records = self.board.read()
            behind = [p for p, r in records.items()
                      if p != self.peer_id and r.status == "training" and r.version < self.state.version]
            if not behind:
                return
            self.stop.wait(1.0)

    def run(self) -> dict[str, Any]:
        self._setup()
        self._status = "training"
        self._heartbeat_stop = threading.Event()
        heartbeat = threading.Thread(target=self._heartbeat, daemon=True, name="progress-heartbeat")
        try:
            self._publish()
            heartbeat.start()
            self._catch_up()
            if self.counters.first_eval_loss is None:
                self.counters.first_eval_loss = self.evaluate()
                self.log(f"eval_loss {self.counters.first_eval_loss:.4f} before training")
            while not self.stop.is_set() and not self._finished():
                train_loss = self._inner_steps(self.cfg.inner.steps_per_outer)
                if self.stop.is_set():
                    break
                self._catch_up()
                if self._finished():
                    break
                outcome = self._outer_round(train_loss)
                if outcome.superseded:
                    # We were late for the swarm's round: take its newer Θ (our steps are rebased onto
                    # it) and join the next round right away, so we fall back into step with the others.
                    self._catch_up()
                    if not self._finished():
                        self._outer_round(train_loss)
                self._publish()
                self._checkpoint()
            self._checkpoint()  # keeps inner steps taken since the last round
            if self._finished():
                self._status = "done"
                self._publish("done")
                self.log(f"reached version {self.state.version}; serving state to learners still behind")
                self._linger()
            return self.summary()
        finally:
            self._heartbeat_stop.set()
            self._shutdown()

    def summary(self) -> dict[str, Any]:
        c = self.counters
        return {
            "peer_id": self.peer_id,
            "shard": self.shard,
            "outer_steps": c.outer_steps,
            "rounds_failed": c.rounds_failed,
            "syncs": c.syncs,
            "inner_steps": c.inner_steps,
            "tokens": c.tokens,
            "bytes_sent": c.bytes_sent,
            "first_eval_loss": c.first_eval_loss,
            "last_eval_loss": self.evaluate(self.state.params),
            "version": self.state.version,
            "global_tokens": self.state.tokens,
            "global_state_sha256": self.state.sha256(),
        }

    def _shutdown(self) -> None:
        if hasattr(self, "board"):
            self._publish("left")
        if hasattr(self, "averaging"):
            self.averaging.shutdown()
        if hasattr(self, "dht"):
            self.dht.shutdown()
        if hasattr(self, "_dir_lock"):
            self._dir_lock.release()


def _check_downloaded(meta: Any, tensors: list[torch.Tensor], current: GlobalState) -> str:
    n = len(current.params)
    if not isinstance(meta, dict):
        return "metadata is not a map"
    for key, typ in (("version", int), ("sha256", str), ("momentum_initialized", bool), ("tokens", int)):
        if not isinstance(meta.get(key), typ):
            return f"metadata field {key} missing or of the wrong type"
    if len(tensors) != 2 * n:
        return f"expected {2 * n} tensors, got {len(tensors)}"
    for t, ref in zip(tensors, current.tensors(), strict=True):
        if t.shape != ref.shape:
            return f"tensor of shape {tuple(t.shape)} where {tuple(ref.shape)} was expected"
        if not torch.isfinite(t).all():
            return "tensor holds NaN or Inf"
    sha = state_sha256([t.float() for t in tensors], meta["version"], meta["momentum_initialized"])
    if sha != meta["sha256"]:
        return "hash of the received tensors does not match the advertised sha256"
    return ""


def write_summary(path: str | Path, summary: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(path)
