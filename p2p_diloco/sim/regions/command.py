"""The ``p2p-diloco regions`` subcommand: check, then simulate, emit compose, or clean up."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from p2p_diloco.config import ConfigError, load_learner_config
from p2p_diloco.sim.regions.topology import load_topology, resolve_path


def run_regions_command(args: argparse.Namespace) -> int:
    """Dispatch ``--emit-compose`` / ``--cleanup`` / a simulated run; user errors raise ConfigError."""
    if args.cleanup:
        return _cleanup()
    topo = load_topology(args.topology)
    if args.emit_compose:
        from p2p_diloco.sim.regions.compose import render_compose

        sys.stdout.write(render_compose(topo, _display_path(args.topology)))
        return 0

    from p2p_diloco.sim.regions import netns

    # Fail fast, before any namespace exists: privileges, then every learner's configuration.
    netns.check_available()
    learner_config = resolve_path(topo.learner_config)
    load_learner_config(learner_config, list(args.overrides))
    steps = args.max_outer_steps if args.max_outer_steps is not None else topo.max_outer_steps
    if steps < 1:
        raise ConfigError("--max-outer-steps must be at least 1")

    from p2p_diloco.sim.regions.simulator import RegionsOptions, main

    extra = [a for o in args.overrides for a in ("--set", o)]
    return main(RegionsOptions(topo, learner_config.resolve(), steps, Path(args.workdir), extra))


def _cleanup() -> int:
    from p2p_diloco.sim.regions import netns

    netns.check_available()
    removed = netns.cleanup_stale()
    print(f"removed {len(removed)} namespaces left by crashed runs" + (f": {' '.join(removed)}" if removed else ""))
    live = netns.live_runs()
    if live:
        print(f"still running (not touched): runs supervised by pid {', '.join(map(str, live))}")
    return 0


def _display_path(path: str) -> str:
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(p)
