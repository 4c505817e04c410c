"""Signed records: the owner's peer ID from its key, and the rules of OwnedRecords."""

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time

from p2p_diloco.admission import peer_id_of
from p2p_diloco.config import ConfigError
from p2p_diloco.signed_records import (
    IdentityKey,
    OwnedRecords,
    owner_marker,
    peer_id_of_owner,
    peer_id_of_public_key,
)


def test_the_owner_of_a_record_is_the_peer_of_its_identity(tmp_path):
    key = tmp_path / "identity.key"
    pid = peer_id_of(key)
    signer = RSASignatureValidator(IdentityKey.load(key))
    assert str(peer_id_of_public_key(IdentityKey.load(key).get_public_key())) == pid
    assert str(peer_id_of_owner(owner_marker(signer))) == pid
    assert PeerID.from_identity(key.read_bytes()).to_base58() == pid


@pytest.mark.parametrize("subkey", [
    b"", b"[owner:]", b"[owner:ssh-rsa AAAA]", b"[owner:ssh-rsa AAAAB3NzaC1yc2E]x", "text", None, 5,
    PeerID.from_base58("QmUK4ZGUxwHLxJKdh2GvY4JyKL7GoH9JXMPkyX6fbBwFca").to_bytes(), b"[owner:" + b"A" * 5000 + b"]",
])
def test_subkeys_that_name_no_owner(subkey):
    assert peer_id_of_owner(subkey) is None


def test_identity_file_that_is_not_a_key(tmp_path):
    (tmp_path / "bad.key").write_bytes(b"nonsense")
    with pytest.raises(ConfigError, match="does not hold a libp2p private key"):
        IdentityKey.load(tmp_path / "bad.key")


def test_owned_records_must_name_an_owner_under_protected_keys_and_expire_soon(tmp_path):
    peer_id_of(tmp_path / "k.key")  # makes the key
    signer = RSASignatureValidator(IdentityKey.load(tmp_path / "k.key"))
    rule = OwnedRecords(["lin_progress"], max_ttl=100)
    now = get_dht_time()
    protected, other = DHTID.generate(source="lin_progress").to_bytes(), DHTID.generate(source="x").to_bytes()

    def record(key, subkey, expires):
        return DHTRecord(key, MSGPackSerializer.dumps(subkey), b"v", expires)

    assert rule.validate(record(protected, owner_marker(signer), now + 50))
    assert not rule.validate(record(protected, b"peer-id-bytes", now + 50))  # unsigned under a protected key
    assert not rule.validate(record(protected, owner_marker(signer), now + 500))  # expires too late
    assert rule.validate(record(other, b"peer-id-bytes", now + 50))  # hivemind's own keys: any subkey
    assert not rule.validate(record(other, b"peer-id-bytes", now + 10**6))
    rule.protect(["x"])
    assert not rule.validate(record(other, b"peer-id-bytes", now + 50))
