"""RPC traffic of a learner's DHT process: calls made and served, and their bytes, per RPC.

hivemind counts nothing of what its DHT sends. In the DHT's own process, hivemind's ``DHTNode`` makes
its ``P2P`` from ``hivemind.dht.node.P2P``; :class:`~p2p_diloco.net.dht.LinkedDHT` puts a subclass
from :func:`counting_p2p` there, which counts every unary protobuf call it makes (``DHTProtocol``'s
ping, store and find, and the reachability check's question), by RPC and every one it serves. The learner
reads the counts with :func:`read_traffic` (one request to the DHT process).

Bytes are the serialized protobuf messages (request out and reply in for a call made; request in
and reply out for one served): what the RPCs carry, without libp2p's framing, encryption and
multiplexing. Streams (the averager's all-reduce and state downloads, on a replica of this P2P in
the averager's process) are not counted here; the learner counts their payload itself.

The finds and stores are also counted by the kind of key they carry (:func:`key_kind`: progress records, group
declarations, sketches, ...; :func:`read_key_traffic`), which is what tells where the control plane's bytes go
as a swarm grows (docs/scale.md). A request names its keys by their DHT ids only: the node of this process
(:func:`keyed_node`) remembers the kind of each key it reads or stores, and the keys peers ask it about are the
swarm's shared keys, known the same way; a key it never touched counts as ``other``, the routing table's lookups
of node ids as ``routing``. A request for several keys is split among them: each key's value or result to its
own kind, the rest of the message evenly.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import AsyncIterable, Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hivemind.p2p import P2P


@dataclass
class RpcTraffic:
    """One RPC's calls through this peer's P2P (``DHTProtocol.rpc_find``, say)."""

    calls_made: int = 0
    calls_failed: int = 0  # made, and no reply came (error or timeout)
    calls_served: int = 0
    bytes_out: int = 0  # requests sent + replies served
    bytes_in: int = 0  # replies received + requests served


def rpc_of(handle_name: str) -> str:
    """``DHTProtocol.rpc_find`` for ``ns::DHTProtocol.rpc_find``: the handler's name without its namespace."""
    return handle_name.rsplit("::", 1)[-1]


def _size(message: Any) -> int:
    try:
        return int(message.ByteSize())
    except Exception:  # noqa: BLE001 - a handler may answer None (an authorizer refused); nothing was sent
        return 0


# The kinds of DHT key a learner uses, by the end of the key's name (the functions that name them: progress_key,
# lineages_key, download_key, group_key, commit_key, sketch_key); the first that matches wins.
KEY_KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("progress", re.compile(r"_progress$")),
    ("lineages", re.compile(r"_lineages$")),
    ("download", re.compile(r"\.all_averagers$")),
    ("group", re.compile(r"\.0b[01]*$")),
    ("commit", re.compile(r"_commit_\d+_\d+$")),
    ("sketch", re.compile(r"_sketch_[^.]*$")),
)
OTHER, ROUTING = "other", "routing"
_KEYS_REMEMBERED = 4096  # key ids whose kind a process remembers: the most recently used


def key_kind(key: object) -> str:
    """The kind of a DHT key by its name (:data:`KEY_KINDS`), ``other`` for any other."""
    if isinstance(key, bytes):
        key = key.decode("utf-8", errors="replace")
    if isinstance(key, str):
        for kind, pattern in KEY_KINDS:
            if pattern.search(key):
                return kind
    return OTHER


class KeyKinds:
    """The kind of each DHT key id this process used lately (the key's name is not in the requests)."""

    def __init__(self, size: int = _KEYS_REMEMBERED):
        self._kinds: OrderedDict[bytes, str] = OrderedDict()
        self._size = size
        # whether a key id is a node's this process knows (a routing lookup); asked for each key of unknown kind
        self.is_node: Callable[[bytes], bool] = lambda key_id: False

    def remember(self, key_id: bytes, key: object) -> None:
        self._kinds[key_id] = key_kind(key)
        self._kinds.move_to_end(key_id)
        while len(self._kinds) > self._size:
            self._kinds.popitem(last=False)

    def of(self, key_id: bytes) -> str:
        kind = self._kinds.get(key_id)
        if kind is not None:
            return kind
        return ROUTING if self.is_node(key_id) else OTHER


