"""The trainer: a CPU fp32 step is bit for bit the loop it replaced, micro-batches give the whole batch's
gradient, devices this machine lacks are one line, placement and MFU on a (simulated) GPU, evaluation,
checkpoint entries and activation checkpointing."""

import re

import pytest
import torch

from p2p_diloco.config import RunConfig, load_learner_config
from p2p_diloco.core.inner_optim import AdamW
from p2p_diloco.core.lr_schedule import SchedulePosition, inner_lr
from p2p_diloco.core.outer import load_into_module
from p2p_diloco.errors import LearnerError
from p2p_diloco.learner.startup import build
from p2p_diloco.train.models.gpt import build_model
from p2p_diloco.train.trainer import (
    Placement,
    Throughput,
    Trainer,
    enable_activation_checkpointing,
    peak_bf16_flops,
    resolve_device,
    resolve_placement,
)

CPU = Placement(torch.device("cpu"))
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


def _cfg(*overrides: str):
    return load_learner_config("peers/small-cpu.toml", ["inner.batch_size=8", "inner.warmup_steps=3", *overrides])


def _batches(n: int, seed: int = 1, b: int = 8, t: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (b, t), generator=g), torch.randint(0, 256, (b, t), generator=g))
            for _ in range(n)]


def _trainer(cfg, placement: Placement = CPU) -> Trainer:
    return Trainer(build_model(cfg.model, cfg.run.seed), cfg, placement)


def test_cpu_fp32_step_is_bit_identical_to_the_loop_before_the_trainer():
    cfg = _cfg()
    trainer, state = build(cfg)
    assert trainer.placement.describe() == "device cpu, fp32" and not state.pin_memory
    assert trainer.params == list(state.params)
    # The learner's inner step as it was written before trainer.py (learner.py at 0da125a).
    model = build_model(cfg.model, cfg.run.seed)
    params = list(model.parameters())
    opt = AdamW(params, lr=cfg.inner.lr, weight_decay=cfg.inner.weight_decay,
                betas=(cfg.inner.beta1, cfg.inner.beta2))
    position = SchedulePosition(cfg.inner.steps_per_outer)
    for version, (x, y) in zip([0, 0, 0, 1, 1, 1], _batches(6), strict=True):
        model.train()
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.inner.grad_clip)
        at = position.step(version)
        opt.lr = inner_lr(cfg.inner, at, cfg.decay_steps)
        opt.step()
        assert trainer.step(x, y, version) == loss.item()
        assert trainer.lr_at == at and trainer.inner_opt.lr == opt.lr
    for ours, theirs in zip(state.params, params, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_micro_batches_give_the_whole_batch_gradient(micro):
    whole = _trainer(_cfg("inner.grad_clip=0"))
    parts = _trainer(_cfg("inner.grad_clip=0", f"inner.micro_batch_size={micro}"))
    x, y = _batches(1)[0]
    loss_whole, loss_parts = whole.step(x, y, 0), parts.step(x, y, 0)
    assert loss_parts == pytest.approx(loss_whole, abs=1e-6)
    for a, b in zip(whole.params, parts.params, strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7)
    assert parts.meter.tokens == whole.meter.tokens == x.numel()


def test_a_micro_batch_of_the_whole_batch_is_the_plain_step():
    plain, micro = _trainer(_cfg()), _trainer(_cfg("inner.micro_batch_size=8"))
    for x, y in _batches(3):
        assert plain.step(x, y, 0) == micro.step(x, y, 0)
    assert all(torch.equal(a, b) for a, b in zip(plain.params, micro.params, strict=True))


def test_bf16_autocast_runs_on_the_cpu_too_and_keeps_fp32_parameters():
    cfg = _cfg("run.precision=bf16", "inner.micro_batch_size=4")
    placement = resolve_placement(cfg.run)
    assert placement.describe() == "device cpu, bf16 autocast" and not placement.pin_memory
    trainer = _trainer(cfg, placement)
    losses = [trainer.step(x, y, 0) for x, y in _batches(2)]
    assert all(0 < loss < 10 for loss in losses)
    assert all(p.dtype == torch.float32 for p in trainer.params)
    assert 0 < trainer.evaluate(_batches(2, seed=5)) < 10


@no_cuda
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3", "mps"])
def test_a_device_this_machine_lacks_is_one_line(spec):
    with pytest.raises(LearnerError) as e:
        resolve_device(spec)
    assert str(e.value).startswith(f"run.device={spec} but ") and "\n" not in str(e.value)
    with pytest.raises(LearnerError):  # the learner's start-up refuses it before building anything
        build(_cfg(f"run.device={spec}"))


@no_cuda
def test_auto_is_the_cpu_without_cuda():
    assert resolve_device("auto") == torch.device("cpu") and resolve_device("cpu") == torch.device("cpu")
    assert resolve_placement(RunConfig()).describe() == "device cpu, fp32"


def _fake_gpu(monkeypatch, count: int = 1, name: str = "NVIDIA H200", capability: tuple[int, int] = (9, 0)) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_placement_on_a_gpu(monkeypatch):
    _fake_gpu(monkeypatch, count=2)
    for spec in ("auto", "cuda", "cuda:1"):
        p = resolve_placement(RunConfig(device=spec))
        index = 1 if spec == "cuda:1" else 0
        assert p.device == torch.device("cuda", index) and p.autocast_dtype == torch.bfloat16
        assert p.describe() == f"device cuda:{index} (NVIDIA H200), bf16 autocast"
        assert p.pin_memory and p.peak_flops == 989e12 and p.precision == "bf16"
    assert resolve_placement(RunConfig(device="cuda", precision="fp32")).describe() == \
        "device cuda:0 (NVIDIA H200), fp32"
    with pytest.raises(LearnerError, match=r"^run.device=cuda:2 but this machine has 2 CUDA device\(s\)"):
        resolve_placement(RunConfig(device="cuda:2"))


def test_a_gpu_without_native_bf16_trains_in_fp32_unless_bf16_is_asked_for(monkeypatch):
    _fake_gpu(monkeypatch, name="Tesla V100-SXM2-16GB", capability=(7, 0))
    p = resolve_placement(RunConfig(device="cuda"))
    assert p.autocast_dtype is None and p.peak_flops is None
    with pytest.raises(LearnerError, match="no native bf16"):
        resolve_placement(RunConfig(device="cuda", precision="bf16"))


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12), ("NVIDIA L4", 121e12),
    ("NVIDIA L40S", 362e12), ("NVIDIA GH200 480GB", 989e12), ("NVIDIA A10G", None), ("Tesla T4", None),
])
def test_peak_flops_table(name, peak):
    assert peak_bf16_flops(name) == peak


