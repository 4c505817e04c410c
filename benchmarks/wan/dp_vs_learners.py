"""WAN benchmark: time to a target eval loss, per-step data parallel vs our learners, over shaped links.

Two regions of two hosts each, joined by WAN links shaped with tbf (both directions, per region),
built with the same network namespaces as ``p2p-diloco regions`` (needs root). The same model
(byte-level GPT, 5.07M parameters: a 20.3 MB fp32 gradient per data-parallel step), the same data
shards and the same inner hyperparameters on both sides:

- **data parallel**: 4 gloo ranks (``benchmarks/wan/dp_worker.py``), one per host, every step's
  gradients all-reduced across the shaped links.
- **learners**: 4 ``p2p-diloco learner`` processes started by ``p2p-diloco regions`` (bootstrap node,
  DHT, butterfly all-reduce through the same links) with ``run.stop_at_eval_loss``: H = 50, P = 2
  fragments, τ = 20 overlap steps with the ``mix`` policy (progress made during the overlap is kept,
  not overwritten: τ is 40 % of a fragment's period here), int4 outer gradients, quorum 2, and the
  wall-clock schedule (slots shared by all learners; each fragment's round every
  ``period_seconds(rate)``: 20 s, ≈ H steps, or more on a link so slow that a round would not end
  before the next fragment's slot).
  With the steps schedule, the two learners of one region started a few seconds after the other two,
  missed the first group, and then spent their time downloading the state (≈ 40 MB over the WAN
  link, ≈ 10 s each) instead of contributing; they never got back in phase.

How each time to target is obtained:

- learners: **measured end to end**, from launching the swarm (start-up included) to the first log
  line where a learner's *global* model (its Θ, not its local weights) evaluates at or below the
  target; the start-up part (until the first learner evaluates its initial model) is reported too;
- data parallel: the arithmetic of per-step DP makes its loss curve independent of the link, so the
  script measures (1) the number of steps to reach the target in a reference run on loopback and
  (2) the median step time over the shaped links in a short run (``--dp-steps`` steps) with the same
  seeds, checks that the two runs' losses agree at the steps both evaluated, and reports
  steps × step time. It does not run data parallel to the target over a slow link (hours at 10 Mbit/s).

Bytes crossing region links are measured from the WAN links' qdisc counters (whole run for the
learners; per DP step, times the steps to target, for data parallel). Compute utilization is
compute time / (compute + all-reduce) for DP, and compute_seconds / train_seconds from the learners'
summaries.

    sudo .venv/bin/python benchmarks/wan/dp_vs_learners.py                     # 50, 10, 2 mbit
    sudo .venv/bin/python benchmarks/wan/dp_vs_learners.py --rates 20mbit --target-loss 2.6
    # learners only, data parallel's runs copied from earlier workdirs (its curve and step time do
    # not depend on our code):
    sudo .venv/bin/python benchmarks/wan/dp_vs_learners.py --rates 2mbit,10mbit --dp-from DIR [DIR ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from run import two_region_topology  # noqa: E402  (benchmarks/wan/run.py, beside this script)

from p2p_diloco.sim.local_swarm import lineage_verdict  # noqa: E402
from p2p_diloco.sim.processes import Proc, child_env, cli  # noqa: E402
from p2p_diloco.sim.regions import netns  # noqa: E402
from p2p_diloco.sim.regions.netns import Fabric, Host  # noqa: E402
from p2p_diloco.sim.regions.topology import Topology, rate_bits_per_second  # noqa: E402

CONFIG = ROOT / "peers" / "small-cpu.toml"
RESULTS = ROOT / "benchmarks" / "results" / "wan_dp_vs_learners.json"
MODEL = ["model.n_layer=2", "model.n_embd=448", "model.n_head=4", "model.seq_len=32", "inner.batch_size=8",
         "data.num_shards=4"]
LEARNERS = [
    "inner.steps_per_outer=50", "sync.fragments=2", "sync.overlap_steps=20", "sync.apply_policy=mix",
    "sync.schedule=clock",
    "averaging.compression=int4",
    "averaging.min_group_size=2", "averaging.target_group_size=4", "averaging.matchmaking_time=2.5",
    "averaging.request_timeout=1.0", "averaging.round_timeout=30.0", "averaging.allreduce_timeout=120.0",
    "averaging.next_chunk_timeout=60.0", "network.record_ttl=8.0", "run.linger_seconds=300.0", "run.log_every=50",
]
NO_GROUP = re.compile(r"outer round not committed \(.*(no group formed|could not find a group)")
STARTED = re.compile(r"^\s*(\S+) \| (\d\d:\d\d:\d\d) \S+ .*eval_loss [\d.]+ before training")
LINE_TIME = re.compile(r"^\s*\S+ \| (\d\d:\d\d:\d\d) ")
REACHED = re.compile(r"^\s*(\S+) \| (\d\d:\d\d:\d\d) \S+ .*global model eval_loss ([\d.]+) at version (\d+) "
                     r"\(target [\d.]+: reached\)")


def period_seconds(rate: str, fragments: int = 2) -> int:
    """Clock-schedule period: slots of different fragments at least two expected rounds apart.

    An int4 fragment round moves about 2.5 MB over a region's uplink here (measured: 1.4–2.0 MB sent
    per learner per round), after about 3 s of matchmaking. A learner whose round is still in flight
    at its next slot skips that slot and later has to download the fragment, which is expensive on a
    slow link.
    """
    expected_round = 3.0 + 2.5e6 * 8 / rate_bits_per_second(rate)
    return max(20, round(2 * fragments * expected_round))


def topology(rate: str, steps: int, work: Path) -> tuple[Path, Topology]:
    from p2p_diloco.config import read_toml

    path = work / f"topology-{rate}.toml"
    path.write_text(two_region_topology(rate, steps, run_id="wan-dp-vs-learners", net=78, config=CONFIG))
    return path, Topology.model_validate(read_toml(path))


# ------------------------------------------------------------------------------------------ data parallel


def run_dp(hosts: list[Host] | None, max_steps: int, target: float | None, eval_every: int, work: Path,
           name: str, timeout: float, max_seconds: float = 1e9) -> dict:
    """4 gloo ranks, in the hosts' namespaces (over the shaped links) or on loopback (hosts None)."""
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    world = len(hosts) if hosts else 4
    master = f"{hosts[0].addr}:29500" if hosts else "127.0.0.1:29500"
    procs: list[Proc] = []
    for r in range(world):
        cmd = [sys.executable, str(ROOT / "benchmarks" / "wan" / "dp_worker.py"), "--rank", str(r), "--world",
               str(world), "--master", master, "--iface", "eth0" if hosts else "lo", "--config", str(CONFIG),
               *[x for o in MODEL for x in ("--set", o)], "--max-steps", str(max_steps),
               "--max-seconds", str(max_seconds), "--eval-every", str(eval_every), "--out", str(out / f"rank-{r}.json")]
        if target is not None:
            cmd += ["--target-loss", str(target)]
        if hosts:
            cmd = ["ip", "netns", "exec", hosts[r].ns, *cmd]
        procs.append(Proc(f"rank-{r}", cmd, out / f"rank-{r}.log"))
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in procs:
        p.kill_group()
    if any(c != 0 for c in codes):
        raise RuntimeError(f"data-parallel run {name} failed: exit codes {codes}; see {out}")
    return dp_result(out)


