"""Private swarms: which peers may talk to this one.

A swarm with an allow-list (``network.allowed_peers`` / ``--allowed-peers FILE``: one peer ID per
line) answers only the peers it names. The rule is enforced on every RPC that reaches this peer's
p2pd, DHT and averaging alike, using the remote peer ID that libp2p's secure channel authenticated
(the peer proved it holds the private key behind that ID during the handshake): a DHT request, a
group join, a part of an all-reduce or a state download from an outsider is refused before any of
its bytes are parsed by our code, and the refusal is logged once per peer and process. A swarm
without an allow-list is public (docs/security.md says what defends it then).

How the rule reaches hivemind: :func:`gated_p2p` subclasses hivemind's ``P2P`` so that every handler
it registers is wrapped by the rule (``add_protobuf_handler`` for unary calls,
``add_binary_stream_handler`` for every stream). The averager gets it through
``LinkedDHT.replicate_p2p``; the DHT's own process creates its ``P2P`` inside hivemind's ``DHTNode``,
so :class:`p2p_diloco.net.dht.LinkedDHT` points that module at the gated class in its child
process only.

Identities: a learner's private key is ``identity.key`` in its checkpoint directory, a bootstrap
node's the file given to ``--identity``. :func:`peer_id_of` reads one (creating it if missing) so an
operator can print every peer ID with ``p2p-diloco peer-id`` and write the list before anyone starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import base58

from p2p_diloco.config import ConfigError

if TYPE_CHECKING:
    from hivemind.p2p import P2P, PeerID

logger = logging.getLogger("p2p_diloco.trust.admission")

_MAX_LIST_LINES = 100_000
# A libp2p peer ID is a multihash of the public key: identity (0x00) for small keys such as
# Ed25519, sha2-256 (0x12) for larger ones such as RSA; then the digest's length and the digest.
_MULTIHASH_CODES = (0x00, 0x12)


def check_peer_id(text: str) -> str:
    """``text`` if it is a well-formed base58 libp2p peer ID, else ValueError saying why."""
    try:
        raw = base58.b58decode(text)
    except ValueError:
        raise ValueError("not base58") from None
    if len(raw) < 3 or raw[0] not in _MULTIHASH_CODES or raw[1] != len(raw) - 2 or len(raw) > 64:
        raise ValueError("not a libp2p peer ID (a multihash of a public key)")
    return text


def read_allow_list(path: str | Path) -> frozenset[str]:
    """The peer IDs in an allow-list file: one a line, ``#`` starts a comment; ConfigError if unusable."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"allow-list {p}: cannot read it ({type(e).__name__}: {e})") from None
    if len(lines) > _MAX_LIST_LINES:
        raise ConfigError(f"allow-list {p}: {len(lines)} lines, more than {_MAX_LIST_LINES}")
    peers = set()
    for n, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            peers.add(check_peer_id(text))
        except ValueError as e:
            raise ConfigError(f"allow-list {p}, line {n}: {text[:60]!r} is {e}") from None
    if not peers:
        raise ConfigError(f"allow-list {p} names no peer: it would refuse everyone (leave it unset for a "
                          f"public swarm)")
    return frozenset(peers)


@dataclass
class Admission:
    """The rule: ``allowed`` peer IDs (base58), or None for a public swarm that admits everyone."""

    allowed: frozenset[str] | None = None
    source: str = ""  # where the list came from, for log lines
    _refused: set[str] = field(default_factory=set, repr=False)

    @classmethod
    def from_file(cls, path: str | Path | None) -> Admission:
        """The rule of an allow-list file; a public swarm when ``path`` is None."""
        return cls(None) if path is None else cls(read_allow_list(path), str(path))

    @property
    def private(self) -> bool:
        return self.allowed is not None

    def lists(self, peer: str) -> bool:
        """Whether ``peer`` (base58) is a member: on the list, or anyone in a public swarm. For what members read
        (records signed by any key are valid DHT values: the gates on inbound calls do not stop a member from
        storing records under fresh keys)."""
        return self.allowed is None or peer in self.allowed

    def admits(self, remote: PeerID, local: PeerID | None, what: str) -> bool:
        """Whether ``remote`` may call ``what`` on this peer (``local``; a peer always admits itself).

        A refusal is logged once per remote peer (per process), at WARNING.
        """
        if self.allowed is None or remote == local:
            return True
        name = remote.to_base58()
        if name in self.allowed:
            return True
        if name not in self._refused:
            self._refused.add(name)
            logger.warning(f"refused peer {name}: not on the allow-list {self.source} (it called {what}; "
                           f"further requests from it are refused without a log line)")
        return False

    def names(self, peers: Iterable[str]) -> list[str]:
        """Those of ``peers`` that the list does not name (all admitted for a public swarm)."""
        return [] if self.allowed is None else [p for p in peers if p not in self.allowed]