def test_the_optimizer_trains_the_parameters_on_the_placement_device():
    cfg = _cfg()
    model = build_model(cfg.model, 0)
    # Moving to "meta" replaces the parameter objects (to CUDA it keeps them): what counts is that
    # the trainer, its optimizer and the learner state all hold the moved ones.
    trainer = Trainer(model, cfg, Placement(torch.device("meta")))
    assert trainer.model is model and all(p.device.type == "meta" for p in trainer.params)
    assert all(a is b for a, b in zip(model.parameters(), trainer.params, strict=True))
    assert trainer.inner_opt.params == trainer.params and not trainer.inner_opt.foreach


def test_throughput_rates_and_mfu(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("p2p_diloco.train.trainer.time.perf_counter", lambda: now[0])
    meter = Throughput(parameters=1000, peak_flops=6e9)
    for _ in range(4):
        meter.add(500)
    now[0] += 2.0
    assert meter.rates() == "1,000 tokens/s, MFU 0.1%, 2.0 steps/s"
    assert meter.mfu(1000) == pytest.approx(6e6 / 6e9)
    assert Throughput(1000, None).mfu(1e6) is None and "MFU" not in Throughput(1000, None).rates()
    # The integration tests read the lr and schedule step off the progress line.
    line = f"[abc step=30 round=1] inner 30/30 loss 2.0 ({meter.rates()}, lr 2.00e-03 at schedule step 29)"
    assert re.findall(r"round=(\d+)\] inner .*steps/s, lr (\S+) at schedule step (\d+)\)", line) == \
        [("1", "2.00e-03", "29")]


def test_evaluate_the_local_model_and_the_global_parameters():
    cfg = _cfg()
    trainer = _trainer(cfg)
    for x, y in _batches(2):
        trainer.step(x, y, 0)
    evals = _batches(3, seed=9)
    local = [p.detach().clone() for p in trainer.params]
    theta = [p.detach().clone() for p in build_model(cfg.model, cfg.run.seed).parameters()]
    # How learner.evaluate measured Θ before the trainer: a fresh model holding it.
    fresh = build_model(cfg.model, cfg.run.seed)
    load_into_module(fresh, theta)
    fresh.eval()
    with torch.no_grad():
        expected = sum(float(fresh(x, y)[1]) for x, y in evals) / len(evals)
    assert trainer.evaluate(evals, theta) == expected
    assert trainer.evaluate(evals, theta) == expected  # the second copy is reused
    assert all(torch.equal(a, b) for a, b in zip(local, trainer.params, strict=True))  # θ untouched
    assert trainer.evaluate(evals) != expected


def test_checkpoint_entries_continue_training_identically():
    cfg = _cfg()
    a, b = _trainer(cfg), _trainer(cfg)
    batches = _batches(4)
    for x, y in batches[:3]:
        a.step(x, y, 0)
    saved = a.checkpoint_state()
    assert set(saved) == {"model", "inner_opt", "lr_position"}
    assert all(t.device.type == "cpu" for s in saved["inner_opt"]["state"].values() for t in s.values())
    b.model.load_state_dict(saved["model"])
    b.inner_opt.load_state_dict(saved["inner_opt"])
    b.lr_position.load(saved["lr_position"])
    x, y = batches[3]
    assert a.step(x, y, 0) == b.step(x, y, 0)
    assert all(torch.equal(p, q) for p, q in zip(a.params, b.params, strict=True))


def _lrs(trainer: Trainer, versions: list[int]) -> list[float]:
    lrs = []
    for version, (x, y) in zip(versions, _batches(len(versions)), strict=True):
        trainer.step(x, y, version)
        lrs.append(trainer.inner_opt.lr)
    return lrs


def test_a_fresh_optimizer_past_the_schedules_start_ramps_its_lr_up():
    """A learner that joins at version 2 (schedule position 2·H) with a fresh AdamW ramps its lr over
    inner.rejoin_warmup_steps steps, then follows the schedule; at the run's start, with a loaded
    optimizer state, or with the setting at 0, the lr is the schedule's from the first step."""
    cfg = _cfg("inner.rejoin_warmup_steps=4")
    lr = cfg.inner.lr  # past the schedule's warm-up of 3 steps, the constant lr
    joined = _trainer(cfg)
    assert _lrs(joined, [2] * 6) == pytest.approx([lr / 4, lr / 2, 3 * lr / 4, lr, lr, lr])
    assert joined.rewarm_steps == 4
    at_start = _trainer(cfg)
    assert _lrs(at_start, [0] * 5) == pytest.approx([inner_lr(cfg.inner, k, None) for k in range(5)])
    assert at_start.rewarm_steps == 0
    resumed = _trainer(cfg)
    resumed.inner_opt.load_state_dict(at_start.inner_opt.state_dict())
    assert _lrs(resumed, [2, 2]) == pytest.approx([lr, lr])
    assert _lrs(_trainer(_cfg("inner.rejoin_warmup_steps=0")), [2, 2]) == pytest.approx([lr, lr])


def test_report_says_what_hardware_trained():
    report = _trainer(_cfg()).report(tokens=6400, seconds=2.0)
    assert report["device"] == "cpu" and report["precision"] == "fp32" and report["mfu"] is None
    assert report["tokens_per_second"] == 3200 and report["parameters"] > 0


class _HFLike(torch.nn.Module):
    """What activation checkpointing looks for: a transformers model's method and per-layer flag."""

    def __init__(self, enabled: bool = False):
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)
        self.layer.gradient_checkpointing = enabled
        self.calls = 0

    def gradient_checkpointing_enable(self) -> None:
        self.calls += 1


def test_activation_checkpointing():
    inner = _HFLike()
    enable_activation_checkpointing(torch.nn.Sequential(inner))  # found inside a wrapper
    assert inner.calls == 1
    done = _HFLike(enabled=True)
    enable_activation_checkpointing(torch.nn.Sequential(done))  # enabled by its builder: left alone
    assert done.calls == 0
    with pytest.raises(LearnerError, match="^model.activation_checkpointing is set but the ByteGPT model") as e:
        build(_cfg("model.activation_checkpointing=true"))
    assert "\n" not in str(e.value)
