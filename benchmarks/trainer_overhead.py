"""Overhead of the trainer: a learner's tokens/s against a bare PyTorch loop on the same work.

Both sides train the same model (the config's, from the run seed), on the same data shard (read and tokenised
as a learner does, :func:`p2p_diloco.learner.startup.load_data`), with the same batch size, seq_len, device and seed,
with one torch thread (``run.threads=1``), for the same number of inner steps:

- **bare**: a plain loop in a fresh process: next batch, forward, ``zero_grad``, backward, clip to
  ``inner.grad_clip``, ``torch.optim.AdamW.step()`` at the learners' inner hyperparameters. No swarm, no
  evals, no checkpoints. tokens/s = tokens / wall time of the loop.
- **learner**: a real ``p2p-diloco learner`` process alone, a swarm of one (``averaging.min_group_size=1``,
  no ``--initial-peers``: its rounds commit by themselves), ``--max-outer-steps N``. From its ``--summary``:
  tokens / ``train_seconds`` (the whole training loop: inner steps, rounds, evals, checkpoints) and
  tokens / ``compute_seconds`` (inner steps only, batch sampling included).

The two alternate, ``--repeats`` times each (the order flips every repeat), so that both see the same machine
state. ``--also NAME=SET[,SET...]`` adds learner arms with extra settings (e.g. ``no-evals=run.eval_every=1000``)
to show what a setting costs. The bare process also times one eval (``data.eval_batches`` batches, no grad),
so the report can say how much of the learner's non-compute time its evals explain.

On a shared machine the load moves both sides by tens of percent between runs, so the report gives the
ratio of the best run of each side and of each repeat's pair, and the learner's own compute share of its
training loop (compute / train seconds: measured inside one process, hardly moved by the load). The
whole-loop ratio is that share times the compute-only ratio.

Usage::

    .venv/bin/python benchmarks/trainer_overhead.py                      # small-cpu and llama-tiny, 3 repeats
    .venv/bin/python benchmarks/trainer_overhead.py --configs peers/llama-tiny.toml --seconds 20 \\
        --also no-evals=run.eval_every=1000 --json benchmarks/results/trainer_overhead.json

Nothing leaves 127.0.0.1; each learner runs in its own process group, which is checked empty afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["peers/small-cpu.toml", "peers/llama-tiny.toml"]
# What makes a swarm of one on one torch thread; linger 0: nobody is behind it.
SOLO = ["averaging.min_group_size=1", "run.threads=1", "run.linger_seconds=0"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated peer configs to measure")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="extra overrides for both sides")
    p.add_argument("--device", default="cpu", help="run.device of both sides")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side (alternating)")
    p.add_argument("--seconds", type=float, default=15.0,
                   help="target training time of one bare run; sets the number of outer steps from a short "
                        "calibration (unless --outer-steps)")
    p.add_argument("--outer-steps", type=int, default=None, help="N: the learner runs N·H inner steps, bare the same")
    p.add_argument("--also", action="append", default=[], metavar="NAME=SET[,SET...]",
                   help="an extra learner arm with these overrides, e.g. no-evals=run.eval_every=1000")
    p.add_argument("--shard", type=int, default=0, help="data shard both sides train on")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before one run is stopped")
    p.add_argument("--workdir", default=None, help="logs, checkpoints, token cache (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--from-workdir", action="store_true",
                   help="do not train: rebuild the results from the runs kept in --workdir (with the same --configs, "
                        "--also and --outer-steps or the N the run printed), e.g. after a run was stopped")
    p.add_argument("--note", default=None, help="a line kept in the JSON (e.g. which code each config ran)")
    p.add_argument("--bare-worker", default=None, metavar="OUT.json", help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- bare loop


def bare_worker(args: argparse.Namespace) -> int:
    """The bare loop, in its own process (imports and data loading are outside the timed loop)."""
    import torch

    from p2p_diloco.config import load_learner_config
    from p2p_diloco.learner.startup import load_data
    from p2p_diloco.train.data.tokenizer import load_tokenizer
    from p2p_diloco.train.models.registry import build_model
    from p2p_diloco.train.trainer import resolve_device

    cfg = load_learner_config(args.config, args.overrides)
    torch.set_num_threads(cfg.run.threads)
    device = resolve_device(cfg.run.device)
    data = load_data(cfg, args.shard, load_tokenizer(cfg.data.tokenizer))  # the learner's shard, sampler, evals
    model = build_model(cfg.model, cfg.run.seed).to(device)
    params = list(model.parameters())
    inner = cfg.inner
    opt = torch.optim.AdamW(params, lr=inner.lr, weight_decay=inner.weight_decay, betas=(inner.beta1, inner.beta2))
    tokens = 0
    model.train()
    started = time.perf_counter()
    for _ in range(args.steps):
        x, y = data.sampler.next_batch()
        x, y = x.to(device), y.to(device)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, inner.grad_clip)
        opt.step()
        loss.item()  # the learner reads its loss every step too (and so waits for a GPU)
        tokens += x.numel()
    seconds = time.perf_counter() - started
    model.eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        eval_loss = sum(float(model(x.to(device), y.to(device))[1]) for x, y in data.eval_batches)
    eval_seconds = time.perf_counter() - t0
    out = {"steps": args.steps, "tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
           "one_eval_seconds": eval_seconds, "eval_loss": eval_loss / len(data.eval_batches),
           "parameters": sum(p.numel() for p in params), "device": str(device)}
    Path(args.bare_worker).write_text(json.dumps(out))
    return 0


# ------------------------------------------------------------------------------------------------ runners


def run_bare(args: argparse.Namespace, config: str, sets: list[str], steps: int, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--bare-worker", str(out), "--config", config, "--steps", str(steps),
           "--shard", str(args.shard), *[x for s in sets for x in ("--set", s)]]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=args.timeout)
    return json.loads(out.read_text())


def run_learner(args: argparse.Namespace, config: str, sets: list[str], outer_steps: int, d: Path) -> dict:
    """One learner alone until version ``outer_steps``. Alone, every round must commit: the first one that
    does not (or ``--timeout``) ends the run with an error instead of a learner that never gets there."""
    from p2p_diloco.sim.processes import LOOPBACK_ANY_PORT, Proc, cli, processes_in_group, stop_procs

    d.mkdir(parents=True, exist_ok=True)
    proc = Proc("learner", cli(
        "learner", "--config", config, "--host-maddrs", LOOPBACK_ANY_PORT, "--shard-index", str(args.shard),
        "--max-outer-steps", str(outer_steps), "--checkpoint-dir", str(d / "ckpt"),
        "--summary", str(d / "summary.json"), *[x for s in sets for x in ("--set", s)],
    ), d / "learner.log")
    problem = None
    try:
        deadline = time.monotonic() + args.timeout
        while proc.popen.poll() is None and problem is None:
            time.sleep(0.5)
            if "outer round not committed" in (d / "learner.log").read_text(errors="replace"):
                problem = "a round of a swarm of one did not commit"
            elif time.monotonic() > deadline:
                problem = f"no exit after {args.timeout:.0f} s"
    finally:
        stop_procs([proc], grace=15)
        time.sleep(0.3)
        left = processes_in_group(proc.pid)
    code = proc.popen.returncode
    if problem or code != 0 or not (d / "summary.json").exists():
        raise RuntimeError(f"learner: {problem or f'exit code {code}'}; see {d / 'learner.log'}")
    return read_learner(d, left)


def read_learner(d: Path, leftovers: list[str] | None = None) -> dict:
    """A learner run's figures, from its ``--summary`` JSON and its log."""
    s = json.loads((d / "summary.json").read_text())
    log = (d / "learner.log").read_text(errors="replace")
    return {
        "inner_steps": s["inner_steps"], "tokens": s["tokens"], "outer_steps": s["outer_steps"],
        "rounds_failed": s["rounds_failed"],
        "train_seconds": s["train_seconds"], "compute_seconds": s["compute_seconds"], "wait_seconds": s["wait_seconds"],
        "tokens_per_second": s["tokens"] / s["train_seconds"],
        "compute_tokens_per_second": s["tokens"] / s["compute_seconds"],
        "evals_in_loop": len(re.findall(r"outer step done .* eval_loss ", log)),
        "last_eval_loss": s["last_eval_loss"], "leftover_processes": leftovers or [],
        "warnings": log.count(" WARNING ") + log.count(" WARN "),
        "errors": log.count(" ERROR ") + log.count("Traceback"),
    }


