"""Reachability (p2p_diloco/net/reach.py): the verdict from peers' answers, and what a peer agrees to dial."""

import asyncio

import pytest
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerInfo
from hivemind.proto import p2pd_pb2
from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco.config import ConfigError, load_learner_config
from p2p_diloco.net import reach
from p2p_diloco.net.reach import CLIENT, DIRECT, RELAY, DialBack, HostBudget, decide, dialable, peer_ids_of

ASKER = PeerID.from_base58("12D3KooWF4QNTnj8mBC111DmtLhfewNmDd4bepoEjEcQaVn8dFRJ")


@pytest.mark.parametrize(("answers", "relayed", "mode"), [
    ([True, False], False, DIRECT),  # one peer that dialled us is proof enough
    ([None, True], False, DIRECT),
    ([False, None], False, CLIENT),
    ([False, False], True, RELAY),
    ([None, None], False, DIRECT),  # nobody answered: not checked, stays a full peer
    ([], False, DIRECT),
])
def test_verdict(answers, relayed, mode):
    found = decide(answers, relayed)
    assert found.mode == mode
    assert found.client == (mode != DIRECT)
    assert found.dht_client == (mode == CLIENT)
    assert found.record_value == {"direct": "direct", "relay": "relay", "client only": "client"}[mode]


def test_unchecked_verdicts_say_why():
    assert decide([]).how == "not checked: no initial peers"
    assert decide([None, None]).how == "not checked: none of 2 peer(s) answered"


def test_only_addresses_on_the_askers_host_are_dialled():
    mine = Multiaddr("/ip4/10.77.0.11/tcp/41000")
    requested = [
        Multiaddr("/ip4/10.77.2.20/tcp/41000").to_bytes(),  # behind its NAT: the question came from the gateway
        mine.to_bytes(),
        Multiaddr("/ip4/192.0.2.1/tcp/80").to_bytes(),  # a third party: never dialled on the asker's behalf
        b"\xff\x00garbage",
        b"\x04" * 300,
        Multiaddr("/ip4/10.77.0.11/tcp/4001/p2p-circuit").to_bytes(),
    ]
    assert dialable(requested, {"10.77.0.11"}) == [mine]
    assert dialable(requested, set()) == []
    assert len(dialable([mine.to_bytes()] * 20, {"10.77.0.11"})) == 8  # capped


def test_peer_ids_come_from_the_initial_peers_p2p_part():
    maddrs = [f"/ip4/127.0.0.1/tcp/1/p2p/{ASKER}", f"/ip4/10.0.0.1/tcp/2/p2p/{ASKER}", "/ip4/127.0.0.1/tcp/3", "junk"]
    assert peer_ids_of(maddrs) == [ASKER]


class _FakeP2P:
    def __init__(self, addrs):
        self.addrs = addrs

    async def list_peers(self):
        return [PeerInfo(ASKER, self.addrs)]


class _Context:
    remote_id = ASKER


def test_dial_back_dials_the_askers_host_and_refuses_a_repeat(monkeypatch):
    dialled = []

    async def fake_dial(self, peer, targets):
        dialled.append((peer, targets))
        return True

    monkeypatch.setattr(DialBack, "_dial", fake_dial)
    service = DialBack(_FakeP2P([Multiaddr("/ip4/127.0.0.1/tcp/5555")]))
    request = p2pd_pb2.PeerInfo(id=ASKER.to_bytes(), addrs=[Multiaddr("/ip4/127.0.0.1/tcp/41000").to_bytes()])

    async def go():
        first = await service.rpc_check(request, _Context())
        with pytest.raises(PermissionError):  # within the cooldown: no verdict, not a "no"
            await service.rpc_check(request, _Context())
        return first

    assert asyncio.run(go()).available is True
    assert dialled == [(ASKER, [Multiaddr("/ip4/127.0.0.1/tcp/41000")])]


def test_a_host_budget_allows_a_burst_then_one_dial_per_refill():
    budget = HostBudget(burst=3, refill=5.0)
    assert [budget.take("10.0.0.1", 0.0) for _ in range(4)] == [True, True, True, False]
    assert budget.take("10.0.0.2", 0.0)  # another host has its own bucket
    assert not budget.take("10.0.0.1", 4.0) and budget.take("10.0.0.1", 5.5)
    assert budget.take("10.0.0.1", 1000.0) and budget.take("10.0.0.1", 1000.0)


def test_fresh_peer_ids_from_one_host_get_only_the_hosts_budget_of_dials(monkeypatch):
    dialled = []

    async def fake_dial(self, peer, targets):
        dialled.append(peer)
        return True

    class AnyPeer:  # every asker's connection comes from the same host
        async def list_peers(self):
            return [PeerInfo(p, [Multiaddr("/ip4/10.9.0.7/tcp/5555")]) for p in askers]

    askers = [PeerID(b"\x12\x20" + bytes([i]) * 32) for i in range(6)]
    monkeypatch.setattr(DialBack, "_dial", fake_dial)
    service = DialBack(AnyPeer(), budget=HostBudget(burst=4, refill=60.0))
    request = p2pd_pb2.PeerInfo(addrs=[Multiaddr("/ip4/10.9.0.7/tcp/41000").to_bytes()])

    async def go():
        answers = []
        for peer in askers:
            try:
                answers.append((await service.rpc_check(request, type("C", (), {"remote_id": peer})())).available)
            except PermissionError:
                answers.append(None)
        return answers

    assert asyncio.run(go()) == [True] * 4 + [None, None]  # refused: no verdict, not a "no"
    assert dialled == askers[:4]


def test_dial_back_says_no_without_dialling_when_the_address_is_not_the_askers(monkeypatch):
    monkeypatch.setattr(DialBack, "_dial", lambda *_: pytest.fail("must not dial"))
    service = DialBack(_FakeP2P([Multiaddr("/ip4/10.77.0.11/tcp/33333")]))  # its NAT gateway
    request = p2pd_pb2.PeerInfo(id=ASKER.to_bytes(), addrs=[Multiaddr("/ip4/10.77.2.20/tcp/41000").to_bytes()])
    assert asyncio.run(service.rpc_check(request, _Context())).available is False


@pytest.mark.parametrize(("value", "expected"), [("auto", "auto"), ("true", True), ("false", False)])
def test_client_mode_setting(value, expected):
    assert load_learner_config(None, [f"network.client_mode={value}"]).network.client_mode == expected


def test_a_bad_client_mode_is_one_line():
    with pytest.raises(ConfigError, match=r"^network.client_mode: must be auto, true or false, not 'maybe'$"):
        load_learner_config(None, ["network.client_mode=maybe"])


def test_the_handler_name_is_namespaced():
    assert reach.CHECK.startswith("p2p_diloco.")
