"""The topology file, docker-compose.yml and the Docker entrypoint agree; every command parses through the CLI.

No Docker and no root needed: compose commands are parsed with the real argument parser and
validated with the real config loaders; the entrypoint script runs with stand-ins for `ip` and
`p2p-diloco` that record what they were given.
"""

from __future__ import annotations

import ipaddress
import json
import shlex
import tomllib
from pathlib import Path

import pytest

from p2p_diloco.bootstrap import load_bootstrap_config
from p2p_diloco.cli import _learner_overrides, build_parser
from p2p_diloco.config import ConfigError, load_learner_config
from p2p_diloco.sim.regions.compose import render_compose
from p2p_diloco.sim.regions.netns import Host, NetnsUnavailable, gateway_routes, nat_commands, nat_tool, shape_commands
from p2p_diloco.sim.regions.simulator import RegionsOptions, _learner_args
from p2p_diloco.sim.regions.topology import load_topology, rate_bits_per_second

ROOT = Path(__file__).resolve().parents[3]
TOPOLOGY = ROOT / "regions" / "topology.toml"
COMPOSE = ROOT / "docker-compose.yml"


def test_committed_compose_is_generated_from_the_topology(topo):
    expected = render_compose(topo, "regions/topology.toml")
    assert COMPOSE.read_text() == expected, \
        "docker-compose.yml is stale: run `p2p-diloco regions --emit-compose > docker-compose.yml`"


def test_compose_and_topology_agree(topo, compose):
    """Checked field by field from the parsed YAML, not through the generator."""
    assert len(topo.regions) >= 3
    services, networks = compose["services"], compose["networks"]
    assert ipaddress.ip_network(networks["wan"]["ipam"]["config"][0]["subnet"]) == topo.backbone
    for r in topo.regions:
        net = networks[r.name]["ipam"]["config"][0]
        assert ipaddress.ip_network(net["subnet"]) == r.subnet
        # Learners added with --scale take addresses from the range the simulator uses for learners.
        assert r.learner_addr(0) in ipaddress.ip_network(net["ip_range"])
        learners = services[f"learner-{r.name}"]
        assert learners["deploy"]["replicas"] == r.learners
        assert learners["networks"] == [r.name]
        assert learners["cap_add"] == ["NET_ADMIN"]
        assert learners["depends_on"]["bootstrap"]["condition"] == "service_healthy"
        assert learners["environment"]["WAN_GATEWAY"] == str(r.gateway)
        # Through the gateway: the other regions not behind NAT, and the backbone (where NAT'd traffic comes from).
        others = {str(o.subnet) for o in topo.regions if o.name != r.name and not o.nat}
        assert set(learners["environment"]["WAN_ROUTES"].split()) == others | {str(topo.backbone)}
        natted = {str(o.subnet) for o in topo.regions if o.name != r.name and o.nat}
        assert set(learners["environment"].get("WAN_UNREACHABLE", "").split()) == natted
        # Its own checkpoint volume (an anonymous volume per container) and the bootstrap identity, read-only.
        assert "/var/lib/p2p-diloco/checkpoint" in learners["volumes"]
        assert any(v.startswith("bootstrap-identity:") and v.endswith(":ro") for v in learners["volumes"])
        gw = services[f"gw-{r.name}"]
        env, e = gw["environment"], r.name.upper()
        assert env["WAN_BANDWIDTH"] == f"${{{e}_BANDWIDTH:-{r.bandwidth}}}"
        assert float(env["WAN_DELAY_MS"].split(":-")[1].rstrip("}")) == r.delay_ms
        assert float(env["WAN_LOSS_PCT"].split(":-")[1].rstrip("}")) == r.loss_pct
        assert gw["networks"][r.name]["ipv4_address"] == str(r.gateway)
        assert gw["networks"]["wan"]["ipv4_address"] == str(topo.backbone_addr(r.name))
        assert gw["cap_add"] == ["NET_ADMIN"] and gw["sysctls"]["net.ipv4.ip_forward"] == "1"
        routes = dict(x.split("=") for x in env["ROUTES"].split())
        assert routes == {str(o.subnet): str(topo.backbone_addr(o.name))
                          for o in topo.regions if o.name != r.name and not o.nat}
        assert set(env.get("UNREACHABLE", "").split()) == natted
        assert env.get("NAT_SUBNET") == (str(r.subnet) if r.nat else None)
    # The committed topology has a region behind NAT, so the compose swarm exercises it.
    assert any(r.nat for r in topo.regions)
    # Compose v1 (docker-compose 1.29) refuses a top-level name; the project name comes from -p.
    assert set(compose) == {"services", "networks", "volumes"}
    boot = services["bootstrap"]
    assert boot["networks"][topo.bootstrap_region]["ipv4_address"] == str(topo.bootstrap_addr)
    assert any(v.startswith("bootstrap-identity:/") and not v.endswith(":ro") for v in boot["volumes"])
    assert "healthcheck" in boot


