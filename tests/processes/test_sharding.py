"""A model sharded over a unit's workers (sharding.py): FSDP2's split, rank 0's host copy brought up
to date by a gather, its changes written back into every shard by a scatter, and a sharded inner step
equal to one step of the whole model on the whole unit's batch. Two gloo workers in two processes."""

from __future__ import annotations

import multiprocessing
import os
import socket
import traceback
from typing import Any

import pytest
import torch

from p2p_diloco.train.sharding import local_part


def test_each_worker_holds_torch_chunks_of_dim_0():
    full = torch.arange(14.0).reshape(7, 2)
    parts = [local_part(full, r, 3) for r in range(3)]
    assert [tuple(p.shape) for p in parts] == [(3, 2), (3, 2), (1, 2)]
    assert torch.equal(torch.cat(parts), full)
    assert [tuple(local_part(torch.zeros(1, 4), r, 2).shape) for r in range(2)] == [(1, 4), (0, 4)]


class _Net(torch.nn.Module):
    """Uneven shapes: 7 rows split 4 + 3, a one-row table that leaves rank 1 an empty shard."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(5, 7)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(7, 7), torch.nn.Linear(7, 3)])
        self.bias = torch.nn.Embedding(1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return h + self.bias.weight[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, out: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=2)
        try:
            out.put((rank, _check(rank)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        out.put((rank, traceback.format_exc()))


def _check(rank: int) -> str:
    """Every check of one worker; "ok" or the first failure (every rank takes part in every collective)."""
    from p2p_diloco.core.inner_optim import AdamW
    from p2p_diloco.train.sharding import ShardedModel

    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    # Rank 0's θ and moments, as if restored from a checkpoint; every rank builds them as its reference.
    torch.manual_seed(0)
    reference = _Net()
    ref_opt = AdamW(reference.parameters(), lr=0.05)
    reference(x).square().mean().backward()
    ref_opt.step()
    ref_opt.zero_grad()
    torch.manual_seed(rank)  # rank 1 starts elsewhere, without moments: sharding gives it rank 0's
    model = _Net()
    opt = AdamW(model.parameters(), lr=0.05)
    if rank == 0:
        model.load_state_dict(reference.state_dict())
        opt.load_state_dict(ref_opt.state_dict())
    sharded = ShardedModel(model, opt, torch.device("cpu"), rank, 2, host=rank == 0,
                           optimizer_steps={i: 1.0 for i in range(7)})
    full = [p.detach().clone() for p in reference.parameters()]
    failures = []
    if any(not torch.equal(s, local_part(f, rank, 2)) for s, f in zip(sharded.shard_tensors(), full, strict=True)):
        failures.append("the shards are not torch.chunk's chunks of rank 0's θ")
    # Rank 0 changes two tensors of its host copy; the scatter writes them into both ranks' shards.
    if sharded.host is not None:
        with torch.no_grad():
            for i in (0, 6):
                sharded.host_params[i].add_(1.0)
    sharded.scatter([0, 6])
    with torch.no_grad():
        for i in (0, 6):
            full[i] += 1.0
            list(reference.parameters())[i].add_(1.0)
    if any(not torch.equal(s, local_part(f, rank, 2)) for s, f in zip(sharded.shard_tensors(), full, strict=True)):
        failures.append("a scatter left a shard that is not the chunk of rank 0's tensor")
    # One step each on its half of a batch, clipped (the norm is the whole gradient's), against one
    # step of the whole model on the whole batch, from rank 0's moments.
    model(x.chunk(2)[rank]).square().mean().backward()
    torch.nn.utils.clip_grad_norm_(sharded.params, 0.01)
    sharded.optimizer.step()
    reference(x).square().mean().backward()
    torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.01)
    ref_opt.step()
    sharded.gather([0, 1, 2])  # not the others yet: rank 0's copy of them is one step behind
    pairs = list(zip(sharded.host_params, reference.parameters(), strict=False))  # none on rank 1
    if sharded.host is not None:
        fresh = [torch.allclose(h, r, atol=1e-6) for h, r in pairs]
        if fresh != [True] * 3 + [False] * 4:
            failures.append(f"gathering 0-2 left rank 0's host copy at {fresh}")
    sharded.gather(range(3, 7), optimizer=True)
    if sharded.host is not None and sharded.host_optimizer is not None:
        if not all(torch.allclose(h, r, atol=1e-6) for h, r in pairs):
            failures.append("the gathered θ is not the whole model's step")
        ours, theirs = sharded.host_optimizer.state_dict()["state"], ref_opt.state_dict()["state"]
        if ours.keys() != theirs.keys() or not all(
                torch.allclose(ours[i][k], theirs[i][k], atol=1e-7) for i in ours for k in ("exp_avg", "exp_avg_sq")):
            failures.append("the gathered moments are not the whole model's")
        if any(float(ours[i]["step"]) != 2.0 for i in ours):
            failures.append("the step counts did not go on from rank 0's")
    return "; ".join(failures) or "ok"


@pytest.mark.timeout(120)
def test_gather_and_scatter_between_shards_and_rank_0s_host_copy():
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=90) for _ in procs)
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert results == {0: "ok", 1: "ok"}, results
    assert [p.exitcode for p in procs] == [0, 0]
