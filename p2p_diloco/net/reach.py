"""Reachability: can other peers dial this learner? If not, it takes part as a client.

A learner behind NAT or a firewall can dial out but cannot be dialled. As a full peer it would be
put in others' DHT routing tables, chosen as a reducer or a group leader, and named as a state
server, and every one of those would time out. So at start (``network.client_mode = "auto"``, the
default) a learner asks the peers it was given (``--initial-peers``) to dial it back:

* A peer that answers (every reachable learner and the bootstrap node serve :data:`CHECK`) dials the
  addresses the learner announces with a **fresh daemon of its own** (the connection the question
  came on would otherwise be reused and prove nothing), and only those on the host the question came
  from: nobody can use a peer to dial a third party. A NAT'd learner's question comes from its
  gateway's address, not the private one it announces, so the answer is "no" without a dial.
* One "yes" makes the learner ``direct``. Only "no"s make it a client: its DHT restarts in client
  mode (it asks and stores, nobody routes through it), and in averaging it sends its part and gets
  the results back on the streams it opened, but never reduces, leads a group or serves state
  (hivemind's ``AveragingMode.CLIENT``; a group always has a leader that is reachable). With
  ``network.use_auto_relay``, a learner that gets a relayed address (``/p2p-circuit``) keeps a DHT
  reachable through the relay but still averages as a client: relays carry little data. That is
  ``relay``. No answer at all (old peers, no initial peers) leaves it ``direct``, and says so.

``network.client_mode = true`` or ``false`` skips the question. The result is logged in one line at
start and published in the learner's progress record (``reach``), which ``status`` shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import dht_pb2, p2pd_pb2
from hivemind.utils.multiaddr import Multiaddr

logger = logging.getLogger(__name__)

CHECK = "p2p_diloco.reach.check"  # the handler that dials a peer back: a wire name, kept when the module moved
DIRECT, RELAY, CLIENT = "direct", "relay", "client only"
MODES = (DIRECT, RELAY, CLIENT)
RECORD_VALUES = ("direct", "relay", "client")  # the ``reach`` field of progress records, one per mode
_MAX_ADDRS = 8  # addresses a question may name
_MAX_ADDR_BYTES = 256
_COOLDOWN = 10.0  # seconds before the same peer may ask again
# Dials per asking host: a burst of HOST_BURST (a machine starting that many learners at once), then one per
# HOST_REFILL seconds. Fresh peer IDs cost nothing, so the per-peer cooldown alone let one address have this
# peer start a daemon after another for as long as it liked.
HOST_BURST, HOST_REFILL = 16, 5.0
_MAX_WAITING = 8  # checks waiting for the one dial under way; more are refused
# A daemon that only dials: no listening, no relay, no NAT tricks (as Petals' reachability probe).
_PROBE_ARGS: dict[str, Any] = dict(dht_mode="client", use_relay=False, auto_nat=False, nat_port_map=False,
                                   no_listen=True, startup_timeout=30)


def reduces_and_serves(record_value: str) -> bool:
    """Whether peers dial a learner whose record says ``reach=record_value``, so that it reduces in groups and
    serves its state ("": not said, assumed so); a client or relayed learner does neither."""
    return record_value not in RECORD_VALUES[1:]


@dataclass(frozen=True)
class Reach:
    """How peers reach this learner: ``mode`` (``direct``, ``relay``, ``client only``) and ``how`` it was decided."""

    mode: str
    how: str

    @property
    def client(self) -> bool:
        """Whether the learner averages as a client: it sends and receives, never reduces or serves."""
        return self.mode != DIRECT

    @property
    def dht_client(self) -> bool:
        """Whether its DHT runs in client mode (a relayed learner's DHT is reachable through the relay)."""
        return self.mode == CLIENT

    @property
    def record_value(self) -> str:
        """The ``reach`` field of its progress record: ``direct``, ``relay`` or ``client``."""
        return RECORD_VALUES[MODES.index(self.mode)]


def decide(answers: Sequence[bool | None], relayed: bool = False) -> Reach:
    """The verdict from the peers' answers (True: dialled us, False: could not, None: no answer)."""
    yes, no = sum(a is True for a in answers), sum(a is False for a in answers)
    if yes:
        return Reach(DIRECT, f"dialled back by {yes} of {len(answers)} peer(s)")
    if not no:
        why = "no initial peers" if not answers else f"none of {len(answers)} peer(s) answered"
        return Reach(DIRECT, f"not checked: {why}")
    if relayed:
        return Reach(RELAY, f"{no} peer(s) could not dial us; reachable through a relay")
    return Reach(CLIENT, f"{no} peer(s) could not dial us")


def peer_ids_of(maddrs: Sequence[str]) -> list[PeerID]:
    """The peer IDs named by ``/p2p/ID`` in ``maddrs`` (each once, in order; those without one skipped)."""
    out: list[PeerID] = []
    for m in maddrs:
        with contextlib.suppress(Exception):
            pid = PeerID.from_base58(Multiaddr(m).value_for_protocol("p2p"))
            if pid not in out:
                out.append(pid)
    return out


def _host(maddr: Multiaddr) -> str | None:
    for proto in ("ip4", "ip6", "dns4", "dns6", "dns"):
        with contextlib.suppress(Exception):
            return str(maddr.value_for_protocol(proto))
    return None


def dialable(requested: Sequence[bytes], observed_hosts: set[str]) -> list[Multiaddr]:
    """Of the addresses a peer asks us to dial (its announced ones, untrusted bytes), those on a host its
    connections to us come from; malformed, oversized and relayed ones are dropped."""
    out: list[Multiaddr] = []
    for raw in list(requested)[:_MAX_ADDRS]:
        if not isinstance(raw, bytes) or len(raw) > _MAX_ADDR_BYTES:
            continue
        try:
            m = Multiaddr(raw)
            text = str(m)  # parses the bytes: a malformed address fails here
        except Exception:  # noqa: BLE001 - any malformed address is simply not dialled
            continue
        if "p2p-circuit" in text or _host(m) not in observed_hosts:
            continue
        out.append(m)
    return out


class HostBudget:
    """Token buckets of dials per host: ``burst`` at once, then one per ``refill`` seconds (a full bucket is
    forgotten, so the table holds only hosts that asked lately)."""

    def __init__(self, burst: int = HOST_BURST, refill: float = HOST_REFILL):
        self.burst, self.refill = burst, refill
        self._tokens: dict[str, tuple[float, float]] = {}  # host -> (tokens, when counted)

    def take(self, host: str, now: float) -> bool:
        """Whether ``host`` may have one more dial at ``now`` (and count it if so)."""
        self._tokens = {h: (t, w) for h, (t, w) in self._tokens.items()
                        if t + (now - w) / self.refill < self.burst}
        tokens, when = self._tokens.get(host, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - when) / self.refill)
        if tokens < 1.0:
            self._tokens[host] = (tokens, now)
            return False
        self._tokens[host] = (tokens - 1.0, now)
        return True


