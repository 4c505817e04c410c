"""Where an all-reduce's time goes: a sampling profile of `allreduce_bench.py`'s hivemind rounds.

Runs ``benchmarks/allreduce_bench.py`` (hivemind side only) under py-spy (``pip install py-spy``;
not a project dependency), sampling every Python process of the run (the learners' main process and
the forked averager and DHT processes; p2pd is Go and is measured by its CPU seconds instead), and
sorts each on-CPU sample into what it was doing, by the frames on its stack, and into its scope:
"all-reduce" when the stack runs through the averager (``averager.py``, ``allreduce.py``: the
round's work in the averager process), "outside" for the rest (imports, the benchmark's own data
and reference sums, the learners' main processes):

=================  ===============================================================================
codec encode       p2p_diloco.core.quantization / codecs: compressing a part or a reply
codec decode       decoding a received part or reply
checks             the receiver's checks: values finite, declared norm (allreduce.py)
reduce             adding parts into a shard (AllOrNothingReducer / RobustReducer accumulate)
sketch             the reducer check's projections and spot values (shard_sketches.py)
protobuf           SerializeToString / ParseFromString / ByteSize of the messages
stream I/O         hivemind's P2P framing and the socket reads and writes to p2pd
msgpack            hivemind's serializer (gathered metadata, DHT values)
matchmaking        hivemind's matchmaking and key manager
dht                the DHT process's node and protocol
other              anything else on CPU
=================  ===============================================================================

Samples are counted on CPU only (py-spy leaves idle threads out), so the shares say what the
Python side spends its CPU on; ``--rate`` samples per second per process.

    .venv/bin/python benchmarks/allreduce_profile.py --size large --learners 4 --rounds 5 \\
        --json benchmarks/results/allreduce_profile.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CATEGORIES = [  # (name, substrings of a frame); the first category any frame of the stack matches
    ("sketch", ("shard_sketches.py",)),
    ("codec encode", ("quantization.py:", "codecs.py:")),  # refined below: encode vs decode by function
    ("checks", ("_checked_values", "_within_norm", "_check_header")),
    ("reduce", ("accumulate_part", "aggregators.py")),
    ("protobuf", ("SerializeToString", "ParseFromString", "ByteSize", "CopyFrom")),
    ("stream I/O", ("send_raw_data", "receive_raw_data", "readexactly", "p2p_daemon_bindings", "drain")),
    ("msgpack", ("msgpack", "serializer.py")),
    ("matchmaking", ("matchmaking.py", "key_manager.py")),
    ("dht", ("hivemind/dht/",)),
]


def classify(frames: list[str]) -> str:
    """The category of one sampled stack (outermost frame first)."""
    for name, keys in CATEGORIES:
        if any(k in f for f in frames for k in keys):
            if name == "codec encode" and any("decode" in f for f in frames):
                return "codec decode"
            return name
    return "other"


def p2pd_cpu_seconds() -> float:
    """User + system CPU seconds of every p2pd process alive now (ours: the run's)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() != "p2pd":
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            continue
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="large", help="allreduce_bench.py model size")
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--raw", help="keep py-spy's raw stacks here")
    p.add_argument("--top", type=int, default=0, help="also print the N most sampled innermost frames of 'other'")
    args = p.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        raw, bench_json = Path(tmp) / "raw.txt", Path(tmp) / "bench.json"
        cmd = [spy, "record", "--subprocesses", "--format", "raw", "--rate", str(args.rate), "-o", str(raw), "--",
               sys.executable, str(ROOT / "benchmarks" / "allreduce_bench.py"), "--sizes", args.size,
               "--learners", str(args.learners), "--rounds", str(args.rounds), "--skip-gloo",
               "--json", str(bench_json)]
        peak = [0.0]

        def watch(proc: subprocess.Popen) -> None:  # p2pd's CPU, read while its daemons are alive
            while proc.poll() is None:
                peak[0] = max(peak[0], p2pd_cpu_seconds())
                time.sleep(0.2)

        started = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT)
        watcher = threading.Thread(target=watch, args=(proc,), daemon=True)
        watcher.start()
        code = proc.wait()
        watcher.join()
        wall = time.monotonic() - started
        if code != 0:
            print(f"the profiled run failed (exit {code})", file=sys.stderr)
            return code
        counts: collections.Counter[str] = collections.Counter()
        leaves: collections.Counter[str] = collections.Counter()
        for line in raw.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if stack and n.isdigit():
                frames = stack.split(";")
                scope = "all-reduce" if any("allreduce.py" in f or "averager.py" in f for f in frames) else "outside"
                category = classify(frames)
                counts[f"{scope}: {category}"] += int(n)
                if category == "other":
                    leaves[f"{scope}: {frames[-1]}"] += int(n)
        if args.raw:
            shutil.copy(raw, args.raw)
        bench = json.loads(bench_json.read_text())
    total = sum(counts.values())
    rows = [{"category": c, "samples": n, "share": n / total} for c, n in counts.most_common()]
    print("| what the Python processes were doing on CPU | samples | share |\n|---|---|---|")
    for r in rows:
        print(f"| {r['category']} | {r['samples']} | {100 * r['share']:.1f}% |")
    for leaf, n in leaves.most_common(args.top):
        print(f"  other, innermost frame: {leaf} {n}")
    cpu_python = total / args.rate
    print(f"\nPython on CPU: {cpu_python:.1f} s (samples ÷ rate); p2pd: {peak[0]:.1f} s of CPU; wall {wall:.1f} s "
          f"(the whole benchmark: DHTs and averagers starting, warm-up round, {args.rounds} timed rounds)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "python_cpu_seconds": cpu_python,
                                               "p2pd_cpu_seconds": peak[0], "wall_seconds": wall,
                                               "bench": bench}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