KEYS = KeyKinds()  # this process's (the DHT process's: it is the one that makes and serves DHT RPCs)


@dataclass
class KeyTraffic:
    """The finds and stores of one kind of key: how many keys they carried, and their bytes."""

    finds: int = 0
    stores: int = 0
    bytes_out: int = 0
    bytes_in: int = 0


class TrafficCounts:
    """Counts per RPC; ``snapshot()`` is what :func:`read_traffic` returns; ``by_key`` per kind of key."""

    def __init__(self, keys: KeyKinds = KEYS) -> None:
        self.rpcs: dict[str, RpcTraffic] = {}
        self.by_key: dict[str, KeyTraffic] = {}
        self.keys = keys

    def of(self, handle_name: str) -> RpcTraffic:
        return self.rpcs.setdefault(rpc_of(handle_name), RpcTraffic())

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {name: asdict(t) for name, t in sorted(self.rpcs.items())}

    def key_snapshot(self) -> dict[str, dict[str, int]]:
        return {kind: asdict(t) for kind, t in sorted(self.by_key.items())}

    def count_keys(self, handle_name: str, request: Any, reply: Any, made: bool) -> None:
        """Split a find's or store's bytes among the kinds of the keys it carries (``made``: by this peer)."""
        rpc = rpc_of(handle_name)
        if rpc not in ("DHTProtocol.rpc_find", "DHTProtocol.rpc_store"):
            return
        keys = list(getattr(request, "keys", ()))
        if not keys:
            return
        kinds = [self.keys.of(bytes(k)) for k in keys]
        find = rpc == "DHTProtocol.rpc_find"
        # what each key's own part of the request and of the reply weighs
        own_request = [0] * len(keys) if find else [
            len(k) + _item(request.subkeys, i) + _item(request.values, i) for i, k in enumerate(keys)]
        results = list(getattr(reply, "results", ())) if find else []
        own_reply = [_size(results[i]) if i < len(results) else 0 for i in range(len(keys))]
        out_request, in_reply = (True, False) if made else (False, True)
        for message, own, outgoing in ((request, own_request, out_request), (reply, own_reply, in_reply)):
            rest = max(0, _size(message) - sum(own)) / len(keys)
            for kind, mine in zip(kinds, own, strict=True):
                t = self.by_key.setdefault(kind, KeyTraffic())
                if outgoing:
                    t.bytes_out += round(mine + rest)
                else:
                    t.bytes_in += round(mine + rest)
        for kind in kinds:
            t = self.by_key.setdefault(kind, KeyTraffic())
            if find:
                t.finds += 1
            else:
                t.stores += 1


def _item(items: Any, i: int) -> int:
    try:
        return len(items[i])
    except Exception:  # noqa: BLE001 - a peer's request may hold fewer values than keys: hivemind refuses it
        return 0


def count_served(handler: Callable[[Any, Any], Awaitable[Any]], traffic: RpcTraffic,
                 on_reply: Callable[[Any, Any], None] | None = None) -> Callable[[Any, Any], Awaitable[Any]]:
    """``handler`` (a unary protobuf handler), counting each request it serves and its reply (and telling
    ``on_reply`` of both)."""
    async def counted(request: Any, context: Any) -> Any:
        traffic.calls_served += 1
        traffic.bytes_in += _size(request)
        reply = await handler(request, context)
        traffic.bytes_out += _size(reply)
        if on_reply is not None:
            on_reply(request, reply)
        return reply

    return counted


