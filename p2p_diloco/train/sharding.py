"""A learner unit's model sharded with FSDP2 (``run.sharding = "fsdp"``): each worker holds 1/N of θ.

What each of the unit's N workers holds once :class:`ShardedModel` has sharded the model:

- its shard of every parameter, a DTensor: the dim-0 chunk ``rank`` of ``torch.chunk(θ_i, N)``, the
  split FSDP2 uses (:func:`local_part`); its gradients and inner AdamW moments are sharded alike.
  Every ModuleList entry (the transformer blocks) is one FSDP unit, the rest of the model the root
  one, so a forward holds one block's full parameters at a time;
- rank 0 only: :attr:`ShardedModel.host`, a full copy of the model in host memory (CPU, the model's
  dtypes), whose parameters are the learner state's θ (``LearnerState.params``): the rounds'
  snapshots, ``apply_result``, catch-up, checkpoints and evaluation read and write it, as they read
  and write the model itself in a unit without sharding.

The host copy is brought up to date on demand (:meth:`ShardedModel.gather`, a collective: every
worker takes part in the all-gather, rank 0 keeps the result), and what rank 0 changed in it goes
back to every worker's shard (:meth:`ShardedModel.scatter`: a broadcast of the full tensors, each
worker keeping its own chunk). :mod:`p2p_diloco.learner.unit.group` says when the unit does either.

In such a unit the trainer leaves the model in host memory when it is built (:func:`sharded_unit`):
no worker ever holds the whole model on its device.

Example (inside a unit's process group; :meth:`p2p_diloco.learner.unit.group.UnitGroup.train_together` does this)::

    sharded = ShardedModel(trainer.model, trainer.inner_opt, device, rank, workers, host=rank == 0,
                           optimizer_steps=start.optimizer_steps)
    trainer.join_sharded(sharded, workers)
    ...  # inner steps
    sharded.gather([0, 1])    # every rank: θ_0 and θ_1 into rank 0's host copy
    sharded.scatter([0])      # every rank: rank 0's host θ_0 into each worker's shard
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from p2p_diloco.config import RunConfig
from p2p_diloco.core.inner_optim import AdamW

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor


def local_part(full: torch.Tensor, rank: int, workers: int) -> torch.Tensor:
    """Worker ``rank``'s part of a full tensor as FSDP2 shards it: the rank-th of ``torch.chunk``'s dim-0
    chunks (empty when there are fewer chunks than workers).

    >>> [tuple(local_part(torch.zeros(5, 2), r, 2).shape) for r in range(2)]
    [(3, 2), (2, 2)]
    >>> tuple(local_part(torch.zeros(1, 3), 1, 2).shape)
    (0, 3)
    """
    chunks = torch.chunk(full, workers, dim=0)
    return chunks[rank] if rank < len(chunks) else full[:0]


def shard_module(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2 on ``model`` in place: every ModuleList entry its own unit (a transformer block), then the root."""
    from torch.distributed.fsdp import fully_shard

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    entries = [e for lst in lists for e in lst]
    for entry in reversed(entries):  # FSDP2 wants the inner units first (a ModuleList inside a block)
        if any(True for _ in entry.parameters()):
            fully_shard(entry, mesh=mesh)
    fully_shard(model, mesh=mesh)


