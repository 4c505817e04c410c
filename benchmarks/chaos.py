"""Chaos benchmark: goodput of a swarm whose learners are killed and restarted at random moments.

M real learners (own processes, own p2pd) train for a fixed wall time on loopback while a seeded
chaos loop SIGKILLs a random live learner's whole process group, with exponentially distributed
gaps (mean ``--mtbf / M`` for the swarm, i.e. ``--mtbf`` per learner), and restarts it with
``--resume`` after ``--downtime`` seconds. The same seeded schedule is replayed for each mode:

- ``decoupled``: P = 2 fragments at wall-clock slots, rounds overlapped with τ = 25 inner steps,
  quorum K = 2: the survivors keep merging, a restarted learner re-integrates.
- ``sync``: plain synchronous DiLoCo: one fragment, no overlap, and every round waits for all M
  learners (K = M), so a dead learner stalls the others until it is back.
- ``clean``: ``decoupled`` without failures (its failure-free goodput, and one end of the loss comparison).
- ``clean-matched``: ``clean`` again, stopped early: its wall time is cut so that it merges about as many
  tokens as the ``decoupled`` run did (needs both earlier in ``--modes``); the other end of the loss comparison.
  Only the decoupled mode gets this comparison (the issue's loss target is the decoupled mode's).
- ``sync-clean``: ``sync`` without failures (its failure-free goodput, for the per-kill cost).

Goodput = Σ over learners of (inner steps that reached the global model × that learner's seconds per
inner step) / (M × wall time): the fraction of learner-seconds whose work was merged. Killed time,
time blocked waiting for a group and steps lost since the last checkpoint all count as lost.
At the end every learner gets SIGTERM at the same moment and stops training; in their parting
rounds (``run.drain_seconds``) they merge the steps taken since their last round with each other.
Only learner 0 evaluates during the run (every 4th outer step), as one evaluator would.
``goodput_after_start`` divides the same merged work by the learner-seconds after each learner's
first start-up (process start to its first inner step, the same in every mode and paid once in a
long run); restarts after a kill still count in full. Cost per kill = (the mode's failure-free
goodput − its goodput) × M × wall time / failures, in learner-seconds; ``cost_per_kill_live_learner_seconds``
the same with live goodput and live learner-seconds (the dead learner's downtime left out).

``goodput_live`` divides the same merged work by the learner-seconds in which learners were alive:
a killed learner's downtime (kill to restart) leaves the denominator, in both modes, and is reported
on its own (``downtime_learner_seconds``). Restart and start-up time stay in it (the learner is
alive, and not training). ``reintegration_seconds`` lists, per restart, the seconds from the restart
to the restarted learner's first committed round (its steps reach the model again; None: never).
``goodput_never_killed`` is the goodput of the learners that no kill hit: in ``decoupled`` a failure should
cost them nothing (compare ``clean``); in ``sync`` every kill stalls them too.
``goodput_live_after_start`` also leaves each learner's first start-up (launch to its first inner step, paid
once per run: 3.4-4.0% of a 180 s run on 2 cores on 480c80e) out of the live seconds: the live goodput of a long run.

Loss at equal merged tokens: a run's final eval loss is its learners' global model (both fragments) evaluated
as they leave, after their parting rounds, at the run's final global tokens T. The failure-free loss at the
``decoupled`` run's T is read off the line through the final (tokens, loss) points of ``clean`` and
``clean-matched``, which bracket T or end near it (``clean_eval_at_same_tokens``; ``eval_vs_clean`` is the
relative difference). The same evaluation at the same moment of each run: learner 0's evals during the run
are of its local model, which runs ahead of the global one by up to a round's steps.

``--extra-step-seconds S`` slows every inner step by S seconds of sleep, so that more learners fit
on few cores; ``real_compute_share`` says how much of a step was computing.

    python benchmarks/chaos.py --learners 4 --duration 150 --mtbf 60 --seed 0 --json benchmarks/results/chaos.json

``--short`` is the test suite's run (tests/integration/test_chaos_short.py): M = 4, one seed, 60 s per mode.

``--plot [PATH]`` draws each mode's learners from their audit logs (``p2p-diloco plot``); a killed and
restarted learner is one line, its restarts visible as gaps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import add_plot_argument, draw  # noqa: E402

from p2p_diloco.sim.local_swarm import fragment_states  # noqa: E402
from p2p_diloco.sim.processes import LOOPBACK_ANY_PORT, Proc, cli, start_bootstrap, stop_procs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMALL = str(ROOT / "peers" / "small-cpu.toml")
COMMON = [
    "--set", "model.n_embd=128", "--set", "inner.steps_per_outer=60", "--set", "averaging.matchmaking_time=2.5",
    "--set", "averaging.request_timeout=1.0", "--set", "averaging.next_chunk_timeout=5.0",
    # An all-reduce takes under 1 s here; a groupmate killed before sending anything would otherwise
    # hold the round (and, at τ, its learners) for the default 120 s.
    "--set", "averaging.allreduce_timeout=10.0",
    "--set", "network.record_ttl=8.0", "--set", "run.linger_seconds=0", "--set", "run.log_every=1000",
    # A checkpoint every 2 s (about 10 inner steps; a background write of this model takes milliseconds)
    # besides the ones at merges: a kill loses at most 2 s of steps, in every mode alike.
    "--set", "run.checkpoint_every_seconds=2.0",
]
# An eval costs about 3 inner steps. Learner 0 evaluates every 4th outer step (about once a minute,
# for the loss-at-equal-tokens comparison), as one evaluator would in a real run; the others never
# do during the run (their learner-seconds all go to training) and evaluate once when they leave.
EVAL = {True: ["--set", "run.eval_every=4"], False: ["--set", "run.eval_every=1000000"]}
# Decoupled: two fragments on the wall-clock schedule (each fragment's round every 15 s, ≈ H steps,
# at slots shared by all learners, so a restarted learner is back in phase at its next slot), each
# round overlapped with τ = 25 inner steps with local progress kept (mix), quorum K = 2 alone
# (averaging.quorum = fixed, as in every chaos run in BENCHMARKS.md; the default is a majority since
# 2026-12-03); a group closes at once when all M learners are in it, else after matchmaking_time.
# A round still running 2 s past τ (a groupmate died in it) is left to end on its own while the
# learner trains on (sync.max_wait_seconds; a healthy round here ends within τ).
DECOUPLED = ["--set", "sync.fragments=2", "--set", "sync.overlap_steps=25", "--set", "sync.apply_policy=mix",
             "--set", "sync.schedule=clock", "--set", "sync.period_seconds=15", "--set", "sync.max_wait_seconds=2.0",
             "--set", "averaging.min_group_size=2", "--set", "averaging.quorum=fixed",
             "--set", "averaging.round_timeout=10.0"]
MODES = {"decoupled": DECOUPLED, "clean": DECOUPLED, "clean-matched": DECOUPLED}
FAILURE_FREE = {"decoupled": "clean", "sync": "sync-clean"}
READY = re.compile(r"eval_loss \d+\.\d+ before training")
BACK = re.compile(r"outer round committed \| version")  # a restarted learner's steps reach the model again


def sync_mode(m: int) -> list[str]:
    """Plain synchronous DiLoCo: one fragment, no overlap, every round waits for all M learners."""
    return ["--set", "sync.fragments=1", "--set", "sync.overlap_steps=0", "--set", f"averaging.min_group_size={m}",
            "--set", "averaging.round_timeout=300.0"]


def failure_schedule(seed: int, m: int, mtbf: float, duration: float) -> list[tuple[float, int]]:
    """(time, learner) pairs: when to kill which learner (if it is alive then)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(m / mtbf)
        if t >= duration:
            return out
        out.append((t, rng.randrange(m)))


