"""``docker-compose.yml`` for a topology: the same regions, subnets, learners and WAN links in Docker.

``p2p-diloco regions --emit-compose > docker-compose.yml`` writes it; a test checks that the
committed file equals what the committed ``regions/topology.toml`` generates.

Per region: a network with the region's subnet (learners get addresses from its upper half,
``ip_range``), a gateway container ``gw-<region>`` on that network (``.2``) and on the ``wan``
backbone network that shapes both directions of the region's WAN link with ``tc`` (netem + tbf,
from ``<REGION>_BANDWIDTH``, ``<REGION>_DELAY_MS``, ``<REGION>_LOSS_PCT``), and a learner service
``learner-<region>`` whose replicas are the region's learners (``--scale learner-eu=4`` adds more).
Containers route the other regions' subnets and the backbone through their region's gateway. The
bootstrap node keeps its identity on a volume, so its multiaddr (``.10`` of its region, fixed port)
is stable; learners read it from that volume, read-only, once the bootstrap node is healthy.

A region with ``nat = true`` is behind NAT: its gateway translates the region's outgoing traffic to
its own backbone address and drops new connections coming in from the backbone (nftables). Nobody
else routes to its subnet: the other regions' containers and gateways mark it unreachable, which
also keeps their packets from taking the Docker host's bridges around the gateways.

The file works with Compose v2 (``docker compose``) and v1 (``docker-compose`` 1.29): it has no
top-level ``name``, which v1 refuses; the project name comes from ``-p`` or ``COMPOSE_PROJECT_NAME``.
"""

from __future__ import annotations

from typing import Any

import yaml

from p2p_diloco.sim.regions.topology import Region, Topology

PROJECT = "p2p-diloco-regions"
IMAGE = "p2p-diloco:latest"
STATE = "/var/lib/p2p-diloco"
BOOT_DIR = f"{STATE}/bootstrap"
SLOTS_DIR = f"{STATE}/slots"
CKPT_DIR = f"{STATE}/checkpoint"


class _Flow(list):
    """A list written on one line (commands, health checks)."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Flow, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


def env_prefix(region: Region) -> str:
    """The region's name in upper case: the prefix of its ``<REGION>_BANDWIDTH``-style variables."""
    return region.name.upper()


def _routes_to_others(topo: Topology, region: Region) -> str:
    """Subnets a container routes through its gateway: the other regions not behind NAT, and the
    backbone (a NAT'd region's connections arrive from its gateway's backbone address)."""
    others = [str(r.subnet) for r in topo.regions if r.name != region.name and not r.nat]
    return " ".join([*others, str(topo.backbone)])


def _unreachable(topo: Topology, region: Region) -> str:
    """The other regions' subnets behind NAT: routed nowhere (``ip route ... unreachable``)."""
    return " ".join(str(r.subnet) for r in topo.regions if r.name != region.name and r.nat)


def _region_env(topo: Topology, r: Region) -> dict[str, str]:
    env = {"REGION": r.name, "WAN_GATEWAY": str(r.gateway), "WAN_ROUTES": _routes_to_others(topo, r)}
    if _unreachable(topo, r):
        env["WAN_UNREACHABLE"] = _unreachable(topo, r)
    return env


def _gateway(topo: Topology, r: Region) -> dict[str, Any]:
    e = env_prefix(r)
    return {
        "image": IMAGE,
        "build": ".",
        "entrypoint": _Flow(["/app/docker/gateway.sh"]),
        "cap_add": _Flow(["NET_ADMIN"]),
        "sysctls": {"net.ipv4.ip_forward": "1"},
        "environment": {
            "REGION": r.name,
            "WAN_BANDWIDTH": f"${{{e}_BANDWIDTH:-{r.bandwidth}}}",
            "WAN_DELAY_MS": f"${{{e}_DELAY_MS:-{r.delay_ms:g}}}",
            "WAN_LOSS_PCT": f"${{{e}_LOSS_PCT:-{r.loss_pct:g}}}",
            "GATEWAY_ADDR": str(r.gateway),
            "BACKBONE_ADDR": str(topo.backbone_addr(r.name)),
            # Other regions' subnets and the backbone address of the gateway that leads to each,
            # except regions behind NAT: nobody outside can address those.
            "ROUTES": " ".join(f"{o.subnet}={topo.backbone_addr(o.name)}"
                               for o in topo.regions if o.name != r.name and not o.nat),
            **({"UNREACHABLE": _unreachable(topo, r)} if _unreachable(topo, r) else {}),
            # Behind NAT: outgoing traffic from this subnet leaves with BACKBONE_ADDR; no new connection comes in.
            **({"NAT_SUBNET": str(r.subnet)} if r.nat else {}),
        },
        "networks": {r.name: {"ipv4_address": str(r.gateway)},
                     "wan": {"ipv4_address": str(topo.backbone_addr(r.name))}},
        "healthcheck": {"test": _Flow(["CMD", "test", "-f", "/tmp/wan-ready"]), "interval": "2s", "retries": 30},
        "restart": "unless-stopped",
    }


