"""A learner unit of several workers: ``torchrun --nproc-per-node N -m p2p_diloco learner ...``.

The N workers (``--nnodes`` machines of one site times ``--nproc-per-node``) are one learner of the
swarm. Each trains the same model on its own part of the unit's shard (:func:`part_of_shard`), in
DDP (``run.sharding=ddp``, the default: every worker holds the whole model) or sharded with FSDP2
(``run.sharding=fsdp``: each holds 1/N of θ, its gradients and optimizer state; :mod:`p2p_diloco.train.sharding`).
Either way the gradients are averaged over the workers, so all take the same inner step.
Only rank 0 is a swarm peer: DHT, averager, progress records, checkpoints, signals, catch-up and the
parting rounds are its alone (:mod:`p2p_diloco.learner.unit.rank0`, hooks of :class:`p2p_diloco.learner.loop.Learner`).
The other ranks run a lean loop without any of that (:mod:`p2p_diloco.learner.unit.follower`).

The protocol, all broadcasts from rank 0 (:class:`UnitGroup`):

- at start, the :class:`Start` (shard, sampler cursor, lr schedule position, step count, which
  inner-optimizer entries exist), then the model (the restored θ, when rank 0 resumed a checkpoint:
  DDP's own broadcast, or ours before sharding), then the inner optimizer's moments;
- before every inner step, a :class:`Word`: another step or the end, the global version and lr
  schedule position that step uses, and which fragments' θ rank 0 changed since the last word (a
  round's result applied, a download adopted or rebased onto: ``LearnerState.changed``), followed by
  those fragments' parameters (sharded: in full, each worker keeping its chunk). The last word
  comes after rank 0's parting rounds;
- sharded only, between two steps: a gather word, whenever rank 0 is about to read θ (a round's
  snapshot, applying a result, an eval, a checkpoint): every worker takes part in the all-gather of
  the fragments named (and of the optimizer's moments, for a checkpoint) into rank 0's host copy of θ,
  then waits for the next word.

A stop (Ctrl+C or SIGTERM to torchrun, which signals each worker's process group) is rank 0's
decision: it hands its unmerged steps over in parting rounds as any learner does, its hivemind
helpers being in process groups of their own (:func:`join`); the others ignore the signals and leave
at its last word. A dead worker makes the next collective fail on every other rank: each ends with
one :class:`UnitBroken` line and a non-zero exit, and ``torchrun --max-restarts`` starts the unit
again (rank 0 resumes from its checkpoint with ``--resume``).

Backends: gloo on CPUs, nccl on CUDA GPUs (each worker takes ``cuda:LOCAL_RANK``). Only gloo with
workers on one machine is tested here.

Example (what the CLI does under torchrun; :func:`p2p_diloco.learner.unit.launch.run_unit`)::

    group = join(Topology.from_env(), cfg.run)
    learner = Learner(cfg, unit=Leader(group))       # rank 0 (leader.py); the others: follow(cfg, group)
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import re
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from p2p_diloco.config import RunConfig
from p2p_diloco.core.inner_optim import AdamW
from p2p_diloco.errors import LearnerError
from p2p_diloco.learner.state import LearnerState
from p2p_diloco.train.data.batches import BatchSampler, DataError
from p2p_diloco.train.sharding import ShardedModel
from p2p_diloco.train.trainer import Trainer, resolve_device

logger = logging.getLogger(__name__)

# A directory: every rank appends "inner_steps version sha256-of-its-parameters" to rank-R.txt there
# whenever rank 0 sends changed fragments (tests compare the ranks' files).
HASHES_ENV = "P2P_DILOCO_UNIT_HASHES"
_PR_SET_PDEATHSIG = 1


class UnitBroken(RuntimeError):
    """A collective of the unit failed: a worker is gone (or failed mid-step), so the unit ends."""


@dataclass(frozen=True)
class Topology:
    """Where this worker stands in its unit, from torchrun's environment."""

    rank: int
    workers: int
    local_rank: int
    nodes: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Topology | None:
        """The unit torchrun started this process in; None for a plain process (or a unit of one)."""
        env = os.environ if env is None else env
        workers = int(env.get("WORLD_SIZE", "1"))
        if workers <= 1:
            return None
        per_node = int(env.get("LOCAL_WORLD_SIZE", str(workers)))
        return cls(int(env["RANK"]), workers, int(env.get("LOCAL_RANK", "0")), max(1, workers // per_node))


@dataclass
class Start:
    """What rank 0 tells the others before training: where to read, where the schedule stands, and
    the inner-optimizer steps of the parameters that have optimizer state (their moments follow)."""

    shard: int
    cursor: int
    lr_position: list[int]
    version: int
    inner_steps: int
    optimizer_steps: dict[int, float]


# What a control word asks of every worker (its first entry).
END, STEP, GATHER, GATHER_ALL = 0, 1, 2, 3


@dataclass(frozen=True)
class Word:
    """The control word before each inner step, or between two: its ``kind`` (:data:`STEP`: another
    step follows; :data:`END`: the unit ends; :data:`GATHER`: every worker takes part in gathering the
    ``fragments``' θ into rank 0's host copy, :data:`GATHER_ALL` the inner optimizer's moments too,
    then waits for the next word; sharded units only), the version and lr schedule position that step
    uses, and the fragments: whose θ rank 0 changed (it follows; STEP, END) or to gather."""

    kind: int
    version: int
    lr_position: tuple[int, int]
    fragments: tuple[int, ...]

    @property
    def go(self) -> bool:
        """Another inner step follows."""
        return self.kind == STEP

    @property
    def gathers(self) -> bool:
        """A gather, not a step or the end."""
        return self.kind in (GATHER, GATHER_ALL)

    def encode(self, fragments: int, device: torch.device) -> torch.Tensor:
        """One int64 tensor of ``4 + fragments`` entries (a flag per fragment)."""
        flags = [1 if f in self.fragments else 0 for f in range(fragments)]
        return torch.tensor([self.kind, self.version, *self.lr_position, *flags], dtype=torch.int64, device=device)

    @classmethod
    def decode(cls, t: torch.Tensor) -> Word:
        """The word :meth:`encode` made."""
        v = [int(x) for x in t.tolist()]
        return cls(v[0], v[1], (v[2], v[3]), tuple(f for f, flag in enumerate(v[4:]) if flag))


def part_of_shard(sampler: BatchSampler, rank: int, workers: int) -> BatchSampler:
    """Worker ``rank``'s part of the unit's shard: the rank-th of ``workers`` contiguous slices (a window
    may run ``seq_len`` tokens past its end), with its own seed, at the same cursor. DataError when a
    part cannot hold a window."""
    n, window = len(sampler.data), sampler.seq_len + 1
    if n // workers <= window:  # the same test on every rank: rank 0's check speaks for all
        raise DataError(f"the shard holds {n} tokens: too few for {workers} workers' windows of {window}; "
                        "give more text, lower data.num_shards or use fewer workers")
    lo, hi = rank * n // workers, min(n, (rank + 1) * n // workers + window)
    return BatchSampler(sampler.data[lo:hi], sampler.seq_len, sampler.batch_size,
                        seed=sampler.seed + rank * 1_000_033, cursor=sampler.cursor)


def fragment_params(state: LearnerState, fragments: Sequence[int]) -> list[torch.Tensor]:
    """θ of ``fragments``, in fragment then tensor order (the order their broadcasts go in)."""
    return [t for f in fragments for t in state.local(state.fragments[f])]


def fragment_indices(state: LearnerState, fragments: Sequence[int]) -> list[int]:
    """The parameter indices of ``fragments``, in fragment then tensor order."""
    return [i for f in fragments for i in state.fragments[f].tensor_indices]


def params_sha256(params: Sequence[torch.Tensor]) -> str:
    """A hash of the parameters' bytes (equal on ranks that hold the same weights)."""
    h = hashlib.sha256()
    for t in params:
        h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class UnitGroup:
    """The unit's process group, seen from one worker: the broadcasts of the protocol (module docstring)."""

    def __init__(self, topology: Topology, device: torch.device, backend: str, hashes: Path | None = None,
                 sharding: str = "ddp"):
        self.topology, self.device, self.backend, self.hashes = topology, device, backend, hashes
        self.rank, self.workers, self.sharding = topology.rank, topology.workers, sharding

    def describe(self) -> str:
        """``2 workers (gloo, 1 node)``; ``2 workers (gloo, 1 node, fsdp)`` when the model is sharded."""
        t = self.topology
        fsdp = ", fsdp" if self.sharding == "fsdp" else ""
        return f"{t.workers} workers ({self.backend}, {t.nodes} node{'s' if t.nodes > 1 else ''}{fsdp})"

    def start(self, start: Start | None = None) -> Start | None:
        """Rank 0 sends ``start`` (None: the unit ends before training); the others receive it."""
        box: list[Any] = [None if start is None else asdict(start)]
        dist.broadcast_object_list(box, src=0, device=self.device if self.backend == "nccl" else None)
        return None if box[0] is None else Start(**box[0])

    def word(self, word: Word | None, fragments: int) -> Word:
        """Rank 0 sends ``word``; the others pass None and receive it."""
        t = word.encode(fragments, self.device) if word is not None else \
            torch.zeros(4 + fragments, dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return word if word is not None else Word.decode(t)

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Rank 0's ``tensors`` into the others' (in place), all in flight at once."""
        with torch.no_grad():
            works = [dist.broadcast(t.detach(), src=0, async_op=True) for t in tensors]
            for w in works:
                if w is not None:
                    w.wait()

    def train_together(self, trainer: Trainer, optimizer_steps: Mapping[int, float]) -> None:
        """The start's collectives after the :class:`Start`: every worker takes rank 0's θ and inner-optimizer
        moments (of the parameters in ``optimizer_steps``), then trains in DDP or sharded (``run.sharding``)."""
        if self.sharding == "fsdp":
            trainer.join_sharded(ShardedModel(trainer.model, trainer.inner_opt, self.device, self.rank, self.workers,
                                              host=self.rank == 0, optimizer_steps=optimizer_steps), self.workers)
            return
        trainer.join_unit(self.wrap(trainer.model), self.workers)
        self.broadcast(optimizer_moments(trainer.inner_opt, optimizer_steps))

    def share(self, trainer: Trainer, state: LearnerState, fragments: Sequence[int]) -> None:
        """Rank 0's θ of ``fragments`` into every worker's model: into its shard when sharded (from rank 0's
        host copy), else into the whole model."""
        if trainer.sharded is None:
            self.broadcast(fragment_params(state, fragments))
        else:
            trainer.sharded.scatter(fragment_indices(state, fragments))

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` in DDP; its construction broadcasts rank 0's parameters (and buffers) to every worker; the
        buffers are not broadcast again at each forward (rank 0 also evaluates with the model itself)."""
        ids = [self.device.index] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, forward_sync_buffers=False)

    def record(self, inner_steps: int, version: int, trainer: Trainer) -> None:
        """Append this rank's parameters' hash to the test's file ``rank-R.txt``, if :data:`HASHES_ENV`
        named a directory. Sharded: the hash of this rank's shards; rank 0 also appends, for every rank R,
        the hash of R's chunks of its host copy to ``host-R.txt`` (which must be up to date)."""
        if self.hashes is None:
            return
        sharded = trainer.sharded
        lines = {f"rank-{self.rank}": trainer.params if sharded is None else sharded.shard_tensors()}
        if sharded is not None and sharded.host is not None:
            lines.update({f"host-{r}": sharded.host_parts(r) for r in range(self.workers)})
        self.hashes.mkdir(parents=True, exist_ok=True)
        for name, params in lines.items():
            with (self.hashes / f"{name}.txt").open("a") as f:
                f.write(f"{inner_steps} {version} {params_sha256(params)}\n")

    def part(self) -> None:
        """The last collective, after the end: nobody leaves the group (closing its connections) before
        every worker has received what rank 0 sent last."""
        dist.barrier()

    def close(self) -> None:
        """Leave the process group (idempotent)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def join(topology: Topology, run: RunConfig) -> UnitGroup:
    """Join the unit's process group: gloo on the CPU, nccl on CUDA (``cuda:LOCAL_RANK``).

    One-line LearnerError for a device a unit cannot use. The worker dies with its torchrun agent:
    rank 0 gets SIGTERM (it leaves the swarm cleanly), the others SIGKILL.
    """
    if run.device == "mps" or run.device.startswith("cuda:"):
        raise LearnerError(f"run.device={run.device} in a torchrun unit: use cpu, cuda or auto (each worker of a "
                           "unit takes cuda:LOCAL_RANK)")
    if run.device in ("auto", "cuda") and torch.cuda.is_available():
        torch.cuda.set_device(topology.local_rank)
    device = resolve_device(run.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    _die_with_agent(signal.SIGTERM if topology.rank == 0 else signal.SIGKILL)
    if topology.rank == 0:
        # torchrun stops a worker by signalling its whole process group. hivemind's DHT and averager
        # processes (forked from rank 0; p2pd is the DHT process's child) would die of that SIGTERM at
        # once, before rank 0's parting rounds: they get process groups of their own. They still die
        # with rank 0 (lifecycle.die_with_parent), and p2pd with the DHT process.
        os.register_at_fork(after_in_child=_own_process_group)
    store, _, _ = next(dist.rendezvous("env://", topology.rank, topology.workers))
    # torchrun keeps one store across the restarts of --max-restarts: without a prefix per attempt a
    # restarted worker would read the dead workers' addresses and fail to connect.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"p2p_diloco/attempt-{attempt}", store),
                            rank=topology.rank, world_size=topology.workers)
    hashes = os.environ.get(HASHES_ENV)
    group = UnitGroup(topology, device, backend, Path(hashes) if hashes else None, run.sharding)
    logger.info(f"worker {topology.rank} of a learner unit of {group.describe()}, local rank "
                f"{topology.local_rank}, pid {os.getpid()}{'' if topology.rank else '; the swarm peer'}")
    return group


def _own_process_group() -> None:
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)


def _die_with_agent(sig: signal.Signals) -> None:
    if sys.platform.startswith("linux"):
        parent = os.getppid()
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the agent died before prctl took effect
            os._exit(1)


def unit_broken(what: str, e: BaseException) -> UnitBroken:
    """The one-line error for a collective that failed while ``what``."""
    # gloo's messages start with its source file and line, and go on with advice after the first sentence
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip()).split(". ")[0].splitlines()
    first = text[0][:200] if text else type(e).__name__
    return UnitBroken(f"the learner unit failed while {what} ({first}): a worker is gone or failed, so "
                      "every worker ends; under torchrun --max-restarts the unit starts again (rank 0 resumes its "
                      "checkpoint with --resume)")


def optimizer_moments(opt: AdamW, steps: Mapping[int, float]) -> list[torch.Tensor]:
    """The inner optimizer's moments (exp_avg, exp_avg_sq) of the parameters in ``steps``, created
    (empty, to be received) where missing: the tensors of the start's optimizer broadcast."""
    out = []
    for i, step in sorted(steps.items()):
        if i not in opt.state:
            p = opt.params[i]
            opt.state[i] = {"step": torch.tensor(step, dtype=torch.float32),
                            "exp_avg": torch.empty_like(p), "exp_avg_sq": torch.empty_like(p)}
        out += [opt.state[i]["exp_avg"], opt.state[i]["exp_avg_sq"]]
    return out