def dp_result(out: Path) -> dict:
    """Figures of one data-parallel run, from rank 0's JSON file."""
    r0 = json.loads((out / "rank-0.json").read_text())
    # The first step includes gloo's connection set-up; short runs skip only that one.
    skip = min(2 if len(r0["step_seconds"]) > 5 else 1, len(r0["step_seconds"]) - 1)
    steps = r0["step_seconds"][skip:]
    return {
        "steps": r0["steps"], "num_params": r0["num_params"], "curve": r0["curve"],
        "step_seconds_median": statistics.median(steps),
        "allreduce_seconds_median": statistics.median(r0["comm_seconds"][skip:]),
        "compute_seconds_median": statistics.median(r0["compute_seconds"][skip:]),
        "utilization": sum(r0["compute_seconds"]) / max(1e-9, sum(r0["compute_seconds"]) + sum(r0["comm_seconds"])),
        "train_seconds": r0["train_seconds"],
    }


def steps_to_target(curve: list, target: float) -> int | None:
    return next((int(step) for step, loss, _ in curve if loss <= target), None)


def curves_agree(shaped: list, reference: list) -> float | None:
    """Largest |loss difference| at the steps both runs evaluated (None if they share none but step 0)."""
    ref = {int(s): loss for s, loss, _ in reference}
    diffs = [abs(loss - ref[int(s)]) for s, loss, _ in shaped if int(s) in ref and int(s) > 0]
    return max(diffs) if diffs else None


