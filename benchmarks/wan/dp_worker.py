"""One rank of per-step data-parallel training (torch.distributed gloo) for the WAN benchmark.

Every step: forward and backward on this rank's batch, one ``all_reduce`` of all gradients as one flat
fp32 tensor, divide by the world size, clip, AdamW, exactly the learners' inner hyperparameters. Rank
r reads data shard r of ``data.num_shards`` through the learners' own ``BatchSampler`` (same seed
rule as a learner). Rank 0 evaluates the model on the learners' fixed eval batches every
``--eval-every`` steps and decides, for everyone, when to stop (target loss, step or time budget).

The benchmark runs it inside network namespaces (``ip netns exec``) so that the all-reduce crosses the
shaped links, or on loopback for the reference loss curve. Writes a JSON file per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dp_step import data_parallel_step, evaluate, setup_rank  # noqa: E402

from p2p_diloco.config import load_learner_config  # noqa: E402
from p2p_diloco.core.lr_schedule import inner_lr  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True, help="rank 0's address, host:port")
    p.add_argument("--iface", default="lo", help="network interface gloo uses")
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--max-seconds", type=float, default=1e9, help="stop after this much training time")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--target-loss", type=float, default=None, help="stop at the first eval at or below this")
    p.add_argument("--out", required=True, help="JSON file for this rank's results")
    a = p.parse_args(argv)

    host, port = a.master.rsplit(":", 1)
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=port, GLOO_SOCKET_IFNAME=a.iface, TP_SOCKET_IFNAME=a.iface)
    cfg = load_learner_config(a.config, a.overrides)
    torch.set_num_threads(cfg.run.threads)
    dist.init_process_group("gloo", rank=a.rank, world_size=a.world, init_method="env://")
    try:
        sampler, eval_batches, model, params, opt = setup_rank(cfg, a.rank)
        curve = [(0, evaluate(model, eval_batches), 0.0)] if a.rank == 0 else []
        step_seconds, compute_seconds, comm_seconds = [], [], []
        train_seconds = 0.0
        flag = torch.zeros(1)
        dist.barrier()
        step = 0
        while step < a.max_steps:
            step += 1
            busy, reduce_s = data_parallel_step(model, params, opt, sampler.next_batch(), a.world,
                                                cfg.inner.grad_clip, lr=inner_lr(cfg.inner, step - 1, cfg.decay_steps))
            step_seconds.append(busy + reduce_s)
            compute_seconds.append(busy)
            comm_seconds.append(reduce_s)
            train_seconds += busy + reduce_s
            if step % a.eval_every == 0 or step == a.max_steps:
                if a.rank == 0:
                    loss_now = evaluate(model, eval_batches)
                    curve.append((step, loss_now, train_seconds))
                    print(f"dp step {step} eval_loss {loss_now:.4f} step {statistics.median(step_seconds):.3f}s "
                          f"(all-reduce {statistics.median(comm_seconds):.3f}s)", flush=True)
                    done = (a.target_loss is not None and loss_now <= a.target_loss) or train_seconds >= a.max_seconds
                    flag.fill_(float(done))
                dist.broadcast(flag, src=0)
                if flag.item():
                    break
        out = {"rank": a.rank, "world": a.world, "steps": step, "num_params": sum(q.numel() for q in params),
               "step_seconds": step_seconds, "compute_seconds": compute_seconds, "comm_seconds": comm_seconds,
               "train_seconds": train_seconds, "curve": curve}
        Path(a.out).write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
