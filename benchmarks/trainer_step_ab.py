"""A learner's inner step against a bare PyTorch step, in one process, so that the machine's load hits both.

Builds a learner's ``Trainer`` (:func:`p2p_diloco.learner.startup.build`) and a bare copy of the same model with
``torch.optim.AdamW`` at the learner's inner hyperparameters, then alternates blocks of 50 steps of each
on the same 50 random batches (the order flips every block). Prints the seconds of each side and
``trainer/bare time``: the compute-only factor of ``trainer_overhead.py``'s whole-loop ratio, measured
without the load moving between two processes (BENCHMARKS.md, "Overhead of the trainer").

    .venv/bin/python benchmarks/trainer_step_ab.py peers/small-cpu.toml 6
    .venv/bin/python benchmarks/trainer_step_ab.py peers/llama-tiny.toml 6
"""

from __future__ import annotations

import sys
import time

import torch

from p2p_diloco.config import load_learner_config
from p2p_diloco.learner.startup import build
from p2p_diloco.train.models.registry import build_model


def main(config: str, blocks: int) -> None:
    torch.set_num_threads(1)
    cfg = load_learner_config(config, ["inner.steps_per_outer=100", "run.threads=1", "run.device=cpu"])
    trainer, _ = build(cfg)
    model = build_model(cfg.model, cfg.run.seed)
    params, inner = list(model.parameters()), cfg.inner
    opt = torch.optim.AdamW(params, lr=inner.lr, weight_decay=inner.weight_decay, betas=(inner.beta1, inner.beta2))
    vocab = 256 if cfg.model.path is None else 4096
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (inner.batch_size, cfg.model.seq_len + 1), generator=g) for _ in range(50)]

    def bare(x: torch.Tensor, y: torch.Tensor) -> None:
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, inner.grad_clip)
        opt.step()
        loss.item()

    seconds = {"trainer": 0.0, "bare": 0.0}
    for block in range(blocks):
        for side in (["trainer", "bare"] if block % 2 == 0 else ["bare", "trainer"]):
            started = time.perf_counter()
            for b in batches:
                x, y = b[:, :-1], b[:, 1:]
                if side == "trainer":
                    trainer.step(x, y, 0)
                else:
                    bare(x, y)
            seconds[side] += time.perf_counter() - started
    print(config, {k: round(v, 2) for k, v in seconds.items()}, "trainer/bare time",
          round(seconds["trainer"] / seconds["bare"], 3))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 6)