def calibrate(args: argparse.Namespace, config: str, sets: list[str], work: Path) -> float:
    """Seconds per bare step, from 20 steps (the first ones, slower, included: a rough guess is enough)."""
    r = run_bare(args, config, sets, 20, work / "calibrate.json")
    return r["seconds"] / r["steps"]


# ------------------------------------------------------------------------------------------------- report


def _stats(xs: list[float]) -> dict:
    return {"mean": statistics.mean(xs), "min": min(xs), "max": max(xs), "values": xs}


def measure(args: argparse.Namespace, config: str, work: Path) -> dict:
    from p2p_diloco.config import load_learner_config

    sets = [*SOLO, f"run.device={args.device}", f"data.cache_dir={work / 'cache'}", *args.overrides]
    cfg = load_learner_config(config, sets)
    h = cfg.inner.steps_per_outer
    name = Path(config).stem
    cwork = work / name
    cwork.mkdir(parents=True, exist_ok=True)
    step = None
    n = args.outer_steps
    if n is None and args.from_workdir:
        n = json.loads((cwork / "bare-0.json").read_text())["steps"] // h
    if n is None:
        step = calibrate(args, config, sets, cwork)
        n = max(2, round(args.seconds / (step * h)))
    steps = n * h
    arms = {"learner": sets}
    for spec in args.also:
        arm, _, extra = spec.partition("=")
        arms[arm] = [*sets, *[e for e in extra.split(",") if e]]
    print(f"[{name}] H={h} N={n}: {steps} inner steps per run (bare step ≈ {step or 0:.3f} s); arms "
          f"{list(arms)}", flush=True)
    runs: dict[str, list[dict]] = {"bare": [], **{a: [] for a in arms}}
    if args.from_workdir:
        return summarise(config, sets, cfg, n, arms, read_runs(cwork, arms))
    for r in range(args.repeats):
        order = ["bare", *arms] if r % 2 == 0 else [*arms, "bare"]
        for arm in order:
            if arm == "bare":
                res = run_bare(args, config, sets, steps, cwork / f"bare-{r}.json")
            else:
                res = run_learner(args, config, arms[arm], n, cwork / f"{arm}-{r}")
            runs[arm].append(res)
            print(f"[{name}] {arm} #{r}: {res['tokens_per_second']:,.0f} tokens/s"
                  + (f" (compute only {res['compute_tokens_per_second']:,.0f})" if arm != "bare" else ""), flush=True)
    return summarise(config, sets, cfg, n, arms, runs)