def _prefix(host: str) -> str:
    """The unit a budget counts: an IPv4 address or hostname, an IPv6 address's /64 (one subscriber's)."""
    if ":" not in host:
        return host
    with contextlib.suppress(ValueError):
        return str(ipaddress.IPv6Network(f"{host}/64", strict=False))
    return host


class DialBack:
    """Answers :data:`CHECK`: dials the asking peer back with a fresh daemon (one question at a time, within
    a budget per asking host)."""

    def __init__(self, p2p: P2P, timeout: float = 5.0, budget: HostBudget | None = None):
        self.p2p, self.timeout = p2p, timeout
        self.budget = budget or HostBudget()
        self._lock = asyncio.Lock()
        self._waiting = 0
        self._asked: dict[PeerID, float] = {}

    async def rpc_check(self, request: p2pd_pb2.PeerInfo, context: P2PContext) -> dht_pb2.PingResponse:
        peer = context.remote_id
        now = time.monotonic()
        self._asked = {p: t for p, t in self._asked.items() if now - t < _COOLDOWN}
        if peer in self._asked:  # an error, not a "no": the asker counts it as no answer
            logger.info(f"reachability check for {peer}: refused, asked again within {_COOLDOWN:.0f} s")
            raise PermissionError(f"asked again within {_COOLDOWN:.0f} s")
        self._asked[peer] = now
        observed = {h for info in await self.p2p.list_peers() if info.peer_id == peer
                    for a in info.addrs if (h := _host(a)) is not None}
        targets = dialable(request.addrs, observed)
        if not targets:
            logger.debug(f"reachability check for {peer}: no announced address on its host {sorted(observed)}")
            return dht_pb2.PingResponse(available=False)
        hosts = {_prefix(h) for t in targets if (h := _host(t)) is not None}
        if self._waiting >= _MAX_WAITING or not all(self.budget.take(h, now) for h in sorted(hosts)):
            logger.info(f"reachability check for {peer}: refused, too many checks from {sorted(hosts)} "
                        f"or waiting ({self._waiting})")
            raise PermissionError("too many reachability checks; ask again later")
        self._waiting += 1
        try:
            async with self._lock:
                return dht_pb2.PingResponse(available=await self._dial(peer, targets))
        finally:
            self._waiting -= 1

    async def _dial(self, peer: PeerID, targets: list[Multiaddr]) -> bool:
        probe = None
        try:
            probe = await P2P.create(**_PROBE_ARGS)
            await asyncio.wait_for(probe._client.connect(peer, targets), self.timeout)
            return True
        except Exception as e:  # noqa: BLE001 - any failure to dial means "not reachable there"
            logger.debug(f"reachability check for {peer}: could not dial {targets}: {e!r}")
            return False
        finally:
            if probe is not None:
                with contextlib.suppress(Exception):
                    await probe.shutdown()


