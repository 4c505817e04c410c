"""Start-up of a learner: checkpoint directory, DHT, lineage id, data, model, restore (:mod:`.resume`), averager.

The DHT's process (and its p2pd) boots and joins the swarm while this process reads its data and
builds the model and optimizer: a restart pays the longer of the two, not both. While the rest of the
set-up waits on the network, the learner gets a head start (:mod:`p2p_diloco.learner.head_start`): its first
eval and, resumed from a checkpoint, inner steps. Whatever was started before a failure is shut down
again before the error reaches the caller.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from p2p_diloco import STARTED, __version__, peer_log
from p2p_diloco.config import ConfigError, LearnerConfig, NetworkConfig
from p2p_diloco.core.fragments import ClockSchedule, build_fragments
from p2p_diloco.core.grace import GraceWindow
from p2p_diloco.core.outer import GlobalState, OuterOptimizer, state_sha256
from p2p_diloco.core.pace import Pace
from p2p_diloco.core.state_layout import ServedState, parameter_indices
from p2p_diloco.errors import LearnerError
from p2p_diloco.hooks import NO_FAULTS, FaultHooks
from p2p_diloco.learner.audit import Audit
from p2p_diloco.learner.catch_up import CatchUp
from p2p_diloco.learner.head_start import HeadStart
from p2p_diloco.learner.metrics import Metrics, first_address, resources
from p2p_diloco.learner.parting import Leaving
from p2p_diloco.learner.progress import Progress
from p2p_diloco.learner.resume import LOCAL_MODEL_FIELDS, check_compatible, restore
from p2p_diloco.learner.schedule import Rounds
from p2p_diloco.learner.state import LearnerState
from p2p_diloco.net.averaging import HivemindAveraging, averaging_prefix
from p2p_diloco.net.dht import LinkedDHT, start_dht, wait_until_joined
from p2p_diloco.net.progress_records import LineageIndex, ProgressBoard
from p2p_diloco.net.reach import CLIENT, DIRECT, Reach, serve_checks
from p2p_diloco.net.reach import check as check_reach
from p2p_diloco.net.traffic import read_traffic
from p2p_diloco.train.checkpoint import (
    CheckpointWriter,
    claim_checkpoint_dir,
    load_checkpoint,
    save_model_files,
)
from p2p_diloco.train.data.batches import BatchSampler, DataError, fixed_eval_batches, load_splits, shard_for_peer
from p2p_diloco.train.data.tokenizer import Tokenizer, load_tokenizer
from p2p_diloco.train.models.registry import build_model, embedding_names, model_config_json, named_shapes, vocab_size
from p2p_diloco.train.trainer import Trainer, resolve_placement
from p2p_diloco.trust.admission import Admission, admit_self, peer_id_of
from p2p_diloco.trust.certificates import Verifier
from p2p_diloco.trust.commit_board import CommitBoard
from p2p_diloco.trust.signed_records import IdentityKey

logger = logging.getLogger(__name__)

def lineage_id(cfg: LearnerConfig, model_files: dict[str, str] | None = None, tokenizer: str = "bytes") -> str:
    """Hash of the settings that must agree for two learners to share one lineage of the model.

    Learners whose settings differ (model, seed, outer optimizer, fragments, codecs, merging rules)
    would produce different states from the same round; they use different DHT keys and never meet.
    ``model_files`` (from :func:`build`) covers a Hugging Face model: its config.json and a hash of its
    initial weights, which files or the transformers version may change under one seed. None for the
    built-in model, whose Θ₀ the config and seed fix: its lineage id is what it was before HF models.
    ``tokenizer``: the tokenizer's fingerprint (learners that cut text into different tokens train
    different models); bytes, the default, adds nothing.
    """
    keys = {
        "model": cfg.model.model_dump(exclude=LOCAL_MODEL_FIELDS),
        "outer": cfg.outer.model_dump(exclude={"short_rounds", "long_rounds"}),
        "seed": cfg.run.seed,
        "fragments": cfg.sync.fragments, "codecs": [cfg.codec_for(f) for f in range(cfg.sync.fragments)],
        "weighting": cfg.sync.weighting, "rda": cfg.sync.rda, "max_delta_norm": cfg.averaging.max_delta_norm,
        "steps_per_outer": cfg.inner.steps_per_outer, "schedule": cfg.sync.schedule,
        "period": cfg.sync.period_seconds if cfg.sync.schedule == "clock" else None,
    }
    if cfg.sync.pace != "fixed":  # learners that agree on the period among themselves (same remark as below)
        keys["pace"] = cfg.sync.pace
    if cfg.averaging.quorum != "fixed":  # a rule every member of a group applies alike (the fixed quorum's
        keys["quorum"] = cfg.averaging.quorum  # lineages keep the ids they had before the setting)
    if cfg.averaging.established_after:  # weights ramp by it: a group must agree (lineages without the rule
        keys["established_after"] = cfg.averaging.established_after  # keep the ids they had)
    if cfg.outer.short_rounds != "full":  # a different outer step (lineages of full steps keep their ids)
        keys["short_rounds"] = cfg.outer.short_rounds
    if cfg.outer.long_rounds != "full":
        keys["long_rounds"] = cfg.outer.long_rounds
    if model_files is not None:
        keys["model_files"] = model_files
    if tokenizer != "bytes":
        keys["tokenizer"] = tokenizer
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:8]


@dataclass
class LocalData:
    """This learner's data: its shard index, a batch sampler over the shard, and the fixed eval batches."""
    shard: int
    sampler: BatchSampler
    eval_batches: list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Parts:
    """Everything a running learner is made of, built by :func:`set_up`; :meth:`close` shuts it down."""

    ckpt_dir: Path
    dht: LinkedDHT
    lineage: str
    data: LocalData
    trainer: Trainer
    state: LearnerState
    progress: Progress
    averaging: HivemindAveraging
    catch_up: CatchUp
    rounds: Rounds
    writer: CheckpointWriter
    closer: contextlib.ExitStack
    metrics: Metrics = field(default_factory=Metrics)
    audit: Audit = field(default_factory=Audit.disabled)

    def close(self) -> None:
        """Shut down everything :func:`set_up` started, in reverse order."""
        self.closer.close()


