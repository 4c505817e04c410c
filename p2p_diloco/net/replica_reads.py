"""Reads that a DHT node answers from its own replica of the key, when it holds one.

A key's value lives on the ``num_replicas`` nodes nearest to it (XOR distance of the IDs), and every store
is sent to them. hivemind's ``get(key, latest=True)``, the read this project makes of the swarm's progress
records, matchmaking declarations, reducer sketches and commit signatures, asks every node near the key
for it and merges their answers; each answer carries the whole dictionary, every entry with its owner
marker and signature (about 750 bytes). In the README's demo (3 learners, a bootstrap node) each of those
reads asked nodes holding exactly what the reader's own node held: with fewer than ``num_replicas`` (5) nodes,
every store reaches every node. Answered from the node's own replica, a learner's DHT bytes there fell by
about 30% (benchmarks/results/control_plane_2026-12-07_ed0d679.md).

A read made with ``replica_first=True`` (:class:`ReplicaFirstNode`, the DHT process's node) is answered
from this node's own storage, with no RPC, when

- the node is a replica of the key: fewer than ``num_replicas`` of the nodes it knows are nearer to the key
  than itself (then a storer that knows the same nodes sends it every store; a client-mode node stores
  nothing for others and never is);
- it has been up at least ``after`` seconds (the records' TTL): records stored before it joined never reached
  it, and every record that lives longer is stored again within that time (progress records every TTL / 3;
  declarations, sketches and signatures are made for the round at hand);
- its storage holds the key.

Otherwise the read is hivemind's. A read from one replica can miss an entry whose store to this node failed
while it reached others: the callers poll, and :class:`~p2p_diloco.net.dht.LinkedDHT` makes every
:data:`FULL_READ_EVERY`-th read of a key a full one, so a miss costs a few polls, not a round.
Larger swarms, where a node replicates few keys, read as before; records that do not grow with the swarm are
the other half of the work (docs/scale.md). Where the rule can be wrong: a client-mode storer nearer to the key
than a server takes one of its own ``num_replicas`` slots (hivemind counts the storer as a candidate), so with 5
or more servers the farthest of them may believe it replicates a key the client's stores skip; and a node that
became a replica when a nearer one left lacks the older entries until they are stored again. Both cost the
reads of those entries until the next full read. Only :class:`~p2p_diloco.net.dht.LinkedDHT` knows the
keyword (``p2p_diloco.trust.signed_records.replica_first`` gives it to no other DHT).
"""

from __future__ import annotations

import time
from typing import Any

from hivemind.dht.node import DHTNode, _SearchState
from hivemind.dht.routing import DHTID

# One read of a key in this many is a full one, whatever the caller asked (see the module doc).
FULL_READ_EVERY = 4


def holds_replica(node: DHTNode, key_id: DHTID) -> bool:
    """Whether ``node`` is one of the ``num_replicas`` nodes nearest to ``key_id`` among those it knows."""
    if node.protocol.client_mode:
        return False
    ours = key_id.xor_distance(node.node_id)
    nearest = node.protocol.routing_table.get_nearest_neighbors(key_id, node.num_replicas, exclude=node.node_id)
    return sum(key_id.xor_distance(other) < ours for other, _ in nearest) < node.num_replicas


def replica_first_node(after: float) -> type[DHTNode]:
    """hivemind's ``DHTNode`` whose ``get_many_by_id(..., replica_first=True)`` answers from the node's own
    replica once the node has been up ``after`` seconds (module doc); ``replica_first=False`` (the default)
    is hivemind's read."""

    class ReplicaFirstNode(DHTNode):
        @classmethod
        async def create(cls, *args: Any, **kwargs: Any) -> DHTNode:
            node = await super().create(*args, **kwargs)
            node.up_since = time.monotonic()
            return node

        async def get_many_by_id(self, key_ids: Any, sufficient_expiration_time: float | None = None, *args: Any,
                                 replica_first: bool = False, **kwargs: Any) -> Any:
            key_ids = list(key_ids)
            held = self._held(key_ids) if replica_first and not kwargs.get("_is_refresh") else None
            if held is None:
                return await super().get_many_by_id(key_ids, sufficient_expiration_time, *args, **kwargs)
            found = {}
            for key_id, value in held.items():  # hivemind's own merge and decoding of a search's candidates
                state = _SearchState(key_id, float("inf"), serializer=self.protocol.serializer,
                                     record_validator=self.protocol.record_validator)
                state.add_candidate(value, source_node_id=self.node_id)
                state.finish_search()
                found[key_id] = state.future
            if kwargs.get("return_futures"):
                return found
            return {key_id: await future for key_id, future in found.items()}

        def _held(self, key_ids: list[DHTID]) -> dict[DHTID, Any] | None:
            """Each key's value in this node's storage, if the replica answers for all of them (module doc)."""
            if time.monotonic() - self.up_since < after:
                return None
            held = {k: self.protocol.storage.get(k) for k in key_ids}
            if all(v is not None and holds_replica(self, k) for k, v in held.items()):
                return held
            return None

    return ReplicaFirstNode
