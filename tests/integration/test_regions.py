"""`p2p-diloco regions`: real learners in network namespaces, regions joined by tbf-shaped links.

These tests need root and `ip netns` (CI runs as root); elsewhere they skip and say why.
Every test removes its namespaces and processes in a `finally`, even when it fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2p_diloco.regions import netns

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

# Fast rounds for a 2-core machine (as in harness.FAST).
FAST = [
    "--set", "inner.steps_per_outer=20",
    "--set", "averaging.matchmaking_time=2.5",
    "--set", "averaging.request_timeout=1.0",
    "--set", "averaging.round_timeout=10.0",
    "--set", "network.record_ttl=8.0",
    "--set", "run.linger_seconds=40.0",
]

TWO_REGIONS = """\
run_id = "regions-test"
learner_config = "peers/small-cpu.toml"
max_outer_steps = 3
num_shards = 4
bootstrap_region = "north"

[[regions]]
name = "north"
subnet = "10.77.1.0/24"
learners = 2
bandwidth = "20mbit"
delay_ms = 20

[[regions]]
name = "south"
subnet = "10.77.2.0/24"
learners = 2
bandwidth = "20mbit"
"""


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces (CI runs as root)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command"
    probe = f"{netns.run_prefix()}testprobe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


_REASON = _netns_unavailable()
needs_netns = pytest.mark.skipif(_REASON is not None, reason=f"regions simulator: {_REASON}")


class Regions:
    """One `p2p-diloco regions` supervisor process, its log, and a teardown that leaves nothing."""

    def __init__(self, tmp: Path, *args: str):
        self.topology = tmp / "topology.toml"
        self.topology.write_text(TWO_REGIONS)
        self.work = tmp / "work"
        self.log_path = tmp / "regions.log"
        self._log = self.log_path.open("wb")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "p2p_diloco", "regions", "--topology", str(self.topology),
             "--workdir", str(self.work), *args],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.prefix = netns.run_prefix(self.popen.pid)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def namespaces(self) -> list[str]:
        return [ns for ns in netns.list_namespaces() if ns.startswith(self.prefix)]

    def leftover_processes(self) -> list[str]:
        """Processes whose command line names this run's work dir (learners, bootstrap, their p2pd)."""
        found = []
        needle = str(self.work).encode()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if needle in cmd and int(pid) != os.getpid():
                text = cmd.replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{pid}: {text[:200]}")
        return found

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)  # the supervisor's own teardown
            try:
                self.popen.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        netns.delete_namespaces(self.prefix, grace=5.0)  # whatever a failed teardown left
        self._log.close()


def _wait_until(cond, timeout: float, what: str, regions: Regions | None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.3)
    log = regions.text()[-4000:] if regions is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}:\n{log}")


@needs_netns
@pytest.mark.timeout(300)
def test_two_regions_over_a_shaped_link_merge_into_one_state(tmp_path):
    run = Regions(tmp_path, "--max-outer-steps", "3", *FAST)
    try:
        assert run.popen.wait(270) == 0, run.text()[-6000:]
        out = run.text()
        summary = json.loads((run.work / "regions-summary.json").read_text())
        learners = summary["learners"]
        assert sorted(learners) == ["north-0", "north-1", "south-0", "south-1"]
        hashes = {s["global_state_sha256"] for s in learners.values()}
        assert len(hashes) == 1, f"regions ended with {len(hashes)} global states: {learners}"
        for name, s in learners.items():
            assert s["version"] == 3, (name, s)
            assert s["last_eval_loss"] < s["first_eval_loss"] - 0.5, (name, s)
        # Each learner listened on and announced its own namespace's address.
        for name, addr in {"north-0": "10.77.1.129", "south-1": "10.77.2.130"}.items():
            assert f"{name:>10} | " in out and f"visible at ['/ip4/{addr}/tcp/41000/p2p/" in out
        # The rounds crossed the shaped inter-region links, in both directions of each.
        for region in ("north", "south"):
            assert summary["links"][region]["up"] > 500_000, summary["links"]
            assert summary["links"][region]["down"] > 500_000, summary["links"]
        if not summary["netem"]:
            assert "no netem qdisc: delay and loss are NOT applied; shaping bandwidth only" in out
        assert "all 4 learners in 2 regions hold the same global state" in out
        assert run.namespaces() == [] and run.leftover_processes() == []
    finally:
        run.close()


@needs_netns
@pytest.mark.timeout(180)
def test_supervisor_killed_leaves_no_namespace_or_process(tmp_path):
    run = Regions(tmp_path, "--max-outer-steps", "50", *FAST)
    try:
        _wait_until(lambda: "--initial-peers /ip4/10.77.1.10/tcp/31337/p2p/" in run.text(), 90, "the bootstrap", run)
        learner_ns = f"{run.prefix}south-1"
        _wait_until(lambda: learner_ns in netns.list_namespaces() and netns.namespace_pids(learner_ns), 30,
                    "a learner inside its namespace", run)
        os.kill(run.popen.pid, signal.SIGKILL)
        run.popen.wait(10)
        # The detached reaper sees the supervisor gone and removes everything.
        _wait_until(lambda: not run.namespaces() and not run.leftover_processes(), 60,
                    "the reaper to remove namespaces and processes", run)
        assert "removed" in (run.work / "reaper.log").read_text()
    finally:
        run.close()


@needs_netns
@pytest.mark.timeout(60)
def test_cleanup_removes_what_a_crashed_run_left(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer exists: a supervisor that crashed
    ns = f"{netns.run_prefix(gone.pid)}stale"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "300"], start_new_session=True)
    try:
        _wait_until(lambda: netns.namespace_pids(ns), 10, "the stale process", None)
        r = subprocess.run([sys.executable, "-m", "p2p_diloco", "regions", "--cleanup"], cwd=ROOT,
                           capture_output=True, text=True, timeout=40)
        assert r.returncode == 0, r
        assert ns in r.stdout
        assert ns not in netns.list_namespaces()
        assert sleeper.wait(10) is not None
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@needs_netns
@pytest.mark.timeout(60)
@pytest.mark.parametrize("wrap, env, needle", [
    (["unshare", "--user"], {}, "needs root"),  # an unprivileged user namespace: euid is not 0
    ([], {"PATH": "/nonexistent"}, "needs the `ip` command"),
])
def test_without_root_or_iproute2_it_is_a_one_line_error(tmp_path, wrap, env, needle):
    r = subprocess.run([*wrap, sys.executable, "-m", "p2p_diloco", "regions"], cwd=ROOT, capture_output=True,
                       text=True, timeout=40, env={**os.environ, **env})
    if wrap and "unshare" in r.stderr:
        pytest.skip(f"unprivileged user namespaces unavailable: {r.stderr.strip()}")
    assert r.returncode == 2, r
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
