"""Child processes that die with their parent.

hivemind runs the DHT and each averager in a child process (fork), and the DHT process runs p2pd.
If the learner is killed with SIGKILL, those children would live on as orphans: still holding the
learner's identity (so it cannot restart under the same peer ID), still answering peers with stale
state. Linux's PR_SET_PDEATHSIG makes the kernel kill a child when its parent dies; p2pd already
exits when the process that started it goes away.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hivemind

from p2p_diloco.errors import LearnerError
from p2p_diloco.net import record_quota
from p2p_diloco.net.message_caps import cap_stream_messages
from p2p_diloco.net.replica_reads import FULL_READ_EVERY, replica_first_node
from p2p_diloco.net.strong_tasks import in_loops_made_by
from p2p_diloco.net.traffic import counting_p2p, keyed_node
from p2p_diloco.trust.admission import Admission, gated_p2p
from p2p_diloco.trust.signed_records import CheckedOnce, IdentityKey, OwnedRecords, owner_marker

_PR_SET_PDEATHSIG = 1
_ALIVE_CHECK_SECONDS = 1.0
_KEYS_COUNTED = 256  # keys whose reads LinkedDHT counts (to make every few a full read): the most recent


class DHTGone(RuntimeError):
    """The DHT's background process has exited: no request to it will be answered."""


