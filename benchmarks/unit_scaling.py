"""Worker scaling inside a learner unit: tokens/s of a unit of 1 worker against units of N workers.

Each unit is a real learner training alone (a quorum of one, its own DHT, so rounds commit at once
and the figures are the unit's own), on the same model, config, shard and seed, for the same number
of outer steps: first ``p2p-diloco learner`` (1 worker), then ``torchrun --nproc-per-node N -m
p2p_diloco learner`` (N workers, DDP over gloo on the CPU, or nccl on GPUs with ``--set
run.device=cuda``; with ``--sharding fsdp`` the model is sharded over them instead, FSDP2, and rank 0
keeps a host copy of θ, p2p_diloco/train/sharding.py). The runs take turns, so they do not share the
cores. Throughput is the summary's ``tokens_per_second``: the unit's tokens (all workers') over its
training wall time, rounds, evals and checkpoints included, as a user sees it. Beside each unit, the
same inner steps in a bare loop
(the trainer's step in DDP, or sharded, on the same parts of the shard; no swarm, rounds, evals,
checkpoints or control words) show what the machine allows at that moment::

    python benchmarks/unit_scaling.py --workers 1 2 --outer-steps 8 [--sharding fsdp] [--json unit_scaling.json]

On a CPU the N workers share the machine's cores: expect at most min(N, cores / run.threads) times
the tokens/s of one worker, less the cost of DDP's all-reduce of the gradients at every step and of
rank 0's evals, checkpoints and rounds, during which the other workers wait.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_unit(workers: int, work: Path, args: argparse.Namespace) -> dict:
    """Train one unit of ``workers`` workers to ``--outer-steps``; returns its summary."""
    learner = ["learner", "--config", args.config, "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--shard-index", "0",
               "--num-shards", "4", "--max-outer-steps", str(args.outer_steps), "--checkpoint-dir",
               str(work / f"ckpt-{workers}"), "--summary", str(work / f"summary-{workers}.json"),
               "--set", "averaging.min_group_size=1", "--set", f"inner.steps_per_outer={args.steps_per_outer}",
               "--set", f"run.threads={args.threads}", "--set", "run.linger_seconds=0",
               "--set", f"run.sharding={args.sharding}", *[a for o in args.overrides for a in ("--set", o)]]
    launcher = ([sys.executable, "-m", "p2p_diloco"] if workers == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers),
                 "-m", "p2p_diloco"])
    log = work / f"unit-{workers}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(args.threads)}
    began = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen([*launcher, *learner], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(args.timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    if code != 0:
        raise SystemExit(f"error: the {workers}-worker unit failed (exit {code}); its log: {log}\n"
                         f"{log.read_text(errors='replace')[-3000:]}")
    summary = json.loads((work / f"summary-{workers}.json").read_text())
    summary["wall_seconds"] = time.monotonic() - began
    return summary


def run_bare(workers: int, args: argparse.Namespace) -> float:
    """tokens/s of :func:`bare_worker` on ``workers`` workers (torchrun for more than one)."""
    launcher = [sys.executable] if workers == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers)]
    cmd = [*launcher, __file__, "--bare-worker", "--outer-steps", str(args.outer_steps), "--steps-per-outer",
           str(args.steps_per_outer), "--threads", str(args.threads), "--config", args.config,
           "--sharding", args.sharding, *[a for o in args.overrides for a in ("--set", o)]]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("bare tokens/s ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"error: the bare {workers}-worker loop failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return float(lines[-1].split()[-1])


def bare_worker(args: argparse.Namespace) -> None:
    """The unit's inner steps alone: build, this worker's part of shard 0, DDP or FSDP (under torchrun), timed steps."""
    import torch
    import torch.distributed as dist

    from p2p_diloco.config import load_learner_config
    from p2p_diloco.learner.startup import build, load_data
    from p2p_diloco.learner.unit.group import part_of_shard
    from p2p_diloco.train.data.tokenizer import load_tokenizer
    from p2p_diloco.train.sharding import ShardedModel

    cfg = load_learner_config(args.config, [f"inner.steps_per_outer={args.steps_per_outer}", "data.num_shards=4",
                                            f"run.sharding={args.sharding}", *args.overrides])
    torch.set_num_threads(args.threads)
    trainer, _ = build(cfg)
    sampler = load_data(cfg, 0, load_tokenizer(cfg.data.tokenizer)).sampler
    workers, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if workers > 1:
        dist.init_process_group("gloo")
        sampler = part_of_shard(sampler, rank, workers)
        if args.sharding == "fsdp":
            trainer.join_sharded(ShardedModel(trainer.model, trainer.inner_opt, trainer.placement.device, rank,
                                              workers, host=False, optimizer_steps={}), workers)
        else:
            trainer.join_unit(torch.nn.parallel.DistributedDataParallel(trainer.model), workers)
    steps = args.outer_steps * args.steps_per_outer
    for i in range(steps + 10):
        if i == 10:  # after a warm-up
            began = time.perf_counter()
        trainer.step(*sampler.next_batch(), version=i // args.steps_per_outer)
    seconds = time.perf_counter() - began
    if rank == 0:
        print(f"bare tokens/s {steps * cfg.inner.batch_size * cfg.model.seq_len * workers / seconds:.1f}", flush=True)
    if workers > 1:
        dist.destroy_process_group()


def table(results: dict[int, dict], bare: dict[int, float]) -> str:
    """The side-by-side table, speed-ups against the first unit (and the first bare loop)."""
    base, bare_base = next(iter(results.values()))["tokens_per_second"], next(iter(bare.values()))
    rows = ["| workers | inner steps | tokens | train s | tokens/s | speed-up | final eval loss | bare loop tokens/s "
            "| bare speed-up | unit / bare |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, s in results.items():
        tps = s["tokens_per_second"]
        rows.append(f"| {n} | {s['inner_steps']} | {s['tokens']:,} | {s['train_seconds']:.1f} | {tps:,.0f} | "
                    f"{tps / base:.2f}× | {s['last_eval_loss']:.4f} | {bare[n]:,.0f} | {bare[n] / bare_base:.2f}× | "
                    f"{tps / bare[n]:.2f} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="unit sizes to compare, in order")
    p.add_argument("--outer-steps", type=int, default=8)
    p.add_argument("--steps-per-outer", type=int, default=30)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--sharding", choices=["ddp", "fsdp"], default="ddp", help="run.sharding of the units of 2+")
    p.add_argument("--config", default=str(ROOT / "peers" / "small-cpu.toml"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per unit")
    p.add_argument("--json", help="also write the summaries here")
    p.add_argument("--bare-worker", action="store_true", help=argparse.SUPPRESS)  # one worker of run_bare
    args = p.parse_args()
    if args.bare_worker:
        bare_worker(args)
        return
    results: dict[int, dict] = {}
    bare: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="unit-scaling-") as tmp:
        for n in args.workers:
            results[n] = run_unit(n, Path(tmp), args)
            bare[n] = run_bare(n, args)
            print(f"{n} worker(s): {results[n]['tokens_per_second']:,.0f} tokens/s as a learner, {bare[n]:,.0f} in a "
                  "bare loop", flush=True)
    print(f"\n{args.outer_steps} outer steps of {args.steps_per_outer} inner steps, {args.threads} thread(s) per "
          f"worker, {args.sharding} in units of 2+, {os.cpu_count()} cores (load average "
          f"{os.getloadavg()[0]:.1f}), device {results[args.workers[0]]['device']}\n")
    print(table(results, bare))
    if args.json:
        Path(args.json).write_text(json.dumps({str(n): {**s, "bare_tokens_per_second": bare[n]}
                                               for n, s in results.items()}, indent=2))


if __name__ == "__main__":
    main()