def _command(service: dict) -> list[str]:
    cmd = service["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def test_every_compose_command_parses_through_the_cli(topo, compose):
    parser = build_parser()
    checked = 0
    for name, service in compose["services"].items():
        if service.get("entrypoint") == ["/app/docker/gateway.sh"]:
            assert "command" not in service, name
            continue
        args = parser.parse_args(_command(service))
        if args.command == "learner":
            # The overrides the real CLI derives from these flags, applied to the real config file.
            cfg = load_learner_config(ROOT / args.config, _learner_overrides(args))
            assert cfg.data.num_shards == topo.num_shards
            assert cfg.run.max_outer_steps == topo.max_outer_steps
            assert cfg.network.run_id == topo.run_id
            assert service["environment"]["NUM_SHARDS"] == str(topo.num_shards)
        else:
            assert args.command == "bootstrap", name
            cfg = load_bootstrap_config(args.config, {
                "host_maddrs": args.host_maddrs, "announce_maddrs": args.announce_maddrs,
                "identity_path": args.identity_path, "maddrs_file": args.maddrs_file})
            assert cfg.announce_maddrs == [f"/ip4/{topo.bootstrap_addr}/tcp/{topo.bootstrap_port}"]
        checked += 1
    assert checked == len(topo.regions) + 1


def test_simulator_learner_commands_parse_through_the_cli(tmp_path, topo):
    opts = RegionsOptions(topo, ROOT / topo.learner_config, 3, tmp_path, ["--set", "inner.steps_per_outer=20"])
    parser = build_parser()
    seen = set()
    for r in topo.regions:
        for i in range(r.learners):
            host = Host(f"{r.name}-{i}", r.name, f"p2pdr1-{r.name}-{i}", r.learner_addr(i))
            args = parser.parse_args(_learner_args(opts, host, i, "/ip4/10.77.1.10/tcp/31337/p2p/QmX"))
            cfg = load_learner_config(args.config, _learner_overrides(args))
            assert cfg.network.announce_maddrs == [f"/ip4/{r.learner_addr(i)}/tcp/{topo.learner_port}"]
            assert cfg.inner.steps_per_outer == 20
            seen.add(cfg.data.shard_index)
    assert len(seen) == sum(r.learners for r in topo.regions), "every learner has its own shard"


@pytest.mark.parametrize("edit, needle", [
    ({"bootstrap_region": "mars"}, "bootstrap_region"),
    ({"regions.1.subnet": "10.77.0.0/16"}, "overlap"),
    ({"regions.0.bandwidth": "fast"}, "20mbit"),
    ({"regions.0.name": "Europe-West"}, "regions.0.name"),
    ({"regions.0.learners": 9}, "num_shards"),
    ({"regions.0.nat": True}, "bootstrap_region 'eu' has nat = true"),
    ({"regions.0.learners": 0, "regions.1.nat": True, "regions.2.nat": True},
     "every learner is in a region with nat = true"),
])
def test_bad_topology_is_a_one_line_error(tmp_path, edit, needle):
    data = tomllib.loads(TOPOLOGY.read_text())
    for key, value in edit.items():
        node = data
        *path, last = key.split(".")
        for p in path:
            node = node[int(p)] if p.isdigit() else node[p]
        node[last] = value
    path = tmp_path / "t.toml"
    path.write_text(_to_toml(data))
    with pytest.raises(ConfigError) as e:
        load_topology(path)
    assert needle in str(e.value) and "\n" not in str(e.value)


def _to_toml(data: dict) -> str:
    def val(v):
        return json.dumps(v) if not isinstance(v, bool) else str(v).lower()
    lines = [f"{k} = {val(v)}" for k, v in data.items() if k != "regions"]
    for r in data["regions"]:
        lines += ["[[regions]]", *(f"{k} = {val(v)}" for k, v in r.items())]
    return "\n".join(lines) + "\n"


def test_shaping_recipe():
    assert rate_bits_per_second("20mbit") == 20_000_000
    (tbf,) = shape_commands("wan0", "20mbit")
    assert tbf[:6] == ["qdisc", "add", "dev", "wan0", "root", "handle"] and "tbf" in tbf
    netem, child = shape_commands("wan0", "20mbit", delay_ms=40, loss_pct=0.5, netem=True)
    assert netem[netem.index("netem"):] == ["netem", "limit", "100000", "delay", "40ms", "loss", "0.5%"]
    assert child[child.index("parent") + 1] == "1:1" and "tbf" in child


def test_no_gateway_routes_into_a_nat_region(tmp_path):
    data = tomllib.loads(TOPOLOGY.read_text())
    data["regions"][1]["nat"] = True  # us
    path = tmp_path / "t.toml"
    path.write_text(_to_toml(data))
    topo = load_topology(path)
    us = topo.region("us").subnet
    for r in ("eu", "ap"):
        routes = dict(gateway_routes(topo, r))
        assert us not in routes and len(routes) == 1, (r, routes)
    # The NAT'd region itself reaches everyone, via their gateways' backbone addresses.
    assert dict(gateway_routes(topo, "us")) == {topo.region(o).subnet: topo.backbone_addr(o) for o in ("eu", "ap")}


@pytest.mark.parametrize("installed, expected", [(["nft"], "nft"), (["iptables", "nft"], "iptables"), ([], None)])
def test_nat_tool_prefers_iptables_and_names_the_package_when_neither_exists(tmp_path, monkeypatch, installed,
                                                                             expected):
    for name in installed:
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    if expected is not None:
        assert nat_tool() == expected
    else:
        with pytest.raises(NetnsUnavailable) as e:
            nat_tool()
        assert "install the iptables package" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("tool", ["iptables", "nft"])
def test_nat_recipe_translates_to_the_gateway_backbone_address_and_drops_new_inbound(tool):
    subnet, public = ipaddress.IPv4Network("10.77.2.0/24"), ipaddress.IPv4Address("10.77.0.11")
    cmds = [" ".join(c) for c in nat_commands(tool, subnet, "wan0", public)]
    assert all(c.startswith(tool) for c in cmds)
    snat = [c for c in cmds if "snat" in c.lower()]
    assert len(snat) == 1 and "10.77.2.0/24" in snat[0] and snat[0].endswith("10.77.0.11")
    # Both the forward path (into the region) and the gateway's own input: established first, then drop.
    for hook in (("FORWARD", "INPUT") if tool == "iptables" else ("forwarded", "incoming")):
        rules = [c for c in cmds if f" {hook} " in c and "wan0" in c]
        assert len(rules) == 2, (hook, cmds)
        assert "established" in rules[0].lower() and rules[1].lower().endswith("drop")
    with pytest.raises(ValueError):
        nat_commands("pf", subnet, "wan0", public)
