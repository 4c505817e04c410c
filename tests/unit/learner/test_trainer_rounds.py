"""Where θ meets Θ when θ trains on a device: snapshots are CPU fp32 copies, and a global state that
comes in by any door (a round, a download, a checkpoint) is kept in pinned memory on a CUDA learner.

θ is bf16 here as a stand-in for "not CPU fp32"; pinning is simulated (this machine has no CUDA)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from p2p_diloco.config import load_learner_config
from p2p_diloco.core.fragments import build_fragments
from p2p_diloco.core.grace import GraceWindow
from p2p_diloco.core.outer import GlobalState, OuterOptimizer
from p2p_diloco.learner.catch_up import CatchUp
from p2p_diloco.learner.progress import Progress
from p2p_diloco.learner.resume import restore
from p2p_diloco.learner.schedule import Rounds
from p2p_diloco.learner.startup import build
from p2p_diloco.learner.state import LearnerState
from tests.unit.fake_averaging import FakeGroup


@pytest.fixture
def pinned(monkeypatch):
    """Simulated pinned memory: ``pin_memory()`` returns a copy that ``is_pinned()`` knows; returns that test."""
    held: list[torch.Tensor] = []

    def pin_memory(self, *args, **kwargs):
        out = self.clone()
        held.append(out)
        return out

    def is_pinned(self, *args, **kwargs):
        return any(self is t for t in held)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)
    return is_pinned


def _all_pinned(state: LearnerState, is_pinned) -> bool:
    return all(is_pinned(t) for s in state.states for t in s.tensors())


def _learner(dtype: torch.dtype = torch.bfloat16, pin: bool = True) -> tuple[LearnerState, CatchUp, Rounds]:
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.full((3,), 1.0, dtype=dtype)) for _ in range(2)])
    states = [GlobalState(params=[torch.zeros(3)], momentum=[torch.zeros(3)]) for _ in range(2)]
    for s in states:
        s.remember()
    state = LearnerState(fragments=build_fragments([(f"w{i}", (3,)) for i in range(2)], 2, 10), states=states,
                         params=list(model), peer_id="me", pin_memory=pin)
    state.counters.resize(2)
    cfg = load_learner_config("peers/small-cpu.toml", ["averaging.min_group_size=1"])
    averaging = FakeGroup(1).member("me")
    progress = Progress(SimpleNamespace(read=dict), state, 15.0)
    catch_up = CatchUp(cfg, state, averaging, progress, should_stop=lambda: False)
    rounds = Rounds(cfg, state, averaging, OuterOptimizer(cfg.outer), GraceWindow(0, 0.5, 3.0, 6.0), None, catch_up,
                    progress, lambda: None)
    return state, catch_up, rounds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_snapshots_are_cpu_fp32_copies(dtype):
    state, _, _ = _learner(dtype, pin=False)
    frag = state.fragments[0]
    with torch.no_grad():
        state.local(frag)[0].copy_(torch.tensor([0.1, 0.2, 0.3]))
    snap = state.snapshot(frag)
    theta = state.local(frag)[0]
    assert snap[0].dtype == torch.float32 and snap[0].device.type == "cpu"
    assert torch.equal(snap[0], theta.detach().float()) and snap[0].data_ptr() != theta.data_ptr()


def test_a_round_starts_from_a_cpu_fp32_snapshot_and_its_result_is_pinned(pinned, monkeypatch):
    state, _, rounds = _learner()
    assert _all_pinned(state, pinned)  # the initial states
    snapshots = []
    take = state.snapshot
    monkeypatch.setattr(state, "snapshot", lambda frag: snapshots.append(take(frag)) or snapshots[-1])
    frag = state.fragments[0]
    state.counters.tokens_since_merge[0], state.counters.steps_since_merge[0] = 64, 1
    rounds.start(frag, background=False)
    assert rounds.last_outcome is not None and rounds.last_outcome.committed
    assert [(t.dtype, t.device.type) for t in snapshots[0]] == [(torch.float32, "cpu")]
    new = state.states[0]
    assert new.version == 1 and _all_pinned(state, pinned)
    assert torch.equal(state.local(frag)[0].detach(), new.params[0].to(torch.bfloat16))  # overwrite policy


def test_a_downloaded_state_is_pinned_and_local_progress_rebased_onto_it(pinned):
    state, catch_up, _ = _learner()
    frag = state.fragments[1]
    theirs = state.states[1].copy()
    OuterOptimizer(load_learner_config(None, []).outer).apply(theirs, [torch.full((3,), -1.0)], tokens=64)
    assert not pinned(theirs.params[0])
    assert catch_up.adopt({1: theirs}) == [1]
    assert state.states[1] is theirs and _all_pinned(state, pinned)
    # θ ← Θ_new + (θ − Θ_old), computed in fp32 on the CPU, stored in θ's dtype
    assert torch.equal(state.local(frag)[0].detach(), (theirs.params[0] + 1.0).to(torch.bfloat16))


def test_a_restored_checkpoint_is_pinned_and_its_snapshots_are_cpu_fp32(pinned):
    cfg = load_learner_config("peers/small-cpu.toml", ["sync.fragments=2"])
    saved_trainer, saved_state = build(cfg)
    counters = vars(saved_state.counters).copy()
    counters["tokens_since_merge"] = [64, 0]  # fragment 0 holds progress that may have been sent
    payload = {"global": [s.to_dict() for s in saved_state.states], **saved_trainer.checkpoint_state(),
               "counters": counters, "sampler_cursor": 5, "unconfirmed": []}
    trainer, state = build(cfg)
    state.pin_memory = True  # as on a CUDA learner
    assert restore(payload, trainer, state, Path("ckpt")) == 5
    assert _all_pinned(state, pinned)
    assert [(t.dtype, t.device.type) for t in state.unconfirmed[0].snapshot] == \
        [(torch.float32, "cpu")] * len(state.fragments[0].tensor_indices)