class LiveTime:
    """Learner-seconds alive: each learner is alive from its (re)start to its kill or the end of the run."""

    def __init__(self, m: int) -> None:
        self.since: dict[int, float] = {i: 0.0 for i in range(m)}  # alive learner → when its process started
        self.seconds = [0.0] * m

    def killed(self, i: int, now: float) -> None:
        if i in self.since:
            self.seconds[i] += now - self.since.pop(i)

    def restarted(self, i: int, now: float) -> None:
        self.since.setdefault(i, now)

    def total(self, end: float) -> float:
        return sum(self.seconds) + sum(max(0.0, end - t) for t in self.since.values())


def run_mode(mode: str, m: int, duration: float, schedule, downtime: float, work: Path,
             extra_step: float = 0.0) -> dict:
    if work.exists() and any(work.iterdir()):
        # Learners start with --resume and summaries are read back: an old run's files would leak in.
        raise SystemExit(f"error: {work} is not empty (an earlier run's checkpoints would be resumed)")
    work.mkdir(parents=True, exist_ok=True)
    boot, peers = start_bootstrap(work)
    extra = [*(sync_mode(m) if mode.startswith("sync") else MODES[mode]), "--set", f"averaging.target_group_size={m}",
             "--set", f"inner.extra_step_seconds={extra_step}"]

    def start(i: int) -> Proc:
        # Appended: a restart keeps its killed predecessor's lines, which the statistics below count.
        return Proc(f"learner-{i}", cli(
            "learner", "--config", SMALL, "--initial-peers", peers, "--host-maddrs", LOOPBACK_ANY_PORT,
            "--shard-index", str(i), "--num-shards", str(m), "--checkpoint-dir", str(work / f"ckpt-{i}"),
            "--resume", "--summary", str(work / f"summary-{i}.json"), *COMMON, *EVAL[i == 0], *extra,
        ), work / f"learner-{i}.log", append=True)

    learners = [start(i) for i in range(m)]
    restarts: list[tuple[float, int]] = []
    failures = 0
    killed: set[int] = set()  # learners killed at least once
    t0 = time.monotonic()
    pending = list(schedule) if "clean" not in mode else []
    startup: dict[int, float] = {}  # learner → end of its first start-up (first inner step, or its first kill)
    live = LiveTime(m)
    comebacks: list[dict] = []  # per restart: learner, when, where its log went on, when it was back
    try:
        while (now := time.monotonic() - t0) < duration:
            for i in set(range(m)) - set(startup):
                if READY.search(learners[i].text()):
                    startup[i] = now
            while pending and pending[0][0] <= now:
                _, i = pending.pop(0)
                startup.setdefault(i, now)
                if learners[i].alive():
                    learners[i].kill_group()
                    live.killed(i, now)
                    failures += 1
                    killed.add(i)
                    restarts.append((now + downtime, i))
            for when, i in list(restarts):
                if when <= now:
                    restarts.remove((when, i))
                    comebacks.append({"learner": i, "at": now, "offset": len(learners[i].text()), "back": None})
                    learners[i] = start(i)
                    live.restarted(i, now)
            for c in comebacks:
                if c["back"] is None and BACK.search(learners[c["learner"]].text()[c["offset"]:]):
                    c["back"] = now
            time.sleep(0.2)
    finally:
        stop_procs(learners, grace=40)
        stop_procs([boot], grace=10)
    wall = time.monotonic() - t0
    summaries = []
    for i in range(m):
        path = work / f"summary-{i}.json"
        summaries.append(json.loads(path.read_text()) if path.exists() else None)
    result = evaluate(mode, m, wall, duration, failures, summaries, work, killed)
    useful = result["goodput"] * m * duration  # learner-seconds of merged work
    after_start = sum(duration - startup.get(i, duration) for i in range(m))
    result["startup_seconds"] = [round(startup[i], 1) if i in startup else None for i in range(m)]
    result["goodput_after_start"] = useful / after_start if after_start else None
    live_seconds = live.total(duration)
    result["live_learner_seconds"] = round(live_seconds, 1)
    result["downtime_learner_seconds"] = round(m * duration - live_seconds, 1)
    result["goodput_live"] = useful / live_seconds if live_seconds else None
    result["goodput_live_after_start"] = live_after_start(useful, live_seconds,
                                                          [startup.get(i, duration) for i in range(m)])
    result["reintegration_seconds"] = [None if c["back"] is None else round(c["back"] - c["at"], 1)
                                       for c in comebacks]
    result["extra_step_seconds"] = extra_step
    step = result["seconds_per_step"]
    result["real_compute_share"] = (step - extra_step) / step if step else None
    return result