def load_data(cfg: LearnerConfig, shard: int, tokenizer: Tokenizer) -> LocalData:
    """Shard ``shard`` and the eval split as token ids, read in one pass; DataError if either holds at most
    ``seq_len + 1`` tokens."""
    splits = load_splits(cfg.data, [shard, None], tokenizer, min_tokens=cfg.model.seq_len + 2)
    train, evaluation = splits[shard], splits[None]
    if min(len(train), len(evaluation)) <= cfg.model.seq_len + 1:
        raise DataError(f"data shard or eval split is shorter than model.seq_len ({cfg.model.seq_len})")
    if tokenizer.kind == "bytes":
        logger.info(f"shard {shard} holds {len(train) / 1e6:.2f} MB, eval split {len(evaluation) / 1e6:.2f} MB")
    else:
        logger.info(f"shard {shard} holds {len(train):,} tokens, eval split {len(evaluation):,} tokens")
    sampler = BatchSampler(train, cfg.model.seq_len, cfg.inner.batch_size, seed=cfg.run.seed * 7919 + shard)
    return LocalData(shard, sampler,
                     fixed_eval_batches(evaluation, cfg.model.seq_len, cfg.inner.batch_size, cfg.data.eval_batches))


def build(cfg: LearnerConfig, tokenizer: Tokenizer | None = None,
          faults: FaultHooks = NO_FAULTS) -> tuple[Trainer, LearnerState]:
    """Model (placed on ``run.device``), fragments, global state and trainer, from the config alone: no network.
    ``faults`` reach the state it serves to peers (a test's ``serve`` faults and ``lie ... with state``)."""
    placement = resolve_placement(cfg.run)  # a device this machine lacks is refused before any work
    model = build_model(cfg.model, cfg.run.seed)
    tokenizer = tokenizer or load_tokenizer(cfg.data.tokenizer)
    tokens = tokenizer.vocab_size  # ids at or above the model's vocabulary cannot embed
    if tokens > vocab_size(model):
        raise ConfigError(f"data.tokenizer has {tokens} tokens, more than the model's vocabulary of "
                          f"{vocab_size(model)}: use a tokenizer that fits or a model with a larger vocab_size")
    try:
        fragments = build_fragments(named_shapes(model), cfg.sync.fragments, cfg.inner.steps_per_outer,
                                    embedding_names(model))
    except ValueError as e:
        raise LearnerError(f"sync.fragments: {e}") from None
    whole = GlobalState.from_module(model)
    # Hashed before any checkpoint is restored: the lineage is named by where it started.
    config_json = model_config_json(model)
    model_files = None if config_json is None else {
        "config": config_json, "init_sha256": state_sha256(whole.params, version=0, momentum_initialized=False)}
    states = [GlobalState(params=[whole.params[i] for i in f.tensor_indices],
                          momentum=[whole.momentum[i] for i in f.tensor_indices]) for f in fragments]
    for s in states:
        s.remember()
    trainer = Trainer(model, cfg, placement, model_files)  # moves the model to the device
    state = LearnerState(fragments=fragments, states=states, params=trainer.params,
                         pin_memory=placement.pin_memory, served=ServedState(faults))
    state.counters.resize(len(fragments))
    return trainer, state