# ------------------------------------------------------------------------------------------------ learners


def _seconds_since(launched: datetime, hhmmss: str) -> float:
    t = datetime.combine(launched.date(), datetime.strptime(hhmmss, "%H:%M:%S").time())
    if t < launched - timedelta(hours=12):
        t += timedelta(days=1)
    return (t - launched).total_seconds()


# sync.pace = auto (--pace auto): one configuration for every link. The clock's period and τ follow the
# learners' measurements (p2p_diloco/core/pace.py), starting from the default 60 s (a period that starts short
# piles rounds up on a slow link before the first round is measured: at 2 Mbit/s from 20 s, one learner fell
# behind in the first minute and spent the run downloading); the default majority quorum (3 of 4), so that
# the region-local pairs never commit one version twice.
PACE_AUTO = ["sync.pace=auto", "sync.period_seconds=60", "sync.overlap_steps=0", "averaging.quorum=majority"]


def run_learners(rate: str, target: float, max_outer: int, work: Path, timeout: float,
                 change: tuple[str, float] | None = None) -> dict:
    """The learners' run over links at ``rate``; ``change``: (new rate, seconds after launch) for every WAN link."""
    d = work / (f"learners-{rate}" + ("" if change is None else f"-to-{change[0]}"))
    d.mkdir(parents=True, exist_ok=True)
    topo_path, _ = topology(rate, max_outer, d)
    auto = "sync.pace=auto" in LEARNERS
    period = [] if auto else [f"sync.period_seconds={period_seconds(rate)}"]
    cmd = cli("regions", "--topology", str(topo_path), "--workdir", str(d / "run"),
              *[x for o in [*MODEL, *LEARNERS, *period, f"run.stop_at_eval_loss={target}"] for x in ("--set", o)])
    t0 = time.monotonic()
    with (d / "regions.log").open("w") as log:
        # Not a Proc: in this session, a Ctrl+C reaches the supervisor too, which then removes its namespaces.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=child_env())
        try:
            if change is not None:
                try:
                    proc.wait(change[1])
                except subprocess.TimeoutExpired:
                    changed = change_rate(netns.run_prefix(proc.pid), change[0])
                    print(f"[learners {rate}] WAN links now {change[0]} ({changed} qdiscs changed) after "
                          f"{time.monotonic() - t0:.0f} s", flush=True)
            proc.wait(max(1.0, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            print(f"[learners {rate}] still running after {timeout:.0f} s: stopping them (SIGTERM)", flush=True)
            proc.terminate()  # the simulator stops its learners, writes the summary and tears down
            proc.wait(180)
    (d / "overrides.json").write_text(json.dumps(LEARNERS))
    return {**learners_result(d, rate), "exit_code": proc.returncode, "wall_seconds": round(time.monotonic() - t0, 1),
            "rate_change": None if change is None else {"to": change[0], "after_seconds": change[1]}}


def change_rate(prefix: str, rate: str) -> int:
    """Change the tbf rate of every WAN link end of the run whose namespaces start with ``prefix``
    (``tc qdisc change``, as a link slowing down mid-run); returns how many qdiscs were changed."""
    names = [n for n in netns.list_namespaces() if n.startswith(prefix)]
    ends = [(n, "wan0") for n in names if n.startswith(f"{prefix}gw-")]
    ends += [(f"{prefix}wan", f"gw-{n.removeprefix(f'{prefix}gw-')}") for n, _ in ends]
    for ns, dev in ends:
        for cmd in netns.shape_commands(dev, rate, verb="change"):
            netns.sh("tc", "-n", ns, *cmd)
    return len(ends)


def _round_counts(text: str) -> dict:
    """Rounds committed, not committed and without a group, and slots skipped, in a run's log ``text``."""
    return {
        # A round the learner stopped waiting for at τ ends later, in its own words (counted since 2026-12-05).
        "rounds_committed": len(re.findall(r"outer round committed|the round we stopped waiting for committed", text)),
        "rounds_not_committed": len(re.findall(r"outer round not committed|the round we stopped waiting for ended "
                                               r"without a commit", text)),
        # Ours says "no group formed" when the round window closes empty; hivemind's matchmaking, "could not find a
        # group" (the only one the runs of 2026-12-03 logged; this count missed it until 2026-12-03).
        "rounds_without_group": len(re.findall(NO_GROUP, text)),
        "slots_skipped": len(re.findall(r"skipped fragment \d+'s slot", text)),
    }


def learners_result(d: Path, rate: str) -> dict:
    """Figures of one learners' run, from its log and summaries. The launch time is the moment the
    topology file was written, just before ``p2p-diloco regions`` started."""
    launched = datetime.fromtimestamp(int((d / f"topology-{rate}.toml").stat().st_mtime))
    text = (d / "regions.log").read_text(errors="replace")
    reached = [(m.group(1), _seconds_since(launched, m.group(2)), float(m.group(3)), int(m.group(4)))
               for line in text.splitlines() if (m := REACHED.match(line))]
    summary = json.loads((d / "run" / "regions-summary.json").read_text())
    periods = sorted({float(m.group(1)) for m in re.finditer(r"round period now ([\d.]+) s", text)})
    learners = summary["learners"]
    overrides = json.loads(o.read_text()) if (o := d / "overrides.json").exists() else None
    first = min(reached, key=lambda r: r[1]) if reached else None
    started = [_seconds_since(launched, m.group(2)) for line in text.splitlines() if (m := STARTED.match(line))]
    # The whole run's rounds include those after the target, when finished learners leave and the last ones look
    # for groups that no longer form; the rounds up to the first learner at the target are the swarm at work.
    upto = "\n".join(line for line in text.splitlines() if first and (m := LINE_TIME.match(line))
                      and _seconds_since(launched, m.group(1)) <= first[1])
    return {
        # With sync.pace = auto the period starts at sync.period_seconds and follows the learners (periods_taken
        # lists those it took); period_seconds(rate) is the fixed pace's, and no period of an auto run.
        "rate": rate, "period_seconds": None if periods or "sync.pace=auto" in (overrides or LEARNERS)
        else period_seconds(rate),
        "periods_taken": periods,
        **_round_counts(text), "to_target": _round_counts(upto) if first else None,
        "time_to_target_seconds": first[1] if first else None,
        "startup_seconds": min(started) if started else None,
        "reached_by": first[0] if first else None, "version_at_target": first[3] if first else None,
        "eval_loss_at_target": first[2] if first else None,
        # Learners stop at the first version whose global model reaches the target, which can differ
        # between learners; the invariant is one state per fragment version.
        "one_state_per_version": lineage_verdict(list(learners.values()), "learners")[0],
        "versions": {k: s["version"] for k, s in learners.items()},
        "inner_steps": {k: s["inner_steps"] for k, s in learners.items()},
        "utilization": statistics.mean(s["compute_seconds"] / max(1e-9, s["train_seconds"]) for s in learners.values()),
        "step_seconds": statistics.mean(s["compute_seconds"] / max(1, s["inner_steps"]) for s in learners.values()),
        "wan_bytes": summary["links"],
        "log": str(d / "regions.log"),
        "learner_overrides": overrides,
    }


# ------------------------------------------------------------------------------------------------- report


def shaped_dp(dp: dict, links: dict, ref: dict, n_target: int | None) -> dict:
    dp["wan_bytes_per_step"] = max(v["up"] for v in links.values()) / dp["steps"]
    dp["loss_max_abs_diff_vs_reference"] = curves_agree(dp["curve"], ref["curve"])
    dp["time_to_target_seconds"] = n_target * dp["step_seconds_median"] if n_target else None
    return dp


def make_row(rate: str, dp: dict, ln: dict, n_target: int | None) -> dict:
    speedup = (dp["time_to_target_seconds"] / ln["time_to_target_seconds"]
               if dp["time_to_target_seconds"] and ln["time_to_target_seconds"] else None)
    return {"rate": rate, "dp": dp, "learners": ln, "speedup": speedup}


def _links(dp_dir: Path, work: Path, rate: str) -> dict:
    """The WAN byte counters of a shaped DP run: links.json, or (runs made before that file was written)
    the bytes per step the run printed to ``bench.out`` in its workdir, as {"region": {"up": bytes}}."""
    if (dp_dir / "links.json").exists():
        return json.loads((dp_dir / "links.json").read_text())
    m = re.search(rf"^\[dp {rate}\] .*?([\d.]+) MB per step out of a region", (work / "bench.out").read_text(), re.M)
    steps = json.loads((dp_dir / "rank-0.json").read_text())["steps"]
    return {"printed": {"up": float(m.group(1)) * 1e6 * steps}}


def reuse_dp(workdirs: list[Path], rates: list[str], work: Path) -> None:
    """Copy ``dp-reference`` and each rate's ``dp-<rate>`` from the first earlier workdir that has it."""
    for name in ["reference", *rates]:
        src = next((w / f"dp-{name}" for w in workdirs if (w / f"dp-{name}" / "rank-0.json").exists()), None)
        if src is None:
            raise SystemExit(f"error: no dp-{name} run in {', '.join(map(str, workdirs))}")
        shutil.copytree(src, work / f"dp-{name}", dirs_exist_ok=True)
        if name != "reference" and not (src / "links.json").exists():
            (work / f"dp-{name}" / "links.json").write_text(json.dumps(_links(src, src.parent, name)))


def rerender(workdirs: list[Path], target: float, out: str) -> int:
    ref = dp_result(workdirs[0] / "dp-reference")
    n_target = steps_to_target(ref["curve"], target)
    rows = []
    for w in workdirs:
        for d in sorted(w.glob("dp-*")):
            rate = d.name.removeprefix("dp-")
            if rate == "reference" or not (w / f"learners-{rate}" / "run" / "regions-summary.json").exists():
                continue
            dp = shaped_dp(dp_result(d), _links(d, w, rate), ref, n_target)
            rows.append(make_row(rate, dp, learners_result(w / f"learners-{rate}", rate), n_target))
    rows.sort(key=lambda r: -rate_bits_per_second(r["rate"]))
    report(rows, ref, n_target, target, out)
    return 0


def report(rows: list[dict], ref: dict, n_target: int | None, target: float, out: str) -> None:
    res = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, kernel {platform.release()}",
           "target_loss": target, "dp_reference": ref, "dp_steps_to_target": n_target,
           "model_overrides": MODEL, "learner_overrides": LEARNERS, "rows": rows}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"\n| WAN link (each way) | DP step s (all-reduce s) | DP time to {target} (s) | learners' time to "
          f"{target} (s) | speed-up | DP MB out of a region (to target) | learners' MB out of a region "
          "(whole run) | DP utilization | learners' utilization |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        dp, ln = r["dp"], r["learners"]
        dp_mb = dp["wan_bytes_per_step"] * n_target / 1e6 if n_target else None
        ln_mb = max(v["up"] for v in ln["wan_bytes"].values()) / 1e6 if ln["wan_bytes"] else None
        fmt = lambda x, s: "–" if x is None else format(x, s)  # noqa: E731
        print(f"| {r['rate']} | {dp['step_seconds_median']:.2f} ({dp['allreduce_seconds_median']:.2f}) | "
              f"{fmt(dp['time_to_target_seconds'], '.0f')} | {fmt(ln['time_to_target_seconds'], '.0f')} | "
              f"{fmt(r['speedup'], '.1f')}× | {fmt(dp_mb, ',.0f')} | {fmt(ln_mb, ',.1f')} | "
              f"{dp['utilization']:.1%} | {ln['utilization']:.1%} |")
    print(f"results in {out}")


def learners_only(a: argparse.Namespace, work: Path, change: tuple[str, float] | None) -> int:
    """Train the learners at each rate; their speed-up over data parallel's time given by --dp-time."""
    dp_time = {r: float(t) for r, _, t in (x.partition("=") for x in a.dp_time)}
    rows = []
    for rate in a.rates.split(","):
        ln = run_learners(rate, a.target_loss, a.max_outer_steps, work, a.learner_timeout, change)
        t, dp = ln["time_to_target_seconds"], dp_time.get(rate)
        rows.append({"rate": rate, "learners": ln, "dp_time_to_target_seconds": dp,
                     "speedup": dp / t if dp and t else None})
        print(f"[learners {rate}{'' if change is None else f' then {change[0]}'}] time to target {t} s (version "
              f"{ln['version_at_target']}), one state per version {ln['one_state_per_version']}; rounds "
              f"{ln['rounds_committed']} committed, {ln['rounds_not_committed']} not ({ln['rounds_without_group']} "
              f"without a group), {ln['slots_skipped']} slots skipped"
              + ("" if not (tt := ln["to_target"]) else f" (to the target: {tt['rounds_committed']} / "
                 f"{tt['rounds_not_committed']} / {tt['rounds_without_group']}, {tt['slots_skipped']} skipped)")
              + f"; periods {ln['periods_taken']}; "
              f"compute share {ln['utilization']:.1%}; speed-up "
              + (f"{rows[-1]['speedup']:.1f}×" if rows[-1]["speedup"] else "–"), flush=True)
        res = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, kernel {platform.release()}",
               "target_loss": a.target_loss, "model_overrides": MODEL, "learner_overrides": LEARNERS, "rows": rows}
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")  # after every rate: a sweep cut short keeps its rows
    print(f"results in {a.json}; logs in {work}")
    return 0


