"""Learner units of several workers under torchrun (CPU, gloo), with real p2pd daemons on loopback.

torchrun starts each worker in a session of its own, so the swarm's cleanup (which kills torchrun's
process group) would not reach them: every test here also kills each worker's group, by the pid
the worker logs when it joins its unit.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from p2p_diloco.config import ModelConfig
from p2p_diloco.learner.unit.group import HASHES_ENV, params_sha256
from p2p_diloco.sim.processes import LOOPBACK_ANY_PORT, Proc, processes_in_group, wait_until
from p2p_diloco.train.checkpoint import load_checkpoint
from p2p_diloco.train.models.registry import build_model
from p2p_diloco.train.sharding import local_part

from .harness import FAST, SMALL, Swarm, committed_version

TOKENS_PER_STEP = 16 * 64  # peers/small-cpu.toml: inner.batch_size · model.seq_len, per worker


def worker_pids(proc: Proc) -> list[tuple[int, int]]:
    """(rank, pid) of every worker the unit started (restarts included), from the line each logs when it joins."""
    found = re.findall(r"worker (\d+) of a learner unit of .*? pid (\d+)", proc.text())
    return [(int(rank), int(pid)) for rank, pid in found]


@pytest.fixture
def units(swarm: Swarm) -> Iterator[list[Proc]]:
    """torchrun processes started by a test; their workers' process groups are killed afterwards."""
    started: list[Proc] = []
    yield started
    for proc in started:
        for _, pid in worker_pids(proc):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    for pid in processes_using(swarm.tmp):  # whatever of this test's is left (it dies with its parent anyway)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def start_unit(swarm: Swarm, units: list[Proc], name: str, shard: int, max_outer_steps: int,
               extra: Sequence[str] = (), torchrun: Sequence[str] = ()) -> Proc:
    """``torchrun --nproc-per-node 2 -m p2p_diloco learner`` on ``shard`` with the fast settings."""
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *torchrun,
            "-m", "p2p_diloco", "learner", "--config", SMALL, "--host-maddrs", LOOPBACK_ANY_PORT,
            "--shard-index", str(shard), "--num-shards", "4", "--max-outer-steps", str(max_outer_steps),
            "--checkpoint-dir", str(swarm.tmp / f"ckpt-{shard}"), "--summary", str(swarm.summary_path(shard)),
            *FAST, *extra]
    if swarm.bootstrap_addr is not None:
        args += ["--initial-peers", swarm.bootstrap_addr]
    proc = Proc(name, args, swarm.tmp / f"{name}.log")
    swarm.procs.append(proc)
    units.append(proc)
    return proc


