"""The private parts of hivemind this package overrides or replaces, in one place.

hivemind's public API cannot give one all-reduce result per version, all-or-nothing rounds or checked
wire parts, so :mod:`.allreduce`, :mod:`.averager_process`, :mod:`.downloads`, :mod:`.message_caps` and
:mod:`.patient_matchmaking` override private methods (and :mod:`.dht` and :mod:`.record_quota` the storage a DHT
node keeps records in, :mod:`.replica_reads` a node's read of a key). Each entry names the upstream method, the
module that overrides it, and a fingerprint of the upstream source as it was read and checked
against (``PINNED_VERSION``, the version ``constraints.txt`` installs). ``tests/unit/net/
test_hivemind_surface.py`` fails when the installed hivemind differs from it: read the changed upstream
method, adapt the override, then update the fingerprint.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from dataclasses import dataclass

PINNED_VERSION = "1.1.12"


@dataclass(frozen=True)
class Override:
    upstream: str  # "module:Class.attribute"
    ours: str  # the module of this package that overrides it
    fingerprint: str  # the first 16 hex digits of sha256 over the upstream source
    # What our module defines in its place: the method itself, or what that method reads (when ours changes an
    # attribute the upstream method uses rather than the method)
    replaced_by: str = ""

    @property
    def attribute(self) -> str:
        return self.replaced_by or self.upstream.rpartition(".")[2]

    def upstream_source(self) -> str:
        module, _, qualname = self.upstream.partition(":")
        owner, _, attribute = qualname.rpartition(".")
        cls = getattr(importlib.import_module(module), owner)
        return inspect.getsource(cls.__dict__[attribute])

    def upstream_fingerprint(self) -> str:
        return hashlib.sha256(self.upstream_source().encode()).hexdigest()[:16]


OVERRIDES = (
    Override("hivemind.averaging.allreduce:AllReduceRunner._communicate_with_peer", "allreduce", "d910885e9727ed48"),
    Override("hivemind.averaging.allreduce:AllReduceRunner._generate_input_for_peer", "allreduce", "c91d3343d3e60faf"),
    Override("hivemind.averaging.allreduce:AllReduceRunner._accumulate_parts_streaming", "allreduce",
             "6c5a3c7266060303"),
    Override("hivemind.averaging.averager:DecentralizedAverager._step", "averager_process", "dfbb4416e9ebba51"),
    Override("hivemind.averaging.averager:DecentralizedAverager._declare_for_download_periodically",
             "averager_process", "23ae6db0d205bcaf"),
    Override("hivemind.averaging.averager:DecentralizedAverager._aggregate_with_group", "averager_process",
             "c297d8a435ce2b1c"),
    Override("hivemind.averaging.averager:DecentralizedAverager._run_allreduce_inplace_", "averager_process",
             "914d57cffc7d69e1"),
    Override("hivemind.averaging.averager:DecentralizedAverager._load_state_from_peers", "downloads",
             "fe7b419d01ced5fe"),
    Override("hivemind.averaging.averager:DecentralizedAverager.get_current_state", "downloads", "e40a50069c2b4868"),
    Override("hivemind.p2p.p2p_daemon:P2P.receive_raw_data", "message_caps", "353ef452baab5a81"),
    # A node's storage and cache become quota storages (record_quota.py) made right after create() makes them; every
    # record another peer stores reaches them through store_subkey (rpc_store), which the quota storage wraps.
    Override("hivemind.dht.protocol:DHTProtocol.create", "dht", "a5090f84f8c2f94a"),
    Override("hivemind.dht.protocol:DHTProtocol.rpc_store", "record_quota", "1be6960bd046f8f7",
             replaced_by="store_subkey"),
    Override("hivemind.dht.storage:DHTLocalStorage.store_subkey", "record_quota", "a03eb0eed2a6512b"),
    # request_timeout becomes a property; this is the method that reads it, twice
    Override("hivemind.averaging.matchmaking:Matchmaking._request_join_group", "patient_matchmaking",
             "df823040a94d1c1d", replaced_by="request_timeout"),
    # A leader also starts once everyone training is in its group: hivemind's handler is wrapped, and the group is
    # assembled under the preconditions leader_assemble_group asserts (both locks held, no group assembled yet).
    Override("hivemind.averaging.matchmaking:Matchmaking.rpc_join_group", "early_close", "0d6120e412849439"),
    Override("hivemind.averaging.matchmaking:Matchmaking.leader_assemble_group", "early_close", "516cc5ff7fb369f2",
             replaced_by="_close_if_everyone_joined"),
    # A read from the node's own replica goes through hivemind's merge and decoding of a search's candidates.
    Override("hivemind.dht.node:DHTNode.get_many_by_id", "replica_reads", "8eb1ef57b1be5745"),
    Override("hivemind.dht.node:_SearchState.add_candidate", "replica_reads", "c232a1ec3c42f981",
             replaced_by="get_many_by_id"),
    Override("hivemind.dht.node:_SearchState.finish_search", "replica_reads", "1f4dfb2bb5de81c4",
             replaced_by="get_many_by_id"),
)
