"""The admission rule of private swarms: the allow-list file, the rule, and the gates around handlers."""

import asyncio
import logging
from types import SimpleNamespace

import pytest
from hivemind.p2p import P2P, PeerID

from p2p_diloco.config import ConfigError
from p2p_diloco.trust.admission import (
    Admission,
    NotAdmitted,
    _gate_stream,
    _gate_unary,
    admit_self,
    check_peer_id,
    gated_p2p,
    peer_id_of,
    read_allow_list,
)


@pytest.fixture
def ids(tmp_path):
    return [peer_id_of(tmp_path / f"k{i}.key") for i in range(3)]


def test_peer_id_of_makes_a_key_once_and_reads_it_back(tmp_path):
    key = tmp_path / "deep" / "identity.key"
    first = peer_id_of(key)
    assert key.exists() and peer_id_of(key) == first
    assert check_peer_id(first) == first
    with pytest.raises(ConfigError, match="does not exist"):
        peer_id_of(tmp_path / "none.key", create=False)
    (tmp_path / "junk.key").write_bytes(b"\x00junk")
    with pytest.raises(ConfigError, match="does not hold a libp2p private key"):
        peer_id_of(tmp_path / "junk.key")


def test_a_key_made_meanwhile_by_another_process_is_kept_not_overwritten(tmp_path, monkeypatch):
    key = tmp_path / "identity.key"
    theirs = tmp_path / "theirs.key"
    P2P.generate_identity(str(theirs))
    generate = P2P.generate_identity

    def race(path):  # the other process (a learner starting) writes the key while we make ours
        key.write_bytes(theirs.read_bytes())
        generate(path)

    monkeypatch.setattr(P2P, "generate_identity", staticmethod(race))
    assert peer_id_of(key) == PeerID.from_identity(theirs.read_bytes()).to_base58()
    assert key.read_bytes() == theirs.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["identity.key", "theirs.key"]  # no temporary left


@pytest.mark.parametrize("text, why", [
    ("0OIl", "not base58"),  # letters base58 leaves out
    ("abc", "not a libp2p peer ID"),
    ("1" * 40, "not a libp2p peer ID"),
])
def test_malformed_peer_ids_are_refused(text, why):
    with pytest.raises(ValueError, match=why):
        check_peer_id(text)


def test_allow_list_file(tmp_path, ids):
    f = tmp_path / "allowed.txt"
    f.write_text(f"# bootstrap\n{ids[0]}\n\n  {ids[1]}  # learner 1\n")
    assert read_allow_list(f) == {ids[0], ids[1]}
    f.write_text(f"{ids[0]}\nQmNotAPeer\n")
    with pytest.raises(ConfigError, match=r"line 2: 'QmNotAPeer'"):
        read_allow_list(f)
    f.write_text("# nobody\n")
    with pytest.raises(ConfigError, match="names no peer"):
        read_allow_list(f)
    with pytest.raises(ConfigError, match="cannot read it"):
        read_allow_list(tmp_path / "missing.txt")
    f.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="cannot read it"):
        read_allow_list(f)


def test_the_rule_admits_members_and_itself_and_logs_each_outsider_once(ids, caplog):
    rule = Admission(frozenset(ids[:2]), "list.txt")
    member, outsider, me = (PeerID.from_base58(i) for i in (ids[1], ids[2], ids[0]))
    assert Admission().admits(outsider, me, "x")  # public swarm
    assert rule.admits(member, me, "x") and rule.admits(me, me, "x")
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.trust.admission"):
        assert not rule.admits(outsider, me, "DHTProtocol.rpc_store")
        assert not rule.admits(outsider, me, "DHTProtocol.rpc_find")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"refused peer {ids[2]}" in lines[0] and "rpc_store" in lines[0]
    outsider_self = PeerID.from_base58(ids[2])
    assert rule.admits(outsider_self, outsider_self, "x")  # any peer admits itself


def test_admit_self_refuses_a_list_without_this_peer(tmp_path, ids):
    rule = Admission(frozenset(ids[:2]), "list.txt")
    assert admit_self(rule, tmp_path / "k1.key") is rule
    with pytest.raises(ConfigError, match="is not on the allow-list list.txt"):
        admit_self(rule, tmp_path / "k2.key")
    assert admit_self(Admission(), tmp_path / "never-made.key").allowed is None
    assert not (tmp_path / "never-made.key").exists()


def test_gates_call_the_handler_only_for_admitted_peers(ids):
    rule = Admission(frozenset(ids[:2]), "list.txt")
    p2p = SimpleNamespace(peer_id=PeerID.from_base58(ids[0]))
    calls = []

    async def unary(request, context):
        calls.append(("unary", request))
        return "reply"

    async def stream(info, reader, writer):
        calls.append(("stream", info.peer_id))

    class Writer:
        closed = False

        def close(self):
            self.closed = True

    async def scenario():
        gate_u = _gate_unary(unary, rule, "rpc_x", p2p)
        gate_s = _gate_stream(stream, rule, "rpc_y", p2p)
        ok = SimpleNamespace(remote_id=PeerID.from_base58(ids[1]))
        bad = SimpleNamespace(remote_id=PeerID.from_base58(ids[2]))
        assert await gate_u("ping", ok) == "reply"
        with pytest.raises(NotAdmitted):
            await gate_u("ping", bad)
        w_ok, w_bad = Writer(), Writer()
        await gate_s(SimpleNamespace(peer_id=ok.remote_id), None, w_ok)
        await gate_s(SimpleNamespace(peer_id=bad.remote_id), None, w_bad)
        return w_ok, w_bad

    w_ok, w_bad = asyncio.run(scenario())
    assert calls == [("unary", "ping"), ("stream", PeerID.from_base58(ids[1]))]
    assert w_bad.closed and not w_ok.closed


def test_a_public_swarm_uses_hivemind_p2p_unchanged(ids):
    assert gated_p2p(Admission()) is P2P
    gated = gated_p2p(Admission(frozenset(ids), "x"))
    assert issubclass(gated, P2P) and gated is not P2P
