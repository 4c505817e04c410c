"""``p2p-diloco plot RUN_DIR... -o out.png``: a run's story from its learners' audit logs.

Every ``audit.jsonl`` under the given directories (a learner's checkpoint directory, or a run's work
directory holding several) is one learner. Four panels, one line per learner:

1. eval loss of its local model against wall time (``outer_step`` events that carry an eval);
2. the same against the tokens it had trained on;
3. its share of time computing (compute seconds over training-loop seconds, between two outer steps);
4. its cumulative tokens merged into the global state (from its ``committed`` rounds), and the bytes
   each round sent, as dots on a second axis.

matplotlib with the Agg backend: no display needed. Lines that do not parse are skipped (the chain's
integrity is ``p2p-diloco audit verify``'s job, not this one's).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2p_diloco.errors import UserError

AUDIT = "audit.jsonl"


class PlotError(UserError, ValueError):
    """Nothing to plot (no audit log under the directories given)."""


@dataclass
class Series:
    """What one learner's audit log says over time."""

    name: str
    eval_time: list[float] = field(default_factory=list)
    eval_tokens: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    share_time: list[float] = field(default_factory=list)
    compute_share: list[float] = field(default_factory=list)
    merged_time: list[float] = field(default_factory=list)
    merged_tokens: list[int] = field(default_factory=list)
    round_bytes: list[int] = field(default_factory=list)


def find_logs(dirs: Sequence[str | Path]) -> list[Path]:
    """Every audit log in or under ``dirs`` (sorted); PlotError if there is none."""
    logs: list[Path] = []
    for d in map(Path, dirs):
        if not d.exists():
            raise PlotError(f"{d} does not exist")
        logs += [d / AUDIT] if (d / AUDIT).is_file() else sorted(d.rglob(AUDIT))
    if not logs:
        raise PlotError(f"no {AUDIT} under {', '.join(map(str, dirs))}: point at learners' checkpoint directories")
    return sorted(set(logs))


def read_series(log: Path, start: float | None = None) -> Series:
    """The series of one learner's log; times are seconds since ``start`` (default: its first line)."""
    s = Series(name=log.parent.name)
    merged, last = 0, None
    for raw in log.read_bytes().splitlines():
        try:
            e: dict[str, Any] = json.loads(raw)
            t = float(e["time"])
        except (ValueError, KeyError, TypeError):
            continue
        start = t if start is None else start
        if e.get("event") in ("started", "resumed"):
            last = None  # a restart: its counters come from a checkpoint, not from the previous line
        elif e.get("event") == "outer_step":
            _outer_step(s, e, t - start, last)
            last = e
        elif e.get("event") == "committed":
            merged += int(e.get("tokens", 0))
            s.merged_time.append(t - start)
            s.merged_tokens.append(merged)
            s.round_bytes.append(int(e.get("bytes_sent", 0)))
    return s


def _outer_step(s: Series, e: dict[str, Any], t: float, last: dict[str, Any] | None) -> None:
    if isinstance(e.get("eval_loss"), int | float):
        s.eval_time.append(t)
        s.eval_tokens.append(int(e.get("tokens", 0)))
        s.eval_loss.append(float(e["eval_loss"]))
    if last is not None:
        d_train = float(e.get("train_seconds", 0)) - float(last.get("train_seconds", 0))
        d_compute = float(e.get("compute_seconds", 0)) - float(last.get("compute_seconds", 0))
        if d_train > 0:
            s.share_time.append(t)
            s.compute_share.append(min(1.0, max(0.0, d_compute / d_train)))


def plot(dirs: Sequence[str | Path], out: str | Path, title: str = "") -> Path:
    """Draw the four panels for every learner under ``dirs`` into ``out`` (PNG); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = find_logs(dirs)
    firsts = [_first_time(log) for log in logs]
    start = min((t for t in firsts if t is not None), default=None)
    series = [read_series(log, start) for log in logs]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (loss_t, loss_tok), (share, merged) = axes
    bytes_ax = merged.twinx()
    for s in series:
        loss_t.plot(s.eval_time, s.eval_loss, marker=".", label=s.name)
        loss_tok.plot(s.eval_tokens, s.eval_loss, marker=".", label=s.name)
        share.plot(s.share_time, s.compute_share, label=s.name)
        line, = merged.plot(s.merged_time, s.merged_tokens, label=s.name)
        bytes_ax.scatter(s.merged_time, [b / 1e6 for b in s.round_bytes], s=8, color=line.get_color(), alpha=0.5)
    loss_t.set(xlabel="wall time (s)", ylabel="eval loss (local model)", title="eval loss over time")
    loss_tok.set(xlabel="tokens trained by the learner", ylabel="eval loss", title="eval loss over tokens")
    share.set(xlabel="wall time (s)", ylabel="compute / training loop", title="share of time computing", ylim=(0, 1.05))
    merged.set(xlabel="wall time (s)", ylabel="own tokens merged (cumulative)",
               title="contributions (lines) and MB sent per round (dots)")
    bytes_ax.set_ylabel("MB sent per round")
    for ax in (loss_t, loss_tok, share, merged):
        ax.grid(alpha=0.3)
    loss_t.legend(fontsize="small")
    fig.suptitle(title or f"{len(series)} learner(s): {', '.join(map(str, dirs))}"[:120])
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _first_time(log: Path) -> float | None:
    with log.open("rb") as f:
        for raw in f:
            try:
                return float(json.loads(raw)["time"])
            except (ValueError, KeyError, TypeError):
                continue
    return None
