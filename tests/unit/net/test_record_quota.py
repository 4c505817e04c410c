"""The per-owner budget of a DHT node's storage (p2p_diloco/net/record_quota.py)."""

from __future__ import annotations

import logging

from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time

from p2p_diloco.net.record_quota import QuotaStorage

A, B, ME = b"[owner:ssh-rsa AAAA]", b"[owner:ssh-rsa BBBB]", b"[owner:ssh-rsa ME]"


def _key(i: int) -> DHTID:
    return DHTID.generate(source=f"key-{i}")


def test_an_owner_keeps_at_most_its_budget_and_others_keep_theirs(caplog):
    storage = QuotaStorage(records=3, total_bytes=10**6, exempt=ME)
    later = get_dht_time() + 60
    with caplog.at_level(logging.WARNING):
        assert [storage.store_subkey(_key(i), A, b"v", later) for i in range(5)] == [True, True, True, False, False]
    assert storage.held_by(A) == (3, 3) and storage.refused == 2
    assert len([r for r in caplog.records if "refused DHT records" in r.getMessage()]) == 1  # once per owner
    assert storage.store_subkey(_key(0), A, b"new", later + 1)  # a refresh of a record it holds
    assert storage.held_by(A) == (3, 5)
    assert all(storage.store_subkey(_key(i), B, b"v", later) for i in range(3))  # B's own budget
    assert all(storage.store_subkey(_key(i), ME, b"v", later) for i in range(10))  # this node's own records


def test_expired_records_free_their_room():
    storage = QuotaStorage(records=2, total_bytes=10**6)
    now = get_dht_time()
    assert storage.store_subkey(_key(0), A, b"v", now + 0.01)
    assert storage.store_subkey(_key(1), A, b"v", now + 60)
    assert not storage.store_subkey(_key(2), A, b"v", now + 60)
    while get_dht_time() <= now + 0.01:
        pass
    assert storage.store_subkey(_key(2), A, b"v", now + 60)
    assert storage.held_by(A) == (2, 2)


def test_the_byte_budget_counts_value_sizes():
    storage = QuotaStorage(records=100, total_bytes=10)
    later = get_dht_time() + 60
    assert storage.store_subkey(_key(0), A, b"x" * 6, later)
    assert not storage.store_subkey(_key(1), A, b"x" * 6, later)
    assert storage.store_subkey(_key(1), A, b"x" * 4, later)


def test_a_subkey_naming_no_owner_is_left_to_the_validators():
    storage = QuotaStorage(records=1, total_bytes=1)
    later = get_dht_time() + 60
    assert all(storage.store_subkey(_key(i), b"plain", b"value", later) for i in range(3))
