"""hivemind's matchmaking and download-priority keys, signed by their owner.

hivemind's averager declares "I am looking for a group at this key" and "I serve state with this
priority" under DHT subkeys holding its raw peer ID, which any peer can write in another's name: a
forger could fill a group key with peers that never answer, or point every download at itself.
Here both declarations are stored under this peer's owner marker (its RSA public key, as
:mod:`p2p_diloco.trust.signed_records` does for progress records), so hivemind's ``RSASignatureValidator``
signs them in the DHT process and every node that stores or returns them checks the signature; the
peer a declaration speaks for is computed from the key in its subkey. A reader takes only
owner-marked entries and ignores the rest (unsigned or from an older version).

With a DHT that signs nothing (``owner`` empty: tests with a bare hivemind DHT) hivemind's peer-ID
subkeys are kept.

Reads of a group key are paced (``poll_interval``): hivemind's search for a leader reads the key again as
soon as its queue of candidate leaders is empty, which, while we wait as a leader or before anyone else has
declared, is back to back. In the 3-learner demo that was about 660 reads per learner in 40 s, each a
search of every node that returns every declaration, and most of a learner's DHT bytes (docs/scale.md,
"Control-plane bytes").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from hivemind.averaging.key_manager import GroupKey, GroupKeyManager, is_valid_group
from hivemind.p2p import PeerID
from hivemind.utils import DHTExpiration, get_logger

from p2p_diloco.trust.admission import Admission
from p2p_diloco.trust.signed_records import peer_id_of_owner, replica_first

logger = get_logger(__name__)


def download_key(prefix: str) -> str:
    """hivemind's "who serves state, with what priority" key of averagers with ``prefix``."""
    return f"{prefix}.all_averagers"


def declared(entries: object, owner: bytes, members: Admission | None = None) -> Iterator[tuple[PeerID, Any]]:
    """(peer ID, entry) for each declaration in a DHT dictionary value whose subkey the peer signed, and whose
    peer ``members`` lists (a private swarm's allow-list: any key can sign a valid DHT record, so a member
    could otherwise declare under fresh keys, filling a group key with peers nobody admits or pointing
    downloads at them).

    ``owner`` empty: hivemind's own subkeys (raw peer IDs). Anything malformed is skipped.
    """
    if not isinstance(entries, Mapping):
        return
    if members is not None and members.private:
        for peer, entry in declared(entries, owner):
            if members.lists(peer.to_base58()):
                yield peer, entry
        return
    for subkey, entry in entries.items():
        if owner:
            peer = peer_id_of_owner(subkey)
        else:
            try:
                peer = PeerID(subkey) if isinstance(subkey, bytes) else None
            except Exception:  # noqa: BLE001 - a malformed subkey from a peer
                peer = None
        if peer is not None:
            yield peer, entry


class SignedGroupKeyManager(GroupKeyManager):
    """hivemind's :class:`GroupKeyManager`, declaring under this peer's owner marker and reading only
    declarations whose subkey names (and whose signature proves) their owner."""

    def __init__(self, base: GroupKeyManager, owner: bytes, poll_interval: float = 0.0):  # noqa: D107
        self.__dict__.update(base.__dict__)  # takes over hivemind's manager: group bits and target size as set
        self.owner = owner
        self.poll_interval = poll_interval  # the least time between two reads of a group key (seconds)
        self._last_read = float("-inf")

    async def declare_averager(self, group_key: GroupKey, peer_id: PeerID, expiration_time: float,
                               looking_for_group: bool = True) -> bool:
        if not self.owner:
            return await super().declare_averager(group_key, peer_id, expiration_time, looking_for_group)
        # as hivemind does: leaving overwrites the entry with an expiration a hair later than joining's
        expiration_time = expiration_time if looking_for_group else float(np.nextafter(expiration_time, float("inf")))
        return await self.dht.store(key=group_key, subkey=self.owner, value=looking_for_group,
                                    expiration_time=expiration_time, return_future=True)

    async def get_averagers(self, group_key: GroupKey, only_active: bool) -> list[tuple[PeerID, DHTExpiration]]:
        assert is_valid_group(group_key), f"group key {group_key} is invalid"
        wait = self._last_read + self.poll_interval - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self._last_read = time.monotonic()
        result = await self.dht.get(group_key, latest=True, return_future=True, **replica_first(self.dht))
        if result is None:
            return []
        found = []
        for peer, entry in declared(result.value, self.owner, getattr(self.dht, "admission", None)):
            looking, expiration = getattr(entry, "value", None), getattr(entry, "expiration_time", None)
            if not isinstance(looking, bool) or not isinstance(expiration, float | int):
                continue
            if looking or not only_active:
                found.append((peer, float(expiration)))
        return found
