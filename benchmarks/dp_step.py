"""Per-step data parallel, shared by the benchmarks that compare against it (gloo, CPU).

A rank reads its data and builds its model the way a learner does (``p2p_diloco.learner.startup``): the model of
``model`` (the built-in byte GPT, or a Hugging Face config with ``model.path``) from the run seed, and the
tokenizer of ``data.tokenizer`` (bytes by default) passed to ``load_splits``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from p2p_diloco.config import LearnerConfig
from p2p_diloco.train.data.batches import BatchSampler, fixed_eval_batches, load_splits
from p2p_diloco.train.data.tokenizer import load_tokenizer
from p2p_diloco.train.models.registry import build_model


def setup_rank(cfg: LearnerConfig, rank: int):
    """Rank r's sampler over data shard r (a learner's seed rule), the eval batches (rank 0 only), the
    model (the learners' seed) and AdamW with the learners' inner hyperparameters. Tokens come from the
    learners' tokenizer; each rank tokenises (or reads from the cache) only its own shard."""
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    splits = load_splits(cfg.data, [rank, None] if rank == 0 else [rank], tokenizer,
                         min_tokens=cfg.model.seq_len + 2)
    sampler = BatchSampler(splits[rank], cfg.model.seq_len, cfg.inner.batch_size, seed=cfg.run.seed * 7919 + rank)
    eval_batches = None
    if rank == 0:
        eval_batches = fixed_eval_batches(splits[None], cfg.model.seq_len, cfg.inner.batch_size,
                                          cfg.data.eval_batches)
    model = build_model(cfg.model, cfg.run.seed)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.inner.lr, weight_decay=cfg.inner.weight_decay,
                            betas=(cfg.inner.beta1, cfg.inner.beta2))
    return sampler, eval_batches, model, params, opt


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches) -> float:
    """Same as ``Learner.evaluate``: mean loss over the fixed eval batches, model in eval mode."""
    model.eval()
    losses = [float(model(x, y)[1]) for x, y in batches]
    return sum(losses) / len(losses)


def data_parallel_step(model: torch.nn.Module, params: list[torch.Tensor], opt: torch.optim.Optimizer, batch,
                       world: int, grad_clip: float, lr: float | None = None) -> tuple[float, float]:
    """Forward and backward on this rank's batch, one ``all_reduce`` of all gradients as one flat fp32
    tensor, divide by the world size, clip, optimizer step (at ``lr`` if given: the learners'
    schedule, ``lr_schedule.inner_lr``). Returns (compute s, all-reduce s)."""
    t0 = time.perf_counter()
    if lr is not None:
        for group in opt.param_groups:
            group["lr"] = lr
    model.train()
    x, y = batch
    _, loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    t1 = time.perf_counter()
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    t2 = time.perf_counter()
    flat /= world
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p))
        offset += n
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()
    return (t1 - t0) + (time.perf_counter() - t2), t2 - t1
