"""docker-compose.yml for real: the 3-region swarm in containers, disturbed the way the README says.

Needs a Docker engine and a compose client (`docker compose` v2 or `docker-compose` v1); without
them the test skips and says why, unless P2P_DILOCO_REQUIRE_DOCKER=1 (CI sets it), which turns the
skip into a failure. The image is built first with P2P_DILOCO_DOCKER_BUILD when set (CI and
machines without Docker Hub: scripts/docker_build.sh), else with `docker build`.

One run: the swarm comes up; the region behind NAT (`us`) reaches the others only from its
gateway's backbone address and cannot be dialled; `ap`'s learner is stopped and started again
(it resumes from its checkpoint); `ap` is cut off the backbone and healed; `--scale` adds a learner
in `eu`, which downloads the state; every learner ends at max_outer_steps with one global-state
hash. `down -v` removes every container, network and volume, also when the test fails.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from p2p_diloco.sim.processes import wait_until

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
IMAGE = "p2p-diloco:latest"
PREFIX = "p2pdcompose"  # every project this test starts; a crashed run's leftovers go at the next start
CKPT = "/var/lib/p2p-diloco/checkpoint"
MAX_OUTER_STEPS = 14
# Fast rounds for a 2-core machine (as in tests/integration/test_regions.py).
FAST = [
    "--max-outer-steps", str(MAX_OUTER_STEPS),
    "--set", "inner.steps_per_outer=20",
    "--set", "averaging.matchmaking_time=2.5",
    "--set", "averaging.request_timeout=1.0",
    "--set", "averaging.round_timeout=10.0",
    "--set", "network.record_ttl=8.0",
    "--set", "run.linger_seconds=30.0",
]


def _run(cmd: list[str], timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{shlex.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def _compose_client() -> list[str] | None:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        try:
            if subprocess.run([*cmd, "version"], capture_output=True, timeout=30).returncode == 0:
                return cmd
        except subprocess.TimeoutExpired:
            continue
    return None


def _docker_unavailable() -> str | None:
    if shutil.which("docker") is None:
        return "needs the docker command and a Docker engine"
    try:
        r = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                           timeout=30)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer in 30 s"
    if r.returncode != 0:
        return f"no Docker engine reachable: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
    if _compose_client() is None:
        return "needs `docker compose` (v2) or `docker-compose` (v1)"
    return None


def _labelled(kind: str, project: str | None = None) -> list[str]:
    """IDs of `kind` (container, network, volume) objects of compose project `project`, or of every
    project this test ever started (names starting with PREFIX)."""
    ls = {"container": ["docker", "ps", "-a"], "network": ["docker", "network", "ls"],
          "volume": ["docker", "volume", "ls"]}[kind]
    key = "{{.ID}}" if kind != "volume" else "{{.Name}}"
    out = _run([*ls, "--filter", "label=com.docker.compose.project",
                "--format", key + ' {{.Label "com.docker.compose.project"}}']).stdout
    rows = [line.split() for line in out.splitlines() if len(line.split()) == 2]
    return [i for i, p in rows if (p == project if project else p.startswith(PREFIX))]


def _remove(project: str | None) -> None:
    """Force-remove what `down` left of `project` (or of every earlier run of this test)."""
    for kind, rm in (("container", ["docker", "rm", "-f", "-v"]), ("network", ["docker", "network", "rm"]),
                     ("volume", ["docker", "volume", "rm", "-f"])):
        names = _labelled(kind, project)
        if names:
            _run([*rm, *names], timeout=120, check=False)


class ComposeProject:
    """One compose project of docker-compose.yml with fast learners, and what the test reads from it: the
    containers' counterpart of the loopback :class:`~tests.integration.harness.Swarm`."""

    def __init__(self, tmp: Path, client: list[str]):
        self.project = f"{PREFIX}{uuid.uuid4().hex[:8]}"
        self.tmp = tmp
        spec = yaml.safe_load(COMPOSE_FILE.read_text())
        self.learner_services = [s for s in spec["services"] if s.startswith("learner-")]
        # Same learners, fewer and faster outer steps: an override file (`-f`), as a user would write one.
        override = {"services": {s: {"command": [str(c) for c in spec["services"][s]["command"]
                                                 if str(c) != "--max-outer-steps"][:-1] + FAST}
                                 for s in self.learner_services}}
        for s in self.learner_services:  # the dropped pair was --max-outer-steps N, the command's last two words
            assert "--max-outer-steps" in spec["services"][s]["command"][-2:], spec["services"][s]["command"]
        (tmp / "fast.yml").write_text(yaml.safe_dump(override))
        self.base = [*client, "-p", self.project, "-f", str(COMPOSE_FILE), "-f", str(tmp / "fast.yml")]
        self.topology = spec

    def __call__(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return _run([*self.base, *args], timeout=timeout)

    def ids(self, service: str) -> list[str]:
        """Container IDs of `service`, running or not, in creation order."""
        out = _run(["docker", "ps", "-a", "--filter", f"label=com.docker.compose.project={self.project}",
                    "--filter", f"label=com.docker.compose.service={service}", "--format", "{{.ID}}"]).stdout
        return list(reversed(out.split()))

    def learners(self) -> list[str]:
        return [c for s in self.learner_services for c in self.ids(s)]

    def logs(self, container: str) -> str:
        r = _run(["docker", "logs", container], check=False)
        return r.stdout + r.stderr

    def version(self, container: str) -> int:
        """The newest global version `container` logged (`outer step done | version N`), 0 before any."""
        found = re.findall(r"outer step done \| version (\d+)", self.logs(container))
        return int(found[-1]) if found else 0

    def running(self, container: str) -> bool:
        return _run(["docker", "inspect", "-f", "{{.State.Running}}", container]).stdout.strip() == "true"

    def exec(self, container: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run(["docker", "exec", container, *cmd], timeout=60, check=check)

    def wait(self, what: str, cond, timeout: float) -> None:
        """:func:`wait_until`, with the containers' logs in the error."""
        try:
            wait_until(cond, timeout, what=what, poll=2)
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{self.describe()}") from None

    def wait_versions_past(self, containers: list[str], version: int, timeout: float) -> None:
        self.wait(f"{containers} past version {version}",
                  lambda: all(self.version(c) > version for c in containers), timeout)

    def summary(self, container: str) -> dict:
        """The JSON summary the learner wrote at exit, copied out of its checkpoint volume."""
        dest = self.tmp / f"summary-{container}.json"
        r = _run(["docker", "cp", f"{container}:{CKPT}/summary.json", str(dest)], check=False)
        if r.returncode != 0:
            raise AssertionError(f"{container} wrote no summary: {r.stderr.strip()}\n{self.logs(container)[-3000:]}")
        return json.loads(dest.read_text())

    def describe(self) -> str:
        out = []
        for c in _labelled("container", self.project):
            name = _run(["docker", "inspect", "-f", "{{.Name}} {{.State.Status}} exit={{.State.ExitCode}}", c],
                        check=False).stdout.strip()
            out.append(f"--- {name}\n" + "\n".join(self.logs(c).splitlines()[-25:]))
        return "\n".join(out)

    def down(self) -> None:
        """`down -v`, then check nothing of the project is left (removing and naming whatever is)."""
        r = _run([*self.base, "down", "-v", "--remove-orphans", "-t", "5"], timeout=180, check=False)
        left = {kind: _labelled(kind, self.project) for kind in ("container", "network", "volume")}
        if any(left.values()):
            _remove(self.project)
            raise AssertionError(f"`down -v` left {left} (exit {r.returncode}: {r.stderr[-2000:]})")


def _build_image() -> None:
    cmd = os.environ.get("P2P_DILOCO_DOCKER_BUILD")
    argv = shlex.split(cmd) if cmd else ["docker", "build", "-t", IMAGE, "."]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"image build ({shlex.join(argv)}) failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"


@pytest.fixture
def swarm(tmp_path, request):
    reason = _docker_unavailable()
    if reason is not None:
        if os.environ.get("P2P_DILOCO_REQUIRE_DOCKER") == "1":
            pytest.fail(f"P2P_DILOCO_REQUIRE_DOCKER=1 but {reason}")
        pytest.skip(f"docker compose: {reason}")
    _remove(None)  # a crashed earlier run holds the topology's fixed subnets
    _build_image()
    client = _compose_client()
    assert client is not None
    s = ComposeProject(tmp_path, client)
    try:
        yield s
    finally:
        failed = getattr(request.node, "rep_call", None)
        if failed is not None and failed.failed:
            print(s.describe())
        s.down()


@pytest.mark.timeout(900)
def test_compose_swarm_survives_stop_partition_and_scale(swarm):
    s = swarm
    spec = s.topology["services"]
    nat_gw = next(name for name, svc in spec.items() if "NAT_SUBNET" in svc.get("environment", {}))
    nat_region = spec[nat_gw]["environment"]["REGION"]
    nat_backbone = spec[nat_gw]["environment"]["BACKBONE_ADDR"]
    s("up", "-d", timeout=300)
    learners = s.learners()
    expected = {svc: spec[svc]["deploy"]["replicas"] for svc in s.learner_services}
    assert len(learners) == sum(expected.values()), (learners, expected)

    # Every learner trains and the swarm commits rounds.
    s.wait_versions_past(learners, 1, timeout=240)

    # NAT: the region's learners cannot be dialled from outside, and their connections arrive from the
    # gateway's backbone address, never from their private one.
    nat_learner = s.ids(f"learner-{nat_region}")[0]
    nat_ip = s.exec(nat_learner, "sh", "-c", "ip -4 -o addr show scope global | awk '{split($4,a,\"/\"); print a[1]}'"
                    ).stdout.split()[0]
    boot = s.ids("bootstrap")[0]
    dial = s.exec(boot, "python", "-c", f"import socket; socket.create_connection(('{nat_ip}', 41000), 3)",
                  check=False)
    assert dial.returncode != 0, f"the bootstrap node could dial {nat_ip} in the NAT'd region {nat_region}"
    # Even an outsider that routes the private subnet to the NAT gateway gets no new connection in.
    gw_out = s.ids(f"gw-{spec['bootstrap']['environment']['REGION']}")[0]
    dial = s.exec(gw_out, "sh", "-c", f"ip route replace {spec[nat_gw]['environment']['NAT_SUBNET']} via {nat_backbone}"
                  f" && python -c \"import socket; socket.create_connection(('{nat_ip}', 41000), 3)\"", check=False)
    s.exec(gw_out, "ip", "route", "replace", "unreachable", spec[nat_gw]["environment"]["NAT_SUBNET"])
    assert dial.returncode != 0 and "timed out" in dial.stderr, \
        f"{nat_gw} let a new connection from the backbone into {nat_region}: {dial.stderr[-500:]}"
    peers = s.exec(boot, "ss", "-Htn", "state", "established").stdout
    nat_prefix = nat_ip.rsplit(".", 1)[0] + "."
    assert f"{nat_backbone}:" in peers, f"no connection from {nat_backbone} at the bootstrap node:\n{peers}"
    assert nat_prefix not in peers, f"a connection from {nat_region}'s private subnet reached eu:\n{peers}"

    # Stop a region's learners (cleanly) and start them again: they resume from their checkpoints.
    ap = s.ids("learner-ap")
    others = [c for c in learners if c not in ap]
    s("stop", "-t", "30", "learner-ap")
    v = max(s.version(c) for c in others)
    s.wait_versions_past(others, v, timeout=120)  # the others go on without ap
    s("start", "learner-ap")
    s.wait("ap's learner to resume", lambda: all("resumed from" in s.logs(c) for c in ap), timeout=120)

    # Cut ap off the backbone, let the others go on, heal it (the gateway reapplies routes and shaping).
    gw_ap = s.ids("gw-ap")[0]
    wan = f"{s.project}_wan"
    ap_backbone = spec["gw-ap"]["networks"]["wan"]["ipv4_address"]
    _run(["docker", "network", "disconnect", wan, gw_ap])
    v = max(s.version(c) for c in others)
    s.wait_versions_past(others, v, timeout=120)
    _run(["docker", "network", "connect", "--ip", ap_backbone, wan, gw_ap])
    s("restart", "-t", "2", "gw-ap")

    # One more learner in eu, started mid-run: it downloads the newest state and trains with the others.
    replicas = expected["learner-eu"] + 1
    s("up", "-d", "--no-recreate", "--scale", f"learner-eu={replicas}", "learner-eu", timeout=180)
    added = s.ids("learner-eu")[-1]
    assert len(s.ids("learner-eu")) == replicas

    # Everyone runs to max_outer_steps and exits; one global state.
    everyone = s.learners()
    s.wait("every learner to finish", lambda: not any(s.running(c) for c in everyone), timeout=420)
    summaries = {c: s.summary(c) for c in everyone}
    for c, sm in summaries.items():
        assert sm["version"] == MAX_OUTER_STEPS, (c, sm["version"])
    hashes = {sm["global_state_sha256"] for sm in summaries.values()}
    assert len(hashes) == 1, {c: (sm["version"], sm["global_state_sha256"][:16]) for c, sm in summaries.items()}
    assert summaries[added]["syncs"] >= 1, "the added learner never downloaded the swarm's state"
    for c in everyone:
        code = _run(["docker", "inspect", "-f", "{{.State.ExitCode}}", c]).stdout.strip()
        assert code == "0", (c, code, s.logs(c)[-2000:])
