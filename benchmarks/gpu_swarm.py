"""GPU swarm: 2 learners with ``run.device=cuda`` and bf16 autocast, reporting tokens/s, MFU and the final hash.

A bootstrap node and the learners run on loopback through ``p2p-diloco swarm``'s own supervisor
(:func:`p2p_diloco.sim.local_swarm.run_swarm`), each learner a real ``p2p-diloco learner`` process. Every
learner uses the current CUDA device, so on a one-GPU machine they share it: the total tokens/s is
the GPU's, and the MFU of the GPU is the sum of the learners'. Figures come from the learners'
``--summary`` JSON: tokens/s over the training loop's wall time (rounds, evals and checkpoints
included) and over the inner steps alone; MFU = 6·N·tokens/s ÷ the GPU's dense bf16 peak
(:data:`p2p_diloco.train.trainer.PEAK_BF16_FLOPS`; "unknown" for a GPU not in that table).

Usage::

    .venv/bin/python benchmarks/gpu_swarm.py                       # byte GPT, 12 layers × 768, seq 1024 (~85M)
    .venv/bin/python benchmarks/gpu_swarm.py --set inner.micro_batch_size=8 --json benchmarks/results/gpu.json
    .venv/bin/python benchmarks/gpu_swarm.py --config peers/small-cpu.toml --no-model-overrides   # quick check

Needs CUDA: without it the script says so in one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# A GPT-2-small-sized byte model: big enough that the GPU, not the Python around it, sets the pace.
MODEL = ["model.n_layer=12", "model.n_head=12", "model.n_embd=768", "model.seq_len=1024",
         "inner.batch_size=16", "inner.steps_per_outer=200", "inner.lr=6e-4", "data.eval_batches=8"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--learners", type=int, default=2)
    p.add_argument("--outer-steps", type=int, default=3, help="run until the global version reaches this")
    p.add_argument("--config", default=str(ROOT / "peers" / "default.toml"))
    p.add_argument("--no-model-overrides", action="store_true", help="train the config's model as it is")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32", "auto"])
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--workdir", help="checkpoints, logs and summaries (default: a temporary directory)")
    p.add_argument("--json", help="write the figures here")
    return p.parse_args(argv)


def require_cuda() -> None:
    """Exit with one line (code 2) on a machine where torch sees no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        print(f"error: benchmarks/gpu_swarm.py needs a CUDA GPU ({why}); run it on a GPU machine", file=sys.stderr)
        raise SystemExit(2)


def figures(summary: dict) -> dict:
    """One learner's throughput: tokens/s over the training loop and over its inner steps, and the MFUs."""
    per_train = summary["tokens"] / max(1e-9, summary["train_seconds"])
    per_compute = summary["tokens"] / max(1e-9, summary["compute_seconds"])
    mfu = summary.get("mfu")  # over train_seconds, as the learner reported it
    return {"device": summary.get("device"), "precision": summary.get("precision"),
            "parameters": summary.get("parameters"), "tokens": summary["tokens"],
            "tokens_per_second": per_train, "tokens_per_compute_second": per_compute,
            "mfu": mfu, "mfu_inner_steps": None if mfu is None else mfu * per_compute / per_train,
            "version": summary["version"], "global_state_sha256": summary["global_state_sha256"],
            "eval_loss": [summary["first_eval_loss"], summary["last_eval_loss"]]}


def report(rows: list[dict]) -> bool:
    """Print one line per learner, the totals and the hash; True when every learner holds one state."""
    def pct(x: float | None) -> str:
        return "unknown" if x is None else f"{x:.1%}"

    print(f"\n{'learner':>7} {'device':<28} {'tokens/s':>10} {'(steps)':>10} {'MFU':>8} {'(steps)':>8}  sha256")
    for i, r in enumerate(rows):
        print(f"{i:>7} {str(r['device']):<28} {r['tokens_per_second']:>10,.0f} "
              f"{r['tokens_per_compute_second']:>10,.0f} {pct(r['mfu']):>8} {pct(r['mfu_inner_steps']):>8}  "
              f"{r['global_state_sha256'][:16]}")
    mfus = [r["mfu"] for r in rows]
    total_mfu = None if any(m is None for m in mfus) else sum(mfus)
    print(f"total {sum(r['tokens_per_second'] for r in rows):,.0f} tokens/s, MFU {pct(total_mfu)} "
          f"({rows[0]['precision']}, {rows[0]['parameters']:,} parameters)")
    hashes = sorted({r["global_state_sha256"] for r in rows})
    print(f"final hash {hashes[0]}" if len(hashes) == 1 else f"learners disagree: {len(hashes)} hashes")
    return len(hashes) == 1


def main(argv: list[str] | None = None) -> int:
    """Run the swarm, print the figures; the exit code is the swarm's (0: every learner ended on one state)."""
    args = parse_args(argv)
    require_cuda()
    from p2p_diloco.sim.local_swarm import SwarmOptions, read_summaries
    from p2p_diloco.sim.local_swarm import main as run_swarm

    overrides = [] if args.no_model_overrides else list(MODEL)
    overrides += ["run.device=cuda", f"run.precision={args.precision}", *args.overrides]
    with tempfile.TemporaryDirectory(prefix="gpu-swarm-") as tmp:
        work = Path(args.workdir or tmp)
        code = run_swarm(SwarmOptions(learners=args.learners, config=args.config, max_outer_steps=args.outer_steps,
                                      workdir=work, extra=[a for o in overrides for a in ("--set", o)]))
        summaries = read_summaries({i: work / f"summary-{i}.json" for i in range(args.learners)})
    if not summaries:
        print("no learner wrote a summary", file=sys.stderr)
        return code or 1
    rows = [figures(s) for _, s in summaries]
    same = report(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"overrides": overrides, "learners": rows}, indent=2))
    return code if same else (code or 1)


if __name__ == "__main__":
    sys.exit(main())
