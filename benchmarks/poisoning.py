"""Poisoning: what one malicious or broken member does to three honest learners, with each defence.

Each run is a real swarm on loopback: a bootstrap node, three honest learners (``--honest``) and, except in the
clean runs, one more learner that carries out one attack from round 2 on (p2p_diloco/sim/faults.py):

=========  ======================================================================================
nan        its outer gradients are NaN (training that diverged)
scale      its outer gradients are scaled by 10⁶ (exploding updates)
flip       its outer gradients are negated (an honest outer gradient pointed uphill): an ordinary norm
climb      it negates the loss gradient of every inner step before clipping (a learner that climbs the
           loss through all its inner steps: an ordinary norm, pointing much more steeply uphill)
switch     it climbs toward every second round and trains honestly toward the others
free       a free rider: it sends no progress (Δ × 0) and claims the tokens of full rounds
weight     flipped, and it gathers a weight of 10¹⁵ (under the weighted mean: the whole average)
ahead      it signs progress records claiming 1,000 versions more than it holds
ahead_client  the same from a learner in client mode (nobody dials it, so nobody downloads from it)
state      it serves Θ scaled by −50, 3 versions ahead, with a history listing the honest states
shard      as a reducer, it returns the shard it averaged scaled by −50 to everyone
malform    every part it sends and every reply it returns holds 3·10³⁸ in each value (finite)
sketch     it never publishes its reducer sketch (nobody can check the shards it sent parts of)
hash       it signs each commit with another hash of the new state
quorum     it gathers a majority quorum of 1,000,000 (in a pair, the upper median)
unowned    all three: each fails the round it joins (run with ``--honest 2`` so that pairs form)
=========  ======================================================================================

Every case runs with the token-weighted mean and with ``averaging.aggregator=median``; ``--set KEY=VALUE``
changes a setting on every learner (``--set averaging.direction_check=false``: the defaults before the
direction check). The clean runs have the honest learners alone (the same tokens as the honest learners of an attacked
run); ``unchecked`` is a clean run with the reducer check off (``averaging.verify_reducers=false``),
to show what the check costs. Reported per run, over the honest learners: the final eval loss of the
global model (mean over learners), its ratio to the clean run's with the same aggregator, the rounds each committed, the
wall time until all three exited and the time lost against the clean run, the median round time
and the median time spent collecting commit certificates (the defence's cost in a clean run), and
the median megabytes each honest learner sent per committed round.

    .venv/bin/python benchmarks/poisoning.py --versions 6 --json benchmarks/results/poisoning.json
    .venv/bin/python benchmarks/poisoning.py --honest 7 --cases clean climb --aggregators mean

``--plot [PATH]`` draws each run's learners from their audit logs (``p2p-diloco plot``).

Nothing leaves 127.0.0.1; every process group is killed at the end of its run.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import add_plot_argument, draw  # noqa: E402

from p2p_diloco.sim.processes import LOOPBACK_ANY_PORT, Proc, cli, start_bootstrap, stop_procs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMALL = str(ROOT / "peers" / "small-cpu.toml")
# The integration tests' fast settings (tests/integration/harness.py): short rounds on 2 cores.
FAST = [
    "--set", "inner.steps_per_outer=20", "--set", "averaging.matchmaking_time=2.5",
    "--set", "averaging.request_timeout=1.0", "--set", "averaging.round_timeout=10.0",
    "--set", "averaging.next_chunk_timeout=5.0", "--set", "network.record_ttl=8.0",
    "--set", "run.linger_seconds=20.0",
]
ATTACKS = {
    "clean": None,
    "nan": "poison at round 2 with nan",
    "scale": "poison at round 2 with scale 1e6",
    "flip": "poison at round 2 with flip",
    "climb": "poison at round 2 with climb",
    "switch": "poison at round 2 with climb 2",
    "free": "poison at round 2 with scale 0",
    "weight": "poison at round 2 with flip; lie at round 2 with weight",
    "ahead": "lie at round 2 with ahead",
    "ahead_client": "lie at round 2 with ahead",
    "state": "lie at round 2 with state",
    "shard": "lie at round 2 with shard",
    "malform": "malform at round 2 with huge",
    "sketch": "lie at round 2 with sketch",
    "hash": "lie at round 2 with hash",
    "quorum": "lie at round 2 with quorum",
    "unowned": "lie at round 2 with sketch; lie at round 2 with hash; lie at round 2 with quorum",
    "unchecked": None,
}
ATTACKER_SETTINGS = {"ahead_client": ["--set", "network.client_mode=true"]}  # on the attacker alone
CASE_SETTINGS = {"unchecked": ["--set", "averaging.verify_reducers=false"]}  # on every learner of the case
EXCLUDED = re.compile(r"excluded (?P<peer>\S+) from fragment")
COMMITTED = re.compile(r"outer round committed \| .*? round (?P<round>[\d.]+)s sent (?P<mb>[\d.]+) MB "
                       r"certified in (?P<cert>[\d.]+)s")


def run(case: str, aggregator: str, versions: int, work: Path, timeout: float, honest_count: int = 3,
        settings: tuple[str, ...] = (), log_level: str = "INFO") -> dict:
    """One swarm: ``honest_count`` honest learners and, unless ``case`` is clean, the attacker; its figures."""
    work.mkdir(parents=True)
    boot, peers = start_bootstrap(work)
    common = [*FAST, "--set", f"averaging.aggregator={aggregator}", *CASE_SETTINGS.get(case, [])]
    for setting in settings:
        common += ["--set", setting]
    shards = honest_count + 1

    def learner(i: int, extra: list[str]) -> Proc:
        return Proc(f"learner-{i}", cli(
            "--log-level", log_level, "learner", "--config", SMALL, "--initial-peers", peers,
            "--host-maddrs", LOOPBACK_ANY_PORT,
            "--shard-index", str(i), "--num-shards", str(shards), "--max-outer-steps", str(versions),
            "--checkpoint-dir", str(work / f"ckpt-{i}"), "--summary", str(work / f"summary-{i}.json"),
            *common, *extra), work / f"learner-{i}.log")

    started = time.monotonic()
    honest = [learner(i, []) for i in range(honest_count)]
    fault = ATTACKS[case]
    attacker = learner(honest_count, ["--fault", fault, *ATTACKER_SETTINGS.get(case, [])]) if fault else None
    codes: list[int | None] = []
    try:
        for p in honest:
            try:
                codes.append(p.wait(max(1.0, timeout - (time.monotonic() - started))))
            except subprocess.TimeoutExpired:
                codes.append(None)
        wall = time.monotonic() - started
    finally:
        stop_procs([*honest, *([attacker] if attacker else []), boot], grace=10)
    paths = [work / f"summary-{i}.json" for i in range(honest_count)]
    summaries = [json.loads(path.read_text()) if path.exists() else None for path in paths]
    rounds, certify, sent = [], [], []
    for p in honest:
        for m in COMMITTED.finditer(p.text()):
            rounds.append(float(m["round"]))
            certify.append(float(m["cert"]))
            sent.append(float(m["mb"]))
    done = [s for s in summaries if s]
    excluded: dict[str, int] = {}  # the last 6 characters of a peer id → how often an honest learner left it out
    for p in honest:
        for m in EXCLUDED.finditer(p.text()):
            excluded[m["peer"]] = excluded.get(m["peer"], 0) + 1
    return {
        "case": case, "aggregator": aggregator, "honest": honest_count, "settings": list(settings),
        "exclusions": excluded, "exit_codes": codes, "wall_seconds": round(wall, 1),
        "eval_loss": statistics.mean(s["last_eval_loss"] for s in done) if done else None,
        "first_eval_loss": done[0]["first_eval_loss"] if done else None,
        "states": len({s["global_state_sha256"] for s in done}),
        "versions": sorted({s["version"] for s in done}),
        "rounds_committed": [s["outer_steps"] for s in done],
        "rounds_failed": [s["rounds_failed"] for s in done],
        "steps_merged": [round(s["steps_merged"]) for s in done], "inner_steps": [s["inner_steps"] for s in done],
        "round_seconds_median": statistics.median(rounds) if rounds else None,
        "certify_seconds_median": statistics.median(certify) if certify else None,
        "sent_mb_per_round_median": statistics.median(sent) if sent else None,
    }



def table(results: list[dict]) -> str:
    """The Markdown table of BENCHMARKS.md."""
    clean = {r["aggregator"]: r for r in results if r["case"] == "clean"}
    lines = ["| attack | aggregator | honest eval loss | vs clean | one state | rounds committed (each) | wall s | "
             "lost s | round s (median) | certify s (median) | MB sent per round (median) | "
             "exclusions by honest learners |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = clean.get(r["aggregator"])
        ratio = (f"{r['eval_loss'] / base['eval_loss']:.3f}" if base and r["eval_loss"] and base["eval_loss"]
                 else "–")
        lost = f"{r['wall_seconds'] - base['wall_seconds']:+.0f}" if base else "–"
        loss = f"{r['eval_loss']:.4f}" if r["eval_loss"] is not None else "–"
        rs = f"{r['round_seconds_median']:.2f}" if r["round_seconds_median"] is not None else "–"
        cs = f"{r['certify_seconds_median']:.2f}" if r["certify_seconds_median"] is not None else "–"
        excl = ", ".join(f"{p} ×{n}" for p, n in sorted(r.get("exclusions", {}).items(), key=lambda x: -x[1])) or "–"
        mb = f"{r['sent_mb_per_round_median']:.3f}" if r.get("sent_mb_per_round_median") is not None else "–"
        lines.append(f"| {r['case']} | {r['aggregator']} | {loss} | {ratio} | {'yes' if r['states'] == 1 else 'no'} "
                     f"| {r['rounds_committed']} | {r['wall_seconds']:.0f} | {lost} | {rs} | {cs} | {mb} | {excl} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=6, help="global versions each run trains to")
    parser.add_argument("--cases", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    parser.add_argument("--aggregators", nargs="+", default=["mean", "median"], choices=["mean", "median",
                                                                                         "trimmed_mean"])
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take")
    parser.add_argument("--honest", type=int, default=3, help="honest learners in each run (the attacker is one more)")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting for every learner of every run (repeatable)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO"], help="the learners' log level")
    parser.add_argument("--workdir", help="keep the runs' logs here (default: a temporary directory)")
    parser.add_argument("--json", help="write the results here")
    add_plot_argument(parser, "poisoning")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="poisoning-") as tmp:
        base = Path(args.workdir or tmp)
        results = []
        for aggregator in args.aggregators:
            for case in args.cases:
                work = base / f"{case}-{aggregator}"
                r = run(case, aggregator, args.versions, work, args.timeout, args.honest, tuple(args.settings),
                        args.log_level)
                print(json.dumps(r), flush=True)
                if args.plot:
                    draw(work, args.plot, f"{case}-{aggregator}", f"poisoning: {case} attack, {aggregator} "
                         f"aggregator, {args.versions} versions (ckpt-3 is the attacker)")
                results.append(r)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"versions": args.versions, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