def die_with_parent(expected_parent: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent thread exits (Linux; no-op elsewhere).

    Call it only in children forked from the main thread: the signal fires when the forking thread ends.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != expected_parent:  # the parent died before prctl took effect
        os._exit(1)
    # A forked child inherits the learner's handlers, which only set a stop flag: it would then
    # ignore hivemind's terminate(). SIGTERM ends it; Ctrl+C is the parent's to handle (it shuts
    # the children down in order).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _LockedSend:
    """A pipe end whose ``send`` holds a lock; everything else is the pipe's own."""

    def __init__(self, conn: Any):
        self._conn, self._lock = conn, threading.Lock()

    def send(self, obj: Any) -> None:
        with self._lock:
            self._conn.send(obj)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def serialize_requests(component: Any) -> None:
    """Make a hivemind DHT's or averager's requests safe to send from several threads.

    hivemind sends every request to its background process down one multiprocessing pipe
    (``_outer_pipe``) without a lock, and a learner calls it from its training loop, its round thread
    and its progress heartbeat at once; two sends interleaving would corrupt the pipe. Call it in the
    parent after the component has started (the child reads the other end).
    """
    component._outer_pipe = _LockedSend(component._outer_pipe)


class _WholeMessages:
    """The child's end of hivemind's request pipe, read and written one whole message at a time.

    hivemind's DHT and averager processes watch this pipe with uvloop's ``add_reader``, which puts its
    file descriptor in non-blocking mode. multiprocessing's ``recv`` then raises ``BlockingIOError``
    when only part of a message has arrived (the sender wrote the header and is still writing the rest,
    or the pipe was full), and the bytes it already read are lost: hivemind logs the error and reads
    again from the middle of the message, and the process dies ("EOFError: Ran out of input"). Seen
    with 16 learners on 2 cores: 4 learners' DHT processes died in one round and the
    round of 16 failed for everyone. Here a read that has begun waits for the rest: the poll said a
    message is there, and its sender is in the middle of writing it.
    """

    def __init__(self, conn: Any):
        self._conn = conn

    def _blocking(self, method: Any, *args: Any) -> Any:
        fd = self._conn.fileno()
        was_blocking = os.get_blocking(fd)
        os.set_blocking(fd, True)
        try:
            return method(*args)
        finally:
            os.set_blocking(fd, was_blocking)

    def recv(self) -> Any:
        return self._blocking(self._conn.recv)

    def send(self, obj: Any) -> None:
        self._blocking(self._conn.send, obj)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def read_whole_messages(component: Any) -> None:
    """In a hivemind DHT's or averager's own process, before its loop starts: read its requests whole
    (:class:`_WholeMessages`)."""
    if not isinstance(component._inner_pipe, _WholeMessages):
        component._inner_pipe = _WholeMessages(component._inner_pipe)


# p2pd's garbage collection target (Go's GOGC, percent of live heap allocated before a collection; Go's
# default 100): 25 kept p2pd at 65-67 MB instead of 77-87 in swarms of 4 and 8, for 0.07-0.19 s more CPU per
# learner per version (docs/scale.md, "What a learner costs"). A GOGC in the learner's environment wins.
P2PD_GOGC = "25"


class LinkedDHT(hivemind.DHT):
    """hivemind.DHT whose background process (and thus its p2pd) ends when the learner dies, whose
    requests may come from several threads (:func:`serialize_requests`), and whose every RPC handler,
    the DHT's and those of averagers on its p2pd (:meth:`replicate_p2p`), is behind ``admission``."""

    def __init__(self, *args: Any, admission: Admission | None = None, owner: bytes = b"",
                 signing: IdentityKey | None = None, records_per_owner: int = record_quota.MAX_RECORDS_PER_OWNER,
                 replica_reads_after: float | None = None, **kwargs: Any):
        self.admission = admission or Admission()
        self.records_per_owner = records_per_owner  # how many records one other identity may keep on this node
        self.owner = owner  # the subkey of this peer's own signed records (its public key marker)
        # reads with replica_first=True answered from this node's own replica after this many seconds up (None:
        # never; p2p_diloco/net/replica_reads.py)
        self.replica_reads_after = replica_reads_after
        self._replica_reads: OrderedDict[Any, int] = OrderedDict()  # reads of the most recent keys, by key
        self._replica_lock = threading.Lock()
        self.signing = signing  # the identity key itself: the round's gathered metadata is signed with it
        super().__init__(*args, **kwargs)
        serialize_requests(self)

    def run(self) -> None:
        die_with_parent(self._parent_pid)
        cap_stream_messages()
        read_whole_messages(self)
        import hivemind.dht.dht
        import hivemind.dht.node

        in_loops_made_by(hivemind.dht.dht)  # its request tasks, which hivemind does not keep
        # hivemind's DHTNode creates its P2P itself; in this (child) process only, it makes one that
        # counts its RPCs (p2p_diloco/net/traffic.py) and, in a private swarm, is gated.
        hivemind.dht.node.P2P = counting_p2p(gated_p2p(self.admission))
        hivemind.dht.node.DHTProtocol = _quota_protocol(self.owner, self.records_per_owner)
        node = hivemind.dht.node.DHTNode
        if self.replica_reads_after is not None:
            node = replica_first_node(self.replica_reads_after)
        hivemind.dht.dht.DHTNode = keyed_node(node)  # its RPCs counted by kind of key too
        os.environ.setdefault("GOGC", P2PD_GOGC)  # hivemind starts p2pd with a copy of this environment
        super().run()

    async def replicate_p2p(self) -> hivemind.P2P:
        """hivemind's replica of the DHT's P2P (what an averager registers its handlers on), gated."""
        replica: hivemind.P2P | None = getattr(self, "_p2p_replica", None)  # hivemind's attributes
        if replica is None or getattr(self, "_origin_pid", None) != os.getpid():
            self._origin_pid = os.getpid()
            maddr = self.run_coroutine(hivemind.DHT._get_p2p_daemon_listen_maddr)
            replica = self._p2p_replica = await gated_p2p(self.admission).replicate(maddr)
        return replica

    def _serialized(self, method, args, kwargs):
        """Send the request; wait for the answer, checking that the DHT process still lives.

        The answer never comes if the DHT process is gone (a SIGTERM sent to the learner's whole
        process group reaches it too): then this raises instead of waiting forever, so that a learner
        that was told to stop still shuts down.
        """
        future = method(*args, **{**kwargs, "return_future": True})
        if kwargs.get("return_future"):
            return future
        while True:
            try:
                return future.result(timeout=_ALIVE_CHECK_SECONDS)
            except TimeoutError:
                if not self.is_alive():
                    raise DHTGone("the DHT process has exited") from None

    def get(self, key, *args, replica_first: bool = False, **kwargs):
        """hivemind's ``get``; ``replica_first``: answered from this node's own replica of the key where it holds
        one, but for every :data:`~p2p_diloco.net.replica_reads.FULL_READ_EVERY`-th read of the same key, if this
        DHT was started with replica reads (p2p_diloco/net/replica_reads.py)."""
        if replica_first and self.replica_reads_after is not None and self._replica_turn(key):
            kwargs["replica_first"] = True
        return self._serialized(super().get, (key, *args), kwargs)

    def _replica_turn(self, key: Any) -> bool:
        with self._replica_lock:
            n = self._replica_reads.pop(key, 0) + 1
            self._replica_reads[key] = n
            while len(self._replica_reads) > _KEYS_COUNTED:
                self._replica_reads.popitem(last=False)
        return n % FULL_READ_EVERY != 0

    def store(self, *args, **kwargs):
        return self._serialized(super().store, args, kwargs)

    def run_coroutine(self, *args, **kwargs):
        return self._serialized(super().run_coroutine, args, kwargs)


def _quota_protocol(exempt: bytes, records: int) -> type:
    """hivemind's DHTProtocol whose storage and cache hold at most a budget of records per owner
    (p2p_diloco/net/record_quota.py); this node's own records (``exempt``) are not counted."""
    import hivemind.dht.protocol

    class DHTProtocol(hivemind.dht.protocol.DHTProtocol):  # hivemind names RPC handlers after the class
        @classmethod
        async def create(cls, *args: Any, **kwargs: Any) -> hivemind.dht.protocol.DHTProtocol:
            protocol = await super().create(*args, **kwargs)
            record_quota.install(protocol, exempt, records)
            return protocol

    return DHTProtocol


def start_dht(
    *,
    initial_peers: Sequence[str],
    host_maddrs: Sequence[str],
    announce_maddrs: Sequence[str],
    identity_path: str | Path | None,
    startup_timeout: float,
    wait: bool = True,
    what: str = "DHT",
    admission: Admission | None = None,
    signing: IdentityKey | None = None,
    client_mode: bool = False,
    use_relay: bool = True,
    use_auto_relay: bool = False,
    records_per_owner: int = record_quota.MAX_RECORDS_PER_OWNER,
    replica_reads_after: float | None = None,
) -> LinkedDHT:
    """Start a :class:`LinkedDHT` process and join the swarm through ``initial_peers`` (none: a new one).

    Call it on the main thread: the DHT's process dies with the thread that forked it. With
    ``wait=False`` it returns at once and ``dht.wait_until_ready()`` waits for the start. Any failure
    (a malformed multiaddr, a port in use, p2pd not starting in ``startup_timeout`` seconds) becomes
    one :class:`LearnerError` line naming ``what`` was being started. ``admission``: who may call this
    peer (default: everyone). ``client_mode``: a light client, which asks and stores nothing for others.
    ``use_relay`` and ``use_auto_relay``: p2pd's circuit relay and its search for relays behind NAT.
    ``signing``: the identity key that signs this peer's records (hivemind's ``RSASignatureValidator``);
    with it, records of others are validated too: every record must be signed by its owner (:class:`OwnedRecords`).
    ``records_per_owner``: how many live records another identity may keep on this node
    (p2p_diloco/net/record_quota.py). ``replica_reads_after``: reads made with ``replica_first=True`` are answered
    from this node's own replica of the key once it has been up this long (p2p_diloco/net/replica_reads.py).
    """
    validators: list[Any] = []
    owner = b""
    if signing is not None:
        signer = CheckedOnce(signing)
        validators, owner = [signer, OwnedRecords()], owner_marker(signer)
    try:
        return LinkedDHT(
            initial_peers=list(initial_peers) or None,
            host_maddrs=list(host_maddrs),
            announce_maddrs=list(announce_maddrs) or None,
            identity_path=str(identity_path) if identity_path else None,
            startup_timeout=startup_timeout,
            start=True,
            await_ready=wait,
            admission=admission,
            owner=owner,
            signing=signing,
            record_validators=validators,
            client_mode=client_mode,
            use_relay=use_relay,
            use_auto_relay=use_auto_relay,
            records_per_owner=records_per_owner,
            replica_reads_after=replica_reads_after,
        )
    except Exception as e:  # noqa: BLE001 - hivemind raises many types for the same user mistake
        raise _start_error(what, e) from None


def wait_until_joined(dht: LinkedDHT, what: str = "DHT") -> None:
    """Wait for a DHT started with ``wait=False`` to be up and joined; a failure is one :class:`LearnerError`."""
    try:
        dht.wait_until_ready()
    except Exception as e:  # noqa: BLE001 - hivemind raises many types for the same user mistake
        raise _start_error(what, e) from None


def _start_error(what: str, e: Exception) -> LearnerError:
    return LearnerError(f"could not start or join the {what} ({type(e).__name__}: {e})".strip())
