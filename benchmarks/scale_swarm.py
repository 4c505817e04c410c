"""Swarm size: M real learners on loopback, and how rounds, memory and DHT traffic grow with M.

For each M in ``--learners`` a bootstrap node and M learners (own processes, own p2pd; the small
config with inner steps slowed by ``--extra-step-seconds`` so that many fit on few cores) train to
``--outer-steps`` versions, all with ``averaging.target_group_size = M``. While they run, the
memory of each learner (over its process group: learner, DHT and averager processes, p2pd; RSS,
PSS and USS, see ``memory_by_group``) and the machine's memory in use are sampled every
``--sample-seconds``. Afterwards their audit logs and summaries say:

- **rounds**: each (fragment, version) some learner committed, with the largest group that committed
  it; *full* when every learner was in that group (no learner is killed here, so all are live);
- **matchmaking** and **round** time of each committed round as its members logged them (matchmaking
  = round − all-reduce − certificate: from the round's start until its group had formed and agreed);
- **DHT** calls (made and served) and protobuf bytes (out and in) per learner per version, from the
  DHT process's own counts (p2p_diloco/net/traffic.py);
- **one state per fragment version** at the end (the swarm command's check).

    python benchmarks/scale_swarm.py --learners 4 8 16 --outer-steps 6 --extra-step-seconds 0.1 \\
        --json benchmarks/results/scale_DATE_COMMIT.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from p2p_diloco.learner.audit import parse_line
from p2p_diloco.net.traffic import totals
from p2p_diloco.sim.local_swarm import fragment_states, read_summaries
from p2p_diloco.sim.processes import LOOPBACK_ANY_PORT, Proc, cli, start_bootstrap, stop_procs

ROOT = Path(__file__).resolve().parents[1]
SMALL = str(ROOT / "peers" / "small-cpu.toml")


def _kind(proc: psutil.Process, pgid: int) -> str:
    return "learner" if proc.pid == pgid else "p2pd" if proc.info["name"] == "p2pd" else "forks"


def memory_by_group(pgids: set[int], cpu: dict[int, dict[int, tuple[str, float]]] | None = None
                    ) -> dict[int, dict[str, int]]:
    """Memory of every process in each of the process groups ``pgids``, in one pass over the processes.

    Per group, in bytes: ``rss`` (resident, summed: pages the learner's forks share with it copy-on-write
    and the libraries every learner maps count once per process), ``pss`` (proportional: a page shared by
    n processes counts 1/n in each, so the groups' PSS add up to what they occupy together), ``uss``
    (pages of one process alone), and ``pss_learner``, ``pss_forks``, ``pss_p2pd`` by kind of process:
    ``learner`` (the group's leader), ``p2pd``, or ``forks`` (hivemind's DHT and averager processes).
    ``cpu``, if given, gets each process's CPU seconds so far (user + system) by group and pid, with its kind."""
    out = {g: dict.fromkeys(("rss", "pss", "uss", "pss_learner", "pss_forks", "pss_p2pd"), 0) for g in pgids}
    for proc in psutil.process_iter(["pid", "name"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            pgid = os.getpgid(proc.pid)
            if pgid in out:
                mem = proc.memory_full_info()
                kind = _kind(proc, pgid)
                out[pgid]["rss"] += mem.rss
                out[pgid]["pss"] += mem.pss
                out[pgid]["uss"] += mem.uss
                out[pgid][f"pss_{kind}"] += mem.pss
                if cpu is not None:
                    times = proc.cpu_times()
                    cpu.setdefault(pgid, {})[proc.pid] = (kind, times.user + times.system)
    return out


def used_bytes() -> int:
    """The machine's memory in use: total less what the kernel could hand out without swapping."""
    vm = psutil.virtual_memory()
    return vm.total - vm.available


def cpu_per_learner(cpu: dict[int, dict[int, tuple[str, float]]], learners: int) -> dict[str, float]:
    """Mean CPU seconds per learner by kind of process, from the last sample of each process."""
    out: dict[str, float] = {"learner": 0.0, "forks": 0.0, "p2pd": 0.0}
    for procs in cpu.values():
        for kind, seconds in procs.values():
            out[kind] += seconds / learners
    return out


def audit_events(ckpt: Path) -> list[dict]:
    path = ckpt / "audit.jsonl"
    if not path.exists():
        return []
    return [e for raw in path.read_bytes().splitlines() if (e := parse_line(raw))]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_size(m: int, args: argparse.Namespace, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    boot, peers = start_bootstrap(work)
    learners: list[Proc] = []
    mem: list[list[dict[str, int]]] = [[] for _ in range(m)]
    cpu: dict[int, dict[int, tuple[str, float]]] = {}
    used_before = used_bytes()  # the bootstrap node included: one per swarm, a few MB
    used_peak = used_before
    began = time.monotonic()
    try:
        for i in range(m):
            learners.append(Proc(f"learner-{i}", cli(
                "learner", "--config", SMALL, "--initial-peers", peers, "--host-maddrs", LOOPBACK_ANY_PORT,
                "--shard-index", str(i % 16), "--num-shards", "16", "--max-outer-steps", str(args.outer_steps),
                "--checkpoint-dir", str(work / f"ckpt-{i}"), "--summary", str(work / f"summary-{i}.json"),
                "--set", f"inner.extra_step_seconds={args.extra_step_seconds}",
                "--set", f"averaging.target_group_size={m}", "--set", f"run.linger_seconds={args.linger}",
                # One evaluator, as in a real run: the others train (each still evaluates once at the end).
                "--set", f"run.eval_every={1 if i == 0 else 1_000_000}",
                *[a for o in args.overrides for a in ("--set", o)],
            ), work / f"learner-{i}.log"))
        deadline = began + args.timeout
        next_sample = time.monotonic()
        while any(p.alive() for p in learners) and time.monotonic() < deadline:
            if time.monotonic() >= next_sample:
                next_sample += args.sample_seconds
                alive = {i: p.pid for i, p in enumerate(learners) if p.alive()}
                sampled = memory_by_group(set(alive.values()), cpu)
                for i, pgid in alive.items():
                    mem[i].append(sampled[pgid])
                used_peak = max(used_peak, used_bytes())
            time.sleep(0.5)
        timed_out = any(p.alive() for p in learners)
    finally:
        stop_procs(learners, grace=30)
        stop_procs([boot], grace=10)
    wall = time.monotonic() - began
    valid = [s for _, s in read_summaries({i: work / f"summary-{i}.json" for i in range(m)})]

    rounds: dict[tuple[int, int], int] = {}  # (fragment, version) → the largest group that committed it
    matchmaking, round_time, allreduce = [], [], []
    failed = 0
    for i in range(m):
        for e in audit_events(work / f"ckpt-{i}"):
            if e.get("event") == "committed":
                key = (int(e["fragment"]), int(e["version_after"]))
                rounds[key] = max(rounds.get(key, 0), int(e["group_size"]))
                round_time.append(float(e["round_seconds"]))
                allreduce.append(float(e["allreduce_seconds"]))
                matchmaking.append(max(0.0, float(e["round_seconds"]) - float(e["allreduce_seconds"])
                                       - float(e.get("certify_seconds", 0.0))))
            elif e.get("event") == "failed":
                failed += 1
    full = sum(g == m for g in rounds.values())
    versions = max((s["version"] for s in valid), default=0)
    per_round = max(1, versions)
    dht = [totals(s["dht_traffic"]) for s in valid if s.get("dht_traffic")]
    by_rpc: dict[str, float] = {}  # calls made and served per learner per version, by RPC
    for s in valid:
        for rpc, counts in s.get("dht_traffic", {}).items():
            calls = counts["calls_made"] + counts["calls_served"]
            by_rpc[rpc] = by_rpc.get(rpc, 0.0) + calls / len(valid) / per_round
    by_key: dict[str, float] = {}  # KB of finds and stores per learner per version, by kind of key
    for s in valid:
        for kind, counts in s.get("dht_traffic_by_key", {}).items():
            kb = (counts["bytes_out"] + counts["bytes_in"]) / 1024
            by_key[kind] = by_key.get(kind, 0.0) + kb / len(valid) / per_round
    peak = [max(r, key=lambda x: x["pss"]) for r in mem if r]  # each learner's sample of its largest PSS

    def mb(field: str, agg=statistics.fmean) -> float | None:
        return round(agg(p[field] for p in peak) / 2**20, 1) if peak else None
    split = [k for k, shas in fragment_states(valid).items() if len(shas) > 1]
    return {
        "learners": m, "wall_seconds": round(wall, 1), "timed_out": timed_out,
        "summaries_missing": m - len(valid), "exit_codes": [p.popen.returncode for p in learners],
        "version": versions, "rounds": len(rounds), "rounds_full": full,
        "full_fraction": full / len(rounds) if rounds else None,
        "group_sizes": sorted(rounds.values()), "rounds_failed_per_learner": failed / m,
        "matchmaking_seconds_mean": statistics.fmean(matchmaking) if matchmaking else None,
        "matchmaking_seconds_p90": _pct(matchmaking, 0.9),
        "round_seconds_mean": statistics.fmean(round_time) if round_time else None,
        "round_seconds_p90": _pct(round_time, 0.9),
        "allreduce_seconds_mean": statistics.fmean(allreduce) if allreduce else None,
        # At each learner's largest PSS sample: the old RSS sum beside PSS (its share of the machine), by kind.
        "rss_mb_per_learner_mean": mb("rss"), "rss_mb_per_learner_max": mb("rss", max),
        "pss_mb_per_learner_mean": mb("pss"), "pss_mb_per_learner_max": mb("pss", max),
        "uss_mb_per_learner_mean": mb("uss"),
        "pss_mb_per_learner_by_kind": {k: mb(f"pss_{k}") for k in ("learner", "forks", "p2pd")},
        # What the swarm added to the machine's memory in use at its peak, per learner (includes page cache
        # that cannot be dropped, and the shared libraries once for the whole swarm).
        "used_mb_per_learner": round((used_peak - used_before) / m / 2**20, 1),
        # CPU seconds per learner per version: under-counts processes that ended between two samples.
        "cpu_seconds_per_learner_per_version": {k: round(v / per_round, 2) for k, v in cpu_per_learner(cpu, m).items()},
        "dht_calls_per_learner_per_version": (statistics.fmean(d["calls_made"] + d["calls_served"] for d in dht)
                                              / per_round) if dht else None,
        "dht_calls_made_per_learner_per_version": (statistics.fmean(d["calls_made"] for d in dht) / per_round
                                                   if dht else None),
        "dht_kb_per_learner_per_version": (statistics.fmean(d["bytes_out"] + d["bytes_in"] for d in dht)
                                           / per_round / 1024) if dht else None,
        "dht_calls_per_learner_per_version_by_rpc": {k: round(v, 1) for k, v in sorted(by_rpc.items())},
        "dht_kb_per_learner_per_version_by_key": {k: round(v, 1) for k, v in sorted(by_key.items())},
        "lineage_splits": [f"fragment {f} version {v}" for f, v in sorted(split)],
        "states_at_end": len({s["global_state_sha256"] for s in valid}),
        "final_eval_loss": [round(s["last_eval_loss"], 4) for s in valid],
    }


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--outer-steps", type=int, default=6)
    ap.add_argument("--extra-step-seconds", type=float, default=0.1,
                    help="sleep in every inner step (inner.extra_step_seconds), so that many learners share the cores")
    ap.add_argument("--linger", type=float, default=20.0, help="run.linger_seconds: serve late learners this long")
    ap.add_argument("--sample-seconds", type=float, default=5.0, help="how often to sample each learner's memory")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per swarm size before the rest is stopped")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every learner (repeatable)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--workdir", help="keep logs, audit logs and summaries here (default: a temporary directory)")
    args = ap.parse_args()
    # SIGTERM (as `timeout` sends) unwinds like Ctrl+C: run_size's finally stops the learners it started.
    signal.signal(signal.SIGTERM, _interrupt)
    results = []
    workdir = contextlib.nullcontext(args.workdir) if args.workdir else tempfile.TemporaryDirectory(prefix="scale-")
    with workdir as tmp:
        for m in args.learners:
            print(f"running {m} learners ...", flush=True)
            r = run_size(m, args, Path(tmp) / f"m{m}")
            results.append(r)
            print(json.dumps(r), flush=True)
    print("\n| learners | versions | rounds | with every learner | failed rounds / learner | matchmaking s (mean, p90) "
          "| round s (mean, p90) | all-reduce s | RSS MB / learner (mean, max) | PSS MB / learner (mean, max) "
          "| machine MB / learner | DHT calls / learner / version "
          "| DHT KB / learner / version | CPU s / learner / version (learner, DHT and averager, p2pd) "
          "| states at end | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['learners']} | {r['version']} | {r['rounds']} | {_f(r['full_fraction'], '.0%')} | "
              f"{r['rounds_failed_per_learner']:.1f} | {_f(r['matchmaking_seconds_mean'], '.2f')}, "
              f"{_f(r['matchmaking_seconds_p90'], '.2f')} | {_f(r['round_seconds_mean'], '.2f')}, "
              f"{_f(r['round_seconds_p90'], '.2f')} | {_f(r['allreduce_seconds_mean'], '.2f')} | "
              f"{_f(r['rss_mb_per_learner_mean'], '.0f')}, {_f(r['rss_mb_per_learner_max'], '.0f')} | "
              f"{_f(r['pss_mb_per_learner_mean'], '.0f')}, {_f(r['pss_mb_per_learner_max'], '.0f')} | "
              f"{r['used_mb_per_learner']:.0f} | "
              f"{_f(r['dht_calls_per_learner_per_version'], '.0f')} | {_f(r['dht_kb_per_learner_per_version'], '.1f')} "
              f"| {', '.join(f'{v:.1f}' for v in r['cpu_seconds_per_learner_per_version'].values())} "
              f"| {r['states_at_end']} | {r['wall_seconds']:.0f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    sys.exit(0 if all(not r["lineage_splits"] and not r["timed_out"] for r in results) else 1)


if __name__ == "__main__":
    main()