def read_runs(cwork: Path, arms: dict[str, list[str]]) -> dict[str, list[dict]]:
    """The runs a workdir holds, for every repeat in which each side finished (a run stopped part way)."""
    runs: dict[str, list[dict]] = {"bare": [], **{a: [] for a in arms}}
    r = 0
    while (cwork / f"bare-{r}.json").exists() and all((cwork / f"{a}-{r}" / "summary.json").exists() for a in arms):
        runs["bare"].append(json.loads((cwork / f"bare-{r}.json").read_text()))
        for a in arms:
            runs[a].append(read_learner(cwork / f"{a}-{r}"))
        r += 1
    if not r:
        raise SystemExit(f"error: no complete repeat in {cwork}")
    return runs


def summarise(config: str, sets: list[str], cfg, n: int, arms: dict[str, list[str]],
              runs: dict[str, list[dict]]) -> dict:
    """Means, ranges and learner ÷ bare ratios (each learner run against the bare run of its repeat)."""
    h = cfg.inner.steps_per_outer
    steps = n * h
    bare = runs["bare"]
    bare_tps = [b["tokens_per_second"] for b in bare]
    one_eval = statistics.mean(b["one_eval_seconds"] for b in bare)
    out = {"config": config, "overrides": sets, "steps_per_outer": h, "outer_steps": n, "inner_steps": steps,
           "batch_size": cfg.inner.batch_size, "seq_len": cfg.model.seq_len, "parameters": bare[0]["parameters"],
           "tokenizer": cfg.data.tokenizer or "bytes", "model": cfg.model.path or "built-in byte GPT",
           "bare": {"tokens_per_second": _stats(bare_tps), "one_eval_seconds": one_eval, "runs": bare},
           "arms": {}}
    for arm in arms:
        rs = runs[arm]
        # Ratios pair each learner run with the bare run of the same repeat (same machine state).
        whole = [x["tokens_per_second"] / b for x, b in zip(rs, bare_tps, strict=True)]
        compute = [x["compute_tokens_per_second"] / b for x, b in zip(rs, bare_tps, strict=True)]
        other = [x["train_seconds"] - x["compute_seconds"] - x["wait_seconds"] for x in rs]
        best = max(x["tokens_per_second"] for x in rs) / max(bare_tps)
        best_compute = max(x["compute_tokens_per_second"] for x in rs) / max(bare_tps)
        evals = statistics.mean(x["evals_in_loop"] for x in rs)
        out["arms"][arm] = {
            "extra_overrides": arms[arm][len(sets):],
            "tokens_per_second": _stats([x["tokens_per_second"] for x in rs]),
            "compute_tokens_per_second": _stats([x["compute_tokens_per_second"] for x in rs]),
            "ratio_whole_loop": _stats(whole), "ratio_compute_only": _stats(compute),
            # Best of the repeats on each side: the runs least slowed by whatever else the machine ran.
            "ratio_whole_loop_best": best, "ratio_compute_only_best": best_compute,
            # Inside one process, so nearly free of the machine's load: the whole-loop ratio is this
            # share times the compute-only ratio.
            "compute_share": _stats([x["compute_seconds"] / x["train_seconds"] for x in rs]),
            "train_seconds": _stats([x["train_seconds"] for x in rs]),
            "compute_seconds": _stats([x["compute_seconds"] for x in rs]),
            "wait_seconds": _stats([x["wait_seconds"] for x in rs]),
            "other_seconds": _stats(other),
            "evals_in_loop": evals, "evals_seconds_estimated": evals * one_eval,
            "runs": rs,
        }
    return out


