"""Reads of a group key are paced: hivemind's search for a leader would read it back to back."""

import asyncio
import time
from types import SimpleNamespace

from p2p_diloco.trust.signed_matchmaking import SignedGroupKeyManager


class _Dht:
    def __init__(self):
        self.reads: list[float] = []

    async def get(self, key, latest, return_future):
        self.reads.append(time.monotonic())
        return None


def _manager(dht, interval):
    base = SimpleNamespace(dht=dht, prefix="run", group_bits="", target_group_size=4)
    return SignedGroupKeyManager(base, b"[owner:me]", poll_interval=interval)


def test_reads_of_a_group_key_are_at_least_the_poll_interval_apart():
    dht = _Dht()
    manager = _manager(dht, 0.05)

    async def search():
        for _ in range(4):  # as hivemind's loop does while its queue of leaders is empty
            assert await manager.get_averagers("run.0b", only_active=True) == []

    asyncio.run(search())
    gaps = [b - a for a, b in zip(dht.reads, dht.reads[1:], strict=False)]
    assert len(dht.reads) == 4 and min(gaps) >= 0.045, gaps


def test_the_first_read_does_not_wait():
    dht = _Dht()
    manager = _manager(dht, 60.0)
    # A wait of the poll interval before the first read would time out here.
    asyncio.run(asyncio.wait_for(manager.get_averagers("run.0b", only_active=True), timeout=10))
    assert len(dht.reads) == 1


def test_a_private_swarm_reads_declarations_of_its_members_only():
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils.crypto import RSAPrivateKey

    from p2p_diloco.trust.admission import Admission
    from p2p_diloco.trust.signed_matchmaking import declared
    from p2p_diloco.trust.signed_records import peer_id_of_owner

    markers = [RSASignatureValidator(RSAPrivateKey()).local_public_key for _ in range(3)]
    peers = [peer_id_of_owner(m) for m in markers]
    entries = {m: SimpleNamespace(value=True, expiration_time=1.0) for m in markers}
    member = peers[0]  # the others: fresh keys a member signed declarations with
    private = Admission(frozenset({member.to_base58()}), "test list")
    assert [p for p, _ in declared(entries, b"[owner:me]", private)] == [member]
    assert [p for p, _ in declared(entries, b"[owner:me]", Admission())] == peers  # a public swarm reads all
    assert [p for p, _ in declared(entries, b"[owner:me]")] == peers
