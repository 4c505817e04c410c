"""A fresh learner joins a running swarm: is its first outer gradient left out as an outlier?

Real processes on loopback: a bootstrap node and 3 learners with the chaos benchmark's decoupled settings
(benchmarks/chaos.py: 2 fragments on a 15 s clock, τ = 25, 0.1 s of sleep per step); once learner 0 has
committed version 2 of fragment 1, a 4th learner starts from nothing (no checkpoint: a fresh AdamW) with
``inner.rejoin_warmup_steps = W`` for each W in ``--rewarm`` (0: the code before the re-warm-up). Learner
0 logs at DEBUG, where the outlier rule prints every member's norm per √(inner steps at the peak lr) (per
inner step before 2026-12-05). Printed per arm: those lines for the rounds the newcomer was in, every exclusion, and
the newcomer's own rounds. Where the newcomer's start falls against the 15 s clock decides whether its
first round comes after 1 inner step or after ~25, so give an arm more than once to see both.

Usage::

    .venv/bin/python benchmarks/rejoin_swarm.py --rewarm 0,20,0,20 --workdir /tmp/rejoin_swarm
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from chaos import COMMON, DECOUPLED, SMALL  # noqa: E402

from p2p_diloco.sim.processes import LOOPBACK_ANY_PORT, Proc, cli, start_bootstrap, stop_procs  # noqa: E402

ROUND = re.compile(r"outer round (not )?committed")


def arm(rewarm: int, work: Path) -> list[str]:
    """One swarm of 3 and a newcomer with ``rewarm``; the lines that show how the newcomer's rounds went."""
    work.mkdir(parents=True)
    boot, peers = start_bootstrap(work)

    def start(i: int) -> Proc:
        return Proc(f"learner-{i}", cli(
            *(["--log-level", "DEBUG"] if i == 0 else []), "learner", "--config", SMALL, "--initial-peers", peers,
            "--host-maddrs", LOOPBACK_ANY_PORT, "--shard-index", str(i), "--num-shards", "4",
            "--checkpoint-dir", str(work / f"ckpt-{i}"), *COMMON, "--set", "run.eval_every=1000000", *DECOUPLED,
            "--set", "averaging.target_group_size=4", "--set", "inner.extra_step_seconds=0.1",
            "--set", f"inner.rejoin_warmup_steps={rewarm}", "--max-outer-steps", "8"), work / f"learner-{i}.log")

    procs = [boot, *(start(i) for i in range(3))]
    try:
        deadline = time.monotonic() + 240
        while not re.search(r"outer round committed \| version 2 fragment 1", procs[1].text()):
            if time.monotonic() > deadline:
                raise SystemExit(f"error: the swarm did not reach version 2 in 240 s (logs in {work})")
            time.sleep(0.5)
        new = start(3)
        procs.append(new)
        deadline = time.monotonic() + 90
        while len(ROUND.findall(new.text())) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        stop_procs(procs, 10)
    short = re.search(r"\[(\w{6}) step=", new.text())
    peer = short.group(1) if short else "??????"
    lines = [f"newcomer {peer}"]
    for p in procs[1:]:
        for line in p.text().splitlines():
            norms = re.search(r"norms per (inner step|√\(inner steps( at the peak lr)?\))", line)
            if (norms and peer in line) or "excluded" in line or (
                    p is new and (ROUND.search(line) or "synced global state" in line or "ramps up" in line)):
                lines.append(f"{p.name}: {line[:240]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rewarm", default="0,20", help="inner.rejoin_warmup_steps of the newcomer, one arm each")
    p.add_argument("--workdir", type=Path, required=True, help="logs and checkpoints, one folder per arm (new)")
    args = p.parse_args(argv)
    for n, w in enumerate(map(int, args.rewarm.split(","))):  # an arm may repeat: the newcomer's phase varies
        print(f"== inner.rejoin_warmup_steps = {w}", flush=True)
        print("\n".join(arm(w, args.workdir / f"{n}-rewarm-{w}")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