def table(results: list[dict]) -> str:
    """One row per learner arm: best-of-repeats tokens/s and ratios, the paired ratios' mean and range, and
    the learner's own split of its training loop."""
    lines = ["| model | learner arm | bare tokens/s, best (mean) | learner tokens/s, whole loop, best (mean) "
             "| ratio, best of each | ratio, paired runs: mean (range) | compute-only ratio, best of each "
             "| learner's compute / train time: mean (range) | learner s per run: train = compute + wait + other "
             "| evals in the loop (≈ s, from the bare eval time) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        b = r["bare"]["tokens_per_second"]
        for arm, a in r["arms"].items():
            label = arm + (f" ({', '.join(a['extra_overrides'])})" if a["extra_overrides"] else "")
            rw, cs, t = a["ratio_whole_loop"], a["compute_share"], a["tokens_per_second"]
            lines.append(
                f"| {Path(r['config']).stem} ({r['parameters']:,} params) | {label} "
                f"| {b['max']:,.0f} ({b['mean']:,.0f}) "
                f"| {t['max']:,.0f} ({t['mean']:,.0f}) | **{a['ratio_whole_loop_best']:.3f}** "
                f"| {rw['mean']:.3f} ({rw['min']:.3f}–{rw['max']:.3f}) | {a['ratio_compute_only_best']:.3f} "
                f"| {cs['mean']:.1%} ({cs['min']:.1%}–{cs['max']:.1%}) "
                f"| {a['train_seconds']['mean']:.2f} = {a['compute_seconds']['mean']:.2f} + "
                f"{a['wait_seconds']['mean']:.2f} + {a['other_seconds']['mean']:.2f} "
                f"| {a['evals_in_loop']:.0f} (≈ {a['evals_seconds_estimated']:.2f} s) |")
    return "\n".join(lines)


def machine() -> dict:
    """decoupled_bench's machine description, plus the load when the runs started (they share 2 cores)."""
    from decoupled_bench import machine as described

    return {**described(), "loadavg_at_start": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.bare_worker:
        return bare_worker(args)
    if args.from_workdir and not args.workdir:
        raise SystemExit("error: --from-workdir needs --workdir")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="trainer-overhead-"))
    work.mkdir(parents=True, exist_ok=True)
    res = {"started": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(),
           "command": " ".join([Path(sys.executable).name, *sys.argv]), "note": args.note, "results": []}
    if args.from_workdir:
        res["rebuilt_from_workdir"] = str(work)
    t0 = time.perf_counter()
    for config in [c.strip() for c in args.configs.split(",") if c.strip()]:
        res["results"].append(measure(args, config, work))
    res["total_wall_seconds"] = time.perf_counter() - t0
    res["table_markdown"] = table(res["results"])
    print("\n" + res["table_markdown"] + f"\n\ntotal wall {res['total_wall_seconds']:.0f} s", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
        print(f"results in {args.json}")
    leftovers = [x for r in res["results"] for a in r["arms"].values() for run in a["runs"]
                 for x in run["leftover_processes"]]
    if leftovers:
        print(f"leftover processes: {leftovers}", file=sys.stderr)
    if args.workdir is None and not leftovers:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if leftovers else 0


if __name__ == "__main__":
    sys.exit(main())
