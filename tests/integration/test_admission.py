"""Trust at the swarm's door, with real p2pd daemons: private swarms and signed records.

An allow-list keeps outsiders out and members train on. The outsiders are real peers: a learner
started without being on the list, and a hivemind DHT node and averager that call the members' RPCs
directly (DHT find and store, a state download). In a public swarm, progress records are signed
and bound to their owner's peer ID: a forger storing over the wire reaches no reader.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools

import hivemind
import pytest
import torch
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from p2p_diloco.config import AveragingConfig
from p2p_diloco.core.shard_sketches import sketch_key
from p2p_diloco.net.averaging import HivemindAveraging, averaging_prefix, download_priority_key, group_key
from p2p_diloco.net.dht import start_dht
from p2p_diloco.net.progress_records import ProgressBoard, ProgressRecord, progress_key
from p2p_diloco.trust.admission import Admission, peer_id_of
from p2p_diloco.trust.commit_board import commit_key
from p2p_diloco.trust.signed_matchmaking import SignedGroupKeyManager, declared
from p2p_diloco.trust.signed_records import IdentityKey, owner_marker, peer_id_of_owner

from .test_swarm import _assert_one_lineage


@pytest.mark.timeout(300)
def test_outsiders_are_refused_and_members_train_on(swarm):
    tmp = swarm.tmp
    members = [peer_id_of(tmp / "bootstrap.key")] + [peer_id_of(tmp / f"ckpt-{i}" / "identity.key") for i in (0, 1)]
    allow = tmp / "allowed.txt"
    allow.write_text("# the swarm\n" + "\n".join(members) + "\n")
    swarm.start_bootstrap(extra=["--allowed-peers", str(allow)])
    learners = [swarm.start_learner(i, max_outer_steps=3, extra=["--allowed-peers", str(allow)]) for i in (0, 1)]

    # An outsider learner cannot join: nobody answers it, so its DHT bootstrap fails.
    outsider = swarm.start_learner(2, max_outer_steps=3)
    assert outsider.wait(120) != 0, outsider.text()
    outsider_id = peer_id_of(tmp / "ckpt-2" / "identity.key")
    assert "could not start or join the DHT" in outsider.text(), outsider.text()

    for p in learners:
        assert p.wait(240) == 0, p.text()
    _assert_one_lineage(swarm, (0, 1), 3)
    for p in (swarm.bootstrap, *learners):
        refusals = [line for line in p.text().splitlines() if f"refused peer {outsider_id}" in line]
        assert len(refusals) <= 1, refusals  # once per peer and process
    assert f"refused peer {outsider_id}" in swarm.bootstrap.text()


async def _find(target, _dht, node):
    """The outsider asks a member directly for the record (hivemind's DHT protocol; None: no answer)."""
    return await node.protocol.call_find(target, [DHTID.generate("secret")])


async def _store(target, _dht, node):
    """The outsider asks a member directly to store a forged value (None: no answer)."""
    return await node.protocol.call_store(target, [DHTID.generate("secret")], [b"forged"], [get_dht_time() + 60])


@pytest.mark.timeout(150)
def test_an_outsider_cannot_read_write_or_download(tmp_path):
    keys = [tmp_path / f"member-{i}.key" for i in range(2)]
    admission = Admission(frozenset(peer_id_of(k) for k in keys), "test list")
    cfg = AveragingConfig(min_group_size=2, target_group_size=2, matchmaking_time=2.0, request_timeout=1.0,
                          round_timeout=20.0)
    template = [torch.zeros(64, 8)]
    started: list = []
    try:
        first = start_dht(initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                          identity_path=keys[0], startup_timeout=30, admission=admission)
        started.append(first)
        addrs = [str(a) for a in first.get_visible_maddrs()]
        second = start_dht(initial_peers=addrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                           identity_path=keys[1], startup_timeout=30, admission=admission)
        started.append(second)
        assert first.store("secret", b"members only", get_dht_time() + 60)

        # No member answers the outsider's DHT pings: it cannot join through them.
        with pytest.raises(Exception, match="bootstrap failed"):
            started.append(hivemind.DHT(initial_peers=addrs, start=True))
        outsider = hivemind.DHT(initial_peers=addrs, start=True, ensure_bootstrap_success=False)
        started.append(outsider)
        target = first.peer_id
        assert outsider.run_coroutine(functools.partial(_find, target)) is None
        assert outsider.run_coroutine(functools.partial(_store, target)) is None
        assert second.get("secret", latest=True).value == b"members only"

        served = [torch.ones(64, 8), torch.zeros(64, 8)]  # the served layout: parameters, then momentum
        server = HivemindAveraging(first, template, cfg, prefix="private",
                                         state_provider=lambda: ({"v": 1}, served)).start()
        started.append(server)
        member = HivemindAveraging(second, template, cfg, prefix="private").start()
        started.append(member)
        spy = HivemindAveraging(outsider, template, cfg, prefix="private").start()
        started.append(spy)
        assert spy.download_state_from(server.peer_id, timeout=5.0) is None
        loaded = member.download_state_from(server.peer_id, timeout=20.0)
        assert loaded is not None and torch.equal(loaded[1][0], served[0])
    finally:
        for s in reversed(started):
            s.shutdown()


def _signing_peer(tmp_path, name: str, joins, started: list, **kwargs):
    """A learner's DHT (signing records with its identity, owner-marked records only), joined to ``joins``."""
    identity = tmp_path / f"{name}.key"
    peer_id_of(identity)
    started.append(start_dht(initial_peers=[str(a) for a in joins.get_visible_maddrs()] if joins else [],
                             host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[], identity_path=identity,
                             startup_timeout=30, signing=IdentityKey.load(identity), **kwargs))
    return started[-1]


def _signing_members(tmp_path, started: list, **kwargs) -> list:
    """Two learners' DHTs (joined, signing records with their identities, owner-marked records only)."""
    first = _signing_peer(tmp_path, "member-0", None, started, **kwargs)
    return [first, _signing_peer(tmp_path, "member-1", first, started, **kwargs)]


@pytest.mark.timeout(150)
def test_records_are_signed_and_forgeries_never_reach_a_reader(tmp_path):
    """A public swarm: two learners' DHTs with signed records, and a forger storing over the wire."""
    key = progress_key("lin")
    started: list = []
    try:
        members = _signing_members(tmp_path, started)
        boards = [ProgressBoard(m, "lin", 60.0, m.owner) for m in members]
        genuine = ProgressRecord(4, "a" * 64, 100, versions=(4,), shas=("a" * 64,))
        assert boards[0].publish(genuine)

        # The forger signs with its own key (a valid record, in its own name), and also tries every forgery.
        peer_id_of(tmp_path / "forger.key")
        signer = RSASignatureValidator(IdentityKey.load(tmp_path / "forger.key"))
        forger = hivemind.DHT(initial_peers=members[0].get_visible_maddrs(), start=True, record_validators=[signer])
        started.append(forger)
        ahead = ProgressRecord(2**40 - 1, "b" * 64, 1, versions=(2**40 - 1,), shas=("b" * 64,)).encode()
        now = get_dht_time()
        victim_marker = members[0].owner
        forger.store(key, ahead, now + 30, subkey=members[0].peer_id.to_bytes())  # unsigned, old style
        forger.store(key, ahead, now + 30, subkey=victim_marker)  # in the victim's name: no valid signature
        forger.store(key, ahead, now + 10**6, subkey=owner_marker(signer))  # expires far too late
        own = ProgressRecord(3, "c" * 64, 1, versions=(3,), shas=("c" * 64,))
        forger.store(key, own.encode(), now + 30, subkey=owner_marker(signer))  # its own, honest record

        forger_id = str(peer_id_of_owner(owner_marker(signer)))
        for board in boards:
            seen = board.read()
            assert seen[str(members[0].peer_id)] == dataclasses.replace(genuine, wall_time=seen[
                str(members[0].peer_id)].wall_time)
            assert set(seen) == {str(members[0].peer_id), forger_id}, seen
            assert seen[forger_id].version == 3
    finally:
        for s in reversed(started):
            s.shutdown()


@pytest.mark.timeout(150)
def test_matchmaking_and_download_declarations_are_signed(tmp_path):
    """hivemind's matchmaking ("looking for a group here") and download-priority declarations, written by
    two members and a forger over the wire: a reader finds only those their owner signed."""
    lineage = "lin"
    started: list = []
    try:
        members = _signing_members(tmp_path, started)
        managers = [SignedGroupKeyManager(GroupKeyManager(m, averaging_prefix(lineage), "", 4), m.owner)
                    for m in members]
        key = group_key(averaging_prefix(lineage), 0, 7)
        now = get_dht_time()
        for manager in managers:
            assert asyncio.run(manager.declare_averager(key, manager.peer_id, now + 30))

        peer_id_of(tmp_path / "forger.key")
        signer = RSASignatureValidator(IdentityKey.load(tmp_path / "forger.key"))
        forger = hivemind.DHT(initial_peers=members[0].get_visible_maddrs(), start=True, record_validators=[signer])
        started.append(forger)
        ghost = peer_id_of(tmp_path / "ghost.key")  # a peer that never answers
        forger.store(key, True, now + 30, subkey=PeerID.from_base58(ghost).to_bytes())  # hivemind's style
        forger.store(key, True, now + 30, subkey=members[0].owner)  # in a member's name: no valid signature
        forger.store(key, True, now + 30, subkey=owner_marker(signer))  # its own, signed
        forger.store(download_priority_key(lineage), 1e9, now + 30,
                     subkey=PeerID.from_base58(ghost).to_bytes())  # "download from me first", unsigned
        forger.store(download_priority_key(lineage), 1e9, now + 30, subkey=members[1].owner)  # in a member's name
        assert members[0].store(download_priority_key(lineage), 5.0, now + 30, subkey=members[0].owner)

        forger_id = peer_id_of_owner(owner_marker(signer))
        expected = {members[0].peer_id, members[1].peer_id, forger_id}
        for manager in managers:
            found = asyncio.run(manager.get_averagers(key, only_active=True))
            assert {peer for peer, _ in found} == expected, found
        # a member leaves: it overwrites its own declaration, and readers stop seeing it as looking
        assert asyncio.run(managers[1].declare_averager(key, managers[1].peer_id, now + 30, looking_for_group=False))
        assert {p for p, _ in asyncio.run(managers[0].get_averagers(key, only_active=True))} == expected - {
            members[1].peer_id}
        for member in members:
            seen = member.get(download_priority_key(lineage), latest=True)
            assert {p: e.value for p, e in declared(seen.value, member.owner)} == {members[0].peer_id: 5.0}
    finally:
        for s in reversed(started):
            s.shutdown()


@pytest.mark.timeout(150)
def test_a_plain_value_cannot_squat_a_rounds_key(tmp_path):
    """A round's keys are predictable (a commit's, a group's, a reducer sketch's). A peer that stores a plain
    value (no subkey) there, expiring later than the members' entries, made hivemind refuse every member's
    entry under that key, and searches returned the squatter's value: the round could not gather its group,
    sketches or signatures. Every node of the swarm now refuses a record that names no owner."""
    lineage = "lin"
    prefix = averaging_prefix(lineage)
    keys = [commit_key(lineage, 0, 7), group_key(prefix, 0, 7), sketch_key(prefix, "seed-7")]
    started: list = []
    try:
        members = _signing_members(tmp_path, started)
        squatter = hivemind.DHT(initial_peers=members[0].get_visible_maddrs(), start=True)  # validates nothing
        started.append(squatter)
        now = get_dht_time()
        for key in keys:  # within the 1,200 s every node allows
            squatter.store(key, b"squat", now + 1000)
        for key in keys:  # (hivemind reports the last replica's answer: the squatter's refusal, whoever stored)
            for member in members:
                member.store(key, b"mine", now + 60, subkey=member.owner)
        for member in members:
            for key in keys:
                found = member.get(key, latest=True)
                assert found is not None and isinstance(found.value, dict), (key, found)
                assert {peer_id_of_owner(subkey) for subkey in found.value} == {m.peer_id for m in members}

        # A record signed by its owner but of 256 KiB: no member stores it, no search returns it.
        # (A DHT process that reads its requests whole: a bare hivemind DHT can hang on a large one.)
        hoarder = _signing_peer(tmp_path, "hoarder", members[0], started)
        hoarder.store("hoard", b"x" * 2**18, now + 60, subkey=hoarder.owner)
        for member in members:
            assert member.get("hoard", latest=True) is None
    finally:
        for s in reversed(started):
            s.shutdown()


async def _held_by(owner: bytes, _dht, node) -> tuple[int, int]:
    return node.protocol.storage.held_by(owner)


@pytest.mark.timeout(150)
def test_one_identity_cannot_fill_another_nodes_memory(tmp_path):
    """Valid signed records under as many keys as a peer likes filled every node's memory (only each
    record's size was bounded). Now a node keeps at most a budget of live records per owner (16 here, 4,096
    by default) and refuses the rest; the owner's records already there stay, and so do everyone else's."""
    started: list = []
    try:
        members = _signing_members(tmp_path, started, records_per_owner=16)
        hoarder = _signing_peer(tmp_path, "hoarder", members[0], started)
        now = get_dht_time()
        for i in range(40):
            hoarder.store(f"hoard-{i}", b"x" * 1024, now + 60, subkey=hoarder.owner)
        for member in members:
            held, size = member.run_coroutine(functools.partial(_held_by, hoarder.owner))
            assert held == 16 and 16 * 1024 < size < 16 * 2048, (held, size)  # each value and its signature
        assert members[1].get("hoard-0", latest=True) is not None  # the first ones stay
        assert hoarder.store("hoard-0", b"y" * 1024, now + 90, subkey=hoarder.owner)  # and may be refreshed
        assert members[1].get("hoard-0", latest=True).value[hoarder.owner].value == b"y" * 1024
        for i in range(10):  # another owner's records count against its own budget only
            members[0].store(f"mine-{i}", b"m", now + 60, subkey=members[0].owner)
        assert members[1].run_coroutine(functools.partial(_held_by, members[0].owner))[0] == 10
        found = members[1].get("mine-9", latest=True)
        assert found is not None and members[0].owner in found.value
    finally:
        for s in reversed(started):
            s.shutdown()
