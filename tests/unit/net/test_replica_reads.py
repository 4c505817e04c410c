"""Which keys a node holds a replica of (p2p_diloco/net/replica_reads.py), and which reads of a key are full."""

import threading
from collections import OrderedDict
from types import SimpleNamespace

from hivemind.dht.routing import DHTID

from p2p_diloco.net.dht import LinkedDHT
from p2p_diloco.net.replica_reads import FULL_READ_EVERY, holds_replica
from p2p_diloco.trust.signed_records import replica_first


def _node(me: DHTID, others: list[DHTID], replicas: int = 2, client: bool = False):
    def nearest(key, k, exclude=None):
        return [(o, None) for o in sorted((o for o in others if o != exclude), key=key.xor_distance)[:k]]

    table = SimpleNamespace(get_nearest_neighbors=nearest)
    return SimpleNamespace(node_id=me, num_replicas=replicas,
                           protocol=SimpleNamespace(client_mode=client, routing_table=table))


def test_a_node_holds_a_replica_of_the_keys_it_is_among_the_nearest_to():
    key = DHTID.generate(source="records")
    ids = sorted((DHTID.generate() for _ in range(6)), key=key.xor_distance)
    assert holds_replica(_node(ids[0], ids[1:]), key)
    assert holds_replica(_node(ids[1], [ids[0], *ids[2:]]), key)  # one nearer: still among the 2 nearest
    assert not holds_replica(_node(ids[2], ids[:2] + ids[3:]), key)  # two nearer: stores go to them
    assert holds_replica(_node(ids[5], ids[:1]), key)  # knows fewer nodes than there are replicas
    assert not holds_replica(_node(ids[0], ids[1:], client=True), key)  # a client stores nothing for others


def test_every_few_reads_of_a_key_are_full_ones():
    dht = SimpleNamespace(_replica_reads=OrderedDict(), _replica_lock=threading.Lock())
    turns = [LinkedDHT._replica_turn(dht, "a") for _ in range(2 * FULL_READ_EVERY)]
    assert turns == ([True] * (FULL_READ_EVERY - 1) + [False]) * 2
    assert LinkedDHT._replica_turn(dht, "b")  # counted per key


def test_only_a_dht_started_with_replica_reads_is_asked_for_its_replica():
    assert replica_first(SimpleNamespace()) == {}  # hivemind's own DHT: the keyword would fail its read
    assert replica_first(SimpleNamespace(replica_reads_after=None)) == {}
    assert replica_first(SimpleNamespace(replica_reads_after=15.0)) == {"replica_first": True}
