"""Decoupled DiLoCo benchmark: quality, communication, compute utilization and mixed speeds, side by side.

One run trains the same model on the same data shards for the same number of inner steps per worker in
four ways and reports them together. The model is the built-in byte-level GPT (4 layers, width 128 unless
``--set`` says otherwise) or, when the config names one (``model.path``, e.g. ``--config
peers/llama-tiny.toml --set model.path=peers/models/llama-20m``), a Hugging Face model with the config's
tokenizer; every variant builds it and reads its tokens as a learner does.

(a) ``dp``: per-step data parallel. M processes (torch.distributed gloo on 127.0.0.1), worker i reads
    data shard i of M through the learners' own ``BatchSampler`` (same seed rule as a learner), every
    step averages the gradients with ``all_reduce``, clips, and takes an AdamW step with the learners'
    inner hyperparameters. Eval: the final model on the fixed eval batches, exactly like
    ``Learner.evaluate``. Bytes per step are *computed* for a ring all-reduce of fp32 gradients,
    2·(M−1)/M · 4 · num_params, not measured.
(b) ``sync``: plain synchronous DiLoCo through the real CLI: a bootstrap node and M ``p2p-diloco learner``
    processes with ``sync.fragments=1``, ``sync.overlap_steps=0``, ``averaging.compression=none``.
(c) ``decoupled``: the same with ``sync.fragments=P`` (4), ``sync.overlap_steps=τ`` and int4 outer gradients.
(d) ``decoupled-mixed``: (c) again with learner M−1 slowed down by ``inner.extra_step_seconds`` (a sleep of
    (slow_factor − 1) × the step time measured in (c), so its steps take ``slow_factor`` times as long).

For (b)–(d) every figure comes from the learners' ``--summary`` JSON (measured): ``last_eval_loss``
(the global model), ``global_state_sha256``, ``bytes_sent / inner_steps``, ``compute_seconds /
train_seconds`` and ``compute_seconds / (compute_seconds + wait_seconds)``; group sizes and failed
rounds are read from the learners' logs.

τ is chosen from the step time measured in (a): the smallest τ whose τ steps last ``--overlap-seconds``
(default 5 s, above a fragment round ≈ matchmaking_time 3 s + all-reduce), capped at H/P − 1.

Usage::

    .venv/bin/python benchmarks/decoupled_bench.py                 # default run, ~8 min on 2 cores
    .venv/bin/python benchmarks/decoupled_bench.py --quick         # sanity run, ~3 min
    .venv/bin/python benchmarks/decoupled_bench.py --json benchmarks/results/decoupled_bench.json
    .venv/bin/python benchmarks/decoupled_bench.py --config peers/llama-tiny.toml \
        --set model.path=peers/models/llama-20m --variants dp,decoupled --outer-steps 3 --steps-per-outer 32 \
        --overlap-steps 6                                          # a 20M Llama with the BPE, ~12 min on 2 cores

All traffic stays on 127.0.0.1. Each variant's processes run in their own process groups and are killed
(with their p2pd daemons) at the end; the script checks that none is left.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dp_step import data_parallel_step, evaluate, setup_rank  # noqa: E402
from figures import add_plot_argument, draw  # noqa: E402

from p2p_diloco.config import LearnerConfig, load_learner_config
from p2p_diloco.core.lr_schedule import inner_lr  # noqa: E402
from p2p_diloco.sim.processes import LOOPBACK_ANY_PORT, Proc, cli, processes_in_group, start_bootstrap, stop_procs

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = "127.0.0.1"
MODEL = ["model.n_layer=4", "model.n_embd=128", "model.n_head=4", "model.seq_len=64"]


# ------------------------------------------------------------------------------------------ settings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller sanity run (H=48, N=2)")
    p.add_argument("--learners", type=int, default=3, help="M")
    p.add_argument("--outer-steps", type=int, default=None, help="N (default 3, quick 2)")
    p.add_argument("--steps-per-outer", type=int, default=None, help="H (default 150, quick 48)")
    p.add_argument("--fragments", type=int, default=4, help="P for the decoupled variants")
    p.add_argument("--overlap-steps", type=int, default=None, help="τ (default: from the measured step time)")
    p.add_argument("--overlap-seconds", type=float, default=5.0, help="target τ · step time when τ is automatic")
    p.add_argument("--slow-factor", type=float, default=3.0, help="step time of the slow learner / normal")
    p.add_argument("--slow-extra-seconds", type=float, default=None,
                   help="sleep per inner step of the slow learner (default: from the step time measured in (c), "
                        "which then runs first); set it to run decoupled-mixed alone")
    p.add_argument("--config", default=str(ROOT / "peers" / "small-cpu.toml"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="extra overrides for every variant (after the built-in model's overrides, which apply only "
                        "when the config names no model.path)")
    p.add_argument("--variants", default="dp,sync,decoupled,decoupled-mixed",
                   help="comma-separated subset of dp,sync,decoupled,decoupled-mixed")
    p.add_argument("--variant-timeout", type=float, default=600.0, help="seconds before a variant is killed")
    p.add_argument("--workdir", default=None, help="logs, checkpoints, summaries (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the workdir (always kept when something failed)")
    p.add_argument("--json", default=None, help="write all results here")
    add_plot_argument(p, "decoupled_bench", run="VARIANT")
    p.add_argument("--from-json", nargs="+", default=None, metavar="PATH",
                   help="do not train: recompute the targets and tables from results files of earlier runs "
                        "(several files, e.g. variants run side by side, are merged and written to --json)")
    args = p.parse_args(argv)
    if args.outer_steps is None:
        args.outer_steps = 2 if args.quick else 3
    if args.steps_per_outer is None:
        args.steps_per_outer = 48 if args.quick else 150
    return args


def base_overrides(args: argparse.Namespace) -> list[str]:
    """Overrides shared by every variant (DP reads the same resolved config). MODEL sizes the built-in byte
    GPT; a Hugging Face model (``model.path`` in the config or in ``--set``) is sized by its config.json."""
    m = args.learners
    rest = [f"inner.steps_per_outer={args.steps_per_outer}", f"data.num_shards={m}", *args.overrides]
    hf = load_learner_config(args.config, rest).model.path is not None
    return [*([] if hf else MODEL), *rest]


def resolve(args: argparse.Namespace, extra: list[str] = ()) -> LearnerConfig:
    return load_learner_config(args.config, [*base_overrides(args), *extra])


# ------------------------------------------------------------------------------------- (a) data parallel


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _params_sha(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _dp_worker(rank: int, world: int, port: int, cfg_data: dict, steps: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                      TP_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    cfg = LearnerConfig.model_validate(cfg_data)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method="env://")
    try:
        sampler, eval_batches, model, params, opt = setup_rank(cfg, rank)
        curve = []
        if rank == 0:
            curve.append((0, evaluate(model, eval_batches)))
        compute = comm = evals = 0.0
        tokens = 0
        dist.barrier()
        started = time.perf_counter()
        for step in range(1, steps + 1):
            batch = sampler.next_batch()
            busy, reduce_s = data_parallel_step(model, params, opt, batch, world, cfg.inner.grad_clip,
                                                lr=inner_lr(cfg.inner, step - 1, cfg.decay_steps))
            compute += busy
            comm += reduce_s
            tokens += batch[0].numel()
            if rank == 0 and step % cfg.inner.steps_per_outer == 0:
                t4 = time.perf_counter()
                curve.append((step, evaluate(model, eval_batches)))
                evals += time.perf_counter() - t4
        dist.barrier()
        wall = time.perf_counter() - started
        out = {"rank": rank, "steps": steps, "tokens": tokens, "compute_seconds": compute, "comm_seconds": comm,
               "eval_seconds": evals, "wall_seconds": wall, "params_sha256": _params_sha(model),
               "num_params": sum(p.numel() for p in params)}
        if rank == 0:
            out["eval_curve"] = curve
            out["final_eval_loss"] = curve[-1][1] if curve[-1][0] == steps else evaluate(model, eval_batches)
        Path(out_dir, f"dp-{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def run_dp(args: argparse.Namespace, work: Path) -> dict:
    cfg = resolve(args)
    m, steps = args.learners, args.outer_steps * args.steps_per_outer
    out_dir = work / "dp"
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"[dp] {m} gloo workers x {steps} steps", flush=True)
    t0 = time.perf_counter()
    mp.spawn(_dp_worker, args=(m, _free_port(), cfg.model_dump(), steps, str(out_dir)), nprocs=m, join=True)
    total_wall = time.perf_counter() - t0
    ranks = [json.loads((out_dir / f"dp-{r}.json").read_text()) for r in range(m)]
    r0 = ranks[0]
    num_params = r0["num_params"]
    ring_bytes = 2 * (m - 1) / m * 4 * num_params
    res = {
        "variant": "dp",
        "final_eval_loss": r0["final_eval_loss"],
        "eval_curve": r0["eval_curve"],
        "params_identical": len({r["params_sha256"] for r in ranks}) == 1,
        "steps_per_worker": steps,
        "total_tokens": sum(r["tokens"] for r in ranks),
        "wall_seconds": total_wall,
        "train_seconds": max(r["wall_seconds"] for r in ranks),
        "step_compute_seconds": statistics.mean(r["compute_seconds"] / steps for r in ranks),
        "step_comm_seconds": statistics.mean(r["comm_seconds"] / steps for r in ranks),
        "num_params": num_params,
        "bytes_per_step_computed": ring_bytes,
    }
    print(f"[dp] eval {res['final_eval_loss']:.4f}, {res['train_seconds']:.1f}s, "
          f"compute {res['step_compute_seconds'] * 1e3:.0f} ms/step, all-reduce {res['step_comm_seconds'] * 1e3:.0f} "
          f"ms/step, {num_params} params -> {ring_bytes / 1e6:.2f} MB/step (ring, computed)", flush=True)
    return res


# ------------------------------------------------------------------------------------- (b)-(d) real swarm


ROUND_RE = re.compile(r"outer round (committed|not committed \((?P<reason>.*?)\); local progress kept) \| "
                      r"version (?P<version>\d+) fragment (?P<frag>\d+)/\d+ group (?P<group>\d+) "
                      r"window (?P<window>[\d.]+)s allreduce (?P<allreduce>[\d.]+)s round (?P<round>[\d.]+)s")


def parse_log(text: str) -> dict:
    """Round statistics from a learner's log lines (group sizes, windows, failure reasons)."""
    committed_groups, windows, round_s, allreduce_s, failures = [], [], [], [], {}
    for m in ROUND_RE.finditer(text):
        if m.group(1) == "committed":
            committed_groups.append(int(m.group("group")))
            round_s.append(float(m.group("round")))
            allreduce_s.append(float(m.group("allreduce")))
            windows.append(float(m.group("window")))
        else:
            reason = re.sub(r"\d+(\.\d+)?", "#", m.group("reason"))[:120]
            failures[reason] = failures.get(reason, 0) + 1
    return {
        "committed_group_sizes": {str(g): committed_groups.count(g) for g in sorted(set(committed_groups))},
        "round_seconds_median": statistics.median(round_s) if round_s else None,
        "allreduce_seconds_median": statistics.median(allreduce_s) if allreduce_s else None,
        "window_seconds_median": statistics.median(windows) if windows else None,
        "failed_round_reasons": failures,
        "state_downloads": text.count("synced global state"),
        "warnings": len(re.findall(r" WARNING ", text)),
        "errors": len(re.findall(r" (ERROR|CRITICAL) |Traceback", text)),
    }


