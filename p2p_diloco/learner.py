"""A learner unit: local data, inner AdamW steps, fragment rounds with whoever is in the swarm.

The loop, top to bottom::

    join the DHT → download the newest global state if the swarm is ahead
    repeat until every fragment's global version reaches --max-outer-steps (or Ctrl+C / SIGTERM):
        one inner step on the local shard
        if a fragment round in flight is due (τ steps after it started): apply its result, checkpoint
        for each fragment whose sync falls on this step (staggered, see fragments.py):
            catch up if the swarm moved ahead (rebase local progress onto the newer Θ)
            start its round: in the background if τ > 0, else right here
        every H steps: eval (every run.eval_every-th), log, publish progress, checkpoint
    keep serving the global state until the others have finished too (bounded), leave cleanly

A checkpoint is a copy handed to a writer thread: the loop never waits for the disk.

With P = 1 fragment and τ = 0 this is plain synchronous DiLoCo. A round that finds no group
commits nothing: the fragment keeps accumulating local progress, and the next round contributes
all of it, weighted by tokens (see merging.py for the weight and the staleness rule).

What a learner does with its local copy of a fragment when the averaged result arrives τ steps
after the round started (``sync.apply_policy``):

- ``overwrite`` (default, the Decoupled DiLoCo paper's choice): θ_f ← Θ_f. The local progress made
  on that fragment during the τ overlapped steps is dropped; the paper's ablation found this better
  than mixing as the number of learners grows, and it keeps every learner's θ_f equal to the shared
  Θ_f right after a sync.
- ``mix``: θ_f ← Θ_f + (θ_f − θ_f at the round's start): the τ steps of local progress are kept on
  top of the new global fragment and contribute to the next round. With M = 2 it measured 1.9–3.2
  points closer to data parallel than ``overwrite`` (docs/design.md, "Overlap and the apply policy").
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hivemind
import torch
from hivemind.utils import get_dht_time

from p2p_diloco import STARTED
from p2p_diloco.averaging import HivemindAveraging
from p2p_diloco.checkpoint import CheckpointError, CheckpointWriter, claim_checkpoint_dir, load_checkpoint
from p2p_diloco.config import LearnerConfig
from p2p_diloco.data import BatchSampler, DataError, fixed_eval_batches, load_splits, shard_for_peer
from p2p_diloco.faults import FaultPlan
from p2p_diloco.fragments import ClockSchedule, Fragment, build_fragments, due_fragments
from p2p_diloco.grace import GraceWindow
from p2p_diloco.inner_optim import AdamW
from p2p_diloco.lifecycle import LinkedDHT
from p2p_diloco.lr_schedule import SchedulePosition, inner_lr
from p2p_diloco.merging import token_weight
from p2p_diloco.model import build_model
from p2p_diloco.outer import (
    CONTRIBUTOR_VERSIONS,
    HISTORY_LENGTH,
    GlobalState,
    OuterOptimizer,
    load_into_module,
    merge_lineages,
    rebase,
    state_sha256,
)
from p2p_diloco.records import ProgressBoard, ProgressRecord
from p2p_diloco.round import OuterRound, RoundOutcome

logger = logging.getLogger("p2p_diloco.learner")


class LearnerError(RuntimeError):
    """A problem the user can fix (bad address, busy checkpoint dir, incompatible checkpoint)."""


@dataclass
class Counters:
    inner_steps: int = 0
    tokens: int = 0
    outer_steps: int = 0  # fragment rounds this learner committed
    steps_merged: float = 0.0  # inner steps whose progress entered the global model (counted per fragment round / P)
    rounds_failed: int = 0
    syncs: int = 0
    merges: int = 0  # sibling lineages (split brain) this learner merged
    bytes_sent: int = 0
    compute_seconds: float = 0.0  # wall time inside inner steps
    wait_seconds: float = 0.0  # wall time blocked on a round (overlap budget exceeded, or τ = 0)
    download_seconds: float = 0.0  # wall time of background state downloads (inner steps went on)
    # rounds this learner did not see commit whose contributors list showed its outer gradient in Θ
    contributions_confirmed: int = 0
    train_seconds: float = 0.0  # wall time of the training loop (inner steps, rounds, evals, checkpoints)
    first_eval_loss: float | None = None
    # per fragment, since that fragment's last committed round:
    tokens_since_merge: list[int] = field(default_factory=list)
    steps_since_merge: list[int] = field(default_factory=list)
    missed_versions: list[int] = field(default_factory=list)


@dataclass
class InFlight:
    """A fragment round running in the background while inner steps go on."""

    fragment: Fragment
    apply_at: int
    snapshot: list[torch.Tensor]  # θ_f when the round started (for the mix policy)
    tokens: int
    steps: int
    window: float
    state: GlobalState  # the round's own copy of the fragment's state; it becomes ours if committed
    thread: threading.Thread | None = None
    outcome: RoundOutcome | None = None

    def unconfirmed(self, version: int) -> Unconfirmed:
        """What this round sent, started from ``version``, until we know whether it was committed."""
        return Unconfirmed(version, self.snapshot, self.tokens, self.steps)


@dataclass
class Unconfirmed:
    """An outer gradient this learner may have given to a round it did not see commit.

    The round started from ``version`` of the fragment with the learner at ``snapshot``. If the
    swarm's state for ``version + 1`` lists this learner among its contributors, the progress up to
    ``snapshot`` is in Θ already and must not be contributed again (docs/resilience.md).
    """

    version: int
    snapshot: list[torch.Tensor]
    tokens: int
    steps: int


@dataclass
class Download:
    """A state download running in the background while inner steps go on."""

    fragments: tuple[int, ...]  # the fragments the swarm is ahead on (or holds a sibling of)
    started: float
    thread: threading.Thread | None = None
    result: dict[int, GlobalState] | None = None


def _same_or_behind(ours: GlobalState, theirs: GlobalState) -> bool:
    """``theirs`` is our state or one of its ancestors: nothing to take."""
    return theirs.sha256() == ours.sha256() or ours.descends_from(theirs.version, theirs.sha256())


def start_dht(cfg: LearnerConfig, identity_path: Path | None, wait: bool = True) -> hivemind.DHT:
    """Start the DHT's process and join the swarm; ``wait=False`` returns at once (``wait_until_ready``)."""
    net = cfg.network
    try:
        return LinkedDHT(
            initial_peers=net.initial_peers or None,
            host_maddrs=net.host_maddrs,
            announce_maddrs=net.announce_maddrs or None,
            identity_path=str(identity_path) if identity_path else None,
            startup_timeout=net.startup_timeout,
            start=True,
            await_ready=wait,
        )
    except Exception as e:  # noqa: BLE001 - hivemind raises many types for the same user mistake
        raise LearnerError(f"could not start or join the DHT ({type(e).__name__}: {e})".strip()) from None


