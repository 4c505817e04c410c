"""The knobs that keep a learner's processes small (p2p_diloco/learner/lean.py, P2PD_GOGC in net/dht.py)."""

import os
import subprocess
import sys

import psutil
import pytest

from p2p_diloco.net.dht import P2PD_GOGC, LinkedDHT

_LIMIT = "from p2p_diloco.learner.lean import limit_malloc_arenas; print(limit_malloc_arenas())"


def _limit(env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-c", _LIMIT], env=env, capture_output=True, text=True,
                          timeout=60, check=True).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_malloc_arena_limit_is_set_unless_the_user_chose_one():
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    assert _limit(env) == "True"
    assert _limit({**env, "MALLOC_ARENA_MAX": "4"}) == "False"


def _p2pd_gogc() -> list[str | None]:
    """GOGC in the environment of each p2pd that a fresh LinkedDHT starts."""
    dht = LinkedDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        return [p.environ().get("GOGC") for p in psutil.Process().children(recursive=True) if p.name() == "p2pd"]
    finally:
        dht.shutdown()


@pytest.mark.timeout(120)
def test_p2pd_starts_with_the_lean_gc_target_unless_the_user_chose_one(monkeypatch):
    monkeypatch.delenv("GOGC", raising=False)
    assert set(_p2pd_gogc()) == {P2PD_GOGC}
    monkeypatch.setenv("GOGC", "80")
    assert set(_p2pd_gogc()) == {"80"}