def live_after_start(useful: float, live_seconds: float, first_startups: list[float]) -> float | None:
    """Merged work over the live learner-seconds after each learner's first start-up: what live goodput tends
    to in a run long enough for the one start-up to weigh nothing. A learner killed during its first start-up
    ends it there (``first_startups`` holds the kill's time): those seconds were live, the rest is downtime."""
    rest = live_seconds - sum(first_startups)
    return useful / rest if rest > 0 else None


def _counters(work: Path, i: int, summary: dict | None) -> dict | None:
    """A learner's final counters: its summary, or (killed at the end) its last checkpoint's."""
    if summary is not None:
        return summary
    ckpt = work / f"ckpt-{i}" / "latest.pt"
    if not ckpt.exists():
        return None
    import torch

    c = torch.load(ckpt, map_location="cpu", weights_only=True)["counters"]
    return {"steps_merged": c["steps_merged"], "compute_seconds": c["compute_seconds"],
            "inner_steps": c["inner_steps"]}


def _useful(c: dict | None) -> float:
    """Learner-seconds of a learner's work that reached the global model (its merged steps × seconds per step)."""
    return c["steps_merged"] * c["compute_seconds"] / c["inner_steps"] if c and c["inner_steps"] else 0.0


def never_killed_goodput(useful: list[float], killed: set[int], duration: float) -> float | None:
    """Goodput of the learners no kill hit (``useful``: each learner's merged learner-seconds), over their own
    time: what the others' failures cost the learners that kept running. None if every learner was killed."""
    spared = [u for i, u in enumerate(useful) if i not in killed]
    return sum(spared) / (len(spared) * duration) if spared else None