def lineage_id(cfg: LearnerConfig) -> str:
    """Hash of the settings that must agree for two learners to share one lineage of the model.

    Learners whose settings differ (model, seed, outer optimizer, fragments, codecs, merging rules)
    would produce different states from the same round; they use different DHT keys and never meet.
    """
    keys = {
        "model": cfg.model.model_dump(), "outer": cfg.outer.model_dump(), "seed": cfg.run.seed,
        "fragments": cfg.sync.fragments, "codecs": [cfg.codec_for(f) for f in range(cfg.sync.fragments)],
        "weighting": cfg.sync.weighting, "rda": cfg.sync.rda, "max_delta_norm": cfg.averaging.max_delta_norm,
        "steps_per_outer": cfg.inner.steps_per_outer, "schedule": cfg.sync.schedule,
        "period": cfg.sync.period_seconds if cfg.sync.schedule == "clock" else None,
    }
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:8]


def whole_sha256(states: list[GlobalState]) -> str:
    return hashlib.sha256("".join(s.sha256() for s in states).encode()).hexdigest()


class Learner:
    def __init__(self, cfg: LearnerConfig, stop: threading.Event | None = None, faults: FaultPlan | None = None):
        self.cfg = cfg
        self.faults = faults or FaultPlan()
        self.stop = stop or threading.Event()
        self.leave_now = threading.Event()  # a second Ctrl+C / SIGTERM: skip the parting rounds
        # When the parting budget ends (monotonic), set at the first look after the stop signal: until
        # then rounds and downloads go on although stop is set (see _leaving).
        self._parting_until: float | None = None
        self._training = False  # a stop before training began (set-up, first download) leaves at once
        self.counters = Counters()
        self.states: list[GlobalState] = []
        self.inflight: InFlight | None = None
        self.detached: InFlight | None = None  # a round we stopped waiting for at τ; still running
        self.download: Download | None = None
        self._pending: dict[int, float] = {}  # fragment → deadline (monotonic) of a slot not yet started
        # Steps schedule: added to the step counter to find due fragments; moved when we re-join the
        # swarm's rounds after losing phase with it (see _rephase).
        self._phase_shift = 0
        self._out_of_phase = False  # the last round on the steps schedule ended without a commit
        self._next_phase_look = 0.0  # monotonic time of the next DHT look for the others' rounds
        self._target_loss_reached = False
        self._swarm_gone = False  # stop_at_eval_loss: the others reached it and left while we were behind
        self._done_ahead = 0  # newest version seen in a peer that finished ("done")
        self._last_outcome: RoundOutcome | None = None
        self.short_id = "------"
        self._served: tuple[dict[str, Any], list[torch.Tensor]] | None = None
        self._checkpointed: tuple[int, ...] | None = None  # counters at the last checkpoint
        self._unconfirmed: dict[int, Unconfirmed] = {}  # fragment → outer gradient of a round we did not see end
        self._sampler_cursor: int | None = None  # from the checkpoint
        self._seen_records: dict[str, ProgressRecord] | None = None  # the last DHT lookup (_records)
        self._records_stale = False  # set after a failed round; cleared by the next _records() lookup

    # ---- logging -------------------------------------------------------------------------
    def log(self, msg: str, level: int = logging.INFO) -> None:
        version = self.version
        logger.log(level, f"[{self.short_id} step={self.counters.inner_steps} round={version}] {msg}")

    @property
    def version(self) -> int:
        return min((s.version for s in self.states), default=0)

    # ---- setup ---------------------------------------------------------------------------
    def _setup(self) -> None:
        """Start-up. The DHT's process (and its p2pd) boots and joins the swarm while this process reads
        its data and builds the model and optimizer: a restart pays the longer of the two, not both."""
        cfg = self.cfg
        began = time.monotonic()
        torch.set_num_threads(cfg.run.threads)
        self.ckpt_dir, self._dir_lock = claim_checkpoint_dir(cfg.run.checkpoint_dir)
        payload = load_checkpoint(self.ckpt_dir) if cfg.run.resume else None
        if payload is not None:
            saved = payload["config"]
            if saved["model"] != cfg.model.model_dump() or saved.get("sync", {}).get("fragments", 1) != \
                    cfg.sync.fragments:
                raise LearnerError(f"checkpoint in {self.ckpt_dir} was made with a different model or fragments")

        self.dht = start_dht(cfg, self.ckpt_dir / "identity.key", wait=False)
        local_work = time.monotonic()
        if cfg.data.shard_index is not None:
            self._load_data(cfg.data.shard_index)
        self._build(payload)
        local_work = time.monotonic() - local_work
        waited = time.monotonic()
        self._join_dht(payload)
        waited = time.monotonic() - waited
        if cfg.data.shard_index is None:
            self._load_data(shard_for_peer(self.dht.peer_id.to_bytes(), cfg.data.num_shards))
        if self._sampler_cursor is not None:
            self.sampler.cursor = self._sampler_cursor
        self.log(f"checkpoints in {self.ckpt_dir}; data shard {self.shard}/{cfg.data.num_shards}")
        self.log(f"{len(self.fragments)} fragment(s) of {[f.numel for f in self.fragments]} values; overlap τ = "
                 f"{cfg.sync.overlap_steps} steps; quorum K = {cfg.averaging.min_group_size}")

        averager = time.monotonic()
        self.averaging = HivemindAveraging(
            self.dht, [t for s in self.states for t in s.params], cfg.averaging,
            prefix=f"{self.lineage}_outer", state_provider=self._serve_state,
            newest_version=self._newest_live_version, should_stop=self._leaving,
            fragments=self._flat_fragment_indices(), codecs=[cfg.codec_for(f.index) for f in self.fragments],
            faults=self.faults,
        )
        self.averaging.set_state_priority(self.version)
        # Started after hivemind forked its DHT and averager processes, so no fork sees it mid-write.
        self.writer = CheckpointWriter(self.ckpt_dir)
        now = time.monotonic()
        self.log(f"set up in {now - began:.1f} s after {began - STARTED:.1f} s of imports: data, model and "
                 f"optimizer {local_work:.1f} s, then {waited:.1f} s more for the DHT; averager {now - averager:.1f} s")

    def _join_dht(self, payload: dict[str, Any] | None) -> None:
        try:
            self.dht.wait_until_ready()
        except Exception as e:  # noqa: BLE001 - hivemind raises many types for the same user mistake
            raise LearnerError(f"could not start or join the DHT ({type(e).__name__}: {e})".strip()) from None
        self.peer_id = str(self.dht.peer_id)
        self.short_id = self.peer_id[-6:]
        self.log(f"joined DHT; visible at {[str(a) for a in self.dht.get_visible_maddrs()]}")
        # Announce ourselves at once, before the download, so that learners finishing the run see a
        # newcomer behind them and keep serving state until it has caught up.
        self.lineage = f"{self.cfg.network.run_id}-{lineage_id(self.cfg)}"
        self.log(f"lineage {self.lineage} (learners only meet others with the same run id and lineage settings)")
        self.board = ProgressBoard(self.dht, self.lineage, self.cfg.network.record_ttl)
        version0 = min(g["version"] for g in payload["global"]) if payload is not None else 0
        self.board.publish(ProgressRecord(version0, "0" * 64, 0, "training"))

    def _load_data(self, shard: int) -> None:
        cfg = self.cfg
        self.shard = shard
        splits = load_splits(cfg.data, [shard, None])
        train, evaluation = splits[shard], splits[None]
        if min(len(train), len(evaluation)) <= cfg.model.seq_len + 1:
            raise DataError(f"data shard or eval split is shorter than model.seq_len ({cfg.model.seq_len})")
        self.sampler = BatchSampler(train, cfg.model.seq_len, cfg.inner.batch_size, seed=cfg.run.seed * 7919 + shard)
        self.eval_batches = fixed_eval_batches(evaluation, cfg.model.seq_len, cfg.inner.batch_size,
                                               cfg.data.eval_batches)
        self.log(f"shard {shard} holds {len(train) / 1e6:.2f} MB, eval split {len(evaluation) / 1e6:.2f} MB")

    def _build(self, payload: dict[str, Any] | None) -> None:
        """Model, fragments, global state, optimizers and the checkpoint's contents: no network."""
        cfg = self.cfg
        self.model = build_model(cfg.model, cfg.run.seed)
        self.params = list(self.model.parameters())
        named = [(n, p.shape) for n, p in self.model.named_parameters()]
        try:
            self.fragments = build_fragments(named, cfg.sync.fragments, cfg.inner.steps_per_outer)
        except ValueError as e:
            raise LearnerError(f"sync.fragments: {e}") from None
        self.clock = (
            ClockSchedule(self.fragments, cfg.sync.period_seconds, get_dht_time())
            if cfg.sync.schedule == "clock" else None
        )
        whole = GlobalState.from_module(self.model)
        self.states = [
            GlobalState(params=[whole.params[i] for i in f.tensor_indices],
                        momentum=[whole.momentum[i] for i in f.tensor_indices])
            for f in self.fragments
        ]
        for state in self.states:
            state.remember()
        p = len(self.fragments)
        self.counters.tokens_since_merge = [0] * p
        self.counters.steps_since_merge = [0] * p
        self.counters.missed_versions = [0] * p
        self.inner_opt = AdamW(  # torch.optim.AdamW's arithmetic, without its 2-4 s import (inner_optim.py)
            self.params, lr=cfg.inner.lr, weight_decay=cfg.inner.weight_decay,
            betas=(cfg.inner.beta1, cfg.inner.beta2),
        )
        self.lr_position = SchedulePosition(cfg.inner.steps_per_outer)
        self._lr_at = 0  # schedule position of the last inner step (logged with its lr)
        self.outer_opt = OuterOptimizer(cfg.outer)
        self.grace = GraceWindow(cfg.sync.overlap_steps, cfg.sync.grace_gamma, cfg.averaging.matchmaking_time,
                                 min(cfg.sync.max_grace, cfg.averaging.round_timeout / 2))
        if payload is not None:
            self._restore(payload)
        self._refresh_served()

    def _flat_fragment_indices(self) -> list[tuple[int, ...]]:
        """Fragment f's tensors are laid out consecutively in the averager's buffers."""
        out, start = [], 0
        for s in self.states:
            out.append(tuple(range(start, start + len(s.params))))
            start += len(s.params)
        return out

    def _local(self, fragment: Fragment) -> list[torch.Tensor]:
        return [self.params[i] for i in fragment.tensor_indices]

    def _restore(self, payload: dict[str, Any]) -> None:
        self.states = [
            GlobalState(params=g["params"], momentum=g["momentum"], version=g["version"],
                        momentum_initialized=g["momentum_initialized"], tokens=g["tokens"],
                        history=[(int(v), str(h)) for v, h in g.get("history", [])],
                        contributors=[(int(v), tuple(map(str, peers))) for v, peers in g.get("contributors", [])])
            for g in payload["global"]
        ]
        self.model.load_state_dict(payload["model"])
        self.inner_opt.load_state_dict(payload["inner_opt"])
        self.counters = Counters(**payload["counters"])
        self._sampler_cursor = payload["sampler_cursor"]  # applied once the data is loaded (_setup)
        if "lr_position" in payload:  # checkpoints before it restart at version · H
            try:
                self.lr_position.load(payload["lr_position"])
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"checkpoint in {self.ckpt_dir}: bad lr_position ({e})") from None
        # We may have died in a round after sending our outer gradient, and the others may have
        # committed it. A round in flight or unconfirmed at the checkpoint is saved with its
        # snapshot; any other fragment's progress in the checkpoint is all it could have sent.
        saved = {int(u["fragment"]): u for u in payload.get("unconfirmed", [])}
        for frag in self.fragments:
            f, c = frag.index, self.counters
            if f in saved:
                u = saved[f]
                self._unconfirmed[f] = Unconfirmed(int(u["version"]), list(u["snapshot"]), int(u["tokens"]),
                                                   int(u["steps"]))
            elif c.tokens_since_merge[f] > 0:
                snapshot = [p.detach().clone() for p in self._local(frag)]
                self._unconfirmed[f] = Unconfirmed(self.states[f].version, snapshot, c.tokens_since_merge[f],
                                                   c.steps_since_merge[f])
        self.log(f"resumed from {self.ckpt_dir} at version {self.version}")

    # ---- state served to peers -----------------------------------------------------------
    def _refresh_served(self) -> None:
        meta = {
            "versions": [s.version for s in self.states],
            "shas": [s.sha256() for s in self.states],
            "momentum_initialized": [s.momentum_initialized for s in self.states],
            "tokens": [s.tokens for s in self.states],
            "histories": [[list(h) for h in s.history] for s in self.states],
            "contributors": [[[v, list(peers)] for v, peers in s.contributors] for s in self.states],
            "sha256": whole_sha256(self.states),
        }
        self._served = (meta, [t.clone() for s in self.states for t in s.tensors()])

    def _serve_state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        served = self._served  # replaced atomically after each commit; never mutated in place
        assert served is not None
        self.faults.fire("serve", self.version)
        return served

    def _fetch_state(self, peers: Sequence[str] = (), fragments: Sequence[int] | None = None) -> dict[int, GlobalState]:
        """Download and verify ``fragments`` (all when None) from the first of ``peers`` that serves them,
        else the whole state from any peer. Touches no learner state: safe in a background thread."""
        attempts = [*peers[:3], None]  # None: any peer, newest version first (hivemind's priority order)
        for peer in attempts:
            if self._leaving():
                return {}
            timeout = self.cfg.averaging.next_chunk_timeout
            wanted = None if peer is None else fragments
            loaded = (self.averaging.download_state(timeout) if peer is None
                      else self.averaging.download_state_from(peer, timeout, wanted))
            if loaded is None:
                self.log(f"no state from {peer or 'any peer'}", logging.WARNING)
                continue
            theirs, problem = _parse_downloaded(*loaded, self.states, wanted)
            if problem:
                self.log(f"rejected state from {peer or 'a peer'}: {problem}", logging.WARNING)
                continue
            if any(not _same_or_behind(self.states[f], s) for f, s in theirs.items()):
                return theirs
        return {}

    def _adopt(self, theirs: dict[int, GlobalState]) -> list[int]:
        changed = [f for f, state in sorted(theirs.items()) if self._reconcile(self.fragments[f], state)]
        if changed:
            self.counters.syncs += 1
            self._refresh_served()
            self.averaging.set_state_priority(self.version)
            self.log(f"synced global state v{self.version} (fragments {changed}) sha "
                     f"{whole_sha256(self.states)[:12]} from peers (local progress kept)")
        return changed

    def _reconcile(self, frag: Fragment, theirs: GlobalState) -> bool:
        """Take a peer's state of one fragment if it is ahead of ours; merge if it is a sibling lineage."""
        ours = self.states[frag.index]
        if _same_or_behind(ours, theirs):
            return False
        if theirs.descends_from(ours.version, ours.sha256()):
            new = theirs  # ahead of us on our own lineage: catch up
        else:
            new = merge_lineages(ours, theirs)
            self.counters.merges += 1
            self.log(f"split brain on fragment {frag.index}: ours v{ours.version} {ours.sha256()[:12]}, a peer's "
                     f"v{theirs.version} {theirs.sha256()[:12]}; merged into v{new.version} {new.sha256()[:12]} "
                     f"weighted by tokens", logging.WARNING)
        self._rebase_onto(frag, ours, new)
        self.counters.missed_versions[frag.index] += max(0, new.version - ours.version)
        self.states[frag.index] = new
        return True

    def _rebase_onto(self, frag: Fragment, ours: GlobalState, new: GlobalState) -> None:
        """Move our progress on ``frag`` onto ``new``, minus an outer gradient that is already in it."""
        f, c = frag.index, self.counters
        pending = self._unconfirmed.pop(f, None)
        included = None
        if pending is not None and pending.version == ours.version and new.version > ours.version:
            included = new.contributed(ours.version + 1, self.peer_id)
        if not included:
            if included is None and pending is not None and new.version > ours.version:
                self.log(f"fragment {f}: cannot tell whether our outer gradient from version {ours.version} reached "
                         f"version {ours.version + 1} (its contributors are not known); keeping our progress",
                         logging.WARNING)
            rebase(self._local(frag), ours.params, new.params)
            return
        # θ ← Θ_new + (θ − snapshot): what we trained since the round started is kept, what we sent is
        # in Θ_new already. (The mix policy's formula; overwriting would drop steps that are not.)
        rebase(self._local(frag), pending.snapshot, new.params)
        c.tokens_since_merge[f] = max(0, c.tokens_since_merge[f] - pending.tokens)
        c.steps_since_merge[f] = max(0, c.steps_since_merge[f] - pending.steps)
        c.steps_merged += pending.steps / len(self.fragments)
        c.contributions_confirmed += 1
        self.log(f"fragment {f}: our outer gradient from version {ours.version} ({pending.steps} steps) is in version "
                 f"{ours.version + 1}, committed by the others without us seeing it; not contributing it again")

    def _newest_live_version(self, fragment: int = 0) -> int:
        records = self.board.read()
        return max((r.fragment_version(fragment) for p, r in records.items()
                    if p != self.peer_id and r.status != "left"), default=0)

    def _records(self, fresh: bool) -> dict[str, ProgressRecord]:
        """The swarm's progress records: looked up in the DHT now, or as last seen (the heartbeat
        thread looks them up every ``record_ttl / 3``), so that the training loop does not wait for a
        DHT lookup, which on a WAN takes round trips to far peers."""
        if fresh or self._seen_records is None or self._records_stale:
            self._records_stale = False  # before the lookup: a round failing meanwhile marks it stale again
            self._seen_records = self.board.read()
        return self._seen_records

    def _behind(self, fresh: bool = True) -> tuple[list[str], list[int], str]:
        """Peers to download from (newest first), the fragments to take and why, from the progress records."""
        records = {p: r for p, r in self._records(fresh).items() if p != self.peer_id}
        live = {p: r for p, r in records.items() if r.status != "left"}
        self._done_ahead = max([self._done_ahead] + [r.version for r in live.values() if r.status == "done"])
        ahead, siblings, fragments = {}, {}, set()
        mine_shas = [s.sha256() for s in self.states] if live else []  # hashing a fragment is not free
        for p, r in live.items():
            for f in self.fragments:
                mine = self.states[f.index]
                v, sha = r.fragment_version(f.index), r.fragment_sha(f.index)
                if v > mine.version:
                    ahead[p] = max(ahead.get(p, (0, 0.0)), (v, random.random()))
                    fragments.add(f.index)
                elif v == mine.version and sha and sha != mine_shas[f.index]:
                    siblings[p] = max(siblings.get(p, (0, 0.0)), (v, random.random()))
                    fragments.add(f.index)
        if ahead or siblings:
            # Newest first; random among equals, so that many joiners spread over the peers that serve.
            peers = [p for p, _ in sorted(ahead.items(), key=lambda kv: kv[1], reverse=True)]
            peers += [p for p, _ in sorted(siblings.items(), key=lambda kv: kv[1], reverse=True) if p not in ahead]
            reason = "is ahead of" if ahead else "holds a sibling lineage of"
            return peers, sorted(fragments), reason
        target = self.cfg.run.max_outer_steps
        finished = [r.version for r in records.values() if r.status == "left" and target and r.version >= target]
        if finished and self.version < target and not live:
            raise LearnerError(
                f"the swarm already finished at version {max(finished)} and no running peer serves that "
                f"state; start this learner with a higher --max-outer-steps or with other learners"
            )
        if self.cfg.run.stop_at_eval_loss is not None and self._done_ahead > self.version and not live:
            # Peers stopped at the target loss ahead of us and have left while we were behind (say,
            # mid-download over a slow link): nobody is left to merge with or to serve the state, so
            # we stop too instead of training alone. Our local progress is in the checkpoint.
            self._swarm_gone = True
            self.log(f"the swarm reached the target at version {self._done_ahead} and left while we were "
                     "behind; stopping too (local progress is in the checkpoint)", logging.WARNING)
        return [], [], ""

    def _catch_up(self, background: bool = False) -> list[int]:
        """Before contributing: take newer state from peers, and heal sibling lineages (split brain).

        Returns the fragments that changed. ``background``: start the download in a thread and
        return at once; inner steps go on, and :meth:`_poll_download` adopts the state when it has
        arrived (rounds of those fragments wait for it).
        """
        if self.download is not None:
            return []
        peers, fragments, reason = self._behind(fresh=not background)
        if not fragments:
            return []
        self.log(f"the swarm {reason} our version {self.version} of fragments {fragments}: downloading"
                 f"{' in the background' if background else ''}")
        if not background:
            return self._adopt(self._fetch_state(peers, fragments))
        task = Download(fragments=tuple(fragments), started=time.perf_counter())

        def fetch() -> None:
            task.result = self._fetch_state(peers, fragments)

        task.thread = threading.Thread(target=fetch, daemon=True, name="state-download")
        self.download = task
        task.thread.start()
        return []

    def _poll_download(self) -> None:
        """Adopt a background download once it has arrived (and no round of its fragments is running)."""
        task = self.download
        if task is None or task.thread is None or task.thread.is_alive():
            return
        if self.inflight is not None and self.inflight.fragment.index in task.fragments:
            return  # that round holds the fragment's state; adopt after it
        self.download = None
        self.counters.download_seconds += time.perf_counter() - task.started
        busy = self.inflight.fragment.index if self.inflight is not None else None
        theirs = {f: state for f, state in (task.result or {}).items() if f != busy}
        if theirs:
            self._adopt(theirs)

    # ---- training ------------------------------------------------------------------------
    def _inner_step(self) -> float:
        cfg, c = self.cfg, self.counters
        if self.faults.due("inner", self.version + 1):
            self.writer.flush()  # the fault hits the inner steps, not a checkpoint write still under way
        self.faults.fire("inner", self.version + 1)
        started = time.perf_counter()
        self.model.train()
        x, y = self.sampler.next_batch()
        _, loss = self.model(x, y)
        self.inner_opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, cfg.inner.grad_clip)
        self._lr_at = self.lr_position.step(self.version)
        self.inner_opt.lr = inner_lr(cfg.inner, self._lr_at, cfg.decay_steps)
        self.inner_opt.step()
        if cfg.inner.extra_step_seconds:
            time.sleep(cfg.inner.extra_step_seconds)
        elapsed = time.perf_counter() - started
        c.compute_seconds += elapsed
        self.grace.observe_step(elapsed)
        c.inner_steps += 1
        c.tokens += x.numel()
        for f in range(len(self.fragments)):
            c.tokens_since_merge[f] += x.numel()
            c.steps_since_merge[f] += 1
        return loss.item()

    @torch.no_grad()
    def evaluate(self, params: list[torch.Tensor] | None = None) -> float:
        model = self.model
        if params is not None:
            model = build_model(self.cfg.model, self.cfg.run.seed)
            load_into_module(model, params)
        model.eval()
        losses = [float(model(x, y)[1]) for x, y in self.eval_batches]
        return sum(losses) / len(losses)

    def global_params(self) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(self.params)
        for frag, state in zip(self.fragments, self.states, strict=True):
            for i, t in zip(frag.tensor_indices, state.params, strict=True):
                out[i] = t
        return out  # type: ignore[return-value]

    def _start_round(self, frag: Fragment, background: bool | None = None) -> None:
        """Start fragment ``frag``'s round: in the background when τ > 0 (applied at ``apply_at``),
        else (or with ``background=False``) here, applying its result before returning."""
        cfg, c = self.cfg, self.counters
        if background is None:
            background = cfg.sync.overlap_steps > 0
        f = frag.index
        window = self.grace.choose()
        weight = token_weight(c.tokens_since_merge[f], c.steps_since_merge[f], c.missed_versions[f],
                              cfg.sync.weighting)
        local = self._local(frag)
        task = InFlight(
            fragment=frag, apply_at=c.inner_steps + cfg.sync.overlap_steps,
            snapshot=[p.detach().clone() for p in local], tokens=c.tokens_since_merge[f],
            steps=c.steps_since_merge[f], window=window, state=self.states[f].copy(),
        )
        # The round works on a copy: the training thread reads and checkpoints self.states while it
        # runs, and must never see a fragment half-way through the outer step.
        rnd = OuterRound(
            state=task.state, optimizer=self.outer_opt, averaging=self.averaging, local_params=task.snapshot,
            tokens=task.tokens, inner_steps=task.steps, max_delta_norm=cfg.averaging.max_delta_norm,
            weight=weight, fragment=f, rda=cfg.sync.rda and not frag.has_embedding, grace=window,
        )

        def run() -> None:
            task.outcome = rnd.run()

        self.inflight = task
        if not background:
            waited = time.perf_counter()
            run()
            c.wait_seconds += time.perf_counter() - waited
            self._finish_round()
        else:
            task.thread = threading.Thread(target=run, daemon=True, name=f"round-fragment-{f}")
            task.thread.start()

    def _finish_round(self) -> RoundOutcome | None:
        """Join the round in flight (blocking if it is late, up to ``sync.max_wait_seconds``) and apply
        its result locally. Returns None when it is still running after that: see :meth:`_detach`."""
        task, c, cfg = self.inflight, self.counters, self.cfg
        assert task is not None
        if task.thread is not None:
            waited = time.perf_counter()
            task.thread.join(timeout=cfg.sync.max_wait_seconds)
            c.wait_seconds += time.perf_counter() - waited
            if task.thread.is_alive():
                self._detach(task, time.perf_counter() - waited)
                return None
        self.inflight = None
        out, f = task.outcome, task.fragment.index
        assert out is not None
        self._last_outcome = out
        c.bytes_sent += out.bytes_sent
        self.grace.observe_round(out.round_seconds, out.allreduce_seconds, task.window)
        if out.committed:
            self.states[f] = task.state
            self._unconfirmed.pop(f, None)
            local, new = self._local(task.fragment), self.states[f].params
            with torch.no_grad():
                for p, g, snap in zip(local, new, task.snapshot, strict=True):
                    if cfg.sync.apply_policy == "mix":
                        p.copy_(g + (p.detach() - snap))
                    else:
                        p.copy_(g)
            c.outer_steps += 1
            c.steps_merged += task.steps / len(self.fragments)
            # Tokens taken during the overlap were not part of this round; they count for the next one.
            c.tokens_since_merge[f] -= task.tokens
            c.steps_since_merge[f] -= task.steps
            c.missed_versions[f] = 0
            self._out_of_phase = False
            self._refresh_served()
            self.averaging.set_state_priority(self.version)
            if cfg.run.checkpoint_on_commit:
                self._checkpoint()
        else:
            c.rounds_failed += 1
            self._out_of_phase = True
            self._records_stale = True  # the swarm may have moved on: the next catch-up looks it up afresh
            if task.tokens > 0:
                # Our outer gradient may have reached reducers whose group committed without us.
                self._unconfirmed[f] = task.unconfirmed(self.states[f].version)
        status = "committed" if out.committed else f"not committed ({out.reason}); local progress kept"
        self.log(
            f"outer round {status} | version {self.states[f].version} fragment {f}/{len(self.fragments)} "
            f"group {out.group_size} window {task.window:.2f}s allreduce {out.allreduce_seconds:.2f}s "
            f"round {out.round_seconds:.2f}s sent {out.bytes_sent / 1e6:.3f} MB"
        )
        return out

    def _detach(self, task: InFlight, waited: float) -> None:
        """Train on without a round that outlived ``sync.max_wait_seconds`` past τ (a groupmate died
        mid-round, say, and hivemind's all-reduce timeout has not fired yet).

        The round keeps running on its own copy of the fragment's state. If it commits, the result is
        taken like a download from a peer (:meth:`_poll_detached`); if it fails, our outer gradient
        waits for a later round. Until then it is unconfirmed, so that if the others commit it while
        we learn of it only from their state, it is not contributed twice (docs/resilience.md).
        """
        f = task.fragment.index
        self.inflight, self.detached = None, task
        self._unconfirmed[f] = task.unconfirmed(self.states[f].version)
        self.log(f"fragment {f}: round still running after waiting {waited:.1f} s at τ; training on (its result is "
                 "applied if it commits)", logging.WARNING)

    def _poll_detached(self) -> None:
        task = self.detached
        if task is None or (task.thread is not None and task.thread.is_alive()):
            return
        self.detached = None
        out, f = task.outcome, task.fragment.index
        assert out is not None
        self.counters.bytes_sent += out.bytes_sent
        if not out.committed:
            self.counters.rounds_failed += 1
            self._out_of_phase = True
            self.log(f"fragment {f}: the round we stopped waiting for ended without a commit ({out.reason}); "
                     "local progress kept")
            return
        if self.download is not None and f in self.download.fragments:
            return  # a newer state of it is on the way; this one is adopted (or superseded) with it
        self.counters.outer_steps += 1
        self._out_of_phase = False
        self.log(f"fragment {f}: the round we stopped waiting for committed version {task.state.version}")
        if f in self._adopt({f: task.state}):
            self.counters.missed_versions[f] = 0  # our own round, not a version we missed

    def _due(self) -> list[Fragment]:
        if self.clock is not None:
            return self.clock.due(get_dht_time())
        return due_fragments(self.fragments, self.counters.inner_steps + self._phase_shift,
                             self.cfg.inner.steps_per_outer)

    def _rephase(self) -> None:
        """Steps schedule: after a round without a commit, join a round the others are forming now.

        Learners on the steps schedule meet because their step counters reach each fragment's slot at
        about the same time, and a round's barrier keeps them there. One asymmetric round breaks
        that for good: in a 9,600-step benchmark one learner's all-reduce hung for 30 s on a group
        its partner never joined (that side saw no group after 12 s), which put the two 18 s apart,
        longer than a round's search; from then on each searched alone at its own slots and no
        round ever committed again. So while our last round failed, when no round of ours runs, we
        look in the DHT (at most once per matchmaking time) for peers looking for a group at a
        fragment and version we hold, and if there are some, move our schedule so that this
        fragment is due now: we join their round, and its end puts us back in step with them. Only
        the learner whose round failed moves, into a search already under way: nobody waits longer
        than one search.
        """
        if self.clock is not None or not self._out_of_phase or self.inflight is not None or self.detached is not None:
            return
        now = time.monotonic()
        if now < self._next_phase_look:
            return
        self._next_phase_look = now + self.cfg.averaging.matchmaking_time
        target, h, c = self.cfg.run.max_outer_steps, self.cfg.inner.steps_per_outer, self.counters
        for frag in self.fragments:
            version = self.states[frag.index].version
            if frag.index in self._pending or (target is not None and version >= target):
                continue
            try:
                others = self.averaging.searching_peers(frag.index, version)
            except Exception as e:  # noqa: BLE001 - a failed DHT look is a missed chance, not an error
                self.log(f"could not look for the others' rounds: {type(e).__name__}: {e}", logging.DEBUG)
                return
            if others:
                shift = (frag.offset - c.inner_steps) % h
                self.log(f"out of phase with the swarm: joining the round of fragment {frag.index} that "
                         f"{others} other learner(s) are forming (schedule moved by {shift} of {h} steps)")
                self._phase_shift = shift
                self._pending[frag.index] = float("inf")
                return

    def _sync_due_fragments(self) -> None:
        target = self.cfg.run.max_outer_steps
        now = time.monotonic()
        self._rephase()
        for frag in self._due():
            # On the clock schedule a slot stays open while the group forms (matchmaking time): a
            # learner whose previous round is about to end still joins. On the steps schedule the
            # slot waits for the previous round (the overlap budget ran out).
            patience = self.cfg.averaging.matchmaking_time if self.clock is not None else float("inf")
            self._pending[frag.index] = now + patience
        for f in list(self._pending):
            frag = self.fragments[f]
            if self.inflight is not None:
                done = self.inflight.thread is None or not self.inflight.thread.is_alive()
                if done or self.clock is None:
                    self._finish_round()  # its result is ready (or the overlap budget ran out): apply it now
                elif now < self._pending[f]:
                    continue  # keep training; look again after the next inner step
                else:
                    del self._pending[f]
                    # The fragment's progress waits for its next slot.
                    self.log(f"skipped fragment {f}'s slot: fragment {self.inflight.fragment.index}'s "
                             "round is still in flight")
                    continue
            del self._pending[f]
            if self.detached is not None:
                # The averager is still busy with the round we stopped waiting for: a round now would
                # only queue behind it. This fragment's progress waits for its next slot.
                self.log(f"skipped fragment {f}'s slot: fragment {self.detached.fragment.index}'s late round is "
                         "still running")
                continue
            background = self.cfg.sync.overlap_steps > 0
            self._catch_up(background=background)
            if self.download is not None and f in self.download.fragments:
                # The swarm committed this fragment without us. Skipping this round (rather than
                # waiting alone for a group) keeps us in phase: on the steps schedule the swarm's next
                # round of it is about H steps away, as is ours. Our progress stays in θ and counts
                # next time.
                self.log(f"fragment {f}: its newer state is on the way; contributing at its next slot")
                continue
            if target is not None and self.states[f].version >= target:
                continue
            self._start_round(frag)
            if not background and self._last_superseded:
                # We were late for the swarm's round: take its newer Θ (our steps are rebased onto it)
                # and join the next round right away, so we fall back into step with the others.
                self._catch_up()
                if target is None or self.states[f].version < target:
                    self._start_round(frag)

    @property
    def _last_superseded(self) -> bool:
        return self._last_outcome is not None and self._last_outcome.superseded

    def _publish(self, status: str = "training") -> None:
        assert self._served is not None
        meta = self._served[0]  # not _serve_state(): that is the peers' download path (and its fault hook)
        versions = tuple(meta["versions"])
        self.board.publish(ProgressRecord(min(versions), meta["sha256"], sum(meta["tokens"]), status,
                                          versions=versions, shas=tuple(meta["shas"])))

    def _heartbeat(self) -> None:
        period = self.cfg.network.record_ttl / 3
        while not self._heartbeat_stop.wait(period):
            self._publish(self._status)
            self._seen_records = self.board.read()  # leaves _records_stale to the training thread

    def _checkpoint(self) -> None:
        c = self.counters
        mark = (c.inner_steps, c.outer_steps, c.syncs, c.merges)
        if mark == self._checkpointed:
            return  # nothing new since the last one (a commit at the end of an outer step)
        self._checkpointed = mark
        payload = {
            "format": 2,
            "config": self.cfg.model_dump(),
            "global": [
                {"params": s.params, "momentum": s.momentum, "version": s.version,
                 "momentum_initialized": s.momentum_initialized, "tokens": s.tokens,
                 "history": [list(h) for h in s.history],
                 "contributors": [[v, list(peers)] for v, peers in s.contributors]}
                for s in self.states
            ],
            "unconfirmed": self._unconfirmed_for_checkpoint(),
            "model": self.model.state_dict(),
            "inner_opt": self.inner_opt.state_dict(),
            "counters": vars(self.counters).copy(),
            "sampler_cursor": self.sampler.cursor,
            "lr_position": self.lr_position.state(),
        }
        version = self.version
        self.writer.submit(payload, before_rename=lambda: self.faults.fire("checkpoint", version))

    def _unconfirmed_for_checkpoint(self) -> list[dict[str, Any]]:
        pending = dict(self._unconfirmed)
        task = self.inflight
        if task is not None:  # its outcome is unknown until it is applied
            f = task.fragment.index
            pending[f] = task.unconfirmed(self.states[f].version)
        return [{"fragment": f, **vars(u)} for f, u in pending.items()]

    def _finished(self) -> bool:
        target = self.cfg.run.max_outer_steps
        return self._target_loss_reached or self._swarm_gone or (target is not None and self.version >= target)

    def _linger(self) -> None:
        """Serve the final state while learners still training are behind us (bounded)."""
        deadline = time.monotonic() + self.cfg.run.linger_seconds
        while time.monotonic() < deadline and not self.stop.is_set():
            records = self.board.read()
            behind = [p for p, r in records.items()
                      if p != self.peer_id and r.status == "training" and r.version < self.version]
            if not behind:
                return
            self.stop.wait(1.0)

    def _end_of_outer_step(self, losses: list[float]) -> None:
        c, cfg = self.counters, self.cfg
        eval_due = (c.inner_steps // cfg.inner.steps_per_outer) % cfg.run.eval_every == 0
        busy = c.compute_seconds / max(1e-9, c.compute_seconds + c.wait_seconds)
        train_loss = sum(losses) / max(1, len(losses))
        self.log(f"outer step done | version {self.version} tokens {c.tokens} train_loss {train_loss:.4f} "
                 f"{f'eval_loss {self.evaluate():.4f} ' if eval_due else ''}compute {busy:.1%} sent "
                 f"{c.bytes_sent / 1e6:.3f} MB total global_tokens {min(s.tokens for s in self.states)} "
                 f"steps_merged {c.steps_merged:.0f}")
        target = cfg.run.stop_at_eval_loss
        if target is not None and eval_due:
            global_loss = self.evaluate(self.global_params())
            self._target_loss_reached = global_loss <= target
            self.log(f"global model eval_loss {global_loss:.4f} at version {self.version} (target {target:g}"
                     f"{': reached' if self._target_loss_reached else ''})")
        self._publish()
        self._checkpoint()

    def run(self) -> dict[str, Any]:
        self._status = "training"
        self._heartbeat_stop = threading.Event()
        heartbeat = self._heartbeat_thread = threading.Thread(
            target=self._heartbeat, daemon=True, name="progress-heartbeat"
        )
        try:
            self._setup()
            self._publish()
            heartbeat.start()
            self._catch_up()
            if self.counters.first_eval_loss is None:
                self.counters.first_eval_loss = self.evaluate()
                self.log(f"eval_loss {self.counters.first_eval_loss:.4f} before training")
            train_started = time.perf_counter()
            self._train()
            self.counters.train_seconds += time.perf_counter() - train_started
            if self._finished():
                self._status = "done"
                self._publish("done")
                self.log(f"reached version {self.version}; serving state to learners still behind")
                self._linger()
            return self.summary()
        finally:
            self._heartbeat_stop.set()
            self._shutdown()

    def _train(self) -> None:
        cfg, c = self.cfg, self.counters
        self._training = True
        losses: list[float] = []
        started_at = time.perf_counter()
        while not self.stop.is_set() and not self._finished():
            losses.append(self._inner_step())
            if self.inflight is not None and c.inner_steps >= self.inflight.apply_at:
                self._finish_round()
            self._poll_download()
            self._poll_detached()
            self._sync_due_fragments()
            if c.inner_steps % cfg.run.log_every == 0:
                rate = len(losses) / (time.perf_counter() - started_at)
                recent = losses[-cfg.run.log_every:]
                self.log(f"inner {c.inner_steps % cfg.inner.steps_per_outer or cfg.inner.steps_per_outer}/"
                         f"{cfg.inner.steps_per_outer} loss {sum(recent) / len(recent):.4f} ({rate:.1f} steps/s, "
                         f"lr {self.inner_opt.lr:.2e} at schedule step {self._lr_at})")
            if c.inner_steps % cfg.inner.steps_per_outer == 0:
                self._end_of_outer_step(losses)
                losses, started_at = [], time.perf_counter()
        if self.inflight is not None:
            self._finish_round()
        if self.detached is not None and self.detached.thread is not None:
            self.detached.thread.join(timeout=self.cfg.averaging.round_timeout)
            self._poll_detached()
        if self.download is not None and self.download.thread is not None:
            self.download.thread.join(timeout=self.cfg.averaging.next_chunk_timeout)
            self._poll_download()
        self._checkpoint()  # keeps inner steps taken since the last round
        if self.stop.is_set() and not self._finished():
            try:
                self._parting_rounds()
            finally:
                self._parting_until = 0.0  # over: anything still forming gives up now
            self._checkpoint()  # what the parting rounds merged or adopted
        self.writer.flush()

    def _leaving(self) -> bool:
        """Whether matchmaking and downloads should give up: we are leaving and the parting budget
        (``run.drain_seconds`` from the first look after the signal) is spent, or were told twice.
        A round already forming when the signal lands goes on within that budget: it is the
        parting round the others are meeting in."""
        if self.leave_now.is_set():
            return True
        if not self.stop.is_set():
            return False
        if self._parting_until is None:
            self._parting_until = time.monotonic() + (self.cfg.run.drain_seconds if self._training else 0.0)
        return time.monotonic() > self._parting_until

    def _parting_rounds(self) -> None:
        """Leaving on Ctrl+C or SIGTERM: hand the unmerged inner steps to the swarm before going.

        Each fragment holding steps not yet merged joins one more round, in the foreground: at its
        next slot on the clock schedule (where the others will be), at once and again until a group
        forms on the steps schedule, all within ``run.drain_seconds`` of the signal (an all-reduce
        under way at the deadline finishes first). A second signal cuts it short. The checkpoint
        was written just before, and each commit writes another, so a kill meanwhile loses nothing;
        without a live peer there is no one to hand the steps to and they stay in the checkpoint for
        a ``--resume``; nor while a late round still occupies the averager (it may hold them)."""
        cfg, c, target = self.cfg, self.counters, self.cfg.run.max_outer_steps
        budget = cfg.run.drain_seconds

        def open_(frag: Fragment) -> bool:
            return c.steps_since_merge[frag.index] > 0 and (target is None or
                                                           self.states[frag.index].version < target)

        todo = [frag for frag in self.fragments if open_(frag)]
        if budget <= 0 or not todo or self.leave_now.is_set():
            return
        if self._leaving():  # the round that was forming at the signal used the whole budget
            self.log("leaving: no time left for a parting round (run.drain_seconds); the unmerged steps stay in "
                     "the checkpoint")
            return
        if self.detached is not None:
            # The averager is still busy with it (until its all-reduce timeout); a round now would
            # queue behind it, past the budget, and might send the steps that round holds again.
            self.log("leaving: a late round is still running; the unmerged steps stay in the checkpoint")
            return
        if not any(p != self.peer_id and r.status == "training" for p, r in self._records(fresh=True).items()):
            self.log("leaving: no peer is training; the unmerged steps stay in the checkpoint")
            return
        assert self._parting_until is not None  # set by _leaving() above
        deadline = self._parting_until
        self.log(f"leaving: handing {max(c.steps_since_merge):.0f} unmerged inner steps to the swarm in a last round "
                 f"of {len(todo)} fragment(s), for at most {deadline - time.monotonic():.0f} s more (signal again to "
                 "leave now)")
        clock = self.clock
        if clock is not None:
            todo.sort(key=lambda frag: clock.next_slot(frag, get_dht_time()))
        for frag in todo:
            while not self.leave_now.is_set() and open_(frag):
                wait = 0.0 if clock is None else clock.next_slot(frag, get_dht_time()) - get_dht_time()
                if time.monotonic() + wait + cfg.averaging.matchmaking_time > deadline:
                    break
                if self.leave_now.wait(wait):
                    break
                if deadline - time.monotonic() > cfg.averaging.next_chunk_timeout:  # room for a download
                    try:
                        self._catch_up()
                    except LearnerError as e:  # the swarm has finished meanwhile
                        self.log(f"leaving: {e}", logging.WARNING)
                        return
                if not open_(frag):
                    break
                self._start_round(frag, background=False)
                if self._last_outcome is not None and self._last_outcome.committed:
                    break
                if clock is None and self.leave_now.wait(1.0):  # a round that failed at once: no busy loop
                    break
        left = sum(1 for frag in todo if open_(frag))
        self.log("leaving: " + (f"{left} fragment(s) not merged; their steps stay in the checkpoint" if left
                                else "every fragment's steps merged"))

    def summary(self) -> dict[str, Any]:
        c = self.counters
        return {
            "peer_id": self.peer_id,
            "shard": self.shard,
            "outer_steps": c.outer_steps,
            "rounds_failed": c.rounds_failed,
            "syncs": c.syncs,
            "merges": c.merges,
            "inner_steps": c.inner_steps,
            "steps_merged": c.steps_merged,
            "tokens": c.tokens,
            "bytes_sent": c.bytes_sent,
            "compute_seconds": c.compute_seconds,
            "train_seconds": c.train_seconds,
            "wait_seconds": c.wait_seconds,
            "download_seconds": c.download_seconds,
            "contributions_confirmed": c.contributions_confirmed,
            "first_eval_loss": c.first_eval_loss,
            "last_eval_loss": self.evaluate(self.global_params()),
            "version": self.version,
            "versions": [s.version for s in self.states],
            "global_tokens": min(s.tokens for s in self.states),
            "fragment_sha256": [s.sha256() for s in self.states],
            "global_state_sha256": whole_sha256(self.states),
        }

    def _shutdown(self) -> None:
        for task in (self.inflight, self.detached):
            if task is not None and task.thread is not None:
                task.thread.join(timeout=self.cfg.averaging.round_timeout + 5)
        if hasattr(self, "_heartbeat_thread") and self._heartbeat_thread.is_alive():
            self._heartbeat_thread.join(timeout=5)
        if hasattr(self, "board") and self._served is not None:
            self._publish("left")
        if hasattr(self, "averaging"):
            self.averaging.shutdown()
        if hasattr(self, "dht"):
            self.dht.shutdown()
        if hasattr(self, "writer"):
            self.writer.close(timeout=120)  # a snapshot still waiting is written before the lock goes
        if hasattr(self, "_dir_lock"):
            self._dir_lock.release()


def _parse_downloaded(
    meta: Any, tensors: list[torch.Tensor], current: list[GlobalState], fragments: Sequence[int] | None = None
) -> tuple[dict[int, GlobalState], str]:
    """Per-fragment states from a peer's download, each verified against its advertised hash.

    ``fragments``: the fragments whose tensors the download holds (all when None); the metadata
    always describes every fragment.
    """
    if not isinstance(meta, dict):
        return {}, "metadata is not a map"
    p = len(current)
    wanted = list(range(p)) if fragments is None else list(fragments)
    for key, typ in (("versions", int), ("shas", str), ("momentum_initialized", bool), ("tokens", int),
                     ("histories", list)):
        value = meta.get(key)
        if not isinstance(value, list) or len(value) != p or not all(isinstance(v, typ) for v in value):
            return {}, f"metadata field {key} missing or malformed"
    expected = [t for f in wanted for t in current[f].tensors()]
    if len(tensors) != len(expected):
        return {}, f"expected {len(expected)} tensors, got {len(tensors)}"
    for t, ref in zip(tensors, expected, strict=True):
        if t.shape != ref.shape:
            return {}, f"tensor of shape {tuple(t.shape)} where {tuple(ref.shape)} was expected"
        if not torch.isfinite(t).all():
            return {}, "tensor holds NaN or Inf"
    states, start = {}, 0
    for f in wanted:
        n = len(current[f].params)
        chunk = [t.float().clone() for t in tensors[start:start + 2 * n]]
        start += 2 * n
        version, init = meta["versions"][f], meta["momentum_initialized"][f]
        if state_sha256(chunk, version, init, meta["tokens"][f]) != meta["shas"][f]:
            return {}, f"hash of fragment {f} does not match the advertised sha256"
        history = meta["histories"][f]
        if not (isinstance(history, list) and len(history) <= 2 * HISTORY_LENGTH and all(
            isinstance(h, list) and len(h) == 2 and isinstance(h[0], int) and isinstance(h[1], str) for h in history
        )):
            return {}, f"history of fragment {f} is malformed"
        contributors = meta.get("contributors", [[]] * p)
        contributors = contributors[f] if isinstance(contributors, list) and len(contributors) == p else None
        if not (isinstance(contributors, list) and len(contributors) <= 4 * CONTRIBUTOR_VERSIONS and all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], int) and isinstance(e[1], list)
            and all(isinstance(peer, str) for peer in e[1]) for e in contributors
        )):
            return {}, f"contributors of fragment {f} are malformed"
        states[f] = GlobalState(params=chunk[:n], momentum=chunk[n:], version=version,
                                momentum_initialized=init, tokens=meta["tokens"][f],
                                history=[(v, h) for v, h in history],
                                contributors=[(v, tuple(peers)) for v, peers in contributors])
    return states, ""


def write_summary(path: str | Path, summary: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(path)
