"""Reads answered from a node's own replica (p2p_diloco/net/replica_reads.py): no RPC where the node holds
the key, a full read every few reads of a key, and none before the node has been up long enough."""

from hivemind.utils import get_dht_time

from p2p_diloco.net.dht import start_dht
from p2p_diloco.net.replica_reads import FULL_READ_EVERY
from p2p_diloco.net.traffic import read_traffic


def _finds(dht) -> int:
    return read_traffic(dht).get("DHTProtocol.rpc_find", {}).get("calls_made", 0)


def _start(initial, after):
    return start_dht(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                     identity_path=None, startup_timeout=30, replica_reads_after=after)


def test_a_replica_answers_from_its_storage_and_reads_the_swarm_every_few_reads():
    started = []
    try:
        first = _start([], None)
        started.append(first)
        maddrs = [str(m) for m in first.get_visible_maddrs()]
        reader = _start(maddrs, 0.0)
        newcomer = _start(maddrs, 3600.0)  # never up long enough here
        started += [reader, newcomer]
        now = get_dht_time()
        for i, dht in enumerate(started):
            assert dht.store("records", f"record {i}".encode(), now + 60, subkey=f"peer-{i}")

        def read(dht, **kwargs):
            found = dht.get("records", latest=True, **kwargs)
            return {k: v.value for k, v in found.value.items()}

        everything = {f"peer-{i}": f"record {i}".encode() for i in range(3)}
        before = _finds(reader)
        for _ in range(FULL_READ_EVERY - 1):
            assert read(reader, replica_first=True) == everything  # every store reached it: 3 nodes < 5 replicas
        assert _finds(reader) == before  # answered from its own storage
        assert read(reader, replica_first=True) == everything
        assert _finds(reader) > before  # the FULL_READ_EVERY-th read of the key asked the swarm
        before = _finds(reader)
        assert read(reader) == everything  # a read that did not ask for the replica is hivemind's
        assert _finds(reader) > before
        before = _finds(newcomer)
        assert read(newcomer, replica_first=True) == everything
        assert _finds(newcomer) > before  # up less than `after`: records stored before it joined may be missing
        assert reader.get("nobody-stored-this", latest=True, replica_first=True) is None
    finally:
        for dht in reversed(started):
            dht.shutdown()
