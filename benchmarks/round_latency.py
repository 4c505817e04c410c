"""Round latency in the README's demo: a leader that starts once everyone has joined, against one that waits out
its matchmaking window (``averaging.early_close``, p2p_diloco/net/early_close.py), side by side.

Runs ``p2p-diloco swarm`` (a bootstrap node and ``--learners`` learners on loopback, the embedded default data,
``--versions`` outer steps) with ``averaging.early_close`` true and false in turn, ``--repeats`` times each, and
reads each learner's summary: its compute share (seconds in inner steps ÷ seconds training, rounds included),
seconds waiting for rounds, rounds failed, inner steps merged ÷ inner steps, final eval loss and global state;
plus the swarm command's wall time. The two settings must end on the same state and eval loss when every round
holds the same learners (the demo's learners take the same steps either way).

    .venv/bin/python benchmarks/round_latency.py --repeats 2 --json round_latency.json

Nothing leaves 127.0.0.1; the swarm command stops every process it started.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from p2p_diloco.sim.processes import cli


def learner_row(summary: dict) -> dict:
    """What one learner's summary says of its rounds."""
    train = float(summary.get("train_seconds") or 0.0)
    inner = int(summary.get("inner_steps") or 0)
    return {
        "compute_share": float(summary.get("compute_seconds") or 0.0) / train if train > 0 else 0.0,
        "wait_seconds": float(summary.get("wait_seconds") or 0.0),
        "train_seconds": train,
        "rounds_failed": int(summary.get("rounds_failed") or 0),
        "merged_share": float(summary.get("steps_merged") or 0.0) / inner if inner else 0.0,
        "last_eval_loss": summary.get("last_eval_loss"),
        "version": summary.get("version"),
        "sha256": str(summary.get("global_state_sha256", ""))[:16],
    }


def run(work: Path, learners: int, versions: int, early_close: bool) -> dict:
    """One demo swarm: its wall time and each learner's row."""
    began = time.monotonic()
    subprocess.run(cli("swarm", "--learners", str(learners), "--max-outer-steps", str(versions),
                       "--workdir", str(work), "--set", f"averaging.early_close={str(early_close).lower()}"),
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=900)
    wall = time.monotonic() - began
    rows = [learner_row(json.loads((work / f"summary-{i}.json").read_text())) for i in range(learners)]
    return {"early_close": early_close, "wall_seconds": wall, "learners": rows}


def medians(runs: list[dict], early_close: bool) -> dict:
    """Medians over the runs of one setting (learners pooled), and the states they ended on."""
    mine = [r for r in runs if r["early_close"] == early_close]
    rows = [row for r in mine for row in r["learners"]]
    return {
        "runs": len(mine),
        "wall_seconds": statistics.median(r["wall_seconds"] for r in mine),
        "compute_share": statistics.median(row["compute_share"] for row in rows),
        "wait_seconds": statistics.median(row["wait_seconds"] for row in rows),
        "rounds_failed": sum(row["rounds_failed"] for row in rows),
        "merged_share_min": min(row["merged_share"] for row in rows),
        "states": sorted({row["sha256"] for row in rows}),
        "eval_losses": sorted({round(float(row["last_eval_loss"]), 4) for row in rows}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learners", type=int, default=3)
    parser.add_argument("--versions", type=int, default=6, help="outer steps (the demo's default)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    print("command:", " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), flush=True)
    runs = []
    for k in range(args.repeats):
        for early in (True, False):  # alternating: a drift of the machine's load hits both alike
            with tempfile.TemporaryDirectory(prefix="round-latency-") as tmp:
                runs.append(run(Path(tmp), args.learners, args.versions, early))
            r = runs[-1]
            print(f"repeat {k + 1}/{args.repeats} early_close={early}: {r['wall_seconds']:.1f} s, compute "
                  + ", ".join(f"{row['compute_share']:.0%}" for row in r["learners"])
                  + ", eval " + ", ".join(f"{row['last_eval_loss']:.4f}" for row in r["learners"]), flush=True)
    result = {"learners": args.learners, "versions": args.versions, "runs": runs,
              "early_close": medians(runs, True), "window": medians(runs, False)}
    for name in ("early_close", "window"):
        m = result[name]
        print(f"{name:>11}: wall {m['wall_seconds']:.1f} s, compute share {m['compute_share']:.0%}, waiting "
              f"{m['wait_seconds']:.1f} s, rounds failed {m['rounds_failed']}, merged >= {m['merged_share_min']:.0%}, "
              f"states {m['states']}, eval {m['eval_losses']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
