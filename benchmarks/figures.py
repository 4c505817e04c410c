"""The figures the benchmark scripts draw with ``--plot``: where they go and how one run's is drawn."""

from __future__ import annotations

import argparse
import subprocess
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def figure_path(name: str) -> Path:
    """Where ``--plot`` draws by default: benchmarks/results/NAME-DATE-COMMIT.png."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    return ROOT / "benchmarks" / "results" / f"{name}-{date.today().isoformat()}-{commit or 'unknown'}.png"


def add_plot_argument(parser: argparse.ArgumentParser, name: str, run: str = "RUN") -> None:
    """``--plot [PATH]``: draw each run's figure (:func:`draw`) to PATH-``run``.png; PATH defaults to
    :func:`figure_path` of ``name``."""
    parser.add_argument("--plot", nargs="?", const=figure_path(name), type=Path, metavar="PATH",
                        help=f"draw each {run.lower()}'s figure from its learners' audit logs (p2p_diloco.ops.plot) to "
                             f"PATH-{run}.png (default PATH: benchmarks/results/{name}-DATE-COMMIT.png)")


def draw(run_dir: Path, out: Path, run: str, title: str) -> None:
    """One run's figure (``p2p-diloco plot`` of its learners' audit logs) at OUT with the run's name added."""
    from p2p_diloco.ops.plot import PlotError, plot

    path = out.with_name(f"{out.stem}-{run}{out.suffix or '.png'}")
    try:
        print(f"figure: {plot([run_dir], path, title=title)}", flush=True)
    except PlotError as e:
        print(f"no figure for {run}: {e}", flush=True)
