"""Inner steps on a device: the local model θ where it trains, its AdamW, the lr schedule's position,
autocast, micro-batch accumulation, gradient clipping, and how fast it all goes.

What lives where:

- θ, its gradients and the inner AdamW's state live on ``run.device`` (CPU, a CUDA GPU, MPS), in fp32.
- On CUDA the forward pass runs under bf16 autocast (``run.precision``); the backward follows it.
- The global state Θ and the outer momentum stay fp32 on the CPU (pinned on CUDA: see
  :meth:`LearnerState.pin <p2p_diloco.learner.state.LearnerState.pin>`): the outer step is the same
  CPU arithmetic on every learner whatever its hardware, which keeps one lineage bit-identical.
- A fragment crosses between them only at round boundaries: a CPU fp32 snapshot of θ_f when its
  round starts (:meth:`LearnerState.snapshot <p2p_diloco.learner.state.LearnerState.snapshot>`), the
  new Θ_f copied into θ_f when the result is applied (:func:`p2p_diloco.core.outer.apply_result`).

On the CPU in fp32 without micro-batches a step is the same sequence of operations as before this
module existed (forward, zero_grad, backward, clip, AdamW), so results are bit-identical.

Example::

    trainer = Trainer(build_model(cfg.model, cfg.run.seed), cfg, resolve_placement(cfg.run))
    loss = trainer.step(x, y, version=0)   # one inner step
    print(trainer.meter.rates())           # "12,345 tokens/s, 12.1 steps/s" (and MFU on a known GPU)
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from p2p_diloco.config import LearnerConfig, RunConfig
from p2p_diloco.core.inner_optim import AdamW
from p2p_diloco.core.lr_schedule import SchedulePosition, inner_lr
from p2p_diloco.core.outer import load_into_module
from p2p_diloco.errors import LearnerError
from p2p_diloco.train.sharding import ShardedModel, sharded_unit

logger = logging.getLogger(__name__)

# Dense bf16 tensor-core peak FLOP/s per GPU, from the vendors' datasheets (the figures "with sparsity"
# are twice these). A GPU matches the first entry whose words all occur in its name; more specific
# entries come first ("H100 PCIe" before "H100").
PEAK_BF16_FLOPS: list[tuple[frozenset[str], float]] = [
    (frozenset({"H200", "NVL"}), 836e12), (frozenset({"H200"}), 989e12), (frozenset({"GH200"}), 989e12),
    (frozenset({"H100", "PCIE"}), 756e12), (frozenset({"H100", "NVL"}), 835e12), (frozenset({"H100"}), 989e12),
    (frozenset({"H800"}), 989e12), (frozenset({"B200"}), 2250e12), (frozenset({"A100"}), 312e12),
    (frozenset({"A800"}), 312e12), (frozenset({"A30"}), 165e12), (frozenset({"A10"}), 125e12),
    (frozenset({"L40S"}), 362e12), (frozenset({"L40"}), 181e12), (frozenset({"L4"}), 121e12),
]


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named ``device_name`` (``torch.cuda.get_device_name``); None when unknown.

    >>> peak_bf16_flops("NVIDIA H100 PCIe"), peak_bf16_flops("NVIDIA L40S"), peak_bf16_flops("Tesla T4")
    (756000000000000.0, 362000000000000.0, None)
    """
    words = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    return next((flops for needed, flops in PEAK_BF16_FLOPS if needed <= words), None)


def resolve_device(spec: str) -> torch.device:
    """The device ``run.device`` names: ``auto`` is the current CUDA device if there is one, else the CPU;
    ``cuda`` is the current CUDA device (``torch.cuda.set_device`` picks it, e.g. per worker of a unit).

    A device this machine does not have is a one-line :class:`LearnerError`.
    """
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "mps":
        if not torch.backends.mps.is_available():
            raise LearnerError("run.device=mps but this machine has no usable MPS (Apple GPU) device; "
                               "use run.device=cpu or auto")
        return torch.device("mps")
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise LearnerError(f"run.device={spec} but {why}; use run.device=cpu or auto")
    index = int(spec.partition(":")[2] or torch.cuda.current_device())
    count = torch.cuda.device_count()
    if index >= count:
        raise LearnerError(f"run.device={spec} but this machine has {count} CUDA device(s): cuda:0 to "
                           f"cuda:{count - 1}")
    return torch.device("cuda", index)


