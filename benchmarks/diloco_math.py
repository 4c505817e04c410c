"""DiLoCo's arithmetic alone, without any networking: how far from per-step data parallel it lands.

All workers live in one process and run one after another, so nothing here depends on hivemind
(the test suite checks that it is never imported), timing or group formation; what differs from
data parallel is only the algorithm. Same model, data shards, seeds and inner hyperparameters as
the learners (``peers/small-cpu.toml``), equal tokens:

- ``dp``: M workers' gradients averaged every step (one AdamW step on M batches);
- ``single``: one worker, one batch per step (what a learner that never merges would do);
- ``diloco H lr mu``: M workers, H AdamW steps each, then the mean of their outer gradients goes
  through the project's own :class:`~p2p_diloco.core.outer.OuterOptimizer` (Nesterov), every worker restarts
  from the new Θ (keeping its AdamW state), as in plain synchronous DiLoCo with no failures.
- ``decoupled H lr mu policy`` (``--decoupled``): the learners' Decoupled DiLoCo arithmetic with
  ``sync.fragments`` = P, ``sync.overlap_steps`` = τ and ``averaging.compression`` from the config:
  fragment f's round starts at the steps where ``s % H == f·H/P`` (:func:`~p2p_diloco.core.fragments.due_fragments`,
  the learners' own schedule), each outer gradient and their mean cross the codec once each (as input
  and result of the all-reduce, :func:`~p2p_diloco.core.quantization.round_trip`), a fragment's first round
  (f·H/P steps) is that share of an outer step (:func:`~p2p_diloco.core.outer.round_work`), and the new Θ_f reaches
  the workers τ steps later under ``policy`` through :func:`~p2p_diloco.core.outer.apply_result`, the
  function the learners apply every round's result with.

    .venv/bin/python benchmarks/diloco_math.py --steps 600 --json benchmarks/results/diloco_math.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2p_diloco.config import ConfigError, load_learner_config  # noqa: E402
from p2p_diloco.core.fragments import build_fragments, due_fragments  # noqa: E402
from p2p_diloco.core.lr_schedule import inner_lr  # noqa: E402
from p2p_diloco.core.outer import (  # noqa: E402
    GlobalState,
    OuterOptimizer,
    apply_result,
    load_into_module,
    pseudo_gradient,
    round_work,
    weighted_mean,
)
from p2p_diloco.core.quantization import round_trip  # noqa: E402
from p2p_diloco.train.data.batches import BatchSampler, fixed_eval_batches, load_splits  # noqa: E402
from p2p_diloco.train.models.registry import build_model  # noqa: E402


def dp_overrides(overrides: list[str]) -> list[str]:
    """The overrides data parallel depends on: no rounds, so no outer, sync or averaging settings (which
    may not even fit its H)."""
    return [o for o in overrides if o.split(".")[0] in ("model", "data", "inner", "run")]


def variant_config(variant: tuple, m: int, config: str, overrides: list[str]):
    kind, h, lr, mu, _ = variant
    if kind in ("dp", "single"):
        overrides = dp_overrides(overrides)
    return load_learner_config(config, [f"data.num_shards={m}", f"outer.lr={lr}", f"outer.momentum={mu}",
                                        *([f"inner.steps_per_outer={h}"] if h else []), *overrides])


def run(variant: tuple, m: int, steps: int, every: int, config: str, overrides: list[str]) -> dict:
    torch.set_num_threads(1)
    kind, h, lr, mu, policy = variant
    cfg = variant_config(variant, m, config, overrides)
    splits = load_splits(cfg.data, [None, *range(m)])  # one pass over the corpus for all of them
    evals = fixed_eval_batches(splits[None], cfg.model.seq_len, cfg.inner.batch_size, cfg.data.eval_batches)

    @torch.no_grad()
    def evaluate(model):
        model.eval()
        return sum(float(model(x, y)[1]) for x, y in evals) / len(evals)

    def adamw(model):
        return torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr, weight_decay=cfg.inner.weight_decay,
                                 betas=(cfg.inner.beta1, cfg.inner.beta2))

    def step(model, opt, batches, position):
        for group in opt.param_groups:  # the learners' schedule; with equal speeds its position is the step
            group["lr"] = inner_lr(cfg.inner, position, cfg.decay_steps)
        model.train()
        opt.zero_grad(set_to_none=True)
        for x, y in batches:
            (model(x, y)[1] / len(batches)).backward()
        if cfg.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), cfg.inner.grad_clip)
        opt.step()

    samplers = [BatchSampler(splits[i], cfg.model.seq_len, cfg.inner.batch_size,
                             seed=cfg.run.seed * 7919 + i) for i in range(m)]
    base = build_model(cfg.model, cfg.run.seed)
    curve = [(0, evaluate(base))]
    if kind in ("dp", "single"):
        model, opt = base, adamw(base)
        used = samplers if kind == "dp" else samplers[:1]
        for s in range(1, steps + 1):
            step(model, opt, [sm.next_batch() for sm in used], s - 1)
            if s % every == 0:
                curve.append((s, evaluate(model)))
    elif kind == "decoupled":
        curve += decoupled(cfg, base, adamw, step, samplers, m, steps, every, evaluate, policy)
    else:
        state, outer = GlobalState.from_module(base), OuterOptimizer(cfg.outer)
        workers = [copy.deepcopy(base) for _ in range(m)]
        opts = [adamw(w) for w in workers]
        for s in range(1, steps + 1):
            for w, opt, sm in zip(workers, opts, samplers, strict=True):
                step(w, opt, [sm.next_batch()], s - 1)
            if s % h == 0:
                deltas = [pseudo_gradient(state.params, list(w.parameters())) for w in workers]
                outer.apply(state, weighted_mean(deltas, [1.0] * m))
                for w in workers:
                    load_into_module(w, state.params)
            if s % every == 0:
                load_into_module(base, state.params)
                curve.append((s, evaluate(base)))
    name = {"dp": "dp", "single": "single", "diloco": f"diloco H={h} lr={lr} mu={mu}",
            "decoupled": f"decoupled P={cfg.sync.fragments} τ={cfg.sync.overlap_steps} "
                         f"{cfg.averaging.compression} {policy} H={h} lr={lr} mu={mu}"}[kind]
    return {"variant": name, "curve": curve}


def decoupled(cfg, base, adamw, step, samplers, m, steps, every, evaluate, policy) -> list:
    h, tau, codec = cfg.inner.steps_per_outer, cfg.sync.overlap_steps, cfg.averaging.compression
    frags = build_fragments([(n, p.shape) for n, p in base.named_parameters()], cfg.sync.fragments, h)
    whole = [p.detach().clone() for p in base.parameters()]
    states = [GlobalState(params=[whole[i].clone() for i in f.tensor_indices],
                          momentum=[torch.zeros_like(whole[i]) for i in f.tensor_indices]) for f in frags]
    outer = OuterOptimizer(cfg.outer)
    workers = [copy.deepcopy(base) for _ in range(m)]
    opts = [adamw(w) for w in workers]
    pending: list[tuple[int, int, list]] = []  # (step to apply at, fragment, each worker's snapshot)
    merged_at = [0] * len(frags)  # the step of each fragment's last round (its first carries f·H/P steps)

    def wire(ts):  # one crossing of the codec: the arithmetic of the all-reduce's own round trip
        return [round_trip(codec, t) for t in ts]

    def local(w, f):
        params = list(w.parameters())
        return [params[i] for i in frags[f].tensor_indices]

    curve = []
    for s in range(1, steps + 1):
        for w, opt, sm in zip(workers, opts, samplers, strict=True):
            step(w, opt, [sm.next_batch()], s - 1)
        for frag in due_fragments(frags, s, h):
            f = frag.index
            snaps = [[p.detach().clone() for p in local(w, f)] for w in workers]
            deltas = [wire(pseudo_gradient(states[f].params, snap)) for snap in snaps]
            # The learners' share of an outer step (outer.short_rounds): every worker carries s − merged_at steps.
            work = round_work([(1.0, s - merged_at[f])] * m, h)
            merged_at[f] = s
            outer.apply(states[f], wire(weighted_mean(deltas, [1.0] * m)), work=work)
            pending.append((s + tau, f, snaps))
        for due in [x for x in pending if x[0] == s]:
            pending.remove(due)
            _, f, snaps = due
            for w, snap in zip(workers, snaps, strict=True):  # the learner's own door for a round's result
                apply_result(local(w, f), states[f].params, snap, policy)
        if s % every == 0:
            for frag, st in zip(frags, states, strict=True):
                for i, g in zip(frag.tensor_indices, st.params, strict=True):
                    whole[i].copy_(g)
            load_into_module(base, whole)
            curve.append((s, evaluate(base)))
    return curve


def steps_to(curve, loss):
    return next((s for s, v in curve if v <= loss), None)


def _reference_dp(a) -> dict:
    """The dp result of an earlier run, refused unless everything dp depends on was the same."""
    old = json.loads(Path(a.dp_from).read_text())
    mine = (a.learners, a.steps, sorted(dp_overrides(a.overrides)))
    if (old["learners"], old["steps"], sorted(dp_overrides(old["overrides"]))) != mine:
        raise SystemExit(f"--dp-from {a.dp_from}: learners, steps or model/data/inner settings differ from this run")
    dp = old["results"][0]
    if dp["variant"] != "dp" or [s for s, _ in dp["curve"]] != list(range(0, a.steps + 1, a.every)):
        raise SystemExit(f"--dp-from {a.dp_from}: no data-parallel curve evaluated every {a.every} steps")
    return dp


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--learners", type=int, default=4, help="M")
    p.add_argument("--steps", type=int, default=600, help="inner steps per worker")
    p.add_argument("--h", default="50,25", help="comma-separated H values")
    p.add_argument("--outer", default="0.7:0.9,0.7:0.6,1.0:0.0", help="comma-separated outer lr:momentum pairs")
    p.add_argument("--every", type=int, default=50, help="eval every this many steps (a multiple of each H)")
    p.add_argument("--config", default=str(ROOT / "peers" / "small-cpu.toml"))
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="config override for every variant, e.g. inner.lr_schedule=cosine (repeatable)")
    p.add_argument("--no-single", action="store_true", help="leave out the single-worker variant")
    p.add_argument("--no-diloco", action="store_true", help="leave out the synchronous DiLoCo variants")
    p.add_argument("--decoupled", default=None, metavar="POLICIES",
                   help="also the decoupled variants, for these comma-separated apply policies (overwrite,mix); "
                        "P, τ and the codec come from the config (--set sync.fragments=4 ...)")
    p.add_argument("--dp-from", default=None, metavar="JSON",
                   help="take the data-parallel curve from an earlier --json of the same learners, steps, model, "
                        "data and inner settings instead of training it again")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    reference = _reference_dp(a) if a.dp_from else None
    variants = [("dp", 0, 0.7, 0.9, None)] * (reference is None) + [("single", 0, 0.7, 0.9, None)] * (not a.no_single)
    kinds = [("diloco", None)] * (not a.no_diloco) + [("decoupled", p) for p in (a.decoupled or "").split(",") if p]
    variants += [(kind, int(h), float(o.split(":")[0]), float(o.split(":")[1]), policy)
                 for kind, policy in kinds for h in a.h.split(",") for o in a.outer.split(",")]
    for v in variants:  # every variant's settings checked before any trains (a worker's error ends the run)
        try:
            variant_config(v, a.learners, a.config, a.overrides)
        except ConfigError as e:
            raise SystemExit(f"{v[0]} H={v[1]}: {e}") from None
    with ProcessPoolExecutor(a.jobs) as pool:
        n = len(variants)
        results = list(pool.map(run, variants, [a.learners] * n, [a.steps] * n, [a.every] * n, [a.config] * n,
                                [a.overrides] * n))
    results = [reference] * (reference is not None) + results
    dp = results[0]["curve"]
    half = dp[len(dp) // 2]
    print(f"M = {a.learners}, {a.steps} inner steps per worker, equal tokens; eval every {a.every} steps; "
          f"overrides {a.overrides}\n")
    print(f"| variant | eval at {a.steps // 2} | final eval | vs dp | steps to dp's loss at step {half[0]} "
          f"({half[1]:.3f}) |")
    print("|---|---|---|---|---|")
    for r in results:
        c = r["curve"]
        mid = dict(c).get(a.steps // 2)
        print(f"| {r['variant']} | {mid:.4f} | {c[-1][1]:.4f} | {c[-1][1] / dp[-1][1] - 1:+.1%} | "
              f"{steps_to(c, half[1]) or f'> {a.steps}'} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"learners": a.learners, "steps": a.steps, "overrides": a.overrides,
                                               "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
