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
"""

from __future__ import annotations

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


class TrafficCounts:
    """Counts per RPC; ``snapshot()`` is what :func:`read_traffic` returns."""

    def __init__(self) -> None:
        self.rpcs: dict[str, RpcTraffic] = {}

    def of(self, handle_name: str) -> RpcTraffic:
        return self.rpcs.setdefault(rpc_of(handle_name), RpcTraffic())

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {name: asdict(t) for name, t in sorted(self.rpcs.items())}


def count_served(handler: Callable[[Any, Any], Awaitable[Any]], traffic: RpcTraffic
                 ) -> Callable[[Any, Any], Awaitable[Any]]:
    """``handler`` (a unary protobuf handler), counting each request it serves and its reply."""
    async def counted(request: Any, context: Any) -> Any:
        traffic.calls_served += 1
        traffic.bytes_in += _size(request)
        reply = await handler(request, context)
        traffic.bytes_out += _size(reply)
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
                handler = count_served(handler, self.traffic.of(name))
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
            return reply

    CountingP2P.__qualname__ = CountingP2P.__name__ = f"Counting{base.__name__}"
    return CountingP2P


async def _snapshot(_dht: Any, node: Any) -> dict[str, dict[str, int]]:
    counts = getattr(node.p2p, "traffic", None)
    return counts.snapshot() if isinstance(counts, TrafficCounts) else {}


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
