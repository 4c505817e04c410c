"""A learner unit of several workers (unit.py, leader.py, follower.py) without a swarm: the control word, the
workers' parts of the shard, and two real gloo workers in two processes: rank 0 driven as the
learner drives it, rank 1 running the follower's loop. They hold the same weights at every sync
(the restored θ and inner-optimizer moments included); a worker that dies ends the other's next
collective with UnitBroken instead of a hang."""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from p2p_diloco.config import LearnerConfig, load_learner_config
from p2p_diloco.learner.unit.group import (
    END,
    GATHER,
    GATHER_ALL,
    STEP,
    Topology,
    UnitBroken,
    UnitGroup,
    Word,
    params_sha256,
    part_of_shard,
)
from p2p_diloco.learner.unit.rank0 import Solo
from p2p_diloco.train.data.batches import BatchSampler, DataError

OVERRIDES = ["data.num_shards=4", "data.max_corpus_mb=0.3", "inner.batch_size=4", "sync.fragments=2",
             "inner.lr_schedule=cosine", "inner.warmup_steps=2", "run.max_outer_steps=4", "inner.steps_per_outer=4"]


def test_a_control_word_survives_its_encoding():
    words = [Word(STEP, 3, (3, 1), ()), Word(END, 0, (-1, 0), (0, 2)), Word(STEP, 2**40, (7, 4), (4,)),
             Word(GATHER, 1, (1, 0), (0, 1, 2, 3, 4)), Word(GATHER_ALL, 1, (1, 0), ())]
    for word in words:
        assert Word.decode(word.encode(5, torch.device("cpu"))) == word
    assert [(w.go, w.gathers) for w in words] == [(True, False), (False, False), (True, False), (False, True),
                                                 (False, True)]


