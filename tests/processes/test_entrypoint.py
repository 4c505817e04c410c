"""docker/entrypoint.sh, run for real with fake `ip` and `p2p-diloco` on its PATH: the address, slot and
bootstrap it adds to a service's command, and the routes it sets (the compose file's own checks are
in tests/unit/sim/test_regions.py)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from p2p_diloco.cli import _learner_overrides, build_parser
from p2p_diloco.config import load_learner_config
from p2p_diloco.sim.processes import wait_until
from tests.unit.sim.test_regions import ROOT, _command


def _fake_tools(tmp: Path, record: Path) -> dict[str, str]:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "ip").write_text(textwrap.dedent("""\
        #!/bin/sh
        case "$*" in
          *"addr show"*) echo "7: eth0    inet 10.77.2.131/24 brd 10.77.2.255 scope global eth0";;
          *) echo "ip $*" >> "$IP_LOG";;
        esac
        """))
    # Records its argv as one JSON line, then stays alive while FAKE_HOLD exists (holding the slot lock).
    (bin_dir / "p2p-diloco").write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, os, sys, time
        with open({str(record)!r}, "a") as f:
            f.write(json.dumps(sys.argv[1:]) + "\\n")
        while os.path.exists(os.environ.get("FAKE_HOLD", "/nonexistent")):
            time.sleep(0.05)
        """))
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "IP_LOG": str(tmp / "ip.log")}


@pytest.mark.skipif(shutil.which("flock") is None or shutil.which("sh") is None, reason="needs sh and flock")
def test_entrypoint_adds_address_slot_and_bootstrap_and_the_result_parses(tmp_path, topo, compose):
    service = compose["services"]["learner-us"]
    record, hold = tmp_path / "argv.jsonl", tmp_path / "hold"
    boot_dir = tmp_path / "boot"
    boot_dir.mkdir()
    boot_addr = f"/ip4/{topo.bootstrap_addr}/tcp/{topo.bootstrap_port}/p2p/QmBootstrap"
    (boot_dir / "maddrs.txt").write_text(f"/ip4/127.0.0.1/tcp/31337/p2p/QmBootstrap\n{boot_addr}\n")
    env = {**os.environ, **{k: str(v) for k, v in service["environment"].items()},
           **_fake_tools(tmp_path, record), "BOOTSTRAP_MADDRS_FILE": str(boot_dir / "maddrs.txt"),
           "SLOTS_DIR": str(tmp_path / "slots"), "FAKE_HOLD": str(hold)}
    entry = [str(ROOT / "docker" / "entrypoint.sh"), *_command(service)]
    hold.touch()
    # Two replicas of the region at once (docker compose up --scale): distinct slots, distinct shards.
    first = subprocess.Popen(entry, env=env, stdout=subprocess.PIPE, text=True)
    wait_until(lambda: record.exists() and record.read_text(), 20, what="the first replica's command", poll=0.05)
    second = subprocess.Popen(entry, env=env, stdout=subprocess.PIPE, text=True)
    wait_until(lambda: len(record.read_text().splitlines()) >= 2, 20, what="the second replica's command", poll=0.05)
    hold.unlink()
    assert first.wait(20) == 0 and second.wait(20) == 0
    argvs = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(argvs) == 2
    parser = build_parser()
    shards = []
    for argv in argvs:
        args = parser.parse_args(argv)
        assert args.command == "learner"
        assert args.initial_peers == [boot_addr]
        assert args.announce_maddrs == [f"/ip4/10.77.2.131/tcp/{topo.learner_port}"]
        assert args.host_maddrs == [f"/ip4/0.0.0.0/tcp/{topo.learner_port}"]
        cfg = load_learner_config(ROOT / args.config, _learner_overrides(args))
        shards.append(cfg.data.shard_index)
    assert sorted(shards) == [topo.shard_index("us", 0), topo.shard_index("us", 1)]
    routes = (tmp_path / "ip.log").read_text().splitlines()
    assert f"ip route replace 10.77.1.0/24 via {topo.region('us').gateway}" in routes
    assert f"ip route replace {topo.backbone} via {topo.region('us').gateway}" in routes


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs sh")
def test_entrypoint_marks_a_nat_region_unreachable(tmp_path, topo, compose):
    nat = next(r for r in topo.regions if r.nat)
    boot_env = compose["services"]["bootstrap"]["environment"]  # the bootstrap region is never behind NAT
    assert boot_env["WAN_UNREACHABLE"] == str(nat.subnet)
    env = {**os.environ, **_fake_tools(tmp_path, tmp_path / "argv.jsonl"), **{k: str(v) for k, v in boot_env.items()}}
    r = subprocess.run([str(ROOT / "docker" / "entrypoint.sh"), "bootstrap", "--help"], env=env, timeout=20)
    assert r.returncode == 0
    routes = (tmp_path / "ip.log").read_text().splitlines()
    assert f"ip route replace unreachable {nat.subnet}" in routes
    assert not any(str(nat.subnet) in line and " via " in line for line in routes)
