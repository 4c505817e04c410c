"""NAT benchmark: the same three regions with one of them behind NAT, and without.

Runs ``p2p-diloco regions`` (network namespaces; needs root) on north (the bootstrap node, 1 learner),
south (1 learner) and home (2 learners), every WAN link at ``--bandwidth`` both ways, twice per
repeat: home public, then home behind NAT (``nat = true``: its gateway translates its learners'
connections to its backbone address and drops every connection opened from outside, so they run as
clients). Reads every learner's committed-round lines (``outer round committed | ... allreduce
0.42s round 3.15s sent 0.816 MB``), its start-up reachability line and its summary. Writes
``benchmarks/results/nat_regions_<date>_<commit>.json`` and prints a Markdown table.

    sudo .venv/bin/python benchmarks/nat_regions.py             # about 2 minutes on 2 cores
    sudo .venv/bin/python benchmarks/nat_regions.py --repeats 2 --steps 5   # what BENCHMARKS.md reports
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wan.run import FAST  # noqa: E402  (the same fast round settings as the WAN benchmark)

from p2p_diloco.sim.processes import cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FAILED_LOGS = ROOT / "runs" / "nat-bench"


TOPOLOGY = """\
run_id = "nat-bench"
learner_config = "peers/small-cpu.toml"
max_outer_steps = {steps}
num_shards = 6
bootstrap_region = "north"

[[regions]]
name = "north"
subnet = "10.77.1.0/24"
learners = 1
bandwidth = "{rate}"

[[regions]]
name = "south"
subnet = "10.77.2.0/24"
learners = 1
bandwidth = "{rate}"