def sharded_unit(run: RunConfig, env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a worker of a torchrun unit of several workers (``WORLD_SIZE`` > 1, as
    :meth:`p2p_diloco.learner.unit.group.Topology.from_env` reads it) that shards its model (``run.sharding=fsdp``)."""
    env = os.environ if env is None else env
    return run.sharding == "fsdp" and int(env.get("WORLD_SIZE", "1")) > 1


class ShardedModel:
    """``model`` (full θ in host memory) sharded over the unit's ``workers`` in place; a collective.

    Every worker's shards and inner-optimizer moments (of the parameters in ``optimizer_steps``, as
    :class:`p2p_diloco.learner.unit.group.Start` lists them) are then rank 0's: its ``model`` and ``full_opt`` (a
    restored checkpoint, say) go to the others tensor by tensor, each keeping its chunk, so that no
    worker holds more than one full tensor on its device. :attr:`optimizer` is the inner AdamW over
    the shards; with ``host`` (rank 0), :attr:`host` is a full copy of θ kept in host memory.
    """

    def __init__(self, model: torch.nn.Module, full_opt: AdamW, device: torch.device, rank: int, workers: int,
                 host: bool, optimizer_steps: Mapping[int, float]):
        from torch.distributed.device_mesh import init_device_mesh

        self.rank, self.workers, self.device = rank, workers, device
        model.to("cpu")  # sharding moves each FSDP unit's chunks to the device, one unit at a time
        self.host = copy.deepcopy(model).requires_grad_(False) if host else None
        self.host_params = [] if self.host is None else list(self.host.parameters())
        shard_module(model, init_device_mesh(device.type, (workers,)))
        self.model = model
        self.params = list(model.parameters())  # DTensors, in the module's order (as before sharding)
        self.optimizer = _adamw_like(full_opt, self.params, full_opt.foreach)
        # The inner optimizer's moments in host memory (rank 0), for checkpoints: see gather(optimizer=True).
        self.host_optimizer = None if self.host is None else _adamw_like(full_opt, self.host_params, False)
        with torch.no_grad():
            self.scatter(range(len(self.params)))
            for b in model.buffers():
                dist.broadcast(b, src=0)
            self._share_moments(full_opt, optimizer_steps)

    def _share_moments(self, full_opt: AdamW, steps: Mapping[int, float]) -> None:
        for i, step in sorted(steps.items()):
            p, moments = self.params[i], {}
            for k in ("exp_avg", "exp_avg_sq"):
                full = full_opt.state[i][k].to(self.device, p.dtype) if self.rank == 0 else \
                    torch.empty(p.shape, dtype=p.dtype, device=self.device)
                dist.broadcast(full, src=0)
                moments[k] = self._shard_like(p, full)
            self.optimizer.state[i] = {"step": torch.tensor(step, dtype=torch.float32), **moments}
        if self.host_optimizer is not None:
            self.host_optimizer.state = {i: {k: v.to("cpu", copy=True) for k, v in s.items()}
                                         for i, s in full_opt.state.items()}

    def _shard_like(self, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(param)  # a DTensor sharded as ``param``
        _copy_part(out, full, self.rank, self.workers)
        return out

    @torch.no_grad()
    def gather(self, indices: Sequence[int], optimizer: bool = False) -> None:
        """A collective: parameters ``indices`` (and, with ``optimizer``, every inner-optimizer moment)
        all-gathered; rank 0 copies them into its host copy."""
        for i in indices:
            full = _dtensor(self.params[i]).full_tensor()
            if self.host is not None:
                self.host_params[i].copy_(full)
        if not optimizer:
            return
        for i, s in sorted(self.optimizer.state.items()):
            moments = {k: _dtensor(s[k]).full_tensor() for k in ("exp_avg", "exp_avg_sq")}
            if self.host_optimizer is not None:
                self.host_optimizer.lr = self.optimizer.lr
                self.host_optimizer.state[i] = {"step": s["step"].clone(),
                                                **{k: v.to("cpu", copy=True) for k, v in moments.items()}}

    @torch.no_grad()
    def scatter(self, indices: Iterable[int]) -> None:
        """A collective: rank 0's host parameters ``indices`` broadcast in full, one at a time through the
        unit's device, each worker keeping its own chunk in its shard."""
        for i in indices:
            p = self.params[i]
            full = self.host_params[i].to(self.device, p.dtype) if self.host is not None else \
                torch.empty(p.shape, dtype=p.dtype, device=self.device)
            dist.broadcast(full, src=0)
            _copy_part(p, full, self.rank, self.workers)

    def shard_tensors(self) -> list[torch.Tensor]:
        """This worker's local shards of the parameters, in order (for hashes)."""
        return [_dtensor(p).to_local() for p in self.params]

    def host_parts(self, rank: int) -> list[torch.Tensor]:
        """Worker ``rank``'s chunks of rank 0's host θ: what its :meth:`shard_tensors` must equal."""
        return [local_part(p, rank, self.workers) for p in self.host_params]


def _copy_part(dtensor: torch.Tensor, full: torch.Tensor, rank: int, workers: int) -> None:
    """``full``'s chunk for ``rank`` into the local tensor of a sharded parameter or moment."""
    local = _dtensor(dtensor).to_local()
    part = local_part(full, rank, workers)
    if local.shape != part.shape:  # copy_ would broadcast a wrong shape silently
        raise RuntimeError(f"shard of shape {tuple(local.shape)} on rank {rank} for a chunk of {tuple(part.shape)}")
    local.copy_(part)


def _dtensor(t: torch.Tensor) -> DTensor:
    return cast("DTensor", t)


def _adamw_like(opt: AdamW, params: Sequence[torch.Tensor], foreach: bool) -> AdamW:
    """A new AdamW over ``params`` with ``opt``'s hyperparameters and no state."""
    beta1, beta2 = opt.betas
    return AdamW(params, lr=opt.lr, betas=(beta1, beta2), eps=opt.eps, weight_decay=opt.weight_decay, foreach=foreach)