def _bootstrap(topo: Topology) -> dict[str, Any]:
    r = topo.region(topo.bootstrap_region)
    port = topo.bootstrap_port
    return {
        "image": IMAGE,
        "build": ".",
        "command": _Flow([
            "bootstrap", "--host-maddrs", f"/ip4/0.0.0.0/tcp/{port}",
            "--announce-maddrs", f"/ip4/{topo.bootstrap_addr}/tcp/{port}",
            "--identity", f"{BOOT_DIR}/identity.key", "--maddrs-file", f"{BOOT_DIR}/maddrs.txt",
        ]),
        "cap_add": _Flow(["NET_ADMIN"]),
        "environment": _region_env(topo, r),
        "networks": {r.name: {"ipv4_address": str(topo.bootstrap_addr)}},
        "volumes": _Flow([f"bootstrap-identity:{BOOT_DIR}"]),
        "depends_on": {f"gw-{r.name}": {"condition": "service_healthy"}},
        "healthcheck": {"test": _Flow(["CMD", "/app/docker/healthcheck.sh", f"{BOOT_DIR}/maddrs.txt", str(port)]),
                        "interval": "2s", "retries": 60, "start_period": "5s"},
        "restart": "unless-stopped",
    }


def _learners(topo: Topology, r: Region) -> dict[str, Any]:
    return {
        "image": IMAGE,
        "build": ".",
        "command": _Flow([
            "learner", "--config", topo.learner_config, "--run-id", topo.run_id,
            "--num-shards", str(topo.num_shards), "--max-outer-steps", str(topo.max_outer_steps),
        ]),
        "deploy": {"replicas": r.learners},
        "cap_add": _Flow(["NET_ADMIN"]),
        "environment": {
            **_region_env(topo, r),
            "BOOTSTRAP_MADDRS_FILE": f"{BOOT_DIR}/maddrs.txt", "LEARNER_PORT": str(topo.learner_port),
            # The n-th learner of the region (a slot claimed with flock on the slots volume)
            # trains on shard (SHARD_BASE + n % SHARD_STRIDE) % NUM_SHARDS.
            "SLOTS_DIR": SLOTS_DIR, "SHARD_BASE": str(topo.shard_base(r.name)),
            "SHARD_STRIDE": str(topo.shard_stride), "NUM_SHARDS": str(topo.num_shards),
        },
        "networks": _Flow([r.name]),
        # The anonymous volume at CKPT_DIR is each learner's own checkpoint volume (one per container).
        "volumes": _Flow([f"bootstrap-identity:{BOOT_DIR}:ro", f"slots-{r.name}:{SLOTS_DIR}", CKPT_DIR]),
        "depends_on": {"bootstrap": {"condition": "service_healthy"},
                       f"gw-{r.name}": {"condition": "service_healthy"}},
        "restart": "on-failure:3",
    }


def compose_dict(topo: Topology) -> dict[str, Any]:
    """The compose document for ``topo``: per region a gateway and a learner service, the bootstrap node,
    the networks and the volumes.
    """
    services: dict[str, Any] = {}
    for r in topo.regions:
        services[f"gw-{r.name}"] = _gateway(topo, r)
    services["bootstrap"] = _bootstrap(topo)
    for r in topo.regions:
        services[f"learner-{r.name}"] = _learners(topo, r)
    networks: dict[str, Any] = {"wan": {"ipam": {"config": [{"subnet": str(topo.backbone)}]}}}
    for r in topo.regions:
        networks[r.name] = {"ipam": {"config": [{"subnet": str(r.subnet), "ip_range": str(r.learner_range)}]}}
    volumes: dict[str, Any] = {"bootstrap-identity": {}, **{f"slots-{r.name}": {} for r in topo.regions}}
    return {"services": services, "networks": networks, "volumes": volumes}


def render_compose(topo: Topology, source: str = "regions/topology.toml") -> str:
    """The text of ``docker-compose.yml`` for ``topo`` (deterministic: same topology, same bytes)."""
    names = ", ".join(f"{r.name} ({r.learners})" for r in topo.regions)
    nat = ", ".join(r.name for r in topo.regions if r.nat)
    header = (
        f"# Generated from {source} by `p2p-diloco regions --emit-compose`; edit that file, not this one.\n"
        f"# Regions (learners): {names}; bootstrap node in {topo.bootstrap_region} at {topo.bootstrap_addr}.\n"
        + (f"# Behind NAT (their learners dial out but cannot be dialled): {nat}.\n" if nat else "")
        + "# Compose v2 (docker compose) or v1 (docker-compose 1.29). No top-level name: (v1 refuses it), so\n"
        f"# the project name comes from -p or COMPOSE_PROJECT_NAME; the README uses {PROJECT}:\n"
        f"#   export COMPOSE_PROJECT_NAME={PROJECT}\n"
        "#   docker compose up --build                      # the whole swarm\n"
        "#   docker compose up -d --scale learner-eu=4      # more learners in a region\n"
        "#   EU_BANDWIDTH=5mbit US_DELAY_MS=120 docker compose up   # other WAN conditions\n"
    )
    body = yaml.dump(compose_dict(topo), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=200)
    return header + body
