"""Restart latency: how long a killed learner takes from its new process to its first inner step.

A small swarm (the chaos benchmark's decoupled settings) trains on loopback; one learner is killed
(SIGKILL of its process group) and restarted with ``--resume`` at once, ``--restarts`` times, while
the others keep training (the load a real restart meets on this shared machine). Latency = time
from ``Popen`` to the first inner-step log line of the new process (polled every 20 ms).

``--compare DIR`` runs the same measurement on the code of another checkout (``git worktree add
DIR <commit>``) in a second swarm, alternating, so before/after are measured side by side:

    python benchmarks/startup.py --restarts 4 --compare /tmp/before --json benchmarks/results/startup.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos import COMMON, DECOUPLED  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"step=(\d+) round=\d+\] inner ")


def spawn(code: Path, args: list[str], log: Path) -> subprocess.Popen:
    # ``python -m`` puts the working directory first on sys.path: the package of ``code`` is imported.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "p2p_diloco", *args], cwd=code, start_new_session=True,
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)


def kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def wait_for(log: Path, pattern: re.Pattern, offset: int, timeout: float) -> float | None:
    """Seconds until ``pattern`` appears in ``log`` after byte ``offset``; None on timeout."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if pattern.search(log.read_bytes()[offset:].decode(errors="replace")):
            return time.monotonic() - started
        time.sleep(0.02)
    return None


def measure(code: Path, work: Path, learners: int, restarts: int, settle: float) -> list[float]:
    work.mkdir(parents=True)
    maddrs = work / "bootstrap.maddrs"
    boot = spawn(code, ["bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity", str(work / "boot.key"),
                        "--maddrs-file", str(maddrs)], work / "bootstrap.log")
    procs: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 60
        while not (maddrs.exists() and maddrs.read_text().strip()):
            if time.monotonic() > deadline:
                raise SystemExit(f"error: the bootstrap node of {code} did not start")
            time.sleep(0.1)
        peers = maddrs.read_text().split()[0]

        def learner(i: int) -> subprocess.Popen:
            return spawn(code, [
                "learner", "--config", str(code / "peers" / "small-cpu.toml"), "--initial-peers", peers,
                "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--shard-index", str(i), "--num-shards", str(learners),
                "--checkpoint-dir", str(work / f"ckpt-{i}"), "--resume", *COMMON, *DECOUPLED,
                "--set", "run.log_every=1", "--set", f"averaging.target_group_size={learners}",
            ], work / f"learner-{i}.log")

        procs = [learner(i) for i in range(learners)]
        victim = learners - 1
        log = work / f"learner-{victim}.log"
        if wait_for(log, STEP_LINE, 0, 180) is None:
            raise SystemExit(f"error: learner {victim} of {code} never trained; see {log}")
        latencies = []
        for _ in range(restarts):
            time.sleep(settle)  # train (and checkpoint) between restarts
            kill(procs[victim])
            offset = log.stat().st_size
            procs[victim] = learner(victim)
            latency = wait_for(log, STEP_LINE, offset, 180)
            if latency is None:
                raise SystemExit(f"error: the restarted learner of {code} did not train within 180 s; see {log}")
            latencies.append(round(latency, 2))
            print(f"  {code}: restart {len(latencies)}: {latency:.2f} s to the first inner step", flush=True)
        return latencies
    finally:
        for p in [*procs, boot]:
            kill(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", type=int, default=3, help="swarm size (the last one is restarted)")
    ap.add_argument("--restarts", type=int, default=4, help="restarts per code version")
    ap.add_argument("--settle", type=float, default=12.0, help="seconds of training between restarts")
    ap.add_argument("--compare", help="a second checkout whose code is measured the same way")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--workdir", help="keep the logs here (default: a temporary directory)")
    args = ap.parse_args()
    codes = [ROOT] + ([Path(args.compare).resolve()] if args.compare else [])
    for code in codes:
        if not (code / "p2p_diloco" / "__init__.py").exists():
            raise SystemExit(f"error: {code} is not a p2p-diloco checkout")
    results: dict[str, list[float]] = {str(c): [] for c in codes}
    workdir = contextlib.nullcontext(args.workdir) if args.workdir else tempfile.TemporaryDirectory(prefix="startup-")
    with workdir as tmp:
        # Alternate the versions in two halves (A B, then B A), so drift on the machine hits both.
        half = (args.restarts + 1) // 2
        order = [*codes, *reversed(codes)]
        for k, code in enumerate(order):
            n = half if k < len(codes) else args.restarts - half
            if n:
                results[str(code)] += measure(code, Path(tmp) / f"run-{k}", args.learners, n, args.settle)
    print("\n| code | restarts | median s | min s | max s |\n|---|---|---|---|---|")
    for code, xs in results.items():
        print(f"| {code} | {len(xs)} | {statistics.median(xs):.2f} | {min(xs):.2f} | {max(xs):.2f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"learners": args.learners, "latencies": results}, indent=2))


if __name__ == "__main__":
    main()
