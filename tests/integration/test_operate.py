"""Operating a swarm: `p2p-diloco status` and the metrics endpoint, against a real 2-learner swarm."""

import json
import os
import socket
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from p2p_diloco.sim.processes import wait_until

from .harness import ROOT, audit_events, committed_version


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[tuple[str, tuple], float] | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return None
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _committed(scrape: dict[tuple[str, tuple], float]) -> float:
    return sum(v for (n, labels), v in scrape.items()
               if n == "p2p_diloco_rounds_total" and ("outcome", "committed") in labels)


def _status(addr: str) -> dict | None:
    done = subprocess.run([sys.executable, "-m", "p2p_diloco", "status", "--initial-peers", addr, "--json"],
                          capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.timeout(240)
def test_status_and_metrics_during_a_run(swarm):
    port = _free_port()
    addr = swarm.start_bootstrap()
    # The test ends the run (SIGTERM) once it has seen what it looks for, so no check races the end of training.
    slow = ["--set", "inner.extra_step_seconds=0.1"]
    learners = [swarm.start_learner(0, max_outer_steps=1000, extra=[*slow, "--set", f"run.metrics_port={port}"]),
                swarm.start_learner(1, max_outer_steps=1000, extra=slow)]
    wait_until(lambda: committed_version(learners[0]) >= 1, 150, learners[0], "version 1")

    seen = None
    for _ in range(5):  # records are refreshed every record_ttl / 3 seconds
        doc = _status(addr)
        lineages = list(doc["lineages"].values())
        if len(lineages) == 1 and len(lineages[0]["learners"]) == 2:
            seen = lineages[0]
            if all(row["versions"] and row["device_kind"] for row in seen["learners"]):
                break
    assert seen is not None, doc
    for row in seen["learners"]:
        assert row["status"] in ("training", "done") and row["versions"] and min(row["versions"]) >= 1, row
        assert row["device_kind"] == "cpu" and row["cpu_cores"] >= 1 and row["workers"] == 1, row
        assert row["tokens_per_second"] > 0 and row["uptime"] > 0, row
        assert row["address"].startswith("/ip4/127.0.0.1/tcp/") and row["address"].endswith(row["peer_id"]), row
    assert seen["totals"]["learners"] == 2 and all("agree" in f for f in seen["fragments"])
    table = subprocess.run([sys.executable, "-m", "p2p_diloco", "status", "--initial-peers", addr],
                           capture_output=True, text=True, timeout=90, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    assert table.returncode == 0 and "learners" in table.stdout and "lineage" in table.stdout, table
    assert "/ip4/127.0.0.1/tcp/" in table.stdout and "MB received" in table.stdout, table.stdout

    last, peers_visible = None, set()

    def committed_and_seen() -> bool:
        nonlocal last
        last = _scrape(port) or last
        if last is None:
            return False
        peers_visible.add(last.get(("p2p_diloco_peers_visible", ())))
        return 1.0 in peers_visible and _committed(last) >= 1 \
            and last.get(("p2p_diloco_matchmaking_seconds_count", ()), 0) >= 1

    wait_until(committed_and_seen, 120, learners[0], "a scrape with a commit and the other learner visible")
    for p in learners:
        p.terminate()  # leaves as Ctrl+C does: the summary is written at exit
    for p in learners:
        assert p.wait(60) == 0, p.text()
    assert last is not None, "the metrics endpoint never answered"
    s = swarm.summary(0)
    # Counters are pushed at progress lines, outer steps and the end of training: never ahead of the summary.
    for name in ("inner_steps", "tokens", "bytes_sent", "bytes_received", "compute_seconds"):
        assert 0 < last[(f"p2p_diloco_{name}_total", ())] <= s[name] + 1e-6, name
    # Two learners, equal shards: in each round a learner receives what the other sends it (and any state it
    # downloads comes on top).
    assert s["bytes_received"] > 0.5 * s["bytes_sent"], s
    committed = _committed(last)
    assert 1 <= committed <= s["outer_steps"]
    assert last[("p2p_diloco_version", (("fragment", "0"),))] >= 1
    # The last scrape may fall between a round's group forming and its commit being counted.
    assert 1 <= last[("p2p_diloco_matchmaking_seconds_count", ())] <= committed + 1
    assert 1.0 in peers_visible, peers_visible  # the other learner
    assert last[("p2p_diloco_refusals_total", (("kind", "download_rejected"),))] == 0
    joined = audit_events(learners[0], "peer_joined")
    other = swarm.summary(1)["peer_id"]
    assert [e["peer"] for e in joined] == [other], joined
    info = [labels for (n, labels), _ in last.items() if n == "p2p_diloco_learner_info"]
    assert info and ("peer_id", s["peer_id"]) in info[0]


@pytest.mark.timeout(120)
def test_status_without_a_reachable_peer_is_one_line():
    unreachable = "/ip4/127.0.0.1/tcp/1/p2p/QmPdNtwFMXRmt5TMU3Q2mqs2fb9SNowExmuWyms6uT5Gd9"
    done = subprocess.run([sys.executable, "-m", "p2p_diloco", "status", "--initial-peers", unreachable, "--json"],
                          capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().startswith("error: could not start or join the DHT (as a status client)"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
