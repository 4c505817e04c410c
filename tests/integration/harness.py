"""A loopback swarm for integration tests: a bootstrap node and learners, none outliving its test.

Starting, watching and stopping the processes is :mod:`p2p_diloco.sim.processes`; this module holds only
the tests' own settings and bookkeeping.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from p2p_diloco.learner.audit import FILENAME
from p2p_diloco.sim.processes import LOOPBACK_ANY_PORT, Proc, cli, start_bootstrap

ROOT = Path(__file__).resolve().parents[2]
SMALL = str(ROOT / "peers" / "small-cpu.toml")

# Fast settings for a 2-core machine: short rounds, short record lifetime, short linger.
FAST = [
    "--set", "inner.steps_per_outer=20",
    "--set", "averaging.matchmaking_time=2.5",
    "--set", "averaging.request_timeout=1.0",
    "--set", "averaging.round_timeout=10.0",
    "--set", "averaging.next_chunk_timeout=5.0",
    "--set", "network.record_ttl=8.0",
    "--set", "run.linger_seconds=40.0",
]
# For the learners that outlive one killed on purpose: the dead learner's last record said "training" and counts
# as a learner behind them for the records' memory (3 minutes), so each would linger the whole linger time
# serving a state nobody fetches (40 s of a 70 s test). The survivors reach the target together; 10 s is spare.
SURVIVOR = ["--set", "run.linger_seconds=10.0"]


class Swarm:
    """A bootstrap node plus learners, each in its own process group (p2pd daemons included)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[Proc] = []
        self.bootstrap: Proc | None = None
        self.bootstrap_addr: str | None = None

    def start_bootstrap(self, timeout: float = 90, extra: Sequence[str] = ()) -> str:
        """Start the bootstrap node (``self.bootstrap``, with ``extra`` CLI arguments) and return its address."""
        self.bootstrap, self.bootstrap_addr = start_bootstrap(self.tmp, timeout, extra)
        self.procs.append(self.bootstrap)
        return self.bootstrap_addr

    def spawn(self, name: str, args: list[str], append: bool = False) -> Proc:
        """Run ``p2p-diloco ARGS...``, logging to ``tmp/NAME.log`` (after what is there if ``append``);
        killed by :meth:`close`."""
        p = Proc(name, cli(*args), self.tmp / f"{name}.log", append=append)
        self.procs.append(p)
        return p

    def start_learner(self, i: int, max_outer_steps: int, extra: Sequence[str] = (), peers: str | None = None,
                      append: bool = False) -> Proc:
        """Learner ``i`` on shard ``i`` of 4 with the fast settings, joining ``peers`` (default: our bootstrap);
        ``append``: its log goes on after an earlier learner ``i``'s (a restart)."""
        args = [
            "learner", "--config", SMALL, "--initial-peers", peers or self.bootstrap_addr,
            "--host-maddrs", LOOPBACK_ANY_PORT, "--shard-index", str(i), "--num-shards", "4",
            "--max-outer-steps", str(max_outer_steps), "--checkpoint-dir", str(self.tmp / f"ckpt-{i}"),
            "--summary", str(self.summary_path(i)), *FAST, *extra,
        ]
        return self.spawn(f"learner-{i}", args, append)

    def summary_path(self, i: int) -> Path:
        return self.tmp / f"summary-{i}.json"

    def summary(self, i: int) -> dict:
        return json.loads(self.summary_path(i).read_text())

    def close(self) -> None:
        """SIGKILL every process group this swarm started."""
        for p in self.procs:
            p.kill_group()

    def describe(self) -> str:
        """The last lines of every process's log, for a failed test's report."""
        return "\n".join(f"----- {p.name} (rc={p.popen.poll()}) -----\n{p.text()[-3000:]}" for p in self.procs)


def audit_events(proc: Proc, *events: str) -> list[dict]:
    """The events of ``proc``'s audit log so far (``audit.jsonl`` in its ``--checkpoint-dir``), those named in
    ``events`` only if any are; a line still being written is skipped."""
    argv = list(proc.popen.args)
    path = Path(argv[argv.index("--checkpoint-dir") + 1]) / FILENAME
    if not path.exists():
        return []
    found = []
    for raw in path.read_bytes().splitlines():
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if not events or entry.get("event") in events:
            found.append(entry)
    return found


def committed_version(proc: Proc) -> int:
    """The version the last round ``proc`` committed produced (0 before the first), from its audit log."""
    return max((e["version_after"] for e in audit_events(proc, "committed")), default=0)


def eval_losses(proc: Proc, from_version: int = 0) -> list[float]:
    """The eval losses at the end of ``proc``'s outer steps at ``from_version`` or later, from its audit log.

    Right after a learner adopts a newer state it missed (it started late, say), its model is the new
    state plus its own steps since the last merge (docs/design.md, "rebase, never discard"); early in
    training that double step can read above 10 for one outer step, whatever a fault did later.
    """
    return [e["eval_loss"] for e in audit_events(proc, "outer_step")
            if e["eval_loss"] is not None and e["version"] >= from_version]