class NotAdmitted(PermissionError):
    """Raised to a caller that is not on this peer's allow-list (it gets the error as its reply)."""


def gated_p2p(admission: Admission) -> type[P2P]:
    """A subclass of hivemind's ``P2P`` whose every handler is behind ``admission``."""
    from hivemind.p2p import P2P

    if not admission.private:
        return P2P

    class GatedP2P(P2P):
        async def add_protobuf_handler(self, name: str, handler: Callable[..., Any], input_protobuf_type: Any, *,
                                       stream_input: bool = False, stream_output: bool = False,
                                       balanced: bool = False) -> None:
            if not stream_input and not stream_output:  # streams are gated in add_binary_stream_handler
                handler = _gate_unary(handler, admission, name, self)
            await super().add_protobuf_handler(name, handler, input_protobuf_type, stream_input=stream_input,
                                               stream_output=stream_output, balanced=balanced)

        async def add_binary_stream_handler(self, name: str, handler: Any, balanced: bool = False) -> None:
            await super().add_binary_stream_handler(name, _gate_stream(handler, admission, name, self), balanced)

    GatedP2P.__qualname__ = GatedP2P.__name__ = "GatedP2P"
    return GatedP2P


def _gate_unary(handler: Callable[[Any, Any], Awaitable[Any]], admission: Admission, name: str,
                p2p: P2P) -> Callable[[Any, Any], Awaitable[Any]]:
    async def gated(request: Any, context: Any) -> Any:
        if not admission.admits(context.remote_id, p2p.peer_id, name):
            raise NotAdmitted("not on this swarm's allow-list")
        return await handler(request, context)

    return gated


def _gate_stream(handler: Callable[[Any, Any, Any], Awaitable[None]], admission: Admission, name: str,
                 p2p: P2P) -> Callable[[Any, Any, Any], Awaitable[None]]:
    async def gated(stream_info: Any, reader: Any, writer: Any) -> None:
        if not admission.admits(stream_info.peer_id, p2p.peer_id, name):
            writer.close()  # the outsider reads the end of the stream; nothing of it was read here
            return
        await handler(stream_info, reader, writer)

    return gated


def peer_id_of(identity_path: str | Path, create: bool = True) -> str:
    """The base58 peer ID of the private key in ``identity_path`` (made first if missing and ``create``)."""
    from hivemind.p2p import P2P, PeerID

    p = Path(identity_path)
    if not p.exists():
        if not create:
            raise ConfigError(f"identity file {p} does not exist")
        p.parent.mkdir(parents=True, exist_ok=True)
        # Made aside and linked into place, which fails if the file appeared meanwhile: two processes that
        # make the same peer's key at once (a learner starting, `p2p-diloco peer-id` beside it) end up with
        # the one key, never each with its own while p2pd reads a third.
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
        os.close(fd)
        try:
            P2P.generate_identity(tmp)
            with contextlib.suppress(FileExistsError):
                os.link(tmp, p)
        finally:
            os.unlink(tmp)
    try:
        return PeerID.from_identity(p.read_bytes()).to_base58()
    except Exception as e:  # noqa: BLE001 - protobuf and cryptography raise many types for a bad key file
        raise ConfigError(f"identity file {p} does not hold a libp2p private key ({type(e).__name__})") from None


def admit_self(admission: Admission, identity: str | Path) -> Admission:
    """``admission``, once sure it names the peer whose key is ``identity`` (else the others would refuse
    it): ConfigError if not. Creates the identity if missing."""
    if admission.private:
        me = peer_id_of(identity)
        if admission.names([me]):
            raise ConfigError(f"this peer's ID {me} (identity {identity}) is not on the allow-list "
                              f"{admission.source}: the others would refuse it")
        logger.info(f"private swarm: only the {len(admission.allowed or ())} peers on {admission.source} "
                    f"are answered")
    return admission