def evaluate(mode, m, wall, duration, failures, summaries, work: Path, killed: set[int]) -> dict:
    merged = computed = compute_seconds = 0.0
    useful = [0.0] * m
    for i, s in enumerate(summaries):
        c = _counters(work, i, s)
        if c and c["inner_steps"]:
            useful[i] = _useful(c)
            merged += c["steps_merged"]
            computed += c["inner_steps"]
            compute_seconds += c["compute_seconds"]
    valid = [s for s in summaries if s]
    top = max((s["version"] for s in valid), default=0)
    # One lineage: learners holding the same version of a fragment hold the same bytes of it.
    lineages = max(map(len, fragment_states(valid).values()), default=1)
    losses = [s["last_eval_loss"] for s in valid]
    reintegrations = sum(len(re.findall(r"synced global state", (work / f"learner-{i}.log").read_text()))
                         for i in range(m))
    return {
        "mode": mode, "learners": m, "wall_seconds": round(wall, 1), "failures": failures,
        "goodput": sum(useful) / (m * duration), "goodput_never_killed": never_killed_goodput(useful, killed, duration),
        "merged_fraction_of_computed_steps": merged / max(computed, 1),
        "version": top, "lineages": lineages,
        "nan": any(not math.isfinite(x) for x in losses),
        "final_eval_loss": min(losses) if losses else None,
        "global_tokens": max((s["global_tokens"] for s in valid), default=0),
        "reintegrations": reintegrations,
        "summaries_missing": sum(s is None for s in summaries),
        "seconds_per_step": compute_seconds / computed if computed else None,
    }



def matched_duration(duration: float, clean: dict, tokens: int) -> float:
    """Wall time in which a failure-free run merges about ``tokens``: its global tokens grow at a steady
    rate after its learners' start-up (``clean``: the full-length failure-free run)."""
    start = max((x for x in clean["startup_seconds"] if x is not None), default=0.0)
    share = min(1.0, tokens / clean["global_tokens"]) if clean["global_tokens"] > 0 else 1.0
    return start + (duration - start) * share


