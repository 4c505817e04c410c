"""A learner that joins a run in progress: its first outer gradient per inner step against the swarm's.

The outlier rule (p2p_diloco/core/exclusion.py) leaves out a contribution whose norm per √(inner steps) (per
inner step before 2026-12-05) is above ``averaging.norm_outlier_factor`` (8) times the median of the
others'. A learner that joins with a fresh AdamW takes Adam's first, sign-like steps at the swarm's lr;
meeting a round after one step, it was left out (then banned for 3 rounds) in the chaos benchmark at M =
8 (BENCHMARKS.md, Chaos, 2026-12-04 night).

This script measures it without a network, on the learners' own trainer, model, data and schedule:

1. **the swarm's model**: one trainer trains ``--before`` inner steps on shard 0 (versions advance every
   H steps, as in a swarm at equal speeds);
2. from that model, for each of ``--shards`` other shards, inner steps by: **along**, a learner whose AdamW
   trained along (a copy of the swarm trainer's optimizer); **fresh**, a fresh AdamW with
   ``inner.rejoin_warmup_steps = 0`` (the code before the re-warm-up); and **fresh, re-warm-up W** for
   each W in ``--rewarm`` and the config's default;
3. the norm per inner step of each one's outer gradient (θ − the swarm's θ), per fragment, after each
   step count k in ``--first-round`` (on the clock schedule a newcomer can meet a round after one step),
   and its ratio to the median over the *along* learners after ``--yardstick`` steps (the others' rounds):
   the yardstick of the outlier rule until 2026-12-05; and the same ratio per √step (the ratio per step
   times √(k / yardstick)), the rule's yardstick since.

``--before 0`` measures a learner (re)started without a checkpoint at the run's start: every AdamW is fresh,
so *along* and *fresh* take the same steps (the chaos benchmark's case of 2026-12-05: a first round after 1 step
against others' 80, ``--before 0 --first-round 1 --yardstick 80``).

Usage::

    .venv/bin/python benchmarks/rejoin_norm.py                     # small-cpu as in benchmarks/chaos.py
    .venv/bin/python benchmarks/rejoin_norm.py --json benchmarks/results/rejoin_norm.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from p2p_diloco.config import load_learner_config  # noqa: E402
from p2p_diloco.learner.startup import build, load_data, refuse_bad_input  # noqa: E402

# The model and schedule of benchmarks/chaos.py's learners (its decoupled mode: 2 fragments).
CHAOS = ["model.n_embd=128", "inner.steps_per_outer=60", "sync.fragments=2", "run.threads=1"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "peers" / "small-cpu.toml"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="more overrides, after the chaos benchmark's model and schedule")
    p.add_argument("--before", type=int, default=120, help="inner steps the swarm's model has trained")
    p.add_argument("--first-round", default="1,2,5,10,30",
                   help="step counts k of the newcomer's first round to measure (its slot may open at any step)")
    p.add_argument("--yardstick", type=int, default=90,
                   help="inner steps of the learners that trained along (the others' rounds: about 90 in the chaos "
                        "benchmark's 15 s clock period)")
    p.add_argument("--shards", type=int, default=4, help="newcomer shards (1..N); shard 0 is the swarm's")
    p.add_argument("--rewarm", default="10,20,40", help="re-warm-up lengths W to measure besides the default")
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args(argv)


def train(trainer, sampler, steps: int, h: int, first: int, start=(), fragments=(),
          at: frozenset[int] | set[int] = frozenset()) -> dict[int, list[float]]:
    """``steps`` inner steps from schedule position ``first`` (version = position // H, as at equal speeds);
    after each step count in ``at``, the norm per inner step of θ − ``start`` in each fragment."""
    norms: dict[int, list[float]] = {}
    for k in range(1, steps + 1):
        x, y = sampler.next_batch()
        trainer.step(x, y, (first + k - 1) // h)
        if k in at:
            norms[k] = [sum(float((trainer.params[i].detach() - start[i]).pow(2).sum()) for i in idx) ** 0.5 / k
                        for idx in fragments]
    return norms


def run(args: argparse.Namespace) -> dict:
    cfg = load_learner_config(args.config, [*CHAOS, *args.overrides])
    torch.set_num_threads(cfg.run.threads or 1)
    tokenizer = refuse_bad_input(cfg)
    h = cfg.inner.steps_per_outer
    swarm, state = build(cfg, tokenizer)
    fragments = [list(f.tensor_indices) for f in state.fragments]
    ks = sorted(set(map(int, args.first_round.split(","))))
    began = time.perf_counter()
    train(swarm, load_data(cfg, 0, tokenizer).sampler, args.before, h, 0)
    start = [p.detach().clone() for p in swarm.params]
    default = cfg.inner.rejoin_warmup_steps
    arms = {"along": None, "fresh": 0, **{f"fresh, re-warm-up {w}": w
                                          for w in sorted({default, *map(int, args.rewarm.split(","))})}}
    # arm -> k -> one list of per-fragment norms per step for each newcomer shard
    norms: dict[str, dict[int, list[list[float]]]] = {a: {k: [] for k in [*ks, args.yardstick]} for a in arms}
    for shard in range(1, args.shards + 1):
        sampler = load_data(cfg, shard, tokenizer).sampler  # read once; every arm takes the same batches
        for arm, rewarm in arms.items():
            arm_cfg = cfg.model_copy(update={"inner": cfg.inner.model_copy(
                update={"rejoin_warmup_steps": default if rewarm is None else rewarm})})
            trainer, _ = build(arm_cfg, tokenizer)
            with torch.no_grad():
                for p, s in zip(trainer.params, start, strict=True):
                    p.copy_(s)
            if rewarm is None:
                trainer.inner_opt.load_state_dict(copy.deepcopy(swarm.inner_opt.state_dict()))
            trainer.lr_position.load([args.before // h, args.before % h])
            at = {*ks, args.yardstick} if rewarm is None else set(ks)
            sampler.cursor = 0
            got = train(trainer, sampler, max(at), h, args.before, start, fragments, at)
            for k, n in got.items():
                norms[arm][k].append(n)
            print(f"shard {shard} {arm:>24}: norm per inner step by fragment after k steps: " + "; ".join(
                f"k={k}: " + ", ".join(f"{x:.4f}" for x in n) for k, n in sorted(got.items())), flush=True)
    yard = [statistics.median(n[f] for n in norms["along"][args.yardstick]) for f in range(len(fragments))]
    ratios = {a: {k: [max(n[f] / yard[f] for f in range(len(fragments))) for n in norms[a][k]] for k in ks}
              for a in arms}
    # norm / √k over norm / √yardstick: the per-step ratio times √(k / yardstick)
    sqrt_ratios = {a: {k: [r * math.sqrt(k / args.yardstick) for r in by_k[k]] for k in ks}
                   for a, by_k in ratios.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    return {"date": datetime.now(UTC).strftime("%Y-%m-%d"), "commit": commit, "config": args.config,
            "overrides": [*CHAOS, *args.overrides], "before": args.before, "yardstick_steps": args.yardstick,
            "h": h, "lr": cfg.inner.lr, "beta1": cfg.inner.beta1, "beta2": cfg.inner.beta2,
            "outlier_factor": cfg.averaging.norm_outlier_factor, "median_along_per_fragment": yard,
            "norm_per_step": norms, "ratio_to_median_along": ratios,
            "ratio_to_median_along_per_sqrt_step": sqrt_ratios, "seconds": time.perf_counter() - began}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = run(args)
    limit = out["outlier_factor"]
    ks = sorted(next(iter(out["ratio_to_median_along"].values())))
    for key, per in (("ratio_to_median_along", "inner step"), ("ratio_to_median_along_per_sqrt_step", "√step")):
        print(f"\nnorm per {per} of a first round of k steps ÷ the median of learners that trained along over "
              f"{args.yardstick} steps (largest fragment ratio over {args.shards} newcomer shards; the outlier rule "
              f"leaves out above {limit:g}x):")
        print("| arm | " + " | ".join(f"k = {k}" for k in ks) + " |")
        print("|---|" + "---|" * len(ks))
        for arm, by_k in out[key].items():
            print(f"| {arm} | " + " | ".join(f"{max(by_k[k]):.2f} ({sum(r > limit for r in by_k[k])} left out)"
                                             for k in ks) + " |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