# Given the trainer, state and data once they are built, and whether a checkpoint was restored into
# them: the work to do while the DHT joins (None: none).
HeadStarter = Callable[[Trainer, LearnerState, LocalData, bool], "HeadStart | None"]


def set_up(cfg: LearnerConfig, faults: FaultHooks, leaving: Leaving, on_commit: Callable[[], None],
           head_start: HeadStarter | None = None) -> Parts:
    """Start every part of a learner; on failure, shut down what was started and raise. ``head_start``
    makes the work that runs while the network part of the set-up waits; it has ended when this returns."""
    closer = contextlib.ExitStack()
    heads: list[HeadStart] = []

    def started(*args: Any) -> HeadStart | None:
        head = head_start(*args) if head_start is not None else None
        heads.extend([head] if head is not None else [])
        return head

    try:
        return _set_up(cfg, faults, leaving, on_commit, closer, started)
    except BaseException:
        for head in heads:  # no step runs while the rest shuts down
            head.stop()
        closer.close()
        raise


@dataclass
class _Local:
    """What start-up has before the network: what it read (checkpoint directory, identity, allow-list, the
    checkpoint itself) and the parts it built from them, each whole."""
    ckpt_dir: Path
    admission: Admission
    identity: Path
    key: IdentityKey
    metrics: Metrics
    payload: dict[str, Any] | None
    data: LocalData
    trainer: Trainer
    state: LearnerState
    tokenizer: Tokenizer
    clock: ClockSchedule | None


def _set_up(cfg: LearnerConfig, faults: FaultHooks, leaving: Leaving, on_commit: Callable[[], None],
            closer: contextlib.ExitStack, head_start: HeadStarter) -> Parts:
    began = time.monotonic()
    torch.set_num_threads(cfg.run.threads)
    tokenizer = refuse_bad_input(cfg)
    admission = Admission.from_file(cfg.network.allowed_peers)
    ckpt_dir, dir_lock = claim_checkpoint_dir(cfg.run.checkpoint_dir)
    closer.callback(dir_lock.release)
    metrics = Metrics()
    if cfg.run.metrics_port is not None:  # before the DHT: a port in use is refused at once
        closer.callback(metrics.serve(cfg.run.metrics_port))
    payload = load_checkpoint(ckpt_dir) if cfg.run.resume else None
    if payload is not None:
        check_compatible(cfg, payload, ckpt_dir)
    save_model_files(ckpt_dir, cfg.model.path, tokenizer.path)  # so an export needs nothing but the directory
    identity = ckpt_dir / "identity.key"
    peer_id_of(identity)  # made here if missing: it signs our records from the DHT's start on
    admit_self(admission, identity)
    key = IdentityKey.load(identity)  # signs records, commits and the audit log
    start = functools.partial(_start_dht, cfg.network, identity, admission, key)
    dhts = [start(wait=False, client_mode=cfg.network.client_mode is True)]
    closer.callback(lambda: dhts[-1].shutdown())  # the one running: a client's DHT is started again
    local_work = time.monotonic()
    local = _build_local(cfg, faults, tokenizer, admission, ckpt_dir, identity, key, metrics, payload)
    local_work = time.monotonic() - local_work
    head = head_start(local.trainer, local.state, local.data, payload is not None)
    pause = head.paused if head is not None else contextlib.nullcontext
    if head is not None:
        head.start()  # set_up stops it on a failure below
    steps_before = local.state.counters.inner_steps

    def start_paused(wait: bool = True, **kwargs: Any) -> LinkedDHT:
        with pause():  # the fork copies no step under way; the wait for the join need not hold the steps
            dht = start(wait=False, **kwargs)
        if wait:
            wait_until_joined(dht)
        return dht

    waited = time.monotonic()
    dht, reach = _reach(cfg.network, dhts, start_paused)
    lineage, audit, progress = _join(cfg, dht, reach, local, faults, began, closer)
    closer.callback(progress.publish, "left")  # from here on peers see us: say when we are gone
    closer.callback(progress.stop)
    waited = time.monotonic() - waited
    averager = time.monotonic()
    with pause():  # its process forks
        averaging = _start_averaging(cfg, dht, lineage, local, progress, leaving, faults, reach.client)
    closer.callback(averaging.shutdown)
    # Started after hivemind forked its DHT and averager processes, so no fork sees it mid-write.
    writer = CheckpointWriter(ckpt_dir)
    closer.callback(writer.close, timeout=120)  # a snapshot still waiting is written before the lock goes
    catch_up, rounds = _rounds(cfg, dht, lineage, local, audit, progress, averaging, leaving, faults,
                               on_commit if cfg.run.checkpoint_on_commit else (lambda: None))
    if head is not None:
        head.finish()  # raises what the head start's work raised
    now = time.monotonic()
    logger.info(f"set up in {now - began:.1f} s after {began - STARTED:.1f} s of imports: data, model and "
                f"optimizer {local_work:.1f} s, then {waited:.1f} s more for the DHT; averager {now - averager:.1f} s; "
                f"{local.state.counters.inner_steps - steps_before} inner step(s) meanwhile")
    return Parts(ckpt_dir, dht, lineage, local.data, local.trainer, local.state, progress, averaging, catch_up,
                 rounds, writer, closer, metrics, audit)