def loss_at_tokens(points: list[tuple[int, float]], tokens: int) -> float | None:
    """The loss at ``tokens`` on the line through two (tokens, loss) points: read between them, or past the
    nearer one when ``tokens`` lies outside (None without two distinct token counts)."""
    (t0, l0), (t1, l1) = sorted(points)
    if t0 == t1:
        return None
    return l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--duration", type=float, default=150.0, help="seconds of training per mode")
    ap.add_argument("--mtbf", type=float, default=60.0, help="mean seconds between failures of one learner")
    ap.add_argument("--downtime", type=float, default=10.0, help="seconds before a killed learner restarts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extra-step-seconds", type=float, default=0.0,
                    help="sleep this long in every inner step (inner.extra_step_seconds), to fit more learners")
    ap.add_argument("--modes", default="decoupled,sync,clean,clean-matched,sync-clean")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--workdir", help="keep the logs and checkpoints here (default: a temporary directory)")
    ap.add_argument("--short", action="store_true",
                    help="the test suite's short mode: 4 learners, 60 s per mode, decoupled and sync only, two kills "
                         "(seed 0: at 37 s and 48 s); checks that both goodput figures come out, not their values")
    add_plot_argument(ap, "chaos")
    args = ap.parse_args()
    if args.short:
        args.learners, args.duration, args.mtbf, args.downtime, args.modes = 4, 60.0, 80.0, 8.0, "decoupled,sync"
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in {*MODES, "sync", "sync-clean"}]:
        ap.error(f"unknown mode(s) {', '.join(unknown)}")
    if "clean-matched" in modes and not {"decoupled", "clean"} <= set(modes[:modes.index("clean-matched")]):
        ap.error("--modes: clean-matched follows decoupled and clean (it is cut to the tokens the first merged, "
                 "at the second's rate)")
    schedule = failure_schedule(args.seed, args.learners, args.mtbf, args.duration)
    print(f"failure schedule (seed {args.seed}): {[(round(t, 1), i) for t, i in schedule]}", flush=True)
    results = []
    workdir = contextlib.nullcontext(args.workdir) if args.workdir else tempfile.TemporaryDirectory(prefix="chaos-")
    with workdir as tmp:
        by_mode: dict[str, dict] = {}
        for mode in modes:
            duration = args.duration
            if mode == "clean-matched":
                duration = matched_duration(args.duration, by_mode["clean"], by_mode["decoupled"]["global_tokens"])
            print(f"running {mode} ({duration:.0f} s) ...", flush=True)
            r = run_mode(mode, args.learners, duration, schedule, args.downtime, Path(tmp) / mode,
                         args.extra_step_seconds)
            by_mode[mode] = r
            results.append(r)
            print(json.dumps(r), flush=True)
            if args.plot:
                draw(Path(tmp) / mode, args.plot, mode, f"chaos: {mode}, {args.learners} learners, "
                     f"{r['failures']} kills in {duration:.0f} s (seed {args.seed})")
        for r in results:
            free = by_mode.get(FAILURE_FREE.get(r["mode"], ""))
            if free and r["failures"]:
                r["cost_per_kill_learner_seconds"] = (free["goodput"] - r["goodput"]) * r["learners"] * \
                    args.duration / r["failures"]
                # The same over live time: what a kill costs besides the dead learner's downtime.
                r["cost_per_kill_live_learner_seconds"] = (free["goodput_live"] - r["goodput_live"]) * \
                    r["live_learner_seconds"] / r["failures"]
        decoupled, ends = by_mode.get("decoupled"), [by_mode.get("clean"), by_mode.get("clean-matched")]
        if decoupled and all(e and e["final_eval_loss"] is not None for e in [decoupled, *ends]):
            points = [(e["global_tokens"], e["final_eval_loss"]) for e in ends]
            clean_loss = loss_at_tokens(points, decoupled["global_tokens"])
            decoupled["clean_points"] = points
            # Read past the nearer end, not between the two (the matched run stopped a little long or short).
            decoupled["clean_extrapolated"] = not min(t for t, _ in points) <= decoupled["global_tokens"] <= max(
                t for t, _ in points)
            decoupled["clean_eval_at_same_tokens"] = clean_loss
            decoupled["eval_vs_clean"] = None if clean_loss is None else decoupled["final_eval_loss"] / clean_loss - 1
    print("\n| mode | learners | failures | goodput | after start-up | live goodput | live after start-up | "
          "never killed | downtime (learner-s) | "
          "cost per kill (learner-s) | merged / computed steps | version | lineages | NaN | eval loss | "
          "clean eval @ same tokens (difference) | re-integrations | restart to first commit (s) | "
          "real compute per step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ce, cost = r.get("clean_eval_at_same_tokens"), r.get("cost_per_kill_learner_seconds")
        past = ", past an end" if r.get("clean_extrapolated") else ""
        ce_text = "-" if ce is None else f"{ce:.4f} ({r['eval_vs_clean']:+.1%}{past})"
        loss = "-" if r["final_eval_loss"] is None else f"{r['final_eval_loss']:.4f}"
        back = ", ".join("never" if x is None else f"{x:g}" for x in r["reintegration_seconds"]) or "-"
        print(f"| {r['mode']} | {r['learners']} | {r['failures']} | {r['goodput']:.1%} | "
              f"{_pct(r['goodput_after_start'])} | {_pct(r['goodput_live'])} | "
              f"{_pct(r['goodput_live_after_start'])} | {_pct(r['goodput_never_killed'])} | "
              f"{r['downtime_learner_seconds']:.0f} | "
              f"{'-' if cost is None else f'{cost:.0f}'} | "
              f"{r['merged_fraction_of_computed_steps']:.1%} | {r['version']} | {r['lineages']} | {r['nan']} | "
              f"{loss} | {ce_text} | {r['reintegrations']} | "
              f"{back} | {_pct(r['real_compute_share'])} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
