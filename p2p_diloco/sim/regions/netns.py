"""Network namespaces, bridges, veth links and ``tc`` shaping for a simulated multi-region swarm.

Layout built by :class:`Fabric` for a topology (every box is a network namespace)::

    host ns (one per learner / the bootstrap node)      eth0 = an address of its region's subnet
        └─veth─ gateway ns of the region: bridge br0 (.2 of the subnet), IP forwarding on
                    └─ wan0 ══ shaped veth ══ gw-<region> on the backbone ns's bridge br0 (all gateways)

A region with ``nat = true`` is behind NAT: its gateway rewrites the source of every connection
leaving the region to the gateway's backbone address and drops every new connection arriving from
the backbone (``iptables``, or ``nft`` where iptables is missing; see :func:`nat_commands`), and no
other gateway has a route to its subnet. Its hosts can dial out; nobody outside can dial them.

Intra-region traffic stays on the region's bridge, unshaped. Traffic between regions crosses two
WAN links: the sender region's (``wan0`` egress: its upload) and the receiver region's (the backbone
end's egress: its download). Each end carries ``tbf`` at the region's rate and, where the kernel has
``netem``, the region's delay (and on the upload, its loss). Nothing is created in the root
namespace and no sysctl outside our namespaces is touched.

Crash safety: every namespace name starts with ``p2pdr<supervisor pid>-``. :func:`delete_namespaces`
kills whatever runs inside a namespace (``ip netns pids``) before deleting it, which also removes
its veth ends; :func:`cleanup_stale` does this for every run whose supervisor no longer exists,
and a detached reaper (:mod:`.reaper`) does it for this run if the supervisor is killed.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from functools import cache

from p2p_diloco.config import ConfigError
from p2p_diloco.sim.regions.topology import Region, Topology, rate_bits_per_second

FAMILY = "p2pdr"
_OURS = re.compile(rf"^{FAMILY}(\d+)-")


class NetnsUnavailable(ConfigError):
    """This machine cannot build namespaces (not root, no iproute2); the CLI prints one line, exit 2."""


class NetnsError(ConfigError):
    """A plumbing command failed; one line with the command and the kernel's answer."""


