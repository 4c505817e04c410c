"""Gathered metadata signed by the member it speaks for.

Before a round's all-reduce, each member's metadata (version and hash of its state, tokens, steps,
weight, norm, rules, bans: :mod:`p2p_diloco.core.exclusion` decides from it) travels to the group's leader
in hivemind's matchmaking, and the leader relays everyone's to everyone. A leader could change what a
member said (its weight, its norm, the bans it lists) before relaying it. So each member signs its own
metadata with its identity key, and every member checks each entry against the peer ID hivemind's
group names for it: an entry that is unsigned, signed by another key, or changed after signing is
*forged*, and that member is excluded from the round with the reason (the others commit without it).
A leader that relays a forged entry can make a round leave a member out, never make the group count
what the member did not say.

The signature covers the canonical msgpack of the metadata without its ``signed`` field (tuples and
lists pack alike, so hivemind's own serializer round trip does not change it)::

    metadata["signed"] = [public key (OpenSSH bytes), signature]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from p2p_diloco.trust.signed_records import peer_id_of_public_key

FIELD = "signed"
_MAX_KEY_BYTES = 2048


def _body(metadata: Mapping[str, Any]) -> bytes:
    return msgpack.packb(["p2p-diloco gathered 1", {k: v for k, v in metadata.items() if k != FIELD}],
                         use_bin_type=True)


def sign(metadata: dict[str, Any], key: RSAPrivateKey) -> dict[str, Any]:
    """``metadata`` with its signature by ``key`` (the member's identity key)."""
    return {**metadata, FIELD: [key.get_public_key().to_bytes(), key.sign(_body(metadata))]}


def forged(peer: str, metadata: Any) -> str:
    """"" if ``metadata`` is signed by ``peer``'s own key and unchanged since; else why not (one line)."""
    if not isinstance(metadata, dict):
        return "its gathered metadata is not a map"
    signed = metadata.get(FIELD)
    if not (isinstance(signed, list | tuple) and len(signed) == 2 and all(isinstance(x, bytes) for x in signed)):
        return "its gathered metadata is not signed"
    public, signature = signed
    try:
        if len(public) > _MAX_KEY_BYTES:
            raise ValueError("key too long")
        key = RSAPublicKey.from_bytes(public)
        if str(peer_id_of_public_key(key)) != peer:
            return "its gathered metadata is signed with another peer's key"
        body = _body(metadata)
    except Exception:  # noqa: BLE001 - a malformed key or an unpackable value from a peer
        return "its gathered metadata holds a malformed signature"
    if not key.verify(body, signature):
        return "its gathered metadata was changed after it signed it"
    return ""