def _start_dht(net: NetworkConfig, identity: Path, admission: Admission, key: IdentityKey, wait: bool,
               client_mode: bool) -> LinkedDHT:
    return start_dht(initial_peers=net.initial_peers, host_maddrs=net.host_maddrs,
                     announce_maddrs=net.announce_maddrs, identity_path=identity,
                     startup_timeout=net.startup_timeout, admission=admission, signing=key,
                     use_relay=net.use_relay, use_auto_relay=net.use_auto_relay, wait=wait, client_mode=client_mode,
                     replica_reads_after=net.record_ttl if net.replica_reads else None)


def _build_local(cfg: LearnerConfig, faults: FaultHooks, tokenizer: Tokenizer, admission: Admission, ckpt_dir: Path,
                 identity: Path, key: IdentityKey, metrics: Metrics, payload: dict[str, Any] | None) -> _Local:
    """Model, state (restored from ``payload`` if any), data and clock, while the DHT joins."""
    shard = cfg.data.shard_index
    if shard is None:  # the DHT's peer ID is our identity's
        shard = shard_for_peer(PeerID.from_base58(peer_id_of(identity)).to_bytes(), cfg.data.num_shards)
    data = load_data(cfg, shard, tokenizer)
    trainer, state = build(cfg, tokenizer, faults)
    # The clock starts at the next slot of each fragment: made before the DHT wait, as slots open meanwhile.
    clock = (ClockSchedule(state.fragments, cfg.sync.period_seconds, get_dht_time())
             if cfg.sync.schedule == "clock" else None)
    peer_log.set_position(lambda: (state.counters.inner_steps, state.version))
    if payload is not None:  # the sampler goes on from the batches drawn before the restart
        cursor = restore(payload, trainer, state, ckpt_dir)
        data = dataclasses.replace(data, sampler=dataclasses.replace(data.sampler, cursor=cursor))
    state.refresh_served()
    return _Local(ckpt_dir, admission, identity, key, metrics, payload, data, trainer, state, tokenizer, clock)


def _pace(cfg: LearnerConfig) -> Pace | None:
    if cfg.sync.pace != "auto":
        return None
    return Pace(cfg.sync.period_seconds, floor=pace_floor(cfg), fragments=cfg.sync.fragments,
                steps_per_outer=cfg.inner.steps_per_outer, lead=cfg.network.record_ttl,
                max_overlap=cfg.sync.overlap_steps or None)


def _rounds(cfg: LearnerConfig, dht: LinkedDHT, lineage: str, local: _Local, audit: Audit, progress: Progress,
            averaging: HivemindAveraging, leaving: Leaving, faults: FaultHooks,
            after_merge: Callable[[], None]) -> tuple[CatchUp, Rounds]:
    """The round schedule and catch-up; ``after_merge`` runs after a commit or a state taken from peers."""
    def established(fragment: int) -> frozenset[str] | None:  # whose signatures count (trust/certificates.py)
        return progress.counting(local.state.established(cfg.averaging.established_after,
                                                         cfg.averaging.min_group_size, fragment))

    board = CommitBoard(dht, lineage, local.key, cfg.averaging.min_group_size, timeout=cfg.averaging.certify_timeout,
                        round_quorum=averaging.round_quorum, established=established)
    verifier = Verifier(lineage, cfg.averaging.min_group_size, local.admission.allowed, averaging.round_quorum,
                        established=established)
    catch_up = CatchUp(cfg, local.state, averaging, progress, should_stop=leaving, verifier=verifier,
                       certifier=board, audit=audit, on_adopt=after_merge)
    grace = GraceWindow(cfg.sync.overlap_steps, cfg.sync.grace_gamma, cfg.averaging.matchmaking_time,
                        min(cfg.sync.max_grace, cfg.averaging.round_timeout / 2))
    rounds = Rounds(cfg, local.state, averaging, OuterOptimizer(cfg.outer), grace, local.clock, catch_up, progress,
                    after_merge, certifier=board, metrics=local.metrics, audit=audit, pace=progress.pace,
                    faults=faults)
    return catch_up, rounds


