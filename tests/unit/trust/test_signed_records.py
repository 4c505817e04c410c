"""Signed records: the owner's peer ID from its key, and the rules of OwnedRecords."""

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time

from p2p_diloco.config import ConfigError
from p2p_diloco.trust.admission import peer_id_of
from p2p_diloco.trust.signed_records import (
    CheckedOnce,
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


def test_owned_records_must_name_an_owner_under_every_key_and_expire_soon(tmp_path):
    peer_id_of(tmp_path / "k.key")  # makes the key
    signer = RSASignatureValidator(IdentityKey.load(tmp_path / "k.key"))
    rule = OwnedRecords(max_ttl=100)
    now = get_dht_time()
    key = DHTID.generate(source="lin_commit_0_7").to_bytes()

    def record(subkey, expires):
        return DHTRecord(key, MSGPackSerializer.dumps(subkey), b"v", expires)

    assert rule.validate(record(owner_marker(signer), now + 50))
    assert not rule.validate(record(b"peer-id-bytes", now + 50))  # hivemind's raw peer-ID subkey: unsigned
    assert not rule.validate(record(None, now + 50))  # a plain value (no subkey) would squat the key
    assert not rule.validate(record(owner_marker(signer) * 2, now + 50))  # two owners
    assert not rule.validate(record(owner_marker(signer), now + 500))  # expires too late
    big = DHTRecord(key, MSGPackSerializer.dumps(owner_marker(signer)), b"v" * (128 * 1024 + 1), now + 50)
    assert not rule.validate(big)  # too large


def _signed(signer, value: bytes, expires: float) -> DHTRecord:
    key = DHTID.generate(source="lin_progress").to_bytes()
    unsigned = DHTRecord(key, MSGPackSerializer.dumps(owner_marker(signer)), value, expires)
    return DHTRecord(unsigned.key, unsigned.subkey, signer.sign_value(unsigned), expires)


def test_a_signature_is_checked_once_per_distinct_record(tmp_path):
    peer_id_of(tmp_path / "k.key")
    checker = CheckedOnce(IdentityKey.load(tmp_path / "k.key"), size=2)
    expires = get_dht_time() + 60
    good = _signed(checker, b"v1", expires)
    assert checker.validate(good) and checker.validate(good) and checker.checked == 1

    # Any byte changed is a different record, checked on its own: value, signature or expiration.
    assert not checker.validate(DHTRecord(good.key, good.subkey, b"v2" + good.value[2:], expires))
    assert not checker.validate(DHTRecord(good.key, good.subkey, good.value[:-3] + b"AA]", expires))
    assert not checker.validate(DHTRecord(good.key, good.subkey, good.value, expires + 1))
    assert checker.checked == 4
    # A remembered forgery stays rejected; and only `size` verdicts are kept (the good one was evicted).
    assert not checker.validate(DHTRecord(good.key, good.subkey, good.value, expires + 1)) and checker.checked == 4
    assert checker.validate(good) and checker.checked == 5
    # Verdicts agree with hivemind's own validator.
    plain = RSASignatureValidator(IdentityKey.load(tmp_path / "k.key"))
    assert plain.validate(good) and not plain.validate(DHTRecord(good.key, good.subkey, good.value, expires + 1))


def test_unprotected_records_pass_as_with_hivemind(tmp_path):
    peer_id_of(tmp_path / "k.key")
    checker = CheckedOnce(IdentityKey.load(tmp_path / "k.key"))
    record = DHTRecord(b"key", MSGPackSerializer.dumps(b"peer-id-bytes"), b"value", get_dht_time() + 10)
    assert checker.validate(record) and checker.validate(record) and checker.checked == 1