def run_swarm(args: argparse.Namespace, work: Path, name: str, extra: list[str],
              per_learner: dict[int, list[str]] | None = None) -> dict:
    """A bootstrap node and M real learners; returns their summaries plus derived figures."""
    per_learner = per_learner or {}
    m = args.learners
    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    sets = [x for o in [*base_overrides(args), *extra, f"network.run_id=bench-{name}"] for x in ("--set", o)]
    procs: list[Proc] = []
    print(f"[{name}] bootstrap + {m} learners: {' '.join(extra)} "
          f"{' '.join(f'learner {i}: {v}' for i, v in per_learner.items())}", flush=True)
    t0 = time.perf_counter()
    leftovers: list[str] = []
    codes: list[int | None] = []
    timed_out = False
    try:
        boot, addr = start_bootstrap(d)
        procs.append(boot)
        learners = []
        for i in range(m):
            own = [x for o in per_learner.get(i, []) for x in ("--set", o)]
            learners.append(Proc(f"learner-{i}", cli(
                "learner", "--config", args.config, "--initial-peers", addr,
                "--host-maddrs", LOOPBACK_ANY_PORT, "--shard-index", str(i), "--num-shards", str(m),
                "--max-outer-steps", str(args.outer_steps), "--checkpoint-dir", str(d / f"ckpt-{i}"),
                "--summary", str(d / f"summary-{i}.json"), *sets, *own,
            ), d / f"learner-{i}.log"))
        procs.extend(learners)
        deadline = time.monotonic() + args.variant_timeout
        for p in learners:
            try:
                codes.append(p.popen.wait(max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                timed_out = True
                codes.append(None)
        wall = time.perf_counter() - t0
    finally:
        stop_procs(procs, grace=15)
        time.sleep(0.5)
        leftovers = processes_in_group(*(p.pid for p in procs))
    summaries, logs = [], []
    for i in range(m):
        path = d / f"summary-{i}.json"
        summaries.append(json.loads(path.read_text()) if path.exists() else None)
        logs.append(parse_log((d / f"learner-{i}.log").read_text(errors="replace")))
    res = derive(name, summaries, logs, codes, wall, timed_out, leftovers)
    res["extra_overrides"] = extra
    res["per_learner_overrides"] = {str(k): v for k, v in per_learner.items()}
    ok = res["all_ok"]
    print(f"[{name}] {'ok' if ok else 'PROBLEM'}: exit codes {codes}, identical global state "
          f"{res['identical_global_state']}, eval {res.get('eval_loss')}, wall {wall:.0f}s, "
          f"leftover processes {len(leftovers)}", flush=True)
    return res


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else None


def derive(name: str, summaries: list[dict | None], logs: list[dict], codes, wall: float, timed_out: bool,
           leftovers: list[str]) -> dict:
    have = [s for s in summaries if s is not None]
    hashes = {s["global_state_sha256"] for s in have}
    per = []
    for i, (s, lg) in enumerate(zip(summaries, logs, strict=True)):
        if s is None:
            per.append({"learner": i, "summary": None, "log": lg})
            continue
        per.append({
            "learner": i,
            "shard": s["shard"],
            "inner_steps": s["inner_steps"],
            "tokens": s["tokens"],
            "outer_steps": s["outer_steps"],
            "rounds_failed": s["rounds_failed"],
            "syncs": s["syncs"],
            "version": s["version"],
            "last_eval_loss": s["last_eval_loss"],
            "bytes_sent": s["bytes_sent"],
            "bytes_per_inner_step": s["bytes_sent"] / max(1, s["inner_steps"]),
            "compute_seconds": s["compute_seconds"],
            "wait_seconds": s["wait_seconds"],
            "train_seconds": s["train_seconds"],
            "step_seconds": s["compute_seconds"] / max(1, s["inner_steps"]),
            "util_train": s["compute_seconds"] / max(1e-9, s["train_seconds"]),
            "util_wait": s["compute_seconds"] / max(1e-9, s["compute_seconds"] + s["wait_seconds"]),
            "steps_per_second": s["inner_steps"] / max(1e-9, s["train_seconds"]),
            "steps_merged": s.get("steps_merged"),
            "global_tokens": s["global_tokens"],
            "global_state_sha256": s["global_state_sha256"],
            "log": lg,
        })
    ok_rows = [r for r in per if r.get("inner_steps") is not None]
    return {
        "variant": name,
        "exit_codes": codes,
        "timed_out": timed_out,
        "leftover_processes": leftovers,
        "identical_global_state": len(have) == len(summaries) and len(hashes) == 1,
        "global_state_sha256": sorted(hashes),
        "eval_loss": have[0]["last_eval_loss"] if len(hashes) == 1 and have else _mean(
            [s["last_eval_loss"] for s in have]),
        "first_eval_loss": have[0]["first_eval_loss"] if have else None,
        "global_tokens": have[0]["global_tokens"] if have else None,
        "total_tokens": sum(s["tokens"] for s in have),
        "wall_seconds": wall,
        "train_seconds_max": max((s["train_seconds"] for s in have), default=None),
        "bytes_per_inner_step": _mean([r["bytes_per_inner_step"] for r in ok_rows]),
        "util_train": _mean([r["util_train"] for r in ok_rows]),
        "util_wait": _mean([r["util_wait"] for r in ok_rows]),
        "step_seconds": _mean([r["step_seconds"] for r in ok_rows]),
        "learners": per,
        "all_ok": (not timed_out and all(c == 0 for c in codes) and len(have) == len(summaries)
                   and len(hashes) == 1 and not leftovers),
    }


# ------------------------------------------------------------------------------------------------ report


def _f(x, spec: str, none: str = "–") -> str:
    return none if x is None else format(x, spec)


def report(res: dict) -> str:
    """Markdown tables of the measured figures and the targets."""
    v, t = res["variants"], res["targets"]
    lines = ["| variant | final eval loss | identical global state | total tokens (in the global model) "
             "| wall s (train s) | bytes sent / learner / inner step | compute / train time "
             "| compute / (compute + wait) |",
             "|---|---|---|---|---|---|---|---|"]
    if "dp" in v:
        a = v["dp"]
        lines.append(f"| (a) data parallel, gloo | {a['final_eval_loss']:.4f} | "
                     f"{'yes' if a['params_identical'] else 'NO'} (replicas) | {a['total_tokens']:,} (all) | "
                     f"{a['wall_seconds']:.0f} ({a['train_seconds']:.0f}) | {a['bytes_per_step_computed']:,.0f} "
                     f"(computed, ring fp32) | – | – |")
    labels = {"sync": "(b) sync DiLoCo, P=1 τ=0 fp32", "decoupled": "(c) decoupled, P={P} τ={tau} int4",
              "decoupled-mixed": "(c') decoupled, learner {slow} slowed {k}×"}
    for key, label in labels.items():
        if key not in v:
            continue
        r = v[key]
        label = label.format(P=res["settings"]["fragments"], tau=res["settings"]["overlap_steps"],
                             slow=res["settings"]["learners"] - 1, k=res["settings"]["slow_factor"])
        lines.append(f"| {label} | {_f(r['eval_loss'], '.4f')} | {'yes' if r['identical_global_state'] else 'NO'} "
                     f"| {r['total_tokens']:,} ({_f(r['global_tokens'], ',')}) | {r['wall_seconds']:.0f} "
                     f"({_f(r['train_seconds_max'], '.0f')}) | "
                     f"{_f(r['bytes_per_inner_step'], ',.0f')} (measured) | {_f(r['util_train'], '.1%')} | "
                     f"{_f(r['util_wait'], '.1%')} |")
    lines += ["", "| learner | variant | inner steps | steps/s | step ms | committed rounds | failed rounds "
              "| state downloads | committed group sizes | round s (median) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for key in ("sync", "decoupled", "decoupled-mixed"):
        for r in v.get(key, {}).get("learners", []):
            if r.get("inner_steps") is None:
                lines.append(f"| {r['learner']} | {key} | (no summary) | | | | | | | |")
                continue
            lg = r["log"]
            groups = ", ".join(f"{g}: {n}" for g, n in lg["committed_group_sizes"].items())
            lines.append(f"| {r['learner']} | {key} | {r['inner_steps']} | {r['steps_per_second']:.2f} | "
                         f"{r['step_seconds'] * 1e3:.0f} | {r['outer_steps']} | {r['rounds_failed']} | "
                         f"{lg['state_downloads']} | {groups or '–'} | {_f(lg['round_seconds_median'], '.2f')} |")
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    for row in t:
        met = "–" if row["met"] is None else "yes" if row["met"] else "**no**"
        lines.append(f"| {row['target']} | {row['measured']} | {met} |")
    return "\n".join(lines)


def _join(rows: list[dict], key: str, spec: str) -> str:
    return ", ".join(format(r[key], spec) for r in rows)


def _fast_slow(res: dict):
    """(fast learners of the equal run, fast learners of the mixed run, the slow learner) as summary rows."""
    c, mixed = res["variants"].get("decoupled"), res["variants"].get("decoupled-mixed")
    if not c or not mixed:
        return None
    slow = len(mixed["learners"]) - 1
    base = [r for r in c["learners"][:slow] if r.get("inner_steps") is not None]
    fast = [r for r in mixed["learners"][:slow] if r.get("inner_steps") is not None]
    if not base or len(base) != len(fast):
        return None
    return base, fast, mixed["learners"][slow]


def download_bytes(variant: dict, num_params: int) -> float:
    """State downloads are not in ``bytes_sent``: each one moves Θ and the outer momentum in fp32 (computed)."""
    return sum(r["log"]["state_downloads"] for r in variant["learners"]) * 2 * 4 * num_params


def targets(res: dict) -> list[dict]:
    v, out = res["variants"], []
    a, b, c = v.get("dp"), v.get("sync"), v.get("decoupled")
    rows = [r for r in (c or {}).get("learners", []) if r.get("inner_steps") is not None]
    if a and rows:
        worst = max(r["bytes_per_inner_step"] for r in rows)
        ratio = a["bytes_per_step_computed"] / worst
        mean_ratio = a["bytes_per_step_computed"] / c["bytes_per_inner_step"]
        out.append({"target": "bytes per learner per inner step (a)/(c) ≥ 1000× (all-reduce bytes)",
                    "measured": f"{ratio:,.0f}× for the learner that sent most ({worst:,.0f} B/step); "
                                f"{mean_ratio:,.0f}× on the mean over learners",
                    "met": ratio >= 1000, "value": ratio})
        total = sum(r["bytes_sent"] for r in rows) + download_bytes(c, a["num_params"])
        steps = sum(r["inner_steps"] for r in rows)
        out.append({"target": "(informative) same, counting the state downloads (computed: 8 B × params each)",
                    "measured": f"{a['bytes_per_step_computed'] / (total / steps):,.0f}× "
                                f"({total / steps:,.0f} B/step, {sum(r['log']['state_downloads'] for r in rows)} "
                                f"downloads)", "met": None, "value": a["bytes_per_step_computed"] / (total / steps)})
    if c and c.get("util_train") is not None:
        out.append({"target": "(c) compute / train time ≥ 97% (mean over learners)",
                    "measured": f"{c['util_train']:.1%} (per learner "
                                f"{_join(rows, 'util_train', '.1%')})",
                    "met": c["util_train"] >= 0.97, "value": c["util_train"]})
        out.append({"target": "(c) compute / (compute + wait) ≥ 97% (mean over learners)",
                    "measured": f"{c['util_wait']:.1%} (per learner "
                                f"{_join(rows, 'util_wait', '.1%')})",
                    "met": c["util_wait"] >= 0.97, "value": c["util_wait"]})
    if a and c and c.get("eval_loss") is not None:
        rel = c["eval_loss"] / a["final_eval_loss"] - 1
        out.append({"target": "(c) final eval loss within 2% of (a)",
                    "measured": f"{rel:+.2%} ({c['eval_loss']:.4f} vs {a['final_eval_loss']:.4f})",
                    "met": rel <= 0.02, "value": rel})
    if a and b and b.get("eval_loss") is not None:
        rel = b["eval_loss"] / a["final_eval_loss"] - 1
        out.append({"target": "(informative) (b) final eval loss vs (a)",
                    "measured": f"{rel:+.2%} ({b['eval_loss']:.4f} vs {a['final_eval_loss']:.4f})",
                    "met": None, "value": rel})
    fs = _fast_slow(res)
    if fs:
        base, fast, s = fs
        ratio = statistics.mean(f["steps_per_second"] / b_["steps_per_second"]
                                for f, b_ in zip(fast, base, strict=True))
        out.append({"target": "fast learners' inner steps / train s with the slow learner ÷ without ≥ 0.95",
                    "measured": f"{ratio:.3f} ({_join(fast, 'steps_per_second', '.2f')} vs "
                                f"{_join(base, 'steps_per_second', '.2f')} steps/s)",
                    "met": ratio >= 0.95, "value": ratio})
        out.append({"target": "(informative) fast learners' compute / train time and wait s, with ÷ without "
                              "the slow learner (independent of the CPU the sleeping learner frees)",
                    "measured": f"{_join(fast, 'util_train', '.1%')} vs "
                                f"{_join(base, 'util_train', '.1%')}; wait "
                                f"{_join(fast, 'wait_seconds', '.1f')} s vs "
                                f"{_join(base, 'wait_seconds', '.1f')} s",
                    "met": None, "value": None})
        if s.get("inner_steps") is not None:
            out.append({"target": "slow learner's tokens reach the global model (committed rounds ≥ 1)",
                        "measured": f"{s['outer_steps']} committed fragment rounds, {s['inner_steps']} inner steps",
                        "met": s["outer_steps"] >= 1, "value": s["outer_steps"]})
    return out


def machine() -> dict:
    import hivemind

    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpus": os.cpu_count(), "cpu": cpu, "python": platform.python_version(), "torch": torch.__version__,
            "hivemind": hivemind.__version__, "platform": platform.platform()}


# -------------------------------------------------------------------------------------------------- main


def rerender(paths: list[Path], out: Path | None = None) -> int:
    """Recompute targets and tables; several files (variants run side by side) are merged into one."""
    runs = [json.loads(path.read_text()) for path in paths]
    res = runs[0]
    for other in runs[1:]:
        res["variants"].update(other["variants"])
        for key, value in other.get("settings", {}).items():
            res.setdefault("settings", {}).setdefault(key, value)
            if value is not None and res["settings"][key] is None:
                res["settings"][key] = value
        res["total_wall_seconds"] = max(res.get("total_wall_seconds", 0), other.get("total_wall_seconds", 0))
    if len(runs) > 1:
        res["merged_from"] = [r.get("command") for r in runs]
    res["targets"] = targets(res)
    res["table_markdown"] = report(res)
    (out or paths[0]).write_text(json.dumps(res, indent=2))
    print(res["table_markdown"])
    return 0



def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        return rerender([Path(x) for x in args.from_json], Path(args.json) if args.json else None)
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(wanted) - {"dp", "sync", "decoupled", "decoupled-mixed"}
    if unknown:
        print(f"error: unknown variants {sorted(unknown)}", file=sys.stderr)
        return 2
    cfg = resolve(args)
    h, p, m = args.steps_per_outer, args.fragments, args.learners
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="decoupled-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"workdir {work}; M={m} H={h} N={args.outer_steps} P={p}; model {cfg.model.model_dump()}; "
          f"inner lr {cfg.inner.lr} batch {cfg.inner.batch_size}; matchmaking {cfg.averaging.matchmaking_time}s",
          flush=True)
    res: dict = {"started": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(),
                 "command": " ".join([Path(sys.executable).name, *sys.argv]), "variants": {}}
    started = time.perf_counter()

    step_guess = None
    if "dp" in wanted:
        res["variants"]["dp"] = run_dp(args, work)
        step_guess = res["variants"]["dp"]["step_compute_seconds"]
    tau = args.overlap_steps
    if tau is None:
        tau = int(-(-args.overlap_seconds // step_guess)) if step_guess else h // p - 1
        tau = max(1, min(tau, h // p - 1))
    res["settings"] = {"learners": m, "outer_steps": args.outer_steps, "steps_per_outer": h, "fragments": p,
                       "overlap_steps": tau, "slow_factor": args.slow_factor, "config": args.config,
                       "overrides": base_overrides(args), "model": cfg.model.model_dump(),
                       "inner": cfg.inner.model_dump(), "outer": cfg.outer.model_dump(),
                       "averaging": cfg.averaging.model_dump(), "step_seconds_dp": step_guess}
    print(f"overlap τ = {tau} steps (step time {_f(step_guess, '.3f')} s from dp)", flush=True)
    decoupled = [f"sync.fragments={p}", f"sync.overlap_steps={tau}", "averaging.compression=int4"]
    resolve(args, decoupled)  # fail early on an invalid schedule

    if "sync" in wanted:
        res["variants"]["sync"] = run_swarm(args, work, "sync",
                                            ["sync.fragments=1", "sync.overlap_steps=0", "averaging.compression=none"])
    if "decoupled" in wanted or ("decoupled-mixed" in wanted and args.slow_extra_seconds is None):
        res["variants"]["decoupled"] = run_swarm(args, work, "decoupled", decoupled)
    if "decoupled-mixed" in wanted:
        if args.slow_extra_seconds is not None:
            extra_sleep = args.slow_extra_seconds
        else:
            step = res["variants"]["decoupled"]["step_seconds"] or step_guess or 0.1
            extra_sleep = round((args.slow_factor - 1) * step, 3)
        res["settings"]["slow_extra_step_seconds"] = extra_sleep
        res["variants"]["decoupled-mixed"] = run_swarm(
            args, work, "decoupled-mixed", decoupled, {m - 1: [f"inner.extra_step_seconds={extra_sleep}"]})

    if args.plot:  # dp trains in one process: no learner, no audit log
        for name in (v for v in res["variants"] if v != "dp"):
            draw(work / name, args.plot, name, f"decoupled_bench: {name}, M={m} H={h} N={args.outer_steps}")
    res["total_wall_seconds"] = time.perf_counter() - started
    res["targets"] = targets(res)
    table = report(res)
    res["table_markdown"] = table
    print("\n" + table, flush=True)
    print(f"\ntotal wall {res['total_wall_seconds']:.0f}s", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
        print(f"results in {args.json}")
    failed = [k for k, r in res["variants"].items() if k != "dp" and not r["all_ok"]]
    if failed or args.keep or args.workdir:
        print(f"logs kept in {work}" + (f" (problems in {failed})" if failed else ""))
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
