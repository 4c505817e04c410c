"""``p2p-diloco``: bootstrap | learner | swarm | regions | export | peer-id | status | audit.

Errors a user can cause are printed as one line (``error: ...``) with exit code 2; no traceback.
Each subcommand imports what it needs when it runs: ``--help``, config errors and
``regions --emit-compose`` load neither torch nor hivemind.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from p2p_diloco.config import ConfigError, LearnerConfig, load_learner_config
from p2p_diloco.errors import UserError

if TYPE_CHECKING:
    from p2p_diloco.learner.unit.rank0 import Leader
    from p2p_diloco.sim.faults import FaultPlan

EXIT_USAGE = 2


def _add_network_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR",
                   help="multiaddrs of any running peer (bootstrap node or learner), "
                        "e.g. /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...")
    p.add_argument("--host-maddrs", nargs="+", metavar="MADDR",
                   help="addresses to listen on (default /ip4/0.0.0.0/tcp/0; the bootstrap node uses tcp/31337)")
    p.add_argument("--announce-maddrs", nargs="+", metavar="MADDR",
                   help="public addresses to announce to peers, e.g. /ip4/203.0.113.7/tcp/31337 behind NAT")
    p.add_argument("--allowed-peers", metavar="FILE",
                   help="a private swarm: answer only the peer IDs in FILE (one a line, '#' comments; every "
                        "learner's and the bootstrap node's, see 'p2p-diloco peer-id'); default: public")


def _add_learner_parser(sub: argparse._SubParsersAction) -> None:
    """The ``learner`` subcommand and its flags (each becomes a config override, see _learner_overrides)."""
    ln = sub.add_parser("learner", help="train as one learner unit of the swarm",
                        description="Train as one learner unit of the swarm. Under torchrun (torchrun "
                                    "--nproc-per-node N [--nnodes M] -m p2p_diloco learner ...) the N·M workers "
                                    "are one unit: they train with DDP, rank 0 is the swarm peer.")
    ln.add_argument("--config", help="peer config, e.g. peers/small-cpu.toml (default: built-in defaults)")
    _add_network_flags(ln)
    ln.add_argument("--run-id", help="swarm name; learners only average with the same run id")
    ln.add_argument("--data", help="a text file, .jsonl/.json/.parquet/.csv file, or a directory of them "
                                   "(default: Python stdlib sources)")
    ln.add_argument("--model", help="a directory with a Hugging Face config.json, with or without weights "
                                    "(default: the built-in byte-level GPT)")
    ln.add_argument("--tokenizer", help="a Hugging Face tokenizer.json (or a directory with one) or a SentencePiece "
                                        ".model (default: bytes)")
    ln.add_argument("--device", help="auto (default), cpu, cuda, cuda:N or mps")
    ln.add_argument("--shard-index", type=int, help="which data shard this learner owns (default: from peer id)")
    ln.add_argument("--num-shards", type=int, help="number of data shards the corpus is split into")
    ln.add_argument("--max-outer-steps", type=int, help="stop once the global version reaches N")
    ln.add_argument("--checkpoint-dir", help="where checkpoints go (default: first free checkpoints/learner-N)")
    ln.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    ln.add_argument("--summary", help="write a JSON summary here at exit")
    ln.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port, on all interfaces "
                                                     "(default: off)")
    ln.add_argument("--seed", type=int, help="model init and sampling seed (same for the whole swarm)")
    ln.add_argument("--fault", help="fault injection for tests, e.g. 'kill at round 3 during reduce' "
                                    "(';' separates several; see p2p_diloco/sim/faults.py)")
    ln.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="override any config field, e.g. --set inner.lr=3e-4 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    """The ``p2p-diloco`` argument parser: ``--log-level`` and the bootstrap, learner, swarm and regions subcommands."""
    parser = argparse.ArgumentParser(prog="p2p-diloco", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="json: one JSON object per line (time, level, logger, peer, step, round, message)")
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bootstrap", help="run a DHT entry point that does not train")
    b.add_argument("--config", help="TOML file, e.g. bootstrap/bootstrap.toml")
    _add_network_flags(b)
    b.add_argument("--identity", dest="identity_path", help="private key file (created if missing)")
    b.add_argument("--maddrs-file", help="write the node's visible multiaddrs to this file")

    _add_learner_parser(sub)

    s = sub.add_parser("swarm", help="run a bootstrap node and N learners on this machine (demo)")
    s.add_argument("--learners", type=int, default=3)
    s.add_argument("--config", default=str(Path("peers") / "small-cpu.toml"))
    s.add_argument("--max-outer-steps", type=int, default=6)
    s.add_argument("--workdir", default="runs/local-swarm", help="checkpoints, summaries and bootstrap key")
    s.add_argument("--private", action="store_true",
                   help="a private swarm: write WORKDIR/allowed-peers.txt with every peer's ID and give it to all")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="passed on to every learner")

    r = sub.add_parser("regions", help="a multi-region swarm in network namespaces (root), or its docker-compose.yml")
    r.add_argument("--topology", default=str(Path("regions") / "topology.toml"),
                   help="regions, subnets, learners per region, WAN bandwidth/delay/loss")
    r.add_argument("--workdir", default="runs/regions", help="checkpoints, summaries and bootstrap key")
    r.add_argument("--max-outer-steps", type=int, help="default: the topology's max_outer_steps")
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="passed on to every learner")
    r.add_argument("--emit-compose", action="store_true", help="print docker-compose.yml for the topology and exit")
    r.add_argument("--cleanup", action="store_true",
                   help="remove namespaces and processes left behind by a crashed run, then exit")

    e = sub.add_parser("export", help="write a checkpoint's global model: Hugging Face format (save_pretrained, "
                                      "with its tokenizer), or a torch state dict and config for the built-in model")
    e.add_argument("--checkpoint-dir", required=True, help="a learner's checkpoint directory (holding latest.pt)")
    e.add_argument("--out", required=True, help="directory to write the model to (created if missing)")

    st = sub.add_parser("status", help="show the swarm's learners as a table, read from the DHT as a light client "
                                       "(it does not train and is not counted)")
    st.add_argument("--initial-peers", nargs="+", metavar="MADDR", required=True,
                    help="multiaddrs of any running peer (bootstrap node or learner)")
    st.add_argument("--run-id", default="p2p-diloco", help="the swarm's run id (default: p2p-diloco)")
    st.add_argument("--watch", action="store_true", help="refresh in place until Ctrl+C")
    st.add_argument("--json", action="store_true", help="print one JSON document (with --watch: one a line)")
    st.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes with --watch")
    st.add_argument("--identity", help="identity file to join with (a private swarm must allow its peer ID); "
                                       "default: a throwaway one")

    pl = sub.add_parser("plot", help="draw a run from its learners' audit logs: eval loss over time and tokens, "
                                     "share of time computing, contributions and bytes per round (PNG)")
    pl.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                    help="learners' checkpoint directories, or directories holding several")
    pl.add_argument("-o", "--out", default="run.png", help="the PNG to write (default run.png)")

    pid = sub.add_parser("peer-id", help="print the peer ID of a learner's or bootstrap node's identity (creating "
                                         "the identity if missing), for a private swarm's --allowed-peers file")
    who = pid.add_mutually_exclusive_group(required=True)
    who.add_argument("--checkpoint-dir", help="a learner's checkpoint directory (its key is identity.key there)")
    who.add_argument("--identity", help="a bootstrap node's --identity file")

    au = sub.add_parser("audit", help="check learners' audit logs (audit.jsonl in their checkpoint directories)")
    au_sub = au.add_subparsers(dest="audit_command", required=True)
    av = au_sub.add_parser("verify", help="check every chain and signature, cross-check the learners, summarise; "
                                          "exit 1 naming the first inconsistency (FILE:LINE)")
    av.add_argument("dirs", nargs="+", metavar="DIR", help="learners' checkpoint directories (or audit.jsonl files)")
    av.add_argument("--strict", action="store_true",
                    help="also fail on an adopted state that no given log committed and whose certificate was "
                         "not checked")
    return parser


def _learner_overrides(args: argparse.Namespace) -> list[str]:
    """CLI flags become dotted overrides applied after the config file, in one place."""
    def q(v: object) -> str:
        import json
        return json.dumps(v)

    pairs = {
        "network.initial_peers": args.initial_peers, "network.host_maddrs": args.host_maddrs,
        "network.announce_maddrs": args.announce_maddrs, "network.run_id": args.run_id,
        "network.allowed_peers": args.allowed_peers,
        "data.path": args.data, "model.path": args.model, "data.tokenizer": args.tokenizer,
        "run.device": args.device, "data.shard_index": args.shard_index, "data.num_shards": args.num_shards,
        "run.max_outer_steps": args.max_outer_steps, "run.checkpoint_dir": args.checkpoint_dir,
        "run.summary": args.summary, "run.seed": args.seed, "run.metrics_port": args.metrics_port,
    }
    out = [f"{k}={q(v)}" for k, v in pairs.items() if v is not None]
    if args.resume:
        out.append("run.resume=true")
    return out + list(args.overrides)


def _configure_logging(level: str, fmt: str = "text") -> None:
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING" if level != "DEBUG" else "DEBUG")
    logging.basicConfig(level=level, stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    if fmt == "json":
        from p2p_diloco.peer_log import JsonLines

        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonLines())


def _run_learner(args: argparse.Namespace) -> int:
    cfg = load_learner_config(args.config, _learner_overrides(args))
    from p2p_diloco.sim.faults import FaultPlan, FaultPlanError

    try:
        faults = FaultPlan.parse(args.fault)
    except FaultPlanError as e:
        raise ConfigError(str(e)) from None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by torchrun: one worker of a learner unit
        from p2p_diloco.learner.unit.launch import run_unit

        return run_unit(cfg, lambda leader: _learn(cfg, faults, leader))
    return _learn(cfg, faults, None)


def _learn(cfg: LearnerConfig, faults: FaultPlan, unit: Leader | None) -> int:
    """Train as a learner (of one worker, or rank 0 of a unit) until done or signalled; write the summary."""
    from p2p_diloco.learner.lean import limit_malloc_arenas
    from p2p_diloco.net import lazy_imports

    limit_malloc_arenas()  # before the learner's threads and forks: docs/scale.md, "What a learner costs"
    lazy_imports.defer_all()  # before hivemind: what it imports and we never use costs every (re)start
    from p2p_diloco.learner.loop import Learner, write_summary  # torch and hivemind: only once the input is good

    if faults:
        # Faults act on the learner's process group (hang) and reach its forked children through this.
        os.environ["P2P_DILOCO_LEARNER_PID"] = str(os.getpid())
        if any(f.action == "hang" for f in faults.faults) and os.getpgid(0) != os.getpid():
            os.setpgid(0, 0)

    stop = threading.Event()
    learner = Learner(cfg, stop, faults, unit)

    on_signal = stop_handler(stop, learner.leave_now)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    summary = learner.run()
    if cfg.run.summary:
        write_summary(cfg.run.summary, summary)
    logging.getLogger("p2p_diloco").info(
        f"finished at version {summary['version']} sha {summary['global_state_sha256'][:16]} "
        f"eval_loss {summary['first_eval_loss']:.4f} -> {summary['last_eval_loss']:.4f}"
        + (f" (a unit of {summary['workers']} workers)" if summary.get("workers", 1) > 1 else "")
    )
    return 0


def stop_handler(stop: threading.Event, leave_now: threading.Event) -> Callable[[int, FrameType | None], None]:
    """The learner's SIGINT / SIGTERM handler: the first signal sets ``stop``, a second ``leave_now``.

    The events are set from a short-lived thread, not from the handler itself. A Python signal
    handler runs on the main thread between two bytecodes, possibly while that thread is inside
    ``Event.wait`` holding the event's internal (non-reentrant) lock; ``Event.set`` there would wait
    for that lock forever. The thread waits for it instead, until the main thread lets go.
    """

    caught: list[str] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        name, log = signal.Signals(signum).name, logging.getLogger("p2p_diloco")
        caught.append(name)
        if len(caught) > 1:
            log.info(f"caught {name} again; leaving without the parting rounds")
            event = leave_now
        else:
            log.info(f"caught {name}; leaving after this step")
            event = stop
        threading.Thread(target=event.set, name=f"on-{name}", daemon=True).start()

    return on_signal


def _run_bootstrap(args: argparse.Namespace) -> int:
    from p2p_diloco.bootstrap import load_bootstrap_config, run_bootstrap

    cfg = load_bootstrap_config(args.config, {
        "host_maddrs": args.host_maddrs, "announce_maddrs": args.announce_maddrs,
        "initial_peers": args.initial_peers, "identity_path": args.identity_path, "maddrs_file": args.maddrs_file,
        "allowed_peers": args.allowed_peers,
    })
    run_bootstrap(cfg)
    return 0


def _run_swarm(args: argparse.Namespace) -> int:
    from p2p_diloco.sim.local_swarm import SwarmOptions
    from p2p_diloco.sim.local_swarm import main as swarm_main

    if args.learners < 1:
        raise ConfigError("--learners must be at least 1")
    load_learner_config(args.config, list(args.overrides))  # fail fast, before any process starts
    extra = [a for o in args.overrides for a in ("--set", o)]
    return swarm_main(SwarmOptions(args.learners, args.config, args.max_outer_steps, Path(args.workdir), extra,
                                   private=args.private))


def _run_export(args: argparse.Namespace) -> int:
    from p2p_diloco.ops.export import export  # torch (and transformers for HF models): only when exporting

    export(args.checkpoint_dir, args.out)
    return 0


def _run_plot(args: argparse.Namespace) -> int:
    from p2p_diloco.ops.plot import plot  # matplotlib: only when plotting

    print(plot(args.run_dirs, args.out))
    return 0


def _run_peer_id(args: argparse.Namespace) -> int:
    from p2p_diloco.trust.admission import peer_id_of  # hivemind: only to read or make the key

    path = Path(args.checkpoint_dir) / "identity.key" if args.checkpoint_dir else Path(args.identity)
    print(peer_id_of(path))
    return 0


def _run_status(args: argparse.Namespace) -> int:
    from p2p_diloco.ops.status import run_status  # hivemind and rich: only when asked

    return run_status(args.initial_peers, args.run_id, watch=args.watch, as_json=args.json,
                      interval=args.interval, identity=args.identity)


def _run_audit(args: argparse.Namespace) -> int:
    from p2p_diloco.ops.audit_verify import main as verify_main  # hivemind's crypto: only to check signatures

    return verify_main(args.dirs, strict=args.strict)


def _run_regions(args: argparse.Namespace) -> int:
    from p2p_diloco.sim.regions.command import run_regions_command

    return run_regions_command(args)


def main(argv: list[str] | None = None) -> int:
    """Run the ``p2p-diloco`` command line; returns the exit code."""
    args = build_parser().parse_args(argv)
    _configure_logging(args.log_level, args.log_format)
    handler = {"learner": _run_learner, "bootstrap": _run_bootstrap, "swarm": _run_swarm,
               "regions": _run_regions, "export": _run_export, "peer-id": _run_peer_id,
               "status": _run_status, "audit": _run_audit, "plot": _run_plot}[args.command]
    try:
        return handler(args)
    except UserError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