def _established(cfg: LearnerConfig, state: LearnerState) -> Callable[[], frozenset[str] | None]:
    """Who is established by every fragment's standing (:mod:`p2p_diloco.core.standing`): the quorum's base."""
    return functools.partial(state.established, cfg.averaging.established_after, cfg.averaging.min_group_size)


def pace_floor(cfg: LearnerConfig) -> float:
    """The shortest period sync.pace = auto chooses: a slot per fragment of twice the matchmaking time."""
    return 2.0 * cfg.sync.fragments * cfg.averaging.matchmaking_time


def refuse_bad_input(cfg: LearnerConfig) -> Tokenizer:
    """Refuse what the user can fix (a device this machine lacks, a tokenizer or model directory that
    does not load) before the DHT and its p2pd start; returns the loaded tokenizer."""
    resolve_placement(cfg.run)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if cfg.model.path is not None:
        from p2p_diloco.train.models.hf import read_config_json  # transformers: only for Hugging Face models

        read_config_json(cfg.model.path)
    return tokenizer


def _start_averaging(cfg: LearnerConfig, dht: LinkedDHT, lineage: str, local: _Local, progress: Progress,
                     leaving: Leaving, faults: FaultHooks, client: bool) -> HivemindAveraging:
    state = local.state
    averaging = HivemindAveraging(
        dht, [t for s in state.states for t in s.params], cfg.averaging, prefix=averaging_prefix(lineage),
        state_provider=state.served, newest_version=progress.newest_live_version, should_stop=leaving,
        training_learners=progress.training_learners, everyone_training=progress.everyone_training,
        early_close_after=cfg.network.record_ttl,
        established_training=progress.established_training,
        fragments=parameter_indices([len(s.params) for s in state.states]),
        codecs=[cfg.codec_for(f.index) for f in state.fragments], faults=faults, client_mode=client,
        step_tokens=cfg.inner.batch_size * cfg.model.seq_len * local.trainer.workers,
        limits=cfg.contribution_limits,
        on_received=state.counters.count_received, on_matchmaking=local.metrics.matchmaking,
    ).start()
    averaging.set_state_priority(state.version)
    return averaging


# The words of a start that reached none of the initial peers: p2pd's (none could be dialled: not up yet, say) and
# hivemind's (none answered the DHT's first pings in time, hivemind.dht.node's DHTNode.create)
NO_PEER_ANSWERED = ("failed to connect to bootstrap peers", "none of the initial_peers responded")
JOIN_ATTEMPTS = 4  # starts of the DHT while no initial peer answers (docs/configuration.md, network.initial_peers)
JOIN_BACKOFF = 5.0  # seconds before the second start; twice that before the third, ...; jittered by ±50%


