"""Test tiers by directory, and no process left behind.

- ``tests/unit/<subpackage>/``: one process, no network, mirrors ``p2p_diloco/<subpackage>/``.
- ``tests/processes/``: real child processes (p2pd, gloo workers, fresh interpreters), no swarm.
- ``tests/benchmarks/``: the benchmarks' arithmetic, loaded from their scripts (no network).
- ``tests/integration/``: real swarms of learner processes over hivemind and p2pd.

Each directory's tests carry the marker of its name (``pytest -m "not integration"``), set here rather
than in each file. After every test, children it started and left running are stopped (as hivemind's
own ``tests/conftest.py`` does at the end of the session): a failing test must not leave a p2pd or a
learner behind to disturb the next one.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import yaml

from p2p_diloco.sim.regions.topology import load_topology

TIERS = {"integration": "integration", "processes": "processes", "benchmarks": "benchmarks"}
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(str(item.fspath)).resolve().relative_to(HERE).parts[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, TIERS[tier]))


# Helpers a library starts once per process and reuses: stopping one breaks every later test.
SHARED_HELPERS = ("torch_shm_manager", "resource_tracker", "forkserver")


def _shared_helper(p: psutil.Process) -> bool:
    try:
        return any(h in " ".join([p.name(), *p.cmdline()]) for h in SHARED_HELPERS)
    except psutil.Error:
        return True  # gone already


def _children() -> dict[int, psutil.Process]:
    try:
        return {p.pid: p for p in psutil.Process().children(recursive=True) if not _shared_helper(p)}
    except psutil.Error:
        return {}


def _stop(procs: list[psutil.Process], grace: float) -> None:
    """Terminate ``procs``, then kill those still there after ``grace`` seconds (0: kill at once)."""
    for p in procs:
        try:
            p.terminate() if grace else p.kill()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace or 5)
    if alive and grace:
        _stop(alive, 0)


@pytest.fixture(autouse=True)
def stop_leftover_children():
    """Children a test started (not those of wider-scoped fixtures, which exist before it) and left
    running: terminated, then killed after 5 s."""
    before = set(_children())
    yield
    _stop([p for pid, p in _children().items() if pid not in before], 5)


@pytest.fixture(autouse=True, scope="session")
def stop_every_child_at_the_end():
    yield
    _stop(list(_children().values()), 0)


@pytest.fixture(scope="module")
def topo():
    """The committed region topology (regions/topology.toml)."""
    return load_topology(ROOT / "regions" / "topology.toml")


@pytest.fixture(scope="module")
def compose():
    """The committed docker-compose.yml, parsed."""
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())