def counting_p2p(base: type[P2P]) -> type[P2P]:
    """A subclass of ``base`` (hivemind's ``P2P`` or the admission-gated one) that counts unary RPCs in
    ``self.traffic`` (a :class:`TrafficCounts`)."""

    class CountingP2P(base):
        @property
        def traffic(self) -> TrafficCounts:
            counts = self.__dict__.get("_traffic")
            if counts is None:
                counts = self.__dict__["_traffic"] = TrafficCounts()
            return counts

        async def add_protobuf_handler(self, name: str, handler: Callable[..., Any], input_protobuf_type: Any, *,
                                       stream_input: bool = False, stream_output: bool = False,
                                       balanced: bool = False) -> None:
            if not stream_input and not stream_output:
                counts = self.traffic
                handler = count_served(handler, counts.of(name),
                                       lambda request, reply: counts.count_keys(name, request, reply, made=False))
            await super().add_protobuf_handler(name, handler, input_protobuf_type, stream_input=stream_input,
                                               stream_output=stream_output, balanced=balanced)

        async def call_protobuf_handler(self, peer_id: Any, name: str, input: Any, output_protobuf_type: Any) -> Any:
            if isinstance(input, AsyncIterable):
                return await super().call_protobuf_handler(peer_id, name, input, output_protobuf_type)
            t = self.traffic.of(name)
            t.calls_made += 1
            t.bytes_out += _size(input)
            try:
                reply = await super().call_protobuf_handler(peer_id, name, input, output_protobuf_type)
            except BaseException:
                t.calls_failed += 1
                raise
            t.bytes_in += _size(reply)
            self.traffic.count_keys(name, input, reply, made=True)
            return reply

    CountingP2P.__qualname__ = CountingP2P.__name__ = f"Counting{base.__name__}"
    return CountingP2P


async def _snapshot(_dht: Any, node: Any) -> dict[str, dict[str, int]]:
    counts = getattr(node.p2p, "traffic", None)
    return counts.snapshot() if isinstance(counts, TrafficCounts) else {}


async def _key_snapshot(_dht: Any, node: Any) -> dict[str, dict[str, int]]:
    counts = getattr(node.p2p, "traffic", None)
    return counts.key_snapshot() if isinstance(counts, TrafficCounts) else {}


def read_key_traffic(dht: Any) -> dict[str, dict[str, int]]:
    """The DHT process's finds and stores per kind of key (``{}`` if its P2P does not count), e.g.
    ``{"progress": {"finds": 40, "stores": 12, "bytes_out": ..., "bytes_in": ...}, "group": {...}}``."""
    return dht.run_coroutine(_key_snapshot)


def keyed_node(base: type) -> type:
    """A subclass of ``base`` (hivemind's ``DHTNode``) that tells :data:`KEYS` the kind of each key it reads or
    stores, and which ids are nodes' (its routing table's), so that the RPCs can be counted by kind of key."""
    from hivemind.dht.routing import DHTID

    class KeyedNode(base):
        @classmethod
        async def create(cls, *args: Any, **kwargs: Any) -> Any:
            node = await super().create(*args, **kwargs)
            # a lookup, not a copy of the table, in each served RPC; DHTIDs are ints (a peer's over-long key id
            # is no DHTID, and DHTID.from_bytes would raise on it)
            table = node.protocol.routing_table.uid_to_peer_id
            KEYS.is_node = lambda key_id: int.from_bytes(key_id, "big") in table
            return node

        async def get_many(self, keys: Any, *args: Any, **kwargs: Any) -> Any:
            keys = tuple(keys)
            for key in keys:
                KEYS.remember(DHTID.generate(key).to_bytes(), key)
            return await super().get_many(keys, *args, **kwargs)

        async def store_many(self, keys: Any, *args: Any, **kwargs: Any) -> Any:
            keys = list(keys)
            for key in keys:
                KEYS.remember(DHTID.generate(key).to_bytes(), key)
            return await super().store_many(keys, *args, **kwargs)

    KeyedNode.__qualname__ = KeyedNode.__name__ = f"Keyed{base.__name__}"
    return KeyedNode


def read_traffic(dht: Any) -> dict[str, dict[str, int]]:
    """The DHT process's counts per RPC (``{}`` if its P2P does not count), e.g.
    ``{"DHTProtocol.rpc_find": {"calls_made": 12, "calls_failed": 0, "calls_served": 30, "bytes_out": ...}}``."""
    return dht.run_coroutine(_snapshot)


def totals(snapshot: dict[str, dict[str, int]], prefix: str = "DHTProtocol.") -> dict[str, int]:
    """The counts of ``snapshot``'s RPCs whose names start with ``prefix``, summed (the DHT's own by default)."""
    out = dict.fromkeys(("calls_made", "calls_failed", "calls_served", "bytes_out", "bytes_in"), 0)
    for name, counts in snapshot.items():
        if name.startswith(prefix):
            for k in out:
                out[k] += int(counts.get(k, 0))
    return out