def join_dht(dhts: list[LinkedDHT], start: Callable[[], LinkedDHT], attempts: int = JOIN_ATTEMPTS,
             backoff: float = JOIN_BACKOFF, sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait for ``dhts[-1]`` to join the swarm; while none of the initial peers answers its pings, start the DHT
    again (``start``, appended to ``dhts``) after a jittered backoff, ``attempts`` starts in all, then raise the
    last one-line error. A bootstrap node swamped by many joins at once answers late: 24 of 32 learners started
    together on 2 cores stopped with that error (scale_swarm.py); one not up yet cannot be dialled
    until it is."""
    for attempt in range(1, attempts + 1):
        try:
            wait_until_joined(dhts[-1])
            return
        except LearnerError as e:
            if attempt == attempts or not any(words in str(e) for words in NO_PEER_ANSWERED):
                raise
            wait = backoff * attempt * random.uniform(0.5, 1.5)
            logger.warning(f"no initial peer answered (start {attempt} of {attempts} of the DHT); starting it again "
                           f"in {wait:.0f} s")
        with contextlib.suppress(Exception):
            dhts[-1].shutdown()  # its process has given up already
        sleep(wait)
        dhts.append(start())


def _reach(net: NetworkConfig, dhts: list[LinkedDHT], start: Callable[..., LinkedDHT]) -> tuple[LinkedDHT, Reach]:
    """Whether peers can dial us (p2p_diloco.net.reach), decided once the DHT has joined; a learner they cannot
    dial starts its DHT again in client mode (``dhts`` gets the new one). One log line says which."""
    join_dht(dhts, functools.partial(start, wait=False, client_mode=net.client_mode is True))
    dht = dhts[-1]
    if net.client_mode is True:
        found = Reach(CLIENT, "network.client_mode = true")
    elif net.client_mode is False:
        found = Reach(DIRECT, "network.client_mode = false, not checked")
    else:
        found = check_reach(dht, net.initial_peers, relay_wait=30.0 if net.use_auto_relay else 0.0)
    if found.dht_client and not dht.client_mode:
        dht.shutdown()
        dhts.append(start(wait=True, client_mode=True))
        dht = dhts[-1]
    if not found.client:
        serve_checks(dht)  # we can be dialled: answer others' questions
    logger.info(f"reachable: {found.mode} ({found.how})" + (
        "; averaging as a client: sends its part and receives the results, never reduces or serves state"
        if found.client else ""))
    return dht, found


def _join(cfg: LearnerConfig, dht: LinkedDHT, reach: Reach, local: _Local, faults: FaultHooks,
          began: float, closer: contextlib.ExitStack) -> tuple[str, Audit, Progress]:
    """Our lineage, audit log and progress records, announced; after :func:`_reach` (which waited for the DHT
    to join). The audit log is closed by ``closer``, after everything registered later has stopped."""
    state, metrics, payload = local.state, local.metrics, local.payload
    state.peer_id = str(dht.peer_id)
    peer_log.set_peer(state.peer_id[-6:])
    logger.info(f"joined DHT; visible at {[str(a) for a in dht.get_visible_maddrs()]}")
    lineage = f"{cfg.network.run_id}-{lineage_id(cfg, local.trainer.model_files, local.tokenizer.fingerprint)}"
    logger.info(f"lineage {lineage} (learners only meet others with the same run id and lineage settings)")
    ttl, run_id = cfg.network.record_ttl, cfg.network.run_id
    index = LineageIndex(dht, run_id, ttl, dht.owner)  # lets `p2p-diloco status` find our lineage
    logger.info(f"checkpoints in {local.ckpt_dir}; data shard {local.data.shard}/{cfg.data.num_shards}")
    audit = Audit.open(local.ckpt_dir, local.key, state.peer_id, cfg.run.audit_sign_every,
                       on_record=metrics.audited, lineage=lineage, shard=local.data.shard, versions=state.versions,
                       checkpoint=payload is not None)
    closer.callback(audit.close)  # after the rounds, averager and writer have stopped: a signed head, fsynced
    address = first_address(dht)  # for `status`; peers find us through the DHT anyway
    progress = Progress(
        ProgressBoard(dht, lineage, ttl, dht.owner, index, local.admission.lists if local.admission.private else None),
        state, ttl, client=reach.client,
        resources=lambda: resources(local.trainer, state.counters, began, metrics, reach.record_value, address),
        audit=audit, metrics=metrics, traffic=functools.partial(read_traffic, dht), pace=_pace(cfg), faults=faults,
        established=_established(cfg, state), floor=cfg.averaging.min_group_size,
    )
    # Announce ourselves at once, before the download, so that learners finishing the run see a
    # newcomer behind them and keep serving state until it has caught up.
    progress.announce(min(g["version"] for g in payload["global"]) if payload is not None else 0)
    metrics.describe(run_id=cfg.network.run_id, lineage=lineage, peer_id=state.peer_id, version=__version__,
                     codec=",".join(sorted({cfg.codec_for(f) for f in range(cfg.sync.fragments)})))
    logger.info(f"{len(state.fragments)} fragment(s) of {[f.numel for f in state.fragments]} values; overlap τ = "
                + ("measured (sync.pace = auto)" if cfg.sync.pace == "auto" else f"{cfg.sync.overlap_steps} steps")
                + f"; quorum K = {cfg.averaging.min_group_size}"
                + (", and a majority of the learners training" if cfg.averaging.quorum == "majority" else ""))
    return lineage, audit, progress
