"""Signed DHT records, bound to the peer ID of their owner.

A learner's progress record is stored under a subkey that holds its public key (hivemind's
``[owner:ssh-rsa ...]`` marker), and its value is signed with the matching private key by hivemind's
``RSASignatureValidator``. The key is the learner's libp2p identity itself (``identity.key``: an RSA
key, which is what hivemind makes), so the peer ID a record speaks for is *computed* from the
public key in its subkey (:func:`peer_id_of_owner`): nobody can write a record in another peer's
name, or change one, without that peer's private key.

Every DHT node of a learner (and the bootstrap node, which stores records for others) validates
records twice, when a peer asks it to store one and when a peer returns one to a search:

- hivemind's ``RSASignatureValidator`` checks the signature of any record whose subkey names an owner
  (:class:`CheckedOnce`: each distinct record once, as every search returns the same signed records);
- :class:`OwnedRecords` makes the owner marker mandatory under every key (an unsigned record, or a plain
  value without a subkey, is invalid, not merely unprotected) and bounds every record's expiration, so
  that a record cannot be planted to outlive its writer by more than ``max_ttl`` seconds, and its size,
  so that no peer stores megabytes on the others' nodes.

An invalid record is dropped by hivemind without reaching the learner;
:class:`~p2p_diloco.net.progress_records.ProgressBoard` reads the owner's peer ID from the subkey.
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from p2p_diloco.config import ConfigError

_OWNER_RE = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)
_MAX_OWNER_BYTES = 2048  # an OpenSSH RSA-4096 public key is ~720 bytes


class IdentityKey(RSAPrivateKey):
    """hivemind's RSA private key type, holding a libp2p identity's key instead of a fresh one."""

    def __init__(self, key: rsa.RSAPrivateKey):  # noqa: D107 - RSAPrivateKey.__init__ would generate a key
        self._private_key = key

    @classmethod
    def load(cls, identity_path: str | Path) -> IdentityKey:
        """The RSA key of a libp2p identity file (as hivemind writes them); ConfigError otherwise."""
        p = Path(identity_path)
        try:
            der = crypto_pb2.PrivateKey.FromString(p.read_bytes()).data
            key = serialization.load_der_private_key(der, password=None)
        except Exception as e:  # noqa: BLE001 - protobuf and cryptography raise many types for a bad file
            raise ConfigError(f"identity file {p} does not hold a libp2p private key ({type(e).__name__})") from None
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ConfigError(f"identity file {p} holds a {type(key).__name__}; records are signed with RSA "
                              f"identities (the kind p2p-diloco makes): move the file away to get a new one")
        return cls(key)


def peer_id_of_public_key(key: RSAPublicKey) -> PeerID:
    """The libp2p peer ID of an RSA public key (sha2-256 multihash of its protobuf encoding, as
    ``PeerID.from_identity`` computes it from the private key)."""
    der = key._public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(b"\x12\x20" + hashlib.sha256(encoded).digest())


def owner_marker(validator: RSASignatureValidator) -> bytes:
    """The subkey under which this peer stores its own (signed) records."""
    return validator.local_public_key


def peer_id_of_owner(subkey: object) -> PeerID | None:
    """The peer ID whose key an owner-marked subkey holds; None if ``subkey`` is not one."""
    if not isinstance(subkey, bytes) or len(subkey) > _MAX_OWNER_BYTES:
        return None
    return _peer_id_of_marker(subkey)


@functools.lru_cache(maxsize=4096)  # matchmaking reads the same few dozen markers at every poll
def _peer_id_of_marker(subkey: bytes) -> PeerID | None:
    found = _OWNER_RE.fullmatch(subkey)
    if found is None:
        return None
    try:
        return peer_id_of_public_key(RSAPublicKey.from_bytes(found.group(1)))
    except Exception:  # noqa: BLE001 - a malformed key from a peer
        return None


class CheckedOnce(RSASignatureValidator):
    """hivemind's ``RSASignatureValidator``, remembering its verdict on the records it has checked.

    A search returns whole dictionary values (every learner's signed progress record, every declared
    groupmate), from each peer it asks and at every poll, and hivemind checks every signature in each:
    at 16 learners on one machine, RSA verification was 39% of each DHT process's busy time (py-spy)
    and the DHT processes together kept a core busy. A verdict depends only on the record
    (key, subkey, value with its signature, expiration), so it is remembered under the SHA-256 of those,
    for the ``size`` records seen last: a record changed in any byte is checked again.
    """

    def __init__(self, private_key: RSAPrivateKey | None = None, size: int = 8192):
        super().__init__(private_key)
        self._verdicts: OrderedDict[bytes, bool] = OrderedDict()
        self._size = size
        self.checked = 0  # signatures checked (records not remembered)

    def validate(self, record: DHTRecord) -> bool:
        digest = record_digest(record)
        verdict = self._verdicts.get(digest)
        if verdict is not None:
            self._verdicts.move_to_end(digest)
            return verdict
        verdict = super().validate(record)
        self.checked += 1
        self._verdicts[digest] = verdict
        while len(self._verdicts) > self._size:
            self._verdicts.popitem(last=False)
        return verdict


def record_digest(record: DHTRecord) -> bytes:
    """SHA-256 of a record's fields, each length-prefixed (no two records share an encoding)."""
    h = hashlib.sha256()
    for part in (record.key, record.subkey, record.value):
        if part is None:
            h.update(b"\xff" * 8)
        else:
            h.update(struct.pack(">Q", len(part)))
            h.update(part)
    h.update(struct.pack(">d", record.expiration_time))
    return h.digest()


# The largest record value a node stores or takes from a search: a reader takes at most 64 KiB of a
# commit signature or reducer sketch and 16 KiB of a progress record; hivemind adds the owner's signature.
MAX_RECORD_BYTES = 128 * 1024

# The longest a record may be stored for: a progress record lives network.record_ttl (at most 600 s);
# hivemind's matchmaking and state-sharing keys, seconds to a minute. Twice that, for clock skew.
MAX_RECORD_SECONDS = 1200.0


class OwnedRecords(RecordValidatorBase):
    """Only records whose subkey names their owner (and so carry its signature), under every key; each
    with an expiration at most ``max_ttl`` seconds ahead and a value of at most ``max_bytes``.

    Every record a swarm stores is owner-marked (progress records, the lineage index, commit signatures,
    reducer sketches, matchmaking and download declarations), so nothing legitimate is refused. A plain
    value (hivemind's subkey-less record) would squat its key: hivemind refuses a subkey store under a
    key whose plain value expires later, and a search would return the plain value. The swarm's
    per-round keys (commit, group, sketch) are predictable and change every round, so they cannot be
    listed in advance: the rule holds for every key instead.
    """

    def __init__(self, max_ttl: float = MAX_RECORD_SECONDS, max_bytes: int = MAX_RECORD_BYTES):
        self.max_ttl, self.max_bytes = max_ttl, max_bytes

    def validate(self, record: DHTRecord) -> bool:
        if record.expiration_time > get_dht_time() + self.max_ttl or len(record.value) > self.max_bytes:
            return False
        return bool(record.subkey) and len(_OWNER_RE.findall(record.subkey)) == 1

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


def replica_first(dht: Any) -> dict[str, bool]:
    """The keyword with which a reader of signed records asks the DHT for its own replica of the key first
    (p2p_diloco/net/replica_reads.py): only of a LinkedDHT started with replica reads; hivemind's own DHT
    does not know it and would fail the read."""
    return {"replica_first": True} if getattr(dht, "replica_reads_after", None) is not None else {}
