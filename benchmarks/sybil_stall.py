"""Sybil stall: fresh identities of one attacker, from one address, beside three honest learners.

Each run is a real swarm on loopback: a bootstrap node and three honest learners (the integration tests' fast
settings). Once every honest learner has committed ``--arrive-at`` versions, a test-only peer
(``p2p_diloco.sim.sybils``: one DHT node, one address) announces ``--identities`` fresh keys as learners
training at the swarm's version; they never join a round. The run ends when the honest learners reach
``--versions`` or after ``--timeout`` seconds. Reported per setting: the versions the honest learners committed
in the ``--window`` seconds after every honest learner saw the keys join (or until the run ended, if sooner) and
by the end, the rounds that failed, and the wall time; ``--clean`` adds a run without the keys.

- ``established_after=0``: the rule off, every identity counts (the defaults before 2026-12-06): the majority
  quorum of 7 learners is 4, and the 3 honest learners never form a group that large.
- ``established_after=N``: the rule on (p2p_diloco/core/standing.py): the quorum counts identities with N
  certified rounds; the keys count for nothing.

    .venv/bin/python benchmarks/sybil_stall.py --clean --json benchmarks/results/sybil_stall.json

Nothing leaves 127.0.0.1; every process group is killed at the end of its run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from poisoning import FAST, SMALL  # noqa: E402

from p2p_diloco.sim.processes import LOOPBACK_ANY_PORT, Proc, cli, start_bootstrap, stop_procs  # noqa: E402

COMMITTED = re.compile(r"outer round committed \| version (?P<version>\d+)")
FAILED = re.compile(r"outer round not committed")
SEEN = re.compile(r"learner \S+ joined")


def versions(p: Proc) -> int:
    """The newest version ``p`` committed, from its log."""
    return max((int(m["version"]) for m in COMMITTED.finditer(p.text())), default=0)


def run(after: int, work: Path, args: argparse.Namespace, attack: bool = True) -> dict:
    """One swarm with ``averaging.established_after=after`` (and the keys unless not ``attack``); its figures."""
    work.mkdir(parents=True)
    boot, peers = start_bootstrap(work)
    honest = [Proc(f"learner-{i}", cli(
        "learner", "--config", SMALL, "--initial-peers", peers, "--host-maddrs", LOOPBACK_ANY_PORT,
        "--shard-index", str(i), "--num-shards", "3", "--max-outer-steps", str(args.versions),
        "--checkpoint-dir", str(work / f"ckpt-{i}"), "--summary", str(work / f"summary-{i}.json"),
        *FAST, "--set", f"averaging.established_after={after}"), work / f"learner-{i}.log") for i in range(3)]
    sybils: Proc | None = None
    started, arrived, at_arrival, in_window = time.monotonic(), None, None, None
    try:
        while time.monotonic() - started < args.timeout and any(p.popen.poll() is None for p in honest):
            now = time.monotonic()
            if attack and sybils is None and min(versions(p) for p in honest) >= args.arrive_at:
                sybils = Proc("sybils", [sys.executable, "-m", "p2p_diloco.sim.sybils", "--initial-peers", peers,
                                         "--identities", str(args.identities), "--seconds", str(args.timeout),
                                         "--ttl", "8"], work / "sybils.log")
            if sybils is not None and arrived is None and \
                    all(len(SEEN.findall(p.text())) >= 2 + args.identities for p in honest):
                arrived, at_arrival = now - started, [versions(p) for p in honest]
            if arrived is not None and in_window is None and now - started >= arrived + args.window:
                in_window = [versions(p) - v for p, v in zip(honest, at_arrival, strict=True)]
            time.sleep(0.5)
        wall = time.monotonic() - started
        if arrived is not None and in_window is None:  # the run ended within the window
            in_window = [versions(p) - v for p, v in zip(honest, at_arrival, strict=True)]
    finally:
        stop_procs([*honest, *([sybils] if sybils else []), boot], grace=10)
    texts = [p.text() for p in honest]
    return {
        "established_after": after, "identities": args.identities if attack else 0, "wall_seconds": round(wall, 1),
        "sybils_seen_at_seconds": None if arrived is None else round(arrived, 1),
        "versions_at_arrival": at_arrival,
        "versions_in_window": in_window, "window_seconds": args.window,
        "versions_at_end": [versions(p) for p in honest],
        "rounds_failed": [len(FAILED.findall(t)) for t in texts],
        "reached_target": all(versions(p) >= args.versions for p in honest),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=12, help="versions the honest learners train to")
    parser.add_argument("--arrive-at", type=int, default=5, help="the keys arrive once every honest learner "
                                                                  "committed this many versions")
    parser.add_argument("--identities", type=int, default=4, help="fresh keys of the attacker")
    parser.add_argument("--window", type=float, default=60.0, help="seconds after the keys' arrival to count")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds a run may take")
    parser.add_argument("--settings", type=int, nargs="+", default=[0, 4], metavar="N",
                        help="averaging.established_after of each run (0: the rule off)")
    parser.add_argument("--clean", action="store_true", help="one more run without the keys (the last setting)")
    parser.add_argument("--workdir", help="keep the runs' logs here (default: a temporary directory)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sybil-stall-") as tmp:
        base = Path(args.workdir or tmp)
        results = []
        for after in args.settings:
            r = run(after, base / f"established-{after}", args)
            print(json.dumps(r), flush=True)
            results.append(r)
        if args.clean:
            r = run(args.settings[-1], base / "clean", args, attack=False)
            print(json.dumps(r), flush=True)
            results.append(r)
    print(f"{'established_after':>17} {'keys':>4} {'seen at s':>9} {'versions in window':>20} {'at end':>12} "
          f"{'failed rounds':>14} {'wall s':>7}")
    for r in results:
        print(f"{r['established_after']:>17} {r['identities']:>4} {str(r['sybils_seen_at_seconds']):>9} "
              f"{str(r['versions_in_window']):>20} {str(r['versions_at_end']):>12} "
              f"{str(r['rounds_failed']):>14} {r['wall_seconds']:>7}")
    if args.json:
        Path(args.json).write_text(json.dumps({"versions": args.versions, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
