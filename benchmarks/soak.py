"""Soak: a few learners for an hour or more, and whether their memory, file descriptors or connections grow.

A bootstrap node and ``--learners`` learners (own processes, own p2pd; the small config, inner steps
slowed by ``--extra-step-seconds``) train on loopback for ``--minutes``, with no limit on outer steps,
and are then stopped with SIGTERM. Every ``--sample-seconds`` each learner's process group (learner,
DHT and averager processes, p2pd) is sampled for:

- resident memory (RSS, summed over the group),
- open file descriptors (summed over the group),
- TCP connections held by its p2pd (ESTABLISHED), and the learner's committed version.

Growth is measured from the first sample at or after ``--warmup-minutes`` (hivemind's and torch's
allocators and the DHT's routing tables fill during the first minutes) to the last sample, and also as
the largest value after warm-up over that first one: the issue's target is at most 5%.

    python benchmarks/soak.py --minutes 60 --json benchmarks/results/soak_DATE_COMMIT.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from p2p_diloco.sim.local_swarm import fragment_states, read_summaries
from p2p_diloco.sim.processes import LOOPBACK_ANY_PORT, Proc, cli, start_bootstrap, stop_procs

ROOT = Path(__file__).resolve().parents[1]
SMALL = str(ROOT / "peers" / "small-cpu.toml")
_COMMITTED = re.compile(r"outer round committed \| version (\d+)")


def sample_groups(pgids: set[int]) -> dict[int, dict[str, int]]:
    """RSS bytes, open descriptors and p2pd's established TCP connections of each process group, in one pass."""
    out = {g: {"rss": 0, "fds": 0, "p2pd_connections": 0, "processes": 0} for g in pgids}
    for proc in psutil.process_iter(["pid", "name"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            pgid = os.getpgid(proc.pid)
            if pgid not in out:
                continue
            row = out[pgid]
            row["rss"] += proc.memory_info().rss
            row["fds"] += proc.num_fds()
            row["processes"] += 1
            if "p2pd" in (proc.info["name"] or ""):
                row["p2pd_connections"] += sum(c.status == psutil.CONN_ESTABLISHED
                                               for c in proc.net_connections(kind="tcp"))
    return out


def last_committed(log: Path) -> int:
    """The last version this learner's log says it committed (0 if none yet)."""
    with contextlib.suppress(FileNotFoundError):
        found = _COMMITTED.findall(log.read_text(errors="replace"))
        if found:
            return int(found[-1])
    return 0


def growth(series: list[tuple[float, int]], warmup_s: float) -> dict[str, float | None]:
    """From the first sample at or after ``warmup_s`` to the last one: relative change, and the peak's excess."""
    after = [v for t, v in series if t >= warmup_s]
    if len(after) < 2 or after[0] == 0:
        return {"base": None, "end": None, "growth": None, "peak_over_base": None}
    return {"base": after[0], "end": after[-1], "growth": after[-1] / after[0] - 1,
            "peak_over_base": max(after) / after[0] - 1}


def run(args: argparse.Namespace, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    boot, peers = start_bootstrap(work)
    learners: list[Proc] = []
    samples: list[dict] = []
    began = time.monotonic()
    try:
        for i in range(args.learners):
            learners.append(Proc(f"learner-{i}", cli(
                "learner", "--config", SMALL, "--initial-peers", peers, "--host-maddrs", LOOPBACK_ANY_PORT,
                "--shard-index", str(i), "--num-shards", str(args.learners), "--max-outer-steps", "100000000",
                "--checkpoint-dir", str(work / f"ckpt-{i}"), "--summary", str(work / f"summary-{i}.json"),
                "--set", f"inner.extra_step_seconds={args.extra_step_seconds}",
                "--set", f"run.eval_every={args.eval_every}", "--set", "run.linger_seconds=0",
                *[a for o in args.overrides for a in ("--set", o)],
            ), work / f"learner-{i}.log"))
        end = began + args.minutes * 60
        next_sample = time.monotonic()
        while time.monotonic() < end:
            dead = [p.name for p in learners if not p.alive()]
            if dead:
                print(f"learner(s) exited before the end: {dead}", flush=True)
                break
            if time.monotonic() >= next_sample:
                next_sample += args.sample_seconds
                groups = sample_groups({p.pid for p in learners})
                t = time.monotonic() - began
                row = {"t": round(t, 1), "learners": [
                    {**groups[p.pid], "version": last_committed(work / f"learner-{i}.log")}
                    for i, p in enumerate(learners)]}
                samples.append(row)
                print(f"{t / 60:5.1f} min  " + "  ".join(
                    f"{r['rss'] / 2**20:.0f}MB/{r['fds']}fd/{r['p2pd_connections']}c/v{r['version']}"
                    for r in row["learners"]), flush=True)
            time.sleep(1.0)
        survived = all(p.alive() for p in learners)
    finally:
        stop_procs(learners, grace=60)
        stop_procs([boot], grace=10)
    wall = time.monotonic() - began
    valid = [s for _, s in read_summaries({i: work / f"summary-{i}.json" for i in range(args.learners)})]
    warmup = args.warmup_minutes * 60
    per_learner = []
    for i in range(args.learners):
        def series(key: str, i: int = i) -> list[tuple[float, int]]:
            return [(s["t"], s["learners"][i][key]) for s in samples]
        per_learner.append({key: growth(series(key), warmup) for key in ("rss", "fds", "p2pd_connections")})
    rss_growth = [g["rss"]["growth"] for g in per_learner if g["rss"]["growth"] is not None]
    rss_peak = [g["rss"]["peak_over_base"] for g in per_learner if g["rss"]["peak_over_base"] is not None]
    split = [k for k, shas in fragment_states(valid).items() if len(shas) > 1]
    return {
        "learners": args.learners, "minutes": args.minutes, "wall_seconds": round(wall, 1),
        "all_survived": survived, "exit_codes": [p.popen.returncode for p in learners],
        "summaries_missing": args.learners - len(valid),
        "versions_at_end": [s["version"] for s in valid], "rounds_failed": [s["rounds_failed"] for s in valid],
        "lineage_splits": [f"fragment {f} version {v}" for f, v in sorted(split)],
        "final_eval_loss": [round(s["last_eval_loss"], 4) for s in valid],
        "rss_growth_mean": statistics.fmean(rss_growth) if rss_growth else None,
        "rss_growth_max": max(rss_growth) if rss_growth else None,
        "rss_peak_over_base_max": max(rss_peak) if rss_peak else None,
        "per_learner": per_learner, "samples": samples,
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--warmup-minutes", type=float, default=10.0, help="growth is measured from here on")
    ap.add_argument("--sample-seconds", type=float, default=60.0)
    ap.add_argument("--extra-step-seconds", type=float, default=0.05,
                    help="sleep in every inner step (inner.extra_step_seconds), so the learners share the cores")
    ap.add_argument("--eval-every", type=int, default=20, help="run.eval_every: outer steps between evals")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every learner (repeatable)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--workdir", help="keep logs, audit logs and summaries here (default: a temporary directory)")
    args = ap.parse_args()
    workdir = contextlib.nullcontext(args.workdir) if args.workdir else tempfile.TemporaryDirectory(prefix="soak-")
    with workdir as tmp:
        r = run(args, Path(tmp))
    print(f"\n| learner | RSS MB at {args.warmup_minutes:g} min | RSS MB at end | RSS growth | RSS peak over base "
          "| fds (base, end) | p2pd connections (base, end) |")
    print("|---|---|---|---|---|---|---|")
    for i, g in enumerate(r["per_learner"]):
        rss, fds, conn = g["rss"], g["fds"], g["p2pd_connections"]
        mb = (lambda b: "-" if b is None else f"{b / 2**20:.0f}")  # noqa: E731
        print(f"| {i} | {mb(rss['base'])} | {mb(rss['end'])} | {_pct(rss['growth'])} | {_pct(rss['peak_over_base'])} "
              f"| {fds['base']}, {fds['end']} | {conn['base']}, {conn['end']} |")
    print(f"\nversions at end {r['versions_at_end']}, rounds failed {r['rounds_failed']}, "
          f"splits {r['lineage_splits'] or 'none'}, eval {r['final_eval_loss']}, all survived: {r['all_survived']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(r, indent=2))
    ok = r["all_survived"] and r["rss_growth_max"] is not None and r["rss_growth_max"] <= 0.05
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