[[regions]]
name = "home"
subnet = "10.77.3.0/24"
learners = 2
bandwidth = "{rate}"
nat = {nat}
"""

ROUND = re.compile(r"^\s*(\S+) \| .*outer round committed \| version (\d+) .*group (\d+) .*allreduce ([\d.]+)s "
                   r"round ([\d.]+)s sent ([\d.]+) MB")
# The learner's start-up line on how peers reach it (p2p_diloco.net.reach): direct, relay or client only.
REACH = re.compile(r"^\s*(\S+) \| .*reachable[^|]*?: (direct|relay|client only)\b")


def run_one(nat: bool, rate: str, steps: int) -> dict:
    """One ``p2p-diloco regions`` run; its figures as one JSON-able row."""
    with tempfile.TemporaryDirectory(prefix="nat-bench-") as tmp:
        topo = Path(tmp) / "topology.toml"
        topo.write_text(TOPOLOGY.format(steps=steps, rate=rate, nat=str(nat).lower()))
        t0 = time.monotonic()
        r = subprocess.run(cli("regions", "--topology", str(topo), "--workdir", str(Path(tmp) / "work"), *FAST),
                           cwd=ROOT, capture_output=True, text=True, timeout=1200)
        wall = time.monotonic() - t0
        summary_path = Path(tmp) / "work" / "regions-summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"learners": {}, "links": {}}
        if r.returncode != 0:  # kept for a look at what went wrong
            FAILED_LOGS.mkdir(parents=True, exist_ok=True)
            (FAILED_LOGS / f"{'nat' if nat else 'public'}-{int(time.time())}.log").write_text(r.stdout + r.stderr)
    rounds = [m.groups() for line in r.stdout.splitlines() if (m := ROUND.match(line))]
    reach = {m.group(1): m.group(2) for line in r.stdout.splitlines() if (m := REACH.match(line))}
    learners = summary["learners"]

    def mean(xs: list[float], nd: int = 2) -> float | None:
        return round(statistics.mean(xs), nd) if xs else None

    def per(names: list[str], key: str) -> list:
        return [learners[n][key] for n in names if n in learners]

    home = [n for n in learners if n.startswith("home-")]
    public = [n for n in learners if not n.startswith("home-")]
    return {
        "nat": nat, "bandwidth": rate, "exit_code": r.returncode, "wall_seconds": round(wall, 1),
        "reach": reach,
        "round_lines": len(rounds),
        "round_s_mean": mean([float(g[4]) for g in rounds]),
        "allreduce_s_mean": mean([float(g[3]) for g in rounds]),
        "group_sizes": sorted({int(g[2]) for g in rounds}),
        "sent_mb_per_round_mean": {"home": mean([float(g[5]) for g in rounds if g[0].startswith("home-")], 3),
                                   "public": mean([float(g[5]) for g in rounds if not g[0].startswith("home-")], 3)},
        "committed_rounds": {n: s["outer_steps"] for n, s in sorted(learners.items())},
        "versions": sorted({s["version"] for s in learners.values()}),
        "bytes_sent_mb": {n: round(s["bytes_sent"] / 1e6, 2) for n, s in sorted(learners.items())},
        "bytes_sent_mb_mean": {"home": mean([b / 1e6 for b in per(home, "bytes_sent")]),
                               "public": mean([b / 1e6 for b in per(public, "bytes_sent")])},
        "tokens": {n: s["tokens"] for n, s in sorted(learners.items())},
        "eval_loss_last": mean([s["last_eval_loss"] for s in learners.values()], 4),
        "one_state": bool(learners) and len({s["global_state_sha256"] for s in learners.values()}) == 1,
        "learners": len(learners),
        "wan_mb": {k: {"up": round(v["up"] / 1e6, 2), "down": round(v["down"] / 1e6, 2)}
                   for k, v in summary["links"].items()},
    }


def _commit() -> str:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return sha.strip() + ("+dirty" if dirty else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="outer steps per run")
    p.add_argument("--bandwidth", default="20mbit", help="every WAN link, each way")
    p.add_argument("--repeats", type=int, default=1, help="pairs of runs (public, then NAT)")
    p.add_argument("--setups", default="public,nat", help="which of the pair to run (public, nat or both)")
    a = p.parse_args()
    setups = [s == "nat" for s in a.setups.split(",") if s in ("public", "nat")]
    rows = []
    for _ in range(a.repeats):
        for nat in setups:
            row = run_one(nat, a.bandwidth, a.steps)
            print(json.dumps(row), flush=True)
            rows.append(row)
    commit = _commit()
    out = ROOT / "benchmarks" / "results" / f"nat_regions_{datetime.date.today()}_{commit.replace('+', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    out.write_text(json.dumps({
        "commit": commit, "machine": f"{platform.machine()}, {nproc} cores, kernel {platform.release()}",
        "setup": f"north 1 + south 1 + home 2 learners (peers/small-cpu.toml, H = 20), {a.steps} outer steps, "
                 f"every WAN link {a.bandwidth} both ways (tbf); home public, then home behind NAT",
        "rows": rows,
    }, indent=2) + "\n")
    print(f"\nwrote {out.relative_to(ROOT)}")
    print("\n| setup | how home's learners are reached | mean round (s) | mean all-reduce (s) | rounds committed "
          "(north, south, home-0, home-1) | MB sent per learner, home / public | final eval loss | one hash |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = r["committed_rounds"]
        committed = ", ".join(str(c.get(n, "-")) for n in ("north-0", "south-0", "home-0", "home-1"))
        reach = sorted({v for k, v in r["reach"].items() if k.startswith("home-")}) or ["(no line)"]
        sent = r["bytes_sent_mb_mean"]
        print(f"| {'home behind NAT' if r['nat'] else 'all public'} | {', '.join(reach)} | {r['round_s_mean']} | "
              f"{r['allreduce_s_mean']} | {committed} | {sent['home']} / {sent['public']} | {r['eval_loss_last']} | "
              f"{'yes' if r['one_state'] else 'NO'} |")
    return 0 if all(r["exit_code"] == 0 and r["one_state"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