@dataclass(frozen=True)
class Placement:
    """Where inner steps run: the device, the autocast dtype (None: plain fp32), the device's name for
    logs and summaries, and its bf16 peak FLOP/s when known (CUDA only)."""

    device: torch.device
    autocast_dtype: torch.dtype | None = None
    name: str = "cpu"
    peak_flops: float | None = None

    @property
    def precision(self) -> str:
        """``bf16`` (autocast) or ``fp32``."""
        return "fp32" if self.autocast_dtype is None else "bf16"

    @property
    def pin_memory(self) -> bool:
        """Whether host tensors that cross to the device should be pinned (CUDA only)."""
        return self.device.type == "cuda"

    def describe(self) -> str:
        """One line for the log: ``device cpu, fp32`` or ``device cuda:0 (NVIDIA H200), bf16 autocast``."""
        return f"device {self.name}, {'fp32' if self.autocast_dtype is None else 'bf16 autocast'}"

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward pass's autocast context; nothing at all in fp32 (so CPU fp32 arithmetic is untouched)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the device (the tensor itself when it is there already)."""
        return t.to(self.device, non_blocking=True)


def resolve_placement(run: RunConfig) -> Placement:
    """The :class:`Placement` of ``run.device`` and ``run.precision``; LearnerError for what this machine lacks."""
    device = resolve_device(run.device)
    if device.type != "cuda":
        return Placement(device, torch.bfloat16 if run.precision == "bf16" else None, str(device))
    gpu = torch.cuda.get_device_name(device)
    native_bf16 = torch.cuda.get_device_capability(device) >= (8, 0)
    if run.precision == "bf16" and not native_bf16:
        raise LearnerError(f"run.precision=bf16 but {device} ({gpu}) has no native bf16 (compute capability "
                           "below 8.0); use run.precision=fp32 or auto")
    bf16 = run.precision == "bf16" or (run.precision == "auto" and native_bf16)
    return Placement(device, torch.bfloat16 if bf16 else None, f"{device} ({gpu})", peak_bf16_flops(gpu))


