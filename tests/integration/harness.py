"""Start real bootstrap and learner processes on loopback, and make sure none outlives a test."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = str(ROOT / "peers" / "small-cpu.toml")

# Fast settings for a 2-core machine: short rounds, short record lifetime, short linger.
FAST = [
    "--set", "inner.steps_per_outer=20",
    "--set", "averaging.matchmaking_time=2.5",
    "--set", "averaging.request_timeout=1.0",
    "--set", "averaging.round_timeout=10.0",
    "--set", "averaging.next_chunk_timeout=5.0",
    "--set", "network.record_ttl=8.0",
    "--set", "run.linger_seconds=40.0",
]


class Proc:
    def __init__(self, name: str, args: list[str], log: Path):
        self.name, self.log_path = name, log
        self._log = log.open("wb")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "p2p_diloco", *args], stdout=self._log, stderr=subprocess.STDOUT,
            cwd=ROOT, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def kill_group(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


class Swarm:
    """A bootstrap node plus learners, each in its own process group (p2pd daemons included)."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[Proc] = []
        self.bootstrap_addr: str | None = None

    def start_bootstrap(self, timeout: float = 90) -> str:
        maddrs = self.tmp / "bootstrap.maddrs"
        p = self.spawn("bootstrap", ["bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                     "--identity", str(self.tmp / "boot.key"), "--maddrs-file", str(maddrs)])
        wait_until(lambda: maddrs.exists() and maddrs.read_text().strip(), timeout, p, "bootstrap address")
        self.bootstrap_addr = maddrs.read_text().split()[0]
        self.bootstrap = p
        return self.bootstrap_addr

    def spawn(self, name: str, args: list[str]) -> Proc:
        p = Proc(name, args, self.tmp / f"{name}.log")
        self.procs.append(p)
        return p

    def start_learner(self, i: int, max_outer_steps: int, extra: list[str] = (), peers: str | None = None) -> Proc:
        args = [
            "learner", "--config", SMALL, "--initial-peers", peers or self.bootstrap_addr,
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--shard-index", str(i), "--num-shards", "4",
            "--max-outer-steps", str(max_outer_steps), "--checkpoint-dir", str(self.tmp / f"ckpt-{i}"),
            "--summary", str(self.summary_path(i)), *FAST, *extra,
        ]
        return self.spawn(f"learner-{i}", args)

    def summary_path(self, i: int) -> Path:
        return self.tmp / f"summary-{i}.json"

    def summary(self, i: int) -> dict:
        return json.loads(self.summary_path(i).read_text())

    def close(self) -> None:
        for p in self.procs:
            p.kill_group()

    def describe(self) -> str:
        return "\n".join(f"----- {p.name} (rc={p.popen.poll()}) -----\n{p.text()[-3000:]}" for p in self.procs)


def wait_until(cond, timeout: float, proc: Proc | None = None, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc is not None and proc.popen.poll() is not None:
            raise AssertionError(f"{proc.name} exited (rc={proc.popen.returncode}) before {what}:\n{proc.text()}")
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def committed_version(proc: Proc) -> int:
    found = re.findall(r"outer round committed \| version (\d+)", proc.text())
    return int(found[-1]) if found else 0


def processes_in_group(pgid: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pgid=,pid=,stat=,comm="], capture_output=True, text=True).stdout
    rows = [line.split() for line in out.splitlines()]
    return [" ".join(r) for r in rows if r and r[0] == str(pgid) and not r[2].startswith("Z")]
