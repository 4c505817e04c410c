"""`p2p-diloco regions`: real learners in network namespaces, regions joined by tbf-shaped links.

These tests need root and `ip netns` (CI runs as root); elsewhere they skip and say why.
Every test removes its namespaces and processes in a `finally`, even when it fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from p2p_diloco.sim.processes import wait_until
from p2p_diloco.sim.regions import netns

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

    def __init__(self, tmp: Path, *args: str, topology: str = TWO_REGIONS):
        self.topology = tmp / "topology.toml"
        self.topology.write_text(topology)
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
    """:func:`wait_until`, with the regions' log in the error."""
    try:
        wait_until(cond, timeout, what=what, poll=0.3)
    except TimeoutError as e:
        log = regions.text()[-4000:] if regions is not None else ""
        raise AssertionError(f"{e}:\n{log}") from None


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


# Region `home` is behind NAT; `pub` (the bootstrap node's) and `far` are not.
NAT_MECHANICS = """\
run_id = "nat-test"
num_shards = 3
bootstrap_region = "pub"

[[regions]]
name = "pub"
subnet = "10.77.1.0/24"
learners = 1
bandwidth = "100mbit"

[[regions]]
name = "home"
subnet = "10.77.2.0/24"
learners = 1
bandwidth = "100mbit"
nat = true

[[regions]]
name = "far"
subnet = "10.77.3.0/24"
learners = 1
bandwidth = "100mbit"
"""

# Accepts connections on PORT and prints each one's source address, one a line.
_LISTEN = """\
import socket, sys
s = socket.socket()
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
while True:
    c, (addr, _) = s.accept()
    print(addr, flush=True)
    c.close()
"""

_DIAL = """\
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("connected")
except OSError as e:
    print(f"failed: {e!r}")
"""


def _firewalls() -> list[str]:
    return [t for t in netns.NAT_TOOLS if shutil.which(t) is not None] or ["none installed"]


@needs_netns
@pytest.mark.timeout(120)
@pytest.mark.parametrize("firewall", _firewalls())
def test_a_nat_region_dials_out_but_cannot_be_dialled(tmp_path, firewall):
    """Real namespaces and TCP sockets: from `home` (NAT) out, from outside in, and a public control."""
    from p2p_diloco.sim.regions.topology import load_topology

    if firewall == "none installed":
        pytest.skip("neither iptables nor nft is installed")
    path = tmp_path / "t.toml"
    path.write_text(NAT_MECHANICS)
    topo = load_topology(path)
    prefix = f"{netns.run_prefix()}nat{firewall[:3]}-"
    fabric = netns.Fabric(topo, prefix, netem=False, firewall=firewall)
    listeners: list[subprocess.Popen] = []

    def listen(host: str, port: int) -> subprocess.Popen:
        p = subprocess.Popen(["ip", "netns", "exec", f"{prefix}{host}", sys.executable, "-c", _LISTEN, str(port)],
                             stdout=subprocess.PIPE, text=True)
        listeners.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "listening"
        return p

    def dial(host: str, addr: object, port: int, timeout: float = 3.0) -> str:
        r = subprocess.run(["ip", "netns", "exec", f"{prefix}{host}", sys.executable, "-c", _DIAL, str(addr),
                            str(port), str(timeout)], capture_output=True, text=True, timeout=30)
        return r.stdout.strip() or r.stderr.strip()

    home, pub, far = topo.region("home"), topo.region("pub"), topo.region("far")
    public_home = topo.backbone_addr("home")
    try:
        fabric.build()
        inside = listen("home-0", 5000)
        outside = listen("pub-0", 5001)
        # Out of the NAT: connects, and the other end sees the gateway's backbone address.
        assert dial("home-0", pub.learner_addr(0), 5001) == "connected"
        assert dial("home-0", far.learner_addr(0), 5001).startswith("failed")  # nothing listens there: control
        # A public region's connection keeps its own address (the control for the line after next).
        assert dial("far-0", pub.learner_addr(0), 5001) == "connected"
        assert outside.stdout is not None
        assert [outside.stdout.readline().strip() for _ in range(2)] == [str(public_home), str(far.learner_addr(0))]
        # Into the NAT: the learner's own address is not routed from outside, and new connections to the
        # gateway's public address are dropped (a timeout, not a refusal).
        for src in ("pub-0", "far-0"):
            assert "unreachable" in dial(src, home.learner_addr(0), 5000).lower()
        assert "timed out" in dial("pub-0", public_home, 5000, timeout=2.0)
        # Inside the region, the listener is reachable: what blocked the others is the NAT, not the listener.
        assert dial("home-0", home.learner_addr(0), 5000) == "connected"
        assert inside.stdout is not None and inside.stdout.readline().strip() == str(home.learner_addr(0))
    finally:
        for p in listeners:
            p.kill()
            p.wait(10)
        fabric.teardown(grace=2.0)
    assert [ns for ns in netns.list_namespaces() if ns.startswith(prefix)] == []