def sh(*args: str, check: bool = True) -> str:
    """Run one command, return its stdout; raise :class:`NetnsError` with its stderr when it fails."""
    r = subprocess.run(args, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise NetnsError(f"`{' '.join(args)}` failed: {' '.join((r.stderr or r.stdout).split())}")
    return r.stdout


def run_prefix(pid: int | None = None) -> str:
    """Prefix of every namespace of the run supervised by ``pid`` (default: this process)."""
    return f"{FAMILY}{os.getpid() if pid is None else pid}-"


def check_available() -> None:
    """Raise :class:`NetnsUnavailable` unless we are root with ``ip`` and ``tc`` and can add a namespace."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("p2p-diloco regions needs root to create network namespaces (try sudo), "
                               "or use docker compose")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(f"p2p-diloco regions needs the `{tool}` command (install iproute2)")
    probe = f"{run_prefix()}probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        raise NetnsUnavailable(f"cannot create a network namespace here: {' '.join(r.stderr.split())}")
    sh("ip", "netns", "del", probe, check=False)


NAT_TOOLS = ("iptables", "nft")


def nat_tool() -> str:
    """The firewall command NAT'd regions are built with: ``iptables`` (either backend), else ``nft``.

    Raises :class:`NetnsUnavailable` (one line, naming the package) when neither is installed.
    """
    for tool in NAT_TOOLS:
        if shutil.which(tool) is not None:
            return tool
    raise NetnsUnavailable("a region with nat = true needs the `iptables` command (install the iptables package; "
                           "`nft` from nftables works too)")


def nat_commands(tool: str, subnet: ipaddress.IPv4Network, wan_dev: str,
                 public: ipaddress.IPv4Address) -> list[list[str]]:
    """Commands (``tool`` and its arguments) that put a gateway's region behind NAT.

    Connections leaving ``subnet`` through ``wan_dev`` get source address ``public`` (the gateway's
    backbone address); from ``wan_dev``, only packets of connections opened from inside pass (into the
    region or to the gateway itself): a new connection from the backbone is dropped without an answer,
    as home routers and cloud NAT gateways do.
    """
    if tool == "iptables":
        ipt = ["iptables", "-w"]
        return [
            [*ipt, "-t", "nat", "-A", "POSTROUTING", "-s", str(subnet), "-o", wan_dev, "-j", "SNAT",
             "--to-source", str(public)],
            *([*ipt, "-A", chain, "-i", wan_dev, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
              for chain in ("FORWARD", "INPUT")),
            *([*ipt, "-A", chain, "-i", wan_dev, "-j", "DROP"] for chain in ("FORWARD", "INPUT")),
        ]
    if tool == "nft":
        table = ["ip", "p2pdnat"]
        cmds = [["nft", "add", "table", *table],
                ["nft", "add", "chain", *table, "outgoing",
                 "{", "type", "nat", "hook", "postrouting", "priority", "100", ";", "}"],
                ["nft", "add", "rule", *table, "outgoing",
                 "oifname", wan_dev, "ip", "saddr", str(subnet), "snat", "to", str(public)]]
        for chain, hook in (("forwarded", "forward"), ("incoming", "input")):
            cmds += [["nft", "add", "chain", *table, chain,
                      "{", "type", "filter", "hook", hook, "priority", "0", ";", "policy", "accept", ";", "}"],
                     ["nft", "add", "rule", *table, chain, "iifname", wan_dev, "ct", "state", "established,related",
                      "accept"],
                     ["nft", "add", "rule", *table, chain, "iifname", wan_dev, "drop"]]
        return cmds
    raise ValueError(f"unknown NAT tool {tool!r}: one of {NAT_TOOLS}")


def gateway_routes(topo: Topology, region: str) -> list[tuple[ipaddress.IPv4Network, ipaddress.IPv4Address]]:
    """``(subnet, via)`` routes of ``region``'s gateway: every other region's subnet via that region's
    backbone address, except regions behind NAT, which nobody outside can address.
    """
    return [(o.subnet, topo.backbone_addr(o.name)) for o in topo.regions if o.name != region and not o.nat]


@cache
def netem_supported() -> bool:
    """Whether this kernel has the ``netem`` qdisc (delay, loss); tried in a scratch namespace."""
    probe = f"{run_prefix()}netem"
    sh("ip", "netns", "add", probe)
    try:
        sh("ip", "-n", probe, "link", "set", "lo", "up")
        r = subprocess.run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                           capture_output=True, text=True)
        return r.returncode == 0
    finally:
        sh("ip", "netns", "del", probe, check=False)


def list_namespaces() -> list[str]:
    """Names of every network namespace on this machine (``ip netns list``)."""
    # Lines look like "name (id: 3)" or just "name".
    return [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespace_pids(ns: str) -> list[int]:
    """Pids of the processes in namespace ``ns``; empty when none (or when ``ip`` cannot tell)."""
    return [int(p) for p in sh("ip", "netns", "pids", ns, check=False).split()]


def kill_namespace_processes(namespaces: list[str], grace: float = 10.0) -> None:
    """SIGTERM every process inside ``namespaces``, SIGKILL those still there after ``grace`` seconds."""
    pids = {p for ns in namespaces for p in namespace_pids(ns)}
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            pids = {p for p in pids if _alive(p) and not _is_zombie(p)}
            time.sleep(0.1)
        if not pids:
            return


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return True


def delete_namespaces(prefix: str, grace: float = 10.0) -> list[str]:
    """Kill the processes in, then delete, every namespace whose name starts with ``prefix``."""
    doomed = [ns for ns in list_namespaces() if ns.startswith(prefix)]
    if doomed:
        kill_namespace_processes(doomed, grace)
    for ns in doomed:
        # Deleting the namespace destroys its interfaces; a veth's peer goes with it.
        sh("ip", "netns", "del", ns, check=False)
    return doomed


def cleanup_stale(grace: float = 5.0) -> list[str]:
    """Remove the namespaces (and their processes) of every run whose supervisor is gone."""
    removed: list[str] = []
    for pid in sorted({int(m.group(1)) for ns in list_namespaces() if (m := _OURS.match(ns))}):
        if not _alive(pid):
            removed += delete_namespaces(run_prefix(pid), grace)
    return removed


def live_runs() -> list[int]:
    """Supervisor pids of runs that still exist (not stale)."""
    return sorted({int(m.group(1)) for ns in list_namespaces() if (m := _OURS.match(ns)) and _alive(int(m.group(1)))})


@dataclass(frozen=True)
class Host:
    """A machine of the simulated swarm: its own namespace and address in its region's subnet."""

    name: str
    region: str
    ns: str
    addr: ipaddress.IPv4Address


def _burst_bytes(rate_bps: int) -> int:
    # At least 10 ms of traffic (tbf needs burst >= rate / HZ) and at least one 64 KiB GSO frame.
    return max(rate_bps // 8 // 100, 65536)


def shape_commands(dev: str, rate: str, delay_ms: float = 0.0, loss_pct: float = 0.0,
                   netem: bool = False, verb: str = "add") -> list[list[str]]:
    """``tc`` argument lists that shape the egress of ``dev``: tbf at ``rate``, under netem when asked.

    With netem the recipe is netem (delay, loss) at the root and tbf as its only child: packets are
    delayed, then leave at the link's rate. The same commands run in the simulator's namespaces
    and in the Docker gateways (``python -m p2p_diloco.sim.regions.shape``). ``verb = "change"`` re-shapes a
    link already shaped the same way (a link slowing down mid-run).
    """
    bps = rate_bits_per_second(rate)
    tbf = ["tbf", "rate", f"{bps}bit", "burst", str(_burst_bytes(bps)), "latency", "100ms"]
    if netem and (delay_ms > 0 or loss_pct > 0):
        em = ["netem", "limit", "100000"]
        if delay_ms > 0:
            em += ["delay", f"{delay_ms:g}ms"]
        if loss_pct > 0:
            em += ["loss", f"{loss_pct:g}%"]
        return [["qdisc", verb, "dev", dev, "root", "handle", "1:", *em],
                ["qdisc", verb, "dev", dev, "parent", "1:1", "handle", "10:", *tbf]]
    return [["qdisc", verb, "dev", dev, "root", "handle", "1:", *tbf]]


def shape(ns: str | None, dev: str, rate: str, delay_ms: float = 0.0, loss_pct: float = 0.0,
          netem: bool = False) -> None:
    """Shape the egress of ``dev`` in namespace ``ns`` (None: the current one); see :func:`shape_commands`."""
    where = ["-n", ns] if ns else []
    for cmd in shape_commands(dev, rate, delay_ms, loss_pct, netem):
        sh("tc", *where, *cmd)


def qdisc_bytes(ns: str, dev: str) -> int:
    """Bytes sent through the root qdisc of ``dev`` (its egress), 0 if it cannot be read."""
    try:
        rows = json.loads(sh("tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev) or "[]")
    except (NetnsError, json.JSONDecodeError):
        return 0
    return next((int(q.get("bytes", 0)) for q in rows if q.get("root")), 0)


class Fabric:
    """The namespaces and links of one run; :meth:`teardown` removes all of them (idempotent)."""

    def __init__(self, topo: Topology, prefix: str, netem: bool, firewall: str | None = None):
        self.topo, self.prefix, self.netem = topo, prefix, netem
        # The command NAT'd regions' gateways are built with; found (or refused) before anything is built.
        if firewall is None and any(r.nat for r in topo.regions):
            firewall = nat_tool()
        self.firewall = firewall
        self.backbone_ns = f"{prefix}wan"
        self.hosts: list[Host] = []

    def gateway_ns(self, region: str) -> str:
        """Name of ``region``'s gateway namespace."""
        return f"{self.prefix}gw-{region}"

    @staticmethod
    def backbone_port(region: str) -> str:
        """The backbone end of a region's WAN link (``ip -n <prefix>wan link set gw-ap down`` cuts ap off)."""
        return f"gw-{region}"

    def _add_ns(self, ns: str) -> None:
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")

    def build(self) -> list[Host]:
        """Create the backbone, one gateway per region, and one namespace per host; return the hosts."""
        topo = self.topo
        self._add_ns(self.backbone_ns)
        sh("ip", "-n", self.backbone_ns, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.backbone_ns, "link", "set", "br0", "up")
        for region in topo.regions:
            self._add_region(region)
        for region in topo.regions:
            for subnet, via in gateway_routes(topo, region.name):
                sh("ip", "-n", self.gateway_ns(region.name), "route", "add", str(subnet), "via", str(via))
        self.hosts = []
        self._add_host("bootstrap", topo.region(topo.bootstrap_region), topo.bootstrap_addr, 0)
        for region in topo.regions:
            for i in range(region.learners):
                self._add_host(f"{region.name}-{i}", region, region.learner_addr(i), i + 1)
        return self.hosts

    def _add_region(self, region: Region) -> None:
        topo, gw = self.topo, self.gateway_ns(region.name)
        self._add_ns(gw)
        sh("ip", "-n", gw, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", gw, "addr", "add", f"{region.gateway}/{region.subnet.prefixlen}", "dev", "br0")
        sh("ip", "-n", gw, "link", "set", "br0", "up")
        # The WAN link: wan0 in the gateway, gw-<region> on the backbone bridge. Setting the latter
        # down partitions the region and keeps the gateway's routes (they go only with wan0 itself).
        sh("ip", "-n", gw, "link", "add", "wan0", "type", "veth", "peer", "name", self.backbone_port(region.name),
           "netns", self.backbone_ns)
        sh("ip", "-n", gw, "addr", "add", f"{topo.backbone_addr(region.name)}/{topo.backbone.prefixlen}",
           "dev", "wan0")
        sh("ip", "-n", gw, "link", "set", "wan0", "up")
        sh("ip", "-n", self.backbone_ns, "link", "set", self.backbone_port(region.name), "master", "br0", "up")
        # Forwarding inside the gateway namespace only (each namespace has its own copy of the sysctl).
        sh("ip", "netns", "exec", gw, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        if region.nat:
            assert self.firewall is not None  # set in __init__ when any region is NAT'd
            for cmd in nat_commands(self.firewall, region.subnet, "wan0", topo.backbone_addr(region.name)):
                sh("ip", "netns", "exec", gw, *cmd)
        shape(gw, "wan0", region.bandwidth, region.delay_ms, region.loss_pct, self.netem)   # upload
        shape(self.backbone_ns, self.backbone_port(region.name), region.bandwidth, region.delay_ms, 0.0,
              self.netem)  # download

    def _add_host(self, name: str, region: Region, addr: ipaddress.IPv4Address, slot: int) -> Host:
        host = Host(name, region.name, f"{self.prefix}{name}", addr)
        gw = self.gateway_ns(region.name)
        self._add_ns(host.ns)
        sh("ip", "-n", gw, "link", "add", f"h{slot}", "type", "veth", "peer", "name", "eth0", "netns", host.ns)
        sh("ip", "-n", gw, "link", "set", f"h{slot}", "master", "br0", "up")
        sh("ip", "-n", host.ns, "addr", "add", f"{addr}/{region.subnet.prefixlen}", "dev", "eth0")
        sh("ip", "-n", host.ns, "link", "set", "eth0", "up")
        sh("ip", "-n", host.ns, "route", "add", "default", "via", str(region.gateway))
        self.hosts.append(host)
        return host

    def link_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes each region's WAN link carried: ``{"eu": {"up": ..., "down": ...}}``."""
        return {r.name: {"up": qdisc_bytes(self.gateway_ns(r.name), "wan0"),
                         "down": qdisc_bytes(self.backbone_ns, self.backbone_port(r.name))}
                for r in self.topo.regions}

    def teardown(self, grace: float = 10.0) -> list[str]:
        """Kill the processes in, then delete, every namespace of this run; returns their names."""
        return delete_namespaces(self.prefix, grace)