class Throughput:
    """Steps and tokens since :meth:`reset`, as rates over the wall time since then (so the time spent in
    rounds, evals and checkpoints counts, as it does for a user), and model FLOPs utilisation where the
    device's peak is known: MFU = 6·N·(tokens/s) / peak, N the parameter count (forward 2N, backward 4N
    per token; activation recomputation is not counted)."""

    def __init__(self, parameters: int, peak_flops: float | None):
        self.flops_per_token = 6.0 * parameters
        self.peak_flops = peak_flops
        self.reset()

    def reset(self) -> None:
        """Start a new window now."""
        self.started, self.steps, self.tokens = time.perf_counter(), 0, 0

    def add(self, tokens: int) -> None:
        """Count one inner step of ``tokens`` tokens."""
        self.steps += 1
        self.tokens += tokens

    def mfu(self, tokens_per_second: float) -> float | None:
        """Model FLOPs utilisation at ``tokens_per_second``; None when the peak is unknown (CPU, unlisted GPU)."""
        return None if self.peak_flops is None else self.flops_per_token * tokens_per_second / self.peak_flops

    def rates(self) -> str:
        """``12,345 tokens/s, MFU 41.2%, 12.1 steps/s`` for the window so far (no MFU when unknown)."""
        elapsed = max(1e-9, time.perf_counter() - self.started)
        tokens_per_second = self.tokens / elapsed
        mfu = self.mfu(tokens_per_second)
        return (f"{tokens_per_second:,.0f} tokens/s, {'' if mfu is None else f'MFU {mfu:.1%}, '}"
                f"{self.steps / elapsed:.1f} steps/s")


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute activations in the backward pass: a no-op when the model's builder enabled it already
    (hf_model.py does, with its settings), else the first transformers model inside ``model`` is asked
    to; a one-line LearnerError for a model without it (the built-in byte GPT)."""
    modules = list(model.modules())
    if any(getattr(m, "gradient_checkpointing", False) is True for m in modules):
        return
    for m in modules:
        # activation_checkpointing_enable is the transformers 5 name of gradient_checkpointing_enable
        enable = getattr(m, "activation_checkpointing_enable", None) or getattr(m, "gradient_checkpointing_enable",
                                                                                None)
        if callable(enable):
            enable()
            return
    raise LearnerError(f"model.activation_checkpointing is set but the {type(model).__name__} model does not "
                       "support it (Hugging Face models do: --model PATH)")


class Trainer:
    """The local model θ on its device and everything an inner step needs.

    ``model``: called as ``model(x, y) -> (logits, mean loss)``; moved to ``placement.device`` here (in a
    unit that shards it, by :meth:`join_sharded`, 1/N on each worker).
    :attr:`params` are its parameters, which the learner state trains as θ. ``model_files``: carried
    for the lineage id (:func:`p2p_diloco.learner.startup.build` says what it holds).
    """

    def __init__(self, model: torch.nn.Module, cfg: LearnerConfig, placement: Placement,
                 model_files: dict[str, str] | None = None):
        self.model_files = model_files
        if cfg.model.activation_checkpointing:
            enable_activation_checkpointing(model)
        self.placement = placement
        # In a unit that shards the model it stays in host memory until sharding places 1/N of it (sharding.py).
        self.model = model if sharded_unit(cfg.run) else model.to(placement.device)
        # What inner steps run through: the model itself, or its DDP wrapper in a unit of several
        # workers (:meth:`join_unit`). Evaluation and checkpoints always use the model itself.
        self.train_model: torch.nn.Module = self.model
        self.workers = 1
        self.params = list(self.model.parameters())
        self.inner = cfg.inner
        self.decay_steps = cfg.decay_steps
        self.inner_opt = AdamW(  # torch.optim.AdamW's arithmetic, without its 2-4 s import (inner_optim.py)
            self.params, lr=cfg.inner.lr, weight_decay=cfg.inner.weight_decay,
            betas=(cfg.inner.beta1, cfg.inner.beta2), foreach=placement.device.type == "cuda",
        )
        self.lr_position = SchedulePosition(cfg.inner.steps_per_outer)
        self.lr_at = 0  # schedule position of the last inner step (logged with its lr)
        # Steps of the re-warm-up (:meth:`_rewarmed`), decided at this trainer's first step; None before it.
        self.rewarm_steps: int | None = None
        self._rewarmed_steps = 0
        self.meter = Throughput(sum(p.numel() for p in self.params), placement.peak_flops)
        self._eval_model: torch.nn.Module | None = None  # a second copy, for evaluating Θ on the device
        self.sharded: ShardedModel | None = None  # the model sharded over a unit's workers (:meth:`join_sharded`)
        logger.info(placement.describe())

    def step(self, x: torch.Tensor, y: torch.Tensor, version: int,
             on_gradients: Callable[[Sequence[torch.Tensor]], None] | None = None) -> float:
        """One inner step on the batch (x, y) at global ``version``: forward and backward (in micro-batches
        when ``inner.micro_batch_size`` is set), gradient clipping, AdamW at the schedule's lr. Returns the
        batch's mean loss; on a GPU, reading it waits for the step to finish, so step times are true.
        ``on_gradients`` sees the parameters between backward and clipping (fault injection)."""
        self.model.train()
        x, y = self.placement.to_device(x), self.placement.to_device(y)
        loss = self._forward_backward(x, y)
        if on_gradients is not None:
            on_gradients(self.params)
        if self.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.inner.grad_clip)
        self.lr_at = self.lr_position.step(version)
        self.inner_opt.lr = self._rewarmed(inner_lr(self.inner, self.lr_at, self.decay_steps))
        self.inner_opt.step()
        self.meter.add(x.numel() * self.workers)
        return loss.item()

    def restart_optimizer(self) -> None:
        """A fresh inner optimizer (no moments), re-warmed at its next step as a rejoining learner's is
        (:meth:`_rewarmed`): what a learner whose training diverged trains on with (learner/healing.py)."""
        moments = getattr(self.inner_opt, "state", None)
        if isinstance(moments, dict):
            moments.clear()
        self.rewarm_steps, self._rewarmed_steps = None, 0

    def lr_share(self) -> float:
        """(lr of the last step / the peak lr ``inner.lr``)²: what that step counts as in the outlier rule
        (exclusion.py), warm-up, decay and re-warm-up included; 1.0 with a peak lr of 0."""
        return (self.inner_opt.lr / self.inner.lr) ** 2 if self.inner.lr > 0 else 1.0

    def _rewarmed(self, lr: float) -> float:
        """``lr`` times the re-warm-up factor: (k + 1) / W for the first W = ``inner.rejoin_warmup_steps`` steps of
        an AdamW that took its first step fresh at a schedule position past 0, else 1.

        Adam's first update is ±lr on every coordinate (bias correction divides a one-sample mean by its
        own magnitude). A learner that joins a run in progress (or restarts without its checkpoint) and meets
        a round after a step or two would send an outer gradient per inner step some 13x the others' (who
        sent ~90 steps each); the outlier rule leaves it out and its groupmates ban it for their next
        rounds (docs/design.md, "The inner learning rate follows the global version"). At the run's start
        every optimizer is fresh alike: nothing changes there, nor after a checkpoint's optimizer state was
        loaded. Decided once, at the first step, from the optimizer's own step count: the workers of a unit
        (which take rank 0's moments) agree.
        """
        if self.rewarm_steps is None:
            fresh = self.inner_opt.steps_taken() == 0 and self.lr_at > 0
            self.rewarm_steps = self.inner.rejoin_warmup_steps if fresh else 0
            if self.rewarm_steps:
                logger.info(f"inner optimizer starts fresh at schedule step {self.lr_at}, past the run's start: its "
                            f"lr ramps up over {self.rewarm_steps} steps")
        if self._rewarmed_steps >= self.rewarm_steps:
            return lr
        self._rewarmed_steps += 1
        return lr * self._rewarmed_steps / self.rewarm_steps

    def join_unit(self, train_model: torch.nn.Module, workers: int) -> None:
        """Train through ``train_model`` (the model wrapped in DDP) as one of ``workers`` workers of a
        learner unit (:mod:`p2p_diloco.learner.unit.group`): every worker takes the same step on its own batch, so the
        throughput meter counts the unit's tokens, and MFU is over the unit's ``workers`` devices."""
        self.train_model, self.workers = train_model, workers
        peak = None if self.placement.peak_flops is None else self.placement.peak_flops * workers
        self.meter = Throughput(sum(p.numel() for p in self.params), peak)

    def join_sharded(self, sharded: ShardedModel, workers: int) -> None:
        """Train the model as sharded over the ``workers`` of a learner unit (``run.sharding=fsdp``, the
        model and its optimizer rebuilt by :class:`p2p_diloco.train.sharding.ShardedModel`); evaluation and
        checkpoints then use the full host copy rank 0 keeps (kept up to date by the unit)."""
        self.model = sharded.model
        self.params, self.inner_opt, self.sharded = sharded.params, sharded.optimizer, sharded
        self.join_unit(sharded.model, workers)

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        micro = self.inner.micro_batch_size
        if micro is None or micro >= x.shape[0]:
            with self.placement.autocast():
                _, loss = self.train_model(x, y)
            self.inner_opt.zero_grad(set_to_none=True)
            loss.backward()
            return loss.detach()
        self.inner_opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=x.device)
        pieces = list(zip(x.split(micro), y.split(micro), strict=True))
        for n, (xs, ys) in enumerate(pieces):
            # Each micro-batch's mean loss weighted by its share of the batch: the accumulated gradient
            # is the whole batch's mean-loss gradient (up to float rounding).
            share = xs.shape[0] / x.shape[0]
            with self._accumulating(last=n == len(pieces) - 1):
                with self.placement.autocast():
                    _, loss = self.train_model(xs, ys)
                (loss * share).backward()
            total += loss.detach().float() * share
        return total

    def _accumulating(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """In a unit, DDP averages the gradients across workers only at the last micro-batch's backward."""
        no_sync = getattr(self.train_model, "no_sync", None)
        return contextlib.nullcontext() if last or no_sync is None else no_sync()

    @torch.no_grad()
    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 params: Sequence[torch.Tensor] | None = None) -> float:
        """Mean loss over ``batches`` on the device: of the local model, or of ``params`` (e.g. Θ, in the
        model's parameter order) loaded into a second copy of it, made once."""
        model = self._whole() if params is None else self._holding(params)
        model.eval()
        # A sharded unit's rank 0 evaluates its host copy, on the CPU (the module docstring of sharding.py).
        move = self.placement.to_device if self.sharded is None else (lambda t: t)
        losses = []
        for x, y in batches:
            with self.placement.autocast():
                losses.append(float(model(move(x), move(y))[1]))
        return sum(losses) / len(losses)

    def _whole(self) -> torch.nn.Module:
        """The whole local model: the model itself, or the host copy of a sharded one (rank 0 only)."""
        if self.sharded is None:
            return self.model
        if self.sharded.host is None:
            raise RuntimeError("only rank 0 of a sharded unit holds the whole model")
        return self.sharded.host

    def _holding(self, params: Sequence[torch.Tensor]) -> torch.nn.Module:
        if self._eval_model is None:
            self._eval_model = copy.deepcopy(self._whole()).requires_grad_(False)
        load_into_module(self._eval_model, params)
        return self._eval_model

    def checkpoint_state(self) -> dict[str, Any]:
        """The checkpoint's ``model``, ``inner_opt`` and ``lr_position`` entries, with tensors on the CPU.

        On the CPU the model's entries are its own tensors (the checkpoint writer copies them); on a
        device they are CPU copies, so that a checkpoint does not hold a second model in device memory.
        """
        if self.sharded is not None:  # the host copies, brought up to date by the unit (p2p_diloco.learner.unit.rank0)
            assert self.sharded.host is not None and self.sharded.host_optimizer is not None, "rank 0 only"
            return {"model": self.sharded.host.state_dict(), "inner_opt": self.sharded.host_optimizer.state_dict(),
                    "lr_position": self.lr_position.state()}
        model = self.model.state_dict()
        if self.placement.device.type != "cpu":
            model = {k: v.detach().to("cpu", copy=True) for k, v in model.items()}
        return {"model": model, "inner_opt": self.inner_opt.state_dict(), "lr_position": self.lr_position.state()}

    def report(self, tokens: int, seconds: float) -> dict[str, Any]:
        """For the summary: the hardware, and ``tokens`` over ``seconds`` of training as tokens/s and MFU."""
        tokens_per_second = tokens / seconds if seconds > 0 else 0.0
        return {"device": self.placement.name, "precision": self.placement.precision, "workers": self.workers,
                "parameters": sum(p.numel() for p in self.params), "tokens_per_second": tokens_per_second,
                "mfu": self.meter.mfu(tokens_per_second)}