def processes_using(path: Path) -> dict[int, str]:
    """pid → command line of the live processes with ``path`` in their command line (rank 0's hivemind
    helpers and p2pd name its checkpoint directory there, and run in process groups of their own)."""
    out = subprocess.run(["ps", "-eo", "pid=,stat=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines()]
    return {int(r[0]): r[2] for r in rows if len(r) == 3 and str(path) in r[2] and not r[1].startswith("Z")}


def assert_workers_gone(swarm: Swarm, proc: Proc, shard: int = 1) -> None:
    pids = [pid for _, pid in worker_pids(proc)]
    assert len(pids) >= 2, proc.text()
    wait_until(lambda: not processes_in_group(*pids) and not processes_using(swarm.tmp / f"ckpt-{shard}"), 30,
               what="the unit's workers, rank 0's hivemind helpers and p2pd to exit")


def _unit_beside_a_learner(swarm, units, extra):
    """A 2-worker unit (with ``extra`` arguments) and a single learner train to version 3: one model, a
    falling loss. Returns the unit's process and both summaries."""
    swarm.start_bootstrap()
    single = swarm.start_learner(0, max_outer_steps=3)
    unit = start_unit(swarm, units, "unit", shard=1, max_outer_steps=3, extra=extra)
    assert unit.wait(300) == 0, unit.text()
    assert single.wait(120) == 0, single.text()
    solo, pair = swarm.summary(0), swarm.summary(1)
    # One model: the same global state on both learners.
    assert solo["global_state_sha256"] == pair["global_state_sha256"]
    assert solo["version"] == pair["version"] == 3
    assert pair["last_eval_loss"] < pair["first_eval_loss"] - 0.5
    return unit, solo, pair


@pytest.mark.timeout(400)
def test_a_two_worker_unit_and_a_single_learner_train_one_model(swarm, units, monkeypatch):
    hashes = swarm.tmp / "hashes"
    monkeypatch.setenv(HASHES_ENV, str(hashes))  # every rank writes its weights' hash at each sync
    unit, solo, pair = _unit_beside_a_learner(swarm, units, [])
    # The unit's tokens are both workers' tokens, and both learners' tokens are in the global state.
    assert (solo["workers"], pair["workers"]) == (1, 2)
    assert solo["tokens"] == solo["inner_steps"] * TOKENS_PER_STEP
    assert pair["tokens"] == 2 * pair["inner_steps"] * TOKENS_PER_STEP
    assert max(solo["tokens"], pair["tokens"]) < pair["global_tokens"] <= solo["tokens"] + pair["tokens"]
    # Both ranks of the unit held identical weights at its start and after every applied round.
    ranks = [(hashes / f"rank-{r}.txt").read_text().splitlines() for r in range(2)]
    assert ranks[0] == ranks[1], ranks
    applied = [int(line.split()[1]) for line in ranks[0][1:]]
    assert len(applied) >= committed_version(unit) >= 1 and max(applied) == 3, ranks
    text = unit.text()
    assert "learner unit of 2 workers (gloo, 1 node)" in text
    assert "[rank1 " in text and "rank 0 ended the unit" in text
    assert "(a unit of 2 workers)" in text
    assert_workers_gone(swarm, unit)


@pytest.mark.timeout(400)
def test_a_sharded_unit_and_a_single_learner_train_one_model(swarm, units, monkeypatch):
    hashes = swarm.tmp / "hashes"
    monkeypatch.setenv(HASHES_ENV, str(hashes))  # shards' hashes, and rank 0's chunks of its host θ
    unit, solo, pair = _unit_beside_a_learner(swarm, units, ["--set", "run.sharding=fsdp"])
    assert pair["workers"] == 2 and pair["tokens"] == 2 * pair["inner_steps"] * TOKENS_PER_STEP
    assert max(solo["tokens"], pair["tokens"]) < pair["global_tokens"] <= solo["tokens"] + pair["tokens"]
    # Each rank's shards are its chunks of rank 0's θ (the host copy the rounds read and write) at the
    # start and after every applied round; the two ranks hold different halves.
    files = {name: (hashes / f"{name}.txt").read_text().splitlines() for name in ("rank-0", "rank-1", "host-0",
                                                                                 "host-1")}
    assert files["rank-0"] == files["host-0"] and files["rank-1"] == files["host-1"], files
    assert files["rank-0"] != files["rank-1"]
    applied = [int(line.split()[1]) for line in files["rank-1"][1:]]
    assert len(applied) >= committed_version(unit) >= 1 and max(applied) == 3, files
    # The last checkpoint holds the final θ (its chunks are the shards at the last word) and full moments.
    payload = load_checkpoint(swarm.tmp / "ckpt-1")
    assert payload is not None
    model = build_model(ModelConfig.model_validate(payload["config"]["model"]), 0)
    model.load_state_dict(payload["model"])
    for r in range(2):
        assert params_sha256([local_part(p.detach(), r, 2) for p in model.parameters()]) == \
            files[f"rank-{r}"][-1].split()[2]
    moments = payload["inner_opt"]["state"]
    assert [tuple(moments[i]["exp_avg"].shape) for i in sorted(moments)] == \
        [tuple(p.shape) for p in model.parameters()]
    text = unit.text()
    assert "learner unit of 2 workers (gloo, 1 node, fsdp)" in text
    assert "[rank1 " in text and "rank 0 ended the unit" in text and "error:" not in text
    assert_workers_gone(swarm, unit)


@pytest.mark.timeout(300)
def test_a_stop_reaches_every_worker_through_rank_0(swarm, units):
    # Alone (a quorum of one), so that nothing but the signal ends the run; slowed down, so that the
    # signal lands between two rounds, with unmerged steps to hand over.
    unit = start_unit(swarm, units, "unit", shard=1, max_outer_steps=50,
                      extra=["--set", "averaging.min_group_size=1", "--set", "inner.extra_step_seconds=0.05"])
    wait_until(lambda: "round=1] inner 10/20" in unit.text(), 200, unit, "half of version 2's steps")
    os.kill(unit.pid, signal.SIGTERM)  # torchrun sends it on to each worker's process group
    unit.wait(60)
    text = unit.text()
    assert "caught SIGTERM; leaving after this step" in text
    assert "rank 0 ended the unit after" in text  # rank 1 ignored the signal and followed rank 0
    # Rank 0's DHT outlived the signal: it looked for peers to hand its steps to, and said goodbye.
    assert "leaving: no peer is training" in text and "could not" not in text
    assert "finished at version" in text and "error:" not in text
    assert_workers_gone(swarm, unit)


def _checkpointed_version(directory: Path) -> int:
    """The version of the newest checkpoint in ``directory`` (the lowest of its fragments'; 0 without one)."""
    payload = load_checkpoint(directory)
    return min((int(g["version"]) for g in payload["global"]), default=0) if payload else 0


@pytest.mark.timeout(300)
# ddp's dead worker runs in the slow tier: the same restart as fsdp's (which also reshards), 27 s of CI.
@pytest.mark.parametrize("sharding", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp"])
def test_a_dead_worker_ends_the_unit_and_torchrun_brings_it_back(swarm, units, sharding):
    unit = start_unit(swarm, units, "unit", shard=1, max_outer_steps=4, torchrun=["--max-restarts", "1"],
                      extra=["--set", "averaging.min_group_size=1", "--resume", "--set", f"run.sharding={sharding}"])
    # A checkpoint at version 1, not only the commit: the checkpoint is written after the commit's audit event,
    # and a worker killed in between left nothing to resume from (a loaded CI run).
    wait_until(lambda: _checkpointed_version(swarm.tmp / "ckpt-1") >= 1, 200, unit, "a checkpoint at version 1")
    first = dict(worker_pids(unit))
    os.kill(first[1], signal.SIGKILL)
    # Rank 0's next collective fails: one line, and torchrun starts both workers again.
    wait_until(lambda: "error: rank 0: the learner unit failed" in unit.text(), 60, unit, "rank 0's error line")
    assert unit.wait(240) == 0, unit.text()
    text = unit.text()
    assert re.search(r"resumed from \S+ at version [1-4]", text), text
    assert swarm.summary(1)["version"] == 4 and swarm.summary(1)["workers"] == 2
    assert not processes_in_group(*first.values())
    assert_workers_gone(swarm, unit)
