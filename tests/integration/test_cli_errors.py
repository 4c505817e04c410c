import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

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
    (["learner", "--allowed-peers", "peers/missing.txt"], "allow-list peers/missing.txt: cannot read it"),
    (["bootstrap", "--allowed-peers", "README.md", "--identity", "/nonexistent/x/id.key"],
     "allow-list README.md, line"),
    (["peer-id", "--identity", "README.md"], "does not hold a libp2p private key"),
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


@pytest.mark.timeout(120)
def test_a_peer_missing_from_its_own_allow_list_is_a_clear_error(tmp_path):
    other = tmp_path / "other.txt"
    r = _run("peer-id", "--identity", str(tmp_path / "other.key"))
    assert r.returncode == 0 and r.stdout.strip(), r
    other.write_text(r.stdout)
    r = _run("learner", "--allowed-peers", str(other), "--checkpoint-dir", str(tmp_path / "c"))
    assert r.returncode == 2, r
    assert r.stderr.startswith("error: this peer's ID") and "is not on the allow-list" in r.stderr, r.stderr
    r = _run("bootstrap", "--allowed-peers", str(other), "--identity", str(tmp_path / "boot.key"),
             "--host-maddrs", "/ip4/127.0.0.1/tcp/0")
    assert r.returncode == 2 and "is not on the allow-list" in r.stderr, r


def _bad_model_inputs(tmp):
    """(case name, extra learner args) for each bad input of a real-model run, with the files they need."""
    (tmp / "empty").mkdir()
    (tmp / "alien").mkdir()
    (tmp / "alien" / "config.json").write_text('{"model_type": "not-a-model"}')
    (tmp / "small-vocab").mkdir()
    config = json.loads((ROOT / "peers" / "models" / "llama-tiny" / "config.json").read_text())
    (tmp / "small-vocab" / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    (tmp / "rows.jsonl").write_text("".join(json.dumps({"body": "x" * 200}) + "\n" for _ in range(200)))
    (tmp / "tiny").mkdir()
    (tmp / "tiny" / "a.txt").write_text("too little text\n")
    return [
        ("model directory without config.json", ["--model", str(tmp / "empty")], "config.json"),
        ("architecture transformers does not know", ["--model", str(tmp / "alien")], "not-a-model"),
        ("tokenizer bigger than the vocabulary", ["--model", str(tmp / "small-vocab"), "--tokenizer",
                                                 "peers/tokenizers/bpe-4k"], "vocabulary"),
        ("data file without the text field", ["--data", str(tmp / "rows.jsonl"), "--shard-index", "0"], "body"),
        ("shard with too little text", ["--data", str(tmp / "tiny"), "--shard-index", "0"], "at least"),
        ("cuda on a machine without it", ["--device", "cuda"], "cuda"),
    ]


@pytest.mark.timeout(300)
def test_each_bad_input_of_a_real_model_run_is_one_line(tmp_path):
    cases = _bad_model_inputs(tmp_path)

    def run(i):
        return _run("learner", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--checkpoint-dir", str(tmp_path / f"ckpt{i}"),
                    "--set", f"data.cache_dir={tmp_path / f'cache{i}'}", *cases[i][1], timeout=120)

    with ThreadPoolExecutor(2) as pool:  # each case is a process that mostly imports torch and transformers
        results = list(pool.map(run, range(len(cases))))
    for (name, _, needle), r in zip(cases, results, strict=True):
        assert r.returncode == 2, (name, r)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (name, r.stderr)
