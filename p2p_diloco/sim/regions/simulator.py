"""``p2p-diloco regions``: the multi-region swarm of a topology file, in network namespaces.

Every learner and the bootstrap node run as real ``p2p-diloco`` processes, each in its own network
namespace with its own address, as on separate machines: they listen on and announce that address,
and find each other only through the DHT (the bootstrap node's multiaddr is the one thing they are
given). Regions talk over shaped WAN links (see :mod:`.netns`).

The supervisor is an asyncio program on uvloop, like ``p2p-diloco swarm``: it prefixes and forwards
each process's output; on Ctrl+C or SIGTERM it stops every process and removes every namespace.
If the supervisor itself dies, its children get SIGTERM (PR_SET_PDEATHSIG) and a detached reaper
(:mod:`.reaper`) removes what is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import uvloop

from p2p_diloco.config import ConfigError
from p2p_diloco.sim.local_swarm import lineage_verdict, print_summary_table, read_summaries
from p2p_diloco.sim.processes import (
    MADDRS_FILE,
    STOP_GRACE,
    StopRequested,
    bootstrap_args,
    cli,
    spawn_pumped,
    stop_all,
    wait_for_bootstrap,
)
from p2p_diloco.sim.regions import netns
from p2p_diloco.sim.regions.netns import Fabric, Host
from p2p_diloco.sim.regions.topology import Topology


@dataclass
class RegionsOptions:
    """What ``p2p-diloco regions`` runs: the topology, the learners' config file, the target version, the
    work directory and ``extra`` CLI arguments for every learner.
    """
    topology: Topology
    learner_config: Path
    max_outer_steps: int
    workdir: Path
    extra: list[str] = field(default_factory=list)  # ["--set", "inner.lr=1e-3", ...] for every learner
    startup_timeout: float = 120.0
    stop_grace: float = STOP_GRACE


def _in_ns(host: Host, args: list[str]) -> list[str]:
    return ["ip", "netns", "exec", host.ns, *cli(*args)]


class Supervisor:
    """The processes of one run: started in their namespaces, stopped together."""

    def __init__(self) -> None:
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.pumps: list[asyncio.Task] = []

    async def spawn(self, host: Host, args: list[str]) -> asyncio.subprocess.Process:
        """Start ``p2p-diloco ARGS`` in ``host``'s namespace, its output forwarded under the host's name."""
        proc, pump = await spawn_pumped(host.name, _in_ns(host, args))
        self.procs[host.name] = proc
        self.pumps.append(pump)
        return proc

    async def stop_all(self, grace: float) -> None:
        """SIGTERM every process, SIGKILL those left after ``grace`` seconds, then let their output drain."""
        await stop_all(list(self.procs.values()), grace)
        await asyncio.gather(*self.pumps, return_exceptions=True)


class RegionsError(ConfigError):
    """The bootstrap node could not start; printed as one line by the CLI (exit code 2)."""


def _describe(topo: Topology, netem: bool) -> list[str]:
    lines = []
    for r in topo.regions:
        wan = f"WAN {r.bandwidth} each way"
        conditions = [f"delay {r.delay_ms:g} ms"] * (r.delay_ms > 0) + [f"loss {r.loss_pct:g} %"] * (r.loss_pct > 0)
        if conditions:
            wan += ", " + ", ".join(conditions) + ("" if netem else " (not applied: no netem)")
        boot = f", bootstrap node at {topo.bootstrap_addr}" if r.name == topo.bootstrap_region else ""
        nat = f", behind NAT (seen outside as {topo.backbone_addr(r.name)})" if r.nat else ""
        lines.append(f"regions: {r.name:<8} {r.subnet}  {r.learners} learners  {wan}{boot}{nat}")
    return lines


def _learner_args(opts: RegionsOptions, host: Host, slot: int, bootstrap_addr: str) -> list[str]:
    topo, work = opts.topology, opts.workdir
    maddr = f"/ip4/{host.addr}/tcp/{topo.learner_port}"
    return [
        "learner", "--config", str(opts.learner_config), "--run-id", topo.run_id,
        "--initial-peers", bootstrap_addr, "--host-maddrs", maddr, "--announce-maddrs", maddr,
        "--shard-index", str(topo.shard_index(host.region, slot)), "--num-shards", str(topo.num_shards),
        "--max-outer-steps", str(opts.max_outer_steps), "--checkpoint-dir", str(work / "checkpoints" / host.name),
        "--summary", str(work / f"summary-{host.name}.json"), *opts.extra,
    ]


def _prepare(topo: Topology) -> tuple[bool, str | None]:
    """Check for the firewall command NAT'd regions need, remove what a crashed run left, say what will be
    simulated; returns whether netem exists here and the firewall command (None without NAT'd regions).
    """
    firewall = netns.nat_tool() if any(r.nat for r in topo.regions) else None
    stale = netns.cleanup_stale()
    if stale:
        print(f"regions: removed {len(stale)} namespaces left by a crashed run", flush=True)
    netem = netns.netem_supported()
    if topo.netem_needed and not netem:
        print("regions: this kernel has no netem qdisc: delay and loss are NOT applied; "
              "shaping bandwidth only (tbf)", flush=True)
    for line in _describe(topo, netem):
        print(line, flush=True)
    return netem, firewall


async def run_regions(opts: RegionsOptions) -> int:
    """Build the namespaces, run the bootstrap node and learners until they exit or a signal comes, stop
    and remove everything, then report. Returns 0 when every learner exited with 0 and wrote a summary, and
    the summaries agree (:func:`~p2p_diloco.sim.local_swarm.lineage_verdict`).
    """
    topo, work = opts.topology, opts.workdir.resolve()
    opts.workdir = work
    work.mkdir(parents=True, exist_ok=True)
    for old in [*work.glob("summary-*.json"), work / "regions-summary.json", work / MADDRS_FILE]:
        old.unlink(missing_ok=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    netem, firewall = _prepare(topo)

    prefix = netns.run_prefix()
    reaper_log = (work / "reaper.log").open("ab")
    reaper = subprocess.Popen([sys.executable, "-m", "p2p_diloco.sim.regions.reaper", str(os.getpid()), prefix],
                              stdin=subprocess.DEVNULL, stdout=reaper_log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    fabric, sup = Fabric(topo, prefix, netem, firewall), Supervisor()
    learners: dict[str, asyncio.subprocess.Process] = {}
    links: dict[str, dict[str, int]] = {}
    try:
        hosts = await loop.run_in_executor(None, fabric.build)
        print(f"regions: {len(hosts)} hosts in namespaces {prefix}*; inter-region traffic via "
              f"{len(topo.regions)} shaped WAN links", flush=True)
        boot_host, learner_hosts = hosts[0], hosts[1:]
        boot_maddr = f"/ip4/{boot_host.addr}/tcp/{topo.bootstrap_port}"
        boot = await sup.spawn(boot_host, bootstrap_args(work, boot_maddr, announce=True))
        bootstrap_addr = await wait_for_bootstrap(work / MADDRS_FILE, boot, opts.startup_timeout, stop,
                                                  error=RegionsError)
        for host in learner_hosts:
            slot = int(host.name.rsplit("-", 1)[1])
            learners[host.name] = await sup.spawn(host, _learner_args(opts, host, slot, bootstrap_addr))
        waiter = asyncio.ensure_future(asyncio.gather(*(p.wait() for p in learners.values())))
        stopper = asyncio.ensure_future(stop.wait())
        # A list of futures of different result types: typeshed's wait() wants one type.
        await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
        stopper.cancel()
        if stop.is_set():
            print("regions: stopping all processes", flush=True)
    except StopRequested:
        print("regions: stopping all processes", flush=True)
    finally:
        await sup.stop_all(opts.stop_grace)
        links = fabric.link_bytes() if fabric.hosts else {}
        removed = await loop.run_in_executor(None, fabric.teardown)
        reaper.terminate()
        reaper.wait()
        reaper_log.close()
        print(f"regions: removed {len(removed)} namespaces; nothing is left running", flush=True)

    return _report(opts, learners, links, netem)


def _report(opts: RegionsOptions, learners: dict[str, asyncio.subprocess.Process],
            links: dict[str, dict[str, int]], netem: bool) -> int:
    work = opts.workdir
    rows = read_summaries({name: work / f"summary-{name}.json" for name in learners})
    print_summary_table("regions summary", rows)
    for region, b in links.items():
        print(f"WAN link {region}: {b['up'] / 1e6:.2f} MB out of the region, {b['down'] / 1e6:.2f} MB into it")
    codes = {name: p.returncode for name, p in learners.items()}
    regions = {name.rsplit("-", 1)[0] for name, _ in rows}
    consistent, verdict = lineage_verdict([s for _, s in rows], f"{len(rows)} learners in {len(regions)} regions")
    ok = bool(learners) and len(rows) == len(learners) and consistent and all(c == 0 for c in codes.values())
    if ok:
        print(f"{verdict}; eval loss {rows[0][1]['first_eval_loss']:.4f} -> {rows[0][1]['last_eval_loss']:.4f}")
    else:
        print(f"{verdict}; exit codes {codes}")
    (work / "regions-summary.json").write_text(json.dumps({
        "ok": ok, "netem": netem, "links": links, "exit_codes": codes,
        "learners": {name: s for name, s in rows},
    }, indent=2))
    return 0 if ok else 1


def main(opts: RegionsOptions) -> int:
    """Run :func:`run_regions` on uvloop; returns the exit code."""
    return uvloop.run(run_regions(opts))
