import subprocess
import sys

import pytest

from .harness import ROOT


def _run(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "p2p_diloco", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, needle", [
    (["learner", "--set", "inner.lr=-1"], "inner.lr"),
    (["learner", "--config", "peers/missing.toml"], "does not exist"),
    (["learner", "--set", "model.n_head=3"], "n_embd"),
    (["learner", "--shard-index", "7", "--num-shards", "4"], "shard_index"),
    (["swarm", "--learners", "0"], "--learners"),
    (["bootstrap", "--config", "peers/missing.toml"], "does not exist"),
])
def test_bad_config_exits_nonzero_with_one_line(args, needle):
    r = _run(*args)
    assert r.returncode == 2, r
    assert needle in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(120)
def test_bad_initial_peer_is_a_clear_error(tmp_path):
    r = _run("learner", "--initial-peers", "not-a-multiaddr", "--checkpoint-dir", str(tmp_path / "c"))
    assert r.returncode == 2, r
    assert r.stderr.startswith("error: could not start or join the DHT")
    assert "Traceback" not in r.stderr


@pytest.mark.timeout(120)
def test_bad_initial_peer_of_a_bootstrap_node_is_a_clear_error(tmp_path):
    r = _run("bootstrap", "--initial-peers", "not-a-multiaddr", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
             "--identity", str(tmp_path / "id.key"))
    assert r.returncode == 2, r
    assert r.stderr.startswith("error: could not start or join the bootstrap DHT node")
    assert "Traceback" not in r.stderr
