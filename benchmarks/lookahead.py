"""How much of a checkpoint's global model is its last outer steps' momentum look-ahead.

Loads the global model Θ of each learner checkpoint directory given (``p2p-diloco export``'s reading) and
evaluates it on ``--eval-batches`` fixed eval batches of its own config's data, then again with
``lr·μ·b`` (each fragment's Nesterov look-ahead: the part of its last outer step that came from
momentum, b its momentum buffer) put back, for each fragment alone and for all of them. A fragment
whose last round carried few inner steps moved Θ by about lr·μ²·b on momentum alone under
``outer.short_rounds = "full"``: putting the look-ahead back shows what that cost (docs/design.md,
"Short rounds"). With ``"scaled"`` a last round of share w < 1 applied only w·lr·μ·b, and the full lr·μ·b
put back here goes past the state before it. Reads checkpoints only; no network.

    .venv/bin/python benchmarks/lookahead.py WORK/clean/ckpt-0 WORK/clean-matched/ckpt-0 [--json OUT]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2p_diloco.core.fragments import build_fragments  # noqa: E402
from p2p_diloco.core.outer import GlobalState, load_into_module  # noqa: E402
from p2p_diloco.learner.state import LearnerState  # noqa: E402
from p2p_diloco.ops.export import global_model  # noqa: E402
from p2p_diloco.train.checkpoint import load_checkpoint  # noqa: E402
from p2p_diloco.train.data.batches import fixed_eval_batches, load_splits  # noqa: E402
from p2p_diloco.train.models.registry import embedding_names, named_shapes  # noqa: E402


def lookahead_losses(directory: Path, eval_batches: int) -> dict:
    cfg, model = global_model(directory)
    payload = load_checkpoint(directory)
    evals = fixed_eval_batches(load_splits(cfg.data, [None])[None], cfg.model.seq_len, cfg.inner.batch_size,
                               eval_batches)
    frags = build_fragments(named_shapes(model), cfg.sync.fragments, cfg.inner.steps_per_outer,
                            embedding_names(model))

    @torch.no_grad()
    def loss(undo: tuple[int, ...]) -> float:
        states = [GlobalState.from_dict(copy.deepcopy(g)) for g in payload["global"]]
        for f in undo:
            for p, b in zip(states[f].params, states[f].momentum, strict=True):
                p.add_(b, alpha=cfg.outer.lr * cfg.outer.momentum)
        load_into_module(model, LearnerState(frags, states, list(model.parameters())).global_params())
        model.eval()
        return sum(float(model(x, y)[1]) for x, y in evals) / len(evals)

    out = {"checkpoint": str(directory), "versions": [g["version"] for g in payload["global"]],
           "tokens": [g["tokens"] for g in payload["global"]], "as_is": loss(())}
    for f in range(len(frags)):
        out[f"without_lookahead_of_fragment_{f}"] = loss((f,))
    out["without_lookahead_of_all"] = loss(tuple(range(len(frags))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="+", type=Path, help="learner checkpoint directories (holding latest.pt)")
    ap.add_argument("--eval-batches", type=int, default=64,
                    help="fixed eval batches (the learners' own evals use data.eval_batches)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = []
    for d in args.checkpoints:
        r = lookahead_losses(d, args.eval_batches)
        results.append(r)
        print(" | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
