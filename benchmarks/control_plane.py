"""Control plane against data plane: each learner's DHT bytes beside its all-reduce bytes, in the README's demo.

Runs ``p2p-diloco swarm`` (a bootstrap node and ``--learners`` learners on loopback, the embedded default data,
``--versions`` outer steps) ``--repeats`` times and reads each learner's summary: the DHT RPCs its DHT process
made and served, with their bytes (``dht_traffic``: the serialized protobuf messages, request and reply,
p2p_diloco/net/traffic.py), and its all-reduce bytes (``bytes_sent`` + ``bytes_received``: parts out and in,
state downloads included). Reported per learner: both, their ratio, the DHT finds and stores it made, and DHT
bytes per version. The issue's target: DHT bytes at most 20% of all-reduce bytes.

    .venv/bin/python benchmarks/control_plane.py --json control.json

Nothing leaves 127.0.0.1; the swarm command stops every process it started.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from p2p_diloco.sim.processes import cli


def run(work: Path, learners: int, versions: int, settings: list[str]) -> list[dict]:
    """One demo swarm; per learner: its DHT and all-reduce bytes."""
    extra = [arg for s in settings for arg in ("--set", s)]
    subprocess.run(cli("swarm", "--learners", str(learners), "--max-outer-steps", str(versions),
                       "--workdir", str(work), *extra), check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.STDOUT, timeout=900)
    out = []
    for i in range(learners):
        s = json.loads((work / f"summary-{i}.json").read_text())
        traffic = s.get("dht_traffic", {})
        dht = sum(t.get("bytes_out", 0) + t.get("bytes_in", 0) for t in traffic.values())
        allreduce = int(s.get("bytes_sent", 0)) + int(s.get("bytes_received", 0))
        out.append({
            "learner": i, "dht_bytes": dht, "allreduce_bytes": allreduce,
            "ratio": round(dht / allreduce, 3) if allreduce else None,
            "dht_bytes_per_version": round(dht / max(1, int(s["version"]))),
            "finds_made": traffic.get("DHTProtocol.rpc_find", {}).get("calls_made", 0),
            "stores_made": traffic.get("DHTProtocol.rpc_store", {}).get("calls_made", 0),
            "dht_bytes_by_key": {kind: t["bytes_out"] + t["bytes_in"]
                                 for kind, t in s.get("dht_traffic_by_key", {}).items()},
            "version": s["version"], "last_eval_loss": s["last_eval_loss"],
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learners", type=int, default=3)
    parser.add_argument("--versions", type=int, default=6, help="outer steps (the demo's default)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting for every learner (repeatable)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="control-plane-") as tmp:
        for r in range(args.repeats):
            learners = run(Path(tmp) / f"run-{r}", args.learners, args.versions, args.settings)
            runs.append(learners)
            for x in learners:
                print(json.dumps(x), flush=True)
    ratios = [x["ratio"] for learners in runs for x in learners if x["ratio"] is not None]
    print(f"DHT bytes ÷ all-reduce bytes per learner: median {statistics.median(ratios):.3f}, "
          f"worst {max(ratios):.3f} ({len(ratios)} learners, {args.repeats} run(s))")
    if args.json:
        Path(args.json).write_text(json.dumps({"learners": args.learners, "versions": args.versions,
                                               "settings": args.settings, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