def test_topology_comes_from_torchrun_env():
    assert Topology.from_env({}) is None
    assert Topology.from_env({"WORLD_SIZE": "1", "RANK": "0"}) is None  # a unit of one is a plain learner
    env = {"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert Topology.from_env(env) == Topology(rank=5, workers=8, local_rank=1, nodes=2)


def test_each_worker_samples_its_own_part_of_the_shard():
    data = torch.arange(10_000) % 251
    whole = BatchSampler(data, seq_len=16, batch_size=4, seed=7, cursor=5)
    parts = [part_of_shard(whole, r, 3) for r in range(3)]
    assert [p.cursor for p in parts] == [5, 5, 5] and len({p.seed for p in parts}) == 3
    assert parts[0].seed == whole.seed  # rank 0 keeps the learner's seed
    # Contiguous slices that only overlap by one window, covering the shard.
    assert parts[0].data[0] == data[0] and parts[2].data[-1] == data[-1]
    assert sum(len(p.data) for p in parts) <= len(data) + 2 * 17
    for p in parts:
        x, y = p.next_batch()
        assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(DataError, match="too few for 3 workers"):
        part_of_shard(BatchSampler(data[:40], 16, 4, seed=0), 0, 3)


def test_a_solo_learner_is_untouched():
    solo = Solo()
    assert solo.sync(True) and not solo.sync(False)
    with solo.stepping():
        pass
    solo.finish()
    solo.close()


# ---------------------------------------------------------------- two gloo workers in two processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, tmp: str, scenario: str, out: Any, sharding: str = "ddp") -> None:
    """One worker of a 2-worker unit; reports ("done" | "broken" | "error", detail) on ``out``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    try:
        from p2p_diloco.learner.unit.group import join

        cfg = load_learner_config("peers/small-cpu.toml", [*OVERRIDES, f"run.sharding={sharding}"])
        topology = Topology.from_env()
        assert topology is not None
        group = join(topology, cfg.run)
        group.hashes = Path(tmp) / "hashes"
        try:
            if rank == 0:
                out.put(_lead(cfg, group, scenario, Path(tmp)))
            else:
                from p2p_diloco.learner.unit.follower import follow

                if scenario == "dead":
                    threading.Timer(4.0, os._exit, args=(3,)).start()
                out.put(("done", follow(cfg, group)))
        finally:
            group.close()
    except UnitBroken as e:
        out.put(("broken", str(e)))
    except BaseException:  # noqa: BLE001 - reported to the test
        out.put(("error", traceback.format_exc()))


def _lead(cfg: LearnerConfig, group: UnitGroup, scenario: str, tmp: Path) -> tuple[str, Any]:
    """Rank 0 as the learner drives it: a checkpoint-like head start, then steps with θ changes (read
    and written through ``state.local``, as rounds do), a round's snapshot and a checkpoint's refresh;
    at the end θ and the optimizer's moments as a checkpoint has them go to ``tmp/final.pt``."""
    from p2p_diloco.learner.startup import build, load_data
    from p2p_diloco.learner.unit.rank0 import Leader
    from p2p_diloco.train.data.tokenizer import load_tokenizer

    if scenario == "early":  # set-up failed (say, a busy checkpoint dir): the others are told to leave
        Leader(group).close()
        return "done", "left before training"
    trainer, state = build(cfg)
    data = load_data(cfg, 1, load_tokenizer(cfg.data.tokenizer))
    for _ in range(2):  # as if restored: θ and the inner optimizer's moments differ from rank 1's fresh ones
        trainer.step(*data.sampler.next_batch(), version=0)
    leader = Leader(group)
    leader.attach(trainer, data, state)
    began = time.monotonic()
    step = 0
    while time.monotonic() - began < 60:
        if step == 3 or step == 5:  # a round's result arrives: θ of one fragment moves, the version too
            f = 0 if step == 3 else 1
            with torch.no_grad():
                for t in state.local(state.fragments[f]):
                    t.mul_(0.5)
            state.changed.add(f)
            for s in state.states:
                s.version += 1
        if step == 6:
            state.snapshot(state.fragments[1])  # a round starts
            leader.refresh(optimizer=True)  # a checkpoint
        leader.sync(True)
        with leader.stepping():
            trainer.step(*data.sampler.next_batch(), version=state.version)
        step += 1
        state.counters.inner_steps += 1
        if scenario == "agree" and step == 8:
            with torch.no_grad():
                for t in state.local(state.fragments[0]):
                    t.add_(0.25)
            state.changed.add(0)
            leader.finish()
            leader.close()
            torch.save({"params": [t.detach().clone() for t in state.params],
                        "inner_opt": trainer.checkpoint_state()["inner_opt"]}, tmp / "final.pt")
            return "done", params_sha256(state.params)
    return "error", "rank 1 died but rank 0 kept stepping for 60 s"


def _run_unit(tmp_path: Path, scenario: str, sharding: str = "ddp") -> tuple[list[tuple[str, Any]], list[int | None]]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(tmp_path), scenario, out, sharding)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=150) for _ in range(1 if scenario == "dead" else 2)]
        for p in procs:
            p.join(30)
        return results, [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


@pytest.mark.timeout(200)
def test_two_workers_hold_the_same_weights_at_every_sync(tmp_path: Path):
    results, codes = _run_unit(tmp_path, "agree")
    assert all(kind == "done" for kind, _ in results), results
    assert codes == [0, 0]
    lines = [(tmp_path / "hashes" / f"rank-{r}.txt").read_text().splitlines() for r in range(2)]
    # At start (rank 0's restored θ), after each of the two θ changes, and at the end.
    assert len(lines[0]) == 4 and lines[0] == lines[1], lines
    assert [line.split()[:2] for line in lines[0]] == [["0", "0"], ["3", "1"], ["5", "2"], ["8", "2"]]
    assert lines[0][-1].split()[2] == next(detail for kind, detail in results if isinstance(detail, str))


@pytest.mark.timeout(300)
def test_a_sharded_unit_takes_the_steps_a_ddp_unit_takes(tmp_path: Path):
    runs = {}
    for sharding in ("ddp", "fsdp"):
        (tmp_path / sharding).mkdir()
        results, codes = _run_unit(tmp_path / sharding, "agree", sharding)
        assert all(kind == "done" for kind, _ in results) and codes == [0, 0], results
        runs[sharding] = torch.load(tmp_path / sharding / "final.pt")
    # Each rank's shards are its chunks of rank 0's host θ: at start (rank 0's restored θ), after each
    # of the two θ changes (written into the host copy after a gather) and at the end.
    hashes = tmp_path / "fsdp" / "hashes"
    names = ("rank-0", "rank-1", "host-0", "host-1")
    lines = {name: (hashes / f"{name}.txt").read_text().splitlines() for name in names}
    assert lines["rank-0"] == lines["host-0"] and lines["rank-1"] == lines["host-1"], lines
    assert [line.split()[:2] for line in lines["rank-1"]] == [["0", "0"], ["3", "1"], ["5", "2"], ["8", "2"]]
    assert lines["rank-0"] != lines["rank-1"]  # two halves of the model
    # The same steps as DDP's (up to the order of float sums in the gradients' reduction), and the same
    # moments in a checkpoint: restored θ and moments, θ changes, the snapshot's gather, clipping.
    ddp, fsdp = runs["ddp"], runs["fsdp"]
    for a, b in zip(ddp["params"], fsdp["params"], strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-5), (a - b).abs().max()
    assert ddp["inner_opt"]["state"].keys() == fsdp["inner_opt"]["state"].keys()
    for i, s in ddp["inner_opt"]["state"].items():
        t = fsdp["inner_opt"]["state"][i]
        assert float(s["step"]) == float(t["step"]) == 10
        assert torch.allclose(s["exp_avg"], t["exp_avg"], rtol=0, atol=1e-6)
        assert torch.allclose(s["exp_avg_sq"], t["exp_avg_sq"], rtol=1e-4, atol=1e-9)


@pytest.mark.timeout(200)
def test_rank_0_failing_before_training_sends_the_others_home(tmp_path: Path):
    results, codes = _run_unit(tmp_path, "early")
    assert set(results) == {("done", 0), ("done", "left before training")}, results
    assert codes == [0, 0]


@pytest.mark.timeout(200)
def test_a_dead_worker_ends_the_unit_without_a_hang(tmp_path: Path):
    results, codes = _run_unit(tmp_path, "dead")
    kind, detail = results[0]
    assert kind == "broken", results
    assert "a worker is gone or failed" in detail and "\n" not in detail
    assert codes[1] == 3  # rank 1 died (os._exit(3)) and rank 0 ended on its own
