"""``p2p-diloco swarm``: a bootstrap node and N learners as separate processes on loopback.

This is the README's first command: it shows the whole system on one machine. Every learner is a
real ``p2p-diloco learner`` process with its own p2pd daemon, data shard and checkpoint directory;
they find each other only through the DHT, exactly as they would on separate machines.
The supervisor is an asyncio program on uvloop that prefixes and forwards each process's output,
and on Ctrl+C or SIGTERM passes the signal on and waits for every process to leave.

Each child runs in its own session, so a Ctrl+C in the terminal reaches only the supervisor, which
sends every learner one SIGTERM: a learner reads a second signal as "leave now, skip the parting
rounds" (see ``run.drain_seconds``). If the supervisor dies, its children get SIGTERM from the kernel.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import uvloop

from p2p_diloco.sim.processes import (
    LOOPBACK_ANY_PORT,
    MADDRS_FILE,
    bootstrap_args,
    cli,
    spawn_pumped,
    stop_all,
    wait_for_bootstrap,
)


@dataclass
class SwarmOptions:
    """What ``p2p-diloco swarm`` runs: ``learners`` learners on ``config`` until ``max_outer_steps``, files
    under ``workdir``, ``extra`` CLI arguments for every learner; ``startup_timeout``: for the bootstrap node.
    """
    learners: int
    config: str
    max_outer_steps: int
    workdir: Path
    extra: list[str]
    startup_timeout: float = 120.0
    private: bool = False  # an allow-list of the bootstrap node and the learners: nobody else is answered


def write_allow_list(work: Path, learners: int) -> list[str]:
    """Make (or read) the bootstrap node's and each learner's identity, and write their peer IDs to
    ``work/allowed-peers.txt``; the CLI arguments that make a peer use the list."""
    from p2p_diloco.trust.admission import peer_id_of  # hivemind: only for a private swarm

    path = work / "allowed-peers.txt"
    lines = [f"{peer_id_of(work / 'bootstrap.key')}  # bootstrap node"]
    lines += [f"{peer_id_of(work / f'learner-{i}' / 'identity.key')}  # learner-{i}" for i in range(learners)]
    path.write_text("# p2p-diloco swarm --private: the peers that may take part\n" + "\n".join(lines) + "\n")
    return ["--allowed-peers", str(path)]


async def run_swarm(opts: SwarmOptions) -> int:
    """Run the bootstrap node and the learners until every learner exits or a signal comes, stop them all,
    and print the summary. Returns 0 when every learner exited with 0 and wrote a summary, and the summaries
    agree (:func:`lineage_verdict`).
    """
    work = opts.workdir
    work.mkdir(parents=True, exist_ok=True)
    maddrs_file = work / MADDRS_FILE
    maddrs_file.unlink(missing_ok=True)
    for stale in work.glob("summary-*.json"):  # a previous run's results must not pass for this one's
        stale.unlink()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    gate = write_allow_list(work, opts.learners) if opts.private else []
    boot, boot_pump = await spawn_pumped("bootstrap", cli(*bootstrap_args(work), *gate))
    procs, pumps = [boot], [boot_pump]
    try:
        bootstrap_addr = await wait_for_bootstrap(maddrs_file, boot, opts.startup_timeout)
        learners = []
        for i in range(opts.learners):
            args = cli(
                "learner", "--config", opts.config, "--initial-peers", bootstrap_addr,
                "--host-maddrs", LOOPBACK_ANY_PORT, "--shard-index", str(i),
                "--num-shards", str(max(opts.learners, 1)), "--max-outer-steps", str(opts.max_outer_steps),
                "--checkpoint-dir", str(work / f"learner-{i}"), "--summary", str(work / f"summary-{i}.json"),
                *gate, *opts.extra,
            )
            proc, pump = await spawn_pumped(f"learner-{i}", args)
            learners.append(proc)
            procs.append(proc)
            pumps.append(pump)
        waiter = asyncio.ensure_future(asyncio.gather(*(p.wait() for p in learners)))
        stopper = asyncio.ensure_future(stop.wait())
        # A list of futures of different result types: typeshed's wait() wants one type.
        await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
        stopper.cancel()
        if stop.is_set():
            print("swarm: stopping all processes", flush=True)
    finally:
        await stop_all(procs)
        await asyncio.gather(*pumps, return_exceptions=True)

    return _report(work, opts.learners, [p.returncode for p in procs[1:]])

Name = TypeVar("Name")


def read_summaries(paths: Mapping[Name, Path]) -> list[tuple[Name, dict]]:
    """(name, summary) for every learner that wrote its JSON summary."""
    return [(name, json.loads(path.read_text())) for name, path in paths.items() if path.exists()]


def print_summary_table(title: str, rows: Sequence[tuple[object, dict]]) -> None:
    """One line per learner."""
    print(f"\n{title}")
    print(f"{'learner':>8} {'version':>8} {'rounds':>7} {'tokens':>10} {'eval first':>11} {'eval last':>10}  sha256")
    for name, s in rows:
        print(f"{name!s:>8} {s['version']:>8} {s['outer_steps']:>7} {s['tokens']:>10} "
              f"{s['first_eval_loss']:>11.4f} {s['last_eval_loss']:>10.4f}  {s['global_state_sha256'][:16]}")


def fragment_states(summaries: list[dict]) -> dict[tuple[int, int], set[str]]:
    """(fragment, version) -> the distinct hashes the learners holding that version have of it."""
    out: dict[tuple[int, int], set[str]] = {}
    for s in summaries:
        for f, (v, sha) in enumerate(zip(s["versions"], s["fragment_sha256"], strict=True)):
            out.setdefault((f, v), set()).add(sha)
    return out


def lineage_verdict(summaries: list[dict], who: str) -> tuple[bool, str]:
    """Whether learners holding the same version of a fragment hold the same bytes of it, as one line.

    Learners stopped by ``--max-outer-steps`` usually end with identical versions, and then the whole
    global state must be identical. Learners stopped by ``run.stop_at_eval_loss`` stop at the first
    version whose global model reaches the target, which can differ by a round or two between
    them; then each fragment version must still have one state.
    """
    if not summaries:
        return False, "no learner wrote a summary"
    split = [f"fragment {f} version {v} ({len(h)} states)"
             for (f, v), h in sorted(fragment_states(summaries).items()) if len(h) > 1]
    if split:
        return False, "learners ended with distinct global states at " + ", ".join(split)
    if len({s["global_state_sha256"] for s in summaries}) == 1:
        return True, f"all {who} hold the same global state"
    versions = sorted({s["version"] for s in summaries})
    return True, (f"all {who} hold one state per fragment version (they stopped at versions "
                  f"{', '.join(map(str, versions))})")


def _report(work: Path, n: int, codes: list[int | None]) -> int:
    rows = read_summaries({i: work / f"summary-{i}.json" for i in range(n)})
    print_summary_table("swarm summary", rows)
    consistent, verdict = lineage_verdict([s for _, s in rows], f"{n} learners")
    ok = len(rows) == n and consistent and all(c == 0 for c in codes)
    if ok:
        print(f"{verdict}; eval loss {rows[0][1]['first_eval_loss']:.4f} -> {rows[0][1]['last_eval_loss']:.4f}")
    else:
        print(f"{verdict}; exit codes {codes}")
    return 0 if ok else 1


def main(opts: SwarmOptions) -> int:
    """Run :func:`run_swarm` on uvloop; returns the exit code."""
    return uvloop.run(run_swarm(opts))
