"""AdamW for the inner steps, without ``torch.optim``.

``torch.optim``'s optimizers import ``torch._dynamo`` when their first parameter group is added: 1.7 s
on an idle core and about twice that on a busy machine, paid at every start and restart of a
learner (a restart is otherwise ~3 s of imports and a few tenths of a second of set-up on an idle
core). A killed learner's restart is the main cost of a failure (BENCHMARKS.md, Chaos), so the inner
optimizer is this class instead.

It performs the operations of ``torch.optim.AdamW`` with ``foreach=False`` (torch's choice for CPU
tensors) in the same order, so both give bit-identical parameters, and its ``state_dict`` has
torch's layout (``state[i] = {step, exp_avg, exp_avg_sq}``), so checkpoints written with either
load into the other (tests/unit/test_inner_optim.py). Hyperparameters come from the config, not
from a checkpoint: a learner resumed with a new learning rate uses the new one.

With ``foreach=True`` it performs ``torch.optim.AdamW``'s ``foreach=True`` operations instead (torch's
choice for CUDA tensors): a handful of multi-tensor kernels per step instead of ~8 per parameter,
which on a GPU is the difference between launch-bound and not (tests/unit/test_trainer_optim.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class AdamW:
    """``torch.optim.AdamW`` (``foreach=False``) over one list of parameters, bit for bit (module docstring).

    The learner sets :attr:`lr` before every step (the schedule); the other hyperparameters are fixed.
    ``foreach``: multi-tensor kernels, as ``torch.optim.AdamW(foreach=True)`` (for CUDA parameters).
    """
    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, foreach: bool = False):
        self.params = list(params)
        if not self.params:
            raise ValueError("AdamW got an empty parameter list")
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid AdamW settings: lr={lr} betas={betas} eps={eps} weight_decay={weight_decay}")
        self.lr, self.betas, self.eps, self.weight_decay = float(lr), tuple(map(float, betas)), float(eps), \
            float(weight_decay)
        self.state: dict[int, dict[str, torch.Tensor]] = {}
        self.foreach = foreach

    def steps_taken(self) -> int:
        """How many updates this optimizer's state holds (its most-stepped parameter's count); 0 when fresh."""
        return int(max((float(s["step"]) for s in self.state.values()), default=0.0))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients: drop them (``set_to_none``, torch's default) or zero them in place."""
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW update, in place, of every parameter that has a gradient; refuses sparse gradients."""
        if self.foreach:
            self._step_foreach()
            return
        lr, (beta1, beta2), eps, wd = self.lr, self.betas, self.eps, self.weight_decay
        for i, param in enumerate(self.params):
            grad = param.grad
            if grad is None:
                continue
            exp_avg, exp_avg_sq, step_t = self._state_of(i, grad)
            step_t += 1
            if wd != 0:
                param.mul_(1 - lr * wd)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step = step_t.item()
            bias_correction1 = 1 - beta1**step
            bias_correction2 = 1 - beta2**step
            step_size = lr / bias_correction1
            denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
            param.addcdiv_(exp_avg, denom, value=-step_size)

    def _state_of(self, i: int, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(exp_avg, exp_avg_sq, step) of parameter ``i``, created at its first gradient."""
        if grad.is_sparse:
            raise RuntimeError("AdamW does not support sparse gradients")
        state = self.state.get(i)
        if state is None:
            param = self.params[i]
            state = self.state[i] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
            }
        return state["exp_avg"], state["exp_avg_sq"], state["step"]

    def _step_foreach(self) -> None:
        """:meth:`step` with torch's ``_multi_tensor_adam`` operations (decoupled weight decay, not capturable)."""
        groups: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
        for i, param in enumerate(self.params):
            if param.grad is None:
                continue
            group = groups.setdefault((param.device, param.dtype), [[], [], [], [], []])
            for column, t in zip(group, (param, param.grad, *self._state_of(i, param.grad)), strict=True):
                column.append(t)
        lr, (beta1, beta2), eps, wd = self.lr, self.betas, self.eps, self.weight_decay
        for params, grads, exp_avgs, exp_avg_sqs, steps in groups.values():
            torch._foreach_add_(steps, torch.tensor(1.0), alpha=1.0)  # the step counts live on the CPU, as torch's
            if wd != 0:
                torch._foreach_mul_(params, 1 - lr * wd)
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
            counts = [s.item() for s in steps]
            step_sizes = [(lr / (1 - beta1**n)) * -1 for n in counts]
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(denom, [(1 - beta2**n) ** 0.5 for n in counts])
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)

    def state_dict(self) -> dict[str, Any]:
        """CPU copies of the per-parameter state in torch's layout, with one param group of the current hyperparameters.

        CPU copies, so that a GPU learner's checkpoint holds no second copy of the state in device memory.
        """
        return {
            "state": {i: {k: v.to("cpu", copy=True) for k, v in s.items()} for i, s in self.state.items()},
            "param_groups": [{"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                              "amsgrad": False, "maximize": False, "params": list(range(len(self.params)))}],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the per-parameter state of a :meth:`state_dict` (this class's or torch's) after checking it.

        ValueError for another parameter count or shape, or amsgrad / maximize state; its hyperparameters are ignored.
        """
        groups = state_dict.get("param_groups", [])
        n = sum(len(g.get("params", [])) for g in groups)
        if n != len(self.params):
            raise ValueError(f"optimizer state is for {n} parameters, this model has {len(self.params)}")
        if any(g.get("amsgrad") or g.get("maximize") for g in groups):
            raise ValueError("optimizer state was made with amsgrad or maximize, which this AdamW does not do")
        state = {}
        for i, s in state_dict.get("state", {}).items():
            i = int(i)
            p = self.params[i]
            if s["exp_avg"].shape != p.shape or s["exp_avg_sq"].shape != p.shape:
                raise ValueError(f"optimizer state of parameter {i} does not match its shape {tuple(p.shape)}")
            state[i] = {"step": torch.as_tensor(s["step"], dtype=torch.float32).clone(),
                        "exp_avg": s["exp_avg"].to(p.device, p.dtype).clone(),
                        "exp_avg_sq": s["exp_avg_sq"].to(p.device, p.dtype).clone()}
        self.state = state