@needs_netns
@pytest.mark.timeout(60)
def test_a_nat_region_without_iptables_or_nft_is_a_one_line_error(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("ip", "tc"):  # iproute2 only, as on a machine without the iptables package
        (bin_dir / tool).symlink_to(shutil.which(tool))
    topology = tmp_path / "t.toml"
    topology.write_text(NAT_MECHANICS)
    p = subprocess.Popen([sys.executable, "-m", "p2p_diloco", "regions", "--topology", str(topology),
                          "--workdir", str(tmp_path / "work")], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "PATH": str(bin_dir)})
    try:
        _, err = p.communicate(timeout=40)
    finally:
        p.kill()
    assert p.returncode == 2, err
    assert "install the iptables package" in err and len(err.strip().splitlines()) == 1, err
    assert [ns for ns in netns.list_namespaces() if ns.startswith(netns.run_prefix(p.pid))] == []


# Two public regions of one learner each and `home`, two learners behind NAT.
NAT_REGIONS = """\
run_id = "nat-regions-test"
learner_config = "peers/small-cpu.toml"
max_outer_steps = 3
num_shards = 6
bootstrap_region = "north"

[[regions]]
name = "north"
subnet = "10.77.1.0/24"
learners = 1
bandwidth = "20mbit"

[[regions]]
name = "south"
subnet = "10.77.2.0/24"
learners = 1
bandwidth = "20mbit"

[[regions]]
name = "home"
subnet = "10.77.3.0/24"
learners = 2
bandwidth = "20mbit"
nat = true
"""


@needs_netns
@pytest.mark.timeout(300)
def test_learners_behind_nat_take_part_as_clients_and_end_on_one_state(tmp_path):
    if not any(shutil.which(t) for t in netns.NAT_TOOLS):
        pytest.skip("neither iptables nor nft is installed")
    run = Regions(tmp_path, "--max-outer-steps", "3", *FAST, topology=NAT_REGIONS)
    try:
        assert run.popen.wait(270) == 0, run.text()[-6000:]
        out = run.text()
        summary = json.loads((run.work / "regions-summary.json").read_text())
        learners = summary["learners"]
        assert sorted(learners) == ["home-0", "home-1", "north-0", "south-0"]
        hashes = {s["global_state_sha256"] for s in learners.values()}
        assert len(hashes) == 1, f"regions ended with {len(hashes)} global states: {learners}"
        assert "regions: home     10.77.3.0/24  2 learners" in out and "behind NAT (seen outside as 10.77.0.12)" in out
        # Each learner's start-up verdict on how peers reach it: the NAT'd ones could not be dialled back.
        for name, mode in {"north-0": "direct", "south-0": "direct",
                           "home-0": "client only", "home-1": "client only"}.items():
            found = re.findall(rf"^\s*{name} \| .*reachable: (direct|relay|client only)\b", out, re.M)
            assert found == [mode], (name, found, out[-6000:])
        for name, s in learners.items():
            assert s["version"] == 3, (name, s)
        # The clients' tokens are merged: they committed rounds (every round they took part in), in groups
        # that also held the public learners.
        for name in ("home-0", "home-1"):
            assert learners[name]["outer_steps"] >= 1 and learners[name]["bytes_sent"] > 0, (name, learners[name])
            groups = [int(g) for g in re.findall(rf"^\s*{name} \| .*outer round committed \| .* group (\d+) ",
                                                  out, re.M)]
            assert len(groups) == learners[name]["outer_steps"] and min(groups) >= 2, (name, groups)
        assert summary["links"]["home"]["up"] > 500_000 and summary["links"]["home"]["down"] > 500_000
        assert "all 4 learners in 3 regions hold the same global state" in out
        assert run.namespaces() == [] and run.leftover_processes() == []
    finally:
        run.close()
