"""Averaging of outer gradients across a group, behind a small interface.

:class:`Averaging` is what an :class:`~p2p_diloco.round.OuterRound` talks to. :class:`HivemindAveraging`
implements it with a hivemind :class:`DecentralizedAverager` whose all-reduce is the exact variant
in :mod:`p2p_diloco.allreduce`; unit tests implement it with an in-process fake.

Matchmaking is keyed by the global version: before each round the averager's group bits are set
to the binary version number, so only learners that hold the same version look for each other
(hivemind's group key is ``{prefix}.0b{bits}``). Learners at other versions never meet in a group.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol  # noqa: UP035 - hivemind reads typing.AsyncIterator

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import CompressionBase, CompressionInfo, NoCompression, deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time, get_logger
from hivemind.utils.asyncio import achain, aiter_with_timeout, as_aiter, enter_asynchronously
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from p2p_diloco.allreduce import ExactAllReduceRunner
from p2p_diloco.codecs import get_codec
from p2p_diloco.config import AveragingConfig
from p2p_diloco.faults import FaultPlan
from p2p_diloco.lifecycle import die_with_parent

logger = get_logger(__name__)


class RoundFailed(RuntimeError):
    """The round did not produce an average that may be committed; the caller keeps its Δ."""


class RoundSuperseded(RoundFailed):
    """The swarm reached a newer version while we were looking for a group at ours."""


@dataclass
class AverageResult:
    deltas: list[torch.Tensor]
    groupmates: dict[str, dict[str, Any]]  # peer id -> metadata it gathered (version, sha, tokens, ...)
    allreduce_seconds: float
    bytes_sent: int

    @property
    def group_size(self) -> int:
        return len(self.groupmates)


class Averaging(Protocol):
    def average(
        self,
        deltas: Sequence[torch.Tensor],
        weight: float,
        metadata: dict[str, Any],
        version: int,
        fragment: int = 0,
        grace: float | None = None,
    ) -> AverageResult:
        """Average ``deltas`` with a group at ``version``; raise :class:`RoundFailed` if none forms.

        Raises :class:`RoundSuperseded` when the swarm moved past ``version`` during matchmaking.
        """


StateProvider = Callable[[], tuple[dict[str, Any], list[torch.Tensor]]]


class OuterGradientAverager(DecentralizedAverager):
    """DecentralizedAverager running :class:`ExactAllReduceRunner` on one fragment per round.

    ``averaged_tensors`` holds buffers for every parameter; a round all-reduces only the tensors of
    the fragment named in the step's gathered metadata (``{"fragment": f, ...}``), compressed with
    that fragment's codec. ``step()`` returns ``{"gathered": ..., "stats": ...}``: hivemind's gathered
    metadata plus the all-reduce's seconds and bytes, measured inside the averager process.

    Besides hivemind's whole-state download it serves single fragments (``rpc_download_fragments``):
    a learner behind on one fragment fetches that fragment only, 1/P of the bytes.
    """

    # hivemind caches the RPC handlers per class on first use; a subclass that adds an RPC must not
    # inherit the base class's cache.
    _rpc_handlers = None
    _stub_type = None

    def __init__(
        self,
        averaged_tensors,
        dht: DHT,
        *,
        fragments: Sequence[Sequence[int]],
        codecs: Sequence[CompressionBase],
        state_provider: StateProvider | None = None,
        faults: FaultPlan | None = None,
        **kwargs,
    ):
        self._state_provider = state_provider
        self._faults = faults or FaultPlan()
        self._fault_round = 0
        self._fragments = [tuple(f) for f in fragments]
        self._codecs = list(codecs)
        self._round_stats: dict[bytes, dict[str, float]] = {}
        super().__init__(averaged_tensors, dht, **kwargs)

    def run(self) -> None:
        die_with_parent(self._parent_pid)
        super().run()

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        # Mirrors DecentralizedAverager._aggregate_with_group, restricted to one fragment's tensors.
        try:
            bandwidths, mode_ids, user_bytes = zip(*map(self.serializer.loads, group_info.gathered), strict=True)
            gathered = dict(zip(group_info.peer_ids, map(self.serializer.loads, user_bytes), strict=True))
            fragment = _agreed_fragment(gathered, len(self._fragments))
            mine = gathered.get(self.peer_id)
            self._fault_round = int(mine.get("version", -1)) + 1 if isinstance(mine, dict) else 0
            modes = tuple(map(AveragingMode, mode_ids))
            download_bandwidths = [
                thr if mode != AveragingMode.CLIENT else 0.0 for thr, mode in zip(bandwidths, modes, strict=True)
            ]
            indices = self._fragments[fragment]
            size = sum(self._averaged_tensors[i].numel() for i in indices)
            peer_fractions = await asyncio.get_event_loop().run_in_executor(
                None, load_balance_peers, size, download_bandwidths, min_vector_size
            )
            kwargs["compression"], kwargs["tensor_infos"] = self._codecs[fragment], None
            async with enter_asynchronously(self.get_tensors()) as all_tensors:
                tensors = [all_tensors[i] for i in indices]
                await self._run_allreduce_inplace_(tensors, group_info, peer_fractions=peer_fractions, **kwargs)
            return {"gathered": gathered, "stats": self._round_stats.pop(group_info.group_id, {})}
        except BaseException as e:
            if isinstance(e, Exception):
                logger.debug(f"all-reduce failed: {e!r}")
            raise MatchmakingException(f"Unable to run All-Reduce: {e}") from e

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A groupmate's parts for an all-reduce; refused at once if we are in no such group.

        hivemind waits, for a group id it does not know, until this averager registers its next
        group: a follower may receive parts before its leader's "begin all-reduce" arrives. A peer
        that was counted into a group it never joined (its join request timed out after the leader
        had accepted it, see docs/design.md "Ghost groupmates") is not about to register that
        group, and the sender waited ``2 · next_chunk_timeout`` for it while the learner sat at τ.
        Here the part waits only while a group may still be forming for this averager; otherwise
        it gets ``BAD_GROUP_ID`` and the sender drops the round within one poll.
        """
        request = await anext(stream)
        if request.group_id not in self._running_groups and not await self._may_join(request.group_id):
            logger.debug(f"refused parts from {context.remote_id}: not in that group")
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    async def _may_join(self, group_id: bytes, poll: float = 0.05) -> bool:
        """Wait until ``group_id`` is registered (True) or no group is forming here (False).

        "Forming": a join request or accept is under way, a leader accepted us and its answer is
        due, or a group was assembled and is about to be registered. Two polls in a row without
        any of these are needed, because between the matchmaker's return and the registration
        there is one event-loop turn in which none shows.
        """
        mm, idle_polls = self._matchmaking, 0
        while group_id not in self._running_groups:
            forming = (mm.current_leader is not None or mm.lock_request_join_group.locked()
                       or (mm.is_looking_for_group and mm.assembled_group.done()))
            idle_polls = 0 if forming else idle_polls + 1
            if idle_polls >= 2:
                return False
            await asyncio.sleep(poll)
        return True

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        group_id = group_info.group_id if group_id is None else group_id
        started = time.perf_counter()
        runner = ExactAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        runner.faults, runner.round = self._faults, self._fault_round
        self._running_groups[group_id].set_result(runner)
        outputs = await runner.collect()
        for tensor, averaged in zip(tensors, outputs, strict=True):
            tensor.copy_(averaged)
        self._round_stats[group_id] = {
            "seconds": time.perf_counter() - started,
            "bytes_sent": runner.bytes_sent,
        }

    def load_state_from_peer(self, peer: str, timeout: float, fragments: Sequence[int] | None = None):
        """Download the state of one given peer (an MPFuture of (metadata, tensors) or None).

        ``fragments``: only these fragments' tensors (parameters then momentum of each, in order);
        None: the whole state.
        """
        future = MPFuture()
        wanted = None if fragments is None else [int(f) for f in fragments]
        self._outer_pipe.send(("_load_state_from_peer", [],
                               dict(peer=peer, timeout=timeout, future=future, fragments=wanted)))
        return future

    async def rpc_download_fragments(
        self, request: averaging_pb2.AveragingData, _context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Stream the served metadata and the tensors of the fragments listed in ``request.group_id``.

        hivemind has no download request with a free field, so this reuses ``AveragingData``: its
        ``group_id`` bytes carry the msgpack list of fragment indices wanted.
        """
        if not self.allow_state_sharing:
            return
        try:
            wanted = sorted({int(f) for f in self.serializer.loads(request.group_id)})
            if not wanted or not all(0 <= f < len(self._fragments) for f in wanted):
                raise ValueError(f"fragments {wanted} out of range")
        except Exception as e:  # noqa: BLE001 - a malformed request is refused, not fatal
            logger.warning(f"refused a fragment download request: {e!r}")
            return
        metadata, tensors, _ = await self._get_current_state_from_host_process()
        # The served layout: for each fragment, its parameters then its momentum buffers.
        start, selected = 0, []
        for f, indices in enumerate(self._fragments):
            if f in wanted:
                selected += tensors[start:start + 2 * len(indices)]
            start += 2 * len(indices)
        for i, tensor in enumerate(selected):
            info = CompressionInfo.from_tensor(tensor, key=i)
            for part in split_for_streaming(self.state_compression.compress(tensor, info, allow_inplace=False)):
                yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata or b"")
                metadata = None

    async def _load_state_from_peer(
        self, peer: str, timeout: float, future: MPFuture, fragments: list[int] | None = None
    ) -> None:
        # Mirrors the per-peer body of DecentralizedAverager._load_state_from_peers.
        try:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
            if fragments is None:
                stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
            else:
                request = averaging_pb2.AveragingData(group_id=self.serializer.dumps(fragments))
                stream = await stub.rpc_download_fragments(request)
            metadata, tensors, parts = None, [], []
            async for message in aiter_with_timeout(stream, timeout=timeout):
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                if message.tensor_part.dtype and parts:
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    parts = []
                parts.append(message.tensor_part)
            if parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
            future.set_result((metadata, tensors) if metadata is not None else None)
        except Exception as e:  # noqa: BLE001 - any failure: the caller tries another peer
            logger.warning(f"download from {peer} failed: {e!r}")
            if not future.done():
                future.set_result(None)

    def get_current_state(self):
        if self._state_provider is None:
            return {}, [], None
        metadata, tensors = self._state_provider()
        return metadata, tensors, None


@dataclass
class HivemindAveraging:
    """:class:`Averaging` over a hivemind DHT. Also serves and downloads the global state.

    ``fragments`` lists the tensor indices of each fragment (default: one fragment of everything)
    and ``codecs`` the codec name of each fragment.
    """

    dht: DHT
    template: Sequence[torch.Tensor]
    cfg: AveragingConfig
    prefix: str
    state_provider: StateProvider | None = None
    # Polled while looking for a group: returns the swarm's newest version of a fragment, to stop
    # waiting for a group that has already moved on.
    newest_version: Callable[[int], int] | None = None
    fragments: Sequence[Sequence[int]] | None = None
    codecs: Sequence[str] | None = None
    poll_seconds: float = 1.0
    faults: FaultPlan | None = None
    # Set when the learner is asked to stop: matchmaking in progress is abandoned.
    should_stop: Callable[[], bool] = lambda: False
    _buffers: list[torch.Tensor] = field(init=False)
    _averager: OuterGradientAverager = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    # hivemind sends every request down one pipe without a lock; the round thread and the training
    # thread both talk to the averager.
    _pipe_lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    _superseded_by: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        # hivemind logs "could not find a group" as an error with a traceback; for a learner it is a
        # normal outcome that OuterRound reports in one line. Other errors still get through.
        averager_logger = logging.getLogger("hivemind.averaging.averager")
        if not any(isinstance(f, _NoGroupFilter) for f in averager_logger.filters):
            averager_logger.addFilter(_NoGroupFilter())
        self._buffers = [torch.zeros_like(t, dtype=torch.float32) for t in self.template]
        if self.fragments is None:
            self.fragments = [tuple(range(len(self._buffers)))]
        names = list(self.codecs) if self.codecs else [self.cfg.compression] * len(self.fragments)
        sigint = signal.getsignal(signal.SIGINT)  # hivemind sets SIGINT to "ignore" in *our* process
        self._averager = OuterGradientAverager(
            self._buffers,
            self.dht,
            fragments=self.fragments,
            codecs=[get_codec(name) for name in names],
            state_provider=self.state_provider,
            faults=self.faults,
            start=True,
            prefix=self.prefix,
            min_group_size=self.cfg.min_group_size,
            target_group_size=self.cfg.target_group_size,
            min_matchmaking_time=self.cfg.matchmaking_time,
            request_timeout=self.cfg.request_timeout,
            allreduce_timeout=self.cfg.allreduce_timeout,
            next_chunk_timeout=self.cfg.next_chunk_timeout,
            state_compression=NoCompression(),
            allow_state_sharing=True,
            declare_state_period=10.0,
            shutdown_timeout=5.0,
        )
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, sigint)

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    def set_state_priority(self, version: int) -> None:
        """Peers that download state try the highest priority first: the newest version."""
        with self._pipe_lock:
            self._averager.state_sharing_priority = float(version)

    def average(
        self,
        deltas: Sequence[torch.Tensor],
        weight: float,
        metadata: dict[str, Any],
        version: int,
        fragment: int = 0,
        grace: float | None = None,
    ) -> AverageResult:
        """Average one fragment's ``deltas`` with a group at (fragment, version).

        ``grace``: how long the leader may wait for groupmates beyond the quorum (at least the
        configured matchmaking time, hivemind's own minimum).
        """
        indices = self.fragments[fragment]
        with self._lock:
            with self._averager.get_tensors() as buffers:
                for i, d in zip(indices, deltas, strict=True):
                    buffers[i].copy_(d)
            scheduled = None if grace is None else get_dht_time() + max(grace, self.cfg.matchmaking_time)
            timeout = self.cfg.round_timeout if grace is None else max(self.cfg.round_timeout, grace + 1.0)
            with self._pipe_lock:
                self._averager.set_group_bits(group_bits(fragment, version))
                control = self._averager.step(
                    weight=float(weight), gather={**metadata, "fragment": fragment}, timeout=timeout,
                    scheduled_time=scheduled, wait=False,
                    # A retry after a failed all-reduce would re-enter matchmaking with hivemind's randomized
                    # group bits and could pair us with learners at other versions: one attempt per round.
                    allow_retries=False,
                )
            self._watch_for_newer_version(control, fragment, version + 1)
            try:
                result = control.result()
            except Exception as e:  # hivemind raises a zoo of types here; all mean "no average"
                # A cancelled step's future is done at once, but its coroutine in the averager may still
                # be matchmaking; the next round's step would then share the matchmaker with it (seen in
                # a 2 Mbit/s benchmark run: a group of fragment 0 with a member gathering fragment 1).
                # Let it end first.
                _wait_until_finished(control, self.cfg.request_timeout + self.cfg.matchmaking_time)
                if control.cancelled() and self._superseded_by is not None:
                    raise RoundSuperseded(f"the swarm moved on to version {self._superseded_by}") from None
                raise RoundFailed(f"{type(e).__name__}: {e}".strip()) from None
            if not result:
                raise RoundFailed("no group formed within the round window")
            with self._averager.get_tensors() as buffers:
                averaged = [buffers[i].clone() for i in indices]
        if self.faults is not None:
            self.faults.fire("commit", version + 1)
        groupmates = {str(peer): data for peer, data in result["gathered"].items()}
        stats = result.get("stats", {})
        return AverageResult(
            deltas=averaged,
            groupmates=groupmates,
            allreduce_seconds=float(stats.get("seconds", 0.0)),
            bytes_sent=int(stats.get("bytes_sent", 0)),
        )

    def searching_peers(self, fragment: int, version: int) -> int:
        """How many other peers are looking for a group at (``fragment``, ``version``) right now.

        Read from the DHT entries that hivemind's matchmaking declares under the group key while it
        searches (value True until the group forms or the search expires). Entries are peers' input:
        anything malformed is skipped.
        """
        found = self.dht.get(group_key(self.prefix, fragment, version), latest=True)
        if found is None or not isinstance(found.value, dict):
            return 0
        ours, now, count = self.dht.peer_id.to_bytes(), get_dht_time(), 0
        for subkey, entry in found.value.items():
            looking = getattr(entry, "value", None)
            expiration = getattr(entry, "expiration_time", 0.0)
            if subkey != ours and looking is True and isinstance(expiration, int | float) and expiration > now:
                count += 1
        return count

    def _watch_for_newer_version(self, control, fragment: int, next_version: int) -> None:
        """Cancel matchmaking if the swarm already reached ``next_version``; never once all-reduce began."""
        self._superseded_by = None
        version = next_version - 1
        while not control.done():
            try:
                control.result(timeout=self.poll_seconds)
            except TimeoutError:
                pass
            except Exception:  # noqa: BLE001 - the failure itself is reported by the caller
                return
            if control.done() or control.began_allreduce:
                return
            if self.faults:
                self.faults.fire("matchmaking", next_version)
            if self.should_stop():
                control.cancel()
                return
            if self.newest_version is None:
                continue
            newest = self.newest_version(fragment)
            if newest > version and not control.began_allreduce and control.cancel():
                self._superseded_by = newest
                return

    def download_state(self, timeout: float) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """Newest global state from the peers that serve it (highest version first), or None."""
        with self._pipe_lock:
            future = self._averager.load_state_from_peers(wait=False, timeout=timeout)
        return self._await_download(future, timeout)

    def download_state_from(
        self, peer: str, timeout: float, fragments: Sequence[int] | None = None
    ) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """The global state served by one given peer (only ``fragments``' tensors if given), or None."""
        with self._pipe_lock:
            future = self._averager.load_state_from_peer(peer, timeout, fragments)
        return self._await_download(future, timeout)

    def _await_download(self, future, timeout: float):
        try:
            # hivemind's own timeout is per chunk; bound the whole download here.
            loaded = future.result(timeout=timeout * 4)
        except Exception as e:  # noqa: BLE001 - a slow or broken peer must not end the learner
            logger.warning(f"state download failed: {type(e).__name__}: {e}")
            future.cancel()
            return None
        if loaded is None:
            return None
        metadata, tensors = loaded
        return metadata, list(tensors)

    def shutdown(self) -> None:
        try:
            self._averager.shutdown()
        except Exception as e:  # noqa: BLE001 - shutdown must not mask the caller's own exit path
            logger.debug(f"averager shutdown: {e!r}")


class _NoGroupFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "could not find a group" not in record.getMessage()


def _wait_until_finished(control, limit: float) -> None:
    deadline = time.monotonic() + limit
    while control.stage != AveragingStage.FINISHED and time.monotonic() < deadline:
        time.sleep(0.05)


def _agreed_fragment(gathered: dict, num_fragments: int) -> int:
    fragments = {m.get("fragment") if isinstance(m, dict) else None for m in gathered.values()}
    if len(fragments) != 1:
        raise AllreduceException(f"groupmates disagree on the fragment: {fragments}")
    (fragment,) = fragments
    if not isinstance(fragment, int) or not 0 <= fragment < num_fragments:
        raise AllreduceException(f"invalid fragment index {fragment!r}")
    return fragment


def group_bits(fragment: int, version: int) -> str:
    """Group-key bits naming (fragment, version): a 16-bit fragment field, then the version."""
    return format(fragment, "016b") + format(version, "b")


def group_key(prefix: str, fragment: int, version: int) -> str:
    """The DHT key under which hivemind's matchmaking declares searches at (fragment, version)."""
    return f"{prefix}.0b{group_bits(fragment, version)}"