async def _serve(timeout: float, _dht: Any, node: Any) -> None:
    service = DialBack(node.p2p, timeout)
    await node.p2p.add_protobuf_handler(CHECK, service.rpc_check, p2pd_pb2.PeerInfo)


def serve_checks(dht: Any, timeout: float = 5.0) -> None:
    """Answer other peers' reachability questions on ``dht``'s daemon (in the DHT's process)."""
    dht.run_coroutine(functools.partial(_serve, timeout))


async def _ask(peers: list[PeerID], timeout: float, _dht: Any, node: Any) -> list[bool | None]:
    p2p: P2P = node.p2p
    _, maddrs = await p2p._client.identify()
    request = p2pd_pb2.PeerInfo(id=p2p.peer_id.to_bytes(), addrs=[m.to_bytes() for m in maddrs][:_MAX_ADDRS])

    async def one(peer: PeerID) -> bool | None:
        try:
            reply = await asyncio.wait_for(
                p2p.call_protobuf_handler(peer, CHECK, request, dht_pb2.PingResponse), timeout)
            return bool(reply.available)
        except Exception as e:  # noqa: BLE001 - a peer that cannot answer gives no verdict
            logger.debug(f"reachability: {peer} did not answer: {e!r}")
            return None

    return list(await asyncio.gather(*(one(p) for p in peers if p != p2p.peer_id)))


async def _relayed(_dht: Any, node: Any) -> bool:
    _, maddrs = await node.p2p._client.identify()
    return any("p2p-circuit" in str(m) for m in maddrs)


def check(dht: Any, initial_peers: Sequence[str], timeout: float = 15.0, relay_wait: float = 0.0) -> Reach:
    """Ask the peers of ``initial_peers`` whether they can dial ``dht``'s daemon; wait up to ``relay_wait``
    seconds for a relayed address if they cannot."""
    peers = peer_ids_of(initial_peers)[:5]
    answers = dht.run_coroutine(functools.partial(_ask, peers, timeout)) if peers else []
    relayed = False
    if answers and not any(answers) and any(a is False for a in answers) and relay_wait > 0:
        deadline = time.monotonic() + relay_wait
        while not (relayed := dht.run_coroutine(_relayed)) and time.monotonic() < deadline:
            time.sleep(1.0)
    return decide(answers, relayed)