# -------------------------------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="50mbit,10mbit,2mbit")
    p.add_argument("--target-loss", type=float, default=2.6)
    p.add_argument("--dp-steps", type=int, default=10, help="data-parallel steps timed over each shaped link")
    p.add_argument("--dp-seconds", type=float, default=300.0,
                   help="fewer steps (at least 4) over a link where --dp-steps would take longer than this, "
                        "estimated from the bytes per step measured over the previous link")
    p.add_argument("--dp-max-steps", type=int, default=3000, help="cap of the loopback reference run")
    p.add_argument("--max-outer-steps", type=int, default=60, help="cap of the learners' run")
    p.add_argument("--learner-timeout", type=float, default=1500.0)
    p.add_argument("--workdir", default=None)
    p.add_argument("--from-workdirs", nargs="+", default=None, metavar="DIR",
                   help="do not train: rebuild the results from the workdirs of earlier runs (their dp-reference, "
                        "dp-<rate> and learners-<rate> folders) and print the table")
    p.add_argument("--dp-from", nargs="+", default=None, metavar="DIR",
                   help="do not run data parallel again: copy its reference and per-rate runs from the workdirs "
                        "of earlier runs (same model, seeds and links) and train the learners only")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra learner setting, after the built-in ones (repeatable)")
    p.add_argument("--pace", choices=["fixed", "auto"], default="fixed",
                   help="fixed: the clock's period chosen per rate by period_seconds(rate), τ = 20; auto: one "
                        "configuration for every rate (sync.pace = auto, majority quorum: PACE_AUTO)")
    p.add_argument("--change-rate", default=None, metavar="RATE@SECONDS",
                   help="change every WAN link to RATE this many seconds after the learners' launch (tc qdisc change)")
    p.add_argument("--learners-only", action="store_true",
                   help="no data parallel: train the learners only; speed-ups from --dp-time")
    p.add_argument("--dp-time", nargs="*", default=[], metavar="RATE=SECONDS",
                   help="with --learners-only: data parallel's time to the target at RATE, measured earlier")
    p.add_argument("--json", default=str(RESULTS))
    a = p.parse_args()
    if a.pace == "auto":
        LEARNERS.extend(PACE_AUTO)
    LEARNERS.extend(a.overrides)
    change = None
    if a.change_rate:
        to, _, after = a.change_rate.partition("@")
        rate_bits_per_second(to)
        change = (to, float(after))
    if a.from_workdirs:
        return rerender([Path(w) for w in a.from_workdirs], a.target_loss, a.json)
    if os.geteuid() != 0:
        print("error: needs root (network namespaces and tc)", file=sys.stderr)
        return 2
    netns.check_available()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="wan-dp-vs-learners-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"workdir {work}", flush=True)

    if a.learners_only:
        return learners_only(a, work, change)
    if a.dp_from:
        reuse_dp([Path(w) for w in a.dp_from], a.rates.split(","), work)
    ref = (dp_result(work / "dp-reference") if a.dp_from
           else run_dp(None, a.dp_max_steps, a.target_loss, 10, work, "dp-reference", timeout=3600))
    n_target = steps_to_target(ref["curve"], a.target_loss)
    print(f"[dp reference, loopback] {ref['num_params']:,} params; target {a.target_loss} reached at step "
          f"{n_target}; step {ref['step_seconds_median']:.3f}s", flush=True)
    rows = []
    bytes_per_step = None
    for rate in a.rates.split(","):
        dp_steps = a.dp_steps
        if bytes_per_step:
            estimate = bytes_per_step * 8 / rate_bits_per_second(rate) + ref["step_seconds_median"]
            dp_steps = max(4, min(a.dp_steps, int(a.dp_seconds / estimate)))
        if a.dp_from:
            dp, links = dp_result(work / f"dp-{rate}"), _links(work / f"dp-{rate}", work, rate)
        else:
            _, topo = topology(rate, a.max_outer_steps, work)
            fabric = Fabric(topo, netns.run_prefix(), netem=False)
            try:
                hosts = fabric.build()[1:]
                dp = run_dp(hosts, dp_steps, None, 10, work, f"dp-{rate}", timeout=3600)
                links = fabric.link_bytes()
            finally:
                fabric.teardown()
            (work / f"dp-{rate}" / "links.json").write_text(json.dumps(links))
        dp = shaped_dp(dp, links, ref, n_target)
        bytes_per_step = dp["wan_bytes_per_step"]
        print(f"[dp {rate}] step {dp['step_seconds_median']:.2f}s (all-reduce {dp['allreduce_seconds_median']:.2f}s), "
              f"{dp['wan_bytes_per_step'] / 1e6:.1f} MB per step out of a region; time to target "
              f"{dp['time_to_target_seconds']}", flush=True)
        ln = run_learners(rate, a.target_loss, a.max_outer_steps, work, a.learner_timeout, change)
        print(f"[learners {rate}] time to target {ln['time_to_target_seconds']} s (version "
              f"{ln['version_at_target']}), one state per version {ln['one_state_per_version']}", flush=True)
        rows.append(make_row(rate, dp, ln, n_target))

    report(rows, ref, n_target, a.target_loss, a.json)
    print(f"results in {a.json}; logs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
