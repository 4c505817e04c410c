"""WAN benchmark: one outer round's cost when regions are joined by slow links.

Runs ``p2p-diloco regions`` (network namespaces; needs root) on a 2-region, 4-learner topology for
each WAN bandwidth (and codec) below, and reads every learner's committed-round lines
(``allreduce 0.42s round 3.15s sent 0.816 MB``). Writes ``benchmarks/results/wan_bench.json`` and
prints a Markdown table.

    sudo .venv/bin/python benchmarks/wan/run.py            # about 6 minutes on 2 cores
    sudo .venv/bin/python benchmarks/wan/run.py --quick    # 2 settings

Delay and loss are not part of it: they need the netem qdisc, which the machine that made the
committed figures does not have.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from p2p_diloco.sim.processes import cli
from p2p_diloco.sim.regions.topology import rate_bits_per_second

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "wan_bench.json"

FAST = [
    "--set", "inner.steps_per_outer=20", "--set", "averaging.matchmaking_time=2.5",
    "--set", "averaging.request_timeout=1.0", "--set", "averaging.round_timeout=10.0",
    "--set", "network.record_ttl=8.0", "--set", "run.linger_seconds=40.0",
    "--set", "averaging.allreduce_timeout=120.0", "--set", "averaging.next_chunk_timeout=60.0",
]

TOPOLOGY = """\
run_id = "{run_id}"
learner_config = "{config}"
max_outer_steps = {steps}
num_shards = 4
bootstrap_region = "north"

[[regions]]
name = "north"
subnet = "10.{net}.1.0/24"
learners = 2
bandwidth = "{rate}"

[[regions]]
name = "south"
subnet = "10.{net}.2.0/24"
learners = 2
bandwidth = "{rate}"
"""


def two_region_topology(rate: str, steps: int, run_id: str = "wan-bench", net: int = 77,
                        config: str | Path = "peers/small-cpu.toml") -> str:
    """Topology file text: regions north and south, 2 learners each, both WAN links at ``rate``."""
    return TOPOLOGY.format(run_id=run_id, config=config, steps=steps, net=net, rate=rate)

ROUND = re.compile(r"^\s*(\S+) \| .*outer round committed \| version (\d+) .* group (\d+) .*allreduce ([\d.]+)s "
                   r"round ([\d.]+)s sent ([\d.]+) MB")

SETTINGS = [("1gbit", "none"), ("20mbit", "none"), ("10mbit", "none"), ("5mbit", "none"), ("5mbit", "int8"),
            ("1mbit", "none")]


def link_share(rate: str, sent_mb: float, allreduce_s: float) -> float:
    """The share of a region's uplink rate that its all-reduce payload used while the all-reduce ran.

    Each of the 4 learners sends its parts and averaged parts (``sent_mb``) to 3 groupmates in equal
    shares, 2 of them in the other region: the 2 learners of a region put 2 · 2/3 · sent_mb on its uplink.
    """
    return 2 * 2 / 3 * sent_mb * 1e6 * 8 / allreduce_s / rate_bits_per_second(rate)
QUICK = [("1gbit", "none"), ("5mbit", "none")]


def run_one(rate: str, codec: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="wan-bench-") as tmp:
        topo = Path(tmp) / "topology.toml"
        topo.write_text(two_region_topology(rate, steps))
        t0 = time.monotonic()
        r = subprocess.run(cli("regions", "--topology", str(topo), "--workdir", str(Path(tmp) / "work"), *FAST,
                               "--set", f"averaging.compression={codec}"),
                           cwd=ROOT, capture_output=True, text=True, timeout=900)
        wall = time.monotonic() - t0
        summary = json.loads((Path(tmp) / "work" / "regions-summary.json").read_text())
    rounds = [m.groups() for line in r.stdout.splitlines() if (m := ROUND.match(line))]
    allreduce = [float(g[3]) for g in rounds]
    round_s = [float(g[4]) for g in rounds]
    sent = [float(g[5]) for g in rounds]
    full = [(float(g[5]), float(g[3])) for g in rounds if g[2] == "4"]  # link_share assumes a group of all 4
    learners = summary["learners"]
    return {
        "bandwidth": rate, "codec": codec, "exit_code": r.returncode, "wall_seconds": round(wall, 1),
        "committed_rounds": len(rounds), "versions": sorted({s["version"] for s in learners.values()}),
        "one_state": len({s["global_state_sha256"] for s in learners.values()}) == 1,
        "allreduce_s_median": round(statistics.median(allreduce), 2) if allreduce else None,
        "allreduce_s_max": round(max(allreduce), 2) if allreduce else None,
        "round_s_median": round(statistics.median(round_s), 2) if round_s else None,
        "sent_mb_per_learner_round": round(statistics.median(sent), 3) if sent else None,
        "groups": sorted(int(g[2]) for g in rounds),
        "uplink_share_median": round(statistics.median(link_share(rate, mb, s) for mb, s in full), 3) if full else None,
        "wan_mb_per_region": {k: round(v["up"] / 1e6, 2) for k, v in summary["links"].items()},
        "eval_loss_last": round(statistics.mean(s["last_eval_loss"] for s in learners.values()), 4),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=4, help="outer steps per run")
    p.add_argument("--json", type=Path, default=RESULTS, help="where to write the raw figures")
    p.add_argument("--settings", help="comma list of rate:codec (e.g. 1mbit:none) instead of the built-in list")
    a = p.parse_args()
    rows = []
    chosen = [tuple(x.split(":")) for x in a.settings.split(",")] if a.settings else QUICK if a.quick else SETTINGS
    for rate, codec in chosen:
        row = run_one(rate, codec, a.steps)
        print(json.dumps(row), flush=True)
        rows.append(row)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({
        "machine": f"{platform.machine()}, {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()}"
                   f" cores, kernel {platform.release()}",
        "setup": "2 regions x 2 learners (peers/small-cpu.toml, 136,960 parameters, H = 20), tbf on both "
                 "directions of each region's WAN link, no delay/loss (no netem)",
        "rows": rows,
    }, indent=2) + "\n")
    print("\n| WAN link (each way) | codec | all-reduce median / max (s) | round median (s) | sent per learner "
          "per round (MB) | payload rate / link rate (median, groups of 4) | WAN MB out of a region (whole run) | "
          "one state |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        wan = max(r["wan_mb_per_region"].values()) if r["wan_mb_per_region"] else 0
        one = "yes" if r["one_state"] else "NO"
        print(f"| {r['bandwidth']} | {r['codec']} | {r['allreduce_s_median']} / {r['allreduce_s_max']} | "
              f"{r['round_s_median']} | {r['sent_mb_per_learner_round']} | {r['uplink_share_median']} | {wan} | "
              f"{one} |")
    return 0 if all(r["exit_code"] == 0 and r["one_state"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
