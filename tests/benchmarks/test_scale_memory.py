"""The swarm-size benchmark's memory accounting (benchmarks/scale_swarm.py): pages a fork shares with its
parent count once in PSS and twice in RSS."""

import os
import signal
import subprocess
import sys

import pytest

from tests.benchmarks import load_benchmark

MB = 2**20

# A process that fills 64 MB, then forks: parent and child share the 64 MB copy-on-write and both sleep.
_FORKING = """
import os, sys, time
block = bytearray(64 * 2**20)
for i in range(0, len(block), 4096):
    block[i] = 1
if os.fork() == 0:
    os.write(1, b"ready\\n")  # the child alone, in one write (both printing could interleave: "readyready")
time.sleep(60)
"""


@pytest.fixture(scope="module")
def scale_swarm():
    return load_benchmark("scale_swarm")


def test_pages_shared_with_a_fork_count_once_in_pss_and_twice_in_rss(scale_swarm):
    proc = subprocess.Popen([sys.executable, "-c", _FORKING], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"  # the fork happened
        mem = scale_swarm.memory_by_group({proc.pid})[proc.pid]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert mem["rss"] >= 2 * 64 * MB  # the block, resident in both processes
    assert 64 * MB <= mem["pss"] < mem["rss"] - 48 * MB  # the block once
    assert mem["uss"] < mem["pss"]  # the shared block is in neither process's own pages
    assert mem["pss_learner"] + mem["pss_forks"] + mem["pss_p2pd"] == mem["pss"]
    assert mem["pss_forks"] > 0 and mem["pss_p2pd"] == 0
